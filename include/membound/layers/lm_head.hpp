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
// This file is the front (checks and sizes) and makes one call into backend_kernels<backend,
// lm_head_shape> for every backend: backend/cpu/lm_head.hpp on the host. With cuda_backend
// in the policies every pointer (the targets too) is device memory, the executor
// is a cuda_executor, and the kernels are backend/cuda/lm_head.cuh's (include
// membound/backend/cuda.cuh and compile with nvcc); workspace_bytes holds cuBLASLt's workspace too.
// The loss comes back as a host double, so a GPU call synchronizes the executor's stream once, at
// its end. Device targets are not checked here (that would be a copy and a sync): check the host
// copy with check_targets before the upload, as model does; an id outside [0, V) on the device
// reads nothing out of bounds and makes the returned loss NaN.
#pragma once

#include <cstddef>
#include <cstdint>

#include "membound/backend/cpu/lm_head.hpp"  // backend_kernels<cpu_backend, lm_head_shape>
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

// The LM head (see the file comment); Policies set the precision and the backend.
template <typename... Policies>
class lm_head {
 public:
  // Precision and backend: the defaults, overridden by Policies.
  using policies = policy_set<type_list<fp32_precision, cpu_backend>, Policies...>;
  // Storage and accumulator types (fp32_precision by default).
  using precision = get_policy<policies, precision_kind>;
  // cpu_backend (the default) or cuda_backend: where the pointers live and whose kernels run.
  using backend = get_policy<policies, backend_kind>;
  using executor = typename backend::executor;  // thread_pool, or cuda_executor
  // Element type of x, dx, the weights and the gradients.
  using storage_type = typename precision::storage_type;
  // Type a chunk's logits ([chunk, V]) are computed in.
  using accum_type = typename precision::accum_type;

 private:
  using S = storage_type;
  using A = accum_type;
  using kernels = backend_kernels<backend, lm_head_shape>;

 public:
  // Whether the shape can run, and if not which field fails and why. Never throws.
  static constexpr layer_support can_implement(const lm_head_shape& s) noexcept {
    if (s.rows == 0) return {false, "shape.rows", "at least 1", 0.0};
    if (s.width == 0) return {false, "shape.width", "at least 1", 0.0};
    if (s.vocab == 0) return {false, "shape.vocab", "at least 1", 0.0};
    if (s.chunk == 0) return {false, "shape.chunk", "at least 1 logit row per chunk", 0.0};
    return {};
  }
  // Throws invalid_argument naming the failing field, as can_implement reports it.
  static void check(const lm_head_shape& s) {
    const layer_support r = can_implement(s);
    if (!r.ok) detail::throw_unsupported(r, false, "Fix the lm_head_shape before sizing or running the head");
  }

  // Scratch bytes of loss_backward and loss (the normalized rows, one chunk of logits, the GEMMs'
  // buffers) for `threads` CPU threads (the pool's size; the device ignores it).
  static constexpr std::size_t workspace_bytes(const lm_head_shape& s, std::size_t threads) {
    return kernels::template workspace_bytes<S, A>(s, threads);
  }
  // FLOPs of one call: logits, dW and dxn products.
  static constexpr double flops(const lm_head_shape& s) noexcept {
    return 6.0 * static_cast<double>(s.rows) * static_cast<double>(s.width) *
           static_cast<double>(s.vocab);
  }

  // The head's parameters, read only, in storage_type.
  struct weights {
    const S* norm;  // [C]
    const S* w;     // [V, C]
  };
  // Where loss_backward adds (+=) the gradients of scale·Σ loss, shaped as `weights`: the caller
  // zeroes them.
  struct gradients {
    S* norm;  // [C]
    S* w;     // [V, C]
  };

  // Returns Σ_rows cross-entropy (natural log, in double); dx = ∂(scale·Σ loss)/∂x.
  static double loss_backward(const lm_head_shape& s, const weights& w, const S* x,
                              const std::int32_t* targets, double scale, S* dx,
                              const gradients& g, void* workspace, std::size_t workspace_size,
                              executor& ex) {
    detail::need_pointer(dx, "dx");
    detail::need_pointer(g.norm, "gradients.norm");
    detail::need_pointer(g.w, "gradients.w");
    check_inputs(s, w, x, targets);
    kernels::template check_call<S>(s, targets, scale);
    detail::check_workspace_size(workspace_bytes(s, workspace_threads(ex)), workspace, workspace_size);
    return kernels::template loss_backward<S, A>(s, w.norm, w.w, x, targets, scale, dx, g.norm,
                                                 g.w, workspace, workspace_size, ex);
  }

  // The summed cross-entropy alone (evaluation): the same norm, chunks and row order as
  // loss_backward, so the same value to the bit, without a gradient; the same workspace.
  static double loss(const lm_head_shape& s, const weights& w, const S* x, const std::int32_t* targets,
                     void* workspace, std::size_t workspace_size, executor& ex) {
    check_inputs(s, w, x, targets);
    kernels::template check_call<S>(s, targets, 0.0);
    detail::check_workspace_size(workspace_bytes(s, workspace_threads(ex)), workspace, workspace_size);
    return kernels::template loss<S, A>(s, w.norm, w.w, x, targets, workspace, workspace_size, ex);
  }

  // Every target in [0, V): a bad id would index outside the logits.
  static void check_targets(const std::int32_t* t, std::size_t n, std::size_t vocab) {
    cpu::check_targets(t, n, vocab);
  }

 private:
  // The shape and the pointers, on both backends (the targets' values on the CPU only: see the top).
  static void check_inputs(const lm_head_shape& s, const weights& w, const S* x,
                           const std::int32_t* targets) {
    check(s);
    detail::need_pointer(w.norm, "weights.norm");
    detail::need_pointer(w.w, "weights.w");
    detail::need_pointer(x, "x");
    detail::need_pointer(targets, "targets");
  }
};

MEMBOUND_NAMESPACE_END
