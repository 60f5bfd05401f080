// The planner: before the first step, the exact bytes of a training step of a model, and the
// schedule that fits a budget.
//
//   auto p = membound::make_plan(m, {8, 256}, membound::schedules::every<2>{}, {.threads = 2});
//   std::cout << p.table();                           // categories, peak phase, headroom
//   auto q = membound::fit(m, {32, 256}, 2ull << 30, {.threads = 2});  // micro-batch, schedule, chunk
//
// Exactness comes from construction: the step (model::forward_backward) allocates, op by op, in
// the order model/recompute_schedule.hpp's simulate() counts, and every size is the layers' own pure size
// function. The tests compare the prediction with the budget allocator's measured peak for every
// layer type × schedule × precision.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "membound/core/checked_math.hpp"
#include "membound/core/config.hpp"
#include "membound/core/error.hpp"
#include "membound/core/format.hpp"
#include "membound/model/model.hpp"
#include "membound/model/recompute_schedule.hpp"
#include "membound/core/shard.hpp"
#include "membound/optimizer/adamw.hpp"
#include "membound/optimizer/optimizer_policy.hpp"

MEMBOUND_NAMESPACE_BEGIN

// Block-level recompute schedules, as policies.
namespace schedules {
struct none {};    // keep everything forward produces
struct full {};    // keep block inputs only, recompute every block in backward
// Keep the input of every K-th block.
template <std::size_t K>
struct every {
  static_assert(K >= 1, "membound: schedules::every<K>: K (blocks per segment) must be at least 1.");
};
// Revolve's optimal schedule with Slots slots for saved block inputs.
template <std::size_t Slots>
struct binomial {
  static_assert(Slots >= 1, "membound: schedules::binomial<Slots>: at least one slot for a saved block input.");
};
// The least recompute whose peak fits this many bytes (the planner's DP).
struct budget {
  std::size_t bytes = 0;  // the budget the step's peak must fit
};
}  // namespace schedules

// A schedule chosen at run time (what fit() returns, what a command line asks for).
struct schedule_choice {
  // The schedules:: policy of the same name.
  enum class kind : unsigned char { none, full, every, binomial, budget };
  kind k = kind::none;    // which schedule
  std::size_t param = 0;  // K, slots or bytes

  // Each policy as a choice, so that what takes a choice takes a policy too.
  static constexpr schedule_choice of(schedules::none) noexcept { return {kind::none, 0}; }
  // schedules::full as a choice.
  static constexpr schedule_choice of(schedules::full) noexcept { return {kind::full, 0}; }
  // schedules::every<K> as a choice: param = K.
  template <std::size_t K>
  static constexpr schedule_choice of(schedules::every<K>) noexcept { return {kind::every, K}; }
  // schedules::binomial<N> as a choice: param = N.
  template <std::size_t N>
  static constexpr schedule_choice of(schedules::binomial<N>) noexcept { return {kind::binomial, N}; }
  // schedules::budget as a choice: param = its bytes.
  static constexpr schedule_choice of(schedules::budget b) noexcept { return {kind::budget, b.bytes}; }
  // A choice is already one.
  static constexpr schedule_choice of(schedule_choice c) noexcept { return c; }

  // As the plan table writes it: "none", "every<2>", "budget(1.50 GiB)".
  std::string name() const {
    switch (k) {
      case kind::none: return "none";
      case kind::full: return "full";
      case kind::every: return "every<" + std::to_string(param) + ">";
      case kind::binomial: return "binomial<" + std::to_string(param) + ">";
      case kind::budget: return "budget(" + format_bytes(param, false) + ")";
    }
    return "?";
  }
  // The same kind with the same parameter.
  friend constexpr bool operator==(const schedule_choice&, const schedule_choice&) = default;
};

// ZeRO-2 for the planner: this process (rank `rank` of `ranks`) keeps only its shard_of the
// summed gradients. A micro-batch's gradients live only in buckets: each block's, from the start
// to the end of its backward op (the block's gradients, then their reduce-scatter into the ranks'
// shards); the embedding's and the head's (the tied table gets gradients from the loss and from
// the embedding's backward) for the whole micro-batch, reduce-scattered once it is done. The
// reduce-scatter's workspace for blocks of at most k elements per rank is
// exchange_per_element * k + exchange_fixed bytes (the communicator's
// reduce_scatter_blocks_workspace_bytes, which is affine in k), plus k elements to add into the
// shard when accumulation > 1. ranks <= 1: off (one flat array of every gradient).
// overlap: each block's reduce-scatter is started (non-blocking) as its backward ends and
// completed at the end of the next block's backward (the last one's after the micro-batch's
// backward), so its bucket and workspace stay live through the ops in between: chain_link's
// backward_carry.
//
// zero = 0 or 1 with overlap (ZeRO-0/1 overlapped): every rank keeps every gradient (no shard,
// no bucket), and the step's last micro-batch starts, as block i's backward ends, the exchange of
// block i's parameters (ZeRO-0: an all-reduce of the range, its workspace affine in the range's
// largest shard max_shard(k, ranks); ZeRO-1: a reduce-scatter of the range into the ranks'
// optimizer shards, affine in the largest rank's part of it), completed as the next block's
// backward ends: its workspace is that backward's carry. The embedding's and head's exchanges
// follow the micro-batch's backward, one at a time. Earlier micro-batches only accumulate.
//
// zero = 3 (ZeRO-3): ZeRO-2's gradients, and the weights sharded the same way: a rank keeps the
// weights of its shard_of the parameters only. Before each op that reads weights, the weight unit
// it reads (Model::unit_parameters: a block, the embedding's table for the lookup, the head's
// norm and table for the loss) is gathered (all-gather of every rank's part, in place) into a
// slot of the micro-batch's gathered buffer (training_plan::weight_gather), unless a slot holds
// it: one slot of the largest unit. With overlap a second slot takes the gather of the unit the
// next op reads, started non-blocking as the op before it begins (and the gradients'
// reduce-scatters overlap as ZeRO-2's do); the two slots start at the buffer's two ends, which
// holds the largest pair of units read in a row (weight_gather_bytes).
struct gradient_shards {
  // Processes sharing the gradients (off at 1 or fewer) and this process's index among them.
  std::size_t ranks = 0, rank = 0;
  // The exchange's workspace for blocks of k elements per rank: per_element · k + fixed bytes.
  std::size_t exchange_per_element = 0, exchange_fixed = 0;
  bool overlap = false;  // each block's exchange started as its backward ends (see above)
  std::size_t zero = 2;  // the ZeRO stage the exchange serves (see above)
  // ZeRO-2 and 3: the gradients sharded.
  constexpr bool on() const noexcept { return ranks > 1 && zero >= 2; }
  // ZeRO-3: the weights too.
  constexpr bool weights_sharded() const noexcept { return ranks > 1 && zero == 3; }
  // ZeRO-0/1 overlapped: the whole gradient kept, each block's exchange started in its backward.
  constexpr bool whole_overlapped() const noexcept { return ranks > 1 && zero < 2 && overlap; }
};

