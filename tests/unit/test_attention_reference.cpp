// The naive attention reference checked on its own: finite differences for the hand-derived
// backward, cases small enough to work out by hand, single-step decoding against the full
// forward, and GQA against the MHA it abbreviates.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "../support/attention_reference.hpp"
#include "../support/test_rng.hpp"

using namespace membound::reference;

namespace {

using membound_test::rng;

// Weights at ~1/sqrt(fan_in) so scores are O(1): the softmax is neither one-hot nor uniform, and
// every branch of the backward carries weight.
attention_weights random_weights(const attention_config& c, rng& r) {
  const std::size_t HD = c.heads * c.head_dim, KD = c.kv_heads * c.head_dim;
  attention_weights w;
  w.wq = r.fill(c.d_model * HD, 1.5 / std::sqrt(static_cast<double>(c.d_model)));
  w.wk = r.fill(c.d_model * KD, 1.5 / std::sqrt(static_cast<double>(c.d_model)));
  w.wv = r.fill(c.d_model * KD, 1.0 / std::sqrt(static_cast<double>(c.d_model)));
  w.wo = r.fill(HD * c.d_model, 1.0 / std::sqrt(static_cast<double>(HD)));
  return w;
}

double max_abs(const std::vector<double>& a) {
  double m = 0.0;
  for (double e : a) m = std::max(m, std::abs(e));
  return m;
}

// max|a - b| / max|b|: relative to the tensor's scale, so entries near zero do not blow it up.
double rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double d = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) d = std::max(d, std::abs(a[i] - b[i]));
  const double s = max_abs(b);
  return s == 0.0 ? d : d / s;
}

double loss(const attention_config& c, const attention_weights& w, const std::vector<double>& x,
            const std::vector<double>& G) {
  const std::vector<double> y = attention_forward(c, w, x).y;
  double L = 0.0;
  for (std::size_t i = 0; i < y.size(); ++i) L += y[i] * G[i];
  return L;
}

// Central differences of L = Σ y ⊙ G with respect to every entry of `param` (a reference into x
// or one of w's vectors), step h = 1e-6 · max(1, |θ|).
std::vector<double> fd_grad(const attention_config& c, attention_weights& w, std::vector<double>& x,
                            const std::vector<double>& G, std::vector<double>& param) {
  std::vector<double> g(param.size());
  for (std::size_t i = 0; i < param.size(); ++i) {
    const double saved = param[i];
    const double h = 1e-6 * std::max(1.0, std::abs(saved));
    param[i] = saved + h;
    const double lp = loss(c, w, x, G);
    param[i] = saved - h;
    const double lm = loss(c, w, x, G);
    param[i] = saved;
    g[i] = (lp - lm) / ((saved + h) - (saved - h));  // the step actually taken, after rounding
  }
  return g;
}

void check_gradients(const attention_config& c, std::uint64_t seed) {
  rng r{seed};
  attention_weights w = random_weights(c, r);
  std::vector<double> x = r.fill(c.batch * c.seq * c.d_model, 1.0);
  const std::vector<double> G = r.fill(x.size(), 1.0);  // dL/dy

  const attention_forward_result f = attention_forward(c, w, x);
  const attention_grads g = attention_backward(c, w, x, f, G);

  // Tolerance 1e-6: the central difference's truncation error is O(h²·|L'''|) ~ 1e-12 and its
  // rounding error ~ eps·|L|/h ~ 1e-10 relative to O(1) gradients, so a correct backward lands
  // at 1e-10..1e-8 (observed); a wrong term (sign, missing transpose, missed GQA sum) is O(1).
  const struct {
    const char* name;
    std::vector<double>* param;
    const std::vector<double>* analytic;
  } cases[] = {{"dx", &x, &g.dx},
               {"dwq", &w.wq, &g.dwq},
               {"dwk", &w.wk, &g.dwk},
               {"dwv", &w.wv, &g.dwv},
               {"dwo", &w.wo, &g.dwo}};
  for (const auto& k : cases) {
    INFO(k.name);
    const std::vector<double> fd = fd_grad(c, w, x, G, *k.param);
    const std::string name = k.name;
    if (c.seq == 1 && (name == "dwq" || name == "dwk")) {
      // One key: the softmax is exactly 1 whatever q and k are, so y does not depend on Wq, Wk.
      CHECK(max_abs(*k.analytic) == 0.0);
      CHECK(max_abs(fd) == 0.0);
      continue;
    }
    CHECK(max_abs(*k.analytic) > 1e-3);  // the comparison is not between two zeros
    const double e = rel_err(*k.analytic, fd);
    INFO("relative error " << e);
    CHECK(e <= 1e-6);
  }
}

}  // namespace

