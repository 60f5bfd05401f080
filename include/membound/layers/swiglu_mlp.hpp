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
// With cuda_backend in the policies every pointer is device memory, the executor is a
// cuda_executor, and the kernels are backend/cuda/mlp_cuda.cuh's (include membound/backend/cuda.cuh
// and compile with nvcc); saved_bytes is the same, the workspace holds cuBLASLt's too.
#pragma once

#include <cstddef>
#include <limits>
#include <span>
#include <algorithm>
#include <type_traits>

#include "membound/backend/cpu/linalg.hpp"
#include "membound/backend/cpu/model_cpu.hpp"
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/core/element_math.hpp"
#include "membound/core/parallel.hpp"
#include "membound/core/type_list.hpp"
#include "membound/layers/layer_support.hpp"
#include "membound/memory/workspace.hpp"
#include "membound/policy/backend.hpp"
#include "membound/policy/policy_set.hpp"
#include "membound/policy/precision.hpp"
#include "membound/shape/mlp_shape.hpp"

MEMBOUND_NAMESPACE_BEGIN

template <typename... Policies>
class swiglu_mlp {
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
  static constexpr layer_support can_implement(const mlp_shape& s) noexcept {
    if (s.batch == 0) return {false, "shape.batch", "at least 1", 0.0};
    if (s.seq == 0) return {false, "shape.seq", "at least 1", 0.0};
    if (s.width == 0) return {false, "shape.width", "at least 1", 0.0};
    if (s.hidden == 0) return {false, "shape.hidden", "at least 1", 0.0};
    return {};
  }
  static void check(const mlp_shape& s) {
    const layer_support r = can_implement(s);
    if (!r.ok) detail::throw_unsupported(r, false, "Fix the mlp_shape before sizing or running the MLP");
  }

  static constexpr std::size_t weight_elements(const mlp_shape& s) noexcept {
    return 3 * s.width * s.hidden;
  }
  static constexpr std::size_t saved_bytes(const mlp_shape& s) noexcept {
    const std::size_t b[] = {h_s(s)};
    return detail::fits_layout(b) ? saved_layout(s).size() : std::numeric_limits<std::size_t>::max();
  }
  // On the CPU the workspace holds the GEMMs' packing buffers, per thread: size it with the
  // pool's thread count (the device ignores `threads`).
  static constexpr std::size_t forward_workspace_bytes(const mlp_shape& s,
                                                       std::size_t threads) noexcept {
    if constexpr (!on_cpu) return backend_kernels<backend, mlp_shape>::template forward_workspace_bytes<S>(s);
    const std::size_t b[] = {h_a(s), w_acc(s), x_acc(s), bytes_of<std::byte>(threads, pack_bytes(s))};
    return detail::fits_layout(b) ? forward_layout(s, threads).size()
                                  : std::numeric_limits<std::size_t>::max();
  }
  static constexpr std::size_t backward_workspace_bytes(const mlp_shape& s,
                                                        std::size_t threads) noexcept {
    if constexpr (!on_cpu) return backend_kernels<backend, mlp_shape>::template backward_workspace_bytes<S>(s);
    const std::size_t b[] = {h_a(s), w_acc(s), x_acc(s), bytes_of<std::byte>(threads, pack_bytes(s))};
    return detail::fits_layout(b) ? backward_layout(s, threads).size()
                                  : std::numeric_limits<std::size_t>::max();
  }

  struct weights {
    const S* w_gate;  // [C, F]
    const S* w_up;    // [C, F]
    const S* w_down;  // [F, C]
  };
  struct gradients {  // accumulated (+=)
    S* w_gate;
    S* w_up;
    S* w_down;
  };

