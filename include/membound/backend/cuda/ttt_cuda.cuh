// TTT-Linear and TTT-MLP on the GPU: the kernels that basic_ttt<Mlp, ..., cuda_backend> runs.
// The CPU layer (layers/ttt.hpp, backend/cpu/ttt_cpu.hpp) is the specification; this file follows
// its forward step by step:
//   q, k, v = x·Wq, x·Wk, x·Wv            cuBLASLt (gpu::matmul), fp32 out
//   RoPE at t mod b on q, k               rope kernel (angles in double, as the CPU)
//   lr = base·σ(x·lr_wᵀ + lr_b)/D, tok    gpu::matmul_bt + one elementwise kernel
//   the inner loop, dual form             one CTA per (batch, head), mini-batches in order
//   post LayerNorm, gate                  one CTA per row
//   y = pn·Wo                             cuBLASLt
// The saved buffer is the CPU's, byte for byte in layout: the inner state at the start of every
// G-th mini-batch (fp32) and the heads' output before the post norm (storage type).
//
// What lives where (this first version is the plain fp32 SIMT path): the inner state W (W1, b1;
// W2, b2 for the MLP) and the mini-batch's intermediates (Z, x̂, G, tril(XQ·XKᵀ), P, ...) live in
// a per-(batch, head) slice of global scratch, counted exactly in forward_workspace_bytes
// (scratch_elements); a CTA streams them through L1/L2. Keeping W in shared memory (it fits for
// TTT-Linear up to head_dim ≈ 100 in 227 KiB, never for TTT-MLP at head_dim 128: W1 alone is
// 256 KiB) and tensor-core products are the next step, not done here.
//
// The decoding step (ttt_step_kernel) and its state (make_state, reset with the executor) run on
// the device too, on the executor's stream.
// Not on the device yet: backward; it throws invalid_argument naming the backend (unsupported()).
//
// Determinism: every sum runs in a fixed order inside one thread (no atomics, no split
// reductions), so the forward is bit-identical across runs and across the checkpoint group G
// (G only decides which states are copied out).
#pragma once

#include <cstddef>
#include <limits>
#include <string>
#include <type_traits>

#include "membound/backend/cuda/cuda_backend.cuh"
#include "membound/backend/cuda/cuda_check.cuh"
#include "membound/backend/cuda/gemm.cuh"
#include "membound/backend/cuda/model_kernels.cuh"
#include "membound/core/checked_math.hpp"
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/core/element_math.hpp"
#include "membound/core/error.hpp"
#include "membound/memory/workspace.hpp"
#include "membound/policy/backend.hpp"
#include "membound/shape/ttt_shape.hpp"

MEMBOUND_NAMESPACE_BEGIN

namespace gpu {

// The inner model's sizes for one head: hidden width F and the state's element count, laid out
// W1 [D, F], b1 [F], W2 [F, D], b2 [D] as on the CPU.
struct ttt_dims {
  std::size_t D, F, SZ;
  static constexpr ttt_dims of(const ttt_shape& s, bool mlp) noexcept {
    const std::size_t D = s.head_dim(), F = mlp ? 4 * D : D;
    return {D, F, mlp ? 2 * D * F + F + D : D * D + D};
  }
};

// One (batch, head)'s scratch in fp32 elements: the running state, then the mini-batch's
// buffers: z1, x2, g1, z1b, x2b [mb, F]; z2, xh2, g2, zb [mb, D]; att1, p1, att2, p2 [mb, mb];
// sig2, lrm [mb].
constexpr std::size_t ttt_scratch_elements(std::size_t SZ, std::size_t D, std::size_t F,
                                           std::size_t mb) noexcept {
  return SZ + 5 * mb * F + 4 * mb * D + 4 * mb * mb + 2 * mb;
}

inline constexpr unsigned ttt_inner_threads = 256;

}  // namespace gpu

template <>
struct backend_kernels<cuda_backend, ttt_shape> {
  template <typename S, typename A>
  static constexpr void check_types() {
    static_assert(gpu::kernel_storage<S>,
                  "membound: cuda_backend stores float, bf16 or fp16; pick fp32_precision, "
                  "bf16_precision or fp16_precision for a TTT layer on the GPU.");
    static_assert(std::is_same_v<A, float>,
                  "membound: cuda_backend accumulates the TTT inner state in fp32; use a precision "
                  "whose accum_type is float (fp64 runs on cpu_backend only).");
  }

