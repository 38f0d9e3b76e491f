// Attention's softmax on CUDA: y = softmax(x * scale) over the last dimension with the causal
// and/or padding-by-length mask computed here (never materialised), and its backward
// dx = scale * y * (dy - rowsum(dy * y)). Half (f16, bf16) or f32 in, f32 arithmetic, any of
// the three out; one launch per pass, each row read once from global memory (rows up to 1024
// long stay in registers; longer rows are re-read once from L2 by the block kernels).
//
// The arithmetic and its order are the CPU kernel's (src/kernels/softmax.rs): scale, subtract
// the row's maximum, exponentiate, divide by the sum; masked entries are 0, a fully masked
// row is all 0, and a row whose live scores hold an inf or NaN comes out NaN (fmaxf skips a
// NaN, whose exp then poisons the sum), so an overflow in the scores is not hidden.
//
// Compiled at run time by NVRTC (src/kernels/cuda/softmax.rs) and, unmodified, by g++ with the
// CPU grid emulator (tests/cuda_emu/emu.h) for the tests. It includes only prelude.cuh (spliced
// in by nvrtc.rs for NVRTC), which includes no header, so NVRTC needs no toolkit headers on the
// user's machine: the half types are their 16-bit patterns, converted with PTX instructions on
// the device and by the emulator's functions off it.
//
// Kernels (extern "C", names built by the macros at the end):
//   amp_softmax_fwd_w{N}_{in}_{out}: one warp per row, N values per lane in registers
//                                    (cols <= 32 * N), blockDim.x / 32 rows per block;
//   amp_softmax_fwd_b_{in}_{out}:    one block per row, any cols;
//   amp_softmax_bwd_w{N}_{in}_{out}, amp_softmax_bwd_b_{in}_{out}: the same for the backward
//                                    (y and dy of type in, dx of type out).
// The launch plan (which kernel, grid, block) is src/kernels/cuda/softmax.rs's `plan`.

#include "prelude.cuh"

// How many leading keys of `row` are live. Causal: query i (row % q_len) of q_len queries over
// cols keys sees keys j <= i + cols - q_len (the last query sees every key; square: j <= i).
// Padding: keys j >= lens[row / rows_per_len] are masked (lens null: none).
__device__ __forceinline__ int amp_live(long long row, int cols, int q_len, int causal, const int* lens,
                                        int rows_per_len) {
    long long live = cols;
    if (causal) {
        long long lim = row % q_len + 1 + (cols - q_len);
        live = lim < live ? lim : live;
    }
    if (lens) {
        long long l = lens[row / rows_per_len];
        live = l < live ? l : live;
    }
    return live < 0 ? 0 : (int)live;
}

template <typename TI, typename TO, int N>
__device__ __forceinline__ void amp_fwd_warp(const TI* __restrict__ x, TO* __restrict__ y, int rows, int cols,
                                             int q_len, float scale, int causal, const int* __restrict__ lens,
                                             int rows_per_len) {
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    // Whole warps leave together: this kernel has no block barrier.
    if (row >= rows) return;
    const int live = amp_live(row, cols, q_len, causal, lens, rows_per_len);
    const TI* xr = x + row * cols;
    TO* yr = y + row * cols;
    float v[N];
    float m = amp_neg_inf();
#pragma unroll
    for (int k = 0; k < N; k++) {
        const int j = k * 32 + lane;
        // Masked scores are never read.
        v[k] = j < live ? amp_to_f32(xr[j]) * scale : amp_neg_inf();
        m = fmaxf(m, v[k]);
    }
    m = amp_warp_max(m);
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < N; k++) {
        const int j = k * 32 + lane;
        if (j < live) {
            v[k] = expf(v[k] - m);
            s += v[k];
        }
    }
    s = amp_warp_sum(s);
#pragma unroll
    for (int k = 0; k < N; k++) {
        const int j = k * 32 + lane;
        if (j < cols) yr[j] = amp_from_f32<TO>(j < live ? v[k] / s : 0.0f);
    }
}

// Rows longer than a warp's registers: per-thread online maximum and sum over a strided slice
// (one read), block reductions, then a second read (from L2) to write. A -inf score adds
// nothing (exp(-inf - m) = 0) but would start a thread's sum at exp(-inf - -inf) = NaN, so it
// is skipped; a live row whose maximum is -inf comes out NaN, as the one-warp kernel's does.
template <typename TI, typename TO>
__device__ __forceinline__ void amp_fwd_block(const TI* __restrict__ x, TO* __restrict__ y, int rows, int cols,
                                              int q_len, float scale, int causal, const int* __restrict__ lens,
                                              int rows_per_len) {
    __shared__ float red[32];
    const long long row = blockIdx.x;
    if (row >= rows) return;
    const int live = amp_live(row, cols, q_len, causal, lens, rows_per_len);
    const TI* xr = x + row * cols;
    TO* yr = y + row * cols;
    const float ninf = amp_neg_inf();
    float m = ninf, s = 0.0f;
    for (int j = threadIdx.x; j < live; j += blockDim.x) {
        const float v = amp_to_f32(xr[j]) * scale;
        if (v == ninf) continue;
        // Before the first finite value m is -inf and s 0: 0 * exp(-inf) = 0. A NaN leaves m
        // as it is (fmaxf) and makes s NaN, which nothing after it clears.
        const float mn = fmaxf(m, v);
        s = s * expf(m - mn) + expf(v - mn);
        m = mn;
    }
    const float rm = amp_block_max(m, red);
    // A thread without values (s == 0) adds 0, not 0 * exp(-inf - -inf) = NaN.
    float rs = amp_block_sum(s == 0.0f ? 0.0f : s * expf(m - rm), red);
    if (rm == ninf) rs = amp_nan();
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        yr[j] = amp_from_f32<TO>(j < live ? expf(amp_to_f32(xr[j]) * scale - rm) / rs : 0.0f);
    }
}

