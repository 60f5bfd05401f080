// TTT-Linear and TTT-MLP on the GPU: the kernels that basic_ttt<Mlp, ..., cuda_backend> runs.
// The CPU layer (layers/ttt.hpp, backend/cpu/ttt.hpp) is the specification; this file follows
// its forward step by step:
//   q, k, v = x·Wq, x·Wk, x·Wv            cuBLASLt (gpu::matmul), fp32 out
//   RoPE at t mod b on q, k               rope kernel (angles in double, as the CPU)
//   lr = base·σ(x·lr_wᵀ + lr_b)/D, tok    gpu::matmul_bt + one elementwise kernel
//   the inner loop, dual form             one CTA per (batch row or packed sequence, head),
//                                         mini-batches in order
//   post LayerNorm, gate                  one CTA per row
//   y = pn·Wo                             cuBLASLt
// The saved buffer is the CPU's, byte for byte in layout: the inner state at the start of every
// G-th mini-batch (fp32) and the heads' output before the post norm (storage type).
//
// What lives where (fp32 SIMT arithmetic; no tensor cores yet): each (row, head)'s CTA stages
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
//   the inner loop backwards                one CTA per (row, head): groups from the last, each
//                                           group's entering states recomputed from its
//                                           checkpoint with the forward's device functions
//                                           (mb_gradients, mb_update), then its mini-batches in
//                                           reverse (mb_outputs, mb_backward: the second-order
//                                           LayerNorm term, GELU'' for the MLP)
//   per-(row, head) partials                summed over the rows in order, one thread each
// Packed sequences: each sequence is a row of its own (one CTA per (sequence, head), a scratch
// slice and a partial each, as a batch of that many rows has), so the workspace grows with
// shape.sequences as it grows with the batch; empty sequences included.
//   the rate gate, RoPE's transpose         elementwise / per-column kernels
//   d wq, wk, wv, wg, wo and dx             cuBLASLt (fp32 operands; bf16/fp16 rounded once)
// Its workspace is a plain sum of slots (backward_layout), each sized exactly.
//
// Determinism: every sum runs in a fixed order inside one thread (no atomics, no split
// reductions), so forward and backward are bit-identical across runs, and across the
// TTT state group G (G only decides which states are copied out, and the backward recomputes
// the others with the same device functions the forward ran).
#pragma once

#include <cstddef>
#include <limits>
#include <string>
#include <type_traits>

#include "membound/backend/cuda/cuda_backend.cuh"
#include "membound/backend/cuda/cuda_check.cuh"
#include "membound/backend/cuda/gemm.cuh"
#include "membound/backend/cuda/model.cuh"
#include "membound/backend/cuda/packing.cuh"
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

#include "membound/backend/cuda/ttt_sizes.inl"

