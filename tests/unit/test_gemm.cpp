// cpu::gemm with packing buffers from the caller: equals a plain Eigen product to rounding, never
// touches the heap, and gives the same bits on 1 and 3 threads.
#define EIGEN_RUNTIME_NO_MALLOC
#include <doctest/doctest.h>

#include <cstddef>
#include <random>
#include <span>
#include <vector>

#include "membound/membound.hpp"

namespace mb = membound;

namespace {
template <typename A>
std::vector<A> random(std::size_t n, unsigned seed) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<double> u(-1, 1);
  std::vector<A> v(n);
  for (auto& x : v) x = static_cast<A>(u(g));
  return v;
}

enum class kind { nn, bt, at };

// y = the product through the scratch path on `threads` threads.
template <typename A>
std::vector<A> product(kind k, const std::vector<A>& x, const std::vector<A>& w, std::size_t N,
                       std::size_t K, std::size_t M, std::size_t threads) {
  mb::thread_pool pool(threads);
  const std::size_t bytes = k == kind::at ? mb::cpu::matmul_at_scratch_bytes<A>(threads, N, K, M)
                                          : mb::cpu::matmul_scratch_bytes<A>(threads, N, K, M);
  // An exactly sized span at an odd address, with a canary after it: the packing stays inside.
  std::vector<std::byte> buffer(bytes + 1 + 256, std::byte{0xAB});
  const std::span<std::byte> scratch(buffer.data() + 1, bytes);
  std::vector<A> y(k == kind::at ? K * M : N * M, A(7));
  Eigen::internal::set_is_malloc_allowed(false);
  if (k == kind::nn) mb::cpu::matmul(pool, x.data(), w.data(), y.data(), N, K, M, false, mb::cpu::ld3{K, M, M}, scratch);
  if (k == kind::bt) mb::cpu::matmul_bt(pool, x.data(), w.data(), y.data(), N, K, M, false, mb::cpu::ld3{K, K, M}, scratch);
  if (k == kind::at) mb::cpu::matmul_at(pool, x.data(), w.data(), y.data(), N, K, M, false, mb::cpu::ld3{K, M, M}, scratch);
  Eigen::internal::set_is_malloc_allowed(true);
  for (std::size_t i = 1 + bytes; i < buffer.size(); ++i) REQUIRE(buffer[i] == std::byte{0xAB});
  return y;
}

template <typename A>
void check(kind k, std::size_t N, std::size_t K, std::size_t M) {
  const std::size_t xs = N * K, ws = k == kind::at ? N * M : K * M;
  const auto x = random<A>(xs, 1), w = random<A>(ws, 2);
  const auto y1 = product<A>(k, x, w, N, K, M, 1), y3 = product<A>(k, x, w, N, K, M, 3);
  CHECK(y1 == y3);
  using mat = mb::cpu::row_matrix<double>;
  const mat X = mb::cpu::cview(x.data(), N, K, K).template cast<double>();
  mat ref;
  if (k == kind::nn) ref = X * mb::cpu::cview(w.data(), K, M, M).template cast<double>();
  if (k == kind::bt) ref = X * mb::cpu::cview(w.data(), M, K, K).template cast<double>().transpose();
  if (k == kind::at) ref = X.transpose() * mb::cpu::cview(w.data(), N, M, M).template cast<double>();
  const std::size_t rows = k == kind::at ? K : N, depth = k == kind::at ? N : K;
  double err = 0;
  for (std::size_t i = 0; i < rows; ++i)
    for (std::size_t j = 0; j < M; ++j)
      err = std::max(err, std::abs(double(y1[i * M + j]) - ref(Eigen::Index(i), Eigen::Index(j))));
  const double tol = (sizeof(A) == 4 ? 1e-5 : 1e-13) * double(depth);
  CHECK(err <= tol);
}
}  // namespace

