// What the trainer and the planner ask of an optimizer: a policy type with static members only,
// whose state is the caller's bytes (state_bytes(n) of them, exact and known at compile time), so
// that the planner counts it and the trainer allocates it like every other buffer.
//
//   static_assert(membound::check_optimizer_policy<membound::adamw8bit<float>, float>());
//   plan_options po;  po.optimizer_policy = membound::optimizer_of<membound::adamw8bit<float>>();
//
// A policy O for storage type S offers:
//   using storage_type = S;
//   static constexpr std::string_view name;                 // "adamw", "adamw8bit": flags, logs
//   static std::string description();                       // the plan table's line
//   static constexpr std::size_t state_bytes(std::size_t n) noexcept;
//   static void init(const S* w, std::size_t n, void* state, std::size_t bytes);
//   static void update(S* w, const S* g, void* state, std::size_t n,
//                      std::span<const param_span> spans, const optimizer_step& s, thread_pool& pool);
//   static std::span<const std::byte> save_state(const void* state, std::size_t n);
//   static void load_state(std::span<const std::byte> from, void* state, std::size_t n);
//
// A policy may also offer an update of one range of its elements, which optimizer offload runs
// bucket by bucket on the host (planner: plan_options::offload):
//   static constexpr std::size_t range_granule;   // first and count are multiples of it (count
//                                                 // may end at n instead)
//   static void update_range(S* w, const S* g, void* state, std::size_t n, std::size_t first,
//                            std::size_t count, std::span<const param_span> spans,
//                            const optimizer_step& s, thread_pool& pool);
// w and g hold the range's count elements (w[0] is element first); state and spans are the whole
// range's, as for update. Updating [0, n) range by range gives update's bits.
//
// update covers the n elements the state was made for, given as spans inside [0, n) in order
// (each tensor's part; the padding between tensors is in none and takes no step): one call per
// step over the whole flat range, so a policy whose state is kept per block of elements
// (adamw8bit) sees every block whole, even where a block holds the end of one tensor and the
// start of the next (the spans say which elements decay). load_state checks the bytes before it
// writes any: a refused load leaves the state as it was.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>

#include "membound/core/argument_checks.hpp"
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/core/error.hpp"
#include "membound/core/parallel.hpp"

MEMBOUND_NAMESPACE_BEGIN

// AdamW's hyper-parameters (both policies here are AdamW; lr is the run's peak rate only where no
// schedule gives one).
struct adamw_config {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
};

// A run of elements of one tensor inside the optimizer's flat range: [first, first + count),
// and whether it takes weight decay (matrices do; norms and biases do not).
struct param_span {
  std::size_t first = 0;
  std::size_t count = 0;
  bool decay = true;
};

// One step's scalars: t is 1-based, grad_scale multiplies every gradient (clipping, loss scale).
struct optimizer_step {
  std::uint64_t t = 1;
  double lr = 1e-3;
  double grad_scale = 1.0;
  adamw_config config{};
};

namespace detail {
template <typename O>
concept optimizer_has_storage_type = requires { typename O::storage_type; };
template <typename O>
concept optimizer_has_name = requires {
  { O::name } -> std::convertible_to<std::string_view>;
  { O::description() } -> std::convertible_to<std::string>;
};
template <typename O>
concept optimizer_has_state_bytes = requires(std::size_t n) {
  { O::state_bytes(n) } noexcept -> std::same_as<std::size_t>;
};
// Evaluated by the compiler: the planner's compile-time peak needs it.
template <typename O>
concept optimizer_state_bytes_constexpr =
    optimizer_has_state_bytes<O> && requires { typename std::integral_constant<std::size_t, O::state_bytes(1)>; };
template <typename O, typename S>
concept optimizer_has_init = requires(const S* w, std::size_t n, void* state) { O::init(w, n, state, n); };
template <typename O, typename S>
concept optimizer_has_update = requires(S* w, const S* g, void* state, std::size_t n, std::span<const param_span> sp,
                                        const optimizer_step& s, thread_pool& pool) {
  O::update(w, g, state, n, sp, s, pool);
};
template <typename O>
concept optimizer_has_save_load = requires(const void* cs, void* state, std::size_t n, std::span<const std::byte> b) {
  { O::save_state(cs, n) } -> std::same_as<std::span<const std::byte>>;
  O::load_state(b, state, n);
};
template <typename O, typename S>
concept optimizer_has_update_range = requires(S* w, const S* g, void* state, std::size_t n,
                                              std::span<const param_span> sp, const optimizer_step& s,
                                              thread_pool& pool) {
  { O::range_granule } -> std::convertible_to<std::size_t>;
  O::update_range(w, g, state, n, n, n, sp, s, pool);
};
}  // namespace detail

template <typename O, typename S>
concept optimizer_policy =
    detail::optimizer_has_storage_type<O> && detail::optimizer_has_name<O> &&
    detail::optimizer_state_bytes_constexpr<O> && detail::optimizer_has_init<O, S> &&
    detail::optimizer_has_update<O, S> && detail::optimizer_has_save_load<O>;

