// A layer's policies, in the style of dragonbox's policy holder: the layer names one default per
// kind, the user passes any policies in any order, and get<Kind> is the user's policy of that
// kind, else the default.
//
//   policy_set<type_list<fp32_precision, attention_tiles<64, 64>>, bf16_precision>
//       ::get<precision_kind>    is bf16_precision
//       ::get<chunking_kind>     is attention_tiles<64, 64>
//
//   template <typename... Policies>
//   struct attention {
//     using policies = policy_set<type_list<fp32_precision, attention_tiles<64, 64>, recompute>,
//                                 Policies...>;
//     using prec = get_policy<policies, precision_kind>;   // in a template, instead of
//                                                          // typename policies::template get<...>
//   };
//   attention<recompute, bf16_precision> a;   // order does not matter
//
// Each mistake stops the build with one sentence: a type that is not a policy, a policy of a
// kind the layer does not take, two policies of one kind.
#pragma once

#include <cstddef>
#include <type_traits>

#include "membound/core/config.hpp"
#include "membound/core/type_list.hpp"
#include "membound/policy/policy_kind.hpp"

MEMBOUND_NAMESPACE_BEGIN

namespace detail {

// The kind of anything that is not a policy, so that after the first sentence the remaining
// checks and get<> still compile instead of cascading errors.
struct not_a_policy_kind {};

template <typename P>
struct kind_of {
  using type = not_a_policy_kind;
};
template <policy P>
struct kind_of<P> {
  using type = typename P::policy_kind;
};
template <typename P>
using kind_of_t = typename kind_of<P>::type;

template <typename Kind, typename... Ps>
inline constexpr std::size_t count_of_kind =
    (std::size_t{0} + ... + std::size_t{std::is_same_v<kind_of_t<Ps>, Kind>});

// The first of Ps whose kind is Kind, else Fallback. Only the chosen branch is instantiated.
template <typename Kind, typename Fallback, typename... Ps>
struct first_of_kind : std::type_identity<Fallback> {};
template <typename Kind, typename Fallback, typename P, typename... Ps>
struct first_of_kind<Kind, Fallback, P, Ps...>
    : std::conditional_t<std::is_same_v<kind_of_t<P>, Kind>, std::type_identity<P>,
                         first_of_kind<Kind, Fallback, Ps...>> {};

template <typename Policy>
consteval bool check_policy() {
  // `Policy` is named in the compiler's "In instantiation of ... [with Policy = ...]" line.
  static_assert(requires { typename Policy::policy_kind; },
                "membound: invalid policy: Policy has no policy_kind; pass a precision<>, a "
                "chunking policy (attention_tiles<>, scan_chunk<>, ttt_mini_batch<>) or a "
                "recompute policy (save_all, recompute, ttt_state_groups<>).");
  if constexpr (requires { typename Policy::policy_kind; }) {
    static_assert(policy_kind_tag<typename Policy::policy_kind>,
                  "membound: invalid policy: Policy::policy_kind is not a policy kind tag; "
                  "declare kinds with MEMBOUND_POLICY_KIND(tag, \"name\").");
  }
  return policy<Policy>;
}

template <typename Kind, typename... Defaults>
struct default_of {
  static_assert(count_of_kind<Kind, Defaults...> != 0,
                "membound: policy_set::get<Kind>: the layer has no default of this kind; add one "
                "to its Defaults (a layer names a default for every kind it reads).");
  using type = typename first_of_kind<Kind, void, Defaults...>::type;
};

template <typename Defaults, typename... Policies>
struct policy_set_checks {
  static consteval bool run() { return true; }  // policy_set reports the malformed Defaults
};

template <typename... Defaults, typename... Policies>
struct policy_set_checks<type_list<Defaults...>, Policies...> {
  static consteval bool run() {
    // Counted rather than &&-ed, so every argument is checked and each mistake gets its sentence.
    constexpr std::size_t policies = (std::size_t{0} + ... + std::size_t{check_policy<Defaults>()}) +
                                     (std::size_t{0} + ... + std::size_t{check_policy<Policies>()});
    if constexpr (policies != sizeof...(Defaults) + sizeof...(Policies)) {
      return false;
    } else {
      constexpr bool defaults_distinct = ((count_of_kind<kind_of_t<Defaults>, Defaults...> == 1) && ...);
      static_assert(defaults_distinct,
                    "membound: a layer's Defaults must hold exactly one policy per kind; two of "
                    "them share a kind.");
      constexpr std::size_t accepted =
          (std::size_t{0} + ... +
           std::size_t{kind_of_t<Policies>::template check_accepted<
               (count_of_kind<kind_of_t<Policies>, Defaults...> != 0)>()});
      if constexpr (!defaults_distinct || accepted != sizeof...(Policies)) {
        return false;
      } else {
        return (true && ... &&
                kind_of_t<Policies>::template check_at_most_one<
                    count_of_kind<kind_of_t<Policies>, Policies...>>());
      }
    }
  }
};

}  // namespace detail

// Defaults: a type_list of the layer's default policies, one per kind it reads.
// Policies: the user's, in any order, at most one per kind, each of a kind among the Defaults'.
template <typename Defaults, typename... Policies>
struct policy_set {
  static_assert(dependent_false<Defaults>,
                "membound: policy_set<Defaults, Policies...>: Defaults must be a type_list<...> "
                "of the layer's default policies, one per kind.");
  template <typename Kind>
  using get = void;  // so that the sentence above is the only error
};

template <typename... Defaults, typename... Policies>
struct policy_set<type_list<Defaults...>, Policies...> {
  static_assert(detail::policy_set_checks<type_list<Defaults...>, Policies...>::run());

  using defaults = type_list<Defaults...>;
  using given = type_list<Policies...>;

  template <typename Kind>
  using get = typename detail::first_of_kind<
      Kind, typename detail::default_of<Kind, Defaults...>::type, Policies...>::type;

  // Whether the user chose this kind's policy (rather than leaving the default).
  template <typename Kind>
  static constexpr bool is_given = detail::count_of_kind<Kind, Policies...> != 0;

  // The policy in effect for every kind, in the Defaults' order.
  using resolved = type_list<get<detail::kind_of_t<Defaults>>...>;
};

// get<Kind> without `typename Set::template` where Set is a dependent type.
template <typename Set, typename Kind>
using get_policy = typename Set::template get<Kind>;

MEMBOUND_NAMESPACE_END
