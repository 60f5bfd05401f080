#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "../support/fake_caching_allocator.hpp"
#include "membound/memory/budget.hpp"
#include "membound/memory/caching_allocator.hpp"
#include "membound/memory/system_allocator.hpp"
#include "membound/memory/trace.hpp"
#include "membound/core/check_point.hpp"
#include "membound/monitor/null_monitor.hpp"
#include "membound/monitor/pressure_monitor.hpp"

using namespace membound;
using membound_test::fake_caching_allocator;

namespace {

// A budget reduced to what the monitor reads.
struct fake_budget {
  std::size_t used = 0;
  std::size_t cap = 1000;
  std::size_t usage() const noexcept { return used; }
  std::size_t limit() const noexcept { return cap; }
};
static_assert(budgeted<fake_budget>);

// A static-storage budget: its address is a constant, so it may be passed in a constant
// expression (its value is never read).
budget_allocator<system_allocator> global_budget(1024);

struct with_monitor {
  int step;
  [[no_unique_address]] null_monitor monitor;
};
struct without_monitor {
  int step;
};

}  // namespace

// --- check point sets -------------------------------------------------------------------------
using backward_only = check_points<check_point::after_backward>;
static_assert(backward_only::contains(check_point::after_backward));
static_assert(!backward_only::contains(check_point::before_forward));
static_assert(backward_only::size == 1);
static_assert(all_check_points::size == check_point_count);
static_assert(all_check_points::contains(check_point::after_optimizer_step));
static_assert(!check_points<>::contains(check_point::after_forward));
static_assert(is_check_points_v<all_check_points> && !is_check_points_v<int>);
static_assert(to_string(check_point::before_backward) == "before_backward");
static_assert(to_string(pressure_level::emergency) == "emergency");
static_assert(pressure_level::warning < pressure_level::critical);

// --- null_monitor costs nothing ---------------------------------------------------------------
static_assert(std::is_empty_v<null_monitor>);
static_assert(std::is_trivially_copyable_v<null_monitor>);
static_assert(sizeof(with_monitor) == sizeof(without_monitor));
// Usable in a constant expression: no side effects, nothing left at run time.
static_assert(null_monitor::check<check_point::after_backward>(global_budget) ==
              pressure_level::normal);
static_assert(noexcept(null_monitor::check<check_point::after_forward>(global_budget)));
constexpr bool null_check_in_constexpr_function() {
  fake_budget b{999, 1000};
  null_monitor m;
  return m.check<check_point::after_forward>(b) == pressure_level::normal &&
         !m.stricter_plan_requested() && m.level() == pressure_level::normal;
}
static_assert(null_check_in_constexpr_function());

TEST_CASE("null_monitor: never reports pressure") {
  budget_allocator<system_allocator> b(100);
  void* p = b.allocate(100, 64, memory_tag::weights);
  null_monitor m;
  CHECK(m.check<check_point::after_backward>(b) == pressure_level::normal);
  trace_recorder rec(4);
  m.attach(rec);
  CHECK(rec.size() == 0);
  b.deallocate(p, 100, 64, memory_tag::weights);
}

TEST_CASE("pressure_monitor: levels start exactly at the thresholds") {
  pressure_monitor<> m;
  CHECK(m.classify(0, 1000) == pressure_level::normal);
  CHECK(m.classify(899, 1000) == pressure_level::normal);
  CHECK(m.classify(900, 1000) == pressure_level::warning);
  CHECK(m.classify(949, 1000) == pressure_level::warning);
  CHECK(m.classify(950, 1000) == pressure_level::critical);
  CHECK(m.classify(969, 1000) == pressure_level::critical);
  CHECK(m.classify(970, 1000) == pressure_level::emergency);
  CHECK(m.classify(1000, 1000) == pressure_level::emergency);
  CHECK(m.classify(1200, 1000) == pressure_level::emergency);
  CHECK(m.classify(1, 0) == pressure_level::emergency);

  // The same through check(), which also counts entries per level.
  fake_budget b;
  for (std::size_t used : {899u, 900u, 950u, 970u, 969u, 0u}) {
    b.used = used;
    (void)m.check<check_point::after_forward>(b);
    CHECK(m.level() == m.classify(used, 1000));
  }
  CHECK(m.entered(pressure_level::normal) == 1);  // the start is not an entry
  CHECK(m.entered(pressure_level::warning) == 1);
  CHECK(m.entered(pressure_level::critical) == 2);
  CHECK(m.entered(pressure_level::emergency) == 1);

  // Custom thresholds.
  pressure_monitor<> t(pressure_thresholds{0.5, 0.6, 1.0});
  CHECK(t.classify(499, 1000) == pressure_level::normal);
  CHECK(t.classify(500, 1000) == pressure_level::warning);
  CHECK(t.classify(999, 1000) == pressure_level::critical);
  CHECK(t.classify(1000, 1000) == pressure_level::emergency);
}

