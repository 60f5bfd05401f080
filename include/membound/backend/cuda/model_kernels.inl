// The model's bandwidth-bound kernels: RMSNorm forward and backward, the elementwise maps, the
// embedding gather, the fused cross-entropy, the gradient norm's first pass and AdamW's step.
// A fragment, not a header: model.cuh includes it inside namespace membound::gpu::detail, and
// tests/emulation/model_cuda_emulate.cpp includes the same text inside its emulation namespace,
// where the CUDA built-ins are host threads (tests/emulation/cuda_emulate.py model). One text,
// compiled by nvcc and by the emulation: change the kernels here.
//
// The includer provides ld/st, ld_vec/st_vec and raw16 (backend/cuda/storage.cuh), lane_xor,
// ignore_target and model_smem() (the CTA's dynamic shared memory).
//
// Values move in groups of G = 16 / sizeof(S) elements (4 floats, 8 bf16 or fp16): a thread takes
// whole groups, as one 16-byte access each when the launcher found the buffers aligned (Vec).
// RMSNorm's forward takes a row's elements in groups of W: W = G when the row is a whole number of
// groups, else W = 1 (lane l takes elements l, l + 32, ...: each warp access coalesced, where G
// consecutive elements per lane would be 32 strided ones). W depends on the sizes alone, and with
// W = G the element path keeps the 16-byte path's order: every sum has one shape for given sizes,
// whatever the buffers' alignment. RMSNorm's backward and the cross-entropy take groups always
// (element by element where the row is not whole groups or the buffers are unaligned: faster
// there than W = 1, on the H200). The elementwise maps (no sums) take
// groups on the 16-byte path and single elements, grid-strided, otherwise.

template <typename S>
inline constexpr unsigned group_of = static_cast<unsigned>(16 / sizeof(S));

// p[i .. i + G) as floats; the elements at or past n read as 0. A group that n cuts (the last
// of an elementwise map) goes element by element on either path.
template <bool Vec, unsigned G, typename S>
__device__ inline void load_group(const S* p, std::size_t i, std::size_t n, float (&v)[G]) {
  if constexpr (Vec) {
    if (i + G <= n) {
      ld_vec<G>(p, i, v);
      return;
    }
  }
#pragma unroll
  for (unsigned k = 0; k < G; ++k) v[k] = i + k < n ? ld(p, i + k) : 0.0f;
}

// p[i .. min(i + G, n)) = v (rounded to S).
template <bool Vec, unsigned G, typename S>
__device__ inline void store_group(S* p, std::size_t i, std::size_t n, const float (&v)[G]) {
  if constexpr (Vec) {
    if (i + G <= n) {
      st_vec<G>(p, i, v);
      return;
    }
  }
#pragma unroll
  for (unsigned k = 0; k < G; ++k) {
    if (i + k < n) st(p, i + k, v[k]);
  }
}

// Σ over the warp's 32 lanes, every lane the same bits (a butterfly: lanes l and l ^ m add the
// same two numbers at each step, and a + b == b + a).
template <typename T>
__device__ inline T warp_sum(T v) {
#pragma unroll
  for (unsigned m = 16; m >= 1; m /= 2) v += lane_xor(v, m);
  return v;
}

// --- RMSNorm ---------------------------------------------------------------------------------------

// Warp w of CTA b takes row 8b + w: rstd = 1/sqrt(mean(x²) + eps) (when compute; else the kept
// rstd[n]), y = x·rstd·g. Lane l takes the groups l, l + 32, ...; the second pass re-reads the row
// from L1/L2. The expression of y is the one rmsnorm_apply recomputes it by: the same bits.
template <unsigned W, bool Vec, typename S>
__global__ void __launch_bounds__(row_cta_threads)
    rmsnorm_rows_kernel(const S* x, const S* g, S* y, float* rstd, std::size_t N, std::size_t C, float eps,
                        bool compute) {
  constexpr unsigned G = W;
  const std::size_t n = std::size_t{blockIdx.x} * row_warps + threadIdx.x / 32;
  const std::size_t lane = threadIdx.x % 32;
  if (n >= N) return;  // the whole warp; no CTA barrier below
  const S* xr = x + n * C;
  S* yr = y + n * C;
  float r;
  if (compute) {
    float ss = 0;
    for (std::size_t c = lane * G; c < C; c += 32 * G) {
      float v[G];
      load_group<Vec, G>(xr, c, C, v);
#pragma unroll
      for (unsigned k = 0; k < G; ++k) ss += v[k] * v[k];
    }
    ss = warp_sum(ss);
    r = 1.0f / sqrtf(ss / static_cast<float>(C) + eps);
    if (lane == 0) rstd[n] = r;
  } else {
    r = rstd[n];
  }
  for (std::size_t c = lane * G; c < C; c += 32 * G) {
    float v[G], w[G];
    load_group<Vec, G>(xr, c, C, v);
    load_group<Vec, G>(g, c, C, w);
#pragma unroll
    for (unsigned k = 0; k < G; ++k) v[k] = v[k] * r * w[k];
    store_group<Vec, G>(yr, c, C, v);
  }
}

