// The reserve of a plan on each allocator stack, at sizes from the example trainer's up to a few
// GiB: reserved peak / requested peak, as the shadow replay predicts it (test_reserve_plan shows
// the prediction equals the real stack's measured reserved peak to the byte), and what planning
// with the reserve costs in time (Google Benchmark).
//
//   ./build/release/bench/bench_reserve                       # the table, then the timings
//   ./build/release/bench/bench_reserve --benchmark_filter=xx # the table only
#include <benchmark/benchmark.h>

#include <cstdio>
#include <string>
#include <vector>

#include "membound/membound.hpp"

#include "benchmark_main.hpp"

namespace mb = membound;

namespace {

template <typename P>
using net = mb::hybrid_model<P>;

struct row {
  const char* name;
  std::size_t width, heads, seq, batch;
  std::vector<std::size_t> pattern;  // 0 ttt, 1 attn, 2 mamba
};

const std::vector<row> rows = {
    {"example default", 128, 4, 128, 4, {0, 1, 2, 1}},
    {"example --seq 1024 --width 256 --batch 2", 256, 4, 1024, 2, {0, 1, 2, 1}},
    {"8 blocks, width 512, seq 1024", 512, 8, 1024, 4, {0, 1, 2, 1, 0, 1, 2, 1}},
    {"12 blocks, width 1024, seq 2048", 1024, 16, 2048, 2, {1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2}},
};

using caching_stack = mb::budget_allocator<mb::caching_allocator<mb::system_allocator>>;
using arena_stack = mb::budget_allocator<mb::expandable_arena<mb::host_virtual_memory>>;

void table() {
  std::printf("%-42s %12s  %22s %22s %22s %22s\n", "model (schedule none, 2 threads)", "requested",
              "budget<caching<sys>>", "the same, planned", "arena, 2 MiB granule", "arena, 4 KiB granule");
  for (const row& r : rows) {
    mb::model_config c;
    c.vocab = 256;
    c.width = r.width;
    c.heads = r.heads;
    const net<mb::fp32_precision> m(c, r.pattern);
    mb::plan_options o;
    o.threads = 2;
    const mb::training_plan p = mb::make_plan(m, {r.batch, r.seq}, mb::schedules::none{}, o);
    const std::size_t budget = std::size_t{64} << 30;
    caching_stack caching(budget);
    mb::caching_options co;
    co.planned = true;
    caching_stack planned(budget, co);
    arena_stack arena2(budget, mb::expandable_arena_options{budget});
    arena_stack arena4(budget, mb::expandable_arena_options{budget}, mb::host_virtual_memory::page_size());
    auto cell = [&](std::size_t reserved) {
      char b[64];
      std::snprintf(b, sizeof b, "%s (%+.2f%%)", mb::format_bytes(reserved, false).c_str(),
                    100.0 * (static_cast<double>(reserved) / static_cast<double>(p.peak_bytes) - 1.0));
      return std::string(b);
    };
    std::printf("%-42s %12s  %22s %22s %22s %22s\n", r.name, mb::format_bytes(p.peak_bytes, false).c_str(),
                cell(mb::reserve_model(m, caching)(p)).c_str(), cell(mb::reserve_model(m, planned)(p)).c_str(),
                cell(mb::reserve_model(m, arena2)(p)).c_str(),
                cell(mb::reserve_model(m, arena4)(p)).c_str());
  }
  std::printf("\n");
}

// fit() over every micro-batch, schedule and chunk, on requested bytes vs on the arena's reserve.
void BM_fit(benchmark::State& state) {
  const row& r = rows[static_cast<std::size_t>(state.range(0))];
  mb::model_config c;
  c.vocab = 256;
  c.width = r.width;
  c.heads = r.heads;
  const net<mb::fp32_precision> m(c, r.pattern);
  const std::size_t budget = std::size_t{64} << 30;
  arena_stack arena(budget, mb::expandable_arena_options{budget}, mb::host_virtual_memory::page_size());
  mb::fit_options fo;
  fo.threads = 2;
  if (state.range(1) != 0) fo.reserve = mb::reserve_model(m, arena);
  for (auto _ : state) benchmark::DoNotOptimize(mb::fit(m, {r.batch, r.seq}, budget, fo));
  state.SetLabel(std::string(r.name) + (state.range(1) != 0 ? ", with the reserve" : ", requested only"));
}
BENCHMARK(BM_fit)->ArgsProduct({{0, 1, 2}, {0, 1}})->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) {
  // The flags are checked first; the table is worked out before the benchmarks run.
  return bench_flags::benchmark_main(argc, argv, [] { table(); });
}
