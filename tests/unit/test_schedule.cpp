// Block-level checkpoint schedules:
//   - simulate(): hand-computed peaks and costs, and every precondition refused by name; work in
//     flight (backward_carry) counted from one backward op to the end of the next;
//   - binomial: for every (steps <= 30, slots <= 6) the schedule's advances equal Griewank's closed
//     form and an independent recursion, within its slots;
//   - every<K>, full, none: accepted, costs as stated;
//   - optimal_schedule against an exhaustive search over ALL op sequences simulate() accepts
//     (Dijkstra over its states) on random heterogeneous chains: same least cost at every budget.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <queue>
#include <string>
#include <tuple>
#include <vector>

#include "../support/test_rng.hpp"
#include "membound/model/recompute_schedule.hpp"

namespace mb = membound;
using K = mb::chain_op_kind;

namespace {

// Sizes chosen so that every peak is distinct and checkable by hand.
mb::chain three_blocks() {
  mb::chain c;
  // a = 10 for every x; saved 100, 200, 300; workspaces 1, 2, 3 (forward) and 5 (backward).
  for (std::size_t i = 0; i < 3; ++i) {
    mb::chain_link l;
    l.input_bytes = 10;
    l.saved_bytes = 100 * (i + 1);
    l.advance_peak = 10 + (i + 1);
    l.tape_peak = 10 + l.saved_bytes + (i + 1);
    l.retape_peak = l.saved_bytes + (i + 1);
    l.backward_peak = 10 + 5;
    l.forward_cost = static_cast<double>(i + 1);
    c.links.push_back(l);
  }
  c.output_bytes = 10;
  c.loss_peak = 10 + 7;
  c.base_bytes = 1000;
  return c;
}

// The exact least-cost schedule under a budget, over every valid op sequence.
struct search_state {
  std::uint32_t x = 1, saved = 0, host = 0;  // host: inputs offloaded (chain::offload_inputs)
  std::uint8_t next = 0;  // backward done for blocks >= next (L: none)
  bool loss = false;
  auto key() const { return std::make_tuple(x, saved, host, next, loss); }
  bool operator<(const search_state& o) const { return key() < o.key(); }
};

double exhaustive(const mb::chain& c, std::size_t budget, bool& feasible) {
  const std::size_t L = c.length();
  auto live = [&](const search_state& s) {
    std::size_t b = c.base_bytes;
    for (std::size_t i = 0; i <= L; ++i)
      if (s.x >> i & 1) b += c.a(i);
    for (std::size_t i = 0; i < L; ++i)
      if (s.saved >> i & 1) b += c.links[i].saved_bytes;
    if (s.loss) b += c.a(s.next);  // δ_next
    return b;
  };
  std::map<search_state, double> dist;
  using item = std::pair<double, search_state>;
  auto cmp = [](const item& a, const item& b) { return a.first > b.first; };
  std::priority_queue<item, std::vector<item>, decltype(cmp)> q(cmp);
  search_state start;
  start.next = static_cast<std::uint8_t>(L);
  feasible = false;
  if (live(start) > budget) return -1;
  dist[start] = 0;
  q.push({0, start});
  while (!q.empty()) {
    auto [d, s] = q.top();
    q.pop();
    if (dist[s] < d) continue;
    if (s.next == 0 && s.loss && s.x == 0 && s.saved == 0 && s.host == 0) {
      feasible = true;
      return d;
    }
    const std::size_t lv = live(s);
    auto relax = [&](search_state t, std::size_t peak, double cost) {
      if (peak > budget) return;
      auto it = dist.find(t);
      if (it == dist.end() || d + cost < it->second) {
        dist[t] = d + cost;
        q.push({d + cost, t});
      }
    };
    for (std::size_t i = 0; i < L; ++i) {
      const bool xi = s.x >> i & 1, xn = (s.x | s.host) >> (i + 1) & 1, sv = s.saved >> i & 1;
      const double f = c.links[i].forward_cost;
      if (c.offload_inputs) {
        const double moved = c.offload_cost_per_byte * static_cast<double>(c.a(i));
        if (xi && !sv) {
          search_state t = s;
          t.x &= ~(1u << i);
          t.host |= 1u << i;
          relax(t, lv, moved);
        }
        if (s.host >> i & 1) {
          search_state t = s;
          t.host &= ~(1u << i);
          t.x |= 1u << i;
          relax(t, lv + c.a(i), moved);
        }
      }
      if (xi && !xn) {
        search_state t = s;
        t.x |= 1u << (i + 1);
        relax(t, lv + c.links[i].advance_peak, f);
        if (!sv) {
          t.saved |= 1u << i;
          relax(t, lv + c.links[i].tape_peak, f);
        }
      }
      if (xi && !sv) {
        search_state t = s;
        t.saved |= 1u << i;
        relax(t, lv + c.links[i].retape_peak, f);
      }
      if (s.loss && i + 1 == s.next && xi && sv) {
        search_state t = s;
        t.saved &= ~(1u << i);
        t.next = static_cast<std::uint8_t>(i);
        relax(t, lv + c.links[i].backward_peak, 0);
      }
    }
    if (!s.loss && (s.x >> L & 1)) {
      search_state t = s;
      t.loss = true;
      relax(t, lv + c.loss_peak, 0);
    }
    for (std::size_t i = 0; i <= L; ++i) {
      if ((s.x >> i & 1) && (i == L || !(s.saved >> i & 1))) {
        search_state t = s;
        t.x &= ~(1u << i);
        relax(t, lv, 0);
      }
    }
  }
  return -1;
}

mb::chain random_chain(membound_test::rng& r, std::size_t L) {
  mb::chain c;
  auto n = [&](double lo, double hi) { return static_cast<std::size_t>(r.uniform(lo, hi)); };
  for (std::size_t i = 0; i < L; ++i) {
    mb::chain_link l;
    l.input_bytes = n(1, 4);
    l.saved_bytes = n(0, 8);
    c.links.push_back(l);
  }
  c.output_bytes = n(1, 4);
  for (std::size_t i = 0; i < L; ++i) {
    mb::chain_link& l = c.links[i];
    const std::size_t out = c.a(i + 1);
    l.advance_peak = out + n(0, 4);
    l.tape_peak = out + l.saved_bytes + n(0, 4);
    l.retape_peak = l.saved_bytes + n(0, 5);
    l.backward_peak = l.input_bytes + n(0, 5);
    l.forward_cost = static_cast<double>(n(1, 6));
  }
  c.loss_peak = c.output_bytes + n(0, 6);
  c.base_bytes = n(0, 5);
  return c;
}

std::size_t revolve_recursion(std::size_t l, std::size_t s, std::map<std::pair<std::size_t, std::size_t>, std::size_t>& memo) {
  if (l <= 1) return 0;
  if (s == 1) return l * (l - 1) / 2;
  auto it = memo.find({l, s});
  if (it != memo.end()) return it->second;
  std::size_t best = SIZE_MAX;
  for (std::size_t j = 1; j < l; ++j)
    best = std::min(best, j + revolve_recursion(l - j, s - 1, memo) + revolve_recursion(j, s, memo));
  memo[{l, s}] = best;
  return best;
}

}  // namespace

