// The TTT-Linear layer: its hand-derived backward against central finite differences of its own
// forward in double (every outer parameter and the input), state groups G ∈ {1, 2, all}
// giving identical results, thread-count independence, stepping against the full forward, the
// memory taken from an allocator (saved bytes falling with G as reported), and typed errors.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "../support/layer_test_util.hpp"
#include "../support/test_rng.hpp"
#include "../support/ttt_reference.hpp"
#include "membound/membound.hpp"

using membound::thread_pool;
using membound::ttt_shape;
using membound_test::aligned_buffer;
using membound_test::rel_err;
using membound_test::rng;
using membound_test::to_double;
using membound_test::to_storage;

namespace {

constexpr int n_params = 16;
const char* const param_names[n_params] = {"wq",   "wk",   "wv",   "ttt_norm_w", "ttt_norm_b",
                                           "w1",   "b1",   "lr_w", "lr_b",       "tok_offset",
                                           "post_w", "post_b", "wg", "wo", "w2", "b2"};

// Parameters in double, in the order of the layer's weights struct.
struct params {
  std::vector<double> p[n_params];
};

// w2 and b2 are empty for TTT-Linear (F = D); TTT-MLP's hidden width is F = 4·D.
template <std::size_t MB, bool Mlp = false>
params make_params(const ttt_shape& s, rng& r) {
  const std::size_t C = s.width, H = s.heads, D = s.head_dim(), F = Mlp ? 4 * D : D;
  const std::size_t sizes[n_params] = {C * C, C * C, C * C, H * D, H * D, H * D * F, H * F,
                                       H * C, H,     MB,    C,     C,     C * C, C * C,
                                       Mlp ? H * F * D : 0, Mlp ? H * D : 0};
  params p;
  for (int i = 0; i < n_params; ++i) p.p[i] = r.fill(sizes[i], 0.5 / std::sqrt(double(C)));
  // Scales near 1, offsets and biases away from zero, learning rates large enough to matter.
  for (double& v : p.p[3]) v += 1.0;
  for (double& v : p.p[10]) v += 1.0;
  for (double& v : p.p[5]) v *= 2.0;
  for (double& v : p.p[14]) v *= 2.0;
  for (double& v : p.p[7]) v *= 4.0;
  for (double& v : p.p[8]) v = r.uniform(-0.5, 0.5);
  for (double& v : p.p[9]) v = r.uniform(-0.2, 0.2);
  return p;
}

struct result {
  std::vector<double> y, dx;
  params g;
};

template <typename Layer>
result run(const ttt_shape& s, const params& prm, const std::vector<double>& x,
           const std::vector<double>& dy, std::size_t threads, bool backward = true) {
  using S = typename Layer::storage_type;
  thread_pool pool(threads);
  std::vector<S> w[n_params], g[n_params];
  for (int i = 0; i < n_params; ++i) {
    w[i] = to_storage<S>(prm.p[i]);
    g[i].assign(prm.p[i].size(), S(0.0f));
  }
  const typename Layer::weights wv{w[0].data(), w[1].data(),  w[2].data(),  w[3].data(),
                                   w[4].data(), w[5].data(),  w[6].data(),  w[7].data(),
                                   w[8].data(), w[9].data(),  w[10].data(), w[11].data(),
                                   w[12].data(), w[13].data(), w[14].data(), w[15].data()};
  const typename Layer::gradients gv{g[0].data(), g[1].data(),  g[2].data(),  g[3].data(),
                                     g[4].data(), g[5].data(),  g[6].data(),  g[7].data(),
                                     g[8].data(), g[9].data(),  g[10].data(), g[11].data(),
                                     g[12].data(), g[13].data(), g[14].data(), g[15].data()};
  const std::vector<S> xs = to_storage<S>(x), dys = to_storage<S>(dy);
  std::vector<S> y(xs.size()), dx(xs.size());
  aligned_buffer saved(Layer::saved_bytes(s));
  std::memset(saved.get(), 0xff, saved.bytes);  // NaN everywhere: a read before a write shows
  {
    aligned_buffer ws(Layer::forward_workspace_bytes(s, threads));
    std::memset(ws.get(), 0xff, ws.bytes);
    Layer::forward(s, wv, xs.data(), y.data(), saved.get(), saved.bytes, ws.get(), ws.bytes, pool);
  }
  result r;
  r.y = to_double(y.data(), y.size());
  if (!backward) return r;
  aligned_buffer ws(Layer::backward_workspace_bytes(s, threads));
  std::memset(ws.get(), 0xff, ws.bytes);
  Layer::backward(s, wv, xs.data(), saved.get(), saved.bytes, dys.data(), dx.data(), gv, ws.get(),
                  ws.bytes, pool);
  r.dx = to_double(dx.data(), dx.size());
  for (int i = 0; i < n_params; ++i) r.g.p[i] = to_double(g[i].data(), g[i].size());
  return r;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Central differences of L = Σ dy ⊙ y(θ) for every element of every parameter and of x. The
// error is O(h²)·L''' plus roundoff ~ε·|L|/h: with h = 1e-5 both stay below ~1e-9 relative to
// the tensor's largest gradient here; 1e-6 leaves a wide margin yet catches any wrong term.
template <typename Layer>
void finite_difference_case(const ttt_shape& s, std::uint64_t seed) {
  rng r{seed};
  params prm = make_params<Layer::mini_batch, Layer::is_mlp>(s, r);
  std::vector<double> x = r.fill(s.batch * s.seq * s.width, 1.0);
  const std::vector<double> dy = r.fill(x.size(), 1.0);
  const result an = run<Layer>(s, prm, x, dy, 2);
  const double h = 1e-5;
  const auto loss = [&] { return dot(run<Layer>(s, prm, x, dy, 1, false).y, dy); };
  for (int i = 0; i < n_params; ++i) {
    if (i == 12 && !s.use_gate) continue;
    std::vector<double> num(prm.p[i].size());
    for (std::size_t j = 0; j < num.size(); ++j) {
      const double keep = prm.p[i][j];
      prm.p[i][j] = keep + h;
      const double lp = loss();
      prm.p[i][j] = keep - h;
      const double lm = loss();
      prm.p[i][j] = keep;
      num[j] = (lp - lm) / (2 * h);
    }
    const double e = rel_err(an.g.p[i], num);
    INFO(std::string(param_names[i]) << " relative error " << e);
    CHECK(e <= 1e-6);
  }
  std::vector<double> num(x.size());
  for (std::size_t j = 0; j < x.size(); ++j) {
    const double keep = x[j];
    x[j] = keep + h;
    const double lp = loss();
    x[j] = keep - h;
    const double lm = loss();
    x[j] = keep;
    num[j] = (lp - lm) / (2 * h);
  }
  INFO("dx relative error " << rel_err(an.dx, num));
  CHECK(rel_err(an.dx, num) <= 1e-6);
}

ttt_shape shape_of(std::size_t B, std::size_t T, std::size_t C, std::size_t H, bool gate) {
  ttt_shape s;
  s.batch = B;
  s.seq = T;
  s.width = C;
  s.heads = H;
  s.use_gate = gate;
  return s;
}

template <std::size_t MB, typename G>
using f64_layer = membound::ttt_linear<membound::fp64_precision, membound::ttt_mini_batch<MB>, G>;
template <std::size_t MB, typename G>
using f64_mlp = membound::ttt_mlp<membound::fp64_precision, membound::ttt_mini_batch<MB>, G>;

}  // namespace

TEST_CASE("ttt_linear: backward equals finite differences of forward (double)") {
  using membound::ttt_state_groups;
  SUBCASE("mini-batch 3, T 8 (a short last mini-batch), gate") {
    finite_difference_case<f64_layer<3, ttt_state_groups<2>>>(shape_of(2, 8, 8, 2, true), 1);
  }
  SUBCASE("mini-batch 4, T 4, no gate") {
    finite_difference_case<f64_layer<4, ttt_state_groups<1>>>(shape_of(1, 4, 8, 2, false), 2);
  }
  SUBCASE("TTT-MLP: mini-batch 3, T 8, gate") {
    finite_difference_case<f64_mlp<3, ttt_state_groups<2>>>(shape_of(2, 8, 8, 2, true), 4);
  }
  SUBCASE("TTT-MLP: mini-batch 1, no gate") {
    finite_difference_case<f64_mlp<1, membound::ttt_state_groups_all>>(shape_of(1, 4, 4, 1, false), 5);
  }
  SUBCASE("mini-batch 1") {
    finite_difference_case<f64_layer<1, membound::ttt_state_groups_all>>(shape_of(1, 5, 4, 1, true), 3);
  }
}

namespace {

// The reference's weights from ours (the same tensors, in a different order).
membound::reference::ttt_weights to_reference(const params& p, bool gate) {
  membound::reference::ttt_weights w;
  w.wq = p.p[0];
  w.wk = p.p[1];
  w.wv = p.p[2];
  w.ttt_norm_weight = p.p[3];
  w.ttt_norm_bias = p.p[4];
  w.w1 = p.p[5];
  w.b1 = p.p[6];
  w.lr_weight = p.p[7];
  w.lr_bias = p.p[8];
  w.token_offset = p.p[9];
  w.post_norm_weight = p.p[10];
  w.post_norm_bias = p.p[11];
  if (gate) w.wg = p.p[12];
  w.wo = p.p[13];
  w.w2 = p.p[14];
  w.b2 = p.p[15];
  return w;
}

// The reference's config for a layer at shape s (one sequence per batch row).
template <typename Layer>
membound::reference::ttt_config reference_config(const ttt_shape& s) {
  membound::reference::ttt_config c;
  c.kind = Layer::is_mlp ? membound::reference::ttt_kind::mlp : membound::reference::ttt_kind::linear;
  c.batch = s.batch;
  c.seq = s.seq;
  c.width = s.width;
  c.heads = s.heads;
  c.mini_batch = Layer::mini_batch;
  c.use_gate = s.use_gate;
  return c;
}

// The reference's y, dx and gradients in the order of `params` (wg empty without the gate).
result reference_result(const membound::reference::ttt_config& c, const params& prm,
                        const std::vector<double>& x, const std::vector<double>& dy) {
  const auto w = to_reference(prm, c.use_gate);
  const auto want = membound::reference::ttt_reference_gradients(c, w, x, dy);
  result r;
  r.y = membound::reference::ttt_forward(c, w, x).out;
  r.dx = want.dx;
  const std::vector<double>* g[n_params] = {
      &want.dw.wq,          &want.dw.wk,           &want.dw.wv,        &want.dw.ttt_norm_weight,
      &want.dw.ttt_norm_bias, &want.dw.w1,         &want.dw.b1,        &want.dw.lr_weight,
      &want.dw.lr_bias,     &want.dw.token_offset, &want.dw.post_norm_weight,
      &want.dw.post_norm_bias, &want.dw.wg,        &want.dw.wo,        &want.dw.w2,
      &want.dw.b2};
  for (int i = 0; i < n_params; ++i) r.g.p[i] = *g[i];
  return r;
}

}  // namespace

// The primal-form reference (explicit per-token W, exact gradients by dual numbers), itself
// checked against upstream's TTTLinear in PyTorch float64. Same operations in another order:
// agreement to a few hundred ulps of double; 1e-10 relative per tensor.
TEST_CASE("ttt_linear and ttt_mlp <fp64> match the primal-form reference to 1e-10") {
  using membound::ttt_state_groups;
  const auto check_case = [](auto tag, const ttt_shape& s, std::uint64_t seed) {
    using Layer = typename decltype(tag)::type;
    rng r{seed};
    const params prm = make_params<Layer::mini_batch, Layer::is_mlp>(s, r);
    const std::vector<double> x = r.fill(s.batch * s.seq * s.width, 1.0), dy = r.fill(x.size(), 1.0);
    const result got = run<Layer>(s, prm, x, dy, 2);
    const result want = reference_result(reference_config<Layer>(s), prm, x, dy);
    CHECK(rel_err(got.y, want.y) <= 1e-10);
    CHECK(rel_err(got.dx, want.dx) <= 1e-10);
    params want_g = want.g;
    if (!s.use_gate) want_g.p[12] = got.g.p[12];
    double worst = 0;
    for (int i = 0; i < n_params; ++i) {
      const double e = rel_err(got.g.p[i], want_g.p[i]);
      INFO(std::string(param_names[i]) << " relative error " << e);
      CHECK(e <= 1e-10);
      worst = std::max(worst, e);
    }
    MESSAGE("worst gradient relative error " << worst);
  };
  check_case(std::type_identity<f64_layer<4, ttt_state_groups<2>>>{},
             shape_of(2, 11, 16, 2, true), 21);  // short last mini-batch, gate
  check_case(std::type_identity<f64_layer<1, ttt_state_groups<3>>>{},
             shape_of(1, 5, 8, 2, false), 22);   // b = 1
  check_case(std::type_identity<f64_layer<16, membound::ttt_state_groups_all>>{},
             shape_of(1, 7, 8, 1, false), 23);   // T < b
  check_case(std::type_identity<f64_mlp<4, ttt_state_groups<2>>>{},
             shape_of(2, 11, 16, 2, true), 24);  // TTT-MLP
  check_case(std::type_identity<f64_mlp<16, membound::ttt_state_groups_all>>{},
             shape_of(1, 7, 8, 1, false), 25);   // TTT-MLP, T < b
}

// fp32: u = 2^-24. The longest sums are the projections' and weight gradients' (C = 16 and
// B·T = 22 terms) and the inner loop's D = 8-term products over 3 mini-batches; LayerNorms divide
// by σ ~ 0.1..1. Observed errors are ~1e-6; 2e-5 relative per tensor leaves a margin of ~10.
// bf16/fp16 (u = 2^-8, 2^-11) round x, the weights, the heads' output and y once each against
// fp32 on the same inputs; 16u relative per tensor.
TEST_CASE("ttt_linear: fp32 against the reference, bf16 and fp16 against fp32") {
  using membound::ttt_state_groups;
  using membound::ttt_mini_batch;
  const ttt_shape s = shape_of(2, 11, 16, 2, true);
  rng r{31};
  params prm = make_params<4>(s, r);
  std::vector<double> x = r.fill(s.batch * s.seq * s.width, 1.0), dy = r.fill(x.size(), 1.0);
  using f32 = membound::ttt_linear<ttt_mini_batch<4>, ttt_state_groups<2>>;
  const auto compare = [](const result& a, const result& b, double tol) {
    CHECK(rel_err(a.y, b.y) <= tol);
    CHECK(rel_err(a.dx, b.dx) <= tol);
    double worst = std::max(rel_err(a.y, b.y), rel_err(a.dx, b.dx));
    for (int i = 0; i < n_params; ++i) {
      const double e = rel_err(a.g.p[i], b.g.p[i]);
      INFO(std::string(param_names[i]) << " relative error " << e);
      CHECK(e <= tol);
      worst = std::max(worst, e);
    }
    return worst;
  };
  // Inputs rounded to the storage type first, so every layer sees the same values.
  const auto round_all = [&](auto tag) {
    using S = typename decltype(tag)::type;
    for (auto& v : prm.p) v = membound_test::rounded<S>(v);
    x = membound_test::rounded<S>(x);
    dy = membound_test::rounded<S>(dy);
  };
  round_all(std::type_identity<float>{});
  const result want = run<f64_layer<4, ttt_state_groups<2>>>(s, prm, x, dy, 2);
  MESSAGE("fp32 worst relative error " << compare(run<f32>(s, prm, x, dy, 2), want, 2e-5));
  round_all(std::type_identity<membound::bf16>{});
  const result base = run<f32>(s, prm, x, dy, 2);
  MESSAGE("bf16 worst relative error against fp32 "
          << compare(run<membound::ttt_linear<membound::bf16_precision, ttt_mini_batch<4>,
                                              ttt_state_groups<2>>>(s, prm, x, dy, 2),
                     base, 16 * 0x1.0p-8));
  MESSAGE("fp16 worst relative error against fp32 "
          << compare(run<membound::ttt_linear<membound::fp16_precision, ttt_mini_batch<4>,
                                              ttt_state_groups<2>>>(s, prm, x, dy, 2),
                     base, 16 * 0x1.0p-11));
}

TEST_CASE("ttt_linear: state groups and thread counts do not change the results") {
  using membound::ttt_state_groups;
  const ttt_shape s = shape_of(2, 23, 16, 2, true);
  rng r{4};
  const params prm = make_params<4>(s, r);
  const std::vector<double> x = r.fill(s.batch * s.seq * s.width, 1.0), dy = r.fill(x.size(), 1.0);
  const result g1 = run<f64_layer<4, ttt_state_groups<1>>>(s, prm, x, dy, 1);
  const auto same = [&](const result& o) {
    CHECK(o.y == g1.y);
    CHECK(o.dx == g1.dx);
    for (int i = 0; i < n_params; ++i) {
      INFO(std::string(param_names[i]));
      CHECK(o.g.p[i] == g1.g.p[i]);
    }
  };
  same(run<f64_layer<4, ttt_state_groups<1>>>(s, prm, x, dy, 2));
  same(run<f64_layer<4, ttt_state_groups<2>>>(s, prm, x, dy, 1));
  same(run<f64_layer<4, ttt_state_groups<2>>>(s, prm, x, dy, 2));
  same(run<f64_layer<4, membound::ttt_state_groups_all>>(s, prm, x, dy, 3));
  same(run<f64_layer<4, ttt_state_groups<1>>>(s, prm, x, dy, 3));
  // TTT-MLP too.
  const params pm = make_params<4, true>(s, r);
  const result m1 = run<f64_mlp<4, ttt_state_groups<1>>>(s, pm, x, dy, 1);
  for (const result& o : {run<f64_mlp<4, ttt_state_groups<2>>>(s, pm, x, dy, 2),
                          run<f64_mlp<4, membound::ttt_state_groups_all>>(s, pm, x, dy, 3)}) {
    CHECK(o.y == m1.y);
    CHECK(o.dx == m1.dx);
    for (int i = 0; i < n_params; ++i) CHECK(o.g.p[i] == m1.g.p[i]);
  }
}

namespace {

// Sequence lengths as packed offsets [0, l0, l0 + l1, ...].
std::vector<std::int32_t> offsets_of(const std::vector<std::size_t>& lengths) {
  std::vector<std::int32_t> o{0};
  for (const std::size_t n : lengths) o.push_back(o.back() + static_cast<std::int32_t>(n));
  return o;
}

// One layer over packed sequences against each sequence alone through the primal-form reference
// (rows of y and dx in place, the weight gradients summed over sequences), 1e-10 relative per
// tensor as for one sequence; the same bits on 1, 2 and 3 threads and under every state group.
template <typename Layer, typename... Same>
void packed_case(const std::vector<std::size_t>& lengths, bool gate, std::uint64_t seed) {
  const std::vector<std::int32_t> offsets = offsets_of(lengths);
  const auto N = static_cast<std::size_t>(offsets.back());
  ttt_shape s = shape_of(1, N, 8, 2, gate);
  s.offsets = offsets.data();
  s.sequences = lengths.size();
  REQUIRE(Layer::can_implement(s).ok);
  rng r{seed};
  const params prm = make_params<Layer::mini_batch, Layer::is_mlp>(s, r);
  const std::vector<double> x = r.fill(N * s.width, 1.0), dy = r.fill(x.size(), 1.0);
  const result got = run<Layer>(s, prm, x, dy, 2);

  const std::size_t C = s.width;
  result want;
  want.y.assign(N * C, 0.0);
  want.dx.assign(N * C, 0.0);
  for (int i = 0; i < n_params; ++i) want.g.p[i].assign(got.g.p[i].size(), 0.0);
  for (std::size_t q = 0; q < lengths.size(); ++q) {
    const std::size_t T = lengths[q], o = static_cast<std::size_t>(offsets[q]);
    if (T == 0) continue;
    const auto rows = [&](const std::vector<double>& v) {
      return std::vector<double>(v.begin() + static_cast<std::ptrdiff_t>(o * C),
                                 v.begin() + static_cast<std::ptrdiff_t>((o + T) * C));
    };
    const result alone = reference_result(reference_config<Layer>(shape_of(1, T, 8, 2, gate)), prm,
                                          rows(x), rows(dy));
    std::copy(alone.y.begin(), alone.y.end(), want.y.begin() + static_cast<std::ptrdiff_t>(o * C));
    std::copy(alone.dx.begin(), alone.dx.end(), want.dx.begin() + static_cast<std::ptrdiff_t>(o * C));
    for (int i = 0; i < n_params; ++i)
      for (std::size_t e = 0; e < alone.g.p[i].size(); ++e) want.g.p[i][e] += alone.g.p[i][e];
  }
  double worst = std::max(rel_err(got.y, want.y), rel_err(got.dx, want.dx));
  CHECK(rel_err(got.y, want.y) <= 1e-10);
  CHECK(rel_err(got.dx, want.dx) <= 1e-10);
  for (int i = 0; i < n_params; ++i) {
    if (i == 12 && !gate) continue;
    const double e = rel_err(got.g.p[i], want.g.p[i]);
    INFO(std::string(param_names[i]) << " relative error " << e);
    CHECK(e <= 1e-10);
    worst = std::max(worst, e);
  }
  MESSAGE(std::string(Layer::is_mlp ? "packed TTT-MLP" : "packed TTT-Linear") << ": worst relative error " << worst);

  const auto same = [&](const result& o) {
    CHECK(o.y == got.y);
    CHECK(o.dx == got.dx);
    for (int i = 0; i < n_params; ++i) {
      INFO(std::string(param_names[i]));
      CHECK(o.g.p[i] == got.g.p[i]);
    }
  };
  same(run<Layer>(s, prm, x, dy, 1));
  same(run<Layer>(s, prm, x, dy, 3));
  (same(run<Same>(s, prm, x, dy, 2)), ...);
}

}  // namespace

// Lengths 1, b − 1, b, b + 1, an empty one, a long one among short ones (several state groups),
// with b = 4 and G = 2; then S − 1 single tokens and one long sequence, the packing that keeps
// the most states (saved_states' worst case, reached exactly).
TEST_CASE("ttt_linear and ttt_mlp: packed sequences equal each sequence run alone") {
  using membound::ttt_state_groups;
  using membound::ttt_state_groups_all;
  const std::vector<std::size_t> mixed = {1, 3, 4, 5, 0, 14, 2, 9}, worst = {1, 1, 1, 1, 1, 1, 1, 31};
  packed_case<f64_layer<4, ttt_state_groups<2>>, f64_layer<4, ttt_state_groups<1>>,
              f64_layer<4, ttt_state_groups_all>>(mixed, true, 41);
  packed_case<f64_layer<4, ttt_state_groups<2>>, f64_layer<4, ttt_state_groups<3>>>(worst, false, 42);
  packed_case<f64_mlp<4, ttt_state_groups<2>>, f64_mlp<4, ttt_state_groups_all>>(mixed, true, 43);
  packed_case<f64_mlp<4, ttt_state_groups<2>>>(worst, false, 44);
}

// The saved states of a packed shape are the most any packing of its tokens into its sequences
// keeps: at least every packing's Σ ceil(ceil(L / b) / G), equal for the worst one, and the same
// whatever the offsets say (one buffer serves every batch of the same totals). One sequence keeps
// what the unpacked shape keeps, and a packed layer with one sequence is the unpacked layer, bit
// for bit.
TEST_CASE("ttt_linear: packed saved states are the worst case over packings, exactly") {
  using membound::ttt_state_groups;
  using layer = membound::ttt_linear<membound::ttt_mini_batch<4>, ttt_state_groups<3>>;
  rng r{45};
  for (int trial = 0; trial < 200; ++trial) {
    const std::size_t S = 1 + static_cast<std::size_t>(r.uniform(0.0, 9.99));
    std::vector<std::size_t> lengths(S);
    std::size_t kept = 0;
    for (std::size_t& n : lengths) {
      n = static_cast<std::size_t>(r.uniform(0.0, 40.0));
      if (n != 0) kept += ((n - 1) / 4) / 3 + 1;  // ceil(ceil(n / 4) / 3)
    }
    const std::vector<std::int32_t> offsets = offsets_of(lengths);
    ttt_shape s = shape_of(1, static_cast<std::size_t>(offsets.back()), 8, 2, false);
    if (s.seq == 0) continue;
    s.offsets = offsets.data();
    s.sequences = S;
    REQUIRE(layer::can_implement(s).ok);
    CHECK(layer::saved_states(s) >= kept);
    // The worst packing of the same totals: S' − 1 single tokens and the rest in one.
    const std::size_t n = std::min(S, s.seq), rest = s.seq - (n - 1);
    CHECK(layer::saved_states(s) == (n - 1) + (((rest - 1) / 4) / 3 + 1));
  }
  const std::vector<std::int32_t> one = {0, 23};
  ttt_shape s = shape_of(1, 23, 8, 2, false), packed = s;
  packed.offsets = one.data();
  packed.sequences = 1;
  CHECK(layer::saved_bytes(packed) == layer::saved_bytes(s));
  CHECK(layer::backward_workspace_bytes(packed, 2) == layer::backward_workspace_bytes(s, 2));
  const params prm = make_params<4>(s, r);
  const std::vector<double> x = r.fill(23 * 8, 1.0), dy = r.fill(x.size(), 1.0);
  const result a = run<f64_layer<4, ttt_state_groups<3>>>(s, prm, x, dy, 2),
               b = run<f64_layer<4, ttt_state_groups<3>>>(packed, prm, x, dy, 2);
  CHECK(a.y == b.y);
  CHECK(a.dx == b.dx);
  for (int i = 0; i < n_params; ++i) CHECK(a.g.p[i] == b.g.p[i]);
}

// Offsets that do not describe the token axis are refused naming the field, and so is decoding a
// packed shape (a decoding state is one sequence's: decode sequences as batch rows).
TEST_CASE("ttt_linear: bad packed offsets and packed decoding get typed errors") {
  using layer = membound::ttt_linear<>;
  std::vector<std::int32_t> offsets{0, 3, 7};
  ttt_shape s = shape_of(1, 7, 8, 2, false);
  s.offsets = offsets.data();
  s.sequences = 2;
  CHECK(layer::can_implement(s).ok);
  offsets = {0, 3, 8};
  CHECK(std::string(layer::can_implement(s).argument) == "shape.offsets");
  offsets = {0, 4, 3};
  CHECK(std::string(layer::can_implement(s).argument) == "shape.offsets");
  offsets = {1, 3, 7};
  CHECK(std::string(layer::can_implement(s).argument) == "shape.offsets");
  offsets = {0, 3, 7};
  ttt_shape b2 = s;
  b2.batch = 2;
  CHECK(std::string(layer::can_implement(b2).argument) == "shape.batch");
  // Sequences without offsets size a call for any packing (a plan's shape): the same bytes.
  ttt_shape no_offsets = s;
  no_offsets.offsets = nullptr;
  CHECK(layer::can_implement(no_offsets).ok);
  CHECK(layer::saved_bytes(no_offsets) == layer::saved_bytes(s));
  CHECK(layer::backward_workspace_bytes(no_offsets, 2) == layer::backward_workspace_bytes(s, 2));
  try {
    layer::check(b2);
    FAIL("no throw");
  } catch (const membound::invalid_argument& e) {
    CHECK(e.argument() == "shape.batch");
  }
  // Decoding: refused before the state or y_t is touched.
  rng r{46};
  const params prm = make_params<16>(s, r);
  std::vector<float> w[n_params];
  for (int i = 0; i < n_params; ++i) w[i] = to_storage<float>(prm.p[i]);
  const layer::weights wv{w[0].data(), w[1].data(), w[2].data(), w[3].data(), w[4].data(),
                          w[5].data(), w[6].data(), w[7].data(), w[8].data(), w[9].data(),
                          w[10].data(), w[11].data(), w[12].data(), w[13].data()};
  const ttt_shape plain = shape_of(1, 7, 8, 2, false);
  aligned_buffer st_mem(layer::state_bytes(plain)), ws(layer::step_workspace_bytes(plain));
  layer::state st = layer::make_state(plain, wv, st_mem.get(), st_mem.bytes);
  std::vector<float> xt(8, 0.5f), yt(8, 7.0f);
  thread_pool pool(1);
  try {
    layer::step(s, wv, st, xt.data(), yt.data(), ws.get(), ws.bytes, pool);
    FAIL("no throw");
  } catch (const membound::invalid_argument& e) {
    CHECK(e.argument() == "shape.offsets");
  }
  CHECK(st.position == 0);
  // Running needs the offsets: forward refuses a sizing-only shape before writing y.
  std::vector<float> x(7 * 8, 0.5f), y(7 * 8, 7.0f);
  aligned_buffer saved(layer::saved_bytes(no_offsets)), fws(layer::forward_workspace_bytes(no_offsets, 1));
  try {
    layer::forward(no_offsets, wv, x.data(), y.data(), saved.get(), saved.bytes, fws.get(), fws.bytes, pool);
    FAIL("a forward ran packed sequences without their offsets");
  } catch (const membound::invalid_argument& e) {
    CHECK(e.argument() == "shape.offsets");
  }
  CHECK(std::all_of(y.begin(), y.end(), [](float v) { return v == 7.0f; }));
  CHECK(std::all_of(yt.begin(), yt.end(), [](float v) { return v == 7.0f; }));
}

TEST_CASE("ttt_linear: saved bytes fall with G as reported; peak is as reported") {
  using membound::ttt_state_groups;
  const ttt_shape s = shape_of(1, 256, 64, 4, false);  // 16 mini-batches of 16, D = 16
  using g1 = membound::ttt_linear<ttt_state_groups<1>>;
  using g4 = membound::ttt_linear<ttt_state_groups<4>>;
  using gall = membound::ttt_linear<membound::ttt_state_groups_all>;
  const std::size_t per_state = (16 * 16 + 16) * sizeof(float) * 4;  // 4 heads
  CHECK(g1::saved_state_bytes(s) == 16 * per_state);
  CHECK(g4::saved_state_bytes(s) == 4 * per_state);
  CHECK(gall::saved_state_bytes(s) == 1 * per_state);
  CHECK(g1::saved_bytes(s) - g4::saved_bytes(s) == 12 * per_state);
  static_assert(g4::saved_bytes(ttt_shape{1, 256, 64, 4}) > 0);
  // Peak through a budget allocator: saved + the larger workspace, nothing else.
  using alloc_t = membound::budget_allocator<membound::caching_allocator<membound::system_allocator>>;
  rng r{6};
  const params prm = make_params<16>(s, r);
  std::vector<float> w[n_params], g[n_params];
  for (int i = 0; i < n_params; ++i) {
    w[i] = to_storage<float>(prm.p[i]);
    g[i].assign(w[i].size(), 0.0f);
  }
  const g4::weights wv{w[0].data(), w[1].data(), w[2].data(), w[3].data(), w[4].data(),
                       w[5].data(), w[6].data(), w[7].data(), w[8].data(), w[9].data(),
                       w[10].data(), w[11].data(), w[12].data(), w[13].data()};
  const g4::gradients gv{g[0].data(), g[1].data(), g[2].data(), g[3].data(), g[4].data(),
                         g[5].data(), g[6].data(), g[7].data(), g[8].data(), g[9].data(),
                         g[10].data(), g[11].data(), g[12].data(), g[13].data()};
  const std::vector<float> x = to_storage<float>(r.fill(256 * 64, 1.0)), dy = x;
  std::vector<float> y(x.size()), dx(x.size());
  thread_pool pool(2);
  alloc_t alloc(std::size_t{1} << 30);
  const std::size_t sn = g4::saved_bytes(s), fws = g4::forward_workspace_bytes(s, 2),
                    bws = g4::backward_workspace_bytes(s, 2);
  const auto act = membound::memory_tag::activations, wst = membound::memory_tag::workspace;
  void* saved = alloc.allocate(sn, membound::default_alignment, act);
  void* ws = alloc.allocate(fws, membound::default_alignment, wst);
  g4::forward(s, wv, x.data(), y.data(), saved, sn, ws, fws, pool);
  alloc.deallocate(ws, fws, membound::default_alignment, wst);
  ws = alloc.allocate(bws, membound::default_alignment, wst);
  g4::backward(s, wv, x.data(), saved, sn, dy.data(), dx.data(), gv, ws, bws, pool);
  alloc.deallocate(ws, bws, membound::default_alignment, wst);
  alloc.deallocate(saved, sn, membound::default_alignment, act);
  CHECK(alloc.stats().peak_requested == sn + std::max(fws, bws));
  CHECK(std::isfinite(dx[0]));
  MESSAGE("saved " << sn << " B (states " << g4::saved_state_bytes(s) << "), forward ws " << fws
                   << ", backward ws " << bws);
}

namespace {

template <typename layer>
void step_case(std::size_t batch = 2, std::size_t seq = 11, std::size_t threads = 1) {
  const ttt_shape s = shape_of(batch, seq, 16, 2, true);
  rng r{8};
  const params prm = make_params<4, layer::is_mlp>(s, r);
  const std::vector<double> x = r.fill(s.batch * s.seq * s.width, 1.0);
  const std::vector<double> full = run<layer>(s, prm, x, x, 1, false).y;
  thread_pool pool(threads);
  const typename layer::weights wv{
      prm.p[0].data(),  prm.p[1].data(),  prm.p[2].data(),  prm.p[3].data(),
      prm.p[4].data(),  prm.p[5].data(),  prm.p[6].data(),  prm.p[7].data(),
      prm.p[8].data(),  prm.p[9].data(),  prm.p[10].data(), prm.p[11].data(),
      prm.p[12].data(), prm.p[13].data(), prm.p[14].data(), prm.p[15].data()};
  aligned_buffer st_mem(layer::state_bytes(s)), ws(layer::step_workspace_bytes(s));
  typename layer::state st = layer::make_state(s, wv, st_mem.get(), st_mem.bytes);
  const std::size_t B = s.batch, T = s.seq, C = s.width;
  std::vector<double> stepped(x.size()), xt(B * C), yt(B * C);
  const auto at = [](std::size_t i) { return static_cast<std::ptrdiff_t>(i); };
  for (std::size_t t = 0; t < T; ++t) {
    for (std::size_t b = 0; b < B; ++b)
      std::copy(x.begin() + at((b * T + t) * C), x.begin() + at((b * T + t + 1) * C),
                xt.begin() + at(b * C));
    layer::step(s, wv, st, xt.data(), yt.data(), ws.get(), ws.bytes, pool);
    for (std::size_t b = 0; b < B; ++b)
      std::copy(yt.begin() + at(b * C), yt.begin() + at((b + 1) * C),
                stepped.begin() + at((b * T + t) * C));
  }
  // The same sums in a different order (running sums instead of the dual form's products).
  CHECK(rel_err(stepped, full) <= 1e-12);
  CHECK(st.position == T);
}

}  // namespace

TEST_CASE("ttt_linear::step and ttt_mlp::step reproduce the full forward, token by token") {
  step_case<f64_layer<4, membound::ttt_state_groups<2>>>();
  step_case<f64_mlp<4, membound::ttt_state_groups<2>>>();
  // 300 sequences: the projections run as two 256-row tasks, each with its own packing buffers.
  step_case<f64_layer<4, membound::ttt_state_groups<2>>>(300, 5, 2);
}

TEST_CASE("ttt_linear: bad input is refused by name") {
  using layer = membound::ttt_linear<>;
  const auto refused = [](ttt_shape s, const char* argument) {
    INFO(argument);
    try {
      layer::check(s);
      FAIL("no throw");
    } catch (const membound::invalid_argument& e) {
      CHECK(e.argument() == argument);
    }
  };
  refused(shape_of(0, 4, 8, 2, false), "shape.batch");
  refused(shape_of(1, 0, 8, 2, false), "shape.seq");
  refused(shape_of(1, 4, 8, 0, false), "shape.heads");
  refused(shape_of(1, 4, 9, 2, false), "shape.width");
  refused(shape_of(1, 4, 6, 2, false), "shape.width");  // head_dim 3 is odd
  ttt_shape s = shape_of(1, 4, 8, 2, false);
  s.base_lr = -1.0;
  refused(s, "shape.base_lr");
  // A workspace too small names the workspace and leaves y untouched.
  s.base_lr = 1.0;
  rng r{9};
  const params prm = make_params<16>(s, r);
  std::vector<float> w[n_params];
  for (int i = 0; i < n_params; ++i) w[i] = to_storage<float>(prm.p[i]);
  const layer::weights wv{w[0].data(), w[1].data(), w[2].data(), w[3].data(), w[4].data(),
                          w[5].data(), w[6].data(), w[7].data(), w[8].data(), w[9].data(),
                          w[10].data(), w[11].data(), w[12].data(), w[13].data()};
  std::vector<float> x(4 * 8, 0.5f), y(4 * 8, 7.0f);
  aligned_buffer saved(layer::saved_bytes(s)), ws(layer::forward_workspace_bytes(s, 1));
  thread_pool pool(1);
  try {
    layer::forward(s, wv, x.data(), y.data(), saved.get(), saved.bytes, ws.get(), ws.bytes - 4, pool);
    FAIL("no throw");
  } catch (const membound::workspace_too_small& e) {
    CHECK(e.argument() == "workspace");
  }
  CHECK(std::all_of(y.begin(), y.end(), [](float v) { return v == 7.0f; }));
}
