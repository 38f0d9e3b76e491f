// flash.cu's attention on tensor cores, for f16 and bf16 on sm_80 and newer: the same passes
// (forward with online softmax and LSE; dK/dV per key tile; dQ per query tile; flash.cu's
// Delta kernel runs before the last two), the same masking (causal, key lengths), the same
// grouped key/value heads (read in place; dK/dV summed over the group in order) and the same
// fixed summation order per launch, with every product of two t x t x D shapes on
// `mma.sync.aligned.m16n8k16` (inputs in the half type, f32 accumulators). The softmax, the
// scaling and the masks stay in f32.
//
// Rounding, unlike flash.cu's FMA path: P (forward and backward) and dS are rounded to the
// inputs' half type before they multiply V, dO, Q or K, as FlashAttention-2 does (the row sums
// l of the forward are taken from the unrounded f32 P); Q, K, V and dO enter the products as
// stored. The hardware's summation order inside one mma is not specified: the tests bound the
// error against an f64 reference rather than compare bits.
//
// Work split (FlashAttention-2's): a warp owns 16 rows of the tile its block works on (query
// rows in the forward and the dQ pass, key rows in the dK/dV pass); its accumulators live in
// registers in the mma's C layout, and the probabilities it computes in that layout become the
// A operand of the next product without going through shared memory (C of two n-tiles of 8
// columns = A of one k-step of 16). Tiles in shared memory hold the 16-bit patterns, rows
// padded by 8 halves (16 bytes) so that the fragment loads of a warp's 8 row groups hit
// distinct banks. Fragments are loaded with plain 32-bit loads where the pair is contiguous
// in a row, two 16-bit loads where it runs down a column (no ldmatrix).
//
// Tiles (AMP_FLASH_MMA_CONFIGS) keep static shared memory under 48 KiB: forward 64 queries x
// 64 keys (Q fragments in registers, K and V in shared memory); dK/dV 64 keys per block, 64
// (D <= 64), 32 (D = 80, 96) or 16 (D = 128) queries per step; dQ 64 queries per block, as many
// keys per step. Head dimensions as flash.cu's: D = 32, 48, 64, 80, 96, 128 (multiples of 16,
// the mma's k), the tensors' d (a multiple of 8) an argument, columns d..D zeros in the tiles
// and in Q's fragments, never stored.
//
// The mma: amp_mma_16816 below, inline PTX under __CUDA_ARCH__. Off the device (the CPU
// emulator, tests/cuda_emu) it calls amp_emu_mma_16816 from tests/cuda_emu/mma.h, which
// implements the PTX ISA's documented fragment layout ("Matrix Fragments for mma.m16n8k16
// with floating point type") as a warp-collective; only a GPU run (tests/cuda_flash.rs under
// CANDLE_AMP_TEST_DEVICE=cuda) confirms that the hardware's layout is that one.
//
// Compiled by NVRTC for the device's own architecture: below sm_80 this file defines no
// kernel (the `mma` shape needs sm_80), and src/kernels/cuda/flash.rs's plan keeps flash.cu.

#include "prelude.cuh"

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800

// d += a * b on one 16 x 8 x 16 tile (the warp's 32 lanes together): a, b two 16-bit values per
// word, low half first; the fragment layouts are the PTX ISA's for m16n8k16 (see the top).
template <typename T> __device__ __forceinline__ void amp_mma_16816(float* d, const unsigned* a, const unsigned* b);
#if defined(__CUDA_ARCH__)
#define AMP_MMA_16816(T, ty)                                                                           \
    template <> __device__ __forceinline__ void amp_mma_16816<T>(float* d, const unsigned* a, const unsigned* b) { \
        asm("mma.sync.aligned.m16n8k16.row.col.f32." #ty "." #ty ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "  \
            "{%8,%9}, {%0,%1,%2,%3};"                                                                  \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                           \
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));                       \
    }
