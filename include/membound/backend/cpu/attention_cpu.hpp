// CPU kernels of the attention layer: RoPE, and the flash-style tiled forward and backward
// (projections are linalg.hpp's). Everything here works in the accumulator type A on buffers the front end
// (layers/attention.hpp) has already carved and converted; nothing allocates: the tile products
// run through linalg.hpp's gemm with per-thread packing buffers from the caller's workspace
// (flash_gemm_bytes each), and RoPE reads a table of cosines and sines made once per call. Each
// parallel task writes a disjoint region and computes it in a fixed order, so results do not
// depend on the thread count.
//
// Layouts (row-major): x [B·T, C]; q [B·T, H·D] and k, v [B·T, Hkv·D] after projection, so head
// h of token t is the D-wide slice at column h·D of row b·T + t (tiles are strided Eigen maps:
// no transposition copies); lse and the backward's row sums Δ are [B, H, T].
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>

#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/backend/cpu/linalg.hpp"
#include "membound/core/parallel.hpp"
#include "membound/shape/attention_shape.hpp"

MEMBOUND_NAMESPACE_BEGIN

namespace cpu {

// Accumulator elements of per-thread scratch.
constexpr std::size_t forward_scratch(std::size_t q_tile, std::size_t kv_tile,
                                      std::size_t head_dim) noexcept {
  return q_tile * kv_tile + q_tile * head_dim + 2 * q_tile;  // S/P, O accumulator, m, l
}
constexpr std::size_t backward_scratch(std::size_t q_tile, std::size_t kv_tile) noexcept {
  return 2 * q_tile * kv_tile;  // S/P and dP/dS
}
// Per-thread packing bytes of the tile products (linalg.hpp's gemm with the caller's buffers):
// the largest of S = Q·Kᵀ [qt, kt] depth D, O += P·V [qt, D] depth kt, dV += Pᵀ·dO and
// dK += dSᵀ·Q [kt, D] depth qt, dQ += dS·K [qt, D] depth kt.
template <typename A>
constexpr std::size_t flash_gemm_bytes(std::size_t q_tile, std::size_t kv_tile,
                                       std::size_t head_dim) noexcept {
  return std::max({gemm_scratch_bytes<A>(q_tile, kv_tile, head_dim),
                   gemm_scratch_bytes<A>(q_tile, head_dim, kv_tile),
                   gemm_scratch_bytes<A>(kv_tile, head_dim, q_tile)});
}
// Elements of the RoPE table for `positions` positions: per position, D/2 cosines then D/2 sines
// (D is even: the layer checks a multiple of 8).
constexpr std::size_t rope_table_elements(std::size_t positions, std::size_t head_dim) noexcept {
  return positions * head_dim;
}

// The RoPE table for positions position0 .. position0 + T − 1: cos and sin of position·θ_i,
// θ_i = base^(−2i/D), computed in double (as the reference does) and rounded once to A; once per
// call instead of once per element and head.
template <typename A>
void rope_table(thread_pool& pool, A* table, std::size_t T, std::size_t D, double base,
                std::size_t position0) {
  const std::size_t half = D / 2;
  pool.parallel_for(blocks(T, row_block), [&](std::size_t blk, std::size_t) {
    const std::size_t t0 = blk * row_block, t1 = std::min(T, t0 + row_block);
    for (std::size_t t = t0; t < t1; ++t) {
      const double position = static_cast<double>(t + position0);
      A* row = table + t * 2 * half;
      for (std::size_t i = 0; i < half; ++i) {
        const double inv_freq =
            std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(D));
        const double angle = position * inv_freq;
        row[i] = static_cast<A>(std::cos(angle));
        row[half + i] = static_cast<A>(std::sin(angle));
      }
    }
  });
}

