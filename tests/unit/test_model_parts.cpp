// The model's glue against plain double loops written from the formulas: the SwiGLU MLP, the LM
// head with chunked cross-entropy (final RMSNorm included) at several chunk sizes, and their
// bf16 runs against the fp64 ones.
//
// Tolerances: fp64 against the loops differ only in summation order: 1e-12 relative. bf16 rounds
// inputs, weights, stored pre-activations and outputs to 8 significant bits (2^-9 relative each)
// and sums in fp32: a few roundings compound to ~1%, so 3e-2 relative.
#include <algorithm>
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "../support/layer_test_util.hpp"
#include "membound/layers/lm_head.hpp"
#include "membound/layers/swiglu_mlp.hpp"
#include "../support/test_rng.hpp"

namespace mb = membound;
using membound_test::aligned_buffer;
using membound_test::rel_err;

namespace {

struct mlp_result {
  std::vector<double> y, dx, dg, du, dd;
};

mlp_result naive_mlp(const std::vector<double>& x, const std::vector<double>& wg,
                     const std::vector<double>& wu, const std::vector<double>& wd,
                     const std::vector<double>& dy, std::size_t N, std::size_t C, std::size_t F) {
  mlp_result r{std::vector<double>(N * C), std::vector<double>(N * C), std::vector<double>(C * F),
               std::vector<double>(C * F), std::vector<double>(F * C)};
  for (std::size_t n = 0; n < N; ++n) {
    std::vector<double> a(F), b(F), act(F), dact(F);
    for (std::size_t f = 0; f < F; ++f) {
      for (std::size_t c = 0; c < C; ++c) {
        a[f] += x[n * C + c] * wg[c * F + f];
        b[f] += x[n * C + c] * wu[c * F + f];
      }
      const double sg = 1.0 / (1.0 + std::exp(-a[f]));
      act[f] = a[f] * sg * b[f];
    }
    for (std::size_t c = 0; c < C; ++c)
      for (std::size_t f = 0; f < F; ++f) r.y[n * C + c] += act[f] * wd[f * C + c];
    for (std::size_t f = 0; f < F; ++f) {
      for (std::size_t c = 0; c < C; ++c) {
        dact[f] += dy[n * C + c] * wd[f * C + c];
        r.dd[f * C + c] += act[f] * dy[n * C + c];
      }
      const double sg = 1.0 / (1.0 + std::exp(-a[f]));
      const double da = dact[f] * b[f] * (sg + a[f] * sg * (1.0 - sg));
      const double db = dact[f] * a[f] * sg;
      for (std::size_t c = 0; c < C; ++c) {
        r.dg[c * F + f] += x[n * C + c] * da;
        r.du[c * F + f] += x[n * C + c] * db;
        r.dx[n * C + c] += da * wg[c * F + f] + db * wu[c * F + f];
      }
    }
  }
  return r;
}

template <typename P>
mlp_result run_mlp(const std::vector<double>& x, const std::vector<double>& wg,
                   const std::vector<double>& wu, const std::vector<double>& wd,
                   const std::vector<double>& dy, std::size_t N, std::size_t C, std::size_t F,
                   std::size_t threads) {
  using L = mb::swiglu_mlp<P>;
  using S = typename L::storage_type;
  mb::thread_pool pool(threads);
  const mb::mlp_shape s{1, N, C, F};
  auto xs = membound_test::to_storage<S>(x), gs = membound_test::to_storage<S>(wg);
  auto us = membound_test::to_storage<S>(wu), ds = membound_test::to_storage<S>(wd);
  auto dys = membound_test::to_storage<S>(dy);
  std::vector<S> y(N * C), dx(N * C), gg(C * F, S(0.0f)), gu(C * F, S(0.0f)), gd(F * C, S(0.0f));
  aligned_buffer saved(L::saved_bytes(s)), fws(L::forward_workspace_bytes(s, threads)),
      bws(L::backward_workspace_bytes(s, threads));
  const typename L::weights w{gs.data(), us.data(), ds.data()};
  L::forward(s, w, xs.data(), y.data(), saved.get(), saved.bytes, fws.get(), fws.bytes, pool);
  L::backward(s, w, xs.data(), saved.get(), saved.bytes, dys.data(), dx.data(),
              {gg.data(), gu.data(), gd.data()}, bws.get(), bws.bytes, pool);
  using membound_test::to_double;
  return {to_double(y.data(), y.size()), to_double(dx.data(), dx.size()),
          to_double(gg.data(), gg.size()), to_double(gu.data(), gu.size()),
          to_double(gd.data(), gd.size())};
}

struct head_result {
  double loss = 0;
  std::vector<double> dx, dnorm, dw;
};

head_result naive_head(const std::vector<double>& x, const std::vector<double>& g,
                       const std::vector<double>& w, const std::vector<std::int32_t>& t,
                       std::size_t N, std::size_t C, std::size_t V, double eps) {
  head_result r{0.0, std::vector<double>(N * C), std::vector<double>(C), std::vector<double>(V * C)};
  for (std::size_t n = 0; n < N; ++n) {
    double ss = 0;
    for (std::size_t c = 0; c < C; ++c) ss += x[n * C + c] * x[n * C + c];
    const double rs = 1.0 / std::sqrt(ss / static_cast<double>(C) + eps);
    std::vector<double> xn(C), logits(V), dxn(C);
    for (std::size_t c = 0; c < C; ++c) xn[c] = x[n * C + c] * rs * g[c];
    double m = -1e300;
    for (std::size_t v = 0; v < V; ++v) {
      for (std::size_t c = 0; c < C; ++c) logits[v] += xn[c] * w[v * C + c];
      m = std::max(m, logits[v]);
    }
    double z = 0;
    for (std::size_t v = 0; v < V; ++v) z += std::exp(logits[v] - m);
    r.loss += std::log(z) + m - logits[static_cast<std::size_t>(t[n])];
    for (std::size_t v = 0; v < V; ++v) {
      const double d = (std::exp(logits[v] - m) / z - (v == static_cast<std::size_t>(t[n]) ? 1.0 : 0.0)) /
                       static_cast<double>(N);
      for (std::size_t c = 0; c < C; ++c) {
        r.dw[v * C + c] += d * xn[c];
        dxn[c] += d * w[v * C + c];
      }
    }
    // y = x·rs·g: dx = rs·(dxn·g) − x·rs³/C·Σ(dxn·g·x)
    double dot = 0;
    for (std::size_t c = 0; c < C; ++c) {
      dot += dxn[c] * g[c] * x[n * C + c];
      r.dnorm[c] += dxn[c] * x[n * C + c] * rs;
    }
    for (std::size_t c = 0; c < C; ++c)
      r.dx[n * C + c] = rs * dxn[c] * g[c] - x[n * C + c] * rs * rs * rs * dot / static_cast<double>(C);
  }
  return r;
}

template <typename P>
head_result run_head(const std::vector<double>& x, const std::vector<double>& g,
                     const std::vector<double>& w, const std::vector<std::int32_t>& t,
                     std::size_t N, std::size_t C, std::size_t V, std::size_t chunk,
                     std::size_t threads) {
  using H = mb::lm_head<P>;
  using S = typename H::storage_type;
  mb::thread_pool pool(threads);
  const mb::lm_head_shape s{N, C, V, chunk, 1e-5};
  auto xs = membound_test::to_storage<S>(x), gs = membound_test::to_storage<S>(g);
  auto ws = membound_test::to_storage<S>(w);
  std::vector<S> dx(N * C), dg(C, S(0.0f)), dw(V * C, S(0.0f));
  aligned_buffer buf(H::workspace_bytes(s, threads));
  head_result r;
  r.loss = H::loss_backward(s, {gs.data(), ws.data()}, xs.data(), t.data(), 1.0 / static_cast<double>(N),
                            dx.data(), {dg.data(), dw.data()}, buf.get(), buf.bytes, pool) /
           1.0;
  using membound_test::to_double;
  r.dx = to_double(dx.data(), dx.size());
  r.dnorm = to_double(dg.data(), dg.size());
  r.dw = to_double(dw.data(), dw.size());
  return r;
}

}  // namespace

