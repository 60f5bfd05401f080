// The CUDA backend policy and its executor.
//
//   membound::cuda_executor exec;                         // a new non-blocking stream on the
//                                                         // current device, and a cuBLASLt handle
//   using mlp = membound::swiglu_mlp<membound::bf16_precision, membound::cuda_backend>;
//   mlp::forward(shape, w, x, y, saved, saved_bytes, ws, ws_bytes, exec);
//
// The executor is to the device what thread_pool is to the host: every kernel of a call is
// launched on its stream, in order, and nothing is synchronized on the host. It never uses the
// legacy default stream, which would serialize against every other stream of the process.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>

#include "membound/backend/cuda/cuda_check.cuh"
#include "membound/core/config.hpp"
#include "membound/core/error.hpp"
#include "membound/core/memory_tag.hpp"
#include "membound/policy/backend.hpp"

MEMBOUND_NAMESPACE_BEGIN

// Throws backend_error naming the cuBLASLt call.
inline void cublas_check(cublasStatus_t status, const char* call) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  throw backend_error(call, static_cast<int>(status), cublasLtGetStatusString(status));
}

// A stream and a cuBLASLt handle on one device. Owns what it creates; a stream passed in is
// borrowed (the caller keeps it alive and destroys it).
class cuda_executor {
 public:
  // A new non-blocking stream on the current device.
  cuda_executor() : cuda_executor(cuda_current_device()) {}

  explicit cuda_executor(int device) : device_(device) {
    cuda_device_guard guard(device_);
    cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
               "cudaStreamCreateWithFlags");
    owns_stream_ = true;
    try {
      cublas_check(cublasLtCreate(&lt_), "cublasLtCreate");
    } catch (...) {
      (void)cudaStreamDestroy(stream_);
      throw;
    }
  }

  // Borrows `stream` (e.g. a framework's current stream). The legacy default stream (0 or
  // cudaStreamLegacy) is refused: launches on it would wait for, and block, every other stream.
  cuda_executor(cudaStream_t stream, int device) : device_(device), stream_(stream) {
    if (stream == nullptr || stream == cudaStreamLegacy) {
      throw invalid_argument("stream", "a stream created by the caller (or cudaStreamPerThread)",
                             "the legacy default stream",
                             "Create one with cudaStreamCreateWithFlags(&s, "
                             "cudaStreamNonBlocking), or use cuda_executor(device) to own one");
    }
    cuda_device_guard guard(device_);
    cublas_check(cublasLtCreate(&lt_), "cublasLtCreate");
  }

  cuda_executor(const cuda_executor&) = delete;
  cuda_executor& operator=(const cuda_executor&) = delete;

  ~cuda_executor() {
    cuda_device_guard guard(device_, std::nothrow);
    if (lt_ != nullptr) (void)cublasLtDestroy(lt_);
    if (owns_stream_) (void)cudaStreamDestroy(stream_);
  }

  cudaStream_t stream() const noexcept { return stream_; }
  cublasLtHandle_t lt() const noexcept { return lt_; }
  int device() const noexcept { return device_; }

  // Waits for everything launched on the stream; reports an asynchronous kernel error as a
  // backend_error. For tests and step boundaries, never inside a layer.
  void synchronize() const { cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); }

  // The error of the last launch on this thread (launch configuration, not kernel faults).
  static void check_launch(const char* kernel) { cuda_check(cudaGetLastError(), kernel); }

 private:
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  bool owns_stream_ = false;
  cublasLtHandle_t lt_ = nullptr;
};

// The device's workspaces do not grow with host threads: its size functions ignore the count,
// which is 1 here (core/parallel.hpp has the thread_pool's overload).
inline constexpr std::size_t workspace_threads(const cuda_executor&) noexcept { return 1; }

// The device backend: CUDA kernels and cuBLASLt on a cuda_executor's stream, over device memory.
struct cuda_backend {
  using policy_kind = backend_kind;
  using executor = cuda_executor;
  static constexpr memory_space space = memory_space::device;
  static constexpr const char* name = "cuda";
};
static_assert(backend_policy<cuda_backend>);

template <typename B>
inline constexpr bool is_cuda_backend_v = std::same_as<B, cuda_backend>;

MEMBOUND_NAMESPACE_END