// RoPE from the table (rope_table of T positions): row n is token n % T. inverse rotates by
// −angle (sin negated exactly: the transpose, for gradients). The inner loop runs over the D/2
// pairs of a head, contiguous in x and in the table, so it vectorizes.
template <typename A>
void rope_rows(thread_pool& pool, A* x, std::size_t N, std::size_t T, std::size_t heads,
               std::size_t D, const A* table, bool inverse) {
  const std::size_t half = D / 2, width = heads * D;
  pool.parallel_for(blocks(N, row_block), [&](std::size_t blk, std::size_t) {
    const std::size_t r0 = blk * row_block, r1 = std::min(N, r0 + row_block);
    for (std::size_t n = r0; n < r1; ++n) {
      const A* c = table + (n % T) * 2 * half;
      const A* sn = c + half;
      A* row = x + n * width;
      for (std::size_t h = 0; h < heads; ++h) {
        A* lo = row + h * D;
        A* hi = lo + half;
        if (inverse) {
          for (std::size_t i = 0; i < half; ++i) {
            const A x1 = lo[i], x2 = hi[i];
            lo[i] = x1 * c[i] + x2 * sn[i];
            hi[i] = x2 * c[i] - x1 * sn[i];
          }
        } else {
          for (std::size_t i = 0; i < half; ++i) {
            const A x1 = lo[i], x2 = hi[i];
            lo[i] = x1 * c[i] - x2 * sn[i];
            hi[i] = x2 * c[i] + x1 * sn[i];
          }
        }
      }
    }
  });
}

// RoPE (rotate-half) in place on every D-wide head of rows [N, heads·D]; row n is token n % T,
// at position n % T + position0. inverse rotates by -angle (the transpose, for gradients).
// Angles are computed in double as the reference does, then applied in A.
template <typename A>
void rope_rows(thread_pool& pool, A* x, std::size_t N, std::size_t T, std::size_t heads,
               std::size_t D, double base, std::size_t position0, bool inverse) {
  const std::size_t half = D / 2, width = heads * D;
  pool.parallel_for(blocks(N, row_block), [&](std::size_t blk, std::size_t) {
    const std::size_t r0 = blk * row_block, r1 = std::min(N, r0 + row_block);
    for (std::size_t n = r0; n < r1; ++n) {
      const double position = static_cast<double>(n % T + position0);
      A* row = x + n * width;
      for (std::size_t i = 0; i < half; ++i) {
        const double inv_freq =
            std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(D));
        const double angle = position * inv_freq * (inverse ? -1.0 : 1.0);
        const A c = static_cast<A>(std::cos(angle)), s = static_cast<A>(std::sin(angle));
        for (std::size_t h = 0; h < heads; ++h) {
          A* head = row + h * D;
          const A x1 = head[i], x2 = head[i + half];
          head[i] = x1 * c - x2 * s;
          head[i + half] = x2 * c + x1 * s;
        }
      }
    }
  });
}

// Flash forward: o [B·T, H·D] and lse [B, H, T] from rotated q, k and v. One task per
// (b, h, query tile); key tiles entirely above the diagonal are skipped when causal, and the
// diagonal tile is masked. Online softmax: running max m, running sum l, rescaled accumulator.
template <typename A>
void flash_forward(thread_pool& pool, const attention_shape& sh, std::size_t qt, std::size_t kt,
                   const A* q, const A* k, const A* v, A* o, A* lse, A* scratch,
                   std::byte* packing) {
  const std::size_t B = sh.batch, T = sh.seq, H = sh.heads, Hkv = sh.kv_heads, D = sh.head_dim;
  const std::size_t HD = H * D, KD = Hkv * D, group = H / Hkv, nq = blocks(T, qt);
  const std::size_t per = forward_scratch(qt, kt, D), pack = flash_gemm_bytes<A>(qt, kt, D);
  const A scale = static_cast<A>(1.0 / std::sqrt(static_cast<double>(D)));
  constexpr A neg_inf = -std::numeric_limits<A>::infinity();  // m before any key
  pool.parallel_for(B * H * nq, [&](std::size_t task, std::size_t thread) {
    const std::size_t b = task / (H * nq), h = (task / nq) % H, i0 = (task % nq) * qt;
    const std::size_t g = h / group, ni = std::min(qt, T - i0);
    A* s_buf = scratch + thread * per;
    const gemm_scratch pk{packing + thread * pack, pack};
    auto acc = view(s_buf + qt * kt, ni, D, D);
    A* m = s_buf + qt * kt + qt * D;
    A* l = m + qt;
    const auto Q = cview(q + (b * T + i0) * HD + h * D, ni, D, HD);
    acc.setZero();
    std::fill(m, m + ni, neg_inf);
    std::fill(l, l + ni, A(0));
    // Keys past the tile's last query are masked for every row: the loop stops there.
    const std::size_t kv_end = sh.causal ? i0 + ni : T;
    for (std::size_t j0 = 0; j0 < kv_end; j0 += kt) {
      const std::size_t nk = std::min(kt, kv_end - j0);
      const auto K = cview(k + (b * T + j0) * KD + g * D, nk, D, KD);
      const auto V = cview(v + (b * T + j0) * KD + g * D, nk, D, KD);
      auto St = view(s_buf, ni, nk, nk);
      gemm(St, Q, K.transpose(), scale, false, pk);
      for (std::size_t r = 0; r < ni; ++r) {
        const auto ri = static_cast<Eigen::Index>(r);
        // Keys after query i = i0 + r are masked: the row's tail from column i + 1 - j0 on.
        const std::size_t i = i0 + r;
        const std::size_t live = !sh.causal ? nk : (i < j0 ? 0 : std::min(nk, i + 1 - j0));
        St.row(ri).tail(static_cast<Eigen::Index>(nk - live)).setZero();  // exp(-inf)
        if (live == 0) continue;  // a key tile wholly after this query: m, l, acc unchanged
        auto row = St.row(ri).head(static_cast<Eigen::Index>(live)).array();
        // Tile 0 holds key 0, which no query masks, so m is finite from the first tile on.
        const A mn = std::max(m[r], row.maxCoeff());
        const A alpha = std::exp(m[r] - mn);  // exp(-inf) = 0 on the first tile
        row = (row - mn).exp();  // Eigen's vectorized exp: the scalar one costs more than the GEMMs
        const A sum = row.sum();
        l[r] = l[r] * alpha + sum;
        acc.row(ri) *= alpha;
        m[r] = mn;
      }
      gemm(acc, St, V, A(1), true, pk);
    }
    auto O = view(o + (b * T + i0) * HD + h * D, ni, D, HD);
    A* lse_row = lse + (b * H + h) * T + i0;
    for (std::size_t r = 0; r < ni; ++r) {
      const auto ri = static_cast<Eigen::Index>(r);
      O.row(ri) = acc.row(ri) / l[r];
      lse_row[r] = m[r] + std::log(l[r]);
    }
  });
}

