// The SwiGLU MLP on the host: the same calls as backend_kernels<cuda_backend, mlp_shape>
// (backend/cuda/mlp.cuh), which layers/swiglu_mlp.hpp makes without knowing which backend
// runs them. Three GEMMs (backend/cpu/gemm.hpp, packing buffers per thread from the caller's workspace)
// and the fused SwiGLU rows (backend/cpu/model.hpp), in the accumulator type A; bf16/fp16 storage is
// widened into workspace slots first. The front has checked every argument and the workspace's
// size; this carves the workspace and runs.
#pragma once

#include <algorithm>
#include <cstddef>
#include <limits>
#include <span>
#include <type_traits>

#include "membound/backend/cpu/gemm.hpp"
#include "membound/backend/cpu/model.hpp"
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/core/parallel.hpp"
#include "membound/memory/workspace.hpp"
#include "membound/policy/backend.hpp"
#include "membound/shape/mlp_shape.hpp"

MEMBOUND_NAMESPACE_BEGIN

template <>
struct backend_kernels<cpu_backend, mlp_shape> {
  // The workspace holds the GEMMs' packing buffers, per thread: size it with the pool's size.
  template <typename S, typename A>
  static constexpr std::size_t forward_workspace_bytes(const mlp_shape& s,
                                                       std::size_t threads) noexcept {
    return fits<S, A>(s, threads) ? forward_layout<S, A>(s, threads).size() : too_large;
  }
  template <typename S, typename A>
  static constexpr std::size_t backward_workspace_bytes(const mlp_shape& s,
                                                        std::size_t threads) noexcept {
    return fits<S, A>(s, threads) ? backward_layout<S, A>(s, threads).size() : too_large;
  }

  // a_s, b_s: the saved pre-activations [N, F], written here.
  template <typename S, typename A>
  static void forward(const mlp_shape& s, const S* wg, const S* wu, const S* wd, const S* x, S* y,
                      S* a_s, S* b_s, void* workspace, std::size_t workspace_size,
                      thread_pool& ex) {
    const std::size_t threads = ex.size();
    const auto ws = carve(forward_layout<S, A>(s, threads), workspace, workspace_size);
    const std::size_t N = s.batch * s.seq, C = s.width, F = s.hidden;
    const std::span<std::byte> pk{ws.template get<std::byte>(f_gemm), threads * pack_bytes<A>(s)};
    const A* xa = cpu::widen_or_alias(ex, x, N * C, ws.template get<A>(f_x));
    const wptrs<A> wa = widen_weights(s, wg, wu, wd, ws.template get<A>(f_w), ex);
    A* a = cpu::accum_target(a_s, ws.template get<A>(f_a));
    A* b = cpu::accum_target(b_s, ws.template get<A>(f_b));
    cpu::matmul(ex, xa, wa.g, a, N, C, F, false, cpu::ld3{C, F, F}, pk);
    cpu::matmul(ex, xa, wa.u, b, N, C, F, false, cpu::ld3{C, F, F}, pk);
    if constexpr (widened<S, A>) {  // backward sees the rounded values: use them here too
      cpu::narrow(ex, static_cast<const A*>(a), N * F, a_s);
      cpu::narrow(ex, static_cast<const A*>(b), N * F, b_s);
    }
    A* act = ws.template get<A>(f_act);
    activation(ex, a_s, b_s, act, N, F);
    A* ya = cpu::accum_target(y, ws.template get<A>(f_y));
    cpu::matmul(ex, static_cast<const A*>(act), wa.d, ya, N, F, C, false, cpu::ld3{F, C, C}, pk);
    if constexpr (widened<S, A>) cpu::narrow(ex, static_cast<const A*>(ya), N * C, y);
  }

