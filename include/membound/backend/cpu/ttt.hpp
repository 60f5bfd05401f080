// CPU kernels of the TTT-Linear layer: the inner loop over mini-batches in the dual form, its
// hand-derived backward (with recomputation inside TTT state groups), and the row LayerNorms.
// Everything works in the accumulator type A on buffers carved from the caller's saved bytes (by
// layers/ttt.hpp) and workspace (by backend_kernels<cpu_backend, ttt_shape> below).
//
// Per (batch row b, head h), per mini-batch of K ≤ b_mb tokens with inner state (W [D, D], w [D]):
//   Z1 = XK·W + w,  G = ∇_Z1 ½‖LN(Z1) − (XV − XK)‖²  (LN over D with the head's γ, β)
//   η[i, s] = tok[i] · lr[s] for s ≤ i (tok: the clamped token scales; lr: the per-token rates)
//   P = η ⊙ (tril(XQ·XKᵀ) + 1)         Zbar = XQ·W + w − P·G         out = XQ + LN(Zbar)
//   W ← W − XKᵀ·diag(η[K−1, :])·G,     w ← w − Σ_s η[K−1, s]·G_s
// which equals the primal form W_i = W − Σ_{s≤i} η[i, s]·∇ℓ_s(W) applied token by token.
// Layouts: XQ, XK, XV, out [B·T, H·D] (head h at columns h·D); lr [B, H, T].
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <span>
#include <type_traits>
#include <utility>

#include "membound/backend/cpu/gemm.hpp"
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/core/element_math.hpp"
#include "membound/core/parallel.hpp"
#include "membound/memory/workspace.hpp"
#include "membound/policy/backend.hpp"
#include "membound/shape/ttt_shape.hpp"

MEMBOUND_NAMESPACE_BEGIN

namespace cpu {

// LayerNorm of one row: xhat = (z − μ)/σ, σ = sqrt(var + eps) (biased variance); returns σ.
template <typename A>
A ln_row(const A* z, std::size_t D, A eps, A* xhat) {
  A mu = 0;
  for (std::size_t j = 0; j < D; ++j) mu += z[j];
  mu /= static_cast<A>(D);
  A var = 0;
  for (std::size_t j = 0; j < D; ++j) var += (z[j] - mu) * (z[j] - mu);
  var /= static_cast<A>(D);
  const A sigma = std::sqrt(var + eps);
  for (std::size_t j = 0; j < D; ++j) xhat[j] = (z[j] - mu) / sigma;
  return sigma;
}

// Backward of x̂ = LN(z) given dL/dx̂ (dxhat) and an explicit dL/dσ: dz (written).
template <typename A>
void ln_row_backward(const A* xhat, A sigma, const A* dxhat, A dsigma, std::size_t D, A* dz) {
  A m1 = 0, m2 = 0;
  for (std::size_t j = 0; j < D; ++j) {
    m1 += dxhat[j];
    m2 += dxhat[j] * xhat[j];
  }
  m1 /= static_cast<A>(D);
  m2 /= static_cast<A>(D);
  for (std::size_t j = 0; j < D; ++j)
    dz[j] = (dxhat[j] - m1 - xhat[j] * m2) / sigma + dsigma * xhat[j] / static_cast<A>(D);
}

// RoPE on interleaved pairs (x[2i], x[2i+1]) of every D-wide head of rows [N, heads·D], at
// position (n mod T) mod period (TTT counts positions inside each mini-batch), or under packed
// sequences (n − its sequence's start) mod period: the rotation ttt-lm-pytorch gets from
// permute_qk + rotate-half + undo_permute_qk. inverse: the transpose.
template <typename A>
void rope_pairs(thread_pool& pool, A* x, std::size_t N, std::size_t T, std::size_t heads,
                std::size_t D, double base, std::size_t period, bool inverse,
                const packed_sequences& packing = {}) {
  const std::size_t width = heads * D;
  // Frequency outer, rows inner: one pow per (block, pair) instead of per row, and the block's
  // rows share a handful of positions (there are `period` of them), so cos/sin are cached by
  // position. The values are the very same doubles, so the bits do not change.
  constexpr std::size_t cache = 64;
  pool.parallel_for(blocks(N, row_block), [&](std::size_t blk, std::size_t) {
    const std::size_t r0 = blk * row_block, r1 = std::min(N, r0 + row_block);
    std::size_t tag[cache], position[row_block];
    A cs[cache], sn[cache];
    for (std::size_t n = r0; n < r1; ++n) {
      position[n - r0] = (packing.packed() ? n - packing.begin_of(n) : n % T) % period;
    }
    for (std::size_t i = 0; i < D / 2; ++i) {
      const double inv_freq =
          std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(D));
      std::fill(tag, tag + cache, ~std::size_t{0});
      for (std::size_t n = r0; n < r1; ++n) {
        const std::size_t pos = position[n - r0], slot = pos % cache;
        if (tag[slot] != pos) {
          const double angle = static_cast<double>(pos) * inv_freq * (inverse ? -1.0 : 1.0);
          cs[slot] = static_cast<A>(std::cos(angle));
          sn[slot] = static_cast<A>(std::sin(angle));
          tag[slot] = pos;
        }
        const A c = cs[slot], s = sn[slot];
        A* row = x + n * width + 2 * i;
        for (std::size_t h = 0; h < heads; ++h) {
          A* p = row + h * D;
          const A x1 = p[0], x2 = p[1];
          p[0] = x1 * c - x2 * s;
          p[1] = x2 * c + x1 * s;
        }
      }
    }
  });
}

// GELU, tanh form (the reference implementation's), and its first two derivatives: one
// definition with the CUDA kernels' (core/element_math.hpp).
template <typename A>
struct gelu_tanh {
  static A f(A x) { return gelu_tanh_f(x); }
  static A d1(A x) { return gelu_tanh_d1(x); }
  static A d2(A x) { return gelu_tanh_d2(x); }
};

// Packing bytes of one thread for every product of one mini-batch (K <= mb rows, inner widths D
// and F): the largest of the products below, each bounded by its K = mb case.
template <typename A>
constexpr std::size_t ttt_inner_gemm_bytes(std::size_t D, std::size_t F, std::size_t mb) noexcept {
  std::size_t m = 0;
  for (const std::size_t n : {D, F}) {
    const std::size_t o = n == D ? F : D;  // the other width: a layer is [n, o]
    m = std::max({m, gemm_scratch_bytes<A>(mb, o, n), gemm_scratch_bytes<A>(mb, n, o),
                  gemm_scratch_bytes<A>(n, o, mb), gemm_scratch_bytes<A>(mb, mb, n),
                  gemm_scratch_bytes<A>(mb, n, mb), gemm_scratch_bytes<A>(mb, o, mb)});
  }
  return m;
}

// The rows of one (b, h) mini-batch, and its learning rates.
template <typename A>
struct ttt_minibatch {
  const A *q, *k, *v;  // [K, D] with row stride ld
  std::size_t K, D, ld;
  const A* lr;   // [K]
  const A* tok;  // [mb] clamped token scales
  const A *gamma, *beta;
  A eps;
};

// Z = X·W + b: X [K, nin] (row stride ldx), W [nin, nout], Z [K, nout] contiguous.
template <typename A>
void ttt_linear_rows(const A* x, std::size_t ldx, std::size_t K, std::size_t nin, std::size_t nout,
                     const A* W, const A* b, A* z, gemm_scratch pk) {
  auto Z = view(z, K, nout, nout);
  gemm(Z, cview(x, K, nin, ldx), cview(W, nin, nout, nout), A(1), false, pk);
  for (std::size_t i = 0; i < K; ++i)
    for (std::size_t j = 0; j < nout; ++j) z[i * nout + j] += b[j];
}

// G = ∇_Z ½‖γ ⊙ LN(Z) + β − (V − K)‖² row by row (Z [K, D]); keeps x̂ and σ for the backward.
template <typename A>
void ttt_ln_l2(const ttt_minibatch<A>& m, const A* z, A* xh, A* sig, A* g) {
  const std::size_t K = m.K, D = m.D;
  for (std::size_t i = 0; i < K; ++i) {
    sig[i] = ln_row(z + i * D, D, m.eps, xh + i * D);
    // gx = (γ x̂ + β − (v − k)) ⊙ γ;  G = (gx − mean gx − x̂ mean(gx x̂)) / σ
    A* gr = g + i * D;
    A a = 0, c = 0;
    for (std::size_t j = 0; j < D; ++j) {
      const A r = m.gamma[j] * xh[i * D + j] + m.beta[j] - (m.v[i * m.ld + j] - m.k[i * m.ld + j]);
      gr[j] = r * m.gamma[j];
      a += gr[j];
      c += gr[j] * xh[i * D + j];
    }
    a /= static_cast<A>(D);
    c /= static_cast<A>(D);
    for (std::size_t j = 0; j < D; ++j) gr[j] = (gr[j] - a - xh[i * D + j] * c) / sig[i];
  }
}

// The backward of ttt_ln_l2 given dG: dZ (written), dγ, dβ (accumulated) and the target's
// gradient into dk (+) and dv (−) (row stride ld). `rowd` is 3·D scratch.
template <typename A>
void ttt_ln_l2_backward(const ttt_minibatch<A>& m, const A* xh, const A* sig, const A* g,
                        const A* dg, A* pgam, A* pbet, A* dz, A* dk, A* dv, A* rowd) {
  const std::size_t K = m.K, D = m.D;
  const A invD = A(1) / static_cast<A>(D);
  for (std::size_t i = 0; i < K; ++i) {
    const A* xr = xh + i * D;
    const A* g_r = g + i * D;
    const A* dg_r = dg + i * D;
    A* r = rowd;
    A* dgx = rowd + D;
    A* dxh = rowd + 2 * D;
    A cc = 0, m1 = 0, sdx = 0, dsig = 0;
    for (std::size_t j = 0; j < D; ++j) {
      r[j] = m.gamma[j] * xr[j] + m.beta[j] - (m.v[i * m.ld + j] - m.k[i * m.ld + j]);
      cc += r[j] * m.gamma[j] * xr[j];
      m1 += dg_r[j];
      sdx += dg_r[j] * xr[j];
      dsig -= dg_r[j] * g_r[j];
    }
    cc *= invD;
    m1 *= invD;
    dsig /= sig[i];
    // G = (gx − mean gx − x̂·mean(gx x̂))/σ: its partials in gx, x̂ and σ.
    for (std::size_t j = 0; j < D; ++j) {
      const A gx = r[j] * m.gamma[j];
      dgx[j] = (dg_r[j] - m1 - xr[j] * sdx * invD) / sig[i];
      dxh[j] = -(dg_r[j] * cc) / sig[i] - sdx / sig[i] * gx * invD;
      const A dr = dgx[j] * m.gamma[j];
      pgam[j] += dgx[j] * r[j] + dr * xr[j];
      pbet[j] += dr;
      dv[i * m.ld + j] -= dr;  // the target is v − k
      dk[i * m.ld + j] += dr;
      dxh[j] += dr * m.gamma[j];
    }
    ln_row_backward(xr, sig[i], dxh, dsig, D, dz + i * D);
  }
}

