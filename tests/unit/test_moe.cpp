// The mixture-of-experts feed-forward (layers/moe_mlp.hpp) against a plain double loop written
// from the formulas (router softmax, top-k with ties to the lower expert, GShard's dispatch order
// with Switch's capacity, the gates, Mixtral's balancing loss), and its backward against central
// finite differences of that loop. Also: one expert is swiglu_mlp bit for bit; the bits do not
// depend on the thread count; adversarial routings drop what the capacity says and never need
// more rows than moe_rows; bad shapes get typed errors naming the field. In models and the
// trainer: test_moe_model.cpp.
//
// Tolerances: fp64 against the loop differs only in summation order: 1e-12 relative. Finite
// differences with step 1e-6 in double: truncation ~h² and cancellation ~1e-16/h, 1e-6 relative
// normwise (the routing is the same at x ± h: the test data keeps its probability gaps far above
// h). bf16 rounds inputs, weights, pre-activations and outputs to 8 bits: 3e-2 relative (as
// test_model_parts' SwiGLU).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "../support/layer_test_util.hpp"
#include "../support/test_rng.hpp"
#include "membound/layers/moe_mlp.hpp"
#include "membound/layers/swiglu_mlp.hpp"

namespace mb = membound;
using membound_test::aligned_buffer;
using membound_test::rel_err;

