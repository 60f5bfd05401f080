// Attention on the GPU: the kernels that attention<..., cuda_backend> runs. The CPU layer
// (layers/attention.hpp, backend/cpu/attention.hpp) is the specification; this file is its
// device twin, keyed by the shape type (backend_kernels<cuda_backend, attention_shape>), so it
// needs the shape only: the layer owns the argument checks and the saved layout (O in storage,
// lse in fp32, and q, k, v in fp32 under save_all), this owns the device workspace and launches.
//
// Structure (FlashAttention-2 order of work, no T×T matrix anywhere):
//   forward   q, k, v = x·W (cuBLASLt, fp32 out); RoPE as a separate in-place kernel over q and k
//             (cleaner than fusing it into the tile loads: backward needs the rotated q, k too and
//             undoes RoPE on dq, dk with the same kernel); flash_forward: one CTA per (query tile,
//             head, batch), K/V tiles streamed through shared memory, online softmax in fp32,
//             the GQA head mapping h -> h / (H / Hkv) in the loads; y = O·Wo.
//   backward  dO = dy·Woᵀ, Δ = rowsum(dO ⊙ O); flash_dkdv: one CTA per (key tile, kv head,
//             batch) that sums over the group's query heads in a fixed order; flash_dq: a separate
//             pass, one CTA per (query tile, head, batch). No atomics: bit-identical repeats.
//   step      q, k, v for one position, RoPE at position t, k and v appended to the cache, then a
//             split decode: scores of every cached key in parallel (grid over key chunks), then
//             one CTA per (batch, head) reducing max, sum and P·V in a fixed order.
// Causal key tiles entirely above a query tile's diagonal are never loaded (the loop stops at
// the diagonal); only the diagonal tile is masked.
//
// Compute: fp32 storage runs the SIMT kernels below. bf16/fp16 storage at head_dim <= 128 runs
// attention_mma.cuh's mma.sync kernels (forward, dQ and dK/dV with every fragment in registers;
// the default, cuda_executor::kernels().attention = tensor_core) where use_mma allows them, else the
// first kernels (a WMMA forward, the SIMT backward). Both ran on an H200 (2026-11-27).
// No cp.async/TMA yet. The layer's attention_tiles policy sizes the CPU tiles; the device tiles
// are fixed below.
#pragma once

#include <cstddef>
#include <limits>
#include <type_traits>

#include "membound/backend/cuda/attention_mma.cuh"
#include "membound/backend/cuda/cuda_backend.cuh"
#include "membound/backend/cuda/cudnn_attention.cuh"
#include "membound/backend/cuda/gemm.cuh"
#include "membound/backend/cuda/model.cuh"
#include "membound/backend/cuda/packing.cuh"
#include "membound/core/checked_math.hpp"
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/memory/workspace.hpp"
#include "membound/policy/backend.hpp"
#include "membound/shape/attention_shape.hpp"

MEMBOUND_NAMESPACE_BEGIN

namespace gpu {

// Rows of queries (or keys) per CTA, one thread each, and rows per shared-memory tile streamed.
inline constexpr unsigned attn_rows = 64;
inline constexpr unsigned attn_tile = 32;
// Decode: keys scored per thread block of the first pass, and the second pass's block size.
inline constexpr unsigned decode_threads = 256;

// Dynamic shared memory of the flash kernels: two [attn_tile, D] fp32 tiles (K and V forward and
// in the dQ pass; Q and dO in the dK/dV pass) plus two [attn_tile] vectors (lse and Δ).
constexpr std::size_t attention_smem_bytes(std::size_t D) noexcept {
  return sizeof(float) * (2 * std::size_t{attn_tile} * D + 2 * std::size_t{attn_tile});
}

}  // namespace gpu

template <>
struct backend_kernels<cuda_backend, attention_shape> {
  // keep_qkv: the layer's save_all (q, k, v live in `saved`, not in the workspace). The device's
  // tiles are its own (below) and its workspace does not grow with the host's thread count: A,
  // Tiles and `threads` are the host backend's and are ignored here.
  template <typename S, typename A, typename Tiles>
  static constexpr std::size_t forward_workspace_bytes(const attention_shape& s, bool keep_qkv,
                                                       std::size_t /*threads*/) noexcept {
    return fits(s) ? forward_layout<S>(s, keep_qkv).size() : std::numeric_limits<std::size_t>::max();
  }
  template <typename S, typename A, typename Tiles>
  static constexpr std::size_t backward_workspace_bytes(const attention_shape& s, bool keep_qkv,
                                                        std::size_t /*threads*/) noexcept {
    return fits(s) ? backward_layout<S>(s, keep_qkv).size()
                   : std::numeric_limits<std::size_t>::max();
  }
  template <typename S, typename A, typename Tiles>
  static constexpr std::size_t step_workspace_bytes(const attention_shape& s, std::size_t slots,
                                                    std::size_t /*threads*/) noexcept {
    return fits(s) && bytes_of<float>(s.batch, s.heads, slots) != std::numeric_limits<std::size_t>::max()
               ? step_layout<S>(s, slots).size()
               : std::numeric_limits<std::size_t>::max();
  }

 private:
  static constexpr bool fits(const attention_shape& s) noexcept {
    constexpr std::size_t m = std::numeric_limits<std::size_t>::max();
    return bytes_of<float>(s.batch, s.seq, s.heads, s.head_dim) != m &&
           bytes_of<float>(s.batch, s.seq, s.d_model) != m &&
           bytes_of<float>(s.d_model, s.heads, s.head_dim) != m &&
           packed_offsets_bytes(s.sequences) < detail::huge_slot;  // a sizing call's `sequences`
  }
  static constexpr std::size_t rows(const attention_shape& s) noexcept { return s.batch * s.seq; }
  static constexpr std::size_t hd(const attention_shape& s) noexcept { return s.heads * s.head_dim; }
  static constexpr std::size_t kd(const attention_shape& s) noexcept {
    return s.kv_heads * s.head_dim;
  }

  // cuBLASLt's workspace first (256-byte aligned); nothing shares bytes (the layouts are small
  // next to the saved O and the projections, and flat slots keep the proof of "exact" simple).
  // The last slot of forward's and backward's holds packed sequences' offsets (0 bytes if none).
  enum forward_slot : std::size_t { f_gemm, f_q, f_k, f_v, f_offsets };
  template <typename S>
  static constexpr workspace_layout<5> forward_layout(const attention_shape& s, bool keep_qkv) {
    workspace_layout<5> l;
    l.add(gpu::gemm_workspace_bytes_max, gpu::gemm_workspace_alignment);
    l.add(keep_qkv ? 0 : bytes_of<float>(rows(s), hd(s)));
    l.add(keep_qkv ? 0 : bytes_of<float>(rows(s), kd(s)));
    l.add(keep_qkv ? 0 : bytes_of<float>(rows(s), kd(s)));
    l.add(packed_offsets_bytes(s.sequences));
    return l;
  }
  // dq/dk/dv in fp32 for the flash kernels; their S copies feed the GEMMs (cuBLASLt takes both
  // operands in one type), and dx is summed in fp32 then rounded once (0 bytes for fp32).
  enum backward_slot : std::size_t {
    b_gemm, b_q, b_k, b_v, b_dout, b_delta, b_dq, b_dk, b_dv, b_dqs, b_dks, b_dvs, b_dx, b_offsets
  };
  template <typename S>
  static constexpr workspace_layout<14> backward_layout(const attention_shape& s, bool keep_qkv) {
    constexpr bool narrow = !std::is_same_v<S, float>;
    workspace_layout<14> l;
    l.add(gpu::gemm_workspace_bytes_max, gpu::gemm_workspace_alignment);
    l.add(keep_qkv ? 0 : bytes_of<float>(rows(s), hd(s)));
    l.add(keep_qkv ? 0 : bytes_of<float>(rows(s), kd(s)));
    l.add(keep_qkv ? 0 : bytes_of<float>(rows(s), kd(s)));
    l.add(bytes_of<float>(rows(s), hd(s)));                  // dO
    l.add(bytes_of<float>(s.batch, s.heads, s.seq));         // Δ
    l.add(bytes_of<float>(rows(s), hd(s)));                  // dq
    l.add(bytes_of<float>(rows(s), kd(s)));                  // dk
    l.add(bytes_of<float>(rows(s), kd(s)));                  // dv
    l.add(narrow ? bytes_of<S>(rows(s), hd(s)) : 0);
    l.add(narrow ? bytes_of<S>(rows(s), kd(s)) : 0);
    l.add(narrow ? bytes_of<S>(rows(s), kd(s)) : 0);
    l.add(narrow ? bytes_of<float>(rows(s), s.d_model) : 0);  // dx
    l.add(packed_offsets_bytes(s.sequences));
    return l;
  }
  enum step_slot : std::size_t { st_gemm, st_q, st_k, st_v, st_scores, st_o };
  template <typename S>
  static constexpr workspace_layout<6> step_layout(const attention_shape& s, std::size_t slots) {
    workspace_layout<6> l;
    l.add(gpu::gemm_workspace_bytes_max, gpu::gemm_workspace_alignment);
    l.add(bytes_of<float>(s.batch, hd(s)));
    l.add(bytes_of<float>(s.batch, kd(s)));
    l.add(bytes_of<float>(s.batch, kd(s)));
    l.add(bytes_of<float>(s.batch, s.heads, slots));  // one score per cached key
    l.add(bytes_of<S>(s.batch, hd(s)));                 // o, in S: an operand of o·Wo
    return l;
  }

