// The mixture-of-experts feed-forward on the GPU: the kernels that moe_mlp<..., cuda_backend> runs.
// The CPU backend (backend/cpu/moe.hpp) is the specification, step for step:
//   router    logits = x·Wr (cuBLASLt, fp32), then one thread per token: softmax, top-k, gates;
//   dispatch  one thread per expert walks the choices in priority order (every first choice
//             before any second, tokens in order) and keeps the first `capacity`; the offsets
//             summed in order; the kept choices' rows;
//   experts   the kept rows gathered by expert into one buffer of moe_rows(shape) rows, then per
//             expert its SwiGLU as cuBLASLt GEMMs over exactly its rows (a grouped GEMM as E
//             launches: the row counts come to the host, a copy of E + 1 ints, and the statistics'
//             32 bytes when asked for, then one wait for the stream per call, as grouped-GEMM MoE
//             codes read their batch sizes);
//   combine   y = Σ_j g_j·Y[row(t, j)], one thread per (token, column), j in order.
// Backward recomputes the gathers, never keeps Y, and runs the CPU's order: the gates' gradient
// dg = (dy·Wdᵀ)·act, the SwiGLU backward, the experts' weight gradients, dx scattered back, the
// router's backward with the balancing loss's term. Forward's statistics (the balancing loss, the
// drops) are computed on the device and copied back when asked for.
//
// Precision: storage S (float, bf16, fp16), fp32 in every GEMM's accumulator and every kernel.
// As in backend/cuda/mlp.cuh, values that feed a GEMM (the gathered rows, act, dact, da, db, the
// gated dy and the router's logit gradient) are rounded to S, where the CPU keeps them in fp32:
// the same arithmetic for fp32, one more rounding each for bf16/fp16 (the tests bound it).
//
// Memory: every buffer holds moe_rows(shape) rows whatever the routing, as on the CPU, so the
// sizes are exact for the worst router. The host copy of the expert offsets is a vector of E + 1
// ints (the one host allocation of a call).
//
// Costs not yet measured (no GPU run): the two waits per block and step; the dispatch and the
// statistics run on E threads and one thread (O(N·k) and O(N·E) each); the gates' backward is a
// thread per row (uncoalesced along F); and each expert's GEMMs take the expert's row count, which
// changes with the routing, so the GEMM plan cache (keyed by shape) keeps adding plans, up to the
// capacity's distinct counts per product.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "membound/backend/cuda/cuda_backend.cuh"
#include "membound/backend/cuda/cuda_check.cuh"
#include "membound/backend/cuda/gemm.cuh"
#include "membound/backend/cuda/model.cuh"
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/memory/workspace.hpp"
#include "membound/policy/backend.hpp"
#include "membound/shape/moe_shape.hpp"

MEMBOUND_NAMESPACE_BEGIN

template <>
struct backend_kernels<cuda_backend, moe_shape> {
  // A and `threads` are the host backend's: the device computes in fp32 and sizes nothing per
  // host thread.
  template <typename S, typename A>
  static constexpr std::size_t forward_workspace_bytes(const moe_shape& s, std::size_t /*threads*/) noexcept {
    return fits(s) ? forward_layout<S>(s).size() : std::numeric_limits<std::size_t>::max();
  }
  template <typename S, typename A>
  static constexpr std::size_t backward_workspace_bytes(const moe_shape& s, std::size_t /*threads*/) noexcept {
    return fits(s) ? backward_layout<S>(s).size() : std::numeric_limits<std::size_t>::max();
  }

