// TTT-Linear and TTT-MLP on the GPU: the kernels that basic_ttt<Mlp, ..., cuda_backend> runs.
// The CPU layer (layers/ttt.hpp, backend/cpu/ttt.hpp) is the specification; this file follows
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
// What lives where (fp32 SIMT arithmetic; no tensor cores yet): each (batch, head)'s CTA stages
// the mini-batch's q, k, v rows contiguously and keeps them, the mini-batch's intermediates (Z,
// x̂, G, tril(XQ·XKᵀ), P, ...) and then the inner state W (W1, b1; W2, b2 for the MLP) in shared
// memory as far as the device allows, hottest first (gpu::ttt_placement; on_chip() reports it
// for a shape); the rest streams through its slice of global scratch, reserved in full in
// forward_workspace_bytes so that the plan is the same on every device. On sm_90 (227 KiB) with
// mini-batch 16 (test_cuda_ttt's host part prints these): TTT-Linear at head_dim 64 is wholly on
// chip, forward and backward (G = 1), and at head_dim 128 in the forward; TTT-MLP at head_dim 64
// keeps the forward's rows on chip and its 129 KiB state in global memory; at head_dim 128 its W1
// alone is 256 KiB.
//
// The decoding step (ttt_step_kernel) and its state (make_state, reset with the executor) run on
// the device too, on the executor's stream.
//
// Backward, the CPU's algorithm step by step:
//   q, k, v, lr, σ, tok recomputed          the forward's GEMMs and kernels
//   dpn = dy·Woᵀ; gate; post norm backward  one CTA per row; d post_w, d post_b per column
//   the inner loop backwards                one CTA per (batch, head): groups from the last, each
//                                           group's entering states recomputed from its
//                                           checkpoint with the forward's device functions
//                                           (mb_gradients, mb_update), then its mini-batches in
//                                           reverse (mb_outputs, mb_backward: the second-order
//                                           LayerNorm term, GELU'' for the MLP)
//   per-(batch, head) partials              summed over the batch in order, one thread each
//   the rate gate, RoPE's transpose         elementwise / per-column kernels
//   d wq, wk, wv, wg, wo and dx             cuBLASLt (fp32 operands; bf16/fp16 rounded once)
// Its workspace is a plain sum of slots (backward_layout), each sized exactly.
//
// Determinism: every sum runs in a fixed order inside one thread (no atomics, no split
// reductions), so forward and backward are bit-identical across runs, and across the
// checkpoint group G (G only decides which states are copied out, and the backward recomputes
// the others with the same device functions the forward ran).
#pragma once

#include <atomic>
#include <cstddef>
#include <limits>
#include <string>
#include <type_traits>

#include "membound/backend/cuda/cuda_backend.cuh"
#include "membound/backend/cuda/cuda_check.cuh"
#include "membound/backend/cuda/gemm.cuh"
#include "membound/backend/cuda/model.cuh"
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

// The decoding step's scratch per (batch, head) in fp32 elements: the effective state [SZ], then
// z1, x2, g1, z1b, x2b [F] (MLP), z2, xh2, g2, zb [D] (ttt_step_kernel's carve).
constexpr std::size_t ttt_step_elements(std::size_t SZ, std::size_t D, std::size_t F,
                                        bool mlp) noexcept {
  return SZ + (mlp ? 5 * F : 0) + 4 * D;
}

// The inner loop (forward and backward kernels) keeps one (batch, head)'s working set in two
// parts: its "rows" (the mini-batch's q, k, v rows staged contiguously, [mb, D] each, and every
// per-mini-batch buffer) and its inner states (the running state [SZ]; in the backward also the
// group's entering states [gsz, SZ]; the running dL/d(state) [SZ] goes with the running state,
// else it stays in the partials). The launcher puts them in shared memory, hottest first
// (rows, then the running state, then the group's states), as far as the device's opt-in limit
// allows (ttt_placement); the rest streams through the CTA's slice of global scratch, which is
// always reserved at full size, so the plan does not depend on the device (the scratch is a few
// MB next to the N×C buffers). Placement only moves bytes: the sums and their order are the same,
// so every placement gives the same bits.
// TTT-Linear has no hidden layer (F = D) and no second attention matrix: its F-wide and second-
// layer buffers are empty.
//
// The forward's rows in fp32 elements, in carve order (ttt_detail::carve_forward): z1, x2, g1,
// z1b, x2b [mb, F] (MLP); z2, xh2, g2, zb [mb, D]; att1, p1 [mb, mb]; att2, p2 [mb, mb] (MLP);
// sig2, lrm [mb]; the staged q, k, v [mb, D].
constexpr std::size_t ttt_forward_rows(std::size_t D, std::size_t F, std::size_t mb,
                                       bool mlp) noexcept {
  const std::size_t f = mlp ? mb * F : 0, a2 = mlp ? mb * mb : 0;
  return 5 * f + 4 * mb * D + 2 * mb * mb + 2 * a2 + 2 * mb + 3 * mb * D;
}
// The backward's rows: the forward's, then (ttt_detail::carve_backward) xhb [mb, D], sigb [mb];
// dx2b, dz1b, dg1, dx2, dz1 [mb, F] (MLP); s1, s2 [mb, F]; dzb, dg2, dz2 [mb, D]; dp1 [mb, mb],
// dp2 [mb, mb] (MLP); de, dl [mb]; rowd [mb, 3·D]; the staged d_out, dq, dk, dv [mb, D].
constexpr std::size_t ttt_backward_rows(std::size_t D, std::size_t F, std::size_t mb,
                                        bool mlp) noexcept {
  const std::size_t f = mlp ? mb * F : 0, a2 = mlp ? mb * mb : 0;
  return ttt_forward_rows(D, F, mb, mlp) + mb * D + mb + 5 * f + 2 * mb * F + 3 * mb * D +
         mb * mb + a2 + 2 * mb + 3 * mb * D + 4 * mb * D;
}
// One (batch, head)'s slice of the forward's global scratch: the running state, then the rows.
constexpr std::size_t ttt_forward_elements(std::size_t SZ, std::size_t D, std::size_t F,
                                           std::size_t mb, bool mlp) noexcept {
  return SZ + ttt_forward_rows(D, F, mb, mlp);
}
// One (batch, head)'s slice of the backward's global scratch: the group's entering states
// [gsz, SZ], the running state [SZ], then the rows.
constexpr std::size_t ttt_backward_scratch_elements(std::size_t SZ, std::size_t D, std::size_t F,
                                                    std::size_t mb, std::size_t gsz,
                                                    bool mlp) noexcept {
  return (gsz + 1) * SZ + ttt_backward_rows(D, F, mb, mlp);
}

// Where the inner loop's parts live: bit set = in shared memory.
enum ttt_place : unsigned { ttt_rows_on_chip = 1, ttt_state_on_chip = 2, ttt_group_on_chip = 4 };
struct ttt_placement_t {
  unsigned place = 0;
  std::size_t shared_bytes = 0;  // the kernel's dynamic shared memory
};
// Greedy in order of use per mini-batch (rows, the running state, the group's states): a part goes
// on chip when it fits in `limit` bytes beside the hotter parts already there; on chip they lie in
// that order. group = 0 for the forward (it keeps no group).
constexpr ttt_placement_t ttt_placement(std::size_t rows, std::size_t state, std::size_t group,
                                        std::size_t limit) noexcept {
  ttt_placement_t p;
  const std::size_t parts[3] = {rows, state, group};
  const unsigned bits[3] = {ttt_rows_on_chip, ttt_state_on_chip, ttt_group_on_chip};
  std::size_t used = 0;
  for (int i = 0; i < 3; ++i) {
    if (parts[i] == 0) continue;
    // (The first test keeps the sum from wrapping.)
    if (parts[i] > limit / sizeof(float) || used + parts[i] > limit / sizeof(float)) continue;
    used += parts[i];
    p.place |= bits[i];
  }
  p.shared_bytes = used * sizeof(float);
  return p;
}