 public:
#if MEMBOUND_CUDA_COMPILER
  // Writes o_s ([B·T, H·D], S) and lse ([B, H, T], fp32); q, k, v are the saved slots under
  // save_all (non-null) or nullptr (then they live in the workspace).
  template <typename S, typename A, typename Tiles>
  static void forward(const attention_shape& s, const S* wq, const S* wk, const S* wv, const S* wo,
                      const S* x, S* y, S* o_s, float* lse, float* q_saved, float* k_saved,
                      float* v_saved, void* workspace, std::size_t workspace_size,
                      const cuda_executor& ex);
  template <typename S, typename A, typename Tiles>
  static void backward(const attention_shape& s, const S* wq, const S* wk, const S* wv,
                       const S* wo, const S* x, const S* o_s, const float* lse,
                       const float* q_saved, const float* k_saved, const float* v_saved,
                       const S* dy, S* dx, S* gwq, S* gwk, S* gwv, S* gwo, void* workspace,
                       std::size_t workspace_size, const cuda_executor& ex);
  // Appends the rotated key and value at position t = `length` to the cache (keys, then values,
  // each [B, Hkv, slots, D] in S) and writes y_t [B, C].
  template <typename S, typename A, typename Tiles>
  static void step(const attention_shape& s, const S* wq, const S* wk, const S* wv, const S* wo,
                   S* cache_keys, S* cache_values, std::size_t slots, std::size_t length,
                   const S* x_t, S* y_t, void* workspace, std::size_t workspace_size,
                   const cuda_executor& ex);
#else
  template <typename S, typename A, typename Tiles, typename... Args>
  static void forward(Args&&...) {
    static_assert(dependent_false<S, A>,
                  "membound: attention<..., cuda_backend>::forward launches CUDA kernels; compile "
                  "this translation unit with nvcc (a .cu file, or LANGUAGE CUDA in CMake).");
  }
  template <typename S, typename A, typename Tiles, typename... Args>
  static void backward(Args&&...) {
    static_assert(dependent_false<S, A>,
                  "membound: attention<..., cuda_backend>::backward launches CUDA kernels; compile "
                  "this translation unit with nvcc (a .cu file, or LANGUAGE CUDA in CMake).");
  }
  template <typename S, typename A, typename Tiles, typename... Args>
  static void step(Args&&...) {
    static_assert(dependent_false<S, A>,
                  "membound: attention<..., cuda_backend>::step launches CUDA kernels; compile "
                  "this translation unit with nvcc (a .cu file, or LANGUAGE CUDA in CMake).");
  }
#endif
};

#if MEMBOUND_CUDA_COMPILER

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

