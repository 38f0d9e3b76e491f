// The embedding lookup, forward and backward, for a table (vocab, width) of f32, f16 or bf16
// and ids of u32 or i64 (src/kernels/cuda/embed.rs plans the launches):
//
//   forward   out[j, c] = table[ids[j], c]
//   backward  grad[r, c] = sum over j with ids[j] == r of g[j, c], summed in f32 in the order
//             of j (one rounding per add, as the CPU path's sum), rounded once to the table's
//             type; rows no id names get 0.
//
// Ids outside the table: an id equal to its type's largest value (u32::MAX, i64::MAX) gives a
// row of zeros and no gradient, as candle's CUDA index_select and index_add treat it (their
// padding id); any other id outside 0..vocab (negative, too large) gives a row of NaN and no
// gradient, where candle's kernels stop the device with an assert. Nothing is read out of
// bounds; the ids are never read on the host.
//
// Forward: memory-bound, one thread per output value in a grid-stride loop, so a warp reads a
// contiguous run of one table row and writes a contiguous run of the output.
// Backward, deterministic without atomics: the table's rows are cut into `row_tiles` tiles of
// `rows_per_tile` rows and its columns into tiles of blockDim.x; one block owns one (row
// tile, column tile) pair at a time, thread c of it the column c of every row of the tile.
// The block reads the ids in chunks of blockDim.x into shared memory (one coalesced load,
// converted to rows once), and each thread walks the chunk in order, adding g[j, c] into its
// f32 accumulator for row ids[j] where that row is in its tile. So every value of the
// gradient is summed by one thread, in the ids' order: the same bits on every run, whatever
// the grid. Parallelism is row_tiles * width threads (candle's index_add: width threads,
// each looping over every id); the price is that every block scans all the ids, from shared
// memory, a broadcast read per id. The f32 accumulator is the output itself for an f32 table;
// for a half table a scratch that each thread rounds into the output after its last id.
// Compiled at run time by NVRTC (embed_device.rs) and, unmodified, by g++ with the CPU grid
// emulator (tests/cuda_emu/emu.h). It includes only prelude.cuh (see softmax.cu).
//
// Kernels (extern "C"; {t} the table's type f32, f16 or bf16, {i} the ids' type u32 or i64):
//   amp_embed_fwd_{t}_{i}: out from the table and the ids.
//   amp_embed_bwd_{t}_{i}: the table's gradient from the ids and the output's gradient g.

#include "prelude.cuh"

// Rows the backward stages per chunk: the largest block the plan launches.
#define AMP_EMBED_CHUNK 128
// An id's row when it is its type's largest value (a zero row) or otherwise outside the table
// (a NaN row). The plan keeps vocab below 2^31, so no real row takes either value.
#define AMP_EMBED_ZERO 0xffffffffu
#define AMP_EMBED_BAD 0xfffffffeu

__device__ __forceinline__ unsigned int amp_embed_row(unsigned int id, unsigned int vocab) {
    if (id == 0xffffffffu) return AMP_EMBED_ZERO;
    return id < vocab ? id : AMP_EMBED_BAD;
}
__device__ __forceinline__ unsigned int amp_embed_row(long long id, unsigned int vocab) {
    if (id == 0x7fffffffffffffffLL) return AMP_EMBED_ZERO;
    return (id >= 0 && id < (long long)vocab) ? (unsigned int)id : AMP_EMBED_BAD;
}

// 32-bit unsigned indices (64-bit division is slow on a GPU): the plan keeps n * width and
// vocab * width within i32, and the grid's threads at 2^21, so k + stride never wraps.
template <typename T, typename I>
__device__ __forceinline__ void amp_embed_fwd(const T* __restrict__ table, const I* __restrict__ ids,
                                              T* __restrict__ out, int n, int vocab, int width) {
    const unsigned int w = (unsigned int)width, total = (unsigned int)n * w;
    const unsigned int stride = gridDim.x * blockDim.x;
    for (unsigned int k = blockIdx.x * blockDim.x + threadIdx.x; k < total; k += stride) {
        const unsigned int j = k / w, c = k - j * w;
        const unsigned int r = amp_embed_row(ids[j], (unsigned int)vocab);
        if (r < (unsigned int)vocab) {
            out[k] = table[r * w + c];
        } else {
            out[k] = amp_from_f32<T>(r == AMP_EMBED_ZERO ? 0.0f : amp_nan());
        }
    }
}

