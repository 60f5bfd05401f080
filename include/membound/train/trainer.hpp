// The training loop, written once: gradient accumulation over a plan's micro-batches, global-norm
// clipping, cosine learning rate, AdamW, dynamic loss scaling, the pressure monitor at the step's
// check points with a retry under a stricter plan, and checkpoints that resume the identical run.
//
//   membound::trainer t(model, {32, 256}, membound::fit(model, {32, 256}, budget), alloc, pool, opts,
//                       membound::pressure_monitor<>{});
//   for (...) { membound::step_result r = t.step(source); }   // source(request, x, y) fills T tokens
//   t.save("run.ckpt");  ...  t.load("run.ckpt");
//
// What one step does is a function of (weights, optimizer state, loss scaler, step, random state,
// data position) and the plan's micro-batch: a checkpoint holds all of them and the plan, so a
// resumed run continues bit for bit. Weights, gradients and AdamW state come from the caller's
// allocator (tags weights, gradients, optimizer), activations and workspace from it too, through
// model::forward_backward.
//
// A checkpoint also holds a fingerprint of everything that decides how those bytes are read and
// what a step computes with them (every model_config field, the storage and accumulation types,
// each block's identity, the parameter layout, the optimizer state's layout, the effective
// batch); load() refuses a file whose fingerprint differs, naming the field.
//
// Backends: the model's. On cpu_backend the executor is a thread_pool and everything is host
// memory. On cuda_backend it is a cuda_executor, the allocator serves device memory, and the
// trainer's own arithmetic (zeroing, the gradient norm, AdamW) runs on the device through the
// model's glue (backend_kernels<cuda_backend, model_glue>); weights and AdamW's state are made on
// the host (the CPU run's bits) and uploaded, each micro-batch's ids are checked on the host and
// uploaded into the step buffers (plan.step_buffers, planned like every other byte), and
// checkpoints are written from host copies, in the same format: a CPU checkpoint resumes on a
// GPU and back. adamw<S> or adamw8bit<S> (static_asserts say so). One device per rank: over
// several ranks a device_communicator (nccl_communicator) moves the device's gradients and
// weights on the executor's stream, its control() the host values ranks agree on; ZeRO-0 and
// ZeRO-1, blocking (ZeRO-2's router and the overlapped exchanges work on host memory).
//
// Plans: the trainer runs only plans it would make itself. A plan given to it (constructor,
// set_plan) is made again from its choices (micro-batch, accumulation, schedule, logit chunk)
// for this model, the pool's threads and AdamW's state, and refused unless every field matches;
// the plans load() restores and the retry chooses are made that way. So largest_predicted_peak()
// is a prediction for this model, never a number someone typed.
//
// Pressure: the monitor looks at before_forward (each micro-batch), after_forward,
// before_backward, after_backward and after_optimizer_step. When it enters emergency inside a
// step, or an allocation runs out of budget, the step is abandoned (every byte given back, the
// gradients zeroed, the random state and data position rewound, the weights untouched) and run
// again under the least-recompute plan whose peak plus the memory others hold stays under the
// emergency threshold (or, failing that, under the budget). Each retry lowers the peak, so a step
// is retried at most as many times as there are smaller plans. When no plan gets under the
// threshold, emergencies are reported but no longer abandon a step while the plan and the others'
// bytes stay as they are; an out-of-memory with no smaller plan left becomes budget_too_small
// with nothing lost. The monitor sees usage only at its check points: a peak inside an op is
// caught by the out-of-memory path instead.
//
// Data parallel: given a communicator of N ranks (dist/communicator.hpp; membound/mpi.hpp for
// MPI), every rank holds the whole model and optimizer state (ZeRO-0), the plan is per rank (its
// micro-batches times the accumulation make effective.batch / N sequences), and each step every
// rank draws the step's effective.batch requests in the same order and runs its own contiguous
// slice of them: rank r the sequences [r·E/N, (r + 1)·E/N). The gradients are then summed across
// ranks in rank order (in buckets sized to fit inside the step's own peak, so the plan's
// prediction still holds), and every rank takes the same AdamW step from the same sum. The
// loss is summed the same way. So all ranks keep identical weights, the run is reproducible bit
// for bit for a given N, and (ZeRO-0) a checkpoint from any rank resumes any world size. With
// trainer_options::zero = 1 each rank keeps AdamW's state for its shard_of the parameters only
// (balanced: the first n % N ranks one element more, no padding), receives only its shard's
// summed gradient (a reduce-scatter, same rank-order sums), updates that shard and all-gathers the
// weights: the same bits as ZeRO-0, the same bytes on the wire (2·(N − 1)/N of the gradient), and
// 1/N of the optimizer state. The global norm is each shard's sum of squares added in rank order
// under both stages. Its checkpoint is one shard file per rank and a manifest (see save); load
// re-shards a checkpoint of another world size (elementwise optimizer states). With zero = 2 the
// gradients are sharded too: each block's gradients live in a bucket during its backward and are
// reduce-scattered into the ranks' shards as it ends (train/gradient_exchange.hpp); with overlap = true
// that reduce-scatter runs during the next block's backward (the plan counts what is in flight).
// ZeRO-0/1 with overlap = true exchange in the last micro-batch's backward instead of after it:
// each block's all-reduce (reduce-scatter) runs during the next block's backward (see
// gradient_exchange::overlapped_micro_batch); the same bits as the blocking path.
// 16-bit storage moves 16-bit gradients and sums them in fp32, rounding once (summable). The
// constructor is a collective over ranks: a rank whose plan does not fit its budget, or that
// fails to allocate, makes every rank throw before step 1 (rank_cannot_start).
//
// Optimizer offload (a plan made with plan_options::offload, ZeRO-Offload's placement): the
// optimizer's state and two staging buffers of plan.offload_bucket parameters come from
// trainer_options::host, a second (host) memory space with its own budget, before step 1; after
// the gradient norm each bucket of gradients and weights is copied there, updated by the policy's
// update_range and the weights copied back: the same bits as the in-place step, so checkpoints
// move between offloaded and in-place runs. The placement is the trainer's for its lifetime: the
// plans it takes later (set_plan, load, a retry) keep it. On cuda_backend the buckets are copied
// between the device and the host space (pinned memory, the caller's allocator) and updated on
// the executor's host threads: the CPU optimizer's arithmetic, not the device kernel's (within
// the trainer tests' tolerance of an in-place device run), each chunk's update overlapping its
// neighbours' copies (backend/cuda/model.cuh).
//
// Pressure over ranks: one rank cannot change its plan alone (the ranks' collectives must match),
// so the ranks agree. At every point of a step that still comes before a gradient exchange of the
// micro-batch (before_forward, after_forward, before_backward; after_backward too under ZeRO-0/1,
// which exchange only after the last micro-batch, but not in an overlapped one's last, whose
// blocks' exchanges have started by then) every rank gathers every rank's vote (pressure
// emergency; a plan whose peak no longer fits beside the budget's external bytes; an
// out-of-memory met since the last such point). One vote makes every rank abandon
// the step (rank_agreement::agree_on_retry), then all gather their targets (the emergency threshold and the
// budget, each less the rank's others' bytes), take the least of each, and adopt rank 0's fit()
// for it once every rank has checked it under its own target: the same choices everywhere, so the
// exchanges (ZeRO-2's reduce-scatters, ZeRO-0/1's buckets, sized from the plan's headroom) match.
// No plan, with a rank whose current one no longer fits its budget: every rank throws the same
// rank_budget_too_small naming that rank. An out-of-memory after that micro-batch's exchanges have
// started (ZeRO-2's backward, ZeRO-0/1 overlapped's last backward, the exchange after the
// micro-batches) cannot be retried over ranks.
#pragma once

#include <algorithm>
#include <bit>
#include <charconv>
#include <chrono>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/core/error.hpp"
#include "membound/core/format.hpp"
#include "membound/core/parallel.hpp"
#include "membound/memory/allocator.hpp"
#include "membound/memory/stream.hpp"
#include "membound/core/memory_tag.hpp"
#include "membound/model/glue.hpp"
#include "membound/model/planner.hpp"
#include "membound/model/reserve_plan.hpp"
#include "membound/core/check_point.hpp"
#include "membound/monitor/null_monitor.hpp"
#include "membound/core/pressure_level.hpp"
#include "membound/dist/communicator.hpp"
#include "membound/optimizer/adamw.hpp"
#include "membound/optimizer/adamw8bit.hpp"
#include "membound/optimizer/optimizer_policy.hpp"
#include "membound/train/checkpoint_file.hpp"
#include "membound/train/checkpoint_state.hpp"
#include "membound/shape/packed_sequences.hpp"
#include "membound/train/data_source.hpp"
#include "membound/train/fingerprint.hpp"
#include "membound/train/gradient_exchange.hpp"
#include "membound/train/rank_agreement.hpp"
#include "membound/train/schedule_lr.hpp"
#include "membound/train/trainer_errors.hpp"
#include "membound/train/trainer_options.hpp"
#include "membound/train/trainer_report.hpp"

MEMBOUND_NAMESPACE_BEGIN

// What a monitor must offer the trainer (null_monitor and pressure_monitor<...> do).
template <typename M, typename Allocator>
concept step_monitor = requires(M& m, Allocator& a) {
  { m.template check<check_point::before_forward>(a) } -> std::same_as<pressure_level>;
  { m.stricter_plan_requested() } -> std::convertible_to<bool>;
  m.clear_stricter_plan_request();
};

// The training loop (see the file comment) for a Model whose bytes all come from an Allocator.
// Optimizer: an optimizer_policy for the model's storage (optimizer/optimizer_policy.hpp):
// adamw<S> (the default) or adamw8bit<S>.
template <typename Model, typename Allocator, typename Monitor = null_monitor,
          typename Communicator = local_communicator, typename Optimizer = adamw<typename Model::storage_type>>
class trainer {
  static_assert(check_optimizer_policy<Optimizer, typename Model::storage_type>());
  static_assert(step_monitor<Monitor, Allocator>,
                "membound: trainer's Monitor must offer check<check_point>(allocator), "
                "stricter_plan_requested() and clear_stricter_plan_request(): use null_monitor or "
                "pressure_monitor<check_points<...>>.");
  static_assert(communicator<Communicator>,
                "membound: trainer's Communicator must model membound::communicator (rank, size, "
                "reduce_scatter_sum, all_gather, all_reduce_sum, broadcast, barrier): use "
                "local_communicator, or mpi_communicator from membound/mpi.hpp.");

 public:
  // The model's storage type: the weights and the gradients are arrays of it.
  using S = typename Model::storage_type;
  // The model's backend runs everything: the layers, and the trainer's own zeroing, norm and
  // optimizer step (model_glue_of). cpu_backend: a thread_pool; cuda_backend: a cuda_executor.
  using backend = typename Model::backend;
  // Where every kernel of the run goes: a thread_pool, or a cuda_executor.
  using executor = typename Model::executor;
  // Whether the run is on the host (cpu_backend): weights and gradients are then host memory.
  static constexpr bool on_host = is_cpu_backend_v<backend>;

 private:
  using glue = model_glue_of<backend>;
  // On a device the gradients and weights are device memory: only a communicator that moves
  // device memory and agrees on host values through control() can exchange them.
  static_assert(on_host || std::same_as<Communicator, local_communicator> || device_communicator<Communicator>,
                "membound: a trainer on cuda_backend exchanges device memory: use local_communicator "
                "(one GPU) or nccl_communicator from membound/nccl.cuh (one GPU per rank).");
  static_assert(!on_host || !device_communicator<Communicator>,
                "membound: this communicator moves device memory and a cpu_backend trainer's gradients are "
                "host memory: use mpi_communicator from membound/mpi.hpp.");
  static_assert(on_host || std::same_as<Optimizer, adamw<S>> || is_adamw8bit_v<Optimizer>,
                "membound: a trainer on cuda_backend steps with adamw<S> or adamw8bit<S, Block> (their "
                "device kernels); other optimizer policies run on cpu_backend.");

 public:

  // effective: sequences per optimizer step and their length; plan: a plan for this model and
  // batch (fit, or make_plan with optimizer = true) made for pool.size() threads, unedited (see
  // check_plan). Allocates weights, gradients and optimizer state from alloc and initializes them
  // from options.seed.
  //
  // On cuda_backend `ex` is the cuda_executor every kernel of the run goes on and `alloc` a stack
  // over device memory: weights, gradients, optimizer state and the step buffers (the step's
  // token ids, the norm's partials: plan.step_buffers) are device memory; the sources still fill
  // host arrays, which are checked on the host and uploaded. A step synchronizes at the loss and
  // at the gradient norm; checkpoints go through host copies.
  trainer(const Model& m, batch_shape effective, training_plan plan, Allocator& alloc, executor& ex,
          trainer_options o = {}, Monitor monitor = {})
    requires std::same_as<Communicator, local_communicator>
      : trainer(m, effective, std::move(plan), alloc, ex, std::move(o), std::move(monitor), own_local_) {}

