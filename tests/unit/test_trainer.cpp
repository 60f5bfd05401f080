// The training loop's promises (train/trainer.hpp):
//   - the same seed and thread count give a bit-identical loss curve and weights;
//   - a run resumed from a checkpoint at step k continues the uninterrupted run bit for bit, and a
//     corrupt or foreign checkpoint is refused with the trainer unchanged;
//   - dynamic loss scaling: an inf in the gradients skips the update (weights and AdamW state
//     untouched) and halves the scale; clean steps grow it;
//   - an unscaled run whose gradient is NaN stops with a typed error and nothing updated;
//   - memory pressure (a tight budget plus bytes held by someone else) makes the step retry under
//     a stricter plan, and the run then equals an unpressured run under that plan, bit for bit;
//     with no smaller plan left the step fails with budget_too_small and nothing lost.
#include <doctest/doctest.h>

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wfree-nonheap-object"
#endif

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "membound/memory/budget.hpp"
#include "membound/memory/system_allocator.hpp"
#include "membound/model/planner.hpp"
#include "membound/monitor/pressure_monitor.hpp"
#include "membound/train/trainer.hpp"

#include "../support/small_models.hpp"

namespace mb = membound;

namespace {

using membound_test::hybrid;

using membound_test::small_config;

constexpr mb::batch_shape effective{4, 16};

// A learnable stream: a repeating phrase with a little noise; windows drawn from the request's
// random bits (as the example trainer does).
struct text_source {
  std::vector<std::int32_t> text;
  explicit text_source(std::size_t vocab) {
    std::uint32_t s = 7;
    for (std::size_t i = 0; i < 4000; ++i) {
      s = s * 1664525u + 1013904223u;
      const bool noise = (s >> 24) % 10 == 0;
      text.push_back(static_cast<std::int32_t>(noise ? (s >> 8) % vocab : (i * 7 + i / 13) % vocab));
    }
  }
  void operator()(const mb::sequence_request& r, std::int32_t* x, std::int32_t* y) const {
    const std::size_t at = r.random % (text.size() - effective.seq - 1);
    for (std::size_t t = 0; t < effective.seq; ++t) {
      x[t] = text[at + t];
      y[t] = text[at + t + 1];
    }
  }
};

using budget_alloc = mb::budget_allocator<mb::system_allocator>;

mb::trainer_options options(std::uint64_t seed = 3) {
  mb::trainer_options o;
  o.seed = seed;
  o.lr = mb::cosine_lr{1e-2, 1e-3, 2, 20};
  o.head_chunks = {64, 16};
  return o;
}

template <typename Model>
mb::training_plan plan_none(const Model& m, std::size_t threads) {
  mb::plan_options po;
  po.threads = threads;
  po.head_chunk = 64;
  return mb::make_plan(m, effective, mb::schedules::none{}, po);
}

std::vector<unsigned char> raw(const void* p, std::size_t bytes) {
  const auto* b = static_cast<const unsigned char*>(p);
  return {b, b + bytes};
}

// The bits of a loss curve, so that equal means bit-identical (and NaN = NaN).
std::vector<unsigned char> bits(const std::vector<double>& v) { return raw(v.data(), v.size() * sizeof(double)); }

template <typename Trainer>
std::vector<unsigned char> weight_bytes(const Trainer& t) {
  return raw(t.weights(), t.model().weight_bytes());
}

template <typename Trainer>
std::vector<unsigned char> optimizer_bytes(const Trainer& t) {
  return raw(t.optimizer_state(), t.optimizer_bytes());
}

template <typename Trainer, typename Source>
std::vector<double> run_steps(Trainer& t, Source& src, std::size_t steps) {
  std::vector<double> losses;
  for (std::size_t k = 0; k < steps; ++k) losses.push_back(t.step(src).loss);
  return losses;
}

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("membound_test_trainer_" + name)).string();
}

}  // namespace

