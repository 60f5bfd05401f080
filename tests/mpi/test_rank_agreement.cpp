// What the ranks agree on (train/rank_agreement.hpp) on its own, over mpi_communicator at 1, 2 and
// 4 ranks, without a trainer or a model: plans are a plain struct here, so every branch of the
// protocol is reached by choosing each rank's numbers.
//   - agree_to_start: nothing when every rank is ready; else the first rank that is not, with its
//     status, peak and room, the same on every rank.
//   - agree_on_retry: world() when nobody votes; else the first rank that votes, and retry_of
//     says why (pressure at a check point, out of memory with the bytes asked, no room), with
//     that rank's usage and limit.
//   - agree_on_plan: rank 0 fits the least of the ranks' targets and every rank adopts that plan
//     when all find it within their own; the emergency target first, the budget's when some rank
//     has no emergency target or refuses; nothing when no plan fits and every current plan still
//     does; rank_budget_too_small naming the first rank whose plan no longer fits (after an
//     out-of-memory, the one with the least budget left), with its least peak, asked of it alone.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>

#include "membound/mpi.hpp"
#include "membound/train/rank_agreement.hpp"
#include "../support/rank_checks.hpp"

namespace mb = membound;

namespace {

std::size_t& me = membound_test::rank_checks::me;
std::size_t N = 1;
int& failures = membound_test::rank_checks::failures;

using membound_test::rank_checks::check;

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

void start(mb::mpi_communicator& comm) {
  mb::rank_agreement a(me, N);
  check(!a.agree_to_start(comm, mb::start_status::ok, 100 + me, 1000).has_value(), "start: every rank ready");
  const std::size_t last = N - 1;
  const auto r = a.agree_to_start(comm, me == last ? mb::start_status::over_budget : mb::start_status::ok, 100 + me,
                                  1000 + me);
  check(r && r->rank == last && r->status == mb::start_status::over_budget && r->peak == 100 + last &&
            r->room == 1000 + last,
        "start: the rank over budget named with its peak and room, on every rank");
  // Every rank but 0 failed: the first of them is named (rank 0 alone at one rank).
  const auto f = a.agree_to_start(comm, me == 0 && N > 1 ? mb::start_status::ok : mb::start_status::failed, 1, 1);
  check(f && f->rank == (N > 1 ? 1u : 0u) && f->status == mb::start_status::failed, "start: the first failed rank named");
}

void retry(mb::mpi_communicator& comm) {
  mb::rank_agreement a(me, N);
  check(a.agree_on_retry(comm, mb::retry_vote::none, 0, me, 10) == N, "retry: no vote, no retry");
  const std::size_t last = N - 1;
  const std::size_t who =
      a.agree_on_retry(comm, me == last ? mb::retry_vote::pressure : mb::retry_vote::none,
                       static_cast<std::uint64_t>(mb::check_point::after_forward), 700 + me, 900 + me);
  const mb::detail::abandon_step p = a.retry_of(who);
  check(who == last && !p.out_of_memory && p.usage == 700 + last && p.limit == 900 + last &&
            has(p.reason, "pressure emergency at " + std::string(mb::to_string(mb::check_point::after_forward))) &&
            has(p.reason, "on rank " + std::to_string(last) + " of " + std::to_string(N)),
        "retry: a pressure vote names its check point, rank, usage and limit: " + p.reason);
  // Every rank votes: the first rank's vote is every rank's answer.
  const std::size_t first = a.agree_on_retry(comm, me == 0 ? mb::retry_vote::out_of_memory : mb::retry_vote::no_room,
                                             me == 0 ? 3u << 20 : static_cast<std::uint64_t>(mb::check_point::before_backward),
                                             5, 6);
  const mb::detail::abandon_step o = a.retry_of(first);
  check(first == 0 && o.out_of_memory && has(o.reason, "out of memory (a request of 3.00 MiB)"),
        "retry: the first rank's out-of-memory vote wins, with the bytes it asked for: " + o.reason);
  if (N > 1) {
    const mb::detail::abandon_step n = a.retry_of(1);
    check(n.out_of_memory && has(n.reason, "no room for the plan's peak beside others' bytes at " +
                                               std::string(mb::to_string(mb::check_point::before_backward))),
          "retry: a no-room vote is an out-of-memory kind, at its check point: " + n.reason);
  }
}

// A plan of the test's: its choices and the target it was made under.
struct fake_plan {
  mb::plan_choices c;
  std::size_t target = 0;
};

void plans(mb::mpi_communicator& comm) {
  mb::rank_agreement a(me, N);
  int least_peak_calls = 0;
  const auto least_peak = [&] {
    ++least_peak_calls;
    return std::size_t{5000} + me;
  };
  // choose: rank 0 makes micro = its target, so every rank sees which target rank 0 was given.
  const auto choose = [](std::size_t target) { return std::optional<mb::plan_choices>(mb::plan_choices{target, 2, {}, 3}); };
  const auto make_within = [](const mb::plan_choices& c, std::size_t target) {
    return c.micro <= target ? std::optional<fake_plan>(fake_plan{c, target}) : std::nullopt;
  };

  // Emergency targets 1000 + 100·rank, budgets 2000 + 100·rank: the least emergency target (1000),
  // below the emergency threshold, on every rank.
  const mb::rank_targets own{1000 + 100 * me, 2000 + 100 * me, 0, 0, true};
  auto p = a.agree_on_plan(comm, own, false, choose, make_within, least_peak);
  check(p && p->second && p->first.c.micro == 1000 && p->first.c.accumulation == 2 && p->first.c.head_chunk == 3 &&
            p->first.target == 1000 + 100 * me,
        "plan: the least emergency target, fitted by rank 0, made by every rank under its own");

  // The last rank has no emergency target: the budgets' (2000) are tried, below the budget only.
  const std::size_t last = N - 1;
  const mb::rank_targets no_emergency{me == last ? 0 : 1000 + 100 * me, 2000 + 100 * me, 0, 0, true};
  p = a.agree_on_plan(comm, no_emergency, false, choose, make_within, least_peak);
  check(p && !p->second && p->first.c.micro == 2000, "plan: a rank without an emergency target: the budget's");

  // The last rank refuses rank 0's choice under the emergency target: the budget's again.
  const auto refuse_small = [&](const mb::plan_choices& c, std::size_t target) {
    return me == last && target < 2000 ? std::nullopt : make_within(c, target);
  };
  p = a.agree_on_plan(comm, own, false, choose, refuse_small, least_peak);
  check(p && !p->second && p->first.c.micro == 2000, "plan: one rank's refusal moves every rank to the budget's target");

  // No plan anywhere, every current plan still fits: nothing, and no least peak asked.
  const auto none = [](std::size_t) { return std::optional<mb::plan_choices>(); };
  p = a.agree_on_plan(comm, own, false, none, make_within, least_peak);
  check(!p && least_peak_calls == 0, "plan: none found and none needed: every rank runs on");

  // No plan, the last rank's current plan no longer fits (limit 4000, others 1500): every rank
  // throws the same error naming it, with its least peak.
  const mb::rank_targets over{1000, 2000, me == last ? 1500u : 0u, me == last ? 4000u : 0u, me != last};
  try {
    (void)a.agree_on_plan(comm, over, false, none, make_within, least_peak);
    check(false, "plan: a rank over its budget with no plan throws");
  } catch (const mb::rank_budget_too_small& e) {
    check(e.rank() == last && e.minimum() == 5000 + last && e.budget() == 2500 &&
              has(e.what(), "rank " + std::to_string(last) + " of " + std::to_string(N)),
          std::string("plan: rank_budget_too_small names the rank over budget, its room and least peak: ") + e.what());
    check(least_peak_calls == (me == last ? 1 : 0), "plan: the least peak asked of that rank alone");
  }

  // After an out-of-memory, with every current plan fitting: the rank with the least budget
  // target is named (budgets 2000 + 100·rank, the last rank's 1900 at more than one rank).
  least_peak_calls = 0;
  const mb::rank_targets oom{1000, N > 1 && me == last ? 1900 : 2000 + 100 * me, 0, 0, true};
  try {
    (void)a.agree_on_plan(comm, oom, true, none, make_within, least_peak);
    check(false, "plan: an out-of-memory with no plan throws");
  } catch (const mb::rank_budget_too_small& e) {
    check(e.rank() == last && e.minimum() == 5000 + last && least_peak_calls == (me == last ? 1 : 0),
          std::string("plan: after an out-of-memory, the rank with the least budget left: ") + e.what());
  }
}

}  // namespace

int main(int argc, char** argv) {
  membound_test::rank_checks::say_passed = true;
  mb::mpi_environment env(argc, argv);
  mb::mpi_communicator comm;
  me = comm.rank();
  N = comm.size();
  start(comm);
  retry(comm);
  plans(comm);
  std::printf("rank %zu: %d failure(s)\n", me, failures);
  return failures == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