TEST_CASE("simulate: hand-computed peaks and costs for none and full") {
  const mb::chain c = three_blocks();
  // none: tape 0, 1, 2 keeps x0..x3 (40) and saved 600: live 1640 before the loss, whose peak
  // adds 17 -> 1657; the tapes peak at 1000+10 + (10+100+1) = 1121, ... 1000+30+300 + (10+300+3)
  // = 1643. So the loss is the peak.
  const auto none = mb::simulate(c, mb::schedule_none(3));
  CHECK(none.peak_bytes == 1657);
  CHECK(none.recompute_cost == 0);
  // full: advances keep x0..x2 (x3 dropped after the loss): loss peak 1000 + 40 + 17 = 1057;
  // retape 2 with x0, x1, x2, δ3 live (1040) peaks at 1040 + 303 = 1343; backward 2 at
  // 1040 + 300 + 15 = 1355, the peak. Recompute: every block once more = 1 + 2 + 3.
  const auto full = mb::simulate(c, mb::schedule_full(3));
  CHECK(full.peak_bytes == 1355);
  CHECK(full.recompute_cost == 6);
  std::vector<mb::phase_bytes> tl;
  mb::simulate(c, mb::schedule_full(3), &tl);
  CHECK(tl.size() == mb::schedule_full(3).size());
  CHECK(std::max_element(tl.begin(), tl.end(), [](auto& a, auto& b) { return a.peak < b.peak; })->peak == 1355);
}

