// The sizes of one attention layer call, shared by the front end (layers/attention.hpp) and the
// backends' kernels (backend/cpu/attention.hpp).
#pragma once

#include <cstddef>

#include "membound/core/config.hpp"

MEMBOUND_NAMESPACE_BEGIN

struct attention_shape {
  std::size_t batch = 1;     // B
  std::size_t seq = 1;       // T (step ignores it: the cache holds the positions)
  std::size_t d_model = 0;   // C
  std::size_t heads = 0;     // H, query heads
  std::size_t kv_heads = 0;  // Hkv, divides H: head h reads kv head h / (H / Hkv)
  std::size_t head_dim = 0;  // D, a multiple of 8 up to 256
  bool causal = true;
  double rope_base = 10000.0;
};

// Parameter elements: Wq [C, H·D], Wk and Wv [C, Hkv·D], Wo [H·D, C].
constexpr std::size_t attention_weight_elements(const attention_shape& s) noexcept {
  const std::size_t HD = s.heads * s.head_dim, KD = s.kv_heads * s.head_dim;
  return s.d_model * HD + 2 * s.d_model * KD + HD * s.d_model;
}

MEMBOUND_NAMESPACE_END
