// The SwiGLU MLP of a block (Shazeer 2020, as in LLaMA): y = (SiLU(x·Wg) ⊙ (x·Wu))·Wd, with the
// same front end as the sequence layers, so a block composes it exactly like a mixer:
//
//   using mlp = membound::swiglu_mlp<membound::bf16_precision>;
//   mlp::forward(shape, w, x, y, saved, mlp::saved_bytes(shape), ws, fws, pool);
//   mlp::backward(shape, w, x, saved, saved_bytes, dy, dx, grads, ws, bws, pool);
//
// Forward keeps the two pre-activations a = x·Wg and b = x·Wu ([B·T, F] each, storage type) and
// backward uses them as stored; the product SiLU(a)⊙b is recomputed (elementwise, cheap) rather
// than kept. Every buffer is the caller's.
//
// This file is the front (checks, sizes, the saved layout) and makes one call into
// backend_kernels<backend, mlp_shape> for every backend: backend/cpu/mlp.hpp on the host;
// with cuda_backend in the policies every pointer is device memory, the executor is a
// cuda_executor, and the kernels are backend/cuda/mlp.cuh's (include membound/backend/cuda.cuh
// and compile with nvcc); saved_bytes is the same, the workspace holds cuBLASLt's too.
#pragma once

#include <cstddef>
#include <limits>

#include "membound/backend/cpu/mlp.hpp"  // backend_kernels<cpu_backend, mlp_shape>
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/core/parallel.hpp"
#include "membound/core/type_list.hpp"
#include "membound/layers/layer_support.hpp"
#include "membound/memory/workspace.hpp"
#include "membound/policy/backend.hpp"
#include "membound/policy/policy_set.hpp"
#include "membound/policy/precision.hpp"
#include "membound/shape/mlp_shape.hpp"

MEMBOUND_NAMESPACE_BEGIN

// The SwiGLU MLP (see the file comment); Policies set the precision and the backend.
template <typename... Policies>
class swiglu_mlp {
 public:
  // Precision and backend: the defaults, overridden by Policies.
  using policies = policy_set<type_list<fp32_precision, cpu_backend>, Policies...>;
  // Storage and accumulator types (fp32_precision by default).
  using precision = get_policy<policies, precision_kind>;
  // cpu_backend (the default) or cuda_backend: where the pointers live and whose kernels run.
  using backend = get_policy<policies, backend_kind>;
  using executor = typename backend::executor;  // thread_pool, or cuda_executor
  // Element type of x, y, the weights, the gradients and the saved pre-activations.
  using storage_type = typename precision::storage_type;
  // Type the GEMMs accumulate in.
  using accum_type = typename precision::accum_type;

 private:
  using S = storage_type;
  using A = accum_type;
  using kernels = backend_kernels<backend, mlp_shape>;

 public:
  // Whether the shape can run, and if not which field fails and why. Never throws.
  static constexpr layer_support can_implement(const mlp_shape& s) noexcept {
    if (s.batch == 0) return {false, "shape.batch", "at least 1", 0.0};
    if (s.seq == 0) return {false, "shape.seq", "at least 1", 0.0};
    if (s.width == 0) return {false, "shape.width", "at least 1", 0.0};
    if (s.hidden == 0) return {false, "shape.hidden", "at least 1", 0.0};
    return {};
  }
  // Throws invalid_argument naming the failing field, as can_implement reports it.
  static void check(const mlp_shape& s) {
    const layer_support r = can_implement(s);
    if (!r.ok) detail::throw_unsupported(r, false, "Fix the mlp_shape before sizing or running the MLP");
  }