  // Gradients are accumulated (+=) into gwg, gwu, gwd.
  template <typename S, typename A>
  static void backward(const mlp_shape& s, const S* wg, const S* wu, const S* wd, const S* x,
                       const S* a_s, const S* b_s, const S* dy, S* dx, S* gwg, S* gwu, S* gwd,
                       void* workspace, std::size_t workspace_size, thread_pool& ex) {
    const std::size_t threads = ex.size();
    const auto ws = carve(backward_layout<S, A>(s, threads), workspace, workspace_size);
    const std::size_t N = s.batch * s.seq, C = s.width, F = s.hidden;
    const std::span<std::byte> pk{ws.template get<std::byte>(b_gemm), threads * pack_bytes<A>(s)};
    const A* xa = cpu::widen_or_alias(ex, x, N * C, ws.template get<A>(b_x));
    const A* dya = cpu::widen_or_alias(ex, dy, N * C, ws.template get<A>(b_dy));
    const wptrs<A> wa = widen_weights(s, wg, wu, wd, ws.template get<A>(b_w), ex);
    A* act = ws.template get<A>(b_act);
    A* tmp = ws.template get<A>(b_tmp);
    activation(ex, a_s, b_s, act, N, F);
    cpu::weight_grad(ex, static_cast<const A*>(act), dya, gwd, tmp, N, F, C, pk);
    // dact = dy·Wdᵀ, then da = dact·b·SiLU'(a) and db = dact·SiLU(a), in place over act's slot.
    A* da = act;
    A* db = ws.template get<A>(b_db);
    cpu::matmul_bt(ex, dya, wa.d, db, N, C, F, false, cpu::ld3{C, C, F}, pk);
    activation_backward(ex, a_s, b_s, da, db, N, F);
    cpu::weight_grad(ex, xa, static_cast<const A*>(da), gwg, tmp, N, C, F, pk);
    cpu::weight_grad(ex, xa, static_cast<const A*>(db), gwu, tmp, N, C, F, pk);
    A* dxa = cpu::accum_target(dx, ws.template get<A>(b_dx));
    cpu::matmul_bt(ex, static_cast<const A*>(da), wa.g, dxa, N, F, C, false, cpu::ld3{F, F, C},
                   pk);
    cpu::matmul_bt(ex, static_cast<const A*>(db), wa.u, dxa, N, F, C, true, cpu::ld3{F, F, C},
                   pk);
    if constexpr (widened<S, A>) cpu::narrow(ex, static_cast<const A*>(dxa), N * C, dx);
  }

 private:
  static constexpr std::size_t too_large = std::numeric_limits<std::size_t>::max();
  template <typename S, typename A>
  static constexpr bool widened = !std::is_same_v<S, A>;