// Per (batch, head), the backward's partial parameter gradients: dS [SZ], dγ, dβ [D], dtok [mb].
constexpr std::size_t ttt_partial_elements(std::size_t SZ, std::size_t D, std::size_t mb) noexcept {
  return SZ + 2 * D + mb;
}

inline constexpr unsigned ttt_inner_threads = 256;
// A ceiling on the inner loop's shared memory below the device's own limit (227 KiB on sm_90,
// 163 KiB on sm_80, 99 KiB on sm_86/89). Tests lower it to run the global-memory placements on a
// device whose limit would put everything on chip; the results must not change by a bit.
inline std::atomic<std::size_t>& ttt_shared_limit() {
  static std::atomic<std::size_t> limit{std::numeric_limits<std::size_t>::max()};
  return limit;
}
// The backward's inner kernel: fewer threads leave ptxas registers for its many live buffer
// pointers (at 256 the TTT-MLP kernel spilled).
inline constexpr unsigned ttt_backward_threads = 128;

}  // namespace gpu

template <>
struct backend_kernels<cuda_backend, ttt_shape> {
  // A and `threads` are the host backend's (the device accumulates in fp32 and sizes nothing per
  // host thread).
  template <bool Mlp, std::size_t MB, typename S, typename A>
  static constexpr std::size_t forward_workspace_bytes(const ttt_shape& s,
                                                       std::size_t /*threads*/) noexcept {
    return fits<Mlp, MB>(s) ? forward_layout<Mlp, MB, S>(s).size()
                            : std::numeric_limits<std::size_t>::max();
  }
  // G: the checkpoint group (its entering states are the backward's largest per-head buffer).
  template <bool Mlp, std::size_t MB, std::size_t G, typename S, typename A>
  static constexpr std::size_t backward_workspace_bytes(const ttt_shape& s,
                                                        std::size_t /*threads*/) noexcept {
    return fits<Mlp, MB>(s) && backward_fits<Mlp, MB, G>(s)
               ? backward_layout<Mlp, MB, G, S>(s).size()
               : std::numeric_limits<std::size_t>::max();
  }
  // The forward's layout at T = 1, plus the heads' output [B, C] in storage (forward writes it
  // into `saved`; decoding has none).
  template <bool Mlp, std::size_t MB, typename S, typename A>
  static constexpr std::size_t step_workspace_bytes(const ttt_shape& s) noexcept {
    ttt_shape one = s;
    one.seq = 1;
    const std::size_t f = forward_workspace_bytes<Mlp, MB, S, A>(one, 0);
    if (f == std::numeric_limits<std::size_t>::max()) return f;
    return step_layout<Mlp, MB, S>(one).size();
  }

#if MEMBOUND_CUDA_COMPILER
  // ckpt: the saved inner states [B·H, checkpoints, SZ] (fp32); o_s: the heads' output [N, C]
  // (storage). The layer checked the shape, the weights and the saved buffer.
  template <bool Mlp, std::size_t MB, std::size_t G, typename S, typename A, typename Weights>
  static void forward(const ttt_shape& s, const Weights& w, const S* x, S* y, A* ckpt, S* o_s,
                      void* workspace, std::size_t workspace_size, const cuda_executor& ex);
  // The same saved buffer read back; dx written; every gradient in g accumulated (+=).
  template <bool Mlp, std::size_t MB, std::size_t G, typename S, typename A, typename Weights,
            typename Gradients>
  static void backward(const ttt_shape& s, const Weights& w, const S* x, const A* ckpt,
                       const S* o_s, const S* dy, S* dx, const Gradients& g, void* workspace,
                       std::size_t workspace_size, const cuda_executor& ex);
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
  template <bool Mlp, std::size_t MB, std::size_t G, typename S, typename A, typename... Args>
  static void backward(Args&&...) {
    static_assert(dependent_false<S, A>,
                  "membound: basic_ttt<..., cuda_backend>::backward launches CUDA kernels; compile "
                  "this translation unit with nvcc (a .cu file, or LANGUAGE CUDA in CMake).");
  }
#endif

  // What the inner loop keeps on chip for this shape on a device whose kernels may take
  // `shared_limit` bytes of dynamic shared memory (cudaDevAttrMaxSharedMemoryPerBlockOptin; the
  // launchers ask the executor's device): placement bits (gpu::ttt_place) and bytes, forward and
  // backward. What is not on chip streams through the global scratch the workspace holds anyway.
  struct on_chip_report {
    gpu::ttt_placement_t forward, backward;
  };
  template <bool Mlp, std::size_t MB, std::size_t G>
  static constexpr on_chip_report on_chip(const ttt_shape& s, std::size_t shared_limit) noexcept {
    const auto d = gpu::ttt_dims::of(s, Mlp);
    return {gpu::ttt_placement(gpu::ttt_forward_rows(d.D, d.F, MB, Mlp), d.SZ, 0, shared_limit),
            gpu::ttt_placement(gpu::ttt_backward_rows(d.D, d.F, MB, Mlp), 2 * d.SZ,
                               group_in_use<MB, G>(s) * d.SZ, shared_limit)};
  }

 private:
  // One (batch, head)'s slice of the forward's scratch: the inner loop's, or the decoding step's
  // when that is larger (step_layout reuses this layout at T = 1).
  template <bool Mlp, std::size_t MB>
  static constexpr std::size_t forward_elements(const ttt_shape& s) noexcept {
    const auto d = gpu::ttt_dims::of(s, Mlp);
    const std::size_t f = gpu::ttt_forward_elements(d.SZ, d.D, d.F, MB, Mlp);
    const std::size_t st = gpu::ttt_step_elements(d.SZ, d.D, d.F, Mlp);
    return f > st ? f : st;
  }
  template <bool Mlp, std::size_t MB>
  static constexpr bool fits(const ttt_shape& s) noexcept {
    const auto d = gpu::ttt_dims::of(s, Mlp);
    const std::size_t N = s.batch * s.seq;
    if (s.batch != 0 && N / s.batch != s.seq) return false;
    if (d.SZ >= (std::size_t{1} << 31) || MB >= (std::size_t{1} << 15)) return false;  // 32-bit indices
    const std::size_t per = forward_elements<Mlp, MB>(s);
    return bytes_of<float>(N, s.width) != std::numeric_limits<std::size_t>::max() &&
           bytes_of<float>(s.batch * s.heads, per) != std::numeric_limits<std::size_t>::max();
  }

  // The group's entering states in use: min(G, mini-batches) (G is SIZE_MAX for ttt_checkpoint_all).
  template <std::size_t MB, std::size_t G>
  static constexpr std::size_t group_in_use(const ttt_shape& s) noexcept {
    const std::size_t nmb = s.seq / MB + (s.seq % MB != 0);
    return G < nmb ? G : nmb;
  }
  template <bool Mlp, std::size_t MB, std::size_t G>
  static constexpr bool backward_fits(const ttt_shape& s) noexcept {
    const auto d = gpu::ttt_dims::of(s, Mlp);
    const std::size_t gsz = group_in_use<MB, G>(s);
    constexpr std::size_t m = std::numeric_limits<std::size_t>::max();
    if (d.SZ == 0 || gsz + 1 > m / d.SZ / 2) return false;  // (gsz + 1)·SZ and the rest below without wrapping
    return bytes_of<float>(s.batch * s.heads, gpu::ttt_backward_scratch_elements(d.SZ, d.D, d.F, MB, gsz, Mlp)) != m &&
           bytes_of<float>(s.batch * s.heads, gpu::ttt_partial_elements(d.SZ, d.D, MB)) != m;
  }