namespace gpu {
namespace detail {

// The per-thread fp32 row registers hold DM >= D values; D itself is a runtime multiple of 8.
constexpr unsigned attn_dm(std::size_t D) noexcept { return D <= 64 ? 64 : (D <= 128 ? 128 : 256); }

// In-place rotate-half RoPE on x [N, heads·D] at position (n % T) + position0, or under packed
// sequences at n − its sequence's start; inverse applies the transpose (the angle negated), for
// dq and dk. Angles in double, as the CPU computes them. X: fp32, or the storage type (cuDNN's
// 16-bit dq and dk, rotated back in place).
template <typename X>
__global__ void rope_kernel(X* x, std::size_t N, std::size_t T, std::size_t heads,
                            std::size_t D, double base, std::size_t position0, bool inverse,
                            packed_sequences packing) {
  const std::size_t half = D / 2;
  const std::size_t total = N * heads * half;
  for (std::size_t idx = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
       idx < total; idx += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::size_t i = idx % half, h = (idx / half) % heads, n = idx / (half * heads);
    const double position =
        static_cast<double>(packing.packed() ? n - packing.begin_of(n) : n % T + position0);
    const double inv_freq = pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(D));
    const double angle = position * inv_freq * (inverse ? -1.0 : 1.0);
    const float c = static_cast<float>(cos(angle)), sn = static_cast<float>(sin(angle));
    X* head = x + n * heads * D + h * D;
    const float x1 = ld(head, i), x2 = ld(head, i + half);
    st(head, i, x1 * c - x2 * sn);
    st(head, i + half, x2 * c + x1 * sn);
  }
}

// Loads rows [r0, r0 + attn_tile) of a [B·T, width] fp32 matrix's head slice into a [attn_tile, D]
// shared tile; rows past T are zero (never read as keys, but kept defined).
__device__ inline void load_tile(float* tile, const float* src, std::size_t b, std::size_t T,
                                 std::size_t r0, std::size_t width, std::size_t col0,
                                 std::size_t D) {
  for (std::size_t e = threadIdx.x; e < std::size_t{attn_tile} * D; e += blockDim.x) {
    const std::size_t r = e / D, d = e % D, row = r0 + r;
    tile[e] = row < T ? src[(b * T + row) * width + col0 + d] : 0.0f;
  }
}

// One CTA per (query block of attn_rows, head, batch); thread i owns query row q0 + i: its q, the
// running max m, sum l and the accumulator. Causal: key tiles start past the block's last row are
// never loaded.
template <typename S, unsigned DM>
__global__ void __launch_bounds__(attn_rows) flash_forward_kernel(
    const float* q, const float* k, const float* v, S* o, float* lse, std::size_t T,
    std::size_t H, std::size_t Hkv, std::size_t D, attention_band band, float scale) {
  extern __shared__ float smem[];
  float* ks = smem;
  float* vs = smem + std::size_t{attn_tile} * D;
  const std::size_t q0 = static_cast<std::size_t>(blockIdx.x) * attn_rows;
  const std::size_t h = blockIdx.y, b = blockIdx.z, g = h / (H / Hkv);
  const std::size_t HD = H * D, KD = Hkv * D;
  const std::size_t i = q0 + threadIdx.x;
  const bool row_ok = i < T;
  // The row's keys [key_begin, key_end), read once (packed: a search of the offsets).
  const std::size_t key_begin = row_ok ? band.key_begin(i) : 0, key_end = row_ok ? band.key_end(i) : 0;
  float qr[DM], acc[DM];
#pragma unroll
  for (unsigned d = 0; d < DM; ++d) {
    qr[d] = (row_ok && d < D) ? q[(b * T + i) * HD + h * D + d] : 0.0f;
    acc[d] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  const std::size_t last = q0 + attn_rows < T ? q0 + attn_rows : T;  // one past the block's rows
  // Key tiles outside the block's band are never loaded.
  const std::size_t kv_end = band.key_end(last - 1);
  for (std::size_t j0 = band.key_begin(q0) / attn_tile * attn_tile; j0 < kv_end; j0 += attn_tile) {
    __syncthreads();  // the previous tile is no longer read
    load_tile(ks, k, b, T, j0, KD, g * D, D);
    load_tile(vs, v, b, T, j0, KD, g * D, D);
    __syncthreads();
    if (!row_ok) continue;
    for (unsigned jj = 0; jj < attn_tile; ++jj) {
      const std::size_t j = j0 + jj;
      if (j >= key_end) break;  // later keys of the tile are masked too
      if (j < key_begin) continue;
      const float* kr = ks + std::size_t{jj} * D;
      float sc = 0.0f;
#pragma unroll
      for (unsigned d = 0; d < DM; ++d)
        if (d < D) sc += qr[d] * kr[d];
      sc *= scale;  // scaled after the dot, as the backward kernels recompute it
      // The row's first visible key makes m finite, and exp(-inf) = 0 handles that first rescale.
      const float m_new = sc > m ? sc : m;
      const float corr = expf(m - m_new);
      const float p = expf(sc - m_new);
      l = l * corr + p;
      const float* vr = vs + std::size_t{jj} * D;
#pragma unroll
      for (unsigned d = 0; d < DM; ++d)
        if (d < D) acc[d] = acc[d] * corr + p * vr[d];
      m = m_new;
    }
  }
  if (!row_ok) return;
  const float inv = 1.0f / l;  // l >= 1: the row's max contributes exp(0)
#pragma unroll
  for (unsigned d = 0; d < DM; ++d)
    if (d < D) st(o, (b * T + i) * HD + h * D + d, acc[d] * inv);
  lse[(b * H + h) * T + i] = m + logf(l);  // natural log, unscaled scores: S = q·kᵀ/√D
}

// ---- Tensor-core forward (bf16/fp16 storage, D <= 128) ------------------------------------------
// WMMA m16n16k16 with fp32 accumulation. One CTA of 4 warps per (64-query block, head, batch);
// K/V tiles of 64 keys. Q, K, V are rounded to the storage type on their way into shared memory
// (the fp32 path keeps them fp32). WMMA's fragment layouts are opaque, so scores, the PV product
// and the running output all pass through shared memory: warp w computes rows 16w..16w+15 of
// S = Q·Kᵀ, the 64 row threads run the online softmax on S (fp32) and write P, then warp w
// computes its rows of P·V and rescales its rows of the output by the row's correction factor.
inline constexpr unsigned wmma_rows = 64, wmma_keys = 64, wmma_threads = 128;

template <typename S>
using wmma_half_t = std::conditional_t<std::is_same_v<S, bf16>, __nv_bfloat16, __half>;

template <typename H>
__device__ inline H to_half(float v) {
  if constexpr (std::is_same_v<H, __nv_bfloat16>) {
    return __float2bfloat16_rn(v);
  } else {
    return __float2half_rn(v);
  }
}

// Bytes: fp32 O, PV scratch [64, DM] each, S [64, 64], m/l/corr [64] each; then the 16-bit Q, K, V
// [64, DM] each and P [64, 64]. Every WMMA pointer below is a multiple of 32 bytes from the base.
constexpr std::size_t wmma_forward_smem_bytes(unsigned DM) noexcept {
  return sizeof(float) * (2 * std::size_t{wmma_rows} * DM + std::size_t{wmma_rows} * wmma_keys +
                          3 * std::size_t{wmma_rows}) +
         2 * (3 * std::size_t{wmma_rows} * DM + std::size_t{wmma_rows} * wmma_keys);
}

template <typename H>
__device__ inline void load_tile_half(H* tile, const float* src, std::size_t b, std::size_t T,
                                      std::size_t r0, std::size_t width, std::size_t col0,
                                      std::size_t D, unsigned DM) {
  for (std::size_t e = threadIdx.x; e < std::size_t{wmma_rows} * DM; e += blockDim.x) {
    const std::size_t r = e / DM, d = e % DM, row = r0 + r;
    tile[e] = to_half<H>(row < T && d < D ? src[(b * T + row) * width + col0 + d] : 0.0f);
  }
}

template <typename S, unsigned DM>
__global__ void __launch_bounds__(wmma_threads) flash_forward_wmma_kernel(
    const float* q, const float* k, const float* v, S* o, float* lse, std::size_t T,
    std::size_t H, std::size_t Hkv, std::size_t D, attention_band band, float scale) {
  namespace wmma = nvcuda::wmma;
  using HT = wmma_half_t<S>;
  static_assert(DM % 16 == 0 && wmma_rows == wmma_keys && wmma_rows == 16 * (wmma_threads / 32),
                "membound: one 16-row WMMA block per warp");
  extern __shared__ __align__(128) unsigned char attn_wmma_smem[];
  float* os = reinterpret_cast<float*>(attn_wmma_smem);
  float* ts = os + std::size_t{wmma_rows} * DM;
  float* ss = ts + std::size_t{wmma_rows} * DM;
  float* ms = ss + std::size_t{wmma_rows} * wmma_keys;
  float* ls = ms + wmma_rows;
  float* cs = ls + wmma_rows;
  HT* qs = reinterpret_cast<HT*>(cs + wmma_rows);
  HT* ks = qs + std::size_t{wmma_rows} * DM;
  HT* vs = ks + std::size_t{wmma_keys} * DM;
  HT* ps = vs + std::size_t{wmma_keys} * DM;

  const std::size_t q0 = static_cast<std::size_t>(blockIdx.x) * wmma_rows;
  const std::size_t h = blockIdx.y, b = blockIdx.z, g = h / (H / Hkv);
  const std::size_t HD = H * D, KD = Hkv * D;
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  load_tile_half(qs, q, b, T, q0, HD, h * D, D, DM);
  for (std::size_t e = threadIdx.x; e < std::size_t{wmma_rows} * DM; e += blockDim.x) os[e] = 0.0f;
  if (threadIdx.x < wmma_rows) {
    ms[threadIdx.x] = -INFINITY;
    ls[threadIdx.x] = 0.0f;
  }
  const std::size_t last = q0 + wmma_rows < T ? q0 + wmma_rows : T;
  const std::size_t kv_end = band.key_end(last - 1);  // key tiles outside the band are never loaded
  for (std::size_t j0 = band.key_begin(q0) / wmma_keys * wmma_keys; j0 < kv_end; j0 += wmma_keys) {
    __syncthreads();  // the previous tile's K, V, S, P are no longer read
    load_tile_half(ks, k, b, T, j0, KD, g * D, D, DM);
    load_tile_half(vs, v, b, T, j0, KD, g * D, D, DM);
    __syncthreads();
    // S = Q·Kᵀ, warp w: rows 16w..16w+15, all 64 key columns.
    for (unsigned n = 0; n < wmma_keys / 16; ++n) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.0f);
      for (unsigned kk = 0; kk < DM / 16; ++kk) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, HT, wmma::row_major> fa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, HT, wmma::col_major> fb;  // Kᵀ
        wmma::load_matrix_sync(fa, qs + std::size_t{16 * warp} * DM + 16 * kk, DM);
        wmma::load_matrix_sync(fb, ks + std::size_t{16 * n} * DM + 16 * kk, DM);
        wmma::mma_sync(acc, fa, fb, acc);
      }
      wmma::store_matrix_sync(ss + std::size_t{16 * warp} * wmma_keys + 16 * n, acc, wmma_keys,
                              wmma::mem_row_major);
    }
    __syncthreads();
    // Online softmax, one thread per query row. A row past T (or, defensively, a row with every
    // key masked) keeps m = -inf: its correction is 1 and its P row 0, never exp(-inf + inf).
    if (threadIdx.x < wmma_rows) {
      const unsigned r = threadIdx.x;
      const std::size_t i = q0 + r;
      // The row's keys [kb, ke), read once per tile (packed: a search of the offsets).
      const std::size_t kb = i < T ? band.key_begin(i) : 0, ke = i < T ? band.key_end(i) : 0;
      float* srow = ss + std::size_t{r} * wmma_keys;
      float mt = -INFINITY;
      for (unsigned c = 0; c < wmma_keys; ++c) {
        const std::size_t j = j0 + c;
        const bool ok = j < T && kb <= j && j < ke;
        srow[c] = ok ? srow[c] * scale : -INFINITY;
        mt = fmaxf(mt, srow[c]);
      }
      const float m_old = ms[r];
      const float m_new = fmaxf(m_old, mt);
      float corr = 1.0f, sum = 0.0f;
      if (m_new != -INFINITY) {
        corr = expf(m_old - m_new);  // m_old = -inf on the first tile: 0, and O is still 0
        for (unsigned c = 0; c < wmma_keys; ++c) {
          const float p = expf(srow[c] - m_new);  // masked: exp(-inf) = 0
          sum += p;
          ps[std::size_t{r} * wmma_keys + c] = to_half<HT>(p);
        }
      } else {
        for (unsigned c = 0; c < wmma_keys; ++c) ps[std::size_t{r} * wmma_keys + c] = to_half<HT>(0.0f);
      }
      ms[r] = m_new;
      ls[r] = ls[r] * corr + sum;
      cs[r] = corr;
    }
    __syncthreads();
    // O = O·corr + P·V, warp w: its 16 rows, all DM columns (PV into ts, then the rescale).
    for (unsigned n = 0; n < DM / 16; ++n) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.0f);
      for (unsigned kk = 0; kk < wmma_keys / 16; ++kk) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, HT, wmma::row_major> fa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, HT, wmma::row_major> fb;
        wmma::load_matrix_sync(fa, ps + std::size_t{16 * warp} * wmma_keys + 16 * kk, wmma_keys);
        wmma::load_matrix_sync(fb, vs + std::size_t{16 * kk} * DM + 16 * n, DM);
        wmma::mma_sync(acc, fa, fb, acc);
      }
      wmma::store_matrix_sync(ts + std::size_t{16 * warp} * DM + 16 * n, acc, DM,
                              wmma::mem_row_major);
    }
    __syncwarp();  // the warp's own rows of ts are written
    for (unsigned e = lane; e < 16 * DM; e += 32) {
      const std::size_t idx = std::size_t{16 * warp} * DM + e;
      os[idx] = os[idx] * cs[16 * warp + e / DM] + ts[idx];
    }
  }
  __syncthreads();
  for (std::size_t e = threadIdx.x; e < std::size_t{wmma_rows} * DM; e += blockDim.x) {
    const std::size_t r = e / DM, d = e % DM, i = q0 + r;
    if (i < T && d < D) st(o, (b * T + i) * HD + h * D + d, os[e] / ls[r]);
  }
  if (threadIdx.x < wmma_rows && q0 + threadIdx.x < T) {
    lse[(b * H + h) * T + q0 + threadIdx.x] = ms[threadIdx.x] + logf(ls[threadIdx.x]);
  }
}