  template <bool Mlp, std::size_t MB, typename S>
  static constexpr std::size_t forward_workspace_bytes(const ttt_shape& s) {
    return fits<Mlp, MB>(s) ? forward_layout<Mlp, MB, S>(s).size()
                            : std::numeric_limits<std::size_t>::max();
  }
  // No device backward yet: its size is the forward's, so plans stay finite; backward() throws.
  template <bool Mlp, std::size_t MB, typename S>
  static constexpr std::size_t backward_workspace_bytes(const ttt_shape& s) {
    return forward_workspace_bytes<Mlp, MB, S>(s);
  }
  // The forward's layout at T = 1, plus the heads' output [B, C] in storage (forward writes it
  // into `saved`; decoding has none).
  template <bool Mlp, std::size_t MB, typename S>
  static constexpr std::size_t step_workspace_bytes(const ttt_shape& s) {
    ttt_shape one = s;
    one.seq = 1;
    const std::size_t f = forward_workspace_bytes<Mlp, MB, S>(one);
    if (f == std::numeric_limits<std::size_t>::max()) return f;
    return step_layout<Mlp, MB, S>(one).size();
  }

  // What has no device kernels yet: a typed error naming the backend, thrown before any buffer
  // is touched.
  [[noreturn]] static void unsupported(const char* what) {
    throw invalid_argument("backend", "cpu_backend (the TTT layers' device kernels cover forward and step only)",
                           "cuda_backend",
                           std::string("basic_ttt<..., cuda_backend>::") + what +
                               " has no CUDA kernels yet; run it with cpu_backend");
  }

#if MEMBOUND_CUDA_COMPILER
  // ckpt: the saved inner states [B·H, checkpoints, SZ] (fp32); o_s: the heads' output [N, C]
  // (storage). The layer checked the shape, the weights and the saved buffer.
  template <bool Mlp, std::size_t MB, std::size_t G, typename S, typename A, typename Weights>
  static void forward(const ttt_shape& s, const Weights& w, const S* x, S* y, A* ckpt, S* o_s,
                      void* workspace, std::size_t workspace_size, const cuda_executor& ex);
  // One decoding token per sequence at mini-batch position i (st: [B·H, 2, SZ] fp32, the
  // starting state then the running sums, as on the CPU). The layer checked the state.
  template <bool Mlp, std::size_t MB, typename S, typename A, typename Weights>
  static void step(const ttt_shape& s, const Weights& w, A* state, std::size_t i, const S* x_t,
                   S* y_t, void* workspace, std::size_t workspace_size, const cuda_executor& ex);
  // The state from the layer's W1, b1 (W2, b2), sums zeroed, on the executor's stream.
  template <bool Mlp, typename A, typename Weights>
  static void reset_state(const ttt_shape& s, const Weights& w, A* state, const cuda_executor& ex);
#else
  template <bool Mlp, std::size_t MB, typename S, typename A, typename... Args>
  static void step(Args&&...) {
    static_assert(dependent_false<S, A>,
                  "membound: basic_ttt<..., cuda_backend>::step launches CUDA kernels; compile "
                  "this translation unit with nvcc (a .cu file, or LANGUAGE CUDA in CMake).");
  }
  template <bool Mlp, typename A, typename... Args>
  static void reset_state(Args&&...) {
    static_assert(dependent_false<A>,
                  "membound: basic_ttt<..., cuda_backend>::make_state/reset launch CUDA kernels; "
                  "compile this translation unit with nvcc (a .cu file, or LANGUAGE CUDA in CMake).");
  }
  template <bool Mlp, std::size_t MB, std::size_t G, typename S, typename A, typename... Args>
  static void forward(Args&&...) {
    static_assert(dependent_false<S, A>,
                  "membound: basic_ttt<..., cuda_backend>::forward launches CUDA kernels; compile "
                  "this translation unit with nvcc (a .cu file, or LANGUAGE CUDA in CMake).");
  }
#endif

 private:
  template <bool Mlp, std::size_t MB>
  static constexpr bool fits(const ttt_shape& s) noexcept {
    const auto d = gpu::ttt_dims::of(s, Mlp);
    const std::size_t N = s.batch * s.seq;
    if (s.batch != 0 && N / s.batch != s.seq) return false;
    if (d.SZ >= (std::size_t{1} << 31) || MB >= (std::size_t{1} << 15)) return false;  // 32-bit indices
    const std::size_t per = gpu::ttt_scratch_elements(d.SZ, d.D, d.F, MB);
    return bytes_of<float>(N, s.width) != std::numeric_limits<std::size_t>::max() &&
           bytes_of<float>(s.batch * s.heads, per) != std::numeric_limits<std::size_t>::max();
  }

