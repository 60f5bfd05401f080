// Recompute policies at the sequence level: what one layer keeps from forward for backward, and
// what it recomputes (what PyTorch calls activation checkpointing; in membound "checkpoint" means a
// checkpoint file only). Block-level schedules across layers (which blocks' activations to keep)
// belong to the planner: model/recompute_schedule.hpp.
#pragma once

#include <cstddef>

#include "membound/core/config.hpp"
#include "membound/policy/policy_kind.hpp"

MEMBOUND_NAMESPACE_BEGIN

MEMBOUND_POLICY_KIND(recompute_kind, "recompute");

// Keep everything forward produces: the most memory, no recomputation.
struct save_all {
  using policy_kind = recompute_kind;
};

// Keep the minimum (the layer's inputs and small per-row statistics) and recompute the rest in
// backward: the least memory, one more forward's work.
struct recompute {
  using policy_kind = recompute_kind;
};

// TTT state groups: keep the inner model's state at the start of every group of G consecutive
// mini-batches and recompute the states inside a group in backward (G is ttt-lm's
// scan_checkpoint_group_size). G = 1 keeps every state; a larger G keeps 1/G of them.
template <std::size_t G>
struct ttt_state_groups {
  static_assert(G >= 1,
                "membound: ttt_state_groups<G>: G (mini-batches per saved inner state) must be at "
                "least 1; G = 1 keeps every inner state.");

  using policy_kind = recompute_kind;
  static constexpr std::size_t group_size = G;
};

// One group for the whole sequence: only the initial inner state is kept ("G = all").
using ttt_state_groups_all = ttt_state_groups<static_cast<std::size_t>(-1)>;

template <typename T>
inline constexpr bool is_ttt_state_groups_v = false;
template <std::size_t G>
inline constexpr bool is_ttt_state_groups_v<ttt_state_groups<G>> = true;

// The names before "checkpoint" came to mean a checkpoint file only; kept for one release.
using checkpoint_kind [[deprecated("membound: checkpoint_kind is now recompute_kind")]] = recompute_kind;
template <std::size_t G>
using ttt_checkpoint_groups [[deprecated("membound: ttt_checkpoint_groups<G> is now ttt_state_groups<G>")]] =
    ttt_state_groups<G>;
using ttt_checkpoint_all [[deprecated("membound: ttt_checkpoint_all is now ttt_state_groups_all")]] =
    ttt_state_groups_all;

MEMBOUND_NAMESPACE_END
