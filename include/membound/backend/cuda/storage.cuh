// Device loads and stores of the storage types (float, bf16, fp16) as fp32: what every kernel
// that reads or writes storage uses, the model's (backend/cuda/model.cuh) and the NCCL
// communicator's ordered sums (dist/nccl_communicator.cuh) alike; their 16-byte forms (ld_vec,
// st_vec, raw16) and a warp's lane exchange (lane_xor), which the bandwidth-bound kernels use.
#pragma once

#include <cstddef>
#include <type_traits>

#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"

#if MEMBOUND_CUDA_COMPILER
#include <cuda_fp16.h>
#include <vector_types.h>
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

// v rounded to S's 16 bits (to nearest even; a NaN stays a quiet NaN of its sign, overflow
// reaches inf), float's bits unchanged.
template <typename S>
__device__ inline unsigned storage_bits(float v) {
  if constexpr (std::is_same_v<S, float>) {
    return __float_as_uint(v);
  } else if constexpr (std::is_same_v<S, bf16>) {
    const unsigned u = __float_as_uint(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  } else {
    return __half_as_ushort(__float2half_rn(v));
  }
}

template <typename S>
__device__ inline void st(S* p, std::size_t i, float v) {
  if constexpr (std::is_same_v<S, float>) {
    p[i] = v;
  } else {
    reinterpret_cast<unsigned short*>(p)[i] = static_cast<unsigned short>(storage_bits<S>(v));
  }
}

// The value of a 16-bit storage element held in the low 16 bits of `bits`.
template <typename S>
__device__ inline float from_half_bits(unsigned bits) {
  if constexpr (std::is_same_v<S, bf16>) {
    return __uint_as_float(bits << 16);
  } else {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
  }
}

// 16 bytes moved as one access (a 128-bit load or store).
using raw16 = uint4;

// p[i .. i + W) as floats in W·sizeof(S)/16 16-byte loads: p + i must be 16-byte aligned.
template <unsigned W, typename S>
__device__ inline void ld_vec(const S* p, std::size_t i, float (&v)[W]) {
  static_assert(W * sizeof(S) % 16 == 0, "ld_vec moves whole 16-byte words");
  const raw16* q = reinterpret_cast<const raw16*>(p + i);
#pragma unroll
  for (unsigned k = 0; k < W * sizeof(S) / 16; ++k) {
    const raw16 u = q[k];
    const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (unsigned j = 0; j < 4; ++j) {
      if constexpr (std::is_same_v<S, float>) {
        v[4 * k + j] = __uint_as_float(w[j]);
      } else {  // little-endian: the lower element in the low half
        v[8 * k + 2 * j] = from_half_bits<S>(w[j] & 0xffffu);
        v[8 * k + 2 * j + 1] = from_half_bits<S>(w[j] >> 16);
      }
    }
  }
}

// p[i .. i + W) = v rounded to S (st's rounding), in 16-byte stores: p + i 16-byte aligned.
template <unsigned W, typename S>
__device__ inline void st_vec(S* p, std::size_t i, const float (&v)[W]) {
  static_assert(W * sizeof(S) % 16 == 0, "st_vec moves whole 16-byte words");
  raw16* q = reinterpret_cast<raw16*>(p + i);
#pragma unroll
  for (unsigned k = 0; k < W * sizeof(S) / 16; ++k) {
    unsigned w[4];
#pragma unroll
    for (unsigned j = 0; j < 4; ++j) {
      if constexpr (std::is_same_v<S, float>) {
        w[j] = __float_as_uint(v[4 * k + j]);
      } else {
        w[j] = storage_bits<S>(v[8 * k + 2 * j]) | (storage_bits<S>(v[8 * k + 2 * j + 1]) << 16);
      }
    }
    q[k] = raw16{w[0], w[1], w[2], w[3]};
  }
}

// The value of lane (lane ^ mask) in the calling warp (all 32 lanes take part).
template <typename T>
__device__ inline T lane_xor(T v, unsigned mask) {
  return __shfl_xor_sync(0xffffffffu, v, static_cast<int>(mask));
}

}  // namespace gpu::detail
#endif

MEMBOUND_NAMESPACE_END