  // The routing forward keeps (shape/moe_shape.hpp), in device memory.
  template <typename A>
  using routing = moe_routing<A>;

#if MEMBOUND_CUDA_COMPILER
  // a_s, b_s: the experts' pre-activations [moe_rows, F], written here.
  template <typename S, typename A>
  static void forward(const moe_shape& s, const S* wr, const S* wg, const S* wu, const S* wd, const S* x, S* y,
                      routing<A> r, S* a_s, S* b_s, void* workspace, std::size_t workspace_size,
                      const cuda_executor& ex, moe_stats* stats);
  // dx overwritten; the weight gradients added (+=) to gwr, gwg, gwu, gwd.
  template <typename S, typename A>
  static void backward(const moe_shape& s, const S* wr, const S* wg, const S* wu, const S* wd, const S* x,
                       routing<A> r, const S* a_s, const S* b_s, const S* dy, S* dx, S* gwr, S* gwg, S* gwu,
                       S* gwd, void* workspace, std::size_t workspace_size, const cuda_executor& ex);
#else
  template <typename S, typename A, typename... Args>
  static void forward(Args&&...) {
    static_assert(dependent_false<S, A>,
                  "membound: moe_mlp<..., cuda_backend>::forward launches CUDA kernels; compile this "
                  "translation unit with nvcc (a .cu file, or LANGUAGE CUDA in CMake).");
  }
  template <typename S, typename A, typename... Args>
  static void backward(Args&&...) {
    static_assert(dependent_false<S, A>,
                  "membound: moe_mlp<..., cuda_backend>::backward launches CUDA kernels; compile "
                  "this translation unit with nvcc (a .cu file, or LANGUAGE CUDA in CMake).");
  }
#endif

 private:
  // The forward's statistics as the device writes them (moe_kernels.inl's moe_device_stats: a
  // double and three int64).
  static constexpr std::size_t stats_bytes = 32;
  static constexpr bool renormalized(const moe_shape& s) noexcept { return s.renormalize && s.top_k > 1; }
  static constexpr bool fits(const moe_shape& s) noexcept {
    const std::size_t b[] = {bytes_of<float>(moe_rows(s), s.width), bytes_of<float>(moe_rows(s), s.hidden),
                             bytes_of<float>(s.tokens(), s.width), bytes_of<float>(s.tokens(), s.experts),
                             bytes_of<std::int32_t>(s.experts + 1)};
    return detail::fits_layout(b);
  }

  // cuBLASLt's workspace first (256-byte aligned); nothing shares bytes (flat slots keep the proof
  // of "exact" simple). Forward: named [E] (int32), the statistics (32 bytes), the gathered rows
  // xg [R, C] (S), act [R, F] (S), the experts' outputs yg [R, C] (fp32), R = moe_rows.
  enum forward_slot : std::size_t { f_gemm, f_named, f_stats, f_xg, f_act, f_yg };
  template <typename S>
  static constexpr workspace_layout<6> forward_layout(const moe_shape& s) {
    const std::size_t R = moe_rows(s);
    workspace_layout<6> l;
    l.add(gpu::gemm_workspace_bytes_max, gpu::gemm_workspace_alignment);
    l.add(bytes_of<std::int32_t>(s.experts));
    l.add(stats_bytes);
    l.add(bytes_of<S>(R, s.width));
    l.add(bytes_of<S>(R, s.hidden));
    l.add(bytes_of<float>(R, s.width));
    return l;
  }
  // Backward: xg, dyg [R, C] (S; dyg gated in place); act, dact (then da in place), db [R, F] (S);
  // u = dy·Wdᵀ [R, F] (fp32); dxg [R, C] (fp32); src [R] (int32); dg [N, k] (fp32); named [E];
  // dl [N, E] (fp32) and its S copy (bf16/fp16); dx [N, C] in fp32 (bf16/fp16).
  enum backward_slot : std::size_t {
    b_gemm, b_xg, b_dyg, b_act, b_dact, b_db, b_u, b_dxg, b_src, b_dg, b_named, b_dl, b_dls, b_dx
  };
  template <typename S>
  static constexpr workspace_layout<14> backward_layout(const moe_shape& s) {
    constexpr bool narrow = !std::is_same_v<S, float>;
    const std::size_t R = moe_rows(s), N = s.tokens(), C = s.width, F = s.hidden, E = s.experts;
    workspace_layout<14> l;
    l.add(gpu::gemm_workspace_bytes_max, gpu::gemm_workspace_alignment);
    l.add(bytes_of<S>(R, C));
    l.add(bytes_of<S>(R, C));
    l.add(bytes_of<S>(R, F));
    l.add(bytes_of<S>(R, F));
    l.add(bytes_of<S>(R, F));
    l.add(bytes_of<float>(R, F));
    l.add(bytes_of<float>(R, C));
    l.add(bytes_of<std::int32_t>(R));
    l.add(bytes_of<float>(N, s.top_k));
    l.add(bytes_of<std::int32_t>(E));
    l.add(bytes_of<float>(N, E));
    l.add(narrow ? bytes_of<S>(N, E) : 0);
    l.add(narrow ? bytes_of<float>(N, C) : 0);
    return l;
  }

#if MEMBOUND_CUDA_COMPILER
  // f(e, first row, rows) for every expert with rows, in order (off: the host's offsets).
  template <typename F>
  static void each_expert(const std::vector<std::int32_t>& off, F&& f) {
    for (std::size_t e = 0; e + 1 < off.size(); ++e) {
      const std::size_t r0 = static_cast<std::size_t>(off[e]), n = static_cast<std::size_t>(off[e + 1]) - r0;
      if (n != 0) f(e, r0, n);
    }
  }
  // The expert offsets on the host (E + 1 ints): the grouped GEMMs' row counts. Waits for the stream.
  static std::vector<std::int32_t> host_offsets(const std::int32_t* off, std::size_t E, const cuda_executor& ex) {
    std::vector<std::int32_t> h(E + 1);
    cuda_check(cudaMemcpyAsync(h.data(), off, (E + 1) * sizeof(std::int32_t), cudaMemcpyDeviceToHost, ex.stream()),
               "cudaMemcpyAsync (the experts' offsets)");
    ex.synchronize();
    return h;
  }
#endif
};