  static void forward(const mlp_shape& s, const weights& w, const S* x, S* y, void* saved,
                      std::size_t saved_size, void* workspace, std::size_t workspace_size,
                      executor& pool) {
    check(s);
    check_weights(w);
    detail::not_null(x, "x");
    detail::not_null(y, "y");
    const auto sv = detail::carve_named(saved_layout(s), saved_bytes(s), saved, saved_size, "saved");
    if constexpr (!on_cpu) {
      backend_kernels<backend, mlp_shape>::template forward<S, A>(
          s, w.w_gate, w.w_up, w.w_down, x, y, sv.template get<S>(s_a), sv.template get<S>(s_b),
          workspace, workspace_size, pool);
    } else {
      forward_cpu(s, w, x, y, sv, workspace, workspace_size, pool);
    }
  }

  static void backward(const mlp_shape& s, const weights& w, const S* x, const void* saved,
                       std::size_t saved_size, const S* dy, S* dx, const gradients& g,
                       void* workspace, std::size_t workspace_size, executor& pool) {
    check(s);
    check_weights(w);
    detail::not_null(x, "x");
    detail::not_null(dy, "dy");
    detail::not_null(dx, "dx");
    detail::not_null(g.w_gate, "gradients.w_gate");
    detail::not_null(g.w_up, "gradients.w_up");
    detail::not_null(g.w_down, "gradients.w_down");
    const auto sv = detail::carve_named(saved_layout(s), saved_bytes(s), const_cast<void*>(saved),
                                        saved_size, "saved");
    if constexpr (!on_cpu) {
      backend_kernels<backend, mlp_shape>::template backward<S, A>(
          s, w.w_gate, w.w_up, w.w_down, x, sv.template get<S>(s_a), sv.template get<S>(s_b), dy,
          dx, g.w_gate, g.w_up, g.w_down, workspace, workspace_size, pool);
    } else {
      backward_cpu(s, w, x, sv, dy, dx, g, workspace, workspace_size, pool);
    }
  }

 private:
  template <typename SavedView>
  static void forward_cpu(const mlp_shape& s, const weights& w, const S* x, S* y, const SavedView& sv,
                          void* workspace, std::size_t workspace_size, thread_pool& pool) {
    const std::size_t threads = pool.size();
    const auto ws = detail::carve_named(forward_layout(s, threads),
                                        forward_workspace_bytes(s, threads), workspace,
                                        workspace_size, "workspace");
    const std::size_t N = s.batch * s.seq, C = s.width, F = s.hidden;
    const std::span<std::byte> pk{ws.template get<std::byte>(f_gemm), threads * pack_bytes(s)};
    const A* xa = cpu::widen_or_alias(pool, x, N * C, ws.template get<A>(f_x));
    const wptrs wa = widen_weights(w, s, ws.template get<A>(f_w), pool);
    S* a_s = sv.template get<S>(s_a);
    S* b_s = sv.template get<S>(s_b);
    A* a = cpu::accum_target(a_s, ws.template get<A>(f_a));
    A* b = cpu::accum_target(b_s, ws.template get<A>(f_b));
    cpu::matmul(pool, xa, wa.g, a, N, C, F, false, cpu::ld3{C, F, F}, pk);
    cpu::matmul(pool, xa, wa.u, b, N, C, F, false, cpu::ld3{C, F, F}, pk);
    if constexpr (widened) {  // backward sees the rounded values: use them here too
      cpu::narrow(pool, static_cast<const A*>(a), N * F, a_s);
      cpu::narrow(pool, static_cast<const A*>(b), N * F, b_s);
    }
    A* act = ws.template get<A>(f_act);
    activation(pool, a_s, b_s, act, N, F);
    A* ya = cpu::accum_target(y, ws.template get<A>(f_y));
    cpu::matmul(pool, static_cast<const A*>(act), wa.d, ya, N, F, C, false, cpu::ld3{F, C, C}, pk);
    if constexpr (widened) cpu::narrow(pool, static_cast<const A*>(ya), N * C, y);
  }

