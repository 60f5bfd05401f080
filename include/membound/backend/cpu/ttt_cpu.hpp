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

#include "membound/backend/cpu/linalg.hpp"
#include "membound/core/config.hpp"
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
  pool.parallel_for(blocks(N, row_block), [&](std::size_t blk, std::size_t) {
    const std::size_t r0 = blk * row_block, r1 = std::min(N, r0 + row_block);
    for (std::size_t n = r0; n < r1; ++n) {
      const double position = static_cast<double>((n % T) % period);
      A* row = x + n * width;
      for (std::size_t i = 0; i < D / 2; ++i) {
        const double inv_freq =
            std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(D));
        const double angle = position * inv_freq * (inverse ? -1.0 : 1.0);
        const A c = static_cast<A>(std::cos(angle)), s = static_cast<A>(std::sin(angle));
        for (std::size_t h = 0; h < heads; ++h) {
          A* p = row + h * D + 2 * i;
          const A x1 = p[0], x2 = p[1];
          p[0] = x1 * c - x2 * s;
          p[1] = x2 * c + x1 * s;
        }
      }
    }
  });
}

// Sizes of the per-task scratch, in accumulator elements.
constexpr std::size_t ttt_forward_scratch(std::size_t D, std::size_t mb) noexcept {
  return D * D + D + 4 * mb * D + 2 * mb * mb + 2 * mb;
}
constexpr std::size_t ttt_backward_scratch(std::size_t D, std::size_t mb,
                                           std::size_t group) noexcept {
  return group * (D * D + D) + 2 * (D * D + D) + 11 * mb * D + 3 * mb * mb + 4 * mb + 2 * D;
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

// The inner gradient G = ∇_Z1 ½‖LN(Z1) − (V − K)‖² of one mini-batch at (W, w); Z1, the LN
// statistics and the residual are left in the scratch for the backward.
template <typename A>
void ttt_inner_grad(const ttt_minibatch<A>& m, const A* W, const A* w, A* z1, A* xh, A* sig,
                    A* g) {
  const std::size_t K = m.K, D = m.D;
  auto Z = view(z1, K, D, D);
  gemm(Z, cview(m.k, K, D, m.ld), cview(W, D, D, D), A(1), false);
  for (std::size_t i = 0; i < K; ++i) {
    A* zr = z1 + i * D;
    for (std::size_t j = 0; j < D; ++j) zr[j] += w[j];
    sig[i] = ln_row(zr, D, m.eps, xh + i * D);
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

// P = η ⊙ (tril(XQ·XKᵀ) + 1) (lower triangle; zero above), and tril(XQ·XKᵀ) itself into `att`.
template <typename A>
void ttt_p_matrix(const ttt_minibatch<A>& m, A* att, A* p) {
  const std::size_t K = m.K, D = m.D;
  auto At = view(att, K, K, K);
  gemm(At, cview(m.q, K, D, m.ld), cview(m.k, K, D, m.ld).transpose(), A(1), false);
  for (std::size_t i = 0; i < K; ++i)
    for (std::size_t s = 0; s < K; ++s) {
      if (s > i) {
        att[i * K + s] = 0;
        p[i * K + s] = 0;
      } else {
        p[i * K + s] = m.tok[i] * m.lr[s] * (att[i * K + s] + A(1));
      }
    }
}

// Zbar = XQ·W + w − P·G.
template <typename A>
void ttt_zbar(const ttt_minibatch<A>& m, const A* W, const A* w, const A* p, const A* g, A* zb) {
  const std::size_t K = m.K, D = m.D;
  auto Zb = view(zb, K, D, D);
  gemm(Zb, cview(m.q, K, D, m.ld), cview(W, D, D, D), A(1), false);
  gemm(Zb, cview(p, K, K, K), cview(g, K, D, D), A(-1), true);
  for (std::size_t i = 0; i < K; ++i)
    for (std::size_t j = 0; j < D; ++j) zb[i * D + j] += w[j];
}

// W ← W − XKᵀ·diag(e)·G, w ← w − Σ_s e_s·G_s with e_s = tok[K−1]·lr[s]; `eg` is K·D scratch.
template <typename A>
void ttt_update(const ttt_minibatch<A>& m, const A* g, A* W, A* w, A* eg) {
  const std::size_t K = m.K, D = m.D;
  for (std::size_t s = 0; s < K; ++s) {
    const A e = m.tok[K - 1] * m.lr[s];
    for (std::size_t j = 0; j < D; ++j) {
      eg[s * D + j] = e * g[s * D + j];
      w[j] -= eg[s * D + j];
    }
  }
  auto Wm = view(W, D, D, D);
  gemm(Wm, cview(m.k, K, D, m.ld).transpose(), cview(eg, K, D, D), A(-1), true);
}

}  // namespace cpu

MEMBOUND_NAMESPACE_END
