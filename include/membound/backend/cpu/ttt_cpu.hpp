// CPU kernels of the TTT-Linear layer: the inner loop over mini-batches in the dual form, its
// hand-derived backward (with recomputation inside checkpoint groups), and the row LayerNorms.
// Everything works in the accumulator type A on buffers the front end (layers/ttt.hpp) carved.
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
#include <utility>

#include "membound/backend/cpu/linalg.hpp"
#include "membound/core/config.hpp"
#include "membound/core/element_math.hpp"
#include "membound/core/parallel.hpp"

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
// position (n mod T) mod period (TTT counts positions inside each mini-batch): the rotation
// ttt-lm-pytorch gets from permute_qk + rotate-half + undo_permute_qk. inverse: the transpose.
template <typename A>
void rope_pairs(thread_pool& pool, A* x, std::size_t N, std::size_t T, std::size_t heads,
                std::size_t D, double base, std::size_t period, bool inverse) {
  const std::size_t width = heads * D;
  // Frequency outer, rows inner: one pow per (block, pair) instead of per row, and the block's
  // rows share a handful of positions (there are `period` of them), so cos/sin are cached by
  // position. The values are the very same doubles, so the bits do not change.
  constexpr std::size_t cache = 64;
  pool.parallel_for(blocks(N, row_block), [&](std::size_t blk, std::size_t) {
    const std::size_t r0 = blk * row_block, r1 = std::min(N, r0 + row_block);
    std::size_t tag[cache];
    A cs[cache], sn[cache];
    for (std::size_t i = 0; i < D / 2; ++i) {
      const double inv_freq =
          std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(D));
      std::fill(tag, tag + cache, ~std::size_t{0});
      for (std::size_t n = r0; n < r1; ++n) {
        const std::size_t pos = (n % T) % period, slot = pos % cache;
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

MEMBOUND_NAMESPACE_END