  // Data parallel over comm's ranks: `plan` is this rank's (effective.batch / comm.size()
  // sequences per step); every rank passes the same model, batch, options and seed.
  trainer(const Model& m, batch_shape effective, training_plan plan, Allocator& alloc, executor& ex,
          trainer_options o, Monitor monitor, Communicator& comm)
      : m_(m), eff_(effective), plan_(std::move(plan)), alloc_(alloc), ex_(ex), mem_(alloc, stream_of(ex)), o_(std::move(o)),
        monitor_(std::move(monitor)), n_(m.parameter_elements()),
        scaling_(o_.scaling == loss_scaling::dynamic ||
                 (o_.scaling == loss_scaling::automatic && std::is_same_v<S, fp16>)),
        scaler_(o_.scaler), offload_{plan_.offload_optimizer, plan_.offload_bucket, plan_.host_budget,
                 plan_.activations_offloadable && !o_.host.empty(), plan_.offload_flops_per_byte},
        comm_(comm) {
    m_.check(eff_.row());
    check_options(o_);
    // After the option checks, so that a bad stage is named as options.zero, in its turn.
    exchange_.emplace(m, alloc, ex, comm, o_.zero, o_.overlap);
    check_world();
    opt_shard_ = exchange_->shard();
    // Each tensor's part in this rank's optimizer range, relative to its start.
    for (const param_entry& e : m_.parameters()) {
      const std::size_t lo = std::max(e.offset, opt_shard_.begin), hi = std::min(e.offset + e.count, opt_shard_.end);
      if (lo < hi) opt_spans_.push_back({lo - opt_shard_.begin, hi - lo, e.decay});
    }
    glue::template check_optimizer_spans<Optimizer>(std::span<const param_span>(opt_spans_));
    if (world() > 1) agreement_.emplace(comm_.rank(), world());
    // Up to here every rank decided the same from the same arguments. From here one rank may fail
    // alone (its plan, its budget, its allocations): the ranks agree before step 1 (agree_to_start).
    // The stream is set only now: every failure from here releases (and so clears it).
    follow_stream();
    std::exception_ptr failed;
    start_status status = start_status::ok;
    try {
      if constexpr (has_shadow<Allocator>) reserve_ = reserve_model(m_, alloc_);
      check_offload_capability(plan_);
      check_host_space(plan_);  // first: its refusal names both budgets
      check_plan(plan_);
      plan_.reserved_peak = reserve_of(plan_);
      // Before the trainer's own allocations: what others hold now, the room its plan had.
      start_room_ = detail::saturating_sub(limit_now(), foreign_now());
      if (!fits_limit(plan_)) {
        status = start_status::over_budget;
        refuse_over_limit(plan_);
      }
      use_layout(plan_);
      w_ = static_cast<S*>(mem_.allocate(weight_bytes(), default_alignment, memory_tag::weights));
      g_ = static_cast<S*>(mem_.allocate(grad_bytes(), default_alignment, memory_tag::gradients));
      if (offload_.optimizer) {
        // The host space: the state, then the staging buffers (plan.host_peak()).
        opt_ = o_.host.allocate(opt_bytes(), default_alignment, memory_tag::optimizer);
        stage_w_ = static_cast<S*>(o_.host.allocate(stage_bytes(), default_alignment, memory_tag::optimizer));
        stage_g_ = static_cast<S*>(o_.host.allocate(stage_bytes(), default_alignment, memory_tag::optimizer));
      } else {
        opt_ = mem_.allocate(opt_bytes(), default_alignment, memory_tag::optimizer);
      }
      step_buffer_bytes_ = plan_.step_buffers;  // the same for every plan of this batch (check_plan)
      if (step_buffer_bytes_ != 0) {
        sb_ = mem_.allocate(step_buffer_bytes_, default_alignment, memory_tag::other);
      }
    } catch (...) {
      failed = std::current_exception();
      if (status == start_status::ok) status = start_status::failed;
      release();
    }
    agree_to_start(status, failed);
    // The trainer's own requested bytes between steps; the rest of what the allocator serves, and
    // the budget's external bytes, are others' (see foreign_now).
    own_bytes_ = weight_bytes() + grad_bytes() + (offload_.optimizer ? 0 : opt_bytes()) + step_buffer_bytes_;
    try {
      // Made on the host on every backend (the same bits), in place or uploaded (on a device the
      // optimizer state goes up first, then the weights: both before step 1).
      glue::write_via_host(ex_, w_, weight_bytes(), [&](void* wh) {
        S* w = static_cast<S*>(wh);
        // Under ZeRO-3 this rank's shard only, the same bits as its part of the whole.
        m_.init_weights(w, o_.seed, zero3() ? opt_shard_ : shard_range{0, n_});
        fill_optimizer_state([&](void* state) {
          Optimizer::init(exchange_->shard_weights(w), opt_shard_.size(), state, opt_bytes());
        });
      });
      zero_gradients();
    } catch (...) {
      release();
      throw;
    }
    rng_.state = o_.seed ^ 0x6a09e667f3bcc909ULL;
    largest_peak_ = plan_.peak_bytes;
    largest_reserve_ = plan_.budgeted_peak();
    largest_host_ = plan_.host_peak();
  }

  trainer(const trainer&) = delete;
  trainer& operator=(const trainer&) = delete;
  ~trainer() { release(); }

  // ---- One optimizer step ---------------------------------------------------------------------
  // One optimizer step: every micro-batch of the plan (its sequences from `source`), the gradient
  // exchange, clipping and the update; abandoned and run again under a stricter plan when memory
  // runs short (see the file comment).
  template <data_source Source>
  step_result step(Source& source) {
    check_source<Source>();
    follow_stream();
    ran_ = true;
    const auto t0 = std::chrono::steady_clock::now();
    step_result r;
    r.step = steps_ + 1;
    const random_state rng0 = rng_;
    const std::uint64_t position0 = position_;
    // An emergency no plan can get under (only the budget itself) is not abandoned again while
    // the plan and the others' bytes stay as they were.
    bool may_abandon = o_.replan_under_pressure && !tolerating();
    const double scale = scaling_ ? scaler_.scale : 1.0;
    for (;;) {
      try {
        r.loss = accumulate(source, scale, may_abandon, r.pressure);
        r.moe = moe_;
        break;
      } catch (const detail::abandon_step& a) {
        rewind(rng0, position0);
        if (replan(r, a.reason, a.usage, a.limit, true, a.out_of_memory) != replan_outcome::below_emergency) {
          tolerate();  // run it through: emergencies are all that is left
          may_abandon = false;
        }
      } catch (const out_of_memory& e) {
        rewind(rng0, position0);
        if (!o_.replan_under_pressure) throw;
        const oom_report& rep = e.report();
        const std::size_t lim = rep.budget != 0 ? rep.budget : limit_now();
        const std::size_t use = rep.budget != 0 ? rep.budget - rep.free_under_budget : usage_now();
        if (agreeing()) {
          // The other ranks go on to their next agreement point; this rank's vote meets them there
          // (no collective lies between, see oom_may_vote_). Past an exchange it cannot.
          if (!oom_may_vote_) throw;
          const detail::abandon_step a =
              agreement_->retry_of(agreement_->agree_on_retry(ctl(), retry_vote::out_of_memory, rep.requested, use, lim));
          if (replan(r, a.reason, a.usage, a.limit, true, true) == replan_outcome::below_budget) {
            tolerate();
            may_abandon = false;
          }
          continue;
        }
        const replan_outcome got =
            replan(r, retry_reason(retry_vote::out_of_memory, rep.requested), use, lim, true);
        if (got == replan_outcome::below_budget) {
          tolerate();
          may_abandon = false;
        }
        if (got == replan_outcome::none) {
          const std::size_t others = foreign_now();
          throw budget_too_small(lim > others ? lim - others : 0, smallest_peak(),
                                 others == 0 ? std::string{}
                                             : "the budget of " + format_bytes(lim, false) + " less " +
                                                   format_bytes(others, false) + " held by others");
        }
      } catch (...) {
        rewind(rng0, position0);  // a bad token, a null source, ...: nothing happened
        throw;
      }
    }

    const double scaled_norm = exchange_->gradient_norm(g_, sb_, step_tokens());
    // The gradients are scale times the sum over tokens divided by every position: unscaled by
    // scale / counted_ratio_, they are the mean over the counted targets (scale itself when none
    // is ignored).
    const double unscale = scale / counted_ratio_;
    r.grad_norm = scaled_norm / unscale;
    r.lr = o_.lr(steps_);
    if (scaling_) {
      r.applied = scaler_.update(scaled_norm);
    } else if (!std::isfinite(scaled_norm)) {
      rewind(rng0, position0);
      throw non_finite_gradient(r.step, r.loss, scaled_norm);
    }
    if (r.applied) {
      const double gs = clip_factor(r.grad_norm, o_.clip) / unscale;
      // This rank's state covers opt_shard_ (all of them but under ZeRO-1): each tensor's part in it.
      const optimizer_step os{updates_ + 1, r.lr, gs, o_.adam};
      if (offload_.optimizer) {
        offloaded_update(os);
      } else {
        glue::template optimizer_update<Optimizer>(ex_, shard_w(), opt_grads(), opt_, opt_bytes(), opt_shard_.size(),
                                                   std::span<const param_span>(opt_spans_), os);
      }
      // Every rank updated its shard: gather the whole model on every rank (in place). ZeRO-3
      // keeps the shard: its steps gather each weight unit as they read it.
      if (sharded() && !zero3()) comm_.all_gather(static_cast<const S*>(shard_w()), w_, n_);
      ++updates_;
    }
    ++steps_;
    r.loss_scale = scaling_ ? scaler_.scale : 1.0;
    observe<check_point::after_optimizer_step>(r.pressure);
    if (agreeing()) {
      // Every rank reaches this point once a step: a request here changes the plan of every rank
      // from the next step on.
      const bool mine = monitor_.stricter_plan_requested() && !tolerating();
      const emergency_point seen = emergency_seen_;
      clear_request();
      const std::size_t who = agreement_->agree_on_retry(
          ctl(), mine ? retry_vote::pressure : retry_vote::none,
          static_cast<std::uint64_t>(mine && seen.known ? seen.at : check_point::after_optimizer_step),
          mine && seen.known ? seen.usage : usage_now(), mine && seen.known ? seen.limit : limit_now());
      if (who < world()) {
        const detail::abandon_step a = agreement_->retry_of(who);
        if (replan(r, a.reason, a.usage, a.limit, false) != replan_outcome::below_emergency) tolerate();
      }
    } else if (monitor_.stricter_plan_requested()) {
      const emergency_point seen = emergency_seen_;
      clear_request();
      if (o_.replan_under_pressure && !tolerating()) {
        constexpr check_point here = check_point::after_optimizer_step;
        if (replan(r, emergency_reason(seen.known ? seen.at : here, here), seen.known ? seen.usage : usage_now(),
                   seen.known ? seen.limit : limit_now(), false) != replan_outcome::below_emergency) {
          tolerate();
        }
      }
    }
    r.tokens = eff_.tokens();
    r.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    return r;
  }

  // The mean loss over `sequences` sequences of `source` (requests index k, random = a hash of
  // (seed, k)), in the plan's micro-batches, forward only (model::loss): its peak is below the
  // plan's, and nothing of the training state is touched. Under ZeRO-3 a collective (each weight
  // unit gathered as it is reached): every rank calls it with the same arguments, and a rank
  // that fails in it leaves the others in a gather (until the communicator's timeout).
  // Packed (a packed_source for an effective batch with sequences): `sequences` packed rows. The
  // result is the mean over every counted target (each batch weighted by its count).
  template <data_source Source>
  double evaluate(Source& source, std::size_t sequences, std::uint64_t seed = 0) {
    check_source<Source>();
    if (sequences == 0) throw invalid_argument("sequences", "at least 1", "0", "Ask for one or more sequences");
    ran_ = true;
    const std::size_t T = eff_.seq;
    double sum = 0, weight = 0;
    for (std::size_t k = 0; k < sequences; k += plan_.micro.batch) {
      const std::size_t b = std::min(plan_.micro.batch, sequences - k);
      fill(source, b, [&](std::size_t j) {
        random_state h{seed ^ (0xd1b54a32d192ed03ULL * (k + j + 1))};
        return sequence_request{k + j, h.next()};
      });
      // Weighted by counted targets (per sequence: b when nothing is ignored), so the result is
      // the mean over every counted target whatever the batches hold.
      const double counted = static_cast<double>(counted_host()) / static_cast<double>(T);
      planned_restart(true);
      sum += counted * with_weights([&](auto& weights) {
        return m_.loss(weights, tokens_in(), targets_in(), micro_in(batch_shape{b, T, eff_.sequences}),
                       plan_.head_chunk, alloc_, ex_);
      });
      weight += counted;
    }
    return weight == 0 ? 0.0 : sum / weight;
  }

  // The next-token logits of b's sequences under the current weights (model::next_token_logits,
  // on the trainer's allocator and executor; not part of the plan). Under ZeRO-3 a collective:
  // every rank calls it with the same tokens and b, and each weight unit is gathered as it is
  // reached (a rank that fails in it leaves the others in a gather, as evaluate does).
  void next_token_logits(const std::int32_t* tokens, batch_shape b, double* logits) {
    follow_stream();
    with_weights([&](auto& weights) { m_.next_token_logits(weights, tokens, b, logits, alloc_, ex_); });
  }

  // One token per sequence at a time under the current weights: model::start_decoding and
  // decode_step over a state and a workspace from the trainer's allocator (not part of the plan;
  // model::decode_state_bytes and decode_workspace_bytes of them, given back when f returns or
  // throws). f(d) with d.step(tokens [batch] in the trainer's memory, logits [batch, V] on the
  // host or nullptr), d.restart() to begin again at position 0, d.length(). Under ZeRO-3 a
  // collective, as next_token_logits (every rank calls it with the same tokens).
  template <typename F>
  decltype(auto) decode(std::size_t batch, std::size_t max_len, F&& f) {
    follow_stream();
    return with_weights([&](auto& weights) -> decltype(auto) {
      using W = std::remove_reference_t<decltype(weights)>;
      const std::size_t state_bytes = m_.decode_state_bytes(batch, max_len);
      const std::size_t ws_bytes = m_.decode_workspace_bytes(batch, max_len, workspace_threads(ex_));
      owned_block state(mem_, state_bytes, memory_tag::activations);
      owned_block ws(mem_, ws_bytes, memory_tag::workspace);
      decoder<W> d(m_, weights, m_.start_decoding(weights, state.p, state_bytes, batch, max_len, ex_), ws.p, ws_bytes,
                   ex_);
      return f(d);
    });
  }
  // What decode hands f: a decoding over the trainer's weights and buffers.
  template <typename Weights>
  class decoder {
   public:
    // Over the model, the weights (or ZeRO-3's gathering source), a started decoding and its
    // step's workspace; decode builds it.
    decoder(const Model& m, Weights& w, typename Model::decoding d, void* ws, std::size_t ws_bytes,
            executor& ex) noexcept
        : m_(m), w_(w), d_(d), ws_(ws), ws_bytes_(ws_bytes), ex_(ex) {}
    // It refers to buffers that live only while decode's f runs: not copied out of it.
    decoder(const decoder&) = delete;
    decoder& operator=(const decoder&) = delete;
    // Feeds one token per sequence at position length(); the next-token logits unless nullptr.
    void step(const std::int32_t* tokens, double* logits) { m_.decode_step(w_, d_, tokens, logits, ws_, ws_bytes_, ex_); }
    // Back to position 0: every block's state rewritten.
    void restart() { d_ = m_.start_decoding(w_, d_.state, d_.bytes, d_.batch, d_.max_len, ex_); }
    // Tokens fed to each sequence since the start.
    std::size_t length() const noexcept { return d_.length; }
    // Tokens each sequence can take.
    std::size_t max_len() const noexcept { return d_.max_len; }

