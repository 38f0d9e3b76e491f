// Runs src/kernels/cuda/multi_tensor.cu's kernels on the CPU grid emulator, for
// tests/cuda_multi_tensor.rs: one launch of the library's plan. The table is the plan's
// (little-endian u64 words) with arena offsets plus one in place of device pointers (0: none);
// the harness relocates them into the arena it loaded, launches, and writes the arena (and the
// flags) back.
//
//   multi_tensor_harness KERNEL GRID BLOCK CHUNK COUNT TABLE ARENA FLAGS MODE INV DIV
//
// ARENA and FLAGS (f32 values, `-` for the step kernels) are read and rewritten in place.
#include "emu.h"
#include "multi_tensor.cu"

#include "harness.h"

#include <cstring>

int main(int argc, char** argv) {
    if (argc != 12) {
        std::fprintf(stderr, "usage: see the comment at the top of multi_tensor_harness.cpp\n");
        return 2;
    }
    const std::string kernel = argv[1];
    const dim3 grid{(unsigned)std::atol(argv[2]), 1, 1}, block{(unsigned)std::atol(argv[3]), 1, 1};
    const long long chunk = std::atoll(argv[4]);
    const int count = std::atoi(argv[5]);
    std::vector<char> table_bytes = read_file(argv[6]);
    std::vector<char> arena = read_file(argv[7]);
    const bool unscale = kernel == "amp_mt_unscale_check";
    std::vector<char> flags = unscale ? read_file(argv[8]) : std::vector<char>();
    const int mode = std::atoi(argv[9]);
    const float inv = std::strtof(argv[10], nullptr);
    const double div = std::strtod(argv[11], nullptr);

    std::vector<int> pointers;
    if (unscale) {
        pointers = {0, 1, 2};
    } else if (kernel == "amp_mt_adamw") {
        pointers = {0, 1, 2, 3, 4, 5, 6};
    } else if (kernel == "amp_mt_sgd") {
        pointers = {0, 1, 2, 3, 6};
    } else {
        std::fprintf(stderr, "no kernel %s\n", kernel.c_str());
        return 2;
    }
    if (table_bytes.size() != (size_t)count * AMP_MT_RECORD * 8) {
        std::fprintf(stderr, "a table of %zu bytes for %d records\n", table_bytes.size(), count);
        return 2;
    }
    std::vector<unsigned long long> table((size_t)count * AMP_MT_RECORD);
    std::memcpy(table.data(), table_bytes.data(), table_bytes.size());
    const unsigned long long base = (unsigned long long)(uintptr_t)arena.data();
    for (int r = 0; r < count; r++) {
        for (int w : pointers) {
            unsigned long long& p = table[(size_t)r * AMP_MT_RECORD + w];
            if (p != 0) {
                if (p - 1 >= arena.size()) {
                    std::fprintf(stderr, "record %d word %d: offset %llu outside the arena\n", r, w, p - 1);
                    return 2;
                }
                p = base + (p - 1);
            }
        }
    }
    const unsigned long long* t = table.data();
    if (unscale) {
        float* f = (float*)flags.data();
        emu::launch(grid, block, [&] { amp_mt_unscale_check(t, count, chunk, f, mode, inv, div); });
        write_file(argv[8], flags);
    } else if (kernel == "amp_mt_adamw") {
        emu::launch(grid, block, [&] { amp_mt_adamw(t, count, chunk); });
    } else {
        emu::launch(grid, block, [&] { amp_mt_sgd(t, count, chunk); });
    }
    write_file(argv[7], arena);
    return 0;
}