  template <typename A>
  static constexpr std::size_t h_a(const mlp_shape& s) noexcept {
    return bytes_of<A>(s.batch * s.seq, s.hidden);
  }
  template <typename S, typename A>
  static constexpr std::size_t x_acc(const mlp_shape& s) noexcept {
    return widened<S, A> ? bytes_of<A>(s.batch * s.seq, s.width) : 0;
  }
  template <typename S, typename A>
  static constexpr std::size_t w_acc(const mlp_shape& s) noexcept {
    return widened<S, A> ? bytes_of<A>(3 * s.width, s.hidden) : 0;
  }
  template <typename S, typename A>
  static constexpr bool fits(const mlp_shape& s, std::size_t threads) noexcept {
    const std::size_t b[] = {h_a<A>(s), w_acc<S, A>(s), x_acc<S, A>(s),
                             bytes_of<std::byte>(threads, pack_bytes<A>(s))};
    return detail::fits_layout(b);
  }
  // Per-thread packing bytes of the GEMMs (backend/cpu/gemm.hpp's gemm with the caller's buffers): the
  // largest of x·W [N, F] depth C, act·Wd and d·Wᵀ [N, C] depth F, and the weight gradients.
  template <typename A>
  static constexpr std::size_t pack_bytes(const mlp_shape& s) noexcept {
    const std::size_t N = s.batch * s.seq, C = s.width, F = s.hidden;
    return std::max({cpu::matmul_thread_scratch_bytes<A>(N, C, F),
                     cpu::matmul_thread_scratch_bytes<A>(N, F, C),
                     cpu::matmul_at_thread_scratch_bytes<A>(N, F, C),
                     cpu::matmul_at_thread_scratch_bytes<A>(N, C, F)});
  }
  // Phases: 0 the two up projections, 1 the down projection.
  enum forward_slot : std::size_t { f_x, f_w, f_a, f_b, f_act, f_y, f_gemm };
  template <typename S, typename A>
  static constexpr workspace_layout<7> forward_layout(const mlp_shape& s, std::size_t threads) {
    workspace_layout<7> l;
    l.add(x_acc<S, A>(s), default_alignment, {0, 0});
    l.add(w_acc<S, A>(s), default_alignment, {0, 1});
    l.add(widened<S, A> ? h_a<A>(s) : 0, default_alignment, {0, 0});
    l.add(widened<S, A> ? h_a<A>(s) : 0, default_alignment, {0, 0});
    l.add(h_a<A>(s), default_alignment, {1, 1});
    l.add(x_acc<S, A>(s), default_alignment, {1, 1});
    l.add(bytes_of<std::byte>(threads, pack_bytes<A>(s)), default_alignment, {0, 1});
    return l;
  }
  // Phases: 0 Wd's gradient and dact, 1 the gate's backward and Wg, Wu gradients, 2 dx.
  enum backward_slot : std::size_t { b_x, b_dy, b_w, b_act, b_db, b_tmp, b_dx, b_gemm };
  template <typename S, typename A>
  static constexpr workspace_layout<8> backward_layout(const mlp_shape& s, std::size_t threads) {
    workspace_layout<8> l;
    l.add(x_acc<S, A>(s), default_alignment, {0, 1});
    l.add(x_acc<S, A>(s), default_alignment, {0, 0});
    l.add(w_acc<S, A>(s), default_alignment, {0, 2});
    l.add(h_a<A>(s), default_alignment, {0, 2});
    l.add(h_a<A>(s), default_alignment, {0, 2});
    l.add(widened<S, A> ? bytes_of<A>(s.width, s.hidden) : 0, default_alignment, {0, 1});
    l.add(x_acc<S, A>(s), default_alignment, {2, 2});
    l.add(bytes_of<std::byte>(threads, pack_bytes<A>(s)), default_alignment, {0, 2});
    return l;
  }

  template <typename A>
  struct wptrs {
    const A *g, *u, *d;
  };
  template <typename S, typename A>
  static wptrs<A> widen_weights(const mlp_shape& s, const S* wg, const S* wu, const S* wd, A* slot,
                                thread_pool& ex) {
    if constexpr (widened<S, A>) {
      const std::size_t CF = s.width * s.hidden;
      cpu::widen(ex, wg, CF, slot);
      cpu::widen(ex, wu, CF, slot + CF);
      cpu::widen(ex, wd, CF, slot + 2 * CF);
      return {slot, slot + CF, slot + 2 * CF};
    } else {
      (void)s;
      (void)ex;
      (void)slot;
      return {wg, wu, wd};
    }
  }
  // act = SiLU(a)·b from the stored pre-activations; vectorized per row (backend/cpu/model.hpp).
  template <typename S, typename A>
  static void activation(thread_pool& ex, const S* a, const S* b, A* act, std::size_t N,
                         std::size_t F) {
    cpu::for_rows(ex, N, [&](std::size_t n) {
      cpu::swiglu_row(a + n * F, b + n * F, act + n * F, F);
    });
  }
  // da = dact·b·SiLU'(a), db = dact·SiLU(a), with dact in db on entry.
  template <typename S, typename A>
  static void activation_backward(thread_pool& ex, const S* a, const S* b, A* da, A* db,
                                  std::size_t N, std::size_t F) {
    cpu::for_rows(ex, N, [&](std::size_t n) {
      cpu::swiglu_backward_row(a + n * F, b + n * F, da + n * F, db + n * F, F);
    });
  }
};

MEMBOUND_NAMESPACE_END