TEST_CASE("simulate: work in flight (backward_carry) lives from one backward to the end of the next") {
  const mb::chain plain = three_blocks();
  mb::chain c = plain;
  // Each backward leaves 50 bytes in flight and, once the one before it is released, peaks at 60
  // above the rest (its δ 10 plus the 50 it starts): ZeRO-2's overlapped bucket and workspace.
  for (auto& l : c.links) {
    l.backward_carry = 50;
    l.backward_tail_peak = 60;
  }
  for (const auto& ops : {mb::schedule_none(3), mb::schedule_full(3), mb::schedule_every(3, 2)}) {
    std::vector<mb::phase_bytes> with, without;
    mb::simulate(c, ops, &with);
    mb::simulate(plain, ops, &without);
    REQUIRE(with.size() == without.size());
    bool seen_backward = false;
    for (std::size_t k = 0; k < ops.size(); ++k) {
      // Nothing is in flight before the first backward, 50 bytes from it on; the rest is as without.
      CHECK(with[k].in_flight == (seen_backward ? 50u : 0u));
      CHECK(with[k].live_before == without[k].live_before + with[k].in_flight);
      if (ops[k].kind == K::backward) {
        // The larger of its own peak with the 50 still in flight, and its tail with them released.
        CHECK(with[k].peak == std::max(with[k].live_before + 15, with[k].live_before - with[k].in_flight + 60));
        seen_backward = true;
      } else {
        CHECK(with[k].peak == without[k].peak + with[k].in_flight);
      }
    }
  }
  // The first backward of none: 1640 live (x0..x2, saved 600, δ3; x3 discarded), nothing in
  // flight: its tail, 1640 + 60, is the peak (the loss peaked at 1657).
  CHECK(mb::simulate(c, mb::schedule_none(3)).peak_bytes == 1700);
  // The budget DP plans as if 50 were live throughout: what it returns fits.
  const auto full = mb::simulate(c, mb::schedule_full(3));
  const auto got = mb::optimal_schedule(c, full.peak_bytes + 60);
  CHECK(got.stats.peak_bytes <= full.peak_bytes + 60);
}

TEST_CASE("simulate: every broken precondition is refused, naming the op") {
  const mb::chain c = three_blocks();
  auto refused = [&](std::vector<mb::chain_op> ops, const char* what) {
    CAPTURE(what);
    CHECK_THROWS_AS(mb::simulate(c, ops), mb::invalid_argument);
  };
  refused({{K::advance, 1}}, "advance without x_1");
  refused({{K::advance, 0}, {K::advance, 0}}, "x_1 twice");
  refused({{K::tape, 0}, {K::retape, 0}}, "saved twice");
  refused({{K::loss, 3}}, "loss without x_L");
  refused({{K::tape, 0}, {K::tape, 1}, {K::tape, 2}, {K::backward, 2}}, "backward before the loss");
  refused({{K::tape, 0}, {K::tape, 1}, {K::tape, 2}, {K::loss, 3}, {K::backward, 1}}, "backward out of order");
  refused({{K::advance, 0}, {K::advance, 1}, {K::advance, 2}, {K::loss, 3}, {K::backward, 2}}, "backward without saved");
  refused({{K::discard, 1}}, "discard of a dead x");
  refused({{K::tape, 0}, {K::discard, 0}}, "discard of an input whose saved tensors live");
  refused({{K::advance, 7}}, "block out of range");
  refused({{K::tape, 0}, {K::tape, 1}, {K::tape, 2}, {K::loss, 3}}, "incomplete");
  try {
    mb::simulate(c, std::vector<mb::chain_op>{{K::discard, 1}});
  } catch (const mb::invalid_argument& e) {
    CHECK(e.argument() == "ops[0] (D1)");
  }
}