// Δ[b, h, t] = Σ_d dO ⊙ O over head h of row (b, t).
template <typename S>
__global__ void attention_delta_kernel(const float* dout, const S* o, float* delta, std::size_t B,
                                       std::size_t T, std::size_t H, std::size_t D) {
  const std::size_t idx = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (idx >= B * T * H) return;
  const std::size_t h = idx % H, n = idx / H, b = n / T, t = n % T;
  float acc = 0.0f;
  for (std::size_t d = 0; d < D; ++d) {
    const std::size_t e = n * H * D + h * D + d;
    acc += dout[e] * ld(o, e);
  }
  delta[(b * H + h) * T + t] = acc;
}

// dK, dV: one CTA per (key block of attn_rows, kv head, batch); thread j owns key row k0 + j and
// sums over the group's query heads and the query tiles in a fixed order (deterministic). Causal:
// query tiles that end before the block's first key are skipped.
template <unsigned DM>
__global__ void __launch_bounds__(attn_rows) flash_dkdv_kernel(
    const float* q, const float* k, const float* v, const float* dout, const float* lse,
    const float* delta, float* dk, float* dv, std::size_t T, std::size_t H, std::size_t Hkv,
    std::size_t D, attention_band band, float scale) {
  extern __shared__ float smem[];
  float* qs = smem;
  float* dos = smem + std::size_t{attn_tile} * D;
  float* ls = smem + 2 * std::size_t{attn_tile} * D;
  float* ds = ls + attn_tile;
  const std::size_t k0 = static_cast<std::size_t>(blockIdx.x) * attn_rows;
  const std::size_t g = blockIdx.y, b = blockIdx.z, group = H / Hkv;
  const std::size_t HD = H * D, KD = Hkv * D;
  const std::size_t j = k0 + threadIdx.x;
  const bool row_ok = j < T;
  // The queries that see key j, [query_begin, query_end), read once.
  const std::size_t query_begin = row_ok ? band.query_begin(j) : 0,
                    query_end = row_ok ? band.query_end(j) : 0;
  float kr[DM], vr[DM], dkr[DM], dvr[DM];
#pragma unroll
  for (unsigned d = 0; d < DM; ++d) {
    const bool in = row_ok && d < D;
    kr[d] = in ? k[(b * T + j) * KD + g * D + d] : 0.0f;
    vr[d] = in ? v[(b * T + j) * KD + g * D + d] : 0.0f;
    dkr[d] = 0.0f;
    dvr[d] = 0.0f;
  }
  // Query tiles outside the block's band are skipped.
  const std::size_t i_begin = band.query_begin(k0) / attn_tile * attn_tile;
  const std::size_t i_end = band.query_end((k0 + attn_rows < T ? k0 + attn_rows : T) - 1);
  for (std::size_t hh = 0; hh < group; ++hh) {
    const std::size_t h = g * group + hh;
    for (std::size_t i0 = i_begin; i0 < i_end; i0 += attn_tile) {
      __syncthreads();
      load_tile(qs, q, b, T, i0, HD, h * D, D);
      load_tile(dos, dout, b, T, i0, HD, h * D, D);
      for (unsigned r = threadIdx.x; r < attn_tile; r += blockDim.x) {
        const std::size_t row = i0 + r;
        ls[r] = row < T ? lse[(b * H + h) * T + row] : 0.0f;
        ds[r] = row < T ? delta[(b * H + h) * T + row] : 0.0f;
      }
      __syncthreads();
      if (!row_ok) continue;
      for (unsigned ii = 0; ii < attn_tile; ++ii) {
        const std::size_t i = i0 + ii;
        if (i >= query_end) break;  // query_end <= T
        if (i < query_begin) continue;
        const float* qr = qs + std::size_t{ii} * D;
        const float* dor = dos + std::size_t{ii} * D;
        float sc = 0.0f, dp = 0.0f;
#pragma unroll
        for (unsigned d = 0; d < DM; ++d)
          if (d < D) {
            sc += qr[d] * kr[d];
            dp += dor[d] * vr[d];
          }
        const float p = expf(sc * scale - ls[ii]);
        const float dsc = p * (dp - ds[ii]) * scale;
#pragma unroll
        for (unsigned d = 0; d < DM; ++d)
          if (d < D) {
            dvr[d] += p * dor[d];
            dkr[d] += dsc * qr[d];
          }
      }
    }
  }
  if (!row_ok) return;
#pragma unroll
  for (unsigned d = 0; d < DM; ++d)
    if (d < D) {
      dk[(b * T + j) * KD + g * D + d] = dkr[d];
      dv[(b * T + j) * KD + g * D + d] = dvr[d];
    }
}

