// CPU kernels of the Mamba block: the causal depthwise convolution, softplus/SiLU, and the
// chunked selective scan forward and backward. Everything works in the accumulator type A on
// buffers the front end (layers/mamba.hpp) has carved; nothing allocates.
//
// Layouts (row-major, n = b·T + t): xz [N, 2·Di] (x half, then z half); c, u, Δ, y [N, Di];
// x_dbl [N, R + 2·Ns] (dt_low, B, C); A = −exp(A_log) and dA [Di, Ns]; saved chunk states
// [B, chunks − 1, Di, Ns] (the state entering every chunk but the first, which starts at 0).
//
// The scan runs one task per block of scan_channels channels (a fixed partition, so results do
// not depend on the thread count), each sweeping every batch row and time step in order. The
// state update over d_state is vectorized through Eigen arrays (exp included).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>

#include "membound/backend/cpu/linalg.hpp"
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/core/parallel.hpp"
#include "membound/shape/mamba_shape.hpp"

MEMBOUND_NAMESPACE_BEGIN

namespace cpu {

// Channels per scan task.
inline constexpr std::size_t scan_channels = 64;
// The largest d_state: the backward keeps one channel's exp(Δ·a) in a stack array of this size.
inline constexpr std::size_t max_d_state = 256;

constexpr std::size_t scan_chunks(std::size_t T, std::size_t L) noexcept { return blocks(T, L); }

// Accumulator elements of per-thread scratch: forward keeps one state block; backward keeps the
// states of a whole chunk (recomputed from its saved entry state) plus the running dL/dh.
constexpr std::size_t scan_forward_scratch(std::size_t d_state) noexcept {
  return scan_channels * d_state;
}
constexpr std::size_t scan_backward_scratch(std::size_t chunk, std::size_t d_state) noexcept {
  return (chunk + 1) * scan_channels * d_state;
}

template <typename A>
using vec_map = Eigen::Map<Eigen::Array<A, Eigen::Dynamic, 1>>;
template <typename A>
using cvec_map = Eigen::Map<const Eigen::Array<A, Eigen::Dynamic, 1>>;
template <typename A>
vec_map<A> vec(A* p, std::size_t n) {
  return vec_map<A>(p, static_cast<Eigen::Index>(n));
}
template <typename A>
cvec_map<A> cvec(const A* p, std::size_t n) {
  return cvec_map<A>(p, static_cast<Eigen::Index>(n));
}

template <typename A>
A sigmoid(A v) {
  return A(1) / (A(1) + std::exp(-v));
}
template <typename A>
A silu(A v) {
  return v * sigmoid(v);
}
template <typename A>
A silu_grad(A v) {  // d/dv v·σ(v) = σ(v)·(1 + v·(1 − σ(v)))
  const A s = sigmoid(v);
  return s * (A(1) + v * (A(1) - s));
}
template <typename A>
A softplus(A v) {  // log(1 + e^v) without overflow for large v
  return v > A(0) ? v + std::log1p(std::exp(-v)) : std::log1p(std::exp(v));
}

// Rounds A values through storage S in place: a value that forward stores is used as stored, so
// backward's recomputation and the kept copy agree bit for bit. A no-op when S is A.
template <typename S, typename A>
void round_through(A* p, std::size_t n) {
  if constexpr (!std::is_same_v<S, A>) {
    for (std::size_t i = 0; i < n; ++i) p[i] = to_accum<A>(from_accum<S>(p[i]));
  } else {
    (void)p;
    (void)n;
  }
}

// One step of one channel's state: h = exp(Δ·a) ⊙ h + Δ·u·B; returns C·h. The forward, the
// backward's recomputation and single-step decoding all go through it, so they agree bit for bit.
template <typename A>
A scan_update(A* h, const A* a, A delta, A u, const A* b, const A* c, std::size_t ns) {
  auto hv = vec(h, ns);
  hv = (cvec(a, ns) * delta).exp() * hv + (delta * u) * cvec(b, ns);
  return (cvec(c, ns) * hv).sum();
}

// c[n, i] = bias[i] + Σ_k w[i, k] · xi[b, t − (K−1) + k, i], xi read with row stride ldx (it is
// the x half of xz). Zero before the sequence's start.
template <typename A>
void causal_conv(thread_pool& pool, const mamba_shape& s, const A* xi, std::size_t ldx,
                 const A* w, const A* bias, A* c) {
  const std::size_t T = s.seq, Di = s.d_inner, K = s.d_conv, N = s.batch * T;
  pool.parallel_for(blocks(N, row_block), [&](std::size_t blk, std::size_t) {
    const std::size_t r0 = blk * row_block, r1 = std::min(N, r0 + row_block);
    for (std::size_t n = r0; n < r1; ++n) {
      const std::size_t t = n % T;
      A* out = c + n * Di;
      std::copy(bias, bias + Di, out);
      for (std::size_t k = 0; k < K; ++k) {
        if (t + k < K - 1) continue;  // before the sequence's start
        const A* src = xi + (n + k + 1 - K) * ldx;
        for (std::size_t i = 0; i < Di; ++i) out[i] += w[i * K + k] * src[i];
      }
    }
  });
}

// The convolution's transpose: dxi[b, t', i] = Σ_k w[i, k] · dc[b, t' + K−1 − k, i] (written with
// row stride lddx), dw[i, k] = Σ_{b,t} dc · xi[t − (K−1) + k], dbias[i] = Σ dc (both written).
// One task per channel block, so the sums over b and t run in a fixed order.
template <typename A>
void causal_conv_backward(thread_pool& pool, const mamba_shape& s, const A* xi, std::size_t ldx,
                          const A* w, const A* dc, A* dxi, std::size_t lddx, A* dw, A* dbias) {
  const std::size_t B = s.batch, T = s.seq, Di = s.d_inner, K = s.d_conv;
  pool.parallel_for(blocks(Di, scan_channels), [&](std::size_t blk, std::size_t) {
    const std::size_t i0 = blk * scan_channels, i1 = std::min(Di, i0 + scan_channels);
    for (std::size_t i = i0; i < i1; ++i) {
      std::fill(dw + i * K, dw + (i + 1) * K, A(0));
      dbias[i] = A(0);
    }
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t t = 0; t < T; ++t) {
        const std::size_t n = b * T + t;
        const A* g = dc + n * Di;
        A* out = dxi + n * lddx;
        for (std::size_t i = i0; i < i1; ++i) {
          dbias[i] += g[i];
          out[i] = A(0);
        }
        for (std::size_t k = 0; k < K; ++k) {
          if (t + k >= K - 1) {  // dw: tap k saw xi at t − (K−1) + k
            const A* src = xi + (n + k + 1 - K) * ldx;
            for (std::size_t i = i0; i < i1; ++i) dw[i * K + k] += g[i] * src[i];
          }
          if (t + K - 1 - k < T) {  // dxi: xi at t fed output t + K−1 − k through tap k
            const A* later = dc + (n + K - 1 - k) * Di;
            for (std::size_t i = i0; i < i1; ++i) out[i] += w[i * K + k] * later[i];
          }
        }
      }
  });
}

