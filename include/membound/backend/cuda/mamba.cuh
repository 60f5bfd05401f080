// The Mamba block on the GPU: the kernels that mamba<..., cuda_backend> runs. Same semantics,
// saved layout and decoding state as the CPU block (layers/mamba.hpp, backend/cpu/mamba.hpp):
//
//   forward:  xz = x·in_proj (cuBLASLt, into saved) -> conv + SiLU kernel -> x_dbl = u·x_proj
//             (into saved) -> dt = dt_low·dt_proj (fp32) -> Δ kernel (softplus + bias, rounded
//             to storage) -> the scan over chunks in parallel (chunk-local states, the combine
//             over chunks into the saved states, every chunk from its entry state; gate fused)
//             -> out = g·out_proj
//   backward: the same values as stored or recomputed; dg = dout·out_projᵀ; the forward scan's
//             last kernel once more, from the saved states, for y, with the gate's backward fused
//             (g and dz); the reverse scan over chunks in parallel (each chunk's own dL/dh from
//             0, the carry over chunks right to left, every chunk from its carried dL/dh on its
//             states recomputed from the saved entry state); fixed-order reductions of dB/dC,
//             dA/dD/dΔ-bias and the conv weights; the GEMMs back.
//   step:     in_proj GEMM -> conv-window kernel -> x_proj and dt GEMMs -> one scan step -> out_proj
//
// Keyed by the shape type (backend_kernels<cuda_backend, mamba_shape>): the layer owns the call
// shape, the argument checks and the saved layout; this owns the device workspace and launches.
//
// Scan layout. A forward block holds `cpb` channels × Ns state lanes (cpb = max(1, 128 / Ns),
// at most 64), one thread per (channel, state) pair, for one batch row and one chunk of L steps
// (the layer's scan_chunk): B · ceil(T / L) · Di · Ns threads, each carrying its state in an fp32
// register through its chunk only. The states entering chunks 1 .. nch − 1 are the saved
// [B, chunks − 1, Di, Ns] states, where the CPU keeps them: the chunk-local end states are
// written there and combined in place over the chunks (H_{k+1} = exp(a·ΣΔ_k)·H_k + l_k, one
// thread per (b, channel, state)) before the outputs' pass reads them; the chunks' ΣΔ is the one
// extra workspace slot ([B, nch − 2, Di] fp32). y = Σ_s C·h is summed per time tile through
// shared memory in lane order (no shuffles, no atomics). The reverse scan splits the same way:
// each chunk's own dL/dh from 0 (no states needed), the carry over chunks right to left
// (D_{k−1} = exp(a·ΣΔ_k)·D_k + r_k, into a workspace [B, nch, Di, Ns]), then one block
// per (b, chunk, the CPU's 64-channel partition scan_channels) in groups of cpb walks its chunk
// backward from the carried dL/dh, the chunk's states recomputed in registers tile by tile from
// per-thread checkpoints in shared memory (no global copy of the states). Everything summed
// across threads or chunks goes through per-block or per-chunk partials reduced in index order by
// a second kernel, so repeated runs give the same bits.
//
// Precision: storage S (float, bf16, fp16), fp32 everywhere else. As in backend/cuda/mlp.cuh, values that
// feed a GEMM (u, the gated y, dΔ·σ, dx_dbl, dxz) are rounded to S, where the CPU keeps them in
// fp32: no difference for fp32 storage, one more rounding each for bf16/fp16 (the tests bound it).
// The scan itself reads u = SiLU(c) in fp32 from the stored conv output, as the CPU does.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <limits>
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
#include "membound/memory/workspace.hpp"
#include "membound/policy/backend.hpp"
#include "membound/shape/mamba_shape.hpp"

MEMBOUND_NAMESPACE_BEGIN

namespace gpu {

#include "membound/backend/cuda/mamba_sizes.inl"

}  // namespace gpu