TEST_CASE("pressure_monitor: check points outside the set do nothing") {
  pressure_monitor<backward_only> m;
  int calls = 0;
  m.actions(pressure_level::emergency).callback = [&](const pressure_event&) { ++calls; };
  fake_budget b{990, 1000};
  CHECK(m.check<check_point::before_forward>(b) == pressure_level::normal);
  CHECK(m.check<check_point::after_forward>(b) == pressure_level::normal);
  CHECK(m.check<check_point::after_optimizer_step>(b) == pressure_level::normal);
  CHECK(m.level() == pressure_level::normal);
  CHECK(m.entered(pressure_level::emergency) == 0);
  CHECK(calls == 0);
  CHECK_FALSE(m.stricter_plan_requested());

  CHECK(m.check<check_point::after_backward>(b) == pressure_level::emergency);
  CHECK(calls == 1);
  // Outside the set, the current level is returned, not re-measured.
  b.used = 0;
  CHECK(m.check<check_point::before_forward>(b) == pressure_level::emergency);
  CHECK(m.check<check_point::after_backward>(b) == pressure_level::normal);
}

TEST_CASE("pressure_monitor: rising levels run their actions, falling ones do not") {
  // Budget 10 KiB over a caching fake with 1 KiB blocks.
  budget_allocator<fake_caching_allocator> b(10240, std::size_t{1024});
  trace_recorder rec(32);
  pressure_monitor<> m;
  m.attach(rec);
  std::vector<pressure_event> seen;
  for (pressure_level l : {pressure_level::warning, pressure_level::critical,
                           pressure_level::emergency}) {
    m.actions(l).callback = [&](const pressure_event& e) { seen.push_back(e); };
  }
  CHECK_FALSE(m.actions(pressure_level::warning).release_cached);
  CHECK(m.actions(pressure_level::critical).release_cached);
  CHECK_FALSE(m.actions(pressure_level::critical).request_stricter_plan);
  CHECK(m.actions(pressure_level::emergency).release_cached);
  CHECK(m.actions(pressure_level::emergency).request_stricter_plan);

  std::vector<void*> ps;
  for (int i = 0; i < 9; ++i) ps.push_back(b.allocate(1024, 64, memory_tag::activations));

  // 9216 / 10240 = 0.9: warning. No release, no flag.
  CHECK(m.check<check_point::after_forward>(b) == pressure_level::warning);
  REQUIRE(seen.size() == 1);
  CHECK(seen[0].point == check_point::after_forward);
  CHECK(seen[0].previous == pressure_level::normal);
  CHECK(seen[0].current == pressure_level::warning);
  CHECK(seen[0].usage == 9216);
  CHECK(seen[0].limit == 10240);
  CHECK(b.upstream().release_calls() == 0);
  CHECK_FALSE(m.stricter_plan_requested());
  // Same level again: nothing.
  CHECK(m.check<check_point::before_backward>(b) == pressure_level::warning);
  CHECK(seen.size() == 1);

  // Full, with three blocks only cached: emergency, then the cache goes back and usage falls.
  ps.push_back(b.allocate(1024, 64, memory_tag::activations));
  for (int i = 0; i < 3; ++i) {
    b.deallocate(ps.back(), 1024, 64, memory_tag::activations);
    ps.pop_back();
  }
  CHECK(b.usage() == 10240);
  const memory_stats before = b.stats();
  CHECK(m.check<check_point::after_backward>(b) == pressure_level::normal);
  REQUIRE(seen.size() == 2);
  CHECK(seen[1].previous == pressure_level::warning);
  CHECK(seen[1].current == pressure_level::emergency);
  CHECK(seen[1].usage == 10240);
  CHECK(b.upstream().release_calls() == 1);
  CHECK(b.stats().upstream_deallocations == before.upstream_deallocations + 3);
  CHECK(b.usage() == 7168);
  CHECK(m.stricter_plan_requested());
  CHECK(m.entered(pressure_level::emergency) == 1);
  CHECK(m.entered(pressure_level::normal) == 1);

  m.clear_stricter_plan_request();
  CHECK_FALSE(m.stricter_plan_requested());

  // Falling levels are recorded but run nothing: back up to critical, then down by freeing.
  ps.push_back(b.allocate(1024, 64, memory_tag::activations));
  ps.push_back(b.allocate(1024, 64, memory_tag::activations));
  // 9 KiB of 10 KiB is 0.9; external bytes bring it to 0.95, a rise from normal to critical.
  b.set_external(512);
  CHECK(b.usage() == 9728);
  CHECK(m.check<check_point::after_forward>(b) == pressure_level::critical);  // 0.95
  CHECK(seen.size() == 3);
  CHECK(b.upstream().release_calls() == 2);  // critical releases too (nothing cached here)
  CHECK_FALSE(m.stricter_plan_requested());
  b.set_external(0);
  CHECK(m.check<check_point::after_forward>(b) == pressure_level::warning);
  CHECK(seen.size() == 3);
  CHECK(b.upstream().release_calls() == 2);

  // Every change is in the trace, in order.
  std::vector<std::pair<pressure_level, pressure_level>> changes;
  for (const trace_event& e : rec.events()) {
    REQUIRE(e.kind == trace_event_kind::pressure);
    changes.emplace_back(e.previous, e.level);
  }
  using enum pressure_level;
  const std::vector<std::pair<pressure_level, pressure_level>> expected{
      {normal, warning}, {warning, emergency}, {emergency, normal}, {normal, critical},
      {critical, warning}};
  CHECK(changes == expected);
  CHECK(rec[1].point == check_point::after_backward);
  CHECK(rec[1].usage == 10240);
  CHECK(rec[2].usage == 7168);
  CHECK(rec[2].limit == 10240);

  m.detach();
  b.set_external(1000);
  (void)m.check<check_point::after_forward>(b);
  CHECK(rec.size() == expected.size());

  b.set_external(0);
  for (void* p : ps) b.deallocate(p, 1024, 64, memory_tag::activations);
}

