// The CUDA device allocator policy: cudaMalloc/cudaFree, the device twin of system_allocator.
// Every request is an upstream call; wrap it in caching_allocator to keep freed blocks.
//
// It is also the event source (memory/stream.hpp) that makes caching_allocator stream-ordered:
// stream_id is reinterpret_cast<stream_id>(cudaStream_t) (0 = the legacy default stream), events
// are cudaEvent_t made with cudaEventDisableTiming (cheaper to record and query) and recycled.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "membound/backend/cuda/cuda_check.cuh"
#include "membound/core/config.hpp"
#include "membound/core/error.hpp"
#include "membound/core/format.hpp"
#include "membound/memory/allocator.hpp"
#include "membound/memory/memory_stats.hpp"
#include "membound/memory/over_alignment.hpp"
#include "membound/memory/shadow.hpp"
#include "membound/memory/stream.hpp"
#include "membound/core/memory_tag.hpp"

MEMBOUND_NAMESPACE_BEGIN

class cuda_device_allocator {
 public:
  static constexpr memory_space space = memory_space::device;
  // cudaMalloc documents 256-byte alignment. Larger alignments (caching_allocator asks for 512
  // per segment) always over-allocate by alignment - 256 bytes, so that growth_for is exact and a
  // budget above can refuse before calling cudaMalloc; the limit matches system_allocator's.
  static constexpr std::size_t guaranteed_alignment = 256;
  static constexpr std::size_t max_alignment = std::size_t{1} << 21;

  // Binds to the device current on the calling thread.
  cuda_device_allocator() : device_(cuda_current_device()) {}
  explicit cuda_device_allocator(int device) : device_(device) {}
  // Owning statistics makes it non-copyable: a copy would double-count.
  cuda_device_allocator(const cuda_device_allocator&) = delete;
  cuda_device_allocator& operator=(const cuda_device_allocator&) = delete;
  ~cuda_device_allocator() {
    for (const event_id e : spare_events_) (void)cudaEventDestroy(to_event(e));
    (void)cudaGetLastError();  // e.g. cudartUnloading at exit: nothing to report from here
  }

