// A memory layout computed before the first step: where every request of a known, repeating
// sequence lives inside one block of memory, so that an allocator can serve the sequence from
// two exact-size segments instead of size classes and shared segments (caching_allocator's
// planned mode). A training step makes the same requests in the same order every time (the
// planner records them: model/reserve_plan.hpp), which is what static memory planners (llm.c's
// one activation block, TVM's and XLA's buffer assignment) use too.
//
// The sequence has two parts: a prefix made once and kept (weights, gradients, optimizer state),
// and a cycle repeated for ever (one optimizer step and one evaluation), whose blocks are all
// freed inside the cycle. Offsets come from a greedy placement by size (largest first, lowest
// offset whose bytes no block alive at the same time uses), which lands within a few percent of
// the most bytes ever alive at once for a training step's chain-shaped lifetimes; the extent
// is stated, so the plan's reserve stays exact either way.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "membound/core/config.hpp"
#include "membound/core/error.hpp"
#include "membound/memory/allocator.hpp"
#include "membound/core/memory_tag.hpp"

MEMBOUND_NAMESPACE_BEGIN

// One request of a recorded sequence: the allocation of block `id` (bytes, tag), or its free.
struct recorded_request {
  std::uint32_t id = 0;
  bool free = false;
  std::size_t bytes = 0;
  memory_tag tag = memory_tag::other;
  friend constexpr bool operator==(const recorded_request&, const recorded_request&) = default;
};

struct planned_slot {
  std::size_t bytes = 0;
  memory_tag tag = memory_tag::other;
  std::size_t offset = 0;  // from the start of its part's segment
  friend constexpr bool operator==(const planned_slot&, const planned_slot&) = default;
};

struct memory_layout {
  // Every slot starts on this boundary (a multiple of default_alignment and of 512).
  static constexpr std::size_t slot_alignment = 512;
  std::vector<planned_slot> prefix;  // in request order
  std::vector<planned_slot> cycle;   // in request order
  std::size_t prefix_extent = 0;     // bytes of the prefix's segment
  std::size_t cycle_extent = 0;      // bytes of the cycle's segment
  std::size_t cycle_live_peak = 0;   // most slot bytes alive at once in the cycle (the extent's floor)
  // The first repeat_slots slots of the cycle are served `repeats` times in a row before the rest
  // (a step's identical micro-batches): the layout of one stands for all of them.
  std::size_t repeat_slots = 0, repeats = 1;
  // The cycle's last tail_slots slots are one evaluation micro-batch (a run's tail), which a
  // caller may repeat: caching_allocator::restart_tail points the cursor at them.
  std::size_t tail_slots = 0;
  friend bool operator==(const memory_layout&, const memory_layout&) = default;
};

namespace detail {
inline std::size_t slot_bytes(std::size_t bytes) {
  if (bytes > std::numeric_limits<std::size_t>::max() / 2) {
    throw invalid_argument("request bytes", "a size an address range can hold", std::to_string(bytes),
                           "Check the size computation that produced this request");
  }
  return align_up(bytes, memory_layout::slot_alignment);
}
}  // namespace detail

