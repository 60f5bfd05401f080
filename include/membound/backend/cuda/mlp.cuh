// The SwiGLU MLP on the GPU: the kernels that swiglu_mlp<..., cuda_backend> runs. Three cuBLASLt
// GEMMs and one fused elementwise kernel forward, the transposed GEMMs and one fused kernel
// backward, over the same saved pre-activations a = x·Wg and b = x·Wu as the CPU MLP.
//
// Keyed by the shape type (backend_kernels<cuda_backend, mlp_shape>), so this file needs the
// shape only, never layers/: the layer owns the call shape, the argument checks and the saved
// layout; this owns the device workspace and the launches.
//
// Precision: storage S (float, bf16, fp16), every GEMM and elementwise op computes in fp32. The
// intermediates that feed a GEMM (act, dact, da, db) are stored as S, because cuBLASLt takes both
// operands of a product in one type; the CPU keeps them in fp32. For fp32 storage that is the same
// arithmetic; for bf16/fp16 it is one more rounding per intermediate (what mixed-precision
// training on GPUs does), and the tests bound it. dx is summed from its two products in fp32 and
// rounded once.
#pragma once

#include <cstddef>
#include <limits>
#include <type_traits>

#include "membound/backend/cuda/cuda_backend.cuh"
#include "membound/backend/cuda/gemm.cuh"
#include "membound/backend/cuda/model.cuh"
#include "membound/core/checked_math.hpp"
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/memory/workspace.hpp"
#include "membound/policy/backend.hpp"
#include "membound/shape/mlp_shape.hpp"

MEMBOUND_NAMESPACE_BEGIN

template <>
struct backend_kernels<cuda_backend, mlp_shape> {
  // A and `threads` are the host backend's (the device computes in fp32 and sizes nothing per
  // host thread).
  template <typename S, typename A>
  static constexpr std::size_t forward_workspace_bytes(const mlp_shape& s,
                                                       std::size_t /*threads*/) noexcept {
    return fits(s) ? forward_layout<S>(s).size() : std::numeric_limits<std::size_t>::max();
  }
  template <typename S, typename A>
  static constexpr std::size_t backward_workspace_bytes(const mlp_shape& s,
                                                        std::size_t /*threads*/) noexcept {
    return fits(s) ? backward_layout<S>(s).size() : std::numeric_limits<std::size_t>::max();
  }

#if MEMBOUND_CUDA_COMPILER
  // a_s, b_s: the saved pre-activations [N, F], written here. The layer checked the shape, the
  // pointers and the saved buffer.
  template <typename S, typename A>
  static void forward(const mlp_shape& s, const S* wg, const S* wu, const S* wd, const S* x, S* y,
                      S* a_s, S* b_s, void* workspace, std::size_t workspace_size,
                      const cuda_executor& ex) {
    gpu::check_types<S, A>();
    const auto ws = carve(forward_layout<S>(s), workspace, workspace_size);
    const std::size_t N = s.batch * s.seq, C = s.width, F = s.hidden;
    const gpu::gemm_context ctx(ex, gpu::shared_gemm_cache(), ws.template get<std::byte>(f_gemm),
                                gpu::gemm_workspace_bytes_max);
    S* act = ws.template get<S>(f_act);
    gpu::matmul(ctx, x, wg, a_s, N, C, F, false);
    gpu::matmul(ctx, x, wu, b_s, N, C, F, false);
    gpu::swiglu_forward(ex, static_cast<const S*>(a_s), static_cast<const S*>(b_s), act, N * F);
    gpu::matmul(ctx, static_cast<const S*>(act), wd, y, N, F, C, false);
  }