TEST_CASE("trainer: the same seed and threads give a bit-identical loss curve; another seed does not") {
  using P = mb::fp32_precision;
  const hybrid<P> m(small_config());
  const text_source src(40);
  mb::thread_pool pool(2);
  budget_alloc a1(1ull << 30), a2(1ull << 30), a3(1ull << 30);
  mb::trainer t1(m, effective, plan_none(m, 2), a1, pool, options(3));
  mb::trainer t2(m, effective, plan_none(m, 2), a2, pool, options(3));
  mb::trainer t3(m, effective, plan_none(m, 2), a3, pool, options(4));
  auto s1 = src, s2 = src, s3 = src;
  const std::vector<double> l1 = run_steps(t1, s1, 12), l2 = run_steps(t2, s2, 12), l3 = run_steps(t3, s3, 12);
  CHECK(bits(l1) == bits(l2));
  CHECK(weight_bytes(t1) == weight_bytes(t2));
  CHECK(l1 != l3);
  // It learns: the phrase is mostly predictable.
  CHECK(l1.back() < l1.front() - 0.3);
  CHECK(t1.steps_done() == 12);
  CHECK(t1.updates_applied() == 12);
  CHECK(t1.data_position() == 12 * effective.batch);
  // The measured peak (requested bytes) stays within the plan's prediction.
  CHECK(a1.stats().peak_requested <= t1.largest_predicted_peak());
}

TEST_CASE("trainer: accumulation, loss scaling and evaluation do not change what a step computes") {
  using P = mb::fp32_precision;
  const hybrid<P> m(small_config());
  const text_source src(40);
  mb::thread_pool pool(2);
  mb::plan_options po;
  po.threads = 2;
  po.head_chunk = 64;
  po.accumulation = 2;
  const mb::training_plan halves = mb::make_plan(m, {2, effective.seq}, mb::schedules::none{}, po);
  budget_alloc a1(1ull << 30), a2(1ull << 30), a3(1ull << 30), a4(1ull << 30);
  mb::trainer one(m, effective, plan_none(m, 2), a1, pool, options());
  mb::trainer two(m, effective, halves, a2, pool, options());
  mb::trainer_options scaled = options();
  scaled.scaling = mb::loss_scaling::dynamic;
  scaled.scaler.scale = 1024;  // a power of two: scaling and unscaling are exact in fp32
  mb::trainer sc(m, effective, plan_none(m, 2), a3, pool, scaled);
  mb::trainer ev(m, effective, plan_none(m, 2), a4, pool, options());
  auto s1 = src, s2 = src, s3 = src, s4 = src;
  for (int k = 0; k < 4; ++k) {
    const mb::step_result r1 = one.step(s1), r2 = two.step(s2), r3 = sc.step(s3), r4 = ev.step(s4);
    // Two micro-batches of 2 sum the same per-sequence gradients as one of 4, in another order:
    // equal to rounding (fp32 sums of ~1e4 terms, bound 1e-5 relative).
    CHECK(r2.loss == doctest::Approx(r1.loss).epsilon(1e-6));
    CHECK(r2.grad_norm == doctest::Approx(r1.grad_norm).epsilon(1e-5));
    // A scaled loss gives the same true gradient norm once unscaled.
    CHECK(r3.applied);
    CHECK(r3.grad_norm == doctest::Approx(r1.grad_norm).epsilon(1e-5));
    // Evaluating between steps leaves the run bit-identical (it borrows the gradient buffer).
    const double e = ev.evaluate(s4, 6);
    CHECK(std::isfinite(e));
    CHECK(r4.loss == r1.loss);
    CHECK(r4.grad_norm == r1.grad_norm);
  }
  CHECK(weight_bytes(ev) == weight_bytes(one));
}

