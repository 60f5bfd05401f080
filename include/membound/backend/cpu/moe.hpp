// The mixture-of-experts feed-forward on the host (layers/moe_mlp.hpp is the front). One call:
//
//   router   p = softmax(x·Wr) [N, E]; each token's k largest (ties: the lower expert);
//            gates g = p of those, divided by their sum when shape.renormalize and k > 1;
//   dispatch choices in priority order, every token's first choice before any second (GShard),
//            tokens in order within a rank; a choice whose expert already holds `capacity` rows is
//            dropped. Kept choices are grouped by expert: rows [off_e, off_{e+1}) of one buffer
//            of moe_rows(shape) rows, whatever the routing;
//   experts  per expert, its rows through SwiGLU (a = X·Wg_e, b = X·Wu_e, Y = (SiLU(a)⊙b)·Wd_e);
//   combine  y[t] = Σ_j g[t, j] · Y[row(t, j)] over the kept choices, j in order.
//
// Backward recomputes the gathered rows from x and never keeps Y: the gate's gradient is
// dg = (dy·Wdᵀ)·act, the product backward needs anyway. The load-balancing loss's gradient
// α·E·f_e/N (f_e = count_e/N) is added to every token's probabilities before the softmax's backward.
// Everything runs in the accumulator type A; bf16/fp16 storage is widened in workspace slots,
// the pre-activations a, b are kept rounded to storage (backward sees what forward used).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
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
#include "membound/shape/moe_shape.hpp"

MEMBOUND_NAMESPACE_BEGIN

template <>
struct backend_kernels<cpu_backend, moe_shape> {
  template <typename S, typename A>
  static constexpr std::size_t forward_workspace_bytes(const moe_shape& s,
                                                       std::size_t threads) noexcept {
    return fits<S, A>(s, threads) ? forward_layout<S, A>(s, threads).size() : too_large;
  }
  template <typename S, typename A>
  static constexpr std::size_t backward_workspace_bytes(const moe_shape& s,
                                                        std::size_t threads) noexcept {
    return fits<S, A>(s, threads) ? backward_layout<S, A>(s, threads).size() : too_large;
  }

  // The routing forward keeps (shape/moe_shape.hpp).
  template <typename A>
  using routing = moe_routing<A>;

  // a_s, b_s: the experts' pre-activations [moe_rows, F], written here (rows past off[E] unused).
  template <typename S, typename A>
  static void forward(const moe_shape& s, const S* wr, const S* wg, const S* wu, const S* wd,
                      const S* x, S* y, routing<A> r, S* a_s, S* b_s, void* workspace,
                      std::size_t workspace_size, thread_pool& ex, moe_stats* stats) {
    const std::size_t threads = ex.size();
    const auto ws = carve(forward_layout<S, A>(s, threads), workspace, workspace_size);
    const std::size_t N = s.tokens(), C = s.width, F = s.hidden, E = s.experts;
    const std::span<std::byte> pk{ws.template get<std::byte>(f_gemm), threads * pack_bytes<A>(s)};
    const A* xa = cpu::widen_or_alias(ex, x, N * C, ws.template get<A>(f_x));
    const A* wra = cpu::widen_or_alias(ex, wr, C * E, ws.template get<A>(f_wr));
    route(s, xa, wra, r, pk, ex, stats);

    A* xg = ws.template get<A>(f_xg);
    gather(s, xa, r, xg, ex);
    A* a = cpu::accum_target(a_s, ws.template get<A>(f_a));
    A* b = cpu::accum_target(b_s, ws.template get<A>(f_b));
    A* act = ws.template get<A>(f_act);
    A* yg = ws.template get<A>(f_yg);
    A* we = ws.template get<A>(f_we);
    for (std::size_t e = 0; e < E; ++e) {
      const std::size_t r0 = static_cast<std::size_t>(r.off[e]);
      const std::size_t n = static_cast<std::size_t>(r.off[e + 1]) - r0;
      if (n == 0) continue;
      const expert<A> w = expert_weights(s, wg, wu, wd, e, we, ex);
      cpu::matmul(ex, xg + r0 * C, w.g, a + r0 * F, n, C, F, false, cpu::ld3{C, F, F}, pk);
      cpu::matmul(ex, xg + r0 * C, w.u, b + r0 * F, n, C, F, false, cpu::ld3{C, F, F}, pk);
      if constexpr (widened<S, A>) {  // backward sees the rounded values: use them here too
        cpu::narrow(ex, static_cast<const A*>(a + r0 * F), n * F, a_s + r0 * F);
        cpu::narrow(ex, static_cast<const A*>(b + r0 * F), n * F, b_s + r0 * F);
      }
      cpu::for_rows(ex, n, [&](std::size_t i) {
        cpu::swiglu_row(a_s + (r0 + i) * F, b_s + (r0 + i) * F, act + (r0 + i) * F, F);
      });
      cpu::matmul(ex, static_cast<const A*>(act + r0 * F), w.d, yg + r0 * C, n, F, C, false,
                  cpu::ld3{F, C, C}, pk);
    }
    // Combine, each token's choices in order; a token with none kept gets 0.
    A* ya = cpu::accum_target(y, ws.template get<A>(f_y));
    const std::size_t k = s.top_k;
    cpu::for_rows(ex, N, [&](std::size_t t) {
      A* yt = ya + t * C;
      std::fill(yt, yt + C, A(0));
      for (std::size_t j = 0; j < k; ++j) {
        const std::int32_t row = r.row[t * k + j];
        if (row < 0) continue;
        const A gj = r.g[t * k + j];
        const A* src = yg + static_cast<std::size_t>(row) * C;
        for (std::size_t c = 0; c < C; ++c) yt[c] += gj * src[c];
      }
    });
    if constexpr (widened<S, A>) cpu::narrow(ex, static_cast<const A*>(ya), N * C, y);
  }