namespace {

struct moe_weights {
  std::vector<double> wr, wg, wu, wd;  // [C, E], [E, C, F], [E, C, F], [E, F, C]
};

moe_weights random_weights(membound_test::rng& r, const mb::moe_shape& s, double router_scale) {
  const std::size_t C = s.width, F = s.hidden, E = s.experts;
  return {r.fill(C * E, router_scale), r.fill(E * C * F, 0.4), r.fill(E * C * F, 0.4),
          r.fill(E * F * C, 0.4)};
}

struct naive_out {
  std::vector<double> y;
  double aux = 0;
  std::size_t dropped = 0, tokens_dropped = 0, max_rows = 0;
};

// The formulas, one token at a time.
naive_out naive_moe(const mb::moe_shape& s, const moe_weights& w, const std::vector<double>& x) {
  const std::size_t N = s.batch * s.seq, C = s.width, F = s.hidden, E = s.experts, k = s.top_k;
  naive_out o{std::vector<double>(N * C)};
  std::vector<double> p(N * E);
  std::vector<std::size_t> choice(N * k);
  std::vector<double> gate(N * k);
  for (std::size_t t = 0; t < N; ++t) {
    double m = -std::numeric_limits<double>::infinity();
    std::vector<double> l(E);
    for (std::size_t e = 0; e < E; ++e) {
      for (std::size_t c = 0; c < C; ++c) l[e] += x[t * C + c] * w.wr[c * E + e];
      m = std::max(m, l[e]);
    }
    double z = 0;
    for (std::size_t e = 0; e < E; ++e) z += std::exp(l[e] - m);
    for (std::size_t e = 0; e < E; ++e) p[t * E + e] = std::exp(l[e] - m) / z;
    std::vector<std::size_t> order(E);
    for (std::size_t e = 0; e < E; ++e) order[e] = e;
    std::stable_sort(order.begin(), order.end(),
                     [&](std::size_t a, std::size_t b) { return p[t * E + a] > p[t * E + b]; });
    double sum = 0;
    for (std::size_t j = 0; j < k; ++j) {
      choice[t * k + j] = order[j];
      sum += p[t * E + order[j]];
    }
    for (std::size_t j = 0; j < k; ++j)
      gate[t * k + j] = s.renormalize && k > 1 ? p[t * E + order[j]] / sum : p[t * E + order[j]];
  }
  // Capacity: first choices of every token, then second choices.
  const std::size_t cap = s.capacity_factor > 0
                              ? std::min<std::size_t>(N, static_cast<std::size_t>(std::floor(
                                                             s.capacity_factor * double(N * k) / double(E))))
                              : N;
  std::vector<std::size_t> load(E);
  std::vector<char> kept(N * k);
  for (std::size_t j = 0; j < k; ++j)
    for (std::size_t t = 0; t < N; ++t) {
      const std::size_t e = choice[t * k + j];
      kept[t * k + j] = load[e] < cap;
      if (kept[t * k + j]) ++load[e];
      else ++o.dropped;
    }
  for (std::size_t e = 0; e < E; ++e) o.max_rows = std::max(o.max_rows, load[e]);
  for (std::size_t t = 0; t < N; ++t) {
    bool any = false;
    for (std::size_t j = 0; j < k; ++j) {
      if (!kept[t * k + j]) continue;
      any = true;
      const std::size_t e = choice[t * k + j];
      std::vector<double> act(F);
      for (std::size_t f = 0; f < F; ++f) {
        double a = 0, b = 0;
        for (std::size_t c = 0; c < C; ++c) {
          a += x[t * C + c] * w.wg[(e * C + c) * F + f];
          b += x[t * C + c] * w.wu[(e * C + c) * F + f];
        }
        act[f] = a / (1.0 + std::exp(-a)) * b;
      }
      for (std::size_t c = 0; c < C; ++c) {
        double v = 0;
        for (std::size_t f = 0; f < F; ++f) v += act[f] * w.wd[(e * F + f) * C + c];
        o.y[t * C + c] += gate[t * k + j] * v;
      }
    }
    o.tokens_dropped += any ? 0 : 1;
  }
  double aux = 0;
  for (std::size_t e = 0; e < E; ++e) {
    double f = 0, P = 0;
    for (std::size_t q = 0; q < N * k; ++q) f += choice[q] == e ? 1.0 : 0.0;
    for (std::size_t t = 0; t < N; ++t) P += p[t * E + e];
    aux += f / double(N) * P / double(N);
  }
  o.aux = s.aux_loss_weight * double(E) * aux;
  return o;
}

struct layer_out {
  std::vector<double> y, dx, dwr, dwg, dwu, dwd;
  mb::moe_stats stats;
};

template <typename P>
layer_out run_moe(const mb::moe_shape& s, const moe_weights& w, const std::vector<double>& x,
                  const std::vector<double>& dy, std::size_t threads) {
  using L = mb::moe_mlp<P>;
  using S = typename L::storage_type;
  using membound_test::to_double;
  using membound_test::to_storage;
  mb::thread_pool pool(threads);
  const std::size_t N = s.batch * s.seq, C = s.width;
  auto xs = to_storage<S>(x), dys = to_storage<S>(dy);
  auto wr = to_storage<S>(w.wr), wg = to_storage<S>(w.wg), wu = to_storage<S>(w.wu),
       wd = to_storage<S>(w.wd);
  std::vector<S> y(N * C), dx(N * C), gr(wr.size(), S(0.0f)), gg(wg.size(), S(0.0f)),
      gu(wu.size(), S(0.0f)), gd(wd.size(), S(0.0f));
  // Exact sizes: the sanitizer build reports any byte past them.
  aligned_buffer saved(L::saved_bytes(s)), fws(L::forward_workspace_bytes(s, threads)),
      bws(L::backward_workspace_bytes(s, threads));
  const typename L::weights lw{wr.data(), wg.data(), wu.data(), wd.data()};
  layer_out o;
  L::forward(s, lw, xs.data(), y.data(), saved.get(), saved.bytes, fws.get(), fws.bytes, pool, &o.stats);
  L::backward(s, lw, xs.data(), saved.get(), saved.bytes, dys.data(), dx.data(),
              {gr.data(), gg.data(), gu.data(), gd.data()}, bws.get(), bws.bytes, pool);
  o.y = to_double(y.data(), y.size());
  o.dx = to_double(dx.data(), dx.size());
  o.dwr = to_double(gr.data(), gr.size());
  o.dwg = to_double(gg.data(), gg.size());
  o.dwu = to_double(gu.data(), gu.size());
  o.dwd = to_double(gd.data(), gd.size());
  return o;
}

// Central differences of loss() in every entry of v (which loss() reads).
template <typename Loss>
std::vector<double> central_diff(std::vector<double>& v, Loss&& loss) {
  const double h = 1e-6;
  std::vector<double> g(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    const double keep = v[i];
    v[i] = keep + h;
    const double up = loss();
    v[i] = keep - h;
    const double down = loss();
    v[i] = keep;
    g[i] = (up - down) / (2 * h);
  }
  return g;
}

void check_against_loop(const mb::moe_shape& s, std::uint64_t seed) {
  membound_test::rng r{seed};
  moe_weights w = random_weights(r, s, 1.5);
  std::vector<double> x = r.fill(s.batch * s.seq * s.width, 1.0);
  const std::vector<double> R = r.fill(x.size(), 1.0);
  const naive_out ref = naive_moe(s, w, x);
  const layer_out got = run_moe<mb::fp64_precision>(s, w, x, R, 2);
  CHECK(rel_err(got.y, ref.y) < 1e-12);
  CHECK(std::abs(got.stats.aux_loss - ref.aux) <= 1e-12 * std::max(1.0, ref.aux));
  CHECK(got.stats.dropped == ref.dropped);
  CHECK(got.stats.tokens_dropped == ref.tokens_dropped);
  CHECK(got.stats.max_expert_rows == ref.max_rows);
  // Backward (with dy = R) against L = Σ y·R + aux, differentiated through the loop.
  const auto loss = [&] {
    const naive_out o = naive_moe(s, w, x);
    double l = o.aux;
    for (std::size_t i = 0; i < o.y.size(); ++i) l += o.y[i] * R[i];
    return l;
  };
  CHECK(rel_err(got.dx, central_diff(x, loss)) < 1e-6);
  CHECK(rel_err(got.dwr, central_diff(w.wr, loss)) < 1e-6);
  CHECK(rel_err(got.dwg, central_diff(w.wg, loss)) < 1e-6);
  CHECK(rel_err(got.dwu, central_diff(w.wu, loss)) < 1e-6);
  CHECK(rel_err(got.dwd, central_diff(w.wd, loss)) < 1e-6);
}

}  // namespace