// Optimizer offload (ZeRO-Offload's placement): the optimizer's state (AdamW's m, v and fp32
// masters) lives in a second memory space, the host's (pinned memory beside a GPU; a second arena
// on the CPU), with its own budget. After the gradient norm, the state's range is walked in
// buckets: each bucket's gradients and weights are copied into two host staging buffers of
// `bucket` parameters, updated there by the policy's update_range, and the weights copied back.
// The device then holds weights, gradients and activations only; the host holds the state and
// the two buffers, all made before step 1 and kept (its peak is their sum).
inline constexpr std::size_t default_offload_bucket = std::size_t{1} << 20;
// Activation offload: a budget schedule (the DP) may keep a segment's input x_s in the host space
// while the blocks after the segment are reversed: copied out after the forward passes it,
// fetched back before the segment's backward (chain::offload_inputs), each byte each way costing
// flops_per_byte in the DP's cost (recompute FLOPs). The host space holds the inputs offloaded at
// once (their most, host_activations) beside the optimizer's part; when the DP's schedule would
// take it over the host budget, the plan is made without activation offload.
// Whether the optimizer's state is offloaded, its bucket, the host space's budget, and whether
// block inputs may be offloaded.
struct offload_options {
  bool optimizer = false;       // the optimizer's state in the host space
  // Parameters per staged bucket (0: default_offload_bucket), rounded up to a multiple of the
  // policy's range_granule and at most the parameters whose state this process holds.
  std::size_t bucket = 0;
  std::size_t host_budget = 0;  // the host space's budget (0: none)
  bool activations = false;     // budget schedules may offload block inputs (above)
  // The DP's cost of moving one byte (each way) in FLOPs: the device's FLOP rate over the
  // link's bandwidth (0: free, so that any offload that saves recompute is taken). fit() sets it
  // from fit_options::offload_flops_per_byte.
  double flops_per_byte = 0;
};

// What make_plan plans for besides the model, the micro-batch and the schedule.
struct plan_options {
  std::size_t threads = 1;        // CPU threads the step runs with: the workspaces depend on it
  std::size_t head_chunk = 256;   // logit rows per cross-entropy chunk
  std::size_t accumulation = 1;   // micro-batches per optimizer step
  bool optimizer = true;          // count the optimizer's state (AdamW: m, v, and fp32 masters for 16-bit storage)
  // Parameters whose optimizer state this process holds: 0 for all of them; under ZeRO-1 its shard.
  std::size_t optimizer_elements = 0;
  // The optimizer policy whose state_bytes the plan counts: optimizer_of<adamw8bit<S>>(), ...;
  // the default is adamw<S> for the model's storage S.
  optimizer_ref optimizer_policy{};
  // ZeRO-2: the gradients sharded too (gradient_shards); off by default.
  gradient_shards gradients{};
  // The optimizer's state in the host space (offload_options); off by default.
  offload_options offload{};
};

namespace detail {
// The policy's state bytes for n parameters of storage S; a policy for another storage type is
// refused (its bytes would be another layout's).
template <typename S>
constexpr std::size_t policy_state_bytes(const optimizer_ref& r, std::size_t n) {
  if (r.state_bytes == nullptr) return adamw<S>::state_bytes(n);
  if (r.storage != dtype_name<S>()) {
    throw invalid_argument("options.optimizer_policy",
                           "a policy for the model's " + std::string(dtype_name<S>()) + " storage",
                           std::string(r.name) + " for " + std::string(r.storage),
                           "Name the policy for the model's storage: optimizer_of<adamw8bit<Model::storage_type>>()");
  }
  return r.state_bytes(n);
}
}  // namespace detail

// The optimizer's bytes for the parameters o says this process keeps state for.
template <typename Model>
std::size_t optimizer_state_bytes(const Model& m, const plan_options& o) {
  if (!o.optimizer) return 0;
  const std::size_t n = o.optimizer_elements != 0 ? o.optimizer_elements : m.parameter_elements();
  return detail::policy_state_bytes<typename Model::storage_type>(o.optimizer_policy, n);
}

// The plan table's words for the policy o names.
template <typename Model>
std::string optimizer_description(const plan_options& o) {
  if (!o.optimizer) return "(not counted)";
  return o.optimizer_policy.description != nullptr ? o.optimizer_policy.description()
                                                   : adamw<typename Model::storage_type>::description();
}

// One op of the step's timeline: what it is, bytes live before it and its peak.
struct plan_phase {
  std::string name;              // the op, as the table prints it
  std::size_t live_before = 0;   // bytes live when it starts
  std::size_t peak = 0;          // the most bytes live while it runs
};

// make_plan's and fit()'s answer: the exact bytes of a training step, by category and by op.
struct training_plan {
  batch_shape micro;                   // one micro-batch
  std::size_t accumulation = 1;        // micro-batches per optimizer step
  schedule_choice schedule;            // which block inputs forward keeps
  std::size_t head_chunk = 0;          // logit rows per cross-entropy chunk
  std::size_t threads = 1;             // CPU threads the sizes are for
  // Persistent bytes: the weights, the gradients (this rank's shard under ZeRO-2) and the
  // optimizer's state.
  std::size_t weights = 0, gradients = 0, optimizer = 0;
  // Persistent too, on a device only: the step's token and target ids and the gradient norm's
  // partials (Model::step_buffer_bytes for micro.tokens() · accumulation); 0 on the host.
  std::size_t step_buffers = 0;
  std::string optimizer_policy;  // the optimizer's state, in words (the table's line)
  // ZeRO-2 (gradients = this rank's shard): the most gradient bytes a block's backward holds
  // beyond it (its bucket), and the embedding's and head's bucket held through each micro-batch.
  std::size_t gradient_bucket = 0, gradient_held = 0;
  // Overlapped (gradient_shards::overlap): the most bytes in flight between two blocks' backward
  // ops, a bucket and its exchange's workspace (ZeRO-0/1 overlapped: the workspace only).
  std::size_t gradient_in_flight = 0;
  std::size_t gradient_ranks = 1;  // ranks sharing the gradients (1: not sharded)
  // ZeRO-3 (weights = this rank's shard): the gathered weights each micro-batch holds: one slot of
  // the largest weight unit; with overlap, the largest sum of two units read in a row
  // (weight_gather_bytes).
  std::size_t weight_gather = 0;
  gradient_shards gradient_sharding{};  // what it was made with (plan_options::gradients)
  // Optimizer offload (plan_options::offload): then `optimizer` is 0 and the host space holds the
  // state (host_optimizer) and two staging buffers of offload_bucket parameters (host_staging),
  // under host_budget (0: none).
  bool offload_optimizer = false;
  std::size_t host_optimizer = 0;  // the optimizer's state, in the host space
  std::size_t host_staging = 0;    // the two staging buffers
  std::size_t offload_bucket = 0;  // parameters per bucket
  std::size_t host_budget = 0;     // the host space's budget (0: none)
  // Activation offload (offload_options::activations): the most bytes of block inputs in the
  // host space at once, those a micro-batch copies out (and as many back), and what the
  // copies cost in the DP's unit (offload_options::flops_per_byte). All 0 when the schedule
  // offloads nothing.
  std::size_t host_activations = 0;
  std::size_t offloaded_bytes = 0;  // block input bytes copied out per micro-batch (as many back)
  double offload_flops = 0;         // those copies' cost in the DP's unit, both ways
  // What it was made with (plan_options::offload.activations and flops_per_byte): a trainer's
  // replans offer the DP the same choice at the same price.
  bool activations_offloadable = false;
  double offload_flops_per_byte = 0;  // the price of a byte moved each way (flops_per_byte)
  // The host space's peak: the optimizer's part is made before step 1 and kept, the block
  // inputs come and go within a micro-batch.
  std::size_t host_peak() const noexcept { return sat_add(host_optimizer, host_staging, host_activations); }
  // Whether the plan uses the host space at all.
  bool offloads() const noexcept { return offload_optimizer || host_activations != 0; }
  // Whether the host space's bytes fit its budget (none: always).
  bool host_fits() const noexcept { return host_budget == 0 || host_peak() <= host_budget; }
  std::size_t activations = 0;   // most bytes kept between ops (block inputs, saved, δ)
  std::size_t workspace = 0;     // the transient bytes of the peak op
  std::size_t peak_bytes = 0;    // max over the timeline; what the budget allocator measures
  // The reserved peak on the allocator stack the plan was checked for (model/reserve_plan.hpp):
  // rounding, segments and holes included; 0 when no stack was given (then only requested
  // bytes were planned, which is exact over system_allocator alone).
  std::size_t reserved_peak = 0;
  std::string peak_phase;        // the timeline's op at the peak
  std::size_t budget = 0;        // 0: none given
  // Device memory outside every allocator of the stack (the CUDA context, cuBLASLt's handle and
  // workspace, other libraries), measured once by the caller (cudaMemGetInfo before and after
  // they exist) and shown as a line of the table; not part of the peak, but the budget's: fits()
  // and the headroom count it (fit the stack into budget − outside_stack). 0: not measured / none.
  std::size_t outside_stack = 0;
  std::string outside_note;  // what it is and how it was measured, for the table
  double forward_flops = 0;      // of one micro-batch's blocks
  double recompute_flops = 0;    // of one micro-batch
  std::vector<chain_op> ops;         // the schedule's ops, in the order the step runs them
  std::vector<plan_phase> timeline;  // every op of the step with its bytes, in order