TEST_CASE("swiglu_mlp: fp64 equals the plain loops; bf16 within 3e-2; threads agree bit for bit") {
  membound_test::rng r{11};
  const std::size_t N = 37, C = 24, F = 40;
  const auto x = r.fill(N * C, 1.0), wg = r.fill(C * F, 0.3), wu = r.fill(C * F, 0.3),
             wd = r.fill(F * C, 0.3), dy = r.fill(N * C, 1.0);
  const mlp_result ref = naive_mlp(x, wg, wu, wd, dy, N, C, F);
  const mlp_result got = run_mlp<mb::fp64_precision>(x, wg, wu, wd, dy, N, C, F, 2);
  CHECK(rel_err(got.y, ref.y) < 1e-12);
  CHECK(rel_err(got.dx, ref.dx) < 1e-12);
  CHECK(rel_err(got.dg, ref.dg) < 1e-12);
  CHECK(rel_err(got.du, ref.du) < 1e-12);
  CHECK(rel_err(got.dd, ref.dd) < 1e-12);
  const mlp_result one = run_mlp<mb::fp64_precision>(x, wg, wu, wd, dy, N, C, F, 1);
  CHECK(one.dx == got.dx);
  CHECK(one.dg == got.dg);

  const mlp_result bf = run_mlp<mb::bf16_precision>(x, wg, wu, wd, dy, N, C, F, 2);
  CHECK(rel_err(bf.y, ref.y) < 3e-2);
  CHECK(rel_err(bf.dx, ref.dx) < 3e-2);
  CHECK(rel_err(bf.dg, ref.dg) < 3e-2);
  CHECK(rel_err(bf.dd, ref.dd) < 3e-2);
}

