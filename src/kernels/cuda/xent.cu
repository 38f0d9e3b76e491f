// Cross entropy over the last dimension on CUDA, fused with the softmax over the classes (a
// vocabulary): logits of f32, f16 or bf16 and integer targets (u8, u32, i64) in, f32
// arithmetic, no f32 copy of the logits and no stored probabilities.
//
//   amp_xent_fwd_{t}_{i}: one block per row: online maximum and sum of exponentials over a
//       strided slice (one read of the row), block reductions, then the row's log-probability
//       at its target, (x_t - m) - log(s), into `logp`, and m and s into `stats` (the only
//       values kept for the backward: 2 floats per row).
//   amp_xent_mean: one block: the rows' log-probabilities summed in a fixed order (each thread
//       a strided slice in row order, then a fixed tree), times `scale` = -1/rows: the loss.
//       Deterministic: no atomics, the same order on every run.
//   amp_xent_bwd_{t}_{i}: one block per row: dlogits = (exp(x - m) / s - onehot) * (g / rows),
//       in the logits' type, one read of the row and one write, g the loss's gradient (read on
//       the device: no host read).
//   amp_xent_rows_{t}_{i}: the two above for one chunk of a chunked LM head (the logits of some
//       rows, never all): one block per row, the forward's pass for m and s, then the row's
//       log-probability into `logp` and dlogits = (exp(x - m) / s - onehot) * inv_n into `dx`,
//       n the rows of the whole batch (the mean's), not the chunk's. One launch, no statistics
//       buffer; the row is read a second time for dx right after the first, from L2 (a 50257-class
//       half row is 100 KB). Its arithmetic is the forward's and the backward's with g = 1, so
//       its values are theirs bit for bit.
//
// Targets as candle's gather takes them: the type's maximum (255, u32::MAX, i64::MAX) is an
// ignored row (log-probability 0, gradient 0, still counted in the mean's rows); any other
// target outside [0, cols) makes that row's log-probability and gradient NaN (the CPU path
// errors and candle's CUDA gather asserts, which ends the CUDA context; a NaN loss is caught
// by the loss scaler's finite check instead).
//
// The arithmetic is the softmax kernels' (softmax.cu): m the row's maximum (fmaxf skips a NaN,
// whose exp then poisons the sum, so a NaN or inf logit gives a NaN loss, not a hidden one).
// Only prelude.cuh, as softmax.cu: NVRTC needs no toolkit headers; the emulator (tests/cuda_emu)
// compiles this file unmodified.

#include "prelude.cuh"

// The row's target: its class, -1 for an ignored row, -2 for one out of range.
__device__ __forceinline__ long long amp_target(unsigned char t, int cols) {
    return t == 0xffu ? -1 : (t < cols ? (long long)t : -2);
}
__device__ __forceinline__ long long amp_target(unsigned int t, int cols) {
    return t == 0xffffffffu ? -1 : (t < (unsigned int)cols ? (long long)t : -2);
}
__device__ __forceinline__ long long amp_target(long long t, int cols) {
    return t == 0x7fffffffffffffffll ? -1 : (t >= 0 && t < cols ? t : -2);
}

template <typename T, typename I>
__device__ __forceinline__ void amp_xent_fwd(const T* __restrict__ x, const I* __restrict__ targets,
                                             float* __restrict__ logp, float* __restrict__ stats, int rows,
                                             int cols) {
    __shared__ float red[32];
    const long long row = blockIdx.x;
    if (row >= rows) return;
    const T* xr = x + row * cols;
    const float ninf = amp_neg_inf();
    float m = ninf, s = 0.0f;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        const float v = amp_to_f32(xr[j]);
        if (v == ninf) continue;
        const float mn = fmaxf(m, v);
        s = s * expf(m - mn) + expf(v - mn);
        m = mn;
    }
    const float rm = amp_block_max(m, red);
    float rs = amp_block_sum(s == 0.0f ? 0.0f : s * expf(m - rm), red);
    if (rm == ninf) rs = amp_nan();
    if (threadIdx.x == 0) {
        const long long t = amp_target(targets[row], cols);
        float lp;
        if (t == -1) {
            lp = 0.0f;
        } else if (t < 0) {
            lp = amp_nan();
        } else {
            lp = (amp_to_f32(xr[t]) - rm) - logf(rs);
        }
        logp[row] = lp;
        stats[2 * row] = rm;
        stats[2 * row + 1] = rs;
    }
}

// The loss: scale * (sum of the rows' log-probabilities), one block.
__device__ __forceinline__ void amp_xent_mean_impl(const float* __restrict__ logp, float* __restrict__ loss, int rows,
                                                   float scale) {
    __shared__ float red[32];
    float acc = 0.0f;
    for (int i = threadIdx.x; i < rows; i += blockDim.x) acc += logp[i];
    acc = amp_block_sum(acc, red);
    if (threadIdx.x == 0) loss[0] = acc * scale;
}

