// The sizes of one Mamba block call and the pointers it takes, shared by the front end
// (layers/mamba.hpp) and both backends (backend/cpu/mamba.hpp, backend/cuda/mamba.cuh).
#pragma once

#include <cstddef>
#include <cstdint>

#include "membound/core/config.hpp"
#include "membound/shape/packed_sequences.hpp"

MEMBOUND_NAMESPACE_BEGIN

struct mamba_shape {
  std::size_t batch = 1;     // B
  std::size_t seq = 1;       // T (step ignores it: the state carries the past)
  std::size_t d_model = 0;   // C
  std::size_t d_inner = 0;   // Di = expand · C
  std::size_t d_state = 16;  // N
  std::size_t d_conv = 4;    // K, the causal depthwise convolution's width
  std::size_t dt_rank = 0;   // R, the rank of Δ's projection
  // Packed variable-length sequences (nullptr: none; shape/packed_sequences.hpp): `sequences`
  // sequences end to end on one token axis (batch 1, seq their total). The convolution and the
  // scan state restart at each start (mamba_ssm's seq_idx): packed equals each sequence alone.
  const std::int32_t* offsets = nullptr;
  std::size_t sequences = 0;

  constexpr packed_sequences packing() const noexcept {
    return packed_sequences{offsets, offsets == nullptr ? 0 : sequences};
  }

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

// The parameters, in this order (W is [in, out], row-major: y = x·W).
template <typename S>
struct mamba_weights {
  const S* in_proj;   // [C, 2·Di]   x half, then z half
  const S* conv_w;    // [Di, K]     tap K−1 multiplies the current token
  const S* conv_b;    // [Di]
  const S* x_proj;    // [Di, R + 2·Ns]  dt_low, B, C
  const S* dt_proj;   // [R, Di]
  const S* dt_bias;   // [Di]
  const S* a_log;     // [Di, Ns]    A = −exp(a_log)
  const S* d;         // [Di]
  const S* out_proj;  // [Di, C]
};
// Their gradients, accumulated (+=): the caller zeroes them.
template <typename S>
struct mamba_gradients {
  S* in_proj;
  S* conv_w;
  S* conv_b;
  S* x_proj;
  S* dt_proj;
  S* dt_bias;
  S* a_log;
  S* d;
  S* out_proj;
};
// What forward keeps for backward, carved by the front: xz [N, 2·Di] and x_dbl [N, R + 2·Ns] in
// storage, the chunk-entry scan states [B, chunks − 1, Di, Ns] in the accumulator type, and the
// conv output and Δ [N, Di] under save_all (null otherwise).
template <typename S, typename A>
struct mamba_saved {
  S* xz;
  S* xdbl;
  A* states;
  S* c;
  S* delta;
};

// Parameter elements, in the order of mamba_weights.
constexpr std::size_t mamba_weight_elements(const mamba_shape& s) noexcept {
  const std::size_t C = s.d_model, Di = s.d_inner, Ns = s.d_state, R = s.dt_rank;
  return C * 2 * Di + Di * s.d_conv + Di + Di * (R + 2 * Ns) + R * Di + Di + Di * Ns + Di + Di * C;
}

MEMBOUND_NAMESPACE_END
