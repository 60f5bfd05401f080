// Dense linear algebra shared by the CPU layers: strided Eigen maps over the caller's buffers,
// a GEMM that never touches the heap, row-parallel products with their transposes (for input and
// weight gradients), and the storage <-> accumulator conversions. Each parallel task writes a
// disjoint block and computes it in a fixed order, so results do not depend on the thread count.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>

#include "membound/shape/gemm_shape.hpp"
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/core/error.hpp"
#include "membound/core/parallel.hpp"

MEMBOUND_NAMESPACE_BEGIN

namespace cpu {

template <typename A>
using row_matrix = Eigen::Matrix<A, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <typename A>
using strided_map = Eigen::Map<row_matrix<A>, Eigen::Unaligned, Eigen::OuterStride<>>;
template <typename A>
using const_strided_map = Eigen::Map<const row_matrix<A>, Eigen::Unaligned, Eigen::OuterStride<>>;

template <typename A>
strided_map<A> view(A* p, std::size_t rows, std::size_t cols, std::size_t stride) {
  return strided_map<A>(p, static_cast<Eigen::Index>(rows), static_cast<Eigen::Index>(cols),
                        Eigen::OuterStride<>(static_cast<Eigen::Index>(stride)));
}
template <typename A>
const_strided_map<A> cview(const A* p, std::size_t rows, std::size_t cols, std::size_t stride) {
  return const_strided_map<A>(p, static_cast<Eigen::Index>(rows),
                              static_cast<Eigen::Index>(cols),
                              Eigen::OuterStride<>(static_cast<Eigen::Index>(stride)));
}

// Rows per parallel task in the projections: large enough for Eigen's GEMM to be efficient.
inline constexpr std::size_t row_block = 64;

// Every product goes through gemm(): Eigen's GEMM takes its packing buffers from the stack when
// they fit under EIGEN_STACK_ALLOCATION_LIMIT (128 KiB) and from the heap otherwise. Blocks of at
// most 64 rows x 64 columns x 128 depth keep each buffer at or under 64 KiB even in double, so no
// product touches the heap and the layer's memory is exactly its workspace (test_attention checks
// this with Eigen's EIGEN_RUNTIME_NO_MALLOC guard). The depth chunks are summed in a fixed order,
// so results stay independent of the thread count.
inline constexpr Eigen::Index gemm_rows = 64, gemm_cols = 64, gemm_depth = 128;

// y (+)= alpha · l · r, for Eigen expressions (maps, transposes of maps) of matching shapes.
template <typename Y, typename L, typename R, typename Scalar>
void gemm(Y&& y, const L& l, const R& r, Scalar alpha, bool accumulate) {
  const Eigen::Index m = y.rows(), n = y.cols(), k = l.cols();
  for (Eigen::Index i0 = 0; i0 < m; i0 += gemm_rows) {
    const Eigen::Index mi = std::min(gemm_rows, m - i0);
    for (Eigen::Index j0 = 0; j0 < n; j0 += gemm_cols) {
      const Eigen::Index nj = std::min(gemm_cols, n - j0);
      auto yb = y.block(i0, j0, mi, nj);
      if (!accumulate) yb.setZero();
      for (Eigen::Index k0 = 0; k0 < k; k0 += gemm_depth) {
        const Eigen::Index kk = std::min(gemm_depth, k - k0);
        if (mi == 1 || nj == 1) {
          // A vector: Eigen's GEMV would copy a strided operand into a heap temporary, and a
          // coefficient-wise product needs none (nor does a vector gain from packing).
          yb.noalias() += alpha * l.block(i0, k0, mi, kk).lazyProduct(r.block(k0, j0, kk, nj));
        } else {
          yb.noalias() += alpha * (l.block(i0, k0, mi, kk) * r.block(k0, j0, kk, nj));
        }
      }
    }
  }
}

// A GEMM whose packing buffers come from the caller: Eigen 3.4's own level-3 kernel (pack A and
// B panels, GEBP micro-kernel) driven with blockA/blockB pointing into a workspace span, so a large
// product runs as one Eigen product with no heap and no re-packing per 64x64 block. The blocking
// sizes are fixed constants (not Eigen's runtime cache query) so the scratch size follows from the
// shape alone and the planner stays exact; the depth is cut in kc chunks summed in a fixed order,
// so a result depends on the shape only, never on the thread count.
template <typename A>
struct gemm_blocking {
  // What Eigen's own query picks on the layers' shapes (kc ~ 512, mc up to 512), fixed; measured
  // best of the candidates in bench_gemm. Eigen's view of a row-major y = l·r is the transposed
  // column-major product: its packed "lhs" block (kc x mc) holds r's columns, its "rhs" block
  // (kc x nc) l's rows.
  static constexpr Eigen::Index kc = 512, mc = 512, nc = 256;
};

namespace detail {
constexpr std::size_t align64(std::size_t n) noexcept { return (n + 63) / 64 * 64; }
// Bytes of blockA for a product with `cols` result columns and depth `depth`.
template <typename A>
constexpr std::size_t gemm_block_a_bytes(std::size_t cols, std::size_t depth) noexcept {
  using b = gemm_blocking<A>;
  return align64(std::min<std::size_t>(b::kc, depth) * std::min<std::size_t>(b::mc, cols) * sizeof(A));
}
}  // namespace detail

// Bytes of one thread's packing scratch for a y[rows, cols] = l[rows, depth] · r[depth, cols]
// product (blockA then blockB, 64-byte aligned, + 64 for an unaligned base).
template <typename A>
constexpr std::size_t gemm_scratch_bytes(std::size_t rows, std::size_t cols,
                                         std::size_t depth) noexcept {
  using b = gemm_blocking<A>;
  if (rows == 0 || cols == 0 || depth == 0) return 0;
  return detail::gemm_block_a_bytes<A>(cols, depth) +
         detail::align64(std::min<std::size_t>(b::kc, depth) *
                         std::min<std::size_t>(b::nc, rows) * sizeof(A)) +
         64;
}
// The bound over every shape: enough for any product.
template <typename A>
constexpr std::size_t gemm_scratch_bytes() noexcept {
  using b = gemm_blocking<A>;
  return gemm_scratch_bytes<A>(b::nc, b::mc, b::kc);
}

// One thread's packing buffers, from the workspace.
struct gemm_scratch {
  std::byte* data = nullptr;
  std::size_t bytes = 0;
};

namespace detail {
template <typename A>
class workspace_blocking : public Eigen::internal::level3_blocking<A, A> {
 public:
  workspace_blocking(gemm_scratch s, Eigen::Index rows, Eigen::Index cols, Eigen::Index depth) {
    using b = gemm_blocking<A>;
    const auto p = (reinterpret_cast<std::uintptr_t>(s.data) + 63) & ~std::uintptr_t(63);
    this->m_kc = std::min(b::kc, depth);
    this->m_mc = std::min(b::mc, cols);
    this->m_nc = std::min(b::nc, rows);
    this->m_blockA = reinterpret_cast<A*>(p);
    this->m_blockB = reinterpret_cast<A*>(
        p + gemm_block_a_bytes<A>(static_cast<std::size_t>(cols), static_cast<std::size_t>(depth)));
  }
};
template <typename X>
constexpr int order_of() {
  return (std::remove_cvref_t<X>::Flags & Eigen::RowMajorBit) ? Eigen::RowMajor : Eigen::ColMajor;
}
}  // namespace detail

// y (+)= alpha · l · r through Eigen's kernel with the caller's packing buffers; s holds at least
// gemm_scratch_bytes<A>(rows, cols, depth) (callers check before their parallel loop). y is
// row-major; l and r are maps or transposes of maps (anything with data() and outerStride()).
template <typename Y, typename L, typename R, typename Scalar>
void gemm(Y&& y, const L& l, const R& r, Scalar alpha, bool accumulate, gemm_scratch s) {
  using A = std::remove_cv_t<typename std::remove_cvref_t<Y>::Scalar>;
  static_assert(detail::order_of<Y>() == Eigen::RowMajor, "gemm writes a row-major result");
  const Eigen::Index m = y.rows(), n = y.cols(), k = l.cols();
  if (m == 0 || n == 0) return;
  if (!accumulate) y.setZero();
  if (k == 0) return;
  if constexpr (detail::order_of<L>() == Eigen::RowMajor) {
    if (m == 1) {
      // One row (decoding): Eigen's GEMV reads r once, where packing it would copy all of it
      // first. l's row is contiguous, so the GEMV needs no temporary, and s is not used.
      y.row(0).noalias() += A(alpha) * (l.row(0) * r);
      return;
    }
  }
  detail::workspace_blocking<A> blocking(s, m, n, k);
  Eigen::internal::general_matrix_matrix_product<Eigen::Index, A, detail::order_of<L>(), false, A,
                                                 detail::order_of<R>(), false, Eigen::RowMajor,
                                                 1>::run(m, n, k, l.data(), l.outerStride(),
                                                         r.data(), r.outerStride(), y.data(), 1,
                                                         y.outerStride(), A(alpha), blocking,
                                                         nullptr);
}

// ceil(n / block), without the overflow of (n + block − 1) for a huge block (ttt_state_groups_all).
constexpr std::size_t blocks(std::size_t n, std::size_t block) noexcept {
  return n == 0 ? 0 : (n - 1) / block + 1;
}

namespace detail {
// bf16 <-> float on the raw bits, in loops the compiler vectorizes (Eigen's scalar conversion
// branches on NaN per element and does not vectorize; its packet cast uses vcvtneps2bf16 where the
// CPU has it, which flushes subnormals, so a value would round differently in a vector body than
// in the scalar tail). Same bits as bf16(float): round to nearest even, NaN to a quiet NaN that
// keeps the sign.
inline std::uint16_t bf16_bits_rne(float f) noexcept {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const std::uint32_t nan = ((u >> 16) & 0x8000u) | 0x7fc0u;
  return static_cast<std::uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}
inline float bf16_bits_to_float(std::uint16_t b) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}
}  // namespace detail