  // Recompute FLOPs as a fraction of the blocks' forward FLOPs.
  double recompute_overhead() const noexcept {
    return forward_flops == 0 ? 0.0 : recompute_flops / forward_flops;
  }
  // What a budget over the planned stack counts at the peak.
  std::size_t budgeted_peak() const noexcept { return std::max(peak_bytes, reserved_peak); }
  // A saturated peak (a model or shape past any address space) fits no budget, SIZE_MAX included.
  bool fits() const noexcept { return device_fits() && host_fits(); }
  // The device's budget alone (what fits() asks besides host_fits()).
  bool device_fits() const noexcept {
    return !saturated(budgeted_peak()) && (budget == 0 || sat_add(budgeted_peak(), outside_stack) <= budget);
  }

  // A table a person reads before step 1.
  std::string table() const {
    std::string s;
    char line[256];
    auto row = [&](const char* what, std::size_t bytes, const char* note) {
      std::snprintf(line, sizeof line, "  %-22s %14s  %s\n", what, format_bytes(bytes, false).c_str(), note);
      s += line;
    };
    char packing[64] = "";
    if (micro.packed()) std::snprintf(packing, sizeof packing, " (packed: at most %zu sequences)", micro.sequences);
    std::snprintf(line, sizeof line,
                  "plan: micro-batch %zu x %zu tokens%s, %zu micro-batch%s per step, schedule %s, "
                  "logit chunk %zu, %zu thread%s\n",
                  micro.batch, micro.seq, packing, accumulation, accumulation == 1 ? "" : "es",
                  schedule.name().c_str(), head_chunk, threads, threads == 1 ? "" : "s");
    s += line;
    if (weight_gather != 0) {
      const std::string note = "this rank's shard (ZeRO-3 over " + std::to_string(gradient_ranks) + " ranks)";
      row("weights", weights, note.c_str());
      row("weights (gathered)", weight_gather,
          gradient_sharding.overlap ? "in a micro-batch: embedding, head, two block slots (prefetch)"
                                    : "in a micro-batch: embedding, head, one block slot");
    } else {
      row("weights", weights, "");
    }
    if (gradient_ranks > 1) {
      char note[200];
      std::snprintf(note, sizeof note, "this rank's shard (ZeRO-%zu over %zu ranks); in a step + %s per block, + %s held%s",
                    gradient_sharding.zero, gradient_ranks, format_bytes(gradient_bucket, false).c_str(), format_bytes(gradient_held, false).c_str(),
                    gradient_in_flight != 0 ? (", + " + format_bytes(gradient_in_flight, false) + " in flight (overlapped)").c_str()
                                            : "");
      row("gradients", gradients, note);
    } else if (gradient_in_flight != 0) {
      const std::string note = "+ " + format_bytes(gradient_in_flight, false) +
                               " in flight in the last micro-batch's backward (overlapped exchange)";
      row("gradients", gradients, note.c_str());
    } else {
      row("gradients", gradients, "");
    }
    row("optimizer", optimizer,
        offload_optimizer ? "offloaded: in the host space (below)"
        : optimizer == 0  ? "(not counted)"
        : optimizer_policy.empty() ? "AdamW m, v (+ fp32 masters)"
                                   : optimizer_policy.c_str());
    if (step_buffers != 0) row("step buffers", step_buffers, "the step's token ids and targets, the norm's partials");
    row("activations (kept)", activations, "at most, between ops");
    row("workspace (at peak)", workspace, "transient");
    const std::string at = "at " + peak_phase;
    row("predicted peak", peak_bytes, at.c_str());
    if (reserved_peak != 0) {
      char note[64];
      std::snprintf(note, sizeof note, "on the allocator stack, +%.1f%% (rounding, segments)",
                    peak_bytes == 0 ? 0.0 : 100.0 * (static_cast<double>(reserved_peak) / static_cast<double>(peak_bytes) - 1.0));
      row("reserved peak", reserved_peak, note);
    }
    if (outside_stack != 0) row("outside the stack", outside_stack, outside_note.c_str());
    const std::size_t counted = sat_add(budgeted_peak(), outside_stack);
    if (budget != 0) {
      row("budget", budget, "");
      if (counted <= budget) {
        std::snprintf(line, sizeof line, "  %-22s %14s  %.1f%% of the budget free\n", "headroom",
                      format_bytes(budget - counted, false).c_str(),
                      100.0 * static_cast<double>(budget - counted) / static_cast<double>(budget));
      } else {
        std::snprintf(line, sizeof line, "  %-22s %14s  OVER BUDGET\n", "headroom",
                      ("-" + format_bytes(counted - budget, false)).c_str());
      }
      s += line;
    }
    if (offloads()) {
      s += offload_optimizer && host_activations != 0 ? "host space (optimizer and activation offload):\n"
           : offload_optimizer                        ? "host space (optimizer offload):\n"
                                                      : "host space (activation offload):\n";
      if (offload_optimizer) {
        row("optimizer", host_optimizer, optimizer_policy.c_str());
        const std::string note = "a gradient and a weight bucket of " + std::to_string(offload_bucket) + " parameters";
        row("staging", host_staging, note.c_str());
      }
      if (host_activations != 0) {
        const std::string note = "block inputs at once; " + format_bytes(offloaded_bytes, false) +
                                 " out and back per micro-batch";
        row("activations", host_activations, note.c_str());
      }
      row("host peak", host_peak(), offload_optimizer ? "the optimizer's part made before step 1, kept" : "");
      if (host_budget != 0) {
        row("host budget", host_budget, "");
        if (host_fits()) {
          std::snprintf(line, sizeof line, "  %-22s %14s  %.1f%% of the host budget free\n", "host headroom",
                        format_bytes(host_budget - host_peak(), false).c_str(),
                        100.0 * static_cast<double>(host_budget - host_peak()) / static_cast<double>(host_budget));
        } else {
          std::snprintf(line, sizeof line, "  %-22s %14s  OVER THE HOST BUDGET\n", "host headroom",
                        ("-" + format_bytes(host_peak() - host_budget, false)).c_str());
        }
        s += line;
      }
    }
    std::snprintf(line, sizeof line, "  recompute: %.3g FLOPs per micro-batch (%.1f%% of the blocks' forward)\n",
                  recompute_flops, 100.0 * recompute_overhead());
    s += line;
    return s;
  }
};

