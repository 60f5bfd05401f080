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
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "membound/core/config.hpp"
#include "membound/core/error.hpp"
#include "membound/core/format.hpp"
#include "membound/core/parallel.hpp"
#include "membound/memory/allocator.hpp"
#include "membound/memory/memory_tag.hpp"
#include "membound/model/planner.hpp"
#include "membound/monitor/check_point.hpp"
#include "membound/monitor/null_monitor.hpp"
#include "membound/monitor/pressure_level.hpp"
#include "membound/train/adamw.hpp"
#include "membound/train/checkpoint_file.hpp"
#include "membound/train/schedule_lr.hpp"

MEMBOUND_NAMESPACE_BEGIN

// splitmix64: the whole generator is one 64-bit word, so a checkpoint holds it exactly.
struct random_state {
  std::uint64_t state = 0;
  std::uint64_t next() noexcept {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  friend constexpr bool operator==(const random_state&, const random_state&) = default;
};

// What the trainer asks its data for, one sequence at a time: `index` counts the sequences of the
// run (the data position), `random` is 64 fresh bits from the run's generator. A source that
// samples windows uses `random`; one that walks the data in order uses `index`.
struct sequence_request {
  std::uint64_t index = 0;
  std::uint64_t random = 0;
};

// source(request, tokens, targets) writes T token ids and T next-token targets.
template <typename F>
concept sequence_source = std::invocable<F&, const sequence_request&, std::int32_t*, std::int32_t*>;

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
};

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
};

// The gradient of an unscaled run is inf or NaN: training has diverged. Nothing was updated.
class non_finite_gradient : public error {
 public:
  non_finite_gradient(std::uint64_t step, double loss, double norm)
      : error("membound: step " + std::to_string(step) + ": the gradient norm is " + std::to_string(norm) +
              " (loss " + std::to_string(loss) +
              "); the weights were not updated. Lower the learning rate, turn on loss scaling "
              "(trainer_options::scaling = loss_scaling::dynamic), or resume from the last checkpoint") {}
};

// One line naming a plan: "micro 4 x 2, none, chunk 256".
inline std::string plan_summary(const training_plan& p) {
  return "micro-batch " + std::to_string(p.micro.batch) + " x " + std::to_string(p.accumulation) + ", " +
         p.schedule.name() + ", logit chunk " + std::to_string(p.head_chunk);
}

// What a monitor must offer the trainer (null_monitor and pressure_monitor<...> do).
template <typename M, typename Allocator>
concept step_monitor = requires(M& m, Allocator& a) {
  { m.template check<check_point::before_forward>(a) } -> std::same_as<pressure_level>;
  { m.stricter_plan_requested() } -> std::convertible_to<bool>;
  m.clear_stricter_plan_request();
};

namespace detail {
// Thrown through forward_backward by the check-point observer: the step is abandoned.
struct abandon_step {
  std::string reason;
  std::size_t usage = 0, limit = 0;
};
}  // namespace detail

template <typename Model, typename Allocator, typename Monitor = null_monitor>
class trainer {
  static_assert(step_monitor<Monitor, Allocator>,
                "membound: trainer's Monitor must offer check<check_point>(allocator), "
                "stricter_plan_requested() and clear_stricter_plan_request(): use null_monitor or "
                "pressure_monitor<check_points<...>>.");

 public:
  using S = typename Model::storage_type;

