// Human-readable byte counts and numbers for messages, tables, logs and identities.
#pragma once

#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

#include "membound/core/config.hpp"

MEMBOUND_NAMESPACE_BEGIN

// A whole number held in a double (can_implement's `actual`, a packing check's) as text, signed:
// a negative offset is a value a caller can give, and converting it to size_t would be undefined.
inline std::string whole_text(double v) {
  return v < 0.0 ? std::to_string(static_cast<long long>(v)) : std::to_string(static_cast<std::size_t>(v));
}

// The shortest text that reads back as the same double ("1.25", "0.01", "1e-05").
inline std::string shortest_text(double v) {
  char buf[40];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

// "1.50 GiB (1610612736 B)": the binary unit for people, the exact count for tools and tests.
inline std::string format_bytes(std::size_t bytes, bool exact = true) {
  static constexpr const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 5) {
    value /= 1024.0;
    ++unit;
  }
  char buf[96];
  if (unit == 0) {
    std::snprintf(buf, sizeof buf, "%zu B", bytes);
  } else if (exact) {
    std::snprintf(buf, sizeof buf, "%.2f %s (%zu B)", value, units[unit], bytes);
  } else {
    std::snprintf(buf, sizeof buf, "%.2f %s", value, units[unit]);
  }
  return buf;
}

MEMBOUND_NAMESPACE_END
