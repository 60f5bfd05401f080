// Optimizer offload (planner.hpp: offload_options; trainer_options::host), on the CPU with two
// budgeted host arenas standing for the device and the host:
//   - the plan moves the optimizer's state off the device, to the byte: the device peak is the
//     in-place plan's less the state, the host peak the state plus two staging buckets (rounded
//     to the policy's granule, at most the parameters), and the table says so;
//   - fit() offloads only when nothing fits the device budget without it, and a host budget too
//     small is refused naming both budgets;
//   - an offloaded run equals the in-place run bit for bit (losses, weights, optimizer state) for
//     fp32 and bf16 storage (fp32 masters), adamw and adamw8bit, over many buckets; the measured
//     device and host peaks equal their predictions;
//   - checkpoints move between offloaded and in-place runs (the state's layout is the same);
//   - bad input: no host allocator, a host budget too small, a plan that disagrees with the
//     trainer's placement, an optimizer without update_range: typed errors naming the argument.
// Activation offload (offload_options::activations): under a tight budget the DP keeps block
// inputs in the host space and recomputes less; the run equals schedule none's bit for bit and
// both spaces' peaks are exact (with the optimizer offloaded too); a host budget too small plans
// without; fit() weighs the copies; a schedule that offloads needs a host space.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "membound/memory/budget.hpp"
#include "membound/memory/host_allocator_ref.hpp"
#include "membound/memory/system_allocator.hpp"
#include "membound/model/planner.hpp"
#include "membound/optimizer/adamw8bit.hpp"
#include "membound/shape/offload_chunks.hpp"
#include "membound/train/trainer.hpp"

#include "../support/small_models.hpp"
#include "../support/text_source.hpp"

namespace mb = membound;

namespace {

using membound_test::hybrid;
using membound_test::small_config;
using budget_alloc = mb::budget_allocator<mb::system_allocator>;

constexpr mb::batch_shape effective{4, 16};

using text_source = membound_test::text_source<effective.seq>;

mb::trainer_options options() {
  mb::trainer_options o;
  o.seed = 5;
  o.lr = mb::cosine_lr{1e-2, 1e-3, 2, 30};
  o.head_chunks = {64, 16};
  return o;
}

template <typename Opt, typename Model>
mb::plan_options plan_opts(const Model&, std::size_t threads, mb::offload_options off = {}) {
  mb::plan_options po;
  po.threads = threads;
  po.head_chunk = 64;
  po.optimizer_policy = mb::optimizer_of<Opt>();
  po.offload = off;
  return po;
}

std::vector<unsigned char> raw(const void* p, std::size_t bytes) {
  const auto* b = static_cast<const unsigned char*>(p);
  return {b, b + bytes};
}

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("membound_test_offload_" + name)).string();
}

// What a run leaves: the loss bits, the weights and the optimizer state.
struct run_result {
  std::vector<double> losses;
  std::vector<unsigned char> weights, state;
  std::size_t device_peak = 0, host_peak = 0;
};

template <typename P, typename Opt>
run_result train(const hybrid<P>& m, const mb::training_plan& p, std::size_t steps, mb::thread_pool& pool) {
  budget_alloc device(1ull << 30), host(1ull << 30);
  mb::trainer_options o = options();
  o.host = mb::host_allocator_ref(host);
  mb::trainer<hybrid<P>, budget_alloc, mb::null_monitor, mb::local_communicator, Opt> t(m, effective, p, device, pool, o);
  text_source src(40);
  run_result r;
  for (std::size_t k = 0; k < steps; ++k) r.losses.push_back(t.step(src).loss);
  r.weights = raw(t.weights(), m.weight_bytes());
  r.state = raw(t.optimizer_state(), t.optimizer_bytes());
  r.device_peak = device.stats().peak_requested;
  r.host_peak = host.stats().peak_requested;
  return r;
}

