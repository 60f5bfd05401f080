// The sizes of one TTT layer call and the pointers it takes, shared by the front end
// (layers/ttt.hpp) and both backends (backend/cpu/ttt.hpp, backend/cuda/ttt.cuh).
#pragma once

#include <cstddef>
#include <cstdint>

#include "membound/core/config.hpp"
#include "membound/shape/packed_sequences.hpp"

MEMBOUND_NAMESPACE_BEGIN

struct ttt_shape {
  std::size_t batch = 1;  // B
  std::size_t seq = 1;    // T (step ignores it)
  std::size_t width = 0;  // C
  std::size_t heads = 0;  // H, divides C; D = C / H
  bool use_gate = false;
  double base_lr = 1.0;
  double rope_base = 10000.0;
  // Packed variable-length sequences (nullptr: none; shape/packed_sequences.hpp): `sequences`
  // sequences end to end on one token axis (batch 1, seq their total). Each starts from the
  // layer's inner state with mini-batches of its own (the last one partial) and RoPE positions
  // counted from its start: packed equals each sequence alone.
  const std::int32_t* offsets = nullptr;
  std::size_t sequences = 0;

  constexpr std::size_t head_dim() const noexcept { return heads == 0 ? 0 : width / heads; }
  constexpr packed_sequences packing() const noexcept {
    return packed_sequences{offsets, offsets == nullptr ? 0 : sequences};
  }
};

// The inner model's hidden width F (D for TTT-Linear, 4·D for TTT-MLP) and its state size:
// W1 [D, F], b1 [F] (then W2 [F, D], b2 [D] for TTT-MLP), contiguous.
constexpr std::size_t ttt_hidden(const ttt_shape& s, bool mlp) noexcept {
  return mlp ? 4 * s.head_dim() : s.head_dim();
}
constexpr std::size_t ttt_inner_elements(const ttt_shape& s, bool mlp) noexcept {
  const std::size_t D = s.head_dim(), F = ttt_hidden(s, mlp);
  return mlp ? 2 * D * F + F + D : D * D + D;
}

// The parameters (all [in, out], row-major: y = x·W).
template <typename S>
struct ttt_weights {
  const S* wq;         // [C, C]
  const S* wk;         // [C, C]
  const S* wv;         // [C, C]
  const S* ttt_norm_w; // [H, D]   the inner LayerNorm's scale
  const S* ttt_norm_b; // [H, D]   and shift
  const S* w1;         // [H, D, F] the inner W1 at the start of the sequence
  const S* b1;         // [H, F]
  const S* lr_w;       // [H, C]   learning-rate gate
  const S* lr_b;       // [H]
  const S* tok_offset; // [b]      learnable offset of the token scales 1/(i+1)
  const S* post_w;     // [C]      post LayerNorm
  const S* post_b;     // [C]
  const S* wg;         // [C, C]   the gate (read only when shape.use_gate)
  const S* wo;         // [C, C]
  const S* w2 = nullptr;  // [H, F, D] TTT-MLP only
  const S* b2 = nullptr;  // [H, D]    TTT-MLP only
};
// Their gradients, accumulated (+=); wg only when shape.use_gate, w2 and b2 only for TTT-MLP.
template <typename S>
struct ttt_gradients {
  S *wq, *wk, *wv, *ttt_norm_w, *ttt_norm_b, *w1, *b1, *lr_w, *lr_b, *tok_offset, *post_w,
      *post_b, *wg, *wo;
  S* w2 = nullptr;
  S* b2 = nullptr;
};

// Mini-batches of `mini_batch` tokens per sequence (of T tokens: the most any packed sequence
// has), and the saved inner states per (batch, head): one at the start of every group of `group`
// mini-batches of every sequence. ceil(n / block) without the overflow of n + block − 1 for a
// huge group (ttt_state_groups_all), as cpu::blocks.
constexpr std::size_t ttt_mini_batches(const ttt_shape& s, std::size_t mini_batch) noexcept {
  return s.seq == 0 ? 0 : (s.seq - 1) / mini_batch + 1;
}
// Packed, a sequence of L tokens keeps ceil(ceil(L/b)/G) = 1 + floor((L − 1)/(b·G)) states, so
// N tokens in at most S sequences keep at most S' + floor(floor((N − S')/b)/G) with S' = min(S, N)
// (S' − 1 single tokens and one long sequence reach it). The size depends on N and S only, never
// on where the sequences start, so one buffer serves every packing of the same totals and a plan
// over (tokens, sequences) is exact for its worst case.
constexpr std::size_t ttt_saved_states(const ttt_shape& s, std::size_t mini_batch,
                                      std::size_t group) noexcept {
  if (s.sequences != 0) {  // offsets or not: the size is the worst case
    const std::size_t n = s.sequences < s.seq ? s.sequences : s.seq;
    return n + (s.seq - n) / mini_batch / group;
  }
  const std::size_t n = ttt_mini_batches(s, mini_batch);
  return n == 0 ? 0 : (n - 1) / group + 1;
}
// Parameter elements, in the order of ttt_weights (w2, b2 inside the inner state for TTT-MLP).
constexpr std::size_t ttt_weight_elements(const ttt_shape& s, bool mlp,
                                          std::size_t mini_batch) noexcept {
  const std::size_t C = s.width, H = s.heads, D = s.head_dim();
  return 5 * C * C + 2 * H * D + H * ttt_inner_elements(s, mlp) + H * C + H + mini_batch + 2 * C;
}

MEMBOUND_NAMESPACE_END