// Selective scan forward over chunks of L steps: y[n, i] = C_t·h_t[i] + D[i]·u[n, i]. When
// `states` is not null, the state entering chunk c (c ≥ 1) is stored at states[b, c − 1].
template <typename A>
void scan_forward(thread_pool& pool, const mamba_shape& s, std::size_t L, const A* u,
                  const A* delta, const A* xdbl, const A* a, const A* dskip, A* y, A* states,
                  A* scratch) {
  const std::size_t B = s.batch, T = s.seq, Di = s.d_inner, Ns = s.d_state, R = s.dt_rank;
  const std::size_t ldx = R + 2 * Ns, nch = scan_chunks(T, L);
  pool.parallel_for(blocks(Di, scan_channels), [&](std::size_t blk, std::size_t thread) {
    const std::size_t i0 = blk * scan_channels, ni = std::min(scan_channels, Di - i0);
    A* h = scratch + thread * scan_forward_scratch(Ns);
    for (std::size_t b = 0; b < B; ++b) {
      std::fill(h, h + ni * Ns, A(0));
      for (std::size_t t = 0; t < T; ++t) {
        if (states != nullptr && t > 0 && t % L == 0) {
          A* dst = states + ((b * (nch - 1) + t / L - 1) * Di + i0) * Ns;
          std::copy(h, h + ni * Ns, dst);
        }
        const std::size_t n = b * T + t;
        const A* bt = xdbl + n * ldx + R;
        const A* ct = bt + Ns;
        for (std::size_t i = 0; i < ni; ++i) {
          const std::size_t ch = i0 + i;
          const A ui = u[n * Di + ch];
          y[n * Di + ch] =
              scan_update(h + i * Ns, a + ch * Ns, delta[n * Di + ch], ui, bt, ct, Ns) +
              dskip[ch] * ui;
        }
      }
    }
  });
}