template <>
struct backend_kernels<cuda_backend, mamba_shape> {
  // ---- Sizes (exactly what the launches carve) -------------------------------------------------
  // keep: the save_all policy (c and Δ live in `saved`, not in the workspace). L: scan_chunk.
  // A and `threads` are the host backend's (the device accumulates in fp32 and sizes nothing per
  // host thread).
  template <typename S, typename A>
  static constexpr std::size_t forward_workspace_bytes(const mamba_shape& s, std::size_t L,
                                                       bool keep, std::size_t /*threads*/) noexcept {
    return fits(s) ? forward_layout<S>(s, L, keep).size()
                   : std::numeric_limits<std::size_t>::max();
  }
  template <typename S, typename A>
  static constexpr std::size_t backward_workspace_bytes(const mamba_shape& s, std::size_t L,
                                                        bool keep, std::size_t /*threads*/) noexcept {
    return fits(s) ? backward_layout<S>(s, L, keep).size()
                   : std::numeric_limits<std::size_t>::max();
  }
  template <typename S, typename A>
  static constexpr std::size_t step_workspace_bytes(const mamba_shape& s) noexcept {
    return fits(s) ? step_layout<S>(s).size() : std::numeric_limits<std::size_t>::max();
  }
  // Of the backward workspace (fp32; for tests and the plan table): the dB/dC partials [scan
  // blocks, N, 2·Ns]; the dL/dh carried into each chunk [B, nch, Di, Ns] (the last chunk's slot
  // unused), which then holds the per-chunk dA partials in place (each thread overwrites the
  // word it read); the chunks' ΣΔ [B, nch − 2, Di] (as the forward's); the per-chunk dD and
  // d dt_bias partials [B, nch, Di, 2].
  static constexpr std::size_t backward_partial_bytes(const mamba_shape& s) noexcept {
    return bytes_of<float>(gpu::mamba_blocks(s.d_inner, gpu::mamba_scan_channels),
                           s.batch * s.seq, 2 * s.d_state);
  }
  static constexpr std::size_t backward_carry_bytes(const mamba_shape& s, std::size_t L) noexcept {
    return bytes_of<float>(s.batch, gpu::mamba_chunks(s.seq, L), s.d_inner, s.d_state);
  }
  static constexpr std::size_t backward_chunk_sum_bytes(const mamba_shape& s,
                                                        std::size_t L) noexcept {
    return bytes_of<float>(gpu::mamba_chunk_sum_elements(s.batch, s.seq, L, s.d_inner));
  }
  static constexpr std::size_t backward_small_bytes(const mamba_shape& s, std::size_t L) noexcept {
    return bytes_of<float>(s.batch, gpu::mamba_chunks(s.seq, L), s.d_inner, 2);
  }
  // Of the forward workspace: the chunked scan's Σ Δ per (b, chunk 1 .. nch − 2, channel), fp32
  // (the chunk-local end states go straight into the saved states, combined there in place).
  static constexpr std::size_t forward_chunk_sum_bytes(const mamba_shape& s,
                                                       std::size_t L) noexcept {
    return bytes_of<float>(gpu::mamba_chunk_sum_elements(s.batch, s.seq, L, s.d_inner));
  }

  // The device pointers of the weights, gradients and saved buffers (shape/mamba_shape.hpp; c and
  // delta null unless save_all); the states are fp32.
  template <typename S>
  using weights = mamba_weights<S>;
  template <typename S>
  using gradients = mamba_gradients<S>;
  template <typename S>
  using saved = mamba_saved<S, float>;

#if MEMBOUND_CUDA_COMPILER
  template <typename S, typename A>
  static void forward(const mamba_shape& s, std::size_t L, const weights<S>& w, const S* x, S* out,
                      const saved<S>& sv, void* workspace, std::size_t workspace_size,
                      const cuda_executor& ex);
  template <typename S, typename A>
  static void backward(const mamba_shape& s, std::size_t L, const weights<S>& w, const S* x,
                       const saved<S>& sv, const S* dout, S* dx, const gradients<S>& g,
                       void* workspace, std::size_t workspace_size, const cuda_executor& ex);
  template <typename S, typename A>
  static void step(const mamba_shape& s, const weights<S>& w, float* state, const S* x_t, S* out_t,
                   void* workspace, std::size_t workspace_size, const cuda_executor& ex);
  // Zeroes the decoding state on the executor's stream.
  static void reset_state(void* state, std::size_t bytes, const cuda_executor& ex) {
    if (bytes == 0) return;
    cuda_check(cudaMemsetAsync(state, 0, bytes, ex.stream()), "cudaMemsetAsync");
  }
#else
  // The launches exist only where nvcc compiles: the size functions above are all a host-only
  // translation unit (a planner, a .cpp) can use.
  template <typename S, typename A, typename... Args>
  static void forward(Args&&...) {
    static_assert(dependent_false<S, A>,
                  "membound: mamba<..., cuda_backend>::forward launches CUDA kernels; compile this "
                  "translation unit with nvcc (a .cu file, or LANGUAGE CUDA in CMake).");
  }
  template <typename S, typename A, typename... Args>
  static void backward(Args&&...) {
    static_assert(dependent_false<S, A>,
                  "membound: mamba<..., cuda_backend>::backward launches CUDA kernels; compile "
                  "this translation unit with nvcc (a .cu file, or LANGUAGE CUDA in CMake).");
  }
  template <typename S, typename A, typename... Args>
  static void step(Args&&...) {
    static_assert(dependent_false<S, A>,
                  "membound: mamba<..., cuda_backend>::step launches CUDA kernels; compile this "
                  "translation unit with nvcc (a .cu file, or LANGUAGE CUDA in CMake).");
  }
  template <typename... Args>
  static void reset_state(Args&&...) {
    static_assert(dependent_false<Args...>,
                  "membound: mamba<..., cuda_backend>::reset clears device memory; compile this "
                  "translation unit with nvcc (a .cu file, or LANGUAGE CUDA in CMake).");
  }
#endif