inline constexpr unsigned ttt_inner_threads = 256;
// The backward's inner kernel: fewer threads leave ptxas registers for its many live buffer
// pointers (at 256 the TTT-MLP kernel spilled).
inline constexpr unsigned ttt_backward_threads = 128;
static_assert(ttt_inner_threads % 32 == 0 && ttt_backward_threads % 32 == 0,
              "the TTT kernels' row phases run on lane groups with full-warp shuffles "
              "(ttt_kernels.inl): whole warps only");

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
  // G: the TTT state group (its entering states are the backward's largest per-head buffer).
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
  // ckpt: the saved inner states [B·H, saved states, SZ] (fp32; packed, each sequence's in order
  // from its head's first slot, as on the CPU); o_s: the heads' output [N, C]
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
  // The inner loop's rows: one CTA per (row, head), a batch row or, packed, a sequence (the size
  // holds for any packing of shape.sequences sequences).
  static constexpr std::size_t inner_rows(const ttt_shape& s) noexcept {
    return s.sequences != 0 ? s.sequences : s.batch;
  }
  // One (row, head)'s slice of the forward's scratch: the inner loop's, or the decoding step's
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
    if (packed_offsets_bytes(s.sequences) >= detail::huge_slot) return false;
    const std::size_t per = forward_elements<Mlp, MB>(s);
    return bytes_of<float>(N, s.width) != std::numeric_limits<std::size_t>::max() &&
           bytes_of<float>(inner_rows(s), s.heads, per) != std::numeric_limits<std::size_t>::max();
  }

  // The group's entering states in use: min(G, mini-batches) (G is SIZE_MAX for ttt_state_groups_all).
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
    return bytes_of<float>(inner_rows(s) * s.heads, gpu::ttt_backward_scratch_elements(d.SZ, d.D, d.F, MB, gsz, Mlp)) != m &&
           bytes_of<float>(inner_rows(s) * s.heads, gpu::ttt_partial_elements(d.SZ, d.D, MB)) != m;
  }

 public:
  // cuBLASLt's workspace first (256-byte aligned); q, k (then the gate's pre-activation), v [N, C]
  // fp32; lr [N, H]; tok [mb]; the inner loop's scratch [rows·H, forward_elements]; pn [N, C] in
  // storage (the output GEMM's operand); packed sequences' offsets (their device copy).
  enum forward_slot : std::size_t { f_gemm, f_q, f_k, f_v, f_lr, f_tok, f_scratch, f_pn, f_offsets };
  template <bool Mlp, std::size_t MB, typename S>
  static constexpr workspace_layout<9> forward_layout(const ttt_shape& s) {
    const std::size_t N = s.batch * s.seq, C = s.width, H = s.heads;
    workspace_layout<9> l;
    l.add(gpu::gemm_workspace_bytes_max, gpu::gemm_workspace_alignment);
    l.add(bytes_of<float>(N, C));
    l.add(bytes_of<float>(N, C));
    l.add(bytes_of<float>(N, C));
    l.add(bytes_of<float>(N, H));
    l.add(bytes_of<float>(MB));
    l.add(bytes_of<float>(inner_rows(s) * H, forward_elements<Mlp, MB>(s)));
    l.add(bytes_of<S>(N, C));
    l.add(packed_offsets_bytes(s.sequences));
    return l;
  }
  // cuBLASLt's workspace; q, k, v [N, C], lr, σ [N, H], tok [mb] (fp32, as forward); dpn (dy·Woᵀ,
  // then the post norm's output gradient), the gate's pre-activation (then its gradient), x̂ of
  // the post norm, d_o (the heads' output gradient), dq, dk, dv [N, C] fp32; the gated post norm
  // output [N, C] in storage (d wo's operand); dlr [N, H]; the partials [rows·H, partial_elements];
  // the inner loop's scratch [rows·H, backward_scratch_elements]; for bf16/fp16 a storage copy
  // [N, C] of each row gradient in turn (the GEMMs' operand) and dx in fp32 [N, C]; packed
  // sequences' offsets. Nothing shares bytes: the sizes are plain sums.
  enum backward_slot : std::size_t {
    b_gemm, b_q, b_k, b_v, b_lr, b_sig, b_tok, b_dpn, b_gpre, b_xh, b_do, b_dq, b_dk, b_dv, b_pn,
    b_dlr, b_part, b_scratch, b_conv, b_dx, b_offsets
  };
  template <bool Mlp, std::size_t MB, std::size_t G, typename S>
  static constexpr workspace_layout<21> backward_layout(const ttt_shape& s) {
    constexpr bool narrow = !std::is_same_v<S, float>;
    const auto d = gpu::ttt_dims::of(s, Mlp);
    const std::size_t N = s.batch * s.seq, C = s.width, H = s.heads, BH = inner_rows(s) * H;
    workspace_layout<21> l;
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
    l.add(packed_offsets_bytes(s.sequences));
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

// The inner loop's dynamic shared memory (outside ttt_kernels.inl, which the host emulation
// shares: it gives each CTA its own buffer).
__device__ inline float* ttt_smem() {
  extern __shared__ float4 ttt_smem_f4[];
  return reinterpret_cast<float*>(ttt_smem_f4);
}

// A row phase's lane group (ttt_kernels.inl, "Rows on lane groups"): 8 lanes a row, 4 rows a warp.
inline constexpr unsigned row_lanes = 8, rows_per_warp = 32 / row_lanes;
// Σ over the calling lane's group of row_lanes lanes, of each of v's N values: a butterfly (lanes
// l and l ^ m add the same two numbers at each step, and a + b == b + a), so every lane of the
// group gets the same bits. Outside ttt_kernels.inl: the host emulation replays this butterfly in
// one rendezvous of the warp's threads instead of one per shuffle.
template <unsigned N>
__device__ inline void row_sums(float (&v)[N]) {
#pragma unroll
  for (unsigned m = row_lanes / 2; m >= 1; m /= 2) {
#pragma unroll
    for (unsigned k = 0; k < N; ++k) v[k] += detail::lane_xor(v[k], m);
  }
}

// ---- Products on the tensor cores (ttt_kernels.inl, "Products on the tensor cores") ----------
// mma.sync.m16n8k8 on TF32 operands as 3xTF32: each fp32 operand x = hi + lo, both TF32
// (cvt.rna), and a·b ≈ a_hi·b_hi into d plus a_lo·b_hi + a_hi·b_lo into ds (the small terms kept
// apart and added once at the end: two chains of dependent mma, not one); the dropped a_lo·b_lo
// is below 2^-21 of |a|·|b|, so the sums keep fp32's accuracy, not TF32's 2^-11. sm_80 and up.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
struct tf32_parts {
  std::uint32_t hi, lo;
};
__device__ inline tf32_parts tf32_split(float x) {
  tf32_parts p;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(p.hi) : "f"(x));
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(p.lo) : "f"(x - __uint_as_float(p.hi)));
  return p;
}
__device__ inline void mma_tf32(float (&c)[4], std::uint32_t a0, std::uint32_t a1, std::uint32_t a2,
                                std::uint32_t a3, std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
#else
// Below sm_80: d += a·b in fp32 on the CUDA cores, each lane gathering its rows of a and columns
// of b from the fragments by shuffles. Lane (g, t) = (lane / 4, lane % 4) holds a(g, t),
// a(g + 8, t), a(g, t + 4), a(g + 8, t + 4), b(t, g), b(t + 4, g) and sums (g, 2t), (g, 2t + 1),
// (g + 8, 2t), (g + 8, 2t + 1).
__device__ inline void mma_fp32_shuffled(float (&d)[4], const float (&a)[4], const float (&b)[2]) {
  const unsigned lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (unsigned k = 0; k < 8; ++k) {
    const bool high = k >= 4;  // uniform: every lane sends the same register
    const int ra = static_cast<int>(g * 4 + k % 4);
    const float a0 = __shfl_sync(0xffffffffu, high ? a[2] : a[0], ra);
    const float a8 = __shfl_sync(0xffffffffu, high ? a[3] : a[1], ra);
    const float b0 = __shfl_sync(0xffffffffu, high ? b[1] : b[0], static_cast<int>(2 * t * 4 + k % 4));
    const float b1 = __shfl_sync(0xffffffffu, high ? b[1] : b[0], static_cast<int>((2 * t + 1) * 4 + k % 4));
    d[0] += a0 * b0;
    d[1] += a0 * b1;
    d[2] += a8 * b0;
    d[3] += a8 * b1;
  }
}
#endif
// d[n] += the sum over ksteps steps of 8 of a·b[n], for NT 16×8 output tiles that share their
// rows: frag(step, a, b) writes the calling lane's fragments of a (16×8, loaded once a step for
// all NT tiles) and of each tile's b (8×8), in the PTX ISA's m16n8k8 layouts (block_product,
// ttt_kernels.inl). Each tile's sum is the same sequence of operations whatever NT, so NT changes
// no bits. Outside ttt_kernels.inl: the host emulation gathers a strip's fragments and meets its
// warp once per strip instead of once per step.
template <unsigned NT, typename Frag>
__device__ inline void mma_strip(float (&d)[NT][4], unsigned ksteps, Frag frag) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float ds[NT][4] = {};
  for (unsigned s = 0; s < ksteps; ++s) {
    float a[4], b[NT][2];
    frag(s, a, b);
    tf32_parts pa[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) pa[r] = tf32_split(a[r]);
#pragma unroll
    for (unsigned n = 0; n < NT; ++n) {
      const tf32_parts b0 = tf32_split(b[n][0]), b1 = tf32_split(b[n][1]);
      mma_tf32(ds[n], pa[0].lo, pa[1].lo, pa[2].lo, pa[3].lo, b0.hi, b1.hi);
      mma_tf32(ds[n], pa[0].hi, pa[1].hi, pa[2].hi, pa[3].hi, b0.lo, b1.lo);
      mma_tf32(d[n], pa[0].hi, pa[1].hi, pa[2].hi, pa[3].hi, b0.hi, b1.hi);
    }
  }
#pragma unroll
  for (unsigned n = 0; n < NT; ++n)
#pragma unroll
    for (int r = 0; r < 4; ++r) d[n][r] += ds[n][r];
#else
  for (unsigned s = 0; s < ksteps; ++s) {
    float a[4], b[NT][2];
    frag(s, a, b);
#pragma unroll
    for (unsigned n = 0; n < NT; ++n) mma_fp32_shuffled(d[n], a, b[n]);
  }
#endif
}

