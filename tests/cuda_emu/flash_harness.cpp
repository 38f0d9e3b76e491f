// Runs src/kernels/cuda/flash.cu's and flash_mma.cu's kernels on the CPU grid emulator (the
// tensor-core instruction from mma.h), for tests/cuda_flash.rs:
// inputs and outputs as raw little-endian files (f32, or the 16-bit patterns of f16/bf16; LSE
// and Delta f32), kernels, grids and blocks as the library's launch plan gives them.
//
//   flash_harness fwd FWD GRID BLOCK BH T D SCALE CAUSAL HEADS GROUP LENGTHS Q K V O LSE
//   flash_harness bwd PRE GRID BLOCK DKV GRID BLOCK DQ GRID BLOCK BH T D SCALE CAUSAL HEADS GROUP
//                     LENGTHS Q K V O DO LSE DQKV
//
// D: the tensors' head dimension (at most the kernel's own, which the name holds).
// HEADS: query matrices per batch entry; GROUP: query matrices per key/value matrix (K and V
// hold BH / GROUP); LENGTHS: a file of BH / HEADS little-endian int32 key lengths, or - for
// none (a null pointer).
//
// With AMP_EMU_MISALIGN=1 in the environment the inputs sit 2 bytes past a 16-byte boundary,
// as a view at an odd offset would (flash_mma.cu then loads its tiles 16 bits at a time).
//
// The backward runs the three kernels in order, as the library does: Delta, then dK and dV,
// then dQ, into one buffer of dq, dk, dv one after the other.
#include "emu.h"
#include "mma.h"
#include "flash.cu"
#include "flash_mma.cu"

#include "harness.h"

typedef void (*FwdFn)(AMP_FLASH_FWD_ARGS);
typedef void (*PreFn)(AMP_FLASH_PRE_ARGS);
typedef void (*BwdFn)(AMP_FLASH_BWD_ARGS);

#define FWD(T, nt, D, c, BR, BC, TPR) {"amp_flash_fwd_" #nt "_d" #D #c, amp_flash_fwd_##nt##_d##D##c},
#define DKV(T, nt, D, c, BR, BC, TPR) {"amp_flash_bwd_dkv_" #nt "_d" #D #c, amp_flash_bwd_dkv_##nt##_d##D##c},
#define DQ(T, nt, D, c, BR, BC, TPR) {"amp_flash_bwd_dq_" #nt "_d" #D #c, amp_flash_bwd_dq_##nt##_d##D##c},
#define FWDS(D, c, BR, BC, TPR, _) AMP_FLASH_TYPES(FWD, D, c, BR, BC, TPR)
#define DKVS(D, c, BR, BC, TPR, _) AMP_FLASH_TYPES(DKV, D, c, BR, BC, TPR)
#define DQS(D, c, BR, BC, TPR, _) AMP_FLASH_TYPES(DQ, D, c, BR, BC, TPR)
// The tensor-core kernels (names ending in "m"), in the same tables.
#define MFWD(T, nt, D, FR, FC, KR, KC, QR, QC) {"amp_flash_fwd_" #nt "_d" #D "m", amp_flash_fwd_##nt##_d##D##m},
#define MDKV(T, nt, D, FR, FC, KR, KC, QR, QC) {"amp_flash_bwd_dkv_" #nt "_d" #D "m", amp_flash_bwd_dkv_##nt##_d##D##m},
#define MDQ(T, nt, D, FR, FC, KR, KC, QR, QC) {"amp_flash_bwd_dq_" #nt "_d" #D "m", amp_flash_bwd_dq_##nt##_d##D##m},
#define MFWDS(D, FR, FC, KR, KC, QR, QC, _) AMP_FLASH_MMA_TYPES(MFWD, D, FR, FC, KR, KC, QR, QC)
#define MDKVS(D, FR, FC, KR, KC, QR, QC, _) AMP_FLASH_MMA_TYPES(MDKV, D, FR, FC, KR, KC, QR, QC)
#define MDQS(D, FR, FC, KR, KC, QR, QC, _) AMP_FLASH_MMA_TYPES(MDQ, D, FR, FC, KR, KC, QR, QC)
#define PRE(T, nt, _) {"amp_flash_bwd_pre_" #nt, amp_flash_bwd_pre_##nt},

static const std::map<std::string, FwdFn> kFwd = {AMP_FLASH_CONFIGS(FWDS, _) AMP_FLASH_MMA_CONFIGS(MFWDS, _)};
static const std::map<std::string, BwdFn> kDkv = {AMP_FLASH_CONFIGS(DKVS, _) AMP_FLASH_MMA_CONFIGS(MDKVS, _)};
static const std::map<std::string, BwdFn> kDq = {AMP_FLASH_CONFIGS(DQS, _) AMP_FLASH_MMA_CONFIGS(MDQS, _)};
static const std::map<std::string, PreFn> kPre = {AMP_FLASH_TYPES(PRE, _)};

template <typename F> static F find(const std::map<std::string, F>& m, const char* name) {
    auto it = m.find(name);
    if (it == m.end()) {
        std::fprintf(stderr, "no kernel %s\n", name);
        std::exit(2);
    }
    return it->second;
}

