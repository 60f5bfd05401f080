// Checkpoint policies at the sequence level: what one layer keeps from forward for backward.
// Block-level schedules across layers (which blocks to checkpoint) belong to the planner and
// have their own names.
#pragma once

#include <cstddef>

#include "membound/core/config.hpp"
#include "membound/policy/policy_kind.hpp"

MEMBOUND_NAMESPACE_BEGIN

MEMBOUND_POLICY_KIND(checkpoint_kind, "checkpoint");

// Keep everything forward produces: the most memory, no recomputation.
struct save_all {
  using policy_kind = checkpoint_kind;
};

// Keep the minimum (the layer's inputs and small per-row statistics) and recompute the rest in
// backward: the least memory, one more forward's work.
struct recompute {
  using policy_kind = checkpoint_kind;
};

// TTT: keep the inner model's state at the start of every group of G consecutive mini-batches
// and recompute the states inside a group in backward (G is ttt-lm's scan_checkpoint_group_size).
// G = 1 keeps every state; a larger G keeps 1/G of them and recomputes the rest.
template <std::size_t G>
struct ttt_checkpoint_groups {
  static_assert(G >= 1,
                "membound: ttt_checkpoint_groups<G>: G (mini-batches per checkpoint group) must "
                "be at least 1; G = 1 keeps every inner state.");

  using policy_kind = checkpoint_kind;
  static constexpr std::size_t group_size = G;
};

// One group for the whole sequence: only the initial inner state is kept ("G = all").
using ttt_checkpoint_all = ttt_checkpoint_groups<static_cast<std::size_t>(-1)>;

template <typename T>
inline constexpr bool is_ttt_checkpoint_groups_v = false;
template <std::size_t G>
inline constexpr bool is_ttt_checkpoint_groups_v<ttt_checkpoint_groups<G>> = true;

MEMBOUND_NAMESPACE_END