TEST_CASE("trainer: resuming at step k continues the uninterrupted run bit for bit") {
  using P = mb::fp32_precision;
  const hybrid<P> m(small_config());
  text_source src(40);
  mb::thread_pool pool(2);
  // The uninterrupted run (micro-batches of 2: accumulation is part of what must resume).
  mb::fit_options fo;
  fo.threads = 2;
  mb::plan_options po;
  po.threads = 2;
  po.head_chunk = 16;
  po.accumulation = 2;
  const mb::training_plan plan = mb::make_plan(m, {2, effective.seq}, mb::schedules::full{}, po);
  budget_alloc a(1ull << 30);
  mb::trainer full(m, effective, plan, a, pool, options());
  const std::vector<double> whole = run_steps(full, src, 7);

  const std::string path = temp_path("resume.ckpt");
  std::vector<double> resumed;
  {
    budget_alloc a1(1ull << 30);
    mb::trainer first(m, effective, plan, a1, pool, options());
    resumed = run_steps(first, src, 3);
    first.save(path);
  }
  {
    // A different seed and plan: load must replace both.
    budget_alloc a2(1ull << 30);
    mb::trainer second(m, effective, plan_none(m, 2), a2, pool, options(99));
    CHECK(second.load(path));
    CHECK(second.plan().schedule == plan.schedule);
    CHECK(second.plan().micro == plan.micro);
    CHECK(second.steps_done() == 3);
    for (double l : run_steps(second, src, 4)) resumed.push_back(l);
    CHECK(weight_bytes(second) == weight_bytes(full));
    CHECK(optimizer_bytes(second) == optimizer_bytes(full));
    CHECK(second.rng() == full.rng());
    CHECK(second.data_position() == full.data_position());
  }
  REQUIRE(resumed.size() == whole.size());
  CHECK(bits(resumed) == bits(whole));
  std::filesystem::remove(path);
}

TEST_CASE("trainer: a corrupt, truncated or foreign checkpoint is refused and the trainer is unchanged") {
  using P = mb::fp32_precision;
  const hybrid<P> m(small_config());
  text_source src(40);
  mb::thread_pool pool(1);
  budget_alloc a(1ull << 30);
  mb::trainer t(m, effective, plan_none(m, 1), a, pool, options());
  run_steps(t, src, 2);
  const std::string good = temp_path("good.ckpt"), bad = temp_path("bad.ckpt");
  t.save(good);
  run_steps(t, src, 1);
  const auto w = weight_bytes(t), opt = optimizer_bytes(t);
  const auto rng = t.rng();
  const auto pos = t.data_position();

  std::ifstream in(good, std::ios::binary);
  const std::string file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto unchanged = [&] {
    CHECK(weight_bytes(t) == w);
    CHECK(optimizer_bytes(t) == opt);
    CHECK(t.rng() == rng);
    CHECK(t.data_position() == pos);
    CHECK(t.steps_done() == 3);
  };
  SUBCASE("truncated") {
    std::ofstream(bad, std::ios::binary) << file.substr(0, file.size() / 2);
    CHECK_THROWS_AS(t.load(bad), mb::corrupt_checkpoint);
    unchanged();
  }
  SUBCASE("a flipped byte") {
    std::string f = file;
    f[f.size() / 3] = static_cast<char>(f[f.size() / 3] ^ 0x10);
    std::ofstream(bad, std::ios::binary) << f;
    CHECK_THROWS_AS(t.load(bad), mb::corrupt_checkpoint);
    unchanged();
  }
  SUBCASE("missing") {
    CHECK_THROWS_AS(t.load(temp_path("does_not_exist.ckpt")), mb::corrupt_checkpoint);
    unchanged();
  }
  SUBCASE("another model") {
    mb::model_config c = small_config();
    c.width = 64;
    const hybrid<P> other(c);
    budget_alloc a2(1ull << 30);
    mb::trainer t2(other, effective, plan_none(other, 1), a2, pool, options());
    t2.save(bad);
    try {
      t.load(bad);
      FAIL("a checkpoint of another model loaded");
    } catch (const mb::corrupt_checkpoint& e) {
      CHECK(std::string(e.what()).find("another model") != std::string::npos);
    }
    unchanged();
  }
  // The good file still loads and rewinds to step 2.
  t.load(good);
  CHECK(t.steps_done() == 2);
  std::filesystem::remove(good);
  std::filesystem::remove(bad);
}

