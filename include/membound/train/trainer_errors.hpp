// The trainer's typed errors (one part of the trainer, train/trainer.hpp): a diverged gradient,
// a checkpoint this run cannot resume (by field, world size or run settings), and a rank of a
// data-parallel run that cannot start, has no plan left, or failed at a collective step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "membound/core/config.hpp"
#include "membound/core/error.hpp"
#include "membound/core/format.hpp"
#include "membound/model/planner.hpp"
#include "membound/train/checkpoint_file.hpp"
#include "membound/train/fingerprint.hpp"

MEMBOUND_NAMESPACE_BEGIN

// The gradient of an unscaled run is inf or NaN: training has diverged. Nothing was updated.
class non_finite_gradient : public error {
 public:
  non_finite_gradient(std::uint64_t step, double loss, double norm)
      : error("membound: step " + std::to_string(step) + ": the gradient norm is " + std::to_string(norm) +
              " (loss " + std::to_string(loss) +
              "); the weights were not updated. Lower the learning rate, turn on loss scaling "
              "(trainer_options::scaling = loss_scaling::dynamic), or resume from the last checkpoint") {}
};


// A checkpoint this run cannot resume because it was written for something else: another model,
// precision, batch, block type or checkpoint format. field() is the first that differs (what()
// names every one), saved() its value in the file, current() in this run.
class checkpoint_mismatch : public corrupt_checkpoint {
 public:
  checkpoint_mismatch(const std::string& path, std::string field, std::string saved, std::string current,
                      const std::string& why)
      : corrupt_checkpoint(path, why), field_(std::move(field)), saved_(std::move(saved)), current_(std::move(current)) {}
  checkpoint_mismatch(const std::string& path, std::string field, std::string saved, std::string current,
                      const std::string& why, const std::string& what_to_do)
      : corrupt_checkpoint(path, why, what_to_do),
        field_(std::move(field)),
        saved_(std::move(saved)),
        current_(std::move(current)) {}
  const std::string& field() const noexcept { return field_; }
  const std::string& saved() const noexcept { return saved_; }
  const std::string& current() const noexcept { return current_; }

 private:
  std::string field_, saved_, current_;
};

// A rank of a data-parallel run could not start: every rank throws it before step 1 (from the
// trainer's constructor, a collective), naming the rank. Over budget: that rank's plan peak and
// budget; otherwise that rank threw its own error (see its stderr).
class rank_cannot_start : public invalid_argument {
 public:
  rank_cannot_start(std::size_t rank, std::size_t ranks, std::size_t peak, std::size_t limit)
      : invalid_argument("plan",
                         "a plan that fits every rank's budget",
                         "rank " + std::to_string(rank) + " of " + std::to_string(ranks) +
                             ": a reserved peak of " + format_bytes(peak) + " over its budget of " + format_bytes(limit) +
                             " (less what it held outside the stack)",
                         "Give rank " + std::to_string(rank) +
                             " a larger budget, or plan every rank with fit(model, effective, budget) for the "
                             "smallest budget of any rank; no rank started step 1"),
        rank_(rank), peak_(peak), limit_(limit) {}
  rank_cannot_start(std::size_t rank, std::size_t ranks)
      : invalid_argument("plan", "every rank ready to start",
                         "rank " + std::to_string(rank) + " of " + std::to_string(ranks) + " failed (its own error says why)",
                         "Read rank " + std::to_string(rank) + "'s error; no rank started step 1"),
        rank_(rank) {}
  std::size_t rank() const noexcept { return rank_; }
  std::size_t peak() const noexcept { return peak_; }    // 0 when the rank failed otherwise
  std::size_t limit() const noexcept { return limit_; }

 private:
  std::size_t rank_ = 0, peak_ = 0, limit_ = 0;
};

// A checkpoint of another world size that cannot be re-sharded to this one (an optimizer whose
// state is block-wise, adamw8bit): only the same ranks can resume it. field() is "ranks", saved()
// the world that wrote it. (Elementwise states, adamw's, are re-sharded: see trainer::load.)
class checkpoint_world_mismatch : public checkpoint_mismatch {
 public:
  checkpoint_world_mismatch(const std::string& path, const std::string& saved_ranks, std::size_t ranks,
                            std::size_t zero, const std::string& why)
      : checkpoint_mismatch(path, "ranks", saved_ranks, std::to_string(ranks),
                            "it was written by " + saved_ranks + " rank(s) and cannot be re-sharded to this run's " +
                                std::to_string(ranks) + " rank(s) under ZeRO-" + std::to_string(zero) + ": " + why +
                                ". Resume it with " + saved_ranks + " ranks and the same optimizer (mpirun -np " +
                                saved_ranks + " ...)") {}
};

// A checkpoint of this model written under other run settings (see load_options): field(),
// saved() and current() are the first that differs, changes() every one. Nothing was loaded.
class checkpoint_run_changed : public checkpoint_mismatch {
 public:
  checkpoint_run_changed(const std::string& path, std::vector<run_field_change> changes)
      : checkpoint_mismatch(path, changes.at(0).field, changes.at(0).saved, changes.at(0).current, describe(changes),
                            "Build the trainer with the settings it was written with to continue that run bit for "
                            "bit, or load it with load_options{.changes = run_changes::accept} to go on under "
                            "this trainer's"),
        changes_(std::move(changes)) {}
  const std::vector<run_field_change>& changes() const noexcept { return changes_; }

 private:
  static std::string describe(const std::vector<run_field_change>& d) {
    constexpr std::size_t shown = 4;
    std::string why = "it was written by a run with other settings (";
    for (std::size_t k = 0; k < d.size() && k < shown; ++k) {
      why += (k == 0 ? "" : "; ") + d[k].field + " " + d[k].saved + " there, " + d[k].current + " here";
    }
    if (d.size() > shown) why += "; and " + std::to_string(d.size() - shown) + " more";
    return why + ")";
  }
  std::vector<run_field_change> changes_;
};

// No plan fits what one rank of a data-parallel run has left under pressure: every rank throws
// it, with that rank's numbers (its budget less the bytes others hold there, and the least peak).
class rank_budget_too_small : public budget_too_small {
 public:
  rank_budget_too_small(std::size_t rank, std::size_t ranks, std::size_t available, std::size_t minimum,
                        const std::string& context)
      : budget_too_small(available, minimum, "rank " + std::to_string(rank) + " of " + std::to_string(ranks) + ": " + context),
        rank_(rank) {}
  std::size_t rank() const noexcept { return rank_; }

 private:
  std::size_t rank_;
};

// Another rank failed at a collective step (saving, loading); this one throws this, that rank
// its own error.
class rank_failed : public error {
 public:
  rank_failed(std::size_t rank, std::size_t ranks, const std::string& what)
      : error("membound: rank " + std::to_string(rank) + " of " + std::to_string(ranks) + " could not " + what +
              " (its own error says why); every rank stops here"),
        rank_(rank) {}
  std::size_t rank() const noexcept { return rank_; }

 private:
  std::size_t rank_;
};

MEMBOUND_NAMESPACE_END
