// The gated MLP's product and its backward, one pass each, where candle on CUDA runs the
// activation (several generic kernels for SiLU and GELU, and their backwards as more chains)
// and the multiply as separate kernels; and an activation alone (GELU in the tanh form, whose
// candle kernel has a composed backward), forward and backward.
//
//   gated:  a = act(g) in f32, rounded to the activation's output type A (what the unfused
//           activation returns: g's type T, or f32 where autocast runs it in f32); y = a * u in
//           f32, rounded once to the product's type P (T, or f32 where mul promotes);
//           backward (dy in P): da = dy * u in f32 rounded to A (the multiply's gradient, cast
//           back to the activation's type as the unfused graph does), dg = da * act'(g)
//           rounded to T; du = dy * a rounded to T. The activation is recomputed from g, not
//           stored: one pointwise pass, one hidden-width tensor less between the passes;
//   act:    y = act(x) and dx = dy * act'(x), in f32 arithmetic, in x's type.
//
// Activations, in f32 with relative precision in both tails (no 1 + tanh cancellation):
//   silu(x)      = x / (1 + e^-x),                     silu'(x) = s (1 + x (1 - s)), s = σ(x)
//   gelu(x)      = x Φ(x), Φ(x) = erfc(-x/√2) / 2,     gelu'(x) = Φ(x) + x φ(x)
//   gelu_tanh(x) = x σ(2v), v = √(2/π) (x + 0.044715 x³)  (= x/2 (1 + tanh v)),
//                  gelu_tanh'(x) = s + 2 x s (1 - s) √(2/π) (1 + 3 · 0.044715 x²), s = σ(2v)
//   relu(x)      = max(x, 0) (NaN and -0 kept),         relu'(x) = [x > 0] (0 at 0, as PyTorch)
// with σ(z) = 1 / (1 + e^-z) and 1 - σ(z) = e^-z / (1 + e^-z) (no cancellation either way).
//
// One value per thread per step of a grid-stride loop: consecutive threads read consecutive
// values (coalesced), and the grid (a function of the length alone, capped) keeps every
// thread busy on a large tensor. Lengths are 64-bit. No reductions, no atomics.
// Compiled at run time by NVRTC (gated_device.rs) and, unmodified, by g++ with the CPU grid
// emulator (tests/cuda_emu/emu.h). It includes only prelude.cuh.
//
// Kernels (extern "C"; {act} silu, gelu, gelu_tanh or relu; {t}, {a}, {p} f32, f16 or bf16):
//   amp_gated_fwd_{act}_{t}_{a}_{p}: y (P) from g and u (T);
//   amp_gated_bwd_{act}_{t}_{a}_{p}: dg and du (T) from g, u (T) and dy (P);
//   amp_act_fwd_{act}_{t}:           y from x;
//   amp_act_bwd_{act}_{t}:           dx from x and dy.
// The launch plan is src/kernels/cuda/gated.rs.

#include "prelude.cuh"

// σ(z) and 1 - σ(z), both with relative precision: e = e^-z (expf saturates to 0 or inf,
// where the quotients give exactly 1 and 0, or 0 and 1).
__device__ __forceinline__ void amp_glu_sigmoid(float z, float& s, float& one_minus_s) {
    const float e = expf(-z);
    const float d = 1.0f + e;
    s = 1.0f / d;
    // e / (1 + e) is NaN for e = inf: σ is 0 there and 1 - σ is 1.
    one_minus_s = e > 3.0e38f ? 1.0f : e / d;
}

struct AmpSilu {
    static __device__ __forceinline__ float fwd(float x) { return x / (1.0f + expf(-x)); }
    static __device__ __forceinline__ float grad(float x) {
        float s, r;
        amp_glu_sigmoid(x, s, r);
        return s * (1.0f + x * r);
    }
};