  // dx overwritten; the weight gradients added (+=) to gwr, gwg, gwu, gwd.
  template <typename S, typename A>
  static void backward(const moe_shape& s, const S* wr, const S* wg, const S* wu, const S* wd,
                       const S* x, routing<A> r, const S* a_s, const S* b_s, const S* dy, S* dx,
                       S* gwr, S* gwg, S* gwu, S* gwd, void* workspace, std::size_t workspace_size,
                       thread_pool& ex) {
    const std::size_t threads = ex.size();
    const auto ws = carve(backward_layout<S, A>(s, threads), workspace, workspace_size);
    const std::size_t N = s.tokens(), C = s.width, F = s.hidden, E = s.experts, k = s.top_k;
    const std::span<std::byte> pk{ws.template get<std::byte>(b_gemm), threads * pack_bytes<A>(s)};
    const A* xa = cpu::widen_or_alias(ex, x, N * C, ws.template get<A>(b_x));
    const A* dya = cpu::widen_or_alias(ex, dy, N * C, ws.template get<A>(b_dy));
    A* xg = ws.template get<A>(b_xg);
    gather(s, xa, r, xg, ex);
    // dyg: each kept choice's dy row (its gate applied below, after u = dy·Wdᵀ).
    A* dyg = ws.template get<A>(b_dyg);
    gather(s, dya, r, dyg, ex);
    A* act = ws.template get<A>(b_act);
    A* da = ws.template get<A>(b_da);
    A* db = ws.template get<A>(b_db);
    A* tmp = ws.template get<A>(b_tmp);
    A* we = ws.template get<A>(b_we);
    A* dg = ws.template get<A>(b_dg);  // [N, k]: the gates' gradients; 0 for dropped choices
    std::fill(dg, dg + N * k, A(0));
    // Row i of the grouped buffer came from token src_t[i], choice src_j[i] (the inverse of row).
    std::int32_t* src = ws.template get<std::int32_t>(b_src);
    for (std::size_t t = 0; t < N; ++t)
      for (std::size_t j = 0; j < k; ++j)
        if (r.row[t * k + j] >= 0) src[r.row[t * k + j]] = static_cast<std::int32_t>(t * k + j);

    for (std::size_t e = 0; e < E; ++e) {
      const std::size_t r0 = static_cast<std::size_t>(r.off[e]);
      const std::size_t n = static_cast<std::size_t>(r.off[e + 1]) - r0;
      if (n == 0) continue;
      const expert<A> w = expert_weights(s, wg, wu, wd, e, we, ex);
      A* act_e = act + r0 * F;
      A* u = db + r0 * F;  // u = dy·Wdᵀ, ungated, then dact = g·u, then db in place
      cpu::for_rows(ex, n, [&](std::size_t i) {
        cpu::swiglu_row(a_s + (r0 + i) * F, b_s + (r0 + i) * F, act_e + i * F, F);
      });
      cpu::matmul_bt(ex, static_cast<const A*>(dyg + r0 * C), w.d, u, n, C, F, false,
                     cpu::ld3{C, C, F}, pk);
      cpu::for_rows(ex, n, [&](std::size_t i) {
        const std::size_t q = static_cast<std::size_t>(src[r0 + i]);
        const A gq = r.g[q];
        A dot = 0;
        A* ui = u + i * F;
        const A* ai = act_e + i * F;
        for (std::size_t f = 0; f < F; ++f) dot += ui[f] * ai[f];
        dg[q] = dot;
        for (std::size_t f = 0; f < F; ++f) ui[f] *= gq;
        A* di = dyg + (r0 + i) * C;
        for (std::size_t c = 0; c < C; ++c) di[c] *= gq;
      });
      // dWd_e += actᵀ·(g·dy)
      cpu::weight_grad(ex, static_cast<const A*>(act_e), static_cast<const A*>(dyg + r0 * C),
                       gwd + e * F * C, tmp, n, F, C, pk);
      // da, db from dact (in db's rows on entry)
      cpu::for_rows(ex, n, [&](std::size_t i) {
        cpu::swiglu_backward_row(a_s + (r0 + i) * F, b_s + (r0 + i) * F, da + (r0 + i) * F,
                                 db + (r0 + i) * F, F);
      });
      cpu::weight_grad(ex, static_cast<const A*>(xg + r0 * C), static_cast<const A*>(da + r0 * F),
                       gwg + e * C * F, tmp, n, C, F, pk);
      cpu::weight_grad(ex, static_cast<const A*>(xg + r0 * C), static_cast<const A*>(db + r0 * F),
                       gwu + e * C * F, tmp, n, C, F, pk);
      // dX rows = da·Wgᵀ + db·Wuᵀ, over dyg's rows (no longer needed)
      A* dxg = dyg + r0 * C;
      cpu::matmul_bt(ex, static_cast<const A*>(da + r0 * F), w.g, dxg, n, F, C, false,
                     cpu::ld3{F, F, C}, pk);
      cpu::matmul_bt(ex, static_cast<const A*>(db + r0 * F), w.u, dxg, n, F, C, true,
                     cpu::ld3{F, F, C}, pk);
    }

    // dx = Σ_j dX[row(t, j)], then the router's term dlogits·Wrᵀ.
    A* dxa = cpu::accum_target(dx, ws.template get<A>(b_dx));
    cpu::for_rows(ex, N, [&](std::size_t t) {
      A* d = dxa + t * C;
      std::fill(d, d + C, A(0));
      for (std::size_t j = 0; j < k; ++j) {
        const std::int32_t row = r.row[t * k + j];
        if (row < 0) continue;
        const A* sr = dyg + static_cast<std::size_t>(row) * C;
        for (std::size_t c = 0; c < C; ++c) d[c] += sr[c];
      }
    });
    A* dl = ws.template get<A>(b_dl);  // [N, E]: dp, then dlogits in place
    router_backward(s, r, dg, dl, ex);
    const A* wra = cpu::widen_or_alias(ex, wr, C * E, ws.template get<A>(b_wr));
    cpu::weight_grad(ex, xa, static_cast<const A*>(dl), gwr, tmp, N, C, E, pk);
    cpu::matmul_bt(ex, static_cast<const A*>(dl), wra, dxa, N, E, C, true, cpu::ld3{E, E, C}, pk);
    if constexpr (widened<S, A>) cpu::narrow(ex, static_cast<const A*>(dxa), N * C, dx);
  }

