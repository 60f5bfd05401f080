// The LM head with chunked cross-entropy: final RMSNorm, logits = xn·Wᵀ (W [V, C], the embedding
// table when tied), mean cross-entropy against the targets, and in the same pass its backward.
// Logits exist only for `chunk` rows at a time ([chunk, V] in the accumulator type), so the
// B×T×V tensor never does; each chunk is turned into its gradient in place and consumed at once
// (dW += dlogitsᵀ·xn, dxn = dlogits·W), as llm.c's fused classifier does.
//
//   using head = membound::lm_head<membound::bf16_precision>;
//   std::size_t ws = head::workspace_bytes(shape, pool.size());
//   double loss = head::loss_backward(shape, w, x, targets, scale, dx, g, buf, ws, pool);
//
// With cuda_backend in the policies every pointer (the targets too) is device memory, the executor
// is a cuda_executor, and the kernels are backend/cuda/lm_head_cuda.cuh's (include
// membound/backend/cuda.cuh and compile with nvcc); workspace_bytes holds cuBLASLt's workspace too.
// The loss comes back as a host double, so a GPU call synchronizes the executor's stream once, at
// its end. Device targets are not checked here (that would be a copy and a sync): check the host
// copy with check_targets before the upload, as model does; an id outside [0, V) on the device
// reads nothing out of bounds and makes the returned loss NaN.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <type_traits>

#include "membound/backend/cpu/linalg.hpp"
#include "membound/backend/cpu/model_cpu.hpp"
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/core/error.hpp"
#include "membound/core/parallel.hpp"
#include "membound/core/type_list.hpp"
#include "membound/layers/layer_support.hpp"
#include "membound/memory/workspace.hpp"
#include "membound/policy/backend.hpp"
#include "membound/policy/policy_set.hpp"
#include "membound/policy/precision.hpp"
#include "membound/shape/lm_head_shape.hpp"

MEMBOUND_NAMESPACE_BEGIN

template <typename... Policies>
class lm_head {
 public:
  using policies = policy_set<type_list<fp32_precision, cpu_backend>, Policies...>;
  using precision = get_policy<policies, precision_kind>;
  using backend = get_policy<policies, backend_kind>;
  using executor = typename backend::executor;  // thread_pool, or cuda_executor
  using storage_type = typename precision::storage_type;
  using accum_type = typename precision::accum_type;

 private:
  using S = storage_type;
  using A = accum_type;
  static constexpr bool widened = !std::is_same_v<S, A>;
  static constexpr bool on_cpu = is_cpu_backend_v<backend>;

 public:
  static constexpr layer_support can_implement(const lm_head_shape& s) noexcept {
    if (s.rows == 0) return {false, "shape.rows", "at least 1", 0.0};
    if (s.width == 0) return {false, "shape.width", "at least 1", 0.0};
    if (s.vocab == 0) return {false, "shape.vocab", "at least 1", 0.0};
    if (s.chunk == 0) return {false, "shape.chunk", "at least 1 logit row per chunk", 0.0};
    return {};
  }
  static void check(const lm_head_shape& s) {
    const layer_support r = can_implement(s);
    if (!r.ok) detail::throw_unsupported(r, false, "Fix the lm_head_shape before sizing or running the head");
  }

  static constexpr std::size_t workspace_bytes(const lm_head_shape& s, std::size_t threads) {
    if constexpr (!on_cpu) return backend_kernels<backend, lm_head_shape>::template workspace_bytes<S>(s);
    return layout(s, threads).size();
  }
  // FLOPs of one call: logits, dW and dxn products.
  static constexpr double flops(const lm_head_shape& s) noexcept {
    return 6.0 * static_cast<double>(s.rows) * static_cast<double>(s.width) *
           static_cast<double>(s.vocab);
  }

  struct weights {
    const S* norm;  // [C]
    const S* w;     // [V, C]
  };
  struct gradients {  // accumulated (+=)
    S* norm;
    S* w;
  };

