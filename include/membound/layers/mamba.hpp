// The Mamba-1 block (Gu & Dao 2023; the `Mamba` module of state-spaces/mamba with its reference
// path), whose saved memory is set by the scan chunk, not by the sequence length. Semantics are
// those of tests/support/mamba_reference.hpp (W is [in, out], row-major: y = x·W):
//   xz = x·in_proj -> xi, z;  c = causal depthwise conv(xi) + conv_b;  u = SiLU(c)
//   x_dbl = u·x_proj -> dt_low [R], B [Ns], C [Ns];  Δ = softplus(dt_low·dt_proj + dt_bias)
//   h_t = exp(Δ_t·A) ⊙ h_{t−1} + Δ_t·B_t·u_t,  A = −exp(A_log);  y_t = C_t·h_t + D ⊙ u_t
//   out = (y ⊙ SiLU(z))·out_proj
//
//   using block = membound::mamba<membound::bf16_precision, membound::scan_chunk<128>>;
//   block::check(shape);                                       // throws, naming the argument
//   std::size_t saved = block::saved_bytes(shape);             // kept from forward for backward
//   block::forward(shape, w, x, out, saved_buf, saved, ws, block::forward_workspace_bytes(shape, t), pool);
//   block::backward(shape, w, x, saved_buf, saved, dout, dx, grads, ws, bws, pool);
//
// Forward keeps xz, x_dbl (storage type) and the scan state entering every chunk after the first
// (accumulator type): O(B·Di·Ns·T/chunk) state bytes, not O(B·Di·Ns·T). Backward recomputes the
// states inside each chunk from its entry state and runs the reverse scan. The checkpoint policy
// mirrors mamba_ssm's checkpoint_lvl: `recompute` (default, lvl 1) recomputes the conv output and
// Δ in backward, `save_all` (lvl 0) keeps them. Values forward stores (xz, the conv output, x_dbl,
// Δ) are rounded to the storage type once and then used as stored, so both policies give the
// same gradients bit for bit. The scan state is accumulated in the accumulator type (float or
// double). Nothing allocates: every buffer is carved from the caller's saved/workspace bytes.
//
// With cuda_backend in the policies every pointer is device memory, the executor is a
// cuda_executor and the kernels are backend/cuda/mamba_cuda.cuh's (include membound/backend/cuda.cuh
// and compile with nvcc). saved_bytes and saved_state_bytes are the same (the same states are
// saved, in the same place); the workspaces are the device's own and hold cuBLASLt's; the thread
// count the size functions take is ignored there. The decoding state lives on the device: make it
// and reset it with the executor overloads.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <span>
#include <string>
#include <type_traits>

#include "membound/backend/cpu/linalg.hpp"
#include "membound/backend/cpu/mamba_cpu.hpp"
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/core/error.hpp"
#include "membound/core/parallel.hpp"
#include "membound/core/type_list.hpp"
#include "membound/layers/layer_support.hpp"
#include "membound/shape/mamba_shape.hpp"
#include "membound/memory/workspace.hpp"
#include "membound/policy/backend.hpp"
#include "membound/policy/checkpoint.hpp"
#include "membound/policy/chunking.hpp"
#include "membound/policy/policy_set.hpp"
#include "membound/policy/precision.hpp"

MEMBOUND_NAMESPACE_BEGIN

template <typename... Policies>
class mamba {
 public:
  using policies =
      policy_set<type_list<fp32_precision, scan_chunk<128>, recompute, cpu_backend>, Policies...>;
  using precision = get_policy<policies, precision_kind>;
  using backend = get_policy<policies, backend_kind>;
  using executor = typename backend::executor;  // thread_pool, or cuda_executor
  using chunking = get_policy<policies, chunking_kind>;
  using checkpoint = get_policy<policies, checkpoint_kind>;
  static_assert(is_scan_chunk_v<chunking>,
                "membound: mamba takes scan_chunk<L> as its chunking policy (attention_tiles and "
                "ttt_mini_batch belong to attention and TTT).");
  static_assert(std::is_same_v<checkpoint, recompute> || std::is_same_v<checkpoint, save_all>,
                "membound: mamba takes `recompute` (mamba_ssm checkpoint_lvl 1: recompute the conv "
                "output and delta in backward) or `save_all` (lvl 0: keep them) as its checkpoint "
                "policy; ttt_checkpoint_groups belongs to the TTT layer.");
  using storage_type = typename precision::storage_type;
  using accum_type = typename precision::accum_type;
  static_assert(std::is_same_v<accum_type, float> || std::is_same_v<accum_type, double>,
                "membound: mamba accumulates its scan state in float or double; choose a "
                "precision whose accumulator is one of them.");

 private:
  using S = storage_type;
  using A = accum_type;
  static constexpr bool widened = !std::is_same_v<S, A>;
  static constexpr bool keep_conv_delta = std::is_same_v<checkpoint, save_all>;
  static constexpr std::size_t L = chunking::chunk;
  static constexpr bool on_cpu = is_cpu_backend_v<backend>;

 public:
  static constexpr std::size_t chunk = L;

  // ---- Checks --------------------------------------------------------------------------------
  static constexpr layer_support can_implement(const mamba_shape& s) noexcept {
    auto no = [](const char* arg, const char* expected, double actual) {
      return layer_support{false, arg, expected, actual};
    };
    const auto d = [](std::size_t v) { return static_cast<double>(v); };
    if (s.batch == 0) return no("shape.batch", "at least 1", 0.0);
    if (s.seq == 0) return no("shape.seq", "at least 1", 0.0);
    if (s.d_model == 0) return no("shape.d_model", "at least 1", 0.0);
    if (s.d_inner == 0) return no("shape.d_inner", "at least 1 (mamba_shape::defaults: 2·d_model)", 0.0);
    if (s.d_state == 0 || s.d_state > cpu::max_d_state) {
      return no("shape.d_state", "between 1 and 256", d(s.d_state));
    }
    if (s.d_conv == 0) return no("shape.d_conv", "at least 1", 0.0);
    if (s.dt_rank == 0) return no("shape.dt_rank", "at least 1 (mamba_shape::defaults: ceil(d_model / 16))", 0.0);
    return {};
  }

  static void check(const mamba_shape& s) {
    const layer_support r = can_implement(s);
    if (!r.ok) {
      detail::throw_unsupported(r, false, "Fix the mamba_shape before sizing or running the block");
    }
  }