// P = η ⊙ (tril(X·Yᵀ) + 1) with η[i, s] = tok_i·lr_s (zero above the diagonal); tril(X·Yᵀ)
// itself into att. X, Y [K, n] with row strides ldx, ldy.
template <typename A>
void ttt_p_matrix(const A* x, std::size_t ldx, const A* y, std::size_t ldy, std::size_t K,
                  std::size_t n, const A* tok, const A* lr, A* att, A* p, gemm_scratch pk) {
  auto At = view(att, K, K, K);
  gemm(At, cview(x, K, n, ldx), cview(y, K, n, ldy).transpose(), A(1), false, pk);
  for (std::size_t i = 0; i < K; ++i)
    for (std::size_t s = 0; s < K; ++s) {
      if (s > i) {
        att[i * K + s] = 0;
        p[i * K + s] = 0;
      } else {
        p[i * K + s] = tok[i] * lr[s] * (att[i * K + s] + A(1));
      }
    }
}

// Zbar = X·W + b − P·G: X [K, nin] (stride ldx), G and Zbar [K, nout].
template <typename A>
void ttt_dual_rows(const A* x, std::size_t ldx, std::size_t K, std::size_t nin, std::size_t nout,
                   const A* W, const A* b, const A* p, const A* g, A* zb, gemm_scratch pk) {
  ttt_linear_rows(x, ldx, K, nin, nout, W, b, zb, pk);
  auto Zb = view(zb, K, nout, nout);
  gemm(Zb, cview(p, K, K, K), cview(g, K, nout, nout), A(-1), true, pk);
}

// The mini-batch's update: W ← W − Xᵀ·diag(e)·G, b ← b − Σ_s e_s·G_s, e_s = tok[K−1]·lr_s.
// `eg` is [K, nout] scratch.
template <typename A>
void ttt_update(const A* x, std::size_t ldx, std::size_t K, std::size_t nin, std::size_t nout,
                const A* g, A tok_last, const A* lr, A* W, A* b, A* eg, gemm_scratch pk) {
  for (std::size_t s = 0; s < K; ++s) {
    const A e = tok_last * lr[s];
    for (std::size_t j = 0; j < nout; ++j) {
      eg[s * nout + j] = e * g[s * nout + j];
      b[j] -= eg[s * nout + j];
    }
  }
  auto Wm = view(W, nin, nout, nout);
  gemm(Wm, cview(x, K, nin, ldx).transpose(), cview(eg, K, nout, nout), A(-1), true, pk);
}

// The update's backward, given dL/dW' (dWn [nin, nout]) and dL/db' (dbn): accumulates into dX
// (stride lddx), dG [K, nout] and de (dL/de_s, before e_s = tok[K−1]·lr_s is expanded).
// s1 [K, nout] and s2 [K, nin] are scratch.
template <typename A>
void ttt_update_backward(const A* x, std::size_t ldx, std::size_t K, std::size_t nin,
                         std::size_t nout, const A* g, A tok_last, const A* lr, const A* dWn,
                         const A* dbn, A* dx, std::size_t lddx, A* dg, A* de, A* s1, A* s2,
                         gemm_scratch pk) {
  auto XdW = view(s1, K, nout, nout);
  gemm(XdW, cview(x, K, nin, ldx), cview(dWn, nin, nout, nout), A(1), false, pk);
  auto GdWt = view(s2, K, nin, nin);
  gemm(GdWt, cview(g, K, nout, nout), cview(dWn, nin, nout, nout).transpose(), A(1), false,
       pk);
  for (std::size_t i = 0; i < K; ++i) {
    const A e = tok_last * lr[i];
    A d = 0;
    for (std::size_t j = 0; j < nout; ++j) {
      const A t = s1[i * nout + j] + dbn[j];
      d -= t * g[i * nout + j];
      dg[i * nout + j] -= e * t;
    }
    de[i] += d;
    for (std::size_t j = 0; j < nin; ++j) dx[i * lddx + j] -= e * s2[i * nin + j];
  }
}

// The backward of Zbar = X·W + b − P·G given dZbar: accumulates dX (stride lddx), dW, db and
// dG; writes dP = −dZbar·Gᵀ on the lower triangle (zero above).
template <typename A>
void ttt_dual_rows_backward(const A* x, std::size_t ldx, std::size_t K, std::size_t nin,
                            std::size_t nout, const A* W, const A* p, const A* g, const A* dzb,
                            A* dx, std::size_t lddx, A* dW, A* db, A* dg, A* dp,
                            gemm_scratch pk) {
  const auto DZb = cview(dzb, K, nout, nout);
  auto dX = view(dx, K, nin, lddx);
  gemm(dX, DZb, cview(W, nin, nout, nout).transpose(), A(1), true, pk);
  auto dWm = view(dW, nin, nout, nout);
  gemm(dWm, cview(x, K, nin, ldx).transpose(), DZb, A(1), true, pk);
  for (std::size_t i = 0; i < K; ++i)
    for (std::size_t j = 0; j < nout; ++j) db[j] += dzb[i * nout + j];
  auto dG = view(dg, K, nout, nout);
  gemm(dG, cview(p, K, K, K).transpose(), DZb, A(-1), true, pk);
  auto dP = view(dp, K, K, K);
  gemm(dP, DZb, cview(g, K, nout, nout).transpose(), A(-1), false, pk);
  for (std::size_t i = 0; i < K; ++i)
    for (std::size_t s = i + 1; s < K; ++s) dp[i * K + s] = 0;
}

// P = η ⊙ (att + 1), η[i, s] = tok_i·lr_s: turns dP into dL/d(att) in place and accumulates
// dL/dtok_i (ptok) and dL/dlr_s (dl).
template <typename A>
void ttt_p_backward(std::size_t K, const A* tok, const A* lr, const A* att, A* dp, A* ptok,
                    A* dl) {
  for (std::size_t i = 0; i < K; ++i)
    for (std::size_t s = 0; s <= i; ++s) {
      const A d = dp[i * K + s], d_eta = d * (att[i * K + s] + A(1));
      ptok[i] += d_eta * lr[s];
      dl[s] += d_eta * tok[i];
      dp[i * K + s] = d * tok[i] * lr[s];
    }
}

// att = tril(X·Yᵀ): accumulates dX += dAtt·Y and dY += dAttᵀ·X (strides as given).
template <typename A>
void ttt_att_backward(const A* x, std::size_t ldx, const A* y, std::size_t ldy, std::size_t K,
                      std::size_t n, const A* datt, A* dx, std::size_t lddx, A* dy,
                      std::size_t lddy, gemm_scratch pk) {
  const auto dAtt = cview(datt, K, K, K);
  auto dX = view(dx, K, n, lddx);
  gemm(dX, dAtt, cview(y, K, n, ldy), A(1), true, pk);
  auto dY = view(dy, K, n, lddy);
  gemm(dY, dAtt.transpose(), cview(x, K, n, ldx), A(1), true, pk);
}

}  // namespace cpu

// The TTT layers on the host: the same calls as backend_kernels<cuda_backend, ttt_shape>
// (backend/cuda/ttt.cuh), which layers/ttt.hpp makes without knowing which backend runs
// them. Mlp: TTT-MLP (else TTT-Linear); MB: the mini-batch; G: the TTT state group. The front
// has checked every argument and the workspace's size; this carves the workspace and runs the
// dual form in the accumulator type A, one (batch, head) task per thread.
template <>
struct backend_kernels<cpu_backend, ttt_shape> {
  template <bool Mlp, std::size_t MB, typename S, typename A>
  static constexpr std::size_t forward_workspace_bytes(const ttt_shape& s,
                                                       std::size_t threads) noexcept {
    using P = pass<Mlp, MB, 1, S, A>;
    const std::size_t b[] = {P::w_acc_bytes(s), P::wide(s), P::task_scratch(s, threads, false),
                             bytes_of<std::byte>(threads, P::forward_pack_bytes(s))};
    return detail::fits_layout(b) ? P::forward_layout(s, threads).size() : too_large;
  }
  template <bool Mlp, std::size_t MB, std::size_t G, typename S, typename A>
  static constexpr std::size_t backward_workspace_bytes(const ttt_shape& s,
                                                        std::size_t threads) noexcept {
    using P = pass<Mlp, MB, G, S, A>;
    const std::size_t b[] = {P::w_acc_bytes(s), P::wide(s), P::partial_bytes(s),
                             P::task_scratch(s, threads, true),
                             bytes_of<std::byte>(threads, P::backward_pack_bytes(s))};
    return detail::fits_layout(b) ? P::backward_layout(s, threads).size() : too_large;
  }
  template <bool Mlp, std::size_t MB, typename S, typename A>
  static constexpr std::size_t step_workspace_bytes(const ttt_shape& s) noexcept {
    using P = pass<Mlp, MB, 1, S, A>;
    ttt_shape one = s;
    one.seq = 1;
    const std::size_t b[] = {P::w_acc_bytes(one), P::wide(one),
                             bytes_of<A>(ttt_inner_elements(s, Mlp)), P::step_pack_bytes(s)};
    return detail::fits_layout(b) ? P::forward_layout(one, 1, true).size() : too_large;
  }