// The backward's rows per warp: CTA b takes rmsnorm_rows_per_block rows, warp w the w-th run of them.
inline constexpr std::size_t rmsnorm_rows_per_warp = rmsnorm_rows_per_block / row_warps;
static_assert(rmsnorm_rows_per_warp * row_warps == rmsnorm_rows_per_block);

// A warp's dweight partial in shared memory, padded to whole passes of the warp's 32 groups.
template <typename S>
constexpr std::size_t rmsnorm_warp_partial_floats(std::size_t C) {
  const std::size_t pass = std::size_t{32} * group_of<S>;
  return (C + pass - 1) / pass * pass;
}
// The backward kernel's dynamic shared memory: one partial per warp.
template <typename S>
constexpr std::size_t rmsnorm_backward_smem_bytes(std::size_t C) {
  return row_warps * rmsnorm_warp_partial_floats<S>(C) * sizeof(float);
}

// Where column c (group c / G of the row, element c mod G) sits in a warp's partial: lane-major
// within each pass, so the lanes' accesses of one element index hit 32 different banks.
template <unsigned G>
__device__ inline std::size_t partial_slot(std::size_t c) {
  const std::size_t pass = c / (32 * G), in = c % (32 * G);
  return (pass * G + in % G) * 32 + in / G;
}

// CTA b takes rows [32b, 32b + 32), warp w rows 32b + 4w .. + 4: per row dot = Σ dy·g·x (a warp
// sum), dx = rstd·dy·g − x·rstd³·dot/C (+ residual), and dy·x·rstd added into the warp's own
// partial in shared memory (no other warp touches it: no atomics). Then the CTA adds its warps'
// partials in warp order into partial[b] (rmsnorm_dweight_kernel adds the blocks in order).
template <unsigned W, bool Vec, typename S>
__global__ void __launch_bounds__(row_cta_threads)
    rmsnorm_backward_rows_kernel(const S* x, const S* g, const float* rstd, const S* dy, const S* residual, S* dx,
                                 float* partial, std::size_t N, std::size_t C) {
  static_assert(W == group_of<S>, "the warps' partials are sized and laid out for groups of G (partial_slot)");
  constexpr unsigned G = W;
  const std::size_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const std::size_t per = rmsnorm_warp_partial_floats<S>(C);
  float* const smem = reinterpret_cast<float*>(model_smem());
  float* const mine = smem + warp * per;
  for (std::size_t i = lane; i < per; i += 32) mine[i] = 0.0f;  // the warp's own slots only
  const std::size_t b0 = std::size_t{blockIdx.x} * rmsnorm_rows_per_block;
  const std::size_t r0 = b0 + warp * rmsnorm_rows_per_warp;
  const std::size_t r1 = r0 + rmsnorm_rows_per_warp < N ? r0 + rmsnorm_rows_per_warp : N;
  for (std::size_t n = r0; n < r1; ++n) {
    const S* xr = x + n * C;
    const S* dyr = dy + n * C;
    const float r = rstd[n];
    float dot = 0;
    for (std::size_t c = lane * G; c < C; c += 32 * G) {
      float xv[G], dv[G], gv[G];
      load_group<Vec, G>(xr, c, C, xv);
      load_group<Vec, G>(dyr, c, C, dv);
      load_group<Vec, G>(g, c, C, gv);
#pragma unroll
      for (unsigned k = 0; k < G; ++k) dot += dv[k] * gv[k] * xv[k];
    }
    dot = warp_sum(dot);
    const float kc = r * r * r * dot / static_cast<float>(C);
    for (std::size_t c = lane * G; c < C; c += 32 * G) {
      float xv[G], dv[G], gv[G], out[G], rv[G];
      load_group<Vec, G>(xr, c, C, xv);
      load_group<Vec, G>(dyr, c, C, dv);
      load_group<Vec, G>(g, c, C, gv);
      if (residual != nullptr) load_group<Vec, G>(residual + n * C, c, C, rv);
#pragma unroll
      for (unsigned k = 0; k < G; ++k) {
        out[k] = r * dv[k] * gv[k] - xv[k] * kc;
        if (residual != nullptr) out[k] += rv[k];
        mine[partial_slot<G>(c + k)] += dv[k] * xv[k] * r;
      }
      store_group<Vec, G>(dx + n * C, c, C, out);
    }
  }
  __syncthreads();
  for (std::size_t c = threadIdx.x; c < C; c += row_cta_threads) {
    const std::size_t slot = partial_slot<G>(c);
    float s = 0;
    for (std::size_t w = 0; w < row_warps; ++w) s += smem[w * per + slot];
    partial[std::size_t{blockIdx.x} * C + c] = s;
  }
}

