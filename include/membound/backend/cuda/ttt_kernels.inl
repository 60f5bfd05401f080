// The TTT layer's kernels (RoPE, the rates, the inner loop forward and backward, the post norm, decoding).
// A fragment, not a header: ttt.cuh includes it inside namespace membound::gpu::ttt_detail, and
// tests/emulation/ttt_cuda_emulate.cpp includes the same text inside its emulation namespace,
// where the CUDA built-ins are host threads (tests/emulation/cuda_emulate.py ttt). One text, compiled
// by nvcc and by the emulation: change the kernels here.
// RoPE on interleaved pairs at position (n mod T) mod period, or under packed sequences (n − its
// sequence's start) mod period; one thread per (row, pair, head). fixed < period: every row at
// that position instead (decoding). inverse: the transpose (the backward's dq, dk), as
// cpu::rope_pairs.
template <int = 0>  // inline for the linker (a header's plain __global__ is an external symbol)
__global__ void rope_kernel(float* x, std::size_t N, std::size_t T, std::size_t H, std::size_t D,
                            double base, std::size_t period, std::size_t fixed, bool inverse,
                            packed_sequences packing) {
  const std::size_t half = D / 2;
  const std::size_t e = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= N * H * half) return;
  const std::size_t n = e / (H * half), h = (e / half) % H, i = e % half;
  const std::size_t t = packing.packed() ? n - packing.begin_of(n) : n % T;
  const double position = static_cast<double>(fixed < period ? fixed : t % period);
  const double inv_freq = ::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(D));
  const double angle = position * inv_freq * (inverse ? -1.0 : 1.0);
  const float c = static_cast<float>(::cos(angle)), sn = static_cast<float>(::sin(angle));
  float* p = x + n * H * D + h * D + 2 * i;
  const float x1 = p[0], x2 = p[1];
  p[0] = x1 * c - x2 * sn;
  p[1] = x2 * c + x1 * sn;
}

// lr[n, h] = scale·σ(pre[n, h] + lr_b[h]) in place; tok[i] = max(0, 1/(i+1) + tok_offset[i]);
// σ itself into sig when given (the backward's).
template <typename S>
__global__ void rates_kernel(float* lr, const S* lr_b, std::size_t N, std::size_t H, float scale,
                             const S* tok_offset, float* tok, std::size_t mb,
                             float* sig = nullptr) {
  const std::size_t e = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e < N * H) {
    const float sg = 1.0f / (1.0f + ::expf(-(lr[e] + ld(lr_b, e % H))));
    lr[e] = scale * sg;
    if (sig != nullptr) sig[e] = sg;
  }
  if (e < mb) {
    const float t = 1.0f / static_cast<float>(e + 1) + ld(tok_offset, e);
    tok[e] = t > 0.0f ? t : 0.0f;
  }
}

// ncp: the saved states per (batch, head) (ttt_saved_states); nmb: a batch row's mini-batches.
// packing: packed sequences (batch 1), each one task row of its own, or none.
struct inner_args {
  const float *q, *k, *v, *lr, *tok;
  std::size_t T, H, D, F, SZ, mb, group, ncp, nmb;
  float eps;
  unsigned place;  // ttt_place bits: what the launcher gave shared memory
  packed_sequences packing;
};

// The tokens one inner-loop CTA walks (task = row·H + h): batch row `row`, or under packed
// sequences (batch 1) sequence `row`, whose state restarts from the weights and whose
// mini-batches start with it, as on the CPU. Its first saved state is slot ckpt0 of the
// [B·H, ncp] states: (row·H + h)·ncp, or packed h·ncp plus the states of the sequences before it
// (ceil(ceil(L / mb) / group) each, the CPU's layout); it keeps ceil(nmb / group) of them.
struct inner_row {
  std::size_t begin, len, nmb, ckpt0, ncp;
};
__device__ inline inner_row inner_row_of(const packed_sequences& pk, std::size_t row, std::size_t h,
                                         std::size_t T, std::size_t H, std::size_t mb,
                                         std::size_t group, std::size_t ncp) {
  const auto states = [&](std::size_t n) { return n == 0 ? 0 : (n - 1) / group + 1; };
  const auto batches = [&](std::size_t len) { return len == 0 ? 0 : (len - 1) / mb + 1; };
  if (!pk.packed()) return {row * T, T, batches(T), (row * H + h) * ncp, states(batches(T))};
  std::size_t first = 0;
  for (std::size_t q = 0; q < row; ++q) {
    first += states(batches(static_cast<std::size_t>(pk.offsets[q + 1] - pk.offsets[q])));
  }
  const std::size_t begin = static_cast<std::size_t>(pk.offsets[row]);
  const std::size_t len = static_cast<std::size_t>(pk.offsets[row + 1]) - begin;
  return {begin, len, batches(len), h * ncp + first, states(batches(len))};
}

// ---- Rows on lane groups --------------------------------------------------------------------
// A per-row phase (the inner norms and their backward) runs each row on a group of row_lanes
// lanes: warp w's groups take rows 4w .. 4w + 3, then 4(w + warps) .., and lane l of a group the
// columns l, l + 8, ...; a row's sums are each lane's partial in column order, then row_sums'
// butterfly over the group, so its lanes hold the same bits, and the bits do not depend on the
// CTA's size (the forward's 256 threads and the backward's 128 recompute the same states). Every
// lane of a warp takes every step of the loop (the shuffles need the whole warp): a group past the
// last row (not `live`) reads and writes nothing and sums zeros. blockDim.x is a multiple of 32
// (ttt.cuh asserts it).
struct row_slot {
  unsigned lane, group, first, step;  // lane in the group, group in the warp, the loop's start and step
};
__device__ inline row_slot row_slot_of() {
  const unsigned w = threadIdx.x / 32, l = threadIdx.x % 32;
  return {l % row_lanes, l / row_lanes, w * rows_per_warp, blockDim.x / 32 * rows_per_warp};
}

// Two-pass LayerNorm of one row (mean, then biased variance), as cpu::ln_row, on its lane group;
// returns σ. x̂ into xh (which may be z: a lane overwrites only its own columns, after its last
// read).
__device__ inline float ln_row(const float* z, unsigned D, float eps, float* xh, unsigned lane,
                               bool live) {
  float mu[1] = {0.0f};
  if (live)
    for (unsigned j = lane; j < D; j += row_lanes) mu[0] += z[j];
  row_sums(mu);
  const float mean = mu[0] / static_cast<float>(D);
  float var[1] = {0.0f};
  if (live)
    for (unsigned j = lane; j < D; j += row_lanes) var[0] += (z[j] - mean) * (z[j] - mean);
  row_sums(var);
  const float sigma = ::sqrtf(var[0] / static_cast<float>(D) + eps);
  if (xh != nullptr && live)
    for (unsigned j = lane; j < D; j += row_lanes) xh[j] = (z[j] - mean) / sigma;
  return sigma;
}

// The backward of x̂ = LN(z) given dL/dx̂ and an explicit dL/dσ, as cpu::ln_row_backward, on the
// row's lane group (a lane reads dxhat at its own columns only: dz may alias it).
__device__ inline void ln_row_backward(const float* xhat, float sigma, const float* dxhat,
                                       float dsigma, unsigned D, float* dz, unsigned lane,
                                       bool live) {
  float m[2] = {0.0f, 0.0f};
  if (live)
    for (unsigned j = lane; j < D; j += row_lanes) {
      m[0] += dxhat[j];
      m[1] += dxhat[j] * xhat[j];
    }
  row_sums(m);
  const float m1 = m[0] / static_cast<float>(D), m2 = m[1] / static_cast<float>(D);
  if (live)
    for (unsigned j = lane; j < D; j += row_lanes)
      dz[j] = (dxhat[j] - m1 - xhat[j] * m2) / sigma + dsigma * xhat[j] / static_cast<float>(D);
}

// G = ∇_z ½‖γ x̂ + β − (v − k)‖² with x̂ = LN(z), for one row on its lane group, as a row of
// cpu::ttt_ln_l2: writes x̂ and G, returns σ. The inner loop and the decoding step share it.
template <typename S>
__device__ inline float ln_l2_grad_row(const float* z, const float* k, const float* v,
                                       const S* gamma, const S* beta, unsigned D, float eps,
                                       float* xh, float* g, unsigned lane, bool live) {
  const float sg = ln_row(z, D, eps, xh, lane, live);
  float s[2] = {0.0f, 0.0f};
  if (live) {
    for (unsigned j = lane; j < D; j += row_lanes) {
      const float gam = ld(gamma, j);
      const float r = gam * xh[j] + ld(beta, j) - (v[j] - k[j]);
      g[j] = r * gam;
      s[0] += g[j];
      s[1] += g[j] * xh[j];
    }
  }
  row_sums(s);
  const float s1 = s[0] / static_cast<float>(D), s2 = s[1] / static_cast<float>(D);
  if (live)
    for (unsigned j = lane; j < D; j += row_lanes) g[j] = (g[j] - s1 - xh[j] * s2) / sg;
  return sg;
}

