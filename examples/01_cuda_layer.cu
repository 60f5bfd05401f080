// 01: one membound layer inside an existing CUDA program.
//
// The program keeps its own structure: its stream, its buffers, its forward. membound brings one
// layer (here the bf16 SwiGLU MLP on cuda_backend; attention, Mamba and TTT have the same shape of
// call), and the memory for everything comes from a budgeted, stream-ordered device allocator
// whose every byte is counted. The layer reports what it needs before it runs (saved_bytes,
// forward_workspace_bytes), so the caller allocates exactly that.
//
// Built with nothing but target_link_libraries(app PRIVATE membound::cuda) (docs/cmake.md); the
// consumer tests build it by find_package, add_subdirectory and FetchContent. Without a GPU it
// exits 77 (ctest: skipped).
//
//   ./build/release/examples/01_cuda_layer
#include <cuda_runtime_api.h>

#include <cstdio>
#include <vector>

#include <membound/backend/cuda/cuda_allocator.cuh>
#include <membound/backend/cuda/mlp.cuh>
#include <membound/layers/swiglu_mlp.hpp>
#include <membound/memory/budget.hpp>
#include <membound/memory/caching_allocator.hpp>

namespace mb = membound;

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::puts("01_cuda_layer: no GPU here, skipped");
    return 77;
  }
  using mlp = mb::swiglu_mlp<mb::bf16_precision, mb::cuda_backend>;
  using S = mlp::storage_type;
  mb::cuda_executor ex;  // the project's stream would do as well: the layer runs where ex says
  const mb::stream_id stream = mb::cuda_device_allocator::to_stream_id(ex.stream());
  mb::budget_allocator<mb::caching_allocator<mb::cuda_device_allocator>> alloc(std::size_t{64} << 20);

  const mb::mlp_shape s{.batch = 2, .seq = 64, .width = 128, .hidden = 256};
  const std::size_t n = s.batch * s.seq * s.width, w = s.width * s.hidden;
  // Every buffer from the budget, on the executor's stream (blocks freed there are reused there).
  auto take = [&](std::size_t bytes) { return alloc.allocate(bytes, mb::default_alignment, mb::memory_tag::other, stream); };
  void* x = take(n * sizeof(S));
  void* y = take(n * sizeof(S));
  void* weights = take(3 * w * sizeof(S));
  void* saved = take(mlp::saved_bytes(s));
  const std::size_t ws_bytes = mlp::forward_workspace_bytes(s, 1);
  void* ws = take(ws_bytes);
  // Zero inputs and weights: the output must be zero, whatever the kernels' order of sums.
  cudaMemsetAsync(x, 0, n * sizeof(S), ex.stream());
  cudaMemsetAsync(weights, 0, 3 * w * sizeof(S), ex.stream());
  const auto* W = static_cast<const S*>(weights);
  mlp::forward(s, {W, W + w, W + 2 * w}, static_cast<const S*>(x), static_cast<S*>(y), saved,
               mlp::saved_bytes(s), ws, ws_bytes, ex);
  std::vector<unsigned char> host(n * sizeof(S), 1);
  cudaMemcpyAsync(host.data(), y, host.size(), cudaMemcpyDeviceToHost, ex.stream());
  ex.synchronize();
  bool zero = true;
  for (unsigned char b : host) zero = zero && b == 0;

  const std::size_t peak = alloc.stats().peak_requested;
  alloc.deallocate(ws, ws_bytes, mb::default_alignment, mb::memory_tag::other);
  alloc.deallocate(saved, mlp::saved_bytes(s), mb::default_alignment, mb::memory_tag::other);
  alloc.deallocate(weights, 3 * w * sizeof(S), mb::default_alignment, mb::memory_tag::other);
  alloc.deallocate(y, n * sizeof(S), mb::default_alignment, mb::memory_tag::other);
  alloc.deallocate(x, n * sizeof(S), mb::default_alignment, mb::memory_tag::other);
  const bool ok = zero && peak == 2 * n * sizeof(S) + 3 * w * sizeof(S) + mlp::saved_bytes(s) + ws_bytes &&
                  alloc.stats().requested == 0;
  std::printf("01_cuda_layer: swiglu_mlp<bf16, cuda_backend> forward on its own stream, %zu bytes from the budget: %s\n",
              peak, ok ? "OK" : "FAILED");
  return ok ? 0 : 1;
}