TEST_CASE("trainer: fp16 loss scaling skips a step whose gradients overflow and halves the scale") {
  using P = mb::fp16_precision;
  const hybrid<P> m(small_config());
  text_source src(40);
  mb::thread_pool pool(2);
  budget_alloc a(1ull << 30);
  mb::trainer_options o = options();
  o.scaler.scale = std::ldexp(1.0, 40);  // the scaled gradients overflow fp16's 65504: inf
  o.scaler.growth_interval = 2;
  mb::trainer t(m, effective, plan_none(m, 2), a, pool, o);
  REQUIRE(t.loss_scaling_on());
  const auto w = weight_bytes(t), opt = optimizer_bytes(t);
  const mb::step_result r = t.step(src);
  CHECK_FALSE(r.applied);
  CHECK(!std::isfinite(r.grad_norm));
  CHECK(std::isfinite(r.loss));
  CHECK(r.loss_scale == std::ldexp(1.0, 39));
  CHECK(weight_bytes(t) == w);
  CHECK(optimizer_bytes(t) == opt);
  CHECK(t.updates_applied() == 0);
  CHECK(t.steps_done() == 1);
  // From there every step follows the scaler's rule: a skip halves the scale, and every 2nd clean
  // step in a row doubles it.
  double prev = r.loss_scale;
  std::size_t skipped = 1, applied = 0, clean_run = 0, grew = 0;
  for (int k = 0; k < 60 && applied < 6; ++k) {
    const mb::step_result s = t.step(src);
    if (s.applied) {
      ++applied;
      CHECK(std::isfinite(s.grad_norm));
      const bool grow = ++clean_run == 2;
      if (grow) clean_run = 0, ++grew;
      CHECK(s.loss_scale == (grow ? 2 * prev : prev));
    } else {
      ++skipped;
      clean_run = 0;
      CHECK(s.loss_scale == prev / 2);
    }
    prev = s.loss_scale;
  }
  CHECK(applied == 6);
  CHECK(grew >= 1);
  CHECK(t.updates_applied() == 6);
  CHECK(weight_bytes(t) != w);
  MESSAGE("fp16: " << skipped << " skipped and " << applied << " applied steps from a scale of 2^40; now "
                   << t.scaler().scale);
}

TEST_CASE("trainer: an unscaled NaN gradient stops with non_finite_gradient and nothing updated") {
  using P = mb::fp32_precision;
  const hybrid<P> m(small_config());
  text_source src(40);
  mb::thread_pool pool(1);
  budget_alloc a(1ull << 30);
  mb::trainer t(m, effective, plan_none(m, 1), a, pool, options());
  run_steps(t, src, 1);
  t.weights()[m.parameters()[1].offset] = std::numeric_limits<float>::quiet_NaN();
  const auto w = weight_bytes(t), opt = optimizer_bytes(t);
  const auto rng = t.rng();
  CHECK_THROWS_AS(t.step(src), mb::non_finite_gradient);
  CHECK(weight_bytes(t) == w);
  CHECK(optimizer_bytes(t) == opt);
  CHECK(t.rng() == rng);
  CHECK(t.steps_done() == 1);
  CHECK(a.stats().requested == t.own_bytes());  // nothing of the step left behind
}

namespace {

// Bytes live when the loss starts under a plan (after_forward): where a pressure monitor with
// the usual check points sees the most.
std::size_t live_at_loss(const mb::training_plan& p) {
  for (const mb::plan_phase& ph : p.timeline)
    if (ph.name.rfind("loss", 0) == 0) return ph.live_before;
  return p.peak_bytes;
}

}  // namespace