   private:
    const Model& m_;
    Weights& w_;
    typename Model::decoding d_;
    void* ws_;
    std::size_t ws_bytes_;
    executor& ex_;
  };

  // ---- Checkpoints ------------------------------------------------------------------------------
  // Everything a step depends on, written atomically (see checkpoint_file.hpp). Under ZeRO-1/2 a
  // collective (the same files for both: gradients are not saved): every rank writes its shard
  // file (its slice of the weights, its optimizer state, the counters), then rank 0 writes
  // `path`, a manifest naming them (world size, ZeRO stage, each rank's shard and file, the step). Each file is committed atomically and the manifest
  // last, so a crash leaves the previous manifest, whose shard files are still there. The files
  // belong to the checkpoint committed at `path`: once it is, every other shard file of `path`
  // (an earlier step's, another world size's, a killed save's) is removed, by the save and by a
  // load of it (remove_unreferenced_shards). A failure on any rank is thrown on every rank.
  void save(const std::string& path) const {
    follow_stream();
    if (sharded()) {
      save_shards(path);
      return;
    }
    checkpoint_writer cw;
    glue::read_via_host(ex_, w_, m_.weight_bytes(), [&](const void* w) {
      read_optimizer_state([&](const void* state) { write_state(cw, w, m_.weight_bytes(), state); });
    });
    cw.commit(path);
    // A whole checkpoint at `path` names no shard file: any left beside it are garbage.
    (void)remove_unreferenced_shards(path, {});
  }

  // Reads and checks the whole file first; on any error this trainer is unchanged. A file of
  // another format, or whose fingerprint differs from fingerprint(), is checkpoint_mismatch
  // naming the field. The saved plan is restored (made again by this trainer) when it fits the
  // allocator's budget (the run then continues bit for bit); otherwise the current plan stays.
  // Returns whether the saved plan was restored. The monitor's level is not saved: a resumed run
  // starts at the level its first check point sees.
  //
  // Under ZeRO-1/2 a collective reading the manifest save() wrote and this rank's shard, then
  // gathering the weights. Another world size is re-sharded (load_resharded): a manifest of N
  // ranks resumed by M ranks (any ZeRO stage, one process included), or a whole checkpoint
  // resumed under ZeRO-1/2: every rank reads every file's weights and re-slices AdamW's m, v
  // (and masters) to its own range; the state after loading is the saved state exactly, so the
  // run continues as a run of M ranks started from it would. A block-wise state (adamw8bit) is
  // refused with checkpoint_world_mismatch. An error on any rank is thrown on every rank; only
  // one found after the ranks agreed to commit (an optimizer value out of range, which the CRC
  // cannot catch) can leave ranks loaded and others not, and says so.
  //
  // The run's settings (run_settings()) are compared too: by default a checkpoint written under
  // others is refused with checkpoint_run_changed; lo.changes = run_changes::accept loads it and
  // changed_at_load() lists what differed. A checkpoint from before settings were recorded is
  // taken as it is.
  bool load(const std::string& path, const load_options& lo = {}) {
    follow_stream();
    if (sharded()) return load_shards(path, lo);
    if (world() <= 1) {
      const checkpoint_reader r(path);
      check_checkpoint_format(r, path);
      if (r.has("manifest")) return load_resharded(manifest_sources(read_checkpoint_manifest(r, path), path, n_), path, lo);
      staged st = stage(r, path, m_.weight_bytes(), lo);
      commit(r, path, st, w_, m_.weight_bytes());
      return st.restored;
    }
    // ZeRO-0 over ranks: every rank reads the whole file; they agree that all could, and on the
    // plan, before any commits.
    std::exception_ptr failed;
    std::optional<checkpoint_reader> r;
    staged st;
    bool manifest = false;
    try {
      r.emplace(path);
      check_checkpoint_format(*r, path);
      manifest = r->has("manifest");
      if (!manifest) st = stage(*r, path, m_.weight_bytes(), lo);
    } catch (...) {
      failed = std::current_exception();
    }
    agree(failed, "read the checkpoint");
    if (manifest) return load_resharded(manifest_sources(read_checkpoint_manifest(*r, path), path, n_), path, lo);
    agree_on_restoring(st);
    try {
      commit(*r, path, st, w_, m_.weight_bytes());
    } catch (...) {
      failed = std::current_exception();
    }
    agree(failed, "load the checkpoint (the ranks that did are loaded: load again before training)");
    return st.restored;
  }

  // ---- Plans --------------------------------------------------------------------------------------
  // Switch plans between steps: a plan check_plan accepts (this model, the same effective batch,
  // pool.size() threads, optimizer counted, unedited) whose reserved peak fits the budget beside
  // what others hold. A refused plan changes nothing. Over ranks a collective (every rank calls it
  // between the same steps): when one rank cannot fit the plan, every rank refuses it.
  void set_plan(training_plan p) {
    follow_stream();
    // Each rank judges the plan against its own pool and budget; over ranks all refuse together
    // (a rank adopting a plan the others refused would run a different step), and a rank whose
    // check throws still joins the exchange, so that nobody waits in it forever.
    std::exception_ptr failed;
    try {
      check_offload_capability(p);
      check_host_space(p);
      check_plan(p);
      p.reserved_peak = reserve_of(p);
      if (!fits_limit(p)) refuse_over_limit(p);
    } catch (...) {
      failed = std::current_exception();
    }
    if (world() > 1) {
      std::vector<std::uint64_t> all(world(), 0);
      all[comm_.rank()] = failed ? 0 : 1;
      ctl().all_gather(static_cast<const std::uint64_t*>(all.data() + comm_.rank()), all.data(), world());
      if (failed) std::rethrow_exception(failed);
      for (std::size_t r = 0; r < world(); ++r) {
        if (all[r] != 0) continue;
        throw invalid_argument("plan", "a plan every rank accepts (its pool, its budget beside what others hold there)",
                               "rank " + std::to_string(r) + " of " + std::to_string(world()) + " refused it",
                               "Read rank " + std::to_string(r) + "'s error; every rank kept its plan");
      }
    } else if (failed) {
      std::rethrow_exception(failed);
    }
    adopt(std::move(p));
  }
  // The plan the next step runs under.
  const training_plan& plan() const noexcept { return plan_; }
  // The largest predicted peak of any plan this trainer ran a step or an evaluation under, or
  // holds now: what the measured peak of its own bytes stays within.
  std::size_t largest_predicted_peak() const noexcept { return largest_peak_; }
  // The largest predicted reserve of those plans on the trainer's allocator stack (what its
  // reserved peak stays within): the plans' reserved peaks where the stack has a shadow
  // (memory/shadow.hpp), else their requested peaks.
  std::size_t largest_predicted_reserve() const noexcept { return largest_reserve_; }
  // The same for the host space (offload): the largest plan.host_peak() of those plans, what the
  // host allocator's measured peak of the trainer's bytes stays within.
  std::size_t largest_predicted_host_peak() const noexcept { return largest_host_; }

  // This rank's bytes as its plan predicts them (see rank_memory).
  rank_memory memory() const {
    rank_memory r;
    r.rank = comm_.rank();
    r.ranks = world();
    r.zero = sharded() ? o_.zero : 0;
    r.weights = weight_bytes();
    r.gradients = grad_bytes();
    r.optimizer = offload_.optimizer ? 0 : opt_bytes();
    r.host = plan_.offloads() ? plan_.host_peak() : 0;
    r.shard_begin = opt_shard_.begin;
    r.shard_end = opt_shard_.end;
    r.exchange = exchange_->largest_exchange_bytes(plan_.accumulation, exchange_headroom());
    r.peak = plan_.peak_bytes;
    r.limit = limit_now();
    return r;
  }
  // Every rank's memory(), on every rank (a collective over more than one rank).
  std::vector<rank_memory> memory_of_ranks() {
    constexpr std::size_t fields = sizeof(rank_memory) / sizeof(std::uint64_t);
    static_assert(sizeof(rank_memory) == fields * sizeof(std::uint64_t), "membound: rank_memory is gathered as u64s");
    const std::size_t N = world(), me = comm_.rank();
    std::vector<std::uint64_t> all(fields * N);
    const rank_memory mine = memory();
    std::memcpy(all.data() + fields * me, &mine, sizeof mine);
    if (N > 1) ctl().all_gather(static_cast<const std::uint64_t*>(all.data() + fields * me), all.data(), all.size());
    std::vector<rank_memory> out(N);
    std::memcpy(static_cast<void*>(out.data()), all.data(), all.size() * sizeof(std::uint64_t));
    return out;
  }

  // ---- State --------------------------------------------------------------------------------------
  // The model it trains.
  const Model& model() const noexcept { return m_; }
  // What a checkpoint of this trainer must match to be loaded, in the order load() compares it:
  // every model_config field (effective kv_heads and mlp_hidden, doubles by their bits; the
  // window and the experts' settings through the blocks that use them), the storage and
  // accumulation types by name, the depth and each block's identity (its mixer's family, its
  // feed-forward and the policies that change what it computes), the parameter layout, the optimizer
  // state's layout, the effective batch and sequence length.
  std::vector<fingerprint_field> fingerprint() const {
    const model_config& c = m_.config();
    std::vector<fingerprint_field> f;
    const auto add = [&](std::string name, std::string value) { f.push_back({std::move(name), std::move(value)}); };
    const auto num = [](std::size_t v) { return std::to_string(v); };
    add("config.vocab", num(c.vocab));
    add("config.width", num(c.width));
    add("config.heads", num(c.heads));
    add("config.kv_heads", num(c.kv()));
    add("config.mlp_hidden", num(c.hidden()));
    add("config.tie_embeddings", c.tie_embeddings ? "true" : "false");
    add("config.norm_eps", detail::exact_text(c.norm_eps));
    add("config.rope_base", detail::exact_text(c.rope_base));
    add("config.ttt_base_lr", detail::exact_text(c.ttt_base_lr));
    // By identity: bf16 and fp16 are both 2 bytes and read each other's bits as garbage.
    add("storage", std::string(dtype_name<S>()));
    add("accumulation", std::string(dtype_name<typename Model::accum_type>()));
    add("depth", num(m_.depth()));
    for (std::size_t i = 0; i < m_.depth(); ++i) {
      m_.visit_block(i, [&]<typename B>(B*) { add("blocks." + num(i), B::identity(c)); });
    }
    detail::fnv1a h;
    for (const param_entry& e : m_.parameters()) {
      h.bytes(e.name.data(), e.name.size() + 1);  // with its terminator, so names cannot run together
      h.u64(e.offset);
      h.u64(e.count);
      h.u64(e.decay ? 1 : 0);  // which tensors AdamW decays
    }
    char layout[24];
    std::snprintf(layout, sizeof layout, "%016llx", static_cast<unsigned long long>(h.h));
    add("parameters.elements", num(n_));
    add("parameters.tensors", num(m_.parameters().size()));
    add("parameters.layout", std::string("fnv1a ") + layout);
    add("optimizer", Optimizer::description() + ", " + num(opt_bytes()) + " bytes");
    // Under ZeRO-1 the state is one rank's shard: resuming needs the same world and rank.
    if (sharded()) {
      add("zero", "1");
      add("ranks", num(world()));
      add("optimizer.shard", num(opt_shard_.begin) + ".." + num(opt_shard_.end));
    }
    add("effective_batch", num(eff_.batch));
    add("sequence_length", num(eff_.seq));
    if (eff_.packed()) add("sequences_per_row", num(eff_.sequences));  // absent unpacked: older files match
    return f;
  }
  // The settings of the run, which its checkpoints record beside the fingerprint and load()
  // compares (load_options): they do not shape the state, but decide what the run computes from
  // here on. The learning-rate schedule, AdamW's hyper-parameters (its lr is not used), clipping,
  // loss scaling (the scale itself is state), and the caller's trainer_options::run_tags as
  // "tag.NAME". Not the seed: it only starts the weights and the generator, which load() replaces.
  std::vector<fingerprint_field> run_settings() const {
    std::vector<fingerprint_field> f;
    const auto add = [&](std::string name, std::string value) { f.push_back({std::move(name), std::move(value)}); };
    const auto real = [](double v) { return detail::exact_text(v); };
    add("lr.total", std::to_string(o_.lr.total));  // first: a run's length often sets its warm-up too
    add("lr.peak", real(o_.lr.peak));
    add("lr.min_lr", real(o_.lr.min_lr));
    add("lr.warmup", std::to_string(o_.lr.warmup));
    add("adam.beta1", real(o_.adam.beta1));
    add("adam.beta2", real(o_.adam.beta2));
    add("adam.eps", real(o_.adam.eps));
    add("adam.weight_decay", real(o_.adam.weight_decay));
    add("clip", o_.clip > 0 ? real(o_.clip) : "off");  // every clip <= 0 is off
    add("loss_scaling", scaling_ ? "dynamic" : "off");
    if (scaling_) {
      add("scaler.growth_interval", std::to_string(o_.scaler.growth_interval));
      add("scaler.min_scale", real(o_.scaler.min_scale));
      add("scaler.max_scale", real(o_.scaler.max_scale));
    }
    for (const fingerprint_field& t : o_.run_tags) add("tag." + t.name, t.value);
    return f;
  }
  // The run settings the last load() found changed and accepted (load_options); empty when it
  // found none, or when no load ran.
  const std::vector<run_field_change>& changed_at_load() const noexcept { return changed_; }
  // Sequences per optimizer step (over all ranks) and their length.
  batch_shape effective_batch() const noexcept { return eff_; }
  // Optimizer steps run, skipped updates included.
  std::uint64_t steps_done() const noexcept { return steps_; }
  // Steps whose update was applied (inf/NaN gradients skip it): the optimizer's step count.
  std::uint64_t updates_applied() const noexcept { return updates_; }
  // Sequences drawn from the source so far: the next request's index.
  std::uint64_t data_position() const noexcept { return position_; }
  // The run's random generator, as a checkpoint saves it.
  const random_state& rng() const noexcept { return rng_; }
  // The loss scaler's state: its scale and its clean steps.
  const loss_scaler& scaler() const noexcept { return scaler_; }
  // Whether the loss is scaled (trainer_options::scaling; `automatic` turns it on for fp16).
  bool loss_scaling_on() const noexcept { return scaling_; }
  // On a device: written in the executor's stream order (a step's or load's last all-gather may
  // still run); read them on that stream, or after synchronizing it. Under ZeRO-3 (over more than
  // one rank) this rank's shard only: weight_shard() says which parameters.
  const S* weights() const noexcept { return w_; }
  // The same, writable.
  S* weights() noexcept { return w_; }
  // Elements of the weight array, padding included (the model's parameter_elements()).
  std::size_t parameter_elements() const noexcept { return n_; }
  // The parameters weights() holds: all of them, or under ZeRO-3 this rank's shard.
  shard_range weight_shard() const noexcept { return zero3() ? opt_shard_ : shard_range{0, n_}; }
  // The optimizer state this rank holds, in the Optimizer's layout and the backend's memory.
  const void* optimizer_state() const noexcept { return opt_; }
  // Bytes of optimizer_state().
  std::size_t optimizer_bytes() const noexcept { return opt_bytes(); }
  // The pressure monitor, to read or adjust between steps.
  Monitor& monitor() noexcept { return monitor_; }
  // Bytes held by the trainer itself between steps (weights, gradients, optimizer) as the
  // allocator counts them, and by others (usage minus those), when the allocator has a budget.
  std::size_t own_bytes() const noexcept { return own_bytes_; }
  // The bytes others hold: the budget's external bytes plus what the allocator serves beyond
  // own_bytes().
  std::size_t foreign_bytes() const { return foreign_now(); }