// ---- Products on the tensor cores -----------------------------------------------------------
// out(i, j, Σ_k a(i, k)·b(k, j)) for i < M, j < N, k < Kd: each product of the inner loop, on
// the tensor cores (mma_strip, ttt.cuh: fp32-class sums from three TF32 products). The output is
// cut into 16×8 tiles and the tiles into strips of NT along a row; warp w takes strips w,
// w + warps, ... A strip's lanes load their fragments through a and b (any layout, transpose or
// scale: the accessors say it), a's once a step for the whole strip, and out gets each sum once,
// from the lane that holds it. The tiles pad M to 16, N to 8·NT and Kd to 8 with zeros, never
// reading a or b there. A tile's sum has one order whatever NT, the CTA's size or the placement,
// so the forward and the backward's recomputation agree bit for bit. No barrier: the caller's
// phase ends with one.
template <unsigned NT, typename A, typename B, typename E>
__device__ inline void block_strips(unsigned M, unsigned N, unsigned Kd, A a, B b, E out) {
  const unsigned lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const unsigned sn = ((N + 7) / 8 + NT - 1) / NT, strips = (M + 15) / 16 * sn, ksteps = (Kd + 7) / 8;
  for (unsigned strip = threadIdx.x / 32; strip < strips; strip += blockDim.x / 32) {
    const unsigned i0 = strip / sn * 16, j0 = strip % sn * 8 * NT;
    const auto av = [&](unsigned i, unsigned k) { return i < M && k < Kd ? a(i, k) : 0.0f; };
    const auto bv = [&](unsigned k, unsigned j) { return j < N && k < Kd ? b(k, j) : 0.0f; };
    float d[NT][4] = {};
    // The PTX ISA's m16n8k8 layouts: lane (g, t) holds a(g, t), a(g + 8, t), a(g, t + 4),
    // a(g + 8, t + 4), b(t, g), b(t + 4, g) and sums (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1).
    mma_strip<NT>(d, ksteps, [&](unsigned s, float (&fa)[4], float (&fb)[NT][2]) {
      const unsigned k0 = s * 8;
      fa[0] = av(i0 + g, k0 + t);
      fa[1] = av(i0 + g + 8, k0 + t);
      fa[2] = av(i0 + g, k0 + t + 4);
      fa[3] = av(i0 + g + 8, k0 + t + 4);
#pragma unroll
      for (unsigned n = 0; n < NT; ++n) {
        fb[n][0] = bv(k0 + t, j0 + 8 * n + g);
        fb[n][1] = bv(k0 + t + 4, j0 + 8 * n + g);
      }
    });
#pragma unroll
    for (unsigned n = 0; n < NT; ++n)
#pragma unroll
      for (unsigned r = 0; r < 4; ++r) {
        const unsigned i = i0 + g + (r / 2) * 8, j = j0 + 8 * n + 2 * t + r % 2;
        if (i < M && j < N) out(i, j, d[n][r]);
      }
  }
}
// Strips of two tiles where that still leaves every warp one (an A fragment read once for two
// tiles, and two independent chains of mma), else single tiles: the same bits either way.
template <typename A, typename B, typename E>
__device__ inline void block_product(unsigned M, unsigned N, unsigned Kd, A a, B b, E out) {
  const unsigned tiles = (M + 15) / 16 * ((N + 7) / 8);
  if (tiles >= 2 * (blockDim.x / 32))
    block_strips<2>(M, N, Kd, a, b, out);
  else
    block_strips<1>(M, N, Kd, a, b, out);
}

// One mini-batch of one (batch, head), as the CTA that owns it sees it. Forward and backward run
// the same device functions below on it, so the states the backward recomputes from a checkpoint
// are the forward's bits, whatever G is.
struct mb_ctx {
  const float *q, *k, *v;  // row 0 of the mini-batch; row i at i·C
  const float* lrm;        // [K] the tokens' rates, gathered
  const float* tok;        // [mb] the clamped token scales
  unsigned K, D, F, C, h;
  float eps;
};
// The mini-batch's forward buffers in the CTA's scratch: [mb, F], [mb, D], [mb, mb], [mb].
struct mb_fwd {
  float *z1, *x2, *g1, *z1b, *x2b, *z2, *xh2, *g2, *zb, *att1, *p1, *att2, *p2, *sig2;
};
// The mini-batch's rows of q, k, v staged contiguously ([mb, D] at row stride ttt_row_stride(D)).
struct mb_rows {
  float *q, *k, *v;
};

// Carves the forward's rows from p in ttt_forward_rows' order (the MLP's buffers are empty for
// TTT-Linear); returns the end.
// Hands out consecutive buffers of a (batch, head)'s scratch.
struct carver {
  float* p;
  __device__ float* take(std::size_t n) {
    float* q = p;
    p += n;
    return q;
  }
};
template <bool Mlp>
__device__ inline float* carve_forward(float* p, unsigned D, unsigned F, unsigned mb, mb_fwd& f,
                                       float*& lrm, mb_rows& r) {
  const unsigned fw = Mlp ? mb * F : 0, a2 = Mlp ? mb * mb : 0;
  carver c{p};
  f.z1 = c.take(fw);
  f.x2 = c.take(fw);
  f.g1 = c.take(fw);
  f.z1b = c.take(fw);
  f.x2b = c.take(fw);
  f.z2 = c.take(mb * D);
  f.xh2 = c.take(mb * D);
  f.g2 = c.take(mb * D);
  f.zb = c.take(mb * D);
  f.att1 = c.take(mb * mb);
  f.p1 = c.take(mb * mb);
  f.att2 = c.take(a2);
  f.p2 = c.take(a2);
  f.sig2 = c.take(mb);
  lrm = c.take(mb);
  r.q = c.take(mb * ttt_row_stride(D));
  r.k = c.take(mb * ttt_row_stride(D));
  r.v = c.take(mb * ttt_row_stride(D));
  return c.p;
}

// K rows of D from src (row stride C, global) into dst (row stride ttt_row_stride(D); its pad
// columns are never read). No barrier: coalesced loads once per mini-batch instead of strided
// ones in every product.
__device__ inline void stage_rows(const float* src, std::size_t C, unsigned K, unsigned D,
                                  float* dst) {
  const unsigned ls = static_cast<unsigned>(ttt_row_stride(D));
  for (unsigned e = threadIdx.x; e < K * D; e += blockDim.x) dst[(e / D) * ls + e % D] = src[(e / D) * C + e % D];
}
// The reverse: K rows of D from src (stride ttt_row_stride(D)) into dst (row stride C). No barrier.
__device__ inline void unstage_rows(const float* src, std::size_t C, unsigned K, unsigned D,
                                    float* dst) {
  const unsigned ls = static_cast<unsigned>(ttt_row_stride(D));
  for (unsigned e = threadIdx.x; e < K * D; e += blockDim.x) dst[(e / D) * C + e % D] = src[(e / D) * ls + e % D];
}

// Each phase below is a product on the tensor cores (block_product), a strided loop over its
// outputs, every output summed by one thread in index order, or a row phase on lane groups (its
// loop uniform within each warp); phases are separated by __syncthreads, which every thread reaches. A
// function ends with a barrier unless it says otherwise.

// The inner gradients at state W: Z (Z1, X2 = GELU(Z1) for the MLP), G2 through the LayerNorm,
// and G1 = (G2·W2ᵀ) ⊙ GELU'(Z1) for the MLP.
// Not inlined, as mb_update: one body of machine code serves the forward and the backward's
// recomputation, so no caller's context can change how its sums are contracted or ordered. The
// structs come by value, in registers: by reference the callers kept them in a stack frame (176
// bytes in the forward, 240 in the backward, read from local memory in every phase).
template <bool Mlp, typename S>
__device__ __noinline__ void mb_gradients(mb_ctx m, const float* W, mb_fwd b, const S* norm_w,
                                          const S* norm_b) {
  const unsigned K = m.K, D = m.D, F = m.F, C = m.C, h = m.h;
  const float* W1 = W;
  const float* B1 = W + D * F;
  const float* W2 = B1 + F;
  const float* B2 = W2 + F * D;
  const float* k = m.k;
  const float* v = m.v;
  if constexpr (Mlp) {
    block_product(
        K, F, D, [&](unsigned i, unsigned c) { return k[i * C + c]; },
        [&](unsigned c, unsigned f) { return W1[c * F + f]; },
        [&](unsigned i, unsigned f, float acc) {
          const float z = acc + B1[f];
          b.z1[i * F + f] = z;
          b.x2[i * F + f] = gelu_tanh_f(z);
        });
    __syncthreads();
    block_product(
        K, D, F, [&](unsigned i, unsigned f) { return b.x2[i * F + f]; },
        [&](unsigned f, unsigned j) { return W2[f * D + j]; },
        [&](unsigned i, unsigned j, float acc) { b.z2[i * D + j] = acc + B2[j]; });
  } else {
    block_product(
        K, D, D, [&](unsigned i, unsigned c) { return k[i * C + c]; },
        [&](unsigned c, unsigned j) { return W1[c * D + j]; },
        [&](unsigned i, unsigned j, float acc) { b.z2[i * D + j] = acc + B1[j]; });
  }
  __syncthreads();
  // G2 = ∇ ½‖γ x̂ + β − (v − k)‖² through the LayerNorm, a lane group per row (as ttt_ln_l2).
  const row_slot rs = row_slot_of();
  for (unsigned i0 = rs.first; i0 < K; i0 += rs.step) {
    const bool live = i0 + rs.group < K;
    const unsigned i = live ? i0 + rs.group : i0;
    const float sg = ln_l2_grad_row(b.z2 + i * D, k + i * C, v + i * C, norm_w + h * D, norm_b + h * D,
                                    D, m.eps, b.xh2 + i * D, b.g2 + i * D, rs.lane, live);
    if (live && rs.lane == 0) b.sig2[i] = sg;
  }
  __syncthreads();
  if constexpr (Mlp) {
    block_product(
        K, F, D, [&](unsigned i, unsigned j) { return b.g2[i * D + j]; },
        [&](unsigned j, unsigned f) { return W2[f * D + j]; },
        [&](unsigned i, unsigned f, float acc) { b.g1[i * F + f] = acc * gelu_tanh_d1(b.z1[i * F + f]); });
    __syncthreads();
  }
}