  // Elements of Wg, Wu and Wd together: 3·C·F.
  static constexpr std::size_t weight_elements(const mlp_shape& s) noexcept {
    return 3 * s.width * s.hidden;
  }
  // Bytes forward keeps for backward: the pre-activations a and b, [B·T, F] each.
  static constexpr std::size_t saved_bytes(const mlp_shape& s) noexcept {
    const std::size_t b[] = {h_s(s)};
    return detail::fits_layout(b) ? saved_layout(s).size() : std::numeric_limits<std::size_t>::max();
  }
  // On the CPU the workspace holds the GEMMs' packing buffers, per thread: size it with the
  // pool's thread count (the device ignores `threads`).
  static constexpr std::size_t forward_workspace_bytes(const mlp_shape& s,
                                                       std::size_t threads) noexcept {
    return kernels::template forward_workspace_bytes<S, A>(s, threads);
  }
  // Scratch bytes backward needs for `threads` CPU threads.
  static constexpr std::size_t backward_workspace_bytes(const mlp_shape& s,
                                                        std::size_t threads) noexcept {
    return kernels::template backward_workspace_bytes<S, A>(s, threads);
  }

  // The MLP's parameters, read only: [in, out] matrices, row-major, in storage_type.
  struct weights {
    const S* w_gate;  // [C, F]
    const S* w_up;    // [C, F]
    const S* w_down;  // [F, C]
  };
  // Where backward adds (+=) the weight gradients, shaped as `weights`: the caller zeroes them.
  struct gradients {
    S* w_gate;  // dL/dWg, [C, F]
    S* w_up;    // dL/dWu, [C, F]
    S* w_down;  // dL/dWd, [F, C]
  };

  // y = MLP(x); keeps a and b in `saved` for backward. Checks every argument before writing.
  static void forward(const mlp_shape& s, const weights& w, const S* x, S* y, void* saved,
                      std::size_t saved_size, void* workspace, std::size_t workspace_size,
                      executor& ex) {
    check(s);
    check_weights(w);
    detail::need_pointer(x, "x");
    detail::need_pointer(y, "y");
    const auto sv = detail::carve_named(saved_layout(s), saved_bytes(s), saved, saved_size, "saved");
    detail::check_workspace_size(forward_workspace_bytes(s, workspace_threads(ex)), workspace, workspace_size);
    kernels::template forward<S, A>(s, w.w_gate, w.w_up, w.w_down, x, y, sv.template get<S>(s_a),
                                    sv.template get<S>(s_b), workspace, workspace_size, ex);
  }

  // dx from dy (overwritten), and the weight gradients added to `g`, from forward's `saved`.
  static void backward(const mlp_shape& s, const weights& w, const S* x, const void* saved,
                       std::size_t saved_size, const S* dy, S* dx, const gradients& g,
                       void* workspace, std::size_t workspace_size, executor& ex) {
    check(s);
    check_weights(w);
    detail::need_pointer(x, "x");
    detail::need_pointer(dy, "dy");
    detail::need_pointer(dx, "dx");
    detail::need_pointer(g.w_gate, "gradients.w_gate");
    detail::need_pointer(g.w_up, "gradients.w_up");
    detail::need_pointer(g.w_down, "gradients.w_down");
    const auto sv = detail::carve_named(saved_layout(s), saved_bytes(s), const_cast<void*>(saved),
                                        saved_size, "saved");
    detail::check_workspace_size(backward_workspace_bytes(s, workspace_threads(ex)), workspace, workspace_size);
    kernels::template backward<S, A>(s, w.w_gate, w.w_up, w.w_down, x,
                                     static_cast<const S*>(sv.template get<S>(s_a)),
                                     static_cast<const S*>(sv.template get<S>(s_b)), dy, dx,
                                     g.w_gate, g.w_up, g.w_down, workspace, workspace_size, ex);
  }

 private:
  static constexpr std::size_t h_s(const mlp_shape& s) noexcept { return bytes_of<S>(s.batch * s.seq, s.hidden); }

  enum saved_slot : std::size_t { s_a, s_b };
  static constexpr workspace_layout<2> saved_layout(const mlp_shape& s) {
    workspace_layout<2> l;
    l.add(h_s(s));
    l.add(h_s(s));
    return l;
  }
  static void check_weights(const weights& w) {
    detail::need_pointer(w.w_gate, "weights.w_gate");
    detail::need_pointer(w.w_up, "weights.w_up");
    detail::need_pointer(w.w_down, "weights.w_down");
  }
};

MEMBOUND_NAMESPACE_END