  void* allocate(std::size_t bytes, std::size_t alignment = default_alignment,
                 memory_tag tag = memory_tag::other) {
    detail::check_alignment(alignment, max_alignment, "cuda_device_allocator");
    detail::check_tag(tag);
    if (bytes == 0) return nullptr;
    cuda_device_guard guard(device_);
    const std::size_t reserved = growth_for(bytes, alignment);
    void* raw = malloc_or_throw(bytes, reserved);
    void* p = nullptr;
    try {
      p = over_aligned_.place(raw, reserved, alignment);
    } catch (...) {
      (void)cudaFree(raw);
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
    // cudaFree needs no particular current device. Its errors (e.g. cudartUnloading at exit)
    // cannot be reported from a noexcept path; the bytes are gone either way.
    if (cudaFree(raw) != cudaSuccess) (void)cudaGetLastError();
    stats_.on_deallocate(bytes, reserved, tag);
    stats_.on_release(reserved);
  }

  std::size_t growth_for(std::size_t bytes, std::size_t alignment) const noexcept {
    return detail::over_aligned_blocks<guaranteed_alignment>::growth_for(bytes, alignment);
  }
  memory_stats stats() const noexcept { return stats_.stats(); }
  void reset_peaks() noexcept { stats_.reset_peaks(); }
  int device() const noexcept { return device_; }

  // ---- events (stream_event_source) ------------------------------------------------------------
  // An event of this allocator's device: a recycled one when there is one.
  event_id create_event() {
    if (!spare_events_.empty()) {
      const event_id e = spare_events_.back();
      spare_events_.pop_back();
      return e;
    }
    cuda_device_guard guard(device_);
    cudaEvent_t e = nullptr;
    cuda_check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    return reinterpret_cast<event_id>(e);
  }
  // The stream must belong to this allocator's device (CUDA requires event and stream to share
  // a context).
  void record_event(event_id e, stream_id stream) {
    cuda_device_guard guard(device_);
    cuda_check(cudaEventRecord(to_event(e), to_stream(stream)), "cudaEventRecord");
  }
  // Non-blocking. cudaErrorNotReady is the normal "not yet"; any other failure (a kernel fault
  // reported here) is a backend_error.
  bool event_done(event_id e) const {
    const cudaError_t status = cudaEventQuery(to_event(e));
    if (status == cudaSuccess) return true;
    if (status == cudaErrorNotReady) {
      (void)cudaGetLastError();  // not an error: keep it out of later checks
      return false;
    }
    cuda_check(status, "cudaEventQuery");
    return false;
  }
  // Keeps the event for the next create_event. A completed event can be recorded again.
  void destroy_event(event_id e) noexcept {
    try {
      spare_events_.push_back(e);
    } catch (...) {
      (void)cudaEventDestroy(to_event(e));  // no room to keep it: really destroy it
    }
  }
  std::size_t spare_events() const noexcept { return spare_events_.size(); }

  static cudaStream_t to_stream(stream_id s) noexcept { return reinterpret_cast<cudaStream_t>(s); }
  static stream_id to_stream_id(cudaStream_t s) noexcept { return reinterpret_cast<stream_id>(s); }

 private:
  // Called with device_ current. cudaErrorMemoryAllocation is an out_of_memory, the rest are
  // backend errors.
  void* malloc_or_throw(std::size_t requested, std::size_t bytes) {
    void* p = nullptr;
    const cudaError_t status = cudaMalloc(&p, bytes);
    if (status == cudaSuccess) return p;
    stats_.on_failure();
    if (status != cudaErrorMemoryAllocation) cuda_check(status, "cudaMalloc");
    throw out_of_memory(oom(requested, bytes, status));
  }

  oom_report oom(std::size_t requested, std::size_t bytes, cudaError_t status) const {
    (void)cudaGetLastError();  // an OOM is not sticky: clear it so the caller can go on
    oom_report r;
    r.source = "cuda_device_allocator";
    r.requested = requested;
    r.growth_needed = bytes;
    fill_usage(r, stats_.stats());
    r.detail = std::string("cudaMalloc: ") + cudaGetErrorString(status);
    std::size_t free_bytes = 0, total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
      r.detail += "; device " + std::to_string(device_) + " has " + format_bytes(free_bytes) +
                  " free of " + format_bytes(total_bytes);
    } else {
      (void)cudaGetLastError();
    }
    r.hint = "the device is full: free other allocations (or other processes' memory), lower the "
             "batch or sequence length, or cache freed blocks with caching_allocator so "
             "fragmentation does not force new cudaMalloc calls";
    return r;
  }

  int device_;
  static cudaEvent_t to_event(event_id e) noexcept { return reinterpret_cast<cudaEvent_t>(e); }

  stats_tracker stats_;
  detail::over_aligned_blocks<guaranteed_alignment> over_aligned_;
  std::vector<event_id> spare_events_;                     // recycled events of device_
};

static_assert(check_allocator<cuda_device_allocator>());
static_assert(stream_event_source<cuda_device_allocator>);

// The planner's shadow of a device leaf (memory/shadow.hpp): addresses only, with cudaMalloc's
// 256-byte guarantee, so an over-aligned request (a caching segment at 512) reserves what
// growth_for says here. With it, reserve_model plans the reserve of a device stack (budget over
// the caching allocator, planned or not) as it does a host one.
template <>
struct shadow_traits<cuda_device_allocator> {
  using type = address_only_allocator<memory_space::device, cuda_device_allocator::guaranteed_alignment>;
  static std::tuple<> args(const cuda_device_allocator&) { return {}; }
  static void sync(type&, const cuda_device_allocator&) noexcept {}
};

MEMBOUND_NAMESPACE_END