// The output rows' Zbar at state W (gradients from mb_gradients): P1 = η ⊙ (tril(XQ·XKᵀ) + 1),
// η[i, s] = tok_i·lr_s; Linear: Zbar = XQ·W1 + b1 − P1·G; MLP: Zbar1 = XQ·W1 + b1 − P1·G1,
// X2bar = GELU(Zbar1), P2 from tril(X2bar·X2ᵀ), Zbar = X2bar·W2 + b2 − P2·G2.
template <bool Mlp>
__device__ void mb_outputs(const mb_ctx& m, const float* W, const mb_fwd& b) {
  const unsigned K = m.K, D = m.D, F = m.F, C = m.C;
  const float* W1 = W;
  const float* B1 = W + D * F;
  const float* W2 = B1 + F;
  const float* B2 = W2 + F * D;
  const float* q = m.q;
  const float* k = m.k;
  // att = tril(X·Yᵀ) (zero above the diagonal) and P = η ⊙ (att + 1) there.
  const auto att_out = [&](float* att, float* p) {
    return [=, &m](unsigned i, unsigned s, float acc) {
      att[i * K + s] = s > i ? 0.0f : acc;
      p[i * K + s] = s > i ? 0.0f : m.tok[i] * m.lrm[s] * (acc + 1.0f);
    };
  };
  block_product(
      K, K, D, [&](unsigned i, unsigned c) { return q[i * C + c]; },
      [&](unsigned c, unsigned s) { return k[s * C + c]; }, att_out(b.att1, b.p1));
  __syncthreads();
  // X·W + b − P·G as one product over [X | P]·[W; −G] (k < nin: X·W, then P·G).
  const auto dual = [&](unsigned nin, unsigned nout, const float* x, unsigned ldx, const float* w,
                        const float* bias, const float* p, const float* g, auto store) {
    block_product(
        K, nout, nin + K,
        [&](unsigned i, unsigned c) { return c < nin ? x[i * ldx + c] : p[i * K + c - nin]; },
        [&](unsigned c, unsigned j) { return c < nin ? w[c * nout + j] : -g[(c - nin) * nout + j]; },
        [&](unsigned i, unsigned j, float acc) { store(i, j, acc + bias[j]); });
  };
  if constexpr (Mlp) {
    dual(D, F, q, C, W1, B1, b.p1, b.g1, [&](unsigned i, unsigned f, float z) {
      b.z1b[i * F + f] = z;
      b.x2b[i * F + f] = gelu_tanh_f(z);
    });
    __syncthreads();
    block_product(
        K, K, F, [&](unsigned i, unsigned f) { return b.x2b[i * F + f]; },
        [&](unsigned f, unsigned s) { return b.x2[s * F + f]; }, att_out(b.att2, b.p2));
    __syncthreads();
    dual(F, D, b.x2b, F, W2, B2, b.p2, b.g2,
         [&](unsigned i, unsigned j, float z) { b.zb[i * D + j] = z; });
  } else {
    dual(D, D, q, C, W1, B1, b.p1, b.g2,
         [&](unsigned i, unsigned j, float z) { b.zb[i * D + j] = z; });
  }
  __syncthreads();
}

// The update, e_s = tok[K−1]·lr_s: W1 −= XKᵀ·diag(e)·G1, b1 −= Σ e_s G1_s (G1 is G2 for
// TTT-Linear); for the MLP also W2 −= X2ᵀ·diag(e)·G2, b2 −= Σ e_s G2_s. In place: it starts
// without a barrier (callers put it after the last phase that reads W) and ends with one.
template <bool Mlp>
__device__ __noinline__ void mb_update(mb_ctx m, float* W, mb_fwd b) {
  const unsigned K = m.K, D = m.D, F = m.F, C = m.C, tid = threadIdx.x, nt = blockDim.x;
  float* W1 = W;
  float* B1 = W + D * F;
  float* W2 = B1 + F;
  float* B2 = W2 + F * D;
  const float* k = m.k;
  const float tl = m.tok[K - 1];
  const float* ga = Mlp ? b.g1 : b.g2;
  block_product(
      D, F, K, [&](unsigned c, unsigned s) { return k[s * C + c]; },
      [&](unsigned s, unsigned f) { return tl * m.lrm[s] * ga[s * F + f]; },
      [&](unsigned c, unsigned f, float acc) { W1[c * F + f] -= acc; });
  for (unsigned f = tid; f < F; f += nt) {
    float acc = B1[f];
    for (unsigned s = 0; s < K; ++s) acc -= tl * m.lrm[s] * ga[s * F + f];
    B1[f] = acc;
  }
  if constexpr (Mlp) {
    block_product(
        F, D, K, [&](unsigned f, unsigned s) { return b.x2[s * F + f]; },
        [&](unsigned s, unsigned j) { return tl * m.lrm[s] * b.g2[s * D + j]; },
        [&](unsigned f, unsigned j, float acc) { W2[f * D + j] -= acc; });
    for (unsigned j = tid; j < D; j += nt) {
      float acc = B2[j];
      for (unsigned s = 0; s < K; ++s) acc -= tl * m.lrm[s] * b.g2[s * D + j];
      B2[j] = acc;
    }
  }
  __syncthreads();
}

// The inner loop of one (batch row or packed sequence, head) per CTA. Its rows and state live in shared memory or in
// this CTA's slice of global scratch ([state | rows]) as a.place says. Two CTAs an SM: ptxas may
// take 128 registers (at its own 80, TTT-MLP's call of mb_gradients spilled 4 bytes).
template <bool Mlp, typename S>
__global__ void __launch_bounds__(ttt_inner_threads, 2)
    ttt_forward_kernel(inner_args a, const S* norm_w, const S* norm_b, const S* w1, const S* b1,
                       const S* w2, const S* b2, S* o_s, float* ckpt, float* scratch) {
  // 32-bit indices inside a mini-batch (K·F, D·F < 2^32 for any head the launcher accepts;
  // 64-bit only for the row offsets into [B·T, C]): the MLP kernel spilled with 64-bit ones.
  const std::size_t task = blockIdx.x;
  const unsigned h = static_cast<unsigned>(task % a.H);
  const inner_row row = inner_row_of(a.packing, task / a.H, h, a.T, a.H, a.mb, a.group, a.ncp);
  const unsigned D = static_cast<unsigned>(a.D), F = static_cast<unsigned>(a.F),
                 mb = static_cast<unsigned>(a.mb), C = static_cast<unsigned>(a.H * a.D),
                 ls = static_cast<unsigned>(ttt_row_stride(a.D)), tid = threadIdx.x, nt = blockDim.x;
  float* slice = scratch + task * ttt_forward_elements(a.SZ, D, F, mb, Mlp);
  float* sm = ttt_smem();
  float* rows = (a.place & ttt_rows_on_chip) ? sm : slice + a.SZ;
  float* W = (a.place & ttt_state_on_chip)
                 ? sm + ((a.place & ttt_rows_on_chip) ? ttt_forward_rows(D, F, mb, Mlp) : 0)
                 : slice;
  float* W1 = W;
  float* B1 = W + D * F;
  float* W2 = B1 + F;
  float* B2 = W2 + F * D;
  mb_fwd bf;
  float* lrm;
  mb_rows rs;
  carve_forward<Mlp>(rows, D, F, mb, bf, lrm, rs);

  // The learned initial state of head h.
  for (unsigned e = tid; e < D * F; e += nt) W1[e] = ld(w1, h * D * F + e);
  for (unsigned e = tid; e < F; e += nt) B1[e] = ld(b1, h * F + e);
  if constexpr (Mlp) {
    for (unsigned e = tid; e < F * D; e += nt) W2[e] = ld(w2, h * F * D + e);
    for (unsigned e = tid; e < D; e += nt) B2[e] = ld(b2, h * D + e);
  }
  __syncthreads();

  for (std::size_t m = 0; m < row.nmb; ++m) {
    const std::size_t t0 = m * mb;
    const unsigned K = static_cast<unsigned>((row.len - t0 < mb) ? row.len - t0 : mb);
    const std::size_t r0 = (row.begin + t0) * C + h * D;  // row i of q/k/v/o at r0 + i·C
    if (m % a.group == 0) {
      float* dst = ckpt + (row.ckpt0 + m / a.group) * a.SZ;
      for (unsigned e = tid; e < a.SZ; e += nt) dst[e] = W[e];
    }
    for (unsigned i = tid; i < K; i += nt) lrm[i] = a.lr[(row.begin + t0 + i) * a.H + h];
    stage_rows(a.q + r0, C, K, D, rs.q);
    stage_rows(a.k + r0, C, K, D, rs.k);
    stage_rows(a.v + r0, C, K, D, rs.v);
    __syncthreads();
    const mb_ctx mc{rs.q, rs.k, rs.v, lrm, a.tok, K, D, F, ls, h, a.eps};
    mb_gradients<Mlp>(mc, W, bf, norm_w, norm_b);
    mb_outputs<Mlp>(mc, W, bf);
    // out = XQ + γ ⊙ LN(Zbar) + β, rounded to storage straight into `saved`; a lane group per
    // row (x̂ overwrites Zbar's row: nothing reads it later). No barrier before the update: this
    // phase does not read the state.
    const row_slot slot = row_slot_of();
    for (unsigned i0 = slot.first; i0 < K; i0 += slot.step) {
      const bool live = i0 + slot.group < K;
      const unsigned i = live ? i0 + slot.group : i0;
      float* zr = bf.zb + i * D;
      ln_row(zr, D, a.eps, zr, slot.lane, live);
      const std::size_t r = r0 + i * C;
      if (live)
        for (unsigned j = slot.lane; j < D; j += row_lanes) {
          const float out = mc.q[i * mc.C + j] + ld(norm_w, h * D + j) * zr[j] + ld(norm_b, h * D + j);
          st(o_s, r + j, out);
        }
    }
    mb_update<Mlp>(mc, W, bf);
  }
}