#else
#define AMP_MMA_16816(T, ty)                                                                           \
    template <> __device__ __forceinline__ void amp_mma_16816<T>(float* d, const unsigned* a, const unsigned* b) { \
        amp_emu_mma_16816<sizeof(#ty) == 5>(d, a, b); /* "bf16": bf16, "f16": f16 */                   \
    }
#endif
AMP_MMA_16816(amp_bf16, bf16)
AMP_MMA_16816(amp_f16, f16)

// Two 16-bit values into one word, the first in the low half (the fragments' element order).
__device__ __forceinline__ unsigned amp_pack(unsigned short lo, unsigned short hi) {
    return (unsigned)lo | ((unsigned)hi << 16);
}
// Two f32 values rounded to T, packed.
template <typename T> __device__ __forceinline__ unsigned amp_pack_f32(float lo, float hi) {
    return amp_pack(amp_from_f32<T>(lo).bits, amp_from_f32<T>(hi).bits);
}
// The pair p[0], p[1] of a shared tile (p at an even column of a row: 4-byte aligned).
__device__ __forceinline__ unsigned amp_ld_pair(const unsigned short* p) {
#if defined(__CUDA_ARCH__)
    return *reinterpret_cast<const unsigned*>(p);
#else
    unsigned u;
    std::memcpy(&u, p, 4);
    return u;
#endif
}

// 16 bytes (8 halves) as four words; 16-byte aligned wherever it is loaded or stored whole.
struct __attribute__((aligned(16))) amp_u4 {
    unsigned x, y, z, w;
};
__device__ __forceinline__ amp_u4 amp_ld_u4(const void* p) {
#if defined(__CUDA_ARCH__)
    return *reinterpret_cast<const amp_u4*>(p);
#else
    amp_u4 v;
    std::memcpy(&v, p, 16);
    return v;
#endif
}
__device__ __forceinline__ void amp_st_u4(void* p, amp_u4 v) {
#if defined(__CUDA_ARCH__)
    *reinterpret_cast<amp_u4*>(p) = v;
#else
    std::memcpy(p, &v, 16);
#endif
}

// Rows [row0, row0 + R) of a (t, dh) matrix (dh <= D, a multiple of 8) into a shared tile of
// rows of D + 8 halves (their 16-bit patterns; 16-byte aligned, as the rows' 2 D + 16 bytes keep
// every 8th column); rows past t and columns past dh are zeros. All NT threads of the block
// take part: 16 bytes per load where the matrix is 16-byte aligned (its rows are: 2 dh bytes),
// else 2 (a view at an odd offset).
template <typename T, int D, int R, int NT>
__device__ __forceinline__ void amp_load_half_tile(unsigned short (*dst)[D + 8], const T* __restrict__ src, int row0,
                                                   int t, int dh) {
    if ((reinterpret_cast<unsigned long long>(src) & 15ull) == 0) {
        constexpr int C = D / 8;
        for (int idx = threadIdx.x; idx < R * C; idx += NT) {
            const int r = idx / C, c = (idx - r * C) * 8;
            amp_u4 w = {0u, 0u, 0u, 0u};
            if (row0 + r < t && c < dh) w = amp_ld_u4(src + (long long)(row0 + r) * dh + c);
            amp_st_u4(&dst[r][c], w);
        }
    } else {
        for (int idx = threadIdx.x; idx < R * D; idx += NT) {
            const int r = idx / D, c = idx - r * D;
            dst[r][c] = row0 + r < t && c < dh ? src[(long long)(row0 + r) * dh + c].bits : (unsigned short)0;
        }
    }
}

// The A fragment of the 16 x 16 block of a shared tile at rows r0.., columns c0..: this
// lane's rows g and g + 8, columns 2 tg, 2 tg + 1 and those + 8 (g = lane / 4, tg = lane % 4).
template <int W>
__device__ __forceinline__ void amp_frag_a(unsigned* a, const unsigned short (*s)[W], int r0, int c0, int g, int tg) {
    a[0] = amp_ld_pair(&s[r0 + g][c0 + 2 * tg]);
    a[1] = amp_ld_pair(&s[r0 + g + 8][c0 + 2 * tg]);
    a[2] = amp_ld_pair(&s[r0 + g][c0 + 2 * tg + 8]);
    a[3] = amp_ld_pair(&s[r0 + g + 8][c0 + 2 * tg + 8]);
}
// The B fragment (k = 16 along a row, n = 8 rows) of B = X^T for a shared tile X (row n of X
// is column n of B): this lane's column g, rows 2 tg, 2 tg + 1 and those + 8, contiguous in X.
template <int W>
__device__ __forceinline__ void amp_frag_bt(unsigned* b, const unsigned short (*s)[W], int n0, int k0, int g, int tg) {
    b[0] = amp_ld_pair(&s[n0 + g][k0 + 2 * tg]);
    b[1] = amp_ld_pair(&s[n0 + g][k0 + 2 * tg + 8]);
}
// The B fragment (k = 16 rows, n = 8 columns) of B = X for a shared tile X: this lane's
// column g, rows 2 tg, 2 tg + 1 and those + 8, down a column of X (two 16-bit loads each).
template <int W>
__device__ __forceinline__ void amp_frag_b(unsigned* b, const unsigned short (*s)[W], int k0, int n0, int g, int tg) {
    b[0] = amp_pack(s[k0 + 2 * tg][n0 + g], s[k0 + 2 * tg + 1][n0 + g]);
    b[1] = amp_pack(s[k0 + 2 * tg + 8][n0 + g], s[k0 + 2 * tg + 9][n0 + g]);
}
// The A fragment of k-step kb from C fragments c (n-tiles 2 kb and 2 kb + 1) rounded to T.
template <typename T> __device__ __forceinline__ void amp_c_to_a(unsigned* a, const float* c0, const float* c1) {
    a[0] = amp_pack_f32<T>(c0[0], c0[1]);
    a[1] = amp_pack_f32<T>(c0[2], c0[3]);
    a[2] = amp_pack_f32<T>(c1[0], c1[1]);
    a[3] = amp_pack_f32<T>(c1[2], c1[3]);
}
// The exponentials are exp2 of scores pre-multiplied by log2(e) (one instruction on the device
// where expf is several; FlashAttention-2 does the same); LSE stays in natural-log units.
#define AMP_LOG2E 1.4426950408889634f
#define AMP_LN2 0.6931471805599453f
// Whether query `row` (of t) sees key `col` of the first nk (flash.cu's amp_flash_live).
__device__ __forceinline__ bool amp_mma_live(int row, int col, int t, int nk, int causal) {
    return row < t && col < nk && (!causal || col <= row);
}
// The keys query matrix m sees (flash.cu's amp_flash_keys): lengths[m / heads] in [0, t], or t.
__device__ __forceinline__ int amp_mma_keys(const int* __restrict__ lengths, int m, int heads, int t) {
    if (lengths == nullptr) return t;
    const int n = lengths[m / heads];
    return n < 0 ? 0 : n < t ? n : t;
}
// The key tiles of BC a query tile of BR reads (flash.cu's amp_flash_kv_tiles).
template <int BR, int BC>
__device__ __forceinline__ int amp_mma_kv_tiles(int qt, int nk, int causal) {
    int n = (nk + BC - 1) / BC;
    if (causal) {
        const int last = ((qt + 1) * BR - 1) / BC + 1;
        n = last < n ? last : n;
    }
    return n;
}
// Max and sum over the 4 lanes of a row group (lanes 4 g .. 4 g + 3 hold a C row's columns).
__device__ __forceinline__ float amp_quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float amp_quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Forward: one block of BR / 16 warps per (bh, tile of BR queries), key tiles of BC.
template <typename T, int D, int BR, int BC>
__device__ __forceinline__ void amp_flash_fwd_mma(const T* __restrict__ q, const T* __restrict__ k,
                                                  const T* __restrict__ v, T* __restrict__ o, float* __restrict__ lse,
                                                  int t, int dh, float scale, int causal, int heads, int group,
                                                  const int* __restrict__ lengths) {
    constexpr int NT = BR * 2, KD = D / 16, NS = BC / 8, NO = D / 8, KB = BC / 16;
    __shared__ __attribute__((aligned(16))) unsigned short ks[BC][D + 8];
    __shared__ __attribute__((aligned(16))) unsigned short vs[BC][D + 8];
    const int q_tiles = (t + BR - 1) / BR;
    // Causal: the last query tiles (the most keys) first, as flash.cu.
    const int bh = blockIdx.x / q_tiles, qt = q_tiles - 1 - (blockIdx.x - bh * q_tiles);
    const long long base = (long long)bh * t * dh, kv_base = (long long)(bh / group) * t * dh;
    const int nk = amp_mma_keys(lengths, bh, heads, t);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tg = lane & 3;
    // This lane's two query rows (of the C layout): g and g + 8 of the warp's 16.
    const int row0 = qt * BR + warp * 16 + g, row1 = row0 + 8;
    // Q's A fragments, straight from global memory (read once); rows past t are zeros.
    unsigned qa[KD][4];
    {
        const T* q0 = q + base + (long long)row0 * dh;
        const T* q1 = q + base + (long long)row1 * dh;
        const bool in0 = row0 < t, in1 = row1 < t;
#pragma unroll
        for (int kd = 0; kd < KD; kd++) {
            // Columns past dh zeros, not the next row's (inf * 0 = NaN against K's zero columns;
            // the last row's lie past the end); dh a multiple of 8: a pair is wholly in or out.
            const int c = kd * 16 + 2 * tg;
            const bool lo = kd * 16 < dh, hi = kd * 16 + 8 < dh;
            qa[kd][0] = in0 && lo ? amp_pack(q0[c].bits, q0[c + 1].bits) : 0u;
            qa[kd][1] = in1 && lo ? amp_pack(q1[c].bits, q1[c + 1].bits) : 0u;
            qa[kd][2] = in0 && hi ? amp_pack(q0[c + 8].bits, q0[c + 9].bits) : 0u;
            qa[kd][3] = in1 && hi ? amp_pack(q1[c + 8].bits, q1[c + 9].bits) : 0u;
        }
    }
    const float ninf = amp_neg_inf();
    const float scale2 = scale * AMP_LOG2E;
    const int wrow = qt * BR + warp * 16;  // the warp's first query row
    // Per row (0: g, 1: g + 8): running max (log2 units), this lane's share of the running sum.
    float m[2] = {ninf, ninf}, l[2] = {0.0f, 0.0f};
    float acc[NO][4];
#pragma unroll
    for (int n = 0; n < NO; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    const int kv_tiles = amp_mma_kv_tiles<BR, BC>(qt, nk, causal);
    for (int kt = 0; kt < kv_tiles; kt++) {
        __syncthreads();  // the previous tile's K and V are no longer read
        amp_load_half_tile<T, D, BC, NT>(ks, k + kv_base, kt * BC, nk, dh);
        amp_load_half_tile<T, D, BC, NT>(vs, v + kv_base, kt * BC, nk, dh);
        __syncthreads();
        float s[NS][4];
#pragma unroll
        for (int n = 0; n < NS; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
        for (int kd = 0; kd < KD; kd++) {
#pragma unroll
            for (int n = 0; n < NS; n++) {
                unsigned b[2];
                amp_frag_bt(b, ks, n * 8, kd * 16, g, tg);
                amp_mma_16816<T>(s[n], qa[kd], b);
            }
        }
        float mt[2] = {ninf, ninf};
        // The warp's 16 rows see every key of the tile (no mask to compute) or not.
        const bool full = wrow + 15 < t && (kt + 1) * BC <= nk && (!causal || (kt + 1) * BC - 1 <= wrow);
        if (full) {
#pragma unroll
            for (int n = 0; n < NS; n++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    s[n][e] *= scale2;
                    mt[e >> 1] = fmaxf(mt[e >> 1], s[n][e]);
                }
            }
        } else {
#pragma unroll
            for (int n = 0; n < NS; n++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int col = kt * BC + n * 8 + 2 * tg + (e & 1);
                    s[n][e] = amp_mma_live(e < 2 ? row0 : row1, col, t, nk, causal) ? s[n][e] * scale2 : ninf;
                    mt[e >> 1] = fmaxf(mt[e >> 1], s[n][e]);
                }
            }
        }
        float alpha[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const float mn = fmaxf(m[h], amp_quad_max(mt[h]));
            // As flash.cu: alpha = 0 on the first tile with a live key, 1 where nothing grew.
            alpha[h] = mn == m[h] ? 1.0f : exp2f(m[h] - mn);
            m[h] = mn;
            l[h] *= alpha[h];
        }
#pragma unroll
        for (int n = 0; n < NS; n++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float p = s[n][e] == ninf ? 0.0f : exp2f(s[n][e] - m[e >> 1]);
                s[n][e] = p;
                l[e >> 1] += p;  // the sum of the unrounded f32 P
            }
        }
#pragma unroll
        for (int n = 0; n < NO; n++) {
            acc[n][0] *= alpha[0];
            acc[n][1] *= alpha[0];
            acc[n][2] *= alpha[1];
            acc[n][3] *= alpha[1];
        }
        // O += P V, P rounded to T.
#pragma unroll
        for (int kb = 0; kb < KB; kb++) {
            unsigned pa[4];
            amp_c_to_a<T>(pa, s[2 * kb], s[2 * kb + 1]);
#pragma unroll
            for (int n = 0; n < NO; n++) {
                unsigned b[2];
                amp_frag_b(b, vs, kb * 16, n * 8, g, tg);
                amp_mma_16816<T>(acc[n], pa, b);
            }
        }
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int row = h == 0 ? row0 : row1;
        const float lsum = amp_quad_sum(l[h]);
        if (row < t) {
            T* orow = o + base + (long long)row * dh;
            // No live key (nk = 0): the output 0 (not 0 / 0), the LSE -inf.
            const float inv = nk > 0 ? 1.0f / lsum : 0.0f;
#pragma unroll
            for (int n = 0; n < NO; n++) {
                if (n * 8 >= dh) break;  // columns past dh (dh a multiple of 8)
                orow[n * 8 + 2 * tg] = amp_from_f32<T>(acc[n][2 * h] * inv);
                orow[n * 8 + 2 * tg + 1] = amp_from_f32<T>(acc[n][2 * h + 1] * inv);
            }
            if (tg == 0) lse[(long long)bh * t + row] = m[h] * AMP_LN2 + logf(lsum);
        }
    }
}