template <typename P, typename Opt>
void check_offload_equals_in_place(std::size_t bucket) {
  const hybrid<P> m(small_config());
  mb::thread_pool pool(2);
  const mb::training_plan in_place = mb::make_plan(m, effective, mb::schedules::every<2>{}, plan_opts<Opt>(m, 2));
  const mb::training_plan off =
      mb::make_plan(m, effective, mb::schedules::every<2>{}, plan_opts<Opt>(m, 2, {true, bucket, 0}));
  // The plan: the state leaves the device, to the byte, and nothing else moves.
  REQUIRE(off.offload_optimizer);
  CHECK(off.optimizer == 0);
  CHECK(off.host_optimizer == in_place.optimizer);
  CHECK(off.host_optimizer == Opt::state_bytes(m.parameter_elements()));
  CHECK(off.offload_bucket % Opt::range_granule == 0);
  CHECK(off.offload_bucket >= bucket);
  CHECK(off.offload_bucket < bucket + Opt::range_granule);
  CHECK(off.host_staging == 2 * off.offload_bucket * sizeof(typename P::storage_type));
  CHECK(off.peak_bytes == in_place.peak_bytes - in_place.optimizer);
  CHECK(off.ops == in_place.ops);
  const std::size_t buckets = (m.parameter_elements() + off.offload_bucket - 1) / off.offload_bucket;
  REQUIRE(buckets >= 3);  // several buckets, the last one partial
  CHECK(off.timeline.back().name.find("on the host: " + std::to_string(buckets) + " buckets") != std::string::npos);
  CHECK(off.table().find("offloaded: in the host space") != std::string::npos);
  CHECK(off.table().find("host peak") != std::string::npos);

  const run_result a = train<P, Opt>(m, in_place, 30, pool);
  const run_result b = train<P, Opt>(m, off, 30, pool);
  CHECK(raw(a.losses.data(), a.losses.size() * sizeof(double)) == raw(b.losses.data(), b.losses.size() * sizeof(double)));
  CHECK(a.weights == b.weights);
  CHECK(a.state == b.state);
  CHECK(a.losses.back() < a.losses.front());
  // Measured = predicted, in both spaces.
  CHECK(a.device_peak == in_place.peak_bytes);
  CHECK(a.host_peak == 0);
  CHECK(b.device_peak == off.peak_bytes);
  CHECK(b.host_peak == off.host_peak());
  MESSAGE("device peak " << a.device_peak << " B in place, " << b.device_peak << " B offloaded (+ " << b.host_peak
                         << " B on the host)");
}

}  // namespace

TEST_CASE("offload: fp32 adamw, offloaded in buckets of 1000, equals the in-place run bit for bit") {
  check_offload_equals_in_place<mb::fp32_precision, mb::adamw<float>>(1000);
}

TEST_CASE("offload: bf16 with fp32 masters equals the in-place run bit for bit") {
  check_offload_equals_in_place<mb::bf16_precision, mb::adamw<mb::bf16>>(777);
}

TEST_CASE("offload: adamw8bit's buckets are whole quantization blocks and equal the in-place run") {
  check_offload_equals_in_place<mb::bf16_precision, mb::adamw8bit<mb::bf16, 256>>(300);  // rounded to 512
}

TEST_CASE("offload: the chunks cover every parameter once, in granule multiples, each within its slot") {
  // Both backends walk these (the device overlaps a chunk's update with its neighbours' copies).
  for (const std::size_t granule : {std::size_t{1}, std::size_t{256}, std::size_t{2048}}) {
    for (const std::size_t buckets : {std::size_t{1}, std::size_t{2}, std::size_t{3}, std::size_t{7}}) {
      const std::size_t bucket = buckets * granule;
      for (const std::size_t n : {std::size_t{0}, std::size_t{1}, granule, bucket - 1, bucket, bucket + 1,
                                  5 * bucket + 3}) {
        const mb::offload_chunks k = mb::offload_chunks::of(n, bucket, granule);
        CHECK(k.slots == (buckets >= 2 ? 2u : 1u));
        std::size_t covered = 0;
        for (std::size_t c = 0; c < k.count; ++c) {
          CHECK(k.first(c) == covered);
          CHECK(k.first(c) % granule == 0);
          CHECK(k.size(c) > 0);
          const bool whole = k.size(c) % granule == 0 || k.first(c) + k.size(c) == n;
          CHECK(whole);
          CHECK(k.slot_offset(c) + k.size(c) <= bucket);  // inside one staging buffer
          const bool apart = c == 0 || k.slots == 1 || k.slot_offset(c) != k.slot_offset(c - 1);
          CHECK(apart);  // neighbours in different slots
          covered += k.size(c);
        }
        CHECK(covered == n);
      }
    }
  }
}