// A plan's reserved peak on an allocator stack, or SIZE_MAX when the stack would refuse it
// (model/reserve_plan.hpp's reserve_model builds one for a stack).
using reserve_function = std::function<std::size_t(const training_plan&)>;

// The smallest budget that would fit, as a typed error (fit() found nothing under `budget`).
class budget_too_small : public invalid_argument {
 public:
  // context: why the budget is what it is, e.g. "32 MiB less 18 MiB held by others".
  budget_too_small(std::size_t budget, std::size_t minimum, const std::string& context = {})
      : invalid_argument("budget", "at least " + format_bytes(minimum) + " (the least peak of any plan)",
                         format_bytes(budget) + (context.empty() ? "" : " (" + context + ")"),
                         "Raise the budget to at least " + format_bytes(minimum, false) +
                             ", or shrink the model, the sequence or the vocabulary"),
        budget_(budget),
        minimum_(minimum) {}
  // The budget fit() was given, in bytes.
  std::size_t budget() const noexcept { return budget_; }
  // The least peak of any plan fit() considered: the smallest budget that would fit.
  std::size_t minimum() const noexcept { return minimum_; }

 private:
  std::size_t budget_, minimum_;
};

namespace detail {

inline std::string op_name(const chain_op& op, const char* block) {
  const std::string b = "block " + std::to_string(op.block) + " (" + block + ")";
  switch (op.kind) {
    case chain_op_kind::advance: return b + " forward";
    case chain_op_kind::tape: return b + " forward, kept";
    case chain_op_kind::retape: return b + " recompute";
    case chain_op_kind::loss: return "loss (head, chunked cross-entropy)";
    case chain_op_kind::backward: return b + " backward";
    case chain_op_kind::discard: return block[0] == '\0' ? "head input freed" : b + " input freed";
    case chain_op_kind::offload: return b + " input to the host";
    case chain_op_kind::fetch: return b + " input back from the host";
  }
  return "?";
}

}  // namespace detail

// The ops of a schedule for a chain (budget: the DP, which throws when nothing fits).
inline std::vector<chain_op> schedule_ops(const chain& c, schedule_choice s) {
  const std::size_t L = c.links.size();
  switch (s.k) {
    case schedule_choice::kind::none: return schedule_none(L);
    case schedule_choice::kind::full: return schedule_full(L);
    case schedule_choice::kind::every: return schedule_every(L, s.param);
    case schedule_choice::kind::binomial: return schedule_binomial(L, s.param);
    case schedule_choice::kind::budget: return optimal_schedule(c, s.param).ops;
  }
  return {};
}

// ZeRO-2: the workspace of one parameter range's reduce-scatter (and, with more than one
// micro-batch per step, the partial sum it adds into the shard): what the trainer allocates.
// ZeRO-0/1 overlapped: the range's all-reduce (ZeRO-0) or reduce-scatter into the shards (ZeRO-1),
// no partial sum (only the last micro-batch exchanges, into the accumulated gradients).
template <typename Model>
std::size_t gradient_exchange_bytes(const Model& m, const gradient_shards& gs, shard_range r, std::size_t accumulation) {
  const std::size_t n = m.parameter_elements();
  std::size_t most = 0;
  if (gs.zero == 0) {
    most = gs.ranks > 0 ? max_shard(r.size(), gs.ranks) : 0;
  } else {
    for (std::size_t k = 0; k < gs.ranks; ++k) most = std::max(most, overlap(shard_of(n, gs.ranks, k), r.begin, r.end).size());
  }
  return sat_add(sat_add(sat_mul(gs.exchange_per_element, most), gs.exchange_fixed),
                 gs.zero >= 2 && accumulation > 1 ? bytes_of<typename Model::storage_type>(most) : 0);
}

// The parameter elements of a weight unit (Model::unit_parameters: a block, the embedding, the head).
template <typename Model>
std::size_t weight_unit_elements(const Model& m, std::size_t unit) {
  const auto p = m.unit_parameters(unit);
  return sat_add(p[0].size(), p[1].size());
}

// ZeRO-3: the gathered weights a micro-batch holds (training_plan::weight_gather). One slot holds
// the unit an op reads (gathered before it, kept while the next op reads it too): the largest
// unit's elements. With `prefetch` (gradient_shards::overlap) a second slot takes the gather of
// the unit the next op reads while this one runs; the two slots start at the buffer's two ends,
// so they hold any two units read one after the other: the embedding and block 0, two blocks
// (a recompute can follow any block by any), a block and the head (the loss is followed by
// the backward of the last block, or by a recompute of any), and the embedding and the head
// when there are no blocks.
template <typename Model>
std::size_t weight_gather_bytes(const Model& m, bool prefetch) {
  const std::size_t L = m.depth();
  const std::size_t E = weight_unit_elements(m, m.embedding_unit()), H = weight_unit_elements(m, m.head_unit());
  std::size_t first = 0, second = 0;  // the two largest blocks
  for (std::size_t i = 0; i < L; ++i) {
    const std::size_t b = weight_unit_elements(m, i);
    if (b > first) {
      second = std::exchange(first, b);
    } else if (b > second) {
      second = b;
    }
  }
  std::size_t most = std::max({E, H, first});
  if (prefetch) {
    most = L == 0 ? sat_add(E, H)
                  : std::max({sat_add(E, weight_unit_elements(m, 0)), sat_add(H, first), sat_add(first, second)});
  }
  return bytes_of<typename Model::storage_type>(most);
}