  // effective: sequences per optimizer step and their length; plan: a plan for it (make_plan or
  // fit) made for pool.size() threads. Allocates weights, gradients and optimizer state from
  // alloc and initializes them from options.seed.
  trainer(const Model& m, batch_shape effective, training_plan plan, Allocator& alloc, thread_pool& pool,
          trainer_options o = {}, Monitor monitor = {})
      : m_(m), eff_(effective), plan_(std::move(plan)), alloc_(alloc), pool_(pool), o_(std::move(o)),
        monitor_(std::move(monitor)), n_(m.parameter_elements()),
        scaling_(o_.scaling == loss_scaling::dynamic ||
                 (o_.scaling == loss_scaling::automatic && std::is_same_v<S, fp16>)),
        scaler_(o_.scaler) {
    m_.check(eff_);
    check_options(o_);
    check_plan(plan_, "plan");
    w_ = static_cast<S*>(alloc_.allocate(m_.weight_bytes(), default_alignment, memory_tag::weights));
    try {
      g_ = static_cast<S*>(alloc_.allocate(m_.weight_bytes(), default_alignment, memory_tag::gradients));
      try {
        opt_ = alloc_.allocate(opt_bytes(), default_alignment, memory_tag::optimizer);
      } catch (...) {
        alloc_.deallocate(g_, m_.weight_bytes(), default_alignment, memory_tag::gradients);
        throw;
      }
    } catch (...) {
      alloc_.deallocate(w_, m_.weight_bytes(), default_alignment, memory_tag::weights);
      throw;
    }
    // What the planner counts as the persistent base (requested bytes, as the budget's system
    // upstream charges them).
    own_bytes_ = 2 * m_.weight_bytes() + opt_bytes();
    try {
      m_.init_weights(w_, o_.seed);
      std::memset(static_cast<void*>(g_), 0, m_.weight_bytes());
      adamw<S>::init(w_, n_, opt_, opt_bytes());
    } catch (...) {
      release();
      throw;
    }
    rng_.state = o_.seed ^ 0x6a09e667f3bcc909ULL;
    largest_peak_ = plan_.peak_bytes;
  }

  trainer(const trainer&) = delete;
  trainer& operator=(const trainer&) = delete;
  ~trainer() { release(); }