TEST_CASE("binomial: advances equal Griewank's closed form and the recursion, for steps <= 30, slots <= 6") {
  std::map<std::pair<std::size_t, std::size_t>, std::size_t> memo;
  std::size_t pairs = 0;
  for (std::size_t L = 1; L <= 30; ++L) {
    mb::chain c;
    for (std::size_t i = 0; i < L; ++i) c.links.push_back({1, 1, 1, 2, 1, 1, 1.0});
    c.output_bytes = 1;
    c.loss_peak = 1;
    for (std::size_t s = 1; s <= 6; ++s) {
      CAPTURE(L);
      CAPTURE(s);
      const auto ops = mb::schedule_binomial(L, s);
      const auto st = mb::simulate(c, ops);
      const std::size_t closed = mb::binomial_min_forwards(L, s);
      CHECK(st.advances == closed);
      CHECK(closed == revolve_recursion(L, s, memo));
      CHECK(st.max_live_inputs <= std::min(s, L) + 2);  // the slots, the value being advanced and its successor
      CHECK(st.forward_ops == st.advances + L);          // one tape/retape per block
      ++pairs;
    }
  }
  CHECK(pairs == 180);
  CHECK_THROWS_AS(mb::schedule_binomial(4, 0), mb::invalid_argument);
}

TEST_CASE("every<K>, full and none: accepted, costs as stated") {
  const mb::chain c = three_blocks();
  for (std::size_t k = 1; k <= 4; ++k) {
    CAPTURE(k);
    const auto st = mb::simulate(c, mb::schedule_every(3, k));
    CHECK(st.recompute_cost == 6);  // every segment is recomputed once: Σ f
    CHECK(st.max_live_inputs <= (3 + k - 1) / k + std::min<std::size_t>(k, 3) + 1);
  }
  CHECK(mb::schedule_every(3, 1) == mb::schedule_full(3));
  CHECK_THROWS_AS(mb::schedule_every(3, 0), mb::invalid_argument);
}

TEST_CASE("optimal_schedule against an exhaustive search over every op sequence") {
  membound_test::rng r{2024};
  std::size_t cases = 0, feasible_cases = 0, worse = 0;
  for (int trial = 0; trial < 120; ++trial) {
    const std::size_t L = 1 + static_cast<std::size_t>(trial % 5);
    const mb::chain c = random_chain(r, L);
    const std::size_t hi = mb::simulate(c, mb::schedule_none(L)).peak_bytes;
    for (std::size_t budget = c.base_bytes; budget <= hi + 1; ++budget) {
      CAPTURE(trial);
      CAPTURE(budget);
      bool ok = false;
      const double best = exhaustive(c, budget, ok);
      ++cases;
      if (!ok) {
        CHECK_THROWS_AS(mb::optimal_schedule(c, budget), mb::schedule_does_not_fit);
        continue;
      }
      ++feasible_cases;
      double total = 0;
      for (const auto& l : c.links) total += l.forward_cost;
      const auto got = mb::optimal_schedule(c, budget, 10000);  // unit 1: no rounding
      CHECK(got.unit == 1);
      CHECK(got.stats.peak_bytes <= budget);
      // The search is a lower bound over every schedule: the DP can never beat it.
      CHECK(got.stats.recompute_cost >= best - total);
      if (got.stats.recompute_cost != best - total) {
        ++worse;
        MESSAGE("DP above the optimum: trial " << trial << ", budget " << budget << ": "
                << got.stats.recompute_cost << " vs " << best - total << "; DP "
                << mb::to_string(got.ops));
      }
    }
  }
  MESSAGE(cases << " (chain, budget) pairs, " << feasible_cases << " feasible, DP above the optimum in " << worse);
  CHECK(feasible_cases > 500);
  // The DP covers segment-nested schedules (every kept input stays until its segment is
  // reversed). The search also finds "relay" schedules that keep an input only to advance it
  // once more and then drop it; they beat the DP on a few chains. Hold that to under 1%.
  CHECK(worse * 100 <= feasible_cases);
}

