// Runs the kernels of src/kernels/cuda/rows.cu on the CPU grid emulator, for tests/cuda_rows.rs
// (the GELU passes take either form's kernels, erf or tanh):
// inputs and outputs as raw little-endian files (f32, or the 16-bit patterns of f16/bf16, each
// in the type its kernel's name gives), the kernels, grids and blocks as the library's launch
// plan gives them. Outputs start filled with a pattern, so a value a kernel fails to write
// shows as wrong.
//
//   rows_harness gelu_fwd KERNEL GRID BLOCK ROWS COLS RPC TILES H BIAS Y
//   rows_harness gelu_bwd KERNEL GRID BLOCK SUM SUM_GRID SUM_BLOCK ROWS COLS RPC TILES CHUNKS
//                H BIAS DY DH DBIAS|-        ('-': no bias gradient, a null scratch buffer)
//   rows_harness add KERNEL GRID BLOCK ROWS COLS RPC TILES BCAST A B OUT
//   rows_harness colsum PART GRID BLOCK SUM SUM_GRID SUM_BLOCK ROWS COLS RPC TILES CHUNKS G OUT
#include "emu.h"
#include "rows.cu"

#include "harness.h"

typedef void (*GeluFwdFn)(AMP_BIAS_GELU_FWD_ARGS);
typedef void (*GeluBwdFn)(AMP_BIAS_GELU_BWD_ARGS);
typedef void (*AddFn)(AMP_ADD_ARGS);
typedef void (*PartFn)(AMP_COLSUM_PART_ARGS);
typedef void (*SumFn)(AMP_COLSUM_SUM_ARGS);

