// Runs one kernel of src/kernels/cuda/softmax.cu on the CPU grid emulator, for
// tests/cuda_kernels.rs: inputs and output as raw little-endian files (f32, or the 16-bit
// patterns of f16/bf16), the kernel, grid and block as the library's launch plan gives them.
//
//   softmax_harness fwd KERNEL GRID BLOCK ROWS COLS Q_LEN SCALE CAUSAL ROWS_PER_LEN X LENS|- Y
//   softmax_harness bwd KERNEL GRID BLOCK ROWS COLS SCALE Y DY DX
#include "emu.h"
#include "softmax.cu"

#include "harness.h"

typedef void (*FwdFn)(AMP_FWD_ARGS);
typedef void (*BwdFn)(AMP_BWD_ARGS);

#define FWD_W(TI, ni, TO, no, N) {"amp_softmax_fwd_w" #N "_" #ni "_" #no, amp_softmax_fwd_w##N##_##ni##_##no},
#define BWD_W(TI, ni, TO, no, N) {"amp_softmax_bwd_w" #N "_" #ni "_" #no, amp_softmax_bwd_w##N##_##ni##_##no},
#define FWD_WS(N, _) AMP_SOFTMAX_TYPES(FWD_W, N)
#define BWD_WS(N, _) AMP_SOFTMAX_TYPES(BWD_W, N)
#define FWD_B(TI, ni, TO, no, _) {"amp_softmax_fwd_b_" #ni "_" #no, amp_softmax_fwd_b_##ni##_##no},
#define BWD_B(TI, ni, TO, no, _) {"amp_softmax_bwd_b_" #ni "_" #no, amp_softmax_bwd_b_##ni##_##no},

static const std::map<std::string, FwdFn> kFwd = {AMP_SOFTMAX_WARP_SIZES(FWD_WS, _) AMP_SOFTMAX_TYPES(FWD_B, _)};
static const std::map<std::string, BwdFn> kBwd = {AMP_SOFTMAX_WARP_SIZES(BWD_WS, _) AMP_SOFTMAX_TYPES(BWD_B, _)};

// The output type is the kernel name's last part.
static size_t out_bytes(const std::string& kernel) {
    return kernel.size() > 4 && kernel.compare(kernel.size() - 4, 4, "_f32") == 0 ? 4 : 2;
}

int main(int argc, char** argv) {
    if (argc < 2) return 2;
    const std::string pass = argv[1];
    if (pass == "fwd" && argc == 14) {
        const std::string kernel = argv[2];
        auto it = kFwd.find(kernel);
        if (it == kFwd.end()) {
            std::fprintf(stderr, "no kernel %s\n", kernel.c_str());
            return 2;
        }
        const dim3 grid{(unsigned)std::atol(argv[3]), 1, 1}, block{(unsigned)std::atol(argv[4]), 1, 1};
        const int rows = std::atoi(argv[5]), cols = std::atoi(argv[6]), q_len = std::atoi(argv[7]);
        const float scale = std::strtof(argv[8], nullptr);
        const int causal = std::atoi(argv[9]), rows_per_len = std::atoi(argv[10]);
        const std::vector<char> x = read_file(argv[11]);
        std::vector<char> lens;
        if (std::string(argv[12]) != "-") lens = read_file(argv[12]);
        // Filled with a pattern, so an element the kernel fails to write shows as a wrong value.
        std::vector<char> y((size_t)rows * cols * out_bytes(kernel), (char)0x7f);
        const FwdFn f = it->second;
        const int* lp = lens.empty() ? nullptr : (const int*)lens.data();
        emu::launch(grid, block, [&] { f(x.data(), y.data(), rows, cols, q_len, scale, causal, lp, rows_per_len); });
        write_file(argv[13], y);
        return 0;
    }
    if (pass == "bwd" && argc == 11) {
        const std::string kernel = argv[2];
        auto it = kBwd.find(kernel);
        if (it == kBwd.end()) {
            std::fprintf(stderr, "no kernel %s\n", kernel.c_str());
            return 2;
        }
        const dim3 grid{(unsigned)std::atol(argv[3]), 1, 1}, block{(unsigned)std::atol(argv[4]), 1, 1};
        const int rows = std::atoi(argv[5]), cols = std::atoi(argv[6]);
        const float scale = std::strtof(argv[7], nullptr);
        const std::vector<char> y = read_file(argv[8]), dy = read_file(argv[9]);
        std::vector<char> dx((size_t)rows * cols * out_bytes(kernel), (char)0x7f);
        const BwdFn f = it->second;
        emu::launch(grid, block, [&] { f(y.data(), dy.data(), dx.data(), rows, cols, scale); });
        write_file(argv[10], dx);
        return 0;
    }
    std::fprintf(stderr, "usage: see the comment at the top of softmax_harness.cpp\n");
    return 2;
}
