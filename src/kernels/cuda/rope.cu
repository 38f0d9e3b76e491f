// The rotary position embedding over x (b, h, t, d), forward and backward, one kernel each,
// for the two table layouts of the CPU pass (src/kernels/rope.rs):
//
//   halves (tables (t, d), candle's `rope`, Hugging Face's rotate_half), pair (x1, x2) =
//          (x[j], x[j + d/2]) with c1, c2, s1, s2 the tables' values at j and j + d/2:
//          forward   y1 = x1 c1 + (-x2) s1,   y2 = x2 c2 + x1 s2
//          backward  dx1 = g1 c1 + g2 s2,     dx2 = g2 c2 + -(g1 s1)
//   pairs  (tables (t, d/2), candle's `rope_i`), pair (x0, x1) = (x[2j], x[2j+1]) with c, s
//          the tables' values at j:
//          forward   y0 = x0 c - x1 s,        y1 = x0 s + x1 c
//          backward  dx0 = g0 c + g1 s,       dx1 = g1 c - g0 s
//
// Each value is the composed ops' (nn::self_attention's apply_rope: cast to f32, broadcast
// products, the sum or difference, cast back) in their order: two f32 products, each rounded,
// then one f32 sum, rounded once to the output's type. NVRTC compiles it with --fmad=false
// (nvrtc.rs), so no product is contracted into an FMA and the result is the CPU's bit for bit.
// Row r of the heads takes the tables' row r % t (the tables may hold more rows; only the
// first t are read). The backward is the transposed rotation of the output's gradient, read
// and written in x's type (the composed graph's cast backward rounds it there).
//
// Memory-bound: one thread per pair per iteration of a grid-stride loop, so a warp reads two
// contiguous runs of x (halves) or one (pairs) and writes the same; the tables are t rows,
// read through the cache by every head. No shared memory, no atomics.
// Compiled at run time by NVRTC (rope_device.rs) and, unmodified, by g++ with the CPU grid
// emulator (tests/cuda_emu/emu.h). It includes only prelude.cuh (see softmax.cu).
//
// Kernels (extern "C"; {t} is f32, f16 or bf16, x's type):
//   amp_rope_halves_fwd_{t}, amp_rope_halves_bwd_{t}, amp_rope_pairs_fwd_{t},
//   amp_rope_pairs_bwd_{t}: out from x (or the gradient) and the f32 tables.
// The launch plan is src/kernels/cuda/rope.rs.

#include "prelude.cuh"

// Pair `k` (of rows * d/2): the offset of its row in x and its row of the tables. 32-bit
// unsigned arithmetic (64-bit division is slow on a GPU): the plan keeps rows * d and the
// grid's threads within i32, so k + stride never wraps.
struct AmpRopePair {
    unsigned int base, j, trow;
};
__device__ __forceinline__ AmpRopePair amp_rope_pair(unsigned int k, unsigned int t, unsigned int half) {
    AmpRopePair p;
    const unsigned int row = k / half;
    p.j = k - row * half;
    p.base = row * 2u * half;
    p.trow = row % t;
    return p;
}

