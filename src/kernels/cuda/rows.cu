// Row kernels for two places where candle on CUDA runs several generic kernels: a linear
// layer's bias + GELU (erf or tanh form), and the residual add between tensors of different float
// types (PyTorch's promotion) fused with its cast.
//
//   bias + GELU:  p = h + bias (f32 arithmetic, rounded to h's type where the bias has it, as
//                 the unfused layer's output is), y = gelu(p) = p * Φ(p) in the output's type;
//                 backward: dp = dy * gelu'(p) in f32, rounded as p is; dh = dp in h's type,
//                 and each column's Σ dp over the rows (f32) into a scratch buffer per chunk of
//                 rows, summed in order by a second kernel into the bias's type;
//   add:          out = a + b in f32, rounded once to the output's type (f32 where the types
//                 differ), b of a's shape or one row broadcast over a's rows; its broadcast
//                 gradient is the column sums of dout, by the same two kernels.
//
// No atomics: every sum is in a fixed order (rows in order within a chunk, chunks in order),
// so a result is the same on every run. Φ(x) = erfc(-x/√2) / 2 keeps its relative precision in
// the negative tail, where 1 + erf(x/√2) would cancel; the tanh form likewise as
// x σ(2v), v = √(2/π) (x + 0.044715 x³), where x/2 (1 + tanh v) would cancel (see gated.cu).
// Compiled at run time by NVRTC (rows_device.rs) and, unmodified, by g++ with the CPU grid
// emulator (tests/cuda_emu/emu.h). It includes only prelude.cuh (see softmax.cu).
//
// Kernels (extern "C"; {h}, {b}, {y}, {a}, {o}, {g} are f32, f16 or bf16). Every one but the
// sums has a block per (chunk of rows, tile of columns), block = chunk * col_tiles + tile, one
// thread per column of the tile, looping over the chunk's rows (coalesced across the threads):
//   amp_bias_gelu_fwd_{h}_{b}_{y}: y from h and bias;
//   amp_bias_gelu_bwd_{h}_{b}_{y}: dh from h, bias and dy, and the chunk's column sums of dp
//                                  (none where `part` is null);
//   amp_bias_gelu_tanh_{fwd,bwd}_{h}_{b}_{y}: the same with GELU's tanh form;
//   amp_add_{a}_{b}_{o}:           out from a and b (b one row where b_bcast);
//   amp_colsum_part_{g}:           the chunk's column sums of g;
//   amp_colsum_sum_{o}:            one thread per column: Σ over the chunks, in order.
// The launch plan is src/kernels/cuda/rows.rs.

#include "prelude.cuh"

// Φ, GELU and its derivative in f32: erfcf and expf are CUDA's device functions (the C
// library's in the emulator). 1/√2 and 1/√(2π).
__device__ __forceinline__ float amp_gelu_cdf(float x) { return 0.5f * erfcf(x * -0.70710678118654752f); }
__device__ __forceinline__ float amp_gelu(float x) { return x * amp_gelu_cdf(x); }
__device__ __forceinline__ float amp_gelu_grad(float x) {
    return amp_gelu_cdf(x) + x * 0.39894228040143268f * expf(-0.5f * x * x);
}

// The two forms as template arguments. The tanh form: 2v = 2 √(2/π) (x + 0.044715 x³),
// gelu = x σ(2v), gelu' = s + 2 x s (1 - s) √(2/π) (1 + 3 · 0.044715 x²), s = σ(2v), with
// 1 - s = e / (1 + e), e = e^-2v (1 where e is inf), so neither tail cancels.
struct AmpGeluErfForm {
    static __device__ __forceinline__ float fwd(float x) { return amp_gelu(x); }
    static __device__ __forceinline__ float grad(float x) { return amp_gelu_grad(x); }
};
struct AmpGeluTanhForm {
    static __device__ __forceinline__ float two_v(float x) {
        return 2.0f * 0.79788456080286536f * (x + 0.044715f * x * x * x);
    }
    static __device__ __forceinline__ float fwd(float x) { return x / (1.0f + expf(-two_v(x))); }
    static __device__ __forceinline__ float grad(float x) {
        const float e = expf(-two_v(x));
        const float d = 1.0f + e;
        const float s = 1.0f / d, r = e > 3.0e38f ? 1.0f : e / d;
        return s + 2.0f * x * s * r * (0.79788456080286536f * (1.0f + 3.0f * 0.044715f * x * x));
    }
};

// The pre-activation (and its gradient) in the type the unfused add would give it: rounded
// to h's type where the bias has that type too, kept in f32 where the bias is f32 (PyTorch's
// promotion; f32 + f32 rounds to nothing).
template <typename TH, typename TB> struct AmpPre {
    static __device__ __forceinline__ float round(float v) { return v; }
};
template <typename T> struct AmpPre<T, T> {
    static __device__ __forceinline__ float round(float v) { return amp_to_f32(amp_from_f32<T>(v)); }
};