#include "membound/backend/cuda/ttt_kernels.inl"

inline unsigned blocks_for(std::size_t n, std::size_t threads) {
  return detail::grid_for(n, threads);
}

// q, k, v, the rates and the token weights of n rows x [n, C] in sequences of T tokens, as the
// forward, the backward and decoding compute them: one function, so that the backward's
// recomputation is the forward's, bit for bit. fixed: every row's position in decoding (the
// token's index in its mini-batch); MB otherwise (row n at (n mod T) mod MB). sig: the rates'
// sigmoids, where the backward keeps them.
template <typename S, typename Weights>
void inner_inputs(const gemm_context& ctx, const ttt_shape& s, const ttt_dims& d, std::size_t MB,
                  const Weights& w, const S* x, std::size_t n, std::size_t T, std::size_t fixed,
                  float* q, float* k, float* v, float* lr, float* tok, float* sig, cudaStream_t st,
                  const packed_sequences& packing = {}) {
  const std::size_t C = s.width, H = s.heads;
  matmul(ctx, x, w.wq, q, n, C, C, false);
  matmul(ctx, x, w.wk, k, n, C, C, false);
  matmul(ctx, x, w.wv, v, n, C, C, false);
  const std::size_t pairs = n * H * (d.D / 2);
  rope_kernel<><<<blocks_for(pairs, 256), 256, 0, st>>>(q, n, T, H, d.D, s.rope_base, MB, fixed, false,
                                                      packing);
  cuda_check(cudaGetLastError(), "ttt rope_kernel launch");
  rope_kernel<><<<blocks_for(pairs, 256), 256, 0, st>>>(k, n, T, H, d.D, s.rope_base, MB, fixed, false,
                                                      packing);
  cuda_check(cudaGetLastError(), "ttt rope_kernel launch");
  matmul_bt(ctx, x, w.lr_w, lr, n, C, H, false);
  const float scale = static_cast<float>(s.base_lr / static_cast<double>(d.D));
  const std::size_t rate_n = n * H > MB ? n * H : MB;
  rates_kernel<S><<<blocks_for(rate_n, 256), 256, 0, st>>>(lr, w.lr_b, n, H, scale, w.tok_offset, tok,
                                                          MB, sig);
  cuda_check(cudaGetLastError(), "ttt rates_kernel launch");
}