 private:
  static constexpr std::size_t too_large = std::numeric_limits<std::size_t>::max();
  template <typename S, typename A>
  static constexpr bool widened = !std::is_same_v<S, A>;

  // One choice's gate is its probability: renormalising it would make it 1 (Switch, k = 1).
  static constexpr bool renormalized(const moe_shape& s) noexcept { return s.renormalize && s.top_k > 1; }

  template <typename A>
  struct expert {
    const A *g, *u, *d;
  };
  // Expert e's three matrices in A: in place, or widened into `slot` (3·C·F).
  template <typename S, typename A>
  static expert<A> expert_weights(const moe_shape& s, const S* wg, const S* wu, const S* wd,
                                  std::size_t e, A* slot, thread_pool& ex) {
    const std::size_t CF = s.width * s.hidden;
    if constexpr (widened<S, A>) {
      cpu::widen(ex, wg + e * CF, CF, slot);
      cpu::widen(ex, wu + e * CF, CF, slot + CF);
      cpu::widen(ex, wd + e * CF, CF, slot + 2 * CF);
      return {slot, slot + CF, slot + 2 * CF};
    } else {
      (void)ex;
      (void)slot;
      return {wg + e * CF, wu + e * CF, wd + e * CF};
    }
  }

  // The router, the top-k, the gates and the dispatch (file comment); fills r and the stats.
  template <typename A>
  static void route(const moe_shape& s, const A* xa, const A* wra, routing<A> r,
                    std::span<std::byte> pk, thread_pool& ex, moe_stats* stats) {
    const std::size_t N = s.tokens(), C = s.width, E = s.experts, k = s.top_k;
    cpu::matmul(ex, xa, wra, r.p, N, C, E, false, cpu::ld3{C, E, E}, pk);
    cpu::for_rows(ex, N, [&](std::size_t t) {
      A* p = r.p + t * E;
      A m = p[0];
      for (std::size_t e = 1; e < E; ++e) m = std::max(m, p[e]);
      A sum = 0;
      for (std::size_t e = 0; e < E; ++e) sum += (p[e] = std::exp(p[e] - m));
      for (std::size_t e = 0; e < E; ++e) p[e] /= sum;
      // The k largest, in descending order; a tie goes to the lower expert (strict >).
      std::int32_t* ch = r.choice + t * k;
      for (std::size_t j = 0; j < k; ++j) {
        std::size_t best = E;
        for (std::size_t e = 0; e < E; ++e) {
          bool taken = false;
          for (std::size_t i = 0; i < j; ++i) taken = taken || ch[i] == static_cast<std::int32_t>(e);
          if (!taken && (best == E || p[e] > p[best])) best = e;
        }
        ch[j] = static_cast<std::int32_t>(best);
      }
      A gs = 0;
      for (std::size_t j = 0; j < k; ++j) gs += p[ch[j]];
      for (std::size_t j = 0; j < k; ++j) r.g[t * k + j] = renormalized(s) ? p[ch[j]] / gs : p[ch[j]];
    });
    // Dispatch: counts of kept choices per expert, in priority order, then their rows.
    const std::size_t cap = moe_capacity(s);
    std::int32_t* off = r.off;
    std::fill(off, off + E + 1, 0);
    std::size_t dropped = 0;
    for (std::size_t j = 0; j < k; ++j)
      for (std::size_t t = 0; t < N; ++t) {
        const auto e = static_cast<std::size_t>(r.choice[t * k + j]);
        if (static_cast<std::size_t>(off[e + 1]) < cap) {
          r.row[t * k + j] = off[e + 1]++;  // rank within the expert, made a row below
        } else {
          r.row[t * k + j] = -1;
          ++dropped;
        }
      }
    std::size_t max_rows = 0;
    for (std::size_t e = 0; e < E; ++e) {
      max_rows = std::max(max_rows, static_cast<std::size_t>(off[e + 1]));
      off[e + 1] += off[e];
    }
    std::size_t tokens_dropped = 0;
    for (std::size_t t = 0; t < N; ++t) {
      bool any = false;
      for (std::size_t j = 0; j < k; ++j) {
        std::int32_t& row = r.row[t * k + j];
        if (row >= 0) {
          row += off[r.choice[t * k + j]];
          any = true;
        }
      }
      tokens_dropped += any ? 0 : 1;
    }
    if (stats != nullptr) *stats = {aux_loss(s, r), N * k, dropped, N, tokens_dropped, max_rows};
  }