  // Returns Σ_rows cross-entropy (natural log, in double); dx = ∂(scale·Σ loss)/∂x.
  static double loss_backward(const lm_head_shape& s, const weights& w, const S* x,
                              const std::int32_t* targets, double scale, S* dx,
                              const gradients& g, void* workspace, std::size_t workspace_size,
                              executor& pool) {
    detail::not_null(dx, "dx");
    detail::not_null(g.norm, "gradients.norm");
    detail::not_null(g.w, "gradients.w");
    if constexpr (!on_cpu) {
      check_inputs(s, w, x, targets);
      return backend_kernels<backend, lm_head_shape>::template loss_backward<S, A>(
          s, w.norm, w.w, x, targets, scale, dx, g.norm, g.w, workspace, workspace_size, pool);
    } else {
      return loss_backward_cpu(s, w, x, targets, scale, dx, g, workspace, workspace_size, pool);
    }
  }

  // The summed cross-entropy alone (evaluation): the same norm, chunks and row order as
  // loss_backward, so the same value to the bit, without a gradient; the same workspace.
  static double loss(const lm_head_shape& s, const weights& w, const S* x, const std::int32_t* targets,
                     void* workspace, std::size_t workspace_size, executor& pool) {
    if constexpr (!on_cpu) {
      check_inputs(s, w, x, targets);
      return backend_kernels<backend, lm_head_shape>::template loss<S, A>(
          s, w.norm, w.w, x, targets, workspace, workspace_size, pool);
    } else {
      const auto nothing = [](auto&&...) {};
      return chunked(s, w, x, targets, A(0), workspace, workspace_size, pool, nothing, nothing, nothing);
    }
  }

  // Every target in [0, V): a bad id would index outside the logits.
  static void check_targets(const std::int32_t* t, std::size_t n, std::size_t vocab) {
    for (std::size_t i = 0; i < n; ++i) {
      if (t[i] < 0 || static_cast<std::size_t>(t[i]) >= vocab) {
        throw invalid_argument("targets[" + std::to_string(i) + "]",
                               "a token id in [0, " + std::to_string(vocab) + ")",
                               std::to_string(t[i]),
                               "Encode the data with the model's vocabulary");
      }
    }
  }

 private:
  static double loss_backward_cpu(const lm_head_shape& s, const weights& w, const S* x,
                                  const std::int32_t* targets, double scale, S* dx,
                                  const gradients& g, void* workspace, std::size_t workspace_size,
                                  thread_pool& pool) {
    const std::size_t N = s.rows, C = s.width, V = s.vocab;
    A* dw = nullptr;
    A* dxn = nullptr;
    std::span<std::byte> scratch;
    const auto start = [&](const auto& ws) {
      scratch = gemm_scratch_of(ws, s, pool.size());
      dw = cpu::accum_target(g.w, ws.template get<A>(w_dw));
      if constexpr (widened) std::fill(dw, dw + V * C, A(0));
      dxn = ws.template get<A>(w_dxn);
    };
    // Each chunk's logits, now its gradient, are consumed at once: dW += dlogitsᵀ·xn, dxn = dlogits·W.
    const auto consume = [&](std::size_t r0, std::size_t r, const A* dlogits, const A* xa, const A* wa) {
      cpu::matmul_at(pool, dlogits, xa + r0 * C, dw, r, V, C, true, cpu::ld3{V, C, C}, scratch);
      cpu::matmul(pool, dlogits, wa, dxn + r0 * C, r, V, C, false, cpu::ld3{V, C, C}, scratch);
    };
    return chunked(s, w, x, targets, static_cast<A>(scale), workspace, workspace_size, pool, start, consume,
                   [&](const auto& ws, S* xn, const A* rstd) {
                     if constexpr (widened) cpu::add_grad(static_cast<const A*>(dw), V * C, g.w);
                     S* dxn_s = xn;  // xn is no longer needed: dxn rounds into its slot
                     cpu::narrow(static_cast<const A*>(dxn), N * C, dxn_s);
                     cpu::rmsnorm_backward(pool, x, w.norm, rstd, static_cast<const S*>(dxn_s),
                                           static_cast<const S*>(nullptr), dx, g.norm,
                                           ws.template get<A>(w_partial), N, C);
                   });
  }

