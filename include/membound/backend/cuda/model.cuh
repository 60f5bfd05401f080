// The model's non-GEMM pieces on the GPU: the device twins of backend/cpu/model.hpp plus the
// trainer's optimizer steps (adamw<S>, adamw8bit<S, Block>), gradient norm and non-finite check.
//
//   cuda_executor ex;
//   gpu::rmsnorm_forward(ex, x, g, y, rstd, N, C, eps);
//   gpu::rmsnorm_backward(ex, x, g, rstd, dy, nullptr, dx, dg, ws,
//                          gpu::rmsnorm_backward_workspace_bytes(N, C), N, C);
//   gpu::global_norm(ex, grads, n, norm_dev, ws, gpu::global_norm_workspace_bytes(n));
//   gpu::adamw_update(ex, w, grads, state, state_bytes, n, segments, t, lr, cfg, 1.0, {norm_dev, 1.0});
//   gpu::adamw8bit_update<S, 2048>(ex, w, grads, state, state_bytes, n, spans, step);
//
// Storage S is float, bf16 or fp16; everything is computed and accumulated in float (the loss and
// the gradient norm in double), as the CPU backend does with fp32 accumulation. Arguments are
// checked on the host before any launch (typed invalid_argument); kernels go on the executor's
// stream and nothing synchronizes. Every reduction has a fixed shape that depends only on the
// sizes (never on the device or on timing; below sm_80, a GPU granting under 99 KiB of shared
// memory takes RMSNorm's wide backward kernel for C from 2049 to 3072) and no float atomics, so
// repeated runs give the same bits. Device results differ from the CPU's in the last bits only:
// sums run in another order, nvcc contracts a·b + c into FMAs, and the device's expf/logf are not
// the host's.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <concepts>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "membound/backend/cuda/cuda_backend.cuh"
#include "membound/backend/cuda/storage.cuh"
#include "membound/core/checked_math.hpp"
#include "membound/core/argument_checks.hpp"
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/core/element_math.hpp"
#include "membound/core/error.hpp"
#include "membound/optimizer/adamw.hpp"
#include "membound/optimizer/adamw8bit.hpp"
#include "membound/optimizer/optimizer_policy.hpp"
#include "membound/shape/lm_head_shape.hpp"
#include "membound/shape/offload_chunks.hpp"

#if MEMBOUND_CUDA_COMPILER
#include <cub/block/block_reduce.cuh>
#include <cuda_fp16.h>
#endif

MEMBOUND_NAMESPACE_BEGIN

