// Block-level recompute schedules for a chain of blocks, and the exact simulator that defines
// what a schedule costs in bytes and FLOPs.
//
// A model step is a chain: x_0 → block 0 → x_1 → … → x_L → loss, then backward δ_L → … → δ_0.
// A schedule is a list of ops over that chain:
//   advance(i)   x_i → x_{i+1}, keeping nothing of block i
//   tape(i)      x_i → x_{i+1} and saved_i (what backward(i) needs)
//   retape(i)    x_i → saved_i only (the output is computed in scratch and dropped)
//   loss         x_L → δ_L (the head: loss and its gradient), exactly once
//   backward(i)  x_i, saved_i, δ_{i+1} → δ_i; frees saved_i and δ_{i+1}; in order L−1 … 0
//   discard(i)   frees x_i; not while saved_i is live (backward(i) reads x_i with saved_i, so a
//                block's input lives as long as its saved tensors: Beaumont et al.'s model)
//   offload(i)   moves x_i to the host space (activation offload): its device bytes are freed,
//                as many host bytes taken; not while saved_i is live
//   fetch(i)     moves x_i back: its device bytes taken again, its host bytes freed
// Start: x_0 live. End: only δ_0 live, nothing in the host space. simulate() is the definition of a schedule's memory: live
// bytes are base + the live values, and an op's peak is the live bytes before it plus its own
// peak (outputs and workspace). model::forward_backward allocates in exactly this order, so the
// allocator's measured peak equals simulate()'s.
//
// Generators: schedule_none (keep everything), schedule_full (keep block inputs, recompute every
// block), schedule_every (keep every K-th input, recompute segments), schedule_binomial
// (Griewank's Revolve: the fewest forward steps for a number of slots for saved block inputs) and
// optimal_schedule (the least recompute under a byte budget, by dynamic programming over
// segments and memory for a heterogeneous chain, after Beaumont et al. 2019).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "membound/core/checked_math.hpp"
#include "membound/core/config.hpp"
#include "membound/core/error.hpp"
#include "membound/core/format.hpp"

MEMBOUND_NAMESPACE_BEGIN

struct chain_link {               // block i
  std::size_t input_bytes = 0;    // a_i: x_i, and δ_i, each this many bytes
  std::size_t saved_bytes = 0;    // s_i: what tape(i) keeps for backward(i)
  std::size_t advance_peak = 0;   // peak bytes of advance(i) above those live before it (>= a_{i+1})
  std::size_t tape_peak = 0;      // same for tape(i) (>= a_{i+1} + s_i)
  std::size_t retape_peak = 0;    // same for retape(i) (>= s_i)
  std::size_t backward_peak = 0;  // same for backward(i) (>= a_i, the new δ_i)
  double forward_cost = 1.0;      // f_i, e.g. FLOPs
  // Work backward(i) leaves in flight (ZeRO-2's overlapped gradient exchange: the block's bucket
  // and its exchange's workspace): live from the end of backward(i) through the ops after it until
  // the next backward releases it, after its own peak and before its tail; the last backward's
  // stays live past the chain's end. 0: nothing in flight.
  std::size_t backward_carry = 0;
  // backward(i)'s peak after the in-flight bytes before it are released (above the bytes live
  // before it less those): where it starts its own exchange. 0 when nothing is carried.
  std::size_t backward_tail_peak = 0;
};

struct chain {
  std::vector<chain_link> links;  // L >= 1 blocks
  std::size_t output_bytes = 0;   // a_L: x_L and δ_L
  std::size_t loss_peak = 0;      // peak of the loss op above live (>= a_L)
  std::size_t base_bytes = 0;     // live throughout: weights, gradients, optimizer state
  // Activation offload: when set, optimal_schedule may keep a segment's input x_s in the host
  // space while the blocks after the segment are reversed (offload, then fetch before the
  // segment's own backward), at offload_cost_per_byte per byte moved each way, in forward_cost's
  // unit. The host space is not bounded here: a caller bounds it (its peak is at most the sum of
  // the block inputs). The generators never offload.
  bool offload_inputs = false;
  double offload_cost_per_byte = 0;

  constexpr std::size_t length() const noexcept { return links.size(); }
  constexpr std::size_t a(std::size_t i) const noexcept { return i < links.size() ? links[i].input_bytes : output_bytes; }
};

enum class chain_op_kind : std::uint8_t { advance, tape, retape, loss, backward, discard, offload, fetch };