  // ckpt: the saved inner states [B·H, saved states, SZ] (A); o_s: the heads' output [N, C]
  // (storage).
  template <bool Mlp, std::size_t MB, std::size_t G, typename S, typename A>
  static void forward(const ttt_shape& s, const ttt_weights<S>& w, const S* x, S* y, A* ckpt,
                      S* o_s, void* workspace, std::size_t workspace_size, thread_pool& ex) {
    pass<Mlp, MB, G, S, A>::forward(s, w, x, y, ckpt, o_s, workspace, workspace_size, ex);
  }
  template <bool Mlp, std::size_t MB, std::size_t G, typename S, typename A>
  static void backward(const ttt_shape& s, const ttt_weights<S>& w, const S* x, const A* ckpt,
                       const S* o_s, const S* dy, S* dx, const ttt_gradients<S>& g,
                       void* workspace, std::size_t workspace_size, thread_pool& ex) {
    pass<Mlp, MB, G, S, A>::backward(s, w, x, ckpt, o_s, dy, dx, g, workspace, workspace_size, ex);
  }
  // One decoding token per sequence at mini-batch position i (state: [B·H, 2, SZ], the starting
  // state then the running sums).
  template <bool Mlp, std::size_t MB, typename S, typename A>
  static void step(const ttt_shape& s, const ttt_weights<S>& w, A* state, std::size_t i,
                   const S* x_t, S* y_t, void* workspace, std::size_t workspace_size,
                   thread_pool& ex) {
    pass<Mlp, MB, 1, S, A>::step(s, w, state, i, x_t, y_t, workspace, workspace_size, ex);
  }
  // Per (b, h): the layer's W1, b1 (W2, b2), then the running sums zeroed, each SZ long.
  template <bool Mlp, typename A, typename S>
  static void reset_state(const ttt_shape& s, const ttt_weights<S>& w, A* state) {
    const std::size_t SZ = ttt_inner_elements(s, Mlp);
    for (std::size_t b = 0; b < s.batch; ++b)
      for (std::size_t h = 0; h < s.heads; ++h) {
        A* q = state + (b * s.heads + h) * 2 * SZ;
        pass<Mlp, 1, 1, S, A>::load_initial(s, w, h, q);
        std::fill(q + SZ, q + 2 * SZ, A(0));
      }
  }
  template <bool Mlp, typename A, typename S>
  static void reset_state(const ttt_shape& s, const ttt_weights<S>& w, A* state, thread_pool&) {
    reset_state<Mlp, A>(s, w, state);
  }

 private:
  static constexpr std::size_t too_large = std::numeric_limits<std::size_t>::max();

  // One configuration's passes: Mlp, mini-batch mb, state group, S storage, A accumulation.
  template <bool Mlp, std::size_t mb, std::size_t group, typename S, typename A>
  struct pass {
    static constexpr bool widened = !std::is_same_v<S, A>;
    static constexpr A ln_eps = A(1e-6);
    static constexpr std::size_t hidden(const ttt_shape& s) noexcept { return ttt_hidden(s, Mlp); }
    static constexpr std::size_t inner_elements(const ttt_shape& s) noexcept {
      return ttt_inner_elements(s, Mlp);
    }
    static constexpr std::size_t mini_batches(const ttt_shape& s) noexcept {
      return ttt_mini_batches(s, mb);
    }
    static constexpr std::size_t saved_states(const ttt_shape& s) noexcept {
      return ttt_saved_states(s, mb, group);
    }

    static void forward(const ttt_shape& s, const ttt_weights<S>& w, const S* x, S* y, A* ckpt,
                        S* o_s, void* workspace, std::size_t workspace_size, thread_pool& ex) {
      const std::size_t threads = ex.size();
      const auto ws = carve(forward_layout(s, threads), workspace, workspace_size);
      const std::size_t N = rows(s), C = s.width;
      const wptrs wa = widen_weights(s, w, ws.template get<A>(f_w));
      const A* xa = cpu::widen_or_alias(x, N * C, ws.template get<A>(f_x));
      A* q = ws.template get<A>(f_q);
      A* k = ws.template get<A>(f_k);
      A* v = ws.template get<A>(f_v);
      A* lr = ws.template get<A>(f_lr);
      A* sig = ws.template get<A>(f_sig);
      A* tok = ws.template get<A>(f_tok);
      const gemm_ws pk{ws.template get<std::byte>(f_gemm), threads * forward_pack_bytes(s)};
      project(s, xa, wa, q, k, v, lr, sig, tok, ex, pk.span());

      // The inner loop, one task per (b, h); its output rounded through storage into `saved`.
      A* o = cpu::accum_target(o_s, ws.template get<A>(f_o));
      inner_forward(s, q, k, v, lr, tok, wa, o, ckpt,
                    ws.template get<A>(f_scratch), pk, ex);
      if constexpr (widened) {
        cpu::narrow(static_cast<const A*>(o), N * C, o_s);
        cpu::widen(static_cast<const S*>(o_s), N * C, o);
      }
      // Post norm, gate, output projection (pn reuses q's slot).
      A* pn = q;
      post_norm(s, o, wa, pn, nullptr, nullptr, ex);
      if (s.use_gate) {
        A* gpre = k;
        mm(ex, xa, wa.wg, gpre, N, C, C, false, pk.span());
        cpu::for_rows(ex, N, [&](std::size_t n) {
          for (std::size_t j = 0; j < C; ++j) pn[n * C + j] *= gelu(gpre[n * C + j]);
        });
      }
      A* ya = cpu::accum_target(y, ws.template get<A>(f_y));
      mm(ex, static_cast<const A*>(pn), wa.wo, ya, N, C, C, false, pk.span());
      if constexpr (widened) cpu::narrow(static_cast<const A*>(ya), N * C, y);
    }

    static void backward(const ttt_shape& s, const ttt_weights<S>& w, const S* x, const A* ckpt,
                         const S* o_s, const S* dy, S* dx, const ttt_gradients<S>& g,
                         void* workspace, std::size_t workspace_size, thread_pool& ex) {
      const std::size_t threads = ex.size();
      const auto ws = carve(backward_layout(s, threads), workspace, workspace_size);
      const std::size_t N = rows(s), C = s.width, H = s.heads, D = s.head_dim(), B = s.batch;
      const wptrs wa = widen_weights(s, w, ws.template get<A>(b_w));
      const A* xa = cpu::widen_or_alias(x, N * C, ws.template get<A>(b_x));
      A* q = ws.template get<A>(b_q);
      A* k = ws.template get<A>(b_k);
      A* v = ws.template get<A>(b_v);
      A* lr = ws.template get<A>(b_lr);
      A* sig = ws.template get<A>(b_sig);
      A* tok = ws.template get<A>(b_tok);
      const gemm_ws pk{ws.template get<std::byte>(b_gemm), threads * backward_pack_bytes(s)};
      const std::span<std::byte> gs = pk.span();
      project(s, xa, wa, q, k, v, lr, sig, tok, ex, gs);
      const A* o = cpu::widen_or_alias(o_s, N * C,
                                  ws.template get<A>(b_o));
      const A* dya = cpu::widen_or_alias(dy, N * C, ws.template get<A>(b_dy));
      A* tmp = ws.template get<A>(b_wtmp);
      A* dxa = ws.template get<A>(b_dx);

      // Output projection, gate and post norm, backwards. pn: the post norm's output; xh: its x̂.
      A* pn = ws.template get<A>(b_pn);
      A* xh = ws.template get<A>(b_xh);
      A* rsig = ws.template get<A>(b_rsig);
      post_norm(s, o, wa, pn, xh, rsig, ex);
      A* dpn = ws.template get<A>(b_dpn);
      mm_bt(ex, dya, wa.wo, dpn, N, C, C, false, gs);  // dL/d(gated)
      if (s.use_gate) {
        A* gpre = ws.template get<A>(b_gpre);
        mm(ex, xa, wa.wg, gpre, N, C, C, false, gs);
        // gated = pn ⊙ gelu(gpre): dgpre = dgated ⊙ pn ⊙ gelu'(gpre), then dpn = dgated ⊙ gelu.
        cpu::for_rows(ex, N, [&](std::size_t n) {
          for (std::size_t j = 0; j < C; ++j) {
            const std::size_t e = n * C + j;
            const A gl = gelu(gpre[e]), dgated = dpn[e];
            dpn[e] = dgated * gl;
            gpre[e] = dgated * pn[e] * gelu_grad(gpre[e]);  // now dgpre
            pn[e] *= gl;                                     // now the gated value
          }
        });
        cpu::weight_grad(ex, static_cast<const A*>(pn), dya, g.wo, tmp, N, C, C, gs);
        cpu::weight_grad(ex, xa, static_cast<const A*>(gpre), g.wg, tmp, N, C, C, gs);
        mm_bt(ex, static_cast<const A*>(gpre), wa.wg, dxa, N, C, C, false, gs);
      } else {
        cpu::weight_grad(ex, static_cast<const A*>(pn), dya, g.wo, tmp, N, C, C, gs);
        std::fill(dxa, dxa + N * C, A(0));
      }
      // Post norm: pn = x̂ ⊙ post_w + post_b. d(post_w) = Σ dpn ⊙ x̂, d(post_b) = Σ dpn.
      A* small = ws.template get<A>(b_small);
      column_sums_product(ex, static_cast<const A*>(dpn), static_cast<const A*>(xh), N, C, small,
                          small + C);
      cpu::add_grad(small, C, g.post_w);
      cpu::add_grad(small + C, C, g.post_b);
      A* d_o = ws.template get<A>(b_do);
      cpu::for_rows(ex, N, [&](std::size_t n) {
        A* dxh = d_o + n * C;  // dL/dx̂, then dL/do in place
        for (std::size_t j = 0; j < C; ++j) dxh[j] = dpn[n * C + j] * wa.post_w[j];
        A tmp_row_m1 = 0, tmp_row_m2 = 0;
        for (std::size_t j = 0; j < C; ++j) {
          tmp_row_m1 += dxh[j];
          tmp_row_m2 += dxh[j] * xh[n * C + j];
        }
        tmp_row_m1 /= static_cast<A>(C);
        tmp_row_m2 /= static_cast<A>(C);
        for (std::size_t j = 0; j < C; ++j)
          dxh[j] = (dxh[j] - tmp_row_m1 - xh[n * C + j] * tmp_row_m2) / rsig[n];
      });

      // The inner loop backwards: dq, dk, dv, dlr and per-(b, h) partial parameter gradients.
      A* dq = ws.template get<A>(b_dq);
      A* dk = ws.template get<A>(b_dk);
      A* dv = ws.template get<A>(b_dv);
      A* dlr = ws.template get<A>(b_dlr);
      A* part = ws.template get<A>(b_part);
      inner_backward(s, q, k, v, lr, tok, wa, ckpt, d_o, dq, dk, dv, dlr,
                     part, ws.template get<A>(b_scratch), pk, ex);

      // Partials summed over the batch in order: the inner state per head, then γ, β per head,
      // then the token offsets per head.
      const std::size_t per = part_elements(s), SZ = inner_elements(s), F = hidden(s);
      A* sum = small;  // [per]
      for (std::size_t j = 0; j < per; ++j) {
        A acc = 0;
        for (std::size_t b = 0; b < B; ++b) acc += part[b * per + j];
        sum[j] = acc;
      }
      for (std::size_t h = 0; h < H; ++h) {
        const A* ph = sum + h * SZ;
        cpu::add_grad(ph, D * F, g.w1 + h * D * F);
        cpu::add_grad(ph + D * F, F, g.b1 + h * F);
        if constexpr (Mlp) {
          cpu::add_grad(ph + D * F + F, F * D, g.w2 + h * F * D);
          cpu::add_grad(ph + 2 * D * F + F, D, g.b2 + h * D);
        }
      }
      cpu::add_grad(sum + H * SZ, H * D, g.ttt_norm_w);
      cpu::add_grad(sum + H * SZ + H * D, H * D, g.ttt_norm_b);
      A* dtok = sum + H * SZ + 2 * H * D;  // [H, mb]: summed over heads, masked by the clamp
      for (std::size_t i = 0; i < mb; ++i) {
        A acc = 0;
        for (std::size_t h = 0; h < H; ++h) acc += dtok[h * mb + i];
        const A raw = A(1) / static_cast<A>(i + 1) + wa.tok_offset[i];
        dtok[i] = raw > A(0) ? acc : A(0);  // clamp_min(·, 0): no gradient where clamped
      }
      cpu::add_grad(dtok, mb, g.tok_offset);

      // The learning-rate gate: lr = base·σ(pre)/D, so dpre = dlr · lr · (1 − σ).
      cpu::for_rows(ex, N, [&](std::size_t n) {
        for (std::size_t h = 0; h < H; ++h) dlr[n * H + h] *= lr[n * H + h] * (A(1) - sig[n * H + h]);
      });
      if constexpr (widened) {
        cpu::matmul_at(ex, static_cast<const A*>(dlr), xa, tmp, N, H, C, false,
                       cpu::ld3{H, C, C}, gs);
        cpu::narrow_add(static_cast<const A*>(tmp), H * C, g.lr_w);
      } else {
        cpu::matmul_at(ex, static_cast<const A*>(dlr), xa, g.lr_w, N, H, C, true,
                       cpu::ld3{H, C, C}, gs);
      }
      column_sums_product(ex, static_cast<const A*>(dlr), static_cast<const A*>(nullptr), N, H,
                          sum, nullptr);
      cpu::add_grad(sum, H, g.lr_b);
      mm(ex, static_cast<const A*>(dlr), wa.lr_w, dxa, N, H, C, true, gs);

      // RoPE's transpose, then the projections.
      cpu::rope_pairs(ex, dq, N, s.seq, H, D, s.rope_base, mb, true, s.packing());
      cpu::rope_pairs(ex, dk, N, s.seq, H, D, s.rope_base, mb, true, s.packing());
      cpu::weight_grad(ex, xa, static_cast<const A*>(dq), g.wq, tmp, N, C, C, gs);
      cpu::weight_grad(ex, xa, static_cast<const A*>(dk), g.wk, tmp, N, C, C, gs);
      cpu::weight_grad(ex, xa, static_cast<const A*>(dv), g.wv, tmp, N, C, C, gs);
      mm_bt(ex, static_cast<const A*>(dq), wa.wq, dxa, N, C, C, true, gs);
      mm_bt(ex, static_cast<const A*>(dk), wa.wk, dxa, N, C, C, true, gs);
      mm_bt(ex, static_cast<const A*>(dv), wa.wv, dxa, N, C, C, true, gs);
      cpu::narrow(static_cast<const A*>(dxa), N * C, dx);
    }

