// How close usage is to the budget, in four steps a trainer can act on.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "membound/core/config.hpp"

MEMBOUND_NAMESPACE_BEGIN

// Ordered: a higher value is closer to the budget, so levels compare with < and >.
enum class pressure_level : std::uint8_t { normal, warning, critical, emergency };

inline constexpr std::size_t pressure_level_count = 4;

constexpr std::size_t index_of(pressure_level l) noexcept { return static_cast<std::size_t>(l); }

constexpr std::string_view to_string(pressure_level l) noexcept {
  switch (l) {
    case pressure_level::normal: return "normal";
    case pressure_level::warning: return "warning";
    case pressure_level::critical: return "critical";
    case pressure_level::emergency: return "emergency";
  }
  return "invalid";
}

MEMBOUND_NAMESPACE_END
