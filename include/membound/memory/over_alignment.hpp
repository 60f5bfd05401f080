// Alignments above what an upstream guarantees, served by over-allocating: the bookkeeping the
// CUDA device and pinned allocators share (cudaMalloc and cudaHostAlloc promise 256 bytes).
//
//   detail::over_aligned_blocks<256> over;
//   const std::size_t reserved = over.growth_for(bytes, alignment);  // bytes + alignment - 256 above 256
//   void* raw = upstream_alloc(reserved);
//   void* p = over.place(raw, reserved, alignment);   // throws only if the record cannot be made
//   ...
//   const auto [raw, reserved] = over.release(p, bytes, alignment);  // what to free, and how much
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <utility>

#include "membound/core/config.hpp"
#include "membound/memory/allocator.hpp"

MEMBOUND_NAMESPACE_BEGIN

namespace detail {

template <std::size_t Guaranteed>
class over_aligned_blocks {
 public:
  static constexpr std::size_t guaranteed_alignment = Guaranteed;

  // What the upstream must reserve for `bytes` at `alignment`: exact, so that growth_for (and the
  // planner's reserve) counts what an allocation really takes.
  static constexpr std::size_t growth_for(std::size_t bytes, std::size_t alignment) noexcept {
    if (bytes == 0) return 0;
    return alignment <= Guaranteed ? bytes : bytes + (alignment - Guaranteed);
  }

  // The pointer to hand out for the upstream's block `raw` of `reserved` bytes: raw itself at a
  // guaranteed alignment, else the first aligned address in it, recorded for release. If the
  // record cannot be made (std::bad_alloc) the caller still owns raw and frees it.
  void* place(void* raw, std::size_t reserved, std::size_t alignment) {
    if (alignment <= Guaranteed) return raw;
    void* p = reinterpret_cast<void*>(align_up(reinterpret_cast<std::uintptr_t>(raw), alignment));
    blocks_.emplace(p, block{raw, reserved});
    return p;
  }

  // The upstream block behind p (handed out for `bytes` at `alignment`) and its reserved bytes;
  // the record is dropped.
  std::pair<void*, std::size_t> release(void* p, std::size_t bytes, std::size_t alignment) noexcept {
    if (alignment > Guaranteed) {
      if (const auto it = blocks_.find(p); it != blocks_.end()) {
        const block b = it->second;
        blocks_.erase(it);
        return {b.raw, b.reserved};
      }
    }
    return {p, bytes};
  }

  std::size_t recorded() const noexcept { return blocks_.size(); }

 private:
  struct block {
    void* raw;             // what the upstream returned, for its free
    std::size_t reserved;  // bytes asked of it
  };
  std::unordered_map<void*, block> blocks_;  // usually empty
};

}  // namespace detail

MEMBOUND_NAMESPACE_END
