// Runs src/kernels/cuda/xent.cu's kernels on the CPU grid emulator, for tests/cuda_xent.rs:
// inputs and outputs as raw little-endian files (f32, the 16-bit patterns of f16/bf16, the
// targets' integers), kernels, grids and blocks as the library's launch plan gives them.
//
//   xent_harness fwd FWD GRID BLOCK MEAN_GRID MEAN_BLOCK ROWS COLS SCALE X TARGETS LOGP STATS LOSS
//   xent_harness bwd BWD GRID BLOCK ROWS COLS INV_ROWS X TARGETS STATS G DX
//   xent_harness rows ROWS_KERNEL GRID BLOCK ROWS COLS INV_N X TARGETS LOGP DX
#include "emu.h"
#include "xent.cu"

#include "harness.h"

typedef void (*FwdFn)(AMP_XENT_FWD_ARGS);
typedef void (*BwdFn)(AMP_XENT_BWD_ARGS);
typedef void (*RowsFn)(AMP_XENT_ROWS_ARGS);

#define FWD(T, nt, I, ni, _) {"amp_xent_fwd_" #nt "_" #ni, amp_xent_fwd_##nt##_##ni},
#define BWD(T, nt, I, ni, _) {"amp_xent_bwd_" #nt "_" #ni, amp_xent_bwd_##nt##_##ni},

static const std::map<std::string, FwdFn> kFwd = {AMP_XENT_TYPES(FWD, _)};
static const std::map<std::string, BwdFn> kBwd = {AMP_XENT_TYPES(BWD, _)};
#define ROWS(T, nt, I, ni, _) {"amp_xent_rows_" #nt "_" #ni, amp_xent_rows_##nt##_##ni},
static const std::map<std::string, RowsFn> kRows = {AMP_XENT_TYPES(ROWS, _)};

// The logits' type is the kernel name's part after "amp_xent_xxx_".
static size_t elem_bytes(const std::string& kernel) { return kernel.compare(13, 4, "f32_") == 0 ? 4 : 2; }

int main(int argc, char** argv) {
    if (argc < 2) return 2;
    const std::string pass = argv[1];
    if (pass == "fwd" && argc == 15) {
        auto it = kFwd.find(argv[2]);
        if (it == kFwd.end() || std::string(argv[5]).empty()) {
            std::fprintf(stderr, "no kernel %s\n", argv[2]);
            return 2;
        }
        const dim3 grid{(unsigned)std::atol(argv[3]), 1, 1}, block{(unsigned)std::atol(argv[4]), 1, 1};
        const dim3 mgrid{(unsigned)std::atol(argv[5]), 1, 1}, mblock{(unsigned)std::atol(argv[6]), 1, 1};
        const int rows = std::atoi(argv[7]), cols = std::atoi(argv[8]);
        const float scale = std::strtof(argv[9], nullptr);
        const std::vector<char> x = read_file(argv[10]), t = read_file(argv[11]);
        // Filled with a pattern, so a value the kernel fails to write shows as a wrong value.
        std::vector<char> logp((size_t)rows * 4, (char)0x7f), stats((size_t)rows * 8, (char)0x7f), loss(4, (char)0x7f);
        const FwdFn f = it->second;
        emu::launch(grid, block,
                    [&] { f(x.data(), t.data(), (float*)logp.data(), (float*)stats.data(), rows, cols); });
        emu::launch(mgrid, mblock, [&] { amp_xent_mean((const float*)logp.data(), (float*)loss.data(), rows, scale); });
        write_file(argv[12], logp);
        write_file(argv[13], stats);
        write_file(argv[14], loss);
        return 0;
    }
    if (pass == "bwd" && argc == 13) {
        const std::string kernel = argv[2];
        auto it = kBwd.find(kernel);
        if (it == kBwd.end()) {
            std::fprintf(stderr, "no kernel %s\n", kernel.c_str());
            return 2;
        }
        const dim3 grid{(unsigned)std::atol(argv[3]), 1, 1}, block{(unsigned)std::atol(argv[4]), 1, 1};
        const int rows = std::atoi(argv[5]), cols = std::atoi(argv[6]);
        const float inv_rows = std::strtof(argv[7], nullptr);
        const std::vector<char> x = read_file(argv[8]), t = read_file(argv[9]), stats = read_file(argv[10]),
                                g = read_file(argv[11]);
        std::vector<char> dx((size_t)rows * cols * elem_bytes(kernel), (char)0x7f);
        const BwdFn f = it->second;
        emu::launch(grid, block, [&] {
            f(x.data(), t.data(), (const float*)stats.data(), (const float*)g.data(), dx.data(), rows, cols, inv_rows);
        });
        write_file(argv[12], dx);
        return 0;
    }
    if (pass == "rows" && argc == 12) {
        const std::string kernel = argv[2];
        auto it = kRows.find(kernel);
        if (it == kRows.end()) {
            std::fprintf(stderr, "no kernel %s\n", kernel.c_str());
            return 2;
        }
        const dim3 grid{(unsigned)std::atol(argv[3]), 1, 1}, block{(unsigned)std::atol(argv[4]), 1, 1};
        const int rows = std::atoi(argv[5]), cols = std::atoi(argv[6]);
        const float inv_n = std::strtof(argv[7], nullptr);
        const std::vector<char> x = read_file(argv[8]), t = read_file(argv[9]);
        std::vector<char> logp((size_t)rows * 4, (char)0x7f);
        // "amp_xent_rows_" is one letter longer than the other kernels' prefix.
        const size_t eb = kernel.compare(14, 4, "f32_") == 0 ? 4 : 2;
        std::vector<char> dx((size_t)rows * cols * eb, (char)0x7f);
        const RowsFn f = it->second;
        emu::launch(grid, block,
                    [&] { f(x.data(), t.data(), (float*)logp.data(), dx.data(), rows, cols, inv_n); });
        write_file(argv[10], logp);
        write_file(argv[11], dx);
        return 0;
    }
    std::fprintf(stderr, "usage: see the comment at the top of xent_harness.cpp\n");
    return 2;
}