TEST_CASE("attention reference: backward matches central finite differences") {
  attention_config c{.batch = 2, .seq = 5, .d_model = 16, .heads = 4, .kv_heads = 2,
                     .head_dim = 8};
  SUBCASE("GQA, causal") { check_gradients(c, 1); }
  SUBCASE("GQA, not causal") {
    c.causal = false;
    check_gradients(c, 2);
  }
  SUBCASE("MQA, causal") {
    c.kv_heads = 1;
    check_gradients(c, 3);
  }
  SUBCASE("T = 1") {
    c.seq = 1;
    check_gradients(c, 4);
  }
  SUBCASE("MHA, D = 16, rope_base 500: high frequencies carry weight") {
    c = {.batch = 1, .seq = 6, .d_model = 8, .heads = 2, .kv_heads = 2, .head_dim = 16,
         .causal = true, .rope_base = 500.0};
    check_gradients(c, 5);
  }
}

TEST_CASE("attention reference: backward honours the position offset") {
  attention_config c{.batch = 1, .seq = 4, .d_model = 8, .heads = 2, .kv_heads = 1,
                     .head_dim = 8};
  rng r{6};
  attention_weights w = random_weights(c, r);
  const std::vector<double> x = r.fill(c.batch * c.seq * c.d_model, 1.0);
  const std::vector<double> G = r.fill(x.size(), 1.0);
  // Scores depend only on relative positions, so y, and with it every gradient, is the same at
  // any offset; the saved q and k are not. Tolerance 1e-12: the only difference is the rounding of
  // cos/sin at other angles, ~1e-16 per entry, carried through O(1)-conditioned sums.
  const attention_forward_result f0 = attention_forward(c, w, x, 0);
  const attention_forward_result f9 = attention_forward(c, w, x, 9);
  CHECK(f9.position_offset == 9);
  CHECK(rel_err(f9.y, f0.y) <= 1e-12);
  CHECK(rel_err(f9.lse, f0.lse) <= 1e-12);
  CHECK(rel_err(f9.q, f0.q) > 1e-3);
  const attention_grads g0 = attention_backward(c, w, x, f0, G);
  const attention_grads g9 = attention_backward(c, w, x, f9, G);
  CHECK(rel_err(g9.dx, g0.dx) <= 1e-12);
  CHECK(rel_err(g9.dwq, g0.dwq) <= 1e-12);
  CHECK(rel_err(g9.dwk, g0.dwk) <= 1e-12);
  CHECK(rel_err(g9.dwv, g0.dwv) <= 1e-12);
  CHECK(rel_err(g9.dwo, g0.dwo) <= 1e-12);
}