TEST_CASE("offload: the bucket is at most the parameters, and the default is 1 Mi parameters") {
  const hybrid<mb::fp32_precision> m(small_config());
  const mb::training_plan p =
      mb::make_plan(m, effective, mb::schedules::none{}, plan_opts<mb::adamw<float>>(m, 1, {true, 0, 0}));
  CHECK(mb::default_offload_bucket == (std::size_t{1} << 20));
  CHECK(p.offload_bucket == m.parameter_elements());  // the model is smaller than the default
  CHECK(p.timeline.back().name.find("1 buckets") != std::string::npos);
}

TEST_CASE("offload: fit() offloads only when nothing fits the device without it, under the host budget") {
  const hybrid<mb::fp32_precision> m(small_config());
  mb::fit_options fo;
  fo.threads = 1;
  fo.head_chunks = {64};
  std::size_t least_in_place = 0;
  try {
    (void)mb::fit(m, effective, 1, fo);
  } catch (const mb::budget_too_small& e) {
    least_in_place = e.minimum();
  }
  REQUIRE(least_in_place > 0);
  fo.offload = {true, 0, 1ull << 30};

  // Room for the state on the device: no offload.
  const mb::training_plan roomy = mb::fit(m, effective, least_in_place, fo);
  CHECK_FALSE(roomy.offload_optimizer);
  CHECK(roomy.budgeted_peak() <= least_in_place);

  // One byte less: only an offloaded plan fits, and fit takes one.
  const mb::training_plan tight = mb::fit(m, effective, least_in_place - 1, fo);
  CHECK(tight.offload_optimizer);
  CHECK(tight.budgeted_peak() <= least_in_place - 1);
  CHECK(tight.fits());
  CHECK(tight.host_peak() <= fo.offload.host_budget);

  // A host budget one byte short of the state and its buckets: refused naming both budgets.
  fo.offload.host_budget = tight.host_peak() - 1;
  try {
    (void)mb::fit(m, effective, least_in_place - 1, fo);
    FAIL("fit took a plan over the host budget");
  } catch (const mb::host_budget_too_small& e) {
    CHECK(e.argument() == "options.offload.host_budget");
    CHECK(e.host_minimum() == tight.host_peak());
    CHECK(std::string(e.what()).find("device budget") != std::string::npos);
  }

  // Without offload the tight budget is too small, naming the least in-place peak.
  fo.offload = {};
  CHECK_THROWS_AS((void)mb::fit(m, effective, least_in_place - 1, fo), mb::budget_too_small);
}

TEST_CASE("offload: fit() keeps the state in place under the budget before it looks under the line offloaded") {
  // A line (prefer_below) under which only an offloaded plan fits, and a budget an in-place plan
  // fits: when needed means not needed here.
  const hybrid<mb::fp32_precision> m(small_config());
  mb::fit_options fo;
  fo.threads = 1;
  fo.head_chunks = {64};
  std::size_t least_in_place = 0;
  try {
    (void)mb::fit(m, effective, 1, fo);
  } catch (const mb::budget_too_small& e) {
    least_in_place = e.minimum();
  }
  fo.offload = {true, 0, 0};
  fo.prefer_below = least_in_place - 1;
  const mb::training_plan p = mb::fit(m, effective, least_in_place, fo);
  CHECK_FALSE(p.offload_optimizer);
  CHECK(p.budget == least_in_place);
  // A host budget no offloaded plan fits does not stop the in-place answer, under the line or not.
  fo.offload.host_budget = 1;
  CHECK_FALSE(mb::fit(m, effective, least_in_place, fo).offload_optimizer);
  // fit_tokens: rows longer than the in-place ones fit only offloaded, and the host budget has no
  // room: the longest in-place row, not an error.
  fo.prefer_below = 0;
  fo.offload = {};
  std::size_t least_row = 0;  // the least in-place budget of one row of 16 tokens in 4 sequences
  try {
    (void)mb::fit(m, {1, 16, 4}, 1, fo);
  } catch (const mb::budget_too_small& e) {
    least_row = e.minimum();
  }
  fo.offload = {true, 0, 1};
  const mb::training_plan rows = mb::fit_tokens(m, 4096, 4, least_row, fo, 16);
  CHECK_FALSE(rows.offload_optimizer);
  CHECK(rows.micro.seq >= 16);
  fo.offload.host_budget = 0;  // with room on the host, longer rows fit offloaded
  CHECK(mb::fit_tokens(m, 4096, 4, least_row, fo, 16).micro.seq > rows.micro.seq);
}