  // ---- Layouts -------------------------------------------------------------------------------
  // cuBLASLt's workspace first: 256-byte aligned, as cuBLAS requires. Phases (forward): 0 in_proj
  // and the conv, 1 x_proj, 2 dt and Δ, 3 the scan, 4 out_proj. Packed sequences' offsets (their
  // device copy) live through every phase.
  enum forward_slot : std::size_t { f_gemm, f_c, f_u, f_dt, f_delta, f_g, f_dsum, f_offsets };
  template <typename S>
  static constexpr workspace_layout<8> forward_layout(const mamba_shape& s, std::size_t L,
                                                      bool keep) {
    const std::size_t N = s.batch * s.seq, Di = s.d_inner;
    workspace_layout<8> l;
    l.add(gpu::gemm_workspace_bytes_max, gpu::gemm_workspace_alignment, {0, 4});
    l.add(keep ? 0 : bytes_of<S>(N, Di), default_alignment, {0, 3});      // c
    l.add(bytes_of<S>(N, Di), default_alignment, {0, 1});                 // u (x_proj's input)
    l.add(bytes_of<float>(N, Di), default_alignment, {2, 2});             // dt (pre-softplus)
    l.add(keep ? 0 : bytes_of<S>(N, Di), default_alignment, {2, 3});      // Δ
    l.add(bytes_of<S>(N, Di), default_alignment, {3, 4});                 // y ⊙ SiLU(z)
    l.add(forward_chunk_sum_bytes(s, L), default_alignment, {3, 3});      // the chunks' Σ Δ
    l.add(packed_offsets_bytes(s.sequences), default_alignment, {0, 4});  // packed sequences
    return l;
  }

  // Phases: 0 the forward's values (conv, Δ) and dg; 1 the scan once more (g, dz) and out_proj's
  // gradient; 2 the reverse scan; 3 the reductions, dt_proj's and x_proj's GEMMs; 4 du's GEMM
  // and the conv's backward; 5 in_proj's gradient and dx.
  enum backward_slot : std::size_t {
    b_gemm, b_c, b_u, b_dt, b_delta, b_dg, b_g, b_dxz, b_carry, b_dsum, b_part, b_small, b_du,
    b_ddt, b_dxdbl, b_cpart, b_offsets
  };
  template <typename S>
  static constexpr workspace_layout<17> backward_layout(const mamba_shape& s, std::size_t L,
                                                        bool keep) {
    const std::size_t N = s.batch * s.seq, Di = s.d_inner, Ns = s.d_state, K = s.d_conv;
    const std::size_t ldx = s.dt_rank + 2 * Ns;
    workspace_layout<17> l;
    l.add(gpu::gemm_workspace_bytes_max, gpu::gemm_workspace_alignment, {0, 5});
    l.add(keep ? 0 : bytes_of<S>(N, Di), default_alignment, {0, 4});     // c
    l.add(bytes_of<S>(N, Di), default_alignment, {0, 3});                // u
    l.add(keep ? 0 : bytes_of<float>(N, Di), default_alignment, {0, 0}); // dt (pre-softplus)
    l.add(keep ? 0 : bytes_of<S>(N, Di), default_alignment, {0, 3});     // Δ
    l.add(bytes_of<float>(N, Di), default_alignment, {0, 2});            // dg = dout·out_projᵀ
    l.add(bytes_of<S>(N, Di), default_alignment, {1, 1});                // y ⊙ SiLU(z)
    l.add(bytes_of<S>(N, 2 * Di), default_alignment, {1, 5});            // dxz
    l.add(backward_carry_bytes(s, L), default_alignment, {2, 3});      // dL/dh in, then dA
    l.add(backward_chunk_sum_bytes(s, L), default_alignment, {2, 2});  // the chunks' Σ Δ
    l.add(backward_partial_bytes(s), default_alignment, {2, 3});       // dB, dC partials
    l.add(backward_small_bytes(s, L), default_alignment, {2, 3});      // dD, dbias per (b, chunk)
    l.add(bytes_of<float>(N, Di), default_alignment, {2, 4});            // du
    l.add(bytes_of<S>(N, Di), default_alignment, {2, 3});                // dΔ·σ(dt)
    l.add(bytes_of<S>(N, ldx), default_alignment, {3, 4});               // dx_dbl
    l.add(bytes_of<float>(gpu::mamba_blocks(N, gpu::mamba_conv_rows), Di, K + 1),
          default_alignment, {4, 4});                                    // conv weight partials
    l.add(packed_offsets_bytes(s.sequences), default_alignment, {0, 5});  // packed sequences
    return l;
  }

