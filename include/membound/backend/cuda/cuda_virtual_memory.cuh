// CUDA virtual memory for expandable_arena: reserve a device address range once, then back it
// with physical memory granule by granule (cuMemCreate + cuMemMap), so the arena grows without
// moving any address and hands memory back without fragmenting the range.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "membound/backend/cuda/cuda_check.cuh"
#include "membound/core/config.hpp"
#include "membound/core/error.hpp"
#include "membound/core/format.hpp"
#include "membound/memory/allocator.hpp"
#include "membound/memory/expandable_arena.hpp"
#include "membound/core/memory_tag.hpp"
#include "membound/memory/virtual_memory.hpp"

MEMBOUND_NAMESPACE_BEGIN

class cuda_virtual_memory {
 public:
  static constexpr memory_space space = memory_space::device;

  // Binds to the device current on the calling thread.
  cuda_virtual_memory() : cuda_virtual_memory(cuda_current_device()) {}
  explicit cuda_virtual_memory(int device) : device_(device) {
    prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop_.location.id = device;
    cuda_device_guard guard(device_);  // the driver calls below need the device's context
    cu_check(detail::cuda_driver().mem_get_allocation_granularity(
                 &granularity_, &prop_, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
             "cuMemGetAllocationGranularity");
  }
  // The bookkeeping owns driver handles: copies would release them twice.
  cuda_virtual_memory(const cuda_virtual_memory&) = delete;
  cuda_virtual_memory& operator=(const cuda_virtual_memory&) = delete;
  // A moved-from object owns no range, so its destructor releases nothing.
  cuda_virtual_memory(cuda_virtual_memory&& other) noexcept
      : device_(other.device_),
        granularity_(other.granularity_),
        prop_(other.prop_),
        ranges_(std::exchange(other.ranges_, {})) {}
  cuda_virtual_memory& operator=(cuda_virtual_memory&& other) noexcept {
    if (this != &other) {
      release_all();
      device_ = other.device_;
      granularity_ = other.granularity_;
      prop_ = other.prop_;
      ranges_ = std::exchange(other.ranges_, {});
    }
    return *this;
  }

  ~cuda_virtual_memory() { release_all(); }

  std::size_t granularity() const noexcept { return granularity_; }
  int device() const noexcept { return device_; }

  void* reserve(std::size_t bytes) {
    check_multiple(bytes, "bytes", "reserve");
    if (bytes == 0) {
      throw invalid_argument("bytes", "a positive multiple of the granularity (" +
                                          format_bytes(granularity_) + ")",
                             "0", "Reserve at least one granule");
    }
    // Bookkeeping first, so that nothing can throw once the address range exists.
    range r{std::vector<std::optional<CUmemGenericAllocationHandle>>(bytes / granularity_)};
    cuda_device_guard guard(device_);
    const auto& drv = detail::cuda_driver();
    CUdeviceptr base = 0;
    const CUresult status = drv.mem_address_reserve(&base, bytes, granularity_, 0, 0);
    if (status == CUDA_ERROR_OUT_OF_MEMORY) {
      throw out_of_memory(oom("cuMemAddressReserve", bytes, status,
                              "the device address space is exhausted: reserve a smaller "
                              "arena capacity"));
    }
    cu_check(status, "cuMemAddressReserve");
    try {
      ranges_.emplace(static_cast<std::uintptr_t>(base), std::move(r));
    } catch (...) {
      (void)drv.mem_address_free(base, bytes);
      throw;
    }
    return reinterpret_cast<void*>(static_cast<std::uintptr_t>(base));
  }

  // One physical allocation per granule, so decommit can hand back any granule on its own
  // (cuMemUnmap cannot split a mapping). On failure nothing stays committed from this call.
  void commit(void* p, std::size_t bytes) {
    if (bytes == 0) return;
    auto [r, first] = locate(p, bytes, "commit");
    const std::size_t count = bytes / granularity_;
    for (std::size_t i = first; i < first + count; ++i) {
      if (r->granules[i]) {
        throw invalid_argument("p", "a range with no committed granule",
                               "granule " + std::to_string(i) + " already committed",
                               "Commit only what was reserved and not yet committed");
      }
    }
    cuda_device_guard guard(device_);
    const auto& drv = detail::cuda_driver();
    const auto base = reinterpret_cast<std::uintptr_t>(p);
    std::size_t done = 0;
    try {
      for (; done < count; ++done) {
        CUmemGenericAllocationHandle handle{};
        const CUresult created = drv.mem_create(&handle, granularity_, &prop_, 0);
        if (created == CUDA_ERROR_OUT_OF_MEMORY) {
          // Roll back first, so the report describes the state the caller is left with.
          unmap_granules(*r, first, done, base - first * granularity_);
          done = 0;
          throw out_of_memory(oom("cuMemCreate", bytes, created,
                                  "the device has no free physical memory: lower the "
                                  "batch/sequence length or the arena's other users"));
        }
        cu_check(created, "cuMemCreate");
        const CUresult mapped = drv.mem_map(base + done * granularity_, granularity_, 0, handle, 0);
        if (mapped != CUDA_SUCCESS) {
          (void)drv.mem_release(handle);
          cu_check(mapped, "cuMemMap");
        }
        r->granules[first + done] = handle;
      }
      CUmemAccessDesc access{};
      access.location = prop_.location;
      access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      cu_check(drv.mem_set_access(base, bytes, &access, 1), "cuMemSetAccess");
    } catch (...) {
      unmap_granules(*r, first, done, base - first * granularity_);
      throw;
    }
  }

  void decommit(void* p, std::size_t bytes) noexcept {
    const auto it = find(p);
    if (it == ranges_.end()) return;
    const std::size_t first = (reinterpret_cast<std::uintptr_t>(p) - it->first) / granularity_;
    const std::size_t count =
        std::min((bytes + granularity_ - 1) / granularity_, it->second.granules.size() - first);
    unmap_granules(it->second, first, count, it->first);
  }

  // `bytes` is what reserve got; the size kept at reserve time is what gets freed.
  void release(void* p, std::size_t /*bytes*/) noexcept {
    const auto it = ranges_.find(reinterpret_cast<std::uintptr_t>(p));
    if (it == ranges_.end()) return;
    cuda_device_guard guard(device_, std::nothrow);
    // Unmapping first keeps release safe even when a caller skipped decommit.
    unmap_granules(it->second, 0, it->second.granules.size(), it->first);
    (void)detail::cuda_driver().mem_address_free(static_cast<CUdeviceptr>(it->first),
                                                 it->second.granules.size() * granularity_);
    ranges_.erase(it);
  }

  // Bytes backed by physical memory in all ranges, for tests and diagnostics.
  std::size_t committed_bytes() const noexcept {
    std::size_t n = 0;
    for (const auto& [base, r] : ranges_) {
      for (const auto& g : r.granules) n += g ? granularity_ : 0;
    }
    return n;
  }

 private:
  struct range {
    std::vector<std::optional<CUmemGenericAllocationHandle>> granules;  // empty: not committed
  };
  using range_map = std::map<std::uintptr_t, range>;

  // The arena releases its range first; this only catches ranges a caller leaked.
  void release_all() noexcept {
    while (!ranges_.empty()) {
      const auto it = ranges_.begin();
      release(reinterpret_cast<void*>(it->first), it->second.granules.size() * granularity_);
    }
  }

  range_map::iterator find(const void* p) noexcept {
    const auto addr = reinterpret_cast<std::uintptr_t>(p);
    auto it = ranges_.upper_bound(addr);
    if (it == ranges_.begin()) return ranges_.end();
    --it;
    if (addr >= it->first + it->second.granules.size() * granularity_) return ranges_.end();
    return it;
  }

  // The reserved range holding [p, p + bytes) and the index of p's granule; throws otherwise.
  std::pair<range*, std::size_t> locate(void* p, std::size_t bytes, const char* who) {
    check_multiple(reinterpret_cast<std::uintptr_t>(p), "p", who);
    check_multiple(bytes, "bytes", who);
    const auto it = find(p);
    const auto addr = reinterpret_cast<std::uintptr_t>(p);
    if (it == ranges_.end() ||
        bytes > it->first + it->second.granules.size() * granularity_ - addr) {
      throw invalid_argument("p", "a range inside one reservation of this cuda_virtual_memory",
                             format_bytes(bytes) + " at " + std::to_string(addr),
                             "Pass addresses returned by reserve() on the same object");
    }
    return {&it->second, (addr - it->first) / granularity_};
  }

  void check_multiple(std::uintptr_t value, const char* argument, const char* who) const {
    if (value % granularity_ != 0) {
      throw invalid_argument(argument,
                             "a multiple of the granularity (" + format_bytes(granularity_) +
                                 ") for cuda_virtual_memory::" + who,
                             std::to_string(value), "Round up with membound::align_up");
    }
  }

  // Granules [first, first + count) of the range reserved at range_base.
  void unmap_granules(range& r, std::size_t first, std::size_t count,
                      std::uintptr_t range_base) noexcept {
    bool any = false;
    for (std::size_t i = first; i < first + count && !any; ++i) any = r.granules[i].has_value();
    if (!any) return;
    cuda_device_guard guard(device_, std::nothrow);
    // Unlike cudaFree, cuMemUnmap does not wait for kernels still using the memory.
    if (cudaDeviceSynchronize() != cudaSuccess) (void)cudaGetLastError();
    const auto& drv = detail::cuda_driver();
    for (std::size_t i = first; i < first + count; ++i) {
      auto& g = r.granules[i];
      if (!g) continue;
      (void)drv.mem_unmap(range_base + i * granularity_, granularity_);
      (void)drv.mem_release(*g);  // the memory goes back once it is both unmapped and released
      g.reset();
    }
  }

  oom_report oom(const char* call, std::size_t bytes, CUresult status, const char* hint) const {
    oom_report r;
    r.source = "cuda_virtual_memory";
    r.requested = r.growth_needed = bytes;
    r.detail = std::string(call) + ": " + detail::cuda_driver_error_string(status) + " (device " +
               std::to_string(device_) + ", committed " + format_bytes(committed_bytes()) + ")";
    r.hint = hint;
    return r;
  }

  int device_;
  std::size_t granularity_ = 0;
  CUmemAllocationProp prop_{};
  range_map ranges_;
};

static_assert(check_virtual_memory<cuda_virtual_memory>());

// A device arena whose blocks never move while it grows up to its reserved capacity.
using cuda_expandable_arena = expandable_arena<cuda_virtual_memory>;

MEMBOUND_NAMESPACE_END