// dK and dV: one block of BC / 16 warps per (bh, tile of BC keys); query tiles of BR.
template <typename T, int D, int BR, int BC>
__device__ __forceinline__ void amp_flash_dkv_mma(const T* __restrict__ q, const T* __restrict__ k,
                                                  const T* __restrict__ v, const T* __restrict__ dout,
                                                  const float* __restrict__ lse, const float* __restrict__ delta,
                                                  T* __restrict__ dk, T* __restrict__ dv, int t, int dh, float scale,
                                                  int causal, int heads, int group, const int* __restrict__ lengths) {
    constexpr int NT = BC * 2, KD = D / 16, NQ = BR / 8, NO = D / 8, KB = BR / 16;
    __shared__ __attribute__((aligned(16))) unsigned short ks[BC][D + 8];
    __shared__ __attribute__((aligned(16))) unsigned short vs[BC][D + 8];
    __shared__ __attribute__((aligned(16))) unsigned short qs[BR][D + 8];
    __shared__ __attribute__((aligned(16))) unsigned short dos[BR][D + 8];
    __shared__ float lse_s[BR];
    __shared__ float del_s[BR];
    const int k_tiles = (t + BC - 1) / BC;
    // kvm: the key/value matrix, read by query matrices kvm * group + 0 .. group - 1 (one batch
    // entry: one key length).
    const int kvm = blockIdx.x / k_tiles, kt = blockIdx.x - kvm * k_tiles;
    const long long kv_base = (long long)kvm * t * dh;
    const int nk = amp_mma_keys(lengths, kvm * group, heads, t);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tg = lane & 3;
    const int kr = warp * 16;  // the warp's first key row in the tile
    const int col0 = kt * BC + kr + g, col1 = col0 + 8;  // this lane's key rows
    const float scale2 = scale * AMP_LOG2E;
    amp_load_half_tile<T, D, BC, NT>(ks, k + kv_base, kt * BC, nk, dh);
    amp_load_half_tile<T, D, BC, NT>(vs, v + kv_base, kt * BC, nk, dh);
    float gk[NO][4], gv[NO][4];
#pragma unroll
    for (int n = 0; n < NO; n++) {
#pragma unroll
        for (int e = 0; e < 4; e++) gk[n][e] = gv[n][e] = 0.0f;
    }
    // No query sees a tile wholly past the key length (its gradients stay 0).
    const int q_tiles = kt * BC < nk ? (t + BR - 1) / BR : 0;
    // The group's query matrices in order, and in each its query tiles: one fixed order.
    for (int hg = 0; hg < group; hg++) {
        const long long m = (long long)kvm * group + hg, base = m * t * dh;
        for (int qt = causal ? (kt * BC) / BR : 0; qt < q_tiles; qt++) {
            __syncthreads();  // the previous tile's Q, dO and statistics are no longer read
            amp_load_half_tile<T, D, BR, NT>(qs, q + base, qt * BR, t, dh);
            amp_load_half_tile<T, D, BR, NT>(dos, dout + base, qt * BR, t, dh);
            for (int i = threadIdx.x; i < BR; i += NT) {
                const bool in = qt * BR + i < t;
                lse_s[i] = in ? lse[m * t + qt * BR + i] * AMP_LOG2E : 0.0f;
                del_s[i] = in ? delta[m * t + qt * BR + i] : 0.0f;
            }
            __syncthreads();
            // S^T = K Q^T and dP^T = V dO^T for the warp's 16 keys x BR queries.
            float s[NQ][4], dp[NQ][4];
#pragma unroll
            for (int n = 0; n < NQ; n++) {
#pragma unroll
                for (int e = 0; e < 4; e++) s[n][e] = dp[n][e] = 0.0f;
            }
#pragma unroll
            for (int kd = 0; kd < KD; kd++) {
                unsigned ka[4], va[4];
                amp_frag_a(ka, ks, kr, kd * 16, g, tg);
                amp_frag_a(va, vs, kr, kd * 16, g, tg);
#pragma unroll
                for (int n = 0; n < NQ; n++) {
                    unsigned b[2];
                    amp_frag_bt(b, qs, n * 8, kd * 16, g, tg);
                    amp_mma_16816<T>(s[n], ka, b);
                    amp_frag_bt(b, dos, n * 8, kd * 16, g, tg);
                    amp_mma_16816<T>(dp[n], va, b);
                }
            }
            // P^T recomputed from the forward's LSE (masked entries exactly 0), dS^T = P^T (dP^T - Delta).
            // The warp's 16 keys are seen by every query of the tile (no mask to compute) or not.
            const int wkey = kt * BC + kr;
            const bool full = (qt + 1) * BR <= t && wkey + 15 < nk && (!causal || wkey + 15 <= qt * BR);
#pragma unroll
            for (int n = 0; n < NQ; n++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int i = n * 8 + 2 * tg + (e & 1);
                    const bool live = full || amp_mma_live(qt * BR + i, e < 2 ? col0 : col1, t, nk, causal);
                    const float p = live ? exp2f(s[n][e] * scale2 - lse_s[i]) : 0.0f;
                    s[n][e] = p;
                    dp[n][e] = p * (dp[n][e] - del_s[i]);
                }
            }
            // dV += P^T dO and dK += dS^T Q, P and dS rounded to T.
#pragma unroll
            for (int kb = 0; kb < KB; kb++) {
                unsigned pa[4], da[4];
                amp_c_to_a<T>(pa, s[2 * kb], s[2 * kb + 1]);
                amp_c_to_a<T>(da, dp[2 * kb], dp[2 * kb + 1]);
#pragma unroll
                for (int n = 0; n < NO; n++) {
                    unsigned b[2];
                    amp_frag_b(b, dos, kb * 16, n * 8, g, tg);
                    amp_mma_16816<T>(gv[n], pa, b);
                    amp_frag_b(b, qs, kb * 16, n * 8, g, tg);
                    amp_mma_16816<T>(gk[n], da, b);
                }
            }
        }
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int col = h == 0 ? col0 : col1;
        if (col < t) {
            const long long off = kv_base + (long long)col * dh;
#pragma unroll
            for (int n = 0; n < NO; n++) {
                if (n * 8 >= dh) break;
                const int c = n * 8 + 2 * tg;
                dk[off + c] = amp_from_f32<T>(gk[n][2 * h] * scale);
                dk[off + c + 1] = amp_from_f32<T>(gk[n][2 * h + 1] * scale);
                dv[off + c] = amp_from_f32<T>(gv[n][2 * h]);
                dv[off + c + 1] = amp_from_f32<T>(gv[n][2 * h + 1]);
            }
        }
    }
}

