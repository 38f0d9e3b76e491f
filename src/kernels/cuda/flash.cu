// Attention on CUDA without the (batch, heads, t, t) scores: FlashAttention-2's tiling with an
// online softmax (https://arxiv.org/abs/2307.08691). q and o of shape (bh, t, d), k and v of
// (bh / group, t, d), contiguous, of f32, f16 or bf16; f32 arithmetic inside (tiles kept in shared memory as f32); the causal
// mask (key j visible to query i iff j <= i) computed here; `scale` given.
//
// Head dimensions: kernels for D = 32, 48, 64, 80, 96 and 128 (a template constant: register
// arrays and unrolled loops sized by it), each taking the tensors' head dimension d as an
// argument: d, a multiple of 8 up to 128, runs on the smallest D >= d. Shared tiles keep D
// columns, columns d..D loaded as zeros (zeros change neither a score q.k nor a product with
// P or dS), and nothing past column d is read or written in global memory. At d == D (the
// common head dimensions) nothing is wasted; otherwise (D - d) / D of the products: 17% at
// d = 40 on D = 48, 19% at 104 on 128, 75% at d = 8 on D = 32.
//
// Grouped-query attention: k and v hold bh / group matrices; query matrix m reads key/value
// matrix m / group (with m = batch * heads + head, that is head / group of its batch: candle-
// transformers' repeat_kv without the copies). Key lengths: `lengths` (null: none) holds one
// int per batch entry (query matrices m with m / heads = that entry); keys j >= lengths[b] are
// masked for every query of the entry (with the causal mask where set) and load as zeros, so
// that whatever the padding holds never reaches a product. Queries past the length are
// computed as any other (only keys are masked). An entry of length 0 has no live key: its
// rows' output is 0 and their LSE -inf, and the backward gives them and its keys gradients 0.
//
//   amp_flash_fwd_{t}_d{D}{c}:     one block per (bh, tile of BR queries); loops over tiles of BC
//       keys, keeping per row a running maximum m, a running sum l and an unnormalised output,
//       rescaled by exp(m_old - m_new) when m grows; writes O = acc / l in the input's type and
//       the row's f32 log-sum-exp LSE = m + log(l), the only statistic the backward needs.
//   amp_flash_bwd_pre_{t}:         one warp per row: Delta = rowsum(dO * O) in f32.
//   amp_flash_bwd_dkv_{t}_d{D}{c}: one block per (key/value matrix, tile of BC keys); loops
//       over its group's query matrices in order and over the query tiles that see it,
//       recomputing P = exp(scale * q k^T - LSE) (never stored), and sums dV = P^T dO and
//       dK = scale * dS^T Q in registers, dS = P * (dO v^T - Delta).
//   amp_flash_bwd_dq_{t}_d{D}{c}:  one block per (bh, tile of BR queries); loops over the key
//       tiles it sees, recomputing P and dS, and sums dQ = scale * dS K in registers.
//
// dQ has its own pass instead of FlashAttention-2's f32 atomics into a dQ buffer: every sum is
// then taken in one fixed order, so gradients are the same on every run (as the norm kernels'
// two-pass parameter gradients), no f32 (bh, t, d) buffer is zeroed, added into and cast, and
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
// Configurations (AMP_FLASH_CONFIGS): per head dimension a large tile (D <= 64: 32 x 32, D >
// 64: 16 x 16, 128 threads; static shared memory under 48 KiB in every pass) and a small one
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

// Rows [row0, row0 + R) of a (t, dh) matrix (dh <= D) into a shared tile of rows of D + 1
// floats; rows past t and columns past dh are zeros. All NT threads of the block take part.
template <typename T, int D, int R, int NT>
__device__ __forceinline__ void amp_load_tile(float (*dst)[D + 1], const T* __restrict__ src, int row0, int t,
                                              int dh) {
    for (int idx = threadIdx.x; idx < R * D; idx += NT) {
        const int r = idx / D, d = idx - r * D;
        dst[r][d] = row0 + r < t && d < dh ? amp_to_f32(src[(long long)(row0 + r) * dh + d]) : 0.0f;
    }
}

// Whether query `row` (of t) sees key `col` of the first nk (nk <= t: the key length).
__device__ __forceinline__ bool amp_flash_live(int row, int col, int t, int nk, int causal) {
    return row < t && col < nk && (!causal || col <= row);
}