struct chain_op {
  chain_op_kind kind = chain_op_kind::advance;
  std::uint32_t block = 0;  // loss: L
  friend constexpr bool operator==(const chain_op&, const chain_op&) = default;
};

inline std::string to_string(const chain_op& op) {
  const char* k = "";
  switch (op.kind) {
    case chain_op_kind::advance: k = "F"; break;
    case chain_op_kind::tape: k = "T"; break;
    case chain_op_kind::retape: k = "R"; break;
    case chain_op_kind::loss: return "L";
    case chain_op_kind::backward: k = "B"; break;
    case chain_op_kind::discard: k = "D"; break;
    case chain_op_kind::offload: k = "O"; break;
    case chain_op_kind::fetch: k = "I"; break;
  }
  // Appended, not `k + std::to_string(...)`: GCC 12 at -O3 reports a false -Wrestrict on that
  // operator+ once inlined into a large translation unit (seen under nvcc's host pass).
  std::string s(k);
  s += std::to_string(op.block);
  return s;
}
inline std::string to_string(std::span<const chain_op> ops) {
  std::string s;
  for (const chain_op& op : ops) {
    if (!s.empty()) s += ' ';
    s += to_string(op);
  }
  return s;
}

struct schedule_stats {
  std::size_t peak_bytes = 0;
  double recompute_cost = 0;         // forward cost beyond each block's first forward
  std::size_t forward_ops = 0;       // advance + tape + retape
  std::size_t advances = 0;          // Revolve's "forward steps"
  std::size_t max_live_inputs = 0;   // most x values live at once (on the device)
  std::size_t host_peak_bytes = 0;   // most bytes of block inputs in the host space at once
  std::size_t offloaded_bytes = 0;   // bytes moved to the host space (as many come back)
  double offload_cost = 0;           // offload_cost_per_byte x the bytes moved both ways
};

// One op: bytes live before it and its peak.
struct phase_bytes {
  std::size_t op = 0;
  std::size_t live_before = 0;
  std::size_t peak = 0;
  std::size_t in_flight = 0;  // of live_before, the backward_carry still in flight
  std::size_t host_after = 0;  // bytes of block inputs in the host space after the op
};