namespace gpu {

// The storage types the kernels take (fp64 stays on the CPU backend).
template <typename S>
concept kernel_storage = std::same_as<S, float> || std::same_as<S, bf16> || std::same_as<S, fp16>;

// Every device layer and the model's glue check their types with this: one sentence for all.
// (The instantiation trace names the layer.)
template <typename S, typename A>
constexpr void check_types() {
  static_assert(kernel_storage<S>,
                "membound: cuda_backend stores float, bf16 or fp16; pick fp32_precision, bf16_precision "
                "or fp16_precision for a layer or model on the GPU.");
  static_assert(std::is_same_v<A, float>,
                "membound: cuda_backend accumulates in fp32 (scan and TTT inner states included); use a "
                "precision whose accum_type is float (fp64 runs on cpu_backend only).");
}

// --- Sizes ---------------------------------------------------------------------------------------

// The kernels' sizes and workspace functions (their text is shared with the host emulation).
#include "membound/backend/cuda/model_sizes.inl"

// A device trainer's step buffers, one allocation: the step's token ids, its target ids, the
// gradient norm's partials and the norm itself, each part at a 256-byte boundary (cudaMalloc's,
// so each is as aligned as an allocation of its own). Offsets and total for steps of `tokens`
// tokens over n parameters; saturated sizes stay saturated.
struct step_buffer_layout {
  std::size_t tokens = 0, targets = 0, partials = 0, norm = 0, bytes = 0;
};
constexpr std::size_t align_to_256(std::size_t x) noexcept { return sat_mul(x / 256 + (x % 256 != 0), 256); }
constexpr step_buffer_layout step_buffers(std::size_t tokens, std::size_t n) noexcept {
  step_buffer_layout l;
  const std::size_t ids = align_to_256(bytes_of<std::int32_t>(tokens));
  l.targets = ids;
  l.partials = sat_add(ids, ids);
  l.norm = sat_add(l.partials, align_to_256(global_norm_workspace_bytes(n)));
  l.bytes = sat_add(l.norm, sizeof(double));
  return l;
}

// Embedding backward: vocabulary rows are split among this many owner threads per column (row v
// belongs to owner v mod G). Enough owners to fill the device when C is small; the result does
// not depend on G, since every (row, column) is still added in token order.
constexpr std::size_t embedding_scatter_owners(std::size_t C) noexcept {
  if (C == 0) return 1;
  const std::size_t g = (std::size_t{1} << 15) / C;
  return g < 1 ? 1 : (g > 64 ? 64 : g);
}

#include "membound/backend/cuda/adamw8bit_sizes.inl"

// --- Host-side argument checks --------------------------------------------------------------------

namespace detail {
// The library's one family (core/argument_checks.hpp), by the names the kernels' callers use.
using membound::detail::need_aligned;
using membound::detail::need_pointer;
using membound::detail::need_space;

// An optimizer setting in [lo, hi] (NaN never is).
inline void need_finite_in(double x, double lo, double hi, const char* name, const char* expected) {
  if (!(x >= lo && x <= hi)) throw invalid_argument(name, expected, std::to_string(x), "Fix the optimizer settings");
}
// One AdamW step's scalars (adamw_update and adamw8bit_update): t from 1, a finite rate, betas in
// [0, 1), a positive eps, a finite decay and gradient scale.
inline void check_adamw_step(std::uint64_t t, double lr, const adamw_config& c, double grad_scale) {
  need_finite_in(lr, 0.0, std::numeric_limits<double>::max(), "lr", "a finite rate, 0 or more");
  need_finite_in(c.beta1, 0.0, std::nextafter(1.0, 0.0), "config.beta1", "in [0, 1)");
  need_finite_in(c.beta2, 0.0, std::nextafter(1.0, 0.0), "config.beta2", "in [0, 1)");
  need_finite_in(c.eps, std::numeric_limits<double>::min(), std::numeric_limits<double>::max(), "config.eps",
                 "a positive finite number");
  need_finite_in(c.weight_decay, 0.0, std::numeric_limits<double>::max(), "config.weight_decay",
                 "0 or more, finite");
  need_finite_in(grad_scale, -std::numeric_limits<double>::max(), std::numeric_limits<double>::max(), "grad_scale",
                 "a finite number");
  if (t == 0) throw invalid_argument("t", "a step counted from 1", "0", "Pass the number of updates done plus one");
}

// Rows index the grid's x dimension and elements are addressed in size_t: keep both in range.
inline void need_extent(std::size_t n, std::size_t max, const char* name) {
  if (n > max) {
    throw invalid_argument(name, "at most " + std::to_string(max), std::to_string(n),
                           "Split the call into smaller pieces");
  }
}

inline void need_matrix(std::size_t N, std::size_t C, const char* rows, const char* cols) {
  need_extent(N, static_cast<std::size_t>(std::numeric_limits<int>::max()), rows);
  if (N != 0 && C == 0) {
    throw invalid_argument(cols, "at least 1", "0", "Every row needs at least one column");
  }
  if (bytes_of<float>(N, C) == std::numeric_limits<std::size_t>::max()) {
    throw invalid_argument(cols, "a size whose rows·columns fit in memory",
                           std::to_string(N) + "·" + std::to_string(C), "Check the shape");
  }
}

// Blocks for a grid-stride loop over n elements.
inline unsigned grid_for(std::size_t n, std::size_t threads) {
  const std::size_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(b < 65536 ? (b == 0 ? 1 : b) : 65536);
}

// Whether every pointer (null counts) is 16-byte aligned: the kernels' 16-byte path (Vec).
template <typename... P>
bool aligned16(const P*... p) {
  return ((reinterpret_cast<std::uintptr_t>(p) % 16 == 0) && ...);
}

// Blocks for a grid-stride loop over the G-element groups of n values.
inline unsigned grid_for_groups(std::size_t n, std::size_t G, std::size_t threads) {
  return grid_for((n + G - 1) / G, threads);
}

// The rows of a row kernel (a warp per row) as CTAs.
inline unsigned row_ctas(std::size_t N) {
  return static_cast<unsigned>((N + row_warps - 1) / row_warps);
}

// How RMSNorm's forward takes a row of C elements (model_kernels.inl): in groups of G when C is a
// whole number of them (16-byte accesses where the buffers are aligned), else element by element
// (on the H200, 2026-11-29, C 4099: 114 us against 200 us in groups). The first two sum in the
// same order; which of groups or elements depends on C alone.
enum class row_path { vectors, groups, elements };
inline row_path row_path_for(std::size_t C, std::size_t G, bool aligned) {
  if (C % G != 0) return row_path::elements;
  return aligned ? row_path::vectors : row_path::groups;
}

}  // namespace detail

#if MEMBOUND_CUDA_COMPILER

// --- Device building blocks -----------------------------------------------------------------------

namespace detail {

// ld and st: backend/cuda/storage.cuh.

struct op_sum {
  template <typename T>
  __device__ T operator()(T a, T b) const { return a + b; }
};
struct op_max {
  template <typename T>
  __device__ T operator()(T a, T b) const { return a > b ? a : b; }
};

// A block-wide reduction whose result every thread gets: CUB's BlockReduce (warp shuffles, then
// the warps in a fixed order) for a block size fixed at compile time, so the same tree on every
// run and device. Launch with exactly Threads threads.
template <typename T, unsigned Threads>
struct block_allreduce {
  using reduce = cub::BlockReduce<T, static_cast<int>(Threads)>;
  struct storage {
    typename reduce::TempStorage temp;
    T result;
  };
  template <typename Op>
  __device__ static T run(T v, Op op, storage& s) {
    const T r = reduce(s.temp).Reduce(v, op);  // valid in thread 0 only
    if (threadIdx.x == 0) s.result = r;
    __syncthreads();
    const T out = s.result;
    __syncthreads();  // the storage may be reused at once
    return out;
  }
};

inline constexpr unsigned row_threads = 256;

// The CTA's dynamic shared memory (rmsnorm_backward_rows_kernel's partials).
__device__ inline unsigned char* model_smem() {
  extern __shared__ __align__(16) unsigned char model_dynamic_smem[];
  return model_dynamic_smem;
}

// --- Kernels -------------------------------------------------------------------------------------

// The bandwidth-bound kernels (their text is shared with the host emulation).
#include "membound/backend/cuda/model_kernels.inl"

// Rows too wide for rmsnorm_backward_rows_kernel's shared partials (C above 3072):
// block b takes rows [32b, 32b + 32), dx row by row, and its own [C] partial of dweight in global
// memory. Each column's partial is read and written by one thread only, so no atomics.
template <typename S>
__global__ void rmsnorm_backward_wide_kernel(const S* x, const S* g, const float* rstd, const S* dy, const S* residual,
                                        S* dx, float* partial, std::size_t N, std::size_t C) {
  using allreduce = block_allreduce<float, row_threads>;
  __shared__ typename allreduce::storage red;
  const std::size_t r0 = blockIdx.x * rmsnorm_rows_per_block;
  const std::size_t r1 = r0 + rmsnorm_rows_per_block < N ? r0 + rmsnorm_rows_per_block : N;
  float* part = partial + blockIdx.x * C;
  for (std::size_t c = threadIdx.x; c < C; c += blockDim.x) part[c] = 0;
  for (std::size_t n = r0; n < r1; ++n) {
    const std::size_t row = n * C;
    const float r = rstd[n];
    float dot = 0;
    for (std::size_t c = threadIdx.x; c < C; c += blockDim.x) {
      const float xv = ld(x, row + c), dv = ld(dy, row + c);
      dot += dv * ld(g, c) * xv;
      part[c] += dv * xv * r;
    }
    dot = allreduce::run(dot, op_sum{}, red);
    const float k = r * r * r * dot / static_cast<float>(C);
    for (std::size_t c = threadIdx.x; c < C; c += blockDim.x) {
      float v = r * ld(dy, row + c) * ld(g, c) - ld(x, row + c) * k;
      if (residual != nullptr) v += ld(residual, row + c);
      st(dx, row + c, v);
    }
  }
}

// dweight[c] += Σ_b partial[b][c], the blocks in order.
template <typename S>
__global__ void rmsnorm_dweight_kernel(const float* partial, S* dg, std::size_t blocks, std::size_t C) {
  for (std::size_t c = blockIdx.x * blockDim.x + threadIdx.x; c < C; c += std::size_t{gridDim.x} * blockDim.x) {
    float s = 0;
    for (std::size_t b = 0; b < blocks; ++b) s += partial[b * C + c];
    st(dg, c, ld(dg, c) + s);
  }
}

// Thread (owner o, column c) walks all tokens in order and adds the rows whose id ≡ o (mod G):
// every dtable element has exactly one writer and sees its tokens in token order, as on the CPU
// (embedding_scatter there walks the tokens in order per column block), so the sums are the
// CPU's to the bit and need no atomics. Cost: each thread reads all N ids (broadcast in a warp).
template <typename S>
__global__ void embedding_scatter_kernel(const std::int32_t* tokens, const S* dx, S* dtable, std::size_t N,
                                         std::size_t C, std::size_t V, std::size_t owners, unsigned* bad) {
  const std::size_t id = std::size_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (id >= owners * C) return;
  const std::size_t c = id % C, o = id / C;
  for (std::size_t n = 0; n < N; ++n) {
    const std::int32_t t = tokens[n];
    if (t < 0 || static_cast<std::size_t>(t) >= V) {
      if (bad != nullptr && id == 0) *bad = 1;
      continue;
    }
    if (static_cast<std::size_t>(t) % owners != o) continue;
    const std::size_t at = static_cast<std::size_t>(t) * C + c;
    st(dtable, at, ld(dtable, at) + ld(dx, n * C + c));
  }
}

// *total += Σ row_loss in row order (one thread: the CPU's order, so the same double).
template <int = 0>
__global__ void row_sum_kernel(const double* row_loss, std::size_t R, double* total) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  double s = 0;
  for (std::size_t r = 0; r < R; ++r) s += row_loss[r];
  *total += s;
}

// Root: the norm (sqrt of the sum); else the sum of squares itself (a shard's part of a norm
// over ranks, added to the others' on the host).
template <bool Root = true>
__global__ void norm_final_kernel(const double* partial, std::size_t blocks, double* norm) {
  using allreduce = block_allreduce<double, 1024>;
  __shared__ typename allreduce::storage red;
  double s = 0;
  for (std::size_t b = threadIdx.x; b < blocks; b += blockDim.x) s += partial[b];
  s = allreduce::run(s, op_sum{}, red);
  if (threadIdx.x == 0) *norm = Root ? sqrt(s) : s;
}

// --- adamw8bit<S, Block>'s step (the CPU optimizer's, optimizer/adamw8bit.hpp, byte for byte in
// state layout): one CTA per quantization block (its text is shared with the host emulation).
#include "membound/backend/cuda/adamw8bit_kernels.inl"

}  // namespace detail

