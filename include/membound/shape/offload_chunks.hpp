// The chunks of an offloaded optimizer update (planner: offload_options; the trainer's two staging
// buffers of one bucket each): the parameters go through in chunks of half a bucket, each half of
// the two buffers a slot, so that a device can copy one chunk in and the previous one out while
// the host updates the chunk between (backend/cuda/model.cuh). Chunks are whole multiples of the
// policy's range_granule, so update_range gives the bits of one whole update; a bucket of a
// single granule is one slot, unsplit. Both backends walk the same chunks, so the CPU's offload
// tests (bit for bit against the in-place step) hold the schedule the device runs.
#pragma once

#include <algorithm>
#include <cstddef>

#include "membound/core/config.hpp"

MEMBOUND_NAMESPACE_BEGIN

struct offload_chunks {
  std::size_t n = 0;       // the parameters updated
  std::size_t chunk = 0;   // parameters per chunk (the last may hold fewer)
  std::size_t slots = 0;   // 2 (halves of the staging buffers), or 1 (a single-granule bucket)
  std::size_t count = 0;   // chunks

  // bucket: parameters per staging buffer (a multiple of granule, or all of n), granule: the
  // policy's range_granule.
  static constexpr offload_chunks of(std::size_t n, std::size_t bucket, std::size_t granule) noexcept {
    const std::size_t half = granule == 0 ? 0 : bucket / 2 / granule * granule;
    offload_chunks c;
    c.n = n;
    c.chunk = half != 0 ? half : std::max<std::size_t>(bucket, 1);
    c.slots = half != 0 ? 2 : 1;
    c.count = n == 0 ? 0 : (n - 1) / c.chunk + 1;
    return c;
  }
  constexpr std::size_t first(std::size_t c) const noexcept { return c * chunk; }
  constexpr std::size_t size(std::size_t c) const noexcept { return std::min(chunk, n - first(c)); }
  // Chunk c's slot: its offset (in parameters) into each staging buffer.
  constexpr std::size_t slot_offset(std::size_t c) const noexcept { return (c % slots) * chunk; }
};

MEMBOUND_NAMESPACE_END