namespace detail {
// Moves the optimizer's state of plan p to the host space (plan_options::offload) for the
// `elements` parameters whose state this process holds, S-sized, with its two staging buffers.
template <typename S>
void plan_offload_of(training_plan& p, const plan_options& o, std::size_t elements) {
  if (!o.optimizer) {
    throw invalid_argument("options.offload.optimizer", "false when options.optimizer is false",
                           "true with the optimizer's state not counted",
                           "Count the optimizer (options.optimizer = true) to offload it");
  }
  const std::size_t granule = o.optimizer_policy.state_bytes == nullptr ? 1 : o.optimizer_policy.granule;
  if (granule == 0) {
    throw invalid_argument("options.offload.optimizer", "an optimizer policy with update_range (adamw, adamw8bit)",
                           std::string(o.optimizer_policy.name) + ", which has none",
                           "Offload adamw<S> or adamw8bit<S>, or give the policy range_granule and update_range");
  }
  const std::size_t asked = o.offload.bucket != 0 ? o.offload.bucket : default_offload_bucket;
  const std::size_t rounded = sat_round_up(asked, granule);
  p.offload_optimizer = true;
  p.offload_bucket = std::max<std::size_t>(1, std::min(rounded, elements));
  p.host_optimizer = p.optimizer;
  p.optimizer = 0;
  p.host_staging = sat_mul(bytes_of<S>(p.offload_bucket), 2);
  p.host_budget = o.offload.host_budget;
}
}  // namespace detail

// The plan of one training step of m: micro-batch b, schedule s.
template <typename Model, typename Schedule>
training_plan make_plan(const Model& m, batch_shape b, Schedule s, const plan_options& o = {},
                        std::size_t budget = 0) {
  const schedule_choice sc = schedule_choice::of(s);
  training_plan p;
  p.micro = b;
  p.accumulation = o.accumulation;
  p.schedule = sc;
  p.head_chunk = o.head_chunk;
  p.threads = o.threads;
  using S = typename Model::storage_type;
  const gradient_shards& gs = o.gradients;
  const std::size_t n = m.parameter_elements();
  if (gs.on() && gs.rank >= gs.ranks) {
    throw invalid_argument("options.gradients.rank", "a rank below options.gradients.ranks = " + std::to_string(gs.ranks),
                           std::to_string(gs.rank), "Pass the communicator's rank() and size()");
  }
  // ZeRO-2: a range's reduce-scatter workspace (the largest rank's part of it) and its bucket.
  const auto exchange_of = [&](shard_range r) { return gradient_exchange_bytes(m, gs, r, o.accumulation); };
  p.weights = gs.weights_sharded() ? bytes_of<S>(shard_of(n, gs.ranks, gs.rank).size()) : m.weight_bytes();
  if (gs.weights_sharded()) p.weight_gather = weight_gather_bytes(m, gs.overlap);
  p.gradients = gs.on() ? bytes_of<S>(shard_of(n, gs.ranks, gs.rank).size()) : m.weight_bytes();
  p.gradient_ranks = gs.on() ? gs.ranks : 1;
  p.gradient_sharding = gs;
  p.optimizer = optimizer_state_bytes(m, o);
  p.optimizer_policy = optimizer_description<Model>(o);
  if (o.offload.optimizer) detail::plan_offload_of<S>(p, o, o.optimizer_elements != 0 ? o.optimizer_elements : n);
  p.step_buffers = Model::step_buffer_bytes(sat_mul(b.tokens(), o.accumulation), n);
  p.budget = budget != 0 ? budget : (sc.k == schedule_choice::kind::budget ? sc.param : 0);
  const std::size_t base = sat_add(p.weights, p.gradients, p.optimizer, p.step_buffers);
  std::size_t held_exchange = 0;  // the embedding's and head's reduce-scatter, after the micro-batch
  if (gs.on()) p.gradient_held = bytes_of<S>(sat_add(m.embedding_parameters().size(), m.head_parameters().size()));
  if (gs.on() || gs.whole_overlapped()) {
    held_exchange = std::max(exchange_of(m.embedding_parameters()), exchange_of(m.head_parameters()));
  }
  const std::size_t step_base = sat_add(base, p.gradient_held, p.weight_gather);
  chain c = m.make_chain(b, o.threads, o.head_chunk, step_base);
  if (gs.on()) {
    // Block i's backward: its δ, then its gradient bucket, then the larger of its workspace and
    // (that given back) the bucket's reduce-scatter workspace. Overlapped: the exchange before it
    // is completed and released first, and this one's bucket and workspace stay in flight.
    for (std::size_t i = 0; i < c.links.size(); ++i) {
      chain_link& l = c.links[i];
      const shard_range r = m.block_parameters(i);
      const std::size_t bucket = bytes_of<S>(r.size());
      const std::size_t ws = sat_sub(l.backward_peak, l.input_bytes);
      const std::size_t held = sat_add(l.input_bytes, bucket);
      if (gs.overlap) {
        l.backward_peak = sat_add(held, ws);
        l.backward_tail_peak = sat_add(held, exchange_of(r));
        l.backward_carry = sat_add(bucket, exchange_of(r));
        p.gradient_in_flight = std::max(p.gradient_in_flight, l.backward_carry);
      } else {
        l.backward_peak = sat_add(held, std::max(ws, exchange_of(r)));
      }
      p.gradient_bucket = std::max(p.gradient_bucket, bucket);
    }
  } else if (gs.whole_overlapped()) {
    // ZeRO-0/1 overlapped, the last micro-batch (the others hold less at every op): block i's
    // backward as it is; as it ends (its workspace given back, its new δ live) the exchange before
    // it is completed and released and this block's exchange workspace taken, in flight until the
    // next block's backward ends.
    for (std::size_t i = 0; i < c.links.size(); ++i) {
      chain_link& l = c.links[i];
      const std::size_t ws = exchange_of(m.block_parameters(i));
      l.backward_tail_peak = sat_add(l.input_bytes, ws);
      l.backward_carry = ws;
      p.gradient_in_flight = std::max(p.gradient_in_flight, l.backward_carry);
    }
  }
  if (!(o.offload.flops_per_byte >= 0) || o.offload.flops_per_byte > std::numeric_limits<double>::max()) {
    throw invalid_argument("options.offload.flops_per_byte", "a finite price of 0 or more FLOPs per byte moved",
                           std::to_string(o.offload.flops_per_byte),
                           "Price a byte as the device's FLOP/s over the link's bytes/s (0: free)");
  }
  p.activations_offloadable = o.offload.activations;
  p.offload_flops_per_byte = o.offload.flops_per_byte;
  if (o.offload.activations && sc.k == schedule_choice::kind::budget) {
    c.offload_inputs = true;
    c.offload_cost_per_byte = o.offload.flops_per_byte;
  }
  p.ops = schedule_ops(c, sc);
  std::vector<phase_bytes> tl;
  schedule_stats st = simulate(c, p.ops, &tl);
  if (st.offloaded_bytes != 0 && o.offload.host_budget != 0 &&
      sat_add(p.host_peak(), st.host_peak_bytes) > o.offload.host_budget) {
    // The host space cannot take this schedule's block inputs: the same budget without.
    const std::size_t wanted = sat_add(p.host_peak(), st.host_peak_bytes);
    c.offload_inputs = false;
    try {
      p.ops = schedule_ops(c, sc);
    } catch (const schedule_does_not_fit&) {
      throw invalid_argument("options.offload.host_budget",
                             "at least " + format_bytes(wanted) + " (the host peak of the budget schedule, which fits " +
                                 format_bytes(sc.param) + " of device only with block inputs offloaded)",
                             format_bytes(o.offload.host_budget),
                             "Raise the host budget to at least " + format_bytes(wanted, false) +
                                 ", or the device budget");
    }
    tl.clear();
    st = simulate(c, p.ops, &tl);
  }
  if (st.offloaded_bytes != 0) p.host_budget = o.offload.host_budget;
  p.host_activations = st.host_peak_bytes;
  p.offloaded_bytes = st.offloaded_bytes;
  p.offload_flops = st.offload_cost;
  p.peak_bytes = st.peak_bytes;
  p.recompute_flops = st.recompute_cost;
  for (const chain_link& l : c.links) p.forward_flops += l.forward_cost;

  // The timeline: the embedding, each op, the embedding's backward, the optimizer step.
  const std::size_t a = m.activation_bytes(b);
  p.timeline.push_back({"embedding forward", step_base, sat_add(step_base, a)});
  std::size_t best = sat_add(step_base, a);
  p.peak_phase = "embedding forward";
  p.activations = a;
  p.workspace = 0;
  for (const phase_bytes& ph : tl) {
    const chain_op& op = p.ops[ph.op];
    const bool is_block = op.kind != chain_op_kind::loss && op.block < c.length();
    const char* bn = is_block ? m.block_name(op.block) : "";
    plan_phase q{detail::op_name(op, bn), ph.live_before, ph.peak};
    p.activations = std::max(p.activations, sat_sub(sat_sub(sat_sub(ph.live_before, base), ph.in_flight), p.weight_gather));
    if (q.peak > best) {
      best = q.peak;
      p.peak_phase = q.name;
      // what the op adds beyond its outputs: its workspace
      const std::size_t out = [&]() -> std::size_t {
        const std::size_t L = c.links.size();
        const std::size_t ai = op.block < L ? c.links[op.block].input_bytes : c.output_bytes;
        switch (op.kind) {
          case chain_op_kind::advance: return c.links[op.block].input_bytes;
          case chain_op_kind::tape: return sat_add(ai, c.links[op.block].saved_bytes);
          case chain_op_kind::retape: return c.links[op.block].saved_bytes;
          case chain_op_kind::loss: return c.output_bytes;
          case chain_op_kind::backward: return ai;
          case chain_op_kind::discard: return 0;
          case chain_op_kind::offload: return 0;
          case chain_op_kind::fetch: return ai;
        }
        return 0;
      }();
      p.workspace = sat_sub(sat_sub(q.peak, q.live_before), out);
    }
    p.timeline.push_back(std::move(q));
  }
  // The last block's exchange, overlapped, is still in flight here; the gradient exchange completes it first.
  const std::size_t last_in_flight = gs.overlap && gs.ranks > 1 ? c.links[0].backward_carry : 0;
  p.timeline.push_back({"embedding backward", sat_add(step_base, a, last_in_flight), sat_add(step_base, a, last_in_flight)});
  if (gs.on() || gs.whole_overlapped()) {
    const std::size_t peak = sat_add(step_base, held_exchange);
    p.timeline.push_back({"gradient exchange (embedding, head)", sat_add(step_base, last_in_flight), peak});
    if (peak > best) {
      best = peak;
      p.peak_phase = "gradient exchange (embedding, head)";
      p.workspace = held_exchange;
    }
    p.peak_bytes = std::max(p.peak_bytes, peak);
  }
  const std::string opt_name(o.optimizer_policy.state_bytes == nullptr ? adamw<typename Model::storage_type>::name
                                                                        : o.optimizer_policy.name);
  const std::size_t elements = o.optimizer_elements != 0 ? o.optimizer_elements : n;
  p.timeline.push_back({"optimizer step (" + opt_name +
                            (p.offload_optimizer ? ", on the host: " + std::to_string(elements / p.offload_bucket + (elements % p.offload_bucket != 0)) +
                                                       " buckets of " + std::to_string(p.offload_bucket) + " parameters"
                                                 : std::string(", in place")) +
                            ")",
                        base, base});
  if (best != p.peak_bytes) {
    throw error("membound: planner timeline and simulate() disagree on the peak (" +
                std::to_string(best) + " vs " + std::to_string(p.peak_bytes) + "): a bug, please report it");
  }
  return p;
}

