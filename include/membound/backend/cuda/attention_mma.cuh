// Tensor-core attention kernels: mma.sync.m16n8k16 (bf16 or fp16 operands, fp32 accumulation)
// with every fragment in registers, FlashAttention-2's order of work. backend/cuda/attention.cuh launches
// them for bf16/fp16 storage at head_dim <= 128 when the executor's kernels().attention asks for
// them (the default) and the device has them (sm_80 and up, enough opt-in shared memory); otherwise the first
// kernels (WMMA forward, SIMT backward) run.
//
// What differs from the first kernels, and why:
//   - scores, P and dS never leave registers: an m16n8 accumulator pair is exactly the A operand
//     of the next m16n8k16 product (the FA2 register reuse), so no shared-memory round trip and no
//     one-thread-per-row softmax;
//   - row max and row sum are reduced over the 4 lanes of a quad (__shfl_xor_sync), the running
//     sum stays a per-lane partial until the end (each quad lane sees the same rescale);
//   - shared tiles are 16-bit, rows padded by 8 halves so a warp's 32-bit fragment loads hit 32
//     different banks; operands that are read along the other axis are stored transposed once
//     at load time (V in the forward, K in dQ, Q and dO in dK/dV), so every B fragment is two
//     32-bit loads.
// Rounding: q, k, v, dO to the storage type on their way into shared memory (as the WMMA forward
// did), P and dS to it as operands of the second products; every sum in fp32. No atomics:
// dK/dV and dQ are separate passes with fixed orders, so repeats are bit-identical. With fp16
// storage dO and dS are fp16 operands (smallest normal 6.1e-5), as in FlashAttention-2's fp16
// backward: gradients need the loss scaling fp16 training uses anyway (the trainer's dynamic
// scaler); bf16 has fp32's range.
//
// tests/emulation/cuda_emulate.py attention compiles the kernels (attention_mma_kernels.inl) as
// host C++ (each lane a thread, mma.sync and the shuffles emulated from the PTX ISA's fragment
// layouts) and checks them against a double-precision attention; that is not a GPU run.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "membound/backend/cuda/cuda_backend.cuh"
#include "membound/backend/cuda/cuda_check.cuh"
#include "membound/backend/cuda/model.cuh"
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/shape/attention_shape.hpp"  // attention_band

MEMBOUND_NAMESPACE_BEGIN

namespace gpu {

#include "membound/backend/cuda/attention_mma_sizes.inl"

}  // namespace gpu

#if MEMBOUND_CUDA_COMPILER

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace gpu {
namespace detail {

// --- Device primitives (the emulation supplies its own) -------------------------------------------

// The operand bits of v in the storage's 16-bit type, rounded to nearest even.
template <bool Bf16>
__device__ inline std::uint16_t half_bits(float v) {
  if constexpr (Bf16) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  } else {
    return __half_as_ushort(__float2half_rn(v));
  }
}

// d += a·b for one warp: a is 16×16 (row), b 16×8 (col), d 16×8 fp32, in the PTX ISA's fragment
// layouts. sm_80 and up; the launchers never choose these kernels below that.
template <bool Bf16>
__device__ inline void mma_16816(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                 std::uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (Bf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#else
  (void)d;
  (void)a;
  (void)b0;
  (void)b1;
  __trap();
#endif
}

// lane_xor (the quad reductions of a fragment row): backend/cuda/storage.cuh.

// The CTA's dynamic shared memory.
__device__ inline unsigned char* attn_mma_smem() {
  extern __shared__ __align__(16) unsigned char attn_mma_dynamic[];
  return attn_mma_dynamic;
}

#include "membound/backend/cuda/attention_mma_kernels.inl"

}  // namespace detail
}  // namespace gpu

#endif  // MEMBOUND_CUDA_COMPILER

MEMBOUND_NAMESPACE_END
