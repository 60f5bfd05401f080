// The naive Mamba-1 reference checked on its own: finite differences for the hand-derived
// backward, the recurrence against the scan written out as an explicit sum, cases small enough
// to work out by hand, single-step decoding against the full forward, the initialisation, and
// the argument checks.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "../support/mamba_reference.hpp"
#include "../support/test_rng.hpp"

using namespace membound::reference;

namespace {

using membound_test::rng;

// mamba_init with dt in [0.05, 1] rather than [0.001, 0.1], so exp(delta·A) decays visibly over a
// few tokens and the scan's carry matters; x_proj tripled so that Bm, Cm and dt_low are O(1) and
// the SSM path carries as much weight as the skip d·u; then every tensor nudged so that no
// parameter sits at a special value (a_log = log(n+1), d = 1) that could hide a wrong term.
mamba_weights test_weights(const mamba_config& c, rng& r) {
  mamba_weights w = mamba_init(c, r, 0.05, 1.0);
  for (double& e : w.x_proj) e *= 3.0;
  const auto nudge = [&r](std::vector<double>& v, double scale) {
    for (double& e : v) e += r.uniform(-scale, scale);
  };
  nudge(w.in_proj, 0.3);
  nudge(w.conv_w, 0.2);
  nudge(w.conv_b, 0.2);
  nudge(w.x_proj, 0.3);
  nudge(w.dt_proj, 0.5);
  nudge(w.dt_bias, 0.3);
  nudge(w.a_log, 0.3);
  nudge(w.d, 0.5);
  nudge(w.out_proj, 0.3);
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

// Rows [first, first + n) of a row-major tensor.
std::vector<double> slice(const std::vector<double>& v, std::size_t first, std::size_t n) {
  return {v.begin() + static_cast<std::ptrdiff_t>(first),
          v.begin() + static_cast<std::ptrdiff_t>(first + n)};
}

double loss(const mamba_config& c, const mamba_weights& w, const std::vector<double>& x,
            const std::vector<double>& G) {
  const std::vector<double> out = mamba_forward(c, w, x).out;
  double L = 0.0;
  for (std::size_t i = 0; i < out.size(); ++i) L += out[i] * G[i];
  return L;
}

// Central differences of L = Σ out ⊙ G with respect to every entry of `param` (a reference into
// x or one of w's vectors), step h = 1e-5 · max(1, |θ|).
std::vector<double> fd_grad(const mamba_config& c, mamba_weights& w, std::vector<double>& x,
                            const std::vector<double>& G, std::vector<double>& param) {
  std::vector<double> g(param.size());
  for (std::size_t i = 0; i < param.size(); ++i) {
    const double saved = param[i];
    const double h = 1e-5 * std::max(1.0, std::abs(saved));
    param[i] = saved + h;
    const double lp = loss(c, w, x, G);
    param[i] = saved - h;
    const double lm = loss(c, w, x, G);
    param[i] = saved;
    g[i] = (lp - lm) / ((saved + h) - (saved - h));  // the step actually taken, after rounding
  }
  return g;
}

void check_gradients(const mamba_config& c, std::uint64_t seed) {
  rng r{seed};
  mamba_weights w = test_weights(c, r);
  std::vector<double> x = r.fill(c.batch * c.seq * c.d_model, 1.5);
  const std::vector<double> G = r.fill(x.size(), 1.0);  // dL/d(out)

  const mamba_forward_result f = mamba_forward(c, w, x);
  const mamba_grads g = mamba_backward(c, w, x, f, G);

  // Tolerance 1e-6, relative to each tensor's largest entry. With h = 1e-5 the central
  // difference's truncation error is h²/6·|L'''| ~ 1e-11 (L is smooth: exp, log1p, products, with
  // O(1) derivatives), and its rounding error ~ eps·|L|/h ~ 1e-16·O(1)/1e-5 ~ 1e-11 absolute, so a
  // correct backward lands around 1e-11..5e-9 relative (observed); a wrong term (a sign, the
  // carry off by one token, a missed path into u) is O(1).
  const struct {
    const char* name;
    std::vector<double>* param;
    const std::vector<double>* analytic;
  } cases[] = {{"dx", &x, &g.dx},
               {"d_in_proj", &w.in_proj, &g.d_in_proj},
               {"d_conv_w", &w.conv_w, &g.d_conv_w},
               {"d_conv_b", &w.conv_b, &g.d_conv_b},
               {"d_x_proj", &w.x_proj, &g.d_x_proj},
               {"d_dt_proj", &w.dt_proj, &g.d_dt_proj},
               {"d_dt_bias", &w.dt_bias, &g.d_dt_bias},
               {"d_a_log", &w.a_log, &g.d_a_log},
               {"d_d", &w.d, &g.d_d},
               {"d_out_proj", &w.out_proj, &g.d_out_proj}};
  for (const auto& k : cases) {
    INFO(std::string(k.name));
    REQUIRE(k.analytic->size() == k.param->size());
    const std::vector<double> fd = fd_grad(c, w, x, G, *k.param);
    if (c.seq == 1 && std::string(k.name) == "d_a_log") {
      // One token: h_0 = delta·Bm·u starts from h_{-1} = 0, so A never multiplies anything.
      CHECK(max_abs(*k.analytic) == 0.0);
      CHECK(max_abs(fd) == 0.0);
      continue;
    }
    CHECK(max_abs(*k.analytic) > 1e-4);  // the comparison is not between two zeros
    const double e = rel_err(*k.analytic, fd);
    INFO("relative error " << e);
    CHECK(e <= 1e-6);
  }
}

}  // namespace

TEST_CASE("mamba reference: backward matches central finite differences") {
  mamba_config c{.batch = 2, .seq = 5, .d_model = 4, .d_inner = 8, .d_state = 3, .d_conv = 4,
                 .dt_rank = 2};
  SUBCASE("B=2 T=5 C=4 Di=8 N=3 K=4 R=2") { check_gradients(c, 1); }
  SUBCASE("K = 1: the conv is a per-channel scale and shift") {
    c.d_conv = 1;
    check_gradients(c, 2);
  }
  SUBCASE("N = 1") {
    c.d_state = 1;
    check_gradients(c, 3);
  }
  SUBCASE("T = 1") {
    c.seq = 1;
    check_gradients(c, 4);
  }
  SUBCASE("T = 2 < K - 1: padding on every token; R = 3 > C / 2") {
    c = {.batch = 1, .seq = 2, .d_model = 3, .d_inner = 5, .d_state = 2, .d_conv = 4,
         .dt_rank = 3};
    check_gradients(c, 5);
  }
  SUBCASE("T = 12, K = 3: a long carry") {
    c = {.batch = 1, .seq = 12, .d_model = 3, .d_inner = 4, .d_state = 2, .d_conv = 3,
         .dt_rank = 1};
    check_gradients(c, 6);
  }
}

TEST_CASE("mamba reference: the recurrence equals the scan written as an explicit sum") {
  // Unrolling h_t = a_t ⊙ h_{t-1} + delta_t·Bm_t·u_t from h_{-1} = 0 gives
  //   h_t[i,n] = Σ_{s<=t} (Π_{r=s+1..t} exp(delta_r[i]·A[i,n])) · delta_s[i]·Bm_s[n]·u_s[i]
  // computed here term by term from the forward's delta, Bm, u, with the products rebuilt for
  // every (s, t) — no running state shared with the reference's loop. Then
  //   y_t[i] = Σ_n Cm_t[n]·h_t[i,n] + d[i]·u_t[i],  g = y ⊙ silu(z).
  mamba_config c{.batch = 2, .seq = 9, .d_model = 4, .d_inner = 6, .d_state = 5, .d_conv = 3,
                 .dt_rank = 2};
  rng r{20};
  const mamba_weights w = test_weights(c, r);
  const std::vector<double> x = r.fill(c.batch * c.seq * c.d_model, 1.5);
  const mamba_forward_result f = mamba_forward(c, w, x);
  const std::size_t B = c.batch, T = c.seq, Di = c.d_inner, N = c.d_state;

  std::vector<double> h(B * T * Di * N, 0.0), y(B * T * Di, 0.0), g(B * T * Di, 0.0);
  for (std::size_t b = 0; b < B; ++b)
    for (std::size_t t = 0; t < T; ++t)
      for (std::size_t i = 0; i < Di; ++i) {
        const std::size_t ti = (b * T + t) * Di + i;
        double yi = w.d[i] * f.u[ti];
        for (std::size_t n = 0; n < N; ++n) {
          const double A = -std::exp(w.a_log[i * N + n]);
          double sum = 0.0;
          for (std::size_t s = 0; s <= t; ++s) {
            double decay = 1.0;
            for (std::size_t q = s + 1; q <= t; ++q)
              decay *= std::exp(f.delta[(b * T + q) * Di + i] * A);
            const std::size_t si = (b * T + s) * Di + i;
            sum += decay * f.delta[si] * f.Bm[(b * T + s) * N + n] * f.u[si];
          }
          h[ti * N + n] = sum;
          yi += f.Cm[(b * T + t) * N + n] * sum;
        }
        y[ti] = yi;
        g[ti] = yi * f.z[ti] / (1.0 + std::exp(-f.z[ti]));
      }
  // Tolerance 1e-13 relative: at most T = 9 terms and 9-factor products of O(1) numbers, summed in
  // another order; a few dozen ulps at worst. A wrong decay index is O(0.1) here (delta ~ 0.05..1).
  CHECK(max_abs(f.h) > 1e-2);
  CHECK(rel_err(f.h, h) <= 1e-13);
  CHECK(rel_err(f.y, y) <= 1e-13);
  CHECK(rel_err(f.g, g) <= 1e-13);
  // And the decay matters in this case: the same sum with every decay set to 1 is far off.
  std::vector<double> h_nodecay(h.size(), 0.0);
  for (std::size_t b = 0; b < B; ++b)
    for (std::size_t t = 0; t < T; ++t)
      for (std::size_t i = 0; i < Di; ++i)
        for (std::size_t n = 0; n < N; ++n)
          for (std::size_t s = 0; s <= t; ++s) {
            const std::size_t si = (b * T + s) * Di + i;
            h_nodecay[((b * T + t) * Di + i) * N + n] +=
                f.delta[si] * f.Bm[(b * T + s) * N + n] * f.u[si];
          }
  CHECK(rel_err(h_nodecay, h) > 1e-2);
}

TEST_CASE("mamba reference: the stages before the scan, checked by hand") {
  mamba_config c{.batch = 2, .seq = 6, .d_model = 3, .d_inner = 4, .d_state = 2, .d_conv = 3,
                 .dt_rank = 2};
  rng r{21};
  mamba_weights w = test_weights(c, r);
  const std::vector<double> x = r.fill(c.batch * c.seq * c.d_model, 1.0);
  const std::size_t B = 2, T = 6, C = 3, Di = 4, N = 2, K = 3, R = 2, P = R + 2 * N;

  SUBCASE("in_proj: columns [0, Di) are xi, [Di, 2Di) are z") {
    const mamba_forward_result f = mamba_forward(c, w, x);
    for (std::size_t row = 0; row < B * T; ++row)
      for (std::size_t i = 0; i < Di; ++i) {
        double xi = 0.0, z = 0.0;
        for (std::size_t k = 0; k < C; ++k) {
          xi += x[row * C + k] * w.in_proj[k * 2 * Di + i];
          z += x[row * C + k] * w.in_proj[k * 2 * Di + Di + i];
        }
        CHECK(f.xi[row * Di + i] == xi);  // same sum in the same order: bit-identical
        CHECK(f.z[row * Di + i] == z);
      }
  }
  SUBCASE("conv: a one-hot tap k shifts xi by K-1-k tokens, zero before the start") {
    for (std::size_t tap = 0; tap < K; ++tap) {
      CAPTURE(tap);
      std::fill(w.conv_w.begin(), w.conv_w.end(), 0.0);
      for (std::size_t i = 0; i < Di; ++i) w.conv_w[i * K + tap] = 1.0;
      const mamba_forward_result f = mamba_forward(c, w, x);
      const std::size_t shift = K - 1 - tap;  // tap K-1 is the current token
      for (std::size_t b = 0; b < B; ++b)
        for (std::size_t t = 0; t < T; ++t)
          for (std::size_t i = 0; i < Di; ++i) {
            const double src = t >= shift ? f.xi[(b * T + t - shift) * Di + i] : 0.0;
            // Exact: the other taps add 0·xi = +0, and bias + 1·src rounds once either way.
            const double cv = f.c[(b * T + t) * Di + i];
            CHECK(cv == w.conv_b[i] + src);
            // silu written differently (v / (1 + e^-v) against v·σ(v)): an ulp or two.
            CHECK(std::abs(f.u[(b * T + t) * Di + i] - cv / (1.0 + std::exp(-cv))) <= 1e-15);
          }
    }
  }
  SUBCASE("x_proj columns split into dt_low, Bm, Cm; delta = log(1 + exp(dt))") {
    const mamba_forward_result f = mamba_forward(c, w, x);
    for (std::size_t row = 0; row < B * T; ++row) {
      std::vector<double> xd(P, 0.0);
      for (std::size_t p = 0; p < P; ++p)
        for (std::size_t i = 0; i < Di; ++i) xd[p] += f.u[row * Di + i] * w.x_proj[i * P + p];
      for (std::size_t k = 0; k < R; ++k) CHECK(f.dt_low[row * R + k] == xd[k]);
      for (std::size_t n = 0; n < N; ++n) {
        CHECK(f.Bm[row * N + n] == xd[R + n]);
        CHECK(f.Cm[row * N + n] == xd[R + N + n]);
      }
      for (std::size_t i = 0; i < Di; ++i) {
        double dt = w.dt_bias[i];
        for (std::size_t k = 0; k < R; ++k) dt += xd[k] * w.dt_proj[k * Di + i];
        // Tolerance 1e-15 relative: the bias added first rather than last, and the unguarded
        // log(1 + e^v) formula (fine for the moderate dt here) against the stable one.
        CHECK(std::abs(f.dt[row * Di + i] - dt) <= 1e-15 * std::max(1.0, std::abs(dt)));
        CHECK(std::abs(f.delta[row * Di + i] - std::log(1.0 + std::exp(dt))) <= 1e-15);
      }
    }
  }
}

TEST_CASE("mamba reference: T = 1 in closed form") {
  // One token: h_0 = delta·Bm·u, so y = (delta·(Bm·Cm) + d)·u and A plays no part.
  mamba_config c{.batch = 3, .seq = 1, .d_model = 5, .d_inner = 6, .d_state = 4, .d_conv = 4,
                 .dt_rank = 1};
  rng r{22};
  mamba_weights w = test_weights(c, r);
  const std::vector<double> x = r.fill(c.batch * c.d_model, 1.5);
  const mamba_forward_result f = mamba_forward(c, w, x);
  const std::size_t B = 3, C = 5, Di = 6, N = 4;
  std::vector<double> out(B * C, 0.0);
  for (std::size_t b = 0; b < B; ++b) {
    double bc = 0.0;
    for (std::size_t n = 0; n < N; ++n) bc += f.Bm[b * N + n] * f.Cm[b * N + n];
    for (std::size_t i = 0; i < Di; ++i) {
      const std::size_t bi = b * Di + i;
      // Only the last conv tap sees a token: c = conv_b + conv_w[i, K-1]·xi. Exact, as above.
      CHECK(f.c[bi] == w.conv_b[i] + w.conv_w[i * 4 + 3] * f.xi[bi]);
      const double y = (f.delta[bi] * bc + w.d[i]) * f.u[bi];
      const double g = y * f.z[bi] / (1.0 + std::exp(-f.z[bi]));
      for (std::size_t k = 0; k < C; ++k) out[b * C + k] += g * w.out_proj[i * C + k];
    }
  }
  CHECK(rel_err(f.out, out) <= 1e-13);  // short sums in another order: a few ulps
  // A changes nothing at T = 1.
  mamba_weights w2 = w;
  for (double& a : w2.a_log) a += 1.0;
  CHECK(mamba_forward(c, w2, x).out == f.out);
}

TEST_CASE("mamba reference: stepping reproduces the full forward, and leaves its final state") {
  mamba_config c{.batch = 2, .seq = 7, .d_model = 4, .d_inner = 8, .d_state = 3, .d_conv = 4,
                 .dt_rank = 2};
  SUBCASE("K = 4") {}
  SUBCASE("K = 1: an empty conv state") { c.d_conv = 1; }
  SUBCASE("K = 2, N = 1") {
    c.d_conv = 2;
    c.d_state = 1;
  }
  SUBCASE("K = 9 > T: the window never fills") { c.d_conv = 9; }
  rng r{23};
  const mamba_weights w = test_weights(c, r);
  const std::vector<double> x = r.fill(c.batch * c.seq * c.d_model, 1.5);
  const mamba_forward_result f = mamba_forward(c, w, x);
  const std::size_t B = c.batch, T = c.seq, C = c.d_model, Di = c.d_inner, N = c.d_state,
                    W = c.d_conv - 1;

  mamba_state s = make_mamba_state(c);
  CHECK(s.conv.size() == B * Di * W);
  CHECK(s.ssm.size() == B * Di * N);
  // Tolerance 1e-12 relative (per row, to the row's max): the step does the forward's arithmetic
  // in the forward's order on one token (observed bit-identical); anything beyond a few ulps means
  // it read a different window or state.
  for (std::size_t t = 0; t < T; ++t) {
    std::vector<double> x_t(B * C);
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t k = 0; k < C; ++k) x_t[b * C + k] = x[(b * T + t) * C + k];
    const std::vector<double> out_t = mamba_step(c, w, s, x_t);
    for (std::size_t b = 0; b < B; ++b) {
      CAPTURE(t);
      CAPTURE(b);
      CHECK(rel_err(slice(out_t, b * C, C), slice(f.out, (b * T + t) * C, C)) <= 1e-12);
    }
  }
  // Final state: h of the last token, and the last K-1 xi oldest first (zeros before token 0).
  for (std::size_t b = 0; b < B; ++b)
    for (std::size_t i = 0; i < Di; ++i) {
      for (std::size_t n = 0; n < N; ++n)
        CHECK(std::abs(s.ssm[(b * Di + i) * N + n] - f.h[((b * T + T - 1) * Di + i) * N + n]) <=
              1e-12 * max_abs(f.h));
      for (std::size_t k = 0; k < W; ++k) {
        const std::size_t back = W - k;  // xi of token T - back
        const double want = back <= T ? f.xi[(b * T + T - back) * Di + i] : 0.0;
        CHECK(s.conv[(b * Di + i) * W + k] == want);  // copied, not computed
      }
    }
}