TEST_CASE("attention reference: RoPE by hand") {
  SUBCASE("position 0 is the identity, exactly") {
    rng r{7};
    std::vector<double> v = r.fill(8, 1.0);
    const std::vector<double> before = v;
    rope_rotate(v, 0, 10000.0);
    CHECK(v == before);  // cos 0 = 1 and sin 0 = 0 exactly, so no rounding at all
  }
  SUBCASE("rotate-half pairs (x[i], x[i + D/2]) with inv_freq = base^(-2i/D)") {
    // D = 4, t = 1, base 10000: inv_freq = (1, 10000^(-1/2) = 0.01), angles (1, 0.01).
    // Tolerance 1e-15: one multiply-add of values in [-1, 1] per entry.
    std::vector<double> v{1.0, 0.0, 0.0, 0.0};
    rope_rotate(v, 1, 10000.0);
    CHECK(std::abs(v[0] - std::cos(1.0)) <= 1e-15);
    CHECK(v[1] == 0.0);
    CHECK(std::abs(v[2] - std::sin(1.0)) <= 1e-15);
    CHECK(v[3] == 0.0);
    std::vector<double> u{0.0, 0.0, 0.0, 1.0};  // second pair: (x1, x2) = (0, 1)
    rope_rotate(u, 3, 10000.0);
    CHECK(std::abs(u[1] - -std::sin(0.03)) <= 1e-15);
    CHECK(std::abs(u[3] - std::cos(0.03)) <= 1e-15);
  }
  SUBCASE("every pair keeps its norm, and the inverse undoes it") {
    rng r{8};
    for (const double base : {10000.0, 500000.0, 10.0}) {
      std::vector<double> v = r.fill(64, 2.0);
      const std::vector<double> before = v;
      rope_rotate(v, 37, base);
      // Tolerance 1e-14 relative: a 2x2 rotation with rounded cos/sin, a few ulps.
      for (std::size_t i = 0; i < 32; ++i) {
        const double n0 = std::hypot(before[i], before[i + 32]);
        const double n1 = std::hypot(v[i], v[i + 32]);
        CHECK(std::abs(n1 - n0) <= 1e-14 * n0);
      }
      CHECK(rel_err(v, before) > 1e-3);
      rope_rotate(v, 37, base, /*inverse=*/true);
      CHECK(rel_err(v, before) <= 1e-14);
    }
  }
  SUBCASE("the forward rotates nothing at t = 0: q there is x·Wq") {
    attention_config c{.batch = 1, .seq = 3, .d_model = 4, .heads = 2, .kv_heads = 1,
                       .head_dim = 8};
    rng r{9};
    const attention_weights w = random_weights(c, r);
    const std::vector<double> x = r.fill(c.seq * c.d_model, 1.0);
    const attention_forward_result f = attention_forward(c, w, x);
    for (std::size_t h = 0; h < 2; ++h)
      for (std::size_t d = 0; d < 8; ++d) {
        double q = 0.0;
        for (std::size_t k = 0; k < 4; ++k) q += x[k] * w.wq[k * 16 + h * 8 + d];
        CHECK(f.q[(h * 3 + 0) * 8 + d] == q);  // same sum in the same order: bit-identical
      }
  }
}

TEST_CASE("attention reference: T = 1 is the value projection, lse the single score") {
  attention_config c{.batch = 2, .seq = 1, .d_model = 6, .heads = 4, .kv_heads = 2,
                     .head_dim = 8};
  rng r{10};
  const attention_weights w = random_weights(c, r);
  const std::vector<double> x = r.fill(c.batch * c.d_model, 1.0);
  const attention_forward_result f = attention_forward(c, w, x);
  const std::size_t C = 6, HD = 32, KD = 16, D = 8;
  for (std::size_t b = 0; b < 2; ++b) {
    // v = x·Wv [Hkv·D]; o[h] = v[h / 2] (softmax over one key is 1); y = o·Wo. lse = q·k/sqrt(D)
    // with no rotation at t = 0. Tolerance 1e-13 relative: short sums in another order.
    std::vector<double> q(HD, 0.0), k(KD, 0.0), v(KD, 0.0), y(C, 0.0);
    for (std::size_t c_ = 0; c_ < C; ++c_) {
      for (std::size_t j = 0; j < HD; ++j) q[j] += x[b * C + c_] * w.wq[c_ * HD + j];
      for (std::size_t j = 0; j < KD; ++j) {
        k[j] += x[b * C + c_] * w.wk[c_ * KD + j];
        v[j] += x[b * C + c_] * w.wv[c_ * KD + j];
      }
    }
    for (std::size_t h = 0; h < 4; ++h) {
      double s = 0.0;
      for (std::size_t d = 0; d < D; ++d) s += q[h * D + d] * k[(h / 2) * D + d];
      s /= std::sqrt(8.0);
      CHECK(std::abs(f.lse[b * 4 + h] - s) <= 1e-13 * std::max(1.0, std::abs(s)));
      CHECK(f.p[b * 4 + h] == 1.0);  // exp(s - lse) with lse = s exactly
      for (std::size_t d = 0; d < D; ++d)
        for (std::size_t c_ = 0; c_ < C; ++c_)
          y[c_] += v[(h / 2) * D + d] * w.wo[(h * D + d) * C + c_];
    }
    const std::vector<double> fy(f.y.begin() + static_cast<std::ptrdiff_t>(b * C),
                                 f.y.begin() + static_cast<std::ptrdiff_t>(b * C + C));
    CHECK(rel_err(fy, y) <= 1e-13);
  }
}

