// What the ranks of a data-parallel run agree on, the trainer's part for replanning over ranks.
// One rank cannot change its plan alone (the ranks' collectives must match), nor start while
// another cannot, so at each such point every rank gathers every rank's word and all read the
// same answer from it:
//   - agree_to_start: each rank's status before step 1; the first that cannot start is named.
//   - agree_on_retry: each rank's vote at an agreement point of the step (pressure, no room for
//     the plan beside others' bytes, an out-of-memory); the first rank that asks for a retry.
//   - agree_on_plan: each rank's targets; the least of each is the world's, rank 0's plan for it
//     is broadcast and adopted once every rank finds it within its own target. With none, the
//     rank that forces the error is named (rank_budget_too_small) on every rank.
// It knows no model, allocator or monitor: the trainer hands in its numbers and the ways to find
// and check a plan, and the host-value communicator (detail::control_of). Its buffers are sized
// at construction, so an agreement allocates nothing.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "membound/core/check_point.hpp"
#include "membound/core/config.hpp"
#include "membound/core/format.hpp"
#include "membound/model/planner.hpp"
#include "membound/train/trainer_errors.hpp"

MEMBOUND_NAMESPACE_BEGIN

namespace detail {
// Thrown through forward_backward by the check-point observer: the step is abandoned.
struct abandon_step {
  std::string reason;
  std::size_t usage = 0, limit = 0;
  bool out_of_memory = false;  // over ranks: some rank ran out (no plan then is an error)
};
}  // namespace detail

// A rank's vote at an agreement point. none keeps going.
enum class retry_vote : std::uint64_t { none = 0, pressure = 1, out_of_memory = 2, no_room = 3 };

// Why a step is abandoned, in the words of the trainer's report and errors: `detail` is the
// request's bytes (out_of_memory) or the check point (pressure, no_room). One process and a
// retry over ranks say it alike.
inline std::string retry_reason(retry_vote why, std::uint64_t detail) {
  switch (why) {
    case retry_vote::out_of_memory:
      return "out of memory (a request of " + format_bytes(static_cast<std::size_t>(detail), false) + ")";
    case retry_vote::no_room:
      return "no room for the plan's peak beside others' bytes at " +
             std::string(to_string(static_cast<check_point>(detail)));
    default:
      return "pressure emergency at " + std::string(to_string(static_cast<check_point>(detail)));
  }
}

// A rank's status before step 1.
enum class start_status : std::uint64_t { ok = 0, over_budget = 1, failed = 2 };

// What one rank knows of its memory when the ranks look for a stricter plan: its targets (the
// emergency threshold and the budget, each less the bytes others hold there and below the current
// plan's peak; 0: no such target), the others' bytes, its limit (0: none) and whether its current
// plan still fits the budget beside them.
struct rank_targets {
  std::size_t emergency = 0, budget = 0;
  std::size_t foreign = 0, limit = 0;
  bool current_fits = true;
};

// The choices that make a plan, as rank 0 broadcasts them.
struct plan_choices {
  std::size_t micro = 0, accumulation = 0;
  schedule_choice schedule{};
  std::size_t head_chunk = 0;
};

class rank_agreement {
 public:
  rank_agreement(std::size_t rank, std::size_t world)
      : rank_(rank), world_(world), status_(start_fields * world), votes_(vote_fields * world),
        targets_(target_fields * world), fits_(world) {}

  std::size_t rank() const noexcept { return rank_; }
  std::size_t world() const noexcept { return world_; }

  // A rank that cannot start, as every rank learns it: its status, and for over_budget its
  // reserved peak and the room it had (the budget less what others held).
  struct start_refusal {
    std::size_t rank = 0;
    start_status status = start_status::ok;
    std::size_t peak = 0, room = 0;
  };
  // Every rank's status, gathered: the first rank that cannot start, or none.
  template <typename Control>
  std::optional<start_refusal> agree_to_start(Control& ctl, start_status status, std::size_t peak, std::size_t room) {
    std::uint64_t* mine = status_.data() + start_fields * rank_;
    mine[0] = static_cast<std::uint64_t>(status);
    mine[1] = peak;
    mine[2] = room;
    ctl.all_gather(static_cast<const std::uint64_t*>(mine), status_.data(), status_.size());
    for (std::size_t r = 0; r < world_; ++r) {
      const std::uint64_t* v = status_.data() + start_fields * r;
      if (v[0] != static_cast<std::uint64_t>(start_status::ok)) {
        return start_refusal{r, static_cast<start_status>(v[0]), static_cast<std::size_t>(v[1]),
                             static_cast<std::size_t>(v[2])};
      }
    }
    return std::nullopt;
  }

  // Every rank's vote, gathered (each rank calls it at the same agreement point, or, after an
  // out-of-memory, at the one the others reach next: no collective lies between). detail: the
  // check point of a pressure or no-room vote, the bytes an out-of-memory asked for. Returns the
  // first rank that asks for a retry, or world() when none does: the same answer on every rank.
  template <typename Control>
  std::size_t agree_on_retry(Control& ctl, retry_vote why, std::uint64_t detail, std::size_t usage,
                             std::size_t limit) {
    std::uint64_t* mine = votes_.data() + vote_fields * rank_;
    mine[0] = static_cast<std::uint64_t>(why);
    mine[1] = detail;
    mine[2] = usage;
    mine[3] = limit;
    ctl.all_gather(static_cast<const std::uint64_t*>(mine), votes_.data(), votes_.size());
    for (std::size_t r = 0; r < world_; ++r) {
      if (votes_[vote_fields * r] != static_cast<std::uint64_t>(retry_vote::none)) return r;
    }
    return world_;
  }