// --- Elementwise maps -----------------------------------------------------------------------------

// f(i) for each group start i of [0, n) in a grid-stride loop (the last group may be partial).
template <unsigned G, typename F>
__device__ inline void for_groups(std::size_t n, F&& f) {
  const std::size_t stride = std::size_t{gridDim.x} * blockDim.x;
  for (std::size_t i = (std::size_t{blockIdx.x} * blockDim.x + threadIdx.x) * G; i < n; i += stride * G) f(i);
}

template <bool Vec, typename S>
__global__ void add_kernel(const S* a, const S* b, S* y, std::size_t n) {
  constexpr unsigned G = Vec ? group_of<S> : 1;
  for_groups<G>(n, [&](std::size_t i) {
    float va[G], vb[G];
    load_group<Vec, G>(a, i, n, va);
    load_group<Vec, G>(b, i, n, vb);
#pragma unroll
    for (unsigned k = 0; k < G; ++k) va[k] += vb[k];
    store_group<Vec, G>(y, i, n, va);
  });
}

template <bool Vec, typename S>
__global__ void convert_kernel(const float* src, S* dst, std::size_t n) {
  constexpr unsigned G = Vec ? group_of<S> : 1;
  for_groups<G>(n, [&](std::size_t i) {
    float v[G];
    load_group<Vec, G>(src, i, n, v);
    store_group<Vec, G>(dst, i, n, v);
  });
}

// Groups of S's width (the narrower type): a float side moves them in two 16-byte words.
template <bool Vec, typename S, typename T>
__global__ void swiglu_forward_kernel(const S* a, const S* b, T* act, std::size_t n) {
  constexpr unsigned G = Vec ? group_of<S> : 1;
  for_groups<G>(n, [&](std::size_t i) {
    float va[G], vb[G];
    load_group<Vec, G>(a, i, n, va);
    load_group<Vec, G>(b, i, n, vb);
#pragma unroll
    for (unsigned k = 0; k < G; ++k) va[k] = membound::swiglu(va[k], vb[k]);
    store_group<Vec, G>(act, i, n, va);
  });
}

template <bool Vec, typename S, typename T>
__global__ void swiglu_backward_kernel(const S* a, const S* b, const T* dact, T* da, T* db, std::size_t n) {
  constexpr unsigned G = Vec ? group_of<S> : 1;
  for_groups<G>(n, [&](std::size_t i) {
    float va[G], vb[G], vd[G], ga[G], gb[G];
    load_group<Vec, G>(a, i, n, va);
    load_group<Vec, G>(b, i, n, vb);
    load_group<Vec, G>(dact, i, n, vd);  // the whole group is read before da or db (maybe dact) is written
#pragma unroll
    for (unsigned k = 0; k < G; ++k) membound::swiglu_backward(va[k], vb[k], vd[k], ga[k], gb[k]);
    store_group<Vec, G>(da, i, n, ga);
    store_group<Vec, G>(db, i, n, gb);
  });
}