// --- Launchers -------------------------------------------------------------------------------------

namespace detail {
// rmsnorm_rows_kernel over N rows on the path row_path_for picks (forward, or apply with !compute).
template <typename S>
void launch_rmsnorm_rows(const cuda_executor& ex, const S* x, const S* g, S* y, float* rstd, std::size_t N,
                         std::size_t C, float eps, bool compute) {
  constexpr unsigned G = group_of<S>;
  const auto rows = [&](auto kernel) {
    kernel<<<row_ctas(N), row_cta_threads, 0, ex.stream()>>>(x, g, y, rstd, N, C, eps, compute);
  };
  switch (row_path_for(C, G, aligned16(x, g, y))) {
    case row_path::vectors: rows(rmsnorm_rows_kernel<G, true, S>); break;
    case row_path::groups: rows(rmsnorm_rows_kernel<G, false, S>); break;
    case row_path::elements: rows(rmsnorm_rows_kernel<1, false, S>); break;
  }
  cuda_executor::check_launch(compute ? "rmsnorm_rows_kernel" : "rmsnorm_rows_kernel (apply)");
}
}  // namespace detail

// y = x·rstd·g per row with rstd = 1/sqrt(mean(x²) + eps) (float), kept [N] for backward.
template <kernel_storage S>
void rmsnorm_forward(const cuda_executor& ex, const S* x, const S* g, S* y, float* rstd, std::size_t N,
                     std::size_t C, double eps) {
  detail::need_matrix(N, C, "N", "C");
  if (!(eps > 0.0) || !std::isfinite(eps)) {
    throw invalid_argument("eps", "a finite value above 0", std::to_string(eps), "Use e.g. 1e-5");
  }
  if (N == 0) return;
  detail::need_pointer(x, "x");
  detail::need_pointer(g, "g");
  detail::need_pointer(y, "y");
  detail::need_pointer(rstd, "rstd");
  detail::launch_rmsnorm_rows(ex, x, g, y, rstd, N, C, static_cast<float>(eps), true);
}

// y = x·rstd·g from a kept rstd [N] (the backward's recompute of the forward's output).
template <kernel_storage S>
void rmsnorm_apply(const cuda_executor& ex, const S* x, const S* g, const float* rstd, S* y, std::size_t N,
                   std::size_t C) {
  detail::need_matrix(N, C, "N", "C");
  if (N == 0) return;
  detail::need_pointer(x, "x");
  detail::need_pointer(g, "g");
  detail::need_pointer(rstd, "rstd");
  detail::need_pointer(y, "y");
  float* kept = const_cast<float*>(rstd);  // only read: compute is false
  detail::launch_rmsnorm_rows(ex, x, g, y, kept, N, C, 0.0f, false);
}

// dx = residual + rstd·(dy⊙g) − x·rstd³/C·Σ(dy⊙g⊙x) (residual may be null), dg += Σ_n dy⊙x·rstd,
// reduced through rmsnorm_backward_workspace_bytes(N, C) of per-row-block partials in block order.
template <kernel_storage S>
void rmsnorm_backward(const cuda_executor& ex, const S* x, const S* g, const float* rstd, const S* dy,
                      const S* residual, S* dx, S* dg, void* workspace, std::size_t workspace_bytes,
                      std::size_t N, std::size_t C) {
  detail::need_matrix(N, C, "N", "C");
  if (N == 0) return;
  detail::need_pointer(x, "x");
  detail::need_pointer(g, "g");
  detail::need_pointer(rstd, "rstd");
  detail::need_pointer(dy, "dy");
  detail::need_pointer(dx, "dx");
  detail::need_pointer(dg, "dg");
  detail::need_space(workspace, workspace_bytes, rmsnorm_backward_workspace_bytes(N, C), "workspace");
  detail::need_aligned(workspace, alignof(float), "workspace");
  const std::size_t blocks = rmsnorm_backward_partials(N);
  float* partial = static_cast<float*>(workspace);
  // The kernel (and so the sums' shape) follows C alone: the warps' partials in shared memory up
  // to rmsnorm_shared_partials_limit, which every GPU from sm_80 grants (sm_86/89's opt-in is
  // 99 KiB), else the wide kernel. An older GPU with less takes the wide kernel there too.
  const std::size_t smem = detail::rmsnorm_backward_smem_bytes<S>(C);
  int optin = 0;
  cuda_check(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, ex.device()),
             "cudaDeviceGetAttribute(cudaDevAttrMaxSharedMemoryPerBlockOptin)");
  if (smem <= rmsnorm_shared_partials_limit && smem <= static_cast<std::size_t>(optin)) {
    const auto launch = [&](auto kernel) {
      cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)),
                 "cudaFuncSetAttribute(rmsnorm_backward_rows_kernel)");
      kernel<<<static_cast<unsigned>(blocks), row_cta_threads, smem, ex.stream()>>>(x, g, rstd, dy, residual,
                                                                                             dx, partial, N, C);
    };
    // Groups even where C is not a whole number of them: on the H200 (2026-11-29, C 4099) the
    // strided element path took 509 us against 312 us.
    constexpr unsigned G = detail::group_of<S>;
    if (C % G == 0 && detail::aligned16(x, g, dy, residual, dx)) {
      launch(detail::rmsnorm_backward_rows_kernel<G, true, S>);
    } else {
      launch(detail::rmsnorm_backward_rows_kernel<G, false, S>);
    }
    cuda_executor::check_launch("rmsnorm_backward_rows_kernel");
  } else {
    detail::rmsnorm_backward_wide_kernel<<<static_cast<unsigned>(blocks), detail::row_threads, 0, ex.stream()>>>(
        x, g, rstd, dy, residual, dx, partial, N, C);
    cuda_executor::check_launch("rmsnorm_backward_wide_kernel");
  }
  detail::rmsnorm_dweight_kernel<<<detail::grid_for(C, 256), 256, 0, ex.stream()>>>(partial, dg, blocks, C);
  cuda_executor::check_launch("rmsnorm_dweight_kernel");
}