template <typename T, typename TO, int N>
__device__ __forceinline__ void amp_bwd_warp(const T* __restrict__ y, const T* __restrict__ dy, TO* __restrict__ dx,
                                             int rows, int cols, float scale) {
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const T* yr = y + row * cols;
    const T* dr = dy + row * cols;
    TO* xr = dx + row * cols;
    float yv[N], dv[N];
    float dot = 0.0f;
#pragma unroll
    for (int k = 0; k < N; k++) {
        const int j = k * 32 + lane;
        yv[k] = j < cols ? amp_to_f32(yr[j]) : 0.0f;
        dv[k] = j < cols ? amp_to_f32(dr[j]) : 0.0f;
        dot += yv[k] * dv[k];
    }
    dot = amp_warp_sum(dot);
#pragma unroll
    for (int k = 0; k < N; k++) {
        const int j = k * 32 + lane;
        if (j < cols) xr[j] = amp_from_f32<TO>((yv[k] * (dv[k] - dot)) * scale);
    }
}

template <typename T, typename TO>
__device__ __forceinline__ void amp_bwd_block(const T* __restrict__ y, const T* __restrict__ dy, TO* __restrict__ dx,
                                              int rows, int cols, float scale) {
    __shared__ float red[32];
    const long long row = blockIdx.x;
    if (row >= rows) return;
    const T* yr = y + row * cols;
    const T* dr = dy + row * cols;
    TO* xr = dx + row * cols;
    float dot = 0.0f;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) dot += amp_to_f32(yr[j]) * amp_to_f32(dr[j]);
    dot = amp_block_sum(dot, red);
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        xr[j] = amp_from_f32<TO>((amp_to_f32(yr[j]) * (amp_to_f32(dr[j]) - dot)) * scale);
    }
}

// ---------------------------------------------------------------------------------- entry points
// X-macros, so that the emulator's harness builds its table of kernels from the same lists.
#define AMP_SOFTMAX_TYPES(X, ...)                                                                      \
    X(float, f32, float, f32, __VA_ARGS__)                                                             \
    X(float, f32, amp_f16, f16, __VA_ARGS__)                                                           \
    X(float, f32, amp_bf16, bf16, __VA_ARGS__)                                                         \
    X(amp_f16, f16, float, f32, __VA_ARGS__)                                                           \
    X(amp_f16, f16, amp_f16, f16, __VA_ARGS__)                                                         \
    X(amp_f16, f16, amp_bf16, bf16, __VA_ARGS__)                                                       \
    X(amp_bf16, bf16, float, f32, __VA_ARGS__)                                                         \
    X(amp_bf16, bf16, amp_f16, f16, __VA_ARGS__)                                                       \
    X(amp_bf16, bf16, amp_bf16, bf16, __VA_ARGS__)

// Values per lane of the one-warp kernels: rows up to 64, 256 and 1024 long.
#define AMP_SOFTMAX_WARP_SIZES(X, ...) X(2, __VA_ARGS__) X(8, __VA_ARGS__) X(32, __VA_ARGS__)

#define AMP_FWD_ARGS                                                                                   \
    const void *x, void *y, int rows, int cols, int q_len, float scale, int causal, const int *lens,   \
        int rows_per_len
#define AMP_BWD_ARGS const void *y, const void *dy, void *dx, int rows, int cols, float scale

#define AMP_DEFINE_WARP(TI, ni, TO, no, N)                                                             \
    extern "C" __global__ void amp_softmax_fwd_w##N##_##ni##_##no(AMP_FWD_ARGS) {                      \
        amp_fwd_warp<TI, TO, N>((const TI*)x, (TO*)y, rows, cols, q_len, scale, causal, lens,          \
                                rows_per_len);                                                         \
    }                                                                                                  \
    extern "C" __global__ void amp_softmax_bwd_w##N##_##ni##_##no(AMP_BWD_ARGS) {                      \
        amp_bwd_warp<TI, TO, N>((const TI*)y, (const TI*)dy, (TO*)dx, rows, cols, scale);              \
    }
#define AMP_DEFINE_WARPS(N, _) AMP_SOFTMAX_TYPES(AMP_DEFINE_WARP, N)
AMP_SOFTMAX_WARP_SIZES(AMP_DEFINE_WARPS, _)

#define AMP_DEFINE_BLOCK(TI, ni, TO, no, _)                                                            \
    extern "C" __global__ void amp_softmax_fwd_b_##ni##_##no(AMP_FWD_ARGS) {                           \
        amp_fwd_block<TI, TO>((const TI*)x, (TO*)y, rows, cols, q_len, scale, causal, lens,            \
                              rows_per_len);                                                           \
    }                                                                                                  \
    extern "C" __global__ void amp_softmax_bwd_b_##ni##_##no(AMP_BWD_ARGS) {                           \
        amp_bwd_block<TI, TO>((const TI*)y, (const TI*)dy, (TO*)dx, rows, cols, scale);                \
    }
AMP_SOFTMAX_TYPES(AMP_DEFINE_BLOCK, _)