 private:
  // ---- Checkpoint helpers -------------------------------------------------------------------------
  struct staged {
    std::uint64_t steps = 0, updates = 0, position = 0;
    random_state rng{};
    loss_scaler scaler{};
    std::optional<training_plan> plan;
    bool restored = false;
    std::vector<run_field_change> changes;  // the run settings that differ (accepted)
    std::size_t tolerated_peak = 0, tolerated_foreign = 0;  // see tolerating(); 0 in older files
  };

  // weights and state: host memory (a device trainer's host copies).
  void write_state(checkpoint_writer& cw, const void* weights, std::size_t weight_bytes, const void* state_bytes) const {
    checkpoint_contents c;
    c.fingerprint = fingerprint();
    c.run_settings = run_settings();
    c.weights = weights;
    c.weight_bytes = weight_bytes;
    c.optimizer = Optimizer::save_state(state_bytes, opt_shard_.size());
    c.counters = {steps_, updates_, position_, rng_, scaler_.scale, scaler_.clean_steps};
    c.plan = {plan_.micro.batch, plan_.accumulation, plan_.head_chunk, static_cast<std::uint64_t>(plan_.schedule.k),
              plan_.schedule.param};
    // An emergency the run tolerates (no plan gets under it) is not abandoned again: a resumed
    // run must know it, or it would replan where the uninterrupted one went on.
    c.tolerated = {tolerated_peak_, tolerated_foreign_, limit_now()};
    write_checkpoint_state(cw, c);
  }

  // Everything of a checkpoint file checked, nothing of this trainer changed.
  staged stage(const checkpoint_reader& r, const std::string& path, std::size_t weight_bytes,
               const load_options& lo) const {
    check_checkpoint_format(r, path);
    check_fingerprint(read_checkpoint_fields(r, "fingerprint", path), path);
    if (r.size("weights") != weight_bytes || r.size("optimizer") != opt_bytes()) {
      throw corrupt_checkpoint(path, "its weight or optimizer section has the wrong size");
    }
    return stage_counters(r, path, lo);
  }

  // The counters, the loss scaler and the plan of a checked file.
  staged stage_counters(const checkpoint_reader& r, const std::string& path, const load_options& lo) const {
    const checkpoint_record c = read_checkpoint_record(r, path);
    staged st;
    if (c.has_run_settings) {
      st.changes = run_differences(c.run_settings);
      if (!st.changes.empty() && lo.changes == run_changes::refuse) throw checkpoint_run_changed(path, st.changes);
    }
    st.steps = c.counters.steps;
    st.updates = c.counters.updates;
    st.rng = c.counters.rng;
    st.position = c.counters.position;
    st.scaler = scaler_;
    st.scaler.scale = c.counters.loss_scale;
    st.scaler.clean_steps = c.counters.loss_scale_clean_steps;
    const checkpoint_plan_choices& pc = c.plan;
    if (pc.micro_batch != 0 && rank_batch().batch % pc.micro_batch == 0 &&
        pc.accumulation == rank_batch().batch / pc.micro_batch && pc.head_chunk != 0 &&
        pc.schedule_kind <= static_cast<std::uint64_t>(schedule_choice::kind::budget)) {
      try {
        training_plan p = own_plan(batch_shape{static_cast<std::size_t>(pc.micro_batch), eff_.seq, eff_.sequences},
                                   static_cast<std::size_t>(pc.accumulation),
                                   schedule_choice{static_cast<schedule_choice::kind>(pc.schedule_kind),
                                                   static_cast<std::size_t>(pc.schedule_param)},
                                   static_cast<std::size_t>(pc.head_chunk), plan_.budget);
        p.reserved_peak = reserve_of(p);
        if (p.fits() && (limit_now() == 0 || p.budgeted_peak() + foreign_now() <= limit_now())) st.plan = std::move(p);
      } catch (const error&) {
        // A plan this build cannot make: keep the current one.
      }
    }
    st.restored = st.plan.has_value();
    // The tolerance holds for the plan it was granted to under the same budget: a run resumed
    // with more room decides again.
    if (st.restored && c.tolerated.peak == st.plan->peak_bytes && c.tolerated.limit == limit_now()) {
      st.tolerated_peak = static_cast<std::size_t>(c.tolerated.peak);
      st.tolerated_foreign = static_cast<std::size_t>(c.tolerated.foreign);
    }
    return st;
  }

  // Everything checked: commit. The optimizer first: load_state checks its values before it
  // writes any, and nothing after it can fail.
  void commit(const checkpoint_reader& r, const std::string& path, staged& st, S* weights, std::size_t weight_bytes) {
    commit_state(r.view("optimizer"), path, st,
                 [&] { glue::write_via_host(ex_, weights, weight_bytes, [&](void* h) { r.copy("weights", h, weight_bytes); }); });
  }
  // The same from this rank's optimizer state and a way to put the weights in place (a file's,
  // or the re-sharded ones).
  template <typename CopyWeights>
  void commit_state(std::span<const std::byte> state, const std::string& path, staged& st, CopyWeights&& copy_weights) {
    try {
      fill_optimizer_state([&](void* h) { Optimizer::load_state(state, h, opt_shard_.size()); });
    } catch (const invalid_argument& e) {
      throw corrupt_checkpoint(path, std::string("its optimizer state is refused: ") + e.what());
    }
    copy_weights();
    zero_gradients();
    steps_ = st.steps;
    updates_ = st.updates;
    rng_ = st.rng;
    position_ = st.position;
    scaler_ = st.scaler;
    changed_ = std::move(st.changes);
    tolerated_peak_ = st.tolerated_peak;
    tolerated_foreign_ = st.tolerated_foreign;
    if (st.plan) adopt(std::move(*st.plan));
  }

  // Over ranks the saved plan is restored only where every rank can restore it (each judges it
  // against its own budget): ranks under different plans would make different collectives.
  void agree_on_restoring(staged& st) const {
    if (world() <= 1) return;
    const std::size_t N = world(), me = comm_.rank();
    std::vector<std::uint64_t> flags(N, 0);
    flags[me] = st.restored ? 1 : 0;
    ctl().all_gather(static_cast<const std::uint64_t*>(flags.data() + me), flags.data(), N);
    if (std::find(flags.begin(), flags.end(), std::uint64_t{0}) == flags.end()) return;
    st.plan.reset();
    st.restored = false;
    st.tolerated_peak = st.tolerated_foreign = 0;
  }

  // Whether every rank succeeded at `what`: each rank's flag gathered. A failed rank rethrows its
  // own error; the others throw rank_failed naming the first failed rank.
  void agree(const std::exception_ptr& failed, const char* what) const {
    const std::size_t N = world(), me = comm_.rank();
    std::vector<std::uint64_t> flags(N, 0);
    flags[me] = failed ? 1 : 0;
    ctl().all_gather(static_cast<const std::uint64_t*>(flags.data() + me), flags.data(), N);
    if (failed) std::rethrow_exception(failed);
    for (std::size_t r = 0; r < N; ++r) {
      if (flags[r] != 0) throw rank_failed(r, N, what);
    }
  }

  void save_shards(const std::string& path) const {
    const std::size_t N = world(), me = comm_.rank();
    const std::string file = checkpoint_shard_path(path, steps_, me, N);
    std::exception_ptr failed;
    try {
      checkpoint_writer cw;
      const std::size_t shard_bytes = opt_shard_.size() * sizeof(S);
      glue::read_via_host(ex_, shard_w(), shard_bytes, [&](const void* w) {
        read_optimizer_state([&](const void* state) { write_state(cw, w, shard_bytes, state); });
      });
      cw.commit(file);
    } catch (...) {
      failed = std::current_exception();
    }
    agree(failed, "write its checkpoint shard");
    if (me == 0) {
      try {
        write_checkpoint_manifest(path, N, steps_, n_);
      } catch (...) {
        failed = std::current_exception();
      }
    }
    agree(failed, "write the checkpoint manifest");
    // The committed manifest owns the files it names; every other shard file of `path` (an earlier
    // step's, another world's, one a killed save left) is named by no manifest now. Each rank
    // cleans its own folder's view (node-local or shared).
    std::vector<std::string> named;
    for (std::size_t r = 0; r < N; ++r) named.push_back(checkpoint_shard_path(path, steps_, r, N));
    (void)remove_unreferenced_shards(path, named);
  }

  bool load_shards(const std::string& path, const load_options& lo) {
    {
      // Another world size, or a whole checkpoint (ZeRO-0, one process): re-sharded.
      std::exception_ptr failed;
      std::optional<std::vector<checkpoint_source>> other;
      try {
        const checkpoint_reader r(path);
        check_checkpoint_format(r, path);
        if (!r.has("manifest")) {
          other = std::vector<checkpoint_source>{{shard_range{0, n_}, path}};
        } else {
          const std::vector<fingerprint_field> f = read_checkpoint_manifest(r, path);
          if (manifest_value(f, "ranks", path) != std::to_string(world()) || manifest_value(f, "zero", path) != "1") {
            other = manifest_sources(f, path, n_);
          }
        }
      } catch (...) {
        failed = std::current_exception();
      }
      agree(failed, "read the checkpoint");
      if (other) return load_resharded(*other, path, lo);
    }
    const std::size_t me = comm_.rank();
    std::exception_ptr failed;
    std::optional<checkpoint_reader> shard;
    std::string shard_path;
    std::vector<std::string> named_files;
    staged st;
    try {
      const checkpoint_reader r(path);
      check_checkpoint_format(r, path);
      if (!r.has("manifest")) {
        throw checkpoint_mismatch(path, "zero", "0", "1",
                                  "it is a whole checkpoint (ZeRO-0 or one process), this run is ZeRO-" + std::to_string(o_.zero) + " over " +
                                      std::to_string(world()) + " ranks, which resumes the manifest a ZeRO-1 save "
                                      "wrote. Resume it with trainer_options::zero = 0");
      }
      const std::vector<fingerprint_field> f = read_checkpoint_manifest(r, path);
      if (manifest_value(f, "ranks", path) != std::to_string(world()) || manifest_value(f, "zero", path) != "1") {
        throw corrupt_checkpoint(path, "its manifest changed while it was read");
      }
      // Every field against this run, as at another world size: the parameters, each shard's range.
      const std::vector<checkpoint_source> sources = manifest_sources(f, path, n_);
      for (const checkpoint_source& c : sources) named_files.push_back(c.file);
      const checkpoint_source mine = sources[me];
      if (mine.range.begin != opt_shard_.begin || mine.range.end != opt_shard_.end) {
        throw corrupt_checkpoint(path, "its shard " + std::to_string(me) + " holds parameters " +
                                           std::to_string(mine.range.begin) + ".." + std::to_string(mine.range.end) +
                                           ", this rank holds " + std::to_string(opt_shard_.begin) + ".." +
                                           std::to_string(opt_shard_.end));
      }
      shard_path = mine.file;
      shard.emplace(shard_path);
      st = stage(*shard, shard_path, opt_shard_.size() * sizeof(S), lo);
      if (std::to_string(st.steps) != manifest_value(f, "step", path)) {
        throw corrupt_checkpoint(shard_path, "it is of step " + std::to_string(st.steps) + ", its manifest '" + path +
                                                 "' of step " + manifest_value(f, "step", path));
      }
    } catch (...) {
      failed = std::current_exception();
    }
    agree(failed, "read its checkpoint shard");
    agree_on_restoring(st);
    try {
      commit(*shard, shard_path, st, shard_w(), opt_shard_.size() * sizeof(S));
    } catch (...) {
      failed = std::current_exception();
    }
    agree(failed, "load its checkpoint shard (the ranks that did are loaded: load again before training)");
    // Every rank holds its shard of the weights: gather the whole model (in place; ZeRO-3 keeps the shard).
    if (!zero3()) comm_.all_gather(static_cast<const S*>(shard_w()), w_, n_);
    // What the loaded manifest does not name (a killed save's files) goes now, not at the next save.
    (void)remove_unreferenced_shards(path, named_files);
    return st.restored;
  }


