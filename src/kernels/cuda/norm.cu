// LayerNorm and RMSNorm over the last dimension on CUDA (llm.c's layernorm kernels, with the
// CPU op's arithmetic: src/kernels/norm/): statistics in f32, saved per row for the backward.
//
//   forward:  mean = Σx / n (0 for RMS), var = Σ(x - mean)² / n, rstd = 1 / sqrt(var + eps),
//             y = (x - mean) * rstd * w + b, rounded once to x's type; mean and rstd (f32) kept;
//   dx:       g = dy * w, x̂ = (x - mean) * rstd,
//             dx = rstd * (g - mean(g) - x̂ * mean(g * x̂)) (RMS: no mean(g) term), x's type;
//   dw, db:   Σ dy * x̂ and Σ dy over the rows, in f32: per chunk of rows into a scratch
//             buffer (one thread per column, rows in order), then a second kernel adds the
//             chunks in order. No atomics: the result is the same on every run.
//
// w and b are f32 (the library widens half parameters first; a missing one is ones/zeros).
// Compiled at run time by NVRTC (norm_device.rs) and, unmodified, by g++ with the CPU grid
// emulator (tests/cuda_emu/emu.h). It includes only prelude.cuh (see softmax.cu).
//
// Kernels (extern "C"; {t} is f32, f16 or bf16, x's type):
//   amp_norm_fwd_{t}:     one warp per row, any cols, blockDim.x / 32 rows per block;
//   amp_norm_dx_{t}:      one warp per row, the same shape;
//   amp_norm_wb_part_{t}: block = chunk * col_tiles + tile, one thread per column of the tile;
//   amp_norm_wb_sum:      one thread per value of the (2, cols) result.
// The launch plan is src/kernels/cuda/norm_plan.rs.

#include "prelude.cuh"

// One warp per row; the row is read three times (sum, squared deviations, write), the second
// and third from L1/L2. Two passes for the variance, as the CPU op (no E[x²] - mean²).
template <typename T>
__device__ __forceinline__ void amp_norm_fwd(const T* __restrict__ x, T* __restrict__ y, const float* __restrict__ w,
                                             const float* __restrict__ b, float* __restrict__ mean_out,
                                             float* __restrict__ rstd_out, int rows, int cols, float eps, int center) {
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    // Whole warps leave together: no block barrier here.
    if (row >= rows) return;
    const T* xr = x + row * cols;
    T* yr = y + row * cols;
    const float n = (float)cols;
    float mean = 0.0f;
    if (center) {
        float s = 0.0f;
        for (int j = lane; j < cols; j += 32) s += amp_to_f32(xr[j]);
        mean = amp_warp_sum(s) / n;
    }
    float v = 0.0f;
    for (int j = lane; j < cols; j += 32) {
        const float d = amp_to_f32(xr[j]) - mean;
        v += d * d;
    }
    const float var = amp_warp_sum(v) / n;
    const float rstd = 1.0f / sqrtf(var + eps);
    for (int j = lane; j < cols; j += 32) {
        yr[j] = amp_from_f32<T>((amp_to_f32(xr[j]) - mean) * rstd * w[j] + b[j]);
    }
    if (lane == 0) {
        mean_out[row] = mean;
        rstd_out[row] = rstd;
    }
}

template <typename T>
__device__ __forceinline__ void amp_norm_dx(const T* __restrict__ x, const T* __restrict__ dy,
                                            const float* __restrict__ w, const float* __restrict__ mean_in,
                                            const float* __restrict__ rstd_in, T* __restrict__ dx, int rows, int cols,
                                            int center) {
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const T* xr = x + row * cols;
    const T* dr = dy + row * cols;
    T* dxr = dx + row * cols;
    const float mean = mean_in[row], rstd = rstd_in[row];
    float sg = 0.0f, sgh = 0.0f;
    for (int j = lane; j < cols; j += 32) {
        const float h = (amp_to_f32(xr[j]) - mean) * rstd;
        const float g = amp_to_f32(dr[j]) * w[j];
        sg += g;
        sgh += g * h;
    }
    const float n = (float)cols;
    const float mg = center ? amp_warp_sum(sg) / n : 0.0f;
    const float mgh = amp_warp_sum(sgh) / n;
    for (int j = lane; j < cols; j += 32) {
        const float h = (amp_to_f32(xr[j]) - mean) * rstd;
        const float g = amp_to_f32(dr[j]) * w[j];
        dxr[j] = amp_from_f32<T>(rstd * (g - mg - h * mgh));
    }
}

