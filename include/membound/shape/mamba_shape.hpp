// The sizes of one Mamba block call, shared by the front end (layers/mamba.hpp) and the CPU
// kernels (backend/cpu/mamba_cpu.hpp).
#pragma once

#include <cstddef>

#include "membound/core/config.hpp"

MEMBOUND_NAMESPACE_BEGIN

struct mamba_shape {
  std::size_t batch = 1;     // B
  std::size_t seq = 1;       // T (step ignores it: the state carries the past)
  std::size_t d_model = 0;   // C
  std::size_t d_inner = 0;   // Di = expand · C
  std::size_t d_state = 16;  // N
  std::size_t d_conv = 4;    // K, the causal depthwise convolution's width
  std::size_t dt_rank = 0;   // R, the rank of Δ's projection

  // mamba_simple's defaults: expand 2, d_state 16, d_conv 4, dt_rank ceil(C / 16).
  static constexpr mamba_shape defaults(std::size_t batch, std::size_t seq,
                                        std::size_t d_model) noexcept {
    mamba_shape s;
    s.batch = batch;
    s.seq = seq;
    s.d_model = d_model;
    s.d_inner = 2 * d_model;
    s.dt_rank = (d_model + 15) / 16;
    return s;
  }
};

MEMBOUND_NAMESPACE_END
