// The expandable arena policy: one virtual address range reserved up front, committed from its
// start as the pool grows. The committed prefix is a single segment that only ever grows or
// shrinks at its end, so blocks never move, growth adds exactly the granules a request lacks,
// and a request can use a free block at the end plus fresh memory after it: growth does not
// fragment. (PyTorch calls the same idea "expandable segments".)
//
// Blocks are 512-byte granular with best-fit, split and coalesce, as in caching_allocator (both
// run on detail::block_pool). The free tail is used only when no hole fits, so a repeated step
// commits nothing after its first pass and untouched memory stays at the end, where
// release_cached() can decommit its whole granules.
//
// Threading: not thread-safe; one arena per thread or stream, or a lock around it.
#pragma once

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
#include "membound/memory/detail/block_pool.hpp"
#include "membound/memory/host_virtual_memory.hpp"
#include "membound/memory/memory_stats.hpp"
#include "membound/core/memory_tag.hpp"
#include "membound/memory/virtual_memory.hpp"

MEMBOUND_NAMESPACE_BEGIN

// Settings of expandable_arena, checked by its constructor.
struct expandable_arena_options {
  // Bytes of address space reserved at construction: the most the arena can ever commit.
  // Reserving costs no memory, so the default is generous. A nonzero multiple of the backend's
  // granularity.
  std::size_t capacity = std::size_t{64} << 30;  // 64 GiB
};

// The expandable arena (see the file comment) over VirtualMemory's reserve/commit calls.
template <typename VirtualMemory = host_virtual_memory>
class expandable_arena {
  static_assert(check_virtual_memory<VirtualMemory>());

 public:
  // Host or device: the virtual memory backend's.
  static constexpr memory_space space = VirtualMemory::space;
  // Every block size is a multiple of this, and every block starts on it.
  static constexpr std::size_t block_granule = 512;
  // The largest alignment allocate accepts.
  static constexpr std::size_t max_alignment = block_granule;

  expandable_arena() : expandable_arena(expandable_arena_options{}) {}  // not explicit: `= {}` works
  // Constructs the backend from vm_args and reserves opts.capacity bytes of address space.
  template <typename... Args>
  explicit expandable_arena(expandable_arena_options opts, Args&&... vm_args)
      : vm_(std::forward<Args>(vm_args)...),
        granularity_(checked_granularity(vm_.granularity())),
        capacity_(checked_capacity(opts.capacity, granularity_)) {
    void* base = vm_.reserve(capacity_);
    try {
      seg_ = pool_.add_segment(base, 0, memory_tag::other);
    } catch (...) {
      vm_.release(base, capacity_);
      throw;
    }
  }

  expandable_arena(const expandable_arena&) = delete;
  expandable_arena& operator=(const expandable_arena&) = delete;

  // Decommits and unreserves everything. Blocks still allocated are a bug in the caller; the
  // memory is returned anyway.
  ~expandable_arena() {
    if (seg_->size != 0) vm_.decommit(seg_->ptr(), seg_->size);
    vm_.release(seg_->ptr(), capacity_);
  }

  // Serves `bytes` aligned to `alignment` (a power of two <= 512); nullptr for 0 bytes. Commits
  // exactly growth_for(bytes, alignment) bytes when no free block fits. Throws invalid_argument
  // for bad arguments, out_of_memory when the capacity is exhausted or a commit fails; the arena
  // is then unchanged.
  void* allocate(std::size_t bytes, std::size_t alignment = default_alignment,
                 memory_tag tag = memory_tag::other) {
    detail::check_alignment(alignment, max_alignment, "expandable_arena");
    detail::check_tag(tag);
    if (bytes == 0) return nullptr;
    try {
      if (bytes > capacity_) throw_capacity(bytes);
      const std::size_t size = align_up(bytes, block_granule);
      detail::block_pool::block* b = pool_.best_fit(size);
      std::size_t grown = 0;
      if (b == nullptr) {
        grown = growth_for_size(size);
        if (grown > capacity_ - seg_->size) throw_capacity(bytes);
        grow(bytes, grown);
        b = seg_->last;  // nothing else fitted, so the grown tail is the best fit
      }
      try {
        b = pool_.allocate_block(b, size, block_granule, bytes, alignment, tag);
      } catch (...) {
        if (grown != 0) shrink(grown);
        throw;
      }
      // Statistics change only once nothing can fail any more.
      if (grown != 0) stats_.on_reserve(grown);
      stats_.on_allocate(bytes, b->size, tag);
      update_largest();
      return b->ptr();
    } catch (...) {
      stats_.on_failure();
      throw;
    }
  }

  // Sized deallocation with the same checks as caching_allocator: a wrong p, bytes, alignment or
  // tag throws invalid_argument naming it, with no change. nullptr with 0 bytes is a no-op. Freed
  // memory stays committed until release_cached().
  void deallocate(void* p, std::size_t bytes, std::size_t alignment = default_alignment,
                  memory_tag tag = memory_tag::other) {
    if (p == nullptr && bytes == 0) return;
    detail::block_pool::block* b = pool_.find_live(p);
    detail::check_deallocate(b, p, bytes, alignment, tag, "expandable_arena");
    stats_.on_deallocate(b->requested, b->size, b->tag);
    pool_.free_block(b);
    update_largest();
  }

  // Decommits the whole granules of the free block at the end of the committed range.
  void release_cached() noexcept {
    const std::size_t tail = seg_->free_tail();
    if (tail == 0) return;
    const std::size_t from = align_up(seg_->size - tail, granularity_);
    if (from >= seg_->size) return;
    const std::size_t bytes = seg_->size - from;
    pool_.shrink_segment(seg_, bytes);
    vm_.decommit(reinterpret_cast<void*>(seg_->base + from), bytes);
    stats_.on_release(bytes);
    update_largest();
  }

