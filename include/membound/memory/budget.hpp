// The budget adaptor: a hard cap on the real footprint of the allocator stack below it.
//
// The footprint is what the process actually holds: the upstream's reserved bytes (live blocks,
// cached blocks, rounding, holes) plus external bytes that something outside membound holds but
// that share the same memory. Capping requested bytes would let a caching upstream overshoot by
// its whole cache, so the budget asks the upstream how much its reserve would grow (growth_for)
// and refuses before any upstream call.
//
//   budget_allocator<caching_allocator<>> a(8ull << 30);  // 8 GiB, caching below
//   void* p = a.allocate(n, 256, memory_tag::activations);  // throws out_of_memory over budget
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "membound/core/config.hpp"
#include "membound/core/error.hpp"
#include "membound/core/format.hpp"
#include "membound/memory/allocator.hpp"
#include "membound/memory/stream.hpp"
#include "membound/memory/memory_stats.hpp"
#include "membound/core/memory_tag.hpp"

MEMBOUND_NAMESPACE_BEGIN

namespace detail {

// The hint that ends a budget's out-of-memory report: which policy to change and by how much.
// `usage` is reserved + external when the request was refused.
inline std::string budget_hint(const oom_report& r, std::size_t usage) {
  if (r.growth_needed == std::numeric_limits<std::size_t>::max()) {
    return "no allocator can serve " + format_bytes(r.requested) +
           ": check the size computation that produced this request (an overflow or a negative "
           "size converted to std::size_t)";
  }
  const std::size_t need = saturating_sub(r.growth_needed, r.free_under_budget);
  const std::string raise =
      "or raise the budget to at least " + format_bytes(saturating_add(usage, r.growth_needed));

  // The cache was already released, so these free bytes are stranded in segments that still hold
  // live blocks. When they would cover the shortfall, freeing live memory is not what helps; a
  // policy that does not strand them is.
  if (need != 0 && r.reserved_unallocated >= need) {
    const std::string stranded = "fragmentation: " + format_bytes(r.reserved_unallocated) +
                                 " are reserved but unallocated (at least the " +
                                 format_bytes(need) + " that must be freed), yet ";
    const std::string fix =
        "; switch the allocator policy to expandable_arena, which maps pages on demand so free "
        "holes are not stranded inside segments, ";
    if (r.largest_free_block < r.requested) {
      return stranded + "the largest free block is " + format_bytes(r.largest_free_block) +
             " and cannot hold the " + format_bytes(r.requested) + " request" + fix + raise;
    }
    return stranded + "the upstream would not serve the " + format_bytes(r.requested) +
           " request from them (its largest free block, " + format_bytes(r.largest_free_block) +
           ", is kept for another size class)" + fix + raise;
  }

  // Otherwise point at whoever holds the most bytes.
  memory_tag top = memory_tag::other;
  std::size_t top_bytes = 0;
  for (memory_tag t : all_memory_tags) {
    if (r.tag_current[index_of(t)] > top_bytes) {
      top = t;
      top_bytes = r.tag_current[index_of(t)];
    }
  }
  const std::string free_need = "free at least " + format_bytes(need);
  if (r.external > top_bytes) {
    return "external memory (held outside membound) is the largest holder at " +
           format_bytes(r.external) + ": " + free_need +
           " of it (another library's cache, foreign allocations), " + raise;
  }
  if (top_bytes == 0) {
    return "the request alone needs " + format_bytes(r.growth_needed) +
           " of new reserve but only " + format_bytes(r.free_under_budget) +
           " is free under the budget: split the work with a chunking policy (smaller "
           "tiles/chunks) so no single request needs more, " +
           raise;
  }
  const std::string held =
      std::string(to_string(top)) + " hold the most, " + format_bytes(top_bytes) + ": ";
  switch (top) {
    case memory_tag::activations:
      return held + free_need +
             " with a stricter recompute schedule (e.g. `full`, or `every<K>` with a smaller K), " +
             raise;
    case memory_tag::workspace:
      return held + free_need + " with a chunking policy that uses smaller tiles/chunks, " + raise;
    case memory_tag::weights:
    case memory_tag::gradients:
    case memory_tag::optimizer: {
      const std::size_t half = top_bytes / 2;
      return held + free_need +
             " with a precision policy that stores them in bf16 (halves them, freeing about " +
             format_bytes(half) + (half >= need ? ", enough" : ", not enough on its own") +
             ") or use a smaller model, " + raise;
    }
    case memory_tag::other:
      break;
  }
  return held + free_need + " of what holds it (tag those allocations so plans can see them), " +
         raise;
}

}  // namespace detail

