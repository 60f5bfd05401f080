// The caching allocator policy: keeps memory it got from its upstream in segments and serves
// later requests from them, so a training loop that repeats the same allocations stops calling
// the upstream (cudaMalloc, operator new) after its first step.
//
// Design, after PyTorch's CUDA caching allocator (our own implementation):
//   * requests round up to a 512-byte granule, optionally to power-of-two divisions above 1 MiB;
//   * a small pool (requests <= 1 MiB, 2 MiB segments) and a large pool (requests < 10 MiB share
//     20 MiB segments, larger ones get a segment of their own rounded to 2 MiB). The pools never
//     share a segment, so long-lived small tensors cannot pin down large segments;
//   * placement: the oldest segment with a fitting free block, best fit by (size, address)
//     inside it (block_pool.hpp explains why: a repeated training step then makes no upstream
//     call after its first pass); split when the remainder is worth keeping; coalesce on free;
//   * when the upstream runs out, release the cache and retry once before giving up;
//   * stream-ordered (memory/stream.hpp): a block belongs to the stream it was allocated on,
//     segments and free blocks are per stream (blocks never coalesce across streams), and a
//     freed block is reusable at once on its own stream, where later work is ordered after the
//     work that used it. record_stream(p, s) marks a live block as used on another stream too;
//     freeing it then records an event on each such stream, and the block stays *pending* (not
//     reusable, its segment not releasable) until every event is done. process_events() polls;
//     allocate polls before it grows the reserve. Host upstreams (no events) use host_stream
//     and see no difference.
//
// Threading: not thread-safe. Use one allocator per thread or stream (as llm.c does), or put a
// lock around it.
//
// The bookkeeping lives on the host and never reads or writes block memory, so the same class
// caches device memory when Upstream::space is memory_space::device.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <cstdio>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "membound/core/config.hpp"
#include "membound/core/error.hpp"
#include "membound/core/format.hpp"
#include "membound/memory/allocator.hpp"
#include "membound/memory/detail/block_pool.hpp"
#include "membound/memory/memory_stats.hpp"
#include "membound/core/memory_tag.hpp"
#include "membound/memory/planned_layout.hpp"
#include "membound/memory/stream.hpp"
#include "membound/memory/system_allocator.hpp"

MEMBOUND_NAMESPACE_BEGIN

// Tuning knobs of caching_allocator. The defaults are PyTorch's, which are tuned for training.
// All sizes are in bytes; the constructor rejects inconsistent values with invalid_argument
// naming the field.
struct caching_options {
  // Requests up to this size go to the small pool. Multiple of 512, at most small_segment_size.
  std::size_t small_request_limit = std::size_t{1} << 20;  // 1 MiB
  // Segment size of the small pool. Multiple of 512.
  std::size_t small_segment_size = std::size_t{2} << 20;  // 2 MiB
  // Large requests below this size share large_segment_size segments; from this size on a
  // request gets a segment of its own. At most large_segment_size.
  std::size_t large_segment_limit = std::size_t{10} << 20;  // 10 MiB
  // Segment size shared by large requests below large_segment_limit. Multiple of 512.
  std::size_t large_segment_size = std::size_t{20} << 20;  // 20 MiB
  // A request of its own segment is rounded up to a multiple of this. Power of two, >= 512.
  std::size_t segment_rounding = std::size_t{2} << 20;  // 2 MiB
  // Small pool: split a block when the remainder is at least this many bytes.
  std::size_t small_split_min = 512;
  // Large pool: split a block only when the remainder is larger than this. Keeping remainders
  // of up to 1 MiB inside the block avoids slivers that no large request can use.
  std::size_t large_split_above = std::size_t{1} << 20;  // 1 MiB
  // 0 = off. Otherwise a power of two N: large requests round up to the next of N equal steps
  // between the enclosing powers of two (with 4, 1.3 MiB becomes 1.5 MiB). Fewer distinct sizes
  // make blocks reusable across steps whose sizes vary a little, at the cost of some padding.
  std::size_t roundup_power2_divisions = 0;
  // Alignment passed to the upstream for each segment. Power of two, >= 512, so that every
  // block (a multiple of 512 bytes from the segment start) is 512-aligned.
  std::size_t segment_alignment = 512;
  // Planned mode: a trainer (or any caller with a known, repeating request sequence) hands the
  // allocator a memory_layout (set_layout); requests that follow it are served from two segments
  // of exactly the layout's extents, at the layout's offsets, and the reserve is the layout's
  // size instead of size classes and shared segments. Requests that do not follow it take the
  // ordinary path, so a wrong layout costs memory, never correctness.
  bool planned = false;
};

// The caching allocator (see the file comment): segments from Upstream, tuned by caching_options.
template <typename Upstream = system_allocator>
class caching_allocator {
  static_assert(check_allocator<Upstream>());

