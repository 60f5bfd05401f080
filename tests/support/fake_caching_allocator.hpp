// A tiny caching allocator model for adaptor tests: whole-block reuse (best fit, no splitting),
// segments rounded up to a granularity, an exact growth_for, and two knobs a real allocator
// cannot be made to show on demand: stranded cache (free bytes release_cached cannot return, as
// holes inside segments that still hold live blocks) and an upstream that grows more than it
// predicted.
#pragma once

#include <cstddef>
#include <map>
#include <new>
#include <vector>

#include "membound/memory/allocator.hpp"
#include "membound/memory/memory_stats.hpp"

namespace membound_test {

class fake_caching_allocator {
 public:
  static constexpr membound::memory_space space = membound::memory_space::host;
  static constexpr std::size_t max_alignment = 4096;
  static constexpr std::size_t granule = 64;

  explicit fake_caching_allocator(std::size_t segment = 1024) : segment_(segment) {}
  fake_caching_allocator(const fake_caching_allocator&) = delete;
  fake_caching_allocator& operator=(const fake_caching_allocator&) = delete;
  ~fake_caching_allocator() {
    for (auto& b : free_) ::operator delete(b.p, std::align_val_t{max_alignment});
    for (auto& [p, b] : live_) ::operator delete(p, std::align_val_t{max_alignment});
  }

  void* allocate(std::size_t bytes, std::size_t alignment, membound::memory_tag tag) {
    membound::detail::check_alignment(alignment, max_alignment, "fake_caching_allocator");
    membound::detail::check_tag(tag);
    if (bytes == 0) return nullptr;
    const std::size_t size = membound::align_up(bytes, granule);
    block b{};
    const std::size_t i = best_fit(size);
    if (i != npos) {
      b = free_[i];
      free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      b.size = membound::align_up(size, segment_) + lie_;
      b.p = ::operator new(b.size, std::align_val_t{max_alignment});
      stats_.on_reserve(b.size);
    }
    live_[b.p] = b;
    stats_.on_allocate(bytes, b.size, tag);
    update_largest();
    return b.p;
  }

  void deallocate(void* p, std::size_t bytes, std::size_t, membound::memory_tag tag) noexcept {
    if (p == nullptr) return;
    auto it = live_.find(p);
    free_.push_back(it->second);
    stats_.on_deallocate(bytes, it->second.size, tag);
    live_.erase(it);
    update_largest();
  }

  void release_cached() noexcept {
    ++release_calls_;
    if (stranded_) return;
    for (auto& b : free_) {
      ::operator delete(b.p, std::align_val_t{max_alignment});
      stats_.on_release(b.size);
    }
    free_.clear();
    update_largest();
  }

  // Exact unless lie_by() was called: that extra growth is not predicted.
  std::size_t growth_for(std::size_t bytes, std::size_t) const noexcept {
    if (bytes == 0) return 0;
    const std::size_t size = membound::align_up(bytes, granule);
    return best_fit(size) != npos ? 0 : membound::align_up(size, segment_);
  }

  membound::memory_stats stats() const noexcept { return stats_.stats(); }
  void reset_peaks() noexcept { stats_.reset_peaks(); }

  void strand_cache(bool on) noexcept { stranded_ = on; }
  void lie_by(std::size_t extra) noexcept { lie_ = extra; }
  int release_calls() const noexcept { return release_calls_; }
  std::size_t live_blocks() const noexcept { return live_.size(); }

 private:
  struct block {
    void* p = nullptr;
    std::size_t size = 0;
  };
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);

  std::size_t best_fit(std::size_t size) const noexcept {
    std::size_t best = npos;
    for (std::size_t i = 0; i < free_.size(); ++i) {
      if (free_[i].size >= size && (best == npos || free_[i].size < free_[best].size)) best = i;
    }
    return best;
  }
  void update_largest() noexcept {
    std::size_t m = 0;
    for (auto& b : free_) m = b.size > m ? b.size : m;
    stats_.set_largest_free_block(m);
  }

  std::size_t segment_;
  std::size_t lie_ = 0;
  bool stranded_ = false;
  int release_calls_ = 0;
  std::vector<block> free_;
  std::map<void*, block> live_;
  membound::stats_tracker stats_;
};

static_assert(membound::check_allocator<fake_caching_allocator>());
static_assert(membound::caching_allocator_like<fake_caching_allocator>);
static_assert(membound::reports_growth<fake_caching_allocator>);

}  // namespace membound_test