// The budget adaptor (see the file comment): every byte of Upstream's reserve, plus the external
// bytes, stays within `limit`.
template <typename Upstream>
class budget_allocator {
  static_assert(check_allocator<Upstream>());
  // Refusing *before* the upstream call is what makes the cap hard: a budget that learned of the
  // growth afterwards would already have crossed it (and its peak statistics would show that).
  static_assert(reports_growth<Upstream>,
                "membound: budget_allocator needs an upstream that predicts its growth: give it a "
                "member `std::size_t growth_for(std::size_t bytes, std::size_t alignment) const` "
                "returning exactly how many bytes its reserve would grow by (0 when a free block "
                "fits), as system_allocator, caching_allocator and expandable_arena do.");

 public:
  // Host or device: the upstream's memory.
  static constexpr memory_space space = Upstream::space;

  // The upstream is built in place: allocators own statistics and are usually not movable.
  template <typename... Args>
  explicit budget_allocator(std::size_t limit, Args&&... upstream_args)
      : limit_(checked_limit(limit)), upstream_(std::forward<Args>(upstream_args)...) {
    push_reserve_limit();
  }

  budget_allocator(const budget_allocator&) = delete;
  budget_allocator& operator=(const budget_allocator&) = delete;

  // Refuses (out_of_memory, nothing allocated) when the reserve would have to grow past the
  // budget even after the upstream's cache was released.
  //
  // An upstream whose growth_for is wrong is caught after the call: the block is given back and
  // the refusal says so. Live state is then as before, but the upstream's statistics keep the
  // record of the attempt (its call counts, and a peak that crossed the budget): they are true.
  //
  // `stream` reaches a stream-ordered upstream (caching_allocator over device memory); over any
  // other upstream only host_stream is accepted.
  void* allocate(std::size_t bytes, std::size_t alignment = default_alignment,
                 memory_tag tag = memory_tag::other, stream_id stream = host_stream) {
    detail::check_alignment(alignment, detail::max_alignment_of<Upstream>(), "budget_allocator");
    detail::check_tag(tag);
    if (bytes == 0) return detail::allocate_on(upstream_, 0, alignment, tag, stream, "budget_allocator");

    std::size_t growth = detail::growth_on(upstream_, bytes, alignment, stream, "budget_allocator");
    if (growth == std::numeric_limits<std::size_t>::max()) {
      // No reserve could serve it (the upstream's marker): the size itself is the bug, so no
      // policy advice, and no reason to drop the cache.
      refuse(bytes, growth, usage(), {});
    }
    if (growth > headroom()) {
      if constexpr (caching_allocator_like<Upstream>) {
        upstream_.release_cached();  // cached bytes count against the budget: drop them first
        growth = detail::growth_on(upstream_, bytes, alignment, stream, "budget_allocator");
      }
      if (growth > headroom()) refuse(bytes, growth, usage(), {});
    }

    const std::size_t usage_before = usage();
    const std::size_t reserved_before = reserved();
    void* p = detail::allocate_on(upstream_, bytes, alignment, tag, stream, "budget_allocator");
    if (usage() > limit_) {
      // The upstream grew more than it said: give the block back so the cap still holds.
      const std::size_t grew = detail::saturating_sub(reserved(), reserved_before);
      upstream_.deallocate(p, bytes, alignment, tag);
      if constexpr (caching_allocator_like<Upstream>) upstream_.release_cached();
      std::string why = "upstream growth_for(" + std::to_string(bytes) + ", " +
                        std::to_string(alignment) + ") was wrong: it predicted " +
                        format_bytes(growth) + " of new reserve but the reserve grew by " +
                        format_bytes(grew) + "; the block was given back";
      refuse(bytes, grew, usage_before, std::move(why));
    }
    return p;
  }

  // Gives the block back to the upstream: the same bytes, alignment and tag as allocate.
  void deallocate(void* p, std::size_t bytes, std::size_t alignment = default_alignment,
                  memory_tag tag = memory_tag::other) noexcept(noexcept(
      std::declval<Upstream&>().deallocate(p, bytes, alignment, tag))) {
    upstream_.deallocate(p, bytes, alignment, tag);
  }

  // The upstream's statistics; failed_allocations also counts the budget's own refusals.
  memory_stats stats() const {
    memory_stats s = upstream_.stats();
    s.failed_allocations += refusals_;
    return s;
  }

  // The cap on usage(), in bytes.
  std::size_t limit() const noexcept { return limit_; }

  // Lowering the limit below what is held would break the invariant at once, so it is refused.
  void set_limit(std::size_t bytes) {
    checked_limit(bytes);
    const std::size_t used = usage();
    if (bytes < used) {
      const std::size_t cached = upstream_.stats().free_bytes();
      throw invalid_argument(
          "limit", "at least the current usage " + format_bytes(used),
          format_bytes(bytes),
          "Free " + format_bytes(used - bytes) + " first (release_cached() would return up to " +
              format_bytes(cached) + " of cached reserve), then lower the limit");
    }
    limit_ = bytes;
    push_reserve_limit();
  }