// dQ: one block of BR / 16 warps per (bh, tile of BR queries); key tiles of BC.
template <typename T, int D, int BR, int BC>
__device__ __forceinline__ void amp_flash_dq_mma(const T* __restrict__ q, const T* __restrict__ k,
                                                 const T* __restrict__ v, const T* __restrict__ dout,
                                                 const float* __restrict__ lse, const float* __restrict__ delta,
                                                 T* __restrict__ dq, int t, int dh, float scale, int causal,
                                                 int heads, int group, const int* __restrict__ lengths) {
    constexpr int NT = BR * 2, KD = D / 16, NK = BC / 8, NO = D / 8, KB = BC / 16;
    __shared__ __attribute__((aligned(16))) unsigned short qs[BR][D + 8];
    __shared__ __attribute__((aligned(16))) unsigned short dos[BR][D + 8];
    __shared__ __attribute__((aligned(16))) unsigned short ks[BC][D + 8];
    __shared__ __attribute__((aligned(16))) unsigned short vs[BC][D + 8];
    const int q_tiles = (t + BR - 1) / BR;
    const int bh = blockIdx.x / q_tiles, qt = q_tiles - 1 - (blockIdx.x - bh * q_tiles);
    const long long base = (long long)bh * t * dh, kv_base = (long long)(bh / group) * t * dh;
    const int nk = amp_mma_keys(lengths, bh, heads, t);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tg = lane & 3;
    const int qr = warp * 16;
    const int row0 = qt * BR + qr + g, row1 = row0 + 8;
    amp_load_half_tile<T, D, BR, NT>(qs, q + base, qt * BR, t, dh);
    amp_load_half_tile<T, D, BR, NT>(dos, dout + base, qt * BR, t, dh);
    const long long so = (long long)bh * t;
    // LSE in log2 units, as the exponent below takes it.
    const float lse0 = row0 < t ? lse[so + row0] * AMP_LOG2E : 0.0f;
    const float lse1 = row1 < t ? lse[so + row1] * AMP_LOG2E : 0.0f;
    const float scale2 = scale * AMP_LOG2E;
    const float del0 = row0 < t ? delta[so + row0] : 0.0f, del1 = row1 < t ? delta[so + row1] : 0.0f;
    float gq[NO][4];
#pragma unroll
    for (int n = 0; n < NO; n++) gq[n][0] = gq[n][1] = gq[n][2] = gq[n][3] = 0.0f;
    const int kv_tiles = amp_mma_kv_tiles<BR, BC>(qt, nk, causal);
    for (int kt = 0; kt < kv_tiles; kt++) {
        __syncthreads();  // the previous tile's K and V are no longer read
        amp_load_half_tile<T, D, BC, NT>(ks, k + kv_base, kt * BC, nk, dh);
        amp_load_half_tile<T, D, BC, NT>(vs, v + kv_base, kt * BC, nk, dh);
        __syncthreads();
        float s[NK][4], dp[NK][4];
#pragma unroll
        for (int n = 0; n < NK; n++) {
#pragma unroll
            for (int e = 0; e < 4; e++) s[n][e] = dp[n][e] = 0.0f;
        }
#pragma unroll
        for (int kd = 0; kd < KD; kd++) {
            unsigned qa[4], da[4];
            amp_frag_a(qa, qs, qr, kd * 16, g, tg);
            amp_frag_a(da, dos, qr, kd * 16, g, tg);
#pragma unroll
            for (int n = 0; n < NK; n++) {
                unsigned b[2];
                amp_frag_bt(b, ks, n * 8, kd * 16, g, tg);
                amp_mma_16816<T>(s[n], qa, b);
                amp_frag_bt(b, vs, n * 8, kd * 16, g, tg);
                amp_mma_16816<T>(dp[n], da, b);
            }
        }
        // The warp's 16 rows see every key of the tile (no mask to compute) or not.
        const int wrow = qt * BR + qr;
        const bool full = wrow + 15 < t && (kt + 1) * BC <= nk && (!causal || (kt + 1) * BC - 1 <= wrow);
#pragma unroll
        for (int n = 0; n < NK; n++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int col = kt * BC + n * 8 + 2 * tg + (e & 1);
                const bool live = full || amp_mma_live(e < 2 ? row0 : row1, col, t, nk, causal);
                const float p = live ? exp2f(s[n][e] * scale2 - (e < 2 ? lse0 : lse1)) : 0.0f;
                dp[n][e] = p * (dp[n][e] - (e < 2 ? del0 : del1));
            }
        }
        // dQ += dS K, dS rounded to T.
#pragma unroll
        for (int kb = 0; kb < KB; kb++) {
            unsigned da[4];
            amp_c_to_a<T>(da, dp[2 * kb], dp[2 * kb + 1]);
#pragma unroll
            for (int n = 0; n < NO; n++) {
                unsigned b[2];
                amp_frag_b(b, ks, kb * 16, n * 8, g, tg);
                amp_mma_16816<T>(gq[n], da, b);
            }
        }
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int row = h == 0 ? row0 : row1;
        if (row < t) {
            const long long off = base + (long long)row * dh;
#pragma unroll
            for (int n = 0; n < NO; n++) {
                if (n * 8 >= dh) break;
                const int c = n * 8 + 2 * tg;
                dq[off + c] = amp_from_f32<T>(gq[n][2 * h] * scale);
                dq[off + c + 1] = amp_from_f32<T>(gq[n][2 * h + 1] * scale);
            }
        }
    }
}

