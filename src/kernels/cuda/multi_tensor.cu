// The optimizer side in one launch over many tensors (Apex's multi_tensor_apply, PyTorch's
// fused AdamW): each kernel walks a table of per-tensor records in device memory, and each block
// takes one chunk of one tensor (the grid covers every (tensor, chunk) pair). The record of a
// block is found by a binary search over the records' `first_block` words (a few cached reads
// per block), so the table holds one record per tensor and nothing per block.
//
//   amp_mt_unscale_check: out = [acc +] unscale(raw) in f32 (raw f32, f16 or bf16), and the
//       tensor's flag set to NaN where a value written is inf or NaN (flags start at 0: the
//       caller zeroes them). The device path's `flag(g) = sum(g * 0)` of each master gradient,
//       one f32 per tensor.
//   amp_mt_adamw: the f32 parameter updated in place, the moments read from `m_in`/`v_in`
//       (null: zeros) and written to `m_out`/`v_out` (fresh buffers: the tensor path replaces its
//       moments each step, and snapshots share the old ones), the working copy (null: none)
//       written from the new parameter in its own type, all in one pass.
//   amp_mt_sgd: likewise for SGD with momentum, dampening, Nesterov and L2 weight decay.
//
// The arithmetic is the device path's tensor ops (candle's affine, binary and unary kernels):
// the same f32 operations in the same order, each rounded on its own (NVRTC gets --fmad=false),
// with the f64 hyper-parameters rounded to f32 by the host as candle's affine rounds its scalars.
// sqrtf and '/' are IEEE-rounded (NVRTC's default -prec-sqrt/-prec-div, as candle's nvcc build).
//
// A record is RECORD_WORDS (16) 64-bit words; the layouts are in multi_tensor.rs. Only
// prelude.cuh is included, so NVRTC needs no toolkit headers; the emulator (tests/cuda_emu)
// compiles this file unmodified.

#include "prelude.cuh"

#define AMP_MT_RECORD 16
#define AMP_MT_N 7
#define AMP_MT_FIRST 8
#define AMP_MT_TYPE 9

// The record of this block: the last one whose first block is at most blockIdx.x (records are
// in block order and each covers at least one block).
__device__ __forceinline__ const unsigned long long* amp_mt_record(const unsigned long long* table, int count) {
    int lo = 0, hi = count - 1;
    const unsigned long long b = blockIdx.x;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (table[(long long)mid * AMP_MT_RECORD + AMP_MT_FIRST] <= b) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    return table + (long long)lo * AMP_MT_RECORD;
}

// This block's range [*start, *end) of its tensor's values.
__device__ __forceinline__ void amp_mt_range(const unsigned long long* r, long long chunk, long long* start,
                                             long long* end) {
    const long long n = (long long)r[AMP_MT_N];
    const long long c = (long long)(blockIdx.x - r[AMP_MT_FIRST]);
    *start = c * chunk;
    *end = *start + chunk < n ? *start + chunk : n;
}

__device__ __forceinline__ float amp_mt_lo(unsigned long long w) { return __uint_as_float((unsigned int)w); }
__device__ __forceinline__ float amp_mt_hi(unsigned long long w) { return __uint_as_float((unsigned int)(w >> 32)); }
// inf or NaN, by the exponent bits (no dependence on the compiler's view of NaN compares).
__device__ __forceinline__ bool amp_mt_nonfinite(float v) { return (__float_as_uint(v) & 0x7f800000u) == 0x7f800000u; }

// A value of the type coded 0 (f32), 1 (f16) or 2 (bf16), at index i of `p`.
__device__ __forceinline__ float amp_mt_load(unsigned long long p, int type, long long i) {
    if (type == 1) return amp_to_f32(((const amp_f16*)p)[i]);
    if (type == 2) return amp_to_f32(((const amp_bf16*)p)[i]);
    return ((const float*)p)[i];
}
__device__ __forceinline__ void amp_mt_store(unsigned long long p, int type, long long i, float v) {
    if (type == 1) {
        ((amp_f16*)p)[i] = amp_from_f32<amp_f16>(v);
    } else if (type == 2) {
        ((amp_bf16*)p)[i] = amp_from_f32<amp_bf16>(v);
    } else {
        ((float*)p)[i] = v;
    }
}

// Unscale record: 0 raw, 1 acc (0: none), 2 out, 7 n, 8 first block, 9 raw type, 10 flag index.
// mode 0: identity; 1: g * inv in f32; 2: (float)((double)g / div) (the f32 inverse is not finite).
__device__ __forceinline__ void amp_mt_unscale_check_impl(const unsigned long long* table, int count, long long chunk,
                                                          float* flags, int mode, float inv, double div) {
    __shared__ float red[32];
    const unsigned long long* r = amp_mt_record(table, count);
    long long start, end;
    amp_mt_range(r, chunk, &start, &end);
    const unsigned long long raw = r[0], acc = r[1];
    float* out = (float*)r[2];
    const int type = (int)r[AMP_MT_TYPE];
    float bad = 0.0f;
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) {
        const float x = amp_mt_load(raw, type, i);
        float g = mode == 0 ? x : (mode == 1 ? x * inv : (float)((double)x / div));
        if (acc != 0ull) g = ((const float*)acc)[i] + g;
        out[i] = g;
        if (amp_mt_nonfinite(g)) bad = 1.0f;
    }
    // Every block of the tensor that saw one writes the same NaN: no order between blocks needed.
    bad = amp_block_sum(bad, red);
    if (threadIdx.x == 0 && bad != 0.0f) flags[r[10]] = amp_nan();
}

