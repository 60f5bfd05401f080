// cpu::gemm on the layers' shapes, three ways in one run so every ratio compares measurements
// taken side by side (the machine is shared; each figure is the best of the repetitions, and the
// three variants are interleaved within each repetition):
//   new     cpu::matmul / matmul_bt / matmul_at with packing buffers from a workspace span
//           (Eigen's level-3 kernel, fixed blocking kc = mc = 512, nc = 256; 256-row tasks, and
//           weight gradients in the tiles of cpu::matmul_at_tiling)
//   split   the same products through the old gemm(): 64x64x128 Eigen products (64-row tasks)
//   eigen   one unrestricted Eigen product per thread (rows cut in `threads` contiguous slices,
//           Eigen's own cache-derived blocking, heap allowed): the target
// Columns: ms per product, GF/s = 2·N·K·M / s, %peak = GF/s over the FMA peak of the same number
// of threads, measured first by a register-only FMA loop (12 independent chains per thread; on
// AVX-512 builds 16 lanes, on AVX2 8 lanes; 2 flops per lane per FMA), and new/eigen, split/eigen
// as throughput ratios (1.0 = as fast as one unrestricted Eigen product).
//
// Run: ./build/release/bench/bench_gemm [--threads N] [--min-threads N] [--reps N] [--filter NAME]
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench_flags.hpp"
#include "membound/membound.hpp"

#include "fma_peak.hpp"

namespace mb = membound;
using membound_bench::fma_peak_gflops;
using membound_bench::isa;
using clock_type = std::chrono::steady_clock;

namespace {

// ---- The products -----------------------------------------------------------------------------
enum class kind { nn, bt, at };
struct shape {
  const char* what;
  kind k;
  std::size_t N, K, M;  // nn, bt: y[N,M] = x[N,K]·w ; at: g[K,M] = x[N,K]ᵀ·d[N,M]
};

std::vector<float> random(std::size_t n, unsigned seed) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> v(n);
  for (auto& x : v) x = u(g);
  return v;
}

template <typename F>
double seconds(F&& f) {
  const auto t0 = clock_type::now();
  f();
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

void row(const shape& s, mb::thread_pool& pool, int reps, double peak) {
  const std::size_t N = s.N, K = s.K, M = s.M;
  const auto x = random(N * K, 1);
  const auto w = random(s.k == kind::at ? N * M : K * M, 2);
  std::vector<float> y(s.k == kind::at ? K * M : N * M);
  std::vector<std::byte> scratch(s.k == kind::at ? mb::cpu::matmul_at_scratch_bytes<float>(pool.size(), N, K, M)
                                                  : mb::cpu::matmul_scratch_bytes<float>(pool.size(), N, K, M));
  const std::size_t T = pool.size();
  auto run_new = [&] {
    if (s.k == kind::nn) mb::cpu::matmul(pool, x.data(), w.data(), y.data(), N, K, M, false, mb::cpu::ld3{K, M, M}, scratch);
    if (s.k == kind::bt) mb::cpu::matmul_bt(pool, x.data(), w.data(), y.data(), N, K, M, false, mb::cpu::ld3{K, K, M}, scratch);
    if (s.k == kind::at) mb::cpu::matmul_at(pool, x.data(), w.data(), y.data(), N, K, M, false, mb::cpu::ld3{K, M, M}, scratch);
  };
  auto run_split = [&] {
    if (s.k == kind::nn) mb::cpu::matmul(pool, x.data(), w.data(), y.data(), N, K, M, false);
    if (s.k == kind::bt) mb::cpu::matmul_bt(pool, x.data(), w.data(), y.data(), N, K, M, false);
    if (s.k == kind::at) mb::cpu::matmul_at(pool, x.data(), w.data(), y.data(), N, K, M, false);
  };
  auto run_eigen = [&] {
    const std::size_t rows = s.k == kind::at ? K : N, per = (rows + T - 1) / T;
    pool.parallel_for(T, [&](std::size_t t, std::size_t) {
      const std::size_t r0 = std::min(rows, t * per), r = std::min(per, rows - r0);
      if (r == 0) return;
      auto Y = mb::cpu::view(y.data() + r0 * M, r, M, M);
      if (s.k == kind::nn) Y.noalias() = mb::cpu::cview(x.data() + r0 * K, r, K, K) * mb::cpu::cview(w.data(), K, M, M);
      if (s.k == kind::bt) Y.noalias() = mb::cpu::cview(x.data() + r0 * K, r, K, K) * mb::cpu::cview(w.data(), M, K, K).transpose();
      if (s.k == kind::at) Y.noalias() = mb::cpu::cview(x.data() + r0, N, r, K).transpose() * mb::cpu::cview(w.data(), N, M, M);
    });
  };
  double t_new = 1e30, t_split = 1e30, t_eigen = 1e30;
  run_new(), run_split(), run_eigen();  // warm caches and Eigen's heap blocks
  for (int r = 0; r < reps; ++r) {
    t_new = std::min(t_new, seconds(run_new));
    t_split = std::min(t_split, seconds(run_split));
    t_eigen = std::min(t_eigen, seconds(run_eigen));
  }
  benchmark::DoNotOptimize(y.data());
  const double flops = 2.0 * double(N) * double(K) * double(M);
  const char* kname = s.k == kind::nn ? "x·W" : s.k == kind::bt ? "x·Wᵀ" : "xᵀ·d";
  std::printf("| %zu | %-17s | %-5s | %5zu %5zu %5zu | %7.3f | %7.3f | %7.3f | %6.1f | %5.1f%% | %5.2f | %5.2f |\n",
              T, s.what, kname, N, K, M, t_new * 1e3, t_split * 1e3, t_eigen * 1e3,
              flops / t_new / 1e9, 100.0 * flops / t_new / 1e9 / peak, t_eigen / t_new,
              t_eigen / t_split);
}

}  // namespace