// ---------------------------------------------------------------------------------- entry points
// Arguments as flash.cu's (AMP_FLASH_FWD_ARGS, AMP_FLASH_BWD_ARGS, repeated here: one module
// does not see the other's macros on the device).
#define AMP_FLASH_MMA_TYPES(X, ...) X(amp_f16, f16, __VA_ARGS__) X(amp_bf16, bf16, __VA_ARGS__)

// (head dim, forward BR x BC, dK/dV BR x BC, dQ BR x BC). Threads per block: 2 x the tile's
// own rows (16 per warp): 128 in every pass, as src/kernels/cuda/flash.rs's plan launches.
#define AMP_FLASH_MMA_CONFIGS(X, ...)                                                                  \
    X(32, 64, 64, 64, 64, 64, 64, __VA_ARGS__)                                                         \
    X(48, 64, 64, 64, 64, 64, 64, __VA_ARGS__)                                                         \
    X(64, 64, 64, 64, 64, 64, 64, __VA_ARGS__)                                                         \
    X(80, 64, 64, 32, 64, 64, 32, __VA_ARGS__)                                                         \
    X(96, 64, 64, 32, 64, 64, 32, __VA_ARGS__)                                                         \
    X(128, 64, 64, 16, 64, 64, 16, __VA_ARGS__)

