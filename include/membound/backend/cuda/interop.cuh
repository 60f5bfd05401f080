// A CUDA project's own half-precision buffers, handed to membound's layers as they are.
//
// membound's 16-bit storage types (bf16 = Eigen::bfloat16, fp16 = Eigen::half) have exactly the
// bits and layout of CUDA's __nv_bfloat16 and __half: one IEEE bfloat16 / binary16 pattern in 2
// bytes, 2-byte aligned (checked below). So a layer runs on the caller's buffers without a copy
// or a conversion: storage_ptr(p) views a __nv_bfloat16* as the layer's bf16* (a __half* as
// fp16*, a float* as itself), cuda_ptr(q) views it back. The two types never meet inside one
// function: membound's kernels and the caller's touch the memory in separate launches.
//
//   __nv_bfloat16* x = ...;   // the project's activations
//   mlp::forward(shape, weights, membound::storage_ptr(x), membound::storage_ptr(y), ...);
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"

static_assert(sizeof(membound::bf16) == sizeof(__nv_bfloat16) &&
                  alignof(membound::bf16) == alignof(__nv_bfloat16) &&
                  std::is_trivially_copyable_v<membound::bf16>,
              "membound: bf16 must have the layout of __nv_bfloat16.");
static_assert(sizeof(membound::fp16) == sizeof(__half) && alignof(membound::fp16) == alignof(__half) &&
                  std::is_trivially_copyable_v<membound::fp16>,
              "membound: fp16 must have the layout of __half.");

MEMBOUND_NAMESPACE_BEGIN

// The CUDA type with the bits of storage type S: __nv_bfloat16 for bf16, __half for fp16, float.
template <typename S>
struct cuda_type_of {
  static_assert(std::is_same_v<S, float>,
                "membound: cuda_type_of<S> knows bf16, fp16 and float (the layers' storage types).");
  using type = float;
};
template <>
struct cuda_type_of<bf16> {
  using type = __nv_bfloat16;
};
template <>
struct cuda_type_of<fp16> {
  using type = __half;
};
template <typename S>
using cuda_type_t = typename cuda_type_of<S>::type;

// The storage type with the bits of CUDA type C (the inverse of cuda_type_of).
template <typename C>
struct storage_type_of {
  static_assert(std::is_same_v<C, float>,
                "membound: storage_ptr takes __nv_bfloat16*, __half* or float* (the layers' storage types).");
  using type = float;
};
template <>
struct storage_type_of<__nv_bfloat16> {
  using type = bf16;
};
template <>
struct storage_type_of<__half> {
  using type = fp16;
};

// A CUDA buffer as a layer's storage pointer, const kept.
template <typename C>
auto* storage_ptr(C* p) noexcept {
  using S = typename storage_type_of<std::remove_const_t<C>>::type;
  if constexpr (std::is_const_v<C>) {
    return reinterpret_cast<const S*>(p);
  } else {
    return reinterpret_cast<S*>(p);
  }
}

// A layer's storage pointer as the CUDA type, const kept.
template <typename S>
auto* cuda_ptr(S* p) noexcept {
  using C = cuda_type_t<std::remove_const_t<S>>;
  if constexpr (std::is_const_v<S>) {
    return reinterpret_cast<const C*>(p);
  } else {
    return reinterpret_cast<C*>(p);
  }
}

MEMBOUND_NAMESPACE_END