  // ---- Re-sharding ---------------------------------------------------------------------------------
  // Loads a checkpoint written by another world size (or ZeRO stage): every rank reads every
  // source file's weights (the whole model) and, from each file whose parameters overlap its own
  // optimizer range (opt_shard_: all of them but under ZeRO-1/2), the same slice of each of the
  // optimizer's state arrays. Host memory for the whole weights and this rank's state is taken
  // outside the allocator while loading, as checkpoint_reader's own. Elementwise states only
  // (adamw: m, v, masters); a block-wise state (adamw8bit) is refused. A collective over ranks
  // like load(): an error on any rank is thrown on every rank, and nothing changes before all
  // ranks have read and checked everything.
  bool load_resharded(const std::vector<checkpoint_source>& src, const std::string& path, const load_options& lo) {
    if constexpr (!requires { Optimizer::state_arrays; Optimizer::state_element_bytes; }) {
      // The same refusal on every rank (all read the same manifest): nothing to agree on.
      throw checkpoint_world_mismatch(path, std::to_string(src.size()), world(), sharded() ? o_.zero : 0,
                                      Optimizer::description() +
                                          "'s state is block-wise, and re-sharding slices elementwise states "
                                          "only (adamw)");
    } else {
      std::exception_ptr failed;
      staged st;
      std::vector<S> weights;
      std::vector<std::byte> state;
      try {
        {
          constexpr std::size_t arrays = Optimizer::state_arrays, eb = Optimizer::state_element_bytes;
          static_assert(Optimizer::state_bytes(1) == arrays * eb, "membound: an elementwise state is arrays x element bytes");
          const shard_range mine = opt_shard_;
          weights.resize(n_);
          state.resize(opt_bytes());
          for (std::size_t k = 0; k < src.size(); ++k) {
            const checkpoint_source& s = src[k];
            const checkpoint_reader r(s.file);
            check_checkpoint_format(r, s.file);
            const std::vector<fingerprint_field> f = read_checkpoint_fields(r, "fingerprint", s.file);
            check_fingerprint(f, s.file, /*any_world=*/true);
            check_source_identity(f, s, src.size(), n_, path);
            const std::string want = Optimizer::description() + ", " + std::to_string(Optimizer::state_bytes(s.range.size())) + " bytes";
            const auto saved = std::find_if(f.begin(), f.end(), [](const fingerprint_field& e) { return e.name == "optimizer"; });
            if (saved == f.end() || saved->value != want) {
              throw checkpoint_mismatch(s.file, "optimizer", saved == f.end() ? "(none)" : saved->value, want,
                                        "its optimizer state is not the one this run keeps. Resume it with the optimizer "
                                        "that wrote it");
            }
            if (r.size("weights") != s.range.size() * sizeof(S) || r.size("optimizer") != Optimizer::state_bytes(s.range.size())) {
              throw corrupt_checkpoint(s.file, "its weight or optimizer section has the wrong size for parameters [" +
                                                   std::to_string(s.range.begin) + ", " + std::to_string(s.range.end) + ")");
            }
            r.copy("weights", weights.data() + s.range.begin, s.range.size() * sizeof(S));
            copy_state_overlap(r.view("optimizer"), s.range, std::span<std::byte>(state), mine, arrays, eb);
            const staged sk = stage_counters(r, s.file, lo);
            if (k == 0) {
              st = sk;
            } else if (sk.steps != st.steps || sk.updates != st.updates || sk.position != st.position || !(sk.rng == st.rng)) {
              throw corrupt_checkpoint(s.file, "it is of step " + std::to_string(sk.steps) + ", the first shard '" +
                                                   src[0].file + "' of step " + std::to_string(st.steps));
            }
          }
        }
      } catch (...) {
        failed = std::current_exception();
      }
      agree(failed, "read the checkpoint it re-shards");
      agree_on_restoring(st);
      try {
        commit_state(std::span<const std::byte>(state), path, st,
                     [&] {
                       // Under ZeRO-3 this rank's shard of them.
                       const std::size_t first = zero3() ? opt_shard_.begin : 0;
                       glue::write_via_host(ex_, w_, weight_bytes(), [&](void* h) {
                         std::memcpy(h, weights.data() + first, weight_bytes());
                       });
                     });
      } catch (...) {
        failed = std::current_exception();
      }
      agree(failed, "load the checkpoint it re-shards (the ranks that did are loaded: load again before training)");
      // The files the loaded checkpoint names stay (the next save's manifest replaces it); others go.
      std::vector<std::string> named;
      if (src.size() != 1 || src[0].file != path) {
        for (const checkpoint_source& c : src) named.push_back(c.file);
      }
      (void)remove_unreferenced_shards(path, named);
      return st.restored;
    }
  }

  std::size_t opt_bytes() const noexcept { return Optimizer::state_bytes(opt_shard_.size()); }
  // The optimizer state's bytes for the host to write (fill) or read: the state itself where it
  // lives in the host space (offloaded), else a host copy through the backend's glue (on a
  // device, a copy; on the CPU, the state again).
  template <typename Fill>
  void fill_optimizer_state(Fill&& fill) {
    if (offload_.optimizer) fill(opt_);
    else glue::write_via_host(ex_, opt_, opt_bytes(), fill);
  }
  template <typename Read>
  void read_optimizer_state(Read&& read) const {
    if (offload_.optimizer) read(static_cast<const void*>(opt_));
    else glue::read_via_host(ex_, opt_, opt_bytes(), read);
  }
  // One staging buffer of the offloaded update: a bucket of parameters.
  std::size_t stage_bytes() const noexcept { return bytes_of<S>(offload_.bucket); }

  // The offloaded optimizer step (plan_options::offload): the backend's glue copies each bucket
  // of this rank's gradients and weights into the host's staging buffers and runs the policy's
  // update_range there. check_host_space refused the plan where either cannot.
  void offloaded_update(const optimizer_step& os) {
    if constexpr (glue::offloads_optimizer && offloadable_optimizer<Optimizer, S>) {
      glue::template offloaded_update<Optimizer>(ex_, shard_w(), opt_grads(), opt_, opt_shard_.size(),
                                                 std::span<const param_span>(opt_spans_), os, stage_w_, stage_g_,
                                                 offload_.bucket);
    } else {
      (void)os;
      throw error("membound: an offloaded plan reached a trainer that cannot run it (check_host_space): a bug, "
                  "please report it");
    }
  }

  // A plan with the optimizer offloaded needs a backend that offloads and a policy with
  // update_range (checked before the plan itself, which make_plan would refuse less plainly).
  static void check_offload_capability(const training_plan& p) {
    if (p.host_activations != 0 && !glue::offloads_activations) {
      throw invalid_argument("plan.host_activations", "0 on this backend (activation offload runs on cpu_backend only)",
                             format_bytes(p.host_activations),
                             "Plan without offload_options::activations: its device path is not built yet");
    }
    if (!p.offload_optimizer) return;
    if (!glue::offloads_optimizer) {
      throw invalid_argument("plan.offload_optimizer", "false on this backend (it does not offload)", "true",
                             "Plan without offload on this backend");
    }
    if (!offloadable_optimizer<Optimizer, S>) {
      throw invalid_argument("plan.offload_optimizer", "false for an optimizer policy without update_range", "true",
                             "Offload adamw<S> or adamw8bit<S>, or plan without offload");
    }
  }

  // ... and a host space (options.host), another allocator than the trainer's, whose budget
  // holds the plan's host peak beside what it serves already (both budgets named), and a plan
  // within its own host budget.
  void check_host_space(const training_plan& p) const {
    if (!p.offloads()) return;
    if (o_.host.empty()) {
      throw invalid_argument("options.host", "a host allocator for the plan's host space (" +
                                                 format_bytes(p.host_peak()) +
                                                 (p.offload_optimizer ? ": the optimizer's state and its staging buffers"
                                                                      : ": offloaded block inputs") +
                                                 ")",
                             "none", "Pass trainer_options::host = host_allocator_ref(your host allocator)");
    }
    if (o_.host.refers_to(&alloc_)) {
      throw invalid_argument("options.host", "another allocator than the trainer's (the device space)",
                             "the trainer's own allocator",
                             "Give the host space its own host allocator: the plan counts it outside the device's");
    }
    if (!p.host_fits()) {
      throw invalid_argument("plan.host_budget", "at least the plan's host peak of " + format_bytes(p.host_peak()),
                             format_bytes(p.host_budget),
                             "Make the plan with fit(..., {.offload = {true, bucket, host budget}}), which keeps "
                             "under the host budget, or raise it");
    }
    const std::size_t limit = o_.host.limit(), held = host_others();
    if (limit != 0 && detail::saturating_add(p.host_peak(), held) > limit) {
      throw invalid_argument(
          "options.host", "a host space whose budget holds the plan's host peak of " + format_bytes(p.host_peak()) +
                              (held != 0 ? " beside the " + format_bytes(held) + " it serves already" : std::string{}),
          "a host budget of " + format_bytes(limit) + " (the device's: " +
              (limit_now() != 0 ? format_bytes(limit_now()) : std::string("none")) + ")",
          "Raise the host budget, or plan with fit_options::offload.host_budget = the host budget so that fit "
          "refuses first");
    }
  }
  // The host bytes the trainer holds between steps: the offloaded state and its staging buffers
  // once made (block inputs come and go within a step).
  std::size_t own_host_bytes() const noexcept {
    return offload_.optimizer && opt_ != nullptr ? detail::saturating_add(opt_bytes(), 2 * stage_bytes()) : 0;
  }
  // What others hold in the host space: the trainer's own state and staging buffers are the plan's.
  std::size_t host_others() const { return detail::saturating_sub(o_.host.stats().requested, own_host_bytes()); }
  // The host budget a plan of this trainer may take: the plan's own (offload_options::host_budget),
  // within what the host allocator can serve beside others' bytes (0: no bound). Replans keep to
  // it, so a schedule that offloads block inputs never runs the host space out mid-step.
  std::size_t host_room() const {
    const std::size_t own = offload_.host_budget;
    if (o_.host.empty() || o_.host.limit() == 0) return own;
    const std::size_t free = std::max<std::size_t>(1, detail::saturating_sub(o_.host.limit(), host_others()));
    return own == 0 ? free : std::min(own, free);
  }
  // The layout the gradient exchange decides (ZeRO stage, world): see gradient_exchange.
  bool sharded() const noexcept { return exchange_->sharded(); }
  bool zero2() const noexcept { return exchange_->zero2(); }
  bool zero3() const noexcept { return exchange_->zero3(); }
  // The weight bytes this rank keeps: the whole model's, or under ZeRO-3 its shard's.
  std::size_t weight_bytes() const noexcept { return exchange_->weight_bytes(); }
  // The weights of this rank's optimizer shard.
  S* shard_w() const noexcept { return exchange_->shard_weights(w_); }
  // A block of mem_ given back on every exit.
  struct owned_block {
    stream_view<Allocator>& a;
    std::size_t bytes;
    memory_tag tag;
    void* p;
    owned_block(stream_view<Allocator>& from, std::size_t n, memory_tag t)
        : a(from), bytes(n), tag(t), p(from.allocate(n, default_alignment, t)) {}
    ~owned_block() { a.deallocate(p, bytes, default_alignment, tag); }
    owned_block(const owned_block&) = delete;
    owned_block& operator=(const owned_block&) = delete;
  };
  // f(weights) with the weights a forward reads: the array, or under ZeRO-3 the gathered ones
  // (their buffer from the allocator for the call; each weight unit gathered as it is reached).
  template <typename F>
  decltype(auto) with_weights(F&& f) {
    if (zero3()) {
      typename exchange_type::gathered_weights gathered(*exchange_, w_);
      return f(gathered);
    }
    S* w = w_;
    return f(w);
  }
  bool whole_overlapped() const noexcept { return exchange_->whole_overlapped(); }
  std::size_t grad_bytes() const noexcept { return exchange_->grad_bytes(); }
  // The summed gradient of this rank's optimizer shard.
  S* opt_grads() const noexcept { return exchange_->shard_gradients(g_); }
  gradient_shards gradient_sharding() const { return exchange_->sharding(); }
  std::size_t optimizer_elements() const noexcept { return exchange_->optimizer_elements(); }
  // The bytes the blocking gradient exchange may take: the step's predicted peak less the trainer's own.
  std::size_t exchange_headroom() const noexcept {
    return plan_.peak_bytes > own_bytes_ ? plan_.peak_bytes - own_bytes_ : 0;
  }

  void release() noexcept {
    // A collective (ZeRO-1's all-gather into w_) may still be writing: done before the bytes go.
    try {
      glue::synchronize(ex_);
    } catch (...) {  // a sticky device error: the frees below report nothing either
    }
    // The executor's stream may go before the communicator: it must not keep ordering against it.
    if constexpr (requires { comm_.clear_stream(); comm_.caller_stream() == ex_.stream(); }) {
      if (comm_.caller_stream() == ex_.stream()) comm_.clear_stream();
    }
    if (sb_ != nullptr) mem_.deallocate(sb_, step_buffer_bytes_, default_alignment, memory_tag::other);
    sb_ = nullptr;
    if (stage_g_ != nullptr) o_.host.deallocate(stage_g_, stage_bytes(), default_alignment, memory_tag::optimizer);
    if (stage_w_ != nullptr) o_.host.deallocate(stage_w_, stage_bytes(), default_alignment, memory_tag::optimizer);
    stage_g_ = stage_w_ = nullptr;
    if (opt_ != nullptr) {
      if (offload_.optimizer) o_.host.deallocate(opt_, opt_bytes(), default_alignment, memory_tag::optimizer);
      else mem_.deallocate(opt_, opt_bytes(), default_alignment, memory_tag::optimizer);
    }
    if (g_ != nullptr) mem_.deallocate(g_, grad_bytes(), default_alignment, memory_tag::gradients);
    if (w_ != nullptr) mem_.deallocate(w_, weight_bytes(), default_alignment, memory_tag::weights);
    opt_ = nullptr;
    g_ = nullptr;
    w_ = nullptr;
  }

  // Every rank's status, gathered (rank_agreement::agree_to_start): when one rank cannot start,
  // every rank throws before step 1 (a rank that went on would wait forever in the first
  // exchange). The failing rank throws its own error, unless it is over budget: then every rank
  // throws the same rank_cannot_start with that rank's numbers.
  void agree_to_start(start_status status, const std::exception_ptr& failed) {
    if (world() > 1) {
      // start_room_: the budget less what others held, before our allocations.
      if (const auto refusal = agreement_->agree_to_start(ctl(), status, plan_.budgeted_peak(), start_room_)) {
        release();
        if (refusal->status == start_status::over_budget) {
          throw rank_cannot_start(refusal->rank, world(), refusal->peak, refusal->room);
        }
        if (failed) std::rethrow_exception(failed);
        throw rank_cannot_start(refusal->rank, world());
      }
    } else if (failed) {
      std::rethrow_exception(failed);
    }
  }