  // The shape and the pointers, on both backends (the targets' values on the CPU only: see the top).
  static void check_inputs(const lm_head_shape& s, const weights& w, const S* x,
                           const std::int32_t* targets) {
    check(s);
    detail::not_null(w.norm, "weights.norm");
    detail::not_null(w.w, "weights.w");
    detail::not_null(x, "x");
    detail::not_null(targets, "targets");
  }

  // The path both share: checks, the final RMSNorm, then for each chunk of rows its logits turned
  // into cross-entropy and (times scale) its gradient in place, handed to consume(r0, r, dlogits,
  // xa, wa); start(ws) runs before the chunks and finish(ws, xn, rstd) after them.
  template <typename Start, typename Consume, typename Finish>
  static double chunked(const lm_head_shape& s, const weights& w, const S* x, const std::int32_t* targets,
                        A scale, void* workspace, std::size_t workspace_size, thread_pool& pool,
                        Start&& start, Consume&& consume, Finish&& finish) {
    check_inputs(s, w, x, targets);
    check_targets(targets, s.rows, s.vocab);
    const auto l = layout(s, pool.size());
    const auto ws = detail::carve_named(l, l.size(), workspace, workspace_size, "workspace");
    const std::span<std::byte> scratch = gemm_scratch_of(ws, s, pool.size());
    const std::size_t N = s.rows, C = s.width, V = s.vocab, R = s.chunk;
    S* xn = ws.template get<S>(w_xn);
    A* rstd = ws.template get<A>(w_rstd);
    cpu::rmsnorm_forward(pool, x, w.norm, xn, rstd, N, C, s.eps);
    const A* xa = cpu::widen_or_alias(static_cast<const S*>(xn), N * C, ws.template get<A>(w_xa));
    const A* wa = cpu::widen_or_alias(w.w, V * C, ws.template get<A>(w_wa));
    start(ws);
    A* logits = ws.template get<A>(w_logits);
    double* row_loss = ws.template get<double>(w_rowloss);
    double total = 0;
    for (std::size_t r0 = 0; r0 < N; r0 += R) {
      const std::size_t r = std::min(R, N - r0);
      cpu::matmul_bt(pool, xa + r0 * C, wa, logits, r, C, V, false, cpu::ld3{C, C, V}, scratch);
      total += cpu::cross_entropy_chunk(pool, logits, targets + r0, r, V, scale, row_loss);
      consume(r0, r, static_cast<const A*>(logits), xa, wa);
    }
    finish(ws, xn, static_cast<const A*>(rstd));
    return total;
  }

  enum slot : std::size_t { w_xn, w_rstd, w_xa, w_wa, w_dw, w_dxn, w_logits, w_rowloss, w_partial, w_gemm };
  // Packing buffers of the three products per chunk (logits, dW, dxn), one set per thread.
  static constexpr std::size_t gemm_bytes(const lm_head_shape& s, std::size_t threads) {
    const std::size_t C = s.width, V = s.vocab, R = std::min(s.chunk, s.rows);
    return threads * std::max({cpu::matmul_thread_scratch_bytes<A>(R, C, V),
                               cpu::matmul_at_thread_scratch_bytes<A>(R, V, C),
                               cpu::matmul_thread_scratch_bytes<A>(R, V, C)});
  }
  template <typename W>
  static std::span<std::byte> gemm_scratch_of(const W& ws, const lm_head_shape& s, std::size_t threads) {
    return {ws.template get<std::byte>(w_gemm), gemm_bytes(s, threads)};
  }
  static constexpr workspace_layout<10> layout(const lm_head_shape& s, std::size_t threads) {
    const std::size_t N = s.rows, C = s.width, V = s.vocab, R = std::min(s.chunk, s.rows);
    workspace_layout<10> l;
    l.add(bytes_of<S>(N, C));
    l.add(bytes_of<A>(N));
    l.add(widened ? bytes_of<A>(N, C) : 0);
    l.add(widened ? bytes_of<A>(V, C) : 0);
    l.add(widened ? bytes_of<A>(V, C) : 0);
    l.add(bytes_of<A>(N, C));
    l.add(bytes_of<A>(R, V));
    l.add(bytes_of<double>(R));
    l.add(bytes_of<A>(cpu::row_partials(N, C)));
    l.add(gemm_bytes(s, threads));
    return l;
  }
};

MEMBOUND_NAMESPACE_END