// dQ: one CTA per (query block, head, batch), thread i owns query row q0 + i; keys in order.
template <unsigned DM>
__global__ void __launch_bounds__(attn_rows) flash_dq_kernel(
    const float* q, const float* k, const float* v, const float* dout, const float* lse,
    const float* delta, float* dq, std::size_t T, std::size_t H, std::size_t Hkv, std::size_t D,
    attention_band band, float scale) {
  extern __shared__ float smem[];
  float* ks = smem;
  float* vs = smem + std::size_t{attn_tile} * D;
  const std::size_t q0 = static_cast<std::size_t>(blockIdx.x) * attn_rows;
  const std::size_t h = blockIdx.y, b = blockIdx.z, g = h / (H / Hkv);
  const std::size_t HD = H * D, KD = Hkv * D;
  const std::size_t i = q0 + threadIdx.x;
  const bool row_ok = i < T;
  // The row's keys [key_begin, key_end), read once (packed: a search of the offsets).
  const std::size_t key_begin = row_ok ? band.key_begin(i) : 0, key_end = row_ok ? band.key_end(i) : 0;
  float qr[DM], dor[DM], dqr[DM];
#pragma unroll
  for (unsigned d = 0; d < DM; ++d) {
    const bool in = row_ok && d < D;
    qr[d] = in ? q[(b * T + i) * HD + h * D + d] : 0.0f;
    dor[d] = in ? dout[(b * T + i) * HD + h * D + d] : 0.0f;
    dqr[d] = 0.0f;
  }
  const float li = row_ok ? lse[(b * H + h) * T + i] : 0.0f;
  const float di = row_ok ? delta[(b * H + h) * T + i] : 0.0f;
  const std::size_t last = q0 + attn_rows < T ? q0 + attn_rows : T;
  const std::size_t kv_end = band.key_end(last - 1);
  for (std::size_t j0 = band.key_begin(q0) / attn_tile * attn_tile; j0 < kv_end; j0 += attn_tile) {
    __syncthreads();
    load_tile(ks, k, b, T, j0, KD, g * D, D);
    load_tile(vs, v, b, T, j0, KD, g * D, D);
    __syncthreads();
    if (!row_ok) continue;
    for (unsigned jj = 0; jj < attn_tile; ++jj) {
      const std::size_t j = j0 + jj;
      if (j >= key_end) break;
      if (j < key_begin) continue;
      const float* kr = ks + std::size_t{jj} * D;
      const float* vr = vs + std::size_t{jj} * D;
      float sc = 0.0f, dp = 0.0f;
#pragma unroll
      for (unsigned d = 0; d < DM; ++d)
        if (d < D) {
          sc += qr[d] * kr[d];
          dp += dor[d] * vr[d];
        }
      const float p = expf(sc * scale - li);
      const float dsc = p * (dp - di) * scale;
#pragma unroll
      for (unsigned d = 0; d < DM; ++d)
        if (d < D) dqr[d] += dsc * kr[d];
    }
  }
  if (!row_ok) return;
#pragma unroll
  for (unsigned d = 0; d < DM; ++d)
    if (d < D) dq[(b * T + i) * HD + h * D + d] = dqr[d];
}

// Writes the rotated k and v of position t into slot t mod L of the cache ([B, Hkv, L, D] each,
// S; under a window the ring's oldest position).
template <typename S>
__global__ void cache_append_kernel(const float* k, const float* v, S* ck, S* cv, std::size_t B,
                                    std::size_t Hkv, std::size_t L, std::size_t D, std::size_t t) {
  const std::size_t idx = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (idx >= B * Hkv * D) return;
  const std::size_t d = idx % D, g = (idx / D) % Hkv, b = idx / (D * Hkv);
  const std::size_t dst = ((b * Hkv + g) * L + t % L) * D + d;
  st(ck, dst, k[idx]);
  st(cv, dst, v[idx]);
}

// Decode pass 1: the scaled score of every visible key, positions first .. first + len − 1 (in
// slots p mod L), for every (batch, head), in parallel over keys (the split over the cache): one
// thread per (b, h, key).
template <typename S>
__global__ void decode_scores_kernel(const float* q, const S* ck, float* scores, std::size_t H,
                                     std::size_t Hkv, std::size_t L, std::size_t D,
                                     std::size_t first, std::size_t len, float scale) {
  const std::size_t j = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  const std::size_t h = blockIdx.y, b = blockIdx.z, g = h / (H / Hkv);
  if (j >= len) return;
  const float* qr = q + (b * H + h) * D;
  const std::size_t kbase = ((b * Hkv + g) * L + (first + j) % L) * D;
  float sc = 0.0f;
  for (std::size_t d = 0; d < D; ++d) sc += qr[d] * ld(ck, kbase + d);
  scores[(b * H + h) * L + j] = sc * scale;
}

// Decode pass 2: one CTA of decode_threads per (b, h): the max and the sum of exp over the scores
// (block reductions of fixed shape), then thread d accumulates o_d = Σ_j p_j v_jd in key order.
template <typename S>
__global__ void __launch_bounds__(decode_threads) decode_combine_kernel(
    const float* scores, const S* cv, S* o, std::size_t H, std::size_t Hkv, std::size_t L,
    std::size_t D, std::size_t first, std::size_t len) {
  using reduce = block_allreduce<float, decode_threads>;
  __shared__ typename reduce::storage red;
  const std::size_t h = blockIdx.x, b = blockIdx.y, g = h / (H / Hkv);
  const float* sr = scores + (b * H + h) * L;
  float m = -INFINITY;
  for (std::size_t j = threadIdx.x; j < len; j += decode_threads) m = fmaxf(m, sr[j]);
  m = reduce::run(m, op_max{}, red);
  float l = 0.0f;
  for (std::size_t j = threadIdx.x; j < len; j += decode_threads) l += expf(sr[j] - m);
  l = reduce::run(l, op_sum{}, red);
  const float inv = 1.0f / l;
  for (std::size_t d = threadIdx.x; d < D; d += decode_threads) {
    float acc = 0.0f;
    for (std::size_t j = 0; j < len; ++j)
      acc += expf(sr[j] - m) * ld(cv, ((b * Hkv + g) * L + (first + j) % L) * D + d);
    st(o, (b * H + h) * D + d, acc * inv);
  }
}

template <unsigned DM, typename Kernel>
void set_smem(Kernel kernel, std::size_t bytes) {
  // Above 48 KiB of dynamic shared memory a kernel must opt in (D = 256 needs 64 KiB + 256 B).
  cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(bytes)),
             "cudaFuncSetAttribute(attention)");
}

template <typename X>
void rope(const cuda_executor& ex, X* x, std::size_t N, std::size_t T,
                 std::size_t heads, std::size_t D, double base, std::size_t position0,
                 bool inverse, const packed_sequences& packing = {}) {
  const std::size_t n = N * heads * (D / 2);
  if (n == 0) return;
  const unsigned grid = grid_for(n, 256) < 4096u ? grid_for(n, 256) : 4096u;
  rope_kernel<<<grid, 256, 0, ex.stream()>>>(x, N, T, heads, D, base, position0, inverse, packing);
  cuda_executor::check_launch("rope_kernel");
}

// The shape's band with its packed sequences' offsets staged into the workspace slot `offsets`.
inline attention_band device_band(const cuda_executor& ex, const attention_shape& s,
                                  std::int32_t* offsets) {
  attention_band band = band_of(s);
  band.packing = stage_packing(ex, band.packing, offsets);
  return band;
}

template <typename S, unsigned DM>
void launch_forward(const cuda_executor& ex, const attention_shape& s, const float* q,
                    const float* k, const float* v, S* o, float* lse, const attention_band& band) {
  const std::size_t smem = attention_smem_bytes(s.head_dim);
  set_smem<DM>(flash_forward_kernel<S, DM>, smem);
  const dim3 grid(static_cast<unsigned>((s.seq + attn_rows - 1) / attn_rows),
                  static_cast<unsigned>(s.heads), static_cast<unsigned>(s.batch));
  flash_forward_kernel<S, DM><<<grid, attn_rows, smem, ex.stream()>>>(
      q, k, v, o, lse, s.seq, s.heads, s.kv_heads, s.head_dim, band,
      static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.head_dim))));
  cuda_executor::check_launch("flash_forward_kernel");
}

// The tensor-core forward for bf16/fp16 at D <= 128 (DM 64 or 128).
template <typename S, unsigned DM>
void launch_forward_wmma(const cuda_executor& ex, const attention_shape& s, const float* q,
                         const float* k, const float* v, S* o, float* lse,
                         const attention_band& band) {
  const std::size_t smem = wmma_forward_smem_bytes(DM);  // 80.75 KiB (DM 64), 136.75 KiB (DM 128)
  set_smem<DM>(flash_forward_wmma_kernel<S, DM>, smem);
  const dim3 grid(static_cast<unsigned>((s.seq + wmma_rows - 1) / wmma_rows),
                  static_cast<unsigned>(s.heads), static_cast<unsigned>(s.batch));
  flash_forward_wmma_kernel<S, DM><<<grid, wmma_threads, smem, ex.stream()>>>(
      q, k, v, o, lse, s.seq, s.heads, s.kv_heads, s.head_dim, band,
      static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.head_dim))));
  cuda_executor::check_launch("flash_forward_wmma_kernel");
}