TEST_CASE("moe_mlp: fp64 equals the plain loop; backward equals finite differences") {
  // {batch, seq, C, F, E, k, capacity factor, renormalize, aux weight}
  SUBCASE("Switch: top-1, probabilities as gates, no capacity") {
    check_against_loop({2, 7, 6, 5, 4, 1, 0.0, false, 0.0}, 21);
  }
  SUBCASE("Switch: top-1 at capacity 1.0 (drops), balancing loss") {
    check_against_loop({1, 17, 6, 5, 4, 1, 1.0, false, 0.05}, 22);
  }
  SUBCASE("Mixtral: top-2 renormalised, no capacity, balancing loss") {
    check_against_loop({1, 15, 8, 6, 5, 2, 0.0, true, 0.02}, 23);
  }
  SUBCASE("GShard: top-2 at capacity 0.6 (second choices and some first dropped)") {
    check_against_loop({3, 5, 6, 4, 4, 2, 0.6, true, 0.1}, 24);
  }
  SUBCASE("one token, k = E = 2") {
    check_against_loop({1, 1, 4, 3, 2, 2, 0.0, true, 0.3}, 25);
  }
}

TEST_CASE("moe_mlp: one expert, top-1, is swiglu_mlp bit for bit; threads agree bit for bit") {
  membound_test::rng r{31};
  const mb::moe_shape s{1, 37, 24, 40, 1, 1, 0.0, true, 0.0};
  const moe_weights w = random_weights(r, s, 1.0);
  const auto x = r.fill(37 * 24, 1.0), dy = r.fill(37 * 24, 1.0);
  const layer_out moe = run_moe<mb::fp32_precision>(s, w, x, dy, 2);

  using M = mb::swiglu_mlp<mb::fp32_precision>;
  mb::thread_pool pool(2);
  const mb::mlp_shape ms{1, 37, 24, 40};
  auto xs = membound_test::to_storage<float>(x), dys = membound_test::to_storage<float>(dy);
  auto wg = membound_test::to_storage<float>(w.wg), wu = membound_test::to_storage<float>(w.wu),
       wd = membound_test::to_storage<float>(w.wd);
  std::vector<float> y(xs.size()), dx(xs.size()), gg(wg.size()), gu(wu.size()), gd(wd.size());
  aligned_buffer saved(M::saved_bytes(ms)), fws(M::forward_workspace_bytes(ms, 2)),
      bws(M::backward_workspace_bytes(ms, 2));
  M::forward(ms, {wg.data(), wu.data(), wd.data()}, xs.data(), y.data(), saved.get(), saved.bytes,
             fws.get(), fws.bytes, pool);
  M::backward(ms, {wg.data(), wu.data(), wd.data()}, xs.data(), saved.get(), saved.bytes, dys.data(),
              dx.data(), {gg.data(), gu.data(), gd.data()}, bws.get(), bws.bytes, pool);
  using membound_test::to_double;
  CHECK(moe.y == to_double(y.data(), y.size()));
  CHECK(moe.dx == to_double(dx.data(), dx.size()));
  CHECK(moe.dwg == to_double(gg.data(), gg.size()));
  CHECK(moe.dwu == to_double(gu.data(), gu.size()));
  CHECK(moe.dwd == to_double(gd.data(), gd.size()));
  CHECK(moe.dwr == std::vector<double>(24, 0.0));  // one expert: p = 1, nothing to learn

  const mb::moe_shape s2{2, 19, 12, 16, 6, 2, 0.8, true, 0.01};
  membound_test::rng r2{32};
  const moe_weights w2 = random_weights(r2, s2, 1.0);
  const auto x2 = r2.fill(2 * 19 * 12, 1.0), dy2 = r2.fill(2 * 19 * 12, 1.0);
  const layer_out one = run_moe<mb::fp32_precision>(s2, w2, x2, dy2, 1);
  const layer_out three = run_moe<mb::fp32_precision>(s2, w2, x2, dy2, 3);
  CHECK(one.stats.dropped > 0);
  CHECK(one.y == three.y);
  CHECK(one.dx == three.dx);
  CHECK(one.dwr == three.dwr);
  CHECK(one.dwg == three.dwg);
  CHECK(one.dwu == three.dwu);
  CHECK(one.dwd == three.dwd);
}