  // ---- Memory known before running ------------------------------------------------------------
  // Parameter elements, in the order of `weights`.
  static constexpr std::size_t weight_elements(const mamba_shape& s) noexcept {
    const std::size_t C = s.d_model, Di = s.d_inner, Ns = s.d_state, R = s.dt_rank;
    return C * 2 * Di + Di * s.d_conv + Di + Di * (R + 2 * Ns) + R * Di + Di + Di * Ns + Di +
           Di * C;
  }

  static constexpr std::size_t saved_bytes(const mamba_shape& s) noexcept {
    const std::size_t b[] = {xz_bytes(s), xdbl_bytes(s), states_bytes(s), inner_s_bytes(s)};
    return detail::fits_layout(b) ? saved_layout(s).size() : std::numeric_limits<std::size_t>::max();
  }
  // Of saved_bytes, the chunk-entry scan states: B · (ceil(T / chunk) − 1) · Di · Ns accumulators.
  static constexpr std::size_t saved_state_bytes(const mamba_shape& s) noexcept {
    return states_bytes(s);
  }
  static constexpr std::size_t forward_workspace_bytes(const mamba_shape& s,
                                                       std::size_t threads) noexcept {
    if constexpr (!on_cpu) {
      return backend_kernels<backend, mamba_shape>::template forward_workspace_bytes<S>(
          s, L, keep_conv_delta);
    }
    const std::size_t b[] = {w_acc_bytes(s), xz_acc_bytes(s), inner_bytes(s), xdbl_acc_bytes(s),
                             bytes_of<A>(threads, cpu::scan_forward_scratch(s.d_state)),
                             forward_gemm_bytes(s, threads)};
    return detail::fits_layout(b) ? forward_layout(s, threads).size()
                                  : std::numeric_limits<std::size_t>::max();
  }
  static constexpr std::size_t backward_workspace_bytes(const mamba_shape& s,
                                                        std::size_t threads) noexcept {
    if constexpr (!on_cpu) {
      return backend_kernels<backend, mamba_shape>::template backward_workspace_bytes<S>(
          s, L, keep_conv_delta);
    }
    const std::size_t b[] = {w_acc_bytes(s), xz_acc_bytes(s), inner_bytes(s), part_bytes(s),
                             bytes_of<A>(threads, cpu::scan_backward_scratch(std::min(L, s.seq),
                                                                             s.d_state)),
                             backward_gemm_bytes(s, threads)};
    return detail::fits_layout(b) ? backward_layout(s, threads).size()
                                  : std::numeric_limits<std::size_t>::max();
  }
  // The decoding state: conv [B, Di, K − 1] (the last K − 1 inputs, oldest first), then the scan
  // state [B, Di, Ns], in the accumulator type. Constant in the sequence length.
  static constexpr std::size_t state_bytes(const mamba_shape& s) noexcept {
    return bytes_of<A>(s.batch, s.d_inner, s.d_conv - 1 + s.d_state);
  }
  static constexpr std::size_t step_workspace_bytes(const mamba_shape& s) noexcept {
    if constexpr (!on_cpu) {
      return backend_kernels<backend, mamba_shape>::template step_workspace_bytes<S>(s);
    }
    return step_layout(s).size();
  }

  struct weights {
    const S* in_proj;   // [C, 2·Di]   x half, then z half
    const S* conv_w;    // [Di, K]     tap K−1 multiplies the current token
    const S* conv_b;    // [Di]
    const S* x_proj;    // [Di, R + 2·Ns]  dt_low, B, C
    const S* dt_proj;   // [R, Di]
    const S* dt_bias;   // [Di]
    const S* a_log;     // [Di, Ns]    A = −exp(a_log)
    const S* d;         // [Di]
    const S* out_proj;  // [Di, C]
  };
  struct gradients {  // accumulated (+=): the caller zeroes them
    S* in_proj;
    S* conv_w;
    S* conv_b;
    S* x_proj;
    S* dt_proj;
    S* dt_bias;
    S* a_log;
    S* d;
    S* out_proj;
  };

  // The decoding state over the caller's state_bytes(shape) bytes (aligned to accum_type).
  struct state {
    void* data = nullptr;
    std::size_t bytes = 0;
    std::size_t position = 0;  // tokens consumed since reset
  };
  static state make_state(const mamba_shape& s, void* data, std::size_t bytes) {
    static_assert(on_cpu,
                  "membound: a device decoding state is zeroed on the executor's stream: call "
                  "make_state(shape, data, bytes, executor) for mamba<..., cuda_backend>.");
    check(s);
    const std::size_t need = state_bytes(s);
    if (data == nullptr || bytes < need) throw workspace_too_small("state", need, data == nullptr ? 0 : bytes);
    detail::check_aligned(data, alignof(A), "state");
    state st{data, bytes, 0};
    reset(s, st);
    return st;
  }
  // The device state, zeroed on the executor's stream (cpu_backend: the same as above).
  static state make_state(const mamba_shape& s, void* data, std::size_t bytes, executor& ex) {
    check(s);
    const std::size_t need = state_bytes(s);
    if (data == nullptr || bytes < need) throw workspace_too_small("state", need, data == nullptr ? 0 : bytes);
    detail::check_aligned(data, alignof(A), "state");
    state st{data, bytes, 0};
    reset(s, st, ex);
    return st;
  }
  static void reset(const mamba_shape& s, state& st, executor& ex) {
    if constexpr (on_cpu) {
      (void)ex;
      reset(s, st);
    } else {
      backend_kernels<backend, mamba_shape>::reset_state(st.data, state_bytes(s), ex);
      st.position = 0;
    }
  }
  static void reset(const mamba_shape& s, state& st) {
    static_assert(on_cpu,
                  "membound: a device decoding state is zeroed on the executor's stream: call "
                  "reset(shape, state, executor) for mamba<..., cuda_backend>.");
    A* p = static_cast<A*>(st.data);
    std::fill(p, p + state_bytes(s) / sizeof(A), A(0));
    st.position = 0;
  }

  // ---- Forward -------------------------------------------------------------------------------
  static void forward(const mamba_shape& s, const weights& w, const S* x, S* out, void* saved,
                      std::size_t saved_size, void* workspace, std::size_t workspace_size,
                      executor& pool) {
    check(s);
    check_weights(w);
    detail::not_null(x, "x");
    detail::not_null(out, "out");
    const auto sv = detail::carve_named(saved_layout(s), saved_bytes(s), saved, saved_size, "saved");
    if constexpr (!on_cpu) {
      using kernels = backend_kernels<backend, mamba_shape>;
      kernels::template forward<S, A>(s, L, device_weights(w), x, out, device_saved(sv),
                                      workspace, workspace_size, pool);
    } else {
      forward_cpu(s, w, x, out, sv, workspace, workspace_size, pool);
    }
  }

