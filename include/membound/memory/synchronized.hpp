// A mutex-guarded adaptor for an allocator shared between threads. Every other membound
// allocator is single-threaded by design (training touches memory from one host thread; locks
// on that path would be pure cost), so sharing is opted into here, once, at the top of a stack:
//
//   synchronized<budget_allocator<caching_allocator<>>> shared(limit);
#pragma once

#include <concepts>
#include <cstddef>
#include <mutex>
#include <utility>

#include "membound/core/config.hpp"
#include "membound/memory/allocator.hpp"
#include "membound/memory/stream.hpp"
#include "membound/memory/memory_stats.hpp"
#include "membound/core/memory_tag.hpp"

MEMBOUND_NAMESPACE_BEGIN

template <typename Upstream>
class synchronized {
  static_assert(check_allocator<Upstream>());

 public:
  static constexpr memory_space space = Upstream::space;

  template <typename... Args>
    requires std::constructible_from<Upstream, Args...>
  explicit synchronized(Args&&... upstream_args)
      : upstream_(std::forward<Args>(upstream_args)...) {}

  synchronized(const synchronized&) = delete;
  synchronized& operator=(const synchronized&) = delete;

  void* allocate(std::size_t bytes, std::size_t alignment = default_alignment,
                 memory_tag tag = memory_tag::other, stream_id stream = host_stream) {
    std::lock_guard lock(mutex_);
    return detail::allocate_on(upstream_, bytes, alignment, tag, stream, "synchronized");
  }

  void deallocate(void* p, std::size_t bytes, std::size_t alignment = default_alignment,
                  memory_tag tag = memory_tag::other) {
    std::lock_guard lock(mutex_);
    upstream_.deallocate(p, bytes, alignment, tag);
  }

  memory_stats stats() const {
    std::lock_guard lock(mutex_);
    return upstream_.stats();
  }

  void release_cached() requires caching_allocator_like<Upstream> {
    std::lock_guard lock(mutex_);
    upstream_.release_cached();
  }
  std::size_t growth_for(std::size_t bytes, std::size_t alignment,
                         stream_id stream = host_stream) const
    requires reports_growth<Upstream>
  {
    std::lock_guard lock(mutex_);
    return detail::growth_on(upstream_, bytes, alignment, stream, "synchronized");
  }
  // Non-const: polls a stream-ordered upstream's pending blocks (see traced_allocator).
  std::size_t growth_for(std::size_t bytes, std::size_t alignment, stream_id stream = host_stream)
    requires reports_growth<Upstream>
  {
    std::lock_guard lock(mutex_);
    return detail::growth_on(upstream_, bytes, alignment, stream, "synchronized");
  }
  void record_stream(void* p, stream_id stream) requires stream_ordered_allocator<Upstream> {
    std::lock_guard lock(mutex_);
    upstream_.record_stream(p, stream);
  }
  void reset_peaks() requires detail::has_reset_peaks<Upstream> {
    std::lock_guard lock(mutex_);
    upstream_.reset_peaks();
  }
  void set_reserve_limit(std::size_t bytes) requires detail::has_reserve_limit<Upstream> {
    std::lock_guard lock(mutex_);
    upstream_.set_reserve_limit(bytes);
  }

  // The budget interface, when the upstream is a budget.
  std::size_t limit() const requires budgeted<Upstream> {
    std::lock_guard lock(mutex_);
    return upstream_.limit();
  }
  std::size_t usage() const requires budgeted<Upstream> {
    std::lock_guard lock(mutex_);
    return upstream_.usage();
  }
  std::size_t headroom() const requires detail::has_headroom<Upstream> {
    std::lock_guard lock(mutex_);
    return upstream_.headroom();
  }
  std::size_t external() const requires detail::has_external<Upstream> {
    std::lock_guard lock(mutex_);
    return upstream_.external();
  }
  void set_limit(std::size_t bytes) requires detail::has_set_limit<Upstream> {
    std::lock_guard lock(mutex_);
    upstream_.set_limit(bytes);
  }
  void set_external(std::size_t bytes) requires detail::has_set_external<Upstream> {
    std::lock_guard lock(mutex_);
    upstream_.set_external(bytes);
  }

  // Several calls as one step under the lock, e.g. read usage and allocate only if it fits.
  template <typename F>
  decltype(auto) with_lock(F&& f) {
    std::lock_guard lock(mutex_);
    return std::forward<F>(f)(upstream_);
  }

 private:
  mutable std::mutex mutex_;
  Upstream upstream_;
};

MEMBOUND_NAMESPACE_END