  template <typename SavedView>
  static void backward_cpu(const mlp_shape& s, const weights& w, const S* x, const SavedView& sv,
                           const S* dy, S* dx, const gradients& g, void* workspace,
                           std::size_t workspace_size, thread_pool& pool) {
    const std::size_t threads = pool.size();
    const auto ws = detail::carve_named(backward_layout(s, threads),
                                        backward_workspace_bytes(s, threads), workspace,
                                        workspace_size, "workspace");
    const std::size_t N = s.batch * s.seq, C = s.width, F = s.hidden;
    const std::span<std::byte> pk{ws.template get<std::byte>(b_gemm), threads * pack_bytes(s)};
    const S* a_s = sv.template get<S>(s_a);
    const S* b_s = sv.template get<S>(s_b);
    const A* xa = cpu::widen_or_alias(pool, x, N * C, ws.template get<A>(b_x));
    const A* dya = cpu::widen_or_alias(pool, dy, N * C, ws.template get<A>(b_dy));
    const wptrs wa = widen_weights(w, s, ws.template get<A>(b_w), pool);
    A* act = ws.template get<A>(b_act);
    A* tmp = ws.template get<A>(b_tmp);
    activation(pool, a_s, b_s, act, N, F);
    cpu::weight_grad(pool, static_cast<const A*>(act), dya, g.w_down, tmp, N, F, C, pk);
    // dact = dy·Wdᵀ, then da = dact·b·SiLU'(a) and db = dact·SiLU(a), in place over act's slot.
    A* da = act;
    A* db = ws.template get<A>(b_db);
    cpu::matmul_bt(pool, dya, wa.d, db, N, C, F, false, cpu::ld3{C, C, F}, pk);
    activation_backward(pool, a_s, b_s, da, db, N, F);
    cpu::weight_grad(pool, xa, static_cast<const A*>(da), g.w_gate, tmp, N, C, F, pk);
    cpu::weight_grad(pool, xa, static_cast<const A*>(db), g.w_up, tmp, N, C, F, pk);
    A* dxa = cpu::accum_target(dx, ws.template get<A>(b_dx));
    cpu::matmul_bt(pool, static_cast<const A*>(da), wa.g, dxa, N, F, C, false, cpu::ld3{F, F, C},
                   pk);
    cpu::matmul_bt(pool, static_cast<const A*>(db), wa.u, dxa, N, F, C, true, cpu::ld3{F, F, C},
                   pk);
    if constexpr (widened) cpu::narrow(pool, static_cast<const A*>(dxa), N * C, dx);
  }

 private:
  static constexpr std::size_t h_s(const mlp_shape& s) noexcept { return bytes_of<S>(s.batch * s.seq, s.hidden); }
  static constexpr std::size_t h_a(const mlp_shape& s) noexcept { return bytes_of<A>(s.batch * s.seq, s.hidden); }
  static constexpr std::size_t x_acc(const mlp_shape& s) noexcept {
    return widened ? bytes_of<A>(s.batch * s.seq, s.width) : 0;
  }
  static constexpr std::size_t w_acc(const mlp_shape& s) noexcept {
    return widened ? bytes_of<A>(3 * s.width, s.hidden) : 0;
  }

