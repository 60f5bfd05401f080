// The sizes of one LM head call (final RMSNorm, chunked logits, fused cross-entropy), shared by
// the front end (layers/lm_head.hpp) and the backends' kernels.
#pragma once

#include <cstddef>
#include <cstdint>

#include "membound/core/config.hpp"

MEMBOUND_NAMESPACE_BEGIN

// A target that takes no part in the loss (PyTorch's ignore_index default): its row's loss and
// gradient are zero, and a model's mean counts only the other targets. Packed sequences give it
// to each sequence's last token, whose next token belongs to another sequence.
inline constexpr std::int32_t ignore_target = -100;

// How many of the n host targets count (are not ignore_target): what a mean loss divides by.
constexpr std::size_t counted_targets(const std::int32_t* targets, std::size_t n) noexcept {
  std::size_t c = 0;
  for (std::size_t i = 0; i < n; ++i) c += targets[i] != ignore_target ? 1 : 0;
  return c;
}

struct lm_head_shape {
  std::size_t rows = 1;    // N = B·T tokens
  std::size_t width = 0;   // C
  std::size_t vocab = 0;   // V
  std::size_t chunk = 256; // logit rows at a time
  double eps = 1e-5;       // the final RMSNorm's
};

MEMBOUND_NAMESPACE_END