// The keys query matrix m sees: lengths[m / heads] clipped to [0, t], or t without lengths.
__device__ __forceinline__ int amp_flash_keys(const int* __restrict__ lengths, int m, int heads, int t) {
    if (lengths == nullptr) return t;
    const int n = lengths[m / heads];
    return n < 0 ? 0 : n < t ? n : t;
}

// The key tiles of BC a query tile [qt * BR, (qt + 1) * BR) reads: those holding the first nk
// keys, and under the causal mask only up to its last row (tile 0 always where nk > 0: every
// row sees key 0, so a row's running maximum is finite after it unless a score is not).
template <int BR, int BC>
__device__ __forceinline__ int amp_flash_kv_tiles(int qt, int nk, int causal) {
    int n = (nk + BC - 1) / BC;
    if (causal) {
        const int last = ((qt + 1) * BR - 1) / BC + 1;
        n = last < n ? last : n;
    }
    return n;
}

template <typename T, int D, int BR, int BC, int TPR>
__device__ __forceinline__ void amp_flash_fwd(const T* __restrict__ q, const T* __restrict__ k,
                                              const T* __restrict__ v, T* __restrict__ o, float* __restrict__ lse,
                                              int t, int dh, float scale, int causal, int heads, int group,
                                              const int* __restrict__ lengths) {
    constexpr int NT = BR * TPR, NS = BC / TPR, NO = D / TPR;
    __shared__ float qs[BR][D + 1];
    __shared__ float ks[BC][D + 1];
    __shared__ float vs[BC][D + 1];
    __shared__ float ps[BR][BC + 1];
    const int q_tiles = (t + BR - 1) / BR;
    // Causal: the last query tiles see the most keys; they get the first blocks, so that the
    // GPU's last wave holds the short ones.
    const int bh = blockIdx.x / q_tiles, qt = q_tiles - 1 - (blockIdx.x - bh * q_tiles);
    const long long base = (long long)bh * t * dh, kv_base = (long long)(bh / group) * t * dh;
    const int nk = amp_flash_keys(lengths, bh, heads, t);
    const int r = threadIdx.x / TPR, j = threadIdx.x % TPR;
    const int row = qt * BR + r;
    amp_load_tile<T, D, BR, NT>(qs, q + base, qt * BR, t, dh);
    const float ninf = amp_neg_inf();
    float m = ninf, l = 0.0f, acc[NO];
#pragma unroll
    for (int x = 0; x < NO; x++) acc[x] = 0.0f;
    const int kv_tiles = amp_flash_kv_tiles<BR, BC>(qt, nk, causal);
    for (int kt = 0; kt < kv_tiles; kt++) {
        __syncthreads();  // the previous tile's K, V and P are no longer read
        amp_load_tile<T, D, BC, NT>(ks, k + kv_base, kt * BC, nk, dh);
        amp_load_tile<T, D, BC, NT>(vs, v + kv_base, kt * BC, nk, dh);
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
            const bool live = amp_flash_live(row, kt * BC + j + TPR * x, t, nk, causal);
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
        T* orow = o + base + (long long)row * dh;
        // No live key (nk = 0): acc and l are 0; the output 0 (not 0 / 0), the LSE -inf.
        const float inv = nk > 0 ? 1.0f / l : 0.0f;
#pragma unroll
        for (int x = 0; x < NO; x++) {
            if (j + TPR * x < dh) orow[j + TPR * x] = amp_from_f32<T>(acc[x] * inv);
        }
        if (j == 0) lse[(long long)bh * t + row] = m + logf(l);
    }
}