// ---- Backward pieces: the reverse of cpu::ttt_* (backend/cpu/ttt.hpp), one phase each ------

// The update's backward (cpu::ttt_update_backward) given dL/dW' (dWn [nin, nout]) and dL/db'
// (dbn): accumulates dX (stride lddx), dG [K, nout] and de. s1 [K, nout], s2 [K, nin] scratch.
__device__ inline void update_backward(const float* x, unsigned ldx, unsigned K, unsigned nin,
                                       unsigned nout, const float* g, float tl, const float* lr,
                                       const float* dWn, const float* dbn, float* dx,
                                       unsigned lddx, float* dg, float* de, float* s1, float* s2) {
  const unsigned tid = threadIdx.x, nt = blockDim.x;
  block_product(  // s1 = X·dW'
      K, nout, nin, [&](unsigned i, unsigned a) { return x[i * ldx + a]; },
      [&](unsigned a, unsigned o) { return dWn[a * nout + o]; },
      [&](unsigned i, unsigned o, float acc) { s1[i * nout + o] = acc; });
  block_product(  // s2 = G·dW'ᵀ
      K, nin, nout, [&](unsigned i, unsigned o) { return g[i * nout + o]; },
      [&](unsigned o, unsigned a) { return dWn[a * nout + o]; },
      [&](unsigned i, unsigned a, float acc) { s2[i * nin + a] = acc; });
  __syncthreads();
  for (unsigned e = tid; e < K * nout; e += nt) {
    const unsigned i = e / nout, o = e % nout;
    dg[e] -= tl * lr[i] * (s1[e] + dbn[o]);
  }
  for (unsigned e = tid; e < K * nin; e += nt) {
    const unsigned i = e / nin, a = e % nin;
    dx[i * lddx + a] -= tl * lr[i] * s2[e];
  }
  // de_i −= (s1_i + db')·g_i, a row per lane group (a warp's loop is uniform: row_sums).
  const row_slot rs = row_slot_of();
  for (unsigned i0 = rs.first; i0 < K; i0 += rs.step) {
    const bool live = i0 + rs.group < K;
    const unsigned i = live ? i0 + rs.group : i0;
    float v[1] = {0.0f};
    if (live)
      for (unsigned o = rs.lane; o < nout; o += row_lanes) v[0] += (s1[i * nout + o] + dbn[o]) * g[i * nout + o];
    row_sums(v);
    if (live && rs.lane == 0) de[i] -= v[0];
  }
  __syncthreads();
}

// Z = X·W + b backwards: dX += dZ·Wᵀ (stride lddx), dW += Xᵀ·dZ, db += Σ dZ.
__device__ inline void linear_rows_backward(const float* x, unsigned ldx, unsigned K, unsigned nin,
                                            unsigned nout, const float* W, const float* dz,
                                            float* dx, unsigned lddx, float* dW, float* db) {
  const unsigned tid = threadIdx.x, nt = blockDim.x;
  block_product(
      K, nin, nout, [&](unsigned i, unsigned o) { return dz[i * nout + o]; },
      [&](unsigned o, unsigned a) { return W[a * nout + o]; },
      [&](unsigned i, unsigned a, float acc) { dx[i * lddx + a] += acc; });
  block_product(
      nin, nout, K, [&](unsigned a, unsigned i) { return x[i * ldx + a]; },
      [&](unsigned i, unsigned o) { return dz[i * nout + o]; },
      [&](unsigned a, unsigned o, float acc) { dW[a * nout + o] += acc; });
  for (unsigned o = tid; o < nout; o += nt) {
    float acc = 0.0f;
    for (unsigned i = 0; i < K; ++i) acc += dz[i * nout + o];
    db[o] += acc;
  }
  __syncthreads();
}

// The backward of Zbar = X·W + b − P·G given dZbar (cpu::ttt_dual_rows_backward): accumulates dX
// (stride lddx), dW, db and dG; writes dP = −dZbar·Gᵀ on the lower triangle (zero above).
__device__ inline void dual_rows_backward(const float* x, unsigned ldx, unsigned K, unsigned nin,
                                          unsigned nout, const float* W, const float* p,
                                          const float* g, const float* dzb, float* dx,
                                          unsigned lddx, float* dW, float* db, float* dg,
                                          float* dp) {
  // The X·W + b part is linear_rows_backward's (its barrier ends it; the P·G part reads none of
  // what it writes).
  linear_rows_backward(x, ldx, K, nin, nout, W, dzb, dx, lddx, dW, db);
  block_product(  // dG −= Pᵀ·dZbar (P is zero above the diagonal)
      K, nout, K, [&](unsigned s, unsigned i) { return p[i * K + s]; },
      [&](unsigned i, unsigned o) { return dzb[i * nout + o]; },
      [&](unsigned s, unsigned o, float acc) { dg[s * nout + o] -= acc; });
  block_product(  // dP = −dZbar·Gᵀ on the lower triangle
      K, K, nout, [&](unsigned i, unsigned o) { return dzb[i * nout + o]; },
      [&](unsigned o, unsigned s) { return g[s * nout + o]; },
      [&](unsigned i, unsigned s, float acc) { dp[i * K + s] = s <= i ? -acc : 0.0f; });
  __syncthreads();
}

// P = η ⊙ (att + 1), η[i, s] = tok_i·lr_s (cpu::ttt_p_backward): accumulates dL/dtok_i (ptok)
// and dL/dlr_s (dl), then turns dP into dL/d(att) in place.
__device__ inline void p_backward(unsigned K, const float* tok, const float* lr, const float* att,
                                  float* dp, float* ptok, float* dl) {
  const unsigned tid = threadIdx.x, nt = blockDim.x;
  for (unsigned i = tid; i < K; i += nt)
    for (unsigned s = 0; s <= i; ++s) ptok[i] += dp[i * K + s] * (att[i * K + s] + 1.0f) * lr[s];
  for (unsigned s = tid; s < K; s += nt)
    for (unsigned i = s; i < K; ++i) dl[s] += dp[i * K + s] * (att[i * K + s] + 1.0f) * tok[i];
  __syncthreads();
  for (unsigned e = tid; e < K * K; e += nt) {
    const unsigned i = e / K, s = e % K;
    if (s <= i) dp[e] = dp[e] * tok[i] * lr[s];
  }
  __syncthreads();
}

