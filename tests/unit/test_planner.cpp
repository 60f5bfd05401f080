// The planner's completeness and its arithmetic:
//   - fit() and optimal_schedule() consider every schedule a generator makes (none, every<k> for
//     every k up to L, binomial<s> for every s, the DP): a budget equal to any such schedule's
//     exact peak is met, on random models and random heterogeneous chains;
//   - the least peak budget_too_small and schedule_does_not_fit report is achievable: a budget of
//     exactly minimum() fits, one byte less does not;
//   - size arithmetic saturates: parameter counts at width 2^32, a 2^60-parameter model, chains
//     with sizes near SIZE_MAX. A saturated size never fits a budget, SIZE_MAX included, and no
//     sum is ever smaller than one of its parts. Or the call throws a typed error; never a wrap.
#include <doctest/doctest.h>

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wfree-nonheap-object"
#endif

#include <cstdint>
#include <limits>
#include <vector>

#include "membound/core/checked_math.hpp"
#include "membound/model/planner.hpp"

#include "../support/small_models.hpp"

namespace mb = membound;

namespace {

using membound_test::any_blocks;
using membound_test::rng;

std::vector<mb::schedule_choice> generated(std::size_t L) {
  using K = mb::schedule_choice::kind;
  std::vector<mb::schedule_choice> v{{K::none, 0}, {K::full, 0}};
  for (std::size_t k = 1; k <= L; ++k) v.push_back({K::every, k});
  for (std::size_t s = 1; s <= L; ++s) v.push_back({K::binomial, s});
  return v;
}

std::vector<std::vector<mb::chain_op>> generated_ops(std::size_t L) {
  std::vector<std::vector<mb::chain_op>> v{mb::schedule_none(L)};
  for (std::size_t k = 1; k <= L; ++k) v.push_back(mb::schedule_every(L, k));
  for (std::size_t s = 1; s <= L; ++s) v.push_back(mb::schedule_binomial(L, s));
  return v;
}

mb::chain random_chain(rng& r, std::size_t L) {
  mb::chain c;
  for (std::size_t i = 0; i < L; ++i) {
    mb::chain_link l;
    l.input_bytes = 1 + r.below(5000);
    l.saved_bytes = r.below(20000);
    l.advance_peak = 1 + r.below(5000) + r.below(8000);
    l.tape_peak = l.advance_peak + l.saved_bytes + r.below(3000);
    l.retape_peak = l.saved_bytes + r.below(9000);
    l.backward_peak = l.input_bytes + r.below(12000);
    l.forward_cost = 1.0 + static_cast<double>(r.below(100));
    c.links.push_back(l);
  }
  c.output_bytes = 1 + r.below(5000);
  c.loss_peak = c.output_bytes + r.below(30000);
  c.base_bytes = r.below(100000);
  // advance peaks include the output (the chain's contract: >= a_{i+1})
  for (std::size_t i = 0; i < L; ++i) {
    const std::size_t out = c.a(i + 1);
    c.links[i].advance_peak = std::max(c.links[i].advance_peak, out);
    c.links[i].tape_peak = std::max(c.links[i].tape_peak, out + c.links[i].saved_bytes);
  }
  return c;
}

// Two TTT-Linear blocks, the model: small enough to fit at any budget the cases try.
using two_ttt_blocks = mb::model<mb::embedding<mb::fp32_precision>, mb::block<mb::ttt_linear<mb::fp32_precision>>,
                                 mb::block<mb::ttt_linear<mb::fp32_precision>>, mb::lm_head<mb::fp32_precision>>;
two_ttt_blocks two_ttt_blocks_model() {
  mb::model_config c;
  c.vocab = 4096;
  c.width = 32;
  c.heads = 1;
  return two_ttt_blocks(c);
}

}  // namespace

TEST_CASE("planner: the issue's case: fit at every<2>'s exact peak finds it (two TTT-Linear blocks)") {
  const two_ttt_blocks m = two_ttt_blocks_model();
  const mb::training_plan every2 = mb::make_plan(m, {1, 64}, mb::schedules::every<2>{});
  const mb::training_plan p = mb::fit(m, {1, 64}, every2.peak_bytes);
  CHECK(p.peak_bytes <= every2.peak_bytes);
  try {
    (void)mb::fit(m, {1, 64}, 0);
    FAIL_CHECK("a zero budget fitted");
  } catch (const mb::budget_too_small& e) {
    CHECK(e.minimum() <= every2.peak_bytes);
    CHECK_NOTHROW((void)mb::fit(m, {1, 64}, e.minimum()));
    CHECK_THROWS_AS((void)mb::fit(m, {1, 64}, e.minimum() - 1), mb::budget_too_small);
  }
}