TEST_CASE("offload: weighed, fit() takes offload when its copies cost less than the recompute it saves") {
  const hybrid<mb::fp32_precision> m(small_config());
  mb::fit_options fo;
  fo.threads = 1;
  fo.head_chunks = {64};
  // A budget where the in-place plans must recompute and an offloaded one need not.
  // The smallest micro-batch (1 sequence, 4 per step) without recompute, one byte short.
  const mb::training_plan none_in_place = mb::make_plan(m, {1, effective.seq}, mb::schedules::none{}, {1, 64, 4});
  const std::size_t budget = none_in_place.peak_bytes - 1;
  const mb::training_plan in_place = mb::fit(m, effective, budget, fo);
  REQUIRE(in_place.recompute_flops * static_cast<double>(in_place.accumulation) > 0);
  fo.offload = {true, 0, 0};
  fo.offload_mode = mb::fit_options::offload_choice::weighed;
  fo.offload_flops_per_byte = 0;  // a free link: offload wins as soon as it saves recompute
  const mb::training_plan cheap = mb::fit(m, effective, budget, fo);
  CHECK(cheap.offload_optimizer);
  CHECK(cheap.recompute_flops * static_cast<double>(cheap.accumulation) <
        in_place.recompute_flops * static_cast<double>(in_place.accumulation));
  // A link so slow that the copies cost more than any recompute: in place.
  fo.offload_flops_per_byte = 1e12;
  const mb::training_plan dear = mb::fit(m, effective, budget, fo);
  CHECK_FALSE(dear.offload_optimizer);
  CHECK(dear.recompute_flops == in_place.recompute_flops);
  // Room for everything: in place at equal (zero) cost.
  fo.offload_flops_per_byte = 0;
  CHECK_FALSE(mb::fit(m, effective, 1ull << 30, fo).offload_optimizer);
}

TEST_CASE("offload: a checkpoint moves between offloaded and in-place runs, bit for bit") {
  using P = mb::bf16_precision;
  using Opt = mb::adamw<mb::bf16>;
  const hybrid<P> m(small_config());
  mb::thread_pool pool(2);
  const mb::training_plan in_place = mb::make_plan(m, effective, mb::schedules::none{}, plan_opts<Opt>(m, 2));
  const mb::training_plan off =
      mb::make_plan(m, effective, mb::schedules::none{}, plan_opts<Opt>(m, 2, {true, 500, 0}));
  const run_result whole = train<P, Opt>(m, off, 12, pool);
  const std::string path = temp_path("resume.ckpt");
  for (const bool first_offloaded : {true, false}) {
    CAPTURE(first_offloaded);
    budget_alloc d1(1ull << 30), h1(1ull << 30), d2(1ull << 30), h2(1ull << 30);
    mb::trainer_options o1 = options(), o2 = options();
    o1.host = mb::host_allocator_ref(h1);
    o2.host = mb::host_allocator_ref(h2);
    text_source src(40);
    std::vector<double> losses;
    {
      mb::trainer t(m, effective, first_offloaded ? off : in_place, d1, pool, o1);
      for (int k = 0; k < 6; ++k) losses.push_back(t.step(src).loss);
      t.save(path);
    }
    mb::trainer t(m, effective, first_offloaded ? in_place : off, d2, pool, o2);
    REQUIRE(t.load(path));
    text_source src2(40);
    for (int k = 0; k < 6; ++k) losses.push_back(t.step(src2).loss);
    CHECK(raw(losses.data(), losses.size() * sizeof(double)) ==
          raw(whole.losses.data(), whole.losses.size() * sizeof(double)));
    CHECK(raw(t.weights(), m.weight_bytes()) == whole.weights);
  }
  std::filesystem::remove(path);
}

