// 02: the same model under two policy combinations: their time and their peak, side by side.
//
// Policies are template parameters, so a combination is a type and comparing two is a loop over
// types. Here the precision policy (fp32 everywhere, or bf16 storage with fp32 accumulation) and
// the allocator policy (a PyTorch-style caching allocator, or one expandable arena) change
// together; each combination is planned for the same budget, trains the same steps, and reports
// its predicted and measured reserved peak and its time per step. Swap in other policies (the TTT
// mini-batch, the scan chunk, the monitor) the same way. For a full grid with repetitions and
// the spread over repeats, use bench/policy_grid (docs/benchmarks.md).
//
//   ./build/release/examples/02_policy_grid            # 5 steps per combination
//   ./build/release/examples/02_policy_grid 20
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "membound/membound.hpp"

#include "cli_checks.hpp"

namespace mb = membound;

struct outcome {
  std::size_t predicted = 0, measured = 0;  // reserved peak of the stack, bytes
  double ms = 0;                            // median milliseconds per optimizer step
  double loss = 0;                          // the last step's
};

// One combination: a model at precision P on allocator stack Stack, planned for `budget`.
template <typename P, typename Stack>
outcome run(Stack& alloc, std::size_t budget, std::size_t steps) {
  using model = mb::model<mb::embedding<P>, mb::block<mb::ttt_linear<P>>, mb::block<mb::attention<P>>,
                          mb::block<mb::mamba<P>>, mb::lm_head<P>>;
  const model m(mb::model_config{.vocab = 256, .width = 128, .heads = 4});
  const mb::batch_shape batch{8, 128};
  mb::fit_options fo;
  fo.threads = 2;
  fo.reserve = mb::reserve_model(m, alloc);  // the plan counts what this stack reserves
  const mb::training_plan plan = mb::fit(m, batch, budget, fo);

  const std::string text = "Now is the winter of our discontent made glorious summer by this sun of York. ";
  auto source = [&](const mb::sequence_request& r, std::int32_t* x, std::int32_t* y) {
    for (std::size_t t = 0; t < batch.seq; ++t) {
      x[t] = static_cast<unsigned char>(text[(r.random + t) % text.size()]);
      y[t] = static_cast<unsigned char>(text[(r.random + t + 1) % text.size()]);
    }
  };
  mb::thread_pool pool(2);
  mb::trainer t(m, batch, plan, alloc, pool);
  std::vector<double> ms;
  outcome o;
  for (std::size_t k = 0; k < steps; ++k) {
    const mb::step_result s = t.step(source);
    ms.push_back(s.ms);
    o.loss = s.loss;
  }
  std::nth_element(ms.begin(), ms.begin() + ms.size() / 2, ms.end());
  o.ms = ms[ms.size() / 2];
  o.predicted = plan.reserved_peak;
  o.measured = alloc.stats().peak_reserved;
  return o;
}

int main(int argc, char** argv) {
  try {
    std::size_t steps = 5;
    if (argc > 2) throw mb::invalid_argument("arguments", "at most one (steps per combination)", std::to_string(argc - 1), "e.g. 02_policy_grid 20");
    if (argc == 2) steps = cli_checks::whole("STEPS", argv[1], 1, 100000, "02_policy_grid 20");
    const std::size_t budget = std::size_t{32} << 20;

    // Combination A: fp32, a caching allocator over the system heap, under the budget.
    mb::budget_allocator<mb::caching_allocator<mb::system_allocator>> caching(budget);
    const outcome a = run<mb::fp32_precision>(caching, budget, steps);
    // Combination B: bf16 storage (fp32 accumulation), one expandable arena under the budget.
    mb::budget_allocator<mb::expandable_arena<mb::host_virtual_memory>> arena(
        budget, mb::expandable_arena_options{mb::align_up(budget, std::size_t{2} << 20)});
    const outcome b = run<mb::bf16_precision>(arena, budget, steps);

    std::printf("%-34s %12s %12s %10s %8s\n", "combination (budget 32 MiB)", "predicted", "measured", "ms/step", "loss");
    std::printf("%-34s %12s %12s\n", "", "reserved", "reserved");
    const auto row = [](const char* name, const outcome& o) {
      const double mib = 1 << 20;
      std::printf("%-34s %8.2f MiB %8.2f MiB %10.1f %8.4f\n", name, static_cast<double>(o.predicted) / mib,
                  static_cast<double>(o.measured) / mib, o.ms, o.loss);
    };
    row("fp32 + caching_allocator", a);
    row("bf16 + expandable_arena", b);
    std::printf("B/A: reserved peak %.2f, time per step %.2f (median of %zu steps, 2 threads)\n",
                static_cast<double>(b.measured) / static_cast<double>(a.measured), b.ms / a.ms, steps);
    // The promise holds for both: nothing reserved beyond the prediction.
    const bool kept = a.measured <= a.predicted && b.measured <= b.predicted;
    std::printf("both reserved peaks within their predictions: %s\n", kept ? "yes" : "NO");
    return kept ? 0 : 1;
  } catch (const mb::error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