// Validates every precondition and the end state (invalid_argument names the op) and returns the
// exact peak and costs; `timeline`, when given, receives one entry per op.
constexpr schedule_stats simulate(const chain& c, std::span<const chain_op> ops,
                               std::vector<phase_bytes>* timeline = nullptr) {
  const std::size_t L = c.length();
  if (L == 0) throw invalid_argument("chain", "at least one block", "none", "Build the chain from a model");
  // x[i]: 0 not live, 1 on the device, 2 in the host space (offloaded)
  std::vector<char> x(L + 1, 0), saved(L, 0);
  x[0] = 1;
  std::size_t host = 0;
  std::size_t next_backward = L;  // backward ops run L−1 … 0; δ_{next_backward} is live after the loss
  bool loss_done = false;
  std::size_t live = sat_add(c.base_bytes, c.a(0));
  std::size_t carry = 0;  // the last backward's backward_carry, part of live
  schedule_stats st;
  st.peak_bytes = live;
  st.max_live_inputs = 1;
  double total = 0;
  auto bad = [&](std::size_t k, const std::string& why) {
    throw invalid_argument("ops[" + std::to_string(k) + "] (" + to_string(ops[k]) + ")", why, "",
                           "Build schedules with the generators in model/recompute_schedule.hpp");
  };
  for (std::size_t k = 0; k < ops.size(); ++k) {
    const chain_op& op = ops[k];
    const std::size_t i = op.block;
    const std::size_t before = live, before_carry = carry;
    std::size_t peak = live;
    if (op.kind != chain_op_kind::loss && i > (op.kind == chain_op_kind::discard ? L : L - 1)) {
      bad(k, "a block index below " + std::to_string(L) + " (discard: up to L)");
    }
    switch (op.kind) {
      case chain_op_kind::advance:
      case chain_op_kind::tape:
        if (x[i] != 1) bad(k, "x_" + std::to_string(i) + " live on the device");
        if (x[i + 1]) bad(k, "x_" + std::to_string(i + 1) + " not yet live");
        if (op.kind == chain_op_kind::tape && saved[i]) bad(k, "saved_" + std::to_string(i) + " not yet live");
        peak = sat_add(live, op.kind == chain_op_kind::tape ? c.links[i].tape_peak : c.links[i].advance_peak);
        x[i + 1] = 1;
        live = sat_add(live, c.a(i + 1));
        if (op.kind == chain_op_kind::tape) {
          saved[i] = 1;
          live = sat_add(live, c.links[i].saved_bytes);
        }
        total += c.links[i].forward_cost;
        ++st.forward_ops;
        st.advances += op.kind == chain_op_kind::advance;
        break;
      case chain_op_kind::retape:
        if (x[i] != 1) bad(k, "x_" + std::to_string(i) + " live on the device");
        if (saved[i]) bad(k, "saved_" + std::to_string(i) + " not yet live");
        peak = sat_add(live, c.links[i].retape_peak);
        saved[i] = 1;
        live = sat_add(live, c.links[i].saved_bytes);
        total += c.links[i].forward_cost;
        ++st.forward_ops;
        break;
      case chain_op_kind::loss:
        if (loss_done) bad(k, "one loss op");
        if (x[L] != 1) bad(k, "x_L live on the device");
        peak = sat_add(live, c.loss_peak);
        live = sat_add(live, c.output_bytes);
        loss_done = true;
        break;
      case chain_op_kind::backward:
        if (!loss_done) bad(k, "the loss before any backward");
        if (i + 1 != next_backward) bad(k, "backward of block " + std::to_string(next_backward - 1) + " next");
        if (x[i] != 1 || !saved[i]) bad(k, "x_" + std::to_string(i) + " (on the device) and saved_" + std::to_string(i) + " live");
        peak = sat_add(live, c.links[i].backward_peak);
        if (c.links[i].backward_tail_peak != 0) {
          peak = std::max(peak, sat_add(sat_sub(live, carry), c.links[i].backward_tail_peak));
        }
        // Exact unless a size saturated, and then the peak is SIZE_MAX already.
        live = sat_sub(sat_sub(sat_add(sat_add(sat_sub(live, carry), c.links[i].backward_carry), c.a(i)), c.a(i + 1)),
                       c.links[i].saved_bytes);
        carry = c.links[i].backward_carry;
        saved[i] = 0;
        next_backward = i;
        break;
      case chain_op_kind::discard:
        if (x[i] != 1) bad(k, "x_" + std::to_string(i) + " live on the device");
        if (i < L && saved[i]) bad(k, "saved_" + std::to_string(i) + " used first (a block's input stays while its saved tensors do)");
        x[i] = 0;
        live = sat_sub(live, c.a(i));
        break;
      case chain_op_kind::offload:
        if (x[i] != 1) bad(k, "x_" + std::to_string(i) + " live on the device");
        if (saved[i]) bad(k, "saved_" + std::to_string(i) + " used first (a block's input stays while its saved tensors do)");
        x[i] = 2;
        live = sat_sub(live, c.a(i));
        host = sat_add(host, c.a(i));
        st.host_peak_bytes = std::max(st.host_peak_bytes, host);
        st.offloaded_bytes = sat_add(st.offloaded_bytes, c.a(i));
        st.offload_cost += c.offload_cost_per_byte * static_cast<double>(c.a(i));
        break;
      case chain_op_kind::fetch:
        if (x[i] != 2) bad(k, "x_" + std::to_string(i) + " in the host space (offloaded)");
        peak = sat_add(live, c.a(i));
        x[i] = 1;
        live = sat_add(live, c.a(i));
        host = sat_sub(host, c.a(i));
        st.offload_cost += c.offload_cost_per_byte * static_cast<double>(c.a(i));
        break;
    }
    st.peak_bytes = std::max(st.peak_bytes, peak);
    st.max_live_inputs = std::max<std::size_t>(st.max_live_inputs, static_cast<std::size_t>(std::count(x.begin(), x.end(), 1)));
    if (timeline != nullptr) timeline->push_back({k, before, peak, before_carry, host});
  }
  const bool clean = next_backward == 0 && std::count(x.begin(), x.end(), 0) == static_cast<std::ptrdiff_t>(L + 1) &&
                     std::count(saved.begin(), saved.end(), 1) == 0;
  if (!clean) {
    throw invalid_argument("ops", "a complete schedule: every backward done, every x discarded (none left in the host space), every saved used",
                           "one that stops early (next backward " + std::to_string(next_backward) + ")",
                           "Build schedules with the generators in model/recompute_schedule.hpp");
  }
  for (const chain_link& l : c.links) total -= l.forward_cost;
  st.recompute_cost = total;
  return st;
}