TEST_CASE("attention reference: a 2-token example worked by hand") {
  // C = D = 2, one head, every weight the identity: q = k = v = x before RoPE.
  // x0 = (1, 0), x1 = (0, 1). RoPE with D = 2: one pair (x[0], x[1]), inv_freq 1, angle t.
  //   t = 0: q0 = k0 = (1, 0), v0 = (1, 0)
  //   t = 1: q1 = k1 = (0·cos1 - 1·sin1, 1·cos1 + 0·sin1) = (-sin1, cos1), v1 = (0, 1)
  // Scores / sqrt(2): s00 = 1/√2, s10 = -sin1/√2, s11 = 1/√2, s01 = -sin1/√2.
  attention_config c{.batch = 1, .seq = 2, .d_model = 2, .heads = 1, .kv_heads = 1,
                     .head_dim = 2};
  const std::vector<double> I{1.0, 0.0, 0.0, 1.0};
  const attention_weights w{I, I, I, I};
  const std::vector<double> x{1.0, 0.0, 0.0, 1.0};
  const double r2 = std::sqrt(2.0), s_same = 1.0 / r2, s_cross = -std::sin(1.0) / r2;
  const double lse_pair = std::log(std::exp(s_same) + std::exp(s_cross));
  const double p_cross = std::exp(s_cross - lse_pair), p_same = std::exp(s_same - lse_pair);
  // Tolerance 1e-14: a handful of roundings on O(1) values, computed in another order.
  const double tol = 1e-14;

  SUBCASE("causal: row 0 sees only itself, row 1 mixes v0 and v1") {
    const attention_forward_result f = attention_forward(c, w, x);
    CHECK(std::abs(f.lse[0] - s_same) <= tol);
    CHECK(std::abs(f.lse[1] - lse_pair) <= tol);
    CHECK(f.p[1] == 0.0);  // masked: key 1 > query 0
    // y = o (Wo = I): y0 = v0 = (1, 0); y1 = p10·v0 + p11·v1 = (p_cross, p_same)
    CHECK(std::abs(f.y[0] - 1.0) <= tol);
    CHECK(std::abs(f.y[1] - 0.0) <= tol);
    CHECK(std::abs(f.y[2] - p_cross) <= tol);
    CHECK(std::abs(f.y[3] - p_same) <= tol);
  }
  SUBCASE("not causal: row 0 also sees key 1, with the same relative-position score") {
    c.causal = false;
    const attention_forward_result f = attention_forward(c, w, x);
    CHECK(std::abs(f.lse[0] - lse_pair) <= tol);
    CHECK(std::abs(f.lse[1] - lse_pair) <= tol);
    // y0 = p00·v0 + p01·v1 = (p_same, p_cross)
    CHECK(std::abs(f.y[0] - p_same) <= tol);
    CHECK(std::abs(f.y[1] - p_cross) <= tol);
    CHECK(std::abs(f.y[2] - p_cross) <= tol);
    CHECK(std::abs(f.y[3] - p_same) <= tol);
  }
}

