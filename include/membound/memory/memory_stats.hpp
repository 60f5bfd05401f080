// The statistics every allocator reports, and the tracker that keeps them.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "membound/core/config.hpp"
#include "membound/core/memory_tag.hpp"

MEMBOUND_NAMESPACE_BEGIN

struct tag_usage {
  std::size_t current = 0;  // requested bytes live now
  std::size_t peak = 0;     // highest value of current
  friend constexpr bool operator==(const tag_usage&, const tag_usage&) = default;
};

// Three levels of bytes, because each answers a different question:
//   requested - what callers asked for; this is what the planner predicts exactly.
//   allocated - what live blocks occupy after rounding to size classes.
//   reserved  - what the allocator holds from its upstream (or has committed); the real footprint.
struct memory_stats {
  std::size_t requested = 0, peak_requested = 0;
  std::size_t allocated = 0, peak_allocated = 0;
  std::size_t reserved = 0, peak_reserved = 0;
  std::uint64_t allocations = 0;             // successful allocate() calls
  std::uint64_t deallocations = 0;           // deallocate() calls
  std::uint64_t failed_allocations = 0;      // allocate() calls that threw
  std::uint64_t upstream_allocations = 0;    // calls that grew the reserve (upstream allocate / commit)
  std::uint64_t upstream_deallocations = 0;  // calls that shrank it (upstream free / decommit)
  std::size_t largest_free_block = 0;        // largest block servable without growing the reserve
  std::array<tag_usage, memory_tag_count> tags{};

  constexpr std::size_t free_bytes() const noexcept {
    return reserved > allocated ? reserved - allocated : 0;
  }
  constexpr std::uint64_t upstream_calls() const noexcept {
    return upstream_allocations + upstream_deallocations;
  }
  // 0 when all free bytes are one block; close to 1 when they are scattered in small holes.
  constexpr double fragmentation() const noexcept {
    const std::size_t f = free_bytes();
    if (f == 0) return 0.0;
    return 1.0 - static_cast<double>(std::min(largest_free_block, f)) / static_cast<double>(f);
  }
  constexpr const tag_usage& tag(memory_tag t) const noexcept { return tags[index_of(t)]; }
  // Field by field, so tests can say "nothing changed" in one comparison.
  friend constexpr bool operator==(const memory_stats&, const memory_stats&) = default;
};

// Owned by each allocator; the allocator calls it at every event so stats() is O(1).
class stats_tracker {
 public:
  constexpr void on_allocate(std::size_t requested, std::size_t allocated, memory_tag tag) noexcept {
    s_.requested += requested;
    s_.allocated += allocated;
    s_.peak_requested = std::max(s_.peak_requested, s_.requested);
    s_.peak_allocated = std::max(s_.peak_allocated, s_.allocated);
    tag_usage& u = s_.tags[index_of(tag)];
    u.current += requested;
    u.peak = std::max(u.peak, u.current);
    ++s_.allocations;
  }
  constexpr void on_deallocate(std::size_t requested, std::size_t allocated, memory_tag tag) noexcept {
    s_.requested -= requested;
    s_.allocated -= allocated;
    s_.tags[index_of(tag)].current -= requested;
    ++s_.deallocations;
  }
  constexpr void on_failure() noexcept { ++s_.failed_allocations; }
  constexpr void on_reserve(std::size_t bytes) noexcept {
    s_.reserved += bytes;
    s_.peak_reserved = std::max(s_.peak_reserved, s_.reserved);
    ++s_.upstream_allocations;
  }
  constexpr void on_release(std::size_t bytes) noexcept {
    s_.reserved -= bytes;
    ++s_.upstream_deallocations;
  }
  constexpr void set_largest_free_block(std::size_t bytes) noexcept { s_.largest_free_block = bytes; }
  // Peaks restart from the current values, e.g. at the start of a measured training step.
  constexpr void reset_peaks() noexcept {
    s_.peak_requested = s_.requested;
    s_.peak_allocated = s_.allocated;
    s_.peak_reserved = s_.reserved;
    for (auto& t : s_.tags) t.peak = t.current;
  }
  constexpr const memory_stats& stats() const noexcept { return s_; }
  // The current values (no peaks, no counters): the part of the statistics an allocator's next
  // decisions can depend on (allocator_state_key in memory/shadow.hpp).
  void append_state(std::vector<std::uint64_t>& out) const {
    out.insert(out.end(), {s_.requested, s_.allocated, s_.reserved, s_.largest_free_block});
    for (const tag_usage& t : s_.tags) out.push_back(t.current);
  }

 private:
  memory_stats s_{};
};

MEMBOUND_NAMESPACE_END