// y = a + b elementwise over n values, one rounding (the residual adds).
template <kernel_storage S>
void add_rows(const cuda_executor& ex, const S* a, const S* b, S* y, std::size_t n) {
  if (n == 0) return;
  detail::need_pointer(a, "a");
  detail::need_pointer(b, "b");
  detail::need_pointer(y, "y");
  const unsigned grid = detail::grid_for_groups(n, detail::group_of<S>, 256);
  if (detail::aligned16(a, b, y)) {
    detail::add_kernel<true><<<grid, 256, 0, ex.stream()>>>(a, b, y, n);
  } else {
    detail::add_kernel<false><<<grid, 256, 0, ex.stream()>>>(a, b, y, n);
  }
  cuda_executor::check_launch("add_kernel");
}

// dst = src rounded to S (to nearest even): the one rounding of a value accumulated in fp32.
template <kernel_storage S>
void convert(const cuda_executor& ex, const float* src, S* dst, std::size_t n) {
  if (n == 0) return;
  detail::need_pointer(src, "src");
  detail::need_pointer(dst, "dst");
  const unsigned grid = detail::grid_for_groups(n, detail::group_of<S>, 256);
  if (detail::aligned16(src, dst)) {
    detail::convert_kernel<true><<<grid, 256, 0, ex.stream()>>>(src, dst, n);
  } else {
    detail::convert_kernel<false><<<grid, 256, 0, ex.stream()>>>(src, dst, n);
  }
  cuda_executor::check_launch("convert_kernel");
}

// act = silu(a)·b from the stored pre-activations; act is float or S.
template <kernel_storage S, typename T>
  requires(std::same_as<T, float> || std::same_as<T, S>)
void swiglu_forward(const cuda_executor& ex, const S* a, const S* b, T* act, std::size_t n) {
  if (n == 0) return;
  detail::need_pointer(a, "a");
  detail::need_pointer(b, "b");
  detail::need_pointer(act, "act");
  const unsigned grid = detail::grid_for_groups(n, detail::group_of<S>, 256);
  if (detail::aligned16(a, b, act)) {
    detail::swiglu_forward_kernel<true><<<grid, 256, 0, ex.stream()>>>(a, b, act, n);
  } else {
    detail::swiglu_forward_kernel<false><<<grid, 256, 0, ex.stream()>>>(a, b, act, n);
  }
  cuda_executor::check_launch("swiglu_forward_kernel");
}

// da = dact·b·silu'(a), db = dact·silu(a); da or db may be dact (in place, as the CPU MLP does).
template <kernel_storage S, typename T>
  requires(std::same_as<T, float> || std::same_as<T, S>)
void swiglu_backward(const cuda_executor& ex, const S* a, const S* b, const T* dact, T* da, T* db, std::size_t n) {
  if (n == 0) return;
  detail::need_pointer(a, "a");
  detail::need_pointer(b, "b");
  detail::need_pointer(dact, "dact");
  detail::need_pointer(da, "da");
  detail::need_pointer(db, "db");
  if (da == db) {
    throw invalid_argument("db", "a buffer apart from da", "the same pointer as da",
                           "Give the two gradients separate buffers (one may be dact)");
  }
  const unsigned grid = detail::grid_for_groups(n, detail::group_of<S>, 256);
  if (detail::aligned16(a, b, dact, da, db)) {
    detail::swiglu_backward_kernel<true><<<grid, 256, 0, ex.stream()>>>(a, b, dact, da, db, n);
  } else {
    detail::swiglu_backward_kernel<false><<<grid, 256, 0, ex.stream()>>>(a, b, dact, da, db, n);
  }
  cuda_executor::check_launch("swiglu_backward_kernel");
}

// x[n] = table[tokens[n]] for N device token ids over a [V, C] table. Ids live on the device, so
// they cannot be checked here without a sync: check them on the host before the upload (as
// model::check_tokens does); a bad id still never reads outside the table: its row is zero and
// *bad_token (optional device flag) becomes 1.
template <kernel_storage S>
void embedding_gather(const cuda_executor& ex, const std::int32_t* tokens, const S* table, S* x, std::size_t N,
                      std::size_t C, std::size_t V, unsigned* bad_token = nullptr) {
  detail::need_matrix(N, C, "N", "C");
  detail::need_matrix(V, C, "V", "C");
  if (N == 0) return;
  if (V == 0) throw invalid_argument("V", "at least 1", "0", "The table needs at least one row");
  detail::need_pointer(tokens, "tokens");
  detail::need_pointer(table, "table");
  detail::need_pointer(x, "x");
  if (C * sizeof(S) % 16 == 0 && detail::aligned16(table, x)) {
    detail::embedding_gather_kernel<true><<<detail::row_ctas(N), row_cta_threads, 0, ex.stream()>>>(
        tokens, table, x, N, C, V, bad_token);
  } else {
    detail::embedding_gather_kernel<false><<<detail::row_ctas(N), row_cta_threads, 0, ex.stream()>>>(
        tokens, table, x, N, C, V, bad_token);
  }
  cuda_executor::check_launch("embedding_gather_kernel");
}

// dtable[tokens[n]] += dx[n], deterministic and without atomics (see embedding_scatter_kernel).
template <kernel_storage S>
void embedding_scatter(const cuda_executor& ex, const std::int32_t* tokens, const S* dx, S* dtable, std::size_t N,
                       std::size_t C, std::size_t V, unsigned* bad_token = nullptr) {
  detail::need_matrix(N, C, "N", "C");
  detail::need_matrix(V, C, "V", "C");
  if (N == 0) return;
  if (V == 0) throw invalid_argument("V", "at least 1", "0", "The table needs at least one row");
  detail::need_pointer(tokens, "tokens");
  detail::need_pointer(dx, "dx");
  detail::need_pointer(dtable, "dtable");
  const std::size_t owners = embedding_scatter_owners(C);
  const std::size_t threads = owners * C;
  detail::need_extent(threads, std::size_t{256} * std::numeric_limits<int>::max(), "C");
  detail::embedding_scatter_kernel<<<static_cast<unsigned>((threads + 255) / 256), 256, 0, ex.stream()>>>(
      tokens, dx, dtable, N, C, V, owners, bad_token);
  cuda_executor::check_launch("embedding_scatter_kernel");
}