// prefix: allocations only (kept for the whole run). cycle: every allocation freed again inside
// it. Throws invalid_argument naming the request that breaks either rule.
inline memory_layout make_layout(std::span<const recorded_request> prefix, std::span<const recorded_request> cycle) {
  memory_layout l;
  for (std::size_t k = 0; k < prefix.size(); ++k) {
    const recorded_request& q = prefix[k];
    if (q.free) {
      throw invalid_argument("prefix[" + std::to_string(k) + "]", "an allocation (the prefix is kept for the run)",
                             "a free", "Put blocks that are freed again into the cycle");
    }
    if (q.bytes == 0) continue;
    l.prefix.push_back({q.bytes, q.tag, l.prefix_extent});
    l.prefix_extent += detail::slot_bytes(q.bytes);
  }
  // Lifetimes in request-index time: [alloc, free).
  struct life {
    std::size_t bytes, size, from, to, order;
  };
  std::vector<life> lives;
  std::vector<std::size_t> slot_of;  // id -> index into lives
  for (std::size_t k = 0; k < cycle.size(); ++k) {
    const recorded_request& q = cycle[k];
    if (q.id >= slot_of.size()) slot_of.resize(q.id + 1, SIZE_MAX);
    if (!q.free) {
      if (slot_of[q.id] != SIZE_MAX && lives[slot_of[q.id]].to == SIZE_MAX) {
        throw invalid_argument("cycle[" + std::to_string(k) + "]", "a new block id", "block " + std::to_string(q.id) + " again while live",
                               "Record the sequence with request_recorder");
      }
      slot_of[q.id] = lives.size();
      lives.push_back({q.bytes, detail::slot_bytes(q.bytes), k, SIZE_MAX, lives.size()});
      l.cycle.push_back({q.bytes, q.tag, 0});
    } else {
      if (slot_of[q.id] == SIZE_MAX || lives[slot_of[q.id]].to != SIZE_MAX) {
        throw invalid_argument("cycle[" + std::to_string(k) + "]", "the free of a live block",
                               "block " + std::to_string(q.id), "Record the sequence with request_recorder");
      }
      lives[slot_of[q.id]].to = k;
    }
  }
  std::size_t live = 0;
  for (std::size_t k = 0; k < cycle.size(); ++k) {
    const life& f = lives[slot_of[cycle[k].id]];
    if (f.to == SIZE_MAX) {
      throw invalid_argument("cycle", "every block freed inside the cycle",
                             "block " + std::to_string(cycle[k].id) + " still live at its end",
                             "Keep long-lived blocks in the prefix");
    }
    live = cycle[k].free ? live - f.size : live + f.size;
    l.cycle_live_peak = std::max(l.cycle_live_peak, live);
  }
  // Largest first, then earliest: the big activations settle low and small workspaces fill gaps.
  std::vector<std::size_t> order(lives.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return lives[a].size != lives[b].size ? lives[a].size > lives[b].size : lives[a].from < lives[b].from;
  });
  std::vector<std::size_t> offset(lives.size(), 0);
  std::vector<std::size_t> placed;
  std::vector<std::pair<std::size_t, std::size_t>> busy;  // [offset, end) of overlapping placed blocks
  for (std::size_t i : order) {
    const life& f = lives[i];
    busy.clear();
    for (std::size_t j : placed) {
      const life& g = lives[j];
      if (g.from < f.to && f.from < g.to) busy.push_back({offset[j], offset[j] + g.size});
    }
    std::sort(busy.begin(), busy.end());
    std::size_t at = 0;
    for (const auto& [b, e] : busy) {
      if (b >= at + f.size) break;  // the gap below this block holds f
      at = std::max(at, e);
    }
    offset[i] = at;
    placed.push_back(i);
    l.cycle_extent = std::max(l.cycle_extent, at + f.size);
  }
  for (std::size_t i = 0; i < lives.size(); ++i) l.cycle[lives[i].order].offset = offset[i];
  return l;
}

// The layout of a cycle that is `span` `repeats` times, then `rest`, where `span` gives back every
// block it takes: the span is placed once and its slots serve every copy (memory_layout::
// repeat_slots, repeats), and the rest is placed on its own, over the same bytes, since no block
// of the span outlives it. Its cost and size are the span's and the rest's, whatever `repeats`.
inline memory_layout make_layout(std::span<const recorded_request> prefix, std::span<const recorded_request> span,
                                 std::size_t repeats, std::span<const recorded_request> rest) {
  if (repeats == 0 || span.empty()) return make_layout(prefix, rest);
  memory_layout l = make_layout(prefix, span);
  const memory_layout r = make_layout({}, rest);
  l.repeat_slots = l.cycle.size();
  l.repeats = repeats;
  l.cycle.insert(l.cycle.end(), r.cycle.begin(), r.cycle.end());
  l.cycle_extent = std::max(l.cycle_extent, r.cycle_extent);
  l.cycle_live_peak = std::max(l.cycle_live_peak, r.cycle_live_peak);
  return l;
}

// The first layer of an allocator stack that can take a layout and was asked to
// (caching_options::planned), found through the layers' upstream(); nullptr when there is none.
template <typename A>
auto planned_layer(A& a) noexcept {
  if constexpr (requires { a.set_layout(memory_layout{}); a.planned(); }) {
    return a.planned() ? &a : nullptr;
  } else if constexpr (requires { a.upstream(); }) {
    return planned_layer(a.upstream());
  } else {
    return nullptr;
  }
}
// Whether some layer of A's stack can take a layout (then planned_layer returns a pointer to it).
template <typename A>
inline constexpr bool has_planned_layer =
    !std::is_null_pointer_v<decltype(planned_layer(std::declval<A&>()))>;

MEMBOUND_NAMESPACE_END