static int bench_main(int argc, char** argv) {
  std::size_t max_threads = 2;
  int reps = 15;
  const char* filter = "";  // run only the shapes whose name contains it
  std::size_t min_threads = 1;
  std::string filter_text;
  bench_flags::args a(argc, argv, "usage: bench_gemm [--threads N] [--min-threads N] [--reps N] [--filter NAME]");
  while (a.next()) {
    if (a.is("--threads")) max_threads = static_cast<std::size_t>(a.whole(1, 1024));
    else if (a.is("--reps")) reps = static_cast<int>(a.whole(1, 1000000));
    else if (a.is("--filter")) filter = (filter_text = a.text()).c_str();
    else if (a.is("--min-threads")) min_threads = static_cast<std::size_t>(a.whole(1, 1024));
    else a.unknown();
  }
  if (min_threads > max_threads) {
    throw membound::invalid_argument("--min-threads", "at most --threads (" + std::to_string(max_threads) + ")",
                                     std::to_string(min_threads), "Lower --min-threads or raise --threads");
  }
  // The example trainer's default (batch 8 · seq 128 rows, width 128, MLP 4x, vocab 256) and a
  // long-sequence layer (T = 4096, width 512: attention with 8 heads of 64, MLP 4x).
  const shape shapes[] = {
      {"trainer qkv", kind::nn, 1024, 128, 384},   {"trainer mlp up", kind::nn, 1024, 128, 512},
      {"trainer mlp down", kind::nn, 1024, 512, 128}, {"trainer lm_head", kind::nn, 1024, 128, 256},
      {"trainer dx qkv", kind::bt, 1024, 384, 128}, {"trainer dW qkv", kind::at, 1024, 128, 384},
      {"trainer dW q", kind::at, 1024, 128, 128},     {"trainer dW mlp dn", kind::at, 1024, 512, 128},
      {"T4k qkv", kind::nn, 4096, 512, 1536},      {"T4k mlp up", kind::nn, 4096, 512, 2048},
      {"T4k mlp down", kind::nn, 4096, 2048, 512}, {"T4k dx mlp up", kind::bt, 4096, 2048, 512},
      {"T4k dW mlp up", kind::at, 4096, 512, 2048},
      // Decoding (`step`): one or eight rows through a whole weight, TTT at C = 512 and Mamba's
      // in_proj, x_proj, dt_proj, out_proj at C = 768 (Di 1536, R 48, Ns 16).
      {"step ttt q", kind::nn, 1, 512, 512},       {"step ttt q B8", kind::nn, 8, 512, 512},
      {"step mamba in", kind::nn, 1, 768, 3072},   {"step mamba in B8", kind::nn, 8, 768, 3072},
      {"step mamba x", kind::nn, 1, 1536, 80},     {"step mamba dt", kind::nn, 1, 48, 1536},
      {"step mamba out", kind::nn, 1, 1536, 768},  {"step mamba out B8", kind::nn, 8, 1536, 768},
      {"step ttt inner", kind::nn, 1, 64, 64},     {"step ttt inner up", kind::nn, 1, 64, 256},
      {"step ttt inner dn", kind::nn, 1, 256, 64},
  };
  std::printf("| threads | shape | op | N K M | new ms | split ms | eigen ms | new GF/s | %%peak | new/eigen | split/eigen |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (std::size_t T = min_threads; T <= max_threads; ++T) {
    const double peak = fma_peak_gflops(T);
    std::fprintf(stderr, "FMA peak (%s, fp32), %zu thread(s): %.1f GFLOP/s\n", isa, T, peak);
    mb::thread_pool pool(T);
    // Busy every thread for 200 ms first: a fresh pool's workers can share the caller's core
    // until the scheduler spreads them, which made the first shape's 2-thread figure a 1-thread one.
    pool.parallel_for(T, [](std::size_t, std::size_t) {
      const auto t0 = clock_type::now();
      while (clock_type::now() - t0 < std::chrono::milliseconds(200)) {
      }
    });
    for (const auto& s : shapes)
      if (std::strstr(s.what, filter)) row(s, pool, reps, peak);
  }
  return 0;
}

// Any error, a flag's or the library's, is one `error:` line and exit 1.
int main(int argc, char** argv) {
  return bench_flags::run([&] { return bench_main(argc, argv); });
}
