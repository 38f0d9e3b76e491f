// Runs the kernels of src/kernels/cuda/embed.cu on the CPU grid emulator, for
// tests/cuda_embed.rs: the table, the output's gradient and the results as raw little-endian
// files in the type the kernel's name gives (f32, or the 16-bit patterns of f16/bf16), the ids
// as u32 or i64, the kernel, grid, block and row tiles as the library's launch plan gives
// them. The outputs start filled with a pattern, so a value the kernel fails to write shows as
// wrong; the backward's f32 accumulator too, and it is written out as well.
//
//   embed_harness fwd KERNEL GRID BLOCK N VOCAB WIDTH TABLE IDS OUT
//   embed_harness bwd KERNEL GRID BLOCK N VOCAB WIDTH ROWS_PER_TILE ROW_TILES IDS G OUT ACC
#include "emu.h"
#include "embed.cu"

#include "harness.h"

typedef void (*FwdFn)(AMP_EMBED_FWD_ARGS);
typedef void (*BwdFn)(AMP_EMBED_BWD_ARGS);

#define FWD(T, t, I, i) {"amp_embed_fwd_" #t "_" #i, amp_embed_fwd_##t##_##i},
#define BWD(T, t, I, i) {"amp_embed_bwd_" #t "_" #i, amp_embed_bwd_##t##_##i},
static const std::map<std::string, FwdFn> kFwd = {AMP_EMBED_TYPES(FWD)};
static const std::map<std::string, BwdFn> kBwd = {AMP_EMBED_TYPES(BWD)};

static dim3 d3(const char* s) { return dim3{(unsigned)std::atol(s), 1, 1}; }

static bool ends_with(const std::string& s, const char* tail) {
    const std::string t = tail;
    return s.size() >= t.size() && s.compare(s.size() - t.size(), t.size(), t) == 0;
}

int main(int argc, char** argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: see the comment at the top of embed_harness.cpp\n");
        return 2;
    }
    const std::string mode = argv[1];
    if ((mode == "fwd" && argc != 11) || (mode == "bwd" && argc != 14) || (mode != "fwd" && mode != "bwd")) {
        std::fprintf(stderr, "usage: see the comment at the top of embed_harness.cpp\n");
        return 2;
    }
    const std::string kernel = argv[2];
    const int n = std::atoi(argv[5]), vocab = std::atoi(argv[6]), width = std::atoi(argv[7]);
    const size_t ib = ends_with(kernel, "i64") ? 8 : 4;
    const size_t bytes = kernel.find("_f32_") != std::string::npos ? 4 : 2;
    if (mode == "fwd") {
        const auto it = kFwd.find(kernel);
        if (it == kFwd.end()) {
            std::fprintf(stderr, "no kernel %s\n", kernel.c_str());
            return 2;
        }
        const std::vector<char> table = read_file(argv[8]), ids = read_file(argv[9]);
        if (table.size() != (size_t)vocab * width * bytes || ids.size() != (size_t)n * ib) {
            std::fprintf(stderr, "input sizes do not match the shape\n");
            return 2;
        }
        std::vector<char> out((size_t)n * width * bytes, (char)0x7f);
        emu::launch(d3(argv[3]), d3(argv[4]),
                    [&] { it->second(table.data(), ids.data(), out.data(), n, vocab, width); });
        write_file(argv[10], out);
        return 0;
    }
    const auto it = kBwd.find(kernel);
    if (it == kBwd.end()) {
        std::fprintf(stderr, "no kernel %s\n", kernel.c_str());
        return 2;
    }
    const int rows_per_tile = std::atoi(argv[8]), row_tiles = std::atoi(argv[9]);
    const std::vector<char> ids = read_file(argv[10]), g = read_file(argv[11]);
    if (g.size() != (size_t)n * width * bytes || ids.size() != (size_t)n * ib) {
        std::fprintf(stderr, "input sizes do not match the shape\n");
        return 2;
    }
    std::vector<char> acc((size_t)vocab * width * 4, (char)0x7f);
    std::vector<char> out((size_t)vocab * width * bytes, (char)0x7f);
    // As the device glue: for f32 the accumulator is the output.
    void* dst = bytes == 4 ? (void*)acc.data() : (void*)out.data();
    emu::launch(d3(argv[3]), d3(argv[4]), [&] {
        it->second(ids.data(), g.data(), (float*)acc.data(), dst, n, vocab, width, rows_per_tile, row_tiles);
    });
    write_file(argv[12], bytes == 4 ? acc : out);
    write_file(argv[13], acc);
    return 0;
}