 private:
  template <typename SavedView>
  static void forward_cpu(const mamba_shape& s, const weights& w, const S* x, S* out,
                          const SavedView& sv, void* workspace, std::size_t workspace_size,
                          thread_pool& pool) {
    const std::size_t threads = pool.size();
    const auto ws = detail::carve_named(forward_layout(s, threads),
                                        forward_workspace_bytes(s, threads), workspace,
                                        workspace_size, "workspace");
    const std::span<std::byte> gs{ws.template get<std::byte>(f_gemm), forward_gemm_bytes(s, threads)};
    // Nothing below throws: every output is written after every check.
    const std::size_t N = s.batch * s.seq, C = s.d_model, Di = s.d_inner;
    const std::size_t Ns = s.d_state, R = s.dt_rank, ldx = R + 2 * Ns;
    const wptrs wa = widen_weights(w, s, ws.template get<A>(f_w));
    const A* xa = cpu::widen_or_alias(x, N * C, ws.template get<A>(f_x));
    A* const a_neg = ws.template get<A>(f_a);
    negexp(wa.a_log, Di * Ns, a_neg);

    // Phase 0: xz = x·in_proj, stored (rounded) and used as stored.
    S* xz_s = sv.template get<S>(s_xz);
    A* xz = cpu::accum_target(xz_s, ws.template get<A>(f_xz));
    cpu::matmul(pool, xa, wa.in_proj, xz, N, C, 2 * Di, false, cpu::ld3{C, 2 * Di, 2 * Di}, gs);
    store(pool, xz, N * 2 * Di, xz_s);
    // c = conv(xi) + b, then u = SiLU(c) in place.
    A* u = ws.template get<A>(f_u);
    conv_forward(pool, s, xz, wa, u, keep_conv_delta ? sv.template get<S>(s_c) : nullptr);
    cpu::for_rows(pool, N, [&](std::size_t n) { silu_row(u + n * Di, Di); });

    // Phase 1: x_dbl = u·x_proj (stored), Δ = softplus(dt_low·dt_proj + dt_bias).
    S* xdbl_s = sv.template get<S>(s_xdbl);
    A* xdbl = cpu::accum_target(xdbl_s, ws.template get<A>(f_xdbl));
    cpu::matmul(pool, static_cast<const A*>(u), wa.x_proj, xdbl, N, Di, ldx, false,
                cpu::ld3{Di, ldx, ldx}, gs);
    store(pool, xdbl, N * ldx, xdbl_s);
    A* delta = ws.template get<A>(f_delta);
    delta_forward(pool, s, xdbl, wa, delta, keep_conv_delta ? sv.template get<S>(s_delta) : nullptr,
                  gs);

    // Phase 2: the scan, keeping the chunk-entry states; then the gate, in place.
    A* y = ws.template get<A>(f_y);
    cpu::scan_forward(pool, s, L, static_cast<const A*>(u), static_cast<const A*>(delta),
                      static_cast<const A*>(xdbl), static_cast<const A*>(a_neg), wa.d, y,
                      sv.template get<A>(s_states), ws.template get<A>(f_scratch));
    cpu::for_rows(pool, N, [&](std::size_t n) { gate_row(y + n * Di, xz + n * 2 * Di + Di, Di); });

    // Phase 3: out = g·out_proj.
    A* oa = cpu::accum_target(out, ws.template get<A>(f_out));
    cpu::matmul(pool, static_cast<const A*>(y), wa.out_proj, oa, N, Di, C, false,
                cpu::ld3{Di, C, C}, gs);
    if constexpr (widened) cpu::narrow(static_cast<const A*>(oa), N * C, out);
  }

  // ---- Backward ------------------------------------------------------------------------------
 public:
  static void backward(const mamba_shape& s, const weights& w, const S* x, const void* saved,
                       std::size_t saved_size, const S* dout, S* dx, const gradients& g,
                       void* workspace, std::size_t workspace_size, executor& pool) {
    check(s);
    check_weights(w);
    detail::not_null(x, "x");
    detail::not_null(dout, "dout");
    detail::not_null(dx, "dx");
    check_gradients(g);
    const auto sv = detail::carve_named(saved_layout(s), saved_bytes(s), const_cast<void*>(saved),
                                        saved_size, "saved");
    if constexpr (!on_cpu) {
      using kernels = backend_kernels<backend, mamba_shape>;
      kernels::template backward<S, A>(
          s, L, device_weights(w), x, device_saved(sv), dout, dx,
          typename kernels::template gradients<S>{g.in_proj, g.conv_w, g.conv_b, g.x_proj,
                                                  g.dt_proj, g.dt_bias, g.a_log, g.d, g.out_proj},
          workspace, workspace_size, pool);
    } else {
      backward_cpu(s, w, x, sv, dout, dx, g, workspace, workspace_size, pool);
    }
  }

