// The system allocator policy: aligned host memory straight from the C++ runtime.
// Every request is an upstream call; it caches nothing. The CUDA twin (cudaMalloc/cudaFree)
// is cuda_device_allocator in backend/cuda/cuda_allocator.cuh.
#pragma once

#include <cstddef>
#include <new>
#include <string>

#include "membound/core/config.hpp"
#include "membound/core/error.hpp"
#include "membound/memory/allocator.hpp"
#include "membound/memory/memory_stats.hpp"

MEMBOUND_NAMESPACE_BEGIN

class system_allocator {
 public:
  static constexpr memory_space space = memory_space::host;
  static constexpr std::size_t max_alignment = std::size_t{1} << 21;  // a 2 MiB huge page

  system_allocator() = default;
  // Owning statistics makes it non-copyable: a copy would double-count.
  system_allocator(const system_allocator&) = delete;
  system_allocator& operator=(const system_allocator&) = delete;

  void* allocate(std::size_t bytes, std::size_t alignment = default_alignment,
                 memory_tag tag = memory_tag::other) {
    detail::check_alignment(alignment, max_alignment, "system_allocator");
    detail::check_tag(tag);
    if (bytes == 0) return nullptr;
    void* p = ::operator new(bytes, std::align_val_t{alignment}, std::nothrow);
    if (p == nullptr) {
      stats_.on_failure();
      oom_report r;
      r.source = "system_allocator";
      r.requested = r.growth_needed = bytes;
      fill_usage(r, stats_.stats());
      r.detail = "operator new(size, align_val_t) returned null";
      r.hint = "the host is out of memory: lower the model size or batch, or set a membound "
               "budget below the machine's free memory so the planner can choose a schedule";
      throw out_of_memory(std::move(r));
    }
    stats_.on_reserve(bytes);
    stats_.on_allocate(bytes, bytes, tag);
    return p;
  }

  void deallocate(void* p, std::size_t bytes, std::size_t alignment = default_alignment,
                  memory_tag tag = memory_tag::other) noexcept {
    if (p == nullptr) return;
    ::operator delete(p, std::align_val_t{alignment});
    stats_.on_deallocate(bytes, bytes, tag);
    stats_.on_release(bytes);
  }

  std::size_t growth_for(std::size_t bytes, std::size_t /*alignment*/) const noexcept {
    return bytes;
  }
  memory_stats stats() const noexcept { return stats_.stats(); }
  void reset_peaks() noexcept { stats_.reset_peaks(); }


 private:
  stats_tracker stats_;
};

static_assert(check_allocator<system_allocator>());

MEMBOUND_NAMESPACE_END