// candle's `rope` layout; BWD picks the transposed rotation.
template <typename T, bool BWD>
__device__ __forceinline__ void amp_rope_halves(const T* __restrict__ x, const float* __restrict__ cos_t,
                                                const float* __restrict__ sin_t, T* __restrict__ out, int rows, int t,
                                                int d) {
    const unsigned int half = (unsigned int)d >> 1, pairs = (unsigned int)rows * half;
    const unsigned int stride = gridDim.x * blockDim.x;
    for (unsigned int k = blockIdx.x * blockDim.x + threadIdx.x; k < pairs; k += stride) {
        const AmpRopePair p = amp_rope_pair(k, (unsigned int)t, half);
        const unsigned int i1 = p.base + p.j, i2 = i1 + half;
        const unsigned int c = p.trow * 2u * half + p.j;
        const float a1 = amp_to_f32(x[i1]), a2 = amp_to_f32(x[i2]);
        const float c1 = cos_t[c], c2 = cos_t[c + half], s1 = sin_t[c], s2 = sin_t[c + half];
        float y1, y2;
        if (BWD) {
            const float p11 = a1 * c1, p22 = a2 * s2, p21 = a2 * c2, p12 = a1 * s1;
            y1 = p11 + p22;
            y2 = p21 + -p12;
        } else {
            const float p11 = a1 * c1, p21 = -a2 * s1, p22 = a2 * c2, p12 = a1 * s2;
            y1 = p11 + p21;
            y2 = p22 + p12;
        }
        out[i1] = amp_from_f32<T>(y1);
        out[i2] = amp_from_f32<T>(y2);
    }
}

// candle's `rope_i` layout; BWD picks the transposed rotation.
template <typename T, bool BWD>
__device__ __forceinline__ void amp_rope_pairs(const T* __restrict__ x, const float* __restrict__ cos_t,
                                               const float* __restrict__ sin_t, T* __restrict__ out, int rows, int t,
                                               int d) {
    const unsigned int half = (unsigned int)d >> 1, pairs = (unsigned int)rows * half;
    const unsigned int stride = gridDim.x * blockDim.x;
    for (unsigned int k = blockIdx.x * blockDim.x + threadIdx.x; k < pairs; k += stride) {
        const AmpRopePair p = amp_rope_pair(k, (unsigned int)t, half);
        const unsigned int i0 = p.base + 2u * p.j;
        const unsigned int ti = p.trow * half + p.j;
        const float a0 = amp_to_f32(x[i0]), a1 = amp_to_f32(x[i0 + 1]);
        const float c = cos_t[ti], s = sin_t[ti];
        float y0, y1;
        if (BWD) {
            const float p0c = a0 * c, p1s = a1 * s, p1c = a1 * c, p0s = a0 * s;
            y0 = p0c + p1s;
            y1 = p1c - p0s;
        } else {
            const float p0c = a0 * c, p1s = a1 * s, p0s = a0 * s, p1c = a1 * c;
            y0 = p0c - p1s;
            y1 = p0s + p1c;
        }
        out[i0] = amp_from_f32<T>(y0);
        out[i0 + 1] = amp_from_f32<T>(y1);
    }
}

// ---------------------------------------------------------------------------------- entry points
#define AMP_ROPE_TYPES(X) X(float, f32) X(amp_f16, f16) X(amp_bf16, bf16)

#define AMP_ROPE_ARGS const void *x, const float *cos_t, const float *sin_t, void *out, int rows, int t, int d

#define AMP_ROPE_DEFINE(T, n)                                                                                   \
    extern "C" __global__ void amp_rope_halves_fwd_##n(AMP_ROPE_ARGS) {                                         \
        amp_rope_halves<T, false>((const T*)x, cos_t, sin_t, (T*)out, rows, t, d);                                  \
    }                                                                                                           \
    extern "C" __global__ void amp_rope_halves_bwd_##n(AMP_ROPE_ARGS) {                                         \
        amp_rope_halves<T, true>((const T*)x, cos_t, sin_t, (T*)out, rows, t, d);                                   \
    }                                                                                                           \
    extern "C" __global__ void amp_rope_pairs_fwd_##n(AMP_ROPE_ARGS) {                                          \
        amp_rope_pairs<T, false>((const T*)x, cos_t, sin_t, (T*)out, rows, t, d);                                   \
    }                                                                                                           \
    extern "C" __global__ void amp_rope_pairs_bwd_##n(AMP_ROPE_ARGS) {                                          \
        amp_rope_pairs<T, true>((const T*)x, cos_t, sin_t, (T*)out, rows, t, d);                                    \
    }
AMP_ROPE_TYPES(AMP_ROPE_DEFINE)
