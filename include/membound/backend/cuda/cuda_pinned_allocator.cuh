// The pinned host allocator policy: cudaHostAlloc/cudaFreeHost. Page-locked host memory is what
// cudaMemcpyAsync needs to overlap a copy with compute (pageable memory is staged through a
// driver buffer and the copy is synchronous), so offload and staging buffers come from here.
// Every request is an upstream call, and pinning is slow (it maps pages for the device): wrap it
// in caching_allocator to keep freed blocks.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "membound/backend/cuda/cuda_check.cuh"
#include "membound/core/config.hpp"
#include "membound/core/error.hpp"
#include "membound/core/format.hpp"
#include "membound/core/memory_tag.hpp"
#include "membound/memory/allocator.hpp"
#include "membound/memory/memory_stats.hpp"
#include "membound/memory/over_alignment.hpp"

MEMBOUND_NAMESPACE_BEGIN

class cuda_pinned_allocator {
 public:
  // Host memory: the CPU reads and writes it directly, the device reaches it by copies.
  static constexpr memory_space space = memory_space::host;
  // Pinned memory is page-aligned in practice, but only 256 bytes are promised here (as for
  // cudaMalloc); larger alignments over-allocate by alignment - 256 so growth_for stays exact.
  static constexpr std::size_t guaranteed_alignment = 256;
  static constexpr std::size_t max_alignment = std::size_t{1} << 21;

  // flags: cudaHostAllocDefault, or a combination of cudaHostAllocPortable (pinned for every
  // context), cudaHostAllocMapped (device-addressable), cudaHostAllocWriteCombined (fast
  // host-to-device copies, very slow host reads).
  explicit cuda_pinned_allocator(unsigned int flags = cudaHostAllocDefault) : flags_(flags) {}
  cuda_pinned_allocator(const cuda_pinned_allocator&) = delete;
  cuda_pinned_allocator& operator=(const cuda_pinned_allocator&) = delete;

  void* allocate(std::size_t bytes, std::size_t alignment = default_alignment,
                 memory_tag tag = memory_tag::other) {
    detail::check_alignment(alignment, max_alignment, "cuda_pinned_allocator");
    detail::check_tag(tag);
    if (bytes == 0) return nullptr;
    const std::size_t reserved = growth_for(bytes, alignment);
    void* raw = host_alloc_or_throw(bytes, reserved);
    void* p = nullptr;
    try {
      p = over_aligned_.place(raw, reserved, alignment);
    } catch (...) {
      (void)cudaFreeHost(raw);
      stats_.on_failure();
      throw;
    }
    stats_.on_reserve(reserved);
    stats_.on_allocate(bytes, reserved, tag);
    return p;
  }

  void deallocate(void* p, std::size_t bytes, std::size_t alignment = default_alignment,
                  memory_tag tag = memory_tag::other) noexcept {
    if (p == nullptr) return;
    const auto [raw, reserved] = over_aligned_.release(p, bytes, alignment);
    // cudaFreeHost waits for pending copies from the block; its errors (e.g. at exit) cannot be
    // reported from a noexcept path.
    if (cudaFreeHost(raw) != cudaSuccess) (void)cudaGetLastError();
    stats_.on_deallocate(bytes, reserved, tag);
    stats_.on_release(reserved);
  }

  std::size_t growth_for(std::size_t bytes, std::size_t alignment) const noexcept {
    return detail::over_aligned_blocks<guaranteed_alignment>::growth_for(bytes, alignment);
  }
  memory_stats stats() const noexcept { return stats_.stats(); }
  void reset_peaks() noexcept { stats_.reset_peaks(); }
  unsigned int flags() const noexcept { return flags_; }

 private:
  void* host_alloc_or_throw(std::size_t requested, std::size_t bytes) {
    void* p = nullptr;
    const cudaError_t status = cudaHostAlloc(&p, bytes, flags_);
    if (status == cudaSuccess) return p;
    stats_.on_failure();
    if (status != cudaErrorMemoryAllocation) cuda_check(status, "cudaHostAlloc");
    (void)cudaGetLastError();  // an OOM is not sticky
    oom_report r;
    r.source = "cuda_pinned_allocator";
    r.requested = requested;
    r.growth_needed = bytes;
    fill_usage(r, stats_.stats());
    r.detail = std::string("cudaHostAlloc: ") + cudaGetErrorString(status);
    r.hint = "the host cannot pin that much memory (pinned pages are limited by RAM and by the "
             "locked-memory limit, ulimit -l): pin smaller staging buffers and reuse them, or "
             "cache them with caching_allocator";
    throw out_of_memory(std::move(r));
  }

  unsigned int flags_;
  stats_tracker stats_;
  detail::over_aligned_blocks<guaranteed_alignment> over_aligned_;
};

static_assert(check_allocator<cuda_pinned_allocator>());

MEMBOUND_NAMESPACE_END