// att = tril(X·Yᵀ) (cpu::ttt_att_backward): dX += dAtt·Y, dY += dAttᵀ·X; dAtt is zero above
// the diagonal.
__device__ inline void att_backward(const float* x, unsigned ldx, const float* y, unsigned ldy,
                                    unsigned K, unsigned n, const float* datt, float* dx,
                                    unsigned lddx, float* dy, unsigned lddy) {
  block_product(
      K, n, K, [&](unsigned i, unsigned s) { return datt[i * K + s]; },
      [&](unsigned s, unsigned c) { return y[s * ldy + c]; },
      [&](unsigned i, unsigned c, float acc) { dx[i * lddx + c] += acc; });
  block_product(
      K, n, K, [&](unsigned s, unsigned i) { return datt[i * K + s]; },
      [&](unsigned i, unsigned c) { return x[i * ldx + c]; },
      [&](unsigned s, unsigned c, float acc) { dy[s * lddy + c] += acc; });
  __syncthreads();
}

// The backward of G2 = ∇ ½‖γ x̂ + β − (v − k)‖² (cpu::ttt_ln_l2_backward) given dG2: dZ2
// (written), the target's gradient into dk (+) and dv (−), dγ, dβ (accumulated). One lane group
// per row, then one thread per column for dγ, dβ (rows in order, no shared accumulator); rowd [K, 3·D]
// keeps each row's r and dgx for that second phase.
template <typename S>
__device__ void ln_l2_backward(const mb_ctx& m, const S* norm_w, const S* norm_b, const float* xh,
                               const float* sig, const float* g, const float* dg, float* dz,
                               float* dk, float* dv, float* pgam, float* pbet, float* rowd) {
  const unsigned K = m.K, D = m.D, C = m.C, h = m.h, tid = threadIdx.x, nt = blockDim.x;
  const float invD = 1.0f / static_cast<float>(D);
  const row_slot rs = row_slot_of();
  for (unsigned i0 = rs.first; i0 < K; i0 += rs.step) {
    const bool live = i0 + rs.group < K;
    const unsigned i = live ? i0 + rs.group : i0;
    const float* xr = xh + i * D;
    const float* g_r = g + i * D;
    const float* dg_r = dg + i * D;
    float* r = rowd + i * 3 * D;
    float* dgx = r + D;
    float* dxh = r + 2 * D;
    float sums[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // the row's cc, m1, sdx, −dσ·σ
    if (live)
      for (unsigned j = rs.lane; j < D; j += row_lanes) {
        const float gam = ld(norm_w, h * D + j), bet = ld(norm_b, h * D + j);
        r[j] = gam * xr[j] + bet - (m.v[i * C + j] - m.k[i * C + j]);
        sums[0] += r[j] * gam * xr[j];
        sums[1] += dg_r[j];
        sums[2] += dg_r[j] * xr[j];
        sums[3] += dg_r[j] * g_r[j];
      }
    row_sums(sums);
    const float sg = live ? sig[i] : 1.0f;
    const float cc = sums[0] * invD, m1 = sums[1] * invD, sdx = sums[2], dsig = -sums[3] / sg;
    if (live)
      for (unsigned j = rs.lane; j < D; j += row_lanes) {
        const float gam = ld(norm_w, h * D + j);
        const float gx = r[j] * gam;
        dgx[j] = (dg_r[j] - m1 - xr[j] * sdx * invD) / sg;
        dxh[j] = -(dg_r[j] * cc) / sg - sdx / sg * gx * invD;
        const float dr = dgx[j] * gam;
        dv[i * C + j] -= dr;  // the target is v − k
        dk[i * C + j] += dr;
        dxh[j] += dr * gam;
      }
    ln_row_backward(xr, sg, dxh, dsig, D, dz + i * D, rs.lane, live);
  }
  __syncthreads();
  for (unsigned j = tid; j < D; j += nt) {
    const float gam = ld(norm_w, h * D + j);
    for (unsigned i = 0; i < K; ++i) {
      const float* r = rowd + i * 3 * D;
      const float dgx = r[D + j], dr = dgx * gam;
      pgam[j] += dgx * r[j] + dr * xh[i * D + j];
      pbet[j] += dr;
    }
  }
  __syncthreads();
}

// The mini-batch's backward buffers.
struct mb_bwd {
  float *xhb, *dx2b, *dz1b, *dg1, *dx2, *dz1, *s1, *s2, *dzb, *dg2, *dz2, *dp1, *dp2, *de,
      *dl, *rowd;
};
// Carves the backward's own rows from p (after the forward's) in ttt_backward_rows' order, then
// the staged rows of d_o, dq, dk, dv [mb, D] at row stride ttt_row_stride(D).
template <bool Mlp>
__device__ inline void carve_backward(float* p, unsigned D, unsigned F, unsigned mb, mb_bwd& b,
                                      float*& d_out, float*& dq, float*& dk, float*& dv) {
  const unsigned fw = Mlp ? mb * F : 0;
  carver c{p};
  b.xhb = c.take(mb * D);
  b.dx2b = c.take(fw);
  b.dz1b = c.take(fw);
  b.dg1 = c.take(fw);
  b.dx2 = c.take(fw);
  b.dz1 = c.take(fw);
  b.s1 = c.take(mb * F);
  b.s2 = c.take(mb * F);
  b.dzb = c.take(mb * D);
  b.dg2 = c.take(mb * D);
  b.dz2 = c.take(mb * D);
  b.dp1 = c.take(mb * mb);
  b.dp2 = c.take(Mlp ? mb * mb : 0);
  b.de = c.take(mb);
  b.dl = c.take(mb);
  b.rowd = c.take(mb * 3 * D);
  const std::size_t staged = mb * ttt_row_stride(D);
  d_out = c.take(staged);
  dq = c.take(staged);
  dk = c.take(staged);
  dv = c.take(staged);
}

// One mini-batch backwards (the CPU layer's mb_backward), after mb_gradients and mb_outputs at
// its entering state W: given dL/d(out rows) (d_out, stride C) and dS = dL/d(state leaving it);
// on return dS is dL/d(state entering it). The rows of dq, dk, dv are written; pgam, pbet, ptok
// accumulated; the rates' gradients are left in b.dl.
template <bool Mlp, typename S>
__device__ void mb_backward(const mb_ctx& m, const S* norm_w, const S* norm_b, const float* W,
                            const mb_fwd& f, const mb_bwd& b, const float* d_out, float* dq,
                            float* dk, float* dv, float* dS, float* pgam, float* pbet,
                            float* ptok) {
  const unsigned K = m.K, D = m.D, F = m.F, C = m.C, h = m.h, tid = threadIdx.x, nt = blockDim.x;
  const float* W1 = W;
  const float* W2 = W + D * F + F;
  float* dW1 = dS;
  float* db1 = dS + D * F;
  float* dW2 = db1 + F;
  float* db2 = dW2 + F * D;
  const float tl = m.tok[K - 1];
  const float* q = m.q;
  const float* k = m.k;
  // out = XQ + γ ⊙ x̂(Zbar) + β: dZbar per row, on lane groups; the residual XQ's gradient; dk,
  // dv start at 0.
  const row_slot rs = row_slot_of();
  for (unsigned i0 = rs.first; i0 < K; i0 += rs.step) {
    const bool live = i0 + rs.group < K;
    const unsigned i = live ? i0 + rs.group : i0;
    const float sg = ln_row(f.zb + i * D, D, m.eps, b.xhb + i * D, rs.lane, live);
    float* dxh = b.rowd + i * 3 * D;
    if (live)
      for (unsigned j = rs.lane; j < D; j += row_lanes) {
        dxh[j] = d_out[i * C + j] * ld(norm_w, h * D + j);
        dq[i * C + j] = d_out[i * C + j];
        dk[i * C + j] = 0.0f;
        dv[i * C + j] = 0.0f;
      }
    ln_row_backward(b.xhb + i * D, sg, dxh, 0.0f, D, b.dzb + i * D, rs.lane, live);
  }
  for (unsigned i = tid; i < K; i += nt) {
    b.de[i] = 0.0f;
    b.dl[i] = 0.0f;
  }
  for (unsigned e = tid; e < K * D; e += nt) b.dg2[e] = 0.0f;
  if constexpr (Mlp) {
    for (unsigned e = tid; e < K * F; e += nt) {
      b.dg1[e] = 0.0f;
      b.dx2[e] = 0.0f;
      b.dx2b[e] = 0.0f;
    }
  }
  __syncthreads();
  for (unsigned j = tid; j < D; j += nt)
    for (unsigned i = 0; i < K; ++i) {
      pgam[j] += d_out[i * C + j] * b.xhb[i * D + j];
      pbet[j] += d_out[i * C + j];
    }
  __syncthreads();

  if constexpr (Mlp) {
    // The updates read dS as dL/d(state leaving); everything after adds to it.
    update_backward(f.x2, F, K, F, D, f.g2, tl, m.lrm, dW2, db2, b.dx2, F, b.dg2, b.de, b.s1, b.s2);
    update_backward(k, C, K, D, F, f.g1, tl, m.lrm, dW1, db1, dk, C, b.dg1, b.de, b.s1, b.s2);
    // Zbar2 = X2bar·W2 + b2 − P2·G2, P2 from tril(X2bar·X2ᵀ).
    dual_rows_backward(f.x2b, F, K, F, D, W2, f.p2, f.g2, b.dzb, b.dx2b, F, dW2, db2, b.dg2, b.dp2);
    p_backward(K, m.tok, m.lrm, f.att2, b.dp2, ptok, b.dl);
    att_backward(f.x2b, F, f.x2, F, K, F, b.dp2, b.dx2b, F, b.dx2, F);
    for (unsigned e = tid; e < K * F; e += nt) b.dz1b[e] = b.dx2b[e] * gelu_tanh_d1(f.z1b[e]);
    __syncthreads();
    // Zbar1 = XQ·W1 + b1 − P1·G1, P1 from tril(XQ·XKᵀ).
    dual_rows_backward(q, C, K, D, F, W1, f.p1, f.g1, b.dz1b, dq, C, dW1, db1, b.dg1, b.dp1);
    p_backward(K, m.tok, m.lrm, f.att1, b.dp1, ptok, b.dl);
    att_backward(q, C, k, C, K, D, b.dp1, dq, C, dk, C);
    // G1 = Hm ⊙ GELU'(Z1) with Hm = G2·W2ᵀ: dZ1 gets the GELU'' term, s2 = dL/dHm.
    block_product(
        K, F, D, [&](unsigned i, unsigned j) { return f.g2[i * D + j]; },
        [&](unsigned j, unsigned fo) { return W2[fo * D + j]; },
        [&](unsigned i, unsigned fo, float hm) {
          const unsigned e = i * F + fo;
          b.s1[e] = hm;
          const float z = f.z1[e];
          b.dz1[e] = b.dg1[e] * hm * gelu_tanh_d2(z);
          b.s2[e] = b.dg1[e] * gelu_tanh_d1(z);
        });
    __syncthreads();
    block_product(  // dG2 += dHm·W2
        K, D, F, [&](unsigned i, unsigned fo) { return b.s2[i * F + fo]; },
        [&](unsigned fo, unsigned j) { return W2[fo * D + j]; },
        [&](unsigned i, unsigned j, float acc) { b.dg2[i * D + j] += acc; });
    block_product(  // dW2 += dHmᵀ·G2
        F, D, K, [&](unsigned fo, unsigned i) { return b.s2[i * F + fo]; },
        [&](unsigned i, unsigned j) { return f.g2[i * D + j]; },
        [&](unsigned fo, unsigned j, float acc) { dW2[fo * D + j] += acc; });
    __syncthreads();
    // G2 = ∇ of the inner loss at Z2 = X2·W2 + b2, X2 = GELU(Z1), Z1 = XK·W1 + b1.
    ln_l2_backward(m, norm_w, norm_b, f.xh2, f.sig2, f.g2, b.dg2, b.dz2, dk, dv, pgam, pbet,
                   b.rowd);
    linear_rows_backward(f.x2, F, K, F, D, W2, b.dz2, b.dx2, F, dW2, db2);
    for (unsigned e = tid; e < K * F; e += nt) b.dz1[e] += b.dx2[e] * gelu_tanh_d1(f.z1[e]);
    __syncthreads();
    linear_rows_backward(k, C, K, D, F, W1, b.dz1, dk, C, dW1, db1);
  } else {
    update_backward(k, C, K, D, D, f.g2, tl, m.lrm, dW1, db1, dk, C, b.dg2, b.de, b.s1, b.s2);
    dual_rows_backward(q, C, K, D, D, W1, f.p1, f.g2, b.dzb, dq, C, dW1, db1, b.dg2, b.dp1);
    p_backward(K, m.tok, m.lrm, f.att1, b.dp1, ptok, b.dl);
    att_backward(q, C, k, C, K, D, b.dp1, dq, C, dk, C);
    ln_l2_backward(m, norm_w, norm_b, f.xh2, f.sig2, f.g2, b.dg2, b.dz2, dk, dv, pgam, pbet,
                   b.rowd);
    linear_rows_backward(k, C, K, D, D, W1, b.dz2, dk, C, dW1, db1);
  }
  // e_s = tok[K−1]·lr_s
  if (tid == 0)
    for (unsigned i = 0; i < K; ++i) ptok[K - 1] += b.de[i] * m.lrm[i];
  for (unsigned i = tid; i < K; i += nt) b.dl[i] += b.de[i] * tl;
  __syncthreads();
}

struct backward_args {
  const float *q, *k, *v, *lr, *tok, *d_o, *ckpt;
  float *dq, *dk, *dv, *dlr, *part, *scratch;
  std::size_t T, H, D, F, SZ, mb, group, gsz, ncp, nmb;
  float eps;
  unsigned place;  // ttt_place bits: what the launcher gave shared memory
  packed_sequences packing;
};

// The inner loop backwards, one (batch row or packed sequence, head) per CTA: groups from the last; each group's
// entering states recomputed from its checkpoint (the forward's functions, so the same bits),
// then its mini-batches in reverse. part[task] = [dS (SZ), dγ (D), dβ (D), dtok (mb)], summed
// over the rows afterwards in row order (ttt_reduce_partials_kernel).
template <bool Mlp, typename S>
__global__ void __launch_bounds__(ttt_backward_threads, 1)
    ttt_backward_kernel(backward_args a, const S* norm_w, const S* norm_b) {
  const std::size_t task = blockIdx.x;
  const unsigned h = static_cast<unsigned>(task % a.H);
  const inner_row row = inner_row_of(a.packing, task / a.H, h, a.T, a.H, a.mb, a.group, a.ncp);
  const unsigned D = static_cast<unsigned>(a.D), F = static_cast<unsigned>(a.F),
                 mb = static_cast<unsigned>(a.mb), C = static_cast<unsigned>(a.H * a.D),
                 SZ = static_cast<unsigned>(a.SZ), ls = static_cast<unsigned>(ttt_row_stride(a.D)),
                 tid = threadIdx.x, nt = blockDim.x;
  // Global slice [group states | running state | rows]; on chip [rows | running state, dS |
  // group states], each part there when a.place says so.
  float* slice = a.scratch + task * ttt_backward_scratch_elements(a.SZ, D, F, mb, a.gsz, Mlp);
  float* sm = ttt_smem();
  const bool rows_on_chip = (a.place & ttt_rows_on_chip) != 0,
             state_on_chip = (a.place & ttt_state_on_chip) != 0;
  const std::size_t rows_n = rows_on_chip ? ttt_backward_rows(D, F, mb, Mlp) : 0,
                    state_n = state_on_chip ? 2 * a.SZ : 0;  // shared memory before each part
  float* p = rows_on_chip ? sm : slice + (a.gsz + 1) * a.SZ;
  float* Wc = state_on_chip ? sm + rows_n : slice + a.gsz * a.SZ;  // the running state
  // [gsz, SZ]: the state entering each mini-batch of a group
  float* states = (a.place & ttt_group_on_chip) ? sm + rows_n + state_n : slice;
  mb_fwd bf;
  float* lrm;
  mb_rows rs;
  mb_bwd bb;
  float *d_out, *dqs, *dks, *dvs;  // the staged rows of d_o, dq, dk, dv
  carve_backward<Mlp>(carve_forward<Mlp>(p, D, F, mb, bf, lrm, rs), D, F, mb, bb, d_out, dqs, dks,
                      dvs);

  // dL/d(state) runs beside the running state; the partials get it at the end.
  float* part = a.part + task * (a.SZ + 2 * a.D + a.mb);
  float* dS = state_on_chip ? Wc + a.SZ : part;
  float* pgam = part + SZ;
  float* pbet = pgam + D;
  float* ptok = pbet + D;
  for (unsigned e = tid; e < SZ; e += nt) dS[e] = 0.0f;
  for (unsigned e = tid; e < 2 * D + mb; e += nt) pgam[e] = 0.0f;
  __syncthreads();

  for (std::size_t c = row.ncp; c-- > 0;) {
    const std::size_t m0 = c * a.group;
    const std::size_t m1 = (row.nmb - m0 < a.gsz) ? row.nmb : m0 + a.gsz;
    const float* src = a.ckpt + (row.ckpt0 + c) * a.SZ;
    for (unsigned e = tid; e < SZ; e += nt) Wc[e] = src[e];
    __syncthreads();
    // Recompute the group's entering states (the last one's update is not needed).
    for (std::size_t m = m0; m < m1; ++m) {
      float* dst = states + (m - m0) * a.SZ;
      for (unsigned e = tid; e < SZ; e += nt) dst[e] = Wc[e];
      if (m + 1 == m1) break;
      const std::size_t t0 = m * mb;
      const unsigned K = static_cast<unsigned>((row.len - t0 < mb) ? row.len - t0 : mb);
      const std::size_t r0 = (row.begin + t0) * C + h * D;
      for (unsigned i = tid; i < K; i += nt) lrm[i] = a.lr[(row.begin + t0 + i) * a.H + h];
      stage_rows(a.k + r0, C, K, D, rs.k);  // the gradients and the update read k and v only
      stage_rows(a.v + r0, C, K, D, rs.v);
      __syncthreads();
      const mb_ctx mc{rs.q, rs.k, rs.v, lrm, a.tok, K, D, F, ls, h, a.eps};
      mb_gradients<Mlp>(mc, Wc, bf, norm_w, norm_b);
      mb_update<Mlp>(mc, Wc, bf);
    }
    __syncthreads();
    for (std::size_t m = m1; m-- > m0;) {
      const float* W = states + (m - m0) * a.SZ;
      const std::size_t t0 = m * mb;
      const unsigned K = static_cast<unsigned>((row.len - t0 < mb) ? row.len - t0 : mb);
      const std::size_t r0 = (row.begin + t0) * C + h * D;
      for (unsigned i = tid; i < K; i += nt) lrm[i] = a.lr[(row.begin + t0 + i) * a.H + h];
      stage_rows(a.q + r0, C, K, D, rs.q);
      stage_rows(a.k + r0, C, K, D, rs.k);
      stage_rows(a.v + r0, C, K, D, rs.v);
      stage_rows(a.d_o + r0, C, K, D, d_out);
      __syncthreads();
      const mb_ctx mc{rs.q, rs.k, rs.v, lrm, a.tok, K, D, F, ls, h, a.eps};
      mb_gradients<Mlp>(mc, W, bf, norm_w, norm_b);
      mb_outputs<Mlp>(mc, W, bf);
      mb_backward<Mlp>(mc, norm_w, norm_b, W, bf, bb, d_out, dqs, dks, dvs, dS, pgam, pbet, ptok);
      for (unsigned i = tid; i < K; i += nt) a.dlr[(row.begin + t0 + i) * a.H + h] = bb.dl[i];
      unstage_rows(dqs, C, K, D, a.dq + r0);
      unstage_rows(dks, C, K, D, a.dk + r0);
      unstage_rows(dvs, C, K, D, a.dv + r0);
      __syncthreads();
    }
  }
  if (state_on_chip)
    for (unsigned e = tid; e < SZ; e += nt) part[e] = dS[e];
}

using row_reduce = detail::block_allreduce<float, detail::row_threads>;
struct moments {
  float mu, sigma;
};
// A row's mean and σ = sqrt(biased variance + eps), two passes as cpu::ln_row, reduced over the
// CTA (every thread gets both). The post norm's forward and backward share it, so the backward's
// x̂ is the forward's.
template <typename S>
__device__ inline moments row_moments(const S* row, std::size_t C, float eps,
                                      row_reduce::storage& red) {
  float sum = 0.0f;
  for (std::size_t j = threadIdx.x; j < C; j += blockDim.x) sum += ld(row, j);
  const float mu = row_reduce::run(sum, detail::op_sum{}, red) / static_cast<float>(C);
  float sq = 0.0f;
  for (std::size_t j = threadIdx.x; j < C; j += blockDim.x) {
    const float d = ld(row, j) - mu;
    sq += d * d;
  }
  const float var = row_reduce::run(sq, detail::op_sum{}, red) / static_cast<float>(C);
  return {mu, ::sqrtf(var + eps)};
}

// pn = (LN_C(o)·post_w + post_b) [⊙ GELU(gpre)], one CTA per row; o is the saved storage output.
template <typename S>
__global__ void __launch_bounds__(detail::row_threads)
    ttt_post_norm_kernel(const S* o, const S* post_w, const S* post_b, const float* gpre, S* pn,
                         std::size_t C, float eps) {
  __shared__ row_reduce::storage red;
  const std::size_t n = blockIdx.x;
  const S* row = o + n * C;
  const auto [mu, sigma] = row_moments(row, C, eps, red);
  for (std::size_t j = threadIdx.x; j < C; j += blockDim.x) {
    float v = (ld(row, j) - mu) / sigma * ld(post_w, j) + ld(post_b, j);
    if (gpre != nullptr) v *= gelu_tanh_f(gpre[n * C + j]);
    st(pn, n * C + j, v);
  }
}

// The post norm and gate backwards, one CTA per row (the CPU's post_norm, gate and LayerNorm
// backward): from the saved o, x̂ (kept for the parameters' sums) and pn = x̂·post_w + post_b;
// with the gate (gpre: x·Wg in, dL/dgpre out) dpn = dgated ⊙ GELU(gpre) and pn_s the gated value
// (the output GEMM's operand, for d wo); d_o = LN_C's backward of dpn ⊙ post_w.
template <typename S>
__global__ void __launch_bounds__(detail::row_threads)
    ttt_post_norm_backward_kernel(const S* o, const S* post_w, const S* post_b, float* gpre,
                                  float* dpn, S* pn_s, float* xh, float* d_o, std::size_t C,
                                  float eps) {
  __shared__ row_reduce::storage red;
  const std::size_t n = blockIdx.x;
  const S* row = o + n * C;
  const auto [mu, sigma] = row_moments(row, C, eps, red);
  float m1 = 0.0f, m2 = 0.0f;
  for (std::size_t j = threadIdx.x; j < C; j += blockDim.x) {
    const std::size_t e = n * C + j;
    const float x = (ld(row, j) - mu) / sigma;
    float p = x * ld(post_w, j) + ld(post_b, j);
    if (gpre != nullptr) {
      const float gl = gelu_tanh_f(gpre[e]), dgated = dpn[e];
      dpn[e] = dgated * gl;
      gpre[e] = dgated * p * gelu_tanh_d1(gpre[e]);
      p *= gl;
    }
    st(pn_s, e, p);
    xh[e] = x;
    const float dxh = dpn[e] * ld(post_w, j);
    m1 += dxh;
    m2 += dxh * x;
  }
  m1 = row_reduce::run(m1, detail::op_sum{}, red) / static_cast<float>(C);
  m2 = row_reduce::run(m2, detail::op_sum{}, red) / static_cast<float>(C);
  for (std::size_t j = threadIdx.x; j < C; j += blockDim.x) {
    const std::size_t e = n * C + j;
    const float dxh = dpn[e] * ld(post_w, j);
    d_o[e] = (dxh - m1 - xh[e] * m2) / sigma;
  }
}

// d post_w += Σ_n dpn ⊙ x̂, d post_b += Σ_n dpn: one thread per column, rows in order.
template <typename S>
__global__ void ttt_post_params_kernel(const float* dpn, const float* xh, std::size_t N,
                                       std::size_t C, S* g_post_w, S* g_post_b) {
  const std::size_t j = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= C) return;
  float aw = 0.0f, ab = 0.0f;
  for (std::size_t n = 0; n < N; ++n) {
    aw += dpn[n * C + j] * xh[n * C + j];
    ab += dpn[n * C + j];
  }
  st(g_post_w, j, ld(g_post_w, j) + aw);
  st(g_post_b, j, ld(g_post_b, j) + ab);
}