// Δ[b, h, t] = Σ_d dO[b·T + t, h·D + d] · O[b·T + t, h·D + d]
template <typename A>
void row_dot(thread_pool& pool, const attention_shape& sh, const A* d_out, const A* o, A* delta) {
  const std::size_t B = sh.batch, T = sh.seq, H = sh.heads, D = sh.head_dim, HD = H * D;
  pool.parallel_for(blocks(B * T, row_block), [&](std::size_t blk, std::size_t) {
    const std::size_t r0 = blk * row_block, r1 = std::min(B * T, r0 + row_block);
    for (std::size_t n = r0; n < r1; ++n) {
      const std::size_t b = n / T, t = n % T;
      for (std::size_t h = 0; h < H; ++h) {
        A s = 0;
        for (std::size_t d = 0; d < D; ++d) s += d_out[n * HD + h * D + d] * o[n * HD + h * D + d];
        delta[(b * H + h) * T + t] = s;
      }
    }
  });
}

// P = exp(S - lse) over a (query tile, key tile), 0 where masked; S recomputed from q and k.
template <typename A, typename QMap, typename KMap, typename PMap>
void recompute_p(const QMap& Q, const KMap& K, PMap& P, A scale, const A* lse_row, bool causal,
                 std::size_t i0, std::size_t j0, gemm_scratch pk) {
  gemm(P, Q, K.transpose(), A(1), false, pk);
  const std::size_t nk = static_cast<std::size_t>(P.cols());
  for (Eigen::Index r = 0; r < P.rows(); ++r) {
    const std::size_t i = i0 + static_cast<std::size_t>(r);
    // Keys after query i are masked (P = 0); a row may be fully masked in a diagonal tile.
    const std::size_t live = !causal ? nk : (i < j0 ? 0 : std::min(nk, i + 1 - j0));
    auto row = P.row(r).head(static_cast<Eigen::Index>(live)).array();
    row = (row * scale - lse_row[r]).exp();
    P.row(r).tail(static_cast<Eigen::Index>(nk - live)).setZero();
  }
}

// dS = P ⊙ (dP − Δ) in place over dP, row by row (vectorized).
template <typename A, typename PMap, typename DMap>
void softmax_grad(const PMap& P, DMap& dS, const A* delta_row) {
  for (Eigen::Index r = 0; r < dS.rows(); ++r)
    dS.row(r).array() = P.row(r).array() * (dS.row(r).array() - delta_row[r]);
}

