// The monitor that does nothing, at no cost: an empty type whose check is a constant, so a
// trainer holding it as [[no_unique_address]] pays neither bytes nor instructions.
#pragma once

#include "membound/core/config.hpp"
#include "membound/core/check_point.hpp"
#include "membound/core/pressure_level.hpp"

MEMBOUND_NAMESPACE_BEGIN

class trace_recorder;

struct null_monitor {
  template <check_point P, typename Budget>
  static constexpr pressure_level check(Budget&) noexcept {
    return pressure_level::normal;
  }
  // The rest of the monitor interface, so a trainer calls it without asking which monitor it has.
  static constexpr pressure_level level() noexcept { return pressure_level::normal; }
  static constexpr bool stricter_plan_requested() noexcept { return false; }
  static constexpr void clear_stricter_plan_request() noexcept {}
  static constexpr void attach(trace_recorder&) noexcept {}
  static constexpr void detach() noexcept {}
};

MEMBOUND_NAMESPACE_END