// One chunk of the fused cross-entropy over R rows of float logits [R, V] (in place): each row
// becomes scale·(softmax − onehot(target)), and *loss_total (a device double) grows by
// Σ_rows −log softmax[target], summed in row order. Scratch: cross_entropy_workspace_bytes(R).
inline void cross_entropy_chunk(const cuda_executor& ex, float* logits, const std::int32_t* targets, std::size_t R,
                                std::size_t V, double scale, double* loss_total, void* workspace,
                                std::size_t workspace_bytes) {
  detail::need_matrix(R, V, "R", "V");
  if (!std::isfinite(scale)) {
    throw invalid_argument("scale", "a finite number", std::to_string(scale), "Pass e.g. 1/tokens");
  }
  if (R == 0) return;
  detail::need_pointer(logits, "logits");
  detail::need_pointer(targets, "targets");
  detail::need_pointer(loss_total, "loss_total");
  detail::need_space(workspace, workspace_bytes, cross_entropy_workspace_bytes(R), "workspace");
  detail::need_aligned(workspace, alignof(double), "workspace");
  double* row_loss = static_cast<double*>(workspace);
  const float sc = static_cast<float>(scale);
  const auto xent = [&](auto kernel) {
    kernel<<<static_cast<unsigned>(R), detail::xent_threads, 0, ex.stream()>>>(logits, targets, V, sc, row_loss);
  };
  // Groups of 4 even where V is not a whole number of them: on the H200 (2026-11-29, V 50257) the
  // strided element path took 126 us against 76 us (a running maximum per element, not per group).
  if (V % 4 == 0 && detail::aligned16(logits)) {
    xent(detail::cross_entropy_kernel<4, true>);
  } else {
    xent(detail::cross_entropy_kernel<4, false>);
  }
  cuda_executor::check_launch("cross_entropy_kernel");
  detail::row_sum_kernel<><<<1, 1, 0, ex.stream()>>>(row_loss, R, loss_total);
  cuda_executor::check_launch("row_sum_kernel");
}

// AdamW at step t (1-based) over the listed segments of flat arrays of n parameters; `state` is
// adamw<S>'s layout (m, v, then the fp32 master for 16-bit S: adamw<S>::state_bytes(n) bytes), so
// it is the CPU optimizer's state byte for byte. The math is adamw_step (core/element_math.hpp).
template <kernel_storage S>
void adamw_update(const cuda_executor& ex, S* w, const S* g, void* state, std::size_t state_bytes, std::size_t n,
                  std::span<const adamw_segment> segments, std::uint64_t t, double lr, const adamw_config& c,
                  double grad_scale = 1.0, const adamw_device_inputs& dev = {}) {
  detail::check_adamw_step(t, lr, c, grad_scale);
  detail::need_finite_in(dev.loss_scale, std::numeric_limits<double>::min(), std::numeric_limits<double>::max(),
                         "dev.loss_scale", "a positive finite number");
  std::size_t prev_end = 0;  // segments in increasing order, apart: no element updated twice
  for (std::size_t i = 0; i < segments.size(); ++i) {
    const adamw_segment& s = segments[i];
    const std::string name = "segments[" + std::to_string(i) + "]";
    if (s.offset < prev_end || s.count > n || s.offset > n - s.count) {
      throw invalid_argument(name, "a range inside [0, " + std::to_string(n) + ") after the previous segment",
                             "[" + std::to_string(s.offset) + ", +" + std::to_string(s.count) + ")",
                             "List the segments in order, without overlap, as model::parameters() does");
    }
    prev_end = s.offset + s.count;
  }
  if (n == 0 || segments.empty()) return;
  detail::need_pointer(w, "w");
  detail::need_pointer(g, "g");
  detail::need_space(state, state_bytes, adamw<S>::state_bytes(n), "state");
  detail::need_aligned(state, alignof(float), "state");
  using opt = adamw<S>;
  static_assert(std::is_same_v<typename opt::moment_type, float>);
  float* m = static_cast<float*>(state);
  float* v = m + n;
  float* master = opt::has_master ? m + 2 * n : nullptr;
  const auto k = adamw_coefficients<float>::at(t, lr, c.beta1, c.beta2, c.eps, c.weight_decay, true);
  bool vec = detail::aligned16(w, g, m, v, master);
  for (const adamw_segment& sg : segments) vec = vec && sg.offset % detail::group_of<S> == 0;
  const std::size_t per_block = vec ? detail::adamw_per_block<true, S> : detail::adamw_per_block<false, S>;
  // Each segment in exactly one launch (before 2026-11-29 an empty segment among the first 32
  // shifted the next launch's start onto one already updated: stepped twice).
  for (const adamw_batch& batch : adamw_batches(segments, per_block, k.wd)) {
    const std::size_t blocks = batch.blocks;
    detail::need_extent(blocks, static_cast<std::size_t>(std::numeric_limits<int>::max()), "segments (total blocks)");
    if (vec) {
      detail::adamw_kernel<true><<<static_cast<unsigned>(blocks), detail::adamw_threads, 0, ex.stream()>>>(
          w, g, m, v, master, batch, k, grad_scale, dev);
    } else {
      detail::adamw_kernel<false><<<static_cast<unsigned>(blocks), detail::adamw_threads, 0, ex.stream()>>>(
          w, g, m, v, master, batch, k, grad_scale, dev);
    }
    cuda_executor::check_launch("adamw_kernel");
  }
}

// One adamw8bit<S, Block> step over the n elements its state covers (the spans, in order, inside
// [0, n), say which take a step and which decay): Optimizer::update's result on the device.
// `skip` (optional, device): when *skip != 0 the launch leaves everything as it was.
template <typename S, std::size_t Block>
void adamw8bit_update(const cuda_executor& ex, S* w, const S* g, void* state, std::size_t state_bytes,
                      std::size_t n, std::span<const param_span> spans, const optimizer_step& s,
                      const unsigned* skip = nullptr) {
  using opt = adamw8bit<S, Block>;
  const adamw_config& c = s.config;
  detail::check_adamw_step(s.t, s.lr, c, s.grad_scale);
  membound::detail::check_param_spans(spans, n);
  if (n == 0) return;
  detail::need_pointer(w, "w");
  detail::need_pointer(g, "g");
  detail::need_space(state, state_bytes, opt::state_bytes(n), "state");
  detail::need_aligned(state, alignof(float), "state");
  const auto kd = adamw_coefficients<float>::at(s.t, s.lr, c.beta1, c.beta2, c.eps, c.weight_decay, true);
  const auto kn = adamw_coefficients<float>::at(s.t, s.lr, c.beta1, c.beta2, c.eps, c.weight_decay, false);
  const typename opt::view p = opt::parts(state, n);
  const adamw8bit_tables tb = adamw8bit_tables_for(spans);
  constexpr unsigned threads = Block < adamw8bit_threads ? static_cast<unsigned>(Block) : adamw8bit_threads;
  const std::size_t blocks = opt::blocks(n);
  detail::need_extent(blocks, static_cast<std::size_t>(std::numeric_limits<int>::max()), "n (blocks)");
  detail::adamw8bit_kernel<S, static_cast<unsigned>(Block)>
      <<<static_cast<unsigned>(blocks), threads, 0, ex.stream()>>>(w, g, p.master, p.absmax_m, p.absmax_v, p.m, p.v,
                                                                   n, tb, kd, kn, static_cast<float>(s.grad_scale),
                                                                   skip);
  cuda_executor::check_launch("adamw8bit_kernel");
}