// to_accum / from_accum with the same bits, in a form loops vectorize (bf16 with a float
// accumulator goes through the raw bits above; every other pair is dtype.hpp's conversion).
template <typename A, typename S>
inline A load_accum(S v) noexcept {
  if constexpr (std::is_same_v<S, bf16> && std::is_same_v<A, float>) {
    // The raw member, not std::bit_cast of the struct: GCC 12 vectorizes only this form.
    return detail::bf16_bits_to_float(v.value);
  } else {
    return to_accum<A>(v);
  }
}
template <typename S, typename A>
inline S store_accum(A v) noexcept {
  if constexpr (std::is_same_v<S, bf16> && std::is_same_v<A, float>) {
    return std::bit_cast<bf16>(detail::bf16_bits_rne(v));
  } else {
    return from_accum<S>(v);
  }
}

template <typename A, typename S>
void widen(const S* src, std::size_t n, A* dst) {
  for (std::size_t i = 0; i < n; ++i) dst[i] = load_accum<A>(src[i]);
}
template <typename S, typename A>
void narrow(const A* src, std::size_t n, S* dst) {
  for (std::size_t i = 0; i < n; ++i) dst[i] = store_accum<S>(src[i]);
}
// dst += src with one rounding per element (gradients are accumulated by contract).
template <typename S, typename A>
void narrow_add(const A* src, std::size_t n, S* dst) {
  for (std::size_t i = 0; i < n; ++i) dst[i] = store_accum<S>(load_accum<A>(dst[i]) + src[i]);
}
// Σ_{c<n} f(c) in A, in 16 interleaved partial sums folded pairwise then the tail: a fixed order
// (the bits depend on n only) that the compiler vectorizes, where one running sum would not be.
template <typename A, typename F>
A lane_sum(std::size_t n, F&& f) {
  constexpr std::size_t L = 16;
  A lane[L] = {};
  std::size_t c = 0;
  for (; c + L <= n; c += L)
    for (std::size_t j = 0; j < L; ++j) lane[j] += f(c + j);
  for (std::size_t w = L / 2; w > 0; w /= 2)
    for (std::size_t j = 0; j < w; ++j) lane[j] += lane[j + w];
  A total = lane[0];
  for (; c < n; ++c) total += f(c);
  return total;
}