// The tensor-core kernels run when the executor asks for them (kernels().attention), for bf16/fp16 at
// head_dim <= 128, on sm_80 and up with the dK/dV pass's shared memory (the largest of the three)
// within the device's opt-in limit (sm_86/sm_89 have 99 KiB: DM 128 falls back there), and when
// the code the device loads was compiled for compute_80 or later (a build for older targets only,
// JIT-compiled on a newer card, holds a trap where the mma.sync would be).
template <typename S>
bool use_mma(const cuda_executor& ex, std::size_t D) {
  // cudnn falls back to these where cuDNN does not run.
  if (ex.kernels().attention == attention_kernels::simt_wmma || D > 128) return false;
  int major = 0, optin = 0;
  cuda_check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, ex.device()),
             "cudaDeviceGetAttribute(cudaDevAttrComputeCapabilityMajor)");
  cuda_check(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, ex.device()),
             "cudaDeviceGetAttribute(cudaDevAttrMaxSharedMemoryPerBlockOptin)");
  const unsigned dm = D <= 64 ? 64 : 128;
  if (major < 8 || optin <= 0 || static_cast<std::size_t>(optin) < mma_dkdv_smem_bytes(dm)) {
    return false;
  }
  cudaFuncAttributes attr{};
  cuda_check(dm == 64 ? cudaFuncGetAttributes(&attr, flash_dkdv_mma_kernel<S, 64>)
                      : cudaFuncGetAttributes(&attr, flash_dkdv_mma_kernel<S, 128>),
             "cudaFuncGetAttributes(flash_dkdv_mma_kernel)");
  return attr.ptxVersion >= 80;
}

template <typename S, unsigned DM>
void launch_forward_mma(const cuda_executor& ex, const attention_shape& s, const float* q,
                        const float* k, const float* v, S* o, float* lse,
                        const attention_band& band) {
  const std::size_t smem = mma_forward_smem_bytes(DM);
  set_smem<DM>(flash_forward_mma_kernel<S, DM>, smem);
  const dim3 grid(static_cast<unsigned>((s.seq + mma_tile - 1) / mma_tile),
                  static_cast<unsigned>(s.heads), static_cast<unsigned>(s.batch));
  flash_forward_mma_kernel<S, DM><<<grid, mma_threads, smem, ex.stream()>>>(
      q, k, v, o, lse, s.seq, s.heads, s.kv_heads, s.head_dim, band,
      static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.head_dim))));
  cuda_executor::check_launch("flash_forward_mma_kernel");
}

template <typename S, unsigned DM>
void launch_backward_mma(const cuda_executor& ex, const attention_shape& s, const float* q,
                         const float* k, const float* v, const float* dout, const float* lse,
                         const float* delta, float* dq, float* dk, float* dv,
                         const attention_band& band) {
  const unsigned blocks = static_cast<unsigned>((s.seq + mma_tile - 1) / mma_tile);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.head_dim)));
  const std::size_t smem_kv = mma_dkdv_smem_bytes(DM), smem_q = mma_dq_smem_bytes(DM);
  set_smem<DM>(flash_dkdv_mma_kernel<S, DM>, smem_kv);
  flash_dkdv_mma_kernel<S, DM><<<dim3(blocks, static_cast<unsigned>(s.kv_heads),
                                      static_cast<unsigned>(s.batch)),
                                 mma_threads, smem_kv, ex.stream()>>>(
      q, k, v, dout, lse, delta, dk, dv, s.seq, s.heads, s.kv_heads, s.head_dim, band, scale);
  cuda_executor::check_launch("flash_dkdv_mma_kernel");
  set_smem<DM>(flash_dq_mma_kernel<S, DM>, smem_q);
  flash_dq_mma_kernel<S, DM><<<dim3(blocks, static_cast<unsigned>(s.heads),
                                    static_cast<unsigned>(s.batch)),
                               mma_threads, smem_q, ex.stream()>>>(
      q, k, v, dout, lse, delta, dq, s.seq, s.heads, s.kv_heads, s.head_dim, band, scale);
  cuda_executor::check_launch("flash_dq_mma_kernel");
}

template <unsigned DM>
void launch_backward(const cuda_executor& ex, const attention_shape& s, const float* q,
                     const float* k, const float* v, const float* dout, const float* lse,
                     const float* delta, float* dq, float* dk, float* dv,
                         const attention_band& band) {
  const std::size_t smem = attention_smem_bytes(s.head_dim);
  const unsigned blocks = static_cast<unsigned>((s.seq + attn_rows - 1) / attn_rows);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.head_dim)));
  set_smem<DM>(flash_dkdv_kernel<DM>, smem);
  flash_dkdv_kernel<DM><<<dim3(blocks, static_cast<unsigned>(s.kv_heads),
                               static_cast<unsigned>(s.batch)),
                          attn_rows, smem, ex.stream()>>>(q, k, v, dout, lse, delta, dk, dv, s.seq,
                                                          s.heads, s.kv_heads, s.head_dim,
                                                          band, scale);
  cuda_executor::check_launch("flash_dkdv_kernel");
  set_smem<DM>(flash_dq_kernel<DM>, smem);
  flash_dq_kernel<DM><<<dim3(blocks, static_cast<unsigned>(s.heads),
                             static_cast<unsigned>(s.batch)),
                        attn_rows, smem, ex.stream()>>>(q, k, v, dout, lse, delta, dq, s.seq,
                                                        s.heads, s.kv_heads, s.head_dim, band,
                                                        scale);
  cuda_executor::check_launch("flash_dq_kernel");
}

// Our kernels' backward (Δ, then dK/dV and dQ: tensor-core or SIMT), with dq and dk rotated back.
template <typename S>
void backward_kernels(const cuda_executor& ex, const attention_shape& s, const attention_band& band,
                      const float* q, const float* k, const float* v, const S* o_s, const float* dout,
                      const float* lse, float* delta, float* dq, float* dk, float* dv) {
  const std::size_t N = s.batch * s.seq, D = s.head_dim;
  {
    const std::size_t n = N * s.heads;
    attention_delta_kernel<S><<<grid_for(n, 256), 256, 0, ex.stream()>>>(dout, o_s, delta, s.batch, s.seq,
                                                                         s.heads, D);
    cuda_executor::check_launch("attention_delta_kernel");
  }
  bool done = false;
  if constexpr (!std::is_same_v<S, float>) {
    if (use_mma<S>(ex, D)) {
      if (D <= 64) {
        launch_backward_mma<S, 64>(ex, s, q, k, v, dout, lse, delta, dq, dk, dv, band);
      } else {
        launch_backward_mma<S, 128>(ex, s, q, k, v, dout, lse, delta, dq, dk, dv, band);
      }
      done = true;
    }
  }
  if (!done) {
    switch (attn_dm(D)) {
      case 64: launch_backward<64>(ex, s, q, k, v, dout, lse, delta, dq, dk, dv, band); break;
      case 128: launch_backward<128>(ex, s, q, k, v, dout, lse, delta, dq, dk, dv, band); break;
      default: launch_backward<256>(ex, s, q, k, v, dout, lse, delta, dq, dk, dv, band); break;
    }
  }
  rope(ex, dq, N, s.seq, s.heads, D, s.rope_base, 0, true, band.packing);
  rope(ex, dk, N, s.seq, s.kv_heads, D, s.rope_base, 0, true, band.packing);
}

#if defined(MEMBOUND_WITH_CUDNN)
// x (fp32, n values) rounded to S into the first half of its own bytes, through `via` (n values
// of S that are free until the caller writes them): a conversion in place would race.
template <typename S>
S* narrow_in_place(const cuda_executor& ex, float* x, S* via, std::size_t n) {
  convert(ex, static_cast<const float*>(x), via, n);
  S* out = reinterpret_cast<S*>(x);
  cuda_check(cudaMemcpyAsync(out, via, n * sizeof(S), cudaMemcpyDeviceToDevice, ex.stream()),
             "cudaMemcpyAsync(attention: 16-bit copy for cuDNN)");
  return out;
}

// cuDNN's tensors must start on 16 bytes: checked (after the plan, which writes nothing) before
// anything is converted, so that a caller's misaligned buffer means our kernels, not a failed call
// after the fp32 copies are gone.
template <typename... P>
bool cudnn_aligned(const cuda_executor& ex, const P*... p) {
  if (((reinterpret_cast<std::uintptr_t>(p) % 16 == 0) && ...)) return true;
  cudnn_detail::note_fallback(ex, "a tensor not aligned to 16 bytes");
  return false;
}