// ---- Compile time ---------------------------------------------------------------------------
// The predicted peak as a constant expression, for models that list their blocks: the same
// chain and the same simulate() as make_plan, evaluated by the compiler. `budget` schedules run
// the DP and are for run time only.
template <typename Model>
constexpr std::size_t predicted_peak(const model_config& c, batch_shape b, schedule_choice s,
                                     const plan_options& o = {}) {
  using S = typename Model::storage_type;
  const std::size_t n = Model::count_elements(c);
  const std::size_t base = sat_add(bytes_of<S>(n), bytes_of<S>(n),
                                   o.optimizer && !o.offload.optimizer ? detail::policy_state_bytes<S>(o.optimizer_policy, n) : 0,
                                   Model::step_buffer_bytes(sat_mul(b.tokens(), o.accumulation), n));
  const chain ch = Model::static_chain(c, b, o.threads, o.head_chunk, base);
  const std::size_t L = ch.length();
  std::vector<chain_op> ops;
  switch (s.k) {
    case schedule_choice::kind::none: ops = schedule_none(L); break;
    case schedule_choice::kind::full: ops = schedule_full(L); break;
    case schedule_choice::kind::every: ops = schedule_every(L, s.param); break;
    case schedule_choice::kind::binomial: ops = schedule_binomial(L, s.param); break;
    case schedule_choice::kind::budget:
      throw invalid_argument("schedule", "none, full, every<K> or binomial<N> at compile time",
                             "budget", "Plan budget schedules at run time with make_plan or fit");
  }
  return simulate(ch, ops).peak_bytes;
}

namespace detail {
// Instantiated only when a static plan does not fit, so that the compiler's "required from"
// line shows both numbers: peak_exceeds_budget<PeakBytes, BudgetBytes>.
template <std::size_t PeakBytes, std::size_t BudgetBytes>
struct peak_exceeds_budget {
  static_assert(PeakBytes <= BudgetBytes,
                "membound: this training step does not fit the budget: its predicted peak "
                "exceeds the budget (both in bytes: PeakBytes and BudgetBytes in the 'required "
                "from' lines above). Choose a stricter schedule (schedules::full, "
                "every<K>, binomial<Slots>), a smaller batch or sequence, bf16 storage, or raise "
                "the budget.");
  static constexpr bool value = true;
};
template <bool Fits, std::size_t PeakBytes, std::size_t BudgetBytes>
constexpr bool check_fits() {
  if constexpr (Fits) {
    return true;
  } else {
    return peak_exceeds_budget<PeakBytes, BudgetBytes>::value;
  }
}
}  // namespace detail

// The plan of a model whose shapes are template constants:
//
//   constexpr membound::model_config cfg{.vocab = 256, .width = 256, .heads = 8};
//   using plan = membound::static_plan<net, cfg, membound::batch_shape{8, 512},
//                                      membound::schedules::every<2>, (1ull << 30)>;
//   static_assert(plan::peak_bytes <= plan::budget);   // or just name plan::fits
//
// Naming `fits` (or instantiating the type with a budget it exceeds) stops the build with a
// sentence and both numbers.
template <typename Model, model_config Config, batch_shape Shape, typename Schedule,
          std::size_t Budget, std::size_t Threads = 1, std::size_t HeadChunk = 256,
          bool Optimizer = true>