// The same three over a thread pool, in fixed chunks: elementwise, so the bits are those of the
// serial loops for every thread count. Small buffers skip the pool.
inline constexpr std::size_t elementwise_block = std::size_t{1} << 15;
template <typename F>
void for_chunks(thread_pool& pool, std::size_t n, F&& f) {
  if (n <= elementwise_block || pool.size() == 1) {
    f(std::size_t{0}, n);
    return;
  }
  pool.parallel_for(blocks(n, elementwise_block), [&](std::size_t blk, std::size_t) {
    const std::size_t i0 = blk * elementwise_block;
    f(i0, std::min(elementwise_block, n - i0));
  });
}
template <typename A, typename S>
void widen(thread_pool& pool, const S* src, std::size_t n, A* dst) {
  for_chunks(pool, n, [&](std::size_t i0, std::size_t len) { widen(src + i0, len, dst + i0); });
}
template <typename S, typename A>
void narrow(thread_pool& pool, const A* src, std::size_t n, S* dst) {
  for_chunks(pool, n, [&](std::size_t i0, std::size_t len) { narrow(src + i0, len, dst + i0); });
}
template <typename S, typename A>
void narrow_add(thread_pool& pool, const A* src, std::size_t n, S* dst) {
  for_chunks(pool, n,
             [&](std::size_t i0, std::size_t len) { narrow_add(src + i0, len, dst + i0); });
}