// The per-(row, head) partials [rows·H, SZ + 2D + mb] (rows: batch rows or packed sequences),
// summed over the rows in order into the
// inner state's initial weights and the inner norm's γ, β (one thread per (head, element)); the
// token offsets summed over heads too (one thread each), zero where the clamp was active.
template <typename S>
struct ttt_grad_targets {
  S *w1, *b1, *w2, *b2, *norm_w, *norm_b, *tok_offset;
};
template <typename S>
__global__ void ttt_reduce_partials_kernel(const float* part, std::size_t rows, std::size_t H,
                                           std::size_t D, std::size_t F, std::size_t SZ,
                                           std::size_t mb, const S* tok_offset,
                                           ttt_grad_targets<S> g) {
  const std::size_t e = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::size_t per_head = SZ + 2 * D, pe = SZ + 2 * D + mb;
  if (e < H * per_head) {
    const std::size_t h = e / per_head, j = e % per_head;
    float acc = 0.0f;
    for (std::size_t b = 0; b < rows; ++b) acc += part[(b * H + h) * pe + j];
    S* dst;
    std::size_t i;
    if (j < D * F) {
      dst = g.w1, i = h * D * F + j;
    } else if (j < D * F + F) {
      dst = g.b1, i = h * F + (j - D * F);
    } else if (j < SZ && j < 2 * D * F + F) {  // the MLP's W2 (SZ ends before it for Linear)
      dst = g.w2, i = h * F * D + (j - D * F - F);
    } else if (j < SZ) {
      dst = g.b2, i = h * D + (j - 2 * D * F - F);
    } else if (j < SZ + D) {
      dst = g.norm_w, i = h * D + (j - SZ);
    } else {
      dst = g.norm_b, i = h * D + (j - SZ - D);
    }
    st(dst, i, ld(dst, i) + acc);
  } else if (e < H * per_head + mb) {
    const std::size_t i = e - H * per_head;
    float acc = 0.0f;
    for (std::size_t h = 0; h < H; ++h) {
      float sh = 0.0f;
      for (std::size_t b = 0; b < rows; ++b) sh += part[(b * H + h) * pe + per_head + i];
      acc += sh;
    }
    const float raw = 1.0f / static_cast<float>(i + 1) + ld(tok_offset, i);
    if (raw > 0.0f) st(g.tok_offset, i, ld(g.tok_offset, i) + acc);  // clamp_min: no gradient
  }
}