TEST_CASE("pressure_monitor: over caching_allocator, the emergency release is observed") {
  budget_allocator<caching_allocator<>> b(4 << 20);
  pressure_monitor<backward_only> m;
  void* keep = b.allocate(1 << 20, 256, memory_tag::weights);     // segment A
  void* x = b.allocate(1 << 20, 256, memory_tag::activations);    // fills A
  void* tmp = b.allocate(1 << 20, 256, memory_tag::activations);  // segment B
  void* tmp2 = b.allocate(1 << 20, 256, memory_tag::activations); // fills B
  b.deallocate(tmp, 1 << 20, 256, memory_tag::activations);
  b.deallocate(tmp2, 1 << 20, 256, memory_tag::activations);      // B fully free, cached
  CHECK(b.usage() == 4u << 20);
  CHECK(m.check<check_point::after_backward>(b) == pressure_level::normal);  // after release
  CHECK(b.usage() == 2u << 20);
  CHECK(b.stats().upstream_deallocations == 1);
  CHECK(m.stricter_plan_requested());
  b.deallocate(x, 1 << 20, 256, memory_tag::activations);
  b.deallocate(keep, 1 << 20, 256, memory_tag::weights);
}

TEST_CASE("pressure_monitor: thresholds are validated and named") {
  auto field_of = [](pressure_thresholds t) -> std::string {
    try {
      pressure_monitor<> m(t);
    } catch (const invalid_argument& e) {
      return e.argument();
    }
    return "";
  };
  CHECK(field_of({0.0, 0.95, 0.97}) == "warning");
  CHECK(field_of({-0.1, 0.95, 0.97}) == "warning");
  CHECK(field_of({0.95, 0.95, 0.97}) == "warning");
  CHECK(field_of({std::nan(""), 0.95, 0.97}) == "warning");
  CHECK(field_of({0.90, 0.98, 0.97}) == "critical");
  CHECK(field_of({0.90, 0.95, 0.95}) == "critical");
  CHECK(field_of({0.90, 0.95, 1.01}) == "emergency");
  CHECK(field_of({0.90, 0.95, 1.0}).empty());
  CHECK(field_of({}).empty());

  pressure_monitor<> m;
  CHECK_THROWS_AS(m.set_thresholds({0.9, 0.8, 0.97}), invalid_argument);
  CHECK(m.thresholds().critical == 0.95);  // unchanged
  m.set_thresholds({0.5, 0.6, 0.7});
  CHECK(m.thresholds().warning == 0.5);
}

TEST_CASE("pressure_monitor: a bad threshold or level is named in a typed error") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  try {
    pressure_monitor<> m(pressure_thresholds{0.90, 0.95, nan});
    FAIL("expected invalid_argument");
  } catch (const invalid_argument& e) {
    CHECK(e.argument() == "emergency");  // the NaN one, not its neighbour
    CHECK(!e.what_to_do().empty());
  }
  try {
    pressure_monitor<> m(pressure_thresholds{0.90, 0.95, 2.0});
    FAIL("expected invalid_argument");
  } catch (const invalid_argument& e) {
    CHECK(e.argument() == "emergency");
  }
  pressure_monitor<> m;
  try {
    (void)m.actions(static_cast<pressure_level>(7));
    FAIL("expected invalid_argument");
  } catch (const invalid_argument& e) {
    CHECK(e.argument() == "level");
  }
}