TEST_CASE("simulate: offload and fetch move an input's bytes between the spaces, and are checked") {
  mb::chain c = three_blocks();
  c.offload_cost_per_byte = 0.5;
  // every<2>, with x_0 in the host space while block 2 is reversed.
  const std::vector<mb::chain_op> ops{{K::advance, 0}, {K::advance, 1}, {K::discard, 1}, {K::offload, 0},
                                      {K::advance, 2}, {K::loss, 3},    {K::discard, 3}, {K::retape, 2},
                                      {K::backward, 2}, {K::discard, 2}, {K::fetch, 0},  {K::tape, 0},
                                      {K::retape, 1},  {K::backward, 1}, {K::discard, 1}, {K::backward, 0},
                                      {K::discard, 0}};
  std::vector<mb::phase_bytes> tl;
  const mb::schedule_stats st = mb::simulate(c, ops, &tl);
  CHECK(st.offloaded_bytes == 10);
  CHECK(st.host_peak_bytes == 10);
  CHECK(st.offload_cost == 10.0);  // 10 bytes out and 10 back at 0.5
  CHECK(tl[3].live_before == 1020);  // x_0 and x_2 (advance 1 made x_2; x_1 discarded)
  CHECK(tl[3].peak == 1020);
  CHECK(tl[3].host_after == 10);
  CHECK(tl[4].live_before == 1010);  // x_0 has left the device
  CHECK(tl[10].peak == tl[10].live_before + 10);  // the fetch takes its bytes back
  CHECK(tl[10].host_after == 0);
  CHECK(mb::to_string(ops).find("O0") != std::string::npos);
  CHECK(mb::to_string(ops).find("I0") != std::string::npos);
  auto refused = [&](std::vector<mb::chain_op> bad, const char* what) {
    CAPTURE(what);
    CHECK_THROWS_AS(mb::simulate(c, bad), mb::invalid_argument);
  };
  refused({{K::offload, 1}}, "offload of a dead x");
  refused({{K::fetch, 0}}, "fetch of an input on the device");
  refused({{K::tape, 0}, {K::offload, 0}}, "offload of an input whose saved tensors live");
  refused({{K::offload, 0}, {K::advance, 0}}, "advance from an input in the host space");
  refused({{K::offload, 0}, {K::discard, 0}}, "discard of an input in the host space");
  refused({{K::advance, 0}, {K::offload, 1}, {K::advance, 0}}, "an output whose slot is in the host space");
  std::vector<mb::chain_op> left = ops;
  left.insert(left.end() - 1, {K::offload, 0});
  left.pop_back();
  refused(left, "ends with an input in the host space");
}

TEST_CASE("optimal_schedule: an offload price that is negative or not finite is refused by name") {
  mb::chain c = three_blocks();
  c.offload_inputs = true;
  for (const double bad : {-0.5, std::nan(""), std::numeric_limits<double>::infinity()}) {
    CAPTURE(bad);
    c.offload_cost_per_byte = bad;
    try {
      (void)mb::optimal_schedule(c, 2000);
      FAIL("a bad price was taken");
    } catch (const mb::invalid_argument& e) {
      CHECK(e.argument() == "chain.offload_cost_per_byte");
    }
  }
}