  enum step_slot : std::size_t { st_gemm, st_xz, st_us, st_uf, st_xdbl, st_dt, st_g };
  template <typename S>
  static constexpr workspace_layout<7> step_layout(const mamba_shape& s) {
    const std::size_t B = s.batch, Di = s.d_inner, ldx = s.dt_rank + 2 * s.d_state;
    workspace_layout<7> l;
    l.add(gpu::gemm_workspace_bytes_max, gpu::gemm_workspace_alignment);
    l.add(bytes_of<S>(B, 2 * Di));
    l.add(bytes_of<S>(B, Di));
    l.add(bytes_of<float>(B, Di));
    l.add(bytes_of<S>(B, ldx));
    l.add(bytes_of<float>(B, Di));
    l.add(bytes_of<S>(B, Di));
    return l;
  }

 private:
  // Every [N, ·] size fits, and the backward's [B, nch, Di, Ns] too for any L (nch ≤ T). Each
  // below SIZE_MAX / 32 (memory/workspace.hpp's detail::huge_slot), not merely below SIZE_MAX: the layouts
  // add up to 17 such slots (the packed offsets' among them), and a sum that overflowed would make workspace_layout::add throw
  // inside the layer's noexcept size functions (std::terminate) instead of reporting SIZE_MAX.
  static constexpr bool fits(const mamba_shape& s) noexcept {
    constexpr std::size_t huge = std::numeric_limits<std::size_t>::max() / 32;
    const std::size_t N = s.batch * s.seq;
    if (s.batch != 0 && N / s.batch != s.seq) return false;
    if (packed_offsets_bytes(s.sequences) >= huge) return false;
    const std::size_t ldx = s.dt_rank + 2 * s.d_state;
    return bytes_of<float>(N, 2 * s.d_inner) < huge && bytes_of<float>(N, ldx) < huge &&
           bytes_of<float>(N, s.d_inner, s.d_state) < huge &&
           bytes_of<float>(gpu::mamba_blocks(s.d_inner, gpu::mamba_scan_channels), N,
                           2 * s.d_state) < huge &&
           bytes_of<float>(gpu::mamba_blocks(N, gpu::mamba_conv_rows) + 1, s.d_inner,
                           s.d_conv + 1) < huge;
  }
};

#if MEMBOUND_CUDA_COMPILER

namespace gpu {
namespace mamba_detail {

using gpu::detail::ld;
using gpu::detail::st;

#include "membound/backend/cuda/mamba_kernels.inl"

inline unsigned grid_for(std::size_t n) { return gpu::detail::grid_for(n, 256); }

}  // namespace mamba_detail
}  // namespace gpu

// ---- Launch code ---------------------------------------------------------------------------------

