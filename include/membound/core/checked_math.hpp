// Size arithmetic that cannot wrap: sums and products of byte and element counts saturate at
// SIZE_MAX, so an absurd model or shape becomes a size no budget holds (plans with it never fit)
// instead of a small wrapped-around number that seems to. Every size sum in the model, the
// planner and the optimizer goes through these; the layers' sizes use bytes_of (core/dtype.hpp),
// which saturates the same way.
#pragma once

#include <cstddef>
#include <limits>

#include "membound/core/config.hpp"

MEMBOUND_NAMESPACE_BEGIN

inline constexpr std::size_t size_max = std::numeric_limits<std::size_t>::max();

constexpr std::size_t sat_add(std::size_t a, std::size_t b) noexcept { return a > size_max - b ? size_max : a + b; }
template <typename... R>
constexpr std::size_t sat_add(std::size_t a, std::size_t b, R... rest) noexcept {
  return sat_add(sat_add(a, b), static_cast<std::size_t>(rest)...);
}
constexpr std::size_t sat_mul(std::size_t a, std::size_t b) noexcept {
  return b != 0 && a > size_max / b ? size_max : a * b;
}
constexpr std::size_t sat_sub(std::size_t a, std::size_t b) noexcept { return a > b ? a - b : 0; }
// Up to a multiple of `m` (> 0), saturating.
constexpr std::size_t sat_round_up(std::size_t n, std::size_t m) noexcept {
  const std::size_t r = n % m;
  return r == 0 ? n : sat_add(n, m - r);
}
// Whether a size saturated: it stands for "more than any address space", not a byte count.
constexpr bool saturated(std::size_t n) noexcept { return n == size_max; }

MEMBOUND_NAMESPACE_END