TEST_CASE("attention reference: stepping with the KV cache reproduces the causal forward") {
  attention_config c{.batch = 2, .seq = 7, .d_model = 16, .heads = 4, .kv_heads = 2,
                     .head_dim = 8};
  SUBCASE("GQA") {}
  SUBCASE("MQA") { c.kv_heads = 1; }
  SUBCASE("MHA, D = 64") {
    c.kv_heads = 4;
    c.head_dim = 64;
  }
  rng r{11};
  const attention_weights w = random_weights(c, r);
  const std::vector<double> x = r.fill(c.batch * c.seq * c.d_model, 1.0);
  const attention_forward_result f = attention_forward(c, w, x);
  const std::size_t B = c.batch, T = c.seq, C = c.d_model, D = c.head_dim, Hkv = c.kv_heads;

  attention_kv_cache cache = make_attention_kv_cache(c, T + 2);
  // Tolerance 1e-12 relative (per row, to the row's max): the step does the same arithmetic on a
  // one-row problem; anything beyond a few ulps means it attended to a different set of keys.
  for (std::size_t t = 0; t < T; ++t) {
    std::vector<double> x_t(B * C);
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t k = 0; k < C; ++k) x_t[b * C + k] = x[(b * T + t) * C + k];
    const std::vector<double> y_t = attention_step(c, w, cache, x_t);
    CHECK(cache.length == t + 1);
    for (std::size_t b = 0; b < B; ++b) {
      CAPTURE(t);
      CAPTURE(b);
      const std::vector<double> row(y_t.begin() + static_cast<std::ptrdiff_t>(b * C),
                                    y_t.begin() + static_cast<std::ptrdiff_t>(b * C + C));
      const auto first = f.y.begin() + static_cast<std::ptrdiff_t>((b * T + t) * C);
      const std::vector<double> want(first, first + static_cast<std::ptrdiff_t>(C));
      CHECK(rel_err(row, want) <= 1e-12);
    }
  }
  // The cache holds the forward's rotated k and its v, position by position.
  double worst = 0.0;
  for (std::size_t b = 0; b < B; ++b)
    for (std::size_t g = 0; g < Hkv; ++g)
      for (std::size_t t = 0; t < T; ++t)
        for (std::size_t d = 0; d < D; ++d) {
          const std::size_t in_cache = ((b * Hkv + g) * (T + 2) + t) * D + d;
          const std::size_t in_fwd = ((b * Hkv + g) * T + t) * D + d;
          worst = std::max({worst, std::abs(cache.k[in_cache] - f.k[in_fwd]),
                            std::abs(cache.v[in_cache] - f.v[in_fwd])});
        }
  CHECK(worst <= 1e-15);  // same projection and rotation code on the same inputs: a few ulps
}

TEST_CASE("attention reference: prefill by forward, then step, equals the full forward") {
  attention_config c{.batch = 1, .seq = 8, .d_model = 12, .heads = 6, .kv_heads = 2,
                     .head_dim = 8};
  rng r{12};
  const attention_weights w = random_weights(c, r);
  const std::vector<double> x = r.fill(c.seq * c.d_model, 1.0);
  const attention_forward_result full = attention_forward(c, w, x);

  // Prefill the first 5 tokens with the forward and copy its k, v into a cache.
  const std::size_t T0 = 5, C = 12, D = 8, Hkv = 2, L = 8;
  attention_config pre = c;
  pre.seq = T0;
  const attention_forward_result p =
      attention_forward(pre, w, std::vector<double>(x.begin(), x.begin() + T0 * C));
  attention_kv_cache cache = make_attention_kv_cache(c, L);
  for (std::size_t g = 0; g < Hkv; ++g)
    for (std::size_t t = 0; t < T0; ++t)
      for (std::size_t d = 0; d < D; ++d) {
        cache.k[(g * L + t) * D + d] = p.k[(g * T0 + t) * D + d];
        cache.v[(g * L + t) * D + d] = p.v[(g * T0 + t) * D + d];
      }
  cache.length = T0;
  for (std::size_t t = T0; t < c.seq; ++t) {
    CAPTURE(t);
    const std::vector<double> x_t(x.begin() + static_cast<std::ptrdiff_t>(t * C),
                                  x.begin() + static_cast<std::ptrdiff_t>(t * C + C));
    const std::vector<double> y_t = attention_step(c, w, cache, x_t);
    const std::vector<double> want(full.y.begin() + static_cast<std::ptrdiff_t>(t * C),
                                   full.y.begin() + static_cast<std::ptrdiff_t>(t * C + C));
    CHECK(rel_err(y_t, want) <= 1e-12);  // as above: same arithmetic, a few ulps
  }
  // A full cache refuses another step and is left as it was.
  const std::vector<double> k_before = cache.k;
  try {
    (void)attention_step(c, w, cache, std::vector<double>(C, 0.0));
    FAIL("expected invalid_argument");
  } catch (const membound::invalid_argument& e) {
    CHECK(e.argument() == "cache");
  }
  CHECK(cache.length == L);
  CHECK(cache.k == k_before);
}