    static void step(const ttt_shape& s, const ttt_weights<S>& w, A* state, std::size_t i,
                     const S* x_t, S* y_t, void* workspace, std::size_t workspace_size,
                     thread_pool& ex) {
      ttt_shape one = s;
      one.seq = 1;
      const auto ws = carve(forward_layout(one, 1, true), workspace, workspace_size);
      const std::size_t B = s.batch, C = s.width, H = s.heads, D = s.head_dim();
      const wptrs wa = widen_weights(s, w, ws.template get<A>(f_w));
      const A* xa = cpu::widen_or_alias(x_t, B * C, ws.template get<A>(f_x));
      A* q = ws.template get<A>(f_q);
      A* k = ws.template get<A>(f_k);
      A* v = ws.template get<A>(f_v);
      A* lr = ws.template get<A>(f_lr);
      A* sig = ws.template get<A>(f_sig);
      A* tok = ws.template get<A>(f_tok);
      // The forward's GEMM: the projections' packing buffers per task; the inner loop's one-row
      // products (GEMVs) use none.
      const std::span<std::byte> gs{ws.template get<std::byte>(f_gemm), step_pack_bytes(s)};
      const packing pk{gs, cpu::scratch_slots::per_task};
      const cpu::gemm_scratch inner_pk{};
      project(one, xa, wa, q, k, v, lr, sig, tok, ex, pk, i);
      A* o = ws.template get<A>(f_o);
      A* scratch = ws.template get<A>(f_scratch);
      const std::size_t SZ = inner_elements(s), F = hidden(s);
      A* weff = scratch;  // the token's effective inner state, W − tok_i·Σ
      const mb_buffers sc = carve_mb(weff + SZ, D, F, 1, false);
      for (std::size_t b = 0; b < B; ++b)
        for (std::size_t h = 0; h < H; ++h) {
          A* W = state + (b * H + h) * 2 * SZ;
          A* Gs = W + SZ;
          const A lr_t = lr[b * H + h];
          const cpu::ttt_minibatch<A> m{q + b * C + h * D, k + b * C + h * D, v + b * C + h * D, 1,
                                        D, C, &lr_t, tok, wa.ttt_norm_w + h * D,
                                        wa.ttt_norm_b + h * D, ln_eps};
          // This token's inner gradients at the mini-batch's starting state, added to the sums.
          mb_forward(m, W, sc, false, inner_pk);
          const ilayout L = layout_of(D, F);
          accumulate_outer(m.k, D, F, first_grad(sc), lr_t, Gs + L.w1, Gs + L.b1);
          if constexpr (Mlp) accumulate_outer(sc.x2, F, D, sc.g2, lr_t, Gs + L.w2, Gs + L.b2);
          for (std::size_t e = 0; e < SZ; ++e) weff[e] = W[e] - tok[i] * Gs[e];
          // The output through the effective state (the dual form's row i).
          if constexpr (Mlp) {
            cpu::ttt_linear_rows(m.q, C, 1, D, F, weff + L.w1, weff + L.b1, sc.z1b, inner_pk);
            for (std::size_t j = 0; j < F; ++j) sc.x2b[j] = cpu::gelu_tanh<A>::f(sc.z1b[j]);
            cpu::ttt_linear_rows(static_cast<const A*>(sc.x2b), F, 1, F, D, weff + L.w2,
                                 weff + L.b2, sc.zb, inner_pk);
          } else {
            cpu::ttt_linear_rows(m.q, C, 1, D, D, weff + L.w1, weff + L.b1, sc.zb, inner_pk);
          }
          cpu::ln_row(sc.zb, D, ln_eps, sc.xhb);
          for (std::size_t c = 0; c < D; ++c)
            o[b * C + h * D + c] =
                m.q[c] + wa.ttt_norm_w[h * D + c] * sc.xhb[c] + wa.ttt_norm_b[h * D + c];
          if (i == mb - 1) {  // the mini-batch ends: its last state starts the next
            std::copy(weff, weff + SZ, W);
            std::fill(Gs, Gs + SZ, A(0));
          }
        }
      if constexpr (widened) {  // as forward: the heads' output is rounded through storage
        for (std::size_t e = 0; e < B * C; ++e) o[e] = to_accum<A>(from_accum<S>(o[e]));
      }
      A* pn = q;
      post_norm(one, o, wa, pn, nullptr, nullptr, ex);
      if (s.use_gate) {
        mm(ex, xa, wa.wg, k, B, C, C, false, pk);
        for (std::size_t e = 0; e < B * C; ++e) pn[e] *= gelu(k[e]);
      }
      A* ya = cpu::accum_target(y_t, ws.template get<A>(f_y));
      mm(ex, static_cast<const A*>(pn), wa.wo, ya, B, C, C, false, pk);
      if constexpr (widened) cpu::narrow(static_cast<const A*>(ya), B * C, y_t);
    }

