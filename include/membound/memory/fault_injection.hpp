// Fault injection: adaptors that make chosen upstream calls fail with out_of_memory, so that
// tests (ours and users') can drive every recovery path deterministically.
//
//   fault_injecting<Upstream>  - an allocator; fails chosen allocate() calls.
//   fault_injecting_vm<VM>     - a virtual-memory backend; fails chosen commit() calls.
//
// Calls are numbered from 1 in the order they reach the adaptor, over its whole lifetime
// (clear() forgets the plan, not the count). An injected failure throws
//   out_of_memory{source "fault_injection", detail "injected failure on call k"}
// without calling the wrapped object, which therefore stays unchanged.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "membound/core/config.hpp"
#include "membound/core/error.hpp"
#include "membound/memory/allocator.hpp"
#include "membound/memory/stream.hpp"
#include "membound/memory/memory_stats.hpp"
#include "membound/core/memory_tag.hpp"
#include "membound/memory/virtual_memory.hpp"

MEMBOUND_NAMESPACE_BEGIN

namespace detail {
// Which call numbers fail, and the count of calls so far.
class fault_plan {
 public:
  void fail_on(std::vector<std::uint64_t> call_indices) {
    for (std::uint64_t k : call_indices) {
      if (k == 0) {
        throw invalid_argument("call_indices", "1-based call numbers", "0",
                               "The first call is number 1");
      }
    }
    std::sort(call_indices.begin(), call_indices.end());
    fail_on_ = std::move(call_indices);
  }
  void fail_all_from(std::uint64_t k) {
    if (k == 0) throw invalid_argument("k", "a 1-based call number", "0", "The first call is number 1");
    fail_from_ = k;
  }
  void clear() noexcept {
    fail_on_.clear();
    fail_from_ = 0;
  }
  // Counts one call; returns its number when it must fail, 0 otherwise.
  std::uint64_t next() noexcept {
    const std::uint64_t k = ++calls_;
    const bool fail = (fail_from_ != 0 && k >= fail_from_) ||
                      std::binary_search(fail_on_.begin(), fail_on_.end(), k);
    if (!fail) return 0;
    ++failures_;
    return k;
  }
  std::uint64_t calls() const noexcept { return calls_; }
  std::uint64_t failures() const noexcept { return failures_; }

  [[noreturn]] static void fail(std::uint64_t k, std::size_t bytes, const memory_stats* usage) {
    oom_report r;
    r.source = "fault_injection";
    r.requested = r.growth_needed = bytes;
    if (usage != nullptr) fill_usage(r, *usage);
    r.detail = "injected failure on call " + std::to_string(k);
    throw out_of_memory(std::move(r));
  }

 private:
  std::vector<std::uint64_t> fail_on_;  // sorted
  std::uint64_t fail_from_ = 0;         // 0 = none
  std::uint64_t calls_ = 0, failures_ = 0;
};
}  // namespace detail

template <typename Upstream>
class fault_injecting {
  static_assert(check_allocator<Upstream>());

 public:
  static constexpr memory_space space = Upstream::space;

  fault_injecting() = default;  // not explicit: `fault_injecting<A> f = {};` works
  template <typename... Args>
  explicit fault_injecting(Args&&... upstream_args) : upstream_(std::forward<Args>(upstream_args)...) {}

  // The given allocate calls (1-based, counted over the adaptor's lifetime) fail. Replaces the
  // previous list; fail_all_from stays as it was.
  void fail_on(std::vector<std::uint64_t> call_indices) { plan_.fail_on(std::move(call_indices)); }
  // Call k and every later allocate call fail.
  void fail_all_from(std::uint64_t k) { plan_.fail_all_from(k); }
  // No more injected failures.
  void clear() noexcept { plan_.clear(); }
  // allocate calls that reached the adaptor, failed or not.
  std::uint64_t calls() const noexcept { return plan_.calls(); }
  std::uint64_t failures() const noexcept { return plan_.failures(); }