#if MEMBOUND_CUDA_COMPILER

namespace gpu {
namespace moe_detail {

using gpu::detail::ld;
using gpu::detail::st;

#include "membound/backend/cuda/moe_kernels.inl"

inline unsigned grid_for(std::size_t n) { return gpu::detail::grid_for(n == 0 ? 1 : n, 256); }
static_assert(sizeof(moe_device_stats) == 32, "membound: the statistics' slot (stats_bytes) holds moe_device_stats");

}  // namespace moe_detail
}  // namespace gpu

template <typename S, typename A>
void backend_kernels<cuda_backend, moe_shape>::forward(const moe_shape& s, const S* wr, const S* wg, const S* wu,
                                                       const S* wd, const S* x, S* y, routing<A> r, S* a_s, S* b_s,
                                                       void* workspace, std::size_t workspace_size,
                                                       const cuda_executor& ex, moe_stats* stats) {
  gpu::check_types<S, A>();
  namespace md = gpu::moe_detail;
  const auto ws = carve(forward_layout<S>(s), workspace, workspace_size);
  const std::size_t N = s.tokens(), C = s.width, F = s.hidden, E = s.experts, k = s.top_k;
  const gpu::gemm_context ctx(ex, gpu::shared_gemm_cache(), ws.template get<std::byte>(f_gemm),
                              gpu::gemm_workspace_bytes_max);
  const cudaStream_t st = ex.stream();
  std::int32_t* named = ws.template get<std::int32_t>(f_named);

  // Router and dispatch.
  gpu::matmul(ctx, x, wr, r.p, N, C, E, false);
  md::moe_route_kernel<><<<md::grid_for(N), 256, 0, st>>>(r.p, r.choice, r.g, N, E, k, renormalized(s));
  cuda_executor::check_launch("moe_route_kernel");
  md::moe_dispatch_kernel<><<<md::grid_for(E), 256, 0, st>>>(r.choice, r.row, r.off, named, N, E, k, moe_capacity(s));
  cuda_executor::check_launch("moe_dispatch_kernel");
  md::moe_offsets_kernel<><<<1, 1, 0, st>>>(r.off, E);
  cuda_executor::check_launch("moe_offsets_kernel");
  md::moe_rows_kernel<><<<md::grid_for(N * k), 256, 0, st>>>(r.choice, r.row, r.off, N * k);
  cuda_executor::check_launch("moe_rows_kernel");
  md::moe_device_stats h{};
  if (stats != nullptr) {
    auto* dstats = ws.template get<md::moe_device_stats>(f_stats);
    md::moe_stats_kernel<><<<1, 1, 0, st>>>(r.p, named, r.row, r.off, N, E, k, s.aux_loss_weight, dstats);
    cuda_executor::check_launch("moe_stats_kernel");
    cuda_check(cudaMemcpyAsync(&h, dstats, sizeof h, cudaMemcpyDeviceToHost, st), "cudaMemcpyAsync (the MoE statistics)");
  }
  const std::vector<std::int32_t> off = host_offsets(r.off, E, ex);  // waits for the stream: h too
  if (stats != nullptr) {
    *stats = {h.aux, N * k, static_cast<std::size_t>(h.dropped), N, static_cast<std::size_t>(h.tokens_dropped),
              static_cast<std::size_t>(h.max_rows)};
  }

  // The experts over their rows: a, b (into saved), one SwiGLU over every kept row, then Y.
  const std::size_t kept = static_cast<std::size_t>(off[E]);
  S* xg = ws.template get<S>(f_xg);
  S* act = ws.template get<S>(f_act);
  float* yg = ws.template get<float>(f_yg);
  md::moe_gather_kernel<S><<<md::grid_for(N * k * C), 256, 0, st>>>(x, r.row, xg, N * k, k, C);
  cuda_executor::check_launch("moe_gather_kernel");
  each_expert(off, [&](std::size_t e, std::size_t r0, std::size_t n) {
    gpu::matmul(ctx, static_cast<const S*>(xg + r0 * C), wg + e * C * F, a_s + r0 * F, n, C, F, false);
    gpu::matmul(ctx, static_cast<const S*>(xg + r0 * C), wu + e * C * F, b_s + r0 * F, n, C, F, false);
  });
  gpu::swiglu_forward(ex, static_cast<const S*>(a_s), static_cast<const S*>(b_s), act, kept * F);
  each_expert(off, [&](std::size_t e, std::size_t r0, std::size_t n) {
    gpu::matmul(ctx, static_cast<const S*>(act + r0 * F), wd + e * F * C, yg + r0 * C, n, F, C, false);
  });
  md::moe_combine_kernel<S><<<md::grid_for(N * C), 256, 0, st>>>(yg, r.row, r.g, y, N, k, C);
  cuda_executor::check_launch("moe_combine_kernel");
}