// 1/√2 and 1/√(2π).
struct AmpGeluErf {
    static __device__ __forceinline__ float cdf(float x) { return 0.5f * erfcf(x * -0.70710678118654752f); }
    static __device__ __forceinline__ float fwd(float x) { return x * cdf(x); }
    static __device__ __forceinline__ float grad(float x) {
        return cdf(x) + x * 0.39894228040143268f * expf(-0.5f * x * x);
    }
};

// √(2/π) and the cubic term's coefficient.
struct AmpGeluTanh {
    static __device__ __forceinline__ float two_v(float x) {
        return 2.0f * 0.79788456080286536f * (x + 0.044715f * x * x * x);
    }
    static __device__ __forceinline__ float fwd(float x) { return x / (1.0f + expf(-two_v(x))); }
    static __device__ __forceinline__ float grad(float x) {
        float s, r;
        amp_glu_sigmoid(two_v(x), s, r);
        const float dv = 0.79788456080286536f * (1.0f + 3.0f * 0.044715f * x * x);
        return s + 2.0f * x * s * r * dv;
    }
};

// NaN kept (an overflow stays visible to the loss scaler), -0 kept, as PyTorch's relu.
struct AmpRelu {
    static __device__ __forceinline__ float fwd(float x) { return x < 0.0f ? 0.0f : x; }
    static __device__ __forceinline__ float grad(float x) { return x > 0.0f ? 1.0f : 0.0f; }
};

// d * act'(x): the chain rule's step. ReLU's is a select: d or 0 (d * 0 would be -0 for a
// negative d and NaN for an infinite one).
template <typename ACT> __device__ __forceinline__ float amp_glu_chain(float d, float x) { return d * ACT::grad(x); }
template <> __device__ __forceinline__ float amp_glu_chain<AmpRelu>(float d, float x) { return x > 0.0f ? d : 0.0f; }

// f32 rounded to T's precision and read back (nothing for f32).
template <typename T> __device__ __forceinline__ float amp_glu_round(float v) {
    return amp_to_f32(amp_from_f32<T>(v));
}