    static constexpr std::size_t rows(const ttt_shape& s) noexcept { return s.batch * s.seq; }
    static constexpr std::size_t wide(const ttt_shape& s) noexcept {
      return bytes_of<A>(rows(s), s.width);
    }
    static constexpr std::size_t w_acc_bytes(const ttt_shape& s) noexcept {
      return widened ? bytes_of<A>(ttt_weight_elements(s, Mlp, mb)) : 0;
    }
    static constexpr std::size_t io_acc_bytes(const ttt_shape& s) noexcept {
      return widened ? wide(s) : 0;
    }
    static constexpr std::size_t group_in_use(const ttt_shape& s) noexcept {
      return std::min(group, mini_batches(s));
    }
    // Per thread: forward, one mini-batch's buffers plus the running state; backward, the group's
    // entering states, the state's gradient, the running state and the buffers with gradients.
    static constexpr std::size_t task_scratch(const ttt_shape& s, std::size_t threads,
                                              bool backward) noexcept {
      const std::size_t SZ = inner_elements(s), D = s.head_dim(), F = hidden(s);
      const std::size_t per = backward ? (group_in_use(s) + 2) * SZ + mb_elements(D, F, mb, true)
                                       : SZ + mb_elements(D, F, mb, false);
      return bytes_of<A>(threads, per);
    }
    // Per batch row: the inner state's gradient [H, inner_elements], dγ, dβ [H, D], dtok [H, mb].
    static constexpr std::size_t part_elements(const ttt_shape& s) noexcept {
      const std::size_t H = s.heads, D = s.head_dim();
      return H * inner_elements(s) + 2 * H * D + H * mb;
    }
    static constexpr std::size_t partial_bytes(const ttt_shape& s) noexcept {
      return bytes_of<A>(s.batch, part_elements(s));
    }
    // Packing bytes per thread (backend/cpu/gemm.hpp's gemm with the caller's buffers), one slot shared by
    // every product of a pass: the projections' tasks and the inner loop's (b, h) tasks each use
    // their thread's slice.
    static constexpr std::size_t forward_pack_bytes(const ttt_shape& s) noexcept {
      const std::size_t N = rows(s), C = s.width, H = s.heads;
      return std::max({cpu::matmul_thread_scratch_bytes<A>(N, C, C),  // q, k, v, gate, output
                       cpu::matmul_thread_scratch_bytes<A>(N, C, H),  // the rates' pre-activation
                       cpu::ttt_inner_gemm_bytes<A>(s.head_dim(), hidden(s), mb)});
    }
    static constexpr std::size_t backward_pack_bytes(const ttt_shape& s) noexcept {
      const std::size_t N = rows(s), C = s.width, H = s.heads;
      return std::max({forward_pack_bytes(s),
                       cpu::matmul_at_thread_scratch_bytes<A>(N, C, C),  // d wq, wk, wv, wg, wo
                       cpu::matmul_at_thread_scratch_bytes<A>(N, H, C),  // d lr_w
                       cpu::matmul_thread_scratch_bytes<A>(N, H, C)});   // dx from the rates
    }
    // Decoding's packing bytes, which take no thread count: one set per 256-row task of the
    // projections (one for B <= 256; none for B = 1, a GEMV). The inner loop's products are one
    // row each, GEMVs too, so they pack nothing.
    static constexpr std::size_t step_pack_bytes(const ttt_shape& s) noexcept {
      const std::size_t B = s.batch, C = s.width, H = s.heads;
      return std::max(cpu::matmul_task_scratch_bytes<A>(B, C, C),   // q, k, v, gate, output
                      cpu::matmul_task_scratch_bytes<A>(B, C, H));  // the rates' pre-activation
    }
    struct gemm_ws {
      std::byte* data;
      std::size_t bytes;  // threads · the per-thread bytes
      std::span<std::byte> span() const noexcept { return {data, bytes}; }
      // Thread t's slice for the inner loop's products.
      cpu::gemm_scratch of(std::size_t t, std::size_t threads) const noexcept {
        const std::size_t per = bytes / threads;
        return {data + t * per, per};
      }
    };

    // Phases: 0 projections, 1 inner loop, 2 post norm, gate and output projection.
    enum forward_slot : std::size_t {
      f_w, f_x, f_q, f_k, f_v, f_lr, f_sig, f_tok, f_scratch, f_o, f_y, f_gemm
    };
    // Decoding computes the heads' output in the workspace even when it is the accumulator type
    // (forward writes it straight into `saved`), and sizes its packing buffers per task.
    static constexpr workspace_layout<12> forward_layout(const ttt_shape& s, std::size_t threads,
                                                         bool decoding = false) {
      const std::size_t N = rows(s), H = s.heads;
      workspace_layout<12> l;
      l.add(w_acc_bytes(s), default_alignment, {0, 2});
      l.add(io_acc_bytes(s), default_alignment, {0, 2});
      l.add(wide(s), default_alignment, {0, 2});
      l.add(wide(s), default_alignment, {0, 2});
      l.add(wide(s), default_alignment, {0, 1});
      l.add(bytes_of<A>(N, H), default_alignment, {0, 1});
      l.add(bytes_of<A>(N, H), default_alignment, {0, 1});
      l.add(bytes_of<A>(mb), default_alignment, {0, 1});
      l.add(task_scratch(s, threads, false), default_alignment, {1, 1});
      l.add(decoding ? wide(s) : io_acc_bytes(s), default_alignment, {1, 2});
      l.add(io_acc_bytes(s), default_alignment, {2, 2});
      l.add(decoding ? step_pack_bytes(s) : bytes_of<std::byte>(threads, forward_pack_bytes(s)),
            default_alignment, {0, 2});
      return l;
    }

    // Phases: 0 projections, post norm and gate backwards; 1 inner loop backwards; 2 gradients
    // of the learning-rate gate and the projections, dx.
    enum backward_slot : std::size_t {
      b_w, b_x, b_q, b_k, b_v, b_lr, b_sig, b_tok, b_o, b_dy, b_pn, b_xh, b_rsig, b_dpn, b_gpre,
      b_small, b_do, b_dq, b_dk, b_dv, b_dlr, b_part, b_scratch, b_wtmp, b_dx, b_gemm
    };
    static constexpr workspace_layout<26> backward_layout(const ttt_shape& s, std::size_t threads) {
      const std::size_t N = rows(s), H = s.heads, C = s.width;
      workspace_layout<26> l;
      l.add(w_acc_bytes(s), default_alignment, {0, 2});
      l.add(io_acc_bytes(s), default_alignment, {0, 2});
      l.add(wide(s), default_alignment, {0, 1});  // q
      l.add(wide(s), default_alignment, {0, 1});  // k
      l.add(wide(s), default_alignment, {0, 1});  // v
      l.add(bytes_of<A>(N, H), default_alignment, {0, 2});
      l.add(bytes_of<A>(N, H), default_alignment, {0, 2});
      l.add(bytes_of<A>(mb), default_alignment, {0, 2});
      l.add(io_acc_bytes(s), default_alignment, {0, 0});  // o widened
      l.add(io_acc_bytes(s), default_alignment, {0, 0});  // dy widened
      l.add(wide(s), default_alignment, {0, 0});          // pn
      l.add(wide(s), default_alignment, {0, 0});          // x̂
      l.add(bytes_of<A>(N), default_alignment, {0, 0});   // σ per row
      l.add(wide(s), default_alignment, {0, 0});          // dpn
      l.add(s.use_gate ? wide(s) : 0, default_alignment, {0, 0});
      l.add(bytes_of<A>(std::max(2 * C, part_elements(s))), default_alignment, {0, 2});
      l.add(wide(s), default_alignment, {0, 1});          // d(o)
      l.add(wide(s), default_alignment, {1, 2});          // dq
      l.add(wide(s), default_alignment, {1, 2});          // dk
      l.add(wide(s), default_alignment, {1, 2});          // dv
      l.add(bytes_of<A>(N, H), default_alignment, {1, 2});
      l.add(partial_bytes(s), default_alignment, {1, 2});
      l.add(task_scratch(s, threads, true), default_alignment, {1, 1});
      l.add(widened ? bytes_of<A>(std::max(C * C, H * C)) : 0, default_alignment, {0, 2});
      l.add(wide(s), default_alignment, {0, 2});          // dx in A
      l.add(bytes_of<std::byte>(threads, backward_pack_bytes(s)), default_alignment, {0, 2});
      return l;
    }

    // ---- Helpers -------------------------------------------------------------------------------
    static A gelu(A v) { return cpu::gelu_tanh<A>::f(v); }  // the gate's, as upstream's
    static A gelu_grad(A v) { return cpu::gelu_tanh<A>::d1(v); }

    struct wptrs {
      const A *wq, *wk, *wv, *ttt_norm_w, *ttt_norm_b, *w1, *b1, *lr_w, *lr_b, *tok_offset, *post_w,
          *post_b, *wg, *wo, *w2, *b2;
    };
    static wptrs widen_weights(const ttt_shape& s, const ttt_weights<S>& w, A* slot) {
      if constexpr (widened) {
        const std::size_t C = s.width, H = s.heads, D = s.head_dim(), F = hidden(s);
        A* p = slot;
        const auto take = [&](const S* src, std::size_t n) -> const A* {
          if (src == nullptr) return nullptr;
          cpu::widen(src, n, p);
          const A* out = p;
          p += n;
          return out;
        };
        wptrs r;
        r.wq = take(w.wq, C * C);
        r.wk = take(w.wk, C * C);
        r.wv = take(w.wv, C * C);
        r.ttt_norm_w = take(w.ttt_norm_w, H * D);
        r.ttt_norm_b = take(w.ttt_norm_b, H * D);
        r.w1 = take(w.w1, H * D * F);
        r.b1 = take(w.b1, H * F);
        r.lr_w = take(w.lr_w, H * C);
        r.lr_b = take(w.lr_b, H);
        r.tok_offset = take(w.tok_offset, mb);
        r.post_w = take(w.post_w, C);
        r.post_b = take(w.post_b, C);
        r.wg = s.use_gate ? take(w.wg, C * C) : nullptr;
        r.wo = take(w.wo, C * C);
        r.w2 = Mlp ? take(w.w2, H * F * D) : nullptr;
        r.b2 = Mlp ? take(w.b2, H * D) : nullptr;
        return r;
      } else {
        (void)s;
        (void)slot;
        return {w.wq, w.wk, w.wv, w.ttt_norm_w, w.ttt_norm_b, w.w1, w.b1, w.lr_w, w.lr_b,
                w.tok_offset, w.post_w, w.post_b, w.wg, w.wo, w.w2, w.b2};
      }
    }
    // The packing buffers of the projections: training passes index them by thread (threads · the
    // per-thread bytes of *_pack_bytes), decoding by task (step_pack_bytes).
    struct packing {
      std::span<std::byte> bytes;
      cpu::scratch_slots slots = cpu::scratch_slots::per_thread;
      packing(std::span<std::byte> b, cpu::scratch_slots s = cpu::scratch_slots::per_thread)
          : bytes(b), slots(s) {}
    };
    // y[N, M] (+)= x[N, K]·w (mm) or x·wᵀ (mm_bt, w [M, K]).
    static void mm(thread_pool& ex, const A* x, const A* w, A* y, std::size_t N, std::size_t K,
                   std::size_t M, bool accumulate, packing pk) {
      cpu::matmul(ex, x, w, y, N, K, M, accumulate, cpu::ld3{K, M, M}, pk.bytes, pk.slots);
    }
    static void mm_bt(thread_pool& ex, const A* x, const A* w, A* y, std::size_t N, std::size_t K,
                      std::size_t M, bool accumulate, packing pk) {
      cpu::matmul_bt(ex, x, w, y, N, K, M, accumulate, cpu::ld3{K, K, M}, pk.bytes, pk.slots);
    }