  // Bytes the next allocate(bytes, alignment) would commit: 0 when a free block fits, else the
  // whole granules the free tail lacks. Exact.
  std::size_t growth_for(std::size_t bytes, std::size_t alignment) const {
    detail::check_alignment(alignment, max_alignment, "expandable_arena");
    if (bytes == 0) return 0;
    if (bytes > capacity_) return growth_without_fit(bytes);
    const std::size_t size = align_up(bytes, block_granule);
    return pool_.best_fit(size) != nullptr ? 0 : growth_for_size(size);
  }

  // reserved = committed bytes; upstream_allocations / upstream_deallocations = commit /
  // decommit calls.
  memory_stats stats() const noexcept { return stats_.stats(); }
  // Restarts the peak statistics from the current values.
  void reset_peaks() noexcept { stats_.reset_peaks(); }

  // Bytes of address space reserved: the most it can ever commit.
  std::size_t capacity() const noexcept { return capacity_; }
  // This layer's state that decides its next answers (allocator_state_key, memory/shadow.hpp).
  void append_state(std::vector<std::uint64_t>& out) const {
    out.push_back(capacity_);
    pool_.append_state(out);
    stats_.append_state(out);
  }
  // Bytes committed now: the reserve's prefix in use or cached.
  std::size_t committed() const noexcept { return seg_->size; }
  // The backend's commit granule: commits and decommits are whole multiples of it.
  std::size_t granularity() const noexcept { return granularity_; }
  // Start of the reserved range; blocks are handed out from here upwards.
  void* base() const noexcept { return seg_->ptr(); }
  // The virtual memory backend, for inspection: commit or decommit through it breaks the arena.
  VirtualMemory& vm() noexcept { return vm_; }
  // The same, read only.
  const VirtualMemory& vm() const noexcept { return vm_; }

  // O(blocks) consistency check of the internal structures, for tests and debugging.
  bool check_invariants() const noexcept {
    return pool_.check_invariants(block_granule) && seg_->size % granularity_ == 0 &&
           seg_->size == stats_.stats().reserved;
  }

 private:
  static std::size_t checked_granularity(std::size_t g) {
    if (!is_power_of_two(g) || g < block_granule) {
      throw invalid_argument("VirtualMemory::granularity()", "a power of two of at least 512",
                             std::to_string(g), "Fix the virtual-memory backend's granularity");
    }
    return g;
  }
  static std::size_t checked_capacity(std::size_t capacity, std::size_t granularity) {
    if (capacity == 0 || capacity % granularity != 0) {
      throw invalid_argument("expandable_arena_options::capacity",
                             "a nonzero multiple of the backend granularity (" +
                                 format_bytes(granularity) + ")",
                             format_bytes(capacity), "Round the capacity up to the granularity");
    }
    return capacity;
  }

  // Whole granules that, appended to the free tail, make a block of `size` bytes.
  std::size_t growth_for_size(std::size_t size) const noexcept {
    return align_up(size - seg_->free_tail(), granularity_);
  }
  // The same, for a request no free block can serve (used for errors and oversize requests).
  std::size_t growth_without_fit(std::size_t bytes) const noexcept {
    if (bytes > std::numeric_limits<std::size_t>::max() / 4) return std::numeric_limits<std::size_t>::max();
    return growth_for_size(align_up(bytes, block_granule));
  }

  // Commits `bytes` at the end of the committed range and appends them to the segment.
  void grow(std::size_t requested, std::size_t bytes) {
    void* at = reinterpret_cast<void*>(seg_->base + seg_->size);
    try {
      vm_.commit(at, bytes);
    } catch (const out_of_memory& e) {
      oom_report r = e.report();  // keeps the backend's detail and hint
      r.source = "expandable_arena";
      r.requested = requested;
      r.growth_needed = bytes;
      fill_usage(r, stats_.stats());
      throw out_of_memory(std::move(r));
    }
    try {
      pool_.grow_segment(seg_, bytes);
    } catch (...) {
      vm_.decommit(at, bytes);
      throw;
    }
  }
  // Undoes grow() after a later step failed.
  void shrink(std::size_t bytes) noexcept {
    pool_.shrink_segment(seg_, bytes);
    vm_.decommit(reinterpret_cast<void*>(seg_->base + seg_->size), bytes);
  }

  [[noreturn]] void throw_capacity(std::size_t bytes) const {
    oom_report r;
    r.source = "expandable_arena";
    r.requested = bytes;
    r.growth_needed = growth_without_fit(bytes);
    r.budget = capacity_;
    r.free_under_budget = capacity_ - seg_->size;
    fill_usage(r, stats_.stats());
    r.detail = "the reserved range of " + format_bytes(capacity_) + " is exhausted: " +
               format_bytes(seg_->size) + " committed";
    r.hint = r.growth_needed == std::numeric_limits<std::size_t>::max()
                 ? std::string("check the size computation that produced this request")
                 : "raise expandable_arena_options::capacity to at least " +
                       format_bytes(seg_->size + r.growth_needed) + ", or free memory first";
    throw out_of_memory(std::move(r));
  }

  void update_largest() noexcept { stats_.set_largest_free_block(pool_.largest_free()); }

  VirtualMemory vm_;
  std::size_t granularity_;
  std::size_t capacity_;
  detail::block_pool pool_;
  detail::block_pool::segment* seg_ = nullptr;
  stats_tracker stats_;
};

MEMBOUND_NAMESPACE_END
