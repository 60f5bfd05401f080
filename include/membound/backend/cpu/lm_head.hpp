// The LM head on the host: the same calls as backend_kernels<cuda_backend, lm_head_shape>
// (backend/cuda/lm_head.cuh), which layers/lm_head.hpp makes without knowing which backend
// runs them. The final RMSNorm, then for each chunk of rows its logits ([chunk, V] in A) turned
// into cross-entropy and its gradient in place and consumed at once (dW += dlogitsᵀ·xn,
// dxn = dlogits·W). The front has checked the shape and the pointers, then asked check_call for
// the targets' values (read here, in place) before the workspace.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>

#include "membound/backend/cpu/gemm.hpp"
#include "membound/backend/cpu/model.hpp"
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/core/error.hpp"
#include "membound/core/parallel.hpp"
#include "membound/memory/workspace.hpp"
#include "membound/policy/backend.hpp"
#include "membound/shape/lm_head_shape.hpp"

MEMBOUND_NAMESPACE_BEGIN

namespace cpu {

// Every target in [0, V) or ignore_target: a bad id would index outside the logits.
inline void check_targets(const std::int32_t* t, std::size_t n, std::size_t vocab) {
  for (std::size_t i = 0; i < n; ++i) {
    if (t[i] != ignore_target && (t[i] < 0 || static_cast<std::size_t>(t[i]) >= vocab)) {
      throw invalid_argument("targets[" + std::to_string(i) + "]",
                             "a token id in [0, " + std::to_string(vocab) + ") or ignore_target (-100)",
                             std::to_string(t[i]), "Encode the data with the model's vocabulary");
    }
  }
}

}  // namespace cpu

template <>
struct backend_kernels<cpu_backend, lm_head_shape> {
  // What only the host checks, before the front checks the workspace: every target id in [0, V),
  // read in place (the scale is the caller's).
  template <typename S>
  static void check_call(const lm_head_shape& s, const std::int32_t* targets, double /*scale*/) {
    cpu::check_targets(targets, s.rows, s.vocab);
  }

  // Exact: what loss_backward and loss carve (both take the same workspace).
  template <typename S, typename A>
  static constexpr std::size_t workspace_bytes(const lm_head_shape& s, std::size_t threads) {
    return layout<S, A>(s, threads).size();
  }

  // Σ_rows cross-entropy; dx = ∂(scale·Σ loss)/∂x, dnorm and dw accumulated (+=).
  template <typename S, typename A>
  static double loss_backward(const lm_head_shape& s, const S* norm, const S* w, const S* x,
                              const std::int32_t* targets, double scale, S* dx, S* dnorm, S* dw,
                              void* workspace, std::size_t workspace_size, thread_pool& ex) {
    const std::size_t N = s.rows, C = s.width, V = s.vocab;
    A* dwa = nullptr;
    A* dxn = nullptr;
    std::span<std::byte> scratch;
    const auto start = [&](const auto& ws) {
      scratch = gemm_scratch_of<A>(ws, s, ex.size());
      dwa = cpu::accum_target(dw, ws.template get<A>(w_dw));
      if constexpr (widened<S, A>) std::fill(dwa, dwa + V * C, A(0));
      dxn = ws.template get<A>(w_dxn);
    };
    // Each chunk's logits, now its gradient, are consumed at once: dW += dlogitsᵀ·xn, dxn = dlogits·W.
    const auto consume = [&](std::size_t r0, std::size_t r, const A* dlogits, const A* xa, const A* wa) {
      cpu::matmul_at(ex, dlogits, xa + r0 * C, dwa, r, V, C, true, cpu::ld3{V, C, C}, scratch);
      cpu::matmul(ex, dlogits, wa, dxn + r0 * C, r, V, C, false, cpu::ld3{V, C, C}, scratch);
    };
    return chunked<S, A>(s, norm, w, x, targets, static_cast<A>(scale), workspace, workspace_size,
                         ex, start, consume, [&](const auto& ws, S* xn, const A* rstd) {
                           if constexpr (widened<S, A>) cpu::add_grad(static_cast<const A*>(dwa), V * C, dw);
                           S* dxn_s = xn;  // xn is no longer needed: dxn rounds into its slot
                           cpu::narrow(static_cast<const A*>(dxn), N * C, dxn_s);
                           cpu::rmsnorm_backward(ex, x, norm, rstd, static_cast<const S*>(dxn_s),
                                                 static_cast<const S*>(nullptr), dx, dnorm,
                                                 ws.template get<A>(w_partial), N, C);
                         });
  }

