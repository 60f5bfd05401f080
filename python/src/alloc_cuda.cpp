// The framework allocator on CUDA devices, for PyTorch's CUDAPluggableAllocator
// (membound.torch.use_allocator): cudaMalloc below a stream-ordered caching allocator under the
// budget, the device's other users (the CUDA context, other processes) measured with
// cudaMemGetInfo whenever the reserve is about to grow. Plain C++ over the CUDA runtime API (no
// kernel), linked with the static runtime so the library needs no libcudart at run time.
// Compiled in CI; it has not run on a GPU yet.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <optional>
#include <string>

#include "framework_allocator.hpp"
#include "membound/backend/cuda/cuda_allocator.cuh"
#include "membound/backend/cuda/cuda_memory_info.cuh"

namespace {

struct device_probe {
  template <typename Budget>
  std::optional<std::size_t> operator()(int device, const Budget& budget) const {
    return membound::device_others_probe{device}(budget);
  }
};

using service_type = membound_python::framework_allocator<membound::cuda_device_allocator, device_probe>;

// Never destroyed: the framework may free from its own static destructors, after ours would run.
service_type& service() {
  static service_type& s = *new service_type;
  return s;
}
membound::stream_id stream_from(void* stream) {
  return membound::cuda_device_allocator::to_stream_id(static_cast<cudaStream_t>(stream));
}

}  // namespace

#include "framework_allocator_hooks.inl"