template <typename T, typename I>
__device__ __forceinline__ void amp_xent_bwd(const T* __restrict__ x, const I* __restrict__ targets,
                                             const float* __restrict__ stats, const float* __restrict__ g,
                                             T* __restrict__ dx, int rows, int cols, float inv_rows) {
    const long long row = blockIdx.x;
    if (row >= rows) return;
    const T* xr = x + row * cols;
    T* dr = dx + row * cols;
    const long long t = amp_target(targets[row], cols);
    const float m = stats[2 * row], s = stats[2 * row + 1];
    const float gn = t == -1 ? 0.0f : (t < 0 ? amp_nan() : g[0] * inv_rows);
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        const float p = expf(amp_to_f32(xr[j]) - m) / s;
        dr[j] = amp_from_f32<T>(t == -1 ? 0.0f : (p - (j == t ? 1.0f : 0.0f)) * gn);
    }
}

template <typename T, typename I>
__device__ __forceinline__ void amp_xent_rows(const T* __restrict__ x, const I* __restrict__ targets,
                                              float* __restrict__ logp, T* __restrict__ dx, int rows, int cols,
                                              float inv_n) {
    __shared__ float red[32];
    const long long row = blockIdx.x;
    if (row >= rows) return;
    const T* xr = x + row * cols;
    T* dr = dx + row * cols;
    const float ninf = amp_neg_inf();
    float m = ninf, s = 0.0f;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        const float v = amp_to_f32(xr[j]);
        if (v == ninf) continue;
        const float mn = fmaxf(m, v);
        s = s * expf(m - mn) + expf(v - mn);
        m = mn;
    }
    const float rm = amp_block_max(m, red);
    float rs = amp_block_sum(s == 0.0f ? 0.0f : s * expf(m - rm), red);
    if (rm == ninf) rs = amp_nan();
    const long long t = amp_target(targets[row], cols);
    if (threadIdx.x == 0) {
        logp[row] = t == -1 ? 0.0f : (t < 0 ? amp_nan() : (amp_to_f32(xr[t]) - rm) - logf(rs));
    }
    const float gn = t == -1 ? 0.0f : (t < 0 ? amp_nan() : inv_n);
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        const float p = expf(amp_to_f32(xr[j]) - rm) / rs;
        dr[j] = amp_from_f32<T>(t == -1 ? 0.0f : (p - (j == t ? 1.0f : 0.0f)) * gn);
    }
}

// ---------------------------------------------------------------------------------- entry points
#define AMP_XENT_TYPES(X, ...)                                                                         \
    X(float, f32, unsigned char, u8, __VA_ARGS__)                                                      \
    X(float, f32, unsigned int, u32, __VA_ARGS__)                                                      \
    X(float, f32, long long, i64, __VA_ARGS__)                                                         \
    X(amp_f16, f16, unsigned char, u8, __VA_ARGS__)                                                    \
    X(amp_f16, f16, unsigned int, u32, __VA_ARGS__)                                                    \
    X(amp_f16, f16, long long, i64, __VA_ARGS__)                                                       \
    X(amp_bf16, bf16, unsigned char, u8, __VA_ARGS__)                                                  \
    X(amp_bf16, bf16, unsigned int, u32, __VA_ARGS__)                                                  \
    X(amp_bf16, bf16, long long, i64, __VA_ARGS__)

#define AMP_XENT_FWD_ARGS const void *x, const void *targets, float *logp, float *stats, int rows, int cols
#define AMP_XENT_MEAN_ARGS const float *logp, float *loss, int rows, float scale
#define AMP_XENT_BWD_ARGS                                                                              \
    const void *x, const void *targets, const float *stats, const float *g, void *dx, int rows, int cols,   \
        float inv_rows
#define AMP_XENT_ROWS_ARGS const void *x, const void *targets, float *logp, void *dx, int rows, int cols, float inv_n

#define AMP_XENT_DEFINE(T, nt, I, ni, _)                                                               \
    extern "C" __global__ void amp_xent_fwd_##nt##_##ni(AMP_XENT_FWD_ARGS) {                           \
        amp_xent_fwd<T, I>((const T*)x, (const I*)targets, logp, stats, rows, cols);                   \
    }                                                                                                  \
    extern "C" __global__ void amp_xent_bwd_##nt##_##ni(AMP_XENT_BWD_ARGS) {                           \
        amp_xent_bwd<T, I>((const T*)x, (const I*)targets, stats, g, (T*)dx, rows, cols, inv_rows);    \
    }                                                                                                  \
    extern "C" __global__ void amp_xent_rows_##nt##_##ni(AMP_XENT_ROWS_ARGS) {                         \
        amp_xent_rows<T, I>((const T*)x, (const I*)targets, logp, (T*)dx, rows, cols, inv_n);          \
    }
AMP_XENT_TYPES(AMP_XENT_DEFINE, _)

extern "C" __global__ void amp_xent_mean(AMP_XENT_MEAN_ARGS) { amp_xent_mean_impl(logp, loss, rows, scale); }