  void* allocate(std::size_t bytes, std::size_t alignment = default_alignment,
                 memory_tag tag = memory_tag::other, stream_id stream = host_stream) {
    if (const std::uint64_t k = plan_.next(); k != 0) {
      const memory_stats s = upstream_.stats();
      detail::fault_plan::fail(k, bytes, &s);
    }
    return detail::allocate_on(upstream_, bytes, alignment, tag, stream, "fault_injection");
  }
  void deallocate(void* p, std::size_t bytes, std::size_t alignment = default_alignment,
                  memory_tag tag = memory_tag::other) {
    upstream_.deallocate(p, bytes, alignment, tag);
  }
  // The upstream's statistics, with the injected failures added to failed_allocations.
  memory_stats stats() const noexcept {
    memory_stats s = upstream_.stats();
    s.failed_allocations += plan_.failures();
    return s;
  }

  void release_cached()
    requires caching_allocator_like<Upstream>
  {
    upstream_.release_cached();
  }
  std::size_t growth_for(std::size_t bytes, std::size_t alignment,
                         stream_id stream = host_stream) const
    requires reports_growth<Upstream>
  {
    return detail::growth_on(upstream_, bytes, alignment, stream, "fault_injection");
  }
  // Non-const: polls a stream-ordered upstream's pending blocks (see traced_allocator).
  std::size_t growth_for(std::size_t bytes, std::size_t alignment, stream_id stream = host_stream)
    requires reports_growth<Upstream>
  {
    return detail::growth_on(upstream_, bytes, alignment, stream, "fault_injection");
  }
  void record_stream(void* p, stream_id stream) requires stream_ordered_allocator<Upstream> {
    upstream_.record_stream(p, stream);
  }
  void reset_peaks() requires detail::has_reset_peaks<Upstream> { upstream_.reset_peaks(); }
  void set_reserve_limit(std::size_t bytes) requires detail::has_reserve_limit<Upstream> {
    upstream_.set_reserve_limit(bytes);
  }

  Upstream& upstream() noexcept { return upstream_; }
  const Upstream& upstream() const noexcept { return upstream_; }

 private:
  Upstream upstream_;
  detail::fault_plan plan_;
};

template <typename VM>
class fault_injecting_vm {
  static_assert(check_virtual_memory<VM>());

 public:
  static constexpr memory_space space = VM::space;

  fault_injecting_vm() = default;
  template <typename... Args>
  explicit fault_injecting_vm(Args&&... vm_args) : vm_(std::forward<Args>(vm_args)...) {}

  // As for fault_injecting, counting commit calls.
  void fail_on(std::vector<std::uint64_t> call_indices) { plan_.fail_on(std::move(call_indices)); }
  void fail_all_from(std::uint64_t k) { plan_.fail_all_from(k); }
  void clear() noexcept { plan_.clear(); }
  std::uint64_t calls() const noexcept { return plan_.calls(); }
  std::uint64_t failures() const noexcept { return plan_.failures(); }
  // Bytes committed through this adaptor and not decommitted: a leak check independent of the
  // code under test.
  std::size_t committed_bytes() const noexcept { return committed_; }

  std::size_t granularity() const { return vm_.granularity(); }
  void* reserve(std::size_t bytes) { return vm_.reserve(bytes); }
  void commit(void* p, std::size_t bytes) {
    if (const std::uint64_t k = plan_.next(); k != 0) detail::fault_plan::fail(k, bytes, nullptr);
    vm_.commit(p, bytes);
    committed_ += bytes;
  }
  void decommit(void* p, std::size_t bytes) noexcept {
    vm_.decommit(p, bytes);
    committed_ -= bytes;
  }
  void release(void* p, std::size_t bytes) noexcept { vm_.release(p, bytes); }

  VM& backend() noexcept { return vm_; }
  const VM& backend() const noexcept { return vm_; }

 private:
  VM vm_;
  detail::fault_plan plan_;
  std::size_t committed_ = 0;
};

MEMBOUND_NAMESPACE_END
