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

MEMBOUND_NAMESPACE_END