 public:
  // cuBLASLt's workspace first (256-byte aligned); q, k (then the gate's pre-activation), v [N, C]
  // fp32; lr [N, H]; tok [mb]; the inner loop's scratch [B·H, forward_elements]; pn [N, C] in
  // storage (the output GEMM's operand).
  enum forward_slot : std::size_t { f_gemm, f_q, f_k, f_v, f_lr, f_tok, f_scratch, f_pn };
  template <bool Mlp, std::size_t MB, typename S>
  static constexpr workspace_layout<8> forward_layout(const ttt_shape& s) {
    const std::size_t N = s.batch * s.seq, C = s.width, H = s.heads;
    workspace_layout<8> l;
    l.add(gpu::gemm_workspace_bytes_max, gpu::gemm_workspace_alignment);
    l.add(bytes_of<float>(N, C));
    l.add(bytes_of<float>(N, C));
    l.add(bytes_of<float>(N, C));
    l.add(bytes_of<float>(N, H));
    l.add(bytes_of<float>(MB));
    l.add(bytes_of<float>(s.batch * H, forward_elements<Mlp, MB>(s)));
    l.add(bytes_of<S>(N, C));
    return l;
  }
  // cuBLASLt's workspace; q, k, v [N, C], lr, σ [N, H], tok [mb] (fp32, as forward); dpn (dy·Woᵀ,
  // then the post norm's output gradient), the gate's pre-activation (then its gradient), x̂ of
  // the post norm, d_o (the heads' output gradient), dq, dk, dv [N, C] fp32; the gated post norm
  // output [N, C] in storage (d wo's operand); dlr [N, H]; the partials [B·H, partial_elements];
  // the inner loop's scratch [B·H, backward_scratch_elements]; for bf16/fp16 a storage copy [N, C]
  // of each row gradient in turn (the GEMMs' operand) and dx in fp32 [N, C]. Nothing shares
  // bytes: the sizes are plain sums.
  enum backward_slot : std::size_t {
    b_gemm, b_q, b_k, b_v, b_lr, b_sig, b_tok, b_dpn, b_gpre, b_xh, b_do, b_dq, b_dk, b_dv, b_pn,
    b_dlr, b_part, b_scratch, b_conv, b_dx
  };
  template <bool Mlp, std::size_t MB, std::size_t G, typename S>
  static constexpr workspace_layout<20> backward_layout(const ttt_shape& s) {
    constexpr bool narrow = !std::is_same_v<S, float>;
    const auto d = gpu::ttt_dims::of(s, Mlp);
    const std::size_t N = s.batch * s.seq, C = s.width, H = s.heads, BH = s.batch * H;
    workspace_layout<20> l;
    l.add(gpu::gemm_workspace_bytes_max, gpu::gemm_workspace_alignment);
    l.add(bytes_of<float>(N, C));                      // q
    l.add(bytes_of<float>(N, C));                      // k
    l.add(bytes_of<float>(N, C));                      // v
    l.add(bytes_of<float>(N, H));                      // lr
    l.add(bytes_of<float>(N, H));                      // σ
    l.add(bytes_of<float>(MB));                        // tok
    l.add(bytes_of<float>(N, C));                      // dpn
    l.add(s.use_gate ? bytes_of<float>(N, C) : 0);     // gate pre-activation
    l.add(bytes_of<float>(N, C));                      // x̂
    l.add(bytes_of<float>(N, C));                      // d_o
    l.add(bytes_of<float>(N, C));                      // dq
    l.add(bytes_of<float>(N, C));                      // dk
    l.add(bytes_of<float>(N, C));                      // dv
    l.add(bytes_of<S>(N, C));                          // pn (gated)
    l.add(bytes_of<float>(N, H));                      // dlr
    l.add(bytes_of<float>(BH, gpu::ttt_partial_elements(d.SZ, d.D, MB)));
    l.add(bytes_of<float>(BH, gpu::ttt_backward_scratch_elements(d.SZ, d.D, d.F, MB,
                                                                 group_in_use<MB, G>(s), Mlp)));
    l.add(narrow ? bytes_of<S>(N, C) : 0);             // a row gradient in storage
    l.add(narrow ? bytes_of<float>(N, C) : 0);         // dx in fp32
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

// The inner loop's dynamic shared memory (outside the part tests/emulation/cuda_emulate.py ttt cuts out: the
// emulation gives each CTA its own buffer).
__device__ inline float* ttt_smem() {
  extern __shared__ float4 ttt_smem_f4[];
  return reinterpret_cast<float*>(ttt_smem_f4);
}

// RoPE on interleaved pairs at position (n mod T) mod period; one thread per (row, pair, head).
// fixed < period: every row at that position instead (decoding). inverse: the transpose (the
// backward's dq, dk), as cpu::rope_pairs.
__global__ void rope_kernel(float* x, std::size_t N, std::size_t T, std::size_t H, std::size_t D,
                            double base, std::size_t period, std::size_t fixed,
                            bool inverse = false) {
  const std::size_t half = D / 2;
  const std::size_t e = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= N * H * half) return;
  const std::size_t n = e / (H * half), h = (e / half) % H, i = e % half;
  const double position = static_cast<double>(fixed < period ? fixed : (n % T) % period);
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

struct inner_args {
  const float *q, *k, *v, *lr, *tok;
  std::size_t T, H, D, F, SZ, mb, group, ncp, nmb;
  float eps;
  unsigned place;  // ttt_place bits: what the launcher gave shared memory
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

// The backward of x̂ = LN(z) given dL/dx̂ and an explicit dL/dσ, as cpu::ln_row_backward.
__device__ inline void ln_row_backward(const float* xhat, float sigma, const float* dxhat,
                                       float dsigma, unsigned D, float* dz) {
  float m1 = 0.0f, m2 = 0.0f;
  for (unsigned j = 0; j < D; ++j) {
    m1 += dxhat[j];
    m2 += dxhat[j] * xhat[j];
  }
  m1 /= static_cast<float>(D);
  m2 /= static_cast<float>(D);
  for (unsigned j = 0; j < D; ++j)
    dz[j] = (dxhat[j] - m1 - xhat[j] * m2) / sigma + dsigma * xhat[j] / static_cast<float>(D);
}

// G = ∇_z ½‖γ x̂ + β − (v − k)‖² with x̂ = LN(z), for one row (one thread), as a row of
// cpu::ttt_ln_l2: writes x̂ and G, returns σ. The inner loop and the decoding step share it.
template <typename S>
__device__ inline float ln_l2_grad_row(const float* z, const float* k, const float* v,
                                       const S* gamma, const S* beta, unsigned D, float eps,
                                       float* xh, float* g) {
  const float sg = ln_row(z, D, eps, xh);
  float s1 = 0.0f, s2 = 0.0f;
  for (unsigned j = 0; j < D; ++j) {
    const float gam = ld(gamma, j);
    const float r = gam * xh[j] + ld(beta, j) - (v[j] - k[j]);
    g[j] = r * gam;
    s1 += g[j];
    s2 += g[j] * xh[j];
  }
  s1 /= static_cast<float>(D);
  s2 /= static_cast<float>(D);
  for (unsigned j = 0; j < D; ++j) g[j] = (g[j] - s1 - xh[j] * s2) / sg;
  return sg;
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
// The mini-batch's rows of q, k, v staged contiguously ([mb, D], row stride D).
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
  r.q = c.take(mb * D);
  r.k = c.take(mb * D);
  r.v = c.take(mb * D);
  return c.p;
}

// K rows of D from src (row stride C, global) into dst (row stride D). No barrier: coalesced
// loads once per mini-batch instead of strided ones in every product.
__device__ inline void stage_rows(const float* src, std::size_t C, unsigned K, unsigned D,
                                  float* dst) {
  for (unsigned e = threadIdx.x; e < K * D; e += blockDim.x) dst[e] = src[(e / D) * C + e % D];
}
// The reverse: K rows of D from src (stride D) into dst (row stride C). No barrier.
__device__ inline void unstage_rows(const float* src, std::size_t C, unsigned K, unsigned D,
                                    float* dst) {
  for (unsigned e = threadIdx.x; e < K * D; e += blockDim.x) dst[(e / D) * C + e % D] = src[e];
}

// Each phase below is a strided loop over its outputs, every output summed by one thread in index
// order, phases separated by __syncthreads (every thread reaches every one: the loop bounds are
// uniform across the CTA). A function ends with a barrier unless it says otherwise.

// The inner gradients at state W: Z (Z1, X2 = GELU(Z1) for the MLP), G2 through the LayerNorm,
// and G1 = (G2·W2ᵀ) ⊙ GELU'(Z1) for the MLP.
// Not inlined, as mb_update: one body of machine code serves the forward and the backward's
// recomputation, so no caller's context can change how its sums are contracted or ordered.
template <bool Mlp, typename S>
__device__ __noinline__ void mb_gradients(const mb_ctx& m, const float* W, const mb_fwd& b, const S* norm_w,
                             const S* norm_b) {
  const unsigned K = m.K, D = m.D, F = m.F, C = m.C, h = m.h, tid = threadIdx.x, nt = blockDim.x;
  const float* W1 = W;
  const float* B1 = W + D * F;
  const float* W2 = B1 + F;
  const float* B2 = W2 + F * D;
  const float* k = m.k;
  const float* v = m.v;
  if constexpr (Mlp) {
    for (unsigned e = tid; e < K * F; e += nt) {
      const unsigned i = e / F, f = e % F;
      float acc = 0.0f;
      for (unsigned c = 0; c < D; ++c) acc += k[i * C + c] * W1[c * F + f];
      b.z1[e] = acc + B1[f];
      b.x2[e] = gelu_tanh_f(b.z1[e]);
    }
    __syncthreads();
    for (unsigned e = tid; e < K * D; e += nt) {
      const unsigned i = e / D, j = e % D;
      float acc = 0.0f;
      for (unsigned f = 0; f < F; ++f) acc += b.x2[i * F + f] * W2[f * D + j];
      b.z2[e] = acc + B2[j];
    }
  } else {
    for (unsigned e = tid; e < K * D; e += nt) {
      const unsigned i = e / D, j = e % D;
      float acc = 0.0f;
      for (unsigned c = 0; c < D; ++c) acc += k[i * C + c] * W1[c * D + j];
      b.z2[e] = acc + B1[j];
    }
  }
  __syncthreads();
  // G2 = ∇ ½‖γ x̂ + β − (v − k)‖² through the LayerNorm, one thread per row (as ttt_ln_l2).
  for (unsigned i = tid; i < K; i += nt)
    b.sig2[i] = ln_l2_grad_row(b.z2 + i * D, k + i * C, v + i * C, norm_w + h * D,
                               norm_b + h * D, D, m.eps, b.xh2 + i * D, b.g2 + i * D);
  __syncthreads();
  if constexpr (Mlp) {
    for (unsigned e = tid; e < K * F; e += nt) {
      const unsigned i = e / F, f = e % F;
      float acc = 0.0f;
      for (unsigned j = 0; j < D; ++j) acc += b.g2[i * D + j] * W2[f * D + j];
      b.g1[e] = acc * gelu_tanh_d1(b.z1[e]);
    }
    __syncthreads();
  }
}

// The output rows' Zbar at state W (gradients from mb_gradients): P1 = η ⊙ (tril(XQ·XKᵀ) + 1),
// η[i, s] = tok_i·lr_s; Linear: Zbar = XQ·W1 + b1 − P1·G; MLP: Zbar1 = XQ·W1 + b1 − P1·G1,
// X2bar = GELU(Zbar1), P2 from tril(X2bar·X2ᵀ), Zbar = X2bar·W2 + b2 − P2·G2.
template <bool Mlp>
__device__ void mb_outputs(const mb_ctx& m, const float* W, const mb_fwd& b) {
  const unsigned K = m.K, D = m.D, F = m.F, C = m.C, tid = threadIdx.x, nt = blockDim.x;
  const float* W1 = W;
  const float* B1 = W + D * F;
  const float* W2 = B1 + F;
  const float* B2 = W2 + F * D;
  const float* q = m.q;
  const float* k = m.k;
  for (unsigned e = tid; e < K * K; e += nt) {
    const unsigned i = e / K, s = e % K;
    if (s > i) {
      b.att1[e] = 0.0f;
      b.p1[e] = 0.0f;
    } else {
      float acc = 0.0f;
      for (unsigned c = 0; c < D; ++c) acc += q[i * C + c] * k[s * C + c];
      b.att1[e] = acc;
      b.p1[e] = m.tok[i] * m.lrm[s] * (acc + 1.0f);
    }
  }
  __syncthreads();
  if constexpr (Mlp) {
    for (unsigned e = tid; e < K * F; e += nt) {
      const unsigned i = e / F, f = e % F;
      float acc = 0.0f;
      for (unsigned c = 0; c < D; ++c) acc += q[i * C + c] * W1[c * F + f];
      acc += B1[f];
      float pg = 0.0f;
      for (unsigned s = 0; s <= i; ++s) pg += b.p1[i * K + s] * b.g1[s * F + f];
      b.z1b[e] = acc - pg;
      b.x2b[e] = gelu_tanh_f(b.z1b[e]);
    }
    __syncthreads();
    for (unsigned e = tid; e < K * K; e += nt) {
      const unsigned i = e / K, s = e % K;
      if (s > i) {
        b.att2[e] = 0.0f;
        b.p2[e] = 0.0f;
      } else {
        float acc = 0.0f;
        for (unsigned f = 0; f < F; ++f) acc += b.x2b[i * F + f] * b.x2[s * F + f];
        b.att2[e] = acc;
        b.p2[e] = m.tok[i] * m.lrm[s] * (acc + 1.0f);
      }
    }
    __syncthreads();
    for (unsigned e = tid; e < K * D; e += nt) {
      const unsigned i = e / D, j = e % D;
      float acc = 0.0f;
      for (unsigned f = 0; f < F; ++f) acc += b.x2b[i * F + f] * W2[f * D + j];
      acc += B2[j];
      float pg = 0.0f;
      for (unsigned s = 0; s <= i; ++s) pg += b.p2[i * K + s] * b.g2[s * D + j];
      b.zb[e] = acc - pg;
    }
  } else {
    for (unsigned e = tid; e < K * D; e += nt) {
      const unsigned i = e / D, j = e % D;
      float acc = 0.0f;
      for (unsigned c = 0; c < D; ++c) acc += q[i * C + c] * W1[c * D + j];
      acc += B1[j];
      float pg = 0.0f;
      for (unsigned s = 0; s <= i; ++s) pg += b.p1[i * K + s] * b.g2[s * D + j];
      b.zb[e] = acc - pg;
    }
  }
  __syncthreads();
}

// The update, e_s = tok[K−1]·lr_s: W1 −= XKᵀ·diag(e)·G1, b1 −= Σ e_s G1_s (G1 is G2 for
// TTT-Linear); for the MLP also W2 −= X2ᵀ·diag(e)·G2, b2 −= Σ e_s G2_s. In place: it starts
// without a barrier (callers put it after the last phase that reads W) and ends with one.
template <bool Mlp>
__device__ __noinline__ void mb_update(const mb_ctx& m, float* W, const mb_fwd& b) {
  const unsigned K = m.K, D = m.D, F = m.F, C = m.C, tid = threadIdx.x, nt = blockDim.x;
  float* W1 = W;
  float* B1 = W + D * F;
  float* W2 = B1 + F;
  float* B2 = W2 + F * D;
  const float* k = m.k;
  const float tl = m.tok[K - 1];
  const float* ga = Mlp ? b.g1 : b.g2;
  for (unsigned e = tid; e < D * F; e += nt) {
    const unsigned c = e / F, f = e % F;
    float acc = 0.0f;
    for (unsigned s = 0; s < K; ++s) acc += k[s * C + c] * (tl * m.lrm[s] * ga[s * F + f]);
    W1[e] -= acc;
  }
  for (unsigned f = tid; f < F; f += nt) {
    float acc = B1[f];
    for (unsigned s = 0; s < K; ++s) acc -= tl * m.lrm[s] * ga[s * F + f];
    B1[f] = acc;
  }
  if constexpr (Mlp) {
    for (unsigned e = tid; e < F * D; e += nt) {
      const unsigned f = e / D, j = e % D;
      float acc = 0.0f;
      for (unsigned s = 0; s < K; ++s) acc += b.x2[s * F + f] * (tl * m.lrm[s] * b.g2[s * D + j]);
      W2[e] -= acc;
    }
    for (unsigned j = tid; j < D; j += nt) {
      float acc = B2[j];
      for (unsigned s = 0; s < K; ++s) acc -= tl * m.lrm[s] * b.g2[s * D + j];
      B2[j] = acc;
    }
  }
  __syncthreads();
}

// The inner loop of one (batch, head) per CTA. Its rows and state live in shared memory or in
// this CTA's slice of global scratch ([state | rows]) as a.place says.
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

  for (std::size_t m = 0; m < a.nmb; ++m) {
    const std::size_t t0 = m * mb;
    const unsigned K = static_cast<unsigned>((a.T - t0 < mb) ? a.T - t0 : mb);
    const std::size_t r0 = (b * a.T + t0) * C + h * D;  // row i of q/k/v/o at r0 + i·C
    if (m % a.group == 0) {
      float* dst = ckpt + (task * a.ncp + m / a.group) * a.SZ;
      for (unsigned e = tid; e < a.SZ; e += nt) dst[e] = W[e];
    }
    for (unsigned i = tid; i < K; i += nt) lrm[i] = a.lr[(b * a.T + t0 + i) * a.H + h];
    stage_rows(a.q + r0, C, K, D, rs.q);
    stage_rows(a.k + r0, C, K, D, rs.k);
    stage_rows(a.v + r0, C, K, D, rs.v);
    __syncthreads();
    const mb_ctx mc{rs.q, rs.k, rs.v, lrm, a.tok, K, D, F, D, h, a.eps};
    mb_gradients<Mlp>(mc, W, bf, norm_w, norm_b);
    mb_outputs<Mlp>(mc, W, bf);
    // out = XQ + γ ⊙ LN(Zbar) + β, rounded to storage straight into `saved`; one thread per row
    // (x̂ overwrites Zbar's row: nothing reads it later). No barrier before the update: this
    // phase does not read the state.
    for (unsigned i = tid; i < K; i += nt) {
      float* zr = bf.zb + i * D;
      ln_row(zr, D, a.eps, zr);
      const std::size_t r = r0 + i * C;
      for (unsigned j = 0; j < D; ++j) {
        const float out = mc.q[i * D + j] + ld(norm_w, h * D + j) * zr[j] + ld(norm_b, h * D + j);
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
  for (unsigned e = tid; e < K * nout; e += nt) {  // s1 = X·dW'
    const unsigned i = e / nout, o = e % nout;
    float acc = 0.0f;
    for (unsigned a = 0; a < nin; ++a) acc += x[i * ldx + a] * dWn[a * nout + o];
    s1[e] = acc;
  }
  for (unsigned e = tid; e < K * nin; e += nt) {  // s2 = G·dW'ᵀ
    const unsigned i = e / nin, a = e % nin;
    float acc = 0.0f;
    for (unsigned o = 0; o < nout; ++o) acc += g[i * nout + o] * dWn[a * nout + o];
    s2[e] = acc;
  }
  __syncthreads();
  for (unsigned e = tid; e < K * nout; e += nt) {
    const unsigned i = e / nout, o = e % nout;
    dg[e] -= tl * lr[i] * (s1[e] + dbn[o]);
  }
  for (unsigned e = tid; e < K * nin; e += nt) {
    const unsigned i = e / nin, a = e % nin;
    dx[i * lddx + a] -= tl * lr[i] * s2[e];
  }
  for (unsigned i = tid; i < K; i += nt) {
    float d = 0.0f;
    for (unsigned o = 0; o < nout; ++o) d -= (s1[i * nout + o] + dbn[o]) * g[i * nout + o];
    de[i] += d;
  }
  __syncthreads();
}

// Z = X·W + b backwards: dX += dZ·Wᵀ (stride lddx), dW += Xᵀ·dZ, db += Σ dZ.
__device__ inline void linear_rows_backward(const float* x, unsigned ldx, unsigned K, unsigned nin,
                                            unsigned nout, const float* W, const float* dz,
                                            float* dx, unsigned lddx, float* dW, float* db) {
  const unsigned tid = threadIdx.x, nt = blockDim.x;
  for (unsigned e = tid; e < K * nin; e += nt) {
    const unsigned i = e / nin, a = e % nin;
    float acc = 0.0f;
    for (unsigned o = 0; o < nout; ++o) acc += dz[i * nout + o] * W[a * nout + o];
    dx[i * lddx + a] += acc;
  }
  for (unsigned e = tid; e < nin * nout; e += nt) {
    const unsigned a = e / nout, o = e % nout;
    float acc = 0.0f;
    for (unsigned i = 0; i < K; ++i) acc += x[i * ldx + a] * dz[i * nout + o];
    dW[e] += acc;
  }
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
  const unsigned tid = threadIdx.x, nt = blockDim.x;
  for (unsigned e = tid; e < K * nout; e += nt) {  // P is zero above the diagonal: i ≥ s
    const unsigned s = e / nout, o = e % nout;
    float acc = 0.0f;
    for (unsigned i = s; i < K; ++i) acc += p[i * K + s] * dzb[i * nout + o];
    dg[e] -= acc;
  }
  for (unsigned e = tid; e < K * K; e += nt) {
    const unsigned i = e / K, s = e % K;
    float acc = 0.0f;
    if (s <= i)
      for (unsigned o = 0; o < nout; ++o) acc += dzb[i * nout + o] * g[s * nout + o];
    dp[e] = s <= i ? -acc : 0.0f;
  }
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
  const unsigned tid = threadIdx.x, nt = blockDim.x;
  for (unsigned e = tid; e < K * n; e += nt) {
    const unsigned i = e / n, c = e % n;
    float acc = 0.0f;
    for (unsigned s = 0; s <= i; ++s) acc += datt[i * K + s] * y[s * ldy + c];
    dx[i * lddx + c] += acc;
  }
  for (unsigned e = tid; e < K * n; e += nt) {
    const unsigned s = e / n, c = e % n;
    float acc = 0.0f;
    for (unsigned i = s; i < K; ++i) acc += datt[i * K + s] * x[i * ldx + c];
    dy[s * lddy + c] += acc;
  }
  __syncthreads();
}

// The backward of G2 = ∇ ½‖γ x̂ + β − (v − k)‖² (cpu::ttt_ln_l2_backward) given dG2: dZ2
// (written), the target's gradient into dk (+) and dv (−), dγ, dβ (accumulated). One thread per
// row, then one per column for dγ, dβ (rows in order, no shared accumulator); rowd [K, 3·D] keeps
// each row's r and dgx for that second phase.
template <typename S>
__device__ void ln_l2_backward(const mb_ctx& m, const S* norm_w, const S* norm_b, const float* xh,
                               const float* sig, const float* g, const float* dg, float* dz,
                               float* dk, float* dv, float* pgam, float* pbet, float* rowd) {
  const unsigned K = m.K, D = m.D, C = m.C, h = m.h, tid = threadIdx.x, nt = blockDim.x;
  const float invD = 1.0f / static_cast<float>(D);
  for (unsigned i = tid; i < K; i += nt) {
    const float* xr = xh + i * D;
    const float* g_r = g + i * D;
    const float* dg_r = dg + i * D;
    float* r = rowd + i * 3 * D;
    float* dgx = r + D;
    float* dxh = r + 2 * D;
    float cc = 0.0f, m1 = 0.0f, sdx = 0.0f, dsig = 0.0f;
    for (unsigned j = 0; j < D; ++j) {
      const float gam = ld(norm_w, h * D + j), bet = ld(norm_b, h * D + j);
      r[j] = gam * xr[j] + bet - (m.v[i * C + j] - m.k[i * C + j]);
      cc += r[j] * gam * xr[j];
      m1 += dg_r[j];
      sdx += dg_r[j] * xr[j];
      dsig -= dg_r[j] * g_r[j];
    }
    cc *= invD;
    m1 *= invD;
    dsig /= sig[i];
    for (unsigned j = 0; j < D; ++j) {
      const float gam = ld(norm_w, h * D + j);
      const float gx = r[j] * gam;
      dgx[j] = (dg_r[j] - m1 - xr[j] * sdx * invD) / sig[i];
      dxh[j] = -(dg_r[j] * cc) / sig[i] - sdx / sig[i] * gx * invD;
      const float dr = dgx[j] * gam;
      dv[i * C + j] -= dr;  // the target is v − k
      dk[i * C + j] += dr;
      dxh[j] += dr * gam;
    }
    ln_row_backward(xr, sig[i], dxh, dsig, D, dz + i * D);
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
  float *xhb, *sigb, *dx2b, *dz1b, *dg1, *dx2, *dz1, *s1, *s2, *dzb, *dg2, *dz2, *dp1, *dp2, *de,
      *dl, *rowd;
};
// Carves the backward's own rows from p (after the forward's) in ttt_backward_rows' order, then
// the staged rows of d_o, dq, dk, dv [mb, D].
template <bool Mlp>
__device__ inline void carve_backward(float* p, unsigned D, unsigned F, unsigned mb, mb_bwd& b,
                                      float*& d_out, float*& dq, float*& dk, float*& dv) {
  const unsigned fw = Mlp ? mb * F : 0;
  carver c{p};
  b.xhb = c.take(mb * D);
  b.sigb = c.take(mb);
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
  d_out = c.take(mb * D);
  dq = c.take(mb * D);
  dk = c.take(mb * D);
  dv = c.take(mb * D);
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
  // out = XQ + γ ⊙ x̂(Zbar) + β: dZbar per row; the residual XQ's gradient; dk, dv start at 0.
  for (unsigned i = tid; i < K; i += nt) {
    b.sigb[i] = ln_row(f.zb + i * D, D, m.eps, b.xhb + i * D);
    float* dxh = b.rowd + i * 3 * D;
    for (unsigned j = 0; j < D; ++j) {
      dxh[j] = d_out[i * C + j] * ld(norm_w, h * D + j);
      dq[i * C + j] = d_out[i * C + j];
      dk[i * C + j] = 0.0f;
      dv[i * C + j] = 0.0f;
    }
    ln_row_backward(b.xhb + i * D, b.sigb[i], dxh, 0.0f, D, b.dzb + i * D);
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
    for (unsigned e = tid; e < K * F; e += nt) {
      const unsigned i = e / F, fo = e % F;
      float hm = 0.0f;
      for (unsigned j = 0; j < D; ++j) hm += f.g2[i * D + j] * W2[fo * D + j];
      b.s1[e] = hm;
      const float z = f.z1[e];
      b.dz1[e] = b.dg1[e] * hm * gelu_tanh_d2(z);
      b.s2[e] = b.dg1[e] * gelu_tanh_d1(z);
    }
    __syncthreads();
    for (unsigned e = tid; e < K * D; e += nt) {  // dG2 += dHm·W2
      const unsigned i = e / D, j = e % D;
      float acc = 0.0f;
      for (unsigned fo = 0; fo < F; ++fo) acc += b.s2[i * F + fo] * W2[fo * D + j];
      b.dg2[e] += acc;
    }
    for (unsigned e = tid; e < F * D; e += nt) {  // dW2 += dHmᵀ·G2
      const unsigned fo = e / D, j = e % D;
      float acc = 0.0f;
      for (unsigned i = 0; i < K; ++i) acc += b.s2[i * F + fo] * f.g2[i * D + j];
      dW2[e] += acc;
    }
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
};

// The inner loop backwards, one (batch, head) per CTA: groups from the last; each group's
// entering states recomputed from its checkpoint (the forward's functions, so the same bits),
// then its mini-batches in reverse. part[task] = [dS (SZ), dγ (D), dβ (D), dtok (mb)], summed
// over the batch afterwards in batch order (ttt_reduce_partials_kernel).
template <bool Mlp, typename S>
__global__ void __launch_bounds__(ttt_backward_threads, 1)
    ttt_backward_kernel(backward_args a, const S* norm_w, const S* norm_b) {
  const std::size_t task = blockIdx.x;
  const std::size_t b = task / a.H;
  const unsigned h = static_cast<unsigned>(task % a.H);
  const unsigned D = static_cast<unsigned>(a.D), F = static_cast<unsigned>(a.F),
                 mb = static_cast<unsigned>(a.mb), C = static_cast<unsigned>(a.H * a.D),
                 SZ = static_cast<unsigned>(a.SZ), tid = threadIdx.x, nt = blockDim.x;
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

  for (std::size_t c = a.ncp; c-- > 0;) {
    const std::size_t m0 = c * a.group;
    const std::size_t m1 = (a.nmb - m0 < a.gsz) ? a.nmb : m0 + a.gsz;
    const float* src = a.ckpt + (task * a.ncp + c) * a.SZ;
    for (unsigned e = tid; e < SZ; e += nt) Wc[e] = src[e];
    __syncthreads();
    // Recompute the group's entering states (the last one's update is not needed).
    for (std::size_t m = m0; m < m1; ++m) {
      float* dst = states + (m - m0) * a.SZ;
      for (unsigned e = tid; e < SZ; e += nt) dst[e] = Wc[e];
      if (m + 1 == m1) break;
      const std::size_t t0 = m * mb;
      const unsigned K = static_cast<unsigned>((a.T - t0 < mb) ? a.T - t0 : mb);
      const std::size_t r0 = (b * a.T + t0) * C + h * D;
      for (unsigned i = tid; i < K; i += nt) lrm[i] = a.lr[(b * a.T + t0 + i) * a.H + h];
      stage_rows(a.k + r0, C, K, D, rs.k);  // the gradients and the update read k and v only
      stage_rows(a.v + r0, C, K, D, rs.v);
      __syncthreads();
      const mb_ctx mc{rs.q, rs.k, rs.v, lrm, a.tok, K, D, F, D, h, a.eps};
      mb_gradients<Mlp>(mc, Wc, bf, norm_w, norm_b);
      mb_update<Mlp>(mc, Wc, bf);
    }
    __syncthreads();
    for (std::size_t m = m1; m-- > m0;) {
      const float* W = states + (m - m0) * a.SZ;
      const std::size_t t0 = m * mb;
      const unsigned K = static_cast<unsigned>((a.T - t0 < mb) ? a.T - t0 : mb);
      const std::size_t r0 = (b * a.T + t0) * C + h * D;
      for (unsigned i = tid; i < K; i += nt) lrm[i] = a.lr[(b * a.T + t0 + i) * a.H + h];
      stage_rows(a.q + r0, C, K, D, rs.q);
      stage_rows(a.k + r0, C, K, D, rs.k);
      stage_rows(a.v + r0, C, K, D, rs.v);
      stage_rows(a.d_o + r0, C, K, D, d_out);
      __syncthreads();
      const mb_ctx mc{rs.q, rs.k, rs.v, lrm, a.tok, K, D, F, D, h, a.eps};
      mb_gradients<Mlp>(mc, W, bf, norm_w, norm_b);
      mb_outputs<Mlp>(mc, W, bf);
      mb_backward<Mlp>(mc, norm_w, norm_b, W, bf, bb, d_out, dqs, dks, dvs, dS, pgam, pbet, ptok);
      for (unsigned i = tid; i < K; i += nt) a.dlr[(b * a.T + t0 + i) * a.H + h] = bb.dl[i];
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

// The per-(batch, head) partials [B·H, SZ + 2D + mb] summed over the batch in order into the
// inner state's initial weights and the inner norm's γ, β (one thread per (head, element)); the
// token offsets summed over heads too (one thread each), zero where the clamp was active.
template <typename S>
struct ttt_grad_targets {
  S *w1, *b1, *w2, *b2, *norm_w, *norm_b, *tok_offset;
};
template <typename S>
__global__ void ttt_reduce_partials_kernel(const float* part, std::size_t B, std::size_t H,
                                           std::size_t D, std::size_t F, std::size_t SZ,
                                           std::size_t mb, const S* tok_offset,
                                           ttt_grad_targets<S> g) {
  const std::size_t e = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::size_t per_head = SZ + 2 * D, pe = SZ + 2 * D + mb;
  if (e < H * per_head) {
    const std::size_t h = e / per_head, j = e % per_head;
    float acc = 0.0f;
    for (std::size_t b = 0; b < B; ++b) acc += part[(b * H + h) * pe + j];
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
      for (std::size_t b = 0; b < B; ++b) sh += part[(b * H + h) * pe + per_head + i];
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
  if (tid == 0)  // the inner loss's gradient through the LayerNorm (one row)
    ln_l2_grad_row(z2, k, v, norm_w + h * D, norm_b + h * D, D, a.eps, xh2, g2);
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

// The device's opt-in limit of dynamic shared memory per block (the inner kernels have no static
// shared memory).
inline std::size_t device_shared_limit(const cuda_executor& ex) {
  int v = 0;
  cuda_check(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, ex.device()),
             "cudaDeviceGetAttribute(cudaDevAttrMaxSharedMemoryPerBlockOptin)");
  return v > 0 ? static_cast<std::size_t>(v) : 0;
}
// What the inner loop may take: the device's limit under gpu::ttt_shared_limit().
inline std::size_t inner_shared_limit(const cuda_executor& ex) {
  const std::size_t device = device_shared_limit(ex), cap = ttt_shared_limit().load();
  return device < cap ? device : cap;
}
// Above 48 KiB of dynamic shared memory a kernel must opt in. The attribute is one value per
// kernel for the whole process, so it is always the device's whole limit (a launch asks for what
// it needs below it): two threads launching one kernel with other shapes never undo each other.
template <typename Kernel>
void allow_shared(Kernel kernel, const cuda_executor& ex) {
  cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(device_shared_limit(ex))),
             "cudaFuncSetAttribute(ttt inner loop, MaxDynamicSharedMemorySize)");
}

}  // namespace ttt_detail
}  // namespace gpu

template <bool Mlp, std::size_t MB, std::size_t G, typename S, typename A, typename Weights>
void backend_kernels<cuda_backend, ttt_shape>::forward(const ttt_shape& s, const Weights& w,
                                                        const S* x, S* y, A* ckpt, S* o_s,
                                                        void* workspace, std::size_t workspace_size,
                                                        const cuda_executor& ex) {
  gpu::check_types<S, A>();
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

  const auto place = on_chip<Mlp, MB, G>(s, td::inner_shared_limit(ex)).forward;
  td::allow_shared(td::ttt_forward_kernel<Mlp, S>, ex);
  const td::inner_args args{q,  k,  v,   lr,  tok, T,   H,   d.D,   d.F,
                            d.SZ, MB, G, ncp, nmb, 1e-6f, place.place};
  td::ttt_forward_kernel<Mlp, S><<<static_cast<unsigned>(s.batch * H), gpu::ttt_inner_threads,
                                   place.shared_bytes, st>>>(args, w.ttt_norm_w, w.ttt_norm_b,
                                                             w.w1, w.b1, w.w2, w.b2, o_s, ckpt,
                                                             scratch);
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

template <bool Mlp, std::size_t MB, std::size_t G, typename S, typename A, typename Weights,
          typename Gradients>
void backend_kernels<cuda_backend, ttt_shape>::backward(const ttt_shape& s, const Weights& w,
                                                         const S* x, const A* ckpt, const S* o_s,
                                                         const S* dy, S* dx, const Gradients& g,
                                                         void* workspace,
                                                         std::size_t workspace_size,
                                                         const cuda_executor& ex) {
  gpu::check_types<S, A>();
  namespace td = gpu::ttt_detail;
  constexpr bool narrow = !std::is_same_v<S, float>;
  const auto ws = carve(backward_layout<Mlp, MB, G, S>(s), workspace, workspace_size);
  const auto d = gpu::ttt_dims::of(s, Mlp);
  const std::size_t N = s.batch * s.seq, C = s.width, H = s.heads, T = s.seq, B = s.batch;
  const std::size_t nmb = T / MB + (T % MB != 0), ncp = nmb / G + (nmb % G != 0);
  const std::size_t gsz = group_in_use<MB, G>(s);
  const gpu::gemm_context ctx(ex, gpu::shared_gemm_cache(), ws.template get<std::byte>(b_gemm),
                              gpu::gemm_workspace_bytes_max);
  float* q = ws.template get<float>(b_q);
  float* k = ws.template get<float>(b_k);
  float* v = ws.template get<float>(b_v);
  float* lr = ws.template get<float>(b_lr);
  float* sig = ws.template get<float>(b_sig);
  float* tok = ws.template get<float>(b_tok);
  float* dpn = ws.template get<float>(b_dpn);
  float* gpre = s.use_gate ? ws.template get<float>(b_gpre) : nullptr;
  float* xh = ws.template get<float>(b_xh);
  float* d_o = ws.template get<float>(b_do);
  float* dq = ws.template get<float>(b_dq);
  float* dk = ws.template get<float>(b_dk);
  float* dv = ws.template get<float>(b_dv);
  S* pn = ws.template get<S>(b_pn);
  float* dlr = ws.template get<float>(b_dlr);
  float* part = ws.template get<float>(b_part);
  float* scratch = ws.template get<float>(b_scratch);
  const cudaStream_t st = ex.stream();
  // dx accumulates in fp32: the caller's buffer itself for fp32, else a workspace slot.
  float* dxf;
  if constexpr (narrow) {
    dxf = ws.template get<float>(b_dx);
  } else {
    dxf = dx;
  }
  // A row gradient as the GEMMs' operand: itself for fp32, else rounded into the one conversion
  // slot (stream order makes its reuse by the next gradient safe).
  const auto operand = [&](const float* src) -> const S* {
    if constexpr (narrow) {
      S* c = ws.template get<S>(b_conv);
      gpu::convert(ex, src, c, N * C);
      return c;
    } else {
      return src;
    }
  };

  // q, k, v, the rates and σ exactly as forward computed them (the same GEMMs and kernels).
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
                                                                   w.tok_offset, tok, MB, sig);
  cuda_check(cudaGetLastError(), "ttt rates_kernel launch");

  // Output projection, gate and post norm backwards.
  gpu::matmul_bt(ctx, dy, w.wo, dpn, N, C, C, false);  // dL/d(gated)
  if (s.use_gate) gpu::matmul(ctx, x, w.wg, gpre, N, C, C, false);
  td::ttt_post_norm_backward_kernel<S><<<static_cast<unsigned>(N), gpu::detail::row_threads, 0,
                                         st>>>(o_s, w.post_w, w.post_b, gpre, dpn, pn, xh, d_o, C,
                                               1e-6f);
  cuda_check(cudaGetLastError(), "ttt_post_norm_backward_kernel launch");
  gpu::matmul_at(ctx, static_cast<const S*>(pn), dy, g.wo, N, C, C, true);
  if (s.use_gate) {
    const S* dg = operand(gpre);
    gpu::matmul_at(ctx, x, dg, g.wg, N, C, C, true);
    gpu::matmul_bt(ctx, dg, w.wg, dxf, N, C, C, false);
  } else {
    cuda_check(cudaMemsetAsync(dxf, 0, N * C * sizeof(float), st), "ttt backward dx memset");
  }
  td::ttt_post_params_kernel<S><<<td::blocks_for(C, 256), 256, 0, st>>>(dpn, xh, N, C, g.post_w,
                                                                        g.post_b);
  cuda_check(cudaGetLastError(), "ttt_post_params_kernel launch");

  // The inner loop backwards, then its partials summed over the batch.
  const auto place = on_chip<Mlp, MB, G>(s, td::inner_shared_limit(ex)).backward;
  td::allow_shared(td::ttt_backward_kernel<Mlp, S>, ex);
  const td::backward_args args{q,  k,  v,  lr,  tok,  d_o,  ckpt,  dq,  dk,  dv, dlr,
                               part, scratch, T, H, d.D, d.F, d.SZ, MB, G, gsz, ncp, nmb, 1e-6f,
                               place.place};
  td::ttt_backward_kernel<Mlp, S><<<static_cast<unsigned>(B * H), gpu::ttt_backward_threads,
                                    place.shared_bytes, st>>>(args, w.ttt_norm_w, w.ttt_norm_b);
  cuda_check(cudaGetLastError(), "ttt_backward_kernel launch");
  const td::ttt_grad_targets<S> targets{g.w1, g.b1, g.w2, g.b2, g.ttt_norm_w, g.ttt_norm_b,
                                        g.tok_offset};
  const std::size_t red_n = H * (d.SZ + 2 * d.D) + MB;
  td::ttt_reduce_partials_kernel<S><<<td::blocks_for(red_n, 256), 256, 0, st>>>(
      part, B, H, d.D, d.F, d.SZ, MB, w.tok_offset, targets);
  cuda_check(cudaGetLastError(), "ttt_reduce_partials_kernel launch");

  // The learning-rate gate: dpre = dlr·lr·(1 − σ); its parameters and its share of dx.
  td::ttt_rate_grad_kernel<><<<td::blocks_for(N * H, 256), 256, 0, st>>>(dlr, lr, sig, N * H);
  cuda_check(cudaGetLastError(), "ttt_rate_grad_kernel launch");
  td::ttt_rate_params_kernel<S><<<td::blocks_for(H * C + H, 256), 256, 0, st>>>(dlr, x, N, H, C,
                                                                               g.lr_w, g.lr_b);
  cuda_check(cudaGetLastError(), "ttt_rate_params_kernel launch");
  td::ttt_rate_dx_kernel<S><<<td::blocks_for(N * C, 256), 256, 0, st>>>(dlr, w.lr_w, N, H, C, dxf);
  cuda_check(cudaGetLastError(), "ttt_rate_dx_kernel launch");

  // RoPE's transpose, then the projections.
  td::rope_kernel<<<td::blocks_for(pairs, 256), 256, 0, st>>>(dq, N, T, H, d.D, s.rope_base, MB,
                                                              MB, true);
  cuda_check(cudaGetLastError(), "ttt rope_kernel launch");
  td::rope_kernel<<<td::blocks_for(pairs, 256), 256, 0, st>>>(dk, N, T, H, d.D, s.rope_base, MB,
                                                              MB, true);
  cuda_check(cudaGetLastError(), "ttt rope_kernel launch");
  const float* grads[3] = {dq, dk, dv};
  const S* weights[3] = {w.wq, w.wk, w.wv};
  S* targets3[3] = {g.wq, g.wk, g.wv};
  for (int i = 0; i < 3; ++i) {
    const S* op = operand(grads[i]);
    gpu::matmul_at(ctx, x, op, targets3[i], N, C, C, true);
    gpu::matmul_bt(ctx, op, weights[i], dxf, N, C, C, true);
  }
  if constexpr (narrow) gpu::convert(ex, static_cast<const float*>(dxf), dx, N * C);
}

template <bool Mlp, std::size_t MB, typename S, typename A, typename Weights>
void backend_kernels<cuda_backend, ttt_shape>::step(const ttt_shape& s, const Weights& w, A* state,
                                                     std::size_t i, const S* x_t, S* y_t,
                                                     void* workspace, std::size_t workspace_size,
                                                     const cuda_executor& ex) {
  gpu::check_types<S, A>();
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
  const td::inner_args args{q, k, v, lr, tok, 1, H, d.D, d.F, d.SZ, MB, 1, 1, 1, 1e-6f, 0};
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
  gpu::check_types<S, A>();
  gpu::ttt_detail::ttt_reset_kernel<S><<<static_cast<unsigned>(s.batch * s.heads), 256, 0, ex.stream()>>>(
      state, s.heads, d.D, d.F, d.SZ, Mlp, w.w1, w.b1, w.w2, w.b2);
  cuda_check(cudaGetLastError(), "ttt_reset_kernel launch");
}

#endif  // MEMBOUND_CUDA_COMPILER

MEMBOUND_NAMESPACE_END