 public:
  // Host or device: the upstream's memory.
  static constexpr memory_space space = Upstream::space;
  // Every block size is a multiple of this, and every block starts on it.
  static constexpr std::size_t block_granule = 512;
  // The largest alignment allocate accepts: every block starts on a granule.
  static constexpr std::size_t max_alignment = block_granule;

  caching_allocator() : caching_allocator(caching_options{}) {}  // not explicit: `= {}` works
  // Builds the upstream in place from upstream_args; inconsistent opts throw invalid_argument.
  template <typename... Args>
  explicit caching_allocator(caching_options opts, Args&&... upstream_args)
      : opts_(validated(opts)), upstream_(std::forward<Args>(upstream_args)...) {}

  caching_allocator(const caching_allocator&) = delete;
  caching_allocator& operator=(const caching_allocator&) = delete;

  // Gives every segment back to the upstream. Blocks still allocated at this point are a bug in
  // the caller; their segments are freed anyway so leak checkers stay quiet about the cache.
  ~caching_allocator() {
    if constexpr (stream_event_source<Upstream>) {
      // Pending blocks may still be in use by another stream: wait for their events before the
      // segments go back (a failed query stops the wait, there is nothing else to do here).
      for (auto& [addr, u] : uses_) {
        for (const event_id e : u.events) {
          try {
            while (!upstream_.event_done(e)) {
            }
          } catch (...) {
          }
          upstream_.destroy_event(e);
        }
      }
    }
    if (plan_) {
      plan_->live.clear();
      release_planned(false);
    }
    auto give_back = [this](detail::block_pool::segment& s) noexcept {
      upstream_.deallocate(s.ptr(), s.size, opts_.segment_alignment, s.tag);
    };
    small_.remove_all_segments(give_back);
    large_.remove_all_segments(give_back);
  }

  // Serves `bytes` aligned to `alignment` (a power of two <= 512). Returns nullptr for 0 bytes.
  // Throws invalid_argument for a bad alignment or tag, out_of_memory when the upstream fails even
  // after the cache was released. On any throw the live blocks and the statistics of live memory
  // are unchanged (the retry may have released cached segments, which is the point of it).
  //
  // `stream` is where the block will be used (host_stream for host memory): it is served from
  // that stream's free blocks only. In planned mode, with a layout set, only the layout's stream
  // is accepted (invalid_argument naming `stream` otherwise).
  void* allocate(std::size_t bytes, std::size_t alignment = default_alignment,
                 memory_tag tag = memory_tag::other, stream_id stream = host_stream) {
    detail::check_alignment(alignment, max_alignment, "caching_allocator");
    detail::check_tag(tag);
    if (bytes == 0) return nullptr;
    if (plan_) {
      check_planned_stream(stream);
      if (void* p = planned_allocate(bytes, alignment, tag)) return p;
    }
    try {
      if (bytes > max_request) throw_too_large(bytes);
      const std::size_t size = round_size(bytes);
      detail::block_pool& pool = pool_for(size);
      detail::block_pool::block* b = pool.best_fit(size, stream);
      if (b == nullptr && pending_blocks_ != 0) {
        process_events();  // a pending block whose streams are done beats a new segment
        b = pool.best_fit(size, stream);
      }
      detail::block_pool::segment* fresh = nullptr;
      if (b == nullptr) {
        fresh = new_segment(pool, bytes, segment_size_for(size), tag, stream);
        b = fresh->first;
      }
      try {
        b = pool.allocate_block(b, size, split_min_for(pool), bytes, alignment, tag);
      } catch (...) {
        if (fresh != nullptr) {
          upstream_.deallocate(fresh->ptr(), fresh->size, opts_.segment_alignment, fresh->tag);
          pool.remove_segment(fresh);
        }
        throw;
      }
      // Statistics change only once nothing can fail any more.
      if (fresh != nullptr) stats_.on_reserve(fresh->size);
      stats_.on_allocate(bytes, b->size, tag);
      update_largest();
      return b->ptr();
    } catch (...) {
      stats_.on_failure();
      throw;
    }
  }

  // Sized deallocation: p, bytes, alignment and tag must be exactly what allocate got and
  // returned. Anything else throws invalid_argument naming the argument, with no change.
  // nullptr with 0 bytes is a no-op. A block marked with record_stream becomes pending (see the
  // top of the file); its allocated bytes leave the statistics now, as for any other block.
  void deallocate(void* p, std::size_t bytes, std::size_t alignment = default_alignment,
                  memory_tag tag = memory_tag::other) {
    if (p == nullptr && bytes == 0) return;
    if (plan_ && planned_deallocate(p, bytes, alignment, tag)) return;
    auto [pool, b] = find_live(p);
    stream_uses* uses = nullptr;
    if (!uses_.empty()) {
      if (auto it = uses_.find(reinterpret_cast<std::uintptr_t>(p)); it != uses_.end()) {
        if (it->second.pending) b = nullptr;  // freed already: a double free
        else uses = &it->second;
      }
    }
    detail::check_deallocate(b, p, bytes, alignment, tag, "caching_allocator");
    if (uses != nullptr) {
      record_events(*uses);  // may throw (the upstream's event calls); nothing changed then
      ++pending_blocks_;
      pending_bytes_ += b->size;
      stats_.on_deallocate(b->requested, b->size, b->tag);
      return;
    }
    stats_.on_deallocate(b->requested, b->size, b->tag);
    pool->free_block(b);
    update_largest();
  }