  enum saved_slot : std::size_t { s_a, s_b };
  static constexpr workspace_layout<2> saved_layout(const mlp_shape& s) {
    workspace_layout<2> l;
    l.add(h_s(s));
    l.add(h_s(s));
    return l;
  }
  // Per-thread packing bytes of the GEMMs (linalg.hpp's gemm with the caller's buffers): the
  // largest of x·W [N, F] depth C, act·Wd and d·Wᵀ [N, C] depth F, and the weight gradients.
  static constexpr std::size_t pack_bytes(const mlp_shape& s) noexcept {
    const std::size_t N = s.batch * s.seq, C = s.width, F = s.hidden;
    return std::max({cpu::matmul_thread_scratch_bytes<A>(N, C, F),
                     cpu::matmul_thread_scratch_bytes<A>(N, F, C),
                     cpu::matmul_at_thread_scratch_bytes<A>(N, F, C),
                     cpu::matmul_at_thread_scratch_bytes<A>(N, C, F)});
  }
  // Phases: 0 the two up projections, 1 the down projection.
  enum forward_slot : std::size_t { f_x, f_w, f_a, f_b, f_act, f_y, f_gemm };
  static constexpr workspace_layout<7> forward_layout(const mlp_shape& s, std::size_t threads) {
    workspace_layout<7> l;
    l.add(x_acc(s), default_alignment, {0, 0});
    l.add(w_acc(s), default_alignment, {0, 1});
    l.add(widened ? h_a(s) : 0, default_alignment, {0, 0});
    l.add(widened ? h_a(s) : 0, default_alignment, {0, 0});
    l.add(h_a(s), default_alignment, {1, 1});
    l.add(x_acc(s), default_alignment, {1, 1});
    l.add(bytes_of<std::byte>(threads, pack_bytes(s)), default_alignment, {0, 1});
    return l;
  }
  // Phases: 0 Wd's gradient and dact, 1 the gate's backward and Wg, Wu gradients, 2 dx.
  enum backward_slot : std::size_t { b_x, b_dy, b_w, b_act, b_db, b_tmp, b_dx, b_gemm };
  static constexpr workspace_layout<8> backward_layout(const mlp_shape& s, std::size_t threads) {
    workspace_layout<8> l;
    l.add(x_acc(s), default_alignment, {0, 1});
    l.add(x_acc(s), default_alignment, {0, 0});
    l.add(w_acc(s), default_alignment, {0, 2});
    l.add(h_a(s), default_alignment, {0, 2});
    l.add(h_a(s), default_alignment, {0, 2});
    l.add(widened ? bytes_of<A>(s.width, s.hidden) : 0, default_alignment, {0, 1});
    l.add(x_acc(s), default_alignment, {2, 2});
    l.add(bytes_of<std::byte>(threads, pack_bytes(s)), default_alignment, {0, 2});
    return l;
  }

  struct wptrs {
    const A *g, *u, *d;
  };
  static wptrs widen_weights(const weights& w, const mlp_shape& s, A* slot, thread_pool& pool) {
    if constexpr (widened) {
      const std::size_t CF = s.width * s.hidden;
      cpu::widen(pool, w.w_gate, CF, slot);
      cpu::widen(pool, w.w_up, CF, slot + CF);
      cpu::widen(pool, w.w_down, CF, slot + 2 * CF);
      return {slot, slot + CF, slot + 2 * CF};
    } else {
      (void)s;
      (void)pool;
      (void)slot;
      return {w.w_gate, w.w_up, w.w_down};
    }
  }
  static void check_weights(const weights& w) {
    detail::not_null(w.w_gate, "weights.w_gate");
    detail::not_null(w.w_up, "weights.w_up");
    detail::not_null(w.w_down, "weights.w_down");
  }
  // act = SiLU(a)·b from the stored pre-activations; vectorized per row (model_cpu.hpp).
  static void activation(thread_pool& pool, const S* a, const S* b, A* act, std::size_t N,
                         std::size_t F) {
    cpu::for_rows(pool, N, [&](std::size_t n) {
      cpu::swiglu_row(a + n * F, b + n * F, act + n * F, F);
    });
  }
  // da = dact·b·SiLU'(a), db = dact·SiLU(a), with dact in db on entry.
  static void activation_backward(thread_pool& pool, const S* a, const S* b, A* da, A* db,
                                  std::size_t N, std::size_t F) {
    cpu::for_rows(pool, N, [&](std::size_t n) {
      cpu::swiglu_backward_row(a + n * F, b + n * F, da + n * F, db + n * F, F);
    });
  }
};

MEMBOUND_NAMESPACE_END
