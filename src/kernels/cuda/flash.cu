// Attention on CUDA without the (batch, heads, t, t) scores: FlashAttention-2's tiling with an
// online softmax (https://arxiv.org/abs/2307.08691). q, k, v, o of shape (bh, t, D), contiguous,
// of f32, f16 or bf16; f32 arithmetic inside (tiles kept in shared memory as f32); the causal
// mask (key j visible to query i iff j <= i) computed here; `scale` given.
//
//   amp_flash_fwd_{t}_d{D}{c}:     one block per (bh, tile of BR queries); loops over tiles of BC
//       keys, keeping per row a running maximum m, a running sum l and an unnormalised output,
//       rescaled by exp(m_old - m_new) when m grows; writes O = acc / l in the input's type and
//       the row's f32 log-sum-exp LSE = m + log(l), the only statistic the backward needs.
//   amp_flash_bwd_pre_{t}_d{D}:    one warp per row: Delta = rowsum(dO * O) in f32.
//   amp_flash_bwd_dkv_{t}_d{D}{c}: one block per (bh, tile of BC keys); loops over the query
//       tiles that see it, recomputing P = exp(scale * q k^T - LSE) (never stored), and sums
//       dV = P^T dO and dK = scale * dS^T Q in registers, dS = P * (dO v^T - Delta).
//   amp_flash_bwd_dq_{t}_d{D}{c}:  one block per (bh, tile of BR queries); loops over the key
//       tiles it sees, recomputing P and dS, and sums dQ = scale * dS K in registers.
//
// dQ has its own pass instead of FlashAttention-2's f32 atomics into a dQ buffer: every sum is
// then taken in one fixed order, so gradients are the same on every run (as the norm kernels'
// two-pass parameter gradients), no f32 (bh, t, D) buffer is zeroed, added into and cast, and
// the CPU emulator needs no atomics; the price is S and dP computed a second time (7 instead
// of 5 products of t x t x D per head).
//
// Thread layout: the threads of a block form rows of TPR lanes (TPR a power of two dividing
// 32, so a row's lanes sit in one warp and reduce with xor shuffles). In the forward and the dQ
// pass a row of lanes owns one query row: lane j takes the key columns j + TPR * k of a tile
// and the output dimensions j + TPR * k. In the dK/dV pass it owns one key row, and lane j the
// query rows j + TPR * k of each query tile. Shared tiles have rows of D + 1 floats so that the
// lanes' reads of distinct rows fall in distinct banks. Products are explicit fmaf (NVRTC runs
// with --fmad=false so that the memory-bound kernels round as the CPU's; here the product's
// rounding is the point). This FMA path serves f32 inputs and GPUs before sm_80; for f16 and
// bf16 on sm_80 and newer the plan takes flash_mma.cu's tensor-core kernels (which round P
// and dS to the half type before their products) and only this file's Delta kernel.
//
// Configurations (AMP_FLASH_CONFIGS): per head dimension a large tile (D = 64: 32 x 32, D =
// 128: 16 x 16, 128 threads; static shared memory under 48 KiB in every pass) and a small one
// (8 x 8, one warp) for grids that the large tile would leave too small to fill the GPU.
// src/kernels/cuda/flash.rs's plan picks one; the tests run both on the emulator.
//
// Only prelude.cuh, as softmax.cu: NVRTC needs no toolkit headers; the emulator
// (tests/cuda_emu) compiles this file unmodified.

#include "prelude.cuh"

