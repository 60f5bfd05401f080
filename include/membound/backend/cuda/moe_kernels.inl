// The mixture-of-experts layer's kernels (the router's softmax and top-k, the dispatch in priority
// order, the gathers and combines, the gates' and the router's backward, the forward's statistics).
// A fragment, not a header: moe.cuh includes it inside namespace membound::gpu::moe_detail, and
// tests/emulation/moe_cuda_emulate.cpp includes the same text inside its emulation namespace,
// where the CUDA built-ins are host threads (tests/emulation/cuda_emulate.py moe). One text,
// compiled by nvcc and by the emulation: change the kernels here. Every sum runs in one thread in
// a fixed order (no atomics): repeated calls give the same bits. Kernels that take no type are
// templates all the same (template <int = 0>, launched as kernel<>): a header's plain __global__
// would be an external symbol in every nvcc unit that includes it.

// The router, one thread per token: p = softmax(logits) in place, the k largest in descending
// order (a tie to the lower expert), gates g = p of those, divided by their sum when renorm.
template <int = 0>
__global__ void moe_route_kernel(float* p, std::int32_t* choice, float* g, std::size_t N, std::size_t E,
                                 std::size_t k, bool renorm) {
  for (std::size_t t = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; t < N;
       t += std::size_t{gridDim.x} * blockDim.x) {
    float* pt = p + t * E;
    float m = pt[0];
    for (std::size_t e = 1; e < E; ++e) m = fmaxf(m, pt[e]);
    float sum = 0.0f;
    for (std::size_t e = 0; e < E; ++e) sum += (pt[e] = expf(pt[e] - m));
    for (std::size_t e = 0; e < E; ++e) pt[e] /= sum;
    std::int32_t* ch = choice + t * k;
    for (std::size_t j = 0; j < k; ++j) {
      std::size_t best = E;
      for (std::size_t e = 0; e < E; ++e) {
        bool taken = false;
        for (std::size_t i = 0; i < j; ++i) taken = taken || ch[i] == static_cast<std::int32_t>(e);
        if (!taken && (best == E || pt[e] > pt[best])) best = e;
      }
      ch[j] = static_cast<std::int32_t>(best);
    }
    float gs = 0.0f;
    for (std::size_t j = 0; j < k; ++j) gs += pt[ch[j]];
    for (std::size_t j = 0; j < k; ++j) g[t * k + j] = renorm ? pt[ch[j]] / gs : pt[ch[j]];
  }
}

// The dispatch, one thread per expert e: e's choices in priority order (every token's first
// choice before any second, tokens in order), the first `cap` kept at ranks 0, 1, ... within e
// (moe_rows_kernel makes them rows), the rest dropped (row −1). off[e + 1] = e's kept choices
// (moe_offsets_kernel sums them), named[e] = every choice of e, kept or not (the balancing loss's
// count). A choice belongs to one expert, so each row is written by one thread.
template <int = 0>
__global__ void moe_dispatch_kernel(const std::int32_t* choice, std::int32_t* row, std::int32_t* off,
                                    std::int32_t* named, std::size_t N, std::size_t E, std::size_t k,
                                    std::size_t cap) {
  for (std::size_t e = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; e < E;
       e += std::size_t{gridDim.x} * blockDim.x) {
    std::int32_t kept = 0, all = 0;
    for (std::size_t j = 0; j < k; ++j)
      for (std::size_t t = 0; t < N; ++t) {
        const std::size_t q = t * k + j;
        if (choice[q] != static_cast<std::int32_t>(e)) continue;
        ++all;
        row[q] = static_cast<std::size_t>(kept) < cap ? kept++ : -1;
      }
    off[e + 1] = kept;
    named[e] = all;
    if (e == 0) off[0] = 0;
  }
}

// named[e] = the choices that name expert e (the balancing loss's count), one thread per expert.
template <int = 0>
__global__ void moe_count_kernel(const std::int32_t* choice, std::int32_t* named, std::size_t Nk, std::size_t E) {
  for (std::size_t e = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; e < E;
       e += std::size_t{gridDim.x} * blockDim.x) {
    std::int32_t all = 0;
    for (std::size_t q = 0; q < Nk; ++q) all += choice[q] == static_cast<std::int32_t>(e) ? 1 : 0;
    named[e] = all;
  }
}

