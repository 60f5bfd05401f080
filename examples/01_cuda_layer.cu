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
#include <membound/backend/cuda/interop.cuh>
#include <membound/backend/cuda/mlp.cuh>
#include <membound/layers/swiglu_mlp.hpp>
#include <membound/memory/budget.hpp>
#include <membound/memory/caching_allocator.hpp>
#include <membound/memory/stream.hpp>

namespace mb = membound;

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::puts("01_cuda_layer: no GPU here, skipped");
    return 77;
  }
  using mlp = mb::swiglu_mlp<mb::bf16_precision, mb::cuda_backend>;
  // The project's stream; membound's executor borrows it, so the layer's kernels queue behind the
  // project's own work and before what follows, with no synchronization in between.
  cudaStream_t stream = nullptr;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  mb::cuda_executor ex(stream, 0);
  mb::budget_allocator<mb::caching_allocator<mb::cuda_device_allocator>> alloc(std::size_t{64} << 20);
  // The allocator as the stream sees it: a block freed while the stream's kernels may still use
  // it goes back to that stream only, never to another stream's request (memory/stream.hpp).
  mb::stream_view mem(alloc, mb::stream_of(ex));

  const mb::mlp_shape s{.batch = 2, .seq = 64, .width = 128, .hidden = 256};
  const std::size_t n = s.batch * s.seq * s.width, w = s.width * s.hidden;
  const std::size_t act_bytes = n * sizeof(__nv_bfloat16), w_bytes = 3 * w * sizeof(__nv_bfloat16);
  // The project's own buffers, in CUDA's bf16 type; storage_ptr hands them to the layer as they
  // are (same bits, no copy: backend/cuda/interop.cuh).
  auto* x = static_cast<__nv_bfloat16*>(mem.allocate(act_bytes));
  auto* y = static_cast<__nv_bfloat16*>(mem.allocate(act_bytes));
  auto* weights = static_cast<__nv_bfloat16*>(mem.allocate(w_bytes));
  // What the layer needs besides, asked before it runs.
  const std::size_t saved_bytes = mlp::saved_bytes(s), ws_bytes = mlp::forward_workspace_bytes(s, 1);
  void* saved = mem.allocate(saved_bytes);
  void* ws = mem.allocate(ws_bytes);
  // Zero inputs and weights: the output must be zero, whatever the kernels' order of sums.
  cudaMemsetAsync(x, 0, act_bytes, stream);
  cudaMemsetAsync(weights, 0, w_bytes, stream);
  const auto* W = mb::storage_ptr(static_cast<const __nv_bfloat16*>(weights));
  mlp::forward(s, {W, W + w, W + 2 * w}, mb::storage_ptr(static_cast<const __nv_bfloat16*>(x)), mb::storage_ptr(y),
               saved, saved_bytes, ws, ws_bytes, ex);
  std::vector<unsigned char> host(act_bytes, 1);
  cudaMemcpyAsync(host.data(), y, host.size(), cudaMemcpyDeviceToHost, stream);
  cudaStreamSynchronize(stream);
  bool zero = true;
  for (unsigned char b : host) zero = zero && b == 0;

  const std::size_t peak = alloc.stats().peak_requested;
  mem.deallocate(ws, ws_bytes);
  mem.deallocate(saved, saved_bytes);
  mem.deallocate(weights, w_bytes);
  mem.deallocate(y, act_bytes);
  mem.deallocate(x, act_bytes);
  const bool ok = zero && peak == 2 * act_bytes + w_bytes + saved_bytes + ws_bytes && alloc.stats().requested == 0;
  std::printf("01_cuda_layer: swiglu_mlp<bf16, cuda_backend> forward on the program's stream, %zu bytes from the budget: %s\n",
              peak, ok ? "OK" : "FAILED");
  alloc.upstream().release_cached();  // before the stream goes: nothing of it stays cached
  cudaStreamDestroy(stream);
  return ok ? 0 : 1;
}