TEST_CASE("attention reference: GQA equals MHA with repeated kv-head weights") {
  for (const std::size_t kv_heads : {std::size_t{2}, std::size_t{1}}) {
    CAPTURE(kv_heads);
    attention_config gqa{.batch = 2, .seq = 6, .d_model = 16, .heads = 4, .kv_heads = kv_heads,
                         .head_dim = 8};
    for (const bool causal : {true, false}) {
      gqa.causal = causal;
      attention_config mha = gqa;
      mha.kv_heads = gqa.heads;
      rng r{13 + kv_heads};
      const attention_weights w = random_weights(gqa, r);
      const std::vector<double> x = r.fill(gqa.batch * gqa.seq * gqa.d_model, 1.0);
      const std::vector<double> G = r.fill(x.size(), 1.0);

      // Wk_mha[:, h·D + d] = Wk[:, (h / group)·D + d]: head h gets its kv head's columns.
      const std::size_t C = 16, H = 4, D = 8, group = H / kv_heads, KD = kv_heads * D, HD = H * D;
      attention_weights wm = w;
      wm.wk.assign(C * HD, 0.0);
      wm.wv.assign(C * HD, 0.0);
      for (std::size_t c_ = 0; c_ < C; ++c_)
        for (std::size_t h = 0; h < H; ++h)
          for (std::size_t d = 0; d < D; ++d) {
            wm.wk[c_ * HD + h * D + d] = w.wk[c_ * KD + (h / group) * D + d];
            wm.wv[c_ * HD + h * D + d] = w.wv[c_ * KD + (h / group) * D + d];
          }
      const attention_forward_result fg = attention_forward(gqa, w, x);
      const attention_forward_result fm = attention_forward(mha, wm, x);
      // Tolerance 1e-12: identical per-head arithmetic; only the sums of the backward's
      // accumulation differ in order (ulps), nothing accumulates across many terms.
      CHECK(rel_err(fg.y, fm.y) <= 1e-12);
      CHECK(rel_err(fg.lse, fm.lse) <= 1e-12);

      // The gradient of a shared kv-head weight is the sum over the query heads that read it.
      const attention_grads gg = attention_backward(gqa, w, x, fg, G);
      const attention_grads gm = attention_backward(mha, wm, x, fm, G);
      std::vector<double> dwk_sum(C * KD, 0.0), dwv_sum(C * KD, 0.0);
      for (std::size_t c_ = 0; c_ < C; ++c_)
        for (std::size_t h = 0; h < H; ++h)
          for (std::size_t d = 0; d < D; ++d) {
            dwk_sum[c_ * KD + (h / group) * D + d] += gm.dwk[c_ * HD + h * D + d];
            dwv_sum[c_ * KD + (h / group) * D + d] += gm.dwv[c_ * HD + h * D + d];
          }
      CHECK(rel_err(gg.dx, gm.dx) <= 1e-12);
      CHECK(rel_err(gg.dwq, gm.dwq) <= 1e-12);
      CHECK(rel_err(gg.dwo, gm.dwo) <= 1e-12);
      CHECK(rel_err(gg.dwk, dwk_sum) <= 1e-12);
      CHECK(rel_err(gg.dwv, dwv_sum) <= 1e-12);
    }
  }
}