  // The summed cross-entropy alone: the same norm, chunks and row order, so the same value.
  template <typename S, typename A>
  static double loss(const lm_head_shape& s, const S* norm, const S* w, const S* x,
                     const std::int32_t* targets, void* workspace, std::size_t workspace_size,
                     thread_pool& ex) {
    const auto nothing = [](auto&&...) {};
    return chunked<S, A>(s, norm, w, x, targets, A(0), workspace, workspace_size, ex, nothing,
                         nothing, nothing);
  }

 private:
  template <typename S, typename A>
  static constexpr bool widened = !std::is_same_v<S, A>;

  // The path both share (check_call has run): the final RMSNorm, then for each chunk of rows its
  // logits turned into cross-entropy and (times scale) its gradient in place, handed to
  // consume(r0, r, dlogits, xa, wa); start(ws) runs before the chunks and finish(ws, xn, rstd)
  // after them.
  template <typename S, typename A, typename Start, typename Consume, typename Finish>
  static double chunked(const lm_head_shape& s, const S* norm, const S* w, const S* x,
                        const std::int32_t* targets, A scale, void* workspace,
                        std::size_t workspace_size, thread_pool& ex, Start&& start,
                        Consume&& consume, Finish&& finish) {
    const auto ws = carve(layout<S, A>(s, ex.size()), workspace, workspace_size);
    const std::span<std::byte> scratch = gemm_scratch_of<A>(ws, s, ex.size());
    const std::size_t N = s.rows, C = s.width, V = s.vocab, R = s.chunk;
    S* xn = ws.template get<S>(w_xn);
    A* rstd = ws.template get<A>(w_rstd);
    cpu::rmsnorm_forward(ex, x, norm, xn, rstd, N, C, s.eps);
    const A* xa = cpu::widen_or_alias(static_cast<const S*>(xn), N * C, ws.template get<A>(w_xa));
    const A* wa = cpu::widen_or_alias(w, V * C, ws.template get<A>(w_wa));
    start(ws);
    A* logits = ws.template get<A>(w_logits);
    double* row_loss = ws.template get<double>(w_rowloss);
    double total = 0;
    for (std::size_t r0 = 0; r0 < N; r0 += R) {
      const std::size_t r = std::min(R, N - r0);
      cpu::matmul_bt(ex, xa + r0 * C, wa, logits, r, C, V, false, cpu::ld3{C, C, V}, scratch);
      total += cpu::cross_entropy_chunk(ex, logits, targets + r0, r, V, scale, row_loss);
      consume(r0, r, static_cast<const A*>(logits), xa, wa);
    }
    finish(ws, xn, static_cast<const A*>(rstd));
    return total;
  }

  enum slot : std::size_t { w_xn, w_rstd, w_xa, w_wa, w_dw, w_dxn, w_logits, w_rowloss, w_partial, w_gemm };
  // Packing buffers of the three products per chunk (logits, dW, dxn), one set per thread.
  template <typename A>
  static constexpr std::size_t gemm_bytes(const lm_head_shape& s, std::size_t threads) {
    const std::size_t C = s.width, V = s.vocab, R = std::min(s.chunk, s.rows);
    return threads * std::max({cpu::matmul_thread_scratch_bytes<A>(R, C, V),
                               cpu::matmul_at_thread_scratch_bytes<A>(R, V, C),
                               cpu::matmul_thread_scratch_bytes<A>(R, V, C)});
  }
  template <typename A, typename W>
  static std::span<std::byte> gemm_scratch_of(const W& ws, const lm_head_shape& s, std::size_t threads) {
    return {ws.template get<std::byte>(w_gemm), gemm_bytes<A>(s, threads)};
  }
  template <typename S, typename A>
  static constexpr workspace_layout<10> layout(const lm_head_shape& s, std::size_t threads) {
    const std::size_t N = s.rows, C = s.width, V = s.vocab, R = std::min(s.chunk, s.rows);
    workspace_layout<10> l;
    l.add(bytes_of<S>(N, C));
    l.add(bytes_of<A>(N));
    l.add(widened<S, A> ? bytes_of<A>(N, C) : 0);
    l.add(widened<S, A> ? bytes_of<A>(V, C) : 0);
    l.add(widened<S, A> ? bytes_of<A>(V, C) : 0);
    l.add(bytes_of<A>(N, C));
    l.add(bytes_of<A>(R, V));
    l.add(bytes_of<double>(R));
    l.add(bytes_of<A>(cpu::row_partials(N, C)));
    l.add(gemm_bytes<A>(s, threads));
    return l;
  }
};

MEMBOUND_NAMESPACE_END