TEST_CASE("moe_mlp: bf16 within 3e-2 of fp64") {
  membound_test::rng r{41};
  const mb::moe_shape s{1, 29, 16, 24, 4, 2, 0.0, true, 0.01};
  const moe_weights w = random_weights(r, s, 1.5);
  const auto x = r.fill(29 * 16, 1.0), dy = r.fill(29 * 16, 1.0);
  const layer_out ref = run_moe<mb::fp64_precision>(s, w, x, dy, 2);
  const layer_out bf = run_moe<mb::bf16_precision>(s, w, x, dy, 2);
  CHECK(bf.stats.dropped == 0);
  CHECK(rel_err(bf.y, ref.y) < 3e-2);
  CHECK(rel_err(bf.dx, ref.dx) < 3e-2);
  CHECK(rel_err(bf.dwg, ref.dwg) < 3e-2);
  CHECK(rel_err(bf.dwu, ref.dwu) < 3e-2);
  CHECK(rel_err(bf.dwd, ref.dwd) < 3e-2);
  CHECK(rel_err(bf.dwr, ref.dwr) < 3e-2);
}

TEST_CASE("moe_mlp: adversarial routings drop what the capacity says, within moe_rows") {
  // Every token to expert 0 first and to expert 1 second (x > 0, only Wr's column 0 nonzero: the
  // other logits tie at 0 and go to the lower expert).
  const mb::moe_shape s{1, 16, 4, 3, 4, 2, 1.0, true, 0.0};
  CHECK(mb::moe_capacity(s) == 8);  // floor(1.0 · 16 · 2 / 4)
  CHECK(mb::moe_rows(s) == 32);
  membound_test::rng r0{51};
  moe_weights w = random_weights(r0, s, 1.0);
  std::fill(w.wr.begin(), w.wr.end(), 0.0);
  for (std::size_t c = 0; c < 4; ++c) w.wr[c * 4 + 0] = 1.0;
  std::vector<double> x(16 * 4, 0.5);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] += 0.01 * double(i % 7);
  const layer_out one = run_moe<mb::fp64_precision>(s, w, x, x, 1);
  CHECK(one.stats.dropped == 16);        // 8 of each expert's 16 choices
  CHECK(one.stats.tokens_dropped == 8);  // tokens 8..15 lost both
  CHECK(one.stats.max_expert_rows == 8);
  for (std::size_t t = 8; t < 16; ++t)
    for (std::size_t c = 0; c < 4; ++c) CHECK(one.y[t * 4 + c] == 0.0);
  const naive_out ref = naive_moe(s, w, x);
  CHECK(rel_err(one.y, ref.y) < 1e-12);

  // Random routers: the kept choices never exceed moe_rows, no expert exceeds the capacity.
  membound_test::rng r{52};
  for (int trial = 0; trial < 40; ++trial) {
    mb::moe_shape q{1, 1 + r.below(40), 4, 3, 1 + r.below(8), 1, 0.25 * double(1 + r.below(8)), true, 0.0};
    q.top_k = q.experts >= 2 ? 1 + r.below(2) : 1;
    if (!mb::moe_mlp<mb::fp64_precision>::can_implement(q)) continue;
    CAPTURE(q.seq);
    CAPTURE(q.experts);
    CAPTURE(q.top_k);
    const moe_weights wq = random_weights(r, q, 3.0);
    const auto xq = r.fill(q.seq * 4, 1.0);
    const layer_out o = run_moe<mb::fp64_precision>(q, wq, xq, xq, 1);
    CHECK(q.seq * q.top_k - o.stats.dropped <= mb::moe_rows(q));
    CHECK(o.stats.max_expert_rows <= mb::moe_capacity(q));
    CHECK(o.stats.dropped == naive_moe(q, wq, xq).dropped);
  }
}