// The device's opt-in limit of dynamic shared memory per block (the inner kernels have no static
// shared memory).
inline std::size_t device_shared_limit(const cuda_executor& ex) {
  int v = 0;
  cuda_check(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, ex.device()),
             "cudaDeviceGetAttribute(cudaDevAttrMaxSharedMemoryPerBlockOptin)");
  return v > 0 ? static_cast<std::size_t>(v) : 0;
}
// What the inner loop may take: the device's limit under the executor's kernels().ttt_shared_limit.
inline std::size_t inner_shared_limit(const cuda_executor& ex) {
  const std::size_t device = device_shared_limit(ex), cap = ex.kernels().ttt_shared_limit;
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
  // ceil without the overflow of nmb + G − 1 (ttt_state_groups_all is G = SIZE_MAX).
  const std::size_t nmb = T / MB + (T % MB != 0), ncp = ttt_saved_states(s, MB, G);
  const gpu::gemm_context ctx(ex, gpu::shared_gemm_cache(), ws.template get<std::byte>(f_gemm),
                              gpu::gemm_workspace_bytes_max);
  const packed_sequences pk = gpu::stage_packing(ex, s.packing(), ws.template get<std::int32_t>(f_offsets));
  float* q = ws.template get<float>(f_q);
  float* k = ws.template get<float>(f_k);
  float* v = ws.template get<float>(f_v);
  float* lr = ws.template get<float>(f_lr);
  float* tok = ws.template get<float>(f_tok);
  float* scratch = ws.template get<float>(f_scratch);
  S* pn = ws.template get<S>(f_pn);
  const cudaStream_t st = ex.stream();

  td::inner_inputs(ctx, s, d, MB, w, x, N, T, MB, q, k, v, lr, tok, nullptr, st, pk);

  const auto place = on_chip<Mlp, MB, G>(s, td::inner_shared_limit(ex)).forward;
  td::allow_shared(td::ttt_forward_kernel<Mlp, S>, ex);
  const td::inner_args args{q,  k,  v,   lr,  tok, T,   H,   d.D,   d.F,
                            d.SZ, MB, G, ncp, nmb, 1e-6f, place.place, pk};
  td::ttt_forward_kernel<Mlp, S><<<static_cast<unsigned>(inner_rows(s) * H), gpu::ttt_inner_threads,
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
  const std::size_t N = s.batch * s.seq, C = s.width, H = s.heads, T = s.seq, rows = inner_rows(s);
  const std::size_t nmb = T / MB + (T % MB != 0), ncp = ttt_saved_states(s, MB, G);
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
  const packed_sequences pk = gpu::stage_packing(ex, s.packing(), ws.template get<std::int32_t>(b_offsets));
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
  td::inner_inputs(ctx, s, d, MB, w, x, N, T, MB, q, k, v, lr, tok, sig, st, pk);

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

  // The inner loop backwards, then its partials summed over the rows.
  const auto place = on_chip<Mlp, MB, G>(s, td::inner_shared_limit(ex)).backward;
  td::allow_shared(td::ttt_backward_kernel<Mlp, S>, ex);
  const td::backward_args args{q,  k,  v,  lr,  tok,  d_o,  ckpt,  dq,  dk,  dv, dlr,
                               part, scratch, T, H, d.D, d.F, d.SZ, MB, G, gsz, ncp, nmb, 1e-6f,
                               place.place, pk};
  td::ttt_backward_kernel<Mlp, S><<<static_cast<unsigned>(rows * H), gpu::ttt_backward_threads,
                                    place.shared_bytes, st>>>(args, w.ttt_norm_w, w.ttt_norm_b);
  cuda_check(cudaGetLastError(), "ttt_backward_kernel launch");
  const td::ttt_grad_targets<S> targets{g.w1, g.b1, g.w2, g.b2, g.ttt_norm_w, g.ttt_norm_b,
                                        g.tok_offset};
  const std::size_t red_n = H * (d.SZ + 2 * d.D) + MB;
  td::ttt_reduce_partials_kernel<S><<<td::blocks_for(red_n, 256), 256, 0, st>>>(
      part, rows, H, d.D, d.F, d.SZ, MB, w.tok_offset, targets);
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
  const std::size_t pairs = N * H * (d.D / 2);
  td::rope_kernel<><<<td::blocks_for(pairs, 256), 256, 0, st>>>(dq, N, T, H, d.D, s.rope_base, MB,
                                                              MB, true, pk);
  cuda_check(cudaGetLastError(), "ttt rope_kernel launch");
  td::rope_kernel<><<<td::blocks_for(pairs, 256), 256, 0, st>>>(dk, N, T, H, d.D, s.rope_base, MB,
                                                              MB, true, pk);
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

  td::inner_inputs(ctx, s, d, MB, w, x_t, B, 1, i, q, k, v, lr, tok, nullptr, st);
  const td::inner_args args{q, k, v, lr, tok, 1, H, d.D, d.F, d.SZ, MB, 1, 1, 1, 1e-6f, 0, {}};
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