  std::size_t usage_now() const {
    if constexpr (budgeted<Allocator>) return alloc_.usage();
    else return 0;
  }
  std::size_t limit_now() const {
    if constexpr (budgeted<Allocator>) return alloc_.limit();
    else return 0;
  }
  // Whether p's reserved peak fits the budget beside what others hold (foreign_now: the bytes it
  // counts outside the stack, a CUDA context, set_external, and others' bytes on the stack): a
  // plan that fits only without them would run out of memory at its first peak. The replans and
  // load() judge by the same sum.
  bool fits_limit(const training_plan& p) const {
    const std::size_t limit = limit_now();
    return limit == 0 || detail::saturating_add(p.budgeted_peak(), foreign_now()) <= limit;
  }
  [[noreturn]] void refuse_over_limit(const training_plan& p) const {
    const std::size_t outside = foreign_now();
    const std::string beside = outside == 0 ? std::string{} : " less " + format_bytes(outside) + " held by others";
    throw invalid_argument("plan", "a plan whose reserved peak on this allocator stack fits its budget of " +
                                       format_bytes(limit_now()) + beside,
                           "a reserved peak of " + format_bytes(p.budgeted_peak()) + " (requested " +
                               format_bytes(p.peak_bytes) + ")",
                           outside == 0 ? "Choose it with fit_options::reserve = reserve_model(model, allocator), "
                                          "which counts the stack's rounding and segments"
                                        : "Choose it with fit(model, effective, the budget less " +
                                              format_bytes(outside) + ", {.reserve = reserve_model(model, allocator)}), "
                                              "or raise the budget");
  }
  // Between attempts nothing of the step is live, so all but the trainer's own bytes are others'.
  // Between attempts nothing of the step is live: what the allocator serves beyond the trainer's
  // own requests, and what the budget counts as held outside it, is others'. Requested bytes, not
  // reserved ones, so that the stack's own cache and rounding never pass for someone else's.
  std::size_t foreign_now() const {
    std::size_t external = 0;
    if constexpr (requires { alloc_.external(); }) external = alloc_.external();
    const std::size_t requested = alloc_.stats().requested;
    return detail::saturating_add(external, requested > own_bytes_ ? requested - own_bytes_ : 0);
  }

  // The plan's reserved peak on this stack (0 where the stack has no shadow).
  std::size_t reserve_of(const training_plan& p) const { return reserve_ ? reserve_(p) : 0; }

  // A planned stack (caching_options::planned) is told where the layout resumes: at the cycle's
  // start as a step begins, at its tail (one evaluation micro-batch) as an evaluation's does.
  // Sizes alone cannot always tell (ZeRO-3's steps and evaluations both begin with the gathered
  // weights; evaluation micro-batches in a row would wrap to the cycle's start).
  void planned_restart(bool evaluation) noexcept {
    if constexpr (has_planned_layer<Allocator>) {
      if (auto* layer = planned_layer(alloc_)) evaluation ? layer->restart_tail() : layer->restart_cycle();
    }
  }

  // A planned stack (caching_options::planned) serves the run from the plan's layout.
  void use_layout(const training_plan& p) {
    if constexpr (has_planned_layer<Allocator>) {
      // Every stage's requests are in the layout: ZeRO-2's buckets and ZeRO-3's gathered weights
      // are recorded as the trainer makes them (reserve_plan's micro_batch_requests).
      if (auto* layer = planned_layer(alloc_)) layer->set_layout(plan_layout(m_, p), mem_.stream());
    }
  }

  // Each field on its own, written so that NaN fails too.
  static void check_options(const trainer_options& o) {
    const auto need = [](bool ok, const char* name, const char* expected, double got, const char* todo) {
      if (!ok) throw invalid_argument(name, expected, std::to_string(got), todo);
    };
    const adamw_config& a = o.adam;
    need(a.beta1 >= 0 && a.beta1 < 1, "options.adam.beta1", "a value in [0, 1)", a.beta1, "The usual value is 0.9");
    need(a.beta2 >= 0 && a.beta2 < 1, "options.adam.beta2", "a value in [0, 1)", a.beta2, "The usual value is 0.95 or 0.999");
    need(a.eps > 0 && std::isfinite(a.eps), "options.adam.eps", "a positive number", a.eps, "The usual value is 1e-8");
    need(a.weight_decay >= 0 && std::isfinite(a.weight_decay), "options.adam.weight_decay", "0 or more",
         a.weight_decay, "The usual value is 0.1; 0 turns it off");
    need(o.lr.peak >= 0 && std::isfinite(o.lr.peak), "options.lr.peak", "a finite rate, 0 or more", o.lr.peak,
         "e.g. 3e-4");
    need(o.lr.min_lr >= 0 && std::isfinite(o.lr.min_lr), "options.lr.min_lr", "a finite rate, 0 or more",
         o.lr.min_lr, "e.g. a tenth of the peak");
    need(!std::isnan(o.clip), "options.clip", "a number (<= 0 turns clipping off)", o.clip, "e.g. 1.0");
    need(o.zero <= 3, "options.zero", "0, 1, 2 or 3", static_cast<double>(o.zero),
         "Use 1 to shard AdamW's state over the ranks, 2 to shard the gradients too, 3 the weights too, 0 to keep "
         "all whole");
    need(o.scaler.scale > 0 && std::isfinite(o.scaler.scale), "options.scaler.scale", "a positive finite scale",
         o.scaler.scale, "e.g. 65536");
    need(o.scaler.growth_interval >= 1, "options.scaler.growth_interval", "1 or more",
         static_cast<double>(o.scaler.growth_interval), "The usual value is 2000");
    for (std::size_t k = 0; k < o.run_tags.size(); ++k) {
      const fingerprint_field& t = o.run_tags[k];
      const std::string name = "options.run_tags[" + std::to_string(k) + "]";
      if (t.name.empty() || t.name.find_first_of("=\n") != std::string::npos || t.value.find('\n') != std::string::npos) {
        throw invalid_argument(name, "a name that is not empty and holds no '=' or new line, and a value with no new line",
                               "'" + t.name + "'", "Name the setting plainly, e.g. {\"data\", digest}");
      }
      for (std::size_t j = 0; j < k; ++j) {
        if (o.run_tags[j].name == t.name) {
          throw invalid_argument(name, "a name no other tag has", "'" + t.name + "' again", "Give each tag its own name");
        }
      }
    }
    if (o.head_chunks.empty() || std::find(o.head_chunks.begin(), o.head_chunks.end(), 0u) != o.head_chunks.end()) {
      throw invalid_argument("options.head_chunks", "one or more positive logit chunk sizes",
                             std::to_string(o.head_chunks.size()) + " sizes, or a 0", "e.g. {256, 64}");
    }
  }

  // The plan this trainer makes for a plan's choices (micro-batch, accumulation, schedule, logit
  // chunk): its own model, the pool's threads, AdamW's state counted.
  training_plan own_plan(batch_shape micro, std::size_t accumulation, schedule_choice s, std::size_t head_chunk,
                         std::size_t budget) const {
    plan_options po;
    po.threads = threads();
    po.head_chunk = head_chunk;
    po.accumulation = accumulation;
    po.optimizer = true;
    po.optimizer_elements = optimizer_elements();
    po.optimizer_policy = optimizer_of<Optimizer>();
    po.gradients = gradient_sharding();
    po.offload = offload_;  // fixed for the trainer: its state lives where it was made
    po.offload.host_budget = host_room();
    return make_plan(m_, micro, s, po, budget);
  }

  // A plan is accepted only when it is own_plan of its own choices, field for field: anything
  // else (a plan for another model or precision, one made with optimizer = false, an edited peak
  // or ops list) would make the step allocate what its prediction does not say. Throws
  // invalid_argument("plan") naming the first field that differs; changes nothing.
  void check_plan(const training_plan& p) const {
    const std::string remake =
        "Make it with fit(model, effective, budget) or make_plan(model, micro, schedule, options) for this "
        "model, with optimizer = true and the executor's thread count (the pool's; 1 on a device), and do not "
        "edit its fields";
    const std::size_t B = rank_batch().batch;
    // By division, so that a huge micro-batch times accumulation cannot wrap around to B.
    if (p.micro.seq != eff_.seq || p.micro.sequences != eff_.sequences || p.micro.batch == 0 || p.accumulation == 0 ||
        B % p.micro.batch != 0 || B / p.micro.batch != p.accumulation || (eff_.packed() && p.micro.batch != 1)) {
      throw invalid_argument("plan", "micro-batches of " + std::string(world() > 1 ? "this rank's share of " : "") +
                                         "the effective batch, " + std::to_string(B) + " x " +
                                         std::to_string(eff_.seq) +
                                         (eff_.packed() ? " (packed: one row per micro-batch, " +
                                                              std::to_string(eff_.sequences) + " sequences)"
                                                        : std::string()),
                             std::to_string(p.accumulation) + " x " + std::to_string(p.micro.batch) + " x " +
                                 std::to_string(p.micro.seq),
                             "Make the plan with fit(model, effective, budget) or make_plan for the same batch");
    }
    if (p.threads != threads()) {
      throw invalid_argument("plan", "a plan for " + std::to_string(threads()) + " threads (the executor's)",
                             std::to_string(p.threads) + " threads",
                             "Pass the pool's thread count (1 on a device) in plan_options/fit_options");
    }
    if (p.head_chunk == 0) {
      throw invalid_argument("plan", "plan.head_chunk of at least 1 logit row", "plan.head_chunk = 0", remake);
    }
    if (p.schedule.k > schedule_choice::kind::budget) {
      throw invalid_argument("plan", "plan.schedule of a kind schedule_choice names (none, full, every, binomial, budget)",
                             "plan.schedule kind " + std::to_string(static_cast<unsigned>(p.schedule.k)), remake);
    }
    if (p.ops.empty()) throw invalid_argument("plan", "a plan with a schedule", "no ops", "Use make_plan or fit");
    training_plan q;
    try {
      q = own_plan(p.micro, p.accumulation, p.schedule, p.head_chunk, p.budget);
    } catch (const error& e) {
      throw invalid_argument("plan", "a plan make_plan can make for this model",
                             "schedule " + p.schedule.name() + " is refused: " + e.what(), remake);
    }
    const std::string made = "as make_plan gives this model for micro-batch " + std::to_string(p.micro.batch) + " x " +
                             std::to_string(p.accumulation) + ", schedule " + p.schedule.name() + ", logit chunk " +
                             std::to_string(p.head_chunk) + ", " + std::to_string(threads()) +
                             " threads and the optimizer counted";
    const auto differs = [&](const char* field, const std::string& want, const std::string& got) {
      throw invalid_argument("plan", std::string(field) + " = " + want + " (" + made + ")",
                             std::string(field) + " = " + got, remake);
    };
    const auto bytes = [&](const char* field, std::size_t want, std::size_t got) {
      if (want != got) differs(field, format_bytes(want), format_bytes(got));
    };
    bytes("plan.weights", q.weights, p.weights);
    bytes("plan.weight_gather", q.weight_gather, p.weight_gather);
    bytes("plan.gradients", q.gradients, p.gradients);
    bytes("plan.step_buffers", q.step_buffers, p.step_buffers);
    if (q.offload_optimizer != p.offload_optimizer) {
      differs("plan.offload_optimizer", q.offload_optimizer ? "true" : "false", p.offload_optimizer ? "true" : "false");
    }
    bytes("plan.host_optimizer", q.host_optimizer, p.host_optimizer);
    bytes("plan.host_staging", q.host_staging, p.host_staging);
    if (q.offload_bucket != p.offload_bucket) {
      differs("plan.offload_bucket", std::to_string(q.offload_bucket), std::to_string(p.offload_bucket));
    }
    if (q.gradient_sharding.overlap != p.gradient_sharding.overlap) {
      differs("plan.gradient_sharding.overlap", q.gradient_sharding.overlap ? "true" : "false",
              p.gradient_sharding.overlap ? "true" : "false");
    }
    if (q.optimizer != p.optimizer) {
      differs("plan.optimizer", format_bytes(q.optimizer) + " (" + Optimizer::description() + ")",
              format_bytes(p.optimizer) + (p.optimizer == 0 ? " (made with optimizer = false?)" : ""));
    }
    if (q.ops != p.ops) {
      std::size_t k = 0;
      while (k < q.ops.size() && k < p.ops.size() && q.ops[k] == p.ops[k]) ++k;
      const auto at = [&](const std::vector<chain_op>& o) {
        return std::to_string(o.size()) + " ops" + (k < o.size() ? ", op " + std::to_string(k) + " " + to_string(o[k]) : "");
      };
      differs("plan.ops", at(q.ops), at(p.ops));
    }
    bytes("plan.activations", q.activations, p.activations);
    bytes("plan.workspace", q.workspace, p.workspace);
    bytes("plan.peak_bytes", q.peak_bytes, p.peak_bytes);
    if (q.peak_phase != p.peak_phase) differs("plan.peak_phase", q.peak_phase, p.peak_phase);
    // Bits, not values: make_plan computes them the same way every time.
    if (std::bit_cast<std::uint64_t>(q.forward_flops) != std::bit_cast<std::uint64_t>(p.forward_flops)) {
      differs("plan.forward_flops", detail::exact_text(q.forward_flops), detail::exact_text(p.forward_flops));
    }
    if (std::bit_cast<std::uint64_t>(q.recompute_flops) != std::bit_cast<std::uint64_t>(p.recompute_flops)) {
      differs("plan.recompute_flops", detail::exact_text(q.recompute_flops), detail::exact_text(p.recompute_flops));
    }
    std::size_t k = 0;
    while (k < q.timeline.size() && k < p.timeline.size() && q.timeline[k].name == p.timeline[k].name &&
           q.timeline[k].live_before == p.timeline[k].live_before && q.timeline[k].peak == p.timeline[k].peak) {
      ++k;
    }
    if (k != q.timeline.size() || k != p.timeline.size()) {
      const auto at = [&](const std::vector<plan_phase>& t) {
        return std::to_string(t.size()) + " phases" +
               (k < t.size() ? ", phase " + std::to_string(k) + " '" + t[k].name + "' " + format_bytes(t[k].live_before) +
                                   " live, peak " + format_bytes(t[k].peak)
                             : "");
      };
      differs("plan.timeline", at(q.timeline), at(p.timeline));
    }
    // A reserve, when the plan states one, is this stack's for this plan.
    if (p.reserved_peak != 0) {
      const std::size_t want = reserve_of(q);
      if (want != p.reserved_peak) {
        differs("plan.reserved_peak",
                want == 0 ? std::string("0 (this allocator stack has no shadow to predict it)") : format_bytes(want),
                format_bytes(p.reserved_peak) + " (made for another allocator stack or budget?)");
      }
    }
    // The budget is the caller's: 0 (none) or one the plan fits.
    if (p.budget != 0 && q.peak_bytes > p.budget) {
      throw invalid_argument("plan", "plan.budget = 0 (none) or at least the plan's peak " + format_bytes(q.peak_bytes),
                             "plan.budget = " + format_bytes(p.budget),
                             "Choose the plan with fit(model, effective, budget), which keeps under the budget");
    }
  }