// FlashAttention-2 backward (Δ precomputed by row_dot). Per (query tile i, key tile j) pair:
//   P = exp(S − lse), dV_j += Pᵀ·dO_i, dP = dO_i·V_jᵀ, dS = P ⊙ (dP − Δ),
//   dK_j += dSᵀ·Q_i / √D, dQ_i += dS·K_j / √D.
// dK_j and dV_j sum over the query heads of a kv head (GQA) and the query tiles at or below the
// diagonal; dQ_i over the key tiles. Two schedules, bit-identical (every sum runs in the same
// order: heads, then query tiles for dK/dV; key tiles ascending for dQ):
//   fused, one task per (b, kv head) sweeping every tile pair: 5 products per pair, but only
//          B·Hkv tasks;
//   split, when B·Hkv tasks would leave threads idle: pass 1, one task per (b, kv head, key
//          tile), computes dK, dV; pass 2, one task per (b, h, query tile), recomputes P and dP
//          for dQ: 7 products per pair, B·Hkv·T/kv_tile then B·H·T/q_tile tasks.
// dq [B·T, H·D], dk and dv [B·T, Hkv·D] are written (=), with respect to rotated q and k.
template <typename A>
void flash_backward(thread_pool& pool, const attention_shape& sh, std::size_t qt, std::size_t kt,
                    const A* q, const A* k, const A* v, const A* d_out, const A* lse,
                    const A* delta, A* dq, A* dk, A* dv, A* scratch, std::byte* packing) {
  const std::size_t B = sh.batch, T = sh.seq, H = sh.heads, Hkv = sh.kv_heads, D = sh.head_dim;
  const std::size_t HD = H * D, KD = Hkv * D, group = H / Hkv;
  const std::size_t nq = blocks(T, qt), nkv = blocks(T, kt), per = backward_scratch(qt, kt);
  const std::size_t pack = flash_gemm_bytes<A>(qt, kt, D);
  const auto packing_of = [&](std::size_t thread) {
    return gemm_scratch{packing + thread * pack, pack};
  };
  const A scale = static_cast<A>(1.0 / std::sqrt(static_cast<double>(D)));
  // Earlier query tiles see no key of tile j0 when causal.
  const auto first_query_tile = [&](std::size_t j0) { return sh.causal ? (j0 / qt) * qt : 0; };

  // One tile pair for query head h: P and dS into the thread's scratch, dV and dK accumulated;
  // returns dS (its P is still beside it) for the caller's dQ.
  const auto pair = [&](A* s_buf, gemm_scratch pk, std::size_t b, std::size_t h, std::size_t i0,
                        std::size_t j0, auto& dK, auto& dV, bool want_dkv) {
    const std::size_t g = h / group, ni = std::min(qt, T - i0), nk = std::min(kt, T - j0);
    const auto Q = cview(q + (b * T + i0) * HD + h * D, ni, D, HD);
    const auto dO = cview(d_out + (b * T + i0) * HD + h * D, ni, D, HD);
    const auto K = cview(k + (b * T + j0) * KD + g * D, nk, D, KD);
    const auto V = cview(v + (b * T + j0) * KD + g * D, nk, D, KD);
    auto P = view(s_buf, ni, nk, nk);
    auto dS = view(s_buf + qt * kt, ni, nk, nk);
    recompute_p(Q, K, P, scale, lse + (b * H + h) * T + i0, sh.causal, i0, j0, pk);
    if (want_dkv) gemm(dV, P.transpose(), dO, A(1), true, pk);
    gemm(dS, dO, V.transpose(), A(1), false, pk);  // dP
    softmax_grad(P, dS, delta + (b * H + h) * T + i0);
    if (want_dkv) gemm(dK, dS.transpose(), Q, scale, true, pk);
    return dS;
  };

  const std::size_t kv_tasks = B * Hkv, threads = pool.size();
  if (kv_tasks >= 2 * threads || kv_tasks % threads == 0) {
    pool.parallel_for(kv_tasks, [&](std::size_t task, std::size_t thread) {
      const std::size_t b = task / Hkv, g = task % Hkv;
      A* s_buf = scratch + thread * per;
      for (std::size_t h = g * group; h < (g + 1) * group; ++h)
        view(dq + b * T * HD + h * D, T, D, HD).setZero();
      for (std::size_t j0 = 0; j0 < T; j0 += kt) {
        const std::size_t nk = std::min(kt, T - j0);
        auto dK = view(dk + (b * T + j0) * KD + g * D, nk, D, KD);
        auto dV = view(dv + (b * T + j0) * KD + g * D, nk, D, KD);
        dK.setZero();
        dV.setZero();
        const auto K = cview(k + (b * T + j0) * KD + g * D, nk, D, KD);
        for (std::size_t h = g * group; h < (g + 1) * group; ++h)
          for (std::size_t i0 = first_query_tile(j0); i0 < T; i0 += qt) {
            const auto dS = pair(s_buf, packing_of(thread), b, h, i0, j0, dK, dV, true);
            auto dQ = view(dq + (b * T + i0) * HD + h * D, std::min(qt, T - i0), D, HD);
            gemm(dQ, dS, K, scale, true, packing_of(thread));
          }
      }
    });
    return;
  }

  pool.parallel_for(B * Hkv * nkv, [&](std::size_t task, std::size_t thread) {
    const std::size_t b = task / (Hkv * nkv), g = (task / nkv) % Hkv, j0 = (task % nkv) * kt;
    const std::size_t nk = std::min(kt, T - j0);
    auto dK = view(dk + (b * T + j0) * KD + g * D, nk, D, KD);
    auto dV = view(dv + (b * T + j0) * KD + g * D, nk, D, KD);
    dK.setZero();
    dV.setZero();
    for (std::size_t h = g * group; h < (g + 1) * group; ++h)
      for (std::size_t i0 = first_query_tile(j0); i0 < T; i0 += qt)
        pair(scratch + thread * per, packing_of(thread), b, h, i0, j0, dK, dV, true);
  });

  pool.parallel_for(B * H * nq, [&](std::size_t task, std::size_t thread) {
    const std::size_t b = task / (H * nq), h = (task / nq) % H, i0 = (task % nq) * qt;
    const std::size_t g = h / group, ni = std::min(qt, T - i0);
    auto dQ = view(dq + (b * T + i0) * HD + h * D, ni, D, HD);
    dQ.setZero();
    const std::size_t kv_end = sh.causal ? i0 + ni : T;
    for (std::size_t j0 = 0; j0 < kv_end; j0 += kt) {
      const std::size_t nk = std::min(kt, T - j0);
      auto unused = view(dk, 0, D, KD);
      const auto dS =
          pair(scratch + thread * per, packing_of(thread), b, h, i0, j0, unused, unused, false);
      gemm(dQ, dS, cview(k + (b * T + j0) * KD + g * D, nk, D, KD), scale, true,
           packing_of(thread));
    }
  });
}

