// The LM head on the GPU: the kernels that lm_head<..., cuda_backend> runs. Final RMSNorm, then per
// chunk of rows: logits = xn·Wᵀ (cuBLASLt, fp32 out), the fused softmax-cross-entropy that turns
// them into their gradient in place, dW += dlogitsᵀ·xn and dxn = dlogits·W; then the RMSNorm
// backward. As on the CPU, only [chunk, V] logits ever exist.
//
// Keyed by the shape type (backend_kernels<cuda_backend, lm_head_shape>), so this file needs the
// shape only, never layers/: the layer owns the call shape and the argument checks; this owns the
// device workspace and the launches.
//
// Precision: storage S (float, bf16, fp16), every product and the softmax in fp32, the loss in
// double. cuBLASLt takes both operands of a product in one type, so for bf16/fp16 each chunk's
// dlogits are rounded to S before the two backward GEMMs (the CPU keeps them in fp32; the tests
// bound the difference). dW is summed over the chunks in an fp32 accumulator and added to the
// gradient with one rounding, as the CPU does. dxn goes straight from the GEMM's fp32 sum into
// xn's rows as S (one rounding, as the CPU's narrow into the same slot): the rows of a chunk are
// dead once its two GEMMs have read them, so no [N, C] fp32 buffer is needed.
//
// Synchronization: the loss is returned as a host double, so each call ends with one
// cudaMemcpyAsync of the device total on the executor's stream and one cudaStreamSynchronize of
// that stream; that is the only sync. The targets are device int32 and are not checked here
// (checking them would take a copy and a sync): the caller checks the host copy with
// lm_head::check_targets before the upload, as model does. ignore_target rows count nothing; any
// other id outside [0, V) still reads nothing outside the logits: its row's loss is NaN, so the
// returned loss is NaN.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>

#include "membound/backend/cuda/cuda_backend.cuh"
#include "membound/backend/cuda/cuda_check.cuh"
#include "membound/backend/cuda/gemm.cuh"
#include "membound/backend/cuda/model.cuh"
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/core/error.hpp"
#include "membound/memory/workspace.hpp"
#include "membound/policy/backend.hpp"
#include "membound/shape/lm_head_shape.hpp"

MEMBOUND_NAMESPACE_BEGIN

namespace gpu {

#if MEMBOUND_CUDA_COMPILER
namespace detail {
// g = g + acc, one rounding to S per element (cpu::add_grad).
template <typename S>
__global__ void add_accumulated_kernel(const float* acc, S* g, std::size_t n) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += std::size_t{gridDim.x} * blockDim.x)
    st(g, i, ld(g, i) + acc[i]);
}
}  // namespace detail

// g += acc over n values: an fp32 gradient accumulator added into S storage.
template <kernel_storage S>
void add_accumulated(const cuda_executor& ex, const float* acc, S* g, std::size_t n) {
  if (n == 0) return;
  detail::need_pointer(acc, "acc");
  detail::need_pointer(g, "g");
  detail::add_accumulated_kernel<<<detail::grid_for(n, 256), 256, 0, ex.stream()>>>(acc, g, n);
  cuda_executor::check_launch("add_accumulated_kernel");
}
#endif  // MEMBOUND_CUDA_COMPILER

}  // namespace gpu

template <>
struct backend_kernels<cuda_backend, lm_head_shape> {
  // What only the device checks, before the front checks the workspace (and again before any
  // launch): a finite scale (the loss alone passes 0) and buffers that fit in memory. Device
  // targets are not read here (see layers/lm_head.hpp).
  template <typename S>
  static void check_call(const lm_head_shape& s, const std::int32_t* /*targets*/, double scale) {
    if (!std::isfinite(scale)) {
      throw invalid_argument("scale", "a finite number", std::to_string(scale),
                             "Pass e.g. 1/tokens");
    }
    if (!fits<S>(s)) {
      throw invalid_argument("shape", "rows·width, chunk·vocab and vocab·width that fit in memory",
                             std::to_string(s.rows) + "·" + std::to_string(s.width) + ", " +
                                 std::to_string(s.vocab),
                             "Check the lm_head_shape");
    }
  }