  void adopt(training_plan p) {
    if (p.reserved_peak == 0) p.reserved_peak = reserve_of(p);
    // What the caller measured outside the stack stays in the plan's table and fits().
    if (p.outside_stack == 0 && p.budget == plan_.budget) {
      p.outside_stack = plan_.outside_stack;
      p.outside_note = plan_.outside_note;
    }
    use_layout(p);
    // Before any step or evaluation only the state is held, which every plan counts: a plan that
    // never ran (the constructor's, replaced by load() or set_plan()) is no longer a bound.
    largest_peak_ = ran_ ? std::max(largest_peak_, p.peak_bytes) : p.peak_bytes;
    largest_host_ = ran_ ? std::max(largest_host_, p.host_peak()) : p.host_peak();
    largest_reserve_ = ran_ ? std::max(largest_reserve_, p.budgeted_peak()) : p.budgeted_peak();
    plan_ = std::move(p);
  }

  void rewind(const random_state& rng0, std::uint64_t position0) noexcept {
    rng_ = rng0;
    position_ = position0;
    try {
      zero_gradients();
    } catch (...) {
      // A device that cannot run a memset has failed the run: the next step's own zeroing reports it.
    }
  }

  template <data_source Source, typename Request>
  void fill(Source& source, std::size_t b, Request&& request) {
    const std::size_t T = eff_.seq;
    x_.resize(b * T);
    y_.resize(b * T);
    if constexpr (packed_source<Source>) {
      const std::size_t S = eff_.sequences;
      offsets_.assign(S + 1, -1);  // b is 1: one packed row per micro-batch
      source(request(0), packed_row{x_.data(), y_.data(), offsets_.data(), T, S});
      const packing_check c = check_packing(offsets_.data(), S, 1, T);
      if (!c.ok) {
        throw invalid_argument("source's offsets", c.expected, whole_text(c.actual),
                               "Write packed_row::sequences + 1 offsets, 0 first and packed_row::seq last (an "
                               "unused sequence is empty: repeat seq)");
      }
    } else {
      for (std::size_t j = 0; j < b; ++j) source(request(j), x_.data() + j * T, y_.data() + j * T);
    }
    // A device cannot throw on a bad id: the host copies are checked (on every backend), then
    // staged where the step reads them (uploaded into the step buffers on a device).
    m_.check_tokens(x_.data(), b * T);
    Model::head_type::check_targets(y_.data(), b * T, m_.config().vocab);
    glue::stage_ids(ex_, sb_, x_.data(), y_.data(), b * T, step_tokens());
  }

  // The source's kind matches the effective batch: packed rows for packed sequences, else rows of
  // one sequence each.
  template <typename Source>
  void check_source() const {
    if (packed_source<Source> != eff_.packed()) {
      throw invalid_argument("source", eff_.packed() ? "a packed_source (the effective batch packs sequences)"
                                                     : "a sequence_source (the effective batch has no packed sequences)",
                             packed_source<Source> ? "a packed_source" : "a sequence_source",
                             "Pass the source that fills the rows the effective batch_shape describes");
    }
  }
  // Targets of the staged micro-batch that count (not ignore_target), from the host copy.
  std::size_t counted_host() const noexcept { return counted_targets(y_.data(), y_.size()); }
  // The staged micro-batch's weight in the step's sum over tokens: the model's mean divides by the
  // targets it reads as counted (Model::counted_targets; on a device, which it does not read, by
  // every position), so scaling it by that count over the positions makes every micro-batch a sum
  // over its tokens divided by the same number. Exactly 1 wherever nothing is ignored.
  double micro_weight() const noexcept {
    return Model::counted_targets(targets_in(), y_.size()) / static_cast<double>(y_.size());
  }
  // A micro-batch's shape with the offsets of the row fill() staged (packed rows).
  batch_shape micro_in(batch_shape b) const noexcept {
    if (b.packed()) b.offsets = offsets_.data();
    return b;
  }

  // The ids a micro-batch reads: the host arrays, or on a device their upload in the step buffers.
  const std::int32_t* tokens_in() const noexcept { return glue::staged_tokens(sb_, x_.data()); }
  const std::int32_t* targets_in() const noexcept {
    return glue::staged_targets(sb_, y_.data(), step_tokens());
  }
  // Tokens of a whole step of this rank: every plan's micro-batch × accumulation.
  std::size_t step_tokens() const noexcept { return rank_batch().tokens(); }
  std::size_t threads() const noexcept { return workspace_threads(ex_); }

  // The gradients zeroed where they live (the glue: host memory in place, device memory on the stream).
  void zero_gradients() { glue::fill_zero(ex_, g_, grad_bytes()); }

  // ---- The step's parts: the monitor at the check points, the micro-batches -----------------------

  template <check_point P>
  void observe(pressure_level& highest) {
    const pressure_level l = monitor_.template check<P>(alloc_);
    highest = std::max(highest, l);
    // Where and at what usage the emergency began (the monitor's own classification, before it
    // released the cache): the step is abandoned at a later point, with less in use, and the
    // event names both. A request made elsewhere (between steps) is dated here.
    if (monitor_.stricter_plan_requested() && !emergency_seen_.known) {
      if constexpr (requires { monitor_.last_request().usage; }) {
        const auto& e = monitor_.last_request();
        emergency_seen_ = e.limit != 0 ? emergency_point{e.point, e.usage, e.limit, true}
                                       : emergency_point{P, usage_now(), limit_now(), true};
      } else {
        emergency_seen_ = {P, usage_now(), limit_now(), true};
      }
    }
  }
  // The monitor's request acted on (or cleared): the next one is dated afresh.
  void clear_request() {
    monitor_.clear_stricter_plan_request();
    emergency_seen_ = {};
  }

  // "pressure emergency at after_forward", and where the step was abandoned when elsewhere.
  static std::string emergency_reason(check_point began, check_point acted_at) {
    std::string r = retry_reason(retry_vote::pressure, static_cast<std::uint64_t>(began));
    if (began != acted_at) r += " (acted on at " + std::string(to_string(acted_at)) + ")";
    return r;
  }

  // Checks P and abandons the step when the monitor asks for a stricter plan.
  template <check_point P>
  void watch(pressure_level& highest, bool may_abandon) {
    observe<P>(highest);
    if (agreeing()) {
      // ZeRO-2's after_backward comes after the micro-batch's reduce-scatters: no rank abandons
      // there, the request waits for the next point (the next micro-batch, or the step's end).
      // So does an overlapped ZeRO-0/1 last micro-batch's (its blocks' exchanges have started).
      if (P == check_point::after_backward && backward_exchanges_) return;
      const bool mine = may_abandon && monitor_.stricter_plan_requested();
      const emergency_point seen = emergency_seen_;
      if (mine) clear_request();
      // A plan that cannot fit beside the bytes held outside the allocator would run out of memory
      // later, maybe past an exchange (ZeRO-2's backward), where no rank can abandon: say so now.
      // A pressure vote carries where the emergency began and its usage there.
      const retry_vote why = mine ? retry_vote::pressure : room_for_plan() ? retry_vote::none : retry_vote::no_room;
      const std::size_t who = agreement_->agree_on_retry(ctl(), why, static_cast<std::uint64_t>(mine ? seen.at : P),
                                                         mine ? seen.usage : usage_now(), mine ? seen.limit : limit_now());
      if (who < world()) throw agreement_->retry_of(who);
      return;
    }
    if (may_abandon && monitor_.stricter_plan_requested()) {
      const emergency_point seen = emergency_seen_;
      clear_request();
      throw detail::abandon_step{emergency_reason(seen.at, P), seen.usage, seen.limit};
    }
  }

  template <data_source Source>
  double accumulate(Source& source, double scale, bool may_abandon, pressure_level& highest) {
    planned_restart(false);
    zero_gradients();
    double loss = 0;
    moe_ = {};
    std::size_t counted = 0;  // this rank's counted targets in the step
    // Every rank's micro-batches count in the mean: the accumulation of the whole world.
    const double accum = static_cast<double>(plan_.accumulation * world());
    // The ranks before this one take the step's first sequences: draw them as they would.
    skip_requests(comm_.rank() * rank_batch().batch);
    for (std::size_t micro = 0; micro < plan_.accumulation; ++micro) {
      // No exchange until this micro-batch's backward; under ZeRO-3 its forward gathers weights, so
      // a rank's out-of-memory there cannot meet the others at a vote (they are in a gather).
      oom_may_vote_ = !zero3();
      // Whether this micro-batch's backward starts exchanges (ZeRO-2's, or the last of ZeRO-0/1 overlapped).
      backward_exchanges_ = zero2() || (whole_overlapped() && micro + 1 == plan_.accumulation);
      watch<check_point::before_forward>(highest, may_abandon);
      fill(source, plan_.micro.batch, [&](std::size_t) { return sequence_request{position_++, rng_.next()}; });
      const batch_shape shape = micro_in(plan_.micro);
      const double mean = micro_weight();
      counted += counted_host();
      auto observer = [&](check_point p) {
        switch (p) {
          case check_point::after_forward: watch<check_point::after_forward>(highest, may_abandon); break;
          case check_point::before_backward:
            watch<check_point::before_backward>(highest, may_abandon);
            if (backward_exchanges_) oom_may_vote_ = false;  // each block's exchange follows its backward
            break;
          case check_point::after_backward: watch<check_point::after_backward>(highest, may_abandon); break;
          default: break;
        }
      };
      moe_stats micro_moe{};
      const auto routed = [&](auto& router) {
        return m_.forward_backward_routed(w_, router, tokens_in(), targets_in(), shape, plan_.ops,
                                          plan_.head_chunk, scale * mean / accum, alloc_, ex_, observer, &micro_moe,
                                          o_.host);
      };
      if (zero3()) {
        // The gathered weights first (the planner's order), held through the micro-batch.
        typename exchange_type::gathered_weights gathered(*exchange_, w_);
        const auto sharded_run = [&](auto& router) {
          return m_.forward_backward_routed(gathered, router, tokens_in(), targets_in(), shape, plan_.ops,
                                            plan_.head_chunk, scale * mean / accum, alloc_, ex_, observer, &micro_moe,
                                            o_.host);
        };
        loss += mean * exchange_->zero2_micro_batch(g_, micro == 0, plan_.accumulation, sharded_run) / accum;
      } else if (zero2()) {
        loss += mean * exchange_->zero2_micro_batch(g_, micro == 0, plan_.accumulation, routed) / accum;
      } else if (backward_exchanges_) {
        loss += mean * exchange_->overlapped_micro_batch(g_, plan_.accumulation, routed) / accum;
      } else {
        loss += mean *
                m_.forward_backward(w_, g_, tokens_in(), targets_in(), shape, plan_.ops, plan_.head_chunk,
                                    scale * mean / accum, alloc_, ex_, observer, &micro_moe, o_.host) /
                accum;
      }
      moe_ += micro_moe;
    }
    oom_may_vote_ = false;  // the exchange follows
    backward_exchanges_ = false;
    skip_requests((world() - 1 - comm_.rank()) * rank_batch().batch);
    // The step's mean is over every counted target of every rank: the micro-batches summed over
    // their tokens divided by all positions, then rescaled by positions / counted (1 when nothing
    // is ignored, so no bit changes); the gradients by the same factor, through the unscale.
    double all_counted = static_cast<double>(counted);
    if (world() > 1) loss = exchange_->exchange(g_, loss, exchange_headroom(), &all_counted);
    const double positions = static_cast<double>(step_tokens()) * static_cast<double>(world());
    counted_ratio_ = all_counted == 0 || all_counted == positions ? 1.0 : positions / all_counted;
    return loss * counted_ratio_;
  }

  // Advances the data position and the generator past k sequences other ranks run.
  void skip_requests(std::size_t k) {
    for (std::size_t i = 0; i < k; ++i) {
      ++position_;
      (void)rng_.next();
    }
  }

  std::size_t world() const noexcept { return comm_.size(); }
  // A device communicator orders each collective after the work enqueued on the stream it
  // follows and before the work enqueued after it: this trainer's executor's, set again at each
  // entry that exchanges (trainers may share a communicator) and cleared by release().
  void follow_stream() const {
    if constexpr (requires { comm_.set_stream(ex_.stream()); }) comm_.set_stream(ex_.stream());
  }
  // The communicator of the host values every rank agrees on (see detail::control_of).
  auto& ctl() const { return detail::control_of(comm_); }
  // This rank's share of the effective batch.
  batch_shape rank_batch() const noexcept { return {eff_.batch / world(), eff_.seq, eff_.sequences}; }

