// What a step and a rank report (one part of the trainer, train/trainer.hpp): the step's result,
// a change of plan and why, each rank's predicted bytes, and the one-line plan summary.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "membound/core/config.hpp"
#include "membound/core/format.hpp"
#include "membound/core/pressure_level.hpp"
#include "membound/model/planner.hpp"

MEMBOUND_NAMESPACE_BEGIN

// A change of plan, and why.
struct replan_event {
  std::uint64_t step = 0;         // 1-based step it happened in
  std::string reason;             // "pressure emergency at after_forward", "out of memory", ...
  std::size_t usage = 0;          // footprint when it was seen
  std::size_t limit = 0;
  std::size_t foreign = 0;        // bytes held by others when the new plan was chosen
  std::string from, to;           // plan summaries
  std::size_t from_peak = 0, to_peak = 0;
  bool retried = false;           // the step was run again under `to` (else: from the next step)
  bool stricter_found = true;     // false: no smaller plan fits; the step went on as it was

  std::string describe() const {
    std::string s = "step " + std::to_string(step) + ": " + reason;
    if (limit != 0) {
      char pct[32];
      std::snprintf(pct, sizeof pct, " (%.1f%%)", 100.0 * static_cast<double>(usage) / static_cast<double>(limit));
      s += " at " + format_bytes(usage, false) + " of " + format_bytes(limit, false) + pct;
    }
    if (foreign != 0) s += ", " + format_bytes(foreign, false) + " held by others";
    if (!stricter_found) return s + "; no smaller plan fits, continuing under " + from;
    s += retried ? "; retrying the step under " : "; from the next step: ";
    return s + to + " (predicted peak " + format_bytes(to_peak, false) + ", was " + format_bytes(from_peak, false) + ")";
  }
};

struct step_result {
  std::uint64_t step = 0;       // 1-based
  double loss = 0;              // mean cross-entropy over the effective batch
  double lr = 0;
  double grad_norm = 0;         // of the true (unscaled) gradient, before clipping
  bool applied = true;          // false: the gradients held inf/NaN and the update was skipped
  double loss_scale = 1;        // after the step
  pressure_level pressure = pressure_level::normal;  // the highest level seen in the step
  std::vector<replan_event> replans;
  double ms = 0;
  std::size_t tokens = 0;
  // This rank's mixture-of-experts blocks, summed over its micro-batches (zero without them):
  // the balancing loss (`loss` holds its mean over the micro-batches, weighted as theirs), the
  // choices and the tokens their capacity dropped.
  moe_stats moe{};
};


// One rank's persistent and transient bytes as its plan predicts them (requested bytes): what the
// plan table says per rank of a data-parallel run. exchange is the gradient exchange's buffer,
// sized to fit inside the step's peak (so it is part of `peak`, not added to it).
struct rank_memory {
  std::uint64_t rank = 0, ranks = 1, zero = 0;
  std::uint64_t weights = 0, gradients = 0, optimizer = 0;
  std::uint64_t shard_begin = 0, shard_end = 0;  // the parameters whose optimizer state it holds
  std::uint64_t exchange = 0, peak = 0, limit = 0;  // limit: the allocator's budget, 0 for none
  std::uint64_t host = 0;  // offload: the host space's peak (state and staging, block inputs), else 0
};

// One line per rank: "rank 1/2: weights 219.2 KiB, gradients 219.2 KiB, optimizer 219.2 KiB
// (parameters [28048, 56096)), exchange buffer 99.1 KiB (inside the peak), predicted peak ...".
inline std::string rank_memory_table(const std::vector<rank_memory>& ranks) {
  std::string s;
  for (const rank_memory& r : ranks) {
    s += "rank " + std::to_string(r.rank) + "/" + std::to_string(r.ranks) + " (ZeRO-" + std::to_string(r.zero) +
         "): weights " + format_bytes(r.weights, false) + ", gradients " + format_bytes(r.gradients, false) +
         ", optimizer " + (r.host != 0 && r.optimizer == 0 ? "offloaded, " + format_bytes(r.host, false) + " on the host"
                                                          : format_bytes(r.optimizer, false)) +
         " (parameters [" + std::to_string(r.shard_begin) + ", " +
         std::to_string(r.shard_end) + ")), exchange buffer " + format_bytes(r.exchange, false) +
         " (inside the peak), predicted peak " + format_bytes(r.peak, false) +
         (r.host != 0 && r.optimizer != 0 ? " (+ " + format_bytes(r.host, false) + " of block inputs on the host)"
                                          : std::string{}) +
         (r.limit != 0 ? " of a budget of " + format_bytes(r.limit, false) : std::string{}) + "\n";
  }
  return s;
}

// One line naming a plan, in the plan table's words: "micro-batch 4 x 128 tokens, 2 micro-batches
// per step, schedule none, logit chunk 256".
inline std::string plan_summary(const training_plan& p) {
  return "micro-batch " + std::to_string(p.micro.batch) + " x " + std::to_string(p.micro.seq) + " tokens" +
         (p.micro.packed() ? " (packed: at most " + std::to_string(p.micro.sequences) + " sequences)" : "") + ", " +
         std::to_string(p.accumulation) + (p.accumulation == 1 ? " micro-batch" : " micro-batches") +
         " per step, schedule " + p.schedule.name() + ", logit chunk " + std::to_string(p.head_chunk) +
         (p.host_activations != 0 ? ", " + format_bytes(p.host_activations, false) + " of block inputs on the host"
                                  : std::string{});
}

MEMBOUND_NAMESPACE_END