namespace detail {
// Σ g² in two passes of a shape fixed by n: global_norm_blocks(n) block partials in double, then
// one block over them, writing the root of the sum (Root) or the sum itself into *out.
template <bool Root, kernel_storage S>
void norm_passes(const cuda_executor& ex, const S* g, std::size_t n, double* out, const char* out_name,
                 void* workspace, std::size_t workspace_bytes) {
  need_pointer(out, out_name);
  if (n != 0) need_pointer(g, "g");
  need_space(workspace, workspace_bytes, global_norm_workspace_bytes(n), "workspace");
  need_aligned(workspace, alignof(double), "workspace");
  const std::size_t blocks = global_norm_blocks(n);
  double* partial = static_cast<double*>(workspace);
  if (aligned16(g)) {
    norm_partial_kernel<true><<<static_cast<unsigned>(blocks), norm_threads, 0, ex.stream()>>>(g, n, partial);
  } else {
    norm_partial_kernel<false><<<static_cast<unsigned>(blocks), norm_threads, 0, ex.stream()>>>(g, n, partial);
  }
  cuda_executor::check_launch("norm_partial_kernel");
  norm_final_kernel<Root><<<1, 1024, 0, ex.stream()>>>(partial, blocks, out);
  cuda_executor::check_launch("norm_final_kernel");
}
}  // namespace detail

// *norm = sqrt(Σ g²) over n values (squares summed in double). Scratch:
// global_norm_workspace_bytes(n). The result stays on the device for adamw_update's clipping.
template <kernel_storage S>
void global_norm(const cuda_executor& ex, const S* g, std::size_t n, double* norm, void* workspace,
                 std::size_t workspace_bytes) {
  detail::norm_passes<true>(ex, g, n, norm, "norm", workspace, workspace_bytes);
}

// *sum = Σ g² over n values: global_norm's passes without the root (the same partials, so the
// same bits as its square before the root): one rank's shard of a norm over ranks.
template <kernel_storage S>
void sum_squares(const cuda_executor& ex, const S* g, std::size_t n, double* sum, void* workspace,
                 std::size_t workspace_bytes) {
  detail::norm_passes<false>(ex, g, n, sum, "sum", workspace, workspace_bytes);
}

// *flag = 1 when any of n values is inf or NaN; never cleared here (clear it with
// cudaMemsetAsync before the first check of a step, so several arrays can share one flag).
template <kernel_storage S>
void check_finite(const cuda_executor& ex, const S* data, std::size_t n, unsigned* flag) {
  detail::need_pointer(flag, "flag");
  if (n == 0) return;
  detail::need_pointer(data, "data");
  const unsigned grid = detail::grid_for_groups(n, detail::group_of<S>, 256);
  if (detail::aligned16(data)) {
    detail::check_finite_kernel<true><<<grid, 256, 0, ex.stream()>>>(data, n, flag);
  } else {
    detail::check_finite_kernel<false><<<grid, 256, 0, ex.stream()>>>(data, n, flag);
  }
  cuda_executor::check_launch("check_finite_kernel");
}

#endif  // MEMBOUND_CUDA_COMPILER

}  // namespace gpu

// The model's glue on the device (model/glue.hpp names the interface; backend/cpu/model.hpp has
// the host's): block and model call these with their storage S and accumulation A.
template <>
struct backend_kernels<cuda_backend, model_glue> {
  using executor = cuda_executor;

  template <typename A, typename S>
  static constexpr std::size_t norm_backward_scratch_bytes(std::size_t N, std::size_t C) noexcept {
    return gpu::rmsnorm_backward_workspace_bytes(N, C);
  }
  // The trainer's device buffers (gpu::step_buffers): tokens and targets of a whole step (every
  // plan of a trainer has the same micro-batch × accumulation, so one size serves them all), the
  // gradient norm's partials and result.
  static constexpr std::size_t step_buffer_bytes(std::size_t tokens, std::size_t n) noexcept {
    return gpu::step_buffers(tokens, n).bytes;
  }
  // Where the target ids start in them (the token ids start at 0).
  static constexpr std::size_t step_targets_offset(std::size_t tokens) noexcept {
    return gpu::step_buffers(tokens, 0).targets;
  }

