// Tensor-core attention kernels: mma.sync.m16n8k16 (bf16 or fp16 operands, fp32 accumulation)
// with every fragment in registers, FlashAttention-2's order of work. backend/cuda/attention.cuh launches
// them for bf16/fp16 storage at head_dim <= 128 when gpu::attention_kernel_choice() asks for
// them and the device has them (sm_80 and up, enough opt-in shared memory); otherwise the first
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
// tests/emulation/cuda_emulate.py attention compiles the kernels below the cut marker as host C++ (each
// lane a thread, mma.sync and the shuffles emulated from the PTX ISA's fragment layouts) and
// checks them against a double-precision attention; that is not a GPU run.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "membound/backend/cuda/cuda_backend.cuh"
#include "membound/backend/cuda/cuda_check.cuh"
#include "membound/backend/cuda/model.cuh"
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"

MEMBOUND_NAMESPACE_BEGIN

namespace gpu {

// Which attention kernels the CUDA backend launches for bf16/fp16 storage. One process-wide
// choice (benchmarks and tests compare both in one run). tensor_core is the default since its
// own test cases and the example trainer passed on an H200 (2026-11-27: 6.8-25x the WMMA/SIMT
// pair's TFLOP/s at T = 2k-8k, the trainer's loss within 0.73% after 30 steps); where it cannot
// run (use_mma) the WMMA forward and SIMT backward do. fp32 storage always runs the SIMT kernels.
enum class attention_kernels : unsigned { simt_wmma = 0, tensor_core = 1 };
inline std::atomic<attention_kernels>& attention_kernel_choice() {
  static std::atomic<attention_kernels> choice{attention_kernels::tensor_core};
  return choice;
}

// Rows per CTA (queries in the forward and dQ, keys in dK/dV) and per streamed tile; 4 warps of
// 16 rows each.
inline constexpr unsigned mma_tile = 64;
inline constexpr unsigned mma_threads = 128;

// Halves per shared row: a row-major [64, DM] tile at DM + 8, a transposed [DM, 64] one at 72.
constexpr std::size_t mma_row_stride(unsigned DM) noexcept { return std::size_t{DM} + 8; }
inline constexpr std::size_t mma_tr_stride = std::size_t{mma_tile} + 8;
constexpr std::size_t mma_rm_tile_bytes(unsigned DM) noexcept {
  return 2 * std::size_t{mma_tile} * mma_row_stride(DM);
}
constexpr std::size_t mma_tr_tile_bytes(unsigned DM) noexcept {
  return 2 * std::size_t{DM} * mma_tr_stride;
}
// forward: Q, K row-major, V transposed.     DM 64: 27.0 KiB, DM 128: 52.0 KiB
constexpr std::size_t mma_forward_smem_bytes(unsigned DM) noexcept {
  return 2 * mma_rm_tile_bytes(DM) + mma_tr_tile_bytes(DM);
}
// dQ: Q, dO, K, V row-major, K transposed.   DM 64: 45.0 KiB, DM 128: 86.0 KiB
constexpr std::size_t mma_dq_smem_bytes(unsigned DM) noexcept {
  return 4 * mma_rm_tile_bytes(DM) + mma_tr_tile_bytes(DM);
}
// dK/dV: lse and Δ of the query tile (fp32), K, V, Q, dO row-major, Q and dO transposed.
//                                            DM 64: 54.5 KiB, DM 128: 104.5 KiB
constexpr std::size_t mma_dkdv_smem_bytes(unsigned DM) noexcept {
  return 2 * sizeof(float) * mma_tile + 4 * mma_rm_tile_bytes(DM) + 2 * mma_tr_tile_bytes(DM);
}
// The launchers check the device's opt-in limit against dK/dV's bytes alone: the largest.
static_assert(mma_forward_smem_bytes(64) <= mma_dkdv_smem_bytes(64) &&
                  mma_dq_smem_bytes(64) <= mma_dkdv_smem_bytes(64) &&
                  mma_forward_smem_bytes(128) <= mma_dkdv_smem_bytes(128) &&
                  mma_dq_smem_bytes(128) <= mma_dkdv_smem_bytes(128),
              "membound: the dK/dV pass must need the most shared memory of the three");

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

// The value of lane (lane ^ mask): the quad reductions of a fragment row.
__device__ inline float lane_xor(float v, unsigned mask) {
  return __shfl_xor_sync(0xffffffffu, v, static_cast<int>(mask));
}

// The CTA's dynamic shared memory.
__device__ inline unsigned char* attn_mma_smem() {
  extern __shared__ __align__(16) unsigned char attn_mma_dynamic[];
  return attn_mma_dynamic;
}

// ---- tensor-core kernels (tests/emulation/cuda_emulate.py attention cuts from here) ----
// Fragment coordinates, PTX ISA "mma.m16n8k16": lane = 4·gr + tq. A (16×16, row-major): a[0]
// holds (gr, 2tq..2tq+1), a[1] (gr+8, 2tq..), a[2] (gr, 2tq+8..), a[3] (gr+8, 2tq+8..), low half
// first. B (16×8): b0 holds (k 2tq..2tq+1, n gr), b1 (k 2tq+8.., n gr). C/D (16×8): c[0], c[1] at
// (gr, 2tq), (gr, 2tq+1); c[2], c[3] at (gr+8, 2tq), (gr+8, 2tq+1).

// Two adjacent halves as one 32-bit word (even offsets from a 16-byte base). The tiles are written
// as halves; a __syncthreads separates every such write from these reads.
__device__ inline std::uint32_t lds32(const std::uint16_t* p) {
  return *reinterpret_cast<const std::uint32_t*>(p);
}
template <bool Bf16>
__device__ inline std::uint32_t pack_pair(float lo, float hi) {
  return static_cast<std::uint32_t>(half_bits<Bf16>(lo)) |
         (static_cast<std::uint32_t>(half_bits<Bf16>(hi)) << 16);
}

// Rows [r0, r0 + 64) × columns [0, DM) of a head slice of an fp32 [B·T, width] matrix (first
// column col0), as 16-bit bits: row-major at stride DM + 8 into rm, transposed at stride 72 into
// tr (either may be null). Rows past T and columns past D are zero, so padded products add 0.
template <bool Bf16, unsigned DM>
__device__ inline void mma_load_tile(std::uint16_t* rm, std::uint16_t* tr, const float* src,
                                     std::size_t b, std::size_t T, std::size_t r0,
                                     std::size_t width, std::size_t col0, std::size_t D) {
  constexpr std::size_t LD = mma_row_stride(DM);
  for (unsigned e = threadIdx.x; e < mma_tile * DM; e += mma_threads) {
    const unsigned r = e / DM, d = e % DM;
    const std::size_t row = r0 + r;
    const std::uint16_t h = half_bits<Bf16>(row < T && d < D ? src[(b * T + row) * width + col0 + d]
                                                             : 0.0f);
    if (rm != nullptr) rm[r * LD + d] = h;
    if (tr != nullptr) tr[d * mma_tr_stride + r] = h;
  }
}

// A fragment: rows row0..row0+15, columns k0..k0+15 of a row-major tile of stride LD.
template <std::size_t LD>
__device__ inline void mma_frag_a(std::uint32_t (&a)[4], const std::uint16_t* tile, unsigned row0,
                                  unsigned k0, unsigned lane) {
  const std::uint16_t* p = tile + (row0 + (lane >> 2)) * LD + k0 + 2 * (lane & 3);
  a[0] = lds32(p);
  a[1] = lds32(p + 8 * LD);
  a[2] = lds32(p + 8);
  a[3] = lds32(p + 8 * LD + 8);
}
// B fragment of B[k][n] = tile[n][k]: columns n0..n0+7, k0..k0+15 (pairs run along k, the tile's
// rows).
template <std::size_t LD>
__device__ inline void mma_frag_b(std::uint32_t& b0, std::uint32_t& b1, const std::uint16_t* tile,
                                  unsigned n0, unsigned k0, unsigned lane) {
  const std::uint16_t* p = tile + (n0 + (lane >> 2)) * LD + k0 + 2 * (lane & 3);
  b0 = lds32(p);
  b1 = lds32(p + 8);
}
// The A operand for columns 16kk..16kk+15 of a 16×(8·NT) fp32 accumulator, rounded: the C layout
// of tiles 2kk and 2kk+1 is the A layout of their union.
template <bool Bf16, unsigned NT>
__device__ inline void mma_acc_to_a(std::uint32_t (&a)[4], const float (&c)[NT][4], unsigned kk) {
  a[0] = pack_pair<Bf16>(c[2 * kk][0], c[2 * kk][1]);
  a[1] = pack_pair<Bf16>(c[2 * kk][2], c[2 * kk][3]);
  a[2] = pack_pair<Bf16>(c[2 * kk + 1][0], c[2 * kk + 1][1]);
  a[3] = pack_pair<Bf16>(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

// c += A·Bᵀ for the warp's 16 rows from row0 of the row-major tile `a` and the 8·NT rows of the
// row-major tile `b`, over DM = 16·KB columns (S = Q·Kᵀ, dP = dO·Vᵀ and their transposes).
template <bool Bf16, std::size_t LD, unsigned KB, unsigned NT>
__device__ inline void mma_rows_by_rows(float (&c)[NT][4], const std::uint16_t* a, unsigned row0,
                                        const std::uint16_t* b, unsigned lane) {
#pragma unroll
  for (unsigned n = 0; n < NT; ++n) c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.0f;
#pragma unroll
  for (unsigned kb = 0; kb < KB; ++kb) {
    std::uint32_t fa[4];
    mma_frag_a<LD>(fa, a, row0, 16 * kb, lane);
#pragma unroll
    for (unsigned n = 0; n < NT; ++n) {
      std::uint32_t b0, b1;
      mma_frag_b<LD>(b0, b1, b, 8 * n, 16 * kb, lane);
      mma_16816<Bf16>(c[n], fa, b0, b1);
    }
  }
}
// acc += P·B with P the warp's 16×(8·NT) accumulator rounded to operands (P, dS and their
// transposes) and B[k][n] = bt[n][k] from a transposed tile (V, K, dO, Q), n over DM = 8·DT.
template <bool Bf16, unsigned NT, unsigned DT>
__device__ inline void mma_acc_by_tile(float (&acc)[DT][4], const float (&p)[NT][4],
                                       const std::uint16_t* bt, unsigned lane) {
#pragma unroll
  for (unsigned kk = 0; kk < NT / 2; ++kk) {
    std::uint32_t a[4];
    mma_acc_to_a<Bf16, NT>(a, p, kk);
#pragma unroll
    for (unsigned n = 0; n < DT; ++n) {
      std::uint32_t b0, b1;
      mma_frag_b<mma_tr_stride>(b0, b1, bt, 8 * n, 16 * kk, lane);
      mma_16816<Bf16>(acc[n], a, b0, b1);
    }
  }
}

// The warp's accumulator rows (row0 + gr and row0 + gr + 8 of the batch's T) into an fp32
// [B·T, width] matrix from column col0; rows past T and columns past D are not written.
template <unsigned DT>
__device__ inline void mma_store_rows(float* dst, const float (&acc)[DT][4], std::size_t b,
                                      std::size_t T, std::size_t row0, std::size_t width,
                                      std::size_t col0, std::size_t D, unsigned lane) {
  const unsigned gr = lane >> 2, tq = lane & 3;
#pragma unroll
  for (unsigned r = 0; r < 2; ++r) {
    const std::size_t i = row0 + gr + 8 * r;
    if (i >= T) continue;
#pragma unroll
    for (unsigned n = 0; n < DT; ++n)
#pragma unroll
      for (unsigned c = 0; c < 2; ++c) {
        const std::size_t d = 8 * n + 2 * tq + c;
        if (d < D) dst[(b * T + i) * width + col0 + d] = acc[n][2 * r + c];
      }
  }
}

// Forward: one CTA per (64 queries, head, batch), warp w owns query rows 16w..16w+15 of the
// block. Same outputs as flash_forward_kernel: o (S) and lse (natural log of the unscaled-score
// softmax sum plus the max, fp32). Causal: key tiles past the block's last row are never loaded.
template <typename S, unsigned DM>
__global__ void __launch_bounds__(mma_threads) flash_forward_mma_kernel(
    const float* q, const float* k, const float* v, S* o, float* lse, std::size_t T,
    std::size_t H, std::size_t Hkv, std::size_t D, bool causal, float scale) {
  constexpr bool Bf16 = std::is_same_v<S, bf16>;
  constexpr std::size_t LD = mma_row_stride(DM);
  constexpr unsigned NT = mma_tile / 8, DT = DM / 8, KB = DM / 16;
  static_assert(DM % 16 == 0 && mma_threads == 2 * mma_tile, "membound: 4 warps of 16 rows");
  std::uint16_t* qs = reinterpret_cast<std::uint16_t*>(attn_mma_smem());
  std::uint16_t* ks = qs + mma_tile * LD;
  std::uint16_t* vt = ks + mma_tile * LD;
  const std::size_t q0 = static_cast<std::size_t>(blockIdx.x) * mma_tile;
  const std::size_t h = blockIdx.y, b = blockIdx.z, g = h / (H / Hkv);
  const std::size_t HD = H * D, KD = Hkv * D;
  const unsigned lane = threadIdx.x % 32, w0 = 16 * (threadIdx.x / 32);
  const unsigned gr = lane >> 2, tq = lane & 3;
  mma_load_tile<Bf16, DM>(qs, nullptr, q, b, T, q0, HD, h * D, D);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // rows gr and gr + 8 of the warp
  float acc[DT][4];
#pragma unroll
  for (unsigned n = 0; n < DT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  const std::size_t last = q0 + mma_tile < T ? q0 + mma_tile : T;
  const std::size_t kv_end = causal ? last : T;
  for (std::size_t j0 = 0; j0 < kv_end; j0 += mma_tile) {
    __syncthreads();  // the previous K and V tiles are no longer read
    mma_load_tile<Bf16, DM>(ks, nullptr, k, b, T, j0, KD, g * D, D);
    mma_load_tile<Bf16, DM>(nullptr, vt, v, b, T, j0, KD, g * D, D);
    __syncthreads();
    float s[NT][4];
    mma_rows_by_rows<Bf16, LD, KB, NT>(s, qs, w0, ks, lane);  // S = Q·Kᵀ
    // Scale after the dot (as the backward recomputes it), mask, and the rows' tile maxima. A row
    // past T keeps m = -inf: its correction is 1 and its P row 0, never exp(-inf + inf).
    float mt[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (unsigned n = 0; n < NT; ++n)
#pragma unroll
      for (unsigned e = 0; e < 4; ++e) {
        const std::size_t i = q0 + w0 + gr + 8 * (e >> 1), j = j0 + 8 * n + 2 * tq + (e & 1);
        const bool ok = i < T && j < T && (!causal || j <= i);
        s[n][e] = ok ? s[n][e] * scale : -INFINITY;
        mt[e >> 1] = fmaxf(mt[e >> 1], s[n][e]);
      }
    float corr[2];
#pragma unroll
    for (unsigned r = 0; r < 2; ++r) {
      mt[r] = fmaxf(mt[r], lane_xor(mt[r], 1));
      mt[r] = fmaxf(mt[r], lane_xor(mt[r], 2));
      const float m_new = fmaxf(m[r], mt[r]);
      corr[r] = m_new == -INFINITY ? 1.0f : expf(m[r] - m_new);  // m = -inf first: 0, O is 0
      m[r] = m_new;
      l[r] *= corr[r];
    }
#pragma unroll
    for (unsigned n = 0; n < NT; ++n)
#pragma unroll
      for (unsigned e = 0; e < 4; ++e) {
        const float mr = m[e >> 1];
        const float p = mr == -INFINITY ? 0.0f : expf(s[n][e] - mr);  // masked: exp(-inf) = 0
        s[n][e] = p;
        l[e >> 1] += p;  // this lane's share of the row sum, in fp32 before rounding
      }
#pragma unroll
    for (unsigned n = 0; n < DT; ++n)
#pragma unroll
      for (unsigned e = 0; e < 4; ++e) acc[n][e] *= corr[e >> 1];
    mma_acc_by_tile<Bf16, NT, DT>(acc, s, vt, lane);  // O += P·V, P straight from the registers
  }
#pragma unroll
  for (unsigned r = 0; r < 2; ++r) {
    l[r] += lane_xor(l[r], 1);  // the quad's four shares; every lane gets the same sum
    l[r] += lane_xor(l[r], 2);
    const std::size_t i = q0 + w0 + gr + 8 * r;
    if (i >= T) continue;
    const float inv = 1.0f / l[r];  // l >= 1: the row's max contributes exp(0)
#pragma unroll
    for (unsigned n = 0; n < DT; ++n)
#pragma unroll
      for (unsigned c = 0; c < 2; ++c) {
        const std::size_t d = 8 * n + 2 * tq + c;
        if (d < D) st(o, (b * T + i) * HD + h * D + d, acc[n][2 * r + c] * inv);
      }
    if (tq == 0) lse[(b * H + h) * T + i] = m[r] + logf(l[r]);
  }
}

// dQ: one CTA per (64 queries, head, batch), warp w its 16 rows; key tiles in order up to the
// diagonal. dS = P ⊙ (dP − Δ)·scale with P = exp(S·scale − lse), dQ = dS·K.
template <typename S, unsigned DM>
__global__ void __launch_bounds__(mma_threads) flash_dq_mma_kernel(
    const float* q, const float* k, const float* v, const float* dout, const float* lse,
    const float* delta, float* dq, std::size_t T, std::size_t H, std::size_t Hkv, std::size_t D,
    bool causal, float scale) {
  constexpr bool Bf16 = std::is_same_v<S, bf16>;
  constexpr std::size_t LD = mma_row_stride(DM);
  constexpr unsigned NT = mma_tile / 8, DT = DM / 8, KB = DM / 16;
  std::uint16_t* qs = reinterpret_cast<std::uint16_t*>(attn_mma_smem());
  std::uint16_t* dos = qs + mma_tile * LD;
  std::uint16_t* ks = dos + mma_tile * LD;
  std::uint16_t* vs = ks + mma_tile * LD;
  std::uint16_t* kt = vs + mma_tile * LD;
  const std::size_t q0 = static_cast<std::size_t>(blockIdx.x) * mma_tile;
  const std::size_t h = blockIdx.y, b = blockIdx.z, g = h / (H / Hkv);
  const std::size_t HD = H * D, KD = Hkv * D;
  const unsigned lane = threadIdx.x % 32, w0 = 16 * (threadIdx.x / 32);
  const unsigned gr = lane >> 2, tq = lane & 3;
  mma_load_tile<Bf16, DM>(qs, nullptr, q, b, T, q0, HD, h * D, D);
  mma_load_tile<Bf16, DM>(dos, nullptr, dout, b, T, q0, HD, h * D, D);
  float li[2], di[2];
#pragma unroll
  for (unsigned r = 0; r < 2; ++r) {
    const std::size_t i = q0 + w0 + gr + 8 * r;
    li[r] = i < T ? lse[(b * H + h) * T + i] : 0.0f;
    di[r] = i < T ? delta[(b * H + h) * T + i] : 0.0f;
  }
  float acc[DT][4];
#pragma unroll
  for (unsigned n = 0; n < DT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  const std::size_t last = q0 + mma_tile < T ? q0 + mma_tile : T;
  const std::size_t kv_end = causal ? last : T;
  for (std::size_t j0 = 0; j0 < kv_end; j0 += mma_tile) {
    __syncthreads();
    mma_load_tile<Bf16, DM>(ks, kt, k, b, T, j0, KD, g * D, D);
    mma_load_tile<Bf16, DM>(vs, nullptr, v, b, T, j0, KD, g * D, D);
    __syncthreads();
    float s[NT][4], dp[NT][4];
    mma_rows_by_rows<Bf16, LD, KB, NT>(s, qs, w0, ks, lane);    // S = Q·Kᵀ
    mma_rows_by_rows<Bf16, LD, KB, NT>(dp, dos, w0, vs, lane);  // dP = dO·Vᵀ
#pragma unroll
    for (unsigned n = 0; n < NT; ++n)
#pragma unroll
      for (unsigned e = 0; e < 4; ++e) {
        const std::size_t i = q0 + w0 + gr + 8 * (e >> 1), j = j0 + 8 * n + 2 * tq + (e & 1);
        const bool ok = i < T && j < T && (!causal || j <= i);
        const float p = ok ? expf(s[n][e] * scale - li[e >> 1]) : 0.0f;
        s[n][e] = p * (dp[n][e] - di[e >> 1]) * scale;  // dS
      }
    mma_acc_by_tile<Bf16, NT, DT>(acc, s, kt, lane);  // dQ += dS·K
  }
  mma_store_rows<DT>(dq, acc, b, T, q0 + w0, HD, h * D, D, lane);
}

// dK, dV: one CTA per (64 keys, kv head, batch), warp w its 16 keys; the group's query heads, then
// the query tiles, in a fixed order. Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ as [keys, queries] so P and dS are
// A operands of dV += Pᵀ·dO and dK += dSᵀ·Q. Causal: query tiles before the block's first key
// are skipped.
template <typename S, unsigned DM>
__global__ void __launch_bounds__(mma_threads) flash_dkdv_mma_kernel(
    const float* q, const float* k, const float* v, const float* dout, const float* lse,
    const float* delta, float* dk, float* dv, std::size_t T, std::size_t H, std::size_t Hkv,
    std::size_t D, bool causal, float scale) {
  constexpr bool Bf16 = std::is_same_v<S, bf16>;
  constexpr std::size_t LD = mma_row_stride(DM), LT = mma_tr_stride;
  constexpr unsigned NT = mma_tile / 8, DT = DM / 8, KB = DM / 16;
  float* ls = reinterpret_cast<float*>(attn_mma_smem());
  float* dl = ls + mma_tile;
  std::uint16_t* ks = reinterpret_cast<std::uint16_t*>(dl + mma_tile);
  std::uint16_t* vs = ks + mma_tile * LD;
  std::uint16_t* qs = vs + mma_tile * LD;
  std::uint16_t* dos = qs + mma_tile * LD;
  std::uint16_t* qt = dos + mma_tile * LD;
  std::uint16_t* dot = qt + DM * LT;
  const std::size_t k0 = static_cast<std::size_t>(blockIdx.x) * mma_tile;
  const std::size_t g = blockIdx.y, b = blockIdx.z, group = H / Hkv;
  const std::size_t HD = H * D, KD = Hkv * D;
  const unsigned lane = threadIdx.x % 32, w0 = 16 * (threadIdx.x / 32);
  const unsigned gr = lane >> 2, tq = lane & 3;
  mma_load_tile<Bf16, DM>(ks, nullptr, k, b, T, k0, KD, g * D, D);
  mma_load_tile<Bf16, DM>(vs, nullptr, v, b, T, k0, KD, g * D, D);
  float dka[DT][4], dva[DT][4];
#pragma unroll
  for (unsigned n = 0; n < DT; ++n)
#pragma unroll
    for (unsigned e = 0; e < 4; ++e) dka[n][e] = dva[n][e] = 0.0f;
  const std::size_t i_begin = causal ? k0 : 0;  // k0 is a multiple of the query tile
  for (std::size_t hh = 0; hh < group; ++hh) {
    const std::size_t h = g * group + hh;
    for (std::size_t i0 = i_begin; i0 < T; i0 += mma_tile) {
      __syncthreads();  // the previous query tile is no longer read
      mma_load_tile<Bf16, DM>(qs, qt, q, b, T, i0, HD, h * D, D);
      mma_load_tile<Bf16, DM>(dos, dot, dout, b, T, i0, HD, h * D, D);
      for (unsigned r = threadIdx.x; r < mma_tile; r += mma_threads) {
        const std::size_t row = i0 + r;
        ls[r] = row < T ? lse[(b * H + h) * T + row] : 0.0f;
        dl[r] = row < T ? delta[(b * H + h) * T + row] : 0.0f;
      }
      __syncthreads();
      float st_[NT][4], dpt[NT][4];
      mma_rows_by_rows<Bf16, LD, KB, NT>(st_, ks, w0, qs, lane);   // Sᵀ = K·Qᵀ
      mma_rows_by_rows<Bf16, LD, KB, NT>(dpt, vs, w0, dos, lane);  // dPᵀ = V·dOᵀ
#pragma unroll
      for (unsigned n = 0; n < NT; ++n)
#pragma unroll
        for (unsigned e = 0; e < 4; ++e) {
          const unsigned c = 8 * n + 2 * tq + (e & 1);  // the query's row in the tile
          const std::size_t j = k0 + w0 + gr + 8 * (e >> 1), i = i0 + c;
          const bool ok = i < T && j < T && (!causal || j <= i);
          const float p = ok ? expf(st_[n][e] * scale - ls[c]) : 0.0f;
          st_[n][e] = p;
          dpt[n][e] = p * (dpt[n][e] - dl[c]) * scale;  // dSᵀ
        }
      mma_acc_by_tile<Bf16, NT, DT>(dva, st_, dot, lane);  // dV += Pᵀ·dO
      mma_acc_by_tile<Bf16, NT, DT>(dka, dpt, qt, lane);   // dK += dSᵀ·Q
    }
  }
  mma_store_rows<DT>(dk, dka, b, T, k0 + w0, KD, g * D, D, lane);
  mma_store_rows<DT>(dv, dva, b, T, k0 + w0, KD, g * D, D, lane);
}
// ---- end of the tensor-core kernels ----

}  // namespace detail
}  // namespace gpu

#endif  // MEMBOUND_CUDA_COMPILER

MEMBOUND_NAMESPACE_END
