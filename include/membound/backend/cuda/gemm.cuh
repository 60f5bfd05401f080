// Row-major GEMMs on the GPU through cuBLASLt, with exactly the semantics of cpu::matmul,
// cpu::matmul_bt and cpu::matmul_at (backend/cpu/gemm.hpp, its twin): the pool becomes a
// gemm_context.
//
//   membound::gpu::gemm_cache cache;                       // plans, one per problem
//   const std::size_t ws_bytes = membound::gpu::gemm_workspace_bytes(exec);
//   membound::gpu::gemm_context ctx(exec, cache, ws, ws_bytes);  // ws: device memory, 256-aligned
//   membound::gpu::matmul(ctx, x, w, y, N, K, M, /*accumulate=*/false);      // y = x·w
//   membound::gpu::matmul_bt(ctx, dy, w, dx, N, M, K, false);                // dx = dy·wᵀ
//   membound::gpu::matmul_at(ctx, x, dy, dw, N, K, M, true);                 // dw += xᵀ·dy
//
// Inputs are float, bf16 or fp16; the output is the input type or float. Products are summed in
// fp32 (CUBLAS_COMPUTE_32F) and the result, alpha·sum (+ y when accumulating), is rounded once to
// the output type, with one exception measured on an H200 with cuBLASLt 13.0: accumulating into
// a 16-bit y rounds alpha·sum to the output type first, then adds y and rounds again (the CPU
// rounds once), so such an element can be off by u·|alpha·sum| where sum and y cancel. fp32 stays exact fp32 unless gemm_options::allow_tf32 asks for TF32 tensor
// cores. Nothing is allocated on the device and nothing is synchronized: the kernel is launched on
// exec.stream() with exec.lt(), and the workspace is the caller's.
//
// Row-major is handled by the usual swap, not by CUBLASLT_ORDER_ROW layouts: a row-major R×C
// matrix with leading dimension ld is a column-major C×R one with the same ld, so y = x·w is
// computed as yᵀ = wᵀ·xᵀ in cuBLAS's native column order. It costs nothing, and the column-major
// layouts are the ones every cuBLASLt kernel supports, where ORDER_ROW for these types narrows
// the heuristic's choice (or is refused outright by some kernels and versions).
//
// Determinism: cuBLAS gives bitwise-identical results run to run for a fixed algorithm on the same
// GPU model (same architecture and SM count). The plan fixes the algorithm (chosen once per
// problem by the heuristic, which is not timing-based), and the heuristic may only pick algorithms
// without a split-K reduction (CUBLASLT_REDUCTION_SCHEME_NONE): those sum partial dot products in
// a second pass whose order and intermediate rounding (through the output type, for bf16 a
// precision loss too) depend on the split and the workspace, not on the problem alone. With NONE
// each output element is one dot product accumulated by one tile, in fp32.
//
// Split-K of our own, for weight gradients (matmul_at): g[K, M] = xᵀ·d sums over N tokens, and a
// small g (a 256×256 gradient is 4 output tiles of 128×128) on one dot product per element
// leaves all but a few SMs idle, 56× slower than cuBLASLt's split-K on an H200 (N = 65536,
// bf16; bench/results/gpu_h200_2026-11-26.md). matmul_at therefore cuts N into `parts` equal
// slices, chosen from the shape alone (split_k_for), runs them as one strided-batched cuBLASLt call
// into fp32 partials in the workspace (no split-K inside it), and sums the partials in a fixed
// order (slice 0, 1, ...) in fp32 in its own kernel, which applies alpha, adds g when
// accumulating and rounds once to g's type. The bits then depend on the shape and the device's
// workspace size (which bounds the partials), never on a timing or on the workspace's contents.
// That kernel needs nvcc: matmul_at is defined for translation units nvcc compiles (as every
// layer's device code is); gemm() and the other two products are host code.
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "membound/shape/gemm_shape.hpp"
#include "membound/backend/cuda/cuda_backend.cuh"
#include "membound/backend/cuda/cuda_check.cuh"
#include "membound/backend/cuda/interop.cuh"  // bf16/fp16 have the bits of CUDA_R_16BF/CUDA_R_16F
#include "membound/core/checked_math.hpp"
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/core/error.hpp"
#include "membound/core/format.hpp"


MEMBOUND_NAMESPACE_BEGIN

// Not `cuda`: inside membound that name would hide libcu++'s ::cuda namespace.
namespace gpu {

template <typename T>
concept gemm_element = std::same_as<T, float> || std::same_as<T, bf16> || std::same_as<T, fp16>;

// The output of a GEMM over T: T itself, or float (e.g. bf16 products kept in fp32).
template <typename Out, typename T>
concept gemm_output = gemm_element<T> &&(std::same_as<Out, T> || std::same_as<Out, float>);

template <gemm_element T>
inline constexpr cudaDataType_t cuda_data_type_v = std::same_as<T, float>
                                                       ? CUDA_R_32F
                                                       : (std::same_as<T, bf16> ? CUDA_R_16BF
                                                                                : CUDA_R_16F);

// Workspace handed to cuBLASLt: the sizes cuBLAS recommends (cublasSetWorkspace), 32 MiB on
// Hopper and later, 4 MiB before. A fixed cap per architecture rather than the chosen algorithm's
// own need, so that a program sized for one shape is sized for every shape.
inline constexpr std::size_t gemm_workspace_bytes_hopper = std::size_t{32} << 20;
inline constexpr std::size_t gemm_workspace_bytes_other = std::size_t{4} << 20;
// cuBLAS requires its workspace to be 256-byte aligned (as cudaMalloc returns).
inline constexpr std::size_t gemm_workspace_alignment = 256;

// The most any architecture asks for: what a size function that cannot see the device (a layer's
// workspace_bytes, the planner) reserves, so the plan holds on every GPU.
inline constexpr std::size_t gemm_workspace_bytes_max = gemm_workspace_bytes_hopper;

constexpr std::size_t gemm_workspace_bytes_for(int compute_capability_major) noexcept {
  return compute_capability_major >= 9 ? gemm_workspace_bytes_hopper : gemm_workspace_bytes_other;
}

inline int compute_capability_major(int device) {
  int major = 0;
  cuda_check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
             "cudaDeviceGetAttribute(cudaDevAttrComputeCapabilityMajor)");
  return major;
}