// The rows [r0, r1) of this block's chunk and its column (false past the last column).
struct AmpTile {
    long long r0, r1;
    int col, chunk;
};
__device__ __forceinline__ bool amp_tile(AmpTile& t, int rows, int cols, int rows_per_chunk, int col_tiles) {
    t.chunk = blockIdx.x / col_tiles;
    t.col = (blockIdx.x % col_tiles) * blockDim.x + threadIdx.x;
    if (t.col >= cols) return false;
    t.r0 = (long long)t.chunk * rows_per_chunk;
    t.r1 = t.r0 + rows_per_chunk;
    if (t.r1 > rows) t.r1 = rows;
    return true;
}

template <typename G, typename TH, typename TB, typename TY>
__device__ __forceinline__ void amp_bias_gelu_fwd(const TH* __restrict__ h, const TB* __restrict__ bias,
                                                  TY* __restrict__ y, int rows, int cols, int rows_per_chunk,
                                                  int col_tiles) {
    AmpTile t;
    if (!amp_tile(t, rows, cols, rows_per_chunk, col_tiles)) return;
    const float b = amp_to_f32(bias[t.col]);
#pragma unroll 4
    for (long long r = t.r0; r < t.r1; r++) {
        const long long i = r * cols + t.col;
        const float p = AmpPre<TH, TB>::round(amp_to_f32(h[i]) + b);
        y[i] = amp_from_f32<TY>(G::fwd(p));
    }
}

template <typename G, typename TH, typename TB, typename TY>
__device__ __forceinline__ void amp_bias_gelu_bwd(const TH* __restrict__ h, const TB* __restrict__ bias,
                                                  const TY* __restrict__ dy, TH* __restrict__ dh,
                                                  float* __restrict__ part, int rows, int cols, int rows_per_chunk,
                                                  int col_tiles) {
    AmpTile t;
    if (!amp_tile(t, rows, cols, rows_per_chunk, col_tiles)) return;
    const float b = amp_to_f32(bias[t.col]);
    float s = 0.0f;
#pragma unroll 4
    for (long long r = t.r0; r < t.r1; r++) {
        const long long i = r * cols + t.col;
        const float p = AmpPre<TH, TB>::round(amp_to_f32(h[i]) + b);
        const float dp = AmpPre<TH, TB>::round(amp_to_f32(dy[i]) * G::grad(p));
        dh[i] = amp_from_f32<TH>(dp);
        s += dp;
    }
    if (part) part[(long long)t.chunk * cols + t.col] = s;
}

template <typename TA, typename TB, typename TO>
__device__ __forceinline__ void amp_add(const TA* __restrict__ a, const TB* __restrict__ b, TO* __restrict__ out,
                                        int rows, int cols, int rows_per_chunk, int col_tiles, int b_bcast) {
    AmpTile t;
    if (!amp_tile(t, rows, cols, rows_per_chunk, col_tiles)) return;
    const float brow = b_bcast ? amp_to_f32(b[t.col]) : 0.0f;
#pragma unroll 4
    for (long long r = t.r0; r < t.r1; r++) {
        const long long i = r * cols + t.col;
        const float bv = b_bcast ? brow : amp_to_f32(b[i]);
        out[i] = amp_from_f32<TO>(amp_to_f32(a[i]) + bv);
    }
}

template <typename TG>
__device__ __forceinline__ void amp_colsum_part(const TG* __restrict__ g, float* __restrict__ part, int rows, int cols,
                                                int rows_per_chunk, int col_tiles) {
    AmpTile t;
    if (!amp_tile(t, rows, cols, rows_per_chunk, col_tiles)) return;
    float s = 0.0f;
#pragma unroll 4
    for (long long r = t.r0; r < t.r1; r++) s += amp_to_f32(g[r * cols + t.col]);
    part[(long long)t.chunk * cols + t.col] = s;
}

template <typename TO>
__device__ __forceinline__ void amp_colsum_sum(const float* __restrict__ part, TO* __restrict__ out, int cols,
                                               int chunks) {
    const long long col = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= cols) return;
    float s = 0.0f;
    for (int c = 0; c < chunks; c++) s += part[(long long)c * cols + col];
    out[col] = amp_from_f32<TO>(s);
}

// ---------------------------------------------------------------------------------- entry points
#define AMP_ROWS_TYPES(X) X(float, f32) X(amp_f16, f16) X(amp_bf16, bf16)
// (h, bias, y): the bias in h's type or f32, the output in h's type or f32.
#define AMP_BIAS_GELU_TYPES(X)                                                                                  \
    X(float, f32, float, f32, float, f32)                                                                       \
    X(amp_f16, f16, amp_f16, f16, amp_f16, f16)                                                                 \
    X(amp_f16, f16, amp_f16, f16, float, f32)                                                                   \
    X(amp_f16, f16, float, f32, amp_f16, f16)                                                                   \
    X(amp_f16, f16, float, f32, float, f32)                                                                     \
    X(amp_bf16, bf16, amp_bf16, bf16, amp_bf16, bf16)                                                           \
    X(amp_bf16, bf16, amp_bf16, bf16, float, f32)                                                               \
    X(amp_bf16, bf16, float, f32, amp_bf16, bf16)                                                               \
    X(amp_bf16, bf16, float, f32, float, f32)