// Selective scan backward. Per chunk, last to first: recompute the chunk's states from its saved
// entry state (forward order, through scan_update, so they equal forward's), then run the
// reverse recurrence with the running dL/dh. Given dy = dL/dy [N, Di], writes y (recomputed),
// du (the scan's part), dΔ, dA [Di, Ns] and dD [Di], and per channel block the partial sums of
// dB and dC into part[blk, N, 2·Ns] (reduced by reduce_bc in a fixed order).
template <typename A>
void scan_backward(thread_pool& pool, const mamba_shape& s, std::size_t L, const A* u,
                   const A* delta, const A* xdbl, const A* a, const A* dskip, const A* states,
                   const A* dy, A* y, A* du, A* ddelta, A* da, A* dd, A* part, A* scratch) {
  const std::size_t B = s.batch, T = s.seq, Di = s.d_inner, Ns = s.d_state, R = s.dt_rank;
  const std::size_t ldx = R + 2 * Ns, nch = scan_chunks(T, L), N = B * T;
  const std::size_t Lc = std::min(L, T);  // states per chunk actually held
  pool.parallel_for(blocks(Di, scan_channels), [&](std::size_t blk, std::size_t thread) {
    const std::size_t i0 = blk * scan_channels, ni = std::min(scan_channels, Di - i0);
    A* hs = scratch + thread * scan_backward_scratch(Lc, Ns);  // [Lc, scan_channels, Ns]
    A* dh = hs + Lc * scan_channels * Ns;                       // [scan_channels, Ns]
    A* pblk = part + blk * N * 2 * Ns;
    std::fill(da + i0 * Ns, da + (i0 + ni) * Ns, A(0));
    std::fill(dd + i0, dd + i0 + ni, A(0));
    for (std::size_t b = 0; b < B; ++b) {
      std::fill(dh, dh + ni * Ns, A(0));
      for (std::size_t c = nch; c-- > 0;) {
        const std::size_t t0 = c * L, t1 = std::min(T, t0 + L);
        const A* entry = c == 0 ? nullptr : states + ((b * (nch - 1) + c - 1) * Di + i0) * Ns;
        const auto state_at = [&](std::size_t t) { return hs + (t - t0) * scan_channels * Ns; };
        for (std::size_t t = t0; t < t1; ++t) {
          const std::size_t n = b * T + t;
          A* hc = state_at(t);
          if (t == t0) {
            if (entry) std::copy(entry, entry + ni * Ns, hc);
            else std::fill(hc, hc + ni * Ns, A(0));
          } else {
            std::copy(state_at(t - 1), state_at(t - 1) + ni * Ns, hc);
          }
          const A* bt = xdbl + n * ldx + R;
          for (std::size_t i = 0; i < ni; ++i) {
            const std::size_t ch = i0 + i;
            const A ui = u[n * Di + ch];
            y[n * Di + ch] =
                scan_update(hc + i * Ns, a + ch * Ns, delta[n * Di + ch], ui, bt, bt + Ns, Ns) +
                dskip[ch] * ui;
          }
        }
        for (std::size_t t = t1; t-- > t0;) {
          const std::size_t n = b * T + t;
          const A* bt = xdbl + n * ldx + R;
          const auto Bv = cvec(bt, Ns);
          const auto Cv = cvec(bt + Ns, Ns);
          auto pB = vec(pblk + n * 2 * Ns, Ns);
          auto pC = vec(pblk + n * 2 * Ns + Ns, Ns);
          pB.setZero();
          pC.setZero();
          const A* hprev_base = t > t0 ? state_at(t - 1) : entry;  // null: h_{-1} = 0
          for (std::size_t i = 0; i < ni; ++i) {
            const std::size_t ch = i0 + i;
            const A g = dy[n * Di + ch], ui = u[n * Di + ch], d = delta[n * Di + ch];
            auto dhv = vec(dh + i * Ns, Ns);
            const auto hv = cvec(state_at(t) + i * Ns, Ns);
            const auto av = cvec(a + ch * Ns, Ns);
            dd[ch] += g * ui;
            dhv += g * Cv;  // y_t = C_t·h_t
            pC += g * hv;
            const Eigen::Array<A, Eigen::Dynamic, 1, Eigen::ColMajor, max_d_state, 1> e =
                (av * d).exp();  // used three times: evaluate once (on the stack)
            A dd_t, du_t;
            if (hprev_base) {
              const auto hp = cvec(hprev_base + i * Ns, Ns);
              dd_t = (dhv * (av * e * hp + Bv * ui)).sum();
              vec(da + ch * Ns, Ns) += dhv * d * e * hp;
            } else {
              dd_t = (dhv * Bv).sum() * ui;
            }
            du_t = g * dskip[ch] + d * (dhv * Bv).sum();
            pB += dhv * (d * ui);
            ddelta[n * Di + ch] = dd_t;
            du[n * Di + ch] = du_t;
            dhv *= e;  // h_t depends on h_{t−1} through exp(Δ_t·a)
          }
        }
      }
    }
  });
}

// dB, dC [N, Ns] each, written into x_dbl's gradient at columns R and R + Ns (row stride ldx):
// the per-block partials summed in block order.
template <typename A>
void reduce_bc(thread_pool& pool, const mamba_shape& s, const A* part, A* dxdbl) {
  const std::size_t N = s.batch * s.seq, Di = s.d_inner, Ns = s.d_state, R = s.dt_rank;
  const std::size_t ldx = R + 2 * Ns, nblk = blocks(Di, scan_channels);
  pool.parallel_for(blocks(N, row_block), [&](std::size_t rb, std::size_t) {
    const std::size_t r0 = rb * row_block, r1 = std::min(N, r0 + row_block);
    for (std::size_t n = r0; n < r1; ++n) {
      A* out = dxdbl + n * ldx + R;
      std::copy(part + n * 2 * Ns, part + (n + 1) * 2 * Ns, out);
      for (std::size_t blk = 1; blk < nblk; ++blk) {
        const A* p = part + (blk * N + n) * 2 * Ns;
        for (std::size_t j = 0; j < 2 * Ns; ++j) out[j] += p[j];
      }
    }
  });
}

}  // namespace cpu

MEMBOUND_NAMESPACE_END