namespace detail {
constexpr void push(std::vector<chain_op>& o, chain_op_kind k, std::size_t i) {
  o.push_back({k, static_cast<std::uint32_t>(i)});
}
// The most blocks a chain may have: its op lists, Revolve's table and the DP's are sized from
// it, and must stay far from what a vector can hold (a typed error, never std::length_error).
inline constexpr std::size_t max_chain_length = std::size_t{1} << 16;
// The most entries Revolve's table and the budget DP's table may have (each a few bytes).
inline constexpr std::size_t max_table_entries = std::size_t{1} << 25;
constexpr void check_length(std::size_t L) {
  if (L == 0 || L > max_chain_length) {
    throw invalid_argument("L", "between 1 and " + std::to_string(max_chain_length) + " blocks", std::to_string(L),
                           "A chain has at least one block; split a deeper model into stages");
  }
}
// From x_s (kept), advance to x_e, discarding what lies between.
constexpr void advance_to(std::vector<chain_op>& o, std::size_t s, std::size_t e) {
  for (std::size_t k = s; k < e; ++k) {
    push(o, chain_op_kind::advance, k);
    if (k > s) push(o, chain_op_kind::discard, k);
  }
}
}  // namespace detail

constexpr std::vector<chain_op> schedule_none(std::size_t L) {
  detail::check_length(L);
  std::vector<chain_op> o;
  for (std::size_t i = 0; i < L; ++i) detail::push(o, chain_op_kind::tape, i);
  detail::push(o, chain_op_kind::loss, L);
  detail::push(o, chain_op_kind::discard, L);
  for (std::size_t i = L; i-- > 0;) {
    detail::push(o, chain_op_kind::backward, i);
    detail::push(o, chain_op_kind::discard, i);
  }
  return o;
}

// Keep x_i where i % K == 0; backward recomputes each segment [s, e) from x_s: tape s … e−2
// (their inputs stay for their backward), retape e−1, then backward e−1 … s.
constexpr std::vector<chain_op> schedule_every(std::size_t L, std::size_t K) {
  detail::check_length(L);
  if (K == 0) throw invalid_argument("K", "at least 1 block per segment", "0", "every<1> is full");
  std::vector<chain_op> o;
  for (std::size_t i = 0; i < L; ++i) {
    detail::push(o, chain_op_kind::advance, i);
    if (i % K != 0) detail::push(o, chain_op_kind::discard, i);
  }
  detail::push(o, chain_op_kind::loss, L);
  detail::push(o, chain_op_kind::discard, L);
  for (std::size_t s = (L - 1) / K * K;; s -= K) {
    const std::size_t e = std::min(L, s + K);
    for (std::size_t i = s; i + 1 < e; ++i) detail::push(o, chain_op_kind::tape, i);
    detail::push(o, chain_op_kind::retape, e - 1);
    for (std::size_t i = e; i-- > s;) {
      detail::push(o, chain_op_kind::backward, i);
      detail::push(o, chain_op_kind::discard, i);
    }
    if (s == 0) break;
  }
  return o;
}

constexpr std::vector<chain_op> schedule_full(std::size_t L) { return schedule_every(L, 1); }

// ---- Binomial recompute schedules (Revolve) -------------------------------------------------------
// Slots count the stored block inputs, x_0 included (Revolve's snapshots); the value being
// advanced is not a slot. A reverse step is retape(i) + backward(i) (Revolve's "youturn"); the
// last block is taped in the first sweep ("firsturn"). binomial_min_forwards counts advance ops.

// The fewest advances to reverse l steps with s slots: Griewank & Walther, t(l, s) = r·l −
// β(s + 1, r − 1), β(s, r) = C(s + r, s), r the least with β(s, r) >= l.
inline std::size_t binomial_min_forwards(std::size_t l, std::size_t s) {
  if (s == 0) {
    if (l <= 1) return 0;
    throw invalid_argument("slots", "at least 1 to reverse more than one step", "0", "Give one slot or more");
  }
  auto beta = [](std::size_t n, std::size_t r) {  // C(n + r, n), saturating
    long double v = 1;
    for (std::size_t k = 1; k <= r; ++k) v = v * static_cast<long double>(n + k) / static_cast<long double>(k);
    return v;
  };
  std::size_t r = 0;
  while (beta(s, r) < static_cast<long double>(l)) ++r;
  if (r == 0) return 0;
  return static_cast<std::size_t>(static_cast<long double>(r) * static_cast<long double>(l) - beta(s + 1, r - 1) + 0.5L);
}