 public:
  // cuBLASLt's workspace first (256-byte aligned); q, k (then the gate's pre-activation), v [N, C]
  // fp32; lr [N, H]; tok [mb]; the inner loop's scratch [B·H, scratch_elements]; pn [N, C] in
  // storage (the output GEMM's operand).
  enum forward_slot : std::size_t { f_gemm, f_q, f_k, f_v, f_lr, f_tok, f_scratch, f_pn };
  template <bool Mlp, std::size_t MB, typename S>
  static constexpr workspace_layout<8> forward_layout(const ttt_shape& s) {
    const auto d = gpu::ttt_dims::of(s, Mlp);
    const std::size_t N = s.batch * s.seq, C = s.width, H = s.heads;
    workspace_layout<8> l;
    l.add(gpu::gemm_workspace_bytes_max, gpu::gemm_workspace_alignment);
    l.add(bytes_of<float>(N, C));
    l.add(bytes_of<float>(N, C));
    l.add(bytes_of<float>(N, C));
    l.add(bytes_of<float>(N, H));
    l.add(bytes_of<float>(MB));
    l.add(bytes_of<float>(s.batch * H, gpu::ttt_scratch_elements(d.SZ, d.D, d.F, MB)));
    l.add(bytes_of<S>(N, C));
    return l;
  }
  enum step_slot : std::size_t { s_forward, s_o };
  template <bool Mlp, std::size_t MB, typename S>
  static constexpr workspace_layout<2> step_layout(const ttt_shape& one) {
    workspace_layout<2> l;
    l.add(forward_layout<Mlp, MB, S>(one).size(), gpu::gemm_workspace_alignment);
    l.add(bytes_of<S>(one.batch, one.width));
    return l;
  }
};

#if MEMBOUND_CUDA_COMPILER

namespace gpu {
namespace ttt_detail {

using detail::ld;
using detail::st;

// RoPE on interleaved pairs at position (n mod T) mod period; one thread per (row, pair, head).
// fixed < period: every row at that position instead (decoding).
__global__ void rope_kernel(float* x, std::size_t N, std::size_t T, std::size_t H, std::size_t D,
                            double base, std::size_t period, std::size_t fixed) {
  const std::size_t half = D / 2;
  const std::size_t e = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= N * H * half) return;
  const std::size_t n = e / (H * half), h = (e / half) % H, i = e % half;
  const double position = static_cast<double>(fixed < period ? fixed : (n % T) % period);
  const double inv_freq = ::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(D));
  const double angle = position * inv_freq;
  const float c = static_cast<float>(::cos(angle)), sn = static_cast<float>(::sin(angle));
  float* p = x + n * H * D + h * D + 2 * i;
  const float x1 = p[0], x2 = p[1];
  p[0] = x1 * c - x2 * sn;
  p[1] = x2 * c + x1 * sn;
}

// lr[n, h] = scale·σ(pre[n, h] + lr_b[h]) in place; tok[i] = max(0, 1/(i+1) + tok_offset[i]).
template <typename S>
__global__ void rates_kernel(float* lr, const S* lr_b, std::size_t N, std::size_t H, float scale,
                             const S* tok_offset, float* tok, std::size_t mb) {
  const std::size_t e = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e < N * H) {
    const float sg = 1.0f / (1.0f + ::expf(-(lr[e] + ld(lr_b, e % H))));
    lr[e] = scale * sg;
  }
  if (e < mb) {
    const float t = 1.0f / static_cast<float>(e + 1) + ld(tok_offset, e);
    tok[e] = t > 0.0f ? t : 0.0f;
  }
}

struct inner_args {
  const float *q, *k, *v, *lr, *tok;
  std::size_t T, H, D, F, SZ, mb, group, ncp, nmb;
  float eps;
};

// Two-pass LayerNorm of one row (mean, then biased variance), as cpu::ln_row; returns σ.
__device__ inline float ln_row(const float* z, std::size_t D, float eps, float* xh) {
  float mu = 0.0f;
  for (std::size_t j = 0; j < D; ++j) mu += z[j];
  mu /= static_cast<float>(D);
  float var = 0.0f;
  for (std::size_t j = 0; j < D; ++j) var += (z[j] - mu) * (z[j] - mu);
  var /= static_cast<float>(D);
  const float sigma = ::sqrtf(var + eps);
  if (xh != nullptr)
    for (std::size_t j = 0; j < D; ++j) xh[j] = (z[j] - mu) / sigma;
  return sigma;
}

