// What the emulator harnesses (*_harness.cpp) share: the standard headers they use and their
// raw little-endian files read and written whole (exit status 2 on an I/O error). Included
// after emu.h and the kernels' .cu.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

static std::vector<char> read_file(const char* path) {
    std::ifstream f(path, std::ios::binary);
    if (!f) {
        std::fprintf(stderr, "cannot read %s\n", path);
        std::exit(2);
    }
    return std::vector<char>(std::istreambuf_iterator<char>(f), {});
}

static void write_file(const char* path, const std::vector<char>& v) {
    std::ofstream f(path, std::ios::binary);
    f.write(v.data(), (std::streamsize)v.size());
    if (!f) {
        std::fprintf(stderr, "cannot write %s\n", path);
        std::exit(2);
    }
}