// off[e + 1] += off[e] in order (one thread): expert e's rows are [off[e], off[e + 1]).
template <int = 0>
__global__ void moe_offsets_kernel(std::int32_t* off, std::size_t E) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  for (std::size_t e = 0; e < E; ++e) off[e + 1] += off[e];
}

// A kept choice's rank within its expert made its row: row += off[choice], one thread per choice.
template <int = 0>
__global__ void moe_rows_kernel(const std::int32_t* choice, std::int32_t* row, const std::int32_t* off,
                                std::size_t n) {
  for (std::size_t q = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; q < n;
       q += std::size_t{gridDim.x} * blockDim.x) {
    if (row[q] >= 0) row[q] += off[choice[q]];
  }
}

// The forward's statistics (one thread): the balancing loss α·E·Σ_e (named_e/N)·(P_e/N) with
// P_e = Σ_t p[t, e] in double, tokens in order (the CPU's sums), the dropped choices, the tokens
// all of whose choices were dropped, and the most rows any expert kept.
struct moe_device_stats {
  double aux;
  std::int64_t dropped, tokens_dropped, max_rows;
};
template <int = 0>
__global__ void moe_stats_kernel(const float* p, const std::int32_t* named, const std::int32_t* row,
                                 const std::int32_t* off, std::size_t N, std::size_t E, std::size_t k,
                                 double aux_weight, moe_device_stats* out) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  double total = 0.0;
  std::int64_t max_rows = 0;
  for (std::size_t e = 0; e < E; ++e) {
    double P = 0.0;
    for (std::size_t t = 0; t < N; ++t) P += static_cast<double>(p[t * E + e]);
    total += (static_cast<double>(named[e]) / static_cast<double>(N)) * (P / static_cast<double>(N));
    const std::int64_t rows = off[e + 1] - off[e];
    max_rows = rows > max_rows ? rows : max_rows;
  }
  std::int64_t tokens_dropped = 0;
  for (std::size_t t = 0; t < N; ++t) {
    bool any = false;
    for (std::size_t j = 0; j < k; ++j) any = any || row[t * k + j] >= 0;
    tokens_dropped += any ? 0 : 1;
  }
  out->aux = aux_weight == 0.0 ? 0.0 : aux_weight * static_cast<double>(E) * total;
  out->dropped = static_cast<std::int64_t>(N * k) - off[E];
  out->tokens_dropped = tokens_dropped;
  out->max_rows = max_rows;
}

// out[row(q), ·] = v[token of q, ·] for every kept choice q (C values a row), in S.
template <typename S>
__global__ void moe_gather_kernel(const S* v, const std::int32_t* row, S* out, std::size_t Nk,
                                  std::size_t k, std::size_t C) {
  const std::size_t total = Nk * C;
  for (std::size_t idx = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; idx < total;
       idx += std::size_t{gridDim.x} * blockDim.x) {
    const std::size_t q = idx / C, c = idx % C;
    const std::int32_t r = row[q];
    if (r >= 0) st(out, static_cast<std::size_t>(r) * C + c, ld(v, (q / k) * C + c));
  }
}

// y[t, c] = Σ_j g[t, j]·yg[row(t, j), c] over the kept choices, j in order (0 when none); y in S.
template <typename S>
__global__ void moe_combine_kernel(const float* yg, const std::int32_t* row, const float* g, S* y,
                                   std::size_t N, std::size_t k, std::size_t C) {
  const std::size_t total = N * C;
  for (std::size_t idx = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; idx < total;
       idx += std::size_t{gridDim.x} * blockDim.x) {
    const std::size_t t = idx / C, c = idx % C;
    float v = 0.0f;
    for (std::size_t j = 0; j < k; ++j) {
      const std::int32_t r = row[t * k + j];
      if (r >= 0) v += g[t * k + j] * yg[static_cast<std::size_t>(r) * C + c];
    }
    st(y, idx, v);
  }
}