template <typename S, typename A>
void backend_kernels<cuda_backend, mamba_shape>::forward(const mamba_shape& s, std::size_t L,
                                                         const weights<S>& w, const S* x, S* out,
                                                         const saved<S>& sv, void* workspace,
                                                         std::size_t workspace_size,
                                                         const cuda_executor& ex) {
  gpu::check_types<S, A>();
  namespace md = gpu::mamba_detail;
  const bool keep = sv.c != nullptr;
  const auto ws = carve(forward_layout<S>(s, L, keep), workspace, workspace_size);
  const std::size_t B = s.batch, T = s.seq, N = B * T, C = s.d_model, Di = s.d_inner;
  const std::size_t Ns = s.d_state, R = s.dt_rank, K = s.d_conv, ldx = R + 2 * Ns;
  gpu::detail::need_extent(N, static_cast<std::size_t>(std::numeric_limits<int>::max()), "shape.batch·shape.seq");
  gpu::detail::need_extent(B, 65535, "shape.batch");
  gpu::detail::need_extent(
      gpu::mamba_blocks(Di, gpu::mamba_channels_per_block(Ns)) * gpu::mamba_chunks(T, L),
      static_cast<std::size_t>(std::numeric_limits<int>::max()),
      "the scan's blocks per batch row (channel blocks · ceil(seq / chunk))");
  const gpu::gemm_context ctx(ex, gpu::shared_gemm_cache(), ws.template get<std::byte>(f_gemm),
                              gpu::gemm_workspace_bytes_max);
  S* const c = keep ? sv.c : ws.template get<S>(f_c);
  S* const delta = keep ? sv.delta : ws.template get<S>(f_delta);
  S* const u = ws.template get<S>(f_u);
  float* const dt = ws.template get<float>(f_dt);
  S* const gated = ws.template get<S>(f_g);
  cudaStream_t st = ex.stream();
  const packed_sequences pk = gpu::stage_packing(ex, s.packing(), ws.template get<std::int32_t>(f_offsets));

  gpu::matmul(ctx, x, w.in_proj, sv.xz, N, C, 2 * Di, false);
  md::conv_silu_kernel<<<md::grid_for(N * Di), 256, 0, st>>>(static_cast<const S*>(sv.xz), w.conv_w,
                                                             w.conv_b, c, u, N, T, Di, K, true, pk);
  cuda_executor::check_launch("mamba conv_silu_kernel");
  gpu::matmul(ctx, static_cast<const S*>(u), w.x_proj, sv.xdbl, N, Di, ldx, false);
  gpu::matmul(ctx, static_cast<const S*>(sv.xdbl), w.dt_proj, dt, N, R, Di, false,
              ld3{ldx, Di, Di});
  md::delta_kernel<<<md::grid_for(N * Di), 256, 0, st>>>(static_cast<const float*>(dt), w.dt_bias,
                                                         delta, N, Di);
  cuda_executor::check_launch("mamba delta_kernel");
  // The scan over chunks of L in parallel: A (chunk-local end states into the saved states, ΣΔ),
  // B (the combine over chunks, in place), C (every chunk from its entry state, the outputs).
  const std::size_t cpb = gpu::mamba_channels_per_block(Ns), nchb = gpu::mamba_blocks(Di, cpb);
  const std::size_t nch = gpu::mamba_chunks(T, L);
  const unsigned threads = static_cast<unsigned>(cpb * Ns);
  if (nch > 1) {
    float* const dsum = ws.template get<float>(f_dsum);
    const dim3 grid_a(static_cast<unsigned>(nchb * (nch - 1)), static_cast<unsigned>(B));
    md::scan_chunk_local_kernel<<<grid_a, threads, 0, st>>>(
        static_cast<const S*>(c), static_cast<const S*>(delta), static_cast<const S*>(sv.xdbl),
        w.a_log, T, Di, Ns, R, L, cpb, sv.states, dsum, pk);
    cuda_executor::check_launch("mamba scan_chunk_local_kernel");
    if (nch > 2) {
      md::scan_chunk_combine_kernel<<<md::grid_for(B * Di * Ns), 256, 0, st>>>(
          w.a_log, static_cast<const float*>(dsum), sv.states, B, nch, Di, Ns);
      cuda_executor::check_launch("mamba scan_chunk_combine_kernel");
    }
  }
  const dim3 grid(static_cast<unsigned>(nchb * nch), static_cast<unsigned>(B));
  md::scan_forward_kernel<<<grid, threads, 0, st>>>(
      static_cast<const S*>(sv.xz), static_cast<const S*>(c), static_cast<const S*>(delta),
      static_cast<const S*>(sv.xdbl), w.a_log, w.d, T, Di, Ns, R, L, cpb,
      static_cast<const float*>(sv.states), gated, static_cast<const float*>(nullptr),
      static_cast<S*>(nullptr), pk);
  cuda_executor::check_launch("mamba scan_forward_kernel");
  gpu::matmul(ctx, static_cast<const S*>(gated), w.out_proj, out, N, Di, C, false);
}