    // q, k, v (RoPE'd), lr = base·σ(pre)/D and σ itself [N, H], and the clamped token scales.
    // `position0` offsets the position inside the mini-batch (decoding).
    static void project(const ttt_shape& s, const A* xa, const wptrs& wa, A* q, A* k, A* v, A* lr,
                        A* sig, A* tok, thread_pool& ex, packing pk,
                        std::size_t position0 = 0) {
      const std::size_t N = rows(s), C = s.width, H = s.heads, D = s.head_dim();
      mm(ex, xa, wa.wq, q, N, C, C, false, pk);
      mm(ex, xa, wa.wk, k, N, C, C, false, pk);
      mm(ex, xa, wa.wv, v, N, C, C, false, pk);
      if (position0 == 0) {
        cpu::rope_pairs(ex, q, N, s.seq, H, D, s.rope_base, mb, false, s.packing());
        cpu::rope_pairs(ex, k, N, s.seq, H, D, s.rope_base, mb, false, s.packing());
      } else {  // one token per row at position position0 (seq is 1 here)
        rope_at(q, N, H, D, s.rope_base, position0);
        rope_at(k, N, H, D, s.rope_base, position0);
      }
      mm_bt(ex, xa, wa.lr_w, sig, N, C, H, false, pk);
      const A scale = static_cast<A>(s.base_lr / static_cast<double>(D));
      for (std::size_t n = 0; n < N; ++n)
        for (std::size_t h = 0; h < H; ++h) {
          A& e = sig[n * H + h];
          e = A(1) / (A(1) + std::exp(-(e + wa.lr_b[h])));
          lr[n * H + h] = scale * e;
        }
      for (std::size_t i = 0; i < mb; ++i)
        tok[i] = std::max(A(0), A(1) / static_cast<A>(i + 1) + wa.tok_offset[i]);
    }
    static void rope_at(A* x, std::size_t N, std::size_t H, std::size_t D, double base,
                        std::size_t position) {
      for (std::size_t n = 0; n < N; ++n)
        for (std::size_t i = 0; i < D / 2; ++i) {
          const double inv_freq = std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(D));
          const double angle = static_cast<double>(position) * inv_freq;
          const A c = static_cast<A>(std::cos(angle)), sn = static_cast<A>(std::sin(angle));
          for (std::size_t h = 0; h < H; ++h) {
            A* p = x + n * H * D + h * D + 2 * i;
            const A x1 = p[0], x2 = p[1];
            p[0] = x1 * c - x2 * sn;
            p[1] = x2 * c + x1 * sn;
          }
        }
    }

    // pn = LN_C(o)·post_w + post_b; keeps x̂ and σ per row when asked (backward).
    static void post_norm(const ttt_shape& s, const A* o, const wptrs& wa, A* pn, A* xh, A* rsig,
                          thread_pool& ex) {
      const std::size_t N = rows(s), C = s.width;
      cpu::for_rows(ex, N, [&](std::size_t n) {
        A* dst = xh ? xh + n * C : pn + n * C;
        const A sg = cpu::ln_row(o + n * C, C, ln_eps, dst);
        if (rsig) rsig[n] = sg;
        for (std::size_t j = 0; j < C; ++j) pn[n * C + j] = dst[j] * wa.post_w[j] + wa.post_b[j];
      });
    }

    // ---- One mini-batch ------------------------------------------------------------------------
    // Offsets inside an inner state: W1 [D, F], b1 [F], W2 [F, D], b2 [D].
    struct ilayout {
      std::size_t w1, b1, w2, b2;
    };
    static constexpr ilayout layout_of(std::size_t D, std::size_t F) noexcept {
      return {0, D * F, D * F + F, D * F + F + F * D};
    }
    static void load_initial(const ttt_shape& s, const ttt_weights<S>& w, std::size_t h, A* dst) {
      const std::size_t D = s.head_dim(), F = hidden(s);
      const ilayout L = layout_of(D, F);
      cpu::widen(w.w1 + h * D * F, D * F, dst + L.w1);
      cpu::widen(w.b1 + h * F, F, dst + L.b1);
      if constexpr (Mlp) {
        cpu::widen(w.w2 + h * F * D, F * D, dst + L.w2);
        cpu::widen(w.b2 + h * D, D, dst + L.b2);
      }
    }

    // A mini-batch's buffers ([K ≤ mb] rows each); the second group only in backward.
    struct mb_buffers {
      A *z1, *x2, *g1, *z2, *xh2, *g2, *sig2, *att1, *p1, *z1b, *x2b, *att2, *p2, *zb, *xhb, *sigb,
          *eg, *lrm;
      A *dzb, *dx2b, *dz1b, *dg1, *dg2, *dx2, *dz1, *dz2, *s1, *s2, *dp1, *dp2, *de, *dl, *rowd;
    };
    static constexpr std::size_t mb_elements(std::size_t D, std::size_t F, std::size_t m,
                                             bool backward) noexcept {
      const std::size_t fwd = 6 * m * F + 5 * m * D + 4 * m * m + 3 * m;
      return backward ? fwd + 7 * m * F + 3 * m * D + 2 * m * m + 2 * m + 3 * D : fwd;
    }
    static mb_buffers carve_mb(A* p, std::size_t D, std::size_t F, std::size_t m, bool backward) {
      mb_buffers b{};
      const auto take = [&](std::size_t n) {
        A* r = p;
        p += n;
        return r;
      };
      b.z1 = take(m * F);
      b.x2 = take(m * F);
      b.g1 = take(m * F);
      b.z1b = take(m * F);
      b.x2b = take(m * F);
      b.eg = take(m * F);
      b.z2 = take(m * D);
      b.xh2 = take(m * D);
      b.g2 = take(m * D);
      b.zb = take(m * D);
      b.xhb = take(m * D);
      b.att1 = take(m * m);
      b.p1 = take(m * m);
      b.att2 = take(m * m);
      b.p2 = take(m * m);
      b.sig2 = take(m);
      b.sigb = take(m);
      b.lrm = take(m);
      if (backward) {
        b.dx2b = take(m * F);
        b.dz1b = take(m * F);
        b.dg1 = take(m * F);
        b.dx2 = take(m * F);
        b.dz1 = take(m * F);
        b.s1 = take(m * F);
        b.s2 = take(m * F);
        b.dzb = take(m * D);
        b.dg2 = take(m * D);
        b.dz2 = take(m * D);
        b.dp1 = take(m * m);
        b.dp2 = take(m * m);
        b.de = take(m);
        b.dl = take(m);
        b.rowd = take(3 * D);
      }
      return b;
    }
    // The gradient the first layer's update uses: G1 (MLP) or the only layer's G (Linear, in g2).
    static A* first_grad(const mb_buffers& b) { return Mlp ? b.g1 : b.g2; }

    // The inner gradients at state W (and, with need_out, Zbar of the output rows).
    static void mb_forward(const cpu::ttt_minibatch<A>& m, const A* W, const mb_buffers& b,
                           bool need_out, cpu::gemm_scratch pk) {
      const std::size_t K = m.K, D = m.D, F = Mlp ? 4 * D : D;
      const ilayout L = layout_of(D, F);
      if constexpr (Mlp) {
        cpu::ttt_linear_rows(m.k, m.ld, K, D, F, W + L.w1, W + L.b1, b.z1, pk);
        for (std::size_t e = 0; e < K * F; ++e) b.x2[e] = cpu::gelu_tanh<A>::f(b.z1[e]);
        cpu::ttt_linear_rows(static_cast<const A*>(b.x2), F, K, F, D, W + L.w2, W + L.b2, b.z2, pk);
        cpu::ttt_ln_l2(m, static_cast<const A*>(b.z2), b.xh2, b.sig2, b.g2);
        // G1 = (G2·W2ᵀ) ⊙ GELU'(Z1)
        auto G1 = cpu::view(b.g1, K, F, F);
        cpu::gemm(G1, cpu::cview(static_cast<const A*>(b.g2), K, D, D),
                  cpu::cview(W + L.w2, F, D, D).transpose(), A(1), false, pk);
        for (std::size_t e = 0; e < K * F; ++e) b.g1[e] *= cpu::gelu_tanh<A>::d1(b.z1[e]);
        if (!need_out) return;
        cpu::ttt_p_matrix(m.q, m.ld, m.k, m.ld, K, D, m.tok, m.lr, b.att1, b.p1, pk);
        cpu::ttt_dual_rows(m.q, m.ld, K, D, F, W + L.w1, W + L.b1, b.p1, b.g1, b.z1b, pk);
        for (std::size_t e = 0; e < K * F; ++e) b.x2b[e] = cpu::gelu_tanh<A>::f(b.z1b[e]);
        cpu::ttt_p_matrix(static_cast<const A*>(b.x2b), F, static_cast<const A*>(b.x2), F, K, F,
                          m.tok, m.lr, b.att2, b.p2, pk);
        cpu::ttt_dual_rows(static_cast<const A*>(b.x2b), F, K, F, D, W + L.w2, W + L.b2, b.p2,
                           b.g2, b.zb, pk);
      } else {
        cpu::ttt_linear_rows(m.k, m.ld, K, D, D, W + L.w1, W + L.b1, b.z2, pk);
        cpu::ttt_ln_l2(m, static_cast<const A*>(b.z2), b.xh2, b.sig2, b.g2);
        if (!need_out) return;
        cpu::ttt_p_matrix(m.q, m.ld, m.k, m.ld, K, D, m.tok, m.lr, b.att1, b.p1, pk);
        cpu::ttt_dual_rows(m.q, m.ld, K, D, D, W + L.w1, W + L.b1, b.p1, b.g2, b.zb, pk);
      }
    }
    // The state's update at the mini-batch's end (gradients from mb_forward).
    static void mb_update(const cpu::ttt_minibatch<A>& m, A* W, const mb_buffers& b,
                          cpu::gemm_scratch pk) {
      const std::size_t K = m.K, D = m.D, F = Mlp ? 4 * D : D;
      const ilayout L = layout_of(D, F);
      const A tl = m.tok[K - 1];
      cpu::ttt_update(m.k, m.ld, K, D, F, static_cast<const A*>(first_grad(b)), tl, m.lr, W + L.w1,
                      W + L.b1, b.eg, pk);
      if constexpr (Mlp) {
        cpu::ttt_update(static_cast<const A*>(b.x2), F, K, F, D, static_cast<const A*>(b.g2), tl,
                        m.lr, W + L.w2, W + L.b2, b.eg, pk);
      }
    }
    // Gw += lr·xᵀ·g and gb += lr·g for one row (decoding's running sums).
    static void accumulate_outer(const A* x, std::size_t nin, std::size_t nout, const A* g, A lr,
                                 A* Gw, A* gb) {
      for (std::size_t a = 0; a < nin; ++a)
        for (std::size_t c = 0; c < nout; ++c) Gw[a * nout + c] += lr * x[a] * g[c];
      for (std::size_t c = 0; c < nout; ++c) gb[c] += lr * g[c];
    }

