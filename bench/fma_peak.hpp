// This machine's fp32 FMA peak, measured by a register-only loop: the denominator of every
// "%peak" column in the CPU benchmarks (bench_gemm, bench_attention), so they agree on it.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <thread>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__FMA__)
#include <immintrin.h>
#endif

#include <benchmark/benchmark.h>

namespace membound_bench {

// ---- FMA peak --------------------------------------------------------------------------------
// 12 independent accumulator chains: enough to cover an FMA latency of 4-6 cycles on two ports.
constexpr int chains = 12;

#if defined(__AVX512F__)
constexpr int lanes = 16;
const char* const isa = "AVX-512 FMA";
double fma_kernel(long iters) {
  __m512 acc[chains];
  const __m512 a = _mm512_set1_ps(0.9999f), b = _mm512_set1_ps(1e-7f);
  for (int c = 0; c < chains; ++c) acc[c] = _mm512_set1_ps(static_cast<float>(c));
  for (long i = 0; i < iters; ++i)
#pragma GCC unroll 16  // every chain in its own register: a loop over acc[] goes through memory
    for (int c = 0; c < chains; ++c) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
  __m512 s = acc[0];
  for (int c = 1; c < chains; ++c) s = _mm512_add_ps(s, acc[c]);
  return _mm512_reduce_add_ps(s);
}
#elif defined(__FMA__)
constexpr int lanes = 8;
const char* const isa = "AVX2 FMA";
double fma_kernel(long iters) {
  __m256 acc[chains];
  const __m256 a = _mm256_set1_ps(0.9999f), b = _mm256_set1_ps(1e-7f);
  for (int c = 0; c < chains; ++c) acc[c] = _mm256_set1_ps(static_cast<float>(c));
  for (long i = 0; i < iters; ++i)
#pragma GCC unroll 16  // every chain in its own register: a loop over acc[] goes through memory
    for (int c = 0; c < chains; ++c) acc[c] = _mm256_fmadd_ps(acc[c], a, b);
  float out[8];
  __m256 s = acc[0];
  for (int c = 1; c < chains; ++c) s = _mm256_add_ps(s, acc[c]);
  _mm256_storeu_ps(out, s);
  double r = 0;
  for (float f : out) r += f;
  return r;
}
#else
// No FMA in this build (configure with MEMBOUND_NATIVE_ARCH=ON): the peak of what it can issue.
constexpr int lanes = 4;
const char* const isa = "SSE mul+add (no FMA in this build)";
double fma_kernel(long iters) {
  typedef float v4 __attribute__((vector_size(16)));
  v4 acc[chains];
  const v4 a = {0.9999f, 0.9999f, 0.9999f, 0.9999f}, b = {1e-7f, 1e-7f, 1e-7f, 1e-7f};
  for (int c = 0; c < chains; ++c) acc[c] = v4{} + static_cast<float>(c);
  for (long i = 0; i < iters; ++i)
#pragma GCC unroll 16  // every chain in its own register: a loop over acc[] goes through memory
    for (int c = 0; c < chains; ++c) acc[c] = acc[c] * a + b;
  double r = 0;
  for (int c = 0; c < chains; ++c)
    for (int l = 0; l < 4; ++l) r += acc[c][l];
  return r;
}
#endif

// GFLOP/s of `threads` threads each running the kernel at once (best of 5).
double fma_peak_gflops(std::size_t threads) {
  const long iters = 20'000'000;
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    std::vector<double> sink(threads);
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> pool;
    for (std::size_t t = 0; t < threads; ++t)
      pool.emplace_back([&, t] { sink[t] = fma_kernel(iters); });
    for (auto& th : pool) th.join();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    benchmark::DoNotOptimize(sink.data());
    const double flops = 2.0 * lanes * chains * static_cast<double>(iters) *
                         static_cast<double>(threads);
    best = std::max(best, flops / s / 1e9);
  }
  return best;
}

}  // namespace membound_bench