// Row-major operands with leading dimensions (shape/gemm_shape.hpp's ld3). The overloads
// without them take contiguous rows.
using ::membound::ld3;

// y[N, M] (+)= x[N, K] · w[K, M]
template <typename A>
void matmul(thread_pool& pool, const A* x, const A* w, A* y, std::size_t N, std::size_t K,
            std::size_t M, bool accumulate, ld3 ld) {
  pool.parallel_for(blocks(N, row_block), [&](std::size_t blk, std::size_t) {
    const std::size_t r0 = blk * row_block, r = std::min(row_block, N - r0);
    auto Y = view(y + r0 * ld.y, r, M, ld.y);
    const auto X = cview(x + r0 * ld.x, r, K, ld.x);
    const auto W = cview(w, K, M, ld.w);
    gemm(Y, X, W, A(1), accumulate);
  });
}
template <typename A>
void matmul(thread_pool& pool, const A* x, const A* w, A* y, std::size_t N, std::size_t K,
            std::size_t M, bool accumulate) {
  matmul(pool, x, w, y, N, K, M, accumulate, ld3{K, M, M});
}

// y[N, M] (+)= x[N, K] · w[M, K]ᵀ   (input gradients: dx = dq · Wqᵀ)
template <typename A>
void matmul_bt(thread_pool& pool, const A* x, const A* w, A* y, std::size_t N, std::size_t K,
               std::size_t M, bool accumulate, ld3 ld) {
  pool.parallel_for(blocks(N, row_block), [&](std::size_t blk, std::size_t) {
    const std::size_t r0 = blk * row_block, r = std::min(row_block, N - r0);
    auto Y = view(y + r0 * ld.y, r, M, ld.y);
    const auto X = cview(x + r0 * ld.x, r, K, ld.x);
    const auto W = cview(w, M, K, ld.w);
    gemm(Y, X, W.transpose(), A(1), accumulate);
  });
}
template <typename A>
void matmul_bt(thread_pool& pool, const A* x, const A* w, A* y, std::size_t N, std::size_t K,
               std::size_t M, bool accumulate) {
  matmul_bt(pool, x, w, y, N, K, M, accumulate, ld3{K, K, M});
}

