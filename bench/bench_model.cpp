// The planner's table on this machine: for three hybrid model shapes and every block-level
// schedule, the predicted peak, the measured peak (the budget allocator's peak of requested
// bytes, weights + gradients + AdamW state included) and the time of one training micro-step
// (forward, loss, backward; no optimizer), with the recompute overhead against `none` both as
// the planner's FLOP count and as measured time. One run, so every ratio compares measurements
// taken side by side; schedules are timed in turn, rep by rep, best of --reps.
//
//   shape A: 4 blocks (ttt_linear, attention, mamba, attention), C = 128, 4 heads, B = 4, T = 256
//   shape B: 8 blocks (the same pattern twice),                    C = 256, 8 heads, B = 2, T = 512
//   shape C: 12 blocks (the pattern three times),                  C = 128, 4 heads, B = 1, T = 1024
// vocab 256 (bytes), fp32, logit chunk 256. `budget` rows run the DP at the budget halfway between
// full's and none's peaks.
//
// Run: ./build/release/bench/bench_model [--threads N] [--reps N] [--quick]   (--quick: shape A only)
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench_flags.hpp"
#include "membound/membound.hpp"
#include "membound/model/planner.hpp"

namespace mb = membound;
using P = mb::fp32_precision;
using pattern1 = mb::model<mb::embedding<P>, mb::block<mb::ttt_linear<P>>, mb::block<mb::attention<P>>,
                           mb::block<mb::mamba<P>>, mb::block<mb::attention<P>>, mb::lm_head<P>>;
using pattern2 = mb::model<mb::embedding<P>, mb::block<mb::ttt_linear<P>>, mb::block<mb::attention<P>>,
                           mb::block<mb::mamba<P>>, mb::block<mb::attention<P>>,
                           mb::block<mb::ttt_linear<P>>, mb::block<mb::attention<P>>,
                           mb::block<mb::mamba<P>>, mb::block<mb::attention<P>>, mb::lm_head<P>>;
using pattern3 = mb::model<mb::embedding<P>, mb::block<mb::ttt_linear<P>>, mb::block<mb::attention<P>>,
                           mb::block<mb::mamba<P>>, mb::block<mb::attention<P>>,
                           mb::block<mb::ttt_linear<P>>, mb::block<mb::attention<P>>,
                           mb::block<mb::mamba<P>>, mb::block<mb::attention<P>>,
                           mb::block<mb::ttt_linear<P>>, mb::block<mb::attention<P>>,
                           mb::block<mb::mamba<P>>, mb::block<mb::attention<P>>, mb::lm_head<P>>;

