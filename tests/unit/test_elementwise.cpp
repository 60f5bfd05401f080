// The vectorized elementwise kernels of the CPU backend: bf16 widen/narrow give dtype.hpp's bits
// (round to nearest even, NaN kept quiet with its sign) for every class of float; the threaded
// overloads give the serial bits on any thread count; the RoPE table gives the per-element
// rotation's values; the SwiGLU rows match element_math.hpp's scalar formulas to rounding;
// RMSNorm is bit-identical across thread counts.
#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "membound/membound.hpp"

namespace mb = membound;
namespace cpu = membound::cpu;

TEST_CASE("bf16 narrow and widen give the scalar conversion's bits for every kind of float") {
  std::vector<float> src;
  // A sweep over the bit patterns (both signs, subnormals, normals, inf, NaNs) plus the ties.
  for (std::uint64_t u = 0; u <= 0xffffffffull; u += 65521) src.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(u)));
  for (std::uint32_t hi : {0x00000000u, 0x00010000u, 0x3f800000u, 0x7f7f0000u, 0x80010000u})
    for (std::uint32_t lo : {0x7fffu, 0x8000u, 0x8001u, 0xffffu}) src.push_back(std::bit_cast<float>(hi | lo));
  src.push_back(std::numeric_limits<float>::infinity());
  src.push_back(-std::numeric_limits<float>::infinity());
  src.push_back(std::numeric_limits<float>::max());
  src.push_back(std::numeric_limits<float>::denorm_min());
  src.push_back(-std::numeric_limits<float>::quiet_NaN());
  const std::size_t n = src.size();
  std::vector<mb::bf16> got(n);
  cpu::narrow(src.data(), n, got.data());
  std::size_t bad = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const mb::bf16 want = mb::from_accum<mb::bf16>(src[i]);
    if (std::bit_cast<std::uint16_t>(want) != std::bit_cast<std::uint16_t>(got[i])) ++bad;
  }
  CHECK(bad == 0);
  std::vector<float> back(n);
  cpu::widen(got.data(), n, back.data());
  bad = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const float want = mb::to_accum<float>(got[i]);
    if (std::bit_cast<std::uint32_t>(want) != std::bit_cast<std::uint32_t>(back[i])) ++bad;
  }
  CHECK(bad == 0);
  // narrow_add: one rounding of dst + src.
  std::vector<mb::bf16> acc(n, mb::bf16(0.5f));
  std::vector<float> small(n);
  for (std::size_t i = 0; i < n; ++i) small[i] = std::isfinite(src[i]) ? src[i] * 1e-3f : 1.0f;
  cpu::narrow_add(small.data(), n, acc.data());
  bad = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const mb::bf16 want = mb::from_accum<mb::bf16>(0.5f + small[i]);
    if (std::bit_cast<std::uint16_t>(want) != std::bit_cast<std::uint16_t>(acc[i])) ++bad;
  }
  CHECK(bad == 0);
}

TEST_CASE("threaded widen / narrow / narrow_add equal the serial loops on 1, 2 and 3 threads") {
  const std::size_t n = 3 * cpu::elementwise_block + 123;
  std::mt19937 g(5);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  std::vector<float> src(n);
  for (float& v : src) v = nd(g);
  std::vector<mb::bf16> serial(n);
  cpu::narrow(src.data(), n, serial.data());
  for (std::size_t threads : {1u, 2u, 3u}) {
    mb::thread_pool pool(threads);
    std::vector<mb::bf16> par(n);
    cpu::narrow(pool, src.data(), n, par.data());
    CHECK(std::memcmp(par.data(), serial.data(), n * sizeof(mb::bf16)) == 0);
    std::vector<float> wide(n), wide_serial(n);
    cpu::widen(pool, par.data(), n, wide.data());
    cpu::widen(serial.data(), n, wide_serial.data());
    CHECK(std::memcmp(wide.data(), wide_serial.data(), n * sizeof(float)) == 0);
    std::vector<mb::fp16> h(n), h_serial(n);
    cpu::narrow(pool, src.data(), n, h.data());
    cpu::narrow(src.data(), n, h_serial.data());
    CHECK(std::memcmp(h.data(), h_serial.data(), n * sizeof(mb::fp16)) == 0);
    std::vector<mb::bf16> a = serial, b = serial;
    cpu::narrow_add(pool, src.data(), n, a.data());
    cpu::narrow_add(src.data(), n, b.data());
    CHECK(std::memcmp(a.data(), b.data(), n * sizeof(mb::bf16)) == 0);
  }
}