// Bytes of workspace every GEMM on exec's device needs; query once, allocate once.
inline std::size_t gemm_workspace_bytes(const cuda_executor& exec) {
  return gemm_workspace_bytes_for(compute_capability_major(exec.device()));
}

struct gemm_options {
  float alpha = 1.0f;       // y (+)= alpha · product
  bool allow_tf32 = false;  // fp32 inputs only: CUBLAS_COMPUTE_32F_FAST_TF32 (10-bit mantissas)
};

// Which of the three CPU products: y = x·w, y = x·wᵀ, g = xᵀ·d.
enum class gemm_op : std::uint8_t { nn, bt, at };

inline const char* gemm_op_name(gemm_op op) noexcept {
  switch (op) {
    case gemm_op::nn:
      return "matmul";
    case gemm_op::bt:
      return "matmul_bt";
    case gemm_op::at:
      return "matmul_at";
  }
  return "gemm";
}

// A problem in the CPU functions' own terms: op, N, K, M and ld3 mean what they mean there
// (ld.w is d's for matmul_at). in/out are the element types.
struct gemm_problem {
  gemm_op op = gemm_op::nn;
  std::size_t N = 0, K = 0, M = 0;
  ld3 ld{0, 0, 0};
  cudaDataType_t in = CUDA_R_32F, out = CUDA_R_32F;
  bool allow_tf32 = false;
  bool split_k = false;  // matmul_at only: may run as split_k_for's fixed split (header comment)
};