TEST_CASE("trainer: memory pressure retries the step under a stricter plan, which then equals an unpressured run") {
  using P = mb::fp32_precision;
  const hybrid<P> m(small_config());
  const text_source src(40);
  mb::thread_pool pool(2);
  const mb::training_plan p0 = plan_none(m, 2);
  // Thresholds low enough that the emergency is seen at after_forward before any allocation can
  // fail: a budget twice the plan's peak, and others take enough that the forward ends at 72%.
  const mb::pressure_thresholds th{0.5, 0.6, 0.7};
  const std::size_t limit = 2 * p0.peak_bytes;
  const std::size_t foreign = static_cast<std::size_t>(0.72 * static_cast<double>(limit)) - live_at_loss(p0);
  REQUIRE(p0.peak_bytes + foreign < limit);

  for (const std::size_t pressure_from : {0, 2}) {
    CAPTURE(pressure_from);
    budget_alloc a(limit);
    mb::trainer t(m, effective, p0, a, pool, options(), mb::pressure_monitor<>(th));
    auto s = src;
    std::vector<double> losses;
    std::vector<mb::replan_event> events;
    for (std::size_t k = 0; k < 5; ++k) {
      if (k == pressure_from) a.set_external(foreign);
      const mb::step_result r = t.step(s);
      losses.push_back(r.loss);
      for (const auto& e : r.replans) {
        MESSAGE(e.describe());
        events.push_back(e);
      }
    }
    REQUIRE(!events.empty());
    CHECK(events.front().step == pressure_from + 1);
    CHECK(events.front().retried);
    CHECK(events.front().reason.find("pressure emergency") == 0);
    CHECK(events.front().foreign == foreign);
    CHECK(events.back().stricter_found);
    const mb::training_plan& p1 = t.plan();
    CHECK(p1.peak_bytes < p0.peak_bytes);
    CHECK(p1.peak_bytes + foreign < limit);
    MESSAGE("stricter plan " << mb::plan_summary(p1) << ": peak + others' bytes = "
                             << 100.0 * static_cast<double>(p1.peak_bytes + foreign) / static_cast<double>(limit)
                             << "% of the budget");
    CHECK(t.monitor().entered(mb::pressure_level::emergency) >= 1);
    // Nothing of an abandoned attempt stays; the measured peak is within the plans' predictions.
    CHECK(a.stats().requested == t.own_bytes());
    CHECK(a.stats().peak_requested <= t.largest_predicted_peak());

    // The reference: no pressure, the first plan until the pressure came, then the stricter one.
    budget_alloc ra(1ull << 30);
    mb::trainer ref(m, effective, p0, ra, pool, options());
    auto rs = src;
    std::vector<double> expected;
    for (std::size_t k = 0; k < 5; ++k) {
      if (k == pressure_from) ref.set_plan(p1);
      expected.push_back(ref.step(rs).loss);
    }
    CHECK(bits(losses) == bits(expected));
    CHECK(weight_bytes(t) == weight_bytes(ref));
  }
}

TEST_CASE("trainer: an emergency no plan can get under is retried once, then tolerated") {
  using P = mb::fp32_precision;
  const hybrid<P> m(small_config());
  const text_source src(40);
  mb::thread_pool pool(2);
  const mb::training_plan p0 = plan_none(m, 2);
  // Emergency at 30%: others hold 30% of the budget, so every plan's step is an emergency.
  const mb::pressure_thresholds th{0.1, 0.2, 0.3};
  const std::size_t limit = 3 * p0.peak_bytes;
  budget_alloc a(limit);
  mb::trainer t(m, effective, p0, a, pool, options(), mb::pressure_monitor<>(th));
  a.set_external(limit * 3 / 10);
  auto s = src;
  std::vector<std::size_t> events;
  for (int k = 0; k < 4; ++k) {
    const mb::step_result r = t.step(s);
    events.push_back(r.replans.size());
    for (const auto& e : r.replans) MESSAGE(e.describe());
    CHECK(r.pressure == mb::pressure_level::emergency);
  }
  CHECK(events[0] == 1);  // one abandon, one smaller plan that fits the budget, then run through
  CHECK(events[1] == 0);
  CHECK(events[2] == 0);
  CHECK(events[3] == 0);
  CHECK(t.steps_done() == 4);
  CHECK(a.stats().requested == t.own_bytes());
}