// AdamW record: 0 param (f32, in place), 1 grad (f32), 2 m_in, 3 v_in (0: zeros), 4 m_out,
// 5 v_out, 6 working (0: none), 7 n, 8 first block, 9 working type, 10 (b1, 1-b1), 11 (b2, 1-b2),
// 12 (1/bc1, 1/bc2), 13 (1 - lr*wd, lr), 14 (eps, -): pairs of f32 as (low, high) halves.
__device__ __forceinline__ void amp_mt_adamw_impl(const unsigned long long* table, int count, long long chunk) {
    const unsigned long long* r = amp_mt_record(table, count);
    long long start, end;
    amp_mt_range(r, chunk, &start, &end);
    float* p = (float*)r[0];
    const float* g = (const float*)r[1];
    const float* m_in = (const float*)r[2];
    const float* v_in = (const float*)r[3];
    float* m_out = (float*)r[4];
    float* v_out = (float*)r[5];
    const unsigned long long w = r[6];
    const int wt = (int)r[AMP_MT_TYPE];
    const float b1 = amp_mt_lo(r[10]), omb1 = amp_mt_hi(r[10]);
    const float b2 = amp_mt_lo(r[11]), omb2 = amp_mt_hi(r[11]);
    const float ibc1 = amp_mt_lo(r[12]), ibc2 = amp_mt_hi(r[12]);
    const float decay = amp_mt_lo(r[13]), lr = amp_mt_hi(r[13]);
    const float eps = amp_mt_lo(r[14]);
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) {
        const float gi = g[i];
        const float m = m_in ? m_in[i] : 0.0f, v = v_in ? v_in[i] : 0.0f;
        const float nm = m * b1 + gi * omb1;
        const float nv = v * b2 + (gi * gi) * omb2;
        m_out[i] = nm;
        v_out[i] = nv;
        const float mh = nm * ibc1, vh = nv * ibc2;
        const float np = p[i] * decay - (mh / (sqrtf(vh) + eps)) * lr;
        p[i] = np;
        if (w != 0ull) amp_mt_store(w, wt, i, np);
    }
}

// SGD record: 0 param (f32, in place), 1 grad (f32), 2 buf_in (0: the first step, the buffer
// starts as the direction), 3 buf_out (0: no momentum), 6 working (0: none), 7 n, 8 first block,
// 9 working type, 10 (lr, wd), 11 (momentum, 1 - dampening), 12 bit 0: Nesterov.
__device__ __forceinline__ void amp_mt_sgd_impl(const unsigned long long* table, int count, long long chunk) {
    const unsigned long long* r = amp_mt_record(table, count);
    long long start, end;
    amp_mt_range(r, chunk, &start, &end);
    float* p = (float*)r[0];
    const float* g = (const float*)r[1];
    const float* b_in = (const float*)r[2];
    float* b_out = (float*)r[3];
    const unsigned long long w = r[6];
    const int wt = (int)r[AMP_MT_TYPE];
    const float lr = amp_mt_lo(r[10]), wd = amp_mt_hi(r[10]);
    const float mom = amp_mt_lo(r[11]), omd = amp_mt_hi(r[11]);
    const bool nesterov = (r[12] & 1ull) != 0ull;
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) {
        const float pi = p[i];
        // The tensor path adds the decay only when it is not 0 (p * 0 would turn an inf into NaN).
        float d = wd != 0.0f ? g[i] + pi * wd : g[i];
        if (b_out) {
            const float nb = b_in ? b_in[i] * mom + d * omd : d;
            b_out[i] = nb;
            d = nesterov ? d + nb * mom : nb;
        }
        const float np = pi - d * lr;
        p[i] = np;
        if (w != 0ull) amp_mt_store(w, wt, i, np);
    }
}

// ---------------------------------------------------------------------------------- entry points
#define AMP_MT_UNSCALE_ARGS \
    const unsigned long long *table, int count, long long chunk, float *flags, int mode, float inv, double div
#define AMP_MT_STEP_ARGS const unsigned long long *table, int count, long long chunk

extern "C" __global__ void amp_mt_unscale_check(AMP_MT_UNSCALE_ARGS) {
    amp_mt_unscale_check_impl(table, count, chunk, flags, mode, inv, div);
}
extern "C" __global__ void amp_mt_adamw(AMP_MT_STEP_ARGS) { amp_mt_adamw_impl(table, count, chunk); }
extern "C" __global__ void amp_mt_sgd(AMP_MT_STEP_ARGS) { amp_mt_sgd_impl(table, count, chunk); }
