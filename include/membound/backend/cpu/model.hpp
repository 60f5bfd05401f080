// CPU kernels of the model's glue: RMSNorm, the SwiGLU nonlinearity, the embedding's gather and
// scatter, and one chunk of the fused cross-entropy. Rows run in parallel; every reduction over
// rows (norm scale gradients, embedding gradients) goes through per-row-block partials summed in
// a fixed order, so results do not depend on which thread ran what.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "membound/backend/cpu/gemm.hpp"
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/core/element_math.hpp"
#include "membound/core/parallel.hpp"
#include "membound/policy/backend.hpp"
#include "membound/shape/lm_head_shape.hpp"
#include "membound/shape/offload_chunks.hpp"

MEMBOUND_NAMESPACE_BEGIN

namespace cpu {

// Per-row-block partial sums of a [C] reduction over N rows: how many A values the scratch holds.
constexpr std::size_t row_partials(std::size_t N, std::size_t C) noexcept {
  return blocks(N, row_block) * C;
}

// y = x · rstd · g with rstd = 1/sqrt(mean(x²) + eps); rstd [N] kept for backward. Reads S,
// computes in A, writes y as S (so a recompute from x and rstd gives the same bits).
template <typename A, typename S>
void rmsnorm_forward(thread_pool& pool, const S* x, const S* g, S* y, A* rstd, std::size_t N,
                     std::size_t C, double eps) {
  for_rows(pool, N, [&](std::size_t n) {
    const S* xr = x + n * C;
    const A ss = lane_sum<A>(C, [&](std::size_t c) {
      const A v = load_accum<A>(xr[c]);
      return v * v;
    });
    const A r = A(1) / std::sqrt(ss / A(C) + A(eps));
    rstd[n] = r;
    S* yr = y + n * C;
    for (std::size_t c = 0; c < C; ++c)
      yr[c] = store_accum<S>(load_accum<A>(xr[c]) * r * load_accum<A>(g[c]));
  });
}

// The same normalization from a kept rstd (backward's recompute of the norm's output).
template <typename A, typename S>
void rmsnorm_apply(thread_pool& pool, const S* x, const S* g, const A* rstd, S* y, std::size_t N,
                   std::size_t C) {
  for_rows(pool, N, [&](std::size_t n) {
    const A r = rstd[n];
    const S* xr = x + n * C;
    S* yr = y + n * C;
    for (std::size_t c = 0; c < C; ++c)
      yr[c] = store_accum<S>(load_accum<A>(xr[c]) * r * load_accum<A>(g[c]));
  });
}

// dx = residual + rstd·(dy⊙g) − x·rstd³/C·Σ(dy⊙g⊙x)  (residual may be null), and dg += Σ_n dy⊙x·rstd.
// partial: row_partials(N, C) values of scratch.
template <typename A, typename S>
void rmsnorm_backward(thread_pool& pool, const S* x, const S* g, const A* rstd, const S* dy,
                      const S* residual, S* dx, S* dg, A* partial, std::size_t N, std::size_t C) {
  const std::size_t nb = blocks(N, row_block);
  pool.parallel_for(nb, [&](std::size_t blk, std::size_t) {
    const std::size_t r0 = blk * row_block, r1 = std::min(N, r0 + row_block);
    A* part = partial + blk * C;
    std::fill(part, part + C, A(0));
    for (std::size_t n = r0; n < r1; ++n) {
      const S* xr = x + n * C;
      const S* dr = dy + n * C;
      const A r = rstd[n];
      const A dot = lane_sum<A>(C, [&](std::size_t c) {
        return load_accum<A>(dr[c]) * load_accum<A>(g[c]) * load_accum<A>(xr[c]);
      });
      for (std::size_t c = 0; c < C; ++c) part[c] += load_accum<A>(dr[c]) * load_accum<A>(xr[c]) * r;
      const A k = r * r * r * dot / A(C);
      S* dxr = dx + n * C;
      if (residual != nullptr) {
        const S* rr = residual + n * C;
        for (std::size_t c = 0; c < C; ++c)
          dxr[c] = store_accum<S>(r * load_accum<A>(dr[c]) * load_accum<A>(g[c]) -
                                  load_accum<A>(xr[c]) * k + load_accum<A>(rr[c]));
      } else {
        for (std::size_t c = 0; c < C; ++c)
          dxr[c] = store_accum<S>(r * load_accum<A>(dr[c]) * load_accum<A>(g[c]) -
                                  load_accum<A>(xr[c]) * k);
      }
    }
  });
  for (std::size_t c = 0; c < C; ++c) {
    A s = 0;
    for (std::size_t b = 0; b < nb; ++b) s += partial[b * C + c];
    dg[c] = from_accum<S>(to_accum<A>(dg[c]) + s);
  }
}

// y = a + b elementwise, one rounding (the residual adds).
template <typename A, typename S>
void add_rows(thread_pool& pool, const S* a, const S* b, S* y, std::size_t N, std::size_t C) {
  for_rows(pool, N, [&](std::size_t n) {
    for (std::size_t c = 0; c < C; ++c)
      y[n * C + c] = store_accum<S>(load_accum<A>(a[n * C + c]) + load_accum<A>(b[n * C + c]));
  });
}

// One row of the SwiGLU gate, act = SiLU(a)·b = a/(1 + e^−a)·b, with Eigen's vectorized exp
// (element_math.hpp's scalar formula, same operations; the exp is Eigen's, not std::exp).
template <typename S, typename A>
void swiglu_row(const S* a, const S* b, A* act, std::size_t F) {
  using array = Eigen::Array<A, Eigen::Dynamic, 1>;
  using storage = Eigen::Array<S, Eigen::Dynamic, 1>;
  const auto n = static_cast<Eigen::Index>(F);
  const auto av = Eigen::Map<const storage>(a, n).template cast<A>();
  const auto bv = Eigen::Map<const storage>(b, n).template cast<A>();
  Eigen::Map<array>(act, n) = av / (A(1) + (-av).exp()) * bv;
}
// Its backward, with dact in db on entry: s = σ(a) = 1/(1 + e^−a), da = dact·s·b·(1 + a·(1 − s)),
// db = dact·s·a (one exp per element, as swiglu_backward).
template <typename S, typename A>
void swiglu_backward_row(const S* a, const S* b, A* da, A* db, std::size_t F) {
  using array = Eigen::Array<A, Eigen::Dynamic, 1>;
  using storage = Eigen::Array<S, Eigen::Dynamic, 1>;
  const auto n = static_cast<Eigen::Index>(F);
  const auto av = Eigen::Map<const storage>(a, n).template cast<A>();
  const auto bv = Eigen::Map<const storage>(b, n).template cast<A>();
  Eigen::Map<array> s(da, n), g(db, n);
  s = (A(1) + (-av).exp()).inverse();
  g = g * s;                               // dact·s
  s = g * bv * (A(1) + av * (A(1) - s));   // da
  g = g * av;                              // db
}

// x0[n] = table[tokens[n]]; the ids were checked by the caller.
template <typename S>
void embedding_gather(thread_pool& pool, const std::int32_t* tokens, const S* table, S* x,
                      std::size_t N, std::size_t C) {
  for_rows(pool, N, [&](std::size_t n) {
    const S* src = table + static_cast<std::size_t>(tokens[n]) * C;
    std::copy(src, src + C, x + n * C);
  });
}

// dtable[tokens[n]] += dx[n]. Parallel over column blocks, each walking the tokens in order, so
// repeated tokens add in the same order for every thread count.
template <typename A, typename S>
void embedding_scatter(thread_pool& pool, const std::int32_t* tokens, const S* dx, S* dtable,
                       std::size_t N, std::size_t C) {
  constexpr std::size_t cols = 64;
  pool.parallel_for(blocks(C, cols), [&](std::size_t blk, std::size_t) {
    const std::size_t c0 = blk * cols, c1 = std::min(C, c0 + cols);
    for (std::size_t n = 0; n < N; ++n) {
      S* dst = dtable + static_cast<std::size_t>(tokens[n]) * C;
      for (std::size_t c = c0; c < c1; ++c)
        dst[c] = from_accum<S>(to_accum<A>(dst[c]) + to_accum<A>(dx[n * C + c]));
    }
  });
}

// One chunk of the fused cross-entropy: logits [R, V] (in place) become the gradient
// scale·(softmax − onehot); returns Σ_rows −log softmax[target] in double.
template <typename A>
double cross_entropy_chunk(thread_pool& pool, A* logits, const std::int32_t* targets,
                           std::size_t R, std::size_t V, A scale, double* row_loss) {
  for_rows(pool, R, [&](std::size_t r) {
    A* l = logits + r * V;
    if (targets[r] == ignore_target) {  // no loss, no gradient
      row_loss[r] = 0.0;
      std::fill(l, l + V, A(0));
      return;
    }
    A m = -std::numeric_limits<A>::infinity();
    for (std::size_t v = 0; v < V; ++v) m = std::max(m, l[v]);
    const std::size_t t = static_cast<std::size_t>(targets[r]);
    const A shifted_t = l[t] - m;  // log-sum-exp form: no log(0) when p[target] underflows
    A sum = 0;
    for (std::size_t v = 0; v < V; ++v) {
      l[v] = std::exp(l[v] - m);
      sum += l[v];
    }
    row_loss[r] = std::log(static_cast<double>(sum)) - static_cast<double>(shifted_t);
    const A inv = scale / sum;
    for (std::size_t v = 0; v < V; ++v) l[v] *= inv;
    l[t] -= scale;
  });
  double total = 0;  // fixed order: the loss is the same for every thread count
  for (std::size_t r = 0; r < R; ++r) total += row_loss[r];
  return total;
}

// The sum of squares of a gradient array, in double (double sums in fixed blocks from g: the same
// value for every thread count). inf or NaN anywhere gives a non-finite result. Over ranks the
// trainer adds each rank shard's sum in rank order, so ZeRO-0 and ZeRO-1 get the same bits.
template <typename S>
double sum_squares(const S* g, std::size_t n, thread_pool& pool) {
  constexpr std::size_t block = 1 << 14;
  const std::size_t nb = (n + block - 1) / block;
  std::vector<double> part(nb, 0.0);
  pool.parallel_for(nb, [&](std::size_t b, std::size_t) {
    const std::size_t i0 = b * block, i1 = std::min(n, i0 + block);
    double s = 0;
    for (std::size_t i = i0; i < i1; ++i) {
      const double v = static_cast<double>(to_accum<float>(g[i]));
      s += v * v;
    }
    part[b] = s;
  });
  double s = 0;
  for (double v : part) s += v;
  return s;
}

// The global L2 norm of a gradient array: sqrt(sum_squares).
template <typename S>
double global_norm(const S* g, std::size_t n, thread_pool& pool) {
  return std::sqrt(sum_squares(g, n, pool));
}

}  // namespace cpu

