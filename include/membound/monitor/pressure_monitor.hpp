// The pressure monitor: at chosen check points of a training step, compares a budget's usage with
// its limit, maps the fraction to a pressure level, and on a rising level runs that level's
// actions (a callback, releasing cached memory, asking the trainer for a stricter plan).
//
//   pressure_monitor<check_points<check_point::after_backward>> m;
//   m.check<check_point::after_backward>(budget);  // acts when usage crosses a threshold
//   m.check<check_point::before_forward>(budget);  // not in the set: compiles to `return level`
//   if (m.stricter_plan_requested()) { replan(); m.clear_stricter_plan_request(); }
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>

#include "membound/core/config.hpp"
#include "membound/core/error.hpp"
#include "membound/memory/allocator.hpp"
#include "membound/memory/trace.hpp"
#include "membound/core/check_point.hpp"
#include "membound/core/pressure_level.hpp"

MEMBOUND_NAMESPACE_BEGIN

// Fractions of the budget at which each level starts.
struct pressure_thresholds {
  double warning = 0.90;
  double critical = 0.95;
  double emergency = 0.97;
};

struct pressure_event {
  check_point point = check_point::before_forward;
  pressure_level previous = pressure_level::normal;
  pressure_level current = pressure_level::normal;
  std::size_t usage = 0;
  std::size_t limit = 0;
};

// What to do on entering a level from below.
struct pressure_actions {
  std::function<void(const pressure_event&)> callback;
  bool release_cached = false;         // on the budget, when its stack caches
  bool request_stricter_plan = false;  // sets the flag the trainer polls between steps
};

template <typename CheckPoints = all_check_points>
class pressure_monitor {
  static_assert(is_check_points_v<CheckPoints>,
                "membound: pressure_monitor takes a check_points<...> set, e.g. "
                "membound::all_check_points or check_points<check_point::after_backward>.");

 public:
  explicit pressure_monitor(pressure_thresholds thresholds = {})
      : thresholds_(validated(thresholds)) {
    actions_[index_of(pressure_level::critical)].release_cached = true;
    actions_[index_of(pressure_level::emergency)].release_cached = true;
    actions_[index_of(pressure_level::emergency)].request_stricter_plan = true;
  }

  const pressure_thresholds& thresholds() const noexcept { return thresholds_; }
  void set_thresholds(pressure_thresholds t) { thresholds_ = validated(t); }

  // Editable in place: m.actions(pressure_level::warning).callback = ...;
  pressure_actions& actions(pressure_level l) { return actions_[checked_level(l)]; }
  const pressure_actions& actions(pressure_level l) const { return actions_[checked_level(l)]; }
  void set_actions(pressure_level l, pressure_actions a) {
    actions_[checked_level(l)] = std::move(a);
  }

  // Level changes go to this recorder too; the recorder must outlive the monitor or be detached.
  void attach(trace_recorder& recorder) noexcept { recorder_ = &recorder; }
  void detach() noexcept { recorder_ = nullptr; }

  // The level for a usage fraction, without acting on it.
  pressure_level classify(std::size_t usage, std::size_t limit) const noexcept {
    if (limit == 0) return usage == 0 ? pressure_level::normal : pressure_level::emergency;
    // Exact at the thresholds: usage / limit is correctly rounded, as the threshold literals are.
    const double f = static_cast<double>(usage) / static_cast<double>(limit);
    if (f >= thresholds_.emergency) return pressure_level::emergency;
    if (f >= thresholds_.critical) return pressure_level::critical;
    if (f >= thresholds_.warning) return pressure_level::warning;
    return pressure_level::normal;
  }

