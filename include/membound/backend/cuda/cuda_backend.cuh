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
//
// It also carries the kernel choices of the layers it runs (gpu::kernel_choices): where more than
// one set of kernels computes a layer, which one. They are the executor's, not the process's, so
// two executors (two models, a test beside a run) choose independently; each default is the
// fastest the device takes, and a choice a device cannot run falls back per launch.
//   membound::cuda_executor exec;
//   exec.set_kernels({.attention = membound::gpu::attention_kernels::simt_wmma});
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <limits>
#include <memory>
#include <string>

#include "membound/backend/cuda/cuda_check.cuh"
#include "membound/core/config.hpp"
#include "membound/core/error.hpp"
#include "membound/core/memory_tag.hpp"
#include "membound/core/parallel.hpp"
#include "membound/policy/backend.hpp"

MEMBOUND_NAMESPACE_BEGIN

// Throws backend_error naming the cuBLASLt call.
inline void cublas_check(cublasStatus_t status, const char* call) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  throw backend_error(call, static_cast<int>(status), cublasLtGetStatusString(status));
}

namespace gpu {
// Which attention kernels run for bf16/fp16 storage at head_dim <= 128. tensor_core (the default
// since its own test cases and the example trainer passed on an H200, 2026-11-27: 6.8-25x the
// WMMA/SIMT pair's TFLOP/s at T = 2k-8k, the trainer's loss within 0.73% after 30 steps): the
// mma.sync kernels of attention_mma.cuh, where the device can run them (sm_80 and up with the
// dK/dV pass's shared memory; else the others run). simt_wmma: the first kernels (a WMMA forward,
// the SIMT backward). fp32 storage and larger heads always run the SIMT kernels. cudnn (the default
// in a program built with MEMBOUND_WITH_CUDNN): cuDNN's fused flash attention
// (backend/cuda/cudnn_attention.cuh) where cuDNN loads and can run the call inside the plan's
// slots, else the tensor-core kernels as above.
enum class attention_kernels : unsigned { simt_wmma = 0, tensor_core = 1, cudnn = 2 };

// A cuda_executor's kernel choices (see the top of this file).
struct kernel_choices {
#if defined(MEMBOUND_WITH_CUDNN)
  attention_kernels attention = attention_kernels::cudnn;
#else
  attention_kernels attention = attention_kernels::tensor_core;
#endif
  // With cudnn: ask for cuDNN's deterministic backward (bit-identical repeats; on Hopper it takes
  // a B·H·T²·2-byte workspace, and where that does not fit our kernels run the backward). False:
  // its atomic dQ (faster; repeats differ in the last bits).
  bool cudnn_deterministic = true;
  // The most dynamic shared memory the TTT inner loop takes, under the device's own opt-in limit
  // (227 KiB on sm_90, 163 KiB on sm_80, 99 KiB on sm_86/89; the default: all of it). Lower, its
  // buffers move to global scratch, coldest first (gpu::ttt_placement); the results do not change
  // by a bit and the plan does not change (the scratch is reserved in full).
  std::size_t ttt_shared_limit = std::numeric_limits<std::size_t>::max();
};
}  // namespace gpu

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
  // cudaStreamLegacy) is refused: launches on it would wait for, and block, every other stream
  // (the constructor below borrows it when that is what the caller means).
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

  // The tag of the constructor below.
  struct legacy_default_stream_t {
    explicit legacy_default_stream_t() = default;
  };
  // Borrows the legacy default stream, asked for by name: for a framework whose own work runs there
  // (PyTorch's default stream is it), so that our launches are ordered with the framework's on
  // every host thread, as its own kernels are. They then also wait for, and block, the process's
  // other blocking streams, which is what that framework's kernels do already.
  cuda_executor(legacy_default_stream_t, int device) : device_(device), stream_(cudaStreamLegacy) {
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
  // The kernels this executor's layers choose (see gpu::kernel_choices). Set between calls: a
  // layer reads them as it launches.
  const gpu::kernel_choices& kernels() const noexcept { return kernels_; }
  void set_kernels(const gpu::kernel_choices& k) noexcept { kernels_ = k; }

  // The host threads of the work this executor runs on the CPU (the offloaded optimizer's update,
  // backend/cuda/model.cuh), made at the first use: thread_pool::default_threads() of them, or
  // set_host_threads' count (before that use).
  thread_pool& host_pool() {
    if (!host_pool_) {
      host_pool_ = std::make_unique<thread_pool>(host_threads_ != 0 ? host_threads_ : thread_pool::default_threads());
    }
    return *host_pool_;
  }
  void set_host_threads(std::size_t threads) {
    if (host_pool_) {
      throw invalid_argument("threads", "set before the executor's host pool is first used", std::to_string(threads),
                             "Call set_host_threads right after making the executor");
    }
    if (threads == 0 || threads > thread_pool::max_threads) {
      throw invalid_argument("threads", "between 1 and " + std::to_string(thread_pool::max_threads),
                             std::to_string(threads), "Pass thread_pool::default_threads() for one per core");
    }
    host_threads_ = threads;
  }

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
  gpu::kernel_choices kernels_{};
  std::size_t host_threads_ = 0;
  std::unique_ptr<thread_pool> host_pool_;
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