// Only ever writes 1 (every writer the same value), so the race is benign and no atomic is needed.
template <bool Vec, typename S>
__global__ void check_finite_kernel(const S* data, std::size_t n, unsigned* flag) {
  constexpr unsigned G = Vec ? group_of<S> : 1;
  bool bad = false;
  for_groups<G>(n, [&](std::size_t i) {
    float v[G];
    load_group<Vec, G>(data, i, n, v);
#pragma unroll
    for (unsigned k = 0; k < G; ++k) bad = bad || !isfinite(v[k]);
  });
  if (bad) *flag = 1;
}

// --- Embedding gather -----------------------------------------------------------------------------

// Warp w of CTA b copies row 8b + w: a straight copy of the table row (bits, no rounding), in
// 16-byte words when Vec (rows a whole number of words, both buffers aligned). A token outside
// [0, V) gives a zero row and raises *bad (when given).
template <bool Vec, typename S>
__global__ void __launch_bounds__(row_cta_threads)
    embedding_gather_kernel(const std::int32_t* tokens, const S* table, S* x, std::size_t N, std::size_t C,
                            std::size_t V, unsigned* bad) {
  const std::size_t n = std::size_t{blockIdx.x} * row_warps + threadIdx.x / 32;
  const std::size_t lane = threadIdx.x % 32;
  if (n >= N) return;
  const std::int32_t t = tokens[n];
  const bool ok = t >= 0 && static_cast<std::size_t>(t) < V;
  if (!ok && bad != nullptr && lane == 0) *bad = 1;
  const S* src = table + (ok ? static_cast<std::size_t>(t) : 0) * C;
  S* dst = x + n * C;
  if constexpr (Vec) {
    const raw16* from = reinterpret_cast<const raw16*>(src);
    raw16* to = reinterpret_cast<raw16*>(dst);
    const std::size_t words = C * sizeof(S) / 16;
    for (std::size_t i = lane; i < words; i += 32) to[i] = ok ? from[i] : raw16{0, 0, 0, 0};
  } else {
    // Bits, not values: copy as unsigned integers of the element's size.
    using raw = std::conditional_t<sizeof(S) == 4, unsigned, unsigned short>;
    const raw* from = reinterpret_cast<const raw*>(src);
    raw* to = reinterpret_cast<raw*>(dst);
    for (std::size_t c = lane; c < C; c += 32) to[c] = ok ? from[c] : raw(0);
  }
}

// --- Cross-entropy --------------------------------------------------------------------------------

inline constexpr unsigned xent_threads = 512;
// Groups a thread loads before it uses the first: loads in flight.
inline constexpr unsigned xent_unroll = 4;

// A running log-sum-exp: s = Σ exp(x − m) over the values seen, m their maximum.
struct lse_pair {
  float m, s;
};

// The two pairs merged. The operands are put in a canonical order first, so that lanes l and
// l ^ mask (which merge the same two pairs from opposite sides) compute the same expression, to
// the bit, whatever the compiler contracts into FMAs.
__device__ inline lse_pair lse_merge(lse_pair a, lse_pair b) {
  if (b.m < a.m || (b.m == a.m && b.s < a.s)) {
    const lse_pair t = a;
    a = b;
    b = t;
  }
  // a.m <= b.m: b.m is the maximum. A pair that saw nothing (m = −inf) adds its s, 0 (or a NaN
  // it met beside −inf values: it spreads).
  if (a.m == -INFINITY) return {b.m, b.s + a.s};
  return {b.m, a.s * expf(a.m - b.m) + b.s};
}