  // What every rank abandons the step for after agree_on_retry named rank r.
  detail::abandon_step retry_of(std::size_t r) const {
    const std::uint64_t* v = votes_.data() + vote_fields * r;
    const auto why = static_cast<retry_vote>(v[0]);
    const bool oom = why == retry_vote::out_of_memory || why == retry_vote::no_room;
    return {retry_reason(why, v[1]) + " on rank " + std::to_string(r) + " of " + std::to_string(world_),
            static_cast<std::size_t>(v[2]), static_cast<std::size_t>(v[3]), oom};
  }

  // A stricter plan agreed by every rank (a collective, after every rank gave the step's bytes
  // back). For the emergency target, then the budget's: the least of the ranks' targets; rank 0
  // finds choices for it (choose(target) -> optional<plan_choices>) and broadcasts them; each rank
  // makes its plan of them under its own target (make(choices, target) -> optional<Plan>), and all
  // adopt it when every rank could. Returns the plan and whether it is below the emergency
  // threshold. With none: nothing when every rank's current plan still fits and no rank ran out
  // of memory; else every rank throws the same rank_budget_too_small naming the first rank whose
  // plan no longer fits (after an out-of-memory, the one with the least budget left), with the
  // least peak that rank could run (least_peak(), asked of that rank only).
  template <typename Control, typename Choose, typename Make, typename LeastPeak,
            typename Plan = typename std::invoke_result_t<Make&, const plan_choices&, std::size_t>::value_type>
  std::optional<std::pair<Plan, bool>> agree_on_plan(Control& ctl, const rank_targets& own, bool out_of_memory,
                                                     Choose&& choose, Make&& make, LeastPeak&& least_peak) {
    std::uint64_t* mine = targets_.data() + target_fields * rank_;
    mine[0] = own.emergency;
    mine[1] = own.budget;
    mine[2] = own.foreign;
    mine[3] = own.limit;
    mine[4] = own.current_fits ? 1 : 0;
    ctl.all_gather(static_cast<const std::uint64_t*>(mine), targets_.data(), targets_.size());
    for (std::size_t level = 0; level < 2; ++level) {
      std::uint64_t least = ~std::uint64_t{0};
      for (std::size_t r = 0; r < world_; ++r) least = std::min(least, targets_[target_fields * r + level]);
      if (least == 0) continue;  // some rank has no such target: nobody tries it
      std::uint64_t choice[choice_fields] = {};  // found, micro, accumulation, schedule kind, its parameter, logit chunk
      if (rank_ == 0) {
        if (const std::optional<plan_choices> c = choose(static_cast<std::size_t>(least))) {
          choice[0] = 1;
          choice[1] = c->micro;
          choice[2] = c->accumulation;
          choice[3] = static_cast<std::uint64_t>(c->schedule.k);
          choice[4] = c->schedule.param;
          choice[5] = c->head_chunk;
        }
      }
      ctl.broadcast(choice, choice_fields, 0);
      std::optional<Plan> p;
      if (choice[0] != 0) {
        const plan_choices c{static_cast<std::size_t>(choice[1]), static_cast<std::size_t>(choice[2]),
                             schedule_choice{static_cast<schedule_choice::kind>(choice[3]),
                                             static_cast<std::size_t>(choice[4])},
                             static_cast<std::size_t>(choice[5])};
        p = make(c, static_cast<std::size_t>(mine[level]));
      }
      fits_[rank_] = p ? 1 : 0;
      ctl.all_gather(static_cast<const std::uint64_t*>(fits_.data() + rank_), fits_.data(), world_);
      if (std::all_of(fits_.begin(), fits_.end(), [](std::uint64_t f) { return f != 0; })) {
        return std::pair{std::move(*p), level == 0};
      }
    }
    std::size_t by = world_;
    for (std::size_t r = 0; r < world_ && by == world_; ++r) {
      if (targets_[target_fields * r + 4] == 0) by = r;
    }
    if (by == world_ && !out_of_memory) return std::nullopt;  // every rank runs on under its plan
    if (by == world_) {
      by = 0;
      for (std::size_t r = 1; r < world_; ++r) {
        if (targets_[target_fields * r + 1] < targets_[target_fields * by + 1]) by = r;
      }
    }
    const std::uint64_t* t = targets_.data() + target_fields * by;
    std::uint64_t least_peak_there = rank_ == by ? static_cast<std::uint64_t>(least_peak()) : 0;
    ctl.broadcast(&least_peak_there, 1, by);
    const std::size_t others = static_cast<std::size_t>(t[2]), lim = static_cast<std::size_t>(t[3]);
    throw rank_budget_too_small(by, world_, lim > others ? lim - others : 0, static_cast<std::size_t>(least_peak_there),
                                "the budget of " + format_bytes(lim, false) + " less " + format_bytes(others, false) +
                                    " held by others");
  }

 private:
  static constexpr std::size_t start_fields = 3, vote_fields = 4, target_fields = 5, choice_fields = 6;
  std::size_t rank_, world_;
  // Each rank's (status, peak, room), (vote, detail, usage, limit), (emergency, budget, foreign,
  // limit, current fits) and verdict on rank 0's choice.
  std::vector<std::uint64_t> status_, votes_, targets_, fits_;
};

MEMBOUND_NAMESPACE_END