  // At a check point outside CheckPoints this is `return level();` and nothing else.
  // A callback that throws leaves the new level entered and the remaining actions not run.
  template <check_point P, typename Budget>
  pressure_level check(Budget& budget) {
    if constexpr (!CheckPoints::contains(P)) {
      return level_;
    } else {
      static_assert(budgeted<Budget>,
                    "membound: pressure_monitor::check needs a budget: a type with "
                    "`std::size_t usage() const` and `std::size_t limit() const`, such as "
                    "budget_allocator<...> or an adaptor over one.");
      std::size_t usage = budget.usage();
      const std::size_t limit = budget.limit();
      const pressure_level next = classify(usage, limit);
      if (next == level_) return level_;
      const pressure_level previous = level_;
      enter(P, previous, next, usage, limit);
      if (next < previous) return level_;

      const pressure_actions& a = actions_[index_of(next)];
      if (a.callback) a.callback(pressure_event{P, previous, next, usage, limit});
      if (a.request_stricter_plan) {
        stricter_plan_requested_ = true;
        last_request_ = pressure_event{P, previous, next, usage, limit};
      }
      // Any budget with release_cached() qualifies (caching_allocator_like ones and plain fakes).
      if constexpr (requires { budget.release_cached(); }) {
        if (a.release_cached) {
          budget.release_cached();
          // Releasing may have brought usage under a threshold: record the drop, act on nothing.
          usage = budget.usage();
          const pressure_level after = classify(usage, limit);
          if (after < level_) enter(P, level_, after, usage, limit);
        }
      }
      return level_;
    }
  }

  pressure_level level() const noexcept { return level_; }
  bool stricter_plan_requested() const noexcept { return stricter_plan_requested_; }
  // Where, and at what usage (before any cache was released), the last request was made.
  const pressure_event& last_request() const noexcept { return last_request_; }
  void clear_stricter_plan_request() noexcept { stricter_plan_requested_ = false; }
  // How many times each level was entered (a change into it, up or down).
  std::uint64_t entered(pressure_level l) const noexcept { return entered_[index_of(l)]; }

 private:
  static pressure_thresholds validated(const pressure_thresholds& t) {
    static constexpr const char* rule =
        "Thresholds are fractions of the budget: 0 < warning < critical < emergency <= 1, "
        "e.g. 0.90, 0.95, 0.97";
    // Each value on its own first, so a NaN or out-of-range value is the one named.
    // Written as !(0 < v && v <= 1) so NaN fails too.
    const auto fraction = [](const char* name, double v) {
      if (!(v > 0.0 && v <= 1.0)) {
        throw invalid_argument(name, "a fraction of the budget in (0, 1]", std::to_string(v), rule);
      }
    };
    fraction("warning", t.warning);
    fraction("critical", t.critical);
    fraction("emergency", t.emergency);
    // Out of order: the lower threshold of the pair is named.
    if (!(t.warning < t.critical)) {
      throw invalid_argument("warning", "below critical (" + std::to_string(t.critical) + ")",
                             std::to_string(t.warning), rule);
    }
    if (!(t.critical < t.emergency)) {
      throw invalid_argument("critical", "below emergency (" + std::to_string(t.emergency) + ")",
                             std::to_string(t.critical), rule);
    }
    return t;
  }

  static std::size_t checked_level(pressure_level l) {
    if (index_of(l) >= pressure_level_count) {
      throw invalid_argument("level", "one of pressure_level::normal, warning, critical, emergency",
                             std::to_string(index_of(l)), "Pass a pressure_level enumerator");
    }
    return index_of(l);
  }

  void enter(check_point p, pressure_level previous, pressure_level next, std::size_t usage,
             std::size_t limit) noexcept {
    if (recorder_ != nullptr) recorder_->record_pressure(p, previous, next, usage, limit);
    level_ = next;
    ++entered_[index_of(next)];
  }

  pressure_thresholds thresholds_;
  std::array<pressure_actions, pressure_level_count> actions_{};
  trace_recorder* recorder_ = nullptr;
  pressure_level level_ = pressure_level::normal;
  bool stricter_plan_requested_ = false;
  pressure_event last_request_{};
  std::array<std::uint64_t, pressure_level_count> entered_{};
};

MEMBOUND_NAMESPACE_END