TEST_CASE("offload: bad input is refused by name, before anything is allocated") {
  using P = mb::fp32_precision;
  const hybrid<P> m(small_config());
  mb::thread_pool pool(1);
  const mb::training_plan off =
      mb::make_plan(m, effective, mb::schedules::none{}, plan_opts<mb::adamw<float>>(m, 1, {true, 1000, 0}));
  const mb::training_plan in_place =
      mb::make_plan(m, effective, mb::schedules::none{}, plan_opts<mb::adamw<float>>(m, 1));
  budget_alloc device(1ull << 30);

  SUBCASE("no host allocator") {
    try {
      mb::trainer t(m, effective, off, device, pool, options());
      FAIL("an offloaded plan ran without a host space");
    } catch (const mb::invalid_argument& e) {
      CHECK(e.argument() == "options.host");
    }
    CHECK(device.stats().requested == 0);
  }
  SUBCASE("a host budget below the host peak names both budgets") {
    budget_alloc host(off.host_peak() - 1);
    mb::trainer_options o = options();
    o.host = mb::host_allocator_ref(host);
    try {
      mb::trainer t(m, effective, off, device, pool, o);
      FAIL("an offloaded plan ran over its host budget");
    } catch (const mb::invalid_argument& e) {
      CHECK(e.argument() == "options.host");
      CHECK(std::string(e.what()).find("host budget") != std::string::npos);
      CHECK(std::string(e.what()).find("the device's: 1.00 GiB") != std::string::npos);
    }
    CHECK(device.stats().requested == 0);
    CHECK(host.stats().requested == 0);
  }
  SUBCASE("the trainer's own allocator as the host space") {
    mb::trainer_options o = options();
    o.host = mb::host_allocator_ref(device);
    try {
      mb::trainer t(m, effective, off, device, pool, o);
      FAIL("the state went to the device space unplanned");
    } catch (const mb::invalid_argument& e) {
      CHECK(e.argument() == "options.host");
    }
    CHECK(device.stats().requested == 0);
  }
  SUBCASE("a plan over its own host budget") {
    budget_alloc host(1ull << 30);
    mb::trainer_options o = options();
    o.host = mb::host_allocator_ref(host);
    const mb::training_plan over =
        mb::make_plan(m, effective, mb::schedules::none{}, plan_opts<mb::adamw<float>>(m, 1, {true, 1000, 1024}));
    CHECK_FALSE(over.fits());
    CHECK(over.device_fits());
    try {
      mb::trainer t(m, effective, over, device, pool, o);
      FAIL("a plan over its host budget ran");
    } catch (const mb::invalid_argument& e) {
      CHECK(e.argument() == "plan.host_budget");
    }
    CHECK(host.stats().requested == 0);
  }
  SUBCASE("a plan placed elsewhere than the trainer's state") {
    budget_alloc host(1ull << 30);
    mb::trainer_options o = options();
    o.host = mb::host_allocator_ref(host);
    mb::trainer t(m, effective, off, device, pool, o);
    const std::size_t before = device.stats().requested;
    try {
      t.set_plan(in_place);
      FAIL("set_plan moved the state");
    } catch (const mb::invalid_argument& e) {
      CHECK(e.argument() == "plan");
      CHECK(std::string(e.what()).find("plan.offload_optimizer") != std::string::npos);
    }
    CHECK(t.plan().offload_optimizer);
    CHECK(device.stats().requested == before);
  }
  SUBCASE("offload with the optimizer not counted, or a bucket policy without update_range") {
    mb::plan_options po = plan_opts<mb::adamw<float>>(m, 1, {true, 0, 0});
    po.optimizer = false;
    try {
      (void)mb::make_plan(m, effective, mb::schedules::none{}, po);
      FAIL("offloaded nothing");
    } catch (const mb::invalid_argument& e) {
      CHECK(e.argument() == "options.offload.optimizer");
    }
    po.optimizer = true;
    po.optimizer_policy.granule = 0;  // as optimizer_of gives a policy without update_range
    try {
      (void)mb::make_plan(m, effective, mb::schedules::none{}, po);
      FAIL("offloaded a policy that cannot update a range");
    } catch (const mb::invalid_argument& e) {
      CHECK(e.argument() == "options.offload.optimizer");
    }
  }
  SUBCASE("update_range outside whole blocks") {
    using O8 = mb::adamw8bit<float, 256>;
    const std::size_t n = 1000;
    std::vector<float> w(n, 1.0f), g(n, 0.5f);
    std::vector<std::byte> state(O8::state_bytes(n));
    O8::init(w.data(), n, state.data(), state.size());
    const std::vector<mb::param_span> spans{{0, n, true}};
    for (const auto& [first, count] : {std::pair<std::size_t, std::size_t>{100, 256}, {0, 300}, {768, 300}}) {
      CAPTURE(first);
      CAPTURE(count);
      CHECK_THROWS_AS(O8::update_range(w.data(), g.data(), state.data(), n, first, count, spans, {}, pool),
                      mb::invalid_argument);
    }
    // The last block ends at n: whole.
    CHECK_NOTHROW(O8::update_range(w.data() + 768, g.data() + 768, state.data(), n, 768, 232, spans, {}, pool));
  }
}