    // ---- The inner loop --------------------------------------------------------------------------
    // The sequences of a batch row, as token ranges of the row: the whole row, or under packed
    // sequences (batch 1) each [offsets[q], offsets[q + 1]). Each restarts the inner state from
    // the weights and cuts its own mini-batches, and keeps states_of(its length) saved states, in
    // order, from slot 0 of its (b, h).
    struct token_range {
      std::size_t begin, end;
    };
    static std::size_t sequence_count(const ttt_shape& s) noexcept {
      return s.packing().packed() ? s.sequences : 1;
    }
    static token_range sequence(const ttt_shape& s, std::size_t q) noexcept {
      if (!s.packing().packed()) return {0, s.seq};
      return {static_cast<std::size_t>(s.offsets[q]), static_cast<std::size_t>(s.offsets[q + 1])};
    }
    static constexpr std::size_t states_of(std::size_t tokens) noexcept {
      return tokens == 0 ? 0 : (tokens - 1) / mb / group + 1;  // ceil(ceil(L / b) / G)
    }
    static cpu::ttt_minibatch<A> minibatch(const ttt_shape& s, const A* q, const A* k, const A* v,
                                           const A* lr_row, const A* tok, const wptrs& wa,
                                           std::size_t b, std::size_t h, std::size_t t0,
                                           std::size_t K) {
      const std::size_t C = s.width, D = s.head_dim();
      const std::size_t r = (b * s.seq + t0) * C + h * D;
      return cpu::ttt_minibatch<A>{q + r, k + r, v + r, K, D, C, lr_row, tok,
                                   wa.ttt_norm_w + h * D, wa.ttt_norm_b + h * D, ln_eps};
    }
    // The mini-batch's rates, gathered contiguous: lr[(b·T + t0 + s)·H + h].
    static void gather_lr(const ttt_shape& s, const A* lr, std::size_t b, std::size_t h,
                          std::size_t t0, std::size_t K, A* out) {
      for (std::size_t i = 0; i < K; ++i) out[i] = lr[(b * s.seq + t0 + i) * s.heads + h];
    }
    static A* initial_state(const ttt_shape& s, const wptrs& wa, std::size_t h, A* dst) {
      const std::size_t D = s.head_dim(), F = hidden(s);
      const ilayout L = layout_of(D, F);
      std::copy(wa.w1 + h * D * F, wa.w1 + (h + 1) * D * F, dst + L.w1);
      std::copy(wa.b1 + h * F, wa.b1 + (h + 1) * F, dst + L.b1);
      if constexpr (Mlp) {
        std::copy(wa.w2 + h * F * D, wa.w2 + (h + 1) * F * D, dst + L.w2);
        std::copy(wa.b2 + h * D, wa.b2 + (h + 1) * D, dst + L.b2);
      }
      return dst;
    }

    static void inner_forward(const ttt_shape& s, const A* q, const A* k, const A* v, const A* lr,
                              const A* tok, const wptrs& wa, A* o, A* ckpt, A* scratch,
                              const gemm_ws& gw, thread_pool& ex) {
      const std::size_t H = s.heads, D = s.head_dim(), F = hidden(s), C = s.width;
      const std::size_t ncp = saved_states(s), SZ = inner_elements(s);
      const std::size_t per = SZ + mb_elements(D, F, mb, false);
      ex.parallel_for(s.batch * H, [&](std::size_t task, std::size_t thread) {
        const std::size_t b = task / H, h = task % H;
        A* W = scratch + thread * per;
        const mb_buffers sc = carve_mb(W + SZ, D, F, mb, false);
        const cpu::gemm_scratch pk = gw.of(thread, ex.size());
        A* saved = ckpt + task * ncp * SZ;  // this (b, h)'s states, every sequence's in order
        for (std::size_t sq = 0; sq < sequence_count(s); ++sq) {
          const token_range r = sequence(s, sq);
          initial_state(s, wa, h, W);
          for (std::size_t m = 0, t0 = r.begin; t0 < r.end; ++m, t0 += mb) {
            if (m % group == 0) saved = std::copy(W, W + SZ, saved);
            const std::size_t K = std::min(mb, r.end - t0);
            gather_lr(s, lr, b, h, t0, K, sc.lrm);
            const auto mbt = minibatch(s, q, k, v, sc.lrm, tok, wa, b, h, t0, K);
            mb_forward(mbt, W, sc, true, pk);
            for (std::size_t i = 0; i < K; ++i) {
              cpu::ln_row(sc.zb + i * D, D, ln_eps, sc.xhb);
              A* out = o + (b * s.seq + t0 + i) * C + h * D;
              const A* qr = mbt.q + i * C;
              for (std::size_t j = 0; j < D; ++j) out[j] = qr[j] + mbt.gamma[j] * sc.xhb[j] + mbt.beta[j];
            }
            mb_update(mbt, W, sc, pk);
          }
        }
      });
    }

    // dX += dZ·Wᵀ, dW += Xᵀ·dZ, db += Σ dZ for Z = X·W + b (X [K, nin] stride ldx).
    static void linear_rows_backward(const A* x, std::size_t ldx, std::size_t K, std::size_t nin,
                                     std::size_t nout, const A* W, const A* dz, A* dx,
                                     std::size_t lddx, A* dW, A* db, cpu::gemm_scratch pk) {
      const auto dZ = cpu::cview(dz, K, nout, nout);
      auto dX = cpu::view(dx, K, nin, lddx);
      cpu::gemm(dX, dZ, cpu::cview(W, nin, nout, nout).transpose(), A(1), true, pk);
      auto dWm = cpu::view(dW, nin, nout, nout);
      cpu::gemm(dWm, cpu::cview(x, K, nin, ldx).transpose(), dZ, A(1), true, pk);
      for (std::size_t i = 0; i < K; ++i)
        for (std::size_t j = 0; j < nout; ++j) db[j] += dz[i * nout + j];
    }

