// A pressure monitor that first looks at what others hold. At each check point of the inner
// monitor's set it asks a probe how many bytes of the budget's memory are held outside the
// budget's stack (another process on a shared GPU, another library), sets them as the budget's
// external bytes, then runs the inner monitor's check: so usage() at that check point is the
// memory's real state, and a trainer that sees an emergency retries under a plan that fits
// beside the others (their bytes are the budget's external bytes, which the retry subtracts).
//
//   membound::foreign_memory_monitor mon(membound::pressure_monitor<>{},
//                                        membound::device_others_probe{device});  // cuda_memory_info.cuh
//   membound::trainer t(model, batch, plan, budget, ex, opts, std::move(mon));
//
// The probe is `std::size_t probe(const Budget&)`. When the others' bytes leave less room than
// the stack already holds, the budget refuses them (set_external throws out_of_memory); the
// monitor then records as much as the budget takes (usage = limit: an emergency) instead of
// throwing, so a check point never fails a step that has already updated the weights.
#pragma once

#include <cstddef>
#include <utility>

#include "membound/core/check_point.hpp"
#include "membound/core/config.hpp"
#include "membound/core/error.hpp"
#include "membound/core/pressure_level.hpp"
#include "membound/memory/allocator.hpp"

MEMBOUND_NAMESPACE_BEGIN

template <typename Inner, typename Probe>
class foreign_memory_monitor {
 public:
  foreign_memory_monitor(Inner inner, Probe probe) : inner_(std::move(inner)), probe_(std::move(probe)) {}

  template <check_point P, typename Budget>
  pressure_level check(Budget& budget) {
    static_assert(detail::has_set_external<Budget> && detail::has_external<Budget>,
                  "membound: foreign_memory_monitor sets the budget's external bytes: give the trainer a "
                  "budget_allocator<...> (or an adaptor over one).");
    const std::size_t others = probe_(std::as_const(budget));
    try {
      budget.set_external(others);
    } catch (const out_of_memory&) {
      // All the room there is (set_external released the cache first): usage = limit.
      budget.set_external(budget.external() + budget.headroom());
    }
    ++probes_;
    return inner_.template check<P>(budget);
  }

  pressure_level level() const noexcept { return inner_.level(); }
  bool stricter_plan_requested() const noexcept { return inner_.stricter_plan_requested(); }
  void clear_stricter_plan_request() noexcept { inner_.clear_stricter_plan_request(); }
  // What the trainer asks of a pressure monitor, where the inner one has it: its thresholds (a
  // stricter plan aims under the emergency line) and where its last request began.
  decltype(auto) thresholds() const noexcept
    requires requires(const Inner& i) { i.thresholds(); }
  {
    return inner_.thresholds();
  }
  decltype(auto) last_request() const noexcept
    requires requires(const Inner& i) { i.last_request(); }
  {
    return inner_.last_request();
  }
  Inner& inner() noexcept { return inner_; }
  const Inner& inner() const noexcept { return inner_; }
  Probe& probe() noexcept { return probe_; }
  // How many times the probe was read.
  std::size_t probes() const noexcept { return probes_; }

 private:
  Inner inner_;
  Probe probe_;
  std::size_t probes_ = 0;
};

MEMBOUND_NAMESPACE_END
