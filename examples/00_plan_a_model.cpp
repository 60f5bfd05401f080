// 00: plan a model for a memory budget, then train inside it.
//
// A model is a type: its blocks and their precision are template parameters, its widths run-time
// values. Before anything runs, the planner states every byte of a training step (weights,
// gradients, optimizer state, kept activations, workspace, and what the allocator reserves around
// them) and fits the micro-batch, the recompute schedule and the logit chunk to the budget. The
// trainer then runs on an allocator stack capped at that budget, and the measured peak is the
// predicted one.
//
//   ./build/release/examples/00_plan_a_model            # a 24 MiB budget: 4 micro-batches of 2
//   ./build/release/examples/00_plan_a_model 16         # 16 MiB: 8 micro-batches of 1
//   ./build/release/examples/00_plan_a_model 12         # too small: the least budget, named
#include <cstdint>
#include <cstdio>
#include <string>

#include "membound/membound.hpp"

#include "cli_checks.hpp"

namespace mb = membound;

int run(std::size_t budget);

int main(int argc, char** argv) {
  try {
    // The budget in MiB, checked as every membound program checks its input (cli_checks.hpp).
    std::size_t budget = std::size_t{24} << 20;
    if (argc > 2) throw mb::invalid_argument("arguments", "at most one (the budget in MiB)", std::to_string(argc - 1), "e.g. 00_plan_a_model 24");
    if (argc == 2) budget = cli_checks::whole("BUDGET_MIB", argv[1], 1, 4096, "00_plan_a_model 24") << 20;
    return run(budget);
  } catch (const mb::error& e) {  // bad input, or no plan fits (budget_too_small names the least budget)
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}

// The budget in bytes.
int run(std::size_t budget) {
  // 1. The model: TTT-Linear, attention and Mamba blocks, fp32 on the CPU, 256 byte tokens.
  using P = mb::fp32_precision;
  using model = mb::model<mb::embedding<P>, mb::block<mb::ttt_linear<P>>, mb::block<mb::attention<P>>,
                          mb::block<mb::mamba<P>>, mb::lm_head<P>>;
  const model m(mb::model_config{.vocab = 256, .width = 128, .heads = 4});
  const mb::batch_shape batch{8, 128};  // what one optimizer step sees: 8 sequences of 128 tokens

  // 2. The allocator stack the run will use: a hard budget over an expandable arena (one
  //    reserved address range, pages committed at its end as the step needs them).
  using stack = mb::budget_allocator<mb::expandable_arena<mb::host_virtual_memory>>;
  stack alloc(budget, mb::expandable_arena_options{mb::align_up(budget, std::size_t{2} << 20)});

  // 3. The plan. reserve_model replays the step through a shadow of that stack, so the budget is
  //    compared with what the arena will hold, not only with what the step asks for.
  mb::fit_options fo;
  fo.threads = 2;
  fo.reserve = mb::reserve_model(m, alloc);
  const mb::training_plan plan = mb::fit(m, batch, budget, fo);
  std::printf("%s\n", plan.table().c_str());

  // 4. Train a few steps inside the budget. A source writes one sequence's tokens and targets;
  //    here, windows of a short text repeated.
  const std::string text =
      "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings "
      "and arrows of outrageous fortune, or to take arms against a sea of troubles. ";
  auto source = [&](const mb::sequence_request& r, std::int32_t* x, std::int32_t* y) {
    const std::size_t at = r.random % text.size();
    for (std::size_t t = 0; t < batch.seq; ++t) {
      x[t] = static_cast<unsigned char>(text[(at + t) % text.size()]);
      y[t] = static_cast<unsigned char>(text[(at + t + 1) % text.size()]);
    }
  };
  mb::thread_pool pool(2);
  mb::trainer t(m, batch, plan, alloc, pool);
  for (int k = 0; k < 5; ++k) {
    const mb::step_result s = t.step(source);
    std::printf("step %llu  loss %.4f  %.1f ms\n", static_cast<unsigned long long>(s.step), s.loss, s.ms);
  }

  // 5. The promise, checked: the arena never held more than the plan said.
  const std::size_t measured = alloc.stats().peak_reserved;
  std::printf("reserved peak: measured %s <= predicted %s <= budget %s: %s\n", mb::format_bytes(measured).c_str(),
              mb::format_bytes(plan.reserved_peak).c_str(), mb::format_bytes(budget).c_str(),
              measured <= plan.reserved_peak && plan.reserved_peak <= budget ? "yes" : "NO");
  return measured <= plan.reserved_peak ? 0 : 1;
}