// One decoding position per sequence: o [B, H·D] from rotated q [B, H·D] against the cache's
// first `len` rotated keys and values ([B, Hkv, max_len, D] in storage S). One task per (b, h).
template <typename A, typename S>
void attend_cache(thread_pool& pool, const attention_shape& sh, std::size_t max_len,
                  std::size_t len, const A* q, const S* cache_k, const S* cache_v, A* o,
                  A* scratch) {
  const std::size_t B = sh.batch, H = sh.heads, Hkv = sh.kv_heads, D = sh.head_dim;
  const std::size_t HD = H * D, group = H / Hkv;
  const A scale = static_cast<A>(1.0 / std::sqrt(static_cast<double>(D)));
  pool.parallel_for(B * H, [&](std::size_t task, std::size_t thread) {
    const std::size_t b = task / H, h = task % H, g = h / group;
    A* s = scratch + thread * max_len;
    const A* qh = q + b * HD + h * D;
    const S* kc = cache_k + (b * Hkv + g) * max_len * D;
    const S* vc = cache_v + (b * Hkv + g) * max_len * D;
    A m = -std::numeric_limits<A>::infinity();
    for (std::size_t j = 0; j < len; ++j) {
      A dot = 0;
      for (std::size_t d = 0; d < D; ++d) dot += qh[d] * to_accum<A>(kc[j * D + d]);
      s[j] = dot * scale;
      m = std::max(m, s[j]);
    }
    A sum = 0;
    for (std::size_t j = 0; j < len; ++j) {
      s[j] = std::exp(s[j] - m);
      sum += s[j];
    }
    A* oh = o + b * HD + h * D;
    std::fill(oh, oh + D, A(0));
    for (std::size_t j = 0; j < len; ++j) {
      const A p = s[j] / sum;
      for (std::size_t d = 0; d < D; ++d) oh[d] += p * to_accum<A>(vc[j * D + d]);
    }
  });
}

}  // namespace cpu

MEMBOUND_NAMESPACE_END