// The inner loop of one (batch, head) per CTA. State and mini-batch buffers live in this CTA's
// slice of global scratch; each phase is a strided loop over its outputs, every output summed by
// one thread in index order, phases separated by __syncthreads (every thread reaches every one:
// the loop bounds are uniform across the CTA).
template <bool Mlp, typename S>
__global__ void __launch_bounds__(ttt_inner_threads)
    ttt_forward_kernel(inner_args a, const S* norm_w, const S* norm_b, const S* w1, const S* b1,
                       const S* w2, const S* b2, S* o_s, float* ckpt, float* scratch) {
  // 32-bit indices inside a mini-batch (K·F, D·F < 2^32 for any head the launcher accepts;
  // 64-bit only for the row offsets into [B·T, C]): the MLP kernel spilled with 64-bit ones.
  const std::size_t task = blockIdx.x;
  const std::size_t b = task / a.H;
  const unsigned h = static_cast<unsigned>(task % a.H);
  const unsigned D = static_cast<unsigned>(a.D), F = static_cast<unsigned>(a.F),
                 mb = static_cast<unsigned>(a.mb), C = static_cast<unsigned>(a.H * a.D),
                 tid = threadIdx.x, nt = blockDim.x;
  float* W = scratch + task * ttt_scratch_elements(a.SZ, D, F, mb);
  float* W1 = W;
  float* B1 = W + D * F;
  float* W2 = B1 + F;
  float* B2 = W2 + F * D;
  float* z1 = W + a.SZ;
  float* x2 = z1 + mb * F;
  float* g1 = x2 + mb * F;
  float* z1b = g1 + mb * F;
  float* x2b = z1b + mb * F;
  float* z2 = x2b + mb * F;
  float* xh2 = z2 + mb * D;
  float* g2 = xh2 + mb * D;
  float* zb = g2 + mb * D;
  float* att1 = zb + mb * D;
  float* p1 = att1 + mb * mb;
  float* att2 = p1 + mb * mb;
  float* p2 = att2 + mb * mb;
  float* sig2 = p2 + mb * mb;
  float* lrm = sig2 + mb;

  // The learned initial state of head h.
  for (unsigned e = tid; e < D * F; e += nt) W1[e] = ld(w1, h * D * F + e);
  for (unsigned e = tid; e < F; e += nt) B1[e] = ld(b1, h * F + e);
  if constexpr (Mlp) {
    for (unsigned e = tid; e < F * D; e += nt) W2[e] = ld(w2, h * F * D + e);
    for (unsigned e = tid; e < D; e += nt) B2[e] = ld(b2, h * D + e);
  }
  __syncthreads();

  for (std::size_t m = 0; m < a.nmb; ++m) {
    const std::size_t t0 = m * mb;
    const unsigned K = static_cast<unsigned>((a.T - t0 < mb) ? a.T - t0 : mb);
    const std::size_t r0 = (b * a.T + t0) * C + h * D;  // row i of q/k/v/o at r0 + i·C
    const float* q = a.q + r0;
    const float* k = a.k + r0;
    const float* v = a.v + r0;
    if (m % a.group == 0) {
      float* dst = ckpt + (task * a.ncp + m / a.group) * a.SZ;
      for (unsigned e = tid; e < a.SZ; e += nt) dst[e] = W[e];
    }
    for (unsigned i = tid; i < K; i += nt) lrm[i] = a.lr[(b * a.T + t0 + i) * a.H + h];
    __syncthreads();

    // Z of the inner model at the mini-batch's starting state.
    if constexpr (Mlp) {
      for (unsigned e = tid; e < K * F; e += nt) {
        const unsigned i = e / F, f = e % F;
        float acc = 0.0f;
        for (unsigned c = 0; c < D; ++c) acc += k[i * C + c] * W1[c * F + f];
        z1[e] = acc + B1[f];
        x2[e] = gelu_tanh_f(z1[e]);
      }
      __syncthreads();
      for (unsigned e = tid; e < K * D; e += nt) {
        const unsigned i = e / D, j = e % D;
        float acc = 0.0f;
        for (unsigned f = 0; f < F; ++f) acc += x2[i * F + f] * W2[f * D + j];
        z2[e] = acc + B2[j];
      }
    } else {
      for (unsigned e = tid; e < K * D; e += nt) {
        const unsigned i = e / D, j = e % D;
        float acc = 0.0f;
        for (unsigned c = 0; c < D; ++c) acc += k[i * C + c] * W1[c * D + j];
        z2[e] = acc + B1[j];
      }
    }
    __syncthreads();

    // G2 = ∇ ½‖γ x̂ + β − (v − k)‖² through the LayerNorm, one thread per row (as ttt_ln_l2).
    for (unsigned i = tid; i < K; i += nt) {
      const float sg = ln_row(z2 + i * D, D, a.eps, xh2 + i * D);
      sig2[i] = sg;
      float* gr = g2 + i * D;
      float s1 = 0.0f, s2 = 0.0f;
      for (unsigned j = 0; j < D; ++j) {
        const float gam = ld(norm_w, h * D + j), bet = ld(norm_b, h * D + j);
        const float r = gam * xh2[i * D + j] + bet - (v[i * C + j] - k[i * C + j]);
        gr[j] = r * gam;
        s1 += gr[j];
        s2 += gr[j] * xh2[i * D + j];
      }
      s1 /= static_cast<float>(D);
      s2 /= static_cast<float>(D);
      for (unsigned j = 0; j < D; ++j) gr[j] = (gr[j] - s1 - xh2[i * D + j] * s2) / sg;
    }
    // P1 = η ⊙ (tril(XQ·XKᵀ) + 1), η[i, s] = tok_i·lr_s.
    for (unsigned e = tid; e < K * K; e += nt) {
      const unsigned i = e / K, s = e % K;
      if (s > i) {
        att1[e] = 0.0f;
        p1[e] = 0.0f;
      } else {
        float acc = 0.0f;
        for (unsigned c = 0; c < D; ++c) acc += q[i * C + c] * k[s * C + c];
        att1[e] = acc;
        p1[e] = a.tok[i] * lrm[s] * (acc + 1.0f);
      }
    }
    __syncthreads();
    if constexpr (Mlp) {
      // G1 = (G2·W2ᵀ) ⊙ GELU'(Z1).
      for (unsigned e = tid; e < K * F; e += nt) {
        const unsigned i = e / F, f = e % F;
        float acc = 0.0f;
        for (unsigned j = 0; j < D; ++j) acc += g2[i * D + j] * W2[f * D + j];
        g1[e] = acc * gelu_tanh_d1(z1[e]);
      }
      __syncthreads();
      // Zbar1 = XQ·W1 + b1 − P1·G1, X2bar = GELU(Zbar1).
      for (unsigned e = tid; e < K * F; e += nt) {
        const unsigned i = e / F, f = e % F;
        float acc = 0.0f;
        for (unsigned c = 0; c < D; ++c) acc += q[i * C + c] * W1[c * F + f];
        acc += B1[f];
        float pg = 0.0f;
        for (unsigned s = 0; s <= i; ++s) pg += p1[i * K + s] * g1[s * F + f];
        z1b[e] = acc - pg;
        x2b[e] = gelu_tanh_f(z1b[e]);
      }
      __syncthreads();
      for (unsigned e = tid; e < K * K; e += nt) {
        const unsigned i = e / K, s = e % K;
        if (s > i) {
          att2[e] = 0.0f;
          p2[e] = 0.0f;
        } else {
          float acc = 0.0f;
          for (unsigned f = 0; f < F; ++f) acc += x2b[i * F + f] * x2[s * F + f];
          att2[e] = acc;
          p2[e] = a.tok[i] * lrm[s] * (acc + 1.0f);
        }
      }
      __syncthreads();
      for (unsigned e = tid; e < K * D; e += nt) {
        const unsigned i = e / D, j = e % D;
        float acc = 0.0f;
        for (unsigned f = 0; f < F; ++f) acc += x2b[i * F + f] * W2[f * D + j];
        acc += B2[j];
        float pg = 0.0f;
        for (unsigned s = 0; s <= i; ++s) pg += p2[i * K + s] * g2[s * D + j];
        zb[e] = acc - pg;
      }
    } else {
      for (unsigned e = tid; e < K * D; e += nt) {
        const unsigned i = e / D, j = e % D;
        float acc = 0.0f;
        for (unsigned c = 0; c < D; ++c) acc += q[i * C + c] * W1[c * D + j];
        acc += B1[j];
        float pg = 0.0f;
        for (unsigned s = 0; s <= i; ++s) pg += p1[i * K + s] * g2[s * D + j];
        zb[e] = acc - pg;
      }
    }
    __syncthreads();

    // out = XQ + γ ⊙ LN(Zbar) + β, rounded to storage straight into `saved`; one thread per row
    // (x̂ overwrites Zbar's row: nothing reads it later).
    for (unsigned i = tid; i < K; i += nt) {
      float* zr = zb + i * D;
      ln_row(zr, D, a.eps, zr);
      const std::size_t r = r0 + i * C;
      for (unsigned j = 0; j < D; ++j) {
        const float out = q[i * C + j] + ld(norm_w, h * D + j) * zr[j] + ld(norm_b, h * D + j);
        st(o_s, r + j, out);
      }
    }
    // The update, e_s = tok[K−1]·lr_s: W1 −= XKᵀ·diag(e)·G1, b1 −= Σ e_s G1_s (G1 is G2 for
    // TTT-Linear); for the MLP also W2 −= X2ᵀ·diag(e)·G2, b2 −= Σ e_s G2_s. Nothing above reads
    // the state after the last barrier, so it is updated in place.
    const float tl = a.tok[K - 1];
    const float* ga = Mlp ? g1 : g2;
    for (unsigned e = tid; e < D * F; e += nt) {
      const unsigned c = e / F, f = e % F;
      float acc = 0.0f;
      for (unsigned s = 0; s < K; ++s) acc += k[s * C + c] * (tl * lrm[s] * ga[s * F + f]);
      W1[e] -= acc;
    }
    for (unsigned f = tid; f < F; f += nt) {
      float acc = B1[f];
      for (unsigned s = 0; s < K; ++s) acc -= tl * lrm[s] * ga[s * F + f];
      B1[f] = acc;
    }
    if constexpr (Mlp) {
      for (unsigned e = tid; e < F * D; e += nt) {
        const unsigned f = e / D, j = e % D;
        float acc = 0.0f;
        for (unsigned s = 0; s < K; ++s) acc += x2[s * F + f] * (tl * lrm[s] * g2[s * D + j]);
        W2[e] -= acc;
      }
      for (unsigned j = tid; j < D; j += nt) {
        float acc = B2[j];
        for (unsigned s = 0; s < K; ++s) acc -= tl * lrm[s] * g2[s * D + j];
        B2[j] = acc;
      }
    }
    __syncthreads();
  }
}