// g[K, M] (+)= x[N, K]ᵀ · d[N, M]   (weight gradients), in blocks of rows of g. ld.w is d's.
template <typename A>
void matmul_at(thread_pool& pool, const A* x, const A* d, A* g, std::size_t N, std::size_t K,
               std::size_t M, bool accumulate, ld3 ld) {
  pool.parallel_for(blocks(K, row_block), [&](std::size_t blk, std::size_t) {
    const std::size_t c0 = blk * row_block, r = std::min(row_block, K - c0);
    auto G = view(g + c0 * ld.y, r, M, ld.y);
    const auto X = cview(x + c0, N, r, ld.x);
    const auto Dm = cview(d, N, M, ld.w);
    gemm(G, X.transpose(), Dm, A(1), accumulate);
  });
}
template <typename A>
void matmul_at(thread_pool& pool, const A* x, const A* d, A* g, std::size_t N, std::size_t K,
               std::size_t M, bool accumulate) {
  matmul_at(pool, x, d, g, N, K, M, accumulate, ld3{K, M, M});
}

// The same three products with packing buffers from the workspace. Tasks of gemm_row_block rows
// (a fixed partition: the bits do not depend on the thread count) each pack their own blocks, so
// `scratch` holds threads · the per-thread bytes below, from matmul_scratch_bytes.
inline constexpr std::size_t gemm_row_block = 256;

// Weight gradients g[K, M] have as few rows as a width (128-512), so they are cut in tiles of
// rows and columns: at most 256 x 512 (one Eigen product packs its rows' x panel once and d in
// 512-column blocks: bigger tiles gain nothing), and a g that would be one tile is cut in two
// row halves, so that two threads share the trainer's 128 x 128 projections (one tile left one
// of two cores idle: 0.6x one unrestricted Eigen product at 2 threads, bench_gemm). Tiles are
// equal up to a multiple of 16 (a whole number of AVX-512 packets), so 2 or 4 threads get equal
// work. The tiling depends on the shape only, never on the thread count.
inline constexpr std::size_t gemm_at_row_block = 256, gemm_at_col_block = 512;
struct gemm_tiling {
  std::size_t rows, cols;  // of one tile
  std::size_t row_tiles, col_tiles;
  constexpr std::size_t tiles() const noexcept { return row_tiles * col_tiles; }
};
namespace detail {
constexpr std::size_t even_tile(std::size_t n, std::size_t parts) noexcept {
  const std::size_t t = (n + parts - 1) / parts;
  return std::min(n, (t + 15) / 16 * 16);
}
}  // namespace detail
constexpr gemm_tiling matmul_at_tiling(std::size_t K, std::size_t M) noexcept {
  if (K == 0 || M == 0) return {0, 0, 0, 0};
  std::size_t rp = (K - 1) / gemm_at_row_block + 1, cp = (M - 1) / gemm_at_col_block + 1;
  if (rp * cp == 1 && K >= 32) rp = 2;
  const std::size_t r = detail::even_tile(K, rp), c = detail::even_tile(M, cp);
  return {r, c, (K - 1) / r + 1, (M - 1) / c + 1};
}

// Per thread, for y[N, M] = x[N, K]·w (and ·wᵀ): tasks of at most gemm_row_block rows. One row
// (x is row-major) runs gemm's GEMV, which packs nothing.
template <typename A>
constexpr std::size_t matmul_thread_scratch_bytes(std::size_t N, std::size_t K,
                                                  std::size_t M) noexcept {
  return N == 1 ? 0 : gemm_scratch_bytes<A>(std::min(N, gemm_row_block), M, K);
}
template <typename A>
constexpr std::size_t matmul_scratch_bytes(std::size_t threads, std::size_t N, std::size_t K,
                                           std::size_t M) noexcept {
  return threads * matmul_thread_scratch_bytes<A>(N, K, M);
}
// Per thread, for g[K, M] = x[N, K]ᵀ·d[N, M]: one tile of matmul_at_tiling, depth N.
template <typename A>
constexpr std::size_t matmul_at_thread_scratch_bytes(std::size_t N, std::size_t K,
                                                     std::size_t M) noexcept {
  const gemm_tiling t = matmul_at_tiling(K, M);
  return gemm_scratch_bytes<A>(t.rows, t.cols, N);
}
template <typename A>
constexpr std::size_t matmul_at_scratch_bytes(std::size_t threads, std::size_t N, std::size_t K,
                                              std::size_t M) noexcept {
  return threads * matmul_at_thread_scratch_bytes<A>(N, K, M);
}