namespace {
template <class F>
std::string thrown_argument(F&& f) {
  try {
    f();
  } catch (const membound::invalid_argument& e) {
    return e.argument();
  }
  return "<nothing thrown>";
}
}  // namespace

TEST_CASE("attention reference: malformed configs and shapes name the argument") {
  const attention_config good{.batch = 1, .seq = 3, .d_model = 4, .heads = 4, .kv_heads = 2,
                              .head_dim = 8};
  rng r{20};
  const attention_weights w = random_weights(good, r);
  const std::vector<double> x = r.fill(12, 1.0);
  const auto fwd = [&](attention_config c, const attention_weights& ww,
                       const std::vector<double>& xx) {
    return thrown_argument([&] { (void)attention_forward(c, ww, xx); });
  };
  attention_config c = good;
  c.batch = 0;
  CHECK(fwd(c, w, x) == "config.batch");
  c = good;
  c.seq = 0;
  CHECK(fwd(c, w, x) == "config.seq");
  c = good;
  c.d_model = 0;
  CHECK(fwd(c, w, x) == "config.d_model");
  c = good;
  c.heads = 0;
  CHECK(fwd(c, w, x) == "config.heads");
  c = good;
  c.kv_heads = 3;
  CHECK(fwd(c, w, x) == "config.kv_heads");
  c.kv_heads = 0;
  CHECK(fwd(c, w, x) == "config.kv_heads");
  c = good;
  c.head_dim = 7;
  CHECK(fwd(c, w, x) == "config.head_dim");
  c = good;
  c.rope_base = 0.0;
  CHECK(fwd(c, w, x) == "config.rope_base");
  c.rope_base = std::nan("");
  CHECK(fwd(c, w, x) == "config.rope_base");

  attention_weights bad = w;
  bad.wq.pop_back();
  CHECK(fwd(good, bad, x) == "weights.wq");
  bad = w;
  bad.wk.push_back(0.0);
  CHECK(fwd(good, bad, x) == "weights.wk");
  bad = w;
  bad.wv.clear();
  CHECK(fwd(good, bad, x) == "weights.wv");
  bad = w;
  bad.wo.pop_back();
  CHECK(fwd(good, bad, x) == "weights.wo");
  CHECK(fwd(good, w, std::vector<double>(11)) == "x");

  const attention_forward_result f = attention_forward(good, w, x);
  const std::vector<double> dy_bad(13);
  CHECK(thrown_argument([&] { (void)attention_backward(good, w, x, f, dy_bad); }) == "dy");
  attention_forward_result f_bad = f;
  f_bad.p.pop_back();
  CHECK(thrown_argument([&] { (void)attention_backward(good, w, x, f_bad, x); }) == "forward.p");

  attention_kv_cache cache = make_attention_kv_cache(good, 4);
  CHECK(thrown_argument([&] { (void)attention_step(good, w, cache, std::vector<double>(3)); }) ==
        "x_t");
  c = good;
  c.causal = false;
  CHECK(thrown_argument([&] { (void)attention_step(c, w, cache, std::vector<double>(4)); }) ==
        "config.causal");
  c = good;
  c.batch = 2;  // the cache was sized for batch 1
  CHECK(thrown_argument([&] { (void)attention_step(c, w, cache, std::vector<double>(8)); }) ==
        "cache.k");
  CHECK(cache.length == 0);
  CHECK(thrown_argument([&] { (void)make_attention_kv_cache(good, 0); }) == "max_len");
  std::vector<double> odd(5);
  CHECK(thrown_argument([&] { rope_rotate(odd, 1, 10000.0); }) == "x");

  // The message says what was expected and what came instead.
  c = good;
  c.kv_heads = 3;
  try {
    (void)attention_forward(c, w, x);
  } catch (const membound::invalid_argument& e) {
    const std::string m = e.what();
    CHECK(m.find("a divisor of config.heads (4)") != std::string::npos);
    CHECK(m.find("got 3") != std::string::npos);
  }
}