// pn = (LN_C(o)·post_w + post_b) [⊙ GELU(gpre)], one CTA per row; o is the saved storage output.
template <typename S>
__global__ void __launch_bounds__(detail::row_threads)
    ttt_post_norm_kernel(const S* o, const S* post_w, const S* post_b, const float* gpre, S* pn,
                         std::size_t C, float eps) {
  using reduce = detail::block_allreduce<float, detail::row_threads>;
  __shared__ typename reduce::storage red;
  const std::size_t n = blockIdx.x;
  const S* row = o + n * C;
  float sum = 0.0f;
  for (std::size_t j = threadIdx.x; j < C; j += blockDim.x) sum += ld(row, j);
  const float mu = reduce::run(sum, detail::op_sum{}, red) / static_cast<float>(C);
  float sq = 0.0f;
  for (std::size_t j = threadIdx.x; j < C; j += blockDim.x) {
    const float d = ld(row, j) - mu;
    sq += d * d;
  }
  const float var = reduce::run(sq, detail::op_sum{}, red) / static_cast<float>(C);
  const float sigma = ::sqrtf(var + eps);
  for (std::size_t j = threadIdx.x; j < C; j += blockDim.x) {
    float v = (ld(row, j) - mu) / sigma * ld(post_w, j) + ld(post_b, j);
    if (gpre != nullptr) v *= gelu_tanh_f(gpre[n * C + j]);
    st(pn, n * C + j, v);
  }
}