  // Marks the live block p as used on `stream` as well as on the stream it was allocated on, so
  // that deallocate defers its reuse until the work queued on `stream` so far is done. Call it
  // when handing the block to work on another stream; the stream it was allocated on, or a
  // stream already recorded, is a no-op. Upstreams without events (host memory) have nothing to
  // wait for: only p is checked. Planned blocks are bound to the layout's stream (invalid_argument
  // naming `stream` for any other).
  void record_stream(void* p, stream_id stream) {
    if (plan_ && planned_live(p)) {
      check_planned_stream(stream);
      return;
    }
    auto [pool, b] = find_live(p);
    const auto addr = reinterpret_cast<std::uintptr_t>(p);
    auto it = uses_.find(addr);
    if (b == nullptr || (it != uses_.end() && it->second.pending)) {
      throw invalid_argument("p", "a live block of this caching_allocator", address_string(p),
                             "Call record_stream between allocate and deallocate, with the "
                             "pointer allocate returned");
    }
    if constexpr (stream_event_source<Upstream>) {
      if (stream == b->seg->stream) return;
      if (it == uses_.end()) it = uses_.emplace(addr, stream_uses{pool, b, {}, {}, false}).first;
      stream_uses& u = it->second;
      if (std::find(u.streams.begin(), u.streams.end(), stream) != u.streams.end()) return;
      u.streams.push_back(stream);
      u.events.reserve(u.streams.size());  // so deallocate need not allocate for the events
    }
  }

  // Makes every pending block whose events are all done reusable on its stream. Returns how
  // many it made reusable. Throws what the upstream's event query throws (the block then stays
  // pending). allocate calls it before growing the reserve; call it yourself to see the
  // statistics settle, e.g. once per step.
  std::size_t process_events() {
    std::size_t done_blocks = 0;
    if constexpr (stream_event_source<Upstream>) {
      if (pending_blocks_ == 0) return 0;
      try {
        for (auto it = uses_.begin(); it != uses_.end();) {
          stream_uses& u = it->second;
          bool done = u.pending;
          for (std::size_t k = 0; done && k < u.events.size(); ++k) done = upstream_.event_done(u.events[k]);
          if (!done) {
            ++it;
            continue;
          }
          for (const event_id e : u.events) upstream_.destroy_event(e);
          --pending_blocks_;
          pending_bytes_ -= u.b->size;
          u.pool->free_block(u.b);
          it = uses_.erase(it);
          ++done_blocks;
        }
      } catch (...) {
        // The blocks freed before the failing query stay freed: the statistics must show them.
        if (done_blocks != 0) update_largest();
        throw;
      }
      if (done_blocks != 0) update_largest();
    }
    return done_blocks;
  }

  // The stream a live block of the ordinary path was allocated on (its segment's); nullopt for
  // a pointer that is not one (free, foreign, or a planned layout's block: those are on
  // set_layout's stream).
  std::optional<stream_id> block_stream(const void* p) const noexcept {
    const detail::block_pool::block* b = small_.find_live(p);
    if (b == nullptr) b = large_.find_live(p);
    if (b == nullptr) return std::nullopt;
    return b->seg->stream;
  }
  // Freed blocks waiting for other streams' events. They count as reserved, not allocated.
  std::size_t pending_blocks() const noexcept { return pending_blocks_; }
  // The pending blocks' bytes (block sizes).
  std::size_t pending_bytes() const noexcept { return pending_bytes_; }

  // Gives every fully free segment back to the upstream. Live blocks never move.
  // Segments with a pending block stay (their memory may still be in use on another stream);
  // the events are polled first, so those already done do not hold a segment back.
  void release_cached() noexcept {
    try {
      process_events();
    } catch (...) {
      // A failed query leaves its block pending: its segment stays, the safe side.
    }
    if (plan_) release_planned(true);
    auto give_back = [this](detail::block_pool::segment& s) noexcept {
      upstream_.deallocate(s.ptr(), s.size, opts_.segment_alignment, s.tag);
      stats_.on_release(s.size);
    };
    small_.remove_free_segments(give_back);
    large_.remove_free_segments(give_back);
    update_largest();
  }