TEST_CASE("offload: an out-of-memory retries the step under a stricter plan that keeps the state on the host") {
  using P = mb::fp32_precision;
  using Opt = mb::adamw<float>;
  const hybrid<P> m(small_config());
  mb::thread_pool pool(1);
  const mb::training_plan off = mb::make_plan(m, effective, mb::schedules::none{}, plan_opts<Opt>(m, 1, {true, 1000, 0}));
  mb::plan_options po = plan_opts<Opt>(m, 1, {true, 1000, 0});
  const mb::training_plan full = mb::make_plan(m, effective, mb::schedules::full{}, po);
  REQUIRE(full.peak_bytes < off.peak_bytes);
  // Others take enough that `none` no longer fits but `full` does.
  const std::size_t limit = off.peak_bytes + 1024;
  const std::size_t foreign = limit - full.peak_bytes;
  REQUIRE(off.peak_bytes + foreign > limit);

  budget_alloc device(limit), host(1ull << 30);
  mb::trainer_options o = options();
  o.host = mb::host_allocator_ref(host);
  mb::trainer t(m, effective, off, device, pool, o);
  text_source src(40);
  std::vector<double> losses;
  losses.push_back(t.step(src).loss);
  device.set_external(foreign);
  const mb::step_result r = t.step(src);
  losses.push_back(r.loss);
  REQUIRE(!r.replans.empty());
  CHECK(r.replans.front().retried);
  CHECK(r.replans.front().reason.find("out of memory") == 0);
  // The stricter plan keeps the placement: the state never moved.
  CHECK(t.plan().offload_optimizer);
  CHECK(t.plan().peak_bytes + foreign <= limit);
  CHECK(host.stats().peak_requested == off.host_peak());
  for (int k = 0; k < 3; ++k) losses.push_back(t.step(src).loss);

  // The same run without the pressure, switching to that plan before step 2: the same bits.
  budget_alloc d2(1ull << 30), h2(1ull << 30);
  mb::trainer_options o2 = options();
  o2.host = mb::host_allocator_ref(h2);
  mb::trainer ref(m, effective, off, d2, pool, o2);
  text_source src2(40);
  std::vector<double> expected;
  expected.push_back(ref.step(src2).loss);
  ref.set_plan(t.plan());
  for (int k = 0; k < 4; ++k) expected.push_back(ref.step(src2).loss);
  CHECK(raw(losses.data(), losses.size() * sizeof(double)) == raw(expected.data(), expected.size() * sizeof(double)));
  CHECK(raw(t.weights(), m.weight_bytes()) == raw(ref.weights(), m.weight_bytes()));
}

// ---- Activation offload (offload_options::activations) ---------------------------------------

namespace {

mb::schedule_choice budget_schedule(std::size_t bytes) { return {mb::schedule_choice::kind::budget, bytes}; }

// The least-memory generated schedule's peak (Revolve with one slot): a budget where keeping
// block inputs on the device costs recompute.
template <typename Opt, typename Model>
std::size_t tight_budget(const Model& m, std::size_t threads, mb::batch_shape b = effective) {
  return mb::make_plan(m, b, mb::schedules::binomial<1>{}, plan_opts<Opt>(m, threads)).peak_bytes;
}

}  // namespace