template <typename S, typename A>
void backend_kernels<cuda_backend, mamba_shape>::backward(
    const mamba_shape& s, std::size_t L, const weights<S>& w, const S* x, const saved<S>& sv,
    const S* dout, S* dx, const gradients<S>& g, void* workspace, std::size_t workspace_size,
    const cuda_executor& ex) {
  gpu::check_types<S, A>();
  namespace md = gpu::mamba_detail;
  const bool keep = sv.c != nullptr;
  const auto ws = carve(backward_layout<S>(s, L, keep), workspace, workspace_size);
  const std::size_t B = s.batch, T = s.seq, N = B * T, C = s.d_model, Di = s.d_inner;
  const std::size_t Ns = s.d_state, R = s.dt_rank, K = s.d_conv, ldx = R + 2 * Ns;
  gpu::detail::need_extent(N, static_cast<std::size_t>(std::numeric_limits<int>::max()), "shape.batch·shape.seq");
  gpu::detail::need_extent(B, 65535, "shape.batch");
  gpu::detail::need_extent(gpu::mamba_blocks(N, gpu::mamba_conv_rows), 65535,
                           "shape.batch·shape.seq / 256 (the conv gradient's row blocks)");
  gpu::detail::need_extent(
      gpu::mamba_blocks(Di, gpu::mamba_channels_per_block(Ns)) * gpu::mamba_chunks(T, L),
      static_cast<std::size_t>(std::numeric_limits<int>::max()),
      "the scan's blocks per batch row (channel blocks · ceil(seq / chunk))");
  const gpu::gemm_context ctx(ex, gpu::shared_gemm_cache(), ws.template get<std::byte>(b_gemm),
                              gpu::gemm_workspace_bytes_max);
  cudaStream_t st = ex.stream();
  const S* xz = sv.xz;
  const S* xdbl = sv.xdbl;
  S* const u = ws.template get<S>(b_u);
  const packed_sequences pk = gpu::stage_packing(ex, s.packing(), ws.template get<std::int32_t>(b_offsets));

  // Phase 0: c and Δ as stored, or recomputed exactly as forward did; u = SiLU(c) for x_proj.
  S* c;
  S* delta;
  if (keep) {
    c = sv.c;
    delta = sv.delta;
    md::conv_silu_kernel<<<md::grid_for(N * Di), 256, 0, st>>>(xz, w.conv_w, w.conv_b, c, u, N, T,
                                                               Di, K, false, pk);
    cuda_executor::check_launch("mamba conv_silu_kernel");
  } else {
    c = ws.template get<S>(b_c);
    delta = ws.template get<S>(b_delta);
    float* dt = ws.template get<float>(b_dt);
    md::conv_silu_kernel<<<md::grid_for(N * Di), 256, 0, st>>>(xz, w.conv_w, w.conv_b, c, u, N, T,
                                                               Di, K, true, pk);
    cuda_executor::check_launch("mamba conv_silu_kernel");
    gpu::matmul(ctx, xdbl, w.dt_proj, dt, N, R, Di, false, ld3{ldx, Di, Di});
    md::delta_kernel<<<md::grid_for(N * Di), 256, 0, st>>>(static_cast<const float*>(dt),
                                                           w.dt_bias, delta, N, Di);
    cuda_executor::check_launch("mamba delta_kernel");
  }
  float* const dg = ws.template get<float>(b_dg);
  gpu::matmul_bt(ctx, dout, w.out_proj, dg, N, C, Di, false);

  // Phase 1: y once more, with g = y ⊙ SiLU(z) and dz = dg·y·SiLU'(z) fused, every chunk in
  // parallel from the saved entry states (the forward's phase C alone: its bits); out_proj's
  // gradient.
  const std::size_t cpb = gpu::mamba_channels_per_block(Ns);
  S* const gated = ws.template get<S>(b_g);
  S* const dxz = ws.template get<S>(b_dxz);
  {
    const dim3 grid(static_cast<unsigned>(gpu::mamba_blocks(Di, cpb) * gpu::mamba_chunks(T, L)),
                    static_cast<unsigned>(B));
    md::scan_forward_kernel<<<grid, static_cast<unsigned>(cpb * Ns), 0, st>>>(
        xz, static_cast<const S*>(c), static_cast<const S*>(delta), xdbl, w.a_log, w.d, T, Di, Ns,
        R, L, cpb, static_cast<const float*>(sv.states), gated, static_cast<const float*>(dg),
        dxz, pk);
    cuda_executor::check_launch("mamba scan_forward_kernel");
  }
  gpu::matmul_at(ctx, static_cast<const S*>(gated), dout, g.out_proj, N, Di, C, true);

  // Phase 2: the reverse scan over chunks in parallel: A' (each chunk's own dL/dh from 0 into the
  // carry buffer, ΣΔ), B' (the carry over chunks, right to left, in place), C' (every chunk from
  // its carried dL/dh on its states recomputed in registers).
  const std::size_t nblk = gpu::mamba_blocks(Di, gpu::mamba_scan_channels);
  const std::size_t nch = gpu::mamba_chunks(T, L);
  float* const part = ws.template get<float>(b_part);
  float* const small = ws.template get<float>(b_small);
  float* const du = ws.template get<float>(b_du);
  S* const ddt = ws.template get<S>(b_ddt);
  float* const carry = ws.template get<float>(b_carry);
  if (nch > 1) {
    float* const dsum = ws.template get<float>(b_dsum);
    const dim3 grid_a(static_cast<unsigned>(gpu::mamba_blocks(Di, cpb) * (nch - 1)),
                      static_cast<unsigned>(B));
    md::scan_backward_local_kernel<<<grid_a, static_cast<unsigned>(cpb * Ns), 0, st>>>(
        xz, static_cast<const S*>(delta), xdbl, w.a_log, static_cast<const float*>(dg), T, Di, Ns,
        R, L, cpb, carry, dsum, pk);
    cuda_executor::check_launch("mamba scan_backward_local_kernel");
    if (nch > 2) {
      md::scan_backward_combine_kernel<<<md::grid_for(B * Di * Ns), 256, 0, st>>>(
          w.a_log, static_cast<const float*>(dsum), carry, B, nch, Di, Ns);
      cuda_executor::check_launch("mamba scan_backward_combine_kernel");
    }
  }
  {
    const dim3 grid(static_cast<unsigned>(nblk * nch), static_cast<unsigned>(B));
    md::scan_backward_kernel<<<grid, static_cast<unsigned>(cpb * Ns), 0, st>>>(
        xz, static_cast<const S*>(c), static_cast<const S*>(delta), xdbl, w.a_log, w.d,
        static_cast<const float*>(sv.states), carry, static_cast<const float*>(dg), T, Di, Ns, R,
        L, cpb, ddt, du, part, small, pk);
    cuda_executor::check_launch("mamba scan_backward_kernel");
  }

  // Phase 3: dB, dC and the small gradients in fixed order; dt_proj's gradient and dx_dbl's dt part.
  S* const dxdbl = ws.template get<S>(b_dxdbl);
  md::reduce_bc_kernel<<<md::grid_for(N * 2 * Ns), 256, 0, st>>>(static_cast<const float*>(part),
                                                                 dxdbl, N, Ns, R, nblk);
  cuda_executor::check_launch("mamba reduce_bc_kernel");
  md::reduce_small_kernel<<<md::grid_for(Di * (Ns + 2)), 256, 0, st>>>(
      static_cast<const float*>(carry), static_cast<const float*>(small), w.a_log, g.a_log, g.d,
      g.dt_bias, B * nch, Di, Ns);
  cuda_executor::check_launch("mamba reduce_small_kernel");
  gpu::matmul_at(ctx, xdbl, static_cast<const S*>(ddt), g.dt_proj, N, R, Di, true,
                 ld3{ldx, Di, Di});
  gpu::matmul_bt(ctx, static_cast<const S*>(ddt), w.dt_proj, dxdbl, N, Di, R, false,
                 ld3{Di, Di, ldx});
  gpu::matmul_at(ctx, static_cast<const S*>(u), static_cast<const S*>(dxdbl), g.x_proj, N, Di, ldx,
                 true);

  // Phase 4: du += dx_dbl·x_projᵀ; the conv's backward (dc = du ⊙ SiLU'(c) on the fly).
  gpu::matmul_bt(ctx, static_cast<const S*>(dxdbl), w.x_proj, du, N, ldx, Di, true);
  md::conv_backward_data_kernel<<<md::grid_for(N * Di), 256, 0, st>>>(
      static_cast<const float*>(du), static_cast<const S*>(c), w.conv_w, dxz, N, T, Di, K, pk);
  cuda_executor::check_launch("mamba conv_backward_data_kernel");
  const std::size_t nrb = gpu::mamba_blocks(N, gpu::mamba_conv_rows);
  float* const cpart = ws.template get<float>(b_cpart);
  {
    const dim3 grid(static_cast<unsigned>(gpu::mamba_blocks(Di, 128)), static_cast<unsigned>(nrb));
    md::conv_backward_weight_kernel<<<grid, 128, 0, st>>>(static_cast<const float*>(du),
                                                          static_cast<const S*>(c), xz, cpart, N,
                                                          T, Di, K, pk);
    cuda_executor::check_launch("mamba conv_backward_weight_kernel");
  }
  md::conv_reduce_kernel<<<md::grid_for(Di * (K + 1)), 256, 0, st>>>(
      static_cast<const float*>(cpart), g.conv_w, g.conv_b, nrb, Di, K);
  cuda_executor::check_launch("mamba conv_reduce_kernel");

  // Phase 5: in_proj's gradient and dx = dxz·in_projᵀ (one GEMM, rounded once).
  gpu::matmul_at(ctx, x, static_cast<const S*>(dxz), g.in_proj, N, C, 2 * Di, true);
  gpu::matmul_bt(ctx, static_cast<const S*>(dxz), w.in_proj, dx, N, 2 * Di, C, false);
}

