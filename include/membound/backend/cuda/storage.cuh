// Device loads and stores of the storage types (float, bf16, fp16) as fp32: what every kernel
// that reads or writes storage uses, the model's (backend/cuda/model.cuh) and the NCCL
// communicator's ordered sums (dist/nccl_communicator.cuh) alike.
#pragma once

#include <cstddef>
#include <type_traits>

#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"

#if MEMBOUND_CUDA_COMPILER
#include <cuda_fp16.h>
#endif

MEMBOUND_NAMESPACE_BEGIN

#if MEMBOUND_CUDA_COMPILER
namespace gpu::detail {

// Loads and stores through the raw bits, so device code depends on no host type's conversions.
template <typename S>
__device__ inline float ld(const S* p, std::size_t i) {
  if constexpr (std::is_same_v<S, float>) {
    return p[i];
  } else if constexpr (std::is_same_v<S, bf16>) {
    const unsigned short bits = reinterpret_cast<const unsigned short*>(p)[i];
    return __uint_as_float(static_cast<unsigned>(bits) << 16);  // exact: bf16 is a float's top half
  } else {
    return __half2float(__ushort_as_half(reinterpret_cast<const unsigned short*>(p)[i]));
  }
}

template <typename S>
__device__ inline void st(S* p, std::size_t i, float v) {
  if constexpr (std::is_same_v<S, float>) {
    p[i] = v;
  } else if constexpr (std::is_same_v<S, bf16>) {
    unsigned u = __float_as_uint(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      u = (u >> 16) | 0x40u;  // NaN stays a quiet NaN of its sign
    } else {
      u = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;  // round to nearest even; overflow reaches inf
    }
    reinterpret_cast<unsigned short*>(p)[i] = static_cast<unsigned short>(u);
  } else {
    reinterpret_cast<unsigned short*>(p)[i] = __half_as_ushort(__float2half_rn(v));
  }
}

}  // namespace gpu::detail
#endif

MEMBOUND_NAMESPACE_END