  // Exact: what loss_backward and loss carve (both take the same workspace). A and `threads` are
  // the host backend's (the device computes in fp32 and sizes nothing per host thread).
  template <typename S, typename A>
  static constexpr std::size_t workspace_bytes(const lm_head_shape& s, std::size_t /*threads*/) {
    return fits<S>(s) ? layout<S>(s).size() : std::numeric_limits<std::size_t>::max();
  }

#if MEMBOUND_CUDA_COMPILER
  // Σ_rows cross-entropy; dx = ∂(scale·Σ loss)/∂x, dnorm and dw accumulated (+=). The layer checked
  // the shape and the pointers.
  template <typename S, typename A>
  static double loss_backward(const lm_head_shape& s, const S* norm, const S* w, const S* x,
                              const std::int32_t* targets, double scale, S* dx, S* dnorm, S* dw,
                              void* workspace, std::size_t workspace_size, const cuda_executor& ex) {
    gpu::check_types<S, A>();
    return run<S>(s, norm, w, x, targets, scale, dx, dnorm, dw, workspace, workspace_size, ex);
  }

  // The summed cross-entropy alone: the same launches up to the gradients, so the same value.
  template <typename S, typename A>
  static double loss(const lm_head_shape& s, const S* norm, const S* w, const S* x,
                     const std::int32_t* targets, void* workspace, std::size_t workspace_size,
                     const cuda_executor& ex) {
    gpu::check_types<S, A>();
    return run<S>(s, norm, w, x, targets, 0.0, nullptr, nullptr, nullptr, workspace,
                  workspace_size, ex);
  }

 private:
  // dx == nullptr: the loss alone.
  template <typename S>
  static double run(const lm_head_shape& s, const S* norm, const S* w, const S* x,
                    const std::int32_t* targets, double scale, S* dx, S* dnorm, S* dw,
                    void* workspace, std::size_t workspace_size, const cuda_executor& ex) {
    constexpr bool fp32 = std::is_same_v<S, float>;
    check_call<S>(s, targets, scale);
    const auto l = layout<S>(s);
    const auto ws = carve(l, workspace, workspace_size);
    std::optional<cuda_device_guard> guard;  // the memset, copy and launches go to the current device
    if (cuda_current_device() != ex.device()) guard.emplace(ex.device());
    const bool backward = dx != nullptr;
    const std::size_t N = s.rows, C = s.width, V = s.vocab, R = std::min(s.chunk, s.rows);
    const gpu::gemm_context ctx(ex, gpu::shared_gemm_cache(), ws.template get<std::byte>(k_gemm),
                                gpu::gemm_workspace_bytes_max);
    S* xn = ws.template get<S>(k_xn);
    float* rstd = ws.template get<float>(k_rstd);
    float* logits = ws.template get<float>(k_logits);
    S* dl = ws.template get<S>(k_dl);           // 0 bytes for fp32: the GEMMs read logits
    float* acc = ws.template get<float>(k_dw);  // 0 bytes for fp32: dW accumulates in place
    double* total = ws.template get<double>(k_total);
    gpu::rmsnorm_forward(ex, x, norm, xn, rstd, N, C, s.eps);
    cuda_check(cudaMemsetAsync(total, 0, sizeof(double), ex.stream()), "cudaMemsetAsync");
    for (std::size_t r0 = 0; r0 < N; r0 += R) {
      const std::size_t r = std::min(R, N - r0);
      S* xr = xn + r0 * C;
      gpu::matmul_bt(ctx, static_cast<const S*>(xr), w, logits, r, C, V, false);
      gpu::cross_entropy_chunk(ex, logits, targets + r0, r, V, scale, total,
                               ws.template get<std::byte>(k_rowloss), gpu::cross_entropy_workspace_bytes(R));
      if (!backward) continue;
      if constexpr (fp32) {
        gpu::matmul_at(ctx, static_cast<const float*>(logits), static_cast<const float*>(xr), dw, r, V, C, true);
        // dxn over the chunk's own xn rows: both GEMMs above have read them (stream order).
        gpu::matmul(ctx, static_cast<const float*>(logits), w, xr, r, V, C, false);
      } else {
        gpu::convert(ex, static_cast<const float*>(logits), dl, r * V);  // cuBLASLt: one input type
        gpu::matmul_at(ctx, static_cast<const S*>(dl), static_cast<const S*>(xr), acc, r, V, C, r0 != 0);
        gpu::matmul(ctx, static_cast<const S*>(dl), w, xr, r, V, C, false);
      }
    }
    if (backward) {
      if constexpr (!fp32) gpu::add_accumulated(ex, static_cast<const float*>(acc), dw, V * C);
      gpu::rmsnorm_backward(ex, x, norm, static_cast<const float*>(rstd), static_cast<const S*>(xn),
                            static_cast<const S*>(nullptr), dx, dnorm, ws.template get<std::byte>(k_partial),
                            gpu::rmsnorm_backward_workspace_bytes(N, C), N, C);
    }
    // The only sync of the call: the loss is a host value.
    double loss = 0;
    cuda_check(cudaMemcpyAsync(&loss, total, sizeof(double), cudaMemcpyDeviceToHost, ex.stream()),
               "cudaMemcpyAsync");
    ex.synchronize();
    return loss;
  }

#else
  // A plain C++ translation unit may size the head (workspace_bytes) but not run it: the launches
  // need nvcc.
  template <typename S, typename A, typename... Args>
  static double loss_backward(const lm_head_shape&, Args&&...) {
    static_assert(dependent_false<S, A>,
                  "membound: lm_head on cuda_backend runs only in a file compiled with nvcc.");
    return 0;
  }
  template <typename S, typename A, typename... Args>
  static double loss(const lm_head_shape&, Args&&...) {
    static_assert(dependent_false<S, A>,
                  "membound: lm_head on cuda_backend runs only in a file compiled with nvcc.");
    return 0;
  }