  // Bytes the next allocate(bytes, alignment, tag, stream) would ask the upstream for: 0 when a
  // free block of the right pool and stream fits, else the size of the new segment. Exact, so a
  // budget can refuse before any upstream call. Saturates to SIZE_MAX for requests that can
  // never be served.
  //
  // With pending blocks, this (non-const) overload polls the events first, as allocate does; an
  // event that completes between the two calls can only make allocate grow less than predicted,
  // never more. The const overload does not poll, so it may over-predict while blocks are pending.
  std::size_t growth_for(std::size_t bytes, std::size_t alignment, stream_id stream = host_stream) {
    if (pending_blocks_ != 0 && bytes != 0 && bytes <= max_request) {
      const std::size_t size = round_size(bytes);
      if (pool_for(size).best_fit(size, stream) == nullptr) process_events();
    }
    return std::as_const(*this).growth_for(bytes, alignment, stream);
  }
  // The same without polling the events: it may over-predict while blocks are pending.
  std::size_t growth_for(std::size_t bytes, std::size_t alignment, stream_id stream = host_stream) const {
    detail::check_alignment(alignment, max_alignment, "caching_allocator");
    if (bytes == 0) return 0;
    if (plan_) {
      check_planned_stream(stream);
      if (const auto m = planned_match(bytes)) return m->segment != nullptr ? 0 : m->extent;
    }
    if (bytes > max_request) return std::numeric_limits<std::size_t>::max();
    const std::size_t size = round_size(bytes);
    if (pool_for(size).best_fit(size, stream) != nullptr) return 0;
    return segment_size_for(size);
  }

  // ---- Planned mode (caching_options::planned) ------------------------------------------------
  // Whether it was made with caching_options::planned, which set_layout requires.
  bool planned() const noexcept { return opts_.planned; }
  // Takes a layout; between steps (no block of the cycle live). The prefix (weights, gradients,
  // optimizer state) cannot change once its blocks exist: a layout with another prefix throws
  // invalid_argument then, and nothing changes. A cycle of another extent gives the old cycle
  // segment back; the new one is taken at its first request.
  //
  // The layout's blocks are used on one stream, `stream`: allocate, growth_for and record_stream
  // refuse any other while a layout is set. The stream can change only when no planned block is
  // live (invalid_argument naming `stream` otherwise).
  void set_layout(memory_layout l, stream_id stream = host_stream) {
    if (!opts_.planned) {
      throw invalid_argument("caching_options::planned", "true to take a layout", "false",
                             "Construct the allocator with caching_options{.planned = true}");
    }
    // The cursor moves within the cycle: its repeated span and its tail must lie inside it.
    for (const auto& [name, slots] : {std::pair{"layout.repeat_slots", l.repeat_slots},
                                      std::pair{"layout.tail_slots", l.tail_slots}}) {
      if (slots > l.cycle.size()) {
        throw invalid_argument(name, "at most the cycle's " + std::to_string(l.cycle.size()) + " slots",
                               std::to_string(slots), "Make the layout with make_layout or run_layout");
      }
    }
    if (l.repeats == 0) {
      throw invalid_argument("layout.repeats", "at least 1", "0", "Make the layout with make_layout or run_layout");
    }
    if (plan_ && stream != plan_->stream && !plan_->live.empty()) {
      throw invalid_argument("stream", "the layout's stream " + std::to_string(plan_->stream) +
                                           " while planned blocks are live",
                             std::to_string(stream),
                             "Give back every planned block before moving the layout to another stream");
    }
    if (plan_) {
      for (const auto& b : plan_->live) {
        if (b.cycle) {
          throw invalid_argument("layout", "no block of the current cycle live", "a live block of " + format_bytes(b.bytes),
                                 "Set the layout between steps, when the step's blocks are given back");
        }
      }
      if (plan_->prefix_next != 0 &&
          (l.prefix != plan_->layout.prefix || l.prefix_extent != plan_->layout.prefix_extent)) {
        throw invalid_argument("layout.prefix", "the prefix already made (" + std::to_string(plan_->layout.prefix.size()) +
                                                    " blocks, " + format_bytes(plan_->layout.prefix_extent) + ")",
                               std::to_string(l.prefix.size()) + " blocks, " + format_bytes(l.prefix_extent),
                               "Give back the prefix's blocks first, or keep the same prefix");
      }
      if (stream != plan_->stream) {
        // No planned block is live (checked above), but work queued on the old stream may still
        // use the segments' bytes: give them back (cudaFree waits for the device) rather than
        // hand them to the new stream at once, which the ordinary path never does either.
        release_planned(true);
      }
      if (plan_->cycle_seg != nullptr && l.cycle_extent != plan_->layout.cycle_extent) {
        upstream_.deallocate(plan_->cycle_seg, plan_->layout.cycle_extent, opts_.segment_alignment, memory_tag::other);
        stats_.on_release(plan_->layout.cycle_extent);
        plan_->cycle_seg = nullptr;
      }
      // A prefix given back entirely (prefix_next is 0 again) keeps its segment until
      // release_cached; a new prefix of another extent must not be placed in it.
      if (plan_->prefix_seg != nullptr && plan_->prefix_next == 0 &&
          l.prefix_extent != plan_->layout.prefix_extent) {
        upstream_.deallocate(plan_->prefix_seg, plan_->layout.prefix_extent, opts_.segment_alignment, memory_tag::other);
        stats_.on_release(plan_->layout.prefix_extent);
        plan_->prefix_seg = nullptr;
      }
      plan_->layout = std::move(l);
      plan_->cursor = 0;
      plan_->round = 0;
    } else {
      plan_.emplace();
      plan_->layout = std::move(l);
    }
    plan_->stream = stream;
    plan_->live.reserve(plan_->layout.prefix.size() + plan_->layout.cycle.size());
  }
  // The layout set_layout took, or nullptr before.
  const memory_layout* layout() const noexcept { return plan_ ? &plan_->layout : nullptr; }
  // Requests served from the layout, and requests that did not follow it (ordinary path).
  std::size_t planned_hits() const noexcept { return plan_ ? plan_->hits : 0; }
  // A step begins: its first request takes the cycle's first slot. Sizes alone cannot tell a step
  // from the evaluation the layout places after the last micro-batch when both begin with a
  // request of one size (ZeRO-3's gathered weights), so the trainer says where a step begins.
  void restart_cycle() noexcept {
    if (plan_) {
      plan_->cursor = 0;
      plan_->round = 0;
    }
  }
  // An evaluation micro-batch begins: its first request takes the first of the layout's tail
  // slots (memory_layout::tail_slots). Without it a second evaluation micro-batch in a row
  // would find the cursor back at the cycle's start, and stray.
  void restart_tail() noexcept {
    if (plan_ && plan_->layout.tail_slots != 0) {
      plan_->cursor = plan_->layout.cycle.size() - plan_->layout.tail_slots;
      plan_->round = 0;
    }
  }