  // α · E · Σ_e f_e · P_e: f_e the fraction of the N tokens whose choices name e (before the
  // capacity, as Mixtral's load_balancing_loss_func counts them), P_e the mean probability.
  template <typename A>
  static double aux_loss(const moe_shape& s, routing<A> r) {
    if (s.aux_loss_weight == 0.0) return 0.0;
    const std::size_t N = s.tokens(), E = s.experts, k = s.top_k;
    double total = 0;
    for (std::size_t e = 0; e < E; ++e) {
      double f = 0, P = 0;
      for (std::size_t q = 0; q < N * k; ++q) f += r.choice[q] == static_cast<std::int32_t>(e) ? 1.0 : 0.0;
      for (std::size_t t = 0; t < N; ++t) P += static_cast<double>(r.p[t * E + e]);
      total += (f / static_cast<double>(N)) * (P / static_cast<double>(N));
    }
    return s.aux_loss_weight * static_cast<double>(E) * total;
  }

  // dl [N, E] = the router logits' gradient, from the gates' dg [N, k] and the balancing loss.
  template <typename A>
  static void router_backward(const moe_shape& s, routing<A> r, const A* dg, A* dl,
                              thread_pool& ex) {
    const std::size_t N = s.tokens(), E = s.experts, k = s.top_k;
    // The balancing loss's dL/dp[t, e] = α·E·f_e/N with f_e = count_e/N, the same for every token.
    const A scale = static_cast<A>(s.aux_loss_weight * static_cast<double>(E) /
                                   (static_cast<double>(N) * static_cast<double>(N)));
    cpu::for_rows(ex, N, [&](std::size_t t) {
      A* d = dl + t * E;
      const A* p = r.p + t * E;
      for (std::size_t e = 0; e < E; ++e) d[e] = 0;
      const std::int32_t* ch = r.choice + t * k;
      const A* g = r.g + t * k;
      const A* dgt = dg + t * k;
      if (renormalized(s)) {
        // g_j = p_j / Σ_l p_l: dp_j = (dg_j − Σ_l g_l·dg_l) / Σ_l p_l
        A gs = 0, gd = 0;
        for (std::size_t j = 0; j < k; ++j) {
          gs += p[ch[j]];
          gd += g[j] * dgt[j];
        }
        for (std::size_t j = 0; j < k; ++j) d[ch[j]] += (dgt[j] - gd) / gs;
      } else {
        for (std::size_t j = 0; j < k; ++j) d[ch[j]] += dgt[j];
      }
    });
    if (s.aux_loss_weight != 0.0) {
      for (std::size_t e = 0; e < E; ++e) {
        std::size_t f = 0;
        for (std::size_t q = 0; q < N * k; ++q) f += r.choice[q] == static_cast<std::int32_t>(e) ? 1 : 0;
        const A c = scale * static_cast<A>(f);
        for (std::size_t t = 0; t < N; ++t) dl[t * E + e] += c;
      }
    }
    // softmax backward: dlogit = p ⊙ (dp − Σ p·dp)
    cpu::for_rows(ex, N, [&](std::size_t t) {
      A* d = dl + t * E;
      const A* p = r.p + t * E;
      A dot = 0;
      for (std::size_t e = 0; e < E; ++e) dot += p[e] * d[e];
      for (std::size_t e = 0; e < E; ++e) d[e] = p[e] * (d[e] - dot);
    });
  }