 private:
#endif  // MEMBOUND_CUDA_COMPILER

  // Slots this large would overflow the layout's placement (as memory/workspace.hpp's detail::huge_slot).
  static constexpr std::size_t huge = std::numeric_limits<std::size_t>::max() / 32;
  template <typename S>
  static constexpr bool fits(const lm_head_shape& s) noexcept {
    const std::size_t R = std::min(s.chunk, s.rows);
    return bytes_of<float>(s.rows, s.width) < huge && bytes_of<float>(R, s.vocab) < huge &&
           bytes_of<float>(s.vocab, s.width) < huge;
  }

  // Phase 0: the norm and the chunks; phase 1: the RMSNorm backward, whose partials reuse the
  // chunk scratch. cuBLASLt's workspace first: 256-byte aligned, as cuBLAS requires.
  enum slot : std::size_t { k_gemm, k_xn, k_rstd, k_logits, k_dl, k_dw, k_rowloss, k_partial, k_total };
  template <typename S>
  static constexpr workspace_layout<9> layout(const lm_head_shape& s) {
    constexpr bool fp32 = std::is_same_v<S, float>;
    const std::size_t N = s.rows, C = s.width, V = s.vocab, R = std::min(s.chunk, s.rows);
    workspace_layout<9> l;
    l.add(gpu::gemm_workspace_bytes_max, gpu::gemm_workspace_alignment, {0, 0});
    l.add(bytes_of<S>(N, C), default_alignment, {0, 1});                      // xn, then dxn
    l.add(bytes_of<float>(N), default_alignment, {0, 1});                     // rstd
    l.add(bytes_of<float>(R, V), default_alignment, {0, 0});                  // logits → dlogits
    l.add(fp32 ? 0 : bytes_of<S>(R, V), default_alignment, {0, 0});           // dlogits as S
    l.add(fp32 ? 0 : bytes_of<float>(V, C), default_alignment, {0, 1});       // dW accumulator
    l.add(gpu::cross_entropy_workspace_bytes(R), default_alignment, {0, 0});  // row losses
    l.add(gpu::rmsnorm_backward_workspace_bytes(N, C), default_alignment, {1, 1});
    l.add(sizeof(double), default_alignment, {0, 1});                         // loss total
    return l;
  }
};

MEMBOUND_NAMESPACE_END