  // ---- The trainer's memory moves (host runtime calls: no kernel) ------------------------------
  // On the executor's stream, complete on return (the host buffers may be reused at once).
  static void fill_zero(cuda_executor& ex, void* p, std::size_t bytes) {
    if (bytes == 0) return;
    cuda_check(cudaMemsetAsync(p, 0, bytes, ex.stream()), "cudaMemsetAsync");
  }
  static void copy_to_device(cuda_executor& ex, void* dst, const void* src, std::size_t bytes) {
    if (bytes == 0) return;
    cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, ex.stream()), "cudaMemcpyAsync (to device)");
    ex.synchronize();
  }
  static void copy_to_host(cuda_executor& ex, void* dst, const void* src, std::size_t bytes) {
    if (bytes == 0) return;
    cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, ex.stream()), "cudaMemcpyAsync (to host)");
    ex.synchronize();
  }
  static void synchronize(cuda_executor& ex) { ex.synchronize(); }
  // Two events without timing, destroyed with the scope (the offloaded update's chunk downloads).
  struct copy_events {
    cudaEvent_t e[2] = {nullptr, nullptr};
    copy_events() {
      try {
        for (cudaEvent_t& x : e) {
          cuda_check(cudaEventCreateWithFlags(&x, cudaEventDisableTiming), "cudaEventCreateWithFlags");
        }
      } catch (...) {
        destroy();
        throw;
      }
    }
    ~copy_events() { destroy(); }
    copy_events(const copy_events&) = delete;
    copy_events& operator=(const copy_events&) = delete;
    void destroy() noexcept {
      for (cudaEvent_t& x : e) {
        if (x != nullptr) (void)cudaEventDestroy(x);
        x = nullptr;
      }
    }
  };
  // fill(p) writes `bytes` at dst: p is a host buffer, uploaded to dst when fill returns.
  template <typename Fill>
  static void write_via_host(cuda_executor& ex, void* dst, std::size_t bytes, Fill&& fill) {
    std::vector<host_block> h = host_buffer(bytes);
    fill(static_cast<void*>(h.data()));
    copy_to_device(ex, dst, h.data(), bytes);
  }
  // read(p) reads `bytes` at src: p is a host copy of them.
  template <typename Read>
  static void read_via_host(cuda_executor& ex, const void* src, std::size_t bytes, Read&& read) {
    std::vector<host_block> h = host_buffer(bytes);
    copy_to_host(ex, h.data(), src, bytes);
    read(static_cast<const void*>(h.data()));
  }
  // Host bytes aligned for any optimizer state (its load_state, init and save_state read and
  // write them as floats, doubles or blocks). A named block type: nvcc 13's front end fails an
  // internal assertion destroying a std::vector<std::max_align_t> (an unnamed struct in glibc).
  struct alignas(alignof(std::max_align_t)) host_block {
    unsigned char bytes[alignof(std::max_align_t)];
  };
  static std::vector<host_block> host_buffer(std::size_t bytes) {
    return std::vector<host_block>((bytes + sizeof(host_block) - 1) / sizeof(host_block));
  }
  // A step's n token and target ids, uploaded into the step buffers (step_targets_offset).
  static void stage_ids(cuda_executor& ex, void* buffers, const std::int32_t* tokens,
                        const std::int32_t* targets, std::size_t n, std::size_t step_tokens) {
    auto* l = static_cast<unsigned char*>(buffers);
    const std::size_t bytes = n * sizeof(std::int32_t);
    copy_to_device(ex, l, tokens, bytes);
    copy_to_device(ex, l + step_targets_offset(step_tokens), targets, bytes);
  }
  static const std::int32_t* staged_tokens(const void* buffers, const std::int32_t* /*host*/) noexcept {
    return static_cast<const std::int32_t*>(buffers);
  }
  static const std::int32_t* staged_targets(const void* buffers, const std::int32_t* /*host*/,
                                            std::size_t step_tokens) noexcept {
    return reinterpret_cast<const std::int32_t*>(static_cast<const unsigned char*>(buffers) +
                                                 step_targets_offset(step_tokens));
  }
  // Device ids cannot be read without a copy and a sync: none here (the caller checks its host
  // copy before the upload; a bad id on the device reads nothing outside a table).
  static const std::int32_t* host_ids(const std::int32_t*) noexcept { return nullptr; }
  // `n` elements at p readable on the host: copied into `buffer` (resized), on the stream.
  template <typename S>
  static const S* host_view(cuda_executor& ex, const S* p, std::size_t n, std::vector<S>& buffer) {
    buffer.resize(n);
    copy_to_host(ex, buffer.data(), p, n * sizeof(S));
    return buffer.data();
  }

  // Optimizer offload (planner: offload_options; ZeRO-Offload's placement): the state lives in the
  // host space (pinned memory: the trainer's host allocator), and the parameters go through in
  // offload_chunks (half a bucket each, a slot of the two staging buffers apiece), so that the next
  // chunk's download and the last chunk's upload run on the stream while the host updates this one:
  //   download chunk 0; for each chunk c: queue chunk c + 1's download into the other slot (after
  //   chunk c − 1's upload from it, in stream order), wait for chunk c's download (its slot's
  //   event), run the policy's update_range there on the executor's host threads (the CPU
  //   optimizer's arithmetic), queue its upload.
  // With one slot (a bucket of one granule) the next download is queued after the upload. The
  // uploads end stream-ordered before the next step's kernels and the next step's downloads.
  static constexpr bool offloads_optimizer = true;
  template <typename Optimizer, typename S, typename Spans, typename Step>
  static void offloaded_update(cuda_executor& ex, S* w, const S* g, void* host_state, std::size_t n, Spans spans,
                               const Step& step, S* stage_w, S* stage_g, std::size_t bucket) {
    const offload_chunks k = offload_chunks::of(n, bucket, Optimizer::range_granule);
    const copy_events downloaded;
    const auto download = [&](std::size_t c) {
      const std::size_t bytes = k.size(c) * sizeof(S), at = k.slot_offset(c);
      cuda_check(cudaMemcpyAsync(stage_g + at, g + k.first(c), bytes, cudaMemcpyDeviceToHost, ex.stream()),
                 "cudaMemcpyAsync (gradients to the host)");
      cuda_check(cudaMemcpyAsync(stage_w + at, w + k.first(c), bytes, cudaMemcpyDeviceToHost, ex.stream()),
                 "cudaMemcpyAsync (weights to the host)");
      cuda_check(cudaEventRecord(downloaded.e[c % k.slots], ex.stream()), "cudaEventRecord");
    };
    if (k.count != 0) download(0);
    for (std::size_t c = 0; c < k.count; ++c) {
      if (k.slots == 2 && c + 1 < k.count) download(c + 1);
      cuda_check(cudaEventSynchronize(downloaded.e[c % k.slots]), "cudaEventSynchronize (a chunk's download)");
      S* const sw = stage_w + k.slot_offset(c);
      Optimizer::update_range(sw, stage_g + k.slot_offset(c), host_state, n, k.first(c), k.size(c), spans, step,
                              ex.host_pool());
      cuda_check(cudaMemcpyAsync(w + k.first(c), sw, k.size(c) * sizeof(S), cudaMemcpyHostToDevice, ex.stream()),
                 "cudaMemcpyAsync (weights to the device)");
      if (k.slots == 1 && c + 1 < k.count) download(c + 1);
    }
  }

  // Activation offload (kept block inputs in pinned host memory, copied on a copy stream) is not
  // built on the device yet either: forward_backward refuses a schedule that offloads.
  static constexpr bool offloads_activations = false;