// Partial sums of one chunk of rows for one tile of columns: part[chunk][0][col] = Σ dy * x̂
// and part[chunk][1][col] = Σ dy over the chunk's rows, in row order. Consecutive threads read
// consecutive columns of a row (coalesced).
template <typename T>
__device__ __forceinline__ void amp_norm_wb_part(const T* __restrict__ x, const T* __restrict__ dy,
                                                 const float* __restrict__ mean_in, const float* __restrict__ rstd_in,
                                                 float* __restrict__ part, int rows, int cols, int rows_per_chunk,
                                                 int col_tiles) {
    const int chunk = blockIdx.x / col_tiles, tile = blockIdx.x % col_tiles;
    const int col = tile * blockDim.x + threadIdx.x;
    if (col >= cols) return;
    const long long r0 = (long long)chunk * rows_per_chunk;
    long long r1 = r0 + rows_per_chunk;
    if (r1 > rows) r1 = rows;
    float dw = 0.0f, db = 0.0f;
    for (long long r = r0; r < r1; r++) {
        const float g = amp_to_f32(dy[r * cols + col]);
        dw += g * ((amp_to_f32(x[r * cols + col]) - mean_in[r]) * rstd_in[r]);
        db += g;
    }
    float* p = part + (long long)chunk * 2 * cols;
    p[col] = dw;
    p[cols + col] = db;
}

// out[i] = Σ over chunks of part[chunk][i], chunks in order, for the 2 * cols values.
__device__ __forceinline__ void amp_norm_wb_sum_impl(const float* __restrict__ part, float* __restrict__ out, int cols,
                                                     int chunks) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long n = 2LL * cols;
    if (i >= n) return;
    float s = 0.0f;
    for (int c = 0; c < chunks; c++) s += part[(long long)c * n + i];
    out[i] = s;
}

// ---------------------------------------------------------------------------------- entry points
#define AMP_NORM_TYPES(X) X(float, f32) X(amp_f16, f16) X(amp_bf16, bf16)

#define AMP_NORM_FWD_ARGS                                                                              \
    const void *x, void *y, const float *w, const float *b, float *mean, float *rstd, int rows, int cols, \
        float eps, int center
#define AMP_NORM_DX_ARGS                                                                               \
    const void *x, const void *dy, const float *w, const float *mean, const float *rstd, void *dx, int rows, \
        int cols, int center
#define AMP_NORM_PART_ARGS                                                                             \
    const void *x, const void *dy, const float *mean, const float *rstd, float *part, int rows, int cols, \
        int rows_per_chunk, int col_tiles
#define AMP_NORM_SUM_ARGS const float *part, float *out, int cols, int chunks

#define AMP_NORM_DEFINE(T, t)                                                                          \
    extern "C" __global__ void amp_norm_fwd_##t(AMP_NORM_FWD_ARGS) {                                   \
        amp_norm_fwd<T>((const T*)x, (T*)y, w, b, mean, rstd, rows, cols, eps, center);                \
    }                                                                                                  \
    extern "C" __global__ void amp_norm_dx_##t(AMP_NORM_DX_ARGS) {                                     \
        amp_norm_dx<T>((const T*)x, (const T*)dy, w, mean, rstd, (T*)dx, rows, cols, center);          \
    }                                                                                                  \
    extern "C" __global__ void amp_norm_wb_part_##t(AMP_NORM_PART_ARGS) {                              \
        amp_norm_wb_part<T>((const T*)x, (const T*)dy, mean, rstd, part, rows, cols, rows_per_chunk,   \
                            col_tiles);                                                                \
    }
AMP_NORM_TYPES(AMP_NORM_DEFINE)

extern "C" __global__ void amp_norm_wb_sum(AMP_NORM_SUM_ARGS) { amp_norm_wb_sum_impl(part, out, cols, chunks); }
