// The training loop's promises (train/trainer.hpp):
//   - the same seed and thread count give a bit-identical loss curve and weights;
//   - a run resumed from a checkpoint at step k continues the uninterrupted run bit for bit, and a
//     corrupt or foreign checkpoint is refused with the trainer unchanged: one that differs in any
//     fingerprint field (each model_config field, storage or accumulation type, a block's family
//     or math-changing policy, depth, layout, optimizer, batch, format) is refused by that
//     field's name with both values; blocks that compute the same (another C++ type, a
//     memory-only policy) load each other and continue bit for bit;
//   - the trainer runs only its own plans: one made for another model or precision, without the
//     optimizer, or edited by hand is refused by the constructor and set_plan (naming the field,
//     nothing changed or allocated), and the plans it takes run within their prediction;
//   - dynamic loss scaling: an inf in the gradients skips the update (weights and AdamW state
//     untouched) and halves the scale; clean steps grow it;
//   - an unscaled run whose gradient is NaN stops with a typed error and nothing updated;
//   - memory pressure (a tight budget plus bytes held by someone else) makes the step retry under
//     a stricter plan, and the run then equals an unpressured run under that plan, bit for bit;
//     with no smaller plan left the step fails with budget_too_small and nothing lost;
//   - decode runs over the current weights on the trainer's allocator and gives every byte back.
#include <doctest/doctest.h>

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wfree-nonheap-object"
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "membound/memory/budget.hpp"
#include "membound/memory/system_allocator.hpp"
#include "membound/model/planner.hpp"
#include "membound/monitor/foreign_memory_monitor.hpp"
#include "membound/memory/caching_allocator.hpp"
#include "membound/monitor/pressure_monitor.hpp"
#include "membound/train/checkpoint_file.hpp"
#include "membound/train/trainer.hpp"

#include "../support/small_models.hpp"
#include "../support/text_source.hpp"

namespace mb = membound;

