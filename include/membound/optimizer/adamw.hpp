// AdamW (Loshchilov & Hutter) with decoupled weight decay, over a flat parameter array. With
// bf16/fp16 storage it keeps fp32 master weights, so small updates are not rounded away: the
// master is updated and the stored weight is its rounding. State is the caller's bytes
// (state_bytes(n) of them), like every other buffer in membound. An optimizer_policy
// (optimizer/optimizer_policy.hpp): the trainer's default.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>

#include "membound/core/checked_math.hpp"
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/core/element_math.hpp"
#include "membound/core/error.hpp"
#include "membound/core/format.hpp"
#include "membound/core/parallel.hpp"
#include "membound/optimizer/optimizer_policy.hpp"

MEMBOUND_NAMESPACE_BEGIN

template <typename S>
class adamw {
 public:
  static constexpr bool has_master = !std::is_same_v<S, float> && !std::is_same_v<S, double>;
  using moment_type = std::conditional_t<std::is_same_v<S, double>, double, float>;
  using storage_type = S;
  static constexpr std::string_view name = "adamw";
  // Also the checkpoint fingerprint's text (with the bytes), as it was before policies.
  static std::string description() {
    return "AdamW m, v in " + std::string(dtype_name<moment_type>()) + (has_master ? " + fp32 masters" : "");
  }

  // The state is elementwise: state_arrays arrays of n elements of state_element_bytes each (m,
  // v, and the masters for 16-bit storage), so the state of a range of parameters is the same
  // slice of each array. The trainer re-shards a checkpoint to another world size by this.
  static constexpr std::size_t state_arrays = has_master ? 3 : 2;
  static constexpr std::size_t state_element_bytes = sizeof(moment_type);

  // m and v per parameter, then the fp32 master copy for 16-bit storage.
  static constexpr std::size_t state_bytes(std::size_t n) noexcept {
    return sat_mul(bytes_of<moment_type>(n), has_master ? 3 : 2);
  }

  // Starts the state over `state` (state_bytes(n) bytes, aligned to 4): zero moments, masters
  // copied from the weights.
  static void init(const S* w, std::size_t n, void* state, std::size_t bytes) {
    if (state == nullptr || bytes < state_bytes(n)) {
      throw workspace_too_small("optimizer state", state_bytes(n), state == nullptr ? 0 : bytes);
    }
    moment_type* m = static_cast<moment_type*>(state);
    for (std::size_t i = 0; i < 2 * n; ++i) m[i] = 0;
    if constexpr (has_master) {
      for (std::size_t i = 0; i < n; ++i) m[2 * n + i] = to_accum<float>(w[i]);
    }
  }

  // One update at step t (1-based) over [first, first + count) of the arrays. decay: whether the
  // range takes weight decay (matrices do; norms and biases do not).
  static void update(S* w, const S* g, void* state, std::size_t n, std::size_t first,
                     std::size_t count, std::uint64_t t, double lr, const adamw_config& c,
                     bool decay, double grad_scale, thread_pool& pool) {
    step_run(w + first, g + first, state, n, first, count, t, lr, c, decay, grad_scale, pool);
  }

  // The policy's update: every span of [0, n) in turn, as the per-range update above.
  static void update(S* w, const S* g, void* state, std::size_t n, std::span<const param_span> spans,
                     const optimizer_step& s, thread_pool& pool) {
    update_range(w, g, state, n, 0, n, spans, s, pool);
  }

  // Elementwise: any range is a whole one.
  static constexpr std::size_t range_granule = 1;
  // update over [first, first + count) only: w and g hold that range (w[0] is element first);
  // the spans are update's, over [0, n). The same bits as update for those elements.
  static void update_range(S* w, const S* g, void* state, std::size_t n, std::size_t first, std::size_t count,
                           std::span<const param_span> spans, const optimizer_step& s, thread_pool& pool) {
    detail::check_param_spans(spans, n);
    detail::check_update_range(first, count, n, range_granule);
    const std::size_t last = first + count;
    for (const param_span& sp : spans) {
      const std::size_t lo = std::max(sp.first, first), hi = std::min(sp.first + sp.count, last);
      if (lo < hi) {
        step_run(w + (lo - first), g + (lo - first), state, n, lo, hi - lo, s.t, s.lr, s.config, sp.decay,
                 s.grad_scale, pool);
      }
    }
  }

  // The state is flat bytes already: a checkpoint holds them as they are.
  static std::span<const std::byte> save_state(const void* state, std::size_t n) noexcept {
    return {static_cast<const std::byte*>(state), state_bytes(n)};
  }
  // Checks every value first (v is never negative, masters are finite; NaN fails both), then copies.
  static void load_state(std::span<const std::byte> from, void* state, std::size_t n) {
    if (from.size() != state_bytes(n)) {
      throw invalid_argument("optimizer state", format_bytes(state_bytes(n)) + " (" + description() + ")",
                             format_bytes(from.size()), "Load a state saved by the same policy for the same parameters");
    }
    const auto at = [&](std::size_t i) {
      moment_type x;
      std::memcpy(&x, from.data() + i * sizeof(moment_type), sizeof x);
      return x;
    };
    for (std::size_t i = 0; i < n; ++i) {
      const moment_type v = at(n + i);
      if (!(v >= 0) || !std::isfinite(at(i)) || !std::isfinite(v) || (has_master && !std::isfinite(at(2 * n + i)))) {
        throw invalid_argument("optimizer state", "finite moments with v >= 0 and finite masters",
                               "element " + std::to_string(i) + " is not", "The state is corrupt: load another checkpoint");
      }
    }
    std::memcpy(state, from.data(), from.size());
  }

 private:
  // The step over elements [first, first + count) of the state; w and g hold exactly those.
  static void step_run(S* w, const S* g, void* state, std::size_t n, std::size_t first, std::size_t count,
                       std::uint64_t t, double lr, const adamw_config& c, bool decay, double grad_scale,
                       thread_pool& pool) {
    moment_type* m = static_cast<moment_type*>(state) + first;
    moment_type* v = static_cast<moment_type*>(state) + n + first;
    moment_type* master = has_master ? static_cast<moment_type*>(state) + 2 * n + first : nullptr;
    const auto k = adamw_coefficients<moment_type>::at(t, lr, c.beta1, c.beta2, c.eps, c.weight_decay, decay);
    const moment_type gs = static_cast<moment_type>(grad_scale);
    constexpr std::size_t block = 4096;
    pool.parallel_for((count + block - 1) / block, [&](std::size_t b, std::size_t) {
      const std::size_t i0 = b * block, i1 = std::min(count, i0 + block);
      for (std::size_t i = i0; i < i1; ++i) {
        const moment_type gi = to_accum<moment_type>(g[i]) * gs;
        moment_type p = has_master ? master[i] : to_accum<moment_type>(w[i]);
        adamw_step(k, gi, m[i], v[i], p);
        if constexpr (has_master) master[i] = p;
        w[i] = from_accum<S>(p);
      }
    });
  }
};

MEMBOUND_NAMESPACE_END