  // A ceiling on reserved bytes, normally set by a budget_allocator above. When the preferred
  // segment (2 MiB or 20 MiB) would cross it, the segment shrinks to the rounded request: near a
  // hard budget, the slack of a shared segment must not decide between fitting and failing.
  // growth_for reports the shrunk size, so the budget's check stays exact.
  void set_reserve_limit(std::size_t bytes) noexcept { reserve_limit_ = bytes; }
  // The ceiling set_reserve_limit set; SIZE_MAX when none was.
  std::size_t reserve_limit() const noexcept { return reserve_limit_; }

  // This layer's state that decides its next answers (allocator_state_key, memory/shadow.hpp):
  // both pools, the current statistics, the limit, stream uses, and the planned layout's place.
  void append_state(std::vector<std::uint64_t>& out) const {
    out.insert(out.end(), {reserve_limit_, uses_.size(), pending_blocks_, pending_bytes_});
    small_.append_state(out);
    large_.append_state(out);
    stats_.append_state(out);
    out.push_back(plan_.has_value());
    if (!plan_) return;
    const planned_state& st = *plan_;
    out.insert(out.end(), {reinterpret_cast<std::uintptr_t>(st.prefix_seg), reinterpret_cast<std::uintptr_t>(st.cycle_seg),
                           st.prefix_next, st.cursor, st.round, st.stream, st.live.size()});
    for (const auto& b : st.live) out.insert(out.end(), {b.p, b.bytes, b.size, b.alignment, std::uint64_t{b.cycle}});
  }

  // requested: sum of callers' bytes; allocated: sum of block sizes (after rounding, including
  // a remainder too small to split off); reserved: segment bytes held from the upstream.
  memory_stats stats() const noexcept { return stats_.stats(); }
  // Restarts the peak statistics from the current values.
  void reset_peaks() noexcept { stats_.reset_peaks(); }

  // The size class a request of `bytes` is served with (bytes > 0).
  std::size_t round_size(std::size_t bytes) const noexcept {
    std::size_t size = align_up(bytes, block_granule);
    if (opts_.roundup_power2_divisions != 0 && size > opts_.small_request_limit) {
      const std::size_t floor = std::bit_floor(size);
      if (floor != size) {
        const std::size_t step = floor / opts_.roundup_power2_divisions;
        size = align_up(size, step > block_granule ? step : block_granule);
      }
    }
    return size;
  }

  // The options it was made with.
  const caching_options& options() const noexcept { return opts_; }
  // The allocator below, where segments come from. Allocating through it bypasses the cache.
  Upstream& upstream() noexcept { return upstream_; }
  // The same, read only.
  const Upstream& upstream() const noexcept { return upstream_; }

  // O(blocks) consistency check of the internal structures, for tests and debugging.
  // Pending blocks are allocated in their pool (not free, not reusable) and counted once.
  bool check_invariants() const noexcept {
    std::size_t blocks = 0, bytes = 0;
    for (const auto& [addr, u] : uses_) {
      if (u.b->addr != addr || u.b->free || u.pool->find_live(u.b->ptr()) != u.b) return false;
      if (u.pending != (u.events.size() == u.streams.size() && !u.streams.empty())) return false;
      if (u.pending) {
        ++blocks;
        bytes += u.b->size;
      }
    }
    return blocks == pending_blocks_ && bytes == pending_bytes_ &&
           small_.check_invariants(block_granule) && large_.check_invariants(block_granule);
  }