// The learning-rate gate backwards: lr = base·σ(pre)/D, so dpre = dlr · lr · (1 − σ), in place.
// (A template only so that it is inline for the linker, as backend/cuda/model.cuh's are.)
template <int = 0>
__global__ void ttt_rate_grad_kernel(float* dlr, const float* lr, const float* sig, std::size_t n) {
  const std::size_t e = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e < n) dlr[e] *= lr[e] * (1.0f - sig[e]);
}
// d lr_w[h, c] += Σ_n dpre[n, h]·x[n, c] (threads e < H·C) and d lr_b[h] += Σ_n dpre[n, h] (the
// next H threads); rows in order. H is small: a GEMM's fixed costs buy nothing here.
template <typename S>
__global__ void ttt_rate_params_kernel(const float* dpre, const S* x, std::size_t N, std::size_t H,
                                       std::size_t C, S* g_lr_w, S* g_lr_b) {
  const std::size_t e = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e < H * C) {
    const std::size_t h = e / C, c = e % C;
    float acc = 0.0f;
    for (std::size_t n = 0; n < N; ++n) acc += dpre[n * H + h] * ld(x, n * C + c);
    st(g_lr_w, e, ld(g_lr_w, e) + acc);
  } else if (e < H * C + H) {
    const std::size_t h = e - H * C;
    float acc = 0.0f;
    for (std::size_t n = 0; n < N; ++n) acc += dpre[n * H + h];
    st(g_lr_b, h, ld(g_lr_b, h) + acc);
  }
}
// dx[n, c] += Σ_h dpre[n, h]·lr_w[h, c] (dx in fp32).
template <typename S>
__global__ void ttt_rate_dx_kernel(const float* dpre, const S* lr_w, std::size_t N, std::size_t H,
                                   std::size_t C, float* dx) {
  const std::size_t e = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= N * C) return;
  const std::size_t n = e / C, c = e % C;
  float acc = 0.0f;
  for (std::size_t h = 0; h < H; ++h) acc += dpre[n * H + h] * ld(lr_w, h * C + c);
  dx[e] += acc;
}