// The model's glue on the host (model/glue.hpp names the interface; backend/cuda/model.cuh
// has the device's).
template <>
struct backend_kernels<cpu_backend, model_glue> {
  using executor = thread_pool;

  template <typename A, typename S>
  static constexpr std::size_t norm_backward_scratch_bytes(std::size_t N, std::size_t C) noexcept {
    return bytes_of<A>(cpu::row_partials(N, C));
  }
  template <typename A, typename S>
  static void rmsnorm_forward(thread_pool& pool, const S* x, const S* g, S* y, A* rstd, std::size_t N,
                              std::size_t C, double eps) {
    cpu::rmsnorm_forward(pool, x, g, y, rstd, N, C, eps);
  }
  template <typename A, typename S>
  static void rmsnorm_apply(thread_pool& pool, const S* x, const S* g, const A* rstd, S* y, std::size_t N,
                            std::size_t C) {
    cpu::rmsnorm_apply(pool, x, g, rstd, y, N, C);
  }
  // dx = residual + RMSNorm'ᵀ(dy), dg += its scale gradient; scratch: norm_backward_scratch_bytes.
  template <typename A, typename S>
  static void rmsnorm_backward(thread_pool& pool, const S* x, const S* g, const A* rstd, const S* dy,
                               const S* residual, S* dx, S* dg, void* scratch, std::size_t N, std::size_t C) {
    cpu::rmsnorm_backward(pool, x, g, rstd, dy, residual, dx, dg, static_cast<A*>(scratch), N, C);
  }
  template <typename A, typename S>
  static void add_rows(thread_pool& pool, const S* a, const S* b, S* y, std::size_t N, std::size_t C) {
    cpu::add_rows<A>(pool, a, b, y, N, C);
  }
  // The ids were checked against V before (model::check_tokens): V is the device's bound only.
  template <typename A, typename S>
  static void embedding_gather(thread_pool& pool, const std::int32_t* tokens, const S* table, S* x, std::size_t N,
                               std::size_t C, std::size_t /*V*/) {
    cpu::embedding_gather(pool, tokens, table, x, N, C);
  }
  template <typename A, typename S>
  static void embedding_scatter(thread_pool& pool, const std::int32_t* tokens, const S* dx, S* dtable,
                                std::size_t N, std::size_t C, std::size_t /*V*/) {
    cpu::embedding_scatter<A>(pool, tokens, dx, dtable, N, C);
  }