// Decoding's workspace takes no thread count, so its products give each task (blocks(N,
// gemm_row_block) of them: one for N <= 256 rows) its own packing buffers instead of each thread:
// the bytes follow from the shape alone, and the tasks still run in parallel.
enum class scratch_slots { per_thread, per_task };
template <typename A>
constexpr std::size_t matmul_task_scratch_bytes(std::size_t N, std::size_t K,
                                                std::size_t M) noexcept {
  return blocks(N, gemm_row_block) * matmul_thread_scratch_bytes<A>(N, K, M);
}

namespace detail {
// Slot i's slice of the scratch; throws before any task runs if the span is short.
inline void check_scratch(std::span<std::byte> scratch, std::size_t slots, std::size_t per,
                          const char* unit = "threads") {
  if (scratch.size() < slots * per) {
    throw invalid_argument("scratch", std::to_string(slots * per) + " bytes (" +
                                          std::to_string(slots) + " " + unit + ")",
                           std::to_string(scratch.size()) + " bytes",
                           "Size it with cpu::matmul_scratch_bytes / matmul_at_scratch_bytes / "
                           "matmul_task_scratch_bytes");
  }
}
// y[N, M] (+)= x[N, K] · op(w) in tasks of gemm_row_block rows; wv(w) is op(w)'s view.
template <typename A, typename WView>
void matmul_rows(thread_pool& pool, const A* x, A* y, std::size_t N, std::size_t K,
                 std::size_t M, bool accumulate, ld3 ld, std::span<std::byte> scratch,
                 scratch_slots slots, WView&& wv) {
  const std::size_t per = matmul_thread_scratch_bytes<A>(N, K, M);
  const bool by_task = slots == scratch_slots::per_task;
  check_scratch(scratch, by_task ? blocks(N, gemm_row_block) : pool.size(), per,
                by_task ? "tasks" : "threads");
  pool.parallel_for(blocks(N, gemm_row_block), [&](std::size_t blk, std::size_t t) {
    const std::size_t r0 = blk * gemm_row_block, r = std::min(gemm_row_block, N - r0);
    gemm(view(y + r0 * ld.y, r, M, ld.y), cview(x + r0 * ld.x, r, K, ld.x), wv(), A(1),
         accumulate, gemm_scratch{scratch.data() + (by_task ? blk : t) * per, per});
  });
}
}  // namespace detail

// y[N, M] (+)= x[N, K] · w[K, M]
template <typename A>
void matmul(thread_pool& pool, const A* x, const A* w, A* y, std::size_t N, std::size_t K,
            std::size_t M, bool accumulate, ld3 ld, std::span<std::byte> scratch,
            scratch_slots slots = scratch_slots::per_thread) {
  detail::matmul_rows(pool, x, y, N, K, M, accumulate, ld, scratch, slots,
                      [&] { return cview(w, K, M, ld.w); });
}
// y[N, M] (+)= x[N, K] · w[M, K]ᵀ
template <typename A>
void matmul_bt(thread_pool& pool, const A* x, const A* w, A* y, std::size_t N, std::size_t K,
               std::size_t M, bool accumulate, ld3 ld, std::span<std::byte> scratch,
               scratch_slots slots = scratch_slots::per_thread) {
  detail::matmul_rows(pool, x, y, N, K, M, accumulate, ld, scratch, slots,
                      [&] { return cview(w, M, K, ld.w).transpose(); });
}
// g[K, M] (+)= x[N, K]ᵀ · d[N, M], in blocks of rows of g. ld.w is d's.
template <typename A>
void matmul_at(thread_pool& pool, const A* x, const A* d, A* g, std::size_t N, std::size_t K,
               std::size_t M, bool accumulate, ld3 ld, std::span<std::byte> scratch) {
  const std::size_t per = matmul_at_thread_scratch_bytes<A>(N, K, M);
  detail::check_scratch(scratch, pool.size(), per);
  const gemm_tiling tl = matmul_at_tiling(K, M);
  pool.parallel_for(tl.tiles(), [&](std::size_t tile, std::size_t t) {
    const std::size_t r0 = tile / tl.col_tiles * tl.rows, c0 = tile % tl.col_tiles * tl.cols;
    const std::size_t r = std::min(tl.rows, K - r0), c = std::min(tl.cols, M - c0);
    gemm(view(g + r0 * ld.y + c0, r, c, ld.y), cview(x + r0, N, r, ld.x).transpose(),
         cview(d + c0, N, c, ld.w), A(1), accumulate,
         gemm_scratch{scratch.data() + t * per, per});
  });
}

