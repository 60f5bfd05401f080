// The compile-time axes of bench/policy_grid: the one place that lists them. Adding a policy to a
// list below adds it to the grid (its label comes from policy_label); adding an axis means one
// more entry in grid_axes and one more slot in grid_model.
//
// The first entry of every list is the base. The grid varies one axis at a time from the base
// (the base, then each other entry of each axis with the rest at the base), and crosses each of
// these variants with the run-time axes (schedule, micro-batch, logit chunk). The full product of
// the lists below would be 3·2·2·2·2·2·3 = 288 model types, each a full instantiation of every
// layer's kernels: hours of compile for a table nobody reads. One axis at a time is 10.
#pragma once

#include <concepts>
#include <cstddef>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

#include "membound/membound.hpp"

namespace grid {

namespace mb = membound;

// ---- The lists ----------------------------------------------------------------------------------
using precisions = mb::type_list<mb::fp32_precision, mb::bf16_precision, mb::fp16_precision>;
using attention_tiles = mb::type_list<mb::attention_tiles<64, 64>, mb::attention_tiles<32, 32>>;
using attention_recomputes = mb::type_list<mb::recompute, mb::save_all>;
using scan_chunks = mb::type_list<mb::scan_chunk<128>, mb::scan_chunk<32>>;
using mamba_recomputes = mb::type_list<mb::recompute, mb::save_all>;
// A mini-batch is part of the TTT model's definition (one inner step per mini-batch), not only a
// schedule: a point on this axis trains a different model, with its own loss.
using ttt_mini_batches = mb::type_list<mb::ttt_mini_batch<16>, mb::ttt_mini_batch<8>>;
using ttt_state_group_sizes =
    mb::type_list<mb::ttt_state_groups<4>, mb::ttt_state_groups<1>, mb::ttt_state_groups_all>;

// ---- Labels (tables, JSON, the SVG) ------------------------------------------------------------
template <typename T>
struct policy_label;
template <>
struct policy_label<mb::fp32_precision> {
  static std::string get() { return "fp32"; }
};
template <>
struct policy_label<mb::bf16_precision> {
  static std::string get() { return "bf16"; }
};
template <>
struct policy_label<mb::fp16_precision> {
  static std::string get() { return "fp16"; }
};
template <std::size_t Q, std::size_t KV>
struct policy_label<mb::attention_tiles<Q, KV>> {
  static std::string get() { return std::to_string(Q) + "x" + std::to_string(KV); }
};
template <std::size_t C>
struct policy_label<mb::scan_chunk<C>> {
  static std::string get() { return std::to_string(C); }
};
template <std::size_t M>
struct policy_label<mb::ttt_mini_batch<M>> {
  static std::string get() { return std::to_string(M); }
};
template <std::size_t G>
struct policy_label<mb::ttt_state_groups<G>> {
  static std::string get() { return G == std::numeric_limits<std::size_t>::max() ? "all" : std::to_string(G); }
};
template <>
struct policy_label<mb::recompute> {
  static std::string get() { return "recompute"; }
};
template <>
struct policy_label<mb::save_all> {
  static std::string get() { return "save_all"; }
};

// A label for a policy the lists name but policy_label does not: say what to add.
template <typename T>
concept labelled = requires {
  { policy_label<T>::get() } -> std::convertible_to<std::string>;
};

// ---- The axes ----------------------------------------------------------------------------------
// Which blocks of a model an axis touches: an axis none of the model's blocks takes is not varied
// (its points would repeat the base's).
struct block_kinds {
  bool attention = false, mamba = false, ttt = false;
};

struct precision_axis {
  using list = precisions;
  static constexpr const char* name = "precision";
  static constexpr const char* short_name = "";  // the precision leads every label
  static bool applies(const block_kinds&) { return true; }
};
struct attention_tiles_axis {
  using list = attention_tiles;
  static constexpr const char* name = "attention_tiles";
  static constexpr const char* short_name = "attn tiles ";
  static bool applies(const block_kinds& k) { return k.attention; }
};
struct attention_recompute_axis {
  using list = attention_recomputes;
  static constexpr const char* name = "attention_recompute";
  static constexpr const char* short_name = "attn ";
  static bool applies(const block_kinds& k) { return k.attention; }
};
struct scan_chunk_axis {
  using list = scan_chunks;
  static constexpr const char* name = "scan_chunk";
  static constexpr const char* short_name = "mamba chunk ";
  static bool applies(const block_kinds& k) { return k.mamba; }
};
struct mamba_recompute_axis {
  using list = mamba_recomputes;
  static constexpr const char* name = "mamba_recompute";
  static constexpr const char* short_name = "mamba ";
  static bool applies(const block_kinds& k) { return k.mamba; }
};
struct ttt_mini_batch_axis {
  using list = ttt_mini_batches;
  static constexpr const char* name = "ttt_mini_batch";
  static constexpr const char* short_name = "ttt b=";
  static bool applies(const block_kinds& k) { return k.ttt; }
};
struct ttt_state_groups_axis {
  using list = ttt_state_group_sizes;
  static constexpr const char* name = "ttt_state_groups";
  static constexpr const char* short_name = "ttt G=";
  static bool applies(const block_kinds& k) { return k.ttt; }
};

// The order of the slots of a combination (grid_model reads them by index).
using axes = mb::type_list<precision_axis, attention_tiles_axis, attention_recompute_axis, scan_chunk_axis,
                           mamba_recompute_axis, ttt_mini_batch_axis, ttt_state_groups_axis>;

// ---- Type-list plumbing --------------------------------------------------------------------------
template <typename L, std::size_t I>
struct at;
template <typename T, typename... R>
struct at<mb::type_list<T, R...>, 0> {
  using type = T;
};
template <typename T, typename... R, std::size_t I>
struct at<mb::type_list<T, R...>, I> {
  using type = typename at<mb::type_list<R...>, I - 1>::type;
};
template <typename L, std::size_t I>
using at_t = typename at<L, I>::type;

template <typename Axes>
struct base_of;
template <typename... Ax>
struct base_of<mb::type_list<Ax...>> {
  using type = mb::type_list<at_t<typename Ax::list, 0>...>;
};
using base_combination = typename base_of<axes>::type;

// Combination C with slot I replaced by E.
template <typename C, std::size_t I, typename E, typename Seq = std::make_index_sequence<C::size>>
struct replace;
template <typename... Ts, std::size_t I, typename E, std::size_t... J>
struct replace<mb::type_list<Ts...>, I, E, std::index_sequence<J...>> {
  using type = mb::type_list<std::conditional_t<J == I, E, at_t<mb::type_list<Ts...>, J>>...>;
};
template <typename C, std::size_t I, typename E>
using replace_t = typename replace<C, I, E>::type;

// ---- A combination as a model -------------------------------------------------------------------
template <typename C>
struct grid_model {
  using P = at_t<C, 0>;
  using net = mb::model<mb::embedding<P>,
                        mb::block_pattern<mb::ttt_linear<P, at_t<C, 5>, at_t<C, 6>>,
                                          mb::attention<P, at_t<C, 1>, at_t<C, 2>>,
                                          mb::mamba<P, at_t<C, 3>, at_t<C, 4>>,
                                          mb::ttt_mlp<P, at_t<C, 5>, at_t<C, 6>>>,
                        mb::lm_head<P>>;
};

// The label of slot I of combination C, e.g. "attn save_all".
template <typename C, std::size_t I>
std::string slot_label() {
  using E = at_t<C, I>;
  static_assert(labelled<E>,
                "policy_grid: a policy in bench/grid_policies.hpp's lists has no label; add a "
                "policy_label specialization for it next to the others.");
  return std::string(at_t<axes, I>::short_name) + policy_label<E>::get();
}

// Every slot by axis name, for JSON.
template <typename C, typename F, std::size_t... I>
void for_each_slot(F&& f, std::index_sequence<I...>) {
  (f(at_t<axes, I>::name, policy_label<at_t<C, I>>::get()), ...);
}
template <typename C, typename F>
void for_each_slot(F&& f) {
  for_each_slot<C>(std::forward<F>(f), std::make_index_sequence<axes::size>{});
}

// Calls visit.template operator()<C>(axis, label) for the base (axis "") and for each
// other entry of each axis with the rest at the base. The label is the precision, then the slot
// that differs from the base: "fp32", "bf16", "fp32 attn save_all".
template <std::size_t I, std::size_t J, typename V>
void visit_entry(V& visit) {
  if constexpr (J > 0) {
    using axis = at_t<axes, I>;
    using C = replace_t<base_combination, I, at_t<typename axis::list, J>>;
    std::string label = slot_label<C, 0>();
    if constexpr (I > 0) label += " " + slot_label<C, I>();
    visit.template operator()<C>(axis::name, std::move(label));
  }
}
template <std::size_t I, typename V, std::size_t... J>
void visit_axis(V& visit, std::index_sequence<J...>) {
  (visit_entry<I, J>(visit), ...);
}
template <typename V, std::size_t... I>
void visit_axes(V& visit, std::index_sequence<I...>) {
  (visit_axis<I>(visit, std::make_index_sequence<at_t<axes, I>::list::size>{}), ...);
}
template <typename V>
void for_each_variant(V&& visit) {
  visit.template operator()<base_combination>("", slot_label<base_combination, 0>());
  visit_axes(visit, std::make_index_sequence<axes::size>{});
}

// f.template operator()<Axis>() for each axis.
template <typename F, std::size_t... I>
void for_each_axis(F&& f, std::index_sequence<I...>) {
  (f.template operator()<at_t<axes, I>>(), ...);
}
template <typename F>
void for_each_axis(F&& f) {
  for_each_axis(std::forward<F>(f), std::make_index_sequence<axes::size>{});
}

// The axis names, for --vary and its error message.
template <std::size_t... I>
std::string axis_names(std::index_sequence<I...>) {
  std::string s;
  ((s += (I == 0 ? "" : ", ") + std::string(at_t<axes, I>::name)), ...);
  return s;
}
inline std::string axis_names() { return axis_names(std::make_index_sequence<axes::size>{}); }

}  // namespace grid
