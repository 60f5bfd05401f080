// The trainer's options and load options (one part of the trainer, train/trainer.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "membound/core/config.hpp"
#include "membound/memory/host_allocator_ref.hpp"
#include "membound/optimizer/adamw.hpp"
#include "membound/train/fingerprint.hpp"
#include "membound/train/schedule_lr.hpp"

MEMBOUND_NAMESPACE_BEGIN

// automatic: dynamic loss scaling for fp16 storage (its range needs it), none otherwise.
enum class loss_scaling : std::uint8_t { automatic, off, dynamic };


struct trainer_options {
  adamw_config adam{};      // adam.lr is not used: `lr` gives each step's rate
  cosine_lr lr{};
  double clip = 1.0;        // global-norm clipping; <= 0 turns it off
  loss_scaling scaling = loss_scaling::automatic;
  loss_scaler scaler{};     // its starting scale and growth interval
  std::uint64_t seed = 1;   // weights and the data generator
  bool replan_under_pressure = true;
  std::vector<std::size_t> head_chunks{256, 64};  // what a stricter plan may choose from
  // ZeRO stage over more than one rank: 0 keeps AdamW's state for every parameter on every rank,
  // 1 shards it (each rank updates its shard_of the parameters, then the weights are gathered),
  // 2 shards the gradients too (each block's gradients reduce-scattered as its backward ends).
  std::size_t zero = 0;
  // Each block's gradient exchange is started as its backward ends and completed at the end of the
  // next block's backward, which runs while it is in flight. ZeRO-2: every micro-batch's
  // reduce-scatter of the block's bucket (one bucket and its workspace more between two backward
  // ops); ZeRO-0/1: in the step's last micro-batch (the earlier ones accumulate), the all-reduce
  // (ZeRO-0) or reduce-scatter into the shards (ZeRO-1) of the block's accumulated gradients (one
  // exchange workspace more), then the embedding's and head's after the backward. The same sums,
  // bit for bit; the plan counts what is in flight (plan_options::gradients, see
  // gradient_exchange_of). Needs an overlapping_communicator (ZeRO-1/2) or an
  // overlapping_all_reduce_communicator (ZeRO-0).
  bool overlap = false;
  // The caller's own settings of the run, which its checkpoints record beside the trainer's
  // (run_settings) and load() compares: {"data", a digest of the training text}, a config name.
  // A name is not empty and holds no '=' or new line; a value holds no new line. Over ranks give
  // every rank the same tags (a whole checkpoint loaded under ZeRO-0 is checked by each rank alone).
  std::vector<fingerprint_field> run_tags{};
  // The host space of a plan with the optimizer offloaded (plan_options::offload): the caller's
  // host allocator (a budget_allocator for a host budget), which serves the optimizer's state and
  // the two staging buffers before step 1. Needed only by such a plan; it must outlive the trainer.
  host_allocator_ref host{};
};

// Whether load() takes a checkpoint written under other run settings (trainer::run_settings: the
// learning-rate schedule, AdamW's hyper-parameters, clipping, loss scaling, the caller's
// run_tags). refuse (the default): checkpoint_run_changed, nothing loaded, so that a resumed run
// is the uninterrupted one unless asked otherwise. accept: loaded, the run goes on under this
// trainer's settings, and trainer::changed_at_load() lists what differed.
enum class run_changes : std::uint8_t { refuse, accept };
struct load_options {
  run_changes changes = run_changes::refuse;
};

MEMBOUND_NAMESPACE_END