// Backward: src[row(q)] = q for every kept choice (the choice each grouped row came from).
template <int = 0>
__global__ void moe_sources_kernel(const std::int32_t* row, std::int32_t* src, std::size_t Nk) {
  for (std::size_t q = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; q < Nk;
       q += std::size_t{gridDim.x} * blockDim.x) {
    if (row[q] >= 0) src[row[q]] = static_cast<std::int32_t>(q);
  }
}

// The gates' backward, one thread per kept row i (its choice q = src[i]): dg[q] = u_i·act_i (u =
// dy·Wdᵀ of the row, ungated), then dact_i = g_q·u_i (S: the SwiGLU backward's input) and the
// row's dy scaled by g_q in place (S: dWd's operand).
template <typename S>
__global__ void moe_gate_backward_kernel(const float* u, const S* act, const std::int32_t* src,
                                         const float* g, float* dg, S* dact, S* dyg, std::size_t rows,
                                         std::size_t F, std::size_t C) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < rows;
       i += std::size_t{gridDim.x} * blockDim.x) {
    const std::size_t q = static_cast<std::size_t>(src[i]);
    const float gq = g[q];
    float dot = 0.0f;
    for (std::size_t f = 0; f < F; ++f) dot += u[i * F + f] * ld(act, i * F + f);
    dg[q] = dot;
    for (std::size_t f = 0; f < F; ++f) st(dact, i * F + f, gq * u[i * F + f]);
    for (std::size_t c = 0; c < C; ++c) st(dyg, i * C + c, gq * ld(dyg, i * C + c));
  }
}

// dx[t, c] = Σ_j dxg[row(t, j), c] over the kept choices, j in order (0 when none), fp32.
template <int = 0>
__global__ void moe_scatter_back_kernel(const float* dxg, const std::int32_t* row, float* dx,
                                        std::size_t N, std::size_t k, std::size_t C) {
  const std::size_t total = N * C;
  for (std::size_t idx = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; idx < total;
       idx += std::size_t{gridDim.x} * blockDim.x) {
    const std::size_t t = idx / C, c = idx % C;
    float v = 0.0f;
    for (std::size_t j = 0; j < k; ++j) {
      const std::int32_t r = row[t * k + j];
      if (r >= 0) v += dxg[static_cast<std::size_t>(r) * C + c];
    }
    dx[idx] = v;
  }
}

// The router's backward, one thread per token: dl[t, ·] = the logits' gradient from the gates'
// dg [N, k] (through the renormalisation when renorm), plus the balancing loss's
// aux_scale·named[e] on every p[t, e] (aux_scale = α·E/N²), then the softmax's backward.
template <int = 0>
__global__ void moe_router_backward_kernel(const float* p, const std::int32_t* choice, const float* g,
                                           const float* dg, const std::int32_t* named, float aux_scale,
                                           float* dl, std::size_t N, std::size_t E, std::size_t k,
                                           bool renorm) {
  for (std::size_t t = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; t < N;
       t += std::size_t{gridDim.x} * blockDim.x) {
    float* d = dl + t * E;
    const float* pt = p + t * E;
    for (std::size_t e = 0; e < E; ++e) d[e] = 0.0f;
    const std::int32_t* ch = choice + t * k;
    const float* gt = g + t * k;
    const float* dgt = dg + t * k;
    if (renorm) {
      // g_j = p_j / Σ_l p_l: dp_j = (dg_j − Σ_l g_l·dg_l) / Σ_l p_l
      float gs = 0.0f, gd = 0.0f;
      for (std::size_t j = 0; j < k; ++j) {
        gs += pt[ch[j]];
        gd += gt[j] * dgt[j];
      }
      for (std::size_t j = 0; j < k; ++j) d[ch[j]] += (dgt[j] - gd) / gs;
    } else {
      for (std::size_t j = 0; j < k; ++j) d[ch[j]] += dgt[j];
    }
    if (aux_scale != 0.0f) {
      for (std::size_t e = 0; e < E; ++e) d[e] += aux_scale * static_cast<float>(named[e]);
    }
    float dot = 0.0f;
    for (std::size_t e = 0; e < E; ++e) dot += pt[e] * d[e];
    for (std::size_t e = 0; e < E; ++e) d[e] = pt[e] * (d[e] - dot);
  }
}