TEST_CASE("planner: prefer_below picks the best plan under the line when there is one, else the best under the budget") {
  const two_ttt_blocks m = two_ttt_blocks_model();
  const mb::batch_shape eff{4, 64};
  // A budget a hair above the cheapest plan's peak: the line just below it excludes that plan.
  const mb::training_plan best = mb::fit(m, eff, std::size_t{1} << 30);
  const std::size_t budget = best.peak_bytes + 64;
  mb::fit_options fo;
  fo.prefer_below = best.peak_bytes - 1;
  const mb::training_plan under = mb::fit(m, eff, budget, fo);
  CHECK(under.peak_bytes <= fo.prefer_below);
  CHECK(under.budget == budget);
  CHECK(under.recompute_flops * static_cast<double>(under.accumulation) >=
        best.recompute_flops * static_cast<double>(best.accumulation));
  // It is the plan fit() gives for the line as a budget, with the caller's budget.
  mb::training_plan at_line = mb::fit(m, eff, fo.prefer_below);
  at_line.budget = budget;
  CHECK(under.table() == at_line.table());
  // No plan under the line: the best under the budget; a line at or over the budget changes nothing.
  fo.prefer_below = 1;
  CHECK(mb::fit(m, eff, budget, fo).table() == mb::fit(m, eff, budget).table());
  fo.prefer_below = budget;
  CHECK(mb::fit(m, eff, budget, fo).table() == mb::fit(m, eff, budget).table());
  // Nothing under the budget: budget_too_small as without the line.
  fo.prefer_below = 1;
  CHECK_THROWS_AS((void)mb::fit(m, eff, 2, fo), mb::budget_too_small);
}

TEST_CASE("planner: randomized, fit meets a budget equal to any generated schedule's exact peak; minimum() is achievable") {
  rng r{42};
  std::size_t cases = 0;
  for (int t = 0; t < 25; ++t) {
    std::vector<std::size_t> pattern;
    const mb::model_config cfg = membound_test::random_config(r, 5000, pattern, 5);
    const any_blocks<mb::fp32_precision> m(cfg, pattern);
    const mb::batch_shape b{1 + r.below(3), 1 + r.below(40)};
    mb::fit_options fo;
    fo.head_chunks = {256};
    for (const mb::schedule_choice& s : generated(m.depth())) {
      CAPTURE(s.name());
      const mb::training_plan p = mb::make_plan(m, b, s, {1, 256, 1, true});
      const mb::training_plan f = mb::fit(m, b, p.peak_bytes, fo);
      CHECK(f.peak_bytes <= p.peak_bytes);
      ++cases;
    }
    try {
      (void)mb::fit(m, b, 1, fo);
      FAIL_CHECK("one byte fitted");
    } catch (const mb::budget_too_small& e) {
      CHECK_NOTHROW((void)mb::fit(m, b, e.minimum(), fo));
      CHECK_THROWS_AS((void)mb::fit(m, b, e.minimum() - 1, fo), mb::budget_too_small);
      cases += 2;
    }
  }
  MESSAGE("fit cases: " << cases);
}

TEST_CASE("planner: randomized chains, optimal_schedule meets every generated schedule's exact peak") {
  rng r{7};
  std::size_t cases = 0;
  for (int t = 0; t < 60; ++t) {
    const std::size_t L = 1 + r.below(9);
    const mb::chain c = random_chain(r, L);
    std::size_t least = SIZE_MAX;
    for (const auto& ops : generated_ops(L)) {
      const std::size_t peak = mb::simulate(c, ops).peak_bytes;
      least = std::min(least, peak);
      const mb::optimal_result o = mb::optimal_schedule(c, peak);
      CHECK(o.stats.peak_bytes <= peak);
      CHECK(mb::simulate(c, o.ops).peak_bytes == o.stats.peak_bytes);
      ++cases;
    }
    try {
      (void)mb::optimal_schedule(c, c.base_bytes);
      FAIL_CHECK("the base alone fitted");
    } catch (const mb::schedule_does_not_fit& e) {
      CHECK(e.minimum() <= least);
      CHECK_NOTHROW((void)mb::optimal_schedule(c, e.minimum()));
      ++cases;
    }
  }
  MESSAGE("optimal_schedule cases: " << cases);
}