// Sum over the TPR lanes of a row (aligned groups of a warp: lane ^ o stays in the group).
template <int TPR> __device__ __forceinline__ float amp_group_sum(float v) {
#pragma unroll
    for (int o = TPR / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
template <int TPR> __device__ __forceinline__ float amp_group_max(float v) {
#pragma unroll
    for (int o = TPR / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Rows [row0, row0 + R) of a (t, D) matrix into a shared tile of rows of D + 1 floats; rows
// past t are zeros. All NT threads of the block take part.
template <typename T, int D, int R, int NT>
__device__ __forceinline__ void amp_load_tile(float (*dst)[D + 1], const T* __restrict__ src, int row0, int t) {
    for (int idx = threadIdx.x; idx < R * D; idx += NT) {
        const int r = idx / D, d = idx - r * D;
        dst[r][d] = row0 + r < t ? amp_to_f32(src[(long long)(row0 + r) * D + d]) : 0.0f;
    }
}

// Whether query `row` sees key `col`.
__device__ __forceinline__ bool amp_flash_live(int row, int col, int t, int causal) {
    return row < t && col < t && (!causal || col <= row);
}

template <typename T, int D, int BR, int BC, int TPR>
__device__ __forceinline__ void amp_flash_fwd(const T* __restrict__ q, const T* __restrict__ k,
                                              const T* __restrict__ v, T* __restrict__ o, float* __restrict__ lse,
                                              int t, float scale, int causal) {
    constexpr int NT = BR * TPR, NS = BC / TPR, NO = D / TPR;
    __shared__ float qs[BR][D + 1];
    __shared__ float ks[BC][D + 1];
    __shared__ float vs[BC][D + 1];
    __shared__ float ps[BR][BC + 1];
    const int q_tiles = (t + BR - 1) / BR;
    // Causal: the last query tiles see the most keys; they get the first blocks, so that the
    // GPU's last wave holds the short ones.
    const int bh = blockIdx.x / q_tiles, qt = q_tiles - 1 - (blockIdx.x - bh * q_tiles);
    const long long base = (long long)bh * t * D;
    const int r = threadIdx.x / TPR, j = threadIdx.x % TPR;
    const int row = qt * BR + r;
    amp_load_tile<T, D, BR, NT>(qs, q + base, qt * BR, t);
    const float ninf = amp_neg_inf();
    float m = ninf, l = 0.0f, acc[NO];
#pragma unroll
    for (int x = 0; x < NO; x++) acc[x] = 0.0f;
    // Causal: the key tiles up to this query tile's last row (tile 0 always: every row sees
    // key 0, so m is finite after the first tile unless a score is not).
    const int kv_tiles_all = (t + BC - 1) / BC;
    int kv_tiles = kv_tiles_all;
    if (causal) {
        const int last = (qt + 1) * BR - 1;
        kv_tiles = last / BC + 1 < kv_tiles_all ? last / BC + 1 : kv_tiles_all;
    }
    for (int kt = 0; kt < kv_tiles; kt++) {
        __syncthreads();  // the previous tile's K, V and P are no longer read
        amp_load_tile<T, D, BC, NT>(ks, k + base, kt * BC, t);
        amp_load_tile<T, D, BC, NT>(vs, v + base, kt * BC, t);
        __syncthreads();
        float s[NS];
#pragma unroll
        for (int x = 0; x < NS; x++) s[x] = 0.0f;
        for (int d = 0; d < D; d++) {
            const float qv = qs[r][d];
#pragma unroll
            for (int x = 0; x < NS; x++) s[x] = fmaf(qv, ks[j + TPR * x][d], s[x]);
        }
        float mt = ninf;
#pragma unroll
        for (int x = 0; x < NS; x++) {
            const bool live = amp_flash_live(row, kt * BC + j + TPR * x, t, causal);
            s[x] = live ? s[x] * scale : ninf;
            mt = fmaxf(mt, s[x]);
        }
        const float mn = fmaxf(m, amp_group_max<TPR>(mt));
        // m = -inf before the first tile (l and acc are 0): alpha = 0, not NaN, since mn is
        // finite there. A tile without live keys for this row leaves mn = m: alpha = 1.
        const float alpha = mn == m ? 1.0f : expf(m - mn);
        float ls = 0.0f;
#pragma unroll
        for (int x = 0; x < NS; x++) {
            const float p = s[x] == ninf ? 0.0f : expf(s[x] - mn);
            ps[r][j + TPR * x] = p;
            ls += p;
        }
        // Each lane keeps its share of l; the lanes' alphas agree, so the shares add up at the end.
        l = l * alpha + ls;
        m = mn;
        __syncthreads();  // the row's P is written
#pragma unroll
        for (int x = 0; x < NO; x++) acc[x] *= alpha;
        for (int c = 0; c < BC; c++) {
            const float p = ps[r][c];
#pragma unroll
            for (int x = 0; x < NO; x++) acc[x] = fmaf(p, vs[c][j + TPR * x], acc[x]);
        }
    }
    l = amp_group_sum<TPR>(l);
    if (row < t) {
        T* orow = o + base + (long long)row * D;
        const float inv = 1.0f / l;
#pragma unroll
        for (int x = 0; x < NO; x++) orow[j + TPR * x] = amp_from_f32<T>(acc[x] * inv);
        if (j == 0) lse[(long long)bh * t + row] = m + logf(l);
    }
}

// Delta = rowsum(dO * O) per row (of bh * t), one warp per row.
template <typename T, int D>
__device__ __forceinline__ void amp_flash_pre(const T* __restrict__ o, const T* __restrict__ dout,
                                              float* __restrict__ delta, int rows) {
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;  // whole warps leave together: no block barrier here
    float s = 0.0f;
    for (int d = lane; d < D; d += 32) s = fmaf(amp_to_f32(o[row * D + d]), amp_to_f32(dout[row * D + d]), s);
    s = amp_warp_sum(s);
    if (lane == 0) delta[row] = s;
}

// The query tile's statistics (LSE, Delta) into shared memory; rows past t get 0.
template <int R, int NT>
__device__ __forceinline__ void amp_load_stats(float* lse_s, float* del_s, const float* __restrict__ lse,
                                               const float* __restrict__ delta, long long off, int row0, int t) {
    for (int i = threadIdx.x; i < R; i += NT) {
        const bool in = row0 + i < t;
        lse_s[i] = in ? lse[off + row0 + i] : 0.0f;
        del_s[i] = in ? delta[off + row0 + i] : 0.0f;
    }
}

template <typename T, int D, int BR, int BC, int TPR>
__device__ __forceinline__ void amp_flash_dkv(const T* __restrict__ q, const T* __restrict__ k,
                                              const T* __restrict__ v, const T* __restrict__ dout,
                                              const float* __restrict__ lse, const float* __restrict__ delta,
                                              T* __restrict__ dk, T* __restrict__ dv, int t, float scale,
                                              int causal) {
    constexpr int NT = BC * TPR, NI = BR / TPR, NO = D / TPR;
    __shared__ float ks[BC][D + 1];
    __shared__ float vs[BC][D + 1];
    __shared__ float qs[BR][D + 1];
    __shared__ float dos[BR][D + 1];
    __shared__ float ps[BC][BR + 1];
    __shared__ float dss[BC][BR + 1];
    __shared__ float lse_s[BR];
    __shared__ float del_s[BR];
    const int k_tiles = (t + BC - 1) / BC;
    const int bh = blockIdx.x / k_tiles, kt = blockIdx.x - bh * k_tiles;
    const long long base = (long long)bh * t * D;
    const int c = threadIdx.x / TPR, j = threadIdx.x % TPR;
    const int col = kt * BC + c;
    amp_load_tile<T, D, BC, NT>(ks, k + base, kt * BC, t);
    amp_load_tile<T, D, BC, NT>(vs, v + base, kt * BC, t);
    float gk[NO], gv[NO];
#pragma unroll
    for (int x = 0; x < NO; x++) gk[x] = gv[x] = 0.0f;
    // Causal: only the query tiles from the one holding this tile's first key see it.
    const int q_tiles = (t + BR - 1) / BR;
    for (int qt = causal ? (kt * BC) / BR : 0; qt < q_tiles; qt++) {
        __syncthreads();  // the previous tile's Q, dO, P and dS are no longer read
        amp_load_tile<T, D, BR, NT>(qs, q + base, qt * BR, t);
        amp_load_tile<T, D, BR, NT>(dos, dout + base, qt * BR, t);
        amp_load_stats<BR, NT>(lse_s, del_s, lse, delta, (long long)bh * t, qt * BR, t);
        __syncthreads();
        float s[NI], dp[NI];
#pragma unroll
        for (int x = 0; x < NI; x++) s[x] = dp[x] = 0.0f;
        for (int d = 0; d < D; d++) {
            const float kv = ks[c][d], vv = vs[c][d];
#pragma unroll
            for (int x = 0; x < NI; x++) {
                s[x] = fmaf(qs[j + TPR * x][d], kv, s[x]);
                dp[x] = fmaf(dos[j + TPR * x][d], vv, dp[x]);
            }
        }
#pragma unroll
        for (int x = 0; x < NI; x++) {
            const int i = j + TPR * x;
            // P recomputed from the forward's LSE; masked entries are exactly 0.
            const float p = amp_flash_live(qt * BR + i, col, t, causal) ? expf(s[x] * scale - lse_s[i]) : 0.0f;
            ps[c][i] = p;
            dss[c][i] = p * (dp[x] - del_s[i]);
        }
        __syncthreads();  // the key row's P and dS are written
        for (int i = 0; i < BR; i++) {
            const float p = ps[c][i], ds = dss[c][i];
#pragma unroll
            for (int x = 0; x < NO; x++) {
                gv[x] = fmaf(p, dos[i][j + TPR * x], gv[x]);
                gk[x] = fmaf(ds, qs[i][j + TPR * x], gk[x]);
            }
        }
    }
    if (col < t) {
        const long long off = base + (long long)col * D;
#pragma unroll
        for (int x = 0; x < NO; x++) {
            dk[off + j + TPR * x] = amp_from_f32<T>(gk[x] * scale);
            dv[off + j + TPR * x] = amp_from_f32<T>(gv[x]);
        }
    }
}

template <typename T, int D, int BR, int BC, int TPR>
__device__ __forceinline__ void amp_flash_dq(const T* __restrict__ q, const T* __restrict__ k,
                                             const T* __restrict__ v, const T* __restrict__ dout,
                                             const float* __restrict__ lse, const float* __restrict__ delta,
                                             T* __restrict__ dq, int t, float scale, int causal) {
    constexpr int NT = BR * TPR, NS = BC / TPR, NO = D / TPR;
    __shared__ float qs[BR][D + 1];
    __shared__ float dos[BR][D + 1];
    __shared__ float ks[BC][D + 1];
    __shared__ float vs[BC][D + 1];
    __shared__ float dss[BR][BC + 1];
    __shared__ float lse_s[BR];
    __shared__ float del_s[BR];
    const int q_tiles = (t + BR - 1) / BR;
    // Causal: the last query tiles see the most keys; they get the first blocks, so that the
    // GPU's last wave holds the short ones.
    const int bh = blockIdx.x / q_tiles, qt = q_tiles - 1 - (blockIdx.x - bh * q_tiles);
    const long long base = (long long)bh * t * D;
    const int r = threadIdx.x / TPR, j = threadIdx.x % TPR;
    const int row = qt * BR + r;
    amp_load_tile<T, D, BR, NT>(qs, q + base, qt * BR, t);
    amp_load_tile<T, D, BR, NT>(dos, dout + base, qt * BR, t);
    amp_load_stats<BR, NT>(lse_s, del_s, lse, delta, (long long)bh * t, qt * BR, t);
    float g[NO];
#pragma unroll
    for (int x = 0; x < NO; x++) g[x] = 0.0f;
    const int kv_tiles_all = (t + BC - 1) / BC;
    int kv_tiles = kv_tiles_all;
    if (causal) {
        const int last = (qt + 1) * BR - 1;
        kv_tiles = last / BC + 1 < kv_tiles_all ? last / BC + 1 : kv_tiles_all;
    }
    for (int kt = 0; kt < kv_tiles; kt++) {
        __syncthreads();  // the previous tile's K, V and dS are no longer read
        amp_load_tile<T, D, BC, NT>(ks, k + base, kt * BC, t);
        amp_load_tile<T, D, BC, NT>(vs, v + base, kt * BC, t);
        __syncthreads();
        float s[NS], dp[NS];
#pragma unroll
        for (int x = 0; x < NS; x++) s[x] = dp[x] = 0.0f;
        for (int d = 0; d < D; d++) {
            const float qv = qs[r][d], dov = dos[r][d];
#pragma unroll
            for (int x = 0; x < NS; x++) {
                s[x] = fmaf(qv, ks[j + TPR * x][d], s[x]);
                dp[x] = fmaf(dov, vs[j + TPR * x][d], dp[x]);
            }
        }
#pragma unroll
        for (int x = 0; x < NS; x++) {
            const int cc = j + TPR * x;
            const float p = amp_flash_live(row, kt * BC + cc, t, causal) ? expf(s[x] * scale - lse_s[r]) : 0.0f;
            dss[r][cc] = p * (dp[x] - del_s[r]);
        }
        __syncthreads();  // the row's dS is written
        for (int cc = 0; cc < BC; cc++) {
            const float ds = dss[r][cc];
#pragma unroll
            for (int x = 0; x < NO; x++) g[x] = fmaf(ds, ks[cc][j + TPR * x], g[x]);
        }
    }
    if (row < t) {
        const long long off = base + (long long)row * D;
#pragma unroll
        for (int x = 0; x < NO; x++) dq[off + j + TPR * x] = amp_from_f32<T>(g[x] * scale);
    }
}

// ---------------------------------------------------------------------------------- entry points
// X-macros, so that the emulator's harness builds its table of kernels from the same lists.
#define AMP_FLASH_TYPES(X, ...)                                                                        \
    X(float, f32, __VA_ARGS__)                                                                         \
    X(amp_f16, f16, __VA_ARGS__)                                                                       \
    X(amp_bf16, bf16, __VA_ARGS__)

// (head dim, config name, BR, BC, TPR): the large and the small tile of each head dimension
// (src/kernels/cuda/flash.rs's CONFIGS repeats these numbers).
#define AMP_FLASH_CONFIGS(X, ...)                                                                      \
    X(64, l, 32, 32, 4, __VA_ARGS__)                                                                   \
    X(64, s, 8, 8, 4, __VA_ARGS__)                                                                     \
    X(128, l, 16, 16, 8, __VA_ARGS__)                                                                  \
    X(128, s, 8, 8, 4, __VA_ARGS__)

#define AMP_FLASH_HEAD_DIMS(X, ...) X(64, __VA_ARGS__) X(128, __VA_ARGS__)

// q, k, v, o of bh * t * D values; lse of bh * t.
#define AMP_FLASH_FWD_ARGS                                                                             \
    const void *q, const void *k, const void *v, void *o, float *lse, int bh, int t, float scale, int causal
#define AMP_FLASH_PRE_ARGS const void *o, const void *dout, float *delta, int rows
// dqkv holds dq, dk and dv one after the other (3 * bh * t * D values): the dK/dV pass writes
// the last two thirds, the dQ pass the first.
#define AMP_FLASH_BWD_ARGS                                                                             \
    const void *q, const void *k, const void *v, const void *dout, const float *lse, const float *delta, \
        void *dqkv, int bh, int t, float scale, int causal

#define AMP_FLASH_DEFINE(T, nt, D, c, BR, BC, TPR)                                                     \
    extern "C" __global__ void amp_flash_fwd_##nt##_d##D##c(AMP_FLASH_FWD_ARGS) {                      \
        amp_flash_fwd<T, D, BR, BC, TPR>((const T*)q, (const T*)k, (const T*)v, (T*)o, lse, t, scale,  \
                                         causal);                                                      \
    }                                                                                                  \
    extern "C" __global__ void amp_flash_bwd_dkv_##nt##_d##D##c(AMP_FLASH_BWD_ARGS) {                  \
        const long long n = (long long)bh * t * D;                                                     \
        amp_flash_dkv<T, D, BR, BC, TPR>((const T*)q, (const T*)k, (const T*)v, (const T*)dout, lse,   \
                                         delta, (T*)dqkv + n, (T*)dqkv + 2 * n, t, scale, causal);     \
    }                                                                                                  \
    extern "C" __global__ void amp_flash_bwd_dq_##nt##_d##D##c(AMP_FLASH_BWD_ARGS) {                   \
        amp_flash_dq<T, D, BR, BC, TPR>((const T*)q, (const T*)k, (const T*)v, (const T*)dout, lse,    \
                                        delta, (T*)dqkv, t, scale, causal);                            \
    }
#define AMP_FLASH_DEFINE_TYPES(D, c, BR, BC, TPR, _) AMP_FLASH_TYPES(AMP_FLASH_DEFINE, D, c, BR, BC, TPR)
AMP_FLASH_CONFIGS(AMP_FLASH_DEFINE_TYPES, _)

#define AMP_FLASH_DEFINE_PRE(T, nt, D)                                                                 \
    extern "C" __global__ void amp_flash_bwd_pre_##nt##_d##D(AMP_FLASH_PRE_ARGS) {                     \
        amp_flash_pre<T, D>((const T*)o, (const T*)dout, delta, rows);                                 \
    }
#define AMP_FLASH_DEFINE_PRES(D, _) AMP_FLASH_TYPES(AMP_FLASH_DEFINE_PRE, D)
AMP_FLASH_HEAD_DIMS(AMP_FLASH_DEFINE_PRES, _)