// `acc` and `out` are one buffer for an f32 table (so neither is __restrict__).
template <typename T, typename I>
__device__ __forceinline__ void amp_embed_bwd(const I* __restrict__ ids, const T* __restrict__ g, float* acc,
                                              T* out, int n, int vocab, int width, int rows_per_tile,
                                              int row_tiles) {
    __shared__ unsigned int rows[AMP_EMBED_CHUNK];
    const unsigned int w = (unsigned int)width, nn = (unsigned int)n, v = (unsigned int)vocab;
    const unsigned int col_tiles = (w + blockDim.x - 1) / blockDim.x;
    const unsigned int items = (unsigned int)row_tiles * col_tiles;
    // The item depends on the block only: every thread of a block meets the same barriers.
    for (unsigned int item = blockIdx.x; item < items; item += gridDim.x) {
        const unsigned int rt = item / col_tiles, ct = item - rt * col_tiles;
        const unsigned int c = ct * blockDim.x + threadIdx.x;
        const unsigned int r0 = rt * (unsigned int)rows_per_tile;
        const unsigned int r1 = r0 + (unsigned int)rows_per_tile < v ? r0 + (unsigned int)rows_per_tile : v;
        const bool mine = c < w;
        if (mine) {
            for (unsigned int r = r0; r < r1; ++r) acc[r * w + c] = 0.0f;
        }
        for (unsigned int j0 = 0; j0 < nn; j0 += blockDim.x) {
            const unsigned int count = nn - j0 < blockDim.x ? nn - j0 : blockDim.x;
            // Every thread has finished with the previous chunk before it is overwritten.
            __syncthreads();
            if (threadIdx.x < count) rows[threadIdx.x] = amp_embed_row(ids[j0 + threadIdx.x], v);
            __syncthreads();
            if (mine) {
                for (unsigned int k = 0; k < count; ++k) {
                    const unsigned int r = rows[k];
                    // r in [r0, r1), the sentinels never (unsigned wrap for r < r0).
                    if (r - r0 < r1 - r0) acc[r * w + c] += amp_to_f32(g[(j0 + k) * w + c]);
                }
            }
        }
        if (sizeof(T) != sizeof(float) && mine) {
            for (unsigned int r = r0; r < r1; ++r) out[r * w + c] = amp_from_f32<T>(acc[r * w + c]);
        }
    }
}

// ---------------------------------------------------------------------------------- entry points
#define AMP_EMBED_TYPES(X)                                                                                   \
    X(float, f32, unsigned int, u32)                                                                         \
    X(float, f32, long long, i64) X(amp_f16, f16, unsigned int, u32) X(amp_f16, f16, long long, i64)         \
        X(amp_bf16, bf16, unsigned int, u32) X(amp_bf16, bf16, long long, i64)

#define AMP_EMBED_FWD_ARGS const void *table, const void *ids, void *out, int n, int vocab, int width
#define AMP_EMBED_BWD_ARGS \
    const void *ids, const void *g, float *acc, void *out, int n, int vocab, int width, int rows_per_tile, int row_tiles

#define AMP_EMBED_DEFINE(T, t, I, i)                                                                          \
    extern "C" __global__ void amp_embed_fwd_##t##_##i(AMP_EMBED_FWD_ARGS) {                                  \
        amp_embed_fwd<T, I>((const T*)table, (const I*)ids, (T*)out, n, vocab, width);                       \
    }                                                                                                         \
    extern "C" __global__ void amp_embed_bwd_##t##_##i(AMP_EMBED_BWD_ARGS) {                                  \
        amp_embed_bwd<T, I>((const I*)ids, (const T*)g, acc, (T*)out, n, vocab, width, rows_per_tile, row_tiles); \
    }
AMP_EMBED_TYPES(AMP_EMBED_DEFINE)