// A policy whose update runs one range at a time: what optimizer offload needs.
template <typename O, typename S>
concept offloadable_optimizer = optimizer_policy<O, S> && detail::optimizer_has_update_range<O, S>;

// The concept one requirement at a time, each with a sentence: static_assert(check_optimizer_policy<O, S>()).
template <typename O, typename S>
consteval bool check_optimizer_policy() {
  static_assert(detail::optimizer_has_storage_type<O>,
                "membound: an optimizer policy needs `using storage_type = S;` (the weights' type it updates)");
  if constexpr (detail::optimizer_has_storage_type<O>) {
    static_assert(std::is_same_v<typename O::storage_type, S>,
                  "membound: the optimizer policy is for another storage type than the model's: use the "
                  "policy for the model's storage (adamw<S>, adamw8bit<S> with S = Model::storage_type)");
  }
  static_assert(detail::optimizer_has_name<O>,
                "membound: an optimizer policy needs `static constexpr std::string_view name` and "
                "`static std::string description()` (what the plan table prints)");
  static_assert(detail::optimizer_has_state_bytes<O>,
                "membound: an optimizer policy needs `static constexpr std::size_t state_bytes(std::size_t n) "
                "noexcept`: the exact bytes of its state for n parameters");
  static_assert(detail::optimizer_state_bytes_constexpr<O>,
                "membound: the optimizer policy's state_bytes(n) must be constexpr (the planner evaluates "
                "it at compile time)");
  static_assert(detail::optimizer_has_init<O, S>,
                "membound: an optimizer policy needs `static void init(const S* w, std::size_t n, void* "
                "state, std::size_t bytes)`");
  static_assert(detail::optimizer_has_update<O, S>,
                "membound: an optimizer policy needs `static void update(S* w, const S* g, void* state, "
                "std::size_t n, std::span<const param_span> spans, const optimizer_step& s, thread_pool& "
                "pool)`");
  static_assert(detail::optimizer_has_save_load<O>,
                "membound: an optimizer policy needs `static std::span<const std::byte> save_state(const "
                "void* state, std::size_t n)` and `static void load_state(std::span<const std::byte> from, "
                "void* state, std::size_t n)` (checkpoints)");
  return true;
}

// What the planner keeps of a policy (plan_options is not a template): its name, its storage
// type's name and its state_bytes. The default (no state_bytes) is AdamW for the model's storage.
struct optimizer_ref {
  std::string_view name{};
  std::string_view storage{};
  std::size_t (*state_bytes)(std::size_t) noexcept = nullptr;
  std::string (*description)() = nullptr;
  // update_range's granule (offload's buckets are multiples of it); 0: the policy has no
  // update_range and cannot be offloaded (the planner takes the default, adamw<S>, as 1).
  std::size_t granule = 0;
};

template <typename O>
  requires detail::optimizer_state_bytes_constexpr<O> && detail::optimizer_has_name<O> &&
           detail::optimizer_has_storage_type<O>
constexpr optimizer_ref optimizer_of() noexcept {
  std::size_t granule = 0;
  if constexpr (requires { O::range_granule; }) granule = O::range_granule;
  return {O::name, dtype_name<typename O::storage_type>(), [](std::size_t n) noexcept { return O::state_bytes(n); },
          [] { return std::string(O::description()); }, granule};
}

namespace detail {
// spans must lie in [0, n), in order of first, without overlap. Elements between them (the
// padding between tensors) take no step.
inline void check_param_spans(std::span<const param_span> spans, std::size_t n) {
  std::size_t at = 0;
  for (std::size_t k = 0; k < spans.size(); ++k) {
    if (spans[k].first < at || spans[k].first > n || spans[k].count > n - spans[k].first) {
      throw invalid_argument("spans", "spans inside [0, " + std::to_string(n) + "), in order, not overlapping",
                             "span " + std::to_string(k) + " = [" + std::to_string(spans[k].first) + ", +" +
                                 std::to_string(spans[k].count) + ")" +
                                 (spans[k].first < at ? " where the one before ends at " + std::to_string(at) : ""),
                             "List every tensor's part of the optimizer's range once, in order of offset");
    }
    at = spans[k].first + spans[k].count;
  }
}

// update_range's range: inside [0, n), starting at a multiple of the granule, and of a multiple of
// it or ending at n.
inline void check_update_range(std::size_t first, std::size_t count, std::size_t n, std::size_t granule) {
  const bool inside = first <= n && count <= n - first;
  if (!inside || first % granule != 0 || (count % granule != 0 && first + count != n)) {
    throw invalid_argument("first, count",
                           "a range inside [0, " + std::to_string(n) + ") starting at a multiple of " +
                               std::to_string(granule) + ", of a multiple of it or ending at n",
                           "[" + std::to_string(first) + ", +" + std::to_string(count) + ")",
                           "Cut the state's range into buckets of a multiple of the policy's range_granule");
  }
}

// A state buffer of the wrong size, or none.
inline void check_state_buffer(const void* state, std::size_t bytes, std::size_t need) {
  if (state == nullptr) throw workspace_too_small("optimizer state", need, 0);  // even when need is 0
  need_space(state, bytes, need, "optimizer state");
}
}  // namespace detail

MEMBOUND_NAMESPACE_END