TEST_CASE("packed gemm: matches Eigen, no heap, same bits on any thread count") {
  for (kind k : {kind::nn, kind::bt, kind::at}) {
    // Shapes across every block edge (kc = mc = 512, nc = 256, 256-row tasks) and 1-row/1-column.
    check<float>(k, 300, 257, 530);
    check<float>(k, 600, 1100, 520);
    check<float>(k, 1, 64, 33);
    check<float>(k, 65, 1, 7);
    check<float>(k, 513, 600, 1);
    check<double>(k, 200, 300, 100);
  }
}

TEST_CASE("packed gemm: accumulate adds to y, and the scratch size is a compile-time constant") {
  constexpr std::size_t bytes = mb::cpu::gemm_scratch_bytes<float>();
  static_assert(bytes >= (512 * 512 + 512 * 256) * sizeof(float));
  static_assert(mb::cpu::gemm_scratch_bytes<float>(1024, 384, 128) < bytes);
  const std::size_t N = 130, K = 70, M = 90;
  const auto x = random<float>(N * K, 3), w = random<float>(K * M, 4);
  mb::thread_pool pool(2);
  std::vector<std::byte> scratch(mb::cpu::matmul_scratch_bytes<float>(2, N, K, M));
  std::vector<float> y(N * M, 0.f), y2(N * M, 1.f);
  mb::cpu::matmul(pool, x.data(), w.data(), y.data(), N, K, M, false, mb::cpu::ld3{K, M, M}, scratch);
  mb::cpu::matmul(pool, x.data(), w.data(), y2.data(), N, K, M, true, mb::cpu::ld3{K, M, M}, scratch);
  for (std::size_t i = 0; i < N * M; ++i) CHECK(y2[i] == doctest::Approx(y[i] + 1.f).epsilon(1e-5));
  // A short span is refused before anything is written.
  const std::span<std::byte> shorter(scratch.data(), scratch.size() - 1);
  CHECK_THROWS_AS(mb::cpu::matmul(pool, x.data(), w.data(), y.data(), N, K, M, false,
                                  mb::cpu::ld3{K, M, M}, shorter),
                  mb::invalid_argument);
}

TEST_CASE("packed gemm: weight gradients in tiles from the shape alone, every tile inside g") {
  using mb::cpu::matmul_at_tiling;
  // The trainer's 128-wide projections: one tile would leave a second thread idle; two halves.
  constexpr auto q = matmul_at_tiling(128, 128);
  static_assert(q.rows == 64 && q.cols == 128 && q.tiles() == 2);
  // T = 4k, width 512, MLP up: 256-row tiles, 512-column tiles.
  constexpr auto up = matmul_at_tiling(512, 2048);
  static_assert(up.rows == 256 && up.cols == 512 && up.tiles() == 8);
  // Equal tiles (multiples of 16) rather than a full one and a remainder.
  constexpr auto odd = matmul_at_tiling(384, 1030);
  static_assert(odd.rows == 192 && odd.row_tiles == 2 && odd.cols == 352 && odd.col_tiles == 3);
  // Too small to share: one tile; and nothing for an empty g.
  static_assert(matmul_at_tiling(20, 5).tiles() == 1);
  static_assert(matmul_at_tiling(0, 5).tiles() == 0);
  for (std::size_t K : {1, 31, 32, 100, 128, 257, 600})
    for (std::size_t M : {1, 17, 512, 513, 1500}) {
      const auto t = matmul_at_tiling(K, M);
      CHECK(t.rows * t.row_tiles >= K);
      CHECK(t.rows * (t.row_tiles - 1) < K);
      CHECK(t.cols * t.col_tiles >= M);
      CHECK(t.cols * (t.col_tiles - 1) < M);
    }
  // Products through every kind of tiling: split rows, split columns, both, one tile; same bits
  // on 1 and 3 threads (check()).
  check<float>(kind::at, 700, 128, 384);
  check<float>(kind::at, 300, 384, 1030);
  check<float>(kind::at, 300, 40, 1100);
  check<float>(kind::at, 90, 20, 30);
  check<double>(kind::at, 260, 128, 96);
}