// `bytes` bytes from p rounded up to 256: cuDNN's workspace.
inline std::pair<void*, std::size_t> aligned_region(std::byte* p, std::size_t bytes) {
  const std::size_t pad = (256 - reinterpret_cast<std::uintptr_t>(p) % 256) % 256;
  return {p + pad, bytes > pad ? bytes - pad : 0};
}

// The forward through cuDNN where it runs: q, k, v (fp32, rotated, in the workspace's own slots)
// become 16-bit copies in the first halves of their slots (through o_s, which the attention writes
// last), and cuDNN's workspace is the q slot's second half. False, with nothing written, otherwise.
template <typename S>
bool cudnn_forward(const cuda_executor& ex, const attention_shape& s, const attention_band& band, float* q,
                   float* k, float* v, S* o_s, float* lse) {
  const std::size_t N = s.batch * s.seq, HD = s.heads * s.head_dim, KD = s.kv_heads * s.head_dim;
  const auto [ws, cap] = aligned_region(reinterpret_cast<std::byte*>(q) + N * HD * sizeof(S),
                                        N * HD * (sizeof(float) - sizeof(S)));
  cudnnHandle_t h = nullptr;
  const auto g = cudnn_sdpa_plan<S>(ex, s, band, false, cap, &h);
  if (!g || !cudnn_aligned(ex, q, k, v, o_s, lse)) return false;
  std::unordered_map<std::int64_t, void*> pack{
      {cudnn_detail::u_q, narrow_in_place(ex, q, o_s, N * HD)},
      {cudnn_detail::u_k, narrow_in_place(ex, k, o_s, N * KD)},
      {cudnn_detail::u_v, narrow_in_place(ex, v, o_s, N * KD)},
      {cudnn_detail::u_o, o_s},
      {cudnn_detail::u_stats, lse}};
  cudnn_detail::execute(ex, *g, h, pack, ws, false);
  return true;
}

// The backward through cuDNN where it runs, writing dq, dk, dv in S (the slots dqs, dks, dvs) still
// rotated. Its 16-bit inputs go to the fp32 dq/dk/dv slots' first halves (dO beside q), and its
// workspace is [region, region + region_bytes), bytes no live slot holds (the caller's choice).
// False, with nothing written, otherwise.
template <typename S>
bool cudnn_backward(const cuda_executor& ex, const attention_shape& s, const attention_band& band,
                    const float* q, const float* k, const float* v, const S* o_s, const float* dout,
                    const float* lse, float* dq, float* dk, float* dv, S* dqs, S* dks, S* dvs,
                    std::byte* region, std::size_t region_bytes) {
  const std::size_t N = s.batch * s.seq, HD = s.heads * s.head_dim, KD = s.kv_heads * s.head_dim;
  const auto [ws, cap] = aligned_region(region, region_bytes);
  S* qs = reinterpret_cast<S*>(dq);
  S* dos = qs + N * HD;
  cudnnHandle_t h = nullptr;
  const auto g = cudnn_sdpa_plan<S>(ex, s, band, true, cap, &h);
  if (!g || !cudnn_aligned(ex, qs, dos, dk, dv, o_s, lse, dqs, dks, dvs)) return false;
  S* ks = reinterpret_cast<S*>(dk);
  S* vs = reinterpret_cast<S*>(dv);
  convert(ex, q, qs, N * HD);
  convert(ex, dout, dos, N * HD);
  convert(ex, k, ks, N * KD);
  convert(ex, v, vs, N * KD);
  std::unordered_map<std::int64_t, void*> pack{
      {cudnn_detail::u_q, qs},   {cudnn_detail::u_k, ks},   {cudnn_detail::u_v, vs},
      {cudnn_detail::u_o, const_cast<S*>(o_s)}, {cudnn_detail::u_do, dos},
      {cudnn_detail::u_stats, const_cast<float*>(lse)},
      {cudnn_detail::u_dq, dqs}, {cudnn_detail::u_dk, dks}, {cudnn_detail::u_dv, dvs}};
  cudnn_detail::execute(ex, *g, h, pack, ws, true);
  return true;
}
#endif

}  // namespace detail
}  // namespace gpu

template <typename S, typename A, typename Tiles>
void backend_kernels<cuda_backend, attention_shape>::forward(
    const attention_shape& s, const S* wq, const S* wk, const S* wv, const S* wo, const S* x,
    S* y, S* o_s, float* lse, float* q_saved, float* k_saved, float* v_saved, void* workspace,
    std::size_t workspace_size, const cuda_executor& ex) {
  gpu::check_types<S, A>();
  const bool keep = q_saved != nullptr;
  const auto ws = carve(forward_layout<S>(s, keep), workspace, workspace_size);
  const std::size_t N = rows(s), C = s.d_model, HD = hd(s), KD = kd(s), D = s.head_dim;
  const gpu::gemm_context ctx(ex, gpu::shared_gemm_cache(), ws.template get<std::byte>(f_gemm),
                              gpu::gemm_workspace_bytes_max);
  float* q = keep ? q_saved : ws.template get<float>(f_q);
  float* k = keep ? k_saved : ws.template get<float>(f_k);
  float* v = keep ? v_saved : ws.template get<float>(f_v);
  const attention_band band = gpu::detail::device_band(ex, s, ws.template get<std::int32_t>(f_offsets));
  gpu::matmul(ctx, x, wq, q, N, C, HD, false);
  gpu::matmul(ctx, x, wk, k, N, C, KD, false);
  gpu::matmul(ctx, x, wv, v, N, C, KD, false);
  gpu::detail::rope(ex, q, N, s.seq, s.heads, D, s.rope_base, 0, false, band.packing);
  gpu::detail::rope(ex, k, N, s.seq, s.kv_heads, D, s.rope_base, 0, false, band.packing);
#if defined(MEMBOUND_WITH_CUDNN)
  if constexpr (std::is_same_v<S, float>) {
    gpu::cudnn_detail::note_fallback(ex, "fp32 storage (cuDNN's flash attention takes bf16/fp16)");
  } else {
    // save_all keeps q, k, v in fp32 for the backward: no slot of ours then holds cuDNN's copies.
    if (keep) {
      gpu::cudnn_detail::note_fallback(ex, "save_all (q, k, v kept in fp32)");
    } else if (gpu::detail::cudnn_forward<S>(ex, s, band, q, k, v, o_s, lse)) {
      gpu::matmul(ctx, static_cast<const S*>(o_s), wo, y, N, HD, C, false);
      return;
    }
  }
#endif
  if constexpr (!std::is_same_v<S, float>) {  // tensor cores: bf16/fp16 storage, D <= 128
    if (gpu::detail::use_mma<S>(ex, D)) {
      if (D <= 64) {
        gpu::detail::launch_forward_mma<S, 64>(ex, s, q, k, v, o_s, lse, band);
      } else {
        gpu::detail::launch_forward_mma<S, 128>(ex, s, q, k, v, o_s, lse, band);
      }
    } else if (D <= 64) {
      gpu::detail::launch_forward_wmma<S, 64>(ex, s, q, k, v, o_s, lse, band);
    } else if (D <= 128) {
      gpu::detail::launch_forward_wmma<S, 128>(ex, s, q, k, v, o_s, lse, band);
    } else {
      gpu::detail::launch_forward<S, 256>(ex, s, q, k, v, o_s, lse, band);
    }
  } else {
  switch (gpu::detail::attn_dm(D)) {
    case 64: gpu::detail::launch_forward<S, 64>(ex, s, q, k, v, o_s, lse, band); break;
    case 128: gpu::detail::launch_forward<S, 128>(ex, s, q, k, v, o_s, lse, band); break;
    default: gpu::detail::launch_forward<S, 256>(ex, s, q, k, v, o_s, lse, band); break;
  }
  }
  gpu::matmul(ctx, static_cast<const S*>(o_s), wo, y, N, HD, C, false);
}