    // One mini-batch backwards, given dL/d(out rows) and dS = dL/d(state leaving it); on return dS
    // is dL/d(state entering it). dq, dk, dv rows (stride C) are written; ptok, pgam, pbet
    // accumulated; returns the rates' gradients in b.dl.
    static void mb_backward(const cpu::ttt_minibatch<A>& m, const A* W, const mb_buffers& b,
                            const A* d_out, A* dq, A* dk, A* dv, A* dS, A* pgam, A* pbet,
                            A* ptok, cpu::gemm_scratch pk) {
      const std::size_t K = m.K, D = m.D, F = Mlp ? 4 * D : D, C = m.ld;
      const ilayout L = layout_of(D, F);
      // out = XQ + γ ⊙ x̂(Zbar) + β
      for (std::size_t i = 0; i < K; ++i) {
        b.sigb[i] = cpu::ln_row(b.zb + i * D, D, m.eps, b.xhb + i * D);
        const A* dout = d_out + i * C;
        for (std::size_t j = 0; j < D; ++j) {
          pgam[j] += dout[j] * b.xhb[i * D + j];
          pbet[j] += dout[j];
          b.rowd[j] = dout[j] * m.gamma[j];
        }
        cpu::ln_row_backward(b.xhb + i * D, b.sigb[i], b.rowd, A(0), D, b.dzb + i * D);
        std::copy(dout, dout + D, dq + i * C);  // the residual XQ
        std::fill(dk + i * C, dk + i * C + D, A(0));
        std::fill(dv + i * C, dv + i * C + D, A(0));
      }
      std::fill(b.de, b.de + K, A(0));
      std::fill(b.dl, b.dl + K, A(0));
      std::fill(b.dg2, b.dg2 + K * D, A(0));
      const A tl = m.tok[K - 1];
      A* dW1 = dS + L.w1;
      A* db1 = dS + L.b1;
      if constexpr (Mlp) {
        A* dW2 = dS + L.w2;
        A* db2 = dS + L.b2;
        std::fill(b.dg1, b.dg1 + K * F, A(0));
        std::fill(b.dx2, b.dx2 + K * F, A(0));
        std::fill(b.dx2b, b.dx2b + K * F, A(0));
        // The updates read dS as dL/d(state leaving); everything after adds to it.
        cpu::ttt_update_backward(static_cast<const A*>(b.x2), F, K, F, D,
                                 static_cast<const A*>(b.g2), tl, m.lr, dW2, db2, b.dx2, F, b.dg2,
                                 b.de, b.s1, b.s2, pk);
        cpu::ttt_update_backward(m.k, C, K, D, F, static_cast<const A*>(b.g1), tl, m.lr, dW1, db1,
                                 dk, C, b.dg1, b.de, b.s1, b.s2, pk);
        // Zbar2 = X2bar·W2 + b2 − P2·G2, P2 from tril(X2bar·X2ᵀ).
        cpu::ttt_dual_rows_backward(static_cast<const A*>(b.x2b), F, K, F, D, W + L.w2, b.p2,
                                    b.g2, b.dzb, b.dx2b, F, dW2, db2, b.dg2, b.dp2, pk);
        cpu::ttt_p_backward(K, m.tok, m.lr, b.att2, b.dp2, ptok, b.dl);
        cpu::ttt_att_backward(static_cast<const A*>(b.x2b), F, static_cast<const A*>(b.x2), F, K,
                              F, b.dp2, b.dx2b, F, b.dx2, F, pk);
        for (std::size_t e = 0; e < K * F; ++e) b.dz1b[e] = b.dx2b[e] * cpu::gelu_tanh<A>::d1(b.z1b[e]);
        // Zbar1 = XQ·W1 + b1 − P1·G1, P1 from tril(XQ·XKᵀ).
        cpu::ttt_dual_rows_backward(m.q, C, K, D, F, W + L.w1, b.p1, b.g1, b.dz1b, dq, C, dW1, db1,
                                    b.dg1, b.dp1, pk);
        cpu::ttt_p_backward(K, m.tok, m.lr, b.att1, b.dp1, ptok, b.dl);
        cpu::ttt_att_backward(m.q, C, m.k, C, K, D, b.dp1, dq, C, dk, C, pk);
        // G1 = Hm ⊙ GELU'(Z1) with Hm = G2·W2ᵀ (s1 holds Hm).
        auto Hm = cpu::view(b.s1, K, F, F);
        cpu::gemm(Hm, cpu::cview(static_cast<const A*>(b.g2), K, D, D),
                  cpu::cview(W + L.w2, F, D, D).transpose(), A(1), false, pk);
        for (std::size_t e = 0; e < K * F; ++e) {
          const A z = b.z1[e];
          b.dz1[e] = b.dg1[e] * b.s1[e] * cpu::gelu_tanh<A>::d2(z);
          b.s2[e] = b.dg1[e] * cpu::gelu_tanh<A>::d1(z);  // dL/dHm
        }
        const auto dHm = cpu::cview(static_cast<const A*>(b.s2), K, F, F);
        auto dG2 = cpu::view(b.dg2, K, D, D);
        cpu::gemm(dG2, dHm, cpu::cview(W + L.w2, F, D, D), A(1), true, pk);
        auto dW2m = cpu::view(dW2, F, D, D);
        cpu::gemm(dW2m, dHm.transpose(), cpu::cview(static_cast<const A*>(b.g2), K, D, D),
                  A(1), true, pk);
        // G2 = ∇ of the inner loss at Z2 = X2·W2 + b2, X2 = GELU(Z1), Z1 = XK·W1 + b1.
        cpu::ttt_ln_l2_backward(m, b.xh2, b.sig2, b.g2, b.dg2, pgam, pbet, b.dz2, dk, dv, b.rowd);
        linear_rows_backward(static_cast<const A*>(b.x2), F, K, F, D, W + L.w2, b.dz2, b.dx2, F,
                             dW2, db2, pk);
        for (std::size_t e = 0; e < K * F; ++e) b.dz1[e] += b.dx2[e] * cpu::gelu_tanh<A>::d1(b.z1[e]);
        linear_rows_backward(m.k, C, K, D, F, W + L.w1, b.dz1, dk, C, dW1, db1, pk);
      } else {
        cpu::ttt_update_backward(m.k, C, K, D, D, static_cast<const A*>(b.g2), tl, m.lr, dW1, db1,
                                 dk, C, b.dg2, b.de, b.s1, b.s2, pk);
        cpu::ttt_dual_rows_backward(m.q, C, K, D, D, W + L.w1, b.p1, b.g2, b.dzb, dq, C, dW1, db1,
                                    b.dg2, b.dp1, pk);
        cpu::ttt_p_backward(K, m.tok, m.lr, b.att1, b.dp1, ptok, b.dl);
        cpu::ttt_att_backward(m.q, C, m.k, C, K, D, b.dp1, dq, C, dk, C, pk);
        cpu::ttt_ln_l2_backward(m, b.xh2, b.sig2, b.g2, b.dg2, pgam, pbet, b.dz2, dk, dv, b.rowd);
        linear_rows_backward(m.k, C, K, D, D, W + L.w1, b.dz2, dk, C, dW1, db1, pk);
      }
      // e_s = tok[K−1]·lr_s
      for (std::size_t i = 0; i < K; ++i) {
        ptok[K - 1] += b.de[i] * m.lr[i];
        b.dl[i] += b.de[i] * tl;
      }
    }

    // The inner loop backwards, per (b, h). d_o = dL/d(out) [N, C]. Writes dq, dk, dv [N, C] and
    // dlr [N, H]; part[b] gets this row's inner-state gradient, dγ, dβ and dtok for head h.
    static void inner_backward(const ttt_shape& s, const A* q, const A* k, const A* v, const A* lr,
                               const A* tok, const wptrs& wa, const A* ckpt, const A* d_o, A* dq,
                               A* dk, A* dv, A* dlr, A* part, A* scratch, const gemm_ws& gw,
                               thread_pool& ex) {
      const std::size_t H = s.heads, D = s.head_dim(), F = hidden(s), C = s.width, T = s.seq;
      const std::size_t ncp = saved_states(s), gsz = group_in_use(s);
      const std::size_t SZ = inner_elements(s), pe = part_elements(s);
      const std::size_t per = (gsz + 2) * SZ + mb_elements(D, F, mb, true);
      ex.parallel_for(s.batch * H, [&](std::size_t task, std::size_t thread) {
        const std::size_t b = task / H, h = task % H;
        A* states = scratch + thread * per;  // [gsz, SZ]: the state entering each mini-batch
        A* dS = states + gsz * SZ;           // dL/d(state)
        A* Wc = dS + SZ;                     // the running state while recomputing
        const mb_buffers sc = carve_mb(Wc + SZ, D, F, mb, true);
        const cpu::gemm_scratch pk = gw.of(thread, ex.size());
        A* pt = part + b * pe;
        A* pS = pt + h * SZ;
        A* pgam = pt + H * SZ + h * D;
        A* pbet = pt + H * SZ + H * D + h * D;
        A* ptok = pt + H * SZ + 2 * H * D + h * mb;
        std::fill(pgam, pgam + D, A(0));
        std::fill(pbet, pbet + D, A(0));
        std::fill(ptok, ptok + mb, A(0));
        // Sequences last to first, each from its last group: `slot` is one past its saved states.
        std::size_t slot = 0;
        for (std::size_t sq = 0; sq < sequence_count(s); ++sq) {
          const token_range r = sequence(s, sq);
          slot += states_of(r.end - r.begin);
        }
        const A* saved = ckpt + task * ncp * SZ;
        bool first = true;
        for (std::size_t sq = sequence_count(s); sq-- > 0;) {
          const token_range r = sequence(s, sq);
          if (r.end == r.begin) continue;
          const std::size_t nmb = (r.end - r.begin - 1) / mb + 1, nst = states_of(r.end - r.begin);
          slot -= nst;
          std::fill(dS, dS + SZ, A(0));  // nothing reads the state leaving a sequence
          for (std::size_t c = nst; c-- > 0;) {
            const std::size_t m0 = c * group, m1 = std::min(nmb, m0 + gsz);
            // Recompute the group's entering states from its saved state.
            std::copy(saved + (slot + c) * SZ, saved + (slot + c + 1) * SZ, Wc);
            for (std::size_t m = m0; m < m1; ++m) {
              std::copy(Wc, Wc + SZ, states + (m - m0) * SZ);
              if (m + 1 == m1) break;  // the last one's update is not needed
              const std::size_t t0 = r.begin + m * mb, K = std::min(mb, r.end - t0);
              gather_lr(s, lr, b, h, t0, K, sc.lrm);
              const auto mbt = minibatch(s, q, k, v, sc.lrm, tok, wa, b, h, t0, K);
              mb_forward(mbt, Wc, sc, false, pk);
              mb_update(mbt, Wc, sc, pk);
            }
            for (std::size_t m = m1; m-- > m0;) {
              const std::size_t t0 = r.begin + m * mb, K = std::min(mb, r.end - t0);
              const A* W = states + (m - m0) * SZ;
              gather_lr(s, lr, b, h, t0, K, sc.lrm);
              const auto mbt = minibatch(s, q, k, v, sc.lrm, tok, wa, b, h, t0, K);
              mb_forward(mbt, W, sc, true, pk);
              const std::size_t r0 = (b * T + t0) * C + h * D;
              mb_backward(mbt, W, sc, d_o + r0, dq + r0, dk + r0, dv + r0, dS, pgam, pbet, ptok,
                          pk);
              for (std::size_t i = 0; i < K; ++i) dlr[(b * T + t0 + i) * H + h] = sc.dl[i];
            }
          }
          // Every sequence starts from the layer's inner weights: their gradient sums the
          // sequences' (copied, not added, for the first, so one sequence keeps its bits).
          if (first) {
            std::copy(dS, dS + SZ, pS);
          } else {
            for (std::size_t e = 0; e < SZ; ++e) pS[e] += dS[e];
          }
          first = false;
        }
        if (first) std::fill(pS, pS + SZ, A(0));  // every sequence empty
      });
    }

    // Σ_n a[n, j]·b[n, j] into out_ab and Σ_n a[n, j] into out_a (when not null); b may be null
    // (then out_ab gets Σ a). Column blocks in parallel; rows outer so that each block streams
    // contiguous memory, and each column still sums its rows in order.
    static void column_sums_product(thread_pool& ex, const A* a, const A* b, std::size_t N,
                                    std::size_t M, A* out_ab, A* out_a) {
      ex.parallel_for(cpu::blocks(M, 64), [&](std::size_t blk, std::size_t) {
        const std::size_t j0 = blk * 64, j1 = std::min(M, j0 + 64);
        std::fill(out_ab + j0, out_ab + j1, A(0));
        if (out_a) std::fill(out_a + j0, out_a + j1, A(0));
        for (std::size_t n = 0; n < N; ++n) {
          const A* ar = a + n * M;
          for (std::size_t j = j0; j < j1; ++j) out_ab[j] += ar[j] * (b ? b[n * M + j] : A(1));
          if (out_a)
            for (std::size_t j = j0; j < j1; ++j) out_a[j] += ar[j];
        }
      });
    }
  };
};

MEMBOUND_NAMESPACE_END
