// The sizes of one mixture-of-experts feed-forward call (layers/moe_mlp.hpp), shared by the front
// end and the backends' kernels, and the two counts every size follows from: the slots one
// expert has (its capacity) and the rows all experts compute together at most.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "membound/core/config.hpp"

MEMBOUND_NAMESPACE_BEGIN

struct moe_shape {
  std::size_t batch = 1;
  std::size_t seq = 1;
  std::size_t width = 0;    // C
  std::size_t hidden = 0;   // F, of each expert's SwiGLU
  std::size_t experts = 0;  // E
  std::size_t top_k = 1;    // k: experts per token, 1 (Switch) or 2 (GShard, Mixtral)
  // Slots per expert: floor(capacity_factor · tokens · k / E), Switch's rule; a token's choice
  // that finds its expert full is dropped (the block's residual carries the token). 0: no
  // capacity limit (Mixtral): every choice is computed.
  double capacity_factor = 0.0;
  // The k gates divided by their sum (Mixtral, GShard), else the router's probabilities as they
  // are. Only for k > 1: one gate is always its probability (Switch; renormalised it would be 1
  // and teach the router nothing).
  bool renormalize = true;
  // The load-balancing loss's weight α (Switch's; Mixtral's router_aux_loss_coef, which HF
  // applies once to all layers pooled, where each block here adds its own, as in Switch):
  // α · E · Σ_e f_e · P_e, f_e = (choices that name expert e) / tokens (the k choices of a token
  // each count: Σ_e f_e = k), P_e the mean probability of e. Backward adds its gradient; 0 turns
  // it off. Capacity, dispatch order and this loss are per call: in a model, per micro-batch.
  double aux_loss_weight = 0.0;

  constexpr std::size_t tokens() const noexcept { return batch * seq; }
};

// Slots per expert: the capacity rule above, at most the tokens (a token names an expert once).
constexpr std::size_t moe_capacity(const moe_shape& s) noexcept {
  const std::size_t n = s.tokens();
  if (s.experts == 0) return 0;
  if (!(s.capacity_factor > 0.0)) return n;
  const double c = s.capacity_factor * static_cast<double>(n) * static_cast<double>(s.top_k) /
                   static_cast<double>(s.experts);
  return c >= static_cast<double>(n) ? n : static_cast<std::size_t>(c);  // truncation: the floor
}

// Rows the experts compute in one call, at most: every choice (N·k) or every slot (E·capacity),
// whichever is fewer. Every buffer is sized for it, so no routing needs more memory than the
// plan says: balanced routing fills it, all tokens to one expert fill `capacity` of it.
constexpr std::size_t moe_rows(const moe_shape& s) noexcept {
  return std::min(s.tokens() * s.top_k, s.experts * moe_capacity(s));
}

// The routing a forward keeps for its backward, in `saved` (the backend's memory).
template <typename A>
struct moe_routing {
  A* p;                  // [N, E]: the router's probabilities
  std::int32_t* choice;  // [N, k]: each token's experts, best first
  std::int32_t* row;     // [N, k]: each choice's row of the grouped buffer, −1 when dropped
  A* g;                  // [N, k]: the gates
  std::int32_t* off;     // [E + 1]: expert e's rows are [off[e], off[e + 1])
};

// What forward did with its tokens (the caller's, optional): the load-balancing loss it adds and
// the choices the capacity dropped. += sums calls (a model's blocks, a step's micro-batches).
struct moe_stats {
  double aux_loss = 0.0;            // α · E · Σ_e f_e · P_e, already weighted by α
  std::size_t choices = 0;          // tokens · k
  std::size_t dropped = 0;          // choices dropped at capacity
  std::size_t tokens = 0;
  std::size_t tokens_dropped = 0;   // tokens all of whose choices were dropped (only the residual)
  std::size_t max_expert_rows = 0;  // the fullest expert's kept rows (at most the capacity)

  constexpr moe_stats& operator+=(const moe_stats& o) noexcept {
    aux_loss += o.aux_loss;
    choices += o.choices;
    dropped += o.dropped;
    tokens += o.tokens;
    tokens_dropped += o.tokens_dropped;
    max_expert_rows = std::max(max_expert_rows, o.max_expert_rows);
    return *this;
  }
};

MEMBOUND_NAMESPACE_END