#if MEMBOUND_CUDA_COMPILER
  template <typename A, typename S>
  static void rmsnorm_forward(cuda_executor& ex, const S* x, const S* g, S* y, A* rstd, std::size_t N,
                              std::size_t C, double eps) {
    gpu::check_types<S, A>();
    gpu::rmsnorm_forward(ex, x, g, y, rstd, N, C, eps);
  }
  template <typename A, typename S>
  static void rmsnorm_apply(cuda_executor& ex, const S* x, const S* g, const A* rstd, S* y, std::size_t N,
                            std::size_t C) {
    gpu::check_types<S, A>();
    gpu::rmsnorm_apply(ex, x, g, rstd, y, N, C);
  }
  template <typename A, typename S>
  static void rmsnorm_backward(cuda_executor& ex, const S* x, const S* g, const A* rstd, const S* dy,
                               const S* residual, S* dx, S* dg, void* scratch, std::size_t N, std::size_t C) {
    gpu::check_types<S, A>();
    gpu::rmsnorm_backward(ex, x, g, rstd, dy, residual, dx, dg, scratch, gpu::rmsnorm_backward_workspace_bytes(N, C),
                          N, C);
  }
  template <typename A, typename S>
  static void add_rows(cuda_executor& ex, const S* a, const S* b, S* y, std::size_t N, std::size_t C) {
    gpu::check_types<S, A>();
    gpu::add_rows(ex, a, b, y, N * C);
  }
  template <typename A, typename S>
  static void embedding_gather(cuda_executor& ex, const std::int32_t* tokens, const S* table, S* x, std::size_t N,
                               std::size_t C, std::size_t V) {
    gpu::check_types<S, A>();
    gpu::embedding_gather(ex, tokens, table, x, N, C, V);
  }
  template <typename A, typename S>
  static void embedding_scatter(cuda_executor& ex, const std::int32_t* tokens, const S* dx, S* dtable, std::size_t N,
                                std::size_t C, std::size_t V) {
    gpu::check_types<S, A>();
    gpu::embedding_scatter(ex, tokens, dx, dtable, N, C, V);
  }

  // ---- The trainer's arithmetic -------------------------------------------------------------------
  // sqrt(Σ g²) over n gradients, summed in double on the device (gpu::global_norm's fixed shape:
  // the same bits every run), through the step buffers made for `tokens`; the one host read of
  // the optimizer step.
  template <typename S>
  static double gradient_norm(cuda_executor& ex, const S* g, std::size_t n, void* buffers, std::size_t tokens) {
    const gpu::step_buffer_layout l = gpu::step_buffers(tokens, n);
    auto* base = static_cast<unsigned char*>(buffers);
    auto* norm = reinterpret_cast<double*>(base + l.norm);
    gpu::global_norm(ex, g, n, norm, base + l.partials, gpu::global_norm_workspace_bytes(n));
    double out = 0;
    copy_to_host(ex, &out, norm, sizeof out);
    return out;
  }
  // Σ g² over `count` gradients of a shard (data parallel: each rank's part of the norm), through
  // the step buffers made for `tokens` and `n` parameters (count <= n).
  template <typename S>
  static double sum_squares(cuda_executor& ex, const S* g, std::size_t count, void* buffers, std::size_t tokens,
                            std::size_t n) {
    const gpu::step_buffer_layout l = gpu::step_buffers(tokens, n);
    auto* base = static_cast<unsigned char*>(buffers);
    auto* sum = reinterpret_cast<double*>(base + l.norm);
    gpu::sum_squares(ex, g, count, sum, base + l.partials, gpu::global_norm_workspace_bytes(count));
    double out = 0;
    copy_to_host(ex, &out, sum, sizeof out);
    return out;
  }
  // AdamW (adamw<S>'s state layout, the CPU optimizer's byte for byte) over the spans of
  // [0, n), each with its own decay: the step the trainer gives cpu's Optimizer::update.
  template <typename S>
  static void adamw_update(cuda_executor& ex, S* w, const S* g, void* state, std::size_t state_bytes, std::size_t n,
                           std::span<const param_span> spans, const optimizer_step& step) {
    std::vector<gpu::adamw_segment> seg;
    seg.reserve(spans.size());
    for (const param_span& p : spans) seg.push_back({p.first, p.count, p.decay});
    gpu::adamw_update(ex, w, g, state, state_bytes, n, std::span<const gpu::adamw_segment>(seg), step.t, step.lr,
                      step.config, step.grad_scale);
  }
  // Whether the device can step Optimizer over these spans: throws the launch's own typed error
  // before step 1 (adamw8bit takes at most gpu::adamw8bit_max_spans runs in one launch).
  template <typename Optimizer>
  static void check_optimizer_spans(std::span<const param_span> spans) {
    if constexpr (is_adamw8bit_v<Optimizer>) (void)gpu::adamw8bit_tables_for(spans);
  }
  // The trainer's optimizer step: adamw<S> or adamw8bit<S, Block>, each over its CPU state layout.
  template <typename Optimizer, typename S>
  static void optimizer_update(cuda_executor& ex, S* w, const S* g, void* state, std::size_t state_bytes,
                               std::size_t n, std::span<const param_span> spans, const optimizer_step& step) {
    if constexpr (is_adamw8bit_v<Optimizer>) {
      gpu::adamw8bit_update<S, Optimizer::block>(ex, w, g, state, state_bytes, n, spans, step);
    } else {
      static_assert(std::is_same_v<Optimizer, adamw<S>>,
                    "membound: the device steps adamw<S> or adamw8bit<S, Block>; other optimizers run on "
                    "cpu_backend.");
      adamw_update(ex, w, g, state, state_bytes, n, spans, step);
    }
  }
#else
  // The launches exist only where nvcc compiles; the size functions above are what a host-only
  // translation unit (a planner) can use.
  template <typename A, typename S, typename... Args>
  static void rmsnorm_forward(Args&&...) { needs_nvcc<A, S>(); }
  template <typename A, typename S, typename... Args>
  static void rmsnorm_apply(Args&&...) { needs_nvcc<A, S>(); }
  template <typename A, typename S, typename... Args>
  static void rmsnorm_backward(Args&&...) { needs_nvcc<A, S>(); }
  template <typename A, typename S, typename... Args>
  static void add_rows(Args&&...) { needs_nvcc<A, S>(); }
  template <typename A, typename S, typename... Args>
  static void embedding_gather(Args&&...) { needs_nvcc<A, S>(); }
  template <typename A, typename S, typename... Args>
  static void embedding_scatter(Args&&...) { needs_nvcc<A, S>(); }
  template <typename S, typename... Args>
  static double gradient_norm(Args&&...) {
    needs_nvcc<float, S>();
    return 0;
  }
  template <typename S, typename... Args>
  static double sum_squares(Args&&...) {
    needs_nvcc<float, S>();
    return 0;
  }
  // (Nothing to deduce the storage from: the arguments' types keep the assertion dependent.)
  template <typename... Args>
  static void adamw_update(Args&&...) { needs_nvcc<float, std::tuple<Args...>>(); }
  template <typename Optimizer, typename... Args>
  static void optimizer_update(Args&&...) { needs_nvcc<float, Optimizer>(); }
  template <typename Optimizer, typename... Args>
  static void check_optimizer_spans(Args&&...) { needs_nvcc<float, Optimizer>(); }

 private:
  template <typename A, typename S>
  static void needs_nvcc() {
    static_assert(dependent_false<A, S>,
                  "membound: a model on cuda_backend launches CUDA kernels in its steps; compile this "
                  "translation unit with nvcc (a .cu file, or LANGUAGE CUDA in CMake).");
  }
#endif
};

MEMBOUND_NAMESPACE_END
