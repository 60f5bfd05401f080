// The mixture-of-experts feed-forward in models (block<Mixer, moe_ffn>) and the trainer
// (test_moe.cpp checks the layer itself): every schedule gives none's gradients bit for bit with
// the measured peak equal to the plan's, for a learned router and for an adversarial one (every
// token to the same two experts); the model's loss includes the balancing loss and its gradient
// agrees with finite differences; inference runs without a capacity; the trainer reports the
// drops and learns. Not under the sanitizers (tests/CMakeLists.txt): the kernels it runs are
// test_moe's, which run under them; the model's and trainer's code around them (the statistics,
// the balancing loss's scale) holds no buffer of its own, and the rest is the dense blocks'
// code, which test_model and test_trainer run under them.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "../support/layer_test_util.hpp"
#include "../support/schedule_checks.hpp"
#include "../support/small_models.hpp"
#include "membound/memory/budget.hpp"
#include "membound/memory/system_allocator.hpp"
#include "membound/model/planner.hpp"
#include "membound/train/trainer.hpp"

namespace mb = membound;

namespace {

// Two mixture blocks around a dense one, on three mixer families.
template <typename P>
using moe_model = mb::model<mb::embedding<P>, mb::block<mb::attention<P>, mb::moe_ffn>, mb::block<mb::mamba<P>>,
                            mb::block<mb::ttt_linear<P>, mb::moe_ffn>, mb::lm_head<P>>;

mb::model_config moe_small_config(double capacity_factor) {
  mb::model_config c = membound_test::small_config();
  c.moe.experts = 4;
  c.moe.top_k = 2;
  c.moe.hidden = 24;
  c.moe.capacity_factor = capacity_factor;
  c.moe.aux_loss_weight = 0.01;
  return c;
}

// One step of the `none` plan with the routers' weights set to `router` (NaN: as initialised):
// the loss, the stats, the measured and predicted peaks.
struct moe_step {
  double loss = 0;
  mb::moe_stats stats;
  std::size_t measured = 0, predicted = 0;
  std::vector<double> grads;
};
template <typename Model>
moe_step run_moe_step(const Model& m, mb::batch_shape b, double router) {
  using S = typename Model::storage_type;
  mb::plan_options o;
  o.threads = 2;
  o.head_chunk = 7;
  o.optimizer = false;
  const mb::training_plan p = mb::make_plan(m, b, mb::schedules::none{}, o);
  const auto d = membound_test::make_token_data(b, m.config().vocab, 3);
  mb::budget_allocator<mb::system_allocator> alloc(std::size_t{1} << 32);
  mb::thread_pool pool(2);
  // Weights and gradients from the same allocator, as the plan counts them.
  const std::size_t n = m.parameter_elements();
  S* w = static_cast<S*>(alloc.allocate(m.weight_bytes(), mb::default_alignment, mb::memory_tag::weights));
  S* g = static_cast<S*>(alloc.allocate(m.weight_bytes(), mb::default_alignment, mb::memory_tag::gradients));
  m.init_weights(w, 7);
  std::fill(g, g + n, S(0.0f));
  if (!std::isnan(router)) {
    for (const mb::param_entry& e : m.parameters())
      if (e.name.find("router") != std::string::npos) std::fill(w + e.offset, w + e.offset + e.count, S(router));
  }
  moe_step r;
  r.loss = m.forward_backward(w, g, d.tokens.data(), d.targets.data(), b, p.ops, p.head_chunk, 1.0, alloc, pool, {},
                              &r.stats);
  r.measured = alloc.stats().peak_requested;
  r.predicted = p.peak_bytes;
  r.grads = membound_test::to_double(g, n);
  alloc.deallocate(g, m.weight_bytes(), mb::default_alignment, mb::memory_tag::gradients);
  alloc.deallocate(w, m.weight_bytes(), mb::default_alignment, mb::memory_tag::weights);
  return r;
}

}  // namespace

TEST_CASE("model: moe_ffn blocks under every schedule give none's gradients; measured peak == predicted") {
  const mb::batch_shape b{2, 19};
  SUBCASE("fp32, capacity 1.0 (drops)") {
    membound_test::check_schedules(moe_model<mb::fp32_precision>(moe_small_config(1.0)), b, 2);
  }
  SUBCASE("bf16, no capacity") {
    membound_test::check_schedules(moe_model<mb::bf16_precision>(moe_small_config(0.0)), b, 1);
  }
}

TEST_CASE("model: an adversarial router (every token to experts 0 and 1) needs no byte more than planned") {
  const moe_model<mb::fp32_precision> m(moe_small_config(1.0));
  const mb::batch_shape b{2, 19};
  // A zero router: every logit ties, so every token's choices are experts 0 and 1 (the lower
  // experts win ties). 38 tokens · 2 choices, capacity floor(1.0 · 38 · 2 / 4) = 19 per expert:
  // each of the two experts drops 19, and tokens 19..37 lose both choices; per block.
  const moe_step adv = run_moe_step(m, b, 0.0);
  CHECK(adv.stats.choices == 2 * 76);
  CHECK(adv.stats.dropped == 2 * 38);
  CHECK(adv.stats.tokens_dropped == 2 * 19);
  CHECK(adv.stats.max_expert_rows == 19);
  // Balancing loss per block: α · E · Σ_e f_e · P_e = 0.01 · 4 · (1 · 1/4 + 1 · 1/4) = 0.02.
  CHECK(adv.stats.aux_loss == doctest::Approx(0.04).epsilon(1e-12));
  CHECK(adv.measured == adv.predicted);
  const moe_step learned = run_moe_step(m, b, std::nan(""));
  CHECK(learned.measured == learned.predicted);
  CHECK(learned.stats.dropped < adv.stats.dropped);

  // The returned loss is the cross-entropy plus the balancing loss.
  mb::model_config none = moe_small_config(1.0);
  none.moe.aux_loss_weight = 0.0;
  const moe_step plain = run_moe_step(moe_model<mb::fp32_precision>(none), b, 0.0);
  CHECK(plain.stats.aux_loss == 0.0);
  CHECK(adv.loss - plain.loss == doctest::Approx(adv.stats.aux_loss).epsilon(1e-5));
}