// The dQ pass at 4 blocks of 128 threads per SM (128 registers a thread): without the bound
// the key/value matrix's own offset (grouped heads) takes it to 164 registers at D = 64, 3
// blocks; with it ptxas fits 128 without spilling. The emulator has no such attribute.
#if defined(__CUDA_ARCH__)
#define AMP_FLASH_MMA_DQ_BOUNDS __launch_bounds__(128, 4)
#else
#define AMP_FLASH_MMA_DQ_BOUNDS
#endif

#define AMP_FLASH_MMA_FWD_ARGS                                                                         \
    const void *q, const void *k, const void *v, void *o, float *lse, int bh, int t, int d, float scale, \
        int causal, int heads, int group, const int *lengths
#define AMP_FLASH_MMA_BWD_ARGS                                                                         \
    const void *q, const void *k, const void *v, const void *dout, const float *lse, const float *delta, \
        void *dqkv, int bh, int t, int d, float scale, int causal, int heads, int group, const int *lengths

#define AMP_FLASH_MMA_DEFINE(T, nt, D, FR, FC, KR, KC, QR, QC)                                         \
    extern "C" __global__ void amp_flash_fwd_##nt##_d##D##m(AMP_FLASH_MMA_FWD_ARGS) {                  \
        amp_flash_fwd_mma<T, D, FR, FC>((const T*)q, (const T*)k, (const T*)v, (T*)o, lse, t, d, scale, \
                                        causal, heads, group, lengths);                                \
    }                                                                                                  \
    extern "C" __global__ void amp_flash_bwd_dkv_##nt##_d##D##m(AMP_FLASH_MMA_BWD_ARGS) {              \
        const long long n = (long long)bh * t * d, nkv = (long long)(bh / group) * t * d;              \
        amp_flash_dkv_mma<T, D, KR, KC>((const T*)q, (const T*)k, (const T*)v, (const T*)dout, lse,    \
                                        delta, (T*)dqkv + n, (T*)dqkv + n + nkv, t, d, scale, causal,  \
                                        heads, group, lengths);                                        \
    }                                                                                                  \
    extern "C" __global__ void AMP_FLASH_MMA_DQ_BOUNDS                                                 \
        amp_flash_bwd_dq_##nt##_d##D##m(AMP_FLASH_MMA_BWD_ARGS) {                                      \
        amp_flash_dq_mma<T, D, QR, QC>((const T*)q, (const T*)k, (const T*)v, (const T*)dout, lse,     \
                                       delta, (T*)dqkv, t, d, scale, causal, heads, group, lengths);   \
    }
#define AMP_FLASH_MMA_DEFINE_TYPES(D, FR, FC, KR, KC, QR, QC, _)                                       \
    AMP_FLASH_MMA_TYPES(AMP_FLASH_MMA_DEFINE, D, FR, FC, KR, KC, QR, QC)
AMP_FLASH_MMA_CONFIGS(AMP_FLASH_MMA_DEFINE_TYPES, _)

#endif  // sm_80 and newer, or the emulator