struct static_plan {
  // The step's predicted peak, computed by the compiler.
  static constexpr std::size_t peak_bytes = predicted_peak<Model>(
      Config, Shape, schedule_choice::of(Schedule{}), plan_options{Threads, HeadChunk, 1, Optimizer});
  static constexpr std::size_t budget = Budget;  // in bytes
  // true; when the peak exceeds the budget, naming it stops the build (see above).
  static constexpr bool fits = detail::check_fits<(peak_bytes <= Budget), peak_bytes, Budget>();
};

// Every (micro-batch, schedule, chunk) fit() considers for an effective batch.
struct fit_options {
  std::size_t threads = 1;             // as plan_options: CPU threads the step runs with
  bool optimizer = true;               // as plan_options: count the optimizer's state
  std::size_t optimizer_elements = 0;  // as plan_options: 0 for all, else this process's ZeRO-1 shard
  optimizer_ref optimizer_policy{};    // as plan_options: the default is adamw<S>
  std::vector<std::size_t> head_chunks{256, 64};  // the logit chunk sizes to try
  // When set, a plan fits when its reserved peak on the stack does (reserve_model(m, alloc)).
  reserve_function reserve{};
  gradient_shards gradients{};  // as plan_options: ZeRO-2's gradient shard, off by default (last: positional
                                // initializers written before it still compile)
  // A line to stay under when some plan can (0: none): a pressure monitor's emergency threshold
  // of the budget, over which a plan's first step is abandoned for a stricter one. fit() picks
  // the best plan under it; only when none fits there, the best under the budget.
  std::size_t prefer_below = 0;
  // Optimizer offload (offload_options): with offload.optimizer set, fit() may put the state in
  // the host space, under offload.host_budget, as offload_mode says.
  offload_options offload{};
  // Where fit() puts the optimizer's state when offload.optimizer is set.
  enum class offload_choice : unsigned char {
    when_needed,  // offloaded plans only when no plan fits the budget with the state in place
    weighed,      // every plan, the cheapest by recompute FLOPs + offload_flops_per_byte x the
                  // bytes offload moves a step (3 copies of the shard: its gradients out, its
                  // weights out and back); in place first at equal cost
    always,       // offloaded plans only (a trainer whose state already lives there)
  };
  // when_needed by default.
  offload_choice offload_mode = offload_choice::when_needed;
  // weighed: what one byte over the host link costs, in FLOPs of recompute (a device's measured
  // FLOP/s over its measured copy bandwidth; 0: free); also the price of an offloaded block
  // input's copies when offload.flops_per_byte is 0.
  double offload_flops_per_byte = 0;
};

// fit() found plans under the device budget only with the optimizer offloaded, and none of them
// fits the host budget: both budgets and the least host peak.
class host_budget_too_small : public invalid_argument {
 public:
  // The host budget given, the least host peak of the plans under the device budget, and that budget.
  host_budget_too_small(std::size_t host_budget, std::size_t host_minimum, std::size_t device_budget)
      : invalid_argument("options.offload.host_budget",
                         "at least " + format_bytes(host_minimum) + " (the least host peak of a plan" +
                             (device_budget != 0 ? " that fits the device budget of " + format_bytes(device_budget)
                                                 : std::string()) +
                             " with the optimizer offloaded)",
                         format_bytes(host_budget),
                         "Raise the host budget to at least " + format_bytes(host_minimum, false) +
                             ", or the device budget so that the state fits there, or use a smaller offload bucket "
                             "or an 8-bit optimizer"),
        host_budget_(host_budget),
        host_minimum_(host_minimum) {}
  // The host budget fit() was given.
  std::size_t host_budget() const noexcept { return host_budget_; }
  // The least host peak among the plans that fit the device budget.
  std::size_t host_minimum() const noexcept { return host_minimum_; }

 private:
  std::size_t host_budget_, host_minimum_;
};