namespace detail {
// T[l][c]: fewest advances for l steps with c slots, by the recursion that chooses the first
// checkpoint's distance j: T(l, c) = min_j j + T(l − j, c − 1) + T(j, c); T(1, c) = 0,
// T(l, 1) = l(l − 1)/2. best[l][c] keeps the j.
struct revolve_table {
  std::vector<std::vector<std::size_t>> t, best;
  constexpr revolve_table(std::size_t L, std::size_t C) : t(L + 1, std::vector<std::size_t>(C + 1, 0)), best(t) {
    for (std::size_t l = 2; l <= L; ++l) {
      t[l][1] = l * (l - 1) / 2;
      for (std::size_t c = 2; c <= C; ++c) {
        std::size_t m = std::numeric_limits<std::size_t>::max(), arg = 1;
        for (std::size_t j = 1; j < l; ++j) {
          const std::size_t v = j + t[l - j][c - 1] + t[j][c];
          if (v < m) {
            m = v;
            arg = j;
          }
        }
        t[l][c] = m;
        best[l][c] = arg;
      }
    }
  }
};

// Reverse blocks [s, e) with x_s stored and c slots (x_s's included); first: the loss is still to
// come (e == L and δ_L does not exist yet).
constexpr void revolve(std::vector<chain_op>& o, const revolve_table& tb, std::size_t s, std::size_t e,
                    std::size_t c, bool first, std::size_t L) {
  const std::size_t l = e - s;
  if (l == 1) {
    if (first) {
      push(o, chain_op_kind::tape, s);
      push(o, chain_op_kind::loss, L);
      push(o, chain_op_kind::discard, L);
    } else {
      push(o, chain_op_kind::retape, s);
    }
    push(o, chain_op_kind::backward, s);
    return;
  }
  if (c == 1) {
    for (std::size_t j = e; j-- > s;) {
      advance_to(o, s, j);
      revolve(o, tb, j, j + 1, 1, first && j == e - 1, L);
      if (j > s) push(o, chain_op_kind::discard, j);
    }
    return;
  }
  const std::size_t m = s + tb.best[l][c];
  advance_to(o, s, m);
  revolve(o, tb, m, e, c - 1, first, L);
  push(o, chain_op_kind::discard, m);
  revolve(o, tb, s, m, c, false, L);
}
}  // namespace detail

constexpr std::vector<chain_op> schedule_binomial(std::size_t L, std::size_t slots) {
  detail::check_length(L);
  if (slots == 0 && L > 1) {
    throw invalid_argument("slots", "at least 1 slot for a saved block input (x_0 takes one)", "0",
                           "Use binomial<1> for the least memory");
  }
  const std::size_t c = std::max<std::size_t>(1, std::min(slots, L));
  if ((L + 1) * (c + 1) > detail::max_table_entries) {
    throw invalid_argument("slots", "at most " + std::to_string(detail::max_table_entries / (L + 1) - 1) + " for " +
                                        std::to_string(L) + " blocks (Revolve's table grows with blocks x slots)",
                           std::to_string(slots), "Use fewer slots, or every<K> for a chain this long");
  }
  const detail::revolve_table tb(L, c);
  std::vector<chain_op> o;
  detail::revolve(o, tb, 0, L, c, true, L);
  detail::push(o, chain_op_kind::discard, 0);
  return o;
}

// ---- The least recompute under a budget ---------------------------------------------------------
struct optimal_result {
  std::vector<chain_op> ops;
  schedule_stats stats;
  std::size_t unit = 1;  // bytes per memory cell of the DP
};

// Thrown when no schedule fits; minimum is the least peak of the generated schedules (full and
// binomial with every slot count), the budget to ask for.
class schedule_does_not_fit : public invalid_argument {
 public:
  schedule_does_not_fit(std::size_t budget, std::size_t minimum)
      : invalid_argument("budget", "at least " + format_bytes(minimum) + " for this chain",
                         format_bytes(budget),
                         "Raise the budget, or use a smaller micro-batch or shorter sequence"),
        minimum_(minimum) {}
  std::size_t minimum() const noexcept { return minimum_; }

 private:
  std::size_t minimum_;
};

