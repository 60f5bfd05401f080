// Packed sequences on the device: the layers check and size a packed call from the host offsets
// (shape.offsets is host memory on every backend, as a plan reads it before step 1); the CUDA
// kernels read a device copy, which each call puts in a slot of its own workspace
// (packed_offsets_bytes, shape/packed_sequences.hpp), so the workspace a layer reports holds it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "membound/backend/cuda/cuda_backend.cuh"
#include "membound/backend/cuda/cuda_check.cuh"
#include "membound/core/config.hpp"
#include "membound/shape/packed_sequences.hpp"

MEMBOUND_NAMESPACE_BEGIN
namespace gpu {

// host's offsets copied to dst (host.count + 1 entries) on the executor's stream; the view the
// kernels take. From pageable memory the runtime stages the bytes before it returns (and may wait
// for the stream first, a stall of the host per call), so the caller may then change its array;
// from pinned memory the copy is asynchronous, and the array must stay as it is until the stream
// has run the call. Not packed: nothing is copied and the view stays empty.
inline packed_sequences stage_packing(const cuda_executor& ex, const packed_sequences& host,
                                      std::int32_t* dst) {
  if (!host.packed()) return {};
  cuda_check(cudaMemcpyAsync(dst, host.offsets, packed_offsets_bytes(host.count), cudaMemcpyHostToDevice,
                             ex.stream()),
             "cudaMemcpyAsync (packed sequences' offsets)");
  return packed_sequences{dst, host.count};
}

}  // namespace gpu
MEMBOUND_NAMESPACE_END
