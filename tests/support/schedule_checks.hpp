// One micro-batch through the budget allocator, and the checks the model tests share: every
// schedule gives `none`'s loss and gradients bit for bit, the measured peak (the budget
// allocator's peak of requested bytes) equals the plan's, and the backward agrees with finite
// differences of the loss.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <cstddef>
#include <cstring>
#include <vector>

#include "membound/memory/budget.hpp"
#include "membound/memory/system_allocator.hpp"
#include "membound/model/planner.hpp"
#include "small_models.hpp"

namespace membound_test {

namespace mb = membound;
using data = token_data;
constexpr auto make_data = make_token_data;

struct step_result {
  double loss = 0;
  std::size_t measured_peak = 0;
  std::size_t live_after = 0;
  std::vector<unsigned char> grad_bytes;
};

// Allocates weights, gradients and the optimizer state through the budget allocator (as a
// trainer does) and runs one micro-batch under the plan.
template <typename Model>
step_result run_step(const Model& m, const mb::training_plan& p, const data& d) {
  using S = typename Model::storage_type;
  mb::budget_allocator<mb::system_allocator> alloc(std::size_t{1} << 34);
  mb::thread_pool pool(p.threads);
  S* w = static_cast<S*>(alloc.allocate(m.weight_bytes(), mb::default_alignment, mb::memory_tag::weights));
  S* g = static_cast<S*>(alloc.allocate(m.weight_bytes(), mb::default_alignment, mb::memory_tag::gradients));
  void* opt = p.optimizer == 0 ? nullptr : alloc.allocate(p.optimizer, mb::default_alignment, mb::memory_tag::optimizer);
  m.init_weights(w, 7);
  std::memset(static_cast<void*>(g), 0, m.weight_bytes());
  step_result r;
  r.loss = m.forward_backward(w, g, d.tokens.data(), d.targets.data(), p.micro, p.ops, p.head_chunk,
                              1.0, alloc, pool);
  r.measured_peak = alloc.stats().peak_requested;
  r.grad_bytes.assign(reinterpret_cast<unsigned char*>(g), reinterpret_cast<unsigned char*>(g) + m.weight_bytes());
  if (opt != nullptr) alloc.deallocate(opt, p.optimizer, mb::default_alignment, mb::memory_tag::optimizer);
  alloc.deallocate(g, m.weight_bytes(), mb::default_alignment, mb::memory_tag::gradients);
  alloc.deallocate(w, m.weight_bytes(), mb::default_alignment, mb::memory_tag::weights);
  r.live_after = alloc.stats().requested;
  return r;
}

inline std::vector<mb::schedule_choice> all_schedules(std::size_t L) {
  using K = mb::schedule_choice::kind;
  std::vector<mb::schedule_choice> v{{K::none, 0}, {K::full, 0}};
  for (std::size_t k = 2; k <= L; ++k) v.push_back({K::every, k});
  for (std::size_t s = 1; s <= L; ++s) v.push_back({K::binomial, s});
  return v;
}

// Every schedule (and the DP at budgets between the least and the largest peak): gradients
// equal `none`'s bit for bit, and measured peak == predicted peak.
template <typename Model>
void check_schedules(const Model& m, mb::batch_shape b, std::size_t threads) {
  const data d = make_data(b, m.config().vocab, 3);
  mb::plan_options o;
  o.threads = threads;
  o.head_chunk = 7;
  const mb::training_plan base = mb::make_plan(m, b, mb::schedules::none{}, o);
  const step_result ref = run_step(m, base, d);
  CHECK(ref.measured_peak == base.peak_bytes);
  CHECK(ref.live_after == 0);
  std::size_t least = base.peak_bytes;
  for (const mb::schedule_choice& s : all_schedules(m.depth())) {
    CAPTURE(s.name());
    const mb::training_plan p = mb::make_plan(m, b, s, o);
    const step_result r = run_step(m, p, d);
    CHECK(r.measured_peak == p.peak_bytes);
    CHECK(r.loss == ref.loss);
    CHECK(r.grad_bytes == ref.grad_bytes);
    least = std::min(least, p.peak_bytes);
  }
  for (int k = 0; k <= 4; ++k) {
    const std::size_t budget = least + (base.peak_bytes - least) * static_cast<std::size_t>(k) / 4;
    CAPTURE(budget);
    const mb::training_plan p = mb::make_plan(m, b, mb::schedules::budget{budget}, o);
    CHECK(p.peak_bytes <= budget);
    const step_result r = run_step(m, p, d);
    CHECK(r.measured_peak == p.peak_bytes);
    CHECK(r.grad_bytes == ref.grad_bytes);
  }
}

// Central differences of an fp64 model's loss (under every<2>: recomputed blocks included) at
// entries 0, count/2 and count − 1 of every tensor whose name contains `only` (every tensor when
// empty), against its backward: h = 1e-5 on a loss near ln(vocab) ≈ 3.7 gives truncation
// h²/6·f''' and rounding ~1e-16·3.7/h ≈ 4e-11, so |fd − analytic| <= 1e-4·|analytic| + 1e-9.
// Returns how many entries it checked.
template <typename Model>
std::size_t check_finite_differences(const Model& m, mb::batch_shape b, std::uint32_t data_seed,
                                     const std::string& only = "") {
  const data d = make_data(b, m.config().vocab, data_seed);
  mb::plan_options o;
  o.threads = 2;
  o.head_chunk = 4;
  o.optimizer = false;
  const mb::training_plan p = mb::make_plan(m, b, mb::schedules::every<2>{}, o);
  mb::thread_pool pool(2);
  mb::budget_allocator<mb::system_allocator> alloc(std::size_t{1} << 32);
  std::vector<double> w(m.parameter_elements()), g(w.size(), 0.0), scratch(w.size());
  m.init_weights(w.data(), 9);
  const auto loss = [&](std::vector<double>& grads) {
    return m.forward_backward(w.data(), grads.data(), d.tokens.data(), d.targets.data(), b, p.ops,
                              p.head_chunk, 1.0, alloc, pool);
  };
  (void)loss(g);
  std::size_t checked = 0;
  for (const mb::param_entry& e : m.parameters()) {
    if (e.count == 0 || e.name.find(only) == std::string::npos) continue;
    for (std::size_t j : {std::size_t{0}, e.count / 2, e.count - 1}) {
      CAPTURE(e.name);
      CAPTURE(j);
      const std::size_t k = e.offset + j;
      const double h = 1e-5, orig = w[k];
      w[k] = orig + h;
      const double lp = loss(scratch);
      w[k] = orig - h;
      const double lm = loss(scratch);
      w[k] = orig;
      const double fd = (lp - lm) / (2 * h);
      CHECK(std::abs(fd - g[k]) <= 1e-4 * std::abs(g[k]) + 1e-9);
      ++checked;
    }
  }
  return checked;
}

}  // namespace membound_test