  // Gradients are accumulated (+=) into gwg, gwu, gwd, as on the CPU.
  template <typename S, typename A>
  static void backward(const mlp_shape& s, const S* wg, const S* wu, const S* wd, const S* x,
                       const S* a_s, const S* b_s, const S* dy, S* dx, S* gwg, S* gwu, S* gwd,
                       void* workspace, std::size_t workspace_size, const cuda_executor& ex) {
    gpu::check_types<S, A>();
    const auto ws = carve(backward_layout<S>(s), workspace, workspace_size);
    const std::size_t N = s.batch * s.seq, C = s.width, F = s.hidden;
    const gpu::gemm_context ctx(ex, gpu::shared_gemm_cache(), ws.template get<std::byte>(b_gemm),
                                gpu::gemm_workspace_bytes_max);
    S* act = ws.template get<S>(b_act);  // act, then dact, then da (in place)
    S* db = ws.template get<S>(b_db);
    gpu::swiglu_forward(ex, a_s, b_s, act, N * F);
    gpu::matmul_at(ctx, static_cast<const S*>(act), dy, gwd, N, F, C, true);
    gpu::matmul_bt(ctx, dy, wd, act, N, C, F, false);
    gpu::swiglu_backward(ex, a_s, b_s, static_cast<const S*>(act), act, db, N * F);
    const S* da = act;
    gpu::matmul_at(ctx, x, da, gwg, N, C, F, true);
    gpu::matmul_at(ctx, x, static_cast<const S*>(db), gwu, N, C, F, true);
    if constexpr (std::is_same_v<S, float>) {
      gpu::matmul_bt(ctx, da, wg, dx, N, F, C, false);
      gpu::matmul_bt(ctx, static_cast<const S*>(db), wu, dx, N, F, C, true);
    } else {
      float* dxf = ws.template get<float>(b_dx);
      gpu::matmul_bt(ctx, da, wg, dxf, N, F, C, false);
      gpu::matmul_bt(ctx, static_cast<const S*>(db), wu, dxf, N, F, C, true);
      gpu::convert(ex, static_cast<const float*>(dxf), dx, N * C);
    }
  }
#else
  // The launches exist only where nvcc compiles: the size functions above are all a host-only
  // translation unit (a planner, a .cpp) can use.
  template <typename S, typename A, typename... Args>
  static void forward(Args&&...) {
    static_assert(dependent_false<S, A>,
                  "membound: swiglu_mlp<..., cuda_backend>::forward launches CUDA kernels; compile "
                  "this translation unit with nvcc (a .cu file, or LANGUAGE CUDA in CMake).");
  }
  template <typename S, typename A, typename... Args>
  static void backward(Args&&...) {
    static_assert(dependent_false<S, A>,
                  "membound: swiglu_mlp<..., cuda_backend>::backward launches CUDA kernels; compile "
                  "this translation unit with nvcc (a .cu file, or LANGUAGE CUDA in CMake).");
  }
#endif

 private:
  static constexpr bool fits(const mlp_shape& s) noexcept {
    return bytes_of<float>(s.batch * s.seq, s.hidden) != std::numeric_limits<std::size_t>::max() &&
           bytes_of<float>(s.batch * s.seq, s.width) != std::numeric_limits<std::size_t>::max() &&
           s.batch * s.seq / (s.batch == 0 ? 1 : s.batch) == s.seq;
  }

  // cuBLASLt's workspace first: 256-byte aligned, as cuBLAS requires.
  enum forward_slot : std::size_t { f_gemm, f_act };
  template <typename S>
  static constexpr workspace_layout<2> forward_layout(const mlp_shape& s) {
    workspace_layout<2> l;
    l.add(gpu::gemm_workspace_bytes_max, gpu::gemm_workspace_alignment);
    l.add(bytes_of<S>(s.batch * s.seq, s.hidden));
    return l;
  }
  enum backward_slot : std::size_t { b_gemm, b_act, b_db, b_dx };
  template <typename S>
  static constexpr workspace_layout<4> backward_layout(const mlp_shape& s) {
    workspace_layout<4> l;
    l.add(gpu::gemm_workspace_bytes_max, gpu::gemm_workspace_alignment);
    l.add(bytes_of<S>(s.batch * s.seq, s.hidden));
    l.add(bytes_of<S>(s.batch * s.seq, s.hidden));
    l.add(std::is_same_v<S, float> ? 0 : bytes_of<float>(s.batch * s.seq, s.width));
    return l;
  }
};

MEMBOUND_NAMESPACE_END
