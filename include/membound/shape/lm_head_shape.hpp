// The sizes of one LM head call (final RMSNorm, chunked logits, fused cross-entropy), shared by
// the front end (layers/lm_head.hpp) and the backends' kernels.
#pragma once

#include <cstddef>

#include "membound/core/config.hpp"

MEMBOUND_NAMESPACE_BEGIN

struct lm_head_shape {
  std::size_t rows = 1;    // N = B·T tokens
  std::size_t width = 0;   // C
  std::size_t vocab = 0;   // V
  std::size_t chunk = 256; // logit rows at a time
  double eps = 1e-5;       // the final RMSNorm's
};

MEMBOUND_NAMESPACE_END