namespace detail {

// The DP over segments [s, e) and memory M (cells available to the segment, its own x_s and δ_e
// counted inside). State (first, s, e, M): reverse [s, e) with x_s live (kept for the caller)
// and δ_e live, or, when first, with the loss still to do (e == L). Options:
//   base (e = s + 1):   retape s (or tape s and drop x_{s+1}, if that peaks lower), backward s;
//                       first: tape s, the loss, backward s
//   first only:         advance s … e−1 (keeping x_s), the loss, then reverse [s, e) as non-first
//   tape s:             keep saved_s and x_{s+1}, reverse [s+1, e), discard x_{s+1}, backward s
//   checkpoint at m:    advance s … m−1 (keeping x_s), reverse [m, e), discard x_m, reverse [s, m)
//   offloaded, at m:    the same with x_s in the host space while [m, e) is reversed (offload s
//                       after the advances, fetch s before reversing [s, m)): [m, e) has all of M
// Cost: forward cost of every op, and offload_cost_per_byte x the bytes an offload moves both ways. Sizes are rounded up to cells, so an accepted schedule always
// fits exactly; exact when every size is a multiple of the cell. Time O(L³·M), memory O(L²·M).
class chain_dp {
 public:
  chain_dp(const chain& c, std::size_t cells, std::size_t unit) : c_(c), L_(c.length()), M_(cells), unit_(unit) {
    a_.resize(L_ + 1);
    for (std::size_t i = 0; i <= L_; ++i) a_[i] = up(c.a(i));
    // A retape can also be a tape whose output is dropped at once: whichever peaks lower.
    for (const chain_link& l : c.links)
      u_.push_back({up(l.saved_bytes), up(l.advance_peak), up(l.tape_peak),
                    up(std::min(l.retape_peak, l.tape_peak)), up(std::max(l.backward_peak, l.backward_tail_peak))});
    loss_ = up(c.loss_peak);
    const std::size_t n = 2 * L_ * (L_ + 1) * (M_ + 1);
    cost_.assign(n, -2.0);  // -2: not computed, -1: infeasible
    pick_.assign(n, 0);
  }

  double solve(bool first, std::size_t s, std::size_t e, std::size_t M) {
    const std::size_t k = idx(first, s, e, M);
    if (cost_[k] != -2.0) return cost_[k];
    double best = -1.0;
    int choice = 0;
    auto take = [&](double v, int ch) {
      if (v >= 0 && (best < 0 || v < best)) {
        best = v;
        choice = ch;
      }
    };
    const std::size_t as = a_[s], ae = a_[e];
    const cell& u = u_[s];
    const double f = c_.links[s].forward_cost;
    const std::size_t de = first ? 0 : ae;  // δ_e, when it exists
    if (e == s + 1) {
      if (!first) {
        if (sat_add(as, ae, u.retape) <= M && sat_add(as, ae, u.saved, u.backward) <= M) take(f, 1);
      } else if (sat_add(as, u.tape) <= M && sat_add(as, u.saved, ae, loss_) <= M &&
                 sat_add(as, u.saved, ae, u.backward) <= M) {
        take(f, 1);
      }
    }
    if (first) {
      // advance through the whole segment, the loss, then reverse it as a later segment would.
      std::size_t need = 0;
      double cost = 0;
      for (std::size_t k = s; k < e; ++k) {
        need = std::max(need, sat_add(as, k > s ? a_[k] : 0, u_[k].advance));
        cost += c_.links[k].forward_cost;
      }
      if (need <= M && sat_add(as, ae, loss_) <= M) {
        const double rest = solve(false, s, e, M);
        if (rest >= 0) take(cost + rest, 2);
      }
    }
    if (e > s + 1) {
      // tape s, then the rest with x_s and saved_s outside it.
      if (sat_add(as, de, u.tape) <= M && sat_add(as, u.saved, a_[s + 1], u.backward) <= M && sat_add(as, u.saved) <= M) {
        const double sub = solve(first, s + 1, e, M - as - u.saved);
        if (sub >= 0) take(f + sub, 3);
      }
      // checkpoint at m: the advance chain's peak grows with m; stop once it does not fit. x_s
      // stays on the device, or (offloaded) leaves it while [m, e) is reversed and comes back
      // beside δ_m; in place first, so that a tie keeps it there.
      const double moved = 2.0 * c_.offload_cost_per_byte * static_cast<double>(c_.a(s));
      double chain_cost = 0;
      std::size_t chain_need = 0;
      for (std::size_t m = s + 1; m < e; ++m) {
        const std::size_t kk = m - 1;  // the advance that produces x_m
        chain_need = std::max(chain_need, sat_add(as, kk > s ? a_[kk] : 0, de, u_[kk].advance));
        chain_cost += c_.links[kk].forward_cost;
        if (chain_need > M) break;  // (so as <= M too)
        const double left = solve(false, s, m, M);
        if (left < 0) continue;
        const double right = solve(first, m, e, M - as);
        if (right >= 0) take(chain_cost + right + left, 4 + static_cast<int>(m - s));
        if (c_.offload_inputs && sat_add(as, a_[m]) <= M) {
          const double away = solve(first, m, e, M);
          if (away >= 0) take(chain_cost + away + left + moved, 4 + static_cast<int>(L_ + m - s));
        }
      }
    }
    cost_[k] = best;
    pick_[k] = choice;
    return best;
  }