// The first value of this thread and the grid's stride.
__device__ __forceinline__ long long amp_glu_first() {
    return (long long)blockIdx.x * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ long long amp_glu_stride() { return (long long)gridDim.x * blockDim.x; }

template <typename ACT, typename T, typename A, typename P>
__device__ __forceinline__ void amp_gated_fwd(const T* __restrict__ g, const T* __restrict__ u, P* __restrict__ y,
                                              long long n) {
    const long long stride = amp_glu_stride();
    for (long long i = amp_glu_first(); i < n; i += stride) {
        const float a = amp_glu_round<A>(ACT::fwd(amp_to_f32(g[i])));
        y[i] = amp_from_f32<P>(a * amp_to_f32(u[i]));
    }
}

template <typename ACT, typename T, typename A, typename P>
__device__ __forceinline__ void amp_gated_bwd(const T* __restrict__ g, const T* __restrict__ u,
                                              const P* __restrict__ dy, T* __restrict__ dg, T* __restrict__ du,
                                              long long n) {
    const long long stride = amp_glu_stride();
    for (long long i = amp_glu_first(); i < n; i += stride) {
        const float gv = amp_to_f32(g[i]), d = amp_to_f32(dy[i]);
        const float a = amp_glu_round<A>(ACT::fwd(gv));
        // The product's gradients in P, then cast to the operands' types (one rounding where
        // P is f32: the f32 product is already P's value).
        const float da = amp_glu_round<A>(amp_glu_round<P>(d * amp_to_f32(u[i])));
        du[i] = amp_from_f32<T>(amp_glu_round<P>(d * a));
        dg[i] = amp_from_f32<T>(amp_glu_chain<ACT>(da, gv));
    }
}

template <typename ACT, typename T>
__device__ __forceinline__ void amp_act_fwd(const T* __restrict__ x, T* __restrict__ y, long long n) {
    const long long stride = amp_glu_stride();
    for (long long i = amp_glu_first(); i < n; i += stride) y[i] = amp_from_f32<T>(ACT::fwd(amp_to_f32(x[i])));
}

template <typename ACT, typename T>
__device__ __forceinline__ void amp_act_bwd(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ dx,
                                            long long n) {
    const long long stride = amp_glu_stride();
    for (long long i = amp_glu_first(); i < n; i += stride) {
        dx[i] = amp_from_f32<T>(amp_glu_chain<ACT>(amp_to_f32(dy[i]), amp_to_f32(x[i])));
    }
}

// ---------------------------------------------------------------------------------- entry points
#define AMP_GLU_ACTS(X, ...)                                                                                    \
    X(AmpSilu, silu, __VA_ARGS__)                                                                               \
    X(AmpGeluErf, gelu, __VA_ARGS__)                                                                            \
    X(AmpGeluTanh, gelu_tanh, __VA_ARGS__) X(AmpRelu, relu, __VA_ARGS__)
// (t, a, p): the activation in t or f32, the product in t or f32, never narrower than the
// activation (mul promotes).
#define AMP_GATED_TYPES(X, ...)                                                                                 \
    X(float, f32, float, f32, float, f32, __VA_ARGS__)                                                          \
    X(amp_f16, f16, amp_f16, f16, amp_f16, f16, __VA_ARGS__)                                                    \
    X(amp_f16, f16, amp_f16, f16, float, f32, __VA_ARGS__)                                                      \
    X(amp_f16, f16, float, f32, float, f32, __VA_ARGS__)                                                        \
    X(amp_bf16, bf16, amp_bf16, bf16, amp_bf16, bf16, __VA_ARGS__)                                              \
    X(amp_bf16, bf16, amp_bf16, bf16, float, f32, __VA_ARGS__)                                                  \
    X(amp_bf16, bf16, float, f32, float, f32, __VA_ARGS__)
#define AMP_ACT_TYPES(X, ...) X(float, f32, __VA_ARGS__) X(amp_f16, f16, __VA_ARGS__) X(amp_bf16, bf16, __VA_ARGS__)

#define AMP_GATED_FWD_ARGS const void *g, const void *u, void *y, long long n
#define AMP_GATED_BWD_ARGS const void *g, const void *u, const void *dy, void *dg, void *du, long long n
#define AMP_ACT_FWD_ARGS const void *x, void *y, long long n
#define AMP_ACT_BWD_ARGS const void *x, const void *dy, void *dx, long long n

#define AMP_GATED_DEFINE(T, nt, A, na, P, np, ACT, nact)                                                        \
    extern "C" __global__ void amp_gated_fwd_##nact##_##nt##_##na##_##np(AMP_GATED_FWD_ARGS) {                 \
        amp_gated_fwd<ACT, T, A, P>((const T*)g, (const T*)u, (P*)y, n);                                        \
    }                                                                                                           \
    extern "C" __global__ void amp_gated_bwd_##nact##_##nt##_##na##_##np(AMP_GATED_BWD_ARGS) {                 \
        amp_gated_bwd<ACT, T, A, P>((const T*)g, (const T*)u, (const P*)dy, (T*)dg, (T*)du, n);                 \
    }
#define AMP_GATED_ACT(ACT, nact, _) AMP_GATED_TYPES(AMP_GATED_DEFINE, ACT, nact)
AMP_GLU_ACTS(AMP_GATED_ACT, _)

#define AMP_ACT_DEFINE(T, nt, ACT, nact)                                                                        \
    extern "C" __global__ void amp_act_fwd_##nact##_##nt(AMP_ACT_FWD_ARGS) {                                    \
        amp_act_fwd<ACT, T>((const T*)x, (T*)y, n);                                                             \
    }                                                                                                           \
    extern "C" __global__ void amp_act_bwd_##nact##_##nt(AMP_ACT_BWD_ARGS) {                                    \
        amp_act_bwd<ACT, T>((const T*)x, (const T*)dy, (T*)dx, n);                                              \
    }
#define AMP_ACT_ACT(ACT, nact, _) AMP_ACT_TYPES(AMP_ACT_DEFINE, ACT, nact)
AMP_GLU_ACTS(AMP_ACT_ACT, _)