// (a, b, out): one type kept or widened to f32; two types promoted to f32.
#define AMP_ADD_TYPES(X)                                                                                        \
    X(float, f32, float, f32, float, f32)                                                                       \
    X(amp_f16, f16, amp_f16, f16, amp_f16, f16)                                                                 \
    X(amp_f16, f16, amp_f16, f16, float, f32)                                                                   \
    X(amp_bf16, bf16, amp_bf16, bf16, amp_bf16, bf16)                                                           \
    X(amp_bf16, bf16, amp_bf16, bf16, float, f32)                                                               \
    X(float, f32, amp_f16, f16, float, f32)                                                                     \
    X(amp_f16, f16, float, f32, float, f32)                                                                     \
    X(float, f32, amp_bf16, bf16, float, f32)                                                                   \
    X(amp_bf16, bf16, float, f32, float, f32)                                                                   \
    X(amp_f16, f16, amp_bf16, bf16, float, f32)                                                                 \
    X(amp_bf16, bf16, amp_f16, f16, float, f32)

#define AMP_BIAS_GELU_FWD_ARGS                                                                                  \
    const void *h, const void *bias, void *y, int rows, int cols, int rows_per_chunk, int col_tiles
#define AMP_BIAS_GELU_BWD_ARGS                                                                                  \
    const void *h, const void *bias, const void *dy, void *dh, float *part, int rows, int cols,                 \
        int rows_per_chunk, int col_tiles
#define AMP_ADD_ARGS                                                                                            \
    const void *a, const void *b, void *out, int rows, int cols, int rows_per_chunk, int col_tiles, int b_bcast
#define AMP_COLSUM_PART_ARGS const void *g, float *part, int rows, int cols, int rows_per_chunk, int col_tiles
#define AMP_COLSUM_SUM_ARGS const float *part, void *out, int cols, int chunks

#define AMP_BIAS_GELU_DEFINE_FORM(G, form, TH, nh, TB, nb, TY, ny)                                              \
    extern "C" __global__ void amp_bias_##form##_fwd_##nh##_##nb##_##ny(AMP_BIAS_GELU_FWD_ARGS) {               \
        amp_bias_gelu_fwd<G, TH, TB, TY>((const TH*)h, (const TB*)bias, (TY*)y, rows, cols, rows_per_chunk,     \
                                         col_tiles);                                                            \
    }                                                                                                           \
    extern "C" __global__ void amp_bias_##form##_bwd_##nh##_##nb##_##ny(AMP_BIAS_GELU_BWD_ARGS) {               \
        amp_bias_gelu_bwd<G, TH, TB, TY>((const TH*)h, (const TB*)bias, (const TY*)dy, (TH*)dh, part, rows,     \
                                         cols, rows_per_chunk, col_tiles);                                      \
    }
#define AMP_BIAS_GELU_DEFINE(TH, nh, TB, nb, TY, ny)                                                            \
    AMP_BIAS_GELU_DEFINE_FORM(AmpGeluErfForm, gelu, TH, nh, TB, nb, TY, ny)                                     \
    AMP_BIAS_GELU_DEFINE_FORM(AmpGeluTanhForm, gelu_tanh, TH, nh, TB, nb, TY, ny)
AMP_BIAS_GELU_TYPES(AMP_BIAS_GELU_DEFINE)

#define AMP_ADD_DEFINE(TA, na, TB, nb, TO, no)                                                                  \
    extern "C" __global__ void amp_add_##na##_##nb##_##no(AMP_ADD_ARGS) {                                       \
        amp_add<TA, TB, TO>((const TA*)a, (const TB*)b, (TO*)out, rows, cols, rows_per_chunk, col_tiles,        \
                            b_bcast);                                                                           \
    }
AMP_ADD_TYPES(AMP_ADD_DEFINE)

#define AMP_COLSUM_DEFINE(T, t)                                                                                 \
    extern "C" __global__ void amp_colsum_part_##t(AMP_COLSUM_PART_ARGS) {                                      \
        amp_colsum_part<T>((const T*)g, part, rows, cols, rows_per_chunk, col_tiles);                           \
    }                                                                                                           \
    extern "C" __global__ void amp_colsum_sum_##t(AMP_COLSUM_SUM_ARGS) {                                        \
        amp_colsum_sum<T>(part, (T*)out, cols, chunks);                                                         \
    }
AMP_ROWS_TYPES(AMP_COLSUM_DEFINE)