 private:
  template <typename SavedView>
  static void backward_cpu(const mamba_shape& s, const weights& w, const S* x, const SavedView& sv,
                           const S* dout, S* dx, const gradients& g, void* workspace,
                           std::size_t workspace_size, thread_pool& pool) {
    const std::size_t threads = pool.size();
    const auto ws = detail::carve_named(backward_layout(s, threads),
                                        backward_workspace_bytes(s, threads), workspace,
                                        workspace_size, "workspace");
    const std::span<std::byte> gs{ws.template get<std::byte>(b_gemm), backward_gemm_bytes(s, threads)};
    const std::size_t N = s.batch * s.seq, C = s.d_model, Di = s.d_inner, K = s.d_conv;
    const std::size_t Ns = s.d_state, R = s.dt_rank, ldx = R + 2 * Ns;
    const wptrs wa = widen_weights(w, s, ws.template get<A>(b_w));
    A* const a_neg = ws.template get<A>(b_a);
    negexp(wa.a_log, Di * Ns, a_neg);

    // Phase 0: the forward's values, as stored (or recomputed from what is stored).
    const A* xz = cpu::widen_or_alias(static_cast<const S*>(sv.template get<S>(s_xz)), N * 2 * Di,
                                 ws.template get<A>(b_xz));
    const A* xdbl = cpu::widen_or_alias(static_cast<const S*>(sv.template get<S>(s_xdbl)), N * ldx,
                                   ws.template get<A>(b_xdbl));
    const A* c;
    const A* delta;
    if constexpr (keep_conv_delta) {
      c = cpu::widen_or_alias(static_cast<const S*>(sv.template get<S>(s_c)), N * Di,
                         ws.template get<A>(b_c));
      delta = cpu::widen_or_alias(static_cast<const S*>(sv.template get<S>(s_delta)), N * Di,
                             ws.template get<A>(b_delta));
    } else {
      A* cw = ws.template get<A>(b_c);
      conv_forward(pool, s, xz, wa, cw, nullptr);
      A* dw = ws.template get<A>(b_delta);
      delta_forward(pool, s, xdbl, wa, dw, nullptr, gs);
      c = cw;
      delta = dw;
    }
    A* u = ws.template get<A>(b_u);
    cpu::for_rows(pool, N, [&](std::size_t n) {
      const A* cn = c + n * Di;
      A* un = u + n * Di;
      for (std::size_t i = 0; i < Di; ++i) un[i] = cpu::vmath::silu(cn[i]);
    });
    // dg = dout·out_projᵀ; the scan's output gradient dy = dg ⊙ SiLU(z).
    const A* dya = cpu::widen_or_alias(dout, N * C, ws.template get<A>(b_dout));
    A* dg = ws.template get<A>(b_dg);
    cpu::matmul_bt(pool, dya, wa.out_proj, dg, N, C, Di, false, cpu::ld3{C, C, Di}, gs);
    A* dys = ws.template get<A>(b_dys);
    cpu::for_rows(pool, N, [&](std::size_t n) {
      const A* z = xz + n * 2 * Di + Di;
      const A* dgn = dg + n * Di;
      A* dyn = dys + n * Di;
      for (std::size_t i = 0; i < Di; ++i) dyn[i] = dgn[i] * cpu::vmath::silu(z[i]);
    });

    // Phase 1: the reverse scan.
    A* y = ws.template get<A>(b_y);
    A* du = ws.template get<A>(b_du);
    A* ddelta = ws.template get<A>(b_ddelta);
    A* small = ws.template get<A>(b_small);
    A* da = small;                  // [Di, Ns] w.r.t. A
    A* dd = da + Di * Ns;           // [Di]
    A* dconv_w = dd + Di;           // [Di, K]
    A* dconv_b = dconv_w + Di * K;  // [Di]
    A* ddt_bias = dconv_b + Di;     // [Di]
    A* dxdbl = ws.template get<A>(b_dxdbl);
    cpu::scan_backward(pool, s, L, static_cast<const A*>(u), delta, xdbl,
                       static_cast<const A*>(a_neg), wa.d, sv.template get<A>(s_states),
                       static_cast<const A*>(dys), y, du, ddelta, da, dd,
                       ws.template get<A>(b_part), ws.template get<A>(b_scratch));
    cpu::reduce_bc(pool, s, static_cast<const A*>(ws.template get<A>(b_part)), dxdbl);

    // Phase 2: dz = dg ⊙ y ⊙ SiLU'(z) into dxz's z half; g = y ⊙ SiLU(z); dout_proj = gᵀ·dout.
    A* dxz = ws.template get<A>(b_dxz);
    cpu::for_rows(pool, N, [&](std::size_t n) {
      const A* z = xz + n * 2 * Di + Di;
      A* dz = dxz + n * 2 * Di + Di;
      const A* dgn = dg + n * Di;
      A* yn = y + n * Di;
      for (std::size_t i = 0; i < Di; ++i) {
        const A sg = cpu::vmath::sigmoid(z[i]);  // SiLU = z·σ, SiLU' = σ·(1 + z·(1 − σ))
        dz[i] = dgn[i] * yn[i] * (sg * (A(1) + z[i] * (A(1) - sg)));
        yn[i] *= z[i] * sg;
      }
    });
    A* tmp = ws.template get<A>(b_wtmp);
    weight_grad(pool, static_cast<const A*>(y), dya, g.out_proj, tmp, N, Di, C, gs);

    // Phase 3: dt = dt_low·dt_proj + dt_bias went through softplus, whose derivative σ(dt) is
    // 1 − exp(−Δ) = −expm1(−Δ): the gradient follows from Δ alone, as stored.
    cpu::for_rows(pool, N, [&](std::size_t n) {
      for (std::size_t i = 0; i < Di; ++i)
        ddelta[n * Di + i] *= -std::expm1(-delta[n * Di + i]);
    });
    column_sums(pool, static_cast<const A*>(ddelta), N, Di, ddt_bias);
    if constexpr (widened) {
      cpu::matmul_at(pool, xdbl, static_cast<const A*>(ddelta), tmp, N, R, Di, false,
                     cpu::ld3{ldx, Di, Di}, gs);
      cpu::narrow_add(static_cast<const A*>(tmp), R * Di, g.dt_proj);
    } else {
      cpu::matmul_at(pool, xdbl, static_cast<const A*>(ddelta), g.dt_proj, N, R, Di, true,
                     cpu::ld3{ldx, Di, Di}, gs);
    }
    cpu::matmul_bt(pool, static_cast<const A*>(ddelta), wa.dt_proj, dxdbl, N, Di, R, false,
                   cpu::ld3{Di, Di, ldx}, gs);

    // Phase 4: x_proj's gradients; dc = du ⊙ SiLU'(c); the convolution's transpose.
    weight_grad(pool, static_cast<const A*>(u), static_cast<const A*>(dxdbl), g.x_proj, tmp, N, Di,
                ldx, gs);
    cpu::matmul_bt(pool, static_cast<const A*>(dxdbl), wa.x_proj, du, N, ldx, Di, true,
                   cpu::ld3{ldx, ldx, Di}, gs);
    cpu::for_rows(pool, N, [&](std::size_t n) {
      const A* cn = c + n * Di;
      A* dun = du + n * Di;
      for (std::size_t i = 0; i < Di; ++i) dun[i] *= cpu::vmath::silu_grad(cn[i]);
    });
    cpu::causal_conv_backward(pool, s, xz, 2 * Di, wa.conv_w, static_cast<const A*>(du), dxz,
                              2 * Di, dconv_w, dconv_b);

    // Phase 5: in_proj's gradients and dx = dxz·in_projᵀ.
    const A* xa = cpu::widen_or_alias(x, N * C, ws.template get<A>(b_x));
    weight_grad(pool, xa, static_cast<const A*>(dxz), g.in_proj, tmp, N, C, 2 * Di, gs);
    A* dxa = cpu::accum_target(dx, ws.template get<A>(b_dx));
    cpu::matmul_bt(pool, static_cast<const A*>(dxz), wa.in_proj, dxa, N, 2 * Di, C, false,
                   cpu::ld3{2 * Di, 2 * Di, C}, gs);
    if constexpr (widened) cpu::narrow(static_cast<const A*>(dxa), N * C, dx);

    // The small parameters, each rounded once into its gradient. dA_log = dA ⊙ A.
    for (std::size_t j = 0; j < Di * Ns; ++j) da[j] *= a_neg[j];
    cpu::add_grad(da, Di * Ns, g.a_log);
    cpu::add_grad(dd, Di, g.d);
    cpu::add_grad(dconv_w, Di * K, g.conv_w);
    cpu::add_grad(dconv_b, Di, g.conv_b);
    cpu::add_grad(ddt_bias, Di, g.dt_bias);
  }