// Where the kernels read `v` from: its own buffer, or a copy 2 bytes past an aligned start
// (kept alive in `keep`) under AMP_EMU_MISALIGN=1.
static const char* place(const std::vector<char>& v, std::vector<std::vector<char>>& keep) {
    const char* env = std::getenv("AMP_EMU_MISALIGN");
    if (env == nullptr || std::string(env) != "1") return v.data();
    keep.emplace_back(v.size() + 16);
    char* p = keep.back().data();
    p += (16 - (reinterpret_cast<uintptr_t>(p) & 15)) % 16 + 2;
    std::memcpy(p, v.data(), v.size());
    return p;
}

static dim3 dim(const char* s) { return dim3{(unsigned)std::atol(s), 1, 1}; }

// Bytes past the end of each output, filled with the fill pattern: a kernel that writes past
// its output (a head dimension's padded columns stored) fails the run.
static constexpr size_t kGuard = 4096;

// Writes `v` without its guard to `path`, or exits with status 3 if the guard was written.
static void write_guarded(const char* path, std::vector<char>& v, const char* what) {
    for (size_t i = v.size() - kGuard; i < v.size(); i++) {
        if (v[i] != (char)0x7f) {
            std::fprintf(stderr, "%s: written past its end (byte %zu)\n", what, i);
            std::exit(3);
        }
    }
    v.resize(v.size() - kGuard);
    write_file(path, v);
}

// The key lengths named by `arg` (a file of int32) in `keep`, or null for "-".
static const int* lengths(const char* arg, std::vector<char>& keep) {
    if (std::string(arg) == "-") return nullptr;
    keep = read_file(arg);
    return reinterpret_cast<const int*>(keep.data());
}

int main(int argc, char** argv) {
    if (argc < 2) return 2;
    const std::string pass = argv[1];
    if (pass == "fwd" && argc == 18) {
        const FwdFn f = find(kFwd, argv[2]);
        const dim3 grid = dim(argv[3]), block = dim(argv[4]);
        const int bh = std::atoi(argv[5]), t = std::atoi(argv[6]), d = std::atoi(argv[7]);
        const float scale = std::strtof(argv[8], nullptr);
        const int causal = std::atoi(argv[9]), heads = std::atoi(argv[10]), group = std::atoi(argv[11]);
        std::vector<char> lens;
        const int* lens_p = lengths(argv[12], lens);
        const std::vector<char> q = read_file(argv[13]), k = read_file(argv[14]), v = read_file(argv[15]);
        // Filled with a pattern, so a value the kernel fails to write shows as a wrong value.
        std::vector<char> o(q.size() + kGuard, (char)0x7f), lse((size_t)bh * t * 4, (char)0x7f);
        float* lp = (float*)lse.data();
        std::vector<std::vector<char>> keep;
        keep.reserve(3);
        const char *qp = place(q, keep), *kp = place(k, keep), *vp = place(v, keep);
        emu::launch(grid, block, [&] {
            f(qp, kp, vp, o.data(), lp, bh, t, d, scale, causal, heads, group, lens_p);
        });
        write_guarded(argv[16], o, "o");
        write_file(argv[17], lse);
        return 0;
    }
    if (pass == "bwd" && argc == 26) {
        const PreFn pre = find(kPre, argv[2]);
        const BwdFn dkv = find(kDkv, argv[5]), dq = find(kDq, argv[8]);
        const int bh = std::atoi(argv[11]), t = std::atoi(argv[12]), d = std::atoi(argv[13]);
        const float scale = std::strtof(argv[14], nullptr);
        const int causal = std::atoi(argv[15]), heads = std::atoi(argv[16]), group = std::atoi(argv[17]);
        std::vector<char> lens;
        const int* lens_p = lengths(argv[18], lens);
        const std::vector<char> q = read_file(argv[19]), k = read_file(argv[20]), v = read_file(argv[21]);
        const std::vector<char> o = read_file(argv[22]), dout = read_file(argv[23]), lse = read_file(argv[24]);
        std::vector<float> delta((size_t)bh * t, 12345.0f);
        std::vector<char> dqkv(q.size() + 2 * k.size() + kGuard, (char)0x7f);
        const float* lp = (const float*)lse.data();
        std::vector<std::vector<char>> keep;
        keep.reserve(5);
        const char *qp = place(q, keep), *kp = place(k, keep), *vp = place(v, keep);
        const char *op = place(o, keep), *dp = place(dout, keep);
        emu::launch(dim(argv[3]), dim(argv[4]), [&] { pre(op, dp, delta.data(), bh * t, d); });
        emu::launch(dim(argv[6]), dim(argv[7]), [&] {
            dkv(qp, kp, vp, dp, lp, delta.data(), dqkv.data(), bh, t, d, scale, causal, heads, group, lens_p);
        });
        emu::launch(dim(argv[9]), dim(argv[10]), [&] {
            dq(qp, kp, vp, dp, lp, delta.data(), dqkv.data(), bh, t, d, scale, causal, heads, group, lens_p);
        });
        write_guarded(argv[25], dqkv, "dqkv");
        return 0;
    }
    std::fprintf(stderr, "usage: see the comment at the top of flash_harness.cpp\n");
    return 2;
}