TEST_CASE("mamba reference: prefill by forward, state built from it, then step") {
  // A state taken from a forward over the first T0 tokens (h of token T0-1, xi of the last K-1
  // tokens) continues exactly as the full forward does: the state layout is what it claims.
  mamba_config c{.batch = 2, .seq = 10, .d_model = 4, .d_inner = 6, .d_state = 3, .d_conv = 4,
                 .dt_rank = 2};
  rng r{24};
  const mamba_weights w = test_weights(c, r);
  const std::vector<double> x = r.fill(c.batch * c.seq * c.d_model, 1.5);
  const mamba_forward_result full = mamba_forward(c, w, x);
  const std::size_t B = 2, T = 10, T0 = 6, C = 4, Di = 6, N = 3, W = 3;

  mamba_config pre = c;
  pre.seq = T0;
  std::vector<double> x0(B * T0 * C);
  for (std::size_t b = 0; b < B; ++b)
    for (std::size_t t = 0; t < T0; ++t)
      for (std::size_t k = 0; k < C; ++k) x0[(b * T0 + t) * C + k] = x[(b * T + t) * C + k];
  const mamba_forward_result p = mamba_forward(pre, w, x0);
  mamba_state s = make_mamba_state(c);
  for (std::size_t b = 0; b < B; ++b)
    for (std::size_t i = 0; i < Di; ++i) {
      for (std::size_t n = 0; n < N; ++n)
        s.ssm[(b * Di + i) * N + n] = p.h[((b * T0 + T0 - 1) * Di + i) * N + n];
      for (std::size_t k = 0; k < W; ++k)
        s.conv[(b * Di + i) * W + k] = p.xi[(b * T0 + T0 - W + k) * Di + i];
    }
  for (std::size_t t = T0; t < T; ++t) {
    CAPTURE(t);
    std::vector<double> x_t(B * C);
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t k = 0; k < C; ++k) x_t[b * C + k] = x[(b * T + t) * C + k];
    const std::vector<double> out_t = mamba_step(c, w, s, x_t);
    for (std::size_t b = 0; b < B; ++b)
      CHECK(rel_err(slice(out_t, b * C, C), slice(full.out, (b * T + t) * C, C)) <= 1e-12);
  }
}