  // ---- Decoding ------------------------------------------------------------------------------
 public:
  // One token per sequence: x_t [B, C] -> out_t [B, C], carrying the conv and scan states.
  // shape.seq is ignored. Checks everything before touching the state or out_t.
  static void step(const mamba_shape& s, const weights& w, state& st, const S* x_t, S* out_t,
                   void* workspace, std::size_t workspace_size, executor& pool) {
    check(s);
    check_weights(w);
    detail::not_null(x_t, "x_t");
    detail::not_null(out_t, "out_t");
    if (st.data == nullptr || st.bytes < state_bytes(s)) {
      throw workspace_too_small("state", state_bytes(s), st.data == nullptr ? 0 : st.bytes);
    }
    detail::check_aligned(st.data, alignof(A), "state");
    if constexpr (!on_cpu) {
      using kernels = backend_kernels<backend, mamba_shape>;
      kernels::template step<S, A>(s, device_weights(w), static_cast<A*>(st.data), x_t, out_t,
                                   workspace, workspace_size, pool);
      ++st.position;
    } else {
      step_cpu(s, w, st, x_t, out_t, workspace, workspace_size, pool);
    }
  }

 private:
  static void step_cpu(const mamba_shape& s, const weights& w, state& st, const S* x_t, S* out_t,
                       void* workspace, std::size_t workspace_size, thread_pool& pool) {
    const auto ws = detail::carve_named(step_layout(s), step_workspace_bytes(s), workspace,
                                        workspace_size, "workspace");
    const std::size_t B = s.batch, C = s.d_model, Di = s.d_inner, K = s.d_conv;
    const std::size_t Ns = s.d_state, R = s.dt_rank, ldx = R + 2 * Ns;
    const wptrs wa = widen_weights(w, s, ws.template get<A>(st_w));
    A* a_neg = ws.template get<A>(st_a);
    negexp(wa.a_log, Di * Ns, a_neg);
    const A* xa = cpu::widen_or_alias(x_t, B * C, ws.template get<A>(st_x));
    A* xz = ws.template get<A>(st_xz);
    // The forward's GEMM, packing buffers per task (step_gemm_bytes: one set for B <= 256, none
    // for B = 1).
    const std::span<std::byte> gs{ws.template get<std::byte>(st_gemm), step_gemm_bytes(s)};
    constexpr auto per_task = cpu::scratch_slots::per_task;
    cpu::matmul(pool, xa, wa.in_proj, xz, B, C, 2 * Di, false, cpu::ld3{C, 2 * Di, 2 * Di}, gs,
                per_task);
    cpu::round_through<S>(xz, B * 2 * Di);
    A* conv_state = static_cast<A*>(st.data);        // [B, Di, K − 1]
    A* ssm_state = conv_state + B * Di * (K - 1);   // [B, Di, Ns]
    A* u = ws.template get<A>(st_u);
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t i = 0; i < Di; ++i) {
        A* cs = conv_state + (b * Di + i) * (K - 1);
        const A xi = xz[b * 2 * Di + i];
        A c = wa.conv_b[i];
        for (std::size_t k = 0; k + 1 < K; ++k) c += wa.conv_w[i * K + k] * cs[k];
        c += wa.conv_w[i * K + K - 1] * xi;
        if (K > 1) {
          std::copy(cs + 1, cs + (K - 1), cs);
          cs[K - 2] = xi;
        }
        u[b * Di + i] = c;
      }
    cpu::round_through<S>(u, B * Di);
    for (std::size_t b = 0; b < B; ++b) silu_row(u + b * Di, Di);
    A* xdbl = ws.template get<A>(st_xdbl);
    cpu::matmul(pool, static_cast<const A*>(u), wa.x_proj, xdbl, B, Di, ldx, false,
                cpu::ld3{Di, ldx, ldx}, gs, per_task);
    cpu::round_through<S>(xdbl, B * ldx);
    A* delta = ws.template get<A>(st_delta);
    cpu::matmul(pool, static_cast<const A*>(xdbl), wa.dt_proj, delta, B, R, Di, false,
                cpu::ld3{ldx, Di, Di}, gs, per_task);
    for (std::size_t b = 0; b < B; ++b) softplus_row(delta + b * Di, wa.dt_bias, Di);
    cpu::round_through<S>(delta, B * Di);
    // The scan through the forward's own group kernel: the carried state [Di, Ns] is transposed
    // to the kernel's [Ns][lanes] and back, lanes past Di padded with zeros.
    A* y = ws.template get<A>(st_y);
    constexpr std::size_t W = cpu::scan_lanes<A>;
    A* hg = ws.template get<A>(st_scan);
    A* at = hg + Ns * W;
    A* pad = at + Ns * W;
    for (std::size_t b = 0; b < B; ++b) {
      const A* bt = xdbl + b * ldx + R;
      A* hb = ssm_state + b * Di * Ns;
      for (std::size_t ch = 0; ch < Di; ch += W) {
        const std::size_t nw = std::min(W, Di - ch);
        cpu::transpose_in(static_cast<const A*>(a_neg), ch, nw, Ns, at);
        cpu::transpose_in(static_cast<const A*>(hb), ch, nw, Ns, hg);
        A* yo = nw == W ? y + b * Di + ch : pad + 3 * W;
        cpu::scan_group_step(hg, static_cast<const A*>(at),
                             cpu::lanes_of(static_cast<const A*>(delta) + b * Di + ch, nw, pad),
                             cpu::lanes_of(static_cast<const A*>(u) + b * Di + ch, nw, pad + W),
                             cpu::lanes_of(wa.d + ch, nw, pad + 2 * W), bt, bt + Ns, Ns, yo);
        if (nw != W) std::copy(yo, yo + nw, y + b * Di + ch);
        cpu::transpose_out(static_cast<const A*>(hg), nw, Ns, hb + ch * Ns);
      }
      gate_row(y + b * Di, xz + b * 2 * Di + Di, Di);
    }
    A* oa = cpu::accum_target(out_t, ws.template get<A>(st_out));
    cpu::matmul(pool, static_cast<const A*>(y), wa.out_proj, oa, B, Di, C, false,
                cpu::ld3{Di, C, C}, gs, per_task);
    if constexpr (widened) cpu::narrow(static_cast<const A*>(oa), B * C, out_t);
    ++st.position;
  }

  // The device kernels' views of the weights and of the saved buffers.
  static auto device_weights(const weights& w) {
    return typename backend_kernels<backend, mamba_shape>::template weights<S>{
        w.in_proj, w.conv_w, w.conv_b, w.x_proj, w.dt_proj, w.dt_bias, w.a_log, w.d, w.out_proj};
  }
  template <typename SavedView>
  static auto device_saved(const SavedView& sv) {
    return typename backend_kernels<backend, mamba_shape>::template saved<S>{
        sv.template get<S>(s_xz), sv.template get<S>(s_xdbl), sv.template get<A>(s_states),
        keep_conv_delta ? sv.template get<S>(s_c) : nullptr,
        keep_conv_delta ? sv.template get<S>(s_delta) : nullptr};
  }

 public:
  // Where forward put the chunk-entry states ([B, chunks − 1, Di, Ns], accum_type) inside
  // `saved`: for tests and diagnostics.
  static const A* saved_states(const mamba_shape& s, const void* saved) {
    return static_cast<const A*>(static_cast<const void*>(static_cast<const std::byte*>(saved) +
                                                          saved_layout(s).offset(s_states)));
  }

 private:
  // ---- Sizes ---------------------------------------------------------------------------------
  static constexpr std::size_t rows(const mamba_shape& s) noexcept { return s.batch * s.seq; }
  static constexpr std::size_t xz_bytes(const mamba_shape& s) noexcept {
    return bytes_of<S>(rows(s), 2 * s.d_inner);
  }
  static constexpr std::size_t xdbl_bytes(const mamba_shape& s) noexcept {
    return bytes_of<S>(rows(s), s.dt_rank + 2 * s.d_state);
  }
  static constexpr std::size_t states_bytes(const mamba_shape& s) noexcept {
    return bytes_of<A>(s.batch, cpu::scan_chunks(s.seq, L) - 1, s.d_inner, s.d_state);
  }
  static constexpr std::size_t inner_s_bytes(const mamba_shape& s) noexcept {  // c or Δ, kept
    return keep_conv_delta ? bytes_of<S>(rows(s), s.d_inner) : 0;
  }
  static constexpr std::size_t inner_bytes(const mamba_shape& s) noexcept {  // [N, Di] in A
    return bytes_of<A>(rows(s), s.d_inner);
  }
  static constexpr std::size_t w_acc_bytes(const mamba_shape& s) noexcept {
    return widened ? bytes_of<A>(weight_elements(s)) : 0;
  }
  static constexpr std::size_t xz_acc_bytes(const mamba_shape& s) noexcept {
    return widened ? bytes_of<A>(rows(s), 2 * s.d_inner) : 0;
  }
  static constexpr std::size_t xdbl_acc_bytes(const mamba_shape& s) noexcept {
    return widened ? bytes_of<A>(rows(s), s.dt_rank + 2 * s.d_state) : 0;
  }
  static constexpr std::size_t io_acc_bytes(const mamba_shape& s) noexcept {  // x, out, dout, dx
    return widened ? bytes_of<A>(rows(s), s.d_model) : 0;
  }
  static constexpr std::size_t part_bytes(const mamba_shape& s) noexcept {
    return bytes_of<A>(blocks_of_channels(s), rows(s), 2 * s.d_state);
  }
  static constexpr std::size_t blocks_of_channels(const mamba_shape& s) noexcept {
    return cpu::blocks(s.d_inner, cpu::scan_channels);
  }
  // A conv output / Δ that backward reads straight from `saved` needs no workspace copy.
  static constexpr std::size_t recomputed_inner_bytes(const mamba_shape& s) noexcept {
    return keep_conv_delta && !widened ? 0 : inner_bytes(s);
  }
  static constexpr std::size_t wtmp_bytes(const mamba_shape& s) noexcept {
    if (!widened) return 0;
    const std::size_t C = s.d_model, Di = s.d_inner, R = s.dt_rank, Ns = s.d_state;
    return bytes_of<A>(std::max({C * 2 * Di, Di * (R + 2 * Ns), R * Di, Di * C}));
  }

  // Packing buffers of the projections (one set per thread, sized for the largest product of the
  // pass; cpu::matmul's tasks each use their thread's slice).
  static constexpr std::size_t forward_gemm_bytes(const mamba_shape& s, std::size_t threads) noexcept {
    const std::size_t N = rows(s), C = s.d_model, Di = s.d_inner, R = s.dt_rank;
    const std::size_t ldx = R + 2 * s.d_state;
    return threads * std::max({cpu::matmul_thread_scratch_bytes<A>(N, C, 2 * Di),
                               cpu::matmul_thread_scratch_bytes<A>(N, Di, ldx),
                               cpu::matmul_thread_scratch_bytes<A>(N, R, Di),
                               cpu::matmul_thread_scratch_bytes<A>(N, Di, C)});
  }
  static constexpr std::size_t backward_gemm_bytes(const mamba_shape& s, std::size_t threads) noexcept {
    const std::size_t N = rows(s), C = s.d_model, Di = s.d_inner, R = s.dt_rank;
    const std::size_t ldx = R + 2 * s.d_state;
    return threads * std::max({cpu::matmul_thread_scratch_bytes<A>(N, R, Di),       // Δ (recompute)
                               cpu::matmul_thread_scratch_bytes<A>(N, C, Di),       // dg
                               cpu::matmul_at_thread_scratch_bytes<A>(N, Di, C),    // d out_proj
                               cpu::matmul_at_thread_scratch_bytes<A>(N, R, Di),    // d dt_proj
                               cpu::matmul_thread_scratch_bytes<A>(N, Di, R),       // d dt_low
                               cpu::matmul_at_thread_scratch_bytes<A>(N, Di, ldx),  // d x_proj
                               cpu::matmul_thread_scratch_bytes<A>(N, ldx, Di),     // du
                               cpu::matmul_at_thread_scratch_bytes<A>(N, C, 2 * Di),  // d in_proj
                               cpu::matmul_thread_scratch_bytes<A>(N, 2 * Di, C)});   // dx
  }

  // Decoding's packing buffers, one set per 256-row task of its largest projection (its size
  // takes no thread count; cpu::scratch_slots::per_task), none for B = 1 (GEMVs).
  static constexpr std::size_t step_gemm_bytes(const mamba_shape& s) noexcept {
    const std::size_t B = s.batch, C = s.d_model, Di = s.d_inner, R = s.dt_rank;
    const std::size_t ldx = R + 2 * s.d_state;
    return std::max({cpu::matmul_task_scratch_bytes<A>(B, C, 2 * Di),
                     cpu::matmul_task_scratch_bytes<A>(B, Di, ldx),
                     cpu::matmul_task_scratch_bytes<A>(B, R, Di),
                     cpu::matmul_task_scratch_bytes<A>(B, Di, C)});
  }

  // ---- Layouts (shared by the size functions and the carving) ----------------------------------
  enum saved_slot : std::size_t { s_xz, s_xdbl, s_states, s_c, s_delta };
  static constexpr workspace_layout<5> saved_layout(const mamba_shape& s) {
    workspace_layout<5> l;
    l.add(xz_bytes(s));
    l.add(xdbl_bytes(s));
    l.add(states_bytes(s));
    l.add(inner_s_bytes(s));
    l.add(inner_s_bytes(s));
    return l;
  }

  // Phases: 0 in_proj and conv, 1 x_proj and Δ, 2 scan and gate, 3 out_proj.
  enum forward_slot : std::size_t {
    f_w, f_a, f_x, f_xz, f_u, f_xdbl, f_delta, f_y, f_scratch, f_out, f_gemm
  };
  static constexpr workspace_layout<11> forward_layout(const mamba_shape& s, std::size_t threads) {
    workspace_layout<11> l;
    l.add(w_acc_bytes(s), default_alignment, {0, 3});
    l.add(bytes_of<A>(s.d_inner, s.d_state), default_alignment, {0, 3});
    l.add(io_acc_bytes(s), default_alignment, {0, 0});
    l.add(xz_acc_bytes(s), default_alignment, {0, 2});
    l.add(inner_bytes(s), default_alignment, {0, 2});
    l.add(xdbl_acc_bytes(s), default_alignment, {1, 2});
    l.add(inner_bytes(s), default_alignment, {1, 2});
    l.add(inner_bytes(s), default_alignment, {2, 3});
    l.add(bytes_of<A>(threads, cpu::scan_forward_scratch(s.d_state)), default_alignment, {2, 2});
    l.add(io_acc_bytes(s), default_alignment, {3, 3});
    l.add(forward_gemm_bytes(s, threads), default_alignment, {0, 3});
    return l;
  }

  // Phases: 0 forward values, dg and the scan's dy; 1 reverse scan; 2 gate and out_proj grads;
  // 3 Δ's projection grads; 4 x_proj and conv grads; 5 in_proj grads and dx.
  enum backward_slot : std::size_t {
    b_w, b_a, b_xz, b_xdbl, b_c, b_delta, b_u, b_dout, b_dg, b_dys, b_y, b_du, b_ddelta,
    b_small, b_part, b_scratch, b_dxdbl, b_dxz, b_wtmp, b_x, b_dx, b_gemm
  };
  static constexpr workspace_layout<22> backward_layout(const mamba_shape& s, std::size_t threads) {
    const std::size_t Di = s.d_inner, Ns = s.d_state;
    workspace_layout<22> l;
    l.add(w_acc_bytes(s), default_alignment, {0, 5});
    l.add(bytes_of<A>(Di, Ns), default_alignment, {0, 5});
    l.add(xz_acc_bytes(s), default_alignment, {0, 4});
    l.add(xdbl_acc_bytes(s), default_alignment, {0, 3});
    l.add(recomputed_inner_bytes(s), default_alignment, {0, 4});  // c
    l.add(recomputed_inner_bytes(s), default_alignment, {0, 3});  // Δ
    l.add(inner_bytes(s), default_alignment, {0, 4});             // u
    l.add(io_acc_bytes(s), default_alignment, {0, 2});            // dout
    l.add(inner_bytes(s), default_alignment, {0, 2});             // dg
    l.add(inner_bytes(s), default_alignment, {0, 1});             // the scan's dy
    l.add(inner_bytes(s), default_alignment, {1, 2});             // y, then g
    l.add(inner_bytes(s), default_alignment, {1, 4});             // du, then dc
    l.add(inner_bytes(s), default_alignment, {1, 3});             // dΔ, then d(dt)
    l.add(bytes_of<A>(Di * (Ns + s.d_conv + 3)), default_alignment, {1, 5});
    l.add(part_bytes(s), default_alignment, {1, 1});
    l.add(bytes_of<A>(threads, cpu::scan_backward_scratch(std::min(L, s.seq), Ns)),
          default_alignment, {1, 1});
    l.add(bytes_of<A>(rows(s), s.dt_rank + 2 * Ns), default_alignment, {1, 4});
    l.add(bytes_of<A>(rows(s), 2 * Di), default_alignment, {2, 5});
    l.add(wtmp_bytes(s), default_alignment, {2, 5});
    l.add(io_acc_bytes(s), default_alignment, {5, 5});  // x
    l.add(io_acc_bytes(s), default_alignment, {5, 5});  // dx
    // Every phase but the reverse scan runs a projection; phase 1 could share these bytes, but
    // the scan's part/scratch are the larger and a {0, 5} slot keeps the layout simple.
    l.add(backward_gemm_bytes(s, threads), default_alignment, {0, 5});
    return l;
  }

  enum step_slot : std::size_t {
    st_w, st_a, st_x, st_xz, st_u, st_xdbl, st_delta, st_y, st_out, st_scan, st_gemm
  };
  static constexpr workspace_layout<11> step_layout(const mamba_shape& s) {
    const std::size_t B = s.batch, Di = s.d_inner;
    workspace_layout<11> l;
    l.add(w_acc_bytes(s));
    l.add(bytes_of<A>(Di, s.d_state));
    l.add(widened ? bytes_of<A>(B, s.d_model) : 0);
    l.add(bytes_of<A>(B, 2 * Di));
    l.add(bytes_of<A>(B, Di));
    l.add(bytes_of<A>(B, s.dt_rank + 2 * s.d_state));
    l.add(bytes_of<A>(B, Di));
    l.add(bytes_of<A>(B, Di));
    l.add(widened ? bytes_of<A>(B, s.d_model) : 0);
    // One scan group's state and A ([Ns][lanes] each) and its padded rows.
    l.add(bytes_of<A>(2 * s.d_state + 4, cpu::scan_lanes<A>));
    l.add(step_gemm_bytes(s));
    return l;
  }

  // ---- Helpers -------------------------------------------------------------------------------
  static void check_weights(const weights& w) {
    detail::not_null(w.in_proj, "weights.in_proj");
    detail::not_null(w.conv_w, "weights.conv_w");
    detail::not_null(w.conv_b, "weights.conv_b");
    detail::not_null(w.x_proj, "weights.x_proj");
    detail::not_null(w.dt_proj, "weights.dt_proj");
    detail::not_null(w.dt_bias, "weights.dt_bias");
    detail::not_null(w.a_log, "weights.a_log");
    detail::not_null(w.d, "weights.d");
    detail::not_null(w.out_proj, "weights.out_proj");
  }
  static void check_gradients(const gradients& g) {
    detail::not_null(g.in_proj, "gradients.in_proj");
    detail::not_null(g.conv_w, "gradients.conv_w");
    detail::not_null(g.conv_b, "gradients.conv_b");
    detail::not_null(g.x_proj, "gradients.x_proj");
    detail::not_null(g.dt_proj, "gradients.dt_proj");
    detail::not_null(g.dt_bias, "gradients.dt_bias");
    detail::not_null(g.a_log, "gradients.a_log");
    detail::not_null(g.d, "gradients.d");
    detail::not_null(g.out_proj, "gradients.out_proj");
  }

  struct wptrs {
    const A *in_proj, *conv_w, *conv_b, *x_proj, *dt_proj, *dt_bias, *a_log, *d, *out_proj;
  };
  static wptrs widen_weights(const weights& w, const mamba_shape& s, A* slot) {
    if constexpr (widened) {
      const std::size_t C = s.d_model, Di = s.d_inner, Ns = s.d_state, R = s.dt_rank;
      A* p = slot;
      const auto take = [&](const S* src, std::size_t n) {
        cpu::widen(src, n, p);
        const A* out = p;
        p += n;
        return out;
      };
      wptrs r;
      r.in_proj = take(w.in_proj, C * 2 * Di);
      r.conv_w = take(w.conv_w, Di * s.d_conv);
      r.conv_b = take(w.conv_b, Di);
      r.x_proj = take(w.x_proj, Di * (R + 2 * Ns));
      r.dt_proj = take(w.dt_proj, R * Di);
      r.dt_bias = take(w.dt_bias, Di);
      r.a_log = take(w.a_log, Di * Ns);
      r.d = take(w.d, Di);
      r.out_proj = take(w.out_proj, Di * C);
      return r;
    } else {
      (void)s;
      (void)slot;
      return {w.in_proj, w.conv_w, w.conv_b, w.x_proj, w.dt_proj, w.dt_bias, w.a_log, w.d,
              w.out_proj};
    }
  }

  static void negexp(const A* a_log, std::size_t n, A* out) {
    for (std::size_t j = 0; j < n; ++j) out[j] = -std::exp(a_log[j]);
  }

  // Rounds an A buffer through storage and writes it to the S slot (a no-op for S = A, where the
  // buffer is the slot).
  static void store(thread_pool& pool, A* values, std::size_t n, S* slot) {
    if constexpr (widened) {
      (void)pool;
      cpu::narrow(static_cast<const A*>(values), n, slot);
      cpu::widen(static_cast<const S*>(slot), n, values);
    } else {
      (void)pool;
      (void)values;
      (void)n;
      (void)slot;
    }
  }

  // c = conv(xi) + conv_b into `c`, rounded through storage (and kept when `keep` is not null).
  static void conv_forward(thread_pool& pool, const mamba_shape& s, const A* xz, const wptrs& wa,
                           A* c, S* keep) {
    const std::size_t N = rows(s), Di = s.d_inner;
    cpu::causal_conv(pool, s, xz, 2 * Di, wa.conv_w, wa.conv_b, c);
    if (keep != nullptr) {
      cpu::narrow(static_cast<const A*>(c), N * Di, keep);
      if constexpr (widened) cpu::widen(static_cast<const S*>(keep), N * Di, c);
    } else {
      cpu::round_through<S>(c, N * Di);
    }
  }

  // Δ = softplus(dt_low·dt_proj + dt_bias), rounded through storage (kept when `keep` is set).
  static void delta_forward(thread_pool& pool, const mamba_shape& s, const A* xdbl,
                            const wptrs& wa, A* delta, S* keep, std::span<std::byte> gs) {
    const std::size_t N = rows(s), Di = s.d_inner, ldx = s.dt_rank + 2 * s.d_state;
    cpu::matmul(pool, xdbl, wa.dt_proj, delta, N, s.dt_rank, Di, false, cpu::ld3{ldx, Di, Di}, gs);
    cpu::for_rows(pool, N, [&](std::size_t n) { softplus_row(delta + n * Di, wa.dt_bias, Di); });
    if (keep != nullptr) {
      cpu::narrow(static_cast<const A*>(delta), N * Di, keep);
      if constexpr (widened) cpu::widen(static_cast<const S*>(keep), N * Di, delta);
    } else {
      cpu::round_through<S>(delta, N * Di);
    }
  }

  // g[K, M] += x[N, K]ᵀ·d[N, M] with packing buffers from the workspace; for bf16/fp16 through
  // tmp in A, rounded once per element.
  static void weight_grad(thread_pool& pool, const A* x, const A* d, S* g, A* tmp, std::size_t N,
                          std::size_t K, std::size_t M, std::span<std::byte> gs) {
    if constexpr (widened) {
      cpu::matmul_at(pool, x, d, tmp, N, K, M, false, cpu::ld3{K, M, M}, gs);
      cpu::narrow_add(static_cast<const A*>(tmp), K * M, g);
    } else {
      (void)tmp;
      cpu::matmul_at(pool, x, d, g, N, K, M, true, cpu::ld3{K, M, M}, gs);
    }
  }

  // The elementwise steps that decoding must reproduce bit for bit, shared by forward and step
  // (vmath: vectorized by the compiler).
  static void silu_row(A* v, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) v[i] = cpu::vmath::silu(v[i]);
  }
  static void softplus_row(A* v, const A* bias, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) v[i] = cpu::vmath::softplus(v[i] + bias[i]);
  }
  static void gate_row(A* y, const A* z, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) y[i] *= cpu::vmath::silu(z[i]);
  }

  // out[j] = Σ_n x[n, j], in row order per column block (thread-count independent).
  static void column_sums(thread_pool& pool, const A* x, std::size_t N, std::size_t M, A* out) {
    pool.parallel_for(cpu::blocks(M, cpu::scan_channels), [&](std::size_t blk, std::size_t) {
      const std::size_t j0 = blk * cpu::scan_channels, j1 = std::min(M, j0 + cpu::scan_channels);
      std::fill(out + j0, out + j1, A(0));
      for (std::size_t n = 0; n < N; ++n)
        for (std::size_t j = j0; j < j1; ++j) out[j] += x[n * M + j];
    });
  }

};

MEMBOUND_NAMESPACE_END
