// The sizes of one SwiGLU MLP call, shared by the front end (layers/swiglu_mlp.hpp) and the
// backends' kernels.
#pragma once

#include <cstddef>

#include "membound/core/config.hpp"

MEMBOUND_NAMESPACE_BEGIN

struct mlp_shape {
  std::size_t batch = 1;
  std::size_t seq = 1;
  std::size_t width = 0;   // C
  std::size_t hidden = 0;  // F
};

MEMBOUND_NAMESPACE_END