TEST_CASE("activation offload: under a tight budget the DP keeps block inputs on the host, recomputes less, bit for bit") {
  using P = mb::fp32_precision;
  using Opt = mb::adamw<float>;
  const hybrid<P> m(small_config());
  mb::thread_pool pool(2);
  const std::size_t budget = tight_budget<Opt>(m, 2);
  const mb::training_plan in_place = mb::make_plan(m, effective, budget_schedule(budget), plan_opts<Opt>(m, 2));
  mb::offload_options act;
  act.activations = true;
  const mb::training_plan off = mb::make_plan(m, effective, budget_schedule(budget), plan_opts<Opt>(m, 2, act));
  REQUIRE(off.host_activations != 0);
  CHECK(!off.offload_optimizer);
  CHECK(off.offloads());
  CHECK(off.peak_bytes <= budget);
  CHECK(off.recompute_flops < in_place.recompute_flops);
  CHECK(off.offloaded_bytes % m.activation_bytes(effective) == 0);
  CHECK(off.host_activations % m.activation_bytes(effective) == 0);
  CHECK(off.host_peak() == off.host_activations);
  CHECK(off.offload_flops == 0);  // free by default
  CHECK(off.table().find("host space (activation offload)") != std::string::npos);
  bool out = false, back = false;
  for (const mb::plan_phase& ph : off.timeline) {
    out = out || ph.name.find("input to the host") != std::string::npos;
    back = back || ph.name.find("input back from the host") != std::string::npos;
  }
  CHECK(out);
  CHECK(back);
  MESSAGE("budget " << budget << " B: recompute " << in_place.recompute_flops << " FLOPs in place, "
                    << off.recompute_flops << " with " << off.host_activations << " B of block inputs on the host ("
                    << mb::to_string(off.ops) << ")");

  // The same bits as keeping everything, and both spaces' measured peaks as predicted.
  const mb::training_plan none = mb::make_plan(m, effective, mb::schedules::none{}, plan_opts<Opt>(m, 2));
  const run_result a = train<P, Opt>(m, none, 30, pool);
  const run_result b = train<P, Opt>(m, off, 30, pool);
  CHECK(raw(a.losses.data(), a.losses.size() * sizeof(double)) == raw(b.losses.data(), b.losses.size() * sizeof(double)));
  CHECK(a.weights == b.weights);
  CHECK(a.state == b.state);
  CHECK(b.device_peak == off.peak_bytes);
  CHECK(b.host_peak == off.host_peak());

  // With the optimizer offloaded too: the host holds both, and the peaks are still exact.
  mb::offload_options both = act;
  both.optimizer = true;
  both.bucket = 1000;
  const mb::training_plan two = mb::make_plan(m, effective, budget_schedule(budget - in_place.optimizer),
                                              plan_opts<Opt>(m, 2, both));
  REQUIRE(two.offload_optimizer);
  REQUIRE(two.host_activations != 0);
  CHECK(two.host_peak() == two.host_optimizer + two.host_staging + two.host_activations);
  CHECK(two.table().find("host space (optimizer and activation offload)") != std::string::npos);
  const run_result c = train<P, Opt>(m, two, 30, pool);
  CHECK(a.weights == c.weights);
  CHECK(a.state == c.state);
  CHECK(c.device_peak == two.peak_bytes);
  CHECK(c.host_peak == two.host_peak());
}

TEST_CASE("activation offload: a host budget too small for the block inputs plans without them") {
  using Opt = mb::adamw<float>;
  const hybrid<mb::fp32_precision> m(small_config());
  const std::size_t budget = tight_budget<Opt>(m, 1);
  const mb::training_plan in_place = mb::make_plan(m, effective, budget_schedule(budget), plan_opts<Opt>(m, 1));
  mb::offload_options act;
  act.activations = true;
  const mb::training_plan off = mb::make_plan(m, effective, budget_schedule(budget), plan_opts<Opt>(m, 1, act));
  REQUIRE(off.host_activations != 0);
  act.host_budget = off.host_activations - 1;
  const mb::training_plan small = mb::make_plan(m, effective, budget_schedule(budget), plan_opts<Opt>(m, 1, act));
  CHECK(small.host_activations == 0);
  CHECK(!small.offloads());
  CHECK(small.ops == in_place.ops);
  act.host_budget = off.host_activations;
  CHECK(mb::make_plan(m, effective, budget_schedule(budget), plan_opts<Opt>(m, 1, act)).ops == off.ops);
  // Generated schedules never offload.
  CHECK(mb::make_plan(m, effective, mb::schedules::binomial<1>{}, plan_opts<Opt>(m, 1, {false, 0, 0, true})).host_activations == 0);
}