// One CTA per row of logits: one pass for the maximum and the sum of exps together (each thread a
// running pair over its groups, then the warps' butterflies, then the warps in order), one pass
// that writes scale·(softmax − onehot) over the row (the second read comes from L2: a CTA's row
// was just read). An ignore_target row is zero (loss and gradient); any other target outside
// [0, V) makes the row's loss NaN (the non-finite check then catches it).
template <unsigned W, bool Vec>
__global__ void __launch_bounds__(xent_threads)
    cross_entropy_kernel(float* logits, const std::int32_t* targets, std::size_t V, float scale,
                         double* row_loss) {
  constexpr unsigned G = W;
  __shared__ lse_pair warps[xent_threads / 32];
  float* l = logits + std::size_t{blockIdx.x} * V;
  const std::int32_t t = targets[blockIdx.x];
  const std::size_t tid = threadIdx.x;
  constexpr std::size_t step = std::size_t{xent_threads} * G;
  if (t == ignore_target) {  // the whole CTA returns here, before any barrier: no loss, no gradient
    float zero[G];
#pragma unroll
    for (unsigned k = 0; k < G; ++k) zero[k] = 0.0f;
    for (std::size_t c = tid * G; c < V; c += step) store_group<Vec, G>(l, c, V, zero);
    if (tid == 0) row_loss[blockIdx.x] = 0.0;
    return;
  }
  const bool ok = t >= 0 && static_cast<std::size_t>(t) < V;
  const float lt = ok ? l[t] : 0.0f;  // read before the barrier that precedes any write
  lse_pair p{-INFINITY, 0.0f};
  for (std::size_t c0 = tid * G; c0 < V; c0 += step * xent_unroll) {
    float v[xent_unroll][G];
#pragma unroll
    for (unsigned u = 0; u < xent_unroll; ++u) {
      const std::size_t c = c0 + u * step;
      if (c < V) {
        load_group<Vec, G>(l, c, V, v[u]);
      }
#pragma unroll
      for (unsigned k = 0; k < G; ++k) {
        if (c + k >= V) v[u][k] = -INFINITY;  // past the row: contributes nothing
      }
    }
#pragma unroll
    for (unsigned u = 0; u < xent_unroll; ++u) {
      float gm = v[u][0];
      bool any = v[u][0] != -INFINITY;
#pragma unroll
      for (unsigned k = 1; k < G; ++k) {
        gm = fmaxf(gm, v[u][k]);  // fmaxf drops a NaN: `any` keeps its group in (NaN != −inf)
        any = any || v[u][k] != -INFINITY;
      }
      if (!any) continue;  // only −inf (or past the row): nothing to add; a NaN goes on and spreads
      if (!(gm <= p.m)) {  // a new maximum (or a NaN): rescale what was summed so far
        p.s = p.m == -INFINITY ? p.s * 0.0f : p.s * expf(p.m - gm);  // 0, or a NaN already met
        p.m = gm;
      }
#pragma unroll
      for (unsigned k = 0; k < G; ++k) p.s += expf(v[u][k] - p.m);
    }
  }
#pragma unroll
  for (unsigned m = 16; m >= 1; m /= 2) p = lse_merge(p, lse_pair{lane_xor(p.m, m), lane_xor(p.s, m)});
  if (tid % 32 == 0) warps[tid / 32] = p;
  __syncthreads();
  lse_pair all = warps[0];
  for (unsigned w = 1; w < xent_threads / 32; ++w) all = lse_merge(all, warps[w]);
  if (tid == 0) {
    // log-sum-exp form: no log(0) when p[target] underflows
    row_loss[blockIdx.x] = ok ? log(static_cast<double>(all.s)) - static_cast<double>(lt - all.m) : NAN;
  }
  const float inv = scale / all.s;
  for (std::size_t c = tid * G; c < V; c += step) {
    float v[G];
    load_group<Vec, G>(l, c, V, v);
#pragma unroll
    for (unsigned k = 0; k < G; ++k) {
      v[k] = expf(v[k] - all.m) * inv;
      if (ok && c + k == static_cast<std::size_t>(t)) v[k] -= scale;
    }
    store_group<Vec, G>(l, c, V, v);
  }
}

// --- Gradient norm ----------------------------------------------------------------------------------

// Σ v over the CTA's threads, fixed shape (each warp's butterfly, then the warps in order); the
// result in every thread. Threads: a multiple of 32, at most 1024.
template <unsigned Threads, typename T>
__device__ inline T cta_sum(T v) {
  static_assert(Threads % 32 == 0 && Threads <= 1024);
  __shared__ T warps[Threads / 32];
  v = warp_sum(v);
  if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = v;
  __syncthreads();
  T s = warps[0];
  for (unsigned w = 1; w < Threads / 32; ++w) s += warps[w];
  __syncthreads();  // warps[] may be written again at once
  return s;
}