template <typename S, typename A>
void backend_kernels<cuda_backend, moe_shape>::backward(const moe_shape& s, const S* wr, const S* wg, const S* wu,
                                                        const S* wd, const S* x, routing<A> r, const S* a_s,
                                                        const S* b_s, const S* dy, S* dx, S* gwr, S* gwg,
                                                        S* gwu, S* gwd, void* workspace,
                                                        std::size_t workspace_size, const cuda_executor& ex) {
  gpu::check_types<S, A>();
  namespace md = gpu::moe_detail;
  const auto ws = carve(backward_layout<S>(s), workspace, workspace_size);
  const std::size_t N = s.tokens(), C = s.width, F = s.hidden, E = s.experts, k = s.top_k;
  const gpu::gemm_context ctx(ex, gpu::shared_gemm_cache(), ws.template get<std::byte>(b_gemm),
                              gpu::gemm_workspace_bytes_max);
  const cudaStream_t st = ex.stream();
  const std::vector<std::int32_t> off = host_offsets(r.off, E, ex);
  const std::size_t kept = static_cast<std::size_t>(off[E]);

  S* xg = ws.template get<S>(b_xg);
  S* dyg = ws.template get<S>(b_dyg);
  S* act = ws.template get<S>(b_act);
  S* dact = ws.template get<S>(b_dact);  // dact, then da in place
  S* db = ws.template get<S>(b_db);
  float* u = ws.template get<float>(b_u);
  float* dxg = ws.template get<float>(b_dxg);
  std::int32_t* src = ws.template get<std::int32_t>(b_src);
  float* dg = ws.template get<float>(b_dg);
  std::int32_t* named = ws.template get<std::int32_t>(b_named);
  float* dl = ws.template get<float>(b_dl);
  md::moe_gather_kernel<S><<<md::grid_for(N * k * C), 256, 0, st>>>(x, r.row, xg, N * k, k, C);
  cuda_executor::check_launch("moe_gather_kernel");
  md::moe_gather_kernel<S><<<md::grid_for(N * k * C), 256, 0, st>>>(dy, r.row, dyg, N * k, k, C);
  cuda_executor::check_launch("moe_gather_kernel");
  md::moe_sources_kernel<><<<md::grid_for(N * k), 256, 0, st>>>(r.row, src, N * k);
  cuda_executor::check_launch("moe_sources_kernel");
  cuda_check(cudaMemsetAsync(dg, 0, N * k * sizeof(float), st), "cudaMemsetAsync (dg)");  // dropped: 0
  gpu::swiglu_forward(ex, a_s, b_s, act, kept * F);

  // u = dy·Wdᵀ per expert (ungated), then the gates' gradient, dact and the gated dy.
  each_expert(off, [&](std::size_t e, std::size_t r0, std::size_t n) {
    gpu::matmul_bt(ctx, static_cast<const S*>(dyg + r0 * C), wd + e * F * C, u + r0 * F, n, C, F, false);
  });
  md::moe_gate_backward_kernel<S><<<md::grid_for(kept), 256, 0, st>>>(u, act, src, r.g, dg, dact, dyg, kept, F, C);
  cuda_executor::check_launch("moe_gate_backward_kernel");
  gpu::swiglu_backward(ex, a_s, b_s, static_cast<const S*>(dact), dact, db, kept * F);
  const S* da = dact;
  each_expert(off, [&](std::size_t e, std::size_t r0, std::size_t n) {
    gpu::matmul_at(ctx, static_cast<const S*>(act + r0 * F), static_cast<const S*>(dyg + r0 * C), gwd + e * F * C,
                   n, F, C, true);
    gpu::matmul_at(ctx, static_cast<const S*>(xg + r0 * C), da + r0 * F, gwg + e * C * F, n, C, F, true);
    gpu::matmul_at(ctx, static_cast<const S*>(xg + r0 * C), static_cast<const S*>(db + r0 * F), gwu + e * C * F,
                   n, C, F, true);
    gpu::matmul_bt(ctx, da + r0 * F, wg + e * C * F, dxg + r0 * C, n, F, C, false);
    gpu::matmul_bt(ctx, static_cast<const S*>(db + r0 * F), wu + e * C * F, dxg + r0 * C, n, F, C, true);
  });

  // dx: the experts' rows back to their tokens, then the router's term dl·Wrᵀ.
  float* dxf;
  if constexpr (std::is_same_v<S, float>) {
    dxf = dx;
  } else {
    dxf = ws.template get<float>(b_dx);
  }
  md::moe_scatter_back_kernel<><<<md::grid_for(N * C), 256, 0, st>>>(dxg, r.row, dxf, N, k, C);
  cuda_executor::check_launch("moe_scatter_back_kernel");
  // The balancing loss's count per expert, as the forward's dispatch counted it.
  md::moe_count_kernel<><<<md::grid_for(E), 256, 0, st>>>(r.choice, named, N * k, E);
  cuda_executor::check_launch("moe_count_kernel");
  const float aux_scale = static_cast<float>(s.aux_loss_weight * static_cast<double>(E) /
                                             (static_cast<double>(N) * static_cast<double>(N)));
  md::moe_router_backward_kernel<><<<md::grid_for(N), 256, 0, st>>>(r.p, r.choice, r.g, dg, named, aux_scale, dl, N,
                                                                   E, k, renormalized(s));
  cuda_executor::check_launch("moe_router_backward_kernel");
  const S* dls;
  if constexpr (std::is_same_v<S, float>) {
    dls = dl;
  } else {
    S* c = ws.template get<S>(b_dls);
    gpu::convert(ex, static_cast<const float*>(dl), c, N * E);
    dls = c;
  }
  gpu::matmul_at(ctx, x, dls, gwr, N, C, E, true);
  gpu::matmul_bt(ctx, dls, wr, dxf, N, E, C, true);
  if constexpr (!std::is_same_v<S, float>) gpu::convert(ex, static_cast<const float*>(dxf), dx, N * C);
}

#endif  // MEMBOUND_CUDA_COMPILER

MEMBOUND_NAMESPACE_END