namespace detail {

constexpr std::size_t gemm_element_bytes(cudaDataType_t t) noexcept { return t == CUDA_R_32F ? 4 : 2; }

inline const char* gemm_type_name(cudaDataType_t t) noexcept {
  return t == CUDA_R_32F ? "fp32" : (t == CUDA_R_16BF ? "bf16" : "fp16");
}

// The largest power of two dividing the address, capped at 256 (the heuristic's default
// assumption, and the most any cuBLASLt kernel asks for).
inline std::uint32_t address_alignment(const void* p) noexcept {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  std::uint32_t align = 1;
  while (align < 256 && (a & align) == 0) align <<= 1;
  return align;
}

// One operand as the caller sees it: a row-major rows×cols matrix with leading dimension ld.
struct gemm_operand {
  const char* pointer_name;  // "x", "w", "y"
  const char* ld_name;       // "ld.x", ...
  std::size_t rows, cols, ld;
};

struct gemm_operands {
  gemm_operand x, w, y;
};

inline gemm_operands row_major_operands(const gemm_problem& p) {
  const bool at = p.op == gemm_op::at;
  const gemm_operand x{"x", "ld.x", p.N, p.K, p.ld.x};
  const gemm_operand w = p.op == gemm_op::nn   ? gemm_operand{"w", "ld.w", p.K, p.M, p.ld.w}
                         : p.op == gemm_op::bt ? gemm_operand{"w", "ld.w", p.M, p.K, p.ld.w}
                                               : gemm_operand{"d", "ld.w", p.N, p.M, p.ld.w};
  const gemm_operand y = at ? gemm_operand{"g", "ld.y", p.K, p.M, p.ld.y}
                            : gemm_operand{"y", "ld.y", p.N, p.M, p.ld.y};
  return {x, w, y};
}

// Bytes spanned by a row-major matrix: (rows − 1)·ld + cols elements, saturating.
inline std::size_t span_bytes(const gemm_operand& o, std::size_t element) noexcept {
  return sat_mul(sat_add(sat_mul(o.rows - 1, o.ld), o.cols), element);
}

inline bool overlaps(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes) {
  const auto pa = reinterpret_cast<std::uintptr_t>(a), pb = reinterpret_cast<std::uintptr_t>(b);
  return pa < sat_add(pb, b_bytes) && pb < sat_add(pa, a_bytes);
}

// The plan's key: the problem plus what the heuristic's choice depends on.
struct gemm_key {
  int device;
  gemm_op op;
  std::size_t N, K, M, ldx, ldw, ldy;
  cudaDataType_t in, out;
  bool tf32;
  bool split_k;
  std::uint32_t align_x, align_w, align_y;
  std::size_t workspace_cap;
  bool operator==(const gemm_key&) const = default;
};

struct gemm_key_hash {
  std::size_t operator()(const gemm_key& k) const noexcept {
    std::size_t h = 0;
    const auto mix = [&h](std::size_t v) {
      h ^= std::hash<std::size_t>{}(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    };
    mix(static_cast<std::size_t>(k.device));
    mix(static_cast<std::size_t>(k.op));
    mix(k.N);
    mix(k.K);
    mix(k.M);
    mix(k.ldx);
    mix(k.ldw);
    mix(k.ldy);
    mix(static_cast<std::size_t>(k.in));
    mix(static_cast<std::size_t>(k.out));
    mix((k.tf32 ? 1 : 0) | (k.split_k ? 2 : 0));
    mix((std::size_t{k.align_x} << 18) | (std::size_t{k.align_w} << 9) | k.align_y);
    mix(k.workspace_cap);
    return h;
  }
};

// RAII for the three cuBLASLt descriptor kinds (the handles are pointers to opaque structs).
struct lt_matmul_desc_deleter {
  void operator()(cublasLtMatmulDesc_t d) const noexcept { (void)cublasLtMatmulDescDestroy(d); }
};
struct lt_layout_deleter {
  void operator()(cublasLtMatrixLayout_t l) const noexcept { (void)cublasLtMatrixLayoutDestroy(l); }
};
struct lt_preference_deleter {
  void operator()(cublasLtMatmulPreference_t p) const noexcept {
    (void)cublasLtMatmulPreferenceDestroy(p);
  }
};
using lt_matmul_desc =
    std::unique_ptr<std::remove_pointer_t<cublasLtMatmulDesc_t>, lt_matmul_desc_deleter>;
using lt_layout = std::unique_ptr<std::remove_pointer_t<cublasLtMatrixLayout_t>, lt_layout_deleter>;
using lt_preference =
    std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>, lt_preference_deleter>;

inline lt_layout make_layout(cudaDataType_t type, std::size_t rows, std::size_t cols,
                             std::size_t ld) {
  cublasLtMatrixLayout_t l = nullptr;
  cublas_check(cublasLtMatrixLayoutCreate(&l, type, rows, cols, static_cast<std::int64_t>(ld)),
               "cublasLtMatrixLayoutCreate");
  return lt_layout(l);
}

template <typename V>
void set_desc(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const V& v) {
  cublas_check(cublasLtMatmulDescSetAttribute(d, attr, &v, sizeof(v)),
               "cublasLtMatmulDescSetAttribute");
}
template <typename V>
void set_pref(cublasLtMatmulPreference_t p, cublasLtMatmulPreferenceAttributes_t attr, const V& v) {
  cublas_check(cublasLtMatmulPreferenceSetAttribute(p, attr, &v, sizeof(v)),
               "cublasLtMatmulPreferenceSetAttribute");
}


// The chosen algorithm's configuration and numerical flags (0 where cuBLASLt does not say).
template <typename V>
V algo_config(const cublasLtMatmulAlgo_t& a, cublasLtMatmulAlgoConfigAttributes_t attr) {
  V v{};
  std::size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&a, attr, &v, sizeof(v), &written) !=
      CUBLAS_STATUS_SUCCESS) {
    return V{};
  }
  return v;
}
inline std::uint64_t algo_numerics(const cublasLtMatmulAlgo_t& a) {
  std::uint64_t flags = 0;
  std::size_t written = 0;
  if (cublasLtMatmulAlgoCapGetAttribute(&a, CUBLASLT_ALGO_CAP_NUMERICAL_IMPL_FLAGS, &flags,
                                        sizeof(flags), &written) != CUBLAS_STATUS_SUCCESS) {
    return 0;
  }
  return flags;
}
inline std::string describe_algo(const cublasLtMatmulAlgo_t& a) {
  char text[200];
  std::snprintf(text, sizeof(text),
                "algo %d tile %u stages %u split-k %d reduction %u numerics 0x%llx",
                algo_config<std::int32_t>(a, CUBLASLT_ALGO_CONFIG_ID),
                algo_config<std::uint32_t>(a, CUBLASLT_ALGO_CONFIG_TILE_ID),
                algo_config<std::uint32_t>(a, CUBLASLT_ALGO_CONFIG_STAGES_ID),
                algo_config<std::int32_t>(a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
                algo_config<std::uint32_t>(a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
                static_cast<unsigned long long>(algo_numerics(a)));
  return text;
}
// Why a candidate breaks the header's promise (one fp32 dot product per output element, no
// 16-bit accumulator, no TF32 unless asked), or "" when it keeps it.
inline std::string numerical_refusal(const cublasLtMatmulAlgo_t& a, bool exact_fp32) {
  const auto split = algo_config<std::int32_t>(a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM);
  const auto reduction = algo_config<std::uint32_t>(a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME);
  const std::uint64_t numerics = algo_numerics(a);
  const std::uint64_t accumulator = numerics & CUBLASLT_NUMERICAL_IMPL_FLAGS_ACCUMULATOR_TYPE_MASK;
  if (split > 1 || reduction != CUBLASLT_REDUCTION_SCHEME_NONE) return "split-K " + describe_algo(a);
  if (accumulator != 0 && (accumulator & CUBLASLT_NUMERICAL_IMPL_FLAGS_ACCUMULATOR_32F) == 0) {
    return "accumulator " + describe_algo(a);
  }
  if (exact_fp32 && (numerics & CUBLASLT_NUMERICAL_IMPL_FLAGS_INPUT_TF32) != 0) {
    return "tf32 " + describe_algo(a);
  }
  return {};
}

inline void set_batch(const lt_layout& l, std::size_t count, std::size_t stride) {
  const auto c = static_cast<std::int32_t>(count);
  const auto st = static_cast<std::int64_t>(stride);
  cublas_check(cublasLtMatrixLayoutSetAttribute(l.get(), CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &c, sizeof(c)),
               "cublasLtMatrixLayoutSetAttribute(BATCH_COUNT)");
  cublas_check(cublasLtMatrixLayoutSetAttribute(l.get(), CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &st,
                                                sizeof(st)),
               "cublasLtMatrixLayoutSetAttribute(STRIDED_BATCH_OFFSET)");
}
}  // namespace detail

// How matmul_at splits a problem (see "Split-K" at the top): `parts` slices of `depth` tokens,
// their fp32 partials (`partial_stride` elements apart, 256-byte aligned) at the start of the
// workspace. parts == 1: one plain call.
struct split_k_plan {
  std::size_t parts = 1, depth = 0, partial_stride = 0, partial_bytes = 0;
};
// Split until about this many 128×128 output tiles are in flight (an H100 or H200 has 132 SMs; a
// constant, so that the split follows the shape and not the device), slices of at least
// split_k_min_depth tokens, at most split_k_max_parts of them, partials in at most half of the
// workspace (the rest stays cuBLASLt's), and only splits whose slices start 256-byte aligned.
inline constexpr std::size_t split_k_target_tiles = 128, split_k_max_parts = 32;
inline constexpr std::size_t split_k_min_depth = 1024;
constexpr split_k_plan split_k_for(const gemm_problem& p, std::size_t workspace_bytes) noexcept {
  if (p.op != gemm_op::at || !p.split_k || p.K == 0 || p.M == 0) return {};
  const std::size_t tiles = ((p.K + 127) / 128) * ((p.M + 127) / 128);
  if (tiles >= split_k_target_tiles) return {};
  const std::size_t stride_bytes = (sat_mul(sat_mul(p.K, p.M), std::size_t{4}) + 255) / 256 * 256;
  std::size_t parts = std::min({(split_k_target_tiles + tiles - 1) / tiles, split_k_max_parts,
                                p.N / split_k_min_depth, workspace_bytes / 2 / stride_bytes});
  const std::size_t in = detail::gemm_element_bytes(p.in);
  for (; parts >= 2; --parts) {
    if (p.N % parts != 0) continue;
    const std::size_t depth = p.N / parts;
    if ((depth * p.ld.x * in) % 256 == 0 && (depth * p.ld.w * in) % 256 == 0) {
      return {parts, depth, stride_bytes / 4, parts * stride_bytes};
    }
  }
  return {};
}

// A planned GEMM (CUTLASS's shape: can_implement, workspace_size, run): descriptors, layouts and
// the heuristic's algorithm for one problem on one device, pointer alignment included. Immutable
// once built, so one plan may run from several threads on their own streams.
class gemm_plan {
 public:
  // Throws invalid_argument (workspace_too_small for the workspace) when the call cannot run;
  // nothing on the device is touched. Dimensions are at least 1 and at most INT32_MAX (a negative
  // int converted to size_t lands far above), every leading dimension at least its row's width,
  // pointers non-null and aligned to their element, the output disjoint from the inputs, and the
  // workspace at least gemm_workspace_bytes and 256-byte aligned.
  static void can_implement(const gemm_problem& p, const void* x, const void* w, const void* y,
                            const void* workspace, std::size_t workspace_bytes,
                            std::size_t workspace_required) {
    const char* fn = gemm_op_name(p.op);
    const auto where = [fn](const char* what) { return std::string(fn) + ": " + what; };
    constexpr std::size_t dim_max = static_cast<std::size_t>(std::numeric_limits<int>::max());
    const std::pair<const char*, std::size_t> dims[] = {{"N", p.N}, {"K", p.K}, {"M", p.M}};
    for (const auto& [name, v] : dims) {
      if (v == 0 || v > dim_max) {
        throw invalid_argument(
            where(name), "a dimension in [1, INT32_MAX]",
            v == 0 ? std::string("0") : std::to_string(v) + " (a negative int converted?)",
            "Skip empty products before the call; pass sizes as std::size_t, "
            "not negative ints");
      }
    }
    const detail::gemm_operands ops = detail::row_major_operands(p);
    const std::size_t in_bytes = detail::gemm_element_bytes(p.in);
    const std::size_t out_bytes = detail::gemm_element_bytes(p.out);
    const std::pair<const detail::gemm_operand*, const void*> all[] = {
        {&ops.x, x}, {&ops.w, w}, {&ops.y, y}};
    for (const auto& [o, ptr] : all) {
      if (o->ld < o->cols || o->ld > dim_max) {
        throw invalid_argument(
            where(o->ld_name),
            "a leading dimension of at least the row width " + std::to_string(o->cols) + " of " +
                o->pointer_name + " (" + std::to_string(o->rows) + "x" + std::to_string(o->cols) +
                ", row-major) and at most INT32_MAX",
            std::to_string(o->ld),
            "Pass the distance in elements between consecutive rows of the full buffer");
      }
      const std::size_t element = o == &ops.y ? out_bytes : in_bytes;
      if (ptr == nullptr) {
        throw invalid_argument(where(o->pointer_name), "a device pointer", "nullptr",
                               "Allocate the operand before the call");
      }
      if (reinterpret_cast<std::uintptr_t>(ptr) % element != 0) {
        throw invalid_argument(
            where(o->pointer_name),
            "a pointer aligned to its element (" + std::to_string(element) + " bytes)",
            "an address " + std::to_string(detail::address_alignment(ptr)) + "-byte aligned",
            "Offset views by whole elements; cuBLASLt cannot read a "
            "misaligned array");
      }
    }
    const std::size_t y_span = detail::span_bytes(ops.y, out_bytes);
    if (detail::overlaps(y, y_span, x, detail::span_bytes(ops.x, in_bytes)) ||
        detail::overlaps(y, y_span, w, detail::span_bytes(ops.w, in_bytes))) {
      throw invalid_argument(where(ops.y.pointer_name), "an output disjoint from both inputs",
                             "an output overlapping an input",
                             "Write the product to a separate buffer");
    }
    if (workspace == nullptr || workspace_bytes < workspace_required) {
      // The size to hand is gemm_workspace_bytes(exec), whatever the shape.
      throw workspace_too_small(where("workspace (size it with gpu::gemm_workspace_bytes)"),
                                workspace_required, workspace == nullptr ? 0 : workspace_bytes);
    }
    if (reinterpret_cast<std::uintptr_t>(workspace) % gemm_workspace_alignment != 0) {
      throw invalid_argument(
          where("workspace"), "a 256-byte aligned device pointer",
          "an address " + std::to_string(detail::address_alignment(workspace)) + "-byte aligned",
          "Hand the start of an allocation (cudaMalloc and membound's "
          "allocators align to 256 bytes)");
    }
  }

  // Builds the descriptors and runs the heuristic (host only: no device memory, no launch).
  // align_* are the pointers' alignments, which restrict the algorithms the heuristic may pick.
  gemm_plan(cublasLtHandle_t lt, const gemm_problem& p, std::uint32_t align_x,
            std::uint32_t align_w, std::uint32_t align_y, std::size_t workspace_cap)
      : problem_(p) {
    const bool fp32_in = p.in == CUDA_R_32F;
    const cublasComputeType_t compute =
        fp32_in && p.allow_tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    cublasLtMatmulDesc_t d = nullptr;
    cublas_check(cublasLtMatmulDescCreate(&d, compute, CUDA_R_32F), "cublasLtMatmulDescCreate");
    desc_.reset(d);

    // The swap: cuBLAS's A is the caller's w (or d), its B the caller's x, and C = D = yᵀ.
    cublasOperation_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_N;
    std::size_t m = p.M, n = p.N;  // column-major C is m×n
    switch (p.op) {
      case gemm_op::nn:  // yᵀ[M×N] = wᵀ[M×K] · xᵀ[K×N]
        a_ = detail::make_layout(p.in, p.M, p.K, p.ld.w);
        b_ = detail::make_layout(p.in, p.K, p.N, p.ld.x);
        break;
      case gemm_op::bt:  // yᵀ[M×N] = w[M×K] · xᵀ[K×N]; w is stored as the col-major K×M wᵀ
        ta = CUBLAS_OP_T;
        a_ = detail::make_layout(p.in, p.K, p.M, p.ld.w);
        b_ = detail::make_layout(p.in, p.K, p.N, p.ld.x);
        break;
      case gemm_op::at:  // gᵀ[M×K] = dᵀ[M×N] · x[N×K]; x is stored as the col-major K×N xᵀ
        tb = CUBLAS_OP_T;
        n = p.K;
        split_ = split_k_for(p, workspace_cap);
        if (split_.parts > 1) {
          // Slice s: dᵀ and x from token s·depth on, into fp32 partial s (col-major M×K, ld M).
          a_ = detail::make_layout(p.in, p.M, split_.depth, p.ld.w);
          b_ = detail::make_layout(p.in, p.K, split_.depth, p.ld.x);
          detail::set_batch(a_, split_.parts, split_.depth * p.ld.w);
          detail::set_batch(b_, split_.parts, split_.depth * p.ld.x);
          workspace_cap -= split_.partial_bytes;
        } else {
          a_ = detail::make_layout(p.in, p.M, p.N, p.ld.w);
          b_ = detail::make_layout(p.in, p.K, p.N, p.ld.x);
        }
        break;
    }
    if (split_.parts > 1) {
      c_ = detail::make_layout(CUDA_R_32F, m, n, m);
      detail::set_batch(c_, split_.parts, split_.partial_stride);
    } else {
      c_ = detail::make_layout(p.out, m, n, p.ld.y);
    }
    detail::set_desc(desc_.get(), CUBLASLT_MATMUL_DESC_TRANSA, ta);
    detail::set_desc(desc_.get(), CUBLASLT_MATMUL_DESC_TRANSB, tb);

    cublasLtMatmulPreference_t pref_raw = nullptr;
    cublas_check(cublasLtMatmulPreferenceCreate(&pref_raw), "cublasLtMatmulPreferenceCreate");
    const detail::lt_preference pref(pref_raw);
    detail::set_pref(pref.get(), CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                     static_cast<std::uint64_t>(workspace_cap));
    // Only algorithms without a split-K reduction: see "Determinism" at the top of this file.
    detail::set_pref(pref.get(), CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                     static_cast<std::uint32_t>(CUBLASLT_REDUCTION_SCHEME_NONE));
    // The heuristic assumes 256-byte aligned operands unless told; a column slice or an offset
    // view is less aligned, and an algorithm that needs more would fail at launch.
    detail::set_pref(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_w);
    detail::set_pref(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_x);
    detail::set_pref(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_y);
    detail::set_pref(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_y);
    if (fp32_in && !p.allow_tf32) {
      // COMPUTE_32F already means exact fp32; excluding TF32 inputs says so to the heuristic too.
      detail::set_pref(pref.get(), CUBLASLT_MATMUL_PREF_IMPL_MASK,
                       static_cast<std::uint64_t>(~CUBLASLT_NUMERICAL_IMPL_FLAGS_INPUT_TF32));
    }

    // Several candidates, screened here: the reduction-scheme preference alone does not bind
    // every kernel family (on an H200 with cuBLASLt 13.0 the first choice for bf16 and fp16
    // summed well outside fp32 accuracy), so each candidate's own configuration and numerical
    // flags are read back and the first one that keeps the promise above is taken.
    constexpr int wanted = 16;
    cublasLtMatmulHeuristicResult_t results[wanted]{};
    int found = 0;
    const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
        lt, desc_.get(), a_.get(), b_.get(), c_.get(), c_.get(), pref.get(), wanted, results, &found);
    // cuBLASLt reports "nothing fits" as NOT_SUPPORTED rather than as zero results.
    if (status != CUBLAS_STATUS_NOT_SUPPORTED) {
      cublas_check(status, "cublasLtMatmulAlgoGetHeuristic");
    }
    const cublasLtMatmulHeuristicResult_t* chosen = nullptr;
    std::string refused;
    for (int i = 0; status != CUBLAS_STATUS_NOT_SUPPORTED && i < found && chosen == nullptr; ++i) {
      if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
      const std::string why = detail::numerical_refusal(results[i].algo, fp32_in && !p.allow_tf32);
      if (why.empty()) {
        chosen = &results[i];
      } else if (refused.size() < 400) {
        refused += (refused.empty() ? "" : "; ") + why;
      }
    }
    if (chosen == nullptr) {
      throw backend_error(
          "cublasLtMatmulAlgoGetHeuristic", static_cast<int>(CUBLAS_STATUS_NOT_SUPPORTED),
          std::string("no algorithm for ") + gemm_op_name(p.op) + " N=" + std::to_string(p.N) +
              " K=" + std::to_string(p.K) + " M=" + std::to_string(p.M) + " " +
              detail::gemm_type_name(p.in) + "->" + detail::gemm_type_name(p.out) +
              " with alignments x/w/y " + std::to_string(align_x) + "/" + std::to_string(align_w) +
              "/" + std::to_string(align_y) + " bytes, no split-K, fp32 accumulation, workspace " +
              format_bytes(workspace_cap) + (refused.empty() ? "" : " (refused: " + refused + ")"),
          "Use 16-byte aligned operands and leading dimensions that are multiples of 16 bytes, "
          "or report the shape");
    }
    algo_ = chosen->algo;
    algo_workspace_ = chosen->workspaceSize;
  }

  // The chosen algorithm in words (id, tile, stages, split, reduction, numerical flags, and our
  // own split when there is one): what a test prints when a result is off, so the kernel behind
  // it can be named.
  std::string describe() const {
    const std::string algo = detail::describe_algo(algo_);
    if (split_.parts == 1) return algo;
    return "membound split-K " + std::to_string(split_.parts) + " x " + std::to_string(split_.depth) +
           " tokens into fp32 partials, each " + algo;
  }
  // matmul_at's split of this problem (parts == 1: none).
  const split_k_plan& split() const noexcept { return split_; }

  // What the chosen algorithm itself uses (at most the cap passed to the heuristic).
  std::size_t workspace_size() const noexcept { return algo_workspace_; }
  const gemm_problem& problem() const noexcept { return problem_; }

  // Launches y = alpha·product (+ y) on the stream; validated by the caller (can_implement).
  // A split plan writes its partials to the start of the workspace instead (alpha 1, no y):
  // matmul_at sums them into y.
  void run(const cuda_executor& exec, const void* x, const void* w, void* y, float alpha,
           bool accumulate, void* workspace, std::size_t workspace_bytes) const {
    // beta = 0 means C is not read, so garbage (even NaN) in y is overwritten, as on the CPU.
    float beta = accumulate ? 1.0f : 0.0f;
    void* out = y;
    if (split_.parts > 1) {
      alpha = 1.0f;
      beta = 0.0f;
      out = workspace;
      workspace = static_cast<unsigned char*>(workspace) + split_.partial_bytes;
      workspace_bytes -= split_.partial_bytes;
    }
    cublas_check(
        cublasLtMatmul(exec.lt(), desc_.get(), &alpha, w, a_.get(), x, b_.get(), &beta, out,
                       c_.get(), out, c_.get(), &algo_, workspace, workspace_bytes, exec.stream()),
        "cublasLtMatmul");
  }

 private:
  gemm_problem problem_;
  detail::lt_matmul_desc desc_;
  detail::lt_layout a_, b_, c_;
  cublasLtMatmulAlgo_t algo_{};
  std::size_t algo_workspace_ = 0;
  split_k_plan split_{};
};

