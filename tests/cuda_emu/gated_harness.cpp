// Runs the kernels of src/kernels/cuda/gated.cu on the CPU grid emulator, for
// tests/cuda_gated.rs: inputs and outputs as raw little-endian files (f32, or the 16-bit
// patterns of f16/bf16, each in the type its kernel's name gives), the kernels, grids and
// blocks as the library's launch plan gives them. Outputs start filled with a pattern, so a
// value a kernel fails to write shows as wrong.
//
//   gated_harness gated_fwd KERNEL GRID BLOCK N G U Y
//   gated_harness gated_bwd KERNEL GRID BLOCK N G U DY DG DU
//   gated_harness act_fwd KERNEL GRID BLOCK N X Y
//   gated_harness act_bwd KERNEL GRID BLOCK N X DY DX
#include "emu.h"
#include "gated.cu"

#include "harness.h"

typedef void (*GatedFwdFn)(AMP_GATED_FWD_ARGS);
typedef void (*GatedBwdFn)(AMP_GATED_BWD_ARGS);
typedef void (*ActFwdFn)(AMP_ACT_FWD_ARGS);
typedef void (*ActBwdFn)(AMP_ACT_BWD_ARGS);

#define GATED_FWD(T, t, A, a, P, p, ACT, act)                                                                   \
    {"amp_gated_fwd_" #act "_" #t "_" #a "_" #p, amp_gated_fwd_##act##_##t##_##a##_##p},
#define GATED_BWD(T, t, A, a, P, p, ACT, act)                                                                   \
    {"amp_gated_bwd_" #act "_" #t "_" #a "_" #p, amp_gated_bwd_##act##_##t##_##a##_##p},
#define GATED_FWD_ACT(ACT, act, _) AMP_GATED_TYPES(GATED_FWD, ACT, act)
#define GATED_BWD_ACT(ACT, act, _) AMP_GATED_TYPES(GATED_BWD, ACT, act)
#define ACT_FWD(T, t, ACT, act) {"amp_act_fwd_" #act "_" #t, amp_act_fwd_##act##_##t},
#define ACT_BWD(T, t, ACT, act) {"amp_act_bwd_" #act "_" #t, amp_act_bwd_##act##_##t},
#define ACT_FWD_ACT(ACT, act, _) AMP_ACT_TYPES(ACT_FWD, ACT, act)
#define ACT_BWD_ACT(ACT, act, _) AMP_ACT_TYPES(ACT_BWD, ACT, act)
static const std::map<std::string, GatedFwdFn> kGatedFwd = {AMP_GLU_ACTS(GATED_FWD_ACT, _)};
static const std::map<std::string, GatedBwdFn> kGatedBwd = {AMP_GLU_ACTS(GATED_BWD_ACT, _)};
static const std::map<std::string, ActFwdFn> kActFwd = {AMP_GLU_ACTS(ACT_FWD_ACT, _)};
static const std::map<std::string, ActBwdFn> kActBwd = {AMP_GLU_ACTS(ACT_BWD_ACT, _)};

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

int main(int argc, char** argv) {
    if (argc < 6) return 2;
    const std::string pass = argv[1], kernel = argv[2];
    const dim3 grid = d(argv[3]), block = d(argv[4]);
    const long long n = std::atoll(argv[5]);
    if (pass == "gated_fwd" && argc == 9) {
        const GatedFwdFn f = find(kGatedFwd, kernel);
        const std::vector<char> g = read_file(argv[6]), u = read_file(argv[7]);
        std::vector<char> y((size_t)n * type_bytes(kernel, 1), (char)0x7f);
        emu::launch(grid, block, [&] { f(g.data(), u.data(), y.data(), n); });
        write_file(argv[8], y);
        return 0;
    }
    if (pass == "gated_bwd" && argc == 11) {
        const GatedBwdFn f = find(kGatedBwd, kernel);
        const std::vector<char> g = read_file(argv[6]), u = read_file(argv[7]), dy = read_file(argv[8]);
        std::vector<char> dg((size_t)n * type_bytes(kernel, 3), (char)0x7f), du(dg);
        emu::launch(grid, block, [&] { f(g.data(), u.data(), dy.data(), dg.data(), du.data(), n); });
        write_file(argv[9], dg);
        write_file(argv[10], du);
        return 0;
    }
    if (pass == "act_fwd" && argc == 8) {
        const ActFwdFn f = find(kActFwd, kernel);
        const std::vector<char> x = read_file(argv[6]);
        std::vector<char> y((size_t)n * type_bytes(kernel, 1), (char)0x7f);
        emu::launch(grid, block, [&] { f(x.data(), y.data(), n); });
        write_file(argv[7], y);
        return 0;
    }
    if (pass == "act_bwd" && argc == 9) {
        const ActBwdFn f = find(kActBwd, kernel);
        const std::vector<char> x = read_file(argv[6]), dy = read_file(argv[7]);
        std::vector<char> dx((size_t)n * type_bytes(kernel, 1), (char)0x7f);
        emu::launch(grid, block, [&] { f(x.data(), dy.data(), dx.data(), n); });
        write_file(argv[8], dx);
        return 0;
    }
    std::fprintf(stderr, "usage: see the comment at the top of gated_harness.cpp\n");
    return 2;
}