// The inner model on one row x [D] at a state Ws (W1 [D, F], b1 [F], W2 [F, D], b2 [D]; TTT-Linear
// W [D, D], b [D]), over the CTA's threads: TTT-MLP's z1 = x·W1 + b1, x2 = gelu(z1) [F] and
// z = x2·W2 + b2; TTT-Linear's z = x·W + b [D]. The caller's barrier follows it.
template <bool Mlp>
__device__ void inner_row_forward(const float* x, const float* Ws, unsigned D, unsigned F, float* z1, float* x2,
                                  float* z, unsigned tid, unsigned nt) {
  if constexpr (Mlp) {
    const unsigned w2o = D * F + F, b2o = 2 * D * F + F;
    for (unsigned f = tid; f < F; f += nt) {
      float acc = 0.0f;
      for (unsigned c = 0; c < D; ++c) acc += x[c] * Ws[c * F + f];
      z1[f] = acc + Ws[D * F + f];
      x2[f] = gelu_tanh_f(z1[f]);
    }
    __syncthreads();
    for (unsigned j = tid; j < D; j += nt) {
      float acc = 0.0f;
      for (unsigned f = 0; f < F; ++f) acc += x2[f] * Ws[w2o + f * D + j];
      z[j] = acc + Ws[b2o + j];
    }
  } else {
    for (unsigned j = tid; j < D; j += nt) {
      float acc = 0.0f;
      for (unsigned c = 0; c < D; ++c) acc += x[c] * Ws[c * D + j];
      z[j] = acc + Ws[D * D + j];
    }
  }
}

// One decoding token of one (batch, head) per CTA, the CPU step's arithmetic: the token's
// gradients at the mini-batch's starting state W join the running sums Σ (lr_t-weighted), the
// output goes through W − tok_i·Σ, and the mini-batch's last token folds that into W.
// q, k, v [B, C]; lr [B, H]; o_s [B, C] (storage); scratch per CTA ttt_step_elements.
template <bool Mlp, typename S>
__global__ void __launch_bounds__(ttt_inner_threads)
    ttt_step_kernel(inner_args a, unsigned i_pos, const S* norm_w, const S* norm_b, float* state,
                    S* o_s, float* scratch) {
  const std::size_t task = blockIdx.x;
  const std::size_t b = task / a.H;
  const unsigned h = static_cast<unsigned>(task % a.H);
  const unsigned D = static_cast<unsigned>(a.D), F = static_cast<unsigned>(a.F),
                 C = static_cast<unsigned>(a.H * a.D), SZ = static_cast<unsigned>(a.SZ),
                 tid = threadIdx.x, nt = blockDim.x;
  float* W = state + task * 2 * a.SZ;
  float* Gs = W + a.SZ;
  float* We = scratch + task * ttt_step_elements(a.SZ, D, F, Mlp);  // the effective state
  const unsigned fw = Mlp ? F : 0;  // TTT-Linear has no hidden layer
  float* z1 = We + a.SZ;
  float* x2 = z1 + fw;
  float* g1 = x2 + fw;
  float* z1b = g1 + fw;
  float* x2b = z1b + fw;
  float* z2 = x2b + fw;
  float* xh2 = z2 + D;
  float* g2 = xh2 + D;
  float* zb = g2 + D;
  const std::size_t r0 = b * C + h * D;
  const float* q = a.q + r0;
  const float* k = a.k + r0;
  const float* v = a.v + r0;
  const float lr_t = a.lr[b * a.H + h];
  const float tok_i = a.tok[i_pos];
  const unsigned w2o = D * F + F, b2o = 2 * D * F + F;  // W2, b2 inside a state

  inner_row_forward<Mlp>(k, W, D, F, z1, x2, z2, tid, nt);
  __syncthreads();
  if (tid < 32)  // the inner loss's gradient through the LayerNorm: one row, warp 0's first group
    ln_l2_grad_row(z2, k, v, norm_w + h * D, norm_b + h * D, D, a.eps, xh2, g2, tid % row_lanes,
                   tid < row_lanes);
  __syncthreads();
  if constexpr (Mlp) {
    for (unsigned f = tid; f < F; f += nt) {
      float acc = 0.0f;
      for (unsigned j = 0; j < D; ++j) acc += g2[j] * W[w2o + f * D + j];
      g1[f] = acc * gelu_tanh_d1(z1[f]);
    }
    __syncthreads();
  }
  // Σ += lr_t·xᵀ·g per layer, then the effective state, element by element (one thread each).
  const float* ga = Mlp ? g1 : g2;
  for (unsigned e = tid; e < SZ; e += nt) {
    float add;
    if (e < D * F) {
      add = lr_t * k[e / F] * ga[e % F];
    } else if (e < D * F + F) {
      add = lr_t * ga[e - D * F];
    } else if (e < b2o) {
      add = lr_t * x2[(e - w2o) / D] * g2[(e - w2o) % D];
    } else {
      add = lr_t * g2[e - b2o];
    }
    Gs[e] += add;
    We[e] = W[e] - tok_i * Gs[e];
  }
  __syncthreads();
  inner_row_forward<Mlp>(q, We, D, F, z1b, x2b, zb, tid, nt);
  __syncthreads();
  if (tid < 32) {
    ln_row(zb, D, a.eps, zb, tid % row_lanes, tid < row_lanes);
    if (tid < row_lanes)
      for (unsigned j = tid; j < D; j += row_lanes)
        st(o_s, r0 + j, q[j] + ld(norm_w, h * D + j) * zb[j] + ld(norm_b, h * D + j));
  }
  if (i_pos + 1 == a.mb) {  // the mini-batch ends: its last effective state starts the next
    for (unsigned e = tid; e < SZ; e += nt) {
      W[e] = We[e];
      Gs[e] = 0.0f;
    }
  }
}

// The decoding state from the learned initial state of each head; the running sums zeroed.
template <typename S>
__global__ void ttt_reset_kernel(float* state, std::size_t H, std::size_t D, std::size_t F,
                                 std::size_t SZ, bool mlp, const S* w1, const S* b1, const S* w2,
                                 const S* b2) {
  const std::size_t task = blockIdx.x, h = task % H;
  float* W = state + task * 2 * SZ;
  for (std::size_t e = threadIdx.x; e < SZ; e += blockDim.x) {
    float v;
    if (e < D * F) {
      v = ld(w1, h * D * F + e);
    } else if (e < D * F + F) {
      v = ld(b1, h * F + (e - D * F));
    } else if (mlp && e < 2 * D * F + F) {
      v = ld(w2, h * F * D + (e - D * F - F));
    } else {
      v = ld(b2, h * D + (e - 2 * D * F - F));
    }
    W[e] = v;
    W[SZ + e] = 0.0f;
  }
}