namespace {

using membound_test::hybrid;

using membound_test::small_config;

constexpr mb::batch_shape effective{4, 16};

using text_source = membound_test::text_source<effective.seq>;

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
    // The event names the new plan in the plan table's own words.
    CHECK(events.back().to == mb::plan_summary(p1));
    CHECK(p1.table().starts_with("plan: " + mb::plan_summary(p1) + ","));
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

// The same pressure seen through a probe (foreign_memory_monitor), as on a shared GPU where a
// probe reads cudaMemGetInfo: nobody calls set_external, the monitor does at its check points.
TEST_CASE("trainer: foreign_memory_monitor's probe brings the others' bytes in, and the step retries") {
  using P = mb::fp32_precision;
  const hybrid<P> m(small_config());
  const text_source src(40);
  mb::thread_pool pool(2);
  const mb::training_plan p0 = plan_none(m, 2);
  const mb::pressure_thresholds th{0.5, 0.6, 0.7};
  const std::size_t limit = 2 * p0.peak_bytes;
  const std::size_t foreign = static_cast<std::size_t>(0.72 * static_cast<double>(limit)) - live_at_loss(p0);
  std::size_t others = 0;  // what the probe reports
  const auto probe = [&others](const budget_alloc&) { return others; };
  budget_alloc a(limit);
  mb::trainer t(m, effective, p0, a, pool, options(), mb::foreign_memory_monitor(mb::pressure_monitor<>(th), probe));
  auto s = src;
  (void)t.step(s);
  CHECK(t.plan().schedule.k == mb::schedule_choice::kind::none);
  CHECK(t.monitor().probes() > 0);
  others = foreign;
  const mb::step_result r = t.step(s);
  REQUIRE(!r.replans.empty());
  CHECK(r.replans.front().retried);
  CHECK(r.replans.front().foreign == foreign);
  CHECK(a.external() == foreign);
  CHECK(t.plan().peak_bytes < p0.peak_bytes);
  CHECK(t.plan().peak_bytes + foreign < limit);
  CHECK(a.stats().peak_requested <= t.largest_predicted_peak());

  // Others taking more than the budget leaves: the monitor records all the room there is (an
  // emergency) instead of throwing out of a check point.
  others = limit;
  try {
    (void)t.step(s);
  } catch (const mb::budget_too_small&) {
    // No plan fits in no room: the step fails, typed, with nothing lost.
  }
  CHECK(a.usage() <= limit);
  CHECK(t.steps_done() >= 2);
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

  // Resumed under the same pressure, the tolerance goes on: no replan where the uninterrupted run
  // had none, and the same losses and weights (the checkpoint carries it).
  const std::string path = temp_path("tolerated.ckpt");
  t.save(path);
  budget_alloc b(limit);
  mb::trainer u(m, effective, p0, b, pool, options(), mb::pressure_monitor<>(th));
  b.set_external(limit * 3 / 10);
  CHECK(u.load(path));
  auto s2 = s;
  for (int k = 0; k < 3; ++k) {
    const mb::step_result r = t.step(s), q = u.step(s2);
    CHECK(q.replans.size() == r.replans.size());
    CHECK(bits({q.loss}) == bits({r.loss}));
  }
  CHECK(weight_bytes(u) == weight_bytes(t));
  std::filesystem::remove(path);
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

// The bytes a budget already counts outside the stack (a CUDA context measured at the start, set
// here with set_external) are the budget's: a plan that fits only without them is refused when
// the trainer is made and by set_plan, naming them, with nothing changed (on an H200 a plan fitted
// into the whole budget beside 529 MiB of context ran out of memory in step 1).
TEST_CASE("trainer: a plan that fits only without the bytes held outside the stack is refused") {
  using P = mb::fp32_precision;
  const hybrid<P> m(small_config());
  const text_source src(40);
  mb::thread_pool pool(1);
  const mb::training_plan none = plan_none(m, 1);
  mb::plan_options po;
  po.threads = 1;
  po.head_chunk = 64;
  const mb::training_plan full = mb::make_plan(m, effective, mb::schedules::full{}, po);
  REQUIRE(full.peak_bytes < none.peak_bytes);
  const std::size_t outside = (none.peak_bytes - full.peak_bytes) / 2;
  budget_alloc a(none.peak_bytes);
  a.set_external(outside);
  try {
    mb::trainer t(m, effective, none, a, pool, options());
    FAIL("a plan over the budget less the outside bytes was accepted");
  } catch (const mb::invalid_argument& e) {
    const std::string what = e.what();
    CHECK(what.find("held by others") != std::string::npos);
    CHECK(what.find("the budget less") != std::string::npos);
    MESSAGE(what);
  }
  CHECK(a.stats().requested == 0);
  // The plan that fits beside them is taken; switching back to none is refused, plan unchanged.
  mb::trainer t(m, effective, full, a, pool, options());
  auto s = src;
  (void)t.step(s);
  const auto w = weight_bytes(t);
  CHECK_THROWS_AS(t.set_plan(none), mb::invalid_argument);
  CHECK(t.plan().schedule.k == mb::schedule_choice::kind::full);
  CHECK(weight_bytes(t) == w);
  (void)t.step(s);
  CHECK(t.steps_done() == 2);
  // Without the outside bytes the same switch is accepted.
  a.set_external(0);
  t.set_plan(none);
  CHECK(t.plan().schedule.k == mb::schedule_choice::kind::none);
  (void)t.step(s);
  CHECK(a.stats().peak_requested <= t.largest_predicted_peak());
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

// ---- Checkpoints are refused unless written for this model and run --------------------------------

namespace {

using membound_test::mixed;
namespace mixers = membound_test::mixers;

template <typename Model>
mb::training_plan plan_for(const Model& m, mb::batch_shape eff, std::size_t threads = 1) {
  mb::plan_options po;
  po.threads = threads;
  po.head_chunk = 64;
  return mb::make_plan(m, eff, mb::schedules::none{}, po);
}

// Everything load() or set_plan() could change, to compare before and after a refusal.
struct trainer_state {
  std::vector<unsigned char> weights, optimizer;
  std::uint64_t steps = 0, updates = 0, position = 0;
  mb::random_state rng;
  double scale = 0;
  std::uint64_t clean_steps = 0;
  mb::batch_shape micro;
  std::size_t accumulation = 0, head_chunk = 0, peak = 0, largest = 0, budget = 0;
  mb::schedule_choice schedule;
  std::vector<mb::chain_op> ops;

  template <typename Trainer>
  explicit trainer_state(const Trainer& t)
      : weights(weight_bytes(t)), optimizer(optimizer_bytes(t)), steps(t.steps_done()), updates(t.updates_applied()),
        position(t.data_position()), rng(t.rng()), scale(t.scaler().scale), clean_steps(t.scaler().clean_steps),
        micro(t.plan().micro), accumulation(t.plan().accumulation), head_chunk(t.plan().head_chunk),
        peak(t.plan().peak_bytes), largest(t.largest_predicted_peak()), budget(t.plan().budget),
        schedule(t.plan().schedule), ops(t.plan().ops) {}
  bool operator==(const trainer_state&) const = default;
};

const char* const checkpoint_sections[] = {"format", "fingerprint", "model",    "weights",
                                           "optimizer", "step",     "updates",  "rng",
                                           "data_position", "loss_scale", "loss_scale_clean_steps", "plan",
                                           "run", "tolerated"};

// A checkpoint file's sections, to write back with one of them changed.
struct checkpoint_sections_of {
  std::vector<std::pair<std::string, std::string>> s;
  explicit checkpoint_sections_of(const std::string& path) {
    const mb::checkpoint_reader r(path);
    for (const char* n : checkpoint_sections) {
      if (!r.has(n)) continue;
      std::string bytes(r.size(n), '\0');
      r.copy(n, bytes.data(), bytes.size());
      s.emplace_back(n, std::move(bytes));
    }
  }
  std::string& operator[](const std::string& name) {
    for (auto& [n, b] : s)
      if (n == name) return b;
    s.emplace_back(name, std::string{});
    return s.back().second;
  }
  void erase(const std::string& name) {
    std::erase_if(s, [&](const auto& e) { return e.first == name; });
  }
  void write(const std::string& path) const {
    mb::checkpoint_writer w;
    for (const auto& [n, b] : s) w.add(n, b.data(), b.size());
    w.commit(path);
  }
};

std::string u64_bytes(std::uint64_t v) { return std::string(reinterpret_cast<const char*>(&v), sizeof v); }

// load(path) must throw checkpoint_mismatch naming `field` and leave t exactly as it was.
template <typename Trainer>
void refused(Trainer& t, const std::string& path, const std::string& field, const std::string& saved = {},
             const std::string& current = {}) {
  CAPTURE(field);
  const trainer_state before(t);
  try {
    t.load(path);
    FAIL("a checkpoint differing in " << field << " loaded");
  } catch (const mb::checkpoint_mismatch& e) {
    CHECK(e.field() == field);
    const std::string what = e.what();
    CHECK(what.find(field) != std::string::npos);
    if (!saved.empty()) CHECK(e.saved() == saved);
    if (!current.empty()) CHECK(e.current() == current);
    if (field == "format") {
      CHECK(what.find("format " + saved + ", this build reads format " + current) != std::string::npos);
    } else if (!saved.empty() && !current.empty()) {
      CHECK(what.find("checkpoint written for " + field + " " + saved + ", this run uses " + current) !=
            std::string::npos);
    }
  }
  CHECK(trainer_state(t) == before);
}

// The loading side of the fingerprint tests: a hybrid fp32 trainer a few steps in.
struct loader {
  const hybrid<mb::fp32_precision> m{small_config()};
  mb::thread_pool pool{1};
  budget_alloc a{1ull << 30};
  mb::trainer<hybrid<mb::fp32_precision>, budget_alloc> t{m, effective, plan_none(m, 1), a, pool, options()};
  loader() {
    text_source src(40);
    run_steps(t, src, 2);
  }
};

// A trainer for `m` that saves its initial state to `path`.
template <typename Model>
void save_fresh(const Model& m, mb::batch_shape eff, const std::string& path) {
  mb::thread_pool pool(1);
  budget_alloc a(1ull << 30);
  mb::trainer t(m, eff, plan_for(m, eff), a, pool, options());
  t.save(path);
}

}  // namespace

TEST_CASE("trainer: a checkpoint written under other run settings is refused by the setting's name, unless accepted") {
  using P = mb::fp32_precision;
  const hybrid<P> m(small_config());
  text_source src(40);
  mb::thread_pool pool(1);
  const std::string path = temp_path("run_settings.ckpt");
  const auto tagged = [](mb::trainer_options o) {
    o.run_tags = {{"data", "fnv1a 0123, 4096 bytes"}};
    return o;
  };
  {
    budget_alloc a(1ull << 30);
    mb::trainer t(m, effective, plan_none(m, 1), a, pool, tagged(options()));
    run_steps(t, src, 2);
    t.save(path);
  }
  struct change {
    std::string field;
    std::size_t fields;  // how many settings the edit changes
    std::function<void(mb::trainer_options&)> edit;
  };
  const std::vector<change> changes{
      {"lr.peak", 1, [](auto& o) { o.lr.peak = 5e-3; }},
      {"lr.min_lr", 1, [](auto& o) { o.lr.min_lr = 2e-3; }},
      {"lr.warmup", 1, [](auto& o) { o.lr.warmup = 3; }},
      {"lr.total", 1, [](auto& o) { o.lr.total = 40; }},  // a longer run: another schedule from here on
      {"adam.beta1", 1, [](auto& o) { o.adam.beta1 = 0.8; }},
      {"adam.beta2", 1, [](auto& o) { o.adam.beta2 = 0.999; }},
      {"adam.eps", 1, [](auto& o) { o.adam.eps = 1e-6; }},
      {"adam.weight_decay", 1, [](auto& o) { o.adam.weight_decay = 0.0; }},
      {"clip", 1, [](auto& o) { o.clip = 0.5; }},
      // The scaler's settings come with it; a file without them (scaling off) is not compared on them.
      {"loss_scaling", 1, [](auto& o) { o.scaling = mb::loss_scaling::dynamic; }},
      {"tag.data", 1, [](auto& o) { o.run_tags[0].value = "fnv1a 4567, 4096 bytes"; }},
      {"tag.data", 1, [](auto& o) { o.run_tags.clear(); }},
      {"tag.config", 1, [](auto& o) { o.run_tags.push_back({"config", "small"}); }},
  };
  for (const change& c : changes) {
    CAPTURE(c.field);
    mb::trainer_options o = tagged(options());
    c.edit(o);
    budget_alloc a(1ull << 30);
    mb::trainer t(m, effective, plan_none(m, 1), a, pool, o);
    run_steps(t, src, 1);
    const trainer_state before(t);
    try {
      t.load(path);
      FAIL("a checkpoint of another " << c.field << " loaded");
    } catch (const mb::checkpoint_run_changed& e) {
      CHECK(e.field() == c.field);
      CHECK(e.changes().size() == c.fields);
      const std::string what = e.what();
      CHECK(what.find(c.field + " " + e.saved() + " there, " + e.current() + " here") != std::string::npos);
      CHECK(what.find("run_changes::accept") != std::string::npos);
    }
    CHECK(trainer_state(t) == before);
    CHECK(t.changed_at_load().empty());
    // Accepted: loaded, and what differed is listed.
    CHECK_NOTHROW(t.load(path, {.changes = mb::run_changes::accept}));
    CHECK(t.steps_done() == 2);
    REQUIRE(t.changed_at_load().size() == c.fields);
    CHECK(t.changed_at_load()[0].field == c.field);
    // A refused load after it keeps the list; a load of unchanged settings clears it.
    const std::string mine = temp_path("run_settings_mine.ckpt");
    t.save(mine);
    CHECK_THROWS_AS(t.load(path), mb::checkpoint_run_changed);
    CHECK(t.changed_at_load().size() == c.fields);
    CHECK_NOTHROW(t.load(mine));
    CHECK(t.changed_at_load().empty());
    std::filesystem::remove(mine);
  }
  // A file that records fewer settings (a build that knew fewer) is checked on those it has; a
  // tag it lacks is a change.
  for (const auto& [line, refused_by] : {std::pair<std::string, std::string>{"lr.peak=", ""}, {"tag.data=", "tag.data"}}) {
    CAPTURE(line);
    checkpoint_sections_of f(path);
    std::string& run = f["run"];
    const std::size_t at = run.find(line);
    REQUIRE(at != std::string::npos);
    run.erase(at, run.find('\n', at) + 1 - at);
    const std::string fewer = temp_path("run_settings_fewer.ckpt");
    f.write(fewer);
    budget_alloc a(1ull << 30);
    mb::trainer t(m, effective, plan_none(m, 1), a, pool, tagged(options()));
    if (refused_by.empty()) {
      CHECK_NOTHROW(t.load(fewer));
      CHECK(t.changed_at_load().empty());
    } else {
      try {
        t.load(fewer);
        FAIL("a file without a tag loaded");
      } catch (const mb::checkpoint_run_changed& e) {
        CHECK(e.field() == refused_by);
        CHECK(e.saved() == "(none)");
      }
    }
    std::filesystem::remove(fewer);
  }
  // The same settings (and another seed, which load() replaces): loaded, nothing changed, and
  // a run that goes on equals one under the writer's trainer.
  {
    budget_alloc a(1ull << 30), b(1ull << 30);
    mb::trainer t(m, effective, plan_none(m, 1), a, pool, tagged(options(99)));
    mb::trainer u(m, effective, plan_none(m, 1), b, pool, tagged(options()));
    CHECK_NOTHROW(t.load(path));
    CHECK_NOTHROW(u.load(path));
    CHECK(t.changed_at_load().empty());
    CHECK(bits(run_steps(t, src, 2)) == bits(run_steps(u, src, 2)));
  }
  // A checkpoint from before run settings were recorded loads as it is (nothing to compare).
  {
    checkpoint_sections_of f(path);
    f.erase("run");
    const std::string old = temp_path("run_settings_old.ckpt");
    f.write(old);
    mb::trainer_options o = tagged(options());
    o.lr.peak = 5e-3;
    budget_alloc a(1ull << 30);
    mb::trainer t(m, effective, plan_none(m, 1), a, pool, o);
    CHECK_NOTHROW(t.load(old));
    CHECK(t.steps_done() == 2);
    CHECK(t.changed_at_load().empty());
    std::filesystem::remove(old);
  }
  // A damaged settings section is a corrupt checkpoint, not a change.
  {
    checkpoint_sections_of f(path);
    f["run"] = "lr.peak=1\nno equals sign\n";
    const std::string bad = temp_path("run_settings_bad.ckpt");
    f.write(bad);
    budget_alloc a(1ull << 30);
    mb::trainer t(m, effective, plan_none(m, 1), a, pool, tagged(options()));
    try {
      t.load(bad);
      FAIL("a damaged run section loaded");
    } catch (const mb::checkpoint_mismatch&) {
      FAIL("a damaged run section read as a change");
    } catch (const mb::corrupt_checkpoint& e) {
      CHECK(std::string(e.what()).find("line 2 of its run settings is not name=value") != std::string::npos);
    }
    std::filesystem::remove(bad);
  }
  std::filesystem::remove(path);
}

TEST_CASE("trainer: run tags that cannot be written as settings are refused by name") {
  const hybrid<mb::fp32_precision> m(small_config());
  mb::thread_pool pool(1);
  for (const std::vector<mb::fingerprint_field>& tags :
       {std::vector<mb::fingerprint_field>{{"", "x"}}, {{"a=b", "x"}}, {{"a\nb", "x"}}, {{"data", "two\nlines"}},
        {{"data", "x"}, {"data", "y"}}}) {
    mb::trainer_options o = options();
    o.run_tags = tags;
    budget_alloc a(1ull << 30);
    try {
      mb::trainer t(m, effective, plan_none(m, 1), a, pool, o);
      FAIL("bad run tags taken");
    } catch (const mb::invalid_argument& e) {
      CHECK(e.argument().starts_with("options.run_tags["));
    }
    CHECK(a.stats().peak_requested == 0);
  }
}

TEST_CASE("trainer: the fingerprint names every model_config field, the types, blocks, layout, optimizer and batch") {
  loader l;
  std::vector<std::string> names;
  for (const auto& f : l.t.fingerprint()) {
    CHECK(f.value.find('\n') == std::string::npos);
    CHECK(f.name.find('=') == std::string::npos);
    names.push_back(f.name);
  }
  const std::vector<std::string> want{"config.vocab", "config.width", "config.heads", "config.kv_heads",
                                      "config.mlp_hidden", "config.tie_embeddings", "config.norm_eps",
                                      "config.rope_base", "config.ttt_base_lr", "storage", "accumulation", "depth",
                                      "blocks.0", "blocks.1", "blocks.2", "blocks.3", "parameters.elements",
                                      "parameters.tensors", "parameters.layout", "optimizer", "effective_batch",
                                      "sequence_length"};
  CHECK(names == want);
  // Blocks by identity, policies included; doubles by their bits.
  const auto fp = l.t.fingerprint();
  CHECK(fp[12].value == "ttt_linear<fp32/fp32, mini-batch 16, no gate> + swiglu<fp32/fp32>");
  CHECK(fp[13].value == "attention<fp32/fp32, tiles 64x64, causal, rope> + swiglu<fp32/fp32>");
  CHECK(fp[14].value == "mamba<fp32/fp32, scan chunk 128, d_state 16, d_conv 4, expand 2> + swiglu<fp32/fp32>");
  CHECK(fp[7].value == "10000 (0x40c3880000000000)");
  CHECK(fp[9].value == "fp32");
}

TEST_CASE("trainer: a checkpoint whose fingerprint differs in any one field is refused by that field's name") {
  loader l;
  const std::string good = temp_path("fp_good.ckpt"), bad = temp_path("fp_bad.ckpt");
  l.t.save(good);
  text_source src(40);
  run_steps(l.t, src, 1);  // the trainer is now elsewhere than the file: a load would show
  const auto fields = l.t.fingerprint();
  std::size_t tried = 0;
  for (std::size_t k = 0; k < fields.size(); ++k) {
    checkpoint_sections_of c(good);
    std::string text;
    for (std::size_t j = 0; j < fields.size(); ++j)
      text += fields[j].name + "=" + (j == k ? "edited " + fields[j].value : fields[j].value) + "\n";
    c["fingerprint"] = text;
    c.write(bad);
    refused(l.t, bad, fields[k].name, "edited " + fields[k].value, fields[k].value);
    ++tried;
  }
  SUBCASE("a field missing, or one this build does not know") {
    checkpoint_sections_of c(good);
    std::string text;
    for (std::size_t j = 1; j < fields.size(); ++j) text += fields[j].name + "=" + fields[j].value + "\n";
    c["fingerprint"] = text;
    c.write(bad);
    refused(l.t, bad, "config.vocab", "(none)", fields[0].value);
    c["fingerprint"] = text + fields[0].name + "=" + fields[0].value + "\nconfig.dropout=0.1\n";
    c.write(bad);
    refused(l.t, bad, "config.dropout", "0.1", "(none)");
    tried += 2;
  }
  SUBCASE("a malformed fingerprint is corrupt, not a mismatch") {
    std::string text;
    for (const auto& f : fields) text += f.name + "=" + f.value + "\n";
    for (const std::string& broken : {text + "no equals sign\n", text + fields[3].name + "=x\n",
                                      text.substr(0, text.size() - 1), "=" + text}) {
      checkpoint_sections_of c(good);
      c["fingerprint"] = broken;
      c.write(bad);
      const trainer_state before(l.t);
      CHECK_THROWS_AS(l.t.load(bad), mb::corrupt_checkpoint);
      CHECK(trainer_state(l.t) == before);
      ++tried;
    }
    checkpoint_sections_of c(good);
    c.erase("fingerprint");
    c.write(bad);
    const trainer_state before(l.t);
    CHECK_THROWS_AS(l.t.load(bad), mb::corrupt_checkpoint);
    CHECK(trainer_state(l.t) == before);
    ++tried;
  }
  SUBCASE("format 1, the unnamed fingerprint, is refused as such; so is a newer format") {
    checkpoint_sections_of c(good);
    c.erase("fingerprint");
    const std::uint64_t old_fp[] = {40, 32, 4, 2, 88, 1, 2, 0, 4, 16, 4};  // format 1's list: sizes only
    c["model"] = std::string(reinterpret_cast<const char*>(old_fp), sizeof old_fp);
    c["format"] = u64_bytes(1);
    c.write(bad);
    refused(l.t, bad, "format", "1", "2");
    c["format"] = u64_bytes(3);
    c.write(bad);
    refused(l.t, bad, "format", "3", "2");
    tried += 2;
  }
  MESSAGE(tried << " edited fingerprints refused");
  // The good file still loads.
  l.t.load(good);
  CHECK(l.t.steps_done() == 2);
  std::filesystem::remove(good);
  std::filesystem::remove(bad);
}

TEST_CASE("trainer: a checkpoint of a model differing in one model_config field is refused naming it") {
  loader l;
  const std::string path = temp_path("config.ckpt");
  struct change {
    const char* field;
    void (*edit)(mb::model_config&);
    const char* saved;
  };
  const change changes[] = {
      {"config.vocab", [](mb::model_config& c) { c.vocab = 41; }, "41"},
      {"config.width", [](mb::model_config& c) { c.width = 64; }, "64"},
      {"config.heads", [](mb::model_config& c) { c.heads = 2; }, "2"},
      {"config.kv_heads", [](mb::model_config& c) { c.kv_heads = 0; }, "4"},  // 0 means heads
      {"config.mlp_hidden", [](mb::model_config& c) { c.mlp_hidden = 96; }, "96"},
      {"config.tie_embeddings", [](mb::model_config& c) { c.tie_embeddings = false; }, "false"},
      {"config.norm_eps", [](mb::model_config& c) { c.norm_eps = 1e-6; }, nullptr},
      {"config.rope_base", [](mb::model_config& c) { c.rope_base = 500000; }, "5e+05 (0x411e848000000000)"},
      {"config.ttt_base_lr", [](mb::model_config& c) { c.ttt_base_lr = 0.5; }, "0.5 (0x3fe0000000000000)"},
  };
  for (const change& ch : changes) {
    mb::model_config c = small_config();
    ch.edit(c);
    save_fresh(hybrid<mb::fp32_precision>(c), effective, path);
    refused(l.t, path, ch.field, ch.saved == nullptr ? std::string{} : ch.saved);
  }
  // The batch: as many sequences of as many tokens per step.
  save_fresh(l.m, {2, effective.seq}, path);
  refused(l.t, path, "effective_batch", "2", "4");
  save_fresh(l.m, {effective.batch, 32}, path);
  refused(l.t, path, "sequence_length", "32", "16");
  // -0.0 and 0.0 are equal numbers with other bits: the fingerprint compares bits.
  mb::model_config z = small_config();
  z.ttt_base_lr = 0.0;
  mb::model_config nz = z;
  nz.ttt_base_lr = -0.0;
  {
    const hybrid<mb::fp32_precision> mz(z), mnz(nz);
    mb::thread_pool pool(1);
    budget_alloc a(1ull << 30);
    mb::trainer t(mz, effective, plan_none(mz, 1), a, pool, options());
    save_fresh(mnz, effective, path);
    refused(t, path, "config.ttt_base_lr", "-0 (0x8000000000000000)", "0 (0x0000000000000000)");
  }
  std::filesystem::remove(path);
}

TEST_CASE("trainer: bf16 and fp16 checkpoints (same size, other bits) do not load into each other") {
  using B = hybrid<mb::bf16_precision>;
  using H = hybrid<mb::fp16_precision>;
  const B mb16(small_config());
  const H mh16(small_config());
  text_source src(40);
  mb::thread_pool pool(1);
  budget_alloc ab(1ull << 30), ah(1ull << 30);
  mb::trainer tb(mb16, effective, plan_none(mb16, 1), ab, pool, options());
  mb::trainer th(mh16, effective, plan_none(mh16, 1), ah, pool, options());
  run_steps(tb, src, 2);
  run_steps(th, src, 2);
  REQUIRE(tb.optimizer_bytes() == th.optimizer_bytes());  // the sizes alone cannot tell them apart
  REQUIRE(tb.model().weight_bytes() == th.model().weight_bytes());
  const std::string pb = temp_path("bf16.ckpt"), ph = temp_path("fp16.ckpt");
  tb.save(pb);
  th.save(ph);
  refused(th, pb, "storage", "bf16", "fp16");
  refused(tb, ph, "storage", "fp16", "bf16");
  try {
    th.load(pb);
  } catch (const mb::checkpoint_mismatch& e) {
    MESSAGE(std::string(e.what()));
  }
  // Each loads into its own kind and trains on with finite losses.
  CHECK_NOTHROW(th.load(ph));
  CHECK_NOTHROW(tb.load(pb));
  for (int k = 0; k < 3; ++k) {
    CHECK(std::isfinite(tb.step(src).loss));
    CHECK(std::isfinite(th.step(src).loss));
  }
  std::filesystem::remove(pb);
  std::filesystem::remove(ph);
}

TEST_CASE("trainer: fp32 and fp64 accumulation (same storage, same bytes) do not load into each other") {
  using P32 = mb::fp32_precision;
  using P64 = mb::precision<float, double>;
  using one32 = mb::model<mb::embedding<P32>, mb::block<mb::attention<P32>>, mb::lm_head<P32>>;
  using one64 = mb::model<mb::embedding<P64>, mb::block<mb::attention<P64>>, mb::lm_head<P64>>;
  const one32 m32(small_config());
  const one64 m64(small_config());
  mb::thread_pool pool(1);
  budget_alloc a32(1ull << 30), a64(1ull << 30);
  mb::trainer t32(m32, effective, plan_none(m32, 1), a32, pool, options());
  mb::trainer t64(m64, effective, plan_none(m64, 1), a64, pool, options());
  REQUIRE(t32.optimizer_bytes() == t64.optimizer_bytes());
  const std::string p32 = temp_path("acc32.ckpt"), p64 = temp_path("acc64.ckpt");
  t32.save(p32);
  t64.save(p64);
  refused(t32, p64, "accumulation", "fp64", "fp32");
  refused(t64, p32, "accumulation", "fp32", "fp64");
  std::filesystem::remove(p32);
  std::filesystem::remove(p64);
}

TEST_CASE("trainer: a checkpoint of other blocks (family, math-changing policy, order, depth) is refused by block") {
  using P = mb::fp32_precision;
  using M = mixed<P>;
  const M base(small_config(), {mixers::ttt, mixers::attn, mixers::mamba, mixers::attn});
  mb::thread_pool pool(1);
  budget_alloc a(1ull << 30);
  mb::trainer t(base, effective, plan_none(base, 1), a, pool, options());
  text_source src(40);
  run_steps(t, src, 1);
  const std::string path = temp_path("blocks.ckpt");
  struct change {
    std::vector<std::size_t> pattern;
    const char* field;
    const char* saved;
  };
  const change changes[] = {
      {{mixers::ttt_mlp, mixers::attn, mixers::mamba, mixers::attn}, "blocks.0",
       "ttt_mlp<fp32/fp32, mini-batch 16, no gate> + swiglu<fp32/fp32>"},
      {{mixers::ttt_mini_batch_8, mixers::attn, mixers::mamba, mixers::attn}, "blocks.0",
       "ttt_linear<fp32/fp32, mini-batch 8, no gate> + swiglu<fp32/fp32>"},
      {{mixers::ttt, mixers::attn_tiles_32, mixers::mamba, mixers::attn}, "blocks.1",
       "attention<fp32/fp32, tiles 32x32, causal, rope> + swiglu<fp32/fp32>"},
      {{mixers::ttt, mixers::attn, mixers::mamba_chunk_8, mixers::attn}, "blocks.2",
       "mamba<fp32/fp32, scan chunk 8, d_state 16, d_conv 4, expand 2> + swiglu<fp32/fp32>"},
      {{mixers::ttt, mixers::mamba, mixers::attn, mixers::attn}, "blocks.1", nullptr},
      {{mixers::ttt, mixers::attn, mixers::mamba}, "depth", "3"},
      {{mixers::ttt, mixers::attn, mixers::mamba, mixers::attn, mixers::attn}, "depth", "5"},
  };
  for (const change& ch : changes) {
    save_fresh(M(small_config(), ch.pattern), effective, path);
    refused(t, path, ch.field, ch.saved == nullptr ? std::string{} : ch.saved);
  }
  std::filesystem::remove(path);
}

TEST_CASE("trainer: blocks that compute the same load each other: another C++ type, a memory-only policy") {
  // The identity is what a block computes, not its C++ type: hybrid's checkpoint resumes in a
  // block_pattern model of the same blocks, and in one whose blocks keep more (save_all,
  // state groups of 1), and every run continues bit for bit.
  using P = mb::fp32_precision;
  const hybrid<P> h(small_config());
  const mixed<P> same(small_config(), {mixers::ttt, mixers::attn, mixers::mamba, mixers::attn});
  const mixed<P> kept(small_config(), {mixers::ttt_groups_1, mixers::attn_save_all, mixers::mamba_save_all,
                                       mixers::attn_save_all});
  const text_source src(40);
  mb::thread_pool pool(2);
  budget_alloc a0(1ull << 30), a1(1ull << 30), a2(1ull << 30);
  mb::trainer th(h, effective, plan_none(h, 2), a0, pool, options());
  auto s0 = src;
  run_steps(th, s0, 2);
  const std::string path = temp_path("identity.ckpt");
  th.save(path);
  const std::vector<double> want = run_steps(th, s0, 3);

  mb::trainer ts(same, effective, plan_none(same, 2), a1, pool, options(7));
  mb::trainer tk(kept, effective, plan_none(kept, 2), a2, pool, options(8));
  CHECK(tk.plan().peak_bytes > th.plan().peak_bytes);  // kept really keeps more
  CHECK(ts.load(path));
  CHECK(tk.load(path));
  auto s1 = src, s2 = src;
  run_steps(th, s1, 0);
  // The sources are stateless (windows from the request's random bits): the loaded position and
  // generator give the same windows.
  CHECK(bits(run_steps(ts, s1, 3)) == bits(want));
  CHECK(bits(run_steps(tk, s2, 3)) == bits(want));
  CHECK(weight_bytes(ts) == weight_bytes(th));
  CHECK(weight_bytes(tk) == weight_bytes(th));
  std::filesystem::remove(path);
}

// ---- Plans: the trainer runs only its own ----------------------------------------------------------

namespace {

// The constructor and set_plan refuse p with invalid_argument("plan") whose text names `field`;
// set_plan leaves t exactly as it was, the constructor allocates nothing.
template <typename Trainer, typename Model>
void plan_refused(Trainer& t, const Model& m, const mb::training_plan& p, const std::string& field,
                  std::size_t threads) {
  CAPTURE(field);
  const trainer_state before(t);
  try {
    t.set_plan(p);
    FAIL("set_plan took a plan with a wrong " << field);
  } catch (const mb::invalid_argument& e) {
    CHECK(e.argument() == "plan");
    const std::string what = e.what();
    CHECK(what.find(field) != std::string::npos);
  }
  CHECK(trainer_state(t) == before);
  mb::thread_pool pool(threads);
  budget_alloc a(1ull << 30);
  try {
    mb::trainer fresh(m, effective, p, a, pool, options());
    FAIL("the constructor took a plan with a wrong " << field);
  } catch (const mb::invalid_argument& e) {
    CHECK(e.argument() == "plan");
    CHECK(std::string(e.what()).find(field) != std::string::npos);
  }
  CHECK(a.stats().requested == 0);
}

}  // namespace

TEST_CASE("trainer: a plan made for another model, precision or without the optimizer is refused") {
  using P = mb::fp32_precision;
  const hybrid<P> m(small_config());
  mb::thread_pool pool(2);
  budget_alloc a(1ull << 30);
  mb::trainer t(m, effective, plan_none(m, 2), a, pool, options());
  text_source src(40);
  run_steps(t, src, 1);
  mb::plan_options po;
  po.threads = 2;
  po.head_chunk = 64;
  std::size_t tried = 0;

  // optimizer = false: 2/3 of an fp32 AdamW run's persistent bytes are missing from its peak.
  mb::plan_options no_opt = po;
  no_opt.optimizer = false;
  plan_refused(t, m, mb::make_plan(m, effective, mb::schedules::none{}, no_opt), "plan.optimizer", 2);
  mb::fit_options fo;
  fo.threads = 2;
  fo.optimizer = false;
  plan_refused(t, m, mb::fit(m, effective, 1ull << 30, fo), "plan.optimizer", 2);
  tried += 2;
  // Another model of the same depth and batch: another width; other layer types; other
  // precision; the same weights but layers that keep more (save_all).
  mb::model_config wide = small_config();
  wide.width = 64;
  plan_refused(t, m, mb::make_plan(hybrid<P>(wide), effective, mb::schedules::none{}, po), "plan.weights", 2);
  const mixed<P> attn4(small_config(), {mixers::attn, mixers::attn, mixers::attn, mixers::attn});
  plan_refused(t, m, mb::make_plan(attn4, effective, mb::schedules::none{}, po), "plan.weights", 2);
  const hybrid<mb::bf16_precision> half(small_config());
  plan_refused(t, m, mb::make_plan(half, effective, mb::schedules::none{}, po), "plan.weights", 2);
  const mixed<P> kept(small_config(), {mixers::ttt, mixers::attn_save_all, mixers::mamba, mixers::attn_save_all});
  REQUIRE(kept.weight_bytes() == m.weight_bytes());
  plan_refused(t, m, mb::make_plan(kept, effective, mb::schedules::none{}, po), "plan.activations", 2);
  const mixed<P> chunked(small_config(), {mixers::ttt, mixers::attn, mixers::mamba_chunk_8, mixers::attn});
  REQUIRE(chunked.weight_bytes() == m.weight_bytes());
  // Mamba's scan in chunks of 8 keeps a state per chunk: the same weights, other bytes.
  plan_refused(t, m, mb::make_plan(chunked, effective, mb::schedules::none{}, po), "plan.", 2);
  tried += 5;
  MESSAGE(tried << " plans of other models refused");
}

TEST_CASE("trainer: a plan whose fields were edited by hand is refused, naming the field") {
  using P = mb::fp32_precision;
  const hybrid<P> m(small_config());
  mb::thread_pool pool(2);
  budget_alloc a(1ull << 30);
  mb::trainer t(m, effective, plan_none(m, 2), a, pool, options());
  text_source src(40);
  run_steps(t, src, 1);
  mb::plan_options po;
  po.threads = 2;
  po.head_chunk = 64;
  po.accumulation = 2;
  const mb::training_plan good = mb::make_plan(m, {2, effective.seq}, mb::schedules::every<2>{}, po);
  struct edit {
    const char* field;
    void (*apply)(mb::training_plan&);
  };
  const edit edits[] = {
      {"plan.peak_bytes", [](mb::training_plan& p) { p.peak_bytes -= 1; }},
      {"plan.peak_bytes", [](mb::training_plan& p) { p.peak_bytes += 4096; }},
      {"plan.peak_bytes", [](mb::training_plan& p) { p.peak_bytes = 0; }},
      {"plan.weights", [](mb::training_plan& p) { p.weights /= 2; }},
      {"plan.gradients", [](mb::training_plan& p) { p.gradients = 0; }},
      {"plan.optimizer", [](mb::training_plan& p) { p.optimizer = 0; }},
      {"plan.activations", [](mb::training_plan& p) { p.activations -= 64; }},
      {"plan.workspace", [](mb::training_plan& p) { p.workspace += 64; }},
      {"plan.peak_phase", [](mb::training_plan& p) { p.peak_phase = "embedding forward"; }},
      {"plan.forward_flops", [](mb::training_plan& p) { p.forward_flops *= 2; }},
      {"plan.recompute_flops", [](mb::training_plan& p) { p.recompute_flops = 0; }},
      {"plan.timeline", [](mb::training_plan& p) { p.timeline[3].peak -= 1; }},
      {"plan.timeline", [](mb::training_plan& p) { p.timeline.pop_back(); }},
      {"plan.ops", [](mb::training_plan& p) { p.ops.pop_back(); }},
      {"plan.ops", [](mb::training_plan& p) { std::swap(p.ops[0], p.ops[1]); }},
      // The schedule's label and its ops disagree: every<2>'s ops under "none".
      {"plan.ops", [](mb::training_plan& p) { p.schedule = {mb::schedule_choice::kind::none, 0}; }},
      {"plan.ops", [](mb::training_plan& p) { p.schedule = {mb::schedule_choice::kind::every, 3}; }},
      {"plan.ops", [](mb::training_plan& p) { p.ops.push_back({mb::chain_op_kind::loss, 4}); }},
      {"plan.head_chunk", [](mb::training_plan& p) { p.head_chunk = 0; }},
      // Another chunk changes the loss op's workspace, so the peak or timeline no longer match.
      {"plan.", [](mb::training_plan& p) { p.head_chunk = 16; }},
      {"threads", [](mb::training_plan& p) { p.threads = 1; }},
      {"threads", [](mb::training_plan& p) { p.threads = 0; }},
      {"plan.schedule", [](mb::training_plan& p) { p.schedule.k = static_cast<mb::schedule_choice::kind>(9); }},
      {"schedule every<0>", [](mb::training_plan& p) { p.schedule = {mb::schedule_choice::kind::every, 0}; }},
      {"plan.budget", [](mb::training_plan& p) { p.budget = p.peak_bytes - 1; }},
      {"effective batch", [](mb::training_plan& p) { p.micro.batch = 0; }},
      {"effective batch", [](mb::training_plan& p) { p.accumulation = 0; }},
      {"effective batch", [](mb::training_plan& p) { p.accumulation = 1; }},
      {"effective batch", [](mb::training_plan& p) { p.micro.seq = 8; }},
      // 2^63 + 2 sequences times 2 wraps around to 4 in 64 bits: the check divides.
      {"effective batch", [](mb::training_plan& p) { p.micro.batch = (std::size_t{1} << 63) + 2; }},
      {"plan.ops", [](mb::training_plan& p) { p.ops.clear(); }},
  };
  mb::training_plan lie = good;
  lie.peak_bytes /= 2;
  try {
    t.set_plan(lie);
  } catch (const mb::invalid_argument& e) {
    MESSAGE(std::string(e.what()));
  }
  for (const edit& e : edits) {
    mb::training_plan p = good;
    e.apply(p);
    const std::string field = e.field;
    // "no ops" has its own sentence; the others name the field.
    plan_refused(t, m, p, field == "plan.ops" && p.ops.empty() ? "ops" : field, 2);
  }
  MESSAGE(std::size(edits) << " edited plans refused");
  // The unedited plan is accepted, by both, and runs within its prediction.
  CHECK_NOTHROW(t.set_plan(good));
  budget_alloc fresh_a(1ull << 30);
  mb::trainer fresh(m, effective, good, fresh_a, pool, options());
  run_steps(fresh, src, 2);
  CHECK(fresh_a.stats().peak_requested <= fresh.largest_predicted_peak());
  CHECK(fresh.largest_predicted_peak() == good.peak_bytes);
}

TEST_CASE("trainer: plans made by fit or make_plan for this model are taken and run within their prediction") {
  using P = mb::fp32_precision;
  const hybrid<P> m(small_config());
  const text_source src(40);
  mb::thread_pool pool(2);
  mb::plan_options po;
  po.threads = 2;
  const mb::training_plan p0 = mb::make_plan(m, effective, mb::schedules::none{}, po);
  mb::fit_options fo;
  fo.threads = 2;
  // Tighter than the no-recompute plan: fit picks a schedule or a smaller micro-batch.
  const mb::training_plan tight = mb::fit(m, effective, p0.peak_bytes - 1, fo);
  REQUIRE(tight.peak_bytes < p0.peak_bytes);
  // The planner's DP for fit's micro-batch, under fit's peak.
  mb::plan_options same = po;
  same.accumulation = tight.accumulation;
  same.head_chunk = tight.head_chunk;
  const mb::training_plan dp =
      mb::make_plan(m, tight.micro, mb::schedules::budget{tight.peak_bytes}, same, tight.peak_bytes);
  for (const mb::training_plan* p : {&p0, &tight, &dp}) {
    CAPTURE(mb::plan_summary(*p));
    budget_alloc a(p->budget == 0 ? p->peak_bytes : p->budget);
    mb::trainer t(m, effective, *p, a, pool, options());
    auto s = src;
    for (const mb::step_result& r : {t.step(s), t.step(s)}) CHECK(r.replans.empty());
    CHECK(a.stats().peak_requested <= t.largest_predicted_peak());
    CHECK(t.largest_predicted_peak() == p->peak_bytes);
  }
}

// A planned caching stack (caching_options::planned) serves every request of the steps and of
// evaluations in the plan's micro-batches from the layout: the reserve is the layout's two
// segments, the prediction, and the bits are the unplanned stack's. Evaluation micro-batches in a
// row each restart at the layout's tail (caching_allocator::restart_tail).
TEST_CASE("trainer: on a planned stack, steps and evaluations follow the layout, the reserve as predicted") {
  using P = mb::fp32_precision;
  using planned_alloc = mb::budget_allocator<mb::caching_allocator<mb::system_allocator>>;
  const hybrid<P> m(small_config());
  const text_source src(40);
  mb::thread_pool pool(2);
  for (const std::size_t micro : {std::size_t{1}, std::size_t{2}, std::size_t{4}}) {
    CAPTURE(micro);
    mb::plan_options po;
    po.threads = 2;
    po.head_chunk = 64;
    po.accumulation = effective.batch / micro;
    const mb::training_plan p = mb::make_plan(m, mb::batch_shape{micro, effective.seq}, mb::schedules::none{}, po);
    mb::caching_options co;
    co.planned = true;
    planned_alloc a(std::size_t{1} << 30, co);
    budget_alloc flat_a(std::size_t{1} << 30);
    mb::trainer t(m, effective, p, a, pool, options());
    mb::trainer flat(m, effective, p, flat_a, pool, options());
    auto s = src, fs = src;
    for (int k = 0; k < 3; ++k) CHECK(t.step(s).loss == flat.step(fs).loss);
    auto es = src, fes = src;
    CHECK(t.evaluate(es, 8, 5) == flat.evaluate(fes, 8, 5));
    CHECK(t.step(s).loss == flat.step(fs).loss);
    const mb::memory_layout* l = mb::planned_layer(a)->layout();
    REQUIRE(l != nullptr);
    CHECK(l->tail_slots > 0);
    CHECK(a.stats().peak_reserved == l->prefix_extent + l->cycle_extent);
    CHECK(a.stats().peak_reserved == t.largest_predicted_reserve());
    CHECK(raw(t.weights(), m.weight_bytes()) == raw(flat.weights(), m.weight_bytes()));
  }
}

TEST_CASE("trainer: the plan load() restores is the trainer's own, made again for this model") {
  using P = mb::fp32_precision;
  const hybrid<P> m(small_config());
  mb::thread_pool pool(2);
  mb::plan_options po;
  po.threads = 2;
  po.head_chunk = 16;
  po.accumulation = 2;
  const mb::training_plan saved_plan = mb::make_plan(m, {2, effective.seq}, mb::schedules::binomial<2>{}, po);
  budget_alloc a1(1ull << 30), a2(1ull << 30);
  mb::trainer t1(m, effective, saved_plan, a1, pool, options());
  const std::string path = temp_path("plan.ckpt"), bad = temp_path("plan_bad.ckpt");
  t1.save(path);
  mb::trainer t2(m, effective, plan_none(m, 2), a2, pool, options());
  CHECK(t2.load(path));
  CHECK(t2.plan().ops == saved_plan.ops);
  CHECK(t2.plan().peak_bytes == saved_plan.peak_bytes);
  CHECK(t2.plan().optimizer == saved_plan.optimizer);
  // A plan section whose choices this trainer cannot make (a micro-batch that does not divide
  // the batch, an unknown schedule, a zero chunk) keeps the current plan, and loads the rest.
  std::size_t tried = 0;
  for (const std::array<std::uint64_t, 5>& pl : {std::array<std::uint64_t, 5>{3, 1, 16, 0, 0},
                                                 std::array<std::uint64_t, 5>{2, 2, 0, 0, 0},
                                                 std::array<std::uint64_t, 5>{2, 2, 16, 9, 0},
                                                 std::array<std::uint64_t, 5>{2, 2, 16, 2, 0},
                                                 std::array<std::uint64_t, 5>{0, 2, 16, 0, 0}}) {
    checkpoint_sections_of c(path);
    c["plan"] = std::string(reinterpret_cast<const char*>(pl.data()), sizeof pl);
    c.write(bad);
    budget_alloc a3(1ull << 30);
    const mb::training_plan current = plan_none(m, 2);
    mb::trainer t3(m, effective, current, a3, pool, options());
    CHECK_FALSE(t3.load(bad));
    CHECK(t3.plan().ops == current.ops);
    CHECK(t3.plan().peak_bytes == current.peak_bytes);
    ++tried;
  }
  MESSAGE(tried << " unusable saved plans kept out");
  std::filesystem::remove(path);
  std::filesystem::remove(bad);
}

TEST_CASE("trainer: decode runs over the current weights on the trainer's allocator and gives every byte back") {
  const hybrid<mb::fp32_precision> m(small_config());
  mb::thread_pool pool(2);
  budget_alloc a(1ull << 30);
  mb::trainer t(m, effective, plan_none(m, 2), a, pool, options());
  text_source src(40);
  run_steps(t, src, 1);  // weights that are not the initial ones
  const std::size_t held = a.stats().requested, V = m.config().vocab, L = 7;
  const std::vector<std::int32_t> tok{3, 17, 0, 39, 8, 8, 21};
  std::vector<double> logits(V), ref(V);
  t.decode(1, L, [&](auto& d) {
    CHECK(a.stats().requested == held + m.decode_state_bytes(1, L) + m.decode_workspace_bytes(1, L, 2));
    for (int pass = 0; pass < 2; ++pass) {  // the second after restart(): the same logits again
      for (std::size_t k = 0; k < L; ++k) {
        d.step(&tok[k], logits.data());
        t.next_token_logits(tok.data(), {1, k + 1}, ref.data());
        double err = 0, scale = 0;
        for (std::size_t v = 0; v < V; ++v) {
          err = std::max(err, std::abs(logits[v] - ref[v]));
          scale = std::max(scale, std::abs(ref[v]));
        }
        CHECK(err <= 1e-5 * scale);  // fp32, as test_decoding
      }
      CHECK(d.length() == L);
      d.restart();
      CHECK(d.length() == 0);
    }
  });
  CHECK(a.stats().requested == held);
  // Refused by name, nothing kept.
  CHECK_THROWS_WITH_AS(t.decode(1, 0, [](auto&) {}), doctest::Contains("max_len"), mb::invalid_argument);
  CHECK_THROWS_WITH_AS(t.decode(1, L, [](auto& d) { d.step(nullptr, nullptr); }), doctest::Contains("tokens"),
                       mb::invalid_argument);
  CHECK(a.stats().requested == held);
}
