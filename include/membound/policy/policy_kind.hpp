// What makes a type a policy: a nested `using policy_kind = <kind tag>;`. A kind tag names one
// axis a layer can be configured along (precision, chunking, checkpoint), so that policy_set can
// pick one policy per axis. Declare kind tags with MEMBOUND_POLICY_KIND.
#pragma once

#include <concepts>
#include <cstddef>

#include "membound/core/config.hpp"

// Declares `struct tag` with `static constexpr const char* name` and the checks policy_set runs
// per kind. A macro because C++20 static_assert messages must be string literals: `tag::name`
// cannot be read into a message, so the name is pasted into each sentence here instead.
#define MEMBOUND_POLICY_KIND(tag, kind_name)                                                    \
  struct tag {                                                                                  \
    static constexpr const char* name = kind_name;                                              \
    template <std::size_t Given>                                                                \
    static consteval bool check_at_most_one() {                                                 \
      static_assert(Given <= 1, "membound: at most one policy per kind: two " kind_name        \
                                " policies were given; keep one.");                             \
      return Given <= 1;                                                                        \
    }                                                                                           \
    template <bool Accepted>                                                                    \
    static consteval bool check_accepted() {                                                    \
      static_assert(Accepted, "membound: this layer does not accept a " kind_name              \
                              " policy; remove it from the layer's policies.");                 \
      return Accepted;                                                                          \
    }                                                                                           \
  }

MEMBOUND_NAMESPACE_BEGIN

// A tag declared with MEMBOUND_POLICY_KIND (or one that spells the same members).
template <typename K>
concept policy_kind_tag = requires {
  { K::name } -> std::convertible_to<const char*>;
  { K::template check_at_most_one<1>() } -> std::same_as<bool>;
  { K::template check_accepted<true>() } -> std::same_as<bool>;
};

template <typename P>
concept policy = requires { typename P::policy_kind; } && policy_kind_tag<typename P::policy_kind>;

MEMBOUND_NAMESPACE_END
