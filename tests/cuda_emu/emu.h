// A CPU grid emulator for the library's CUDA C kernels (reference: cuda-kernels.md §7): the
// same .cu source, unmodified, compiled by g++ after this header and run block by block, one
// std::thread per CUDA thread of a block, so races and missing barriers show up as they would
// on a GPU (more often, with threads scheduled by the OS). Warps are 32 threads that meet at a
// per-warp barrier for each shuffle; __syncthreads is a per-block barrier. A thread that
// returns leaves both barriers (arrive_and_drop), as an exited GPU thread stops counting.
// What it cannot run: tensor-core instructions, cp.async, TMA, inline PTX (the .cu guards its
// `asm` with __CUDA_ARCH__ and calls the amp_host_* functions below instead).
#pragma once

#include <barrier>
#include <math.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

struct dim3 {
    unsigned int x = 1, y = 1, z = 1;
};

#define __global__
#define __device__
#define __forceinline__ inline
// Blocks run one at a time, so one static array per kernel is the running block's memory.
#define __shared__ static

namespace emu {
constexpr int kWarp = 32;

struct Block {
    std::unique_ptr<std::barrier<>> block;
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    // One exchange slot per thread for the shuffles.
    std::vector<uint64_t> slots;
};

inline Block* g_block = nullptr;
inline thread_local unsigned int t_linear = 0;
}  // namespace emu

inline dim3 gridDim, blockDim;
inline thread_local dim3 blockIdx, threadIdx;
constexpr int warpSize = emu::kWarp;

inline void __syncthreads() { emu::g_block->block->arrive_and_wait(); }

template <typename T>
inline T __shfl_xor_sync(unsigned int /*mask*/, T v, int lane_mask, int /*width*/ = emu::kWarp) {
    static_assert(sizeof(T) <= sizeof(uint64_t), "shuffle of a value wider than 8 bytes");
    emu::Block& b = *emu::g_block;
    const unsigned int me = emu::t_linear, warp = me / emu::kWarp, lane = me % emu::kWarp;
    uint64_t word = 0;
    std::memcpy(&word, &v, sizeof(T));
    b.slots[me] = word;
    b.warps[warp]->arrive_and_wait();  // every lane has written
    const uint64_t other = b.slots[warp * emu::kWarp + (lane ^ (unsigned)lane_mask)];
    b.warps[warp]->arrive_and_wait();  // every lane has read before the next shuffle writes
    T r;
    std::memcpy(&r, &other, sizeof(T));
    return r;
}

inline float __uint_as_float(unsigned int u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    std::memcpy(&u, &f, 4);
    return u;
}
// expf and fmaxf: the C library's (math.h), as CUDA's device functions of the same names.

// IEEE binary16 <-> binary32 by bits, round to nearest even (what cvt.rn.f16.f32 does).
inline float amp_host_f16_to_f32(unsigned short h) {
    const unsigned int sign = (unsigned int)(h & 0x8000u) << 16;
    const unsigned int exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    unsigned int u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);  // inf, NaN (payload kept)
    } else if (exp != 0) {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else {  // subnormal: value = man * 2^-24
        float f = (float)man * 5.9604644775390625e-8f;
        u = sign | __float_as_uint(f);
    }
    return __uint_as_float(u);
}
inline unsigned short amp_host_f32_to_f16(float f) {
    const unsigned int u = __float_as_uint(f);
    const unsigned int sign = (u >> 16) & 0x8000u;
    const unsigned int a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (unsigned short)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // NaN
    if (a >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);  // rounds to inf (>= 65520)
    if (a < 0x38800000u) {  // below 2^-14: subnormal or zero, man * 2^-24 rounded to even
        // Exact in float: a's value times 2^24 is below 2^10, and nearbyint rounds to even.
        const float scaled = __uint_as_float(a) * 16777216.0f;
        return (unsigned short)(sign | (unsigned int)std::nearbyint(scaled));
    }
    // Normal: rebias the exponent and round the 13 dropped bits to nearest even.
    const unsigned int r = a - 0x38000000u;  // exponent 127 -> 15
    const unsigned int rounded = r + 0xfffu + ((r >> 13) & 1u);
    return (unsigned short)(sign | (rounded >> 13));
}

namespace emu {
// Runs `kernel` over `grid` x `block` (x dimension only, as the library's kernels use):
// block after block, each on block.x threads started once and reused across blocks.
inline void launch(dim3 grid, dim3 block, const std::function<void()>& kernel) {
    gridDim = grid;
    blockDim = block;
    const unsigned int n = block.x;
    const unsigned int warps = (n + kWarp - 1) / kWarp;
    Block state;
    state.slots.assign(n, 0);
    g_block = &state;
    unsigned int current = 0;
    bool done = false;
    // The main thread meets the workers at `gate` before and after each block.
    std::barrier<> gate(n + 1);
    auto arm = [&] {
        state.block = std::make_unique<std::barrier<>>(n);
        state.warps.clear();
        for (unsigned int w = 0; w < warps; w++) {
            const unsigned int in_warp = (w + 1) * kWarp <= n ? kWarp : n - w * kWarp;
            state.warps.push_back(std::make_unique<std::barrier<>>(in_warp));
        }
    };
    std::vector<std::thread> threads;
    threads.reserve(n);
    for (unsigned int t = 0; t < n; t++) {
        threads.emplace_back([&, t] {
            t_linear = t;
            threadIdx = dim3{t, 0, 0};
            for (;;) {
                gate.arrive_and_wait();  // a block is armed (or the grid is done)
                if (done) return;
                blockIdx = dim3{current, 0, 0};
                kernel();
                // Leaving: the remaining threads' barriers stop waiting for this one.
                state.warps[t / kWarp]->arrive_and_drop();
                state.block->arrive_and_drop();
                gate.arrive_and_wait();  // the block is finished
            }
        });
    }
    for (current = 0; current < grid.x; current++) {
        arm();
        gate.arrive_and_wait();
        gate.arrive_and_wait();
    }
    done = true;
    gate.arrive_and_wait();
    for (auto& th : threads) th.join();
    g_block = nullptr;
}
}  // namespace emu
