// CPU kernels of the attention layer: RoPE, and the flash-style tiled forward and backward
// (projections are backend/cpu/gemm.hpp's). Everything here works in the accumulator type A on
// buffers carved from the caller's saved bytes (by layers/attention.hpp) and workspace (by
// backend_kernels<cpu_backend, attention_shape> below); nothing allocates: the tile products run
// through backend/cpu/gemm.hpp's gemm with per-thread packing buffers from the caller's workspace
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

#include <span>
#include <type_traits>

#include "membound/backend/cpu/gemm.hpp"
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/core/parallel.hpp"
#include "membound/memory/workspace.hpp"
#include "membound/policy/backend.hpp"
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
// Per-thread packing bytes of the tile products (backend/cpu/gemm.hpp's gemm with the caller's buffers):
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

// RoPE from the table (rope_table of T positions): row n is token n % T, or under packed
// sequences (`band`, of a shape with offsets) token n's position in its sequence.
// inverse rotates by −angle (sin negated exactly: the transpose, for gradients). The inner loop
// runs over the D/2 pairs of a head, contiguous in x and in the table, so it vectorizes.
template <typename A>
void rope_rows(thread_pool& pool, A* x, std::size_t N, std::size_t T, std::size_t heads,
               std::size_t D, const A* table, bool inverse,
               const attention_band& band = attention_band{}) {
  const std::size_t half = D / 2, width = heads * D;
  pool.parallel_for(blocks(N, row_block), [&](std::size_t blk, std::size_t) {
    const std::size_t r0 = blk * row_block, r1 = std::min(N, r0 + row_block);
    for (std::size_t n = r0; n < r1; ++n) {
      const std::size_t position = band.packing.packed() ? band.position(n) : n % T;
      const A* c = table + position * 2 * half;
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

// The live keys of query i inside the key tile [j0, j0 + nk): columns [first, end) of its row.
struct live_columns {
  std::size_t first, end;
};
inline live_columns live_in_tile(const attention_band& band, std::size_t i, std::size_t j0,
                                 std::size_t nk) noexcept {
  const std::size_t lo = std::clamp(band.key_begin(i), j0, j0 + nk);
  const std::size_t hi = std::clamp(band.key_end(i), lo, j0 + nk);
  return {lo - j0, hi - j0};
}
// Key tiles (of kt, aligned so that a window ≥ T sums exactly as no window) that query rows
// [i0, i0 + ni) see: [begin, end).
inline live_columns key_tiles(const attention_band& band, std::size_t i0, std::size_t ni,
                              std::size_t kt) noexcept {
  return {band.key_begin(i0) / kt * kt, band.key_end(i0 + ni - 1)};
}
// Query tiles (of qt) that see some key of [j0, j0 + nk): [begin, end).
inline live_columns query_tiles(const attention_band& band, std::size_t j0, std::size_t nk,
                                std::size_t qt) noexcept {
  return {band.query_begin(j0) / qt * qt, band.query_end(j0 + nk - 1)};
}

// Flash forward: o [B·T, H·D] and lse [B, H, T] from rotated q, k and v. One task per
// (b, h, query tile); key tiles outside the band (above the diagonal when causal, before the
// window) are skipped, and the tiles on its edges are masked. Online softmax: running max m,
// running sum l, rescaled accumulator.
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
    // Key tiles no row of this query tile sees are never visited.
    const attention_band band = band_of(sh);
    const auto [kv_begin, kv_end] = key_tiles(band, i0, ni, kt);
    for (std::size_t j0 = kv_begin; j0 < kv_end; j0 += kt) {
      const std::size_t nk = std::min(kt, kv_end - j0);
      const auto K = cview(k + (b * T + j0) * KD + g * D, nk, D, KD);
      const auto V = cview(v + (b * T + j0) * KD + g * D, nk, D, KD);
      auto St = view(s_buf, ni, nk, nk);
      gemm(St, Q, K.transpose(), scale, false, pk);
      for (std::size_t r = 0; r < ni; ++r) {
        const auto ri = static_cast<Eigen::Index>(r);
        // Keys outside query i's band are masked (exp(-inf) = 0): the row's head and tail.
        const auto [first, end] = live_in_tile(band, i0 + r, j0, nk);
        St.row(ri).head(static_cast<Eigen::Index>(first)).setZero();
        St.row(ri).tail(static_cast<Eigen::Index>(nk - end)).setZero();
        if (end == first) continue;  // a key tile wholly outside this row's band: m, l, acc unchanged
        auto row = St.row(ri).segment(static_cast<Eigen::Index>(first),
                                      static_cast<Eigen::Index>(end - first)).array();
        // m = -inf until the row's first live tile: alpha = exp(-inf) = 0 on an accumulator of 0.
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
void recompute_p(const QMap& Q, const KMap& K, PMap& P, A scale, const A* lse_row,
                 const attention_band& band, std::size_t i0, std::size_t j0, gemm_scratch pk) {
  gemm(P, Q, K.transpose(), A(1), false, pk);
  const std::size_t nk = static_cast<std::size_t>(P.cols());
  for (Eigen::Index r = 0; r < P.rows(); ++r) {
    // Keys outside query i's band are masked (P = 0); a row may be fully masked in an edge tile.
    const auto [first, end] = live_in_tile(band, i0 + static_cast<std::size_t>(r), j0, nk);
    auto row = P.row(r).segment(static_cast<Eigen::Index>(first),
                                static_cast<Eigen::Index>(end - first)).array();
    row = (row * scale - lse_row[r]).exp();
    P.row(r).head(static_cast<Eigen::Index>(first)).setZero();
    P.row(r).tail(static_cast<Eigen::Index>(nk - end)).setZero();
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
  const attention_band band = band_of(sh);

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
    recompute_p(Q, K, P, scale, lse + (b * H + h) * T + i0, band, i0, j0, pk);
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
        const auto [i_begin, i_end] = query_tiles(band, j0, nk, qt);
        for (std::size_t h = g * group; h < (g + 1) * group; ++h)
          for (std::size_t i0 = i_begin; i0 < i_end; i0 += qt) {
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
    const auto [i_begin, i_end] = query_tiles(band, j0, nk, qt);
    for (std::size_t h = g * group; h < (g + 1) * group; ++h)
      for (std::size_t i0 = i_begin; i0 < i_end; i0 += qt)
        pair(scratch + thread * per, packing_of(thread), b, h, i0, j0, dK, dV, true);
  });

  pool.parallel_for(B * H * nq, [&](std::size_t task, std::size_t thread) {
    const std::size_t b = task / (H * nq), h = (task / nq) % H, i0 = (task % nq) * qt;
    const std::size_t g = h / group, ni = std::min(qt, T - i0);
    auto dQ = view(dq + (b * T + i0) * HD + h * D, ni, D, HD);
    dQ.setZero();
    const auto [kv_begin, kv_end] = key_tiles(band, i0, ni, kt);
    for (std::size_t j0 = kv_begin; j0 < kv_end; j0 += kt) {
      const std::size_t nk = std::min(kt, T - j0);
      auto unused = view(dk, 0, D, KD);
      const auto dS =
          pair(scratch + thread * per, packing_of(thread), b, h, i0, j0, unused, unused, false);
      gemm(dQ, dS, cview(k + (b * T + j0) * KD + g * D, nk, D, KD), scale, true,
           packing_of(thread));
    }
  });
}

// One decoding position t per sequence: o [B, H·D] from rotated q [B, H·D] against the rotated
// keys and values of the positions it sees, t − W + 1 .. t under a window W, else 0 .. t, read
// from the cache ([B, Hkv, slots, D] in storage S; position p in slot p mod slots). One task per
// (b, h); positions in ascending order.
template <typename A, typename S>
void attend_cache(thread_pool& pool, const attention_shape& sh, std::size_t slots,
                  std::size_t t, const A* q, const S* cache_k, const S* cache_v, A* o,
                  A* scratch) {
  const std::size_t first = attention_band{t + 1, sh.window, true}.key_begin(t);
  const std::size_t len = t + 1 - first;
  const std::size_t B = sh.batch, H = sh.heads, Hkv = sh.kv_heads, D = sh.head_dim;
  const std::size_t HD = H * D, group = H / Hkv;
  const A scale = static_cast<A>(1.0 / std::sqrt(static_cast<double>(D)));
  pool.parallel_for(B * H, [&](std::size_t task, std::size_t thread) {
    const std::size_t b = task / H, h = task % H, g = h / group;
    A* s = scratch + thread * slots;
    const A* qh = q + b * HD + h * D;
    const S* kc = cache_k + (b * Hkv + g) * slots * D;
    const S* vc = cache_v + (b * Hkv + g) * slots * D;
    const auto slot = [&](std::size_t j) { return (first + j) % slots; };
    A m = -std::numeric_limits<A>::infinity();
    for (std::size_t j = 0; j < len; ++j) {
      A dot = 0;
      const S* kr = kc + slot(j) * D;
      for (std::size_t d = 0; d < D; ++d) dot += qh[d] * to_accum<A>(kr[d]);
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
      const S* vr = vc + slot(j) * D;
      for (std::size_t d = 0; d < D; ++d) oh[d] += p * to_accum<A>(vr[d]);
    }
  });
}

}  // namespace cpu

// The attention layer on the host: the same calls as backend_kernels<cuda_backend,
// attention_shape> (backend/cuda/attention.cuh), which the layer front makes without
// knowing which backend runs them. The front has checked every argument and the workspace's
// size; this carves the workspace (slots of disjoint lifetimes share bytes) and runs. Tiles sizes
// the flash tiles; `threads` sizes the per-thread scratch (the pool's size).
template <>
struct backend_kernels<cpu_backend, attention_shape> {
  template <typename S, typename A, typename Tiles>
  static constexpr std::size_t forward_workspace_bytes(const attention_shape& s, bool keep_qkv,
                                                       std::size_t threads) noexcept {
    const std::size_t b[] = {acc_bytes<S, A>(s.batch, s.seq, s.d_model), w_acc_bytes<S, A>(s),
                             q_bytes<A>(s), kv_bytes<A>(s),
                             bytes_of<A>(threads, cpu::forward_scratch(Tiles::q_tile, Tiles::kv_tile,
                                                                       s.head_dim)),
                             rope_bytes<A>(s.seq, s.head_dim),
                             bytes_of<std::byte>(threads, forward_pack_bytes<A, Tiles>(s))};
    return detail::fits_layout(b) ? forward_layout<S, A, Tiles>(s, keep_qkv, threads).size()
                                  : too_large;
  }
  template <typename S, typename A, typename Tiles>
  static constexpr std::size_t backward_workspace_bytes(const attention_shape& s, bool keep_qkv,
                                                        std::size_t threads) noexcept {
    const std::size_t b[] = {acc_bytes<S, A>(s.batch, s.seq, s.d_model), w_acc_bytes<S, A>(s),
                             q_bytes<A>(s), kv_bytes<A>(s),
                             bytes_of<A>(threads,
                                         cpu::backward_scratch(Tiles::q_tile, Tiles::kv_tile)),
                             bytes_of<A>(s.d_model, s.heads * s.head_dim),
                             rope_bytes<A>(s.seq, s.head_dim),
                             bytes_of<std::byte>(threads, backward_pack_bytes<A, Tiles>(s))};
    return detail::fits_layout(b) ? backward_layout<S, A, Tiles>(s, keep_qkv, threads).size()
                                  : too_large;
  }
  template <typename S, typename A, typename Tiles>
  static constexpr std::size_t step_workspace_bytes(const attention_shape& s, std::size_t slots,
                                                    std::size_t threads) noexcept {
    const std::size_t b[] = {w_acc_bytes<S, A>(s), bytes_of<A>(threads, slots),
                             bytes_of<A>(s.batch, s.heads, s.head_dim),
                             bytes_of<std::byte>(threads, step_pack_bytes<A>(s))};
    return detail::fits_layout(b) ? step_layout<S, A>(s, slots, threads).size() : too_large;
  }

  // Writes o_s ([B·T, H·D], S) and lse ([B, H, T], A); q, k, v are the saved slots under
  // save_all (non-null) or nullptr (then they live in the workspace).
  template <typename S, typename A, typename Tiles>
  static void forward(const attention_shape& s, const S* wq, const S* wk, const S* wv, const S* wo,
                      const S* x, S* y, S* o_s, A* lse, A* q_saved, A* k_saved, A* v_saved,
                      void* workspace, std::size_t workspace_size, thread_pool& ex) {
    constexpr std::size_t qt = Tiles::q_tile, kt = Tiles::kv_tile;
    const bool keep = q_saved != nullptr;
    const std::size_t threads = ex.size();
    const auto ws = carve(forward_layout<S, A, Tiles>(s, keep, threads), workspace, workspace_size);
    const std::size_t B = s.batch, T = s.seq, C = s.d_model, N = B * T;
    const std::size_t HD = s.heads * s.head_dim;
    const A* xa = cpu::widen_or_alias(ex, x, N * C, ws.template get<A>(f_x));
    const wptrs<A> wa = widen_weights(s, wq, wk, wv, wo, ws.template get<A>(f_w), ex);
    A* q = keep ? q_saved : ws.template get<A>(f_q);
    A* k = keep ? k_saved : ws.template get<A>(f_k);
    A* v = keep ? v_saved : ws.template get<A>(f_v);
    const std::span<std::byte> pk{ws.template get<std::byte>(f_gemm),
                                  threads * forward_pack_bytes<A, Tiles>(s)};
    A* table = ws.template get<A>(f_rope);
    cpu::rope_table(ex, table, T, s.head_dim, s.rope_base, 0);
    project_qkv(s, xa, wa, q, k, v, table, pk, ex);

    A* o = cpu::accum_target(o_s, ws.template get<A>(f_o));
    cpu::flash_forward(ex, s, qt, kt, q, k, v, o, lse, ws.template get<A>(f_scratch), pk.data());
    if constexpr (widened<S, A>) cpu::narrow(ex, static_cast<const A*>(o), N * HD, o_s);

    A* ya = cpu::accum_target(y, ws.template get<A>(f_y));
    cpu::matmul(ex, static_cast<const A*>(o), wa.o, ya, N, HD, C, false, cpu::ld3{HD, C, C}, pk);
    if constexpr (widened<S, A>) cpu::narrow(ex, static_cast<const A*>(ya), N * C, y);
  }

  template <typename S, typename A, typename Tiles>
  static void backward(const attention_shape& s, const S* wq, const S* wk, const S* wv,
                       const S* wo, const S* x, const S* o_s, const A* lse, A* q_saved,
                       A* k_saved, A* v_saved, const S* dy, S* dx, S* gwq, S* gwk, S* gwv,
                       S* gwo, void* workspace, std::size_t workspace_size, thread_pool& ex) {
    constexpr std::size_t qt = Tiles::q_tile, kt = Tiles::kv_tile;
    const bool keep = q_saved != nullptr;
    const std::size_t threads = ex.size();
    const auto ws = carve(backward_layout<S, A, Tiles>(s, keep, threads), workspace, workspace_size);
    const std::size_t B = s.batch, T = s.seq, C = s.d_model, N = B * T;
    const std::size_t HD = s.heads * s.head_dim, KD = s.kv_heads * s.head_dim;

    // Phase 0: q, k, v (kept, or projected again); dO = dy·Woᵀ and Δ = rowsum(dO ⊙ O).
    const A* xa = cpu::widen_or_alias(ex, x, N * C, ws.template get<A>(b_x));
    const wptrs<A> wa = widen_weights(s, wq, wk, wv, wo, ws.template get<A>(b_w), ex);
    A* q = keep ? q_saved : ws.template get<A>(b_q);
    A* k = keep ? k_saved : ws.template get<A>(b_k);
    A* v = keep ? v_saved : ws.template get<A>(b_v);
    const std::span<std::byte> pk{ws.template get<std::byte>(b_gemm),
                                  threads * backward_pack_bytes<A, Tiles>(s)};
    A* table = ws.template get<A>(b_rope);
    cpu::rope_table(ex, table, T, s.head_dim, s.rope_base, 0);
    if (!keep) project_qkv(s, xa, wa, q, k, v, table, pk, ex);
    const A* dya = cpu::widen_or_alias(ex, dy, N * C, ws.template get<A>(b_dy));
    const A* o = cpu::widen_or_alias(ex, o_s, N * HD, ws.template get<A>(b_o));
    A* d_out = ws.template get<A>(b_dout);
    A* delta = ws.template get<A>(b_delta);
    cpu::matmul_bt(ex, dya, wa.o, d_out, N, C, HD, false, cpu::ld3{C, C, HD}, pk);
    cpu::row_dot(ex, s, static_cast<const A*>(d_out), o, delta);

    // Phase 1: the tiled attention backward.
    A* dq = ws.template get<A>(b_dq);
    A* dk = ws.template get<A>(b_dk);
    A* dv = ws.template get<A>(b_dv);
    cpu::flash_backward(ex, s, qt, kt, static_cast<const A*>(q), static_cast<const A*>(k),
                        static_cast<const A*>(v), static_cast<const A*>(d_out), lse,
                        static_cast<const A*>(delta), dq, dk, dv, ws.template get<A>(b_scratch),
                        pk.data());

    // Phase 2: undo RoPE (its transpose) and the weight gradients.
    cpu::rope_rows(ex, dq, N, T, s.heads, s.head_dim, static_cast<const A*>(table), true, band_of(s));
    cpu::rope_rows(ex, dk, N, T, s.kv_heads, s.head_dim, static_cast<const A*>(table), true, band_of(s));
    A* tmp = ws.template get<A>(b_dw);
    cpu::weight_grad(ex, xa, static_cast<const A*>(dq), gwq, tmp, N, C, HD, pk);
    cpu::weight_grad(ex, xa, static_cast<const A*>(dk), gwk, tmp, N, C, KD, pk);
    cpu::weight_grad(ex, xa, static_cast<const A*>(dv), gwv, tmp, N, C, KD, pk);
    cpu::weight_grad(ex, o, dya, gwo, tmp, N, HD, C, pk);

    // Phase 3: dx = dq·Wqᵀ + dk·Wkᵀ + dv·Wvᵀ.
    A* dxa = cpu::accum_target(dx, ws.template get<A>(b_dx));
    cpu::matmul_bt(ex, static_cast<const A*>(dq), wa.q, dxa, N, HD, C, false,
                   cpu::ld3{HD, HD, C}, pk);
    cpu::matmul_bt(ex, static_cast<const A*>(dk), wa.k, dxa, N, KD, C, true,
                   cpu::ld3{KD, KD, C}, pk);
    cpu::matmul_bt(ex, static_cast<const A*>(dv), wa.v, dxa, N, KD, C, true,
                   cpu::ld3{KD, KD, C}, pk);
    if constexpr (widened<S, A>) cpu::narrow(ex, static_cast<const A*>(dxa), N * C, dx);
  }

  // Writes the rotated key and value of position t = `length` into the cache (keys, then values,
  // each [B, Hkv, slots, D] in S; slot t mod slots, over the oldest position under a window) and
  // y_t [B, C].
  template <typename S, typename A, typename Tiles>
  static void step(const attention_shape& s, const S* wq, const S* wk, const S* wv, const S* wo,
                   S* cache_keys, S* cache_values, std::size_t slots, std::size_t length,
                   const S* x_t, S* y_t, void* workspace, std::size_t workspace_size,
                   thread_pool& ex) {
    const std::size_t L = slots, threads = ex.size();
    const auto ws = carve(step_layout<S, A>(s, L, threads), workspace, workspace_size);
    const std::size_t B = s.batch, C = s.d_model, Hkv = s.kv_heads, D = s.head_dim;
    const std::size_t HD = s.heads * D, KD = Hkv * D, t = length;

    const A* xa = cpu::widen_or_alias(ex, x_t, B * C, ws.template get<A>(st_x));
    const wptrs<A> wa = widen_weights(s, wq, wk, wv, wo, ws.template get<A>(st_w), ex);
    A* q = ws.template get<A>(st_q);
    A* k = ws.template get<A>(st_k);
    A* v = ws.template get<A>(st_v);
    const std::span<std::byte> pk{ws.template get<std::byte>(st_gemm),
                                  threads * step_pack_bytes<A>(s)};
    A* table = ws.template get<A>(st_rope);
    cpu::rope_table(ex, table, 1, D, s.rope_base, t);
    cpu::matmul(ex, xa, wa.q, q, B, C, HD, false, cpu::ld3{C, HD, HD}, pk);
    cpu::matmul(ex, xa, wa.k, k, B, C, KD, false, cpu::ld3{C, KD, KD}, pk);
    cpu::matmul(ex, xa, wa.v, v, B, C, KD, false, cpu::ld3{C, KD, KD}, pk);
    cpu::rope_rows(ex, q, B, 1, s.heads, D, static_cast<const A*>(table), false);
    cpu::rope_rows(ex, k, B, 1, Hkv, D, static_cast<const A*>(table), false);
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t g = 0; g < Hkv; ++g)
        for (std::size_t d = 0; d < D; ++d) {
          cache_keys[((b * Hkv + g) * L + t % L) * D + d] = from_accum<S>(k[b * KD + g * D + d]);
          cache_values[((b * Hkv + g) * L + t % L) * D + d] = from_accum<S>(v[b * KD + g * D + d]);
        }
    A* o = ws.template get<A>(st_o);
    cpu::attend_cache(ex, s, L, t, static_cast<const A*>(q),
                      static_cast<const S*>(cache_keys), static_cast<const S*>(cache_values), o,
                      ws.template get<A>(st_scratch));
    A* ya = cpu::accum_target(y_t, ws.template get<A>(st_y));
    cpu::matmul(ex, static_cast<const A*>(o), wa.o, ya, B, HD, C, false, cpu::ld3{HD, C, C}, pk);
    if constexpr (widened<S, A>) cpu::narrow(ex, static_cast<const A*>(ya), B * C, y_t);
  }

 private:
  static constexpr std::size_t too_large = std::numeric_limits<std::size_t>::max();
  // bf16/fp16 storage: convert to A first (fp32/fp64 read the caller's buffers).
  template <typename S, typename A>
  static constexpr bool widened = !std::is_same_v<S, A>;

  template <typename A>
  static constexpr std::size_t q_bytes(const attention_shape& s) noexcept {
    return bytes_of<A>(s.batch, s.seq, s.heads, s.head_dim);
  }
  template <typename A>
  static constexpr std::size_t kv_bytes(const attention_shape& s) noexcept {
    return bytes_of<A>(s.batch, s.seq, s.kv_heads, s.head_dim);
  }
  // An accumulator copy that only bf16/fp16 storage needs.
  template <typename S, typename A>
  static constexpr std::size_t acc_bytes(auto... extents) noexcept {
    return widened<S, A> ? bytes_of<A>(extents...) : 0;
  }
  template <typename S, typename A>
  static constexpr std::size_t w_acc_bytes(const attention_shape& s) noexcept {
    return acc_bytes<S, A>(attention_weight_elements(s));
  }
  template <typename A>
  static constexpr std::size_t rope_bytes(std::size_t positions, std::size_t head_dim) noexcept {
    return bytes_of<A>(positions, head_dim);  // cpu::rope_table_elements, saturating
  }

  // Per-thread packing bytes of every product of a pass (backend/cpu/gemm.hpp's gemm with the caller's
  // buffers): the projections' row tasks and the flash kernel's tile products share one slot.
  template <typename A, typename Tiles>
  static constexpr std::size_t forward_pack_bytes(const attention_shape& s) noexcept {
    const std::size_t N = s.batch * s.seq, C = s.d_model, HD = s.heads * s.head_dim;
    const std::size_t KD = s.kv_heads * s.head_dim;
    return std::max({cpu::matmul_thread_scratch_bytes<A>(N, C, HD),
                     cpu::matmul_thread_scratch_bytes<A>(N, C, KD),
                     cpu::matmul_thread_scratch_bytes<A>(N, HD, C),
                     cpu::flash_gemm_bytes<A>(Tiles::q_tile, Tiles::kv_tile, s.head_dim)});
  }
  template <typename A, typename Tiles>
  static constexpr std::size_t backward_pack_bytes(const attention_shape& s) noexcept {
    const std::size_t N = s.batch * s.seq, C = s.d_model, HD = s.heads * s.head_dim;
    const std::size_t KD = s.kv_heads * s.head_dim;
    return std::max({forward_pack_bytes<A, Tiles>(s), cpu::matmul_thread_scratch_bytes<A>(N, C, HD),
                     cpu::matmul_thread_scratch_bytes<A>(N, KD, C),
                     cpu::matmul_at_thread_scratch_bytes<A>(N, C, HD),
                     cpu::matmul_at_thread_scratch_bytes<A>(N, C, KD),
                     cpu::matmul_at_thread_scratch_bytes<A>(N, HD, C)});
  }
  template <typename A>
  static constexpr std::size_t step_pack_bytes(const attention_shape& s) noexcept {
    const std::size_t C = s.d_model, HD = s.heads * s.head_dim, KD = s.kv_heads * s.head_dim;
    return std::max({cpu::matmul_thread_scratch_bytes<A>(s.batch, C, HD),
                     cpu::matmul_thread_scratch_bytes<A>(s.batch, C, KD),
                     cpu::matmul_thread_scratch_bytes<A>(s.batch, HD, C)});
  }

  // Phases: 0 projections, 1 tiled attention, 2 output projection. q, k, v live here only
  // under recompute.
  enum forward_slot : std::size_t {
    f_x, f_w, f_q, f_k, f_v, f_scratch, f_o, f_y, f_rope, f_gemm
  };
  template <typename S, typename A, typename Tiles>
  static constexpr workspace_layout<10> forward_layout(const attention_shape& s, bool keep_qkv,
                                                       std::size_t threads) {
    const std::size_t x_acc = acc_bytes<S, A>(s.batch, s.seq, s.d_model);
    workspace_layout<10> l;
    l.add(x_acc, default_alignment, {0, 0});
    l.add(w_acc_bytes<S, A>(s), default_alignment, {0, 2});
    l.add(keep_qkv ? 0 : q_bytes<A>(s), default_alignment, {0, 1});
    l.add(keep_qkv ? 0 : kv_bytes<A>(s), default_alignment, {0, 1});
    l.add(keep_qkv ? 0 : kv_bytes<A>(s), default_alignment, {0, 1});
    l.add(bytes_of<A>(threads, cpu::forward_scratch(Tiles::q_tile, Tiles::kv_tile, s.head_dim)),
          default_alignment, {1, 1});
    l.add(widened<S, A> ? q_bytes<A>(s) : 0, default_alignment, {1, 2});
    l.add(x_acc, default_alignment, {2, 2});
    l.add(rope_bytes<A>(s.seq, s.head_dim), default_alignment, {0, 0});
    l.add(bytes_of<std::byte>(threads, forward_pack_bytes<A, Tiles>(s)), default_alignment, {0, 2});
    return l;
  }

  // Phases: 0 recompute q, k, v and dO, Δ; 1 tiled backward; 2 RoPE undo and weight gradients;
  // 3 dx.
  enum backward_slot : std::size_t {
    b_x, b_w, b_q, b_k, b_v, b_dy, b_o, b_dout, b_delta, b_dq, b_dk, b_dv, b_scratch, b_dw, b_dx,
    b_rope, b_gemm
  };
  template <typename S, typename A, typename Tiles>
  static constexpr workspace_layout<18> backward_layout(const attention_shape& s, bool keep_qkv,
                                                        std::size_t threads) {
    const std::size_t x_acc = acc_bytes<S, A>(s.batch, s.seq, s.d_model);
    workspace_layout<18> l;
    l.add(x_acc, default_alignment, {0, 2});
    l.add(w_acc_bytes<S, A>(s), default_alignment, {0, 3});
    l.add(keep_qkv ? 0 : q_bytes<A>(s), default_alignment, {0, 1});
    l.add(keep_qkv ? 0 : kv_bytes<A>(s), default_alignment, {0, 1});
    l.add(keep_qkv ? 0 : kv_bytes<A>(s), default_alignment, {0, 1});
    l.add(x_acc, default_alignment, {0, 2});  // dy
    l.add(widened<S, A> ? q_bytes<A>(s) : 0, default_alignment, {0, 2});  // O
    l.add(q_bytes<A>(s), default_alignment, {0, 1});  // dO
    l.add(bytes_of<A>(s.batch, s.heads, s.seq), default_alignment, {0, 1});  // Δ
    l.add(q_bytes<A>(s), default_alignment, {1, 3});
    l.add(kv_bytes<A>(s), default_alignment, {1, 3});
    l.add(kv_bytes<A>(s), default_alignment, {1, 3});
    l.add(bytes_of<A>(threads, cpu::backward_scratch(Tiles::q_tile, Tiles::kv_tile)),
          default_alignment, {1, 1});
    // One weight gradient at a time, in A before the rounded +=; Hkv·D <= H·D.
    l.add(acc_bytes<S, A>(s.d_model, s.heads * s.head_dim), default_alignment, {2, 2});
    l.add(x_acc, default_alignment, {3, 3});  // dx
    l.add(rope_bytes<A>(s.seq, s.head_dim), default_alignment, {0, 2});
    l.add(bytes_of<std::byte>(threads, backward_pack_bytes<A, Tiles>(s)), default_alignment, {0, 3});
    return l;
  }

  // Phases: 0 projections, 1 attention over the cache, 2 output projection.
  enum step_slot : std::size_t {
    st_x, st_w, st_q, st_k, st_v, st_scratch, st_o, st_y, st_rope, st_gemm
  };
  template <typename S, typename A>
  static constexpr workspace_layout<10> step_layout(const attention_shape& s, std::size_t slots,
                                                    std::size_t threads) {
    workspace_layout<10> l;
    l.add(acc_bytes<S, A>(s.batch, s.d_model), default_alignment, {0, 0});
    l.add(w_acc_bytes<S, A>(s), default_alignment, {0, 2});
    l.add(bytes_of<A>(s.batch, s.heads, s.head_dim), default_alignment, {0, 1});
    l.add(bytes_of<A>(s.batch, s.kv_heads, s.head_dim), default_alignment, {0, 0});
    l.add(bytes_of<A>(s.batch, s.kv_heads, s.head_dim), default_alignment, {0, 0});
    l.add(bytes_of<A>(threads, slots), default_alignment, {1, 1});
    l.add(bytes_of<A>(s.batch, s.heads, s.head_dim), default_alignment, {1, 2});
    l.add(acc_bytes<S, A>(s.batch, s.d_model), default_alignment, {2, 2});
    l.add(rope_bytes<A>(1, s.head_dim), default_alignment, {0, 0});
    l.add(bytes_of<std::byte>(threads, step_pack_bytes<A>(s)), default_alignment, {0, 2});
    return l;
  }

  template <typename A>
  struct wptrs {
    const A *q, *k, *v, *o;
  };
  // q, k, v = x·Wq, x·Wk, x·Wv, with RoPE on q and k: forward computes them, backward recomputes
  // them the same way (bit for bit, so P recomputed from the saved lse matches forward's).
  template <typename A>
  static void project_qkv(const attention_shape& s, const A* xa, const wptrs<A>& wa, A* q, A* k,
                          A* v, const A* table, std::span<std::byte> packing, thread_pool& ex) {
    const std::size_t N = s.batch * s.seq, C = s.d_model;
    const std::size_t HD = s.heads * s.head_dim, KD = s.kv_heads * s.head_dim;
    cpu::matmul(ex, xa, wa.q, q, N, C, HD, false, cpu::ld3{C, HD, HD}, packing);
    cpu::matmul(ex, xa, wa.k, k, N, C, KD, false, cpu::ld3{C, KD, KD}, packing);
    cpu::matmul(ex, xa, wa.v, v, N, C, KD, false, cpu::ld3{C, KD, KD}, packing);
    cpu::rope_rows(ex, q, N, s.seq, s.heads, s.head_dim, table, false, band_of(s));
    cpu::rope_rows(ex, k, N, s.seq, s.kv_heads, s.head_dim, table, false, band_of(s));
  }

  // The weights in A: the caller's own for fp32/fp64, converted copies in `slot` otherwise.
  template <typename S, typename A>
  static wptrs<A> widen_weights(const attention_shape& s, const S* wq, const S* wk, const S* wv,
                                const S* wo, A* slot, thread_pool& ex) {
    if constexpr (widened<S, A>) {
      const std::size_t C = s.d_model, HD = s.heads * s.head_dim, KD = s.kv_heads * s.head_dim;
      A* q = slot;
      A* k = q + C * HD;
      A* v = k + C * KD;
      A* o = v + C * KD;
      cpu::widen(ex, wq, C * HD, q);
      cpu::widen(ex, wk, C * KD, k);
      cpu::widen(ex, wv, C * KD, v);
      cpu::widen(ex, wo, HD * C, o);
      return {q, k, v, o};
    } else {
      (void)s;
      (void)slot;
      (void)ex;
      return {wq, wk, wv, wo};
    }
  }
};

MEMBOUND_NAMESPACE_END