// Delta = rowsum(dO * O) per row (of `rows` rows of dh values), one warp per row.
template <typename T>
__device__ __forceinline__ void amp_flash_pre(const T* __restrict__ o, const T* __restrict__ dout,
                                              float* __restrict__ delta, int rows, int dh) {
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;  // whole warps leave together: no block barrier here
    float s = 0.0f;
    for (int c = lane; c < dh; c += 32) s = fmaf(amp_to_f32(o[row * dh + c]), amp_to_f32(dout[row * dh + c]), s);
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
                                              T* __restrict__ dk, T* __restrict__ dv, int t, int dh, float scale,
                                              int causal, int heads, int group, const int* __restrict__ lengths) {
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
    // kvm: the key/value matrix; its group's query matrices are kvm * group + 0 .. group - 1,
    // all of one batch entry (group divides heads), so of one key length.
    const int kvm = blockIdx.x / k_tiles, kt = blockIdx.x - kvm * k_tiles;
    const long long kv_base = (long long)kvm * t * dh;
    const int nk = amp_flash_keys(lengths, kvm * group, heads, t);
    const int c = threadIdx.x / TPR, j = threadIdx.x % TPR;
    const int col = kt * BC + c;
    amp_load_tile<T, D, BC, NT>(ks, k + kv_base, kt * BC, nk, dh);
    amp_load_tile<T, D, BC, NT>(vs, v + kv_base, kt * BC, nk, dh);
    float gk[NO], gv[NO];
#pragma unroll
    for (int x = 0; x < NO; x++) gk[x] = gv[x] = 0.0f;
    // Causal: only the query tiles from the one holding this tile's first key see it; no query
    // sees a tile wholly past the key length (its gradients stay 0).
    const int q_tiles = kt * BC < nk ? (t + BR - 1) / BR : 0;
    // The group's query matrices in order, and in each its query tiles: one fixed order.
    for (int hg = 0; hg < group; hg++) {
        const long long m = (long long)kvm * group + hg, base = m * t * dh;
        for (int qt = causal ? (kt * BC) / BR : 0; qt < q_tiles; qt++) {
            __syncthreads();  // the previous tile's Q, dO, P and dS are no longer read
            amp_load_tile<T, D, BR, NT>(qs, q + base, qt * BR, t, dh);
            amp_load_tile<T, D, BR, NT>(dos, dout + base, qt * BR, t, dh);
            amp_load_stats<BR, NT>(lse_s, del_s, lse, delta, m * t, qt * BR, t);
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
                const bool live = amp_flash_live(qt * BR + i, col, t, nk, causal);
                const float p = live ? expf(s[x] * scale - lse_s[i]) : 0.0f;
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
    }
    if (col < t) {
        const long long off = kv_base + (long long)col * dh;
#pragma unroll
        for (int x = 0; x < NO; x++) {
            if (j + TPR * x < dh) {
                dk[off + j + TPR * x] = amp_from_f32<T>(gk[x] * scale);
                dv[off + j + TPR * x] = amp_from_f32<T>(gv[x]);
            }
        }
    }
}

template <typename T, int D, int BR, int BC, int TPR>
__device__ __forceinline__ void amp_flash_dq(const T* __restrict__ q, const T* __restrict__ k,
                                             const T* __restrict__ v, const T* __restrict__ dout,
                                             const float* __restrict__ lse, const float* __restrict__ delta,
                                             T* __restrict__ dq, int t, int dh, float scale, int causal,
                                             int heads, int group, const int* __restrict__ lengths) {
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
    const long long base = (long long)bh * t * dh, kv_base = (long long)(bh / group) * t * dh;
    const int nk = amp_flash_keys(lengths, bh, heads, t);
    const int r = threadIdx.x / TPR, j = threadIdx.x % TPR;
    const int row = qt * BR + r;
    amp_load_tile<T, D, BR, NT>(qs, q + base, qt * BR, t, dh);
    amp_load_tile<T, D, BR, NT>(dos, dout + base, qt * BR, t, dh);
    amp_load_stats<BR, NT>(lse_s, del_s, lse, delta, (long long)bh * t, qt * BR, t);
    float g[NO];
#pragma unroll
    for (int x = 0; x < NO; x++) g[x] = 0.0f;
    const int kv_tiles = amp_flash_kv_tiles<BR, BC>(qt, nk, causal);
    for (int kt = 0; kt < kv_tiles; kt++) {
        __syncthreads();  // the previous tile's K, V and dS are no longer read
        amp_load_tile<T, D, BC, NT>(ks, k + kv_base, kt * BC, nk, dh);
        amp_load_tile<T, D, BC, NT>(vs, v + kv_base, kt * BC, nk, dh);
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
            const float p = amp_flash_live(row, kt * BC + cc, t, nk, causal) ? expf(s[x] * scale - lse_s[r]) : 0.0f;
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
        const long long off = base + (long long)row * dh;
#pragma unroll
        for (int x = 0; x < NO; x++) {
            if (j + TPR * x < dh) dq[off + j + TPR * x] = amp_from_f32<T>(g[x] * scale);
        }
    }
}

// ---------------------------------------------------------------------------------- entry points
// X-macros, so that the emulator's harness builds its table of kernels from the same lists.
#define AMP_FLASH_TYPES(X, ...)                                                                        \
    X(float, f32, __VA_ARGS__)                                                                         \
    X(amp_f16, f16, __VA_ARGS__)                                                                       \
    X(amp_bf16, bf16, __VA_ARGS__)

// (head dim, config name, BR, BC, TPR): the large and the small tile of each head dimension
// (src/kernels/cuda/flash.rs's `tiles` repeats these numbers). The large tile is 32 x 32 up
// to D = 64 and 16 x 16 (8 lanes a row) above, where four 32-row tiles of D + 1 floats would
// pass 48 KiB of static shared memory.
#define AMP_FLASH_CONFIGS(X, ...)                                                                      \
    X(32, l, 32, 32, 4, __VA_ARGS__)                                                                   \
    X(32, s, 8, 8, 4, __VA_ARGS__)                                                                     \
    X(48, l, 32, 32, 4, __VA_ARGS__)                                                                   \
    X(48, s, 8, 8, 4, __VA_ARGS__)                                                                     \
    X(64, l, 32, 32, 4, __VA_ARGS__)                                                                   \
    X(64, s, 8, 8, 4, __VA_ARGS__)                                                                     \
    X(80, l, 16, 16, 8, __VA_ARGS__)                                                                   \
    X(80, s, 8, 8, 4, __VA_ARGS__)                                                                     \
    X(96, l, 16, 16, 8, __VA_ARGS__)                                                                   \
    X(96, s, 8, 8, 4, __VA_ARGS__)                                                                     \
    X(128, l, 16, 16, 8, __VA_ARGS__)                                                                  \
    X(128, s, 8, 8, 4, __VA_ARGS__)

// q and o of bh * t * d values (d: the head dimension, a multiple of 8 up to the kernel's D),
// k and v of bh / group * t * d; lse of bh * t; heads: query matrices per batch entry (a
// multiple of group), lengths: null or bh / heads ints.
#define AMP_FLASH_FWD_ARGS                                                                             \
    const void *q, const void *k, const void *v, void *o, float *lse, int bh, int t, int d, float scale, \
        int causal, int heads, int group, const int *lengths
#define AMP_FLASH_PRE_ARGS const void *o, const void *dout, float *delta, int rows, int d
// dqkv holds dq (bh * t * d values), dk and dv (bh / group * t * d each) one after the other:
// the dK/dV pass writes the last two, the dQ pass the first.
#define AMP_FLASH_BWD_ARGS                                                                             \
    const void *q, const void *k, const void *v, const void *dout, const float *lse, const float *delta, \
        void *dqkv, int bh, int t, int d, float scale, int causal, int heads, int group, const int *lengths

#define AMP_FLASH_DEFINE(T, nt, D, c, BR, BC, TPR)                                                     \
    extern "C" __global__ void amp_flash_fwd_##nt##_d##D##c(AMP_FLASH_FWD_ARGS) {                      \
        amp_flash_fwd<T, D, BR, BC, TPR>((const T*)q, (const T*)k, (const T*)v, (T*)o, lse, t, d,      \
                                         scale, causal, heads, group, lengths);                        \
    }                                                                                                  \
    extern "C" __global__ void amp_flash_bwd_dkv_##nt##_d##D##c(AMP_FLASH_BWD_ARGS) {                  \
        const long long n = (long long)bh * t * d, nkv = (long long)(bh / group) * t * d;              \
        amp_flash_dkv<T, D, BR, BC, TPR>((const T*)q, (const T*)k, (const T*)v, (const T*)dout, lse,   \
                                         delta, (T*)dqkv + n, (T*)dqkv + n + nkv, t, d, scale, causal, \
                                         heads, group, lengths);                                       \
    }                                                                                                  \
    extern "C" __global__ void amp_flash_bwd_dq_##nt##_d##D##c(AMP_FLASH_BWD_ARGS) {                   \
        amp_flash_dq<T, D, BR, BC, TPR>((const T*)q, (const T*)k, (const T*)v, (const T*)dout, lse,    \
                                        delta, (T*)dqkv, t, d, scale, causal, heads, group, lengths);  \
    }
#define AMP_FLASH_DEFINE_TYPES(D, c, BR, BC, TPR, _) AMP_FLASH_TYPES(AMP_FLASH_DEFINE, D, c, BR, BC, TPR)
AMP_FLASH_CONFIGS(AMP_FLASH_DEFINE_TYPES, _)

// Delta: one kernel per type, for every head dimension.
#define AMP_FLASH_DEFINE_PRE(T, nt, _)                                                                 \
    extern "C" __global__ void amp_flash_bwd_pre_##nt(AMP_FLASH_PRE_ARGS) {                            \
        amp_flash_pre<T>((const T*)o, (const T*)dout, delta, rows, d);                                 \
    }
AMP_FLASH_TYPES(AMP_FLASH_DEFINE_PRE, _)
