// How planning a planned caching stack scales with a step's micro-batches: the layout with every
// copy placed (make_layout over the flattened cycle) against one micro-batch's slots serving all
// (run_layout), and reserve_model's replay. A measurement, not a test; not built by CMake:
//
//   g++ -std=c++20 -O2 -I include -I tests/support -isystem /usr/include/eigen3 \
//       tools/planned_layout_time.cpp -o /tmp/planned_layout_time && /tmp/planned_layout_time
#include <chrono>
#include <cstdio>

#include "membound/membound.hpp"
#include "small_models.hpp"

namespace mb = membound;

int main() {
  using clock = std::chrono::steady_clock;
  const auto seconds = [](clock::time_point t0) { return std::chrono::duration<double>(clock::now() - t0).count(); };
  const membound_test::hybrid<mb::fp32_precision> m(membound_test::small_config());
  mb::caching_options co;
  co.planned = true;
  mb::budget_allocator<mb::caching_allocator<mb::system_allocator>> alloc(std::size_t{1} << 30, co);
  const auto reserve = mb::reserve_model(m, alloc);
  for (std::size_t A : {1024, 4096, 16384}) {
    mb::plan_options o;
    o.threads = 2;
    o.head_chunk = 16;
    o.accumulation = A;
    const mb::training_plan p = mb::make_plan(m, {2, 24}, mb::schedules::none{}, o);
    const mb::run_requests run = mb::record_run(m, p);
    double flat = -1;  // placing every copy is quadratic in the slots: skipped past 4096
    auto t0 = clock::now();
    if (A <= 4096) {
      (void)mb::make_layout(run.prefix, run.cycle());
      flat = seconds(t0);
    }
    t0 = clock::now();
    const mb::memory_layout shared = mb::run_layout(run);
    const double shared_s = seconds(t0);
    t0 = clock::now();
    const std::size_t reserved = reserve(p);
    std::printf("%6zu micro-batches: every copy placed %8.3f s (%zu slots); shared %.4f s (%zu slots); "
                "reserve_model %.3f s (%zu B)\n",
                A, flat, A * shared.repeat_slots + (shared.cycle.size() - shared.repeat_slots), shared_s,
                shared.cycle.size(), seconds(t0), reserved);
  }
}