  // Row i of the grouped buffer = v[token of row i], for every kept choice.
  template <typename A>
  static void gather(const moe_shape& s, const A* v, routing<A> r, A* out, thread_pool& ex) {
    const std::size_t C = s.width, k = s.top_k;
    cpu::for_rows(ex, s.tokens(), [&](std::size_t t) {
      for (std::size_t j = 0; j < k; ++j) {
        const std::int32_t row = r.row[t * k + j];
        if (row >= 0) std::copy(v + t * C, v + t * C + C, out + static_cast<std::size_t>(row) * C);
      }
    });
  }

  template <typename A>
  static constexpr std::size_t rows_a(const moe_shape& s, std::size_t cols) noexcept {
    return bytes_of<A>(moe_rows(s), cols);
  }
  template <typename S, typename A>
  static constexpr std::size_t x_acc(const moe_shape& s) noexcept {
    return widened<S, A> ? bytes_of<A>(s.tokens(), s.width) : 0;
  }
  template <typename S, typename A>
  static constexpr bool fits(const moe_shape& s, std::size_t threads) noexcept {
    const std::size_t b[] = {rows_a<A>(s, s.width), rows_a<A>(s, s.hidden),
                             bytes_of<A>(s.tokens(), s.width), bytes_of<A>(s.tokens(), s.experts),
                             bytes_of<A>(3 * s.width, s.hidden),
                             bytes_of<std::byte>(threads, pack_bytes<A>(s))};
    return detail::fits_layout(b);
  }
  // Per-thread packing bytes: the experts' products over at most `capacity` rows each, the
  // router's over every token.
  template <typename A>
  static constexpr std::size_t pack_bytes(const moe_shape& s) noexcept {
    const std::size_t N = s.tokens(), R = moe_capacity(s), C = s.width, F = s.hidden,
                      E = s.experts;
    return std::max({cpu::matmul_thread_scratch_bytes<A>(R, C, F),
                     cpu::matmul_thread_scratch_bytes<A>(R, F, C),
                     cpu::matmul_thread_scratch_bytes<A>(R, C, F),
                     cpu::matmul_at_thread_scratch_bytes<A>(R, F, C),
                     cpu::matmul_at_thread_scratch_bytes<A>(R, C, F),
                     cpu::matmul_thread_scratch_bytes<A>(N, C, E),
                     cpu::matmul_thread_scratch_bytes<A>(N, E, C),
                     cpu::matmul_at_thread_scratch_bytes<A>(N, C, E)});
  }
  template <typename S, typename A>
  static constexpr std::size_t we_bytes(const moe_shape& s) noexcept {
    return widened<S, A> ? bytes_of<A>(3 * s.width, s.hidden) : 0;
  }
  template <typename S, typename A>
  static constexpr std::size_t wr_bytes(const moe_shape& s) noexcept {
    return widened<S, A> ? bytes_of<A>(s.width, s.experts) : 0;
  }

