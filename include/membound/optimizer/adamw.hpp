// AdamW (Loshchilov & Hutter) with decoupled weight decay, over a flat parameter array. With
// bf16/fp16 storage it keeps fp32 master weights, so small updates are not rounded away: the
// master is updated and the stored weight is its rounding. State is the caller's bytes
// (state_bytes(n) of them), like every other buffer in membound.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "membound/core/checked_math.hpp"
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/core/element_math.hpp"
#include "membound/core/error.hpp"
#include "membound/core/parallel.hpp"

MEMBOUND_NAMESPACE_BEGIN

struct adamw_config {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
};

template <typename S>
class adamw {
 public:
  static constexpr bool has_master = !std::is_same_v<S, float> && !std::is_same_v<S, double>;
  using moment_type = std::conditional_t<std::is_same_v<S, double>, double, float>;

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
    moment_type* m = static_cast<moment_type*>(state);
    moment_type* v = m + n;
    moment_type* master = has_master ? m + 2 * n : nullptr;
    const auto k = adamw_coefficients<moment_type>::at(t, lr, c.beta1, c.beta2, c.eps, c.weight_decay, decay);
    const moment_type gs = static_cast<moment_type>(grad_scale);
    constexpr std::size_t block = 4096;
    pool.parallel_for((count + block - 1) / block, [&](std::size_t b, std::size_t) {
      const std::size_t i0 = first + b * block, i1 = std::min(first + count, i0 + block);
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