template <typename S, typename A>
void backend_kernels<cuda_backend, mamba_shape>::step(const mamba_shape& s, const weights<S>& w,
                                                      float* state, const S* x_t, S* out_t,
                                                      void* workspace, std::size_t workspace_size,
                                                      const cuda_executor& ex) {
  gpu::check_types<S, A>();
  namespace md = gpu::mamba_detail;
  const auto ws = carve(step_layout<S>(s), workspace, workspace_size);
  const std::size_t B = s.batch, C = s.d_model, Di = s.d_inner, K = s.d_conv;
  const std::size_t Ns = s.d_state, R = s.dt_rank, ldx = R + 2 * Ns;
  const gpu::gemm_context ctx(ex, gpu::shared_gemm_cache(), ws.template get<std::byte>(st_gemm),
                              gpu::gemm_workspace_bytes_max);
  cudaStream_t st = ex.stream();
  S* const xz = ws.template get<S>(st_xz);
  S* const us = ws.template get<S>(st_us);
  float* const uf = ws.template get<float>(st_uf);
  S* const xdbl = ws.template get<S>(st_xdbl);
  float* const dt = ws.template get<float>(st_dt);
  S* const gated = ws.template get<S>(st_g);
  float* const window = state;                 // [B, Di, K − 1]
  float* const ssm = state + B * Di * (K - 1);  // [B, Di, Ns]

  gpu::matmul(ctx, x_t, w.in_proj, xz, B, C, 2 * Di, false);
  md::step_conv_kernel<<<md::grid_for(B * Di), 256, 0, st>>>(static_cast<const S*>(xz), w.conv_w,
                                                             w.conv_b, window, us, uf, B, Di, K);
  cuda_executor::check_launch("mamba step_conv_kernel");
  gpu::matmul(ctx, static_cast<const S*>(us), w.x_proj, xdbl, B, Di, ldx, false);
  gpu::matmul(ctx, static_cast<const S*>(xdbl), w.dt_proj, dt, B, R, Di, false,
              ld3{ldx, Di, Di});
  md::step_scan_kernel<<<md::grid_for(B * Di), 256, 0, st>>>(
      static_cast<const S*>(xz), static_cast<const float*>(uf), static_cast<const float*>(dt),
      static_cast<const S*>(xdbl), w.a_log, w.dt_bias, w.d, ssm, gated, B, Di, Ns, R);
  cuda_executor::check_launch("mamba step_scan_kernel");
  gpu::matmul(ctx, static_cast<const S*>(gated), w.out_proj, out_t, B, Di, C, false);
}

#endif  // MEMBOUND_CUDA_COMPILER

MEMBOUND_NAMESPACE_END
