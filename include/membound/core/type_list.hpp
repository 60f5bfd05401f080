// A list of types as a type: how a layer names its default policies (policy_set's Defaults).
#pragma once

#include <cstddef>

#include "membound/core/config.hpp"

MEMBOUND_NAMESPACE_BEGIN

template <typename... Ts>
struct type_list {
  static constexpr std::size_t size = sizeof...(Ts);
};

template <typename T>
inline constexpr bool is_type_list_v = false;
template <typename... Ts>
inline constexpr bool is_type_list_v<type_list<Ts...>> = true;

MEMBOUND_NAMESPACE_END