 private:
  // Larger requests cannot be rounded without overflow; nothing could serve them anyway.
  static constexpr std::size_t max_request = std::numeric_limits<std::size_t>::max() / 4;

  static caching_options validated(const caching_options& o) {
    auto bad = [](const char* field, const std::string& expected, std::size_t got) {
      throw invalid_argument(std::string("caching_options::") + field, expected,
                             std::to_string(got), "Fix the field or keep its default");
    };
    auto granular = [](std::size_t v) { return v != 0 && v % block_granule == 0; };
    if (!granular(o.small_segment_size))
      bad("small_segment_size", "a nonzero multiple of 512", o.small_segment_size);
    if (!granular(o.small_request_limit) || o.small_request_limit > o.small_segment_size)
      bad("small_request_limit", "a nonzero multiple of 512 no larger than small_segment_size",
          o.small_request_limit);
    if (!granular(o.large_segment_size))
      bad("large_segment_size", "a nonzero multiple of 512", o.large_segment_size);
    if (o.large_segment_limit > o.large_segment_size)
      bad("large_segment_limit", "at most large_segment_size", o.large_segment_limit);
    if (!is_power_of_two(o.segment_rounding) || o.segment_rounding < block_granule)
      bad("segment_rounding", "a power of two of at least 512", o.segment_rounding);
    if (o.roundup_power2_divisions != 0 && !is_power_of_two(o.roundup_power2_divisions))
      bad("roundup_power2_divisions", "0 (off) or a power of two", o.roundup_power2_divisions);
    if (!is_power_of_two(o.segment_alignment) || o.segment_alignment < block_granule)
      bad("segment_alignment", "a power of two of at least 512", o.segment_alignment);
    if (o.large_split_above == std::numeric_limits<std::size_t>::max())
      bad("large_split_above", "less than SIZE_MAX", o.large_split_above);
    return o;
  }

  detail::block_pool& pool_for(std::size_t size) noexcept {
    return size <= opts_.small_request_limit ? small_ : large_;
  }
  const detail::block_pool& pool_for(std::size_t size) const noexcept {
    return size <= opts_.small_request_limit ? small_ : large_;
  }
  std::size_t split_min_for(const detail::block_pool& pool) const noexcept {
    return &pool == &small_ ? opts_.small_split_min : opts_.large_split_above + 1;
  }
  std::size_t segment_size_for(std::size_t size) const noexcept {
    std::size_t preferred = align_up(size, opts_.segment_rounding);
    if (size <= opts_.small_request_limit) preferred = opts_.small_segment_size;
    else if (size < opts_.large_segment_limit) preferred = opts_.large_segment_size;
    // Under a reserve limit, a segment exactly the size of the request beats a refusal.
    const std::size_t reserved = stats_.stats().reserved;
    if (reserved <= reserve_limit_ && preferred > reserve_limit_ - reserved) return size;
    return preferred;
  }

  // Asks the upstream for a segment; on out_of_memory releases the cache and asks once more.
  // Statistics are updated by the caller once the whole allocation has succeeded.
  detail::block_pool::segment* new_segment(detail::block_pool& pool, std::size_t bytes,
                                           std::size_t seg_bytes, memory_tag tag, stream_id stream) {
    void* p = nullptr;
    try {
      p = upstream_.allocate(seg_bytes, opts_.segment_alignment, tag);
    } catch (const out_of_memory&) {
      release_cached();
      try {
        p = upstream_.allocate(seg_bytes, opts_.segment_alignment, tag);
      } catch (const out_of_memory& again) {
        oom_report r = again.report();  // keeps the upstream's requested, budget and detail
        r.source = "caching_allocator";
        fill_usage(r, stats_.stats());
        r.hint = "a request of " + format_bytes(bytes) + " needed a new segment of " +
                 format_bytes(seg_bytes) + ", which the upstream refused even after the cache " +
                 "was released" + (r.hint.empty() ? std::string{} : "; upstream: " + r.hint) +
                 pending_hint();
        throw out_of_memory(std::move(r));
      }
    }
    try {
      return pool.add_segment(p, seg_bytes, tag, stream);
    } catch (...) {
      upstream_.deallocate(p, seg_bytes, opts_.segment_alignment, tag);
      throw;
    }
  }

  [[noreturn]] void throw_too_large(std::size_t bytes) const {
    oom_report r;
    r.source = "caching_allocator";
    r.requested = bytes;
    r.growth_needed = std::numeric_limits<std::size_t>::max();
    fill_usage(r, stats_.stats());
    r.detail = "the request is larger than any address range can hold";
    r.hint = "check the size computation that produced this request";
    throw out_of_memory(std::move(r));
  }

  std::pair<detail::block_pool*, detail::block_pool::block*> find_live(void* p) noexcept {
    if (auto* b = small_.find_live(p)) return {&small_, b};
    return {&large_, large_.find_live(p)};
  }