// Plans by problem, so a training step's repeated shapes run the heuristic once. Thread-safe; a
// plan is never removed while the cache lives, so references handed out stay valid.
class gemm_cache {
 public:
  // The plan for this problem and these pointers' alignments on exec's device.
  const gemm_plan& plan(const cuda_executor& exec, const gemm_problem& p, const void* x,
                        const void* w, const void* y) {
    const detail::gemm_key key{exec.device(),
                               p.op,
                               p.N,
                               p.K,
                               p.M,
                               p.ld.x,
                               p.ld.w,
                               p.ld.y,
                               p.in,
                               p.out,
                               p.in == CUDA_R_32F && p.allow_tf32,
                               p.split_k,
                               detail::address_alignment(x),
                               detail::address_alignment(w),
                               detail::address_alignment(y),
                               workspace_required(exec.device())};
    std::lock_guard lock(mutex_);
    auto it = plans_.find(key);
    if (it != plans_.end()) return *it->second;
    gemm_problem normalized = p;
    normalized.allow_tf32 = key.tf32;
    auto plan = std::make_unique<gemm_plan>(exec.lt(), normalized, key.align_x, key.align_w,
                                            key.align_y, key.workspace_cap);
    return *plans_.emplace(key, std::move(plan)).first->second;
  }

