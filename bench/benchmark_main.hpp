// The main of the programs built on Google Benchmark, with the errors every membound program
// gives (bench_flags.hpp): its --benchmark_* flags go to it, and any other argument is one
// `error:` line naming it and exit 1, before any benchmark runs.
//
//   int main(int argc, char** argv) { return bench_flags::benchmark_main(argc, argv); }
#pragma once

#include <benchmark/benchmark.h>

#include <string>

#include "bench_flags.hpp"

namespace bench_flags {

// `before` runs after the flags are checked, before the benchmarks (e.g. a table of its own).
template <typename Before = void (*)()>
int benchmark_main(int argc, char** argv, Before&& before = [] {}) {
  return run([&] {
    benchmark::Initialize(&argc, argv);  // takes its own flags out of argv (--help exits there)
    if (argc > 1) {
      throw membound::invalid_argument(argv[1], "a Google Benchmark flag (--benchmark_filter=..., see --help)",
                                       "unknown", "Leave it out, or give it as --benchmark_NAME=VALUE");
    }
    before();
    benchmark::RunSpecifiedBenchmarks();
    benchmark::Shutdown();
    return 0;
  });
}

}  // namespace bench_flags