  // What a trainer keeps in the backend's memory beyond weights, gradients and optimizer state,
  // for steps of `tokens` tokens over n parameters. None on the host: the tokens stay in the
  // trainer's vectors and the gradient norm is a double on the stack.
  static constexpr std::size_t step_buffer_bytes(std::size_t /*tokens*/, std::size_t /*n*/) noexcept { return 0; }

  // ---- The trainer's memory moves: this backend's memory is the host's, so they write and read
  // in place, complete on return (the device's copy through its stream).
  static void fill_zero(thread_pool&, void* p, std::size_t bytes) noexcept {
    if (bytes != 0) std::memset(p, 0, bytes);
  }
  static void synchronize(thread_pool&) noexcept {}
  // fill(p) writes `bytes` at dst; p is dst itself.
  template <typename Fill>
  static void write_via_host(thread_pool&, void* dst, std::size_t /*bytes*/, Fill&& fill) {
    fill(dst);
  }
  // read(p) reads `bytes` at src; p is src itself.
  template <typename Read>
  static void read_via_host(thread_pool&, const void* src, std::size_t /*bytes*/, Read&& read) {
    read(src);
  }
  // A step's ids are read where the trainer keeps them: nothing to stage.
  static void stage_ids(thread_pool&, void* /*buffers*/, const std::int32_t* /*tokens*/,
                        const std::int32_t* /*targets*/, std::size_t /*n*/,
                        std::size_t /*step_tokens*/) noexcept {}
  static const std::int32_t* staged_tokens(const void* /*buffers*/, const std::int32_t* host) noexcept {
    return host;
  }
  static const std::int32_t* staged_targets(const void* /*buffers*/, const std::int32_t* host,
                                            std::size_t /*step_tokens*/) noexcept {
    return host;
  }