  // gemm_workspace_bytes for a device, looked up once.
  std::size_t workspace_required(int device) {
    std::lock_guard lock(mutex_);
    for (const auto& [d, bytes] : workspace_by_device_) {
      if (d == device) return bytes;
    }
    const std::size_t bytes = gemm_workspace_bytes_for(compute_capability_major(device));
    workspace_by_device_.emplace_back(device, bytes);
    return bytes;
  }

  std::size_t size() const {
    std::lock_guard lock(mutex_);
    return plans_.size();
  }
  void clear() {
    std::lock_guard lock(mutex_);
    plans_.clear();
  }

 private:
  mutable std::mutex mutex_;
  std::unordered_map<detail::gemm_key, std::unique_ptr<gemm_plan>, detail::gemm_key_hash> plans_;
  std::vector<std::pair<int, std::size_t>> workspace_by_device_;
};

// The plans of the layers' GEMMs: one per process, like cuBLAS's own handle-level caches. Plans
// depend on the device and the problem only, never on the stream, so every executor shares it.
inline gemm_cache& shared_gemm_cache() {
  static gemm_cache cache;
  return cache;
}

// What cpu::matmul's thread_pool is to the host: where and with what a GEMM runs. Borrows all.
class gemm_context {
 public:
  gemm_context(const cuda_executor& exec, gemm_cache& cache, void* workspace,
               std::size_t workspace_bytes, gemm_options options = {}) noexcept
      : exec_(&exec),
        cache_(&cache),
        workspace_(workspace),
        workspace_bytes_(workspace_bytes),
        options_(options) {}