// One decoding token of one (batch, head) per CTA, the CPU step's arithmetic: the token's
// gradients at the mini-batch's starting state W join the running sums Σ (lr_t-weighted), the
// output goes through W − tok_i·Σ, and the mini-batch's last token folds that into W.
// q, k, v [B, C]; lr [B, H]; o_s [B, C] (storage); scratch per CTA ttt_scratch_elements(.., 1).
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
  float* We = scratch + task * ttt_scratch_elements(a.SZ, D, F, 1);  // the effective state
  float* z1 = We + a.SZ;
  float* x2 = z1 + F;
  float* g1 = x2 + F;
  float* z1b = g1 + F;
  float* x2b = z1b + F;
  float* z2 = x2b + F;
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

  if constexpr (Mlp) {
    for (unsigned f = tid; f < F; f += nt) {
      float acc = 0.0f;
      for (unsigned c = 0; c < D; ++c) acc += k[c] * W[c * F + f];
      z1[f] = acc + W[D * F + f];
      x2[f] = gelu_tanh_f(z1[f]);
    }
    __syncthreads();
    for (unsigned j = tid; j < D; j += nt) {
      float acc = 0.0f;
      for (unsigned f = 0; f < F; ++f) acc += x2[f] * W[w2o + f * D + j];
      z2[j] = acc + W[b2o + j];
    }
  } else {
    for (unsigned j = tid; j < D; j += nt) {
      float acc = 0.0f;
      for (unsigned c = 0; c < D; ++c) acc += k[c] * W[c * D + j];
      z2[j] = acc + W[D * D + j];
    }
  }
  __syncthreads();
  if (tid == 0) {  // the inner loss's gradient through the LayerNorm (one row)
    const float sg = ln_row(z2, D, a.eps, xh2);
    float s1 = 0.0f, s2 = 0.0f;
    for (unsigned j = 0; j < D; ++j) {
      const float gam = ld(norm_w, h * D + j), bet = ld(norm_b, h * D + j);
      const float r = gam * xh2[j] + bet - (v[j] - k[j]);
      g2[j] = r * gam;
      s1 += g2[j];
      s2 += g2[j] * xh2[j];
    }
    s1 /= static_cast<float>(D);
    s2 /= static_cast<float>(D);
    for (unsigned j = 0; j < D; ++j) g2[j] = (g2[j] - s1 - xh2[j] * s2) / sg;
  }
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
  if constexpr (Mlp) {
    for (unsigned f = tid; f < F; f += nt) {
      float acc = 0.0f;
      for (unsigned c = 0; c < D; ++c) acc += q[c] * We[c * F + f];
      z1b[f] = acc + We[D * F + f];
      x2b[f] = gelu_tanh_f(z1b[f]);
    }
    __syncthreads();
    for (unsigned j = tid; j < D; j += nt) {
      float acc = 0.0f;
      for (unsigned f = 0; f < F; ++f) acc += x2b[f] * We[w2o + f * D + j];
      zb[j] = acc + We[b2o + j];
    }
  } else {
    for (unsigned j = tid; j < D; j += nt) {
      float acc = 0.0f;
      for (unsigned c = 0; c < D; ++c) acc += q[c] * We[c * D + j];
      zb[j] = acc + We[D * D + j];
    }
  }
  __syncthreads();
  if (tid == 0) {
    ln_row(zb, D, a.eps, zb);
    for (unsigned j = 0; j < D; ++j)
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

inline unsigned blocks_for(std::size_t n, std::size_t threads) {
  return detail::grid_for(n, threads);
}

}  // namespace ttt_detail
}  // namespace gpu