  enum forward_slot : std::size_t { f_x, f_wr, f_xg, f_a, f_b, f_act, f_yg, f_we, f_y, f_gemm };
  template <typename S, typename A>
  static constexpr workspace_layout<10> forward_layout(const moe_shape& s, std::size_t threads) {
    workspace_layout<10> l;
    l.add(x_acc<S, A>(s));
    l.add(wr_bytes<S, A>(s));
    l.add(rows_a<A>(s, s.width));
    l.add(widened<S, A> ? rows_a<A>(s, s.hidden) : 0);
    l.add(widened<S, A> ? rows_a<A>(s, s.hidden) : 0);
    l.add(rows_a<A>(s, s.hidden));
    l.add(rows_a<A>(s, s.width));
    l.add(we_bytes<S, A>(s));
    l.add(x_acc<S, A>(s));
    l.add(bytes_of<std::byte>(threads, pack_bytes<A>(s)));
    return l;
  }
  enum backward_slot : std::size_t {
    b_x, b_dy, b_wr, b_xg, b_dyg, b_act, b_da, b_db, b_tmp, b_we, b_dg, b_src, b_dx, b_dl, b_gemm
  };
  template <typename S, typename A>
  static constexpr workspace_layout<15> backward_layout(const moe_shape& s, std::size_t threads) {
    const std::size_t N = s.tokens(), C = s.width, F = s.hidden, E = s.experts, k = s.top_k;
    workspace_layout<15> l;
    l.add(x_acc<S, A>(s));
    l.add(x_acc<S, A>(s));
    l.add(wr_bytes<S, A>(s));
    l.add(rows_a<A>(s, C));
    l.add(rows_a<A>(s, C));
    l.add(rows_a<A>(s, F));
    l.add(rows_a<A>(s, F));
    l.add(rows_a<A>(s, F));
    l.add(widened<S, A> ? bytes_of<A>(std::max(C * F, C * E)) : 0);
    l.add(we_bytes<S, A>(s));
    l.add(bytes_of<A>(N, k));
    l.add(bytes_of<std::int32_t>(moe_rows(s)));
    l.add(x_acc<S, A>(s));
    l.add(bytes_of<A>(N, E));
    l.add(bytes_of<std::byte>(threads, pack_bytes<A>(s)));
    return l;
  }
};

MEMBOUND_NAMESPACE_END