  const cuda_executor& exec() const noexcept { return *exec_; }
  gemm_cache& cache() const noexcept { return *cache_; }
  void* workspace() const noexcept { return workspace_; }
  std::size_t workspace_bytes() const noexcept { return workspace_bytes_; }
  const gemm_options& options() const noexcept { return options_; }

 private:
  const cuda_executor* exec_;
  gemm_cache* cache_;
  void* workspace_;
  std::size_t workspace_bytes_;
  gemm_options options_;
};

namespace detail {
// Validates, plans (once per problem) and launches the cuBLASLt call; returns the plan it ran.
// Makes exec's device current for the call when it is not: cuBLASLt launches on the current
// device.
inline const gemm_plan& launch_gemm(const gemm_context& ctx, const gemm_problem& p, const void* x,
                                    const void* w, void* y, bool accumulate) {
  const cuda_executor& exec = ctx.exec();
  const std::size_t required = ctx.cache().workspace_required(exec.device());
  gemm_plan::can_implement(p, x, w, y, ctx.workspace(), ctx.workspace_bytes(), required);
  std::optional<cuda_device_guard> guard;
  if (cuda_current_device() != exec.device()) guard.emplace(exec.device());
  const gemm_plan& plan = ctx.cache().plan(exec, p, x, w, y);
  plan.run(exec, x, w, y, ctx.options().alpha, accumulate, ctx.workspace(), ctx.workspace_bytes());
  return plan;
}
}  // namespace detail

