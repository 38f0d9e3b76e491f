// Runs the kernels of src/kernels/cuda/norm.cu on the CPU grid emulator, for
// tests/cuda_norm.rs: inputs and outputs as raw little-endian files (x and dy in x's type:
// f32, or the 16-bit patterns of f16/bf16; w, b, mean, rstd and the sums in f32), the kernels,
// grids and blocks as the library's launch plan gives them.
//
//   norm_harness fwd KERNEL GRID BLOCK ROWS COLS EPS CENTER X W B Y MEAN RSTD
//   norm_harness dx KERNEL GRID BLOCK ROWS COLS CENTER X DY W MEAN RSTD DX
//   norm_harness wb PART GRID BLOCK SUM_GRID SUM_BLOCK ROWS COLS ROWS_PER_CHUNK CHUNKS COL_TILES
//                X DY MEAN RSTD OUT
#include "emu.h"
#include "norm.cu"

#include "harness.h"

typedef void (*FwdFn)(AMP_NORM_FWD_ARGS);
typedef void (*DxFn)(AMP_NORM_DX_ARGS);
typedef void (*PartFn)(AMP_NORM_PART_ARGS);

#define FWD(T, t) {"amp_norm_fwd_" #t, amp_norm_fwd_##t},
#define DX(T, t) {"amp_norm_dx_" #t, amp_norm_dx_##t},
#define PART(T, t) {"amp_norm_wb_part_" #t, amp_norm_wb_part_##t},
static const std::map<std::string, FwdFn> kFwd = {AMP_NORM_TYPES(FWD)};
static const std::map<std::string, DxFn> kDx = {AMP_NORM_TYPES(DX)};
static const std::map<std::string, PartFn> kPart = {AMP_NORM_TYPES(PART)};

template <typename F>
static F find(const std::map<std::string, F>& m, const std::string& k) {
    auto it = m.find(k);
    if (it == m.end()) {
        std::fprintf(stderr, "no kernel %s\n", k.c_str());
        std::exit(2);
    }
    return it->second;
}

static size_t elem_bytes(const std::string& kernel) {
    return kernel.size() > 4 && kernel.compare(kernel.size() - 4, 4, "_f32") == 0 ? 4 : 2;
}

static dim3 d(const char* s) { return dim3{(unsigned)std::atol(s), 1, 1}; }

int main(int argc, char** argv) {
    if (argc < 2) return 2;
    const std::string pass = argv[1];
    // Outputs are filled with a pattern, so a value a kernel fails to write shows as wrong.
    if (pass == "fwd" && argc == 15) {
        const std::string kernel = argv[2];
        const FwdFn f = find(kFwd, kernel);
        const int rows = std::atoi(argv[5]), cols = std::atoi(argv[6]);
        const float eps = std::strtof(argv[7], nullptr);
        const int center = std::atoi(argv[8]);
        const std::vector<char> x = read_file(argv[9]), w = read_file(argv[10]), b = read_file(argv[11]);
        std::vector<char> y((size_t)rows * cols * elem_bytes(kernel), (char)0x7f);
        std::vector<char> mean((size_t)rows * 4, (char)0x7f), rstd((size_t)rows * 4, (char)0x7f);
        emu::launch(d(argv[3]), d(argv[4]), [&] {
            f(x.data(), y.data(), (const float*)w.data(), (const float*)b.data(), (float*)mean.data(),
              (float*)rstd.data(), rows, cols, eps, center);
        });
        write_file(argv[12], y);
        write_file(argv[13], mean);
        write_file(argv[14], rstd);
        return 0;
    }
    if (pass == "dx" && argc == 14) {
        const std::string kernel = argv[2];
        const DxFn f = find(kDx, kernel);
        const int rows = std::atoi(argv[5]), cols = std::atoi(argv[6]), center = std::atoi(argv[7]);
        const std::vector<char> x = read_file(argv[8]), dy = read_file(argv[9]), w = read_file(argv[10]);
        const std::vector<char> mean = read_file(argv[11]), rstd = read_file(argv[12]);
        std::vector<char> dx((size_t)rows * cols * elem_bytes(kernel), (char)0x7f);
        emu::launch(d(argv[3]), d(argv[4]), [&] {
            f(x.data(), dy.data(), (const float*)w.data(), (const float*)mean.data(), (const float*)rstd.data(),
              dx.data(), rows, cols, center);
        });
        write_file(argv[13], dx);
        return 0;
    }
    if (pass == "wb" && argc == 17) {
        const PartFn f = find(kPart, argv[2]);
        const int rows = std::atoi(argv[7]), cols = std::atoi(argv[8]);
        const int per_chunk = std::atoi(argv[9]), chunks = std::atoi(argv[10]), tiles = std::atoi(argv[11]);
        const std::vector<char> x = read_file(argv[12]), dy = read_file(argv[13]);
        const std::vector<char> mean = read_file(argv[14]), rstd = read_file(argv[15]);
        std::vector<float> part((size_t)chunks * 2 * cols, __uint_as_float(0x7fc00001u));
        std::vector<char> out((size_t)2 * cols * 4, (char)0x7f);
        emu::launch(d(argv[3]), d(argv[4]), [&] {
            f(x.data(), dy.data(), (const float*)mean.data(), (const float*)rstd.data(), part.data(), rows, cols,
              per_chunk, tiles);
        });
        emu::launch(d(argv[5]), d(argv[6]), [&] { amp_norm_wb_sum(part.data(), (float*)out.data(), cols, chunks); });
        write_file(argv[16], out);
        return 0;
    }
    std::fprintf(stderr, "usage: see the comment at the top of norm_harness.cpp\n");
    return 2;
}