TEST_CASE("mamba reference: initialisation follows mamba_simple") {
  const mamba_config c{.batch = 1, .seq = 1, .d_model = 16, .d_inner = 32, .d_state = 16,
                       .d_conv = 4, .dt_rank = 1};
  rng r{25};
  const mamba_weights w = mamba_init(c, r);
  CHECK(w.in_proj.size() == 16 * 64);
  CHECK(w.conv_w.size() == 32 * 4);
  CHECK(w.x_proj.size() == 32 * 33);
  CHECK(w.dt_proj.size() == 32);
  CHECK(w.out_proj.size() == 32 * 16);
  CHECK(max_abs(w.in_proj) <= 0.25);  // 1/sqrt(C)
  CHECK(max_abs(w.in_proj) > 0.2);
  CHECK(max_abs(w.conv_w) <= 0.5);    // 1/sqrt(K)
  CHECK(max_abs(w.conv_b) <= 0.5);
  CHECK(max_abs(w.x_proj) <= 1.0 / std::sqrt(32.0));
  CHECK(max_abs(w.dt_proj) <= 1.0);   // R^-0.5
  CHECK(max_abs(w.dt_proj) > 0.5);
  CHECK(max_abs(w.out_proj) <= 1.0 / std::sqrt(32.0));
  for (std::size_t i = 0; i < 32; ++i) {
    CHECK(w.d[i] == 1.0);
    for (std::size_t n = 0; n < 16; ++n)
      CHECK(w.a_log[i * 16 + n] == std::log(static_cast<double>(n + 1)));  // A = -(n + 1)
    // softplus(dt_bias) is the drawn dt, in [dt_min, dt_max]; tolerance: the inverse and the
    // forward each round a few times (relative 1e-12 of dt, far inside the range's width).
    const double dt = std::log1p(std::exp(w.dt_bias[i]));
    CHECK(dt >= 0.001 * (1 - 1e-12));
    CHECK(dt <= 0.1 * (1 + 1e-12));
  }
  SUBCASE("a floor above dt_max clamps every dt to the floor") {
    rng r2{26};
    const mamba_weights f = mamba_init(c, r2, 0.001, 0.01, 0.05);
    for (const double b : f.dt_bias) CHECK(std::abs(std::log1p(std::exp(b)) - 0.05) <= 1e-15);
  }
  SUBCASE("the same seed draws the same weights") {
    rng r3{25};
    const mamba_weights again = mamba_init(c, r3);
    CHECK(again.in_proj == w.in_proj);
    CHECK(again.dt_bias == w.dt_bias);
    CHECK(again.out_proj == w.out_proj);
  }
}