TEST_CASE("sizes: saturating arithmetic never wraps and a saturated size fits nothing") {
  constexpr std::size_t M = mb::size_max;
  static_assert(mb::sat_add(M - 1, 2) == M && mb::sat_add(1, 2, 3) == 6 && mb::sat_mul(std::size_t{1} << 32, std::size_t{1} << 32) == M);
  static_assert(mb::sat_round_up(M - 3, 64) == M && mb::sat_round_up(65, 64) == 128 && mb::sat_sub(1, 2) == 0);
  rng r{3};
  for (int t = 0; t < 10000; ++t) {
    const std::size_t a = r.below(2) ? M - r.below(1000) : r.below(M), b = r.below(2) ? M - r.below(1000) : r.below(M);
    const std::size_t s = mb::sat_add(a, b), p = mb::sat_mul(a, b);
    CHECK(s >= a);
    CHECK(s >= b);
    if (a != 0 && b != 0) CHECK((p >= a && p >= b));
  }
  // simulate on a chain with sizes near SIZE_MAX: the peak saturates, it does not wrap.
  mb::chain c;
  c.links.push_back({M / 2, M / 3, M / 2, M / 2 + M / 3, M / 3, M / 2, 1.0});
  c.links.push_back({M / 2, 10, M / 2, M / 2 + 10, 10, M / 2, 1.0});
  c.output_bytes = M / 2;
  c.loss_peak = M / 2;
  c.base_bytes = M / 4;
  for (const auto& ops : generated_ops(2)) CHECK(mb::simulate(c, ops).peak_bytes == M);
  CHECK_THROWS_AS((void)mb::optimal_schedule(c, M - 1), mb::schedule_does_not_fit);
}

TEST_CASE("sizes: absurd models saturate or are refused by a typed error, and never fit") {
  constexpr std::size_t M = mb::size_max;
  int refused = 0, saturated = 0;
  auto try_model = [&](mb::model_config cfg, std::vector<std::size_t> pattern, mb::batch_shape b) {
    CAPTURE(cfg.width);
    CAPTURE(cfg.vocab);
    try {
      const any_blocks<mb::fp32_precision> m(cfg, pattern);
      CHECK(m.parameter_count() >= cfg.vocab);
      const mb::training_plan p = mb::make_plan(m, b, mb::schedules::none{}, {1, 256, 1, true}, std::size_t{1} << 62);
      CHECK(p.peak_bytes >= m.weight_bytes());
      CHECK_FALSE(p.fits());
      mb::training_plan q = p;
      q.budget = M;
      if (mb::saturated(q.peak_bytes)) CHECK_FALSE(q.fits());
      CHECK_THROWS_AS((void)mb::fit(m, b, std::size_t{1} << 62), mb::budget_too_small);
      CHECK_THROWS_AS((void)mb::fit(m, b, M), mb::budget_too_small);
      ++saturated;
    } catch (const mb::budget_too_small&) {
      throw;
    } catch (const mb::error&) {
      ++refused;  // a typed refusal is as good as a saturated size
    }
  };
  mb::model_config c;
  c.heads = 1;
  c.width = std::size_t{1} << 32;
  c.vocab = 256;
  try_model(c, {1}, {1, 1});  // attention: C·HD = 2^64 wraps to 0 without saturation
  try_model(c, {0}, {1, 1});
  try_model(c, {2}, {1, 1});
  c.width = std::size_t{1} << 31;
  c.vocab = (std::size_t{1} << 31) - 1;
  try_model(c, {1}, {1, 1});
  c.width = std::size_t{1} << 30;
  c.vocab = std::size_t{1} << 30;  // a 2^60-parameter embedding: 2^62 bytes in fp32
  try_model(c, {1}, {1, 1});
  c.width = 64;
  c.heads = 4;
  c.vocab = 256;
  try_model(c, {1}, {std::size_t{1} << 40, std::size_t{1} << 40});  // tokens() = 2^80
  MESSAGE(saturated << " absurd models saturated, " << refused << " refused by a typed error");
  CHECK(saturated + refused == 6);
}