TEST_CASE("moe_mlp: bad shapes and pointers get typed errors naming the field; nothing written") {
  using L = mb::moe_mlp<mb::fp32_precision>;
  const mb::moe_shape ok{1, 4, 8, 4, 4, 2, 1.0, true, 0.01};
  CHECK(L::can_implement(ok));
  const auto field = [](mb::moe_shape s) {
    try {
      L::check(s);
    } catch (const mb::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  mb::moe_shape s = ok;
  s.top_k = 3;
  CHECK(field(s).find("shape.top_k") != std::string::npos);
  s = ok;
  s.experts = 1;
  CHECK(field(s).find("at most shape.experts") != std::string::npos);
  s = ok;
  s.experts = 0;
  CHECK(field(s).find("shape.experts") != std::string::npos);
  s = ok;
  s.capacity_factor = 0.1;  // floor(0.1 · 4 · 2 / 4) = 0 slots
  CHECK(field(s).find("shape.capacity_factor") != std::string::npos);
  CHECK(field(s).find("0.1") != std::string::npos);
  s.capacity_factor = -1.0;
  CHECK(field(s).find("shape.capacity_factor") != std::string::npos);
  s.capacity_factor = std::numeric_limits<double>::quiet_NaN();
  CHECK(field(s).find("shape.capacity_factor") != std::string::npos);
  s = ok;
  s.aux_loss_weight = std::numeric_limits<double>::infinity();
  CHECK(field(s).find("shape.aux_loss_weight") != std::string::npos);
  s = ok;
  s.hidden = 0;
  CHECK(field(s).find("shape.hidden") != std::string::npos);

  mb::thread_pool pool(1);
  std::vector<float> x(32, 0.5f), y(32, 7.0f), wr(32, 0.1f), we(128, 0.1f);
  aligned_buffer saved(L::saved_bytes(ok)), fws(L::forward_workspace_bytes(ok, 1));
  try {
    L::forward(ok, {nullptr, we.data(), we.data(), we.data()}, x.data(), y.data(), saved.get(),
               saved.bytes, fws.get(), fws.bytes, pool);
    FAIL("no error for a null router");
  } catch (const mb::invalid_argument& e) {
    CHECK(std::string(e.what()).find("weights.router") != std::string::npos);
  }
  CHECK_THROWS_AS(L::forward(ok, {wr.data(), we.data(), we.data(), we.data()}, x.data(), y.data(),
                             saved.get(), saved.bytes - 1, fws.get(), fws.bytes, pool),
                  mb::invalid_argument);
  CHECK(y == std::vector<float>(32, 7.0f));
}