// partial[b] = Σ g² (in double) over CTA b's groups of a grid-stride loop whose grid depends on n
// alone (global_norm_blocks), so the sum's shape does too.
template <bool Vec, typename S>
__global__ void __launch_bounds__(norm_threads)
    norm_partial_kernel(const S* g, std::size_t n, double* partial) {
  constexpr unsigned G = group_of<S>;
  double s = 0;
  for_groups<G>(n, [&](std::size_t i) {
    float v[G];
    load_group<Vec, G>(g, i, n, v);
#pragma unroll
    for (unsigned k = 0; k < G; ++k) s += static_cast<double>(v[k]) * static_cast<double>(v[k]);
  });
  s = cta_sum<static_cast<unsigned>(norm_threads)>(s);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// --- AdamW ----------------------------------------------------------------------------------------

inline constexpr unsigned adamw_threads = 256;
// Elements per CTA: a group per thread on the 16-byte path, 4 per thread otherwise.
template <bool Vec, typename S>
inline constexpr std::size_t adamw_per_block = std::size_t{adamw_threads} * (Vec ? group_of<S> : 4);

// CTA b updates its segment's elements [base, base + adamw_per_block<Vec, S>) (the block →
// segment map is a prefix sum over the launch's few segments). With Vec (every segment's offset
// a multiple of G and every buffer aligned: the launcher's choice) thread t takes the group at
// base + G·t as 16-byte accesses (the moments and the master in G·4 bytes, w and g in 16); else
// base + t, base + t + 256, ... element by element (each warp access coalesced; as fast as this
// kernel was before the groups, on the H200: a separate instantiation, so its registers are its
// own). An elementwise update: the same bits either way.
template <bool Vec, typename S>
__global__ void __launch_bounds__(adamw_threads)
    adamw_kernel(S* w, const S* g, float* m, float* v, float* master, adamw_batch batch,
                 adamw_coefficients<float> k, double grad_scale, adamw_device_inputs dev) {
  constexpr unsigned G = group_of<S>;
  if (dev.skip != nullptr && *dev.skip != 0) return;
  unsigned s = 0;
  while (s + 1 < batch.segments && batch.first_block[s + 1] <= blockIdx.x) ++s;
  double gsd = grad_scale;
  if (dev.norm != nullptr) {
    const double norm = *dev.norm / dev.loss_scale;
    const double clip = (dev.max_norm <= 0.0 || !(norm > dev.max_norm)) ? 1.0 : dev.max_norm / norm;
    gsd = clip / dev.loss_scale * grad_scale;
  }
  const float gs = static_cast<float>(gsd);
  k.wd = batch.wd[s];
  const std::size_t end = batch.offset[s] + batch.count[s];
  const std::size_t base = batch.offset[s] + (blockIdx.x - batch.first_block[s]) * adamw_per_block<Vec, S>;
  if constexpr (Vec) {
    const std::size_t i = base + G * threadIdx.x;
    if (i >= end) return;
    float gv[G], mv[G], vv[G], pv[G];
    load_group<true, G>(g, i, end, gv);
    load_group<true, G>(m, i, end, mv);
    load_group<true, G>(v, i, end, vv);
    if (master != nullptr) {
      load_group<true, G>(master, i, end, pv);
    } else {
      load_group<true, G>(w, i, end, pv);
    }
#pragma unroll
    for (unsigned j = 0; j < G; ++j) adamw_step(k, gv[j] * gs, mv[j], vv[j], pv[j]);
    store_group<true, G>(m, i, end, mv);
    store_group<true, G>(v, i, end, vv);
    if (master != nullptr) store_group<true, G>(master, i, end, pv);
    store_group<true, G>(w, i, end, pv);
  } else {
    for (unsigned j = 0; j < 4; ++j) {
      const std::size_t i = base + j * adamw_threads + threadIdx.x;
      if (i >= end) break;
      float p = master != nullptr ? master[i] : ld(w, i);
      adamw_step(k, ld(g, i) * gs, m[i], v[i], p);
      if (master != nullptr) master[i] = p;
      st(w, i, p);
    }
  }
}