TEST_CASE("activation offload: fit() takes it when it saves recompute, and not when its copies cost more") {
  using Opt = mb::adamw<float>;
  const hybrid<mb::fp32_precision> m(small_config());
  constexpr mb::batch_shape row{1, 64};  // one row: no smaller micro-batch to fall back on
  const std::size_t budget = tight_budget<Opt>(m, 1, row);
  mb::fit_options fo;
  fo.threads = 1;
  fo.head_chunks = {64};
  const mb::training_plan in_place = mb::fit(m, row, budget, fo);
  fo.offload.activations = true;
  const mb::training_plan off = mb::fit(m, row, budget, fo);
  CHECK(off.budgeted_peak() <= budget);
  CHECK(off.recompute_flops * static_cast<double>(off.accumulation) <
        in_place.recompute_flops * static_cast<double>(in_place.accumulation));
  CHECK(off.host_activations != 0);
  // A byte over the link priced above a whole forward pass: no copy is worth it.
  fo.offload_flops_per_byte = 1e12;
  const mb::training_plan dear = mb::fit(m, row, budget, fo);
  CHECK(dear.host_activations == 0);
  CHECK(dear.recompute_flops == in_place.recompute_flops);
}

TEST_CASE("activation offload: a price that is negative or not finite is refused by name") {
  using Opt = mb::adamw<float>;
  const hybrid<mb::fp32_precision> m(small_config());
  for (const double bad : {-1.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
    CAPTURE(bad);
    mb::offload_options act;
    act.activations = true;
    act.flops_per_byte = bad;
    try {
      (void)mb::make_plan(m, effective, budget_schedule(tight_budget<Opt>(m, 1)), plan_opts<Opt>(m, 1, act));
      FAIL("make_plan took a bad price");
    } catch (const mb::invalid_argument& e) {
      CHECK(e.argument() == "options.offload.flops_per_byte");
    }
    mb::fit_options fo;
    fo.offload.activations = true;
    fo.offload_flops_per_byte = bad;
    try {
      (void)mb::fit(m, effective, 1ull << 30, fo);
      FAIL("fit took a bad price");
    } catch (const mb::invalid_argument& e) {
      CHECK(e.argument() == "options.offload_flops_per_byte");
    }
  }
}

TEST_CASE("activation offload: a schedule that offloads needs a host space, refused by name before any allocation") {
  using P = mb::fp32_precision;
  using Opt = mb::adamw<float>;
  const hybrid<P> m(small_config());
  mb::thread_pool pool(1);
  mb::offload_options act;
  act.activations = true;
  const mb::training_plan off =
      mb::make_plan(m, effective, budget_schedule(tight_budget<Opt>(m, 1)), plan_opts<Opt>(m, 1, act));
  REQUIRE(off.host_activations != 0);
  budget_alloc device(1ull << 30);
  SUBCASE("the trainer") {
    try {
      mb::trainer t(m, effective, off, device, pool, options());
      FAIL("a plan that offloads ran without a host space");
    } catch (const mb::invalid_argument& e) {
      CHECK(e.argument() == "options.host");
      CHECK(std::string(e.what()).find("offloaded block inputs") != std::string::npos);
    }
    CHECK(device.stats().requested == 0);
  }
  SUBCASE("set_plan on a trainer without a host space") {
    mb::trainer t(m, effective, mb::make_plan(m, effective, mb::schedules::none{}, plan_opts<Opt>(m, 1)), device, pool,
                  options());
    const std::size_t held = device.stats().requested;
    try {
      t.set_plan(off);
      FAIL("set_plan took a plan that offloads without a host space");
    } catch (const mb::invalid_argument& e) {
      CHECK(e.argument() == "options.host");
    }
    CHECK(device.stats().requested == held);
    CHECK(t.plan().host_activations == 0);
  }
  SUBCASE("the model") {
    std::vector<float> w(m.parameter_elements()), g(m.parameter_elements());
    std::vector<std::int32_t> tokens(effective.tokens(), 1), targets(effective.tokens(), 2);
    try {
      (void)m.forward_backward(w.data(), g.data(), tokens.data(), targets.data(), off.micro, off.ops, off.head_chunk,
                               1.0, device, pool);
      FAIL("a schedule that offloads ran without a host space");
    } catch (const mb::invalid_argument& e) {
      CHECK(e.argument() == "host");
    }
    try {
      (void)m.forward_backward(w.data(), g.data(), tokens.data(), targets.data(), off.micro, off.ops, off.head_chunk,
                               1.0, device, pool, {}, nullptr, mb::host_allocator_ref(device));
      FAIL("a schedule that offloads ran with the device as its host space");
    } catch (const mb::invalid_argument& e) {
      CHECK(e.argument() == "host");
    }
    CHECK(device.stats().requested == 0);
  }
}