  void emit(std::vector<chain_op>& o, bool first, std::size_t s, std::size_t e, std::size_t M) const {
    const int ch = pick_[idx(first, s, e, M)];
    if (ch == 1) {
      if (first) {
        push(o, chain_op_kind::tape, s);
        push(o, chain_op_kind::loss, L_);
        push(o, chain_op_kind::discard, L_);
      } else {
        retape(o, s);
      }
      push(o, chain_op_kind::backward, s);
    } else if (ch == 2) {
      advance_to(o, s, e);
      push(o, chain_op_kind::loss, L_);
      push(o, chain_op_kind::discard, L_);
      emit(o, false, s, e, M);
    } else if (ch == 3) {
      push(o, chain_op_kind::tape, s);
      emit(o, first, s + 1, e, M - a_[s] - u_[s].saved);
      push(o, chain_op_kind::discard, s + 1);
      push(o, chain_op_kind::backward, s);
    } else if (static_cast<std::size_t>(ch - 4) < L_) {
      const std::size_t m = s + static_cast<std::size_t>(ch - 4);
      advance_to(o, s, m);
      emit(o, first, m, e, M - a_[s]);
      push(o, chain_op_kind::discard, m);
      emit(o, false, s, m, M);
    } else {
      const std::size_t m = s + static_cast<std::size_t>(ch - 4) - L_;
      advance_to(o, s, m);
      push(o, chain_op_kind::offload, s);
      emit(o, first, m, e, M);
      push(o, chain_op_kind::discard, m);
      push(o, chain_op_kind::fetch, s);
      emit(o, false, s, m, M);
    }
  }

 private:
  struct cell {
    std::size_t saved, advance, tape, retape, backward;
  };
  std::size_t up(std::size_t b) const noexcept { return b / unit_ + (b % unit_ != 0); }
  void retape(std::vector<chain_op>& o, std::size_t s) const {
    if (c_.links[s].tape_peak < c_.links[s].retape_peak) {
      push(o, chain_op_kind::tape, s);
      push(o, chain_op_kind::discard, s + 1);
    } else {
      push(o, chain_op_kind::retape, s);
    }
  }
  std::size_t idx(bool first, std::size_t s, std::size_t e, std::size_t M) const noexcept {
    return ((static_cast<std::size_t>(first) * L_ + s) * (L_ + 1) + e) * (M_ + 1) + M;
  }
  const chain& c_;
  std::size_t L_, M_, unit_;
  std::vector<std::size_t> a_;
  std::vector<cell> u_;
  std::size_t loss_ = 0;
  std::vector<double> cost_;
  std::vector<int> pick_;
};

}  // namespace detail

// The cost optimal_schedule minimizes: recompute, and the offloads' copies (chain::offload_inputs).
constexpr double schedule_cost(const schedule_stats& s) noexcept { return s.recompute_cost + s.offload_cost; }

namespace detail {
inline optimal_result optimal_schedule_of(const chain& c, std::size_t budget_bytes, std::size_t max_cells);
}

