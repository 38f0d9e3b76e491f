// What the fused kernels' .cu files share (softmax.cu, norm.cu, xent.cu include it): the half
// types as their 16-bit patterns, their conversions to and from f32 (PTX instructions on the
// device, the emulator's functions off it), and warp and block reductions. It includes no
// header, so NVRTC needs no toolkit headers on the user's machine; NVRTC gets it spliced in
// place of the include line (src/kernels/cuda/nvrtc.rs), nvcc and the emulator's g++ (-I
// src/kernels/cuda) include it.
//
// Not a .cu of its own: CI's nvcc/ptxas loop compiles it as part of each kernel file.
//
// Guarded: the emulator's flash harness compiles flash.cu and flash_mma.cu in one unit.
#ifndef AMP_PRELUDE_CUH
#define AMP_PRELUDE_CUH

struct amp_f16 {
    unsigned short bits;
};
struct amp_bf16 {
    unsigned short bits;
};

__device__ __forceinline__ float amp_to_f32(float v) { return v; }
__device__ __forceinline__ float amp_to_f32(amp_bf16 v) { return __uint_as_float(((unsigned int)v.bits) << 16); }
__device__ __forceinline__ float amp_to_f32(amp_f16 v) {
#ifdef __CUDA_ARCH__
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
    return f;
#else
    return amp_host_f16_to_f32(v.bits);
#endif
}

template <typename T> __device__ __forceinline__ T amp_from_f32(float v);
template <> __device__ __forceinline__ float amp_from_f32<float>(float v) { return v; }
// Round to nearest even, NaN kept quiet with its sign (the `half` crate's bf16::from_f32).
template <> __device__ __forceinline__ amp_bf16 amp_from_f32<amp_bf16>(float v) {
    unsigned int u = __float_as_uint(v);
    amp_bf16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        r.bits = (unsigned short)((u >> 16) | 0x0040u);
    } else {
        r.bits = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
    return r;
}
template <> __device__ __forceinline__ amp_f16 amp_from_f32<amp_f16>(float v) {
    amp_f16 r;
#ifdef __CUDA_ARCH__
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(v));
#else
    r.bits = amp_host_f32_to_f16(v);
#endif
    return r;
}

// -inf without <math.h> (NVRTC has no INFINITY macro without headers).
__device__ __forceinline__ float amp_neg_inf() { return __uint_as_float(0xff800000u); }
__device__ __forceinline__ float amp_nan() { return __uint_as_float(0x7fc00000u); }

// Butterfly reductions: every lane ends with the warp's result.
__device__ __forceinline__ float amp_warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float amp_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Block reductions (blockDim.x a multiple of 32, at most 1024): every thread gets the result.
// The first barrier keeps a warp from overwriting `red` while another still reads the previous
// reduction's values from it; the second publishes the per-warp values.
__device__ __forceinline__ float amp_block_max(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = amp_warp_max(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    return amp_warp_max(lane < warps ? red[lane] : amp_neg_inf());
}
__device__ __forceinline__ float amp_block_sum(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = amp_warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    return amp_warp_sum(lane < warps ? red[lane] : 0.0f);
}

#endif  // AMP_PRELUDE_CUH