  // ---- One optimizer step ---------------------------------------------------------------------
  template <sequence_source Source>
  step_result step(Source& source) {
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
        break;
      } catch (const detail::abandon_step& a) {
        rewind(rng0, position0);
        if (replan(r, a.reason, a.usage, a.limit, true) != replan_outcome::below_emergency) {
          tolerate();  // run it through: emergencies are all that is left
          may_abandon = false;
        }
      } catch (const out_of_memory& e) {
        rewind(rng0, position0);
        if (!o_.replan_under_pressure) throw;
        const oom_report& rep = e.report();
        const std::size_t lim = rep.budget != 0 ? rep.budget : limit_now();
        const std::size_t use = rep.budget != 0 ? rep.budget - rep.free_under_budget : usage_now();
        const replan_outcome got =
            replan(r, "out of memory (a request of " + format_bytes(rep.requested, false) + ")", use, lim, true);
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

    const double scaled_norm = global_norm(g_, n_, pool_);
    r.grad_norm = scaled_norm / scale;
    r.lr = o_.lr(steps_);
    if (scaling_) {
      r.applied = scaler_.update(scaled_norm);
    } else if (!std::isfinite(scaled_norm)) {
      rewind(rng0, position0);
      throw non_finite_gradient(r.step, r.loss, scaled_norm);
    }
    if (r.applied) {
      const double gs = clip_factor(r.grad_norm, o_.clip) / scale;
      for (const param_entry& e : m_.parameters()) {
        adamw<S>::update(w_, g_, opt_, n_, e.offset, e.count, updates_ + 1, r.lr, o_.adam, e.decay, gs, pool_);
      }
      ++updates_;
    }
    ++steps_;
    r.loss_scale = scaling_ ? scaler_.scale : 1.0;
    observe<check_point::after_optimizer_step>(r.pressure);
    if (monitor_.stricter_plan_requested()) {
      monitor_.clear_stricter_plan_request();
      if (o_.replan_under_pressure && !tolerating()) {
        if (replan(r, "pressure emergency at after_optimizer_step", usage_now(), limit_now(), false) !=
            replan_outcome::below_emergency) {
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
  // plan's, and nothing of the training state is touched.
  template <sequence_source Source>
  double evaluate(Source& source, std::size_t sequences, std::uint64_t seed = 0) {
    if (sequences == 0) throw invalid_argument("sequences", "at least 1", "0", "Ask for one or more sequences");
    const std::size_t T = eff_.seq;
    double sum = 0;
    for (std::size_t k = 0; k < sequences; k += plan_.micro.batch) {
      const std::size_t b = std::min(plan_.micro.batch, sequences - k);
      fill(source, b, [&](std::size_t j) {
        random_state h{seed ^ (0xd1b54a32d192ed03ULL * (k + j + 1))};
        return sequence_request{k + j, h.next()};
      });
      sum += static_cast<double>(b) *
             m_.loss(w_, x_.data(), y_.data(), batch_shape{b, T}, plan_.head_chunk, alloc_, pool_);
    }
    return sum / static_cast<double>(sequences);
  }

  // ---- Checkpoints ------------------------------------------------------------------------------
  // Everything a step depends on, written atomically (see checkpoint_file.hpp).
  void save(const std::string& path) const {
    checkpoint_writer cw;
    cw.add_value<std::uint64_t>("format", format_version);
    const std::vector<std::uint64_t> fp = fingerprint();
    cw.add("model", fp.data(), fp.size() * sizeof(std::uint64_t));
    cw.add("weights", w_, m_.weight_bytes());
    cw.add("optimizer", opt_, opt_bytes());
    cw.add_value<std::uint64_t>("step", steps_);
    cw.add_value<std::uint64_t>("updates", updates_);
    cw.add_value<std::uint64_t>("rng", rng_.state);
    cw.add_value<std::uint64_t>("data_position", position_);
    cw.add_value<double>("loss_scale", scaler_.scale);
    cw.add_value<std::uint64_t>("loss_scale_clean_steps", scaler_.clean_steps);
    const std::uint64_t pl[5] = {plan_.micro.batch, plan_.accumulation, plan_.head_chunk,
                                 static_cast<std::uint64_t>(plan_.schedule.k), plan_.schedule.param};
    cw.add("plan", pl, sizeof pl);
    cw.commit(path);
  }

  // Reads and checks the whole file first; on any error this trainer is unchanged. The saved plan
  // is restored when it fits the allocator's budget (the run then continues bit for bit);
  // otherwise the current plan stays. Returns whether the saved plan was restored. The monitor's
  // level is not saved: a resumed run starts at the level its first check point sees.
  bool load(const std::string& path) {
    const checkpoint_reader r(path);
    if (r.value<std::uint64_t>("format") != format_version) {
      throw corrupt_checkpoint(path, "it has format " + std::to_string(r.value<std::uint64_t>("format")) +
                                         ", this build reads " + std::to_string(format_version));
    }
    const std::vector<std::uint64_t> fp = fingerprint();
    std::vector<std::uint64_t> saved(r.size("model") / sizeof(std::uint64_t));
    r.copy("model", saved.data(), saved.size() * sizeof(std::uint64_t));
    if (saved != fp) {
      throw corrupt_checkpoint(path, "it was written for another model (configuration, layer pattern, "
                                     "precision, batch or sequence length differ)");
    }
    if (r.size("weights") != m_.weight_bytes() || r.size("optimizer") != opt_bytes()) {
      throw corrupt_checkpoint(path, "its weight or optimizer section has the wrong size");
    }
    std::uint64_t pl[5];
    r.copy("plan", pl, sizeof pl);
    const auto steps = r.value<std::uint64_t>("step"), updates = r.value<std::uint64_t>("updates");
    const random_state rng{r.value<std::uint64_t>("rng")};
    const auto position = r.value<std::uint64_t>("data_position");
    loss_scaler sc = scaler_;
    sc.scale = r.value<double>("loss_scale");
    sc.clean_steps = r.value<std::uint64_t>("loss_scale_clean_steps");
    if (!(sc.scale > 0) || !std::isfinite(sc.scale) || updates > steps) {
      throw corrupt_checkpoint(path, "its loss scale or step counters are out of range");
    }
    std::optional<training_plan> restored;
    if (pl[0] != 0 && eff_.batch % pl[0] == 0 && pl[1] == eff_.batch / pl[0] && pl[2] != 0 &&
        pl[3] <= static_cast<std::uint64_t>(schedule_choice::kind::budget)) {
      plan_options po{pool_.size(), static_cast<std::size_t>(pl[2]), static_cast<std::size_t>(pl[1]), true};
      try {
        training_plan p = make_plan(m_, batch_shape{static_cast<std::size_t>(pl[0]), eff_.seq},
                                    schedule_choice{static_cast<schedule_choice::kind>(pl[3]), static_cast<std::size_t>(pl[4])},
                                    po, plan_.budget);
        if (p.fits() && (limit_now() == 0 || p.peak_bytes + foreign_now() <= limit_now())) restored = std::move(p);
      } catch (const error&) {
        // A plan this build cannot make: keep the current one.
      }
    }
    // Everything checked: commit.
    r.copy("weights", w_, m_.weight_bytes());
    r.copy("optimizer", opt_, opt_bytes());
    std::memset(static_cast<void*>(g_), 0, m_.weight_bytes());
    steps_ = steps;
    updates_ = updates;
    rng_ = rng;
    position_ = position;
    scaler_ = sc;
    if (restored) adopt(std::move(*restored));
    return restored.has_value();
  }

  // ---- Plans --------------------------------------------------------------------------------------
  // Switch plans between steps (same effective batch; a plan made for pool.size() threads).
  void set_plan(training_plan p) {
    check_plan(p, "plan");
    adopt(std::move(p));
  }
  const training_plan& plan() const noexcept { return plan_; }
  // The largest predicted peak of any plan this trainer ran under: what the measured peak of its
  // own bytes stays within.
  std::size_t largest_predicted_peak() const noexcept { return largest_peak_; }

  // ---- State --------------------------------------------------------------------------------------
  const Model& model() const noexcept { return m_; }
  batch_shape effective_batch() const noexcept { return eff_; }
  std::uint64_t steps_done() const noexcept { return steps_; }
  std::uint64_t updates_applied() const noexcept { return updates_; }
  std::uint64_t data_position() const noexcept { return position_; }
  const random_state& rng() const noexcept { return rng_; }
  const loss_scaler& scaler() const noexcept { return scaler_; }
  bool loss_scaling_on() const noexcept { return scaling_; }
  const S* weights() const noexcept { return w_; }
  S* weights() noexcept { return w_; }
  std::size_t parameter_elements() const noexcept { return n_; }
  const void* optimizer_state() const noexcept { return opt_; }
  std::size_t optimizer_bytes() const noexcept { return opt_bytes(); }
  Monitor& monitor() noexcept { return monitor_; }
  // Bytes held by the trainer itself between steps (weights, gradients, optimizer) as the
  // allocator counts them, and by others (usage minus those), when the allocator has a budget.
  std::size_t own_bytes() const noexcept { return own_bytes_; }
  std::size_t foreign_bytes() const { return foreign_now(); }

 private:
  static constexpr std::uint64_t format_version = 1;

  std::size_t opt_bytes() const noexcept { return adamw<S>::state_bytes(n_); }

  void release() noexcept {
    alloc_.deallocate(opt_, opt_bytes(), default_alignment, memory_tag::optimizer);
    alloc_.deallocate(g_, m_.weight_bytes(), default_alignment, memory_tag::gradients);
    alloc_.deallocate(w_, m_.weight_bytes(), default_alignment, memory_tag::weights);
  }

  std::size_t usage_now() const {
    if constexpr (budgeted<Allocator>) return alloc_.usage();
    else return 0;
  }
  std::size_t limit_now() const {
    if constexpr (budgeted<Allocator>) return alloc_.limit();
    else return 0;
  }
  // Between attempts nothing of the step is live, so all but the trainer's own bytes are others'.
  std::size_t foreign_now() const {
    const std::size_t u = usage_now();
    return u > own_bytes_ ? u - own_bytes_ : 0;
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
    need(o.scaler.scale > 0 && std::isfinite(o.scaler.scale), "options.scaler.scale", "a positive finite scale",
         o.scaler.scale, "e.g. 65536");
    need(o.scaler.growth_interval >= 1, "options.scaler.growth_interval", "1 or more",
         static_cast<double>(o.scaler.growth_interval), "The usual value is 2000");
    if (o.head_chunks.empty() || std::find(o.head_chunks.begin(), o.head_chunks.end(), 0u) != o.head_chunks.end()) {
      throw invalid_argument("options.head_chunks", "one or more positive logit chunk sizes",
                             std::to_string(o.head_chunks.size()) + " sizes, or a 0", "e.g. {256, 64}");
    }
  }

  void check_plan(const training_plan& p, const char* name) const {
    if (p.micro.seq != eff_.seq || p.micro.batch * p.accumulation != eff_.batch) {
      throw invalid_argument(name, "micro-batches of the effective batch " + std::to_string(eff_.batch) + " x " +
                                       std::to_string(eff_.seq),
                             std::to_string(p.accumulation) + " x " + std::to_string(p.micro.batch) + " x " +
                                 std::to_string(p.micro.seq),
                             "Make the plan with fit(model, effective, budget) or make_plan for the same batch");
    }
    if (p.threads != pool_.size()) {
      throw invalid_argument(name, "a plan for " + std::to_string(pool_.size()) + " threads (the pool's)",
                             std::to_string(p.threads) + " threads",
                             "Pass the pool's thread count in plan_options/fit_options");
    }
    if (p.ops.empty()) throw invalid_argument(name, "a plan with a schedule", "no ops", "Use make_plan or fit");
  }

  void adopt(training_plan p) {
    largest_peak_ = std::max(largest_peak_, p.peak_bytes);
    plan_ = std::move(p);
  }

  void rewind(const random_state& rng0, std::uint64_t position0) noexcept {
    rng_ = rng0;
    position_ = position0;
    std::memset(static_cast<void*>(g_), 0, m_.weight_bytes());
  }

  template <sequence_source Source, typename Request>
  void fill(Source& source, std::size_t b, Request&& request) {
    const std::size_t T = eff_.seq;
    x_.resize(b * T);
    y_.resize(b * T);
    for (std::size_t j = 0; j < b; ++j) source(request(j), x_.data() + j * T, y_.data() + j * T);
  }

  template <check_point P>
  void observe(pressure_level& highest) {
    const pressure_level l = monitor_.template check<P>(alloc_);
    highest = std::max(highest, l);
  }

  // Checks P and abandons the step when the monitor asks for a stricter plan.
  template <check_point P>
  void watch(pressure_level& highest, bool may_abandon) {
    observe<P>(highest);
    if (may_abandon && monitor_.stricter_plan_requested()) {
      monitor_.clear_stricter_plan_request();
      throw detail::abandon_step{"pressure emergency at " + std::string(to_string(P)), usage_now(), limit_now()};
    }
  }

  template <sequence_source Source>
  double accumulate(Source& source, double scale, bool may_abandon, pressure_level& highest) {
    std::memset(static_cast<void*>(g_), 0, m_.weight_bytes());
    double loss = 0;
    const double accum = static_cast<double>(plan_.accumulation);
    for (std::size_t micro = 0; micro < plan_.accumulation; ++micro) {
      watch<check_point::before_forward>(highest, may_abandon);
      fill(source, plan_.micro.batch, [&](std::size_t) { return sequence_request{position_++, rng_.next()}; });
      auto observer = [&](check_point p) {
        switch (p) {
          case check_point::after_forward: watch<check_point::after_forward>(highest, may_abandon); break;
          case check_point::before_backward: watch<check_point::before_backward>(highest, may_abandon); break;
          case check_point::after_backward: watch<check_point::after_backward>(highest, may_abandon); break;
          default: break;
        }
      };
      loss += m_.forward_backward(w_, g_, x_.data(), y_.data(), plan_.micro, plan_.ops, plan_.head_chunk,
                                  scale / accum, alloc_, pool_, observer) /
              accum;
    }
    return loss;
  }

  enum class replan_outcome { none, below_budget, below_emergency };

  // The least-recompute plan below the current peak whose peak plus the others' bytes stays
  // under the emergency threshold (second: true), else under the budget (second: false).
  std::optional<std::pair<training_plan, bool>> stricter_plan() const {
    if (plan_.peak_bytes <= 1) return std::nullopt;
    const std::size_t cap = plan_.peak_bytes - 1;
    std::vector<std::pair<std::size_t, bool>> targets;
    if (const std::size_t limit = limit_now(); limit != 0) {
      const std::size_t foreign = foreign_now();
      double emergency = 1.0;
      if constexpr (requires { monitor_.thresholds().emergency; }) emergency = monitor_.thresholds().emergency;
      const auto soft = static_cast<std::size_t>(emergency * static_cast<double>(limit));
      if (soft > foreign + 1) targets.push_back({std::min(cap, soft - foreign - 1), true});
      if (limit > foreign) targets.push_back({std::min(cap, limit - foreign), false});
    } else {
      targets.push_back({cap, true});
    }
    fit_options fo;
    fo.threads = pool_.size();
    fo.head_chunks = o_.head_chunks;
    for (const auto& [t, below_emergency] : targets) {
      try {
        training_plan p = fit(m_, eff_, t, fo);
        p.budget = plan_.budget;
        return std::pair{std::move(p), below_emergency};
      } catch (const budget_too_small&) {
      }
    }
    return std::nullopt;
  }

  std::size_t smallest_peak() const {
    fit_options fo;
    fo.threads = pool_.size();
    fo.head_chunks = o_.head_chunks;
    try {
      (void)fit(m_, eff_, 0, fo);
    } catch (const budget_too_small& e) {
      return e.minimum();
    }
    return 0;
  }

  // Records the event in r; returns which kind of stricter plan was adopted, if any.
  replan_outcome replan(step_result& r, std::string reason, std::size_t usage, std::size_t limit, bool retry) {
    // A cache below the budget counts as usage but is nobody's: give it back before measuring.
    if constexpr (requires { alloc_.release_cached(); }) alloc_.release_cached();
    replan_event e;
    e.step = r.step;
    e.reason = std::move(reason);
    e.usage = usage;
    e.limit = limit;
    e.foreign = foreign_now();
    e.from = plan_summary(plan_);
    e.from_peak = plan_.peak_bytes;
    auto next = stricter_plan();
    e.stricter_found = next.has_value();
    replan_outcome out = replan_outcome::none;
    if (next) {
      e.to = plan_summary(next->first);
      e.to_peak = next->first.peak_bytes;
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

  std::vector<std::uint64_t> fingerprint() const {
    const model_config& c = m_.config();
    std::vector<std::uint64_t> f{c.vocab, c.width, c.heads, c.kv(), c.hidden(), c.tie_embeddings ? 1u : 0u,
                                 sizeof(S), n_, eff_.batch, eff_.seq, m_.depth()};
    for (std::size_t k : m_.pattern()) f.push_back(k);
    return f;
  }

  const Model& m_;
  batch_shape eff_;
  training_plan plan_;
  Allocator& alloc_;
  thread_pool& pool_;
  trainer_options o_;
  Monitor monitor_;
  std::size_t n_;
  bool scaling_;
  loss_scaler scaler_;
  S* w_ = nullptr;
  S* g_ = nullptr;
  void* opt_ = nullptr;
  std::size_t own_bytes_ = 0;
  std::size_t tolerated_peak_ = 0, tolerated_foreign_ = 0;  // see tolerating()
  std::size_t largest_peak_ = 0;
  std::uint64_t steps_ = 0, updates_ = 0, position_ = 0;
  random_state rng_{};
  std::vector<std::int32_t> x_, y_;
};

MEMBOUND_NAMESPACE_END