#define GELU_FWD(TH, h, TB, b, TY, y)                                                                           \
    {"amp_bias_gelu_fwd_" #h "_" #b "_" #y, amp_bias_gelu_fwd_##h##_##b##_##y},                                 \
        {"amp_bias_gelu_tanh_fwd_" #h "_" #b "_" #y, amp_bias_gelu_tanh_fwd_##h##_##b##_##y},
#define GELU_BWD(TH, h, TB, b, TY, y)                                                                           \
    {"amp_bias_gelu_bwd_" #h "_" #b "_" #y, amp_bias_gelu_bwd_##h##_##b##_##y},                                 \
        {"amp_bias_gelu_tanh_bwd_" #h "_" #b "_" #y, amp_bias_gelu_tanh_bwd_##h##_##b##_##y},
#define ADD(TA, a, TB, b, TO, o) {"amp_add_" #a "_" #b "_" #o, amp_add_##a##_##b##_##o},
#define PART(T, t) {"amp_colsum_part_" #t, amp_colsum_part_##t},
#define SUM(T, t) {"amp_colsum_sum_" #t, amp_colsum_sum_##t},
static const std::map<std::string, GeluFwdFn> kGeluFwd = {AMP_BIAS_GELU_TYPES(GELU_FWD)};
static const std::map<std::string, GeluBwdFn> kGeluBwd = {AMP_BIAS_GELU_TYPES(GELU_BWD)};
static const std::map<std::string, AddFn> kAdd = {AMP_ADD_TYPES(ADD)};
static const std::map<std::string, PartFn> kPart = {AMP_ROWS_TYPES(PART)};
static const std::map<std::string, SumFn> kSum = {AMP_ROWS_TYPES(SUM)};

template <typename F>
static F find(const std::map<std::string, F>& m, const std::string& k) {
    auto it = m.find(k);
    if (it == m.end()) {
        std::fprintf(stderr, "no kernel %s\n", k.c_str());
        std::exit(2);
    }
    return it->second;
}

// The byte size of the type the kernel name's `from_end`-th last part names (1: the last).
static size_t type_bytes(const std::string& kernel, int from_end) {
    size_t end = kernel.size();
    for (int i = 1; i < from_end; i++) end = kernel.rfind('_', end - 1);
    const size_t start = kernel.rfind('_', end - 1) + 1;
    return kernel.compare(start, end - start, "f32") == 0 ? 4 : 2;
}

static dim3 d(const char* s) { return dim3{(unsigned)std::atol(s), 1, 1}; }
static int i(const char* s) { return std::atoi(s); }

int main(int argc, char** argv) {
    if (argc < 2) return 2;
    const std::string pass = argv[1];
    if (pass == "gelu_fwd" && argc == 12) {
        const std::string kernel = argv[2];
        const GeluFwdFn f = find(kGeluFwd, kernel);
        const int rows = i(argv[5]), cols = i(argv[6]), rpc = i(argv[7]), tiles = i(argv[8]);
        const std::vector<char> h = read_file(argv[9]), bias = read_file(argv[10]);
        std::vector<char> y((size_t)rows * cols * type_bytes(kernel, 1), (char)0x7f);
        emu::launch(d(argv[3]), d(argv[4]), [&] { f(h.data(), bias.data(), y.data(), rows, cols, rpc, tiles); });
        write_file(argv[11], y);
        return 0;
    }
    if (pass == "gelu_bwd" && argc == 18) {
        const std::string kernel = argv[2];
        const GeluBwdFn f = find(kGeluBwd, kernel);
        const SumFn sum = find(kSum, argv[5]);
        const int rows = i(argv[8]), cols = i(argv[9]), rpc = i(argv[10]), tiles = i(argv[11]);
        const int chunks = i(argv[12]);
        const std::vector<char> h = read_file(argv[13]), bias = read_file(argv[14]), dy = read_file(argv[15]);
        const bool want_bias = std::string(argv[17]) != "-";
        std::vector<char> dh((size_t)rows * cols * type_bytes(kernel, 3), (char)0x7f);
        std::vector<char> part(want_bias ? (size_t)chunks * cols * 4 : 0, (char)0x7f);
        float* pp = want_bias ? (float*)part.data() : nullptr;
        emu::launch(d(argv[3]), d(argv[4]),
                    [&] { f(h.data(), bias.data(), dy.data(), dh.data(), pp, rows, cols, rpc, tiles); });
        write_file(argv[16], dh);
        if (want_bias) {
            std::vector<char> db((size_t)cols * type_bytes(argv[5], 1), (char)0x7f);
            emu::launch(d(argv[6]), d(argv[7]), [&] { sum(pp, db.data(), cols, chunks); });
            write_file(argv[17], db);
        }
        return 0;
    }
    if (pass == "add" && argc == 13) {
        const std::string kernel = argv[2];
        const AddFn f = find(kAdd, kernel);
        const int rows = i(argv[5]), cols = i(argv[6]), rpc = i(argv[7]), tiles = i(argv[8]), bcast = i(argv[9]);
        const std::vector<char> a = read_file(argv[10]), b = read_file(argv[11]);
        std::vector<char> out((size_t)rows * cols * type_bytes(kernel, 1), (char)0x7f);
        emu::launch(d(argv[3]), d(argv[4]),
                    [&] { f(a.data(), b.data(), out.data(), rows, cols, rpc, tiles, bcast); });
        write_file(argv[12], out);
        return 0;
    }
    if (pass == "colsum" && argc == 15) {
        const PartFn part_fn = find(kPart, argv[2]);
        const SumFn sum = find(kSum, argv[5]);
        const int rows = i(argv[8]), cols = i(argv[9]), rpc = i(argv[10]), tiles = i(argv[11]);
        const int chunks = i(argv[12]);
        const std::vector<char> g = read_file(argv[13]);
        std::vector<char> part((size_t)chunks * cols * 4, (char)0x7f);
        std::vector<char> out((size_t)cols * type_bytes(argv[5], 1), (char)0x7f);
        emu::launch(d(argv[3]), d(argv[4]), [&] { part_fn(g.data(), (float*)part.data(), rows, cols, rpc, tiles); });
        emu::launch(d(argv[6]), d(argv[7]), [&] { sum((const float*)part.data(), out.data(), cols, chunks); });
        write_file(argv[14], out);
        return 0;
    }
    std::fprintf(stderr, "usage: see the comment at the top of rows_harness.cpp\n");
    return 2;
}