// The plan with the least recompute (over the whole optimizer step: per micro-batch times the
// accumulation) whose peak fits `budget`: micro-batch sizes dividing the batch (gradient
// accumulation keeps the effective batch; packed rows run one per micro-batch), every schedule,
// the logit chunk sizes given. Ties go
// to fewer micro-batches, then to the lower peak. Throws budget_too_small naming the least peak
// of any candidate when none fits.
template <typename Model>
training_plan fit(const Model& m, batch_shape effective, std::size_t budget, const fit_options& fo = {}) {
  m.check(effective.row());
  using offload_choice = fit_options::offload_choice;
  if (!(fo.offload_flops_per_byte >= 0) || fo.offload_flops_per_byte > std::numeric_limits<double>::max()) {
    throw invalid_argument("options.offload_flops_per_byte", "a finite price of 0 or more FLOPs per byte moved",
                           std::to_string(fo.offload_flops_per_byte),
                           "Price a byte as the device's FLOP/s over the link's bytes/s (0: free)");
  }
  // Offload only when needed: in place first (under the line, then under the budget), then
  // offloaded (the same way).
  if (fo.offload.optimizer && fo.offload_mode == offload_choice::when_needed) {
    fit_options in_place = fo;
    in_place.offload.optimizer = false;  // block inputs may still be offloaded
    try {
      return fit(m, effective, budget, in_place);
    } catch (const budget_too_small&) {
      // The state does not fit beside the step: offloaded below.
    }
    fit_options offloaded = fo;
    offloaded.offload_mode = offload_choice::always;
    return fit(m, effective, budget, offloaded);
  }
  if (fo.prefer_below != 0 && fo.prefer_below < budget) {
    fit_options under = fo;
    under.prefer_below = 0;
    try {
      training_plan p = fit(m, effective, fo.prefer_below, under);
      p.budget = budget;  // the plan's budget is the caller's; the line only chose among plans
      return p;
    } catch (const budget_too_small&) {
      // Nothing under the line: the best plan under the budget, below.
    } catch (const host_budget_too_small&) {
      // Nothing under the line within the host budget: the same.
    }
  }
  // Where the state may live: in place, offloaded, or either (weighed).
  std::vector<bool> placements{false};
  if (fo.offload.optimizer) placements = fo.offload_mode == offload_choice::always ? std::vector<bool>{true}
                                                                                   : std::vector<bool>{false, true};
  using S = typename Model::storage_type;
  const std::size_t shard = fo.optimizer_elements != 0 ? fo.optimizer_elements : m.parameter_elements();
  const double offload_cost = fo.offload_flops_per_byte * 3.0 * static_cast<double>(bytes_of<S>(shard));
  training_plan best;
  bool found = false;
  std::size_t minimum = std::numeric_limits<std::size_t>::max();
  // Offloaded: the least host peak of a plan that fit the device budget but not the host's.
  std::size_t host_minimum = std::numeric_limits<std::size_t>::max();
  // With a reserve function, what counts is the reserved peak on the stack.
  auto reserve = [&](training_plan& p) {
    if (fo.reserve && p.reserved_peak == 0) p.reserved_peak = fo.reserve(p);
    return p.budgeted_peak();
  };
  auto consider = [&](training_plan p) {
    const std::size_t counted = reserve(p);
    minimum = std::min(minimum, counted);
    if (saturated(counted) || counted > budget) return;
    if (!p.host_fits()) {
      host_minimum = std::min(host_minimum, p.host_peak());
      return;
    }
    const auto cost_of = [&](const training_plan& q) {
      return (q.recompute_flops + q.offload_flops) * static_cast<double>(q.accumulation) +
             (q.offload_optimizer ? offload_cost : 0.0);
    };
    const double cost = cost_of(p), best_cost = cost_of(best);
    // At equal cost: in place, then fewer micro-batches, then the lower peak.
    const auto order = [](const training_plan& q, std::size_t peak) {
      return std::tuple{q.offload_optimizer, q.host_activations != 0, q.accumulation, peak};
    };
    if (!found || cost < best_cost || (cost == best_cost && order(p, counted) < order(best, best.budgeted_peak()))) {
      best = std::move(p);
      found = true;
    }
  };
  // The budget DP at budget B: it plans requested bytes, so when the stack's rounding takes its
  // plan over B, it asks again for that much less. nullopt when it finds nothing under B.
  auto dp_plan = [&](batch_shape b, const plan_options& o, std::size_t B) -> std::optional<training_plan> {
    std::size_t target = B;
    std::optional<training_plan> last;
    for (int tries = 0; tries < 4; ++tries) {
      try {
        training_plan p = make_plan(m, b, schedule_choice{schedule_choice::kind::budget, target}, o, budget);
        const std::size_t counted = reserve(p);
        const bool under = counted <= B;
        last = std::move(p);
        if (under || counted - B >= target) break;
        target -= counted - B;
      } catch (const invalid_argument&) {
        break;
      }
    }
    return last;
  };
  struct combo {
    batch_shape b;
    plan_options o;
  };
  std::vector<combo> combos;
  const std::size_t L = m.depth();
  // Packed rows run one per micro-batch (their sequences share one token axis).
  for (std::size_t mb = effective.packed() ? 1 : effective.batch; mb >= 1; --mb) {
    if (effective.batch % mb != 0) continue;
    for (std::size_t chunk : fo.head_chunks) {
      for (const bool off : placements) {
        plan_options o{fo.threads, chunk, effective.batch / mb, fo.optimizer, fo.optimizer_elements,
                       fo.optimizer_policy, fo.gradients,
                       {off, fo.offload.bucket, fo.offload.host_budget, fo.offload.activations,
                        fo.offload.flops_per_byte != 0 ? fo.offload.flops_per_byte : fo.offload_flops_per_byte}};
        const batch_shape b{mb, effective.seq, effective.sequences};
        // A micro-batch the blocks refuse is no candidate: a mixture of experts whose capacity
        // leaves an expert no slot at its fewer tokens (the whole batch passed the check above).
        try {
          m.check(b);
        } catch (const invalid_argument&) {
          continue;
        }
        combos.push_back({b, o});
        std::vector<schedule_choice> cands{{schedule_choice::kind::none, 0},
                                           {schedule_choice::kind::full, 0}};
        // every<k> for every segment length up to L (every<L> keeps only the chain's ends), and
        // binomial<s> for every slot count Revolve's table allows.
        for (std::size_t k = 2; k <= L; ++k) cands.push_back({schedule_choice::kind::every, k});
        for (std::size_t s = 1; s <= L && (L + 1) * (s + 1) <= detail::max_table_entries; ++s)
          cands.push_back({schedule_choice::kind::binomial, s});
        for (const schedule_choice& s : cands) consider(make_plan(m, b, s, o, budget));
        if (auto p = dp_plan(b, o, budget)) consider(std::move(*p));
      }
    }
  }
  if (!found && host_minimum != std::numeric_limits<std::size_t>::max()) {
    throw host_budget_too_small(fo.offload.host_budget, host_minimum, budget);
  }
  if (!found) {
    // The DP can meet budgets below every generated schedule's peak. Search, per micro-batch and
    // chunk, the least budget it meets, so that minimum() is a budget fit() meets and one byte
    // less is not.
    const auto dp_fits = [&](const combo& c, std::size_t B) {
      const auto p = dp_plan(c.b, c.o, B);
      return p && !saturated(p->budgeted_peak()) && p->budgeted_peak() <= B;
    };
    for (const combo& c : combos) {
      if (saturated(minimum) || minimum == 0 || !dp_fits(c, minimum - 1)) continue;
      std::size_t lo = 0, hi = minimum - 1;  // dp_fits(c, hi) holds
      while (lo < hi) {
        const std::size_t mid = lo + (hi - lo) / 2;
        if (dp_fits(c, mid)) hi = mid;
        else lo = mid + 1;
      }
      minimum = hi;
    }
    throw budget_too_small(budget, minimum,
                           saturated(minimum) ? "no plan fits the allocator's capacity or the address space: raise the "
                                                                 "allocator's capacity, or shrink the model or the batch"
                                              : std::string{});
  }
  best.budget = budget;
  return best;
}

// The plan for the most packed tokens per micro-batch that fits `budget`: `rows` rows per step
// (one per micro-batch) of N tokens holding at most `sequences` sequences each
// (batch_shape{rows, N, min(sequences, N)}), N a multiple of `multiple` up to max_tokens, chosen
// as fit would choose each row length's plan. Its sizes are those of
// the worst packing of N tokens into that many sequences, so any batch of at most N tokens in at
// most `sequences` sequences (padded to N) runs within them. Every plan's peak grows with N, so
// the largest N is found by bisection (O(log max_tokens) fits). Throws budget_too_small, naming
// the least plan's peak at `multiple` tokens, when not even that fits; invalid_argument for a
// multiple of 0, or above max_tokens.
template <typename Model>
training_plan fit_tokens(const Model& m, std::size_t max_tokens, std::size_t sequences, std::size_t budget,
                         const fit_options& fo = {}, std::size_t multiple = 1, std::size_t rows = 1) {
  if (multiple == 0 || multiple > max_tokens) {
    throw invalid_argument("multiple", "between 1 and max_tokens (" + std::to_string(max_tokens) + ")",
                           std::to_string(multiple), "Ask for rows of a whole number of tokens up to max_tokens");
  }
  if (sequences == 0) {
    throw invalid_argument("sequences", "at least 1 per row", "0", "Give the most sequences a row may hold");
  }
  if (rows == 0) throw invalid_argument("rows", "at least 1 per step", "0", "Plan one or more rows per step");
  const auto row = [&](std::size_t k) {  // k multiples of `multiple`
    const std::size_t n = k * multiple;
    return batch_shape{rows, n, std::min(sequences, n)};
  };
  training_plan best = fit(m, row(1), budget, fo);  // throws budget_too_small when nothing fits
  std::size_t lo = 1, hi = max_tokens / multiple;    // row(lo) fits; find the last k that does
  while (lo < hi) {
    const std::size_t mid = lo + (hi - lo + 1) / 2;
    try {
      best = fit(m, row(mid), budget, fo);
      lo = mid;
    } catch (const budget_too_small&) {
      hi = mid - 1;
    } catch (const host_budget_too_small&) {  // fits the device only offloaded, and not the host
      hi = mid - 1;
    }
  }
  return best;  // row(lo)'s: every success moved lo to it
}

MEMBOUND_NAMESPACE_END