// Elementwise over rows: f(n) for every row n in [0, N), in parallel row blocks.
template <typename F>
void for_rows(thread_pool& pool, std::size_t N, F&& f) {
  pool.parallel_for(blocks(N, row_block), [&](std::size_t blk, std::size_t) {
    const std::size_t r0 = blk * row_block, r1 = std::min(N, r0 + row_block);
    for (std::size_t n = r0; n < r1; ++n) f(n);
  });
}

// Storage S vs accumulator A, shared by every layer front end. A buffer already in A (fp32 or
// fp64 storage) is used in place; bf16/fp16 go through the workspace slot.
template <typename A, typename S>
const A* widen_or_alias(const S* src, std::size_t n, A* slot) {
  if constexpr (std::is_same_v<S, A>) {
    (void)n;
    (void)slot;
    return src;
  } else {
    widen(src, n, slot);
    return slot;
  }
}
// Where a result is computed in A: the caller's buffer when it holds A, else the workspace slot
// that is rounded into it afterwards.
template <typename A, typename S>
A* accum_target(S* caller, A* slot) {
  if constexpr (std::is_same_v<S, A>) {
    (void)slot;
    return caller;
  } else {
    (void)caller;
    return slot;
  }
}
// g[K, M] += x[N, K]ᵀ·d[N, M]; for bf16/fp16 through tmp in A, rounded once per element.
template <typename A, typename S>
void weight_grad(thread_pool& pool, const A* x, const A* d, S* g, A* tmp, std::size_t N,
                 std::size_t K, std::size_t M) {
  if constexpr (std::is_same_v<S, A>) {
    (void)tmp;
    matmul_at(pool, x, d, g, N, K, M, true);
  } else {
    matmul_at(pool, x, d, tmp, N, K, M, false);
    narrow_add(static_cast<const A*>(tmp), K * M, g);
  }
}
// The same through the packing scratch of matmul_at (threads · matmul_at_thread_scratch_bytes).
template <typename A, typename S>
void weight_grad(thread_pool& pool, const A* x, const A* d, S* g, A* tmp, std::size_t N,
                 std::size_t K, std::size_t M, std::span<std::byte> scratch) {
  if constexpr (std::is_same_v<S, A>) {
    (void)tmp;
    matmul_at(pool, x, d, g, N, K, M, true, ld3{K, M, M}, scratch);
  } else {
    matmul_at(pool, x, d, tmp, N, K, M, false, ld3{K, M, M}, scratch);
    narrow_add(pool, static_cast<const A*>(tmp), K * M, g);
  }
}
template <typename A, typename S>
const A* widen_or_alias(thread_pool& pool, const S* src, std::size_t n, A* slot) {
  if constexpr (std::is_same_v<S, A>) {
    (void)pool;
    (void)n;
    (void)slot;
    return src;
  } else {
    widen(pool, src, n, slot);
    return slot;
  }
}
// g += src, rounded once per element.
template <typename A, typename S>
void add_grad(const A* src, std::size_t n, S* g) {
  narrow_add(src, n, g);
}

}  // namespace cpu

MEMBOUND_NAMESPACE_END