  // ---- The trainer's arithmetic -----------------------------------------------------------------
  // sqrt(Σ g²) over n gradients in double (fixed blocks: the same bits for every thread count);
  // the device's takes its step buffers, the host needs none.
  template <typename S>
  static double gradient_norm(thread_pool& ex, const S* g, std::size_t n, void* /*buffers*/,
                              std::size_t /*tokens*/) {
    return cpu::global_norm(g, n, ex);
  }
  // Σ g² over `count` gradients of a shard (data parallel: each rank's part of the norm).
  template <typename S>
  static double sum_squares(thread_pool& ex, const S* g, std::size_t count, void* /*buffers*/,
                            std::size_t /*tokens*/, std::size_t /*n*/) {
    return cpu::sum_squares(g, count, ex);
  }
  // Every optimizer steps here, over any spans (the device takes adamw and adamw8bit).
  template <typename Optimizer, typename Spans>
  static void check_optimizer_spans(const Spans& /*spans*/) noexcept {}
  // The trainer's optimizer step: the optimizer's own host update.
  template <typename Optimizer, typename S, typename Spans, typename Step>
  static void optimizer_update(thread_pool& ex, S* w, const S* g, void* state,
                               std::size_t /*state_bytes*/, std::size_t n, Spans spans,
                               const Step& step) {
    Optimizer::update(w, g, state, n, spans, step, ex);
  }
  // Optimizer offload (planner: offload_options) runs here. The state is in the host space;
  // chunk by chunk (offload_chunks: the device's schedule, here in turn) the gradients and weights
  // are copied into a slot of its staging buffers (a device's copies to the host; here between the
  // two host arenas), updated there by update_range, and the weights copied back: the bits of
  // optimizer_update.
  static constexpr bool offloads_optimizer = true;
  template <typename Optimizer, typename S, typename Spans, typename Step>
  static void offloaded_update(thread_pool& ex, S* w, const S* g, void* host_state, std::size_t n, Spans spans,
                               const Step& step, S* stage_w, S* stage_g, std::size_t bucket) {
    const offload_chunks k = offload_chunks::of(n, bucket, Optimizer::range_granule);
    for (std::size_t c = 0; c < k.count; ++c) {
      S* const sw = stage_w + k.slot_offset(c);
      S* const sg = stage_g + k.slot_offset(c);
      std::memcpy(sg, g + k.first(c), k.size(c) * sizeof(S));
      std::memcpy(sw, w + k.first(c), k.size(c) * sizeof(S));
      Optimizer::update_range(sw, sg, host_state, n, k.first(c), k.size(c), spans, step, ex);
      std::memcpy(w + k.first(c), sw, k.size(c) * sizeof(S));
    }
  }

  // Activation offload (planner: offload_options::activations) runs here: a kept block input
  // moves to the host space in forward and back before its segment's backward (a device's copies
  // to and from pinned memory; here between the two host arenas).
  static constexpr bool offloads_activations = true;
  static void offload_copy(thread_pool&, void* dst, const void* src, std::size_t bytes) noexcept {
    if (bytes != 0) std::memcpy(dst, src, bytes);
  }

  // Token ids where the host can read them without a copy: here, the caller's own (the model
  // checks them against the vocabulary before any work).
  static const std::int32_t* host_ids(const std::int32_t* ids) noexcept { return ids; }
  // `n` elements at p readable on the host: p itself (nothing is copied; `buffer` stays empty).
  template <typename S>
  static const S* host_view(thread_pool&, const S* p, std::size_t /*n*/, std::vector<S>& /*buffer*/) noexcept {
    return p;
  }
};

MEMBOUND_NAMESPACE_END
