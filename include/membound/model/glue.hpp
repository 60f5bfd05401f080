// The model's own ops (RMSNorm, the residual add, the embedding's gather and scatter) on the
// backend its layers run on. block and model call them through model_glue_of<Backend>, so one
// schedule, one allocation order and one plan serve both backends:
//   cpu_backend   cpu_model_glue below (backend/cpu/model_cpu.hpp over a thread_pool);
//   cuda_backend  backend_kernels<cuda_backend, model_glue> (backend/cuda/model_kernels.cuh, over
//                 a cuda_executor: every pointer is device memory, nothing synchronizes).
// Every function takes the accumulation type A first; the norm's backward scratch is sized by
// norm_backward_scratch_bytes<A, S>(N, C), the exact bytes of that backend's row-block partials.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "membound/backend/cpu/model_cpu.hpp"
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/core/parallel.hpp"
#include "membound/policy/backend.hpp"

MEMBOUND_NAMESPACE_BEGIN

struct cpu_model_glue {
  using executor = thread_pool;
  // The thread count the CPU size functions take (per-thread scratch).
  static std::size_t threads(const thread_pool& pool) noexcept { return pool.size(); }

  template <typename A, typename S>
  static constexpr std::size_t norm_backward_scratch_bytes(std::size_t N, std::size_t C) noexcept {
    return bytes_of<A>(cpu::row_partials(N, C));
  }
  template <typename A, typename S>
  static void rmsnorm_forward(thread_pool& pool, const S* x, const S* g, S* y, A* rstd, std::size_t N,
                              std::size_t C, double eps) {
    cpu::rmsnorm_forward(pool, x, g, y, rstd, N, C, eps);
  }
  template <typename A, typename S>
  static void rmsnorm_apply(thread_pool& pool, const S* x, const S* g, const A* rstd, S* y, std::size_t N,
                            std::size_t C) {
    cpu::rmsnorm_apply(pool, x, g, rstd, y, N, C);
  }
  // dx = residual + RMSNorm'ᵀ(dy), dg += its scale gradient; scratch: norm_backward_scratch_bytes.
  template <typename A, typename S>
  static void rmsnorm_backward(thread_pool& pool, const S* x, const S* g, const A* rstd, const S* dy,
                               const S* residual, S* dx, S* dg, void* scratch, std::size_t N, std::size_t C) {
    cpu::rmsnorm_backward(pool, x, g, rstd, dy, residual, dx, dg, static_cast<A*>(scratch), N, C);
  }
  template <typename A, typename S>
  static void add_rows(thread_pool& pool, const S* a, const S* b, S* y, std::size_t N, std::size_t C) {
    cpu::add_rows<A>(pool, a, b, y, N, C);
  }
  // The ids were checked against V before (model::check_tokens): V is the device's bound only.
  template <typename A, typename S>
  static void embedding_gather(thread_pool& pool, const std::int32_t* tokens, const S* table, S* x, std::size_t N,
                               std::size_t C, std::size_t /*V*/) {
    cpu::embedding_gather(pool, tokens, table, x, N, C);
  }
  template <typename A, typename S>
  static void embedding_scatter(thread_pool& pool, const std::int32_t* tokens, const S* dx, S* dtable,
                                std::size_t N, std::size_t C, std::size_t /*V*/) {
    cpu::embedding_scatter<A>(pool, tokens, dx, dtable, N, C);
  }

  // What a trainer keeps in the backend's memory beyond weights, gradients and optimizer state,
  // for steps of `tokens` tokens over n parameters. None on the host: the tokens stay in the
  // trainer's vectors and the gradient norm is a double on the stack.
  static constexpr std::size_t step_buffer_bytes(std::size_t /*tokens*/, std::size_t /*n*/) noexcept { return 0; }
};

// Naming backend_kernels<B, model_glue> does not instantiate it: a host-only translation unit
// that uses a CUDA model gets backend_kernels' sentence only when it calls into it.
template <typename Backend>
using model_glue_of =
    std::conditional_t<is_cpu_backend_v<Backend>, cpu_model_glue, backend_kernels<Backend, model_glue>>;

MEMBOUND_NAMESPACE_END