namespace {

double mib(std::size_t b) { return static_cast<double>(b) / (1024.0 * 1024.0); }

template <typename Model>
void run_shape(const char* label, std::size_t width, std::size_t heads, mb::batch_shape b,
               std::size_t threads, int reps) {
  mb::model_config c;
  c.vocab = 256;
  c.width = width;
  c.heads = heads;
  const Model m(c);
  mb::plan_options o;
  o.threads = threads;
  o.head_chunk = 256;
  using K = mb::schedule_choice::kind;
  std::vector<mb::schedule_choice> sch{{K::none, 0}, {K::full, 0}, {K::every, 2}, {K::every, 4},
                                       {K::binomial, 1}, {K::binomial, 2}, {K::binomial, 3}};
  const auto none_plan = mb::make_plan(m, b, sch[0], o);
  const auto full_plan = mb::make_plan(m, b, sch[1], o);
  sch.push_back({K::budget, (none_plan.peak_bytes + full_plan.peak_bytes) / 2});
  std::vector<mb::training_plan> plans;
  for (const auto& s : sch) plans.push_back(mb::make_plan(m, b, s, o));

  std::vector<std::int32_t> tok(b.tokens()), tgt(b.tokens());
  std::uint32_t r = 1;
  for (std::size_t i = 0; i < tok.size(); ++i) {
    r = r * 1664525u + 1013904223u;
    tok[i] = static_cast<std::int32_t>((r >> 8) % 256);
    tgt[i] = static_cast<std::int32_t>((r >> 16) % 256);
  }
  mb::thread_pool pool(threads);
  std::vector<double> best(plans.size(), 1e300);
  std::vector<std::size_t> measured(plans.size(), 0);
  for (int rep = 0; rep <= reps; ++rep) {  // rep 0 warms up
    for (std::size_t k = 0; k < plans.size(); ++k) {
      const auto& p = plans[k];
      mb::budget_allocator<mb::system_allocator> alloc(std::size_t{1} << 40);
      float* w = static_cast<float*>(alloc.allocate(m.weight_bytes(), mb::default_alignment, mb::memory_tag::weights));
      float* g = static_cast<float*>(alloc.allocate(m.weight_bytes(), mb::default_alignment, mb::memory_tag::gradients));
      void* opt = alloc.allocate(p.optimizer, mb::default_alignment, mb::memory_tag::optimizer);
      m.init_weights(w, 1);
      std::memset(static_cast<void*>(g), 0, m.weight_bytes());
      const auto t0 = std::chrono::steady_clock::now();
      m.forward_backward(w, g, tok.data(), tgt.data(), p.micro, p.ops, p.head_chunk, 1.0, alloc, pool);
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (rep > 0) best[k] = std::min(best[k], ms);
      measured[k] = alloc.stats().peak_requested;
      alloc.deallocate(opt, p.optimizer, mb::default_alignment, mb::memory_tag::optimizer);
      alloc.deallocate(g, m.weight_bytes(), mb::default_alignment, mb::memory_tag::gradients);
      alloc.deallocate(w, m.weight_bytes(), mb::default_alignment, mb::memory_tag::weights);
    }
  }
  std::printf("\n%s: %zu blocks, C = %zu, %zu heads, B = %zu, T = %zu, %zu params, persistent %.1f MiB\n\n",
              label, m.depth(), width, heads, b.batch, b.seq, m.parameter_count(),
              mib(none_plan.weights + none_plan.gradients + none_plan.optimizer));
  std::printf("| schedule | predicted MiB | measured MiB | measured = predicted | kept MiB | ms | recompute FLOPs | time vs none |\n");
  std::printf("|---|--:|--:|:-:|--:|--:|--:|--:|\n");
  for (std::size_t k = 0; k < plans.size(); ++k) {
    const auto& p = plans[k];
    std::printf("| %s | %.2f | %.2f | %s | %.2f | %.1f | +%.1f%% | %.2fx |\n", p.schedule.name().c_str(),
                mib(p.peak_bytes), mib(measured[k]), measured[k] == p.peak_bytes ? "yes" : "NO",
                mib(p.activations), best[k], 100.0 * p.recompute_overhead(), best[k] / best[0]);
  }
}

}  // namespace

static int bench_main(int argc, char** argv) {
  std::size_t threads = 2;
  int reps = 3;
  bool quick = false;
  bench_flags::args a(argc, argv, "usage: bench_model [--threads N] [--reps N] [--quick]");
  while (a.next()) {
    if (a.is("--threads")) threads = static_cast<std::size_t>(a.whole(1, 1024));
    else if (a.is("--reps")) reps = static_cast<int>(a.whole(1, 1000000));
    else if (a.is("--quick")) quick = true;
    else a.unknown();
  }
  std::printf("bench_model: %zu threads, best of %d\n", threads, reps);
  run_shape<pattern1>("shape A", 128, 4, {4, 256}, threads, reps);
  if (!quick) {
    run_shape<pattern2>("shape B", 256, 8, {2, 512}, threads, reps);
    run_shape<pattern3>("shape C", 128, 4, {1, 1024}, threads, reps);
  }
  return 0;
}

// Any error, a flag's or the library's, is one `error:` line and exit 1.
int main(int argc, char** argv) {
  return bench_flags::run([&] { return bench_main(argc, argv); });
}