TEST_CASE("model: moe gradients, balancing loss included, agree with finite differences (fp64)") {
  // membound_test::check_finite_differences says how and to what tolerance. The routing must not
  // change within ±h: these weights keep every gap between routing probabilities, and every
  // capacity decision, far from it (one that changed would show as a jump far outside it).
  mb::model_config c = moe_small_config(1.0);
  c.moe.aux_loss_weight = 0.5;  // large enough that its gradient shows in the router's
  const moe_model<mb::fp64_precision> m(c);
  const mb::batch_shape b{1, 13};
  const std::size_t checked = membound_test::check_finite_differences(m, b, 5);
  // Capacity floor(1.0 · 13 · 2 / 4) = 6: the checked point drops choices (same data and weights).
  const auto d = membound_test::make_token_data(b, c.vocab, 5);
  std::vector<double> w(m.parameter_elements());
  m.init_weights(w.data(), 9);
  mb::budget_allocator<mb::system_allocator> alloc(std::size_t{1} << 30);
  mb::thread_pool pool(2);
  mb::moe_stats st;
  (void)m.loss(w.data(), d.tokens.data(), d.targets.data(), b, 4, alloc, pool, &st);
  CHECK(st.dropped > 0);
  CHECK(checked >= 3 * 30);
}

TEST_CASE("model: moe shapes are checked by name; inference computes every choice") {
  mb::model_config c = moe_small_config(1.0);
  c.moe.top_k = 3;
  CHECK_THROWS_WITH_AS(moe_model<mb::fp32_precision>(c).check({1, 8}), doctest::Contains("shape.top_k"),
                       mb::invalid_argument);
  c = moe_small_config(1.0);
  const moe_model<mb::fp32_precision> m(c);
  // One token: floor(1.0 · 1 · 2 / 4) = 0 slots, refused for training ...
  CHECK_THROWS_WITH_AS(m.check({1, 1}), doctest::Contains("shape.capacity_factor"), mb::invalid_argument);
  // ... while next_token_logits runs without a capacity: a one-token prompt works, and its logits
  // are the loss path's of the same weights with no capacity (fp64: -log softmax at the target
  // equals loss() to 1e-12; no balancing loss in either).
  c.moe.aux_loss_weight = 0.0;
  mb::model_config open = c;
  open.moe.capacity_factor = 0.0;
  const moe_model<mb::fp64_precision> capped(c), uncapped(open);
  std::vector<double> w(capped.parameter_elements());
  capped.init_weights(w.data(), 3);
  mb::budget_allocator<mb::system_allocator> alloc(std::size_t{1} << 30);
  mb::thread_pool pool(1);
  const std::int32_t ids[1] = {5}, target[1] = {11};
  std::vector<double> logits(c.vocab);
  capped.next_token_logits(w.data(), ids, {1, 1}, logits.data(), alloc, pool);
  double mx = logits[0];
  for (double l : logits) mx = std::max(mx, l);
  double z = 0;
  for (double l : logits) z += std::exp(l - mx);
  const double nll = std::log(z) + mx - logits[11];
  CHECK(std::abs(nll - uncapped.loss(w.data(), ids, target, {1, 1}, 8, alloc, pool)) <= 1e-12 * nll);
}

TEST_CASE("trainer: a moe model learns within its plan and reports the drops of every step") {
  using P = mb::fp32_precision;
  const moe_model<P> m(moe_small_config(1.0));
  const mb::batch_shape eff{4, 16};
  mb::thread_pool pool(2);
  mb::fit_options fo;
  fo.threads = 2;
  const mb::training_plan plan = mb::fit(m, eff, 1ull << 30, fo);
  mb::trainer_options o;
  o.seed = 3;
  o.lr = mb::cosine_lr{1e-2, 1e-3, 2, 20};
  // A learnable stream: a repeating phrase, windows at the request's random offset.
  std::vector<std::int32_t> text;
  for (std::size_t i = 0; i < 2000; ++i) text.push_back(static_cast<std::int32_t>((i * 7 + i / 13) % 40));
  const auto src = [&](const mb::sequence_request& r, std::int32_t* x, std::int32_t* y) {
    const std::size_t at = r.random % (text.size() - eff.seq - 1);
    for (std::size_t t = 0; t < eff.seq; ++t) {
      x[t] = text[at + t];
      y[t] = text[at + t + 1];
    }
  };
  mb::budget_allocator<mb::system_allocator> a(1ull << 30);
  mb::trainer t(m, eff, plan, a, pool, o);
  std::vector<double> losses;
  std::size_t dropped = 0;
  for (int k = 0; k < 12; ++k) {
    const mb::step_result r = t.step(src);
    losses.push_back(r.loss);
    CHECK(r.moe.choices == 2 * eff.tokens() * 2);  // two mixture blocks, top-2, every micro-batch
    CHECK(r.moe.tokens == 2 * eff.tokens());
    CHECK(r.moe.aux_loss > 0.0);
    dropped += r.moe.dropped;
  }
  CHECK(dropped > 0);  // capacity 1.0: a router that learns unevenly drops some choices
  CHECK(losses.back() < losses.front() - 0.3);
  CHECK(a.stats().peak_requested <= t.largest_predicted_peak());
}