  void check_world() {
    const std::size_t N = world();
    if (N <= 1) return;
    if (eff_.batch % N != 0) {
      throw invalid_argument("effective.batch", "a multiple of the world size " + std::to_string(N),
                             std::to_string(eff_.batch),
                             "Choose an effective batch every rank can take an equal share of");
    }
    if (o_.zero >= 1 && n_ < N) {
      throw invalid_argument("options.zero", "0 for a model with fewer parameters than ranks",
                             std::to_string(o_.zero) + " with " + std::to_string(n_) + " parameters over " + std::to_string(N) + " ranks",
                             "Use ZeRO-0 (options.zero = 0)");
    }
    if (!on_host && o_.zero >= 2) {
      // ZeRO-2's router zeroes and adds its buckets on the host (ZeRO-3's gathers copy there too).
      throw invalid_argument("options.zero", "0 or 1 on cuda_backend over more than one rank", std::to_string(o_.zero),
                             "Use ZeRO-1 (options.zero = 1): it shards AdamW's state; ZeRO-2 and 3 run on cpu_backend");
    }
    if (o_.zero == 3 && o_.overlap && !prefetching_communicator<Communicator>) {
      throw invalid_argument("options.overlap", "false under ZeRO-3 with a communicator that cannot start a gather",
                             std::string(comm_.name()) + ", which has no start_all_gather_blocks",
                             "Use mpi_communicator, or set overlap = false");
    }
    if (o_.zero == 3 && !gathering_communicator<Communicator>) {
      throw invalid_argument("options.zero", "0, 1 or 2 with a communicator without all_gather_blocks",
                             std::string(comm_.name()) + ", which cannot gather a block from the ranks' shards",
                             "Use mpi_communicator for ZeRO-3, or zero = 2");
    }
    if (!on_host && o_.overlap) {
      // The device trainer's exchanges are blocking on its stream (the overlapped ones poll on the host).
      throw invalid_argument("options.overlap", "false on cuda_backend over more than one rank", "true",
                             "Set overlap = false; overlapped exchanges run on cpu_backend");
    }
    if (o_.overlap && o_.zero == 0 && !overlapping_all_reduce_communicator<Communicator>) {
      throw invalid_argument("options.overlap", "a communicator that starts an all-reduce and completes it later (ZeRO-0)",
                             std::string(comm_.name()) + ", which has no start_all_reduce_sum",
                             "Use mpi_communicator, or set overlap = false");
    }
    if (o_.overlap && o_.zero >= 1 && !overlapping_communicator<Communicator>) {
      throw invalid_argument("options.overlap", "a communicator that starts a reduce-scatter and completes it later",
                             std::string(comm_.name()) + ", which has no start_reduce_scatter_blocks_sum",
                             "Use mpi_communicator, or set overlap = false");
    }
    if constexpr (!summable<S>) {
      throw invalid_argument("communicator", "a single rank for storage the gradient exchange cannot sum",
                             std::to_string(N) + " ranks with " + std::string(dtype_name<S>()) + " storage",
                             "Train over several ranks in fp32, fp64, bf16 or fp16 storage, or on one rank");
    } else {
      exchange_->reserve_loss_workspace();
    }
  }

  enum class replan_outcome { none, below_budget, below_emergency };

  // What a stricter plan must stay under: the emergency threshold less the others' bytes
  // (below_emergency), else the budget less them; each also below the current plan's peak. 0: no
  // such target.
  struct plan_targets {
    std::size_t emergency = 0, budget = 0;
  };
  plan_targets targets_now() const {
    if (plan_.budgeted_peak() <= 1) return {};
    const std::size_t cap = plan_.budgeted_peak() - 1;
    const std::size_t limit = limit_now();
    if (limit == 0) return {cap, 0};
    const std::size_t foreign = foreign_now();
    double emergency = 1.0;
    if constexpr (requires { monitor_.thresholds().emergency; }) emergency = monitor_.thresholds().emergency;
    const auto soft = static_cast<std::size_t>(emergency * static_cast<double>(limit));
    plan_targets t;
    if (soft > foreign + 1) t.emergency = std::min(cap, soft - foreign - 1);
    if (limit > foreign) t.budget = std::min(cap, limit - foreign);
    return t;
  }

  fit_options own_fit_options() const {
    fit_options fo;
    fo.threads = threads();
    fo.head_chunks = o_.head_chunks;
    fo.optimizer_elements = optimizer_elements();
    fo.optimizer_policy = optimizer_of<Optimizer>();
    fo.gradients = gradient_sharding();
    // A stricter plan keeps the state where it lives (its host bytes are fixed and already held),
    // and its block inputs within the host space's room.
    fo.offload = {offload_.optimizer, offload_.bucket, host_room(), offload_.activations, offload_.flops_per_byte};
    if (offload_.optimizer) fo.offload_mode = fit_options::offload_choice::always;
    fo.reserve = reserve_;  // the stack's reserve, with the others' bytes of this moment
    return fo;
  }

  // The least-recompute plan whose reserved peak stays within `target` bytes.
  std::optional<training_plan> plan_within(std::size_t target) const {
    try {
      // fit chooses; the trainer makes the plan it runs itself (as for every plan it runs).
      const training_plan chosen = fit(m_, rank_batch(), target, own_fit_options());
      return plan_of_choices(chosen.micro.batch, chosen.accumulation, chosen.schedule, chosen.head_chunk, target);
    } catch (const budget_too_small&) {
      return std::nullopt;
    } catch (const host_budget_too_small&) {  // others took the host space's room meanwhile
      return std::nullopt;
    }
  }
  // own_plan of these choices when its reserved peak is within `target`.
  std::optional<training_plan> plan_of_choices(std::size_t micro, std::size_t accumulation, schedule_choice s,
                                               std::size_t head_chunk, std::size_t target) const {
    training_plan p = own_plan(batch_shape{micro, eff_.seq, eff_.sequences}, accumulation, s, head_chunk, plan_.budget);
    p.budget = plan_.budget;
    p.reserved_peak = reserve_of(p);
    if (p.budgeted_peak() > target) return std::nullopt;
    return p;
  }

  // The least-recompute plan below the current peak whose peak plus the others' bytes stays
  // under the emergency threshold (second: true), else under the budget (second: false).
  std::optional<std::pair<training_plan, bool>> stricter_plan() const {
    const plan_targets t = targets_now();
    if (t.emergency != 0) {
      if (auto p = plan_within(t.emergency)) return std::pair{std::move(*p), true};
    }
    if (t.budget != 0) {
      if (auto p = plan_within(t.budget)) return std::pair{std::move(*p), false};
    }
    return std::nullopt;
  }

  std::size_t smallest_peak() const {
    try {
      (void)fit(m_, rank_batch(), 0, own_fit_options());
    } catch (const budget_too_small& e) {
      return e.minimum();
    }
    return 0;
  }

  // ---- Replanning over ranks ------------------------------------------------------------------------
  // Whether the ranks agree at the step's check points (more than one rank, replanning on).
  bool agreeing() const noexcept { return world() > 1 && o_.replan_under_pressure; }

  // Whether the plan's reserved peak still fits beside the budget's external bytes (held outside
  // the allocator, so they are others' even mid-step).
  bool room_for_plan() const {
    if constexpr (requires { alloc_.external(); }) {
      const std::size_t limit = limit_now();
      return limit == 0 || detail::saturating_add(plan_.budgeted_peak(), alloc_.external()) <= limit;
    } else {
      return true;
    }
  }
  // stricter_plan() agreed by every rank (rank_agreement::agree_on_plan, a collective, after every
  // rank gave the step's bytes back): rank 0 fits the least of the ranks' targets, and every rank
  // adopts the plan only when each finds it within its own target, so all run the same choices.
  // With none, and a rank whose current plan no longer fits its budget (or after an
  // out-of-memory), every rank throws rank_budget_too_small naming that rank.
  std::optional<std::pair<training_plan, bool>> agreed_stricter_plan(bool out_of_memory) {
    const plan_targets own = targets_now();
    const std::size_t foreign = foreign_now(), limit = limit_now();
    const rank_targets mine{own.emergency, own.budget, foreign, limit,
                            limit == 0 || plan_.budgeted_peak() + foreign <= limit};
    const auto choose = [&](std::size_t target) -> std::optional<plan_choices> {
      const std::optional<training_plan> p = plan_within(target);
      if (!p) return std::nullopt;
      return plan_choices{p->micro.batch, p->accumulation, p->schedule, p->head_chunk};
    };
    const auto make = [&](const plan_choices& c, std::size_t target) {
      return plan_of_choices(c.micro, c.accumulation, c.schedule, c.head_chunk, target);
    };
    return agreement_->agree_on_plan(ctl(), mine, out_of_memory, choose, make, [&] { return smallest_peak(); });
  }

  // Records the event in r; returns which kind of stricter plan was adopted, if any. Over ranks a
  // collective (agreed_stricter_plan), which may throw rank_budget_too_small.
  replan_outcome replan(step_result& r, std::string reason, std::size_t usage, std::size_t limit, bool retry,
                        bool out_of_memory = false) {
    // A cache below the budget counts as usage but is nobody's: give it back before measuring.
    if constexpr (requires { alloc_.release_cached(); }) alloc_.release_cached();
    replan_event e;
    e.step = r.step;
    e.reason = std::move(reason);
    e.usage = usage;
    e.limit = limit;
    e.foreign = foreign_now();
    e.from = plan_summary(plan_);
    e.from_peak = plan_.budgeted_peak();
    auto next = agreeing() ? agreed_stricter_plan(out_of_memory) : stricter_plan();
    e.stricter_found = next.has_value();
    replan_outcome out = replan_outcome::none;
    if (next) {
      e.to = plan_summary(next->first);
      e.to_peak = next->first.budgeted_peak();
      e.retried = retry;
      out = next->second ? replan_outcome::below_emergency : replan_outcome::below_budget;
      adopt(std::move(next->first));
    }
    r.replans.push_back(std::move(e));
    return out;
  }

  bool tolerating() const { return tolerated_peak_ == plan_.peak_bytes && tolerated_foreign_ == foreign_now(); }
  void tolerate() {
    tolerated_peak_ = plan_.peak_bytes;
    tolerated_foreign_ = foreign_now();
  }

  // The run settings of a checkpoint against run_settings(), in run_settings()'s order, then any
  // only the checkpoint has.
  std::vector<run_field_change> run_differences(const std::vector<fingerprint_field>& saved) const {
    // A setting of the trainer's that the file does not record is taken as unchanged (a file from
    // a build that recorded fewer); the caller's tags are compared both ways, and the scaler's
    // settings count when only the file has them (it was written with loss scaling on).
    return detail::field_differences(saved, run_settings(), [](const std::string& name, bool missing_from_saved) {
      return name.starts_with("tag.") || (!missing_from_saved && name.starts_with("scaler."));
    });
  }

  // Every field of `saved` against fingerprint(): checkpoint_mismatch naming each one that differs.
  // any_world: the fields that name a world size and a shard (a file being re-sharded) are
  // left out; the caller checks the optimizer's layout itself.
  void check_fingerprint(std::vector<fingerprint_field> saved, const std::string& path, bool any_world = false) const {
    std::vector<fingerprint_field> now = fingerprint();
    if (any_world) {
      const auto world_field = [](const fingerprint_field& f) {
        return f.name == "zero" || f.name == "ranks" || f.name == "optimizer.shard" || f.name == "optimizer";
      };
      std::erase_if(now, world_field);
      std::erase_if(saved, world_field);
    }
    // Every field counts, present on one side or both.
    const std::vector<run_field_change> d =
        detail::field_differences(saved, now, [](const std::string&, bool) { return true; });
    if (d.empty()) return;
    // The first few: a change of precision differs in every block, and one line is enough.
    constexpr std::size_t shown = 4;
    std::string why = "it was written for another model or run (";
    for (std::size_t k = 0; k < d.size() && k < shown; ++k) {
      why += (k == 0 ? "" : "; ") + std::string("checkpoint written for ") + d[k].field + " " + d[k].saved +
             ", this run uses " + d[k].current;
    }
    if (d.size() > shown) {
      const std::size_t more = d.size() - shown;
      why += "; and " + std::to_string(more) + (more == 1 ? " more field differs" : " more fields differ");
    }
    why += "). Build the trainer as the run that wrote it was built (" + d[0].field + " " + d[0].saved +
           ") to resume it";
    throw checkpoint_mismatch(path, d[0].field, d[0].saved, d[0].current, why);
  }

  local_communicator own_local_{};  // the communicator of a one-process trainer
  const Model& m_;
  batch_shape eff_;
  training_plan plan_;
  Allocator& alloc_;
  executor& ex_;
  stream_view<Allocator> mem_;  // alloc_ on ex_'s stream: every block of a step is served there
  trainer_options o_;
  Monitor monitor_;
  std::size_t n_;
  bool scaling_;
  loss_scaler scaler_;
  S* w_ = nullptr;
  S* g_ = nullptr;
  void* opt_ = nullptr;
  void* sb_ = nullptr;  // the step buffers (a device's; none on the host)
  // Optimizer offload (plan.offload_optimizer, fixed when the trainer is made): opt_ and the two
  // staging buffers come from options.host.
  offload_options offload_{};
  S* stage_w_ = nullptr;
  S* stage_g_ = nullptr;
  std::size_t step_buffer_bytes_ = 0;
  std::size_t own_bytes_ = 0;
  std::size_t tolerated_peak_ = 0, tolerated_foreign_ = 0;  // see tolerating()
  std::vector<run_field_change> changed_;                 // see changed_at_load()
  std::size_t largest_peak_ = 0;
  std::size_t largest_reserve_ = 0;
  std::size_t largest_host_ = 0;  // the same for the host space (plan.host_peak())
  bool ran_ = false;  // a step or an evaluation has run (see adopt)
  struct emergency_point {
    check_point at = check_point::before_forward;
    std::size_t usage = 0, limit = 0;
    bool known = false;
  } emergency_seen_{};  // where the monitor's pending request for a stricter plan began (see observe)
  reserve_function reserve_{};
  std::uint64_t steps_ = 0, updates_ = 0, position_ = 0;
  shard_range opt_shard_{};  // the parameters whose AdamW state this rank holds
  std::vector<param_span> opt_spans_;  // each tensor's part of opt_shard_, relative to its start
  random_state rng_{};
  std::vector<std::int32_t> x_, y_;
  std::vector<std::int32_t> offsets_;  // the packed row's offsets (host: the layers read them there)
  double counted_ratio_ = 1.0;  // the last step's positions / counted targets (see accumulate)
  moe_stats moe_{};             // this rank's mixture-of-experts blocks over the step's micro-batches
  Communicator& comm_;
  // ZeRO-0/1/2, overlapped or not; made once the options are checked.
  using exchange_type = gradient_exchange<Model, Allocator, Communicator>;
  std::optional<exchange_type> exchange_;
  // Over ranks: what they agree on before step 1 and when one asks for a stricter plan.
  std::optional<rank_agreement> agreement_;
  std::size_t start_room_ = 0;  // the budget less what others held when the trainer was made
  // An out-of-memory may vote at the next agreement point: no exchange lies before it.
  bool oom_may_vote_ = false;
  // This micro-batch's backward starts gradient exchanges (ZeRO-2, or ZeRO-0/1 overlapped's last).
  bool backward_exchanges_ = false;
};

MEMBOUND_NAMESPACE_END