namespace {

template <class F>
void expect_invalid(F&& f, const std::string& argument) {
  CAPTURE(argument);
  try {
    f();
    FAIL("expected membound::invalid_argument");
  } catch (const membound::invalid_argument& e) {
    CHECK(e.argument() == argument);
    CHECK(std::string(e.what()).find(argument) != std::string::npos);
  }
}

}  // namespace

TEST_CASE("mamba reference: malformed arguments throw invalid_argument naming them") {
  const mamba_config good{.batch = 2, .seq = 3, .d_model = 4, .d_inner = 6, .d_state = 2,
                          .d_conv = 3, .dt_rank = 1};
  rng r{27};
  const mamba_weights w = test_weights(good, r);
  const std::vector<double> x = r.fill(2 * 3 * 4, 1.0);
  const mamba_forward_result f = mamba_forward(good, w, x);

  SUBCASE("a zero dimension") {
    const struct {
      std::size_t mamba_config::*field;
      const char* name;
    } dims[] = {{&mamba_config::batch, "config.batch"},
                {&mamba_config::seq, "config.seq"},
                {&mamba_config::d_model, "config.d_model"},
                {&mamba_config::d_inner, "config.d_inner"},
                {&mamba_config::d_state, "config.d_state"},
                {&mamba_config::d_conv, "config.d_conv"},
                {&mamba_config::dt_rank, "config.dt_rank"}};
    for (const auto& d : dims) {
      mamba_config c = good;
      c.*d.field = 0;
      expect_invalid([&] { (void)mamba_forward(c, w, x); }, d.name);
      expect_invalid([&] { (void)mamba_backward(c, w, x, f, x); }, d.name);
      if (d.field != &mamba_config::seq) {  // the step and its state ignore seq
        expect_invalid([&] { (void)make_mamba_state(c); }, d.name);
        rng rr{1};
        expect_invalid([&] { (void)mamba_init(c, rr); }, d.name);
      }
    }
    mamba_config c = good;
    c.seq = 0;
    mamba_state s = make_mamba_state(c);  // fine: a state has no length
    CHECK(mamba_step(c, w, s, std::vector<double>(2 * 4, 0.5)).size() == 2 * 4);
  }
  SUBCASE("a weight of the wrong size") {
    const struct {
      std::vector<double> mamba_weights::*field;
      const char* name;
    } ws[] = {{&mamba_weights::in_proj, "weights.in_proj"},
              {&mamba_weights::conv_w, "weights.conv_w"},
              {&mamba_weights::conv_b, "weights.conv_b"},
              {&mamba_weights::x_proj, "weights.x_proj"},
              {&mamba_weights::dt_proj, "weights.dt_proj"},
              {&mamba_weights::dt_bias, "weights.dt_bias"},
              {&mamba_weights::a_log, "weights.a_log"},
              {&mamba_weights::d, "weights.d"},
              {&mamba_weights::out_proj, "weights.out_proj"}};
    for (const auto& k : ws) {
      mamba_weights bad = w;
      (bad.*k.field).push_back(0.0);
      expect_invalid([&] { (void)mamba_forward(good, bad, x); }, k.name);
      expect_invalid([&] { (void)mamba_backward(good, bad, x, f, x); }, k.name);
      mamba_state s = make_mamba_state(good);
      expect_invalid([&] { (void)mamba_step(good, bad, s, std::vector<double>(8, 0.0)); }, k.name);
    }
  }
  SUBCASE("activations of the wrong size") {
    const std::vector<double> short_x(x.begin(), x.end() - 1);
    expect_invalid([&] { (void)mamba_forward(good, w, short_x); }, "x");
    expect_invalid([&] { (void)mamba_backward(good, w, short_x, f, x); }, "x");
    expect_invalid([&] { (void)mamba_backward(good, w, x, f, short_x); }, "dy");
    mamba_forward_result bad = f;
    bad.h.pop_back();
    expect_invalid([&] { (void)mamba_backward(good, w, x, bad, x); }, "forward.h");
    bad = f;
    bad.Bm.clear();
    expect_invalid([&] { (void)mamba_backward(good, w, x, bad, x); }, "forward.Bm");
  }
  SUBCASE("a step with a wrong input or state leaves the state as it was") {
    mamba_state s = make_mamba_state(good);
    (void)mamba_step(good, w, s, std::vector<double>(8, 0.5));  // some non-zero state
    const mamba_state before = s;
    expect_invalid([&] { (void)mamba_step(good, w, s, std::vector<double>(7, 0.5)); }, "x_t");
    CHECK(s.conv == before.conv);
    CHECK(s.ssm == before.ssm);
    mamba_state bad = s;
    bad.conv.push_back(0.0);
    expect_invalid([&] { (void)mamba_step(good, w, bad, std::vector<double>(8, 0.5)); },
                   "state.conv");
    bad = s;
    bad.ssm.pop_back();
    expect_invalid([&] { (void)mamba_step(good, w, bad, std::vector<double>(8, 0.5)); },
                   "state.ssm");
    CHECK(bad.conv == before.conv);
  }
  SUBCASE("an initialisation range that is not one") {
    rng rr{2};
    expect_invalid([&] { (void)mamba_init(good, rr, 0.0); }, "dt_min");
    expect_invalid([&] { (void)mamba_init(good, rr, 0.1, 0.01); }, "dt_max");
    expect_invalid([&] { (void)mamba_init(good, rr, 0.001, 0.1, -1.0); }, "dt_init_floor");
  }
}