// The schedule of least cost (schedule_cost) whose simulated peak is at most budget_bytes, over
// memory discretized into at most max_cells cells. Throws schedule_does_not_fit (with the least
// peak among the generated fallbacks, as the budget to ask for) when the DP finds none. With
// chain::offload_inputs, a schedule that offloads is taken only when it costs strictly less than
// the best that does not (or when only it fits): a tie keeps every input on the device.
inline optimal_result optimal_schedule(const chain& c, std::size_t budget_bytes, std::size_t max_cells = 512) {
  if (!c.offload_inputs) return detail::optimal_schedule_of(c, budget_bytes, max_cells);
  // A negative price would make the DP offload for gain, NaN would compare false everywhere.
  if (!(c.offload_cost_per_byte >= 0) || c.offload_cost_per_byte > std::numeric_limits<double>::max()) {
    throw invalid_argument("chain.offload_cost_per_byte", "a finite cost of 0 or more per byte moved",
                           std::to_string(c.offload_cost_per_byte), "Price a byte as FLOP/s over the link's bytes/s (0: free)");
  }
  chain in_place = c;
  in_place.offload_inputs = false;
  std::optional<optimal_result> kept;
  try {
    kept = detail::optimal_schedule_of(in_place, budget_bytes, max_cells);
  } catch (const schedule_does_not_fit&) {
    return detail::optimal_schedule_of(c, budget_bytes, max_cells);  // only offloading can fit, if anything
  }
  std::optional<optimal_result> moved;
  try {
    moved = detail::optimal_schedule_of(c, budget_bytes, max_cells);
  } catch (const schedule_does_not_fit&) {
    // (a superset of the choices: not expected once the in-place DP fits)
  }
  if (moved && schedule_cost(moved->stats) < schedule_cost(kept->stats)) return std::move(*moved);
  kept->stats = simulate(c, kept->ops);  // the same schedule, its stats under c (nothing offloaded)
  return std::move(*kept);
}

namespace detail {
inline optimal_result optimal_schedule_of(const chain& c, std::size_t budget_bytes, std::size_t max_cells) {
  detail::check_length(c.length());
  const std::size_t L = c.length();
  // When the DP (whose rounding is conservative) finds nothing, the generated schedules that fit
  // are the answer, the cheapest first; when none fits, the least peak is the budget to ask for.
  // Every schedule a generator makes: none, every<k> (full is every<1>) and binomial<s>, as far
  // as Revolve's table allows.
  auto fallback = [&](bool must) {
    std::vector<std::vector<chain_op>> cands{schedule_none(L)};
    for (std::size_t k = 1; k <= L; ++k) cands.push_back(schedule_every(L, k));
    for (std::size_t s = 1; s <= L && (L + 1) * (s + 1) <= detail::max_table_entries; ++s)
      cands.push_back(schedule_binomial(L, s));
    std::size_t least = std::numeric_limits<std::size_t>::max();
    optimal_result best;
    bool found = false;
    for (auto& ops : cands) {
      const schedule_stats st = simulate(c, ops);
      least = std::min(least, st.peak_bytes);
      if (st.peak_bytes <= budget_bytes && (!found || schedule_cost(st) < schedule_cost(best.stats))) {
        best.ops = std::move(ops);
        best.stats = st;
        found = true;
      }
    }
    if (!found && must) throw schedule_does_not_fit(budget_bytes, least);
    if (!found) best.stats.recompute_cost = std::numeric_limits<double>::infinity();
    return best;
  };
  if (max_cells == 0 || max_cells > detail::max_table_entries) {
    throw invalid_argument("max_cells", "between 1 and " + std::to_string(detail::max_table_entries), std::to_string(max_cells),
                           "The default of 512 plans to within 0.2% of the budget");
  }
  // The DP's table has 2·L·(L + 1)·(cells + 1) entries: fewer cells for long chains.
  max_cells = std::min(max_cells, detail::max_table_entries / (2 * L * (L + 1)));
  if (max_cells < 8) return fallback(true);  // a chain too long for the DP: the generators decide
  // In-flight bytes (backward_carry) are outside the DP's model: it plans as if the largest were
  // live throughout, which only overstates (simulate() below gives the exact peak).
  std::size_t in_flight = 0;
  for (const chain_link& l : c.links) in_flight = std::max(in_flight, l.backward_carry);
  if (budget_bytes <= sat_add(c.base_bytes, in_flight)) return fallback(true);
  const std::size_t avail = budget_bytes - c.base_bytes - in_flight;
  const std::size_t unit = std::max<std::size_t>(1, avail / std::max<std::size_t>(1, max_cells) + (avail % std::max<std::size_t>(1, max_cells) != 0));
  const std::size_t cells = avail / unit;
  detail::chain_dp dp(c, cells, unit);
  if (dp.solve(true, 0, L, cells) < 0) return fallback(true);
  optimal_result r;
  dp.emit(r.ops, true, 0, L, cells);
  detail::push(r.ops, chain_op_kind::discard, 0);
  r.stats = simulate(c, r.ops);
  r.unit = unit;
  // Rounding to cells can hide a generated schedule that fits exactly (none at its own peak):
  // the cheaper of the two wins.
  optimal_result g = fallback(false);
  if (schedule_cost(g.stats) < schedule_cost(r.stats)) {
    g.unit = unit;
    return g;
  }
  return r;
}
}  // namespace detail

MEMBOUND_NAMESPACE_END