// One cuBLASLt call for any problem, never split (split_k is ignored: the partials need
// matmul_at's reduction kernel).
inline void gemm(const gemm_context& ctx, gemm_problem p, const void* x, const void* w, void* y,
                 bool accumulate) {
  p.split_k = false;
  (void)detail::launch_gemm(ctx, p, x, w, y, accumulate);
}

namespace detail {
template <typename T, typename Out>
gemm_problem make_problem(gemm_op op, std::size_t N, std::size_t K, std::size_t M, ld3 ld,
                          const gemm_options& o) {
  // matmul_at's problems may split (header comment); the other two never do.
  return gemm_problem{op,          N,           K, M, ld, cuda_data_type_v<T>, cuda_data_type_v<Out>,
                      o.allow_tf32, op == gemm_op::at};
}

#if MEMBOUND_CUDA_COMPILER
// g[k·ldg + m] = round(alpha · Σ_s partial_s[k·M + m] (+ g)), s in order: one thread per element,
// so the sum's order is fixed. Partials are col-major M×K (gᵀ), as the batched call wrote them.
template <typename Out>
__global__ void split_k_reduce_kernel(const float* __restrict__ partials, std::size_t parts,
                                      std::size_t stride, std::size_t M, std::size_t K, Out* g,
                                      std::size_t ldg, float alpha, bool accumulate) {
  const std::size_t count = M * K;
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < count;
       i += std::size_t{gridDim.x} * blockDim.x) {
    float sum = 0.0f;
    for (std::size_t s = 0; s < parts; ++s) sum += partials[s * stride + i];
    Out* dst = g + (i / M) * ldg + i % M;
    float v = alpha * sum;
    if constexpr (std::is_same_v<Out, float>) {
      *dst = accumulate ? v + *dst : v;
    } else if constexpr (std::is_same_v<Out, bf16>) {
      auto* h = reinterpret_cast<__nv_bfloat16*>(dst);
      if (accumulate) v += __bfloat162float(*h);
      *h = __float2bfloat16_rn(v);
    } else {
      auto* h = reinterpret_cast<__half*>(dst);
      if (accumulate) v += __half2float(*h);
      *h = __float2half_rn(v);
    }
  }
}
#endif  // MEMBOUND_CUDA_COMPILER
}  // namespace detail