TEST_CASE("optimal_schedule with offload against an exhaustive search, and never above the DP without it") {
  membound_test::rng r{4242};
  std::size_t feasible_cases = 0, worse = 0, cheaper = 0, fits_only_offloaded = 0;
  for (int trial = 0; trial < 80; ++trial) {
    const std::size_t L = 2 + static_cast<std::size_t>(trial % 4);
    mb::chain c = random_chain(r, L);
    mb::chain off = c;
    off.offload_inputs = true;
    off.offload_cost_per_byte = (trial % 3) * 0.25;  // free, and two prices
    const std::size_t hi = mb::simulate(c, mb::schedule_none(L)).peak_bytes;
    for (std::size_t budget = c.base_bytes; budget <= hi + 1; ++budget) {
      CAPTURE(trial);
      CAPTURE(budget);
      bool ok = false;
      const double best = exhaustive(off, budget, ok);
      if (!ok) {
        CHECK_THROWS_AS(mb::optimal_schedule(off, budget), mb::schedule_does_not_fit);
        continue;
      }
      double total = 0;
      for (const auto& l : c.links) total += l.forward_cost;
      bool in_place_fits = true;
      double in_place_cost = 0;
      try {
        in_place_cost = mb::schedule_cost(mb::optimal_schedule(c, budget, 10000).stats);
      } catch (const mb::schedule_does_not_fit&) {
        in_place_fits = false;
      }
      mb::optimal_result got;
      try {
        got = mb::optimal_schedule(off, budget, 10000);
      } catch (const mb::schedule_does_not_fit&) {
        ++feasible_cases;
        ++worse;  // the search found one, the DP none
        continue;
      }
      ++feasible_cases;
      const mb::schedule_stats again = mb::simulate(off, got.ops);
      CHECK(again.peak_bytes <= budget);
      std::size_t inputs = 0;
      for (const auto& l : c.links) inputs += l.input_bytes;
      CHECK(again.host_peak_bytes <= inputs);
      CHECK(mb::schedule_cost(again) >= best - total - 1e-9);
      if (mb::schedule_cost(again) > best - total + 1e-9) ++worse;
      if (!in_place_fits) {
        ++fits_only_offloaded;
      } else {
        CHECK(mb::schedule_cost(again) <= in_place_cost + 1e-9);
        if (mb::schedule_cost(again) < in_place_cost - 1e-9) ++cheaper;
      }
    }
  }
  MESSAGE(feasible_cases << " feasible (chain, budget) pairs with offload: cheaper than in place in " << cheaper
                         << ", fitting only offloaded in " << fits_only_offloaded << ", DP above the optimum in "
                         << worse);
  CHECK(feasible_cases > 300);
  CHECK(cheaper > 0);
  CHECK(fits_only_offloaded > 0);
  // The DP offloads only a segment's kept input while the blocks after it are reversed; the search
  // also offloads inputs it then advances from again ("relays", as above). Hold that to under 5%.
  CHECK(worse * 20 <= feasible_cases);
}

TEST_CASE("optimal_schedule: a large budget costs nothing; coarse cells stay within the budget") {
  membound_test::rng r{7};
  mb::chain c = random_chain(r, 32);
  for (auto& l : c.links) {  // realistic magnitudes: MiB-sized, uneven
    l.input_bytes *= 1 << 20;
    l.saved_bytes *= 3 << 20;
    l.advance_peak *= 1 << 20;
    l.tape_peak *= 3 << 20;
    l.retape_peak *= 3 << 20;
    l.backward_peak *= 2 << 20;
  }
  for (auto& l : c.links) {
    l.tape_peak = std::max(l.tape_peak, l.saved_bytes + 4 * (1u << 20));
    l.retape_peak = std::max(l.retape_peak, l.saved_bytes);
    l.advance_peak = std::max(l.advance_peak, std::size_t{4} << 20);
    l.backward_peak = std::max(l.backward_peak, std::size_t{4} << 20);
  }
  c.output_bytes <<= 20;
  c.loss_peak = (c.loss_peak << 20) + c.output_bytes;
  const auto none = mb::simulate(c, mb::schedule_none(32));
  CHECK(mb::optimal_schedule(c, none.peak_bytes).stats.recompute_cost == 0);
  const auto full = mb::simulate(c, mb::schedule_full(32));
  for (int k = 0; k <= 4; ++k) {
    const std::size_t budget = full.peak_bytes + (none.peak_bytes - full.peak_bytes) * static_cast<std::size_t>(k) / 4;
    const auto got = mb::optimal_schedule(c, budget);
    CHECK(got.stats.peak_bytes <= budget);
    CHECK(got.stats.recompute_cost <= full.recompute_cost);
  }
}