TEST_CASE("trainer: out of memory with no smaller plan is budget_too_small, and nothing is lost") {
  using P = mb::fp32_precision;
  const hybrid<P> m(small_config());
  const text_source src(40);
  mb::thread_pool pool(1);
  const mb::training_plan p0 = plan_none(m, 1);
  budget_alloc a(p0.peak_bytes);
  mb::trainer t(m, effective, p0, a, pool, options());
  auto s = src;
  // Others hold all but a little more than the trainer's own bytes: no plan's step fits.
  a.set_external(p0.peak_bytes - t.own_bytes() - 4096);
  const auto w = weight_bytes(t);
  try {
    t.step(s);
    FAIL("the step ran without memory");
  } catch (const mb::budget_too_small& e) {
    CHECK(e.minimum() > 4096 + t.own_bytes());
    MESSAGE(std::string(e.what()));
  }
  CHECK(weight_bytes(t) == w);
  CHECK(t.steps_done() == 0);
  CHECK(t.data_position() == 0);
  CHECK(a.stats().requested == t.own_bytes());
  // Memory comes back: the step runs, and its loss is the reference's first step under that plan.
  a.set_external(0);
  const double loss = t.step(s).loss;
  budget_alloc ra(1ull << 30);
  mb::trainer ref(m, effective, t.plan(), ra, pool, options());
  auto rs = src;
  CHECK(ref.step(rs).loss == loss);
}

TEST_CASE("trainer: a plan for another batch or thread count is refused by name") {
  using P = mb::fp32_precision;
  const hybrid<P> m(small_config());
  mb::thread_pool pool(2);
  budget_alloc a(1ull << 30);
  CHECK_THROWS_AS(mb::trainer(m, effective, plan_none(m, 1), a, pool, options()), mb::invalid_argument);
  mb::plan_options po;
  po.threads = 2;
  const mb::training_plan other = mb::make_plan(m, {3, effective.seq}, mb::schedules::none{}, po);
  CHECK_THROWS_AS(mb::trainer(m, effective, other, a, pool, options()), mb::invalid_argument);
  CHECK(a.stats().requested == 0);
}

TEST_CASE("trainer: bad options are refused by the field's name, before anything is allocated") {
  using P = mb::fp32_precision;
  const hybrid<P> m(small_config());
  mb::thread_pool pool(1);
  budget_alloc a(1ull << 30);
  auto refused = [&](auto edit, const char* field) {
    mb::trainer_options o = options();
    edit(o);
    try {
      mb::trainer t(m, effective, plan_none(m, 1), a, pool, o);
      FAIL("accepted a bad " << field);
    } catch (const mb::invalid_argument& e) {
      CHECK(e.argument() == field);
    }
    CHECK(a.stats().requested == 0);
  };
  refused([](mb::trainer_options& o) { o.adam.beta1 = 1.0; }, "options.adam.beta1");
  refused([](mb::trainer_options& o) { o.adam.beta2 = std::nan(""); }, "options.adam.beta2");
  refused([](mb::trainer_options& o) { o.adam.eps = 0; }, "options.adam.eps");
  refused([](mb::trainer_options& o) { o.lr.peak = -1e-3; }, "options.lr.peak");
  refused([](mb::trainer_options& o) { o.clip = std::nan(""); }, "options.clip");
  refused([](mb::trainer_options& o) { o.scaler.scale = 0; }, "options.scaler.scale");
  refused([](mb::trainer_options& o) { o.scaler.growth_interval = 0; }, "options.scaler.growth_interval");
  refused([](mb::trainer_options& o) { o.head_chunks = {64, 0}; }, "options.head_chunks");
}