// y[N, M] (+)= alpha · x[N, K] · w[K, M]
template <gemm_element T, gemm_output<T> Out>
void matmul(const gemm_context& ctx, const T* x, const T* w, Out* y, std::size_t N, std::size_t K,
            std::size_t M, bool accumulate, ld3 ld) {
  gemm(ctx, detail::make_problem<T, Out>(gemm_op::nn, N, K, M, ld, ctx.options()), x, w, y,
       accumulate);
}
template <gemm_element T, gemm_output<T> Out>
void matmul(const gemm_context& ctx, const T* x, const T* w, Out* y, std::size_t N, std::size_t K,
            std::size_t M, bool accumulate) {
  matmul(ctx, x, w, y, N, K, M, accumulate, ld3{K, M, M});
}

// y[N, M] (+)= alpha · x[N, K] · w[M, K]ᵀ   (input gradients: dx = dq · Wqᵀ)
template <gemm_element T, gemm_output<T> Out>
void matmul_bt(const gemm_context& ctx, const T* x, const T* w, Out* y, std::size_t N,
               std::size_t K, std::size_t M, bool accumulate, ld3 ld) {
  gemm(ctx, detail::make_problem<T, Out>(gemm_op::bt, N, K, M, ld, ctx.options()), x, w, y,
       accumulate);
}
template <gemm_element T, gemm_output<T> Out>
void matmul_bt(const gemm_context& ctx, const T* x, const T* w, Out* y, std::size_t N,
               std::size_t K, std::size_t M, bool accumulate) {
  matmul_bt(ctx, x, w, y, N, K, M, accumulate, ld3{K, K, M});
}

// g[K, M] (+)= alpha · x[N, K]ᵀ · d[N, M]   (weight gradients). ld.w is d's. Split over N when
// the shape calls for it (split_k_for), with the result summed in a fixed order.
#if MEMBOUND_CUDA_COMPILER
template <gemm_element T, gemm_output<T> Out>
void matmul_at(const gemm_context& ctx, const T* x, const T* d, Out* g, std::size_t N,
               std::size_t K, std::size_t M, bool accumulate, ld3 ld) {
  const gemm_plan& plan = detail::launch_gemm(
      ctx, detail::make_problem<T, Out>(gemm_op::at, N, K, M, ld, ctx.options()), x, d, g,
      accumulate);
  const split_k_plan& sp = plan.split();
  if (sp.parts == 1) return;
  const std::size_t count = K * M;
  const auto grid = static_cast<unsigned>(std::min<std::size_t>((count + 255) / 256, 4096));
  // cuBLASLt launched on the current device, which launch_gemm made exec's for its call.
  std::optional<cuda_device_guard> guard;
  if (cuda_current_device() != ctx.exec().device()) guard.emplace(ctx.exec().device());
  detail::split_k_reduce_kernel<Out><<<grid, 256, 0, ctx.exec().stream()>>>(
      static_cast<const float*>(ctx.workspace()), sp.parts, sp.partial_stride, M, K, g, ld.y,
      ctx.options().alpha, accumulate);
  cuda_executor::check_launch("split_k_reduce_kernel");
}
#else
template <gemm_element T, gemm_output<T> Out>
void matmul_at(const gemm_context&, const T*, const T*, Out*, std::size_t, std::size_t,
               std::size_t, bool, ld3) {
  static_assert(sizeof(T) == 0,
                "membound: gpu::matmul_at may split a weight gradient and sum the slices in its "
                "own kernel: compile this file with nvcc (as .cu), or call gpu::gemm, which never "
                "splits.");
}
#endif  // MEMBOUND_CUDA_COMPILER
template <gemm_element T, gemm_output<T> Out>
void matmul_at(const gemm_context& ctx, const T* x, const T* d, Out* g, std::size_t N,
               std::size_t K, std::size_t M, bool accumulate) {
  matmul_at(ctx, x, d, g, N, K, M, accumulate, ld3{K, M, M});
}

}  // namespace gpu

MEMBOUND_NAMESPACE_END