template <typename S, typename A, typename Tiles>
void backend_kernels<cuda_backend, attention_shape>::backward(
    const attention_shape& s, const S* wq, const S* wk, const S* wv, const S* wo, const S* x,
    const S* o_s, const float* lse, const float* q_saved, const float* k_saved,
    const float* v_saved, const S* dy, S* dx, S* gwq, S* gwk, S* gwv, S* gwo, void* workspace,
    std::size_t workspace_size, const cuda_executor& ex) {
  gpu::check_types<S, A>();
  const bool keep = q_saved != nullptr;
  const auto ws = carve(backward_layout<S>(s, keep), workspace, workspace_size);
  const std::size_t N = rows(s), C = s.d_model, HD = hd(s), KD = kd(s), D = s.head_dim;
  const gpu::gemm_context ctx(ex, gpu::shared_gemm_cache(), ws.template get<std::byte>(b_gemm),
                              gpu::gemm_workspace_bytes_max);
  const float* q = q_saved;
  const float* k = k_saved;
  const float* v = v_saved;
  const attention_band band = gpu::detail::device_band(ex, s, ws.template get<std::int32_t>(b_offsets));
  if (!keep) {  // recompute exactly as forward did (same GEMMs, same RoPE kernel)
    float* qw = ws.template get<float>(b_q);
    float* kw = ws.template get<float>(b_k);
    float* vw = ws.template get<float>(b_v);
    gpu::matmul(ctx, x, wq, qw, N, C, HD, false);
    gpu::matmul(ctx, x, wk, kw, N, C, KD, false);
    gpu::matmul(ctx, x, wv, vw, N, C, KD, false);
    gpu::detail::rope(ex, qw, N, s.seq, s.heads, D, s.rope_base, 0, false, band.packing);
    gpu::detail::rope(ex, kw, N, s.seq, s.kv_heads, D, s.rope_base, 0, false, band.packing);
    q = qw;
    k = kw;
    v = vw;
  }
  float* dout = ws.template get<float>(b_dout);
  float* delta = ws.template get<float>(b_delta);
  gpu::matmul_bt(ctx, dy, wo, dout, N, C, HD, false);
  float* dq = ws.template get<float>(b_dq);
  float* dk = ws.template get<float>(b_dk);
  float* dv = ws.template get<float>(b_dv);
  bool in_storage = false;  // dq, dk, dv already in S in the dqs/dks/dvs slots (cuDNN)
#if defined(MEMBOUND_WITH_CUDNN)
  if constexpr (std::is_same_v<S, float>) {
    gpu::cudnn_detail::note_fallback(ex, "fp32 storage (cuDNN's flash attention takes bf16/fp16)");
  } else {
    // cuDNN's workspace: the longest run of bytes that none of the slots live during its call holds
    // (its 16-bit inputs, its outputs, the offsets). The others are dead then: the fp32 q, k, v and
    // dO are copied, Δ is ours alone, dx and cuBLASLt's workspace are used before and after on the
    // same stream. By offset: the layout places slots largest first, not in the order added.
    const std::size_t live[] = {b_dq, b_dk, b_dv, b_dqs, b_dks, b_dvs, b_offsets};
    const auto gap = ws.layout().largest_gap(live);
    in_storage = gpu::detail::cudnn_backward<S>(
        ex, s, band, q, k, v, o_s, dout, lse, dq, dk, dv, ws.template get<S>(b_dqs), ws.template get<S>(b_dks),
        ws.template get<S>(b_dvs), static_cast<std::byte*>(ws.data()) + gap.offset,
        gap.bytes);
  }
#endif
  if (in_storage) {
    gpu::detail::rope(ex, ws.template get<S>(b_dqs), N, s.seq, s.heads, D, s.rope_base, 0, true, band.packing);
    gpu::detail::rope(ex, ws.template get<S>(b_dks), N, s.seq, s.kv_heads, D, s.rope_base, 0, true, band.packing);
  } else {
    gpu::detail::backward_kernels<S>(ex, s, band, q, k, v, o_s, dout, lse, delta, dq, dk, dv);
  }

  gpu::matmul_at(ctx, static_cast<const S*>(o_s), dy, gwo, N, HD, C, true);
  const S* dqs;
  const S* dks;
  const S* dvs;
  if constexpr (std::is_same_v<S, float>) {
    dqs = dq;
    dks = dk;
    dvs = dv;
  } else {
    S* a = ws.template get<S>(b_dqs);
    S* bk = ws.template get<S>(b_dks);
    S* c = ws.template get<S>(b_dvs);
    if (!in_storage) {
      gpu::convert(ex, static_cast<const float*>(dq), a, N * HD);
      gpu::convert(ex, static_cast<const float*>(dk), bk, N * KD);
      gpu::convert(ex, static_cast<const float*>(dv), c, N * KD);
    }
    dqs = a;
    dks = bk;
    dvs = c;
  }
  gpu::matmul_at(ctx, x, dqs, gwq, N, C, HD, true);
  gpu::matmul_at(ctx, x, dks, gwk, N, C, KD, true);
  gpu::matmul_at(ctx, x, dvs, gwv, N, C, KD, true);
  if constexpr (std::is_same_v<S, float>) {
    gpu::matmul_bt(ctx, dqs, wq, dx, N, HD, C, false);
    gpu::matmul_bt(ctx, dks, wk, dx, N, KD, C, true);
    gpu::matmul_bt(ctx, dvs, wv, dx, N, KD, C, true);
  } else {
    float* dxf = ws.template get<float>(b_dx);
    gpu::matmul_bt(ctx, dqs, wq, dxf, N, HD, C, false);
    gpu::matmul_bt(ctx, dks, wk, dxf, N, KD, C, true);
    gpu::matmul_bt(ctx, dvs, wv, dxf, N, KD, C, true);
    gpu::convert(ex, static_cast<const float*>(dxf), dx, N * C);
  }
}

template <typename S, typename A, typename Tiles>
void backend_kernels<cuda_backend, attention_shape>::step(
    const attention_shape& s, const S* wq, const S* wk, const S* wv, const S* wo, S* cache_keys,
    S* cache_values, std::size_t slots, std::size_t length, const S* x_t, S* y_t,
    void* workspace, std::size_t workspace_size, const cuda_executor& ex) {
  gpu::check_types<S, A>();
  const auto ws = carve(step_layout<S>(s, slots), workspace, workspace_size);
  const std::size_t B = s.batch, C = s.d_model, HD = hd(s), KD = kd(s), D = s.head_dim;
  // Positions first .. t are visible (the last W under a window), position p in slot p mod slots.
  const std::size_t t = length, first = attention_band{t + 1, s.window, true}.key_begin(t);
  const std::size_t len = t + 1 - first;
  const gpu::gemm_context ctx(ex, gpu::shared_gemm_cache(), ws.template get<std::byte>(st_gemm),
                              gpu::gemm_workspace_bytes_max);
  float* q = ws.template get<float>(st_q);
  float* k = ws.template get<float>(st_k);
  float* v = ws.template get<float>(st_v);
  gpu::matmul(ctx, x_t, wq, q, B, C, HD, false);
  gpu::matmul(ctx, x_t, wk, k, B, C, KD, false);
  gpu::matmul(ctx, x_t, wv, v, B, C, KD, false);
  gpu::detail::rope(ex, q, B, 1, s.heads, D, s.rope_base, t, false);
  gpu::detail::rope(ex, k, B, 1, s.kv_heads, D, s.rope_base, t, false);
  {
    const std::size_t n = B * KD;
    gpu::detail::cache_append_kernel<S><<<gpu::detail::grid_for(n, 256), 256, 0, ex.stream()>>>(
        k, v, cache_keys, cache_values, B, s.kv_heads, slots, D, t);
    cuda_executor::check_launch("cache_append_kernel");
  }
  float* scores = ws.template get<float>(st_scores);
  S* o = ws.template get<S>(st_o);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  gpu::detail::decode_scores_kernel<S>
      <<<dim3(static_cast<unsigned>((len + 255) / 256), static_cast<unsigned>(s.heads),
              static_cast<unsigned>(B)),
         256, 0, ex.stream()>>>(q, cache_keys, scores, s.heads, s.kv_heads, slots, D, first, len, scale);
  cuda_executor::check_launch("decode_scores_kernel");
  gpu::detail::decode_combine_kernel<S>
      <<<dim3(static_cast<unsigned>(s.heads), static_cast<unsigned>(B)), gpu::decode_threads, 0,
         ex.stream()>>>(scores, cache_values, o, s.heads, s.kv_heads, slots, D, first, len);
  cuda_executor::check_launch("decode_combine_kernel");
  gpu::matmul(ctx, static_cast<const S*>(o), wo, y_t, B, HD, C, false);
}

#endif  // MEMBOUND_CUDA_COMPILER

MEMBOUND_NAMESPACE_END