  // A block marked with record_stream: the other streams, and once it is freed (pending) one
  // event per stream. Only such blocks have an entry, so the map is empty for one-stream use.
  struct stream_uses {
    detail::block_pool* pool;
    detail::block_pool::block* b;
    std::vector<stream_id> streams;
    std::vector<event_id> events;
    bool pending;
  };

  // Records one event per stream of u; all or nothing, so a throwing upstream leaves u live.
  void record_events(stream_uses& u) {
    if constexpr (stream_event_source<Upstream>) {
      try {
        for (const stream_id s : u.streams) {
          const event_id e = upstream_.create_event();
          u.events.push_back(e);  // reserved by record_stream: cannot throw
          upstream_.record_event(e, s);
        }
      } catch (...) {
        for (const event_id e : u.events) upstream_.destroy_event(e);
        u.events.clear();
        throw;
      }
      u.pending = true;
    }
  }

  void check_planned_stream(stream_id stream) const {
    if (stream != plan_->stream) {
      throw invalid_argument("stream", "the layout's stream " + std::to_string(plan_->stream) +
                                           " (planned mode serves one stream)",
                             std::to_string(stream),
                             "Use the stream given to set_layout, or a caching_allocator without "
                             "planned mode for work on other streams");
    }
  }

  bool planned_live(const void* p) const noexcept {
    const auto at = reinterpret_cast<std::uintptr_t>(p);
    return std::any_of(plan_->live.begin(), plan_->live.end(), [at](const auto& b) { return b.p == at; });
  }