  // Bytes held outside this allocator (another library, a foreign allocation) that share its
  // memory. Raising them past the budget releases the upstream's cache first, like allocate does,
  // then throws out_of_memory with the external value unchanged.
  void set_external(std::size_t bytes) {
    if (bytes > external_) {
      const std::size_t growth = bytes - external_;
      if (growth > headroom()) {
        if constexpr (caching_allocator_like<Upstream>) upstream_.release_cached();
        if (growth > headroom()) {
          oom_report r = make_report(growth, growth, usage(), {});
          r.source = "budget (external bytes)";
          throw out_of_memory(std::move(r));
        }
      }
    }
    external_ = bytes;
    push_reserve_limit();
  }
  // Bytes last given to set_external.
  std::size_t external() const noexcept { return external_; }

  // The real footprint: everything the stack below holds plus the external bytes.
  std::size_t usage() const { return detail::saturating_add(reserved(), external_); }
  // How far usage() may still grow: limit() − usage(), 0 at or over the cap.
  std::size_t headroom() const { return detail::saturating_sub(limit_, usage()); }

  // Frees the upstream's cache of free blocks; until then they count in usage().
  void release_cached() requires caching_allocator_like<Upstream> { upstream_.release_cached(); }

  // Forwarded, so that budgets stack: an outer budget asks through an inner one.
  std::size_t growth_for(std::size_t bytes, std::size_t alignment,
                         stream_id stream = host_stream) const
    requires reports_growth<Upstream>
  {
    return detail::growth_on(upstream_, bytes, alignment, stream, "budget_allocator");
  }
  // Non-const: polls a stream-ordered upstream's pending blocks, as allocate's own check does.
  std::size_t growth_for(std::size_t bytes, std::size_t alignment, stream_id stream = host_stream)
    requires reports_growth<Upstream>
  {
    return detail::growth_on(upstream_, bytes, alignment, stream, "budget_allocator");
  }
  // A live block is also used on `stream`: its reuse waits for that stream's work (see
  // caching_allocator::record_stream).
  void record_stream(void* p, stream_id stream) requires stream_ordered_allocator<Upstream> {
    upstream_.record_stream(p, stream);
  }

  // Restarts the upstream's peak statistics from the current values.
  void reset_peaks() requires detail::has_reset_peaks<Upstream> { upstream_.reset_peaks(); }

  // From a budget stacked above: the reserve below must also stay under its ceiling.
  void set_reserve_limit(std::size_t bytes) noexcept {
    outer_reserve_limit_ = bytes;
    push_reserve_limit();
  }

  // This layer's state that decides its next answers (allocator_state_key, memory/shadow.hpp).
  void append_state(std::vector<std::uint64_t>& out) const {
    out.insert(out.end(), {limit_, external_, outer_reserve_limit_});
  }
  // The allocator below. Allocating through it directly bypasses the cap; use it to inspect.
  Upstream& upstream() noexcept { return upstream_; }
  // The same, read only.
  const Upstream& upstream() const noexcept { return upstream_; }

 private:
  static std::size_t checked_limit(std::size_t bytes) {
    if (bytes == 0) {
      throw invalid_argument("limit", "a budget above 0 bytes", "0",
                             "Pass the bytes this stack may hold, e.g. 8ull << 30 for 8 GiB");
    }
    return bytes;
  }

  std::size_t reserved() const { return upstream_.stats().reserved; }

  // Tells a caching upstream how far it may grow, so that it shrinks a segment rather than
  // cross the budget with one (see caching_allocator::set_reserve_limit).
  void push_reserve_limit() noexcept {
    if constexpr (detail::has_reserve_limit<Upstream>) {
      upstream_.set_reserve_limit(
          std::min(detail::saturating_sub(limit_, external_), outer_reserve_limit_));
    }
  }

  // `used` is the footprint the refused request was measured against.
  oom_report make_report(std::size_t requested, std::size_t growth, std::size_t used,
                         std::string detail) const {
    oom_report r;
    r.source = "budget";
    r.requested = requested;
    r.growth_needed = growth;
    r.budget = limit_;
    r.free_under_budget = detail::saturating_sub(limit_, used);
    r.external = external_;
    fill_usage(r, upstream_.stats());
    r.detail = std::move(detail);
    r.hint = detail::budget_hint(r, used);
    return r;
  }

  [[noreturn]] void refuse(std::size_t requested, std::size_t growth, std::size_t used,
                           std::string detail) {
    oom_report r = make_report(requested, growth, used, std::move(detail));
    ++refusals_;
    throw out_of_memory(std::move(r));
  }

  std::size_t limit_;
  std::size_t external_ = 0;
  std::size_t outer_reserve_limit_ = std::numeric_limits<std::size_t>::max();
  std::uint64_t refusals_ = 0;
  Upstream upstream_;
};

MEMBOUND_NAMESPACE_END
