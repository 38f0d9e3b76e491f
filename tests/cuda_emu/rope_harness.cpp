// Runs the kernels of src/kernels/cuda/rope.cu on the CPU grid emulator, for tests/cuda_rope.rs:
// x (or the output's gradient) and the result as raw little-endian files in the type the
// kernel's name gives (f32, or the 16-bit patterns of f16/bf16), the tables as f32 files, the
// kernel, grid and block as the library's launch plan gives them. The output starts filled
// with a pattern, so a value the kernel fails to write shows as wrong.
//
//   rope_harness KERNEL GRID BLOCK ROWS T D X COS SIN OUT
#include "emu.h"
#include "rope.cu"

#include "harness.h"

typedef void (*RopeFn)(AMP_ROPE_ARGS);

#define ROPE(T, n)                                                                                              \
    {"amp_rope_halves_fwd_" #n, amp_rope_halves_fwd_##n}, {"amp_rope_halves_bwd_" #n, amp_rope_halves_bwd_##n}, \
        {"amp_rope_pairs_fwd_" #n, amp_rope_pairs_fwd_##n}, {"amp_rope_pairs_bwd_" #n, amp_rope_pairs_bwd_##n},
static const std::map<std::string, RopeFn> kRope = {AMP_ROPE_TYPES(ROPE)};

static dim3 d3(const char* s) { return dim3{(unsigned)std::atol(s), 1, 1}; }

int main(int argc, char** argv) {
    if (argc != 11) {
        std::fprintf(stderr, "usage: see the comment at the top of rope_harness.cpp\n");
        return 2;
    }
    const std::string kernel = argv[1];
    const auto it = kRope.find(kernel);
    if (it == kRope.end()) {
        std::fprintf(stderr, "no kernel %s\n", kernel.c_str());
        return 2;
    }
    const int rows = std::atoi(argv[4]), t = std::atoi(argv[5]), d = std::atoi(argv[6]);
    const size_t bytes = kernel.compare(kernel.size() - 3, 3, "f32") == 0 ? 4 : 2;
    const std::vector<char> x = read_file(argv[7]), cos_t = read_file(argv[8]), sin_t = read_file(argv[9]);
    if (x.size() != (size_t)rows * d * bytes || cos_t.size() != sin_t.size()) {
        std::fprintf(stderr, "input sizes do not match the shape\n");
        return 2;
    }
    std::vector<char> out(x.size(), (char)0x7f);
    emu::launch(d3(argv[2]), d3(argv[3]), [&] {
        it->second(x.data(), (const float*)cos_t.data(), (const float*)sin_t.data(), out.data(), rows, t, d);
    });
    write_file(argv[10], out);
    return 0;
}