TEST_CASE("the RoPE table rotates as the per-element formula, forward and inverse") {
  const std::size_t T = 37, heads = 3, D = 16, N = 2 * T;
  const double base = 10000.0;
  std::mt19937 g(7);
  std::uniform_real_distribution<double> u(-1, 1);
  std::vector<double> x(N * heads * D);
  for (double& v : x) v = u(g);
  mb::thread_pool pool(2);
  for (bool inverse : {false, true}) {
    std::vector<double> old_way = x, table_way = x;
    cpu::rope_rows(pool, old_way.data(), N, T, heads, D, base, 5, inverse);
    std::vector<double> table(cpu::rope_table_elements(T, D));
    cpu::rope_table(pool, table.data(), T, D, base, 5);
    cpu::rope_rows(pool, table_way.data(), N, T, heads, D, static_cast<const double*>(table.data()),
                   inverse);
    double worst = 0;
    for (std::size_t i = 0; i < x.size(); ++i) worst = std::max(worst, std::abs(old_way[i] - table_way[i]));
    CHECK(worst < 1e-14);
  }
}

TEST_CASE("swiglu rows match the scalar formulas; RMSNorm is the same on 1 and 3 threads") {
  const std::size_t N = 70, F = 77;
  std::mt19937 g(9);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::vector<float> a(N * F), b(N * F), dact(N * F);
  for (auto* v : {&a, &b, &dact})
    for (float& e : *v) e = nd(g);
  std::vector<float> act(N * F), da(N * F), db = dact;
  for (std::size_t n = 0; n < N; ++n) {
    cpu::swiglu_row(&a[n * F], &b[n * F], &act[n * F], F);
    cpu::swiglu_backward_row(&a[n * F], &b[n * F], &da[n * F], &db[n * F], F);
  }
  double worst = 0;
  for (std::size_t i = 0; i < N * F; ++i) {
    float wda = 0, wdb = 0;
    mb::swiglu_backward(a[i], b[i], dact[i], wda, wdb);
    const float want = mb::swiglu(a[i], b[i]);
    worst = std::max({worst, std::abs(double(act[i]) - want) / (1 + std::abs(want)),
                      std::abs(double(da[i]) - wda) / (1 + std::abs(wda)),
                      std::abs(double(db[i]) - wdb) / (1 + std::abs(wdb))});
  }
  CHECK(worst < 1e-5);

  const std::size_t C = 129;  // not a multiple of the 16 lanes
  std::vector<mb::bf16> x(N * C), gain(C), dy(N * C), res(N * C);
  for (auto& e : x) e = mb::bf16(nd(g));
  for (auto& e : gain) e = mb::bf16(1.0f + 0.1f * nd(g));
  for (auto& e : dy) e = mb::bf16(nd(g));
  for (auto& e : res) e = mb::bf16(nd(g));
  std::vector<std::vector<std::uint16_t>> outs;
  for (std::size_t threads : {1u, 3u}) {
    mb::thread_pool pool(threads);
    std::vector<mb::bf16> y(N * C), dx(N * C), dg(C, mb::bf16(0.0f));
    std::vector<float> rstd(N), partial(cpu::row_partials(N, C));
    cpu::rmsnorm_forward<float>(pool, x.data(), gain.data(), y.data(), rstd.data(), N, C, 1e-5);
    cpu::rmsnorm_backward<float>(pool, x.data(), gain.data(), rstd.data(), dy.data(), res.data(),
                                 dx.data(), dg.data(), partial.data(), N, C);
    std::vector<std::uint16_t> bits;
    for (auto* v : {&y, &dx, &dg})
      for (mb::bf16 e : *v) bits.push_back(std::bit_cast<std::uint16_t>(e));
    outs.push_back(bits);
    // The normalized row against a double computation.
    double err = 0;
    for (std::size_t n = 0; n < N; ++n) {
      double ss = 0;
      for (std::size_t c = 0; c < C; ++c) ss += double(float(x[n * C + c])) * float(x[n * C + c]);
      const double r = 1.0 / std::sqrt(ss / double(C) + 1e-5);
      for (std::size_t c = 0; c < C; ++c) {
        const double want = double(float(x[n * C + c])) * r * float(gain[c]);
        err = std::max(err, std::abs(double(float(y[n * C + c])) - want) / (1 + std::abs(want)));
      }
    }
    CHECK(err < 1e-2);  // one bf16 rounding
  }
  CHECK(outs[0] == outs[1]);
}