template <bool Mlp, std::size_t MB, std::size_t G, typename S, typename A, typename Weights>
void backend_kernels<cuda_backend, ttt_shape>::forward(const ttt_shape& s, const Weights& w,
                                                        const S* x, S* y, A* ckpt, S* o_s,
                                                        void* workspace, std::size_t workspace_size,
                                                        const cuda_executor& ex) {
  check_types<S, A>();
  namespace td = gpu::ttt_detail;
  const auto ws = carve(forward_layout<Mlp, MB, S>(s), workspace, workspace_size);
  const auto d = gpu::ttt_dims::of(s, Mlp);
  const std::size_t N = s.batch * s.seq, C = s.width, H = s.heads, T = s.seq;
  // ceil without the overflow of nmb + G − 1 (ttt_checkpoint_all is G = SIZE_MAX).
  const std::size_t nmb = T / MB + (T % MB != 0), ncp = nmb / G + (nmb % G != 0);
  const gpu::gemm_context ctx(ex, gpu::shared_gemm_cache(), ws.template get<std::byte>(f_gemm),
                              gpu::gemm_workspace_bytes_max);
  float* q = ws.template get<float>(f_q);
  float* k = ws.template get<float>(f_k);
  float* v = ws.template get<float>(f_v);
  float* lr = ws.template get<float>(f_lr);
  float* tok = ws.template get<float>(f_tok);
  float* scratch = ws.template get<float>(f_scratch);
  S* pn = ws.template get<S>(f_pn);
  const cudaStream_t st = ex.stream();

  gpu::matmul(ctx, x, w.wq, q, N, C, C, false);
  gpu::matmul(ctx, x, w.wk, k, N, C, C, false);
  gpu::matmul(ctx, x, w.wv, v, N, C, C, false);
  const std::size_t pairs = N * H * (d.D / 2);
  td::rope_kernel<<<td::blocks_for(pairs, 256), 256, 0, st>>>(q, N, T, H, d.D, s.rope_base, MB, MB);
  cuda_check(cudaGetLastError(), "ttt rope_kernel launch");
  td::rope_kernel<<<td::blocks_for(pairs, 256), 256, 0, st>>>(k, N, T, H, d.D, s.rope_base, MB, MB);
  cuda_check(cudaGetLastError(), "ttt rope_kernel launch");
  gpu::matmul_bt(ctx, x, w.lr_w, lr, N, C, H, false);
  const float scale = static_cast<float>(s.base_lr / static_cast<double>(d.D));
  const std::size_t rate_n = N * H > MB ? N * H : MB;
  td::rates_kernel<S><<<td::blocks_for(rate_n, 256), 256, 0, st>>>(lr, w.lr_b, N, H, scale,
                                                                   w.tok_offset, tok, MB);
  cuda_check(cudaGetLastError(), "ttt rates_kernel launch");

  const td::inner_args args{q, k, v, lr, tok, T, H, d.D, d.F, d.SZ, MB, G, ncp, nmb, 1e-6f};
  td::ttt_forward_kernel<Mlp, S><<<static_cast<unsigned>(s.batch * H), gpu::ttt_inner_threads, 0,
                                   st>>>(args, w.ttt_norm_w, w.ttt_norm_b, w.w1, w.b1, w.w2, w.b2,
                                         o_s, ckpt, scratch);
  cuda_check(cudaGetLastError(), "ttt_forward_kernel launch");

  const float* gpre = nullptr;
  if (s.use_gate) {
    gpu::matmul(ctx, x, w.wg, k, N, C, C, false);  // k is free after the inner loop
    gpre = k;
  }
  td::ttt_post_norm_kernel<S><<<static_cast<unsigned>(N), gpu::detail::row_threads, 0, st>>>(
      o_s, w.post_w, w.post_b, gpre, pn, C, 1e-6f);
  cuda_check(cudaGetLastError(), "ttt_post_norm_kernel launch");
  gpu::matmul(ctx, static_cast<const S*>(pn), w.wo, y, N, C, C, false);
}

