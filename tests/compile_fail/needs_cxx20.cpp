// Compiled as C++17 (expect_compile_failure.cmake -DSTD=c++17): membound stops with one sentence.
#include "membound/membound.hpp"

int main() { return 0; }