  static std::string address_string(const void* p) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%p", p);
    return buf;
  }

  // Appended to out-of-memory hints: memory that only waits for other streams.
  std::string pending_hint() const {
    if (pending_bytes_ == 0) return {};
    return "; " + format_bytes(pending_bytes_) + " in " + std::to_string(pending_blocks_) +
           " freed block(s) still wait for other streams' events (record_stream): synchronize "
           "those streams and call process_events(), or free such blocks later";
  }

  void update_largest() noexcept {
    const std::size_t s = small_.largest_free(), l = large_.largest_free();
    stats_.set_largest_free_block(s > l ? s : l);
  }

  struct planned_state {
    struct live_block {
      std::uintptr_t p;
      std::size_t bytes, size, alignment;
      memory_tag tag;
      bool cycle;
    };
    memory_layout layout;
    void* prefix_seg = nullptr;
    void* cycle_seg = nullptr;
    std::size_t prefix_next = 0, cursor = 0, hits = 0;
    std::size_t round = 0;  // copies of the layout's repeated span served so far in this cycle
    std::vector<live_block> live;
    stream_id stream = host_stream;
  };
  struct planned_choice {
    const planned_slot* slot;
    bool cycle;
    std::size_t index;       // the slot's index in its part
    void* segment;           // the part's segment, nullptr when not yet taken
    std::size_t extent;
  };

  // The slot the next request of `bytes` takes, if it follows the layout: the next prefix slot,
  // else the cycle's slot at the cursor (or the cycle's first, when a new step starts early,
  // e.g. after an abandoned one), and only when no live block of the cycle overlaps it. Sizes
  // alone decide (growth_for has no tag, and must agree with allocate); the overlap check is
  // what keeps a request that strays from the layout from ever sharing bytes.
  std::optional<planned_choice> planned_match(std::size_t bytes) const noexcept {
    const planned_state& st = *plan_;
    const memory_layout& l = st.layout;
    auto follows = [&](const planned_slot& s) { return s.bytes == bytes; };
    if (st.prefix_next < l.prefix.size() && follows(l.prefix[st.prefix_next])) {
      return planned_choice{&l.prefix[st.prefix_next], false, st.prefix_next, st.prefix_seg, l.prefix_extent};
    }
    if (l.cycle.empty()) return std::nullopt;
    std::size_t k = st.cursor;
    if (!follows(l.cycle[k])) {
      if (!follows(l.cycle[0])) return std::nullopt;
      k = 0;
    }
    const planned_slot& s = l.cycle[k];
    const std::uintptr_t base = reinterpret_cast<std::uintptr_t>(st.cycle_seg);
    const std::size_t size = align_up(s.bytes, memory_layout::slot_alignment);
    for (const auto& b : st.live) {
      if (b.cycle && b.p < base + s.offset + size && base + s.offset < b.p + b.size) return std::nullopt;
    }
    return planned_choice{&s, true, k, st.cycle_seg, l.cycle_extent};
  }

  void* planned_allocate(std::size_t bytes, std::size_t alignment, memory_tag tag) {
    const auto m = planned_match(bytes);
    if (!m) return nullptr;
    planned_state& st = *plan_;
    void*& seg = m->cycle ? st.cycle_seg : st.prefix_seg;
    if (seg == nullptr) {
      try {
        seg = new_planned_segment(m->extent, bytes);
      } catch (...) {
        stats_.on_failure();
        throw;
      }
      stats_.on_reserve(m->extent);
    }
    const std::uintptr_t p = reinterpret_cast<std::uintptr_t>(seg) + m->slot->offset;
    const std::size_t size = align_up(bytes, memory_layout::slot_alignment);
    st.live.push_back({p, bytes, size, alignment, tag, m->cycle});  // reserved in set_layout: no heap call
    if (m->cycle) {
      const memory_layout& l = st.layout;
      if (m->index == 0 && st.cursor != 0) st.round = 0;  // a new step started early
      std::size_t next = m->index + 1;
      // The end of the repeated span: again from its start until every copy was served.
      if (next == l.repeat_slots && ++st.round < l.repeats) next = 0;
      if (next == l.cycle.size()) {
        next = 0;
        st.round = 0;
      }
      st.cursor = next;
    } else {
      ++st.prefix_next;
    }
    ++st.hits;
    stats_.on_allocate(bytes, size, tag);
    return reinterpret_cast<void*>(p);
  }

  bool planned_deallocate(void* p, std::size_t bytes, std::size_t alignment, memory_tag tag) {
    planned_state& st = *plan_;
    const auto at = reinterpret_cast<std::uintptr_t>(p);
    for (std::size_t k = st.live.size(); k-- > 0;) {
      const auto b = st.live[k];
      if (b.p != at) continue;
      if (b.bytes != bytes) {
        throw invalid_argument("bytes", std::to_string(b.bytes) + " (what allocate was given)", std::to_string(bytes),
                               "Pass deallocate the size allocate got");
      }
      if (b.alignment != alignment) {
        throw invalid_argument("alignment", std::to_string(b.alignment) + " (what allocate was given)",
                               std::to_string(alignment), "Pass deallocate the alignment allocate got");
      }
      if (b.tag != tag) {
        throw invalid_argument("tag", std::string(to_string(b.tag)) + " (what allocate was given)",
                               std::string(to_string(tag)), "Pass deallocate the tag allocate got");
      }
      st.live.erase(st.live.begin() + static_cast<std::ptrdiff_t>(k));
      stats_.on_deallocate(b.bytes, b.size, b.tag);
      // The whole prefix given back (a trainer destroyed): the next one is made in the same place.
      if (!b.cycle && std::none_of(st.live.begin(), st.live.end(), [](const auto& x) { return !x.cycle; }))
        st.prefix_next = 0;
      return true;
    }
    return false;
  }

  // Gives back the planned segments no live block uses (all of them when `keep_live` is false,
  // for the destructor). A prefix given back is made again from its first slot.
  void release_planned(bool keep_live) noexcept {
    planned_state& st = *plan_;
    bool cycle_live = false, prefix_live = false;
    if (keep_live)
      for (const auto& b : st.live) (b.cycle ? cycle_live : prefix_live) = true;
    if (st.cycle_seg != nullptr && !cycle_live) {
      upstream_.deallocate(st.cycle_seg, st.layout.cycle_extent, opts_.segment_alignment, memory_tag::other);
      stats_.on_release(st.layout.cycle_extent);
      st.cycle_seg = nullptr;
      st.cursor = 0;
      st.round = 0;
    }
    if (st.prefix_seg != nullptr && !prefix_live) {
      upstream_.deallocate(st.prefix_seg, st.layout.prefix_extent, opts_.segment_alignment, memory_tag::other);
      stats_.on_release(st.layout.prefix_extent);
      st.prefix_seg = nullptr;
      st.prefix_next = 0;
    }
  }

  // One exact-size segment for a part of the layout; on out_of_memory, the cache goes back and
  // the upstream is asked once more, as for any segment.
  void* new_planned_segment(std::size_t extent, std::size_t bytes) {
    try {
      return upstream_.allocate(extent, opts_.segment_alignment, memory_tag::other);
    } catch (const out_of_memory&) {
      release_cached();
      try {
        return upstream_.allocate(extent, opts_.segment_alignment, memory_tag::other);
      } catch (const out_of_memory& again) {
        oom_report r = again.report();
        r.source = "caching_allocator";
        fill_usage(r, stats_.stats());
        r.hint = "a request of " + format_bytes(bytes) + " needed the planned segment of " + format_bytes(extent) +
                 ", which the upstream refused even after the cache was released" +
                 (r.hint.empty() ? std::string{} : "; upstream: " + r.hint) + pending_hint();
        throw out_of_memory(std::move(r));
      }
    }
  }

  caching_options opts_;
  std::optional<planned_state> plan_;
  std::size_t reserve_limit_ = std::numeric_limits<std::size_t>::max();
  Upstream upstream_;
  detail::block_pool small_, large_;
  stats_tracker stats_;
  std::unordered_map<std::uintptr_t, stream_uses> uses_;  // by block address
  std::size_t pending_blocks_ = 0, pending_bytes_ = 0;
};

MEMBOUND_NAMESPACE_END
