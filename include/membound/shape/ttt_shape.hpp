// The sizes of one TTT layer call, shared by the front end (layers/ttt.hpp) and the backends'
// kernels.
#pragma once

#include <cstddef>

#include "membound/core/config.hpp"

MEMBOUND_NAMESPACE_BEGIN

struct ttt_shape {
  std::size_t batch = 1;  // B
  std::size_t seq = 1;    // T (step ignores it)
  std::size_t width = 0;  // C
  std::size_t heads = 0;  // H, divides C; D = C / H
  bool use_gate = false;
  double base_lr = 1.0;
  double rope_base = 10000.0;
  constexpr std::size_t head_dim() const noexcept { return heads == 0 ? 0 : width / heads; }
};

MEMBOUND_NAMESPACE_END
