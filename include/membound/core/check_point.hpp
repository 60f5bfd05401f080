// Where in a training step memory pressure is checked. A monitor checks only at the points in
// its compile-time set; a check at any other point compiles to nothing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <type_traits>

#include "membound/core/config.hpp"

MEMBOUND_NAMESPACE_BEGIN

enum class check_point : std::uint8_t {
  before_forward,
  after_forward,
  before_backward,
  after_backward,
  after_optimizer_step,
};

inline constexpr std::size_t check_point_count = 5;

constexpr std::string_view to_string(check_point p) noexcept {
  switch (p) {
    case check_point::before_forward: return "before_forward";
    case check_point::after_forward: return "after_forward";
    case check_point::before_backward: return "before_backward";
    case check_point::after_backward: return "after_backward";
    case check_point::after_optimizer_step: return "after_optimizer_step";
  }
  return "invalid";
}

// A set of check points as a type, so membership is known at compile time.
template <check_point... Points>
struct check_points {
  static constexpr std::size_t size = sizeof...(Points);
  static constexpr bool contains(check_point p) noexcept { return ((p == Points) || ...); }
};

using all_check_points =
    check_points<check_point::before_forward, check_point::after_forward,
                 check_point::before_backward, check_point::after_backward,
                 check_point::after_optimizer_step>;

// After backward is where activations and gradients coexist: the usual single check.
using peak_check_points = check_points<check_point::after_forward, check_point::after_backward>;

// The observer a step takes when nobody watches its check points.
struct ignore_check_points {
  constexpr void operator()(check_point) const noexcept {}
};

template <typename T>
struct is_check_points : std::false_type {};
template <check_point... Points>
struct is_check_points<check_points<Points...>> : std::true_type {};
template <typename T>
inline constexpr bool is_check_points_v = is_check_points<T>::value;

MEMBOUND_NAMESPACE_END