TEST_CASE("lm_head: chunked cross-entropy equals the full-logit loops for every chunk size") {
  membound_test::rng r{12};
  const std::size_t N = 29, C = 16, V = 41;
  const auto x = r.fill(N * C, 1.0), g = r.fill(C, 1.0), w = r.fill(V * C, 0.5);
  std::vector<std::int32_t> t(N);
  for (std::size_t i = 0; i < N; ++i) t[i] = static_cast<std::int32_t>((i * 13 + 5) % V);
  const head_result ref = naive_head(x, g, w, t, N, C, V, 1e-5);
  head_result first;
  for (std::size_t chunk : {std::size_t{1}, std::size_t{5}, N, std::size_t{1000}}) {
    CAPTURE(chunk);
    const head_result got = run_head<mb::fp64_precision>(x, g, w, t, N, C, V, chunk, 2);
    CHECK(std::abs(got.loss - ref.loss) < 1e-12 * std::abs(ref.loss));
    CHECK(rel_err(got.dx, ref.dx) < 1e-12);
    CHECK(rel_err(got.dnorm, ref.dnorm) < 1e-12);
    CHECK(rel_err(got.dw, ref.dw) < 1e-12);
  }
  const head_result bf = run_head<mb::bf16_precision>(x, g, w, t, N, C, V, 7, 2);
  CHECK(std::abs(bf.loss - ref.loss) < 3e-2 * std::abs(ref.loss));
  CHECK(rel_err(bf.dx, ref.dx) < 3e-2);
  CHECK(rel_err(bf.dw, ref.dw) < 3e-2);
}

TEST_CASE("lm_head: the workspace holds one chunk of logits, never [N, V]") {
  using H = mb::lm_head<mb::fp32_precision>;
  const mb::lm_head_shape small{4096, 64, 50000, 128, 1e-5};
  mb::lm_head_shape big = small;
  big.chunk = 256;
  // Doubling the chunk adds exactly 128 more rows of logits (and of row losses), and the GEMM
  // packing of the chunk's extra rows, nothing else.
  const auto packing = [](std::size_t R) {
    namespace c = mb::cpu;
    return std::max({c::matmul_thread_scratch_bytes<float>(R, 64, 50000),
                     c::matmul_at_thread_scratch_bytes<float>(R, 50000, 64),
                     c::matmul_thread_scratch_bytes<float>(R, 50000, 64)});
  };
  const std::size_t grow = H::workspace_bytes(big, 1) - H::workspace_bytes(small, 1);
  const std::size_t grow_packing = packing(256) - packing(128);
  CHECK(grow >= 128 * 50000 * 4 + grow_packing);
  CHECK(grow < 128 * 50000 * 4 + 128 * 8 + 2 * 256 + grow_packing + 64);
  CHECK(H::workspace_bytes(small, 1) < std::size_t{4096} * 50000 * 4 / 8);
}

TEST_CASE("lm_head and swiglu_mlp: bad input gets a typed error naming the argument") {
  using H = mb::lm_head<mb::fp32_precision>;
  mb::thread_pool pool(1);
  const mb::lm_head_shape s{4, 8, 10, 2, 1e-5};
  std::vector<float> x(32, 0.5f), g(8, 1.0f), w(80, 0.1f), dx(32), dg(8), dw(80);
  std::vector<std::int32_t> t{1, 2, 10, 3};
  aligned_buffer buf(H::workspace_bytes(s, 1));
  try {
    H::loss_backward(s, {g.data(), w.data()}, x.data(), t.data(), 1.0, dx.data(), {dg.data(), dw.data()},
                     buf.get(), buf.bytes, pool);
    FAIL("no error for target 10 with V = 10");
  } catch (const mb::invalid_argument& e) {
    CHECK(std::string(e.what()).find("targets[2]") != std::string::npos);
  }
  CHECK(dw == std::vector<float>(80, 0.0f));  // nothing was written
  mb::lm_head_shape z = s;
  z.chunk = 0;
  CHECK_THROWS_AS(H::check(z), mb::invalid_argument);
  CHECK_THROWS_AS(mb::swiglu_mlp<>::check({1, 4, 8, 0}), mb::invalid_argument);
}