template <bool Mlp, std::size_t MB, typename S, typename A, typename Weights>
void backend_kernels<cuda_backend, ttt_shape>::step(const ttt_shape& s, const Weights& w, A* state,
                                                     std::size_t i, const S* x_t, S* y_t,
                                                     void* workspace, std::size_t workspace_size,
                                                     const cuda_executor& ex) {
  check_types<S, A>();
  namespace td = gpu::ttt_detail;
  ttt_shape one = s;
  one.seq = 1;
  const auto outer = carve(step_layout<Mlp, MB, S>(one), workspace, workspace_size);
  const auto fl = forward_layout<Mlp, MB, S>(one);
  const auto ws = carve(fl, outer.template get<std::byte>(s_forward), fl.size());
  S* o_s = outer.template get<S>(s_o);
  const auto d = gpu::ttt_dims::of(s, Mlp);
  const std::size_t B = s.batch, C = s.width, H = s.heads;
  const gpu::gemm_context ctx(ex, gpu::shared_gemm_cache(), ws.template get<std::byte>(f_gemm),
                              gpu::gemm_workspace_bytes_max);
  float* q = ws.template get<float>(f_q);
  float* k = ws.template get<float>(f_k);
  float* v = ws.template get<float>(f_v);
  float* lr = ws.template get<float>(f_lr);
  float* tok = ws.template get<float>(f_tok);
  float* scratch = ws.template get<float>(f_scratch);
  S* pn = ws.template get<S>(f_pn);
  const cudaStream_t st = ex.stream();

  gpu::matmul(ctx, x_t, w.wq, q, B, C, C, false);
  gpu::matmul(ctx, x_t, w.wk, k, B, C, C, false);
  gpu::matmul(ctx, x_t, w.wv, v, B, C, C, false);
  const std::size_t pairs = B * H * (d.D / 2);
  td::rope_kernel<<<td::blocks_for(pairs, 256), 256, 0, st>>>(q, B, 1, H, d.D, s.rope_base, MB, i);
  cuda_check(cudaGetLastError(), "ttt rope_kernel launch");
  td::rope_kernel<<<td::blocks_for(pairs, 256), 256, 0, st>>>(k, B, 1, H, d.D, s.rope_base, MB, i);
  cuda_check(cudaGetLastError(), "ttt rope_kernel launch");
  gpu::matmul_bt(ctx, x_t, w.lr_w, lr, B, C, H, false);
  const float scale = static_cast<float>(s.base_lr / static_cast<double>(d.D));
  const std::size_t rate_n = B * H > MB ? B * H : MB;
  td::rates_kernel<S><<<td::blocks_for(rate_n, 256), 256, 0, st>>>(lr, w.lr_b, B, H, scale,
                                                                   w.tok_offset, tok, MB);
  cuda_check(cudaGetLastError(), "ttt rates_kernel launch");
  const td::inner_args args{q, k, v, lr, tok, 1, H, d.D, d.F, d.SZ, MB, 1, 1, 1, 1e-6f};
  td::ttt_step_kernel<Mlp, S><<<static_cast<unsigned>(B * H), gpu::ttt_inner_threads, 0, st>>>(
      args, static_cast<unsigned>(i), w.ttt_norm_w, w.ttt_norm_b, state, o_s, scratch);
  cuda_check(cudaGetLastError(), "ttt_step_kernel launch");
  const float* gpre = nullptr;
  if (s.use_gate) {
    gpu::matmul(ctx, x_t, w.wg, k, B, C, C, false);
    gpre = k;
  }
  td::ttt_post_norm_kernel<S><<<static_cast<unsigned>(B), gpu::detail::row_threads, 0, st>>>(
      o_s, w.post_w, w.post_b, gpre, pn, C, 1e-6f);
  cuda_check(cudaGetLastError(), "ttt_post_norm_kernel launch");
  gpu::matmul(ctx, static_cast<const S*>(pn), w.wo, y_t, B, C, C, false);
}

template <bool Mlp, typename A, typename Weights>
void backend_kernels<cuda_backend, ttt_shape>::reset_state(const ttt_shape& s, const Weights& w,
                                                            A* state, const cuda_executor& ex) {
  const auto d = gpu::ttt_dims::of(s, Mlp);
  using S = std::remove_cv_t<std::remove_pointer_t<decltype(w.w1)>>;
  check_types<S, A>();
  gpu::ttt_detail::ttt_reset_kernel<S><<<static_cast<unsigned>(s.batch * s.heads), 256, 0, ex.stream()>>>(
      state, s.heads, d.D, d.F, d.SZ, Mlp, w.w1, w.b1, w.w2, w.b2);
  cuda_check(cudaGetLastError(), "ttt_reset_kernel launch");
}

#endif  // MEMBOUND_CUDA_COMPILER

MEMBOUND_NAMESPACE_END
