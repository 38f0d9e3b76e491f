// The emulator's tensor-core instruction for src/kernels/cuda/flash_mma.cu: what
// `mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32` computes, as a
// warp-collective over emu.h's threads (included after emu.h, before the .cu; the .cu calls
// amp_emu_mma_16816 where __CUDA_ARCH__ is not defined).
//
// The fragment layout is the PTX ISA's, section "Matrix Fragments for mma.m16n8k16 with
// floating point type" (groupID = laneid >> 2, threadID_in_group = laneid % 4):
//   A (16 x 16, row): a0..a7 in 4 words, low half first; row = groupID for a0, a1, a4, a5 and
//     groupID + 8 for the others; col = threadID_in_group * 2 + (i & 1), + 8 for i >= 4.
//   B (16 x 8, col): b0..b3 in 2 words; row = threadID_in_group * 2 + (i & 1), + 8 for
//     i >= 2; col = groupID.
//   C, D (16 x 8, f32): c0..c3; row = groupID for i < 2, groupID + 8 otherwise;
//     col = threadID_in_group * 2 + (i & 1).
// This is the documented layout, implemented from the table; only a run on a GPU (the
// GPU-vs-CPU test of tests/cuda_flash.rs under CANDLE_AMP_TEST_DEVICE=cuda) confirms that the
// hardware distributes the elements the same way.
//
// Arithmetic: each product of two half values is exact in f32; the 16 products of an element
// are added in k order in f32, then added to c. The hardware's order and internal precision
// are not specified, so the tests compare with an f64 reference within a bound, not bits.
#pragma once

#include "emu.h"

namespace emu {
// One lane's operands, published to its warp.
struct MmaOperands {
    uint32_t a[4];
    uint32_t b[2];
};
// Two generations of slots, used in turn: a lane writes the next call's slot while a slower
// lane may still read the current one, and it can reach the same slot again only after every
// lane has arrived at the next call's barrier, i.e. finished reading (one barrier per mma).
inline MmaOperands g_mma[2][1024];
inline thread_local unsigned int t_mma_turn = 0;
}  // namespace emu

// A 16-bit pattern of a bf16 (BF16) or an f16 as f32 (exact).
template <bool BF16> inline float amp_emu_half(uint32_t bits) {
    bits &= 0xffffu;
    return BF16 ? __uint_as_float(bits << 16) : amp_host_f16_to_f32((unsigned short)bits);
}

// d += A * B for the warp's 16 x 8 x 16 tile, each lane passing its fragments (a: 4 words, b:
// 2 words, d: 4 floats), as the PTX instruction with c = d.
template <bool BF16> inline void amp_emu_mma_16816(float* d, const unsigned* a, const unsigned* b) {
    emu::Block& blk = *emu::g_block;
    const unsigned int me = emu::t_linear, warp = me / emu::kWarp, lane = me % emu::kWarp;
    emu::MmaOperands* slots = emu::g_mma[emu::t_mma_turn];
    emu::t_mma_turn ^= 1u;
    for (int i = 0; i < 4; i++) slots[me].a[i] = a[i];
    for (int i = 0; i < 2; i++) slots[me].b[i] = b[i];
    blk.warps[warp]->arrive_and_wait();  // every lane's operands are published
    const emu::MmaOperands* w = slots + warp * emu::kWarp;
    // Element (row, col) of A: lane (row % 8) * 4 + (col % 8) / 2, word (row >= 8) + 2 (col >= 8),
    // half col % 2. Element (k, n) of B: lane n * 4 + (k % 8) / 2, word k >= 8, half k % 2.
    auto a_at = [&](int row, int col) {
        const uint32_t word = w[(row % 8) * 4 + (col % 8) / 2].a[(row >= 8 ? 1 : 0) + (col >= 8 ? 2 : 0)];
        return amp_emu_half<BF16>(col % 2 ? word >> 16 : word);
    };
    auto b_at = [&](int kk, int n) {
        const uint32_t word = w[n * 4 + (kk % 8) / 2].b[kk >= 8 ? 1 : 0];
        return amp_emu_half<BF16>(kk % 2 ? word >> 16 : word);
    };
    const int g = (int)lane >> 2, tg = (int)lane & 3;
    for (int i = 0; i < 4; i++) {
        const int row = g + (i >= 2 ? 8 : 0), col = tg * 2 + (i & 1);
        float sum = 0.0f;
        for (int kk = 0; kk < 16; kk++) sum += a_at(row, kk) * b_at(kk, col);
        d[i] += sum;
    }
}
