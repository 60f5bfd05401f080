// The naive TTT reference checked on its own: the dual numbers and the inner gradient against
// finite differences, the layer's dual-number gradients against central finite differences, the
// primal per-token form against the paper's dual form (written out independently here), RoPE by
// hand, single-step decoding against the full forward, the token-scale clamp, the
// initialisation, and the argument checks.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "../support/test_rng.hpp"
#include "../support/ttt_reference.hpp"

using namespace membound::reference;
namespace td = membound::reference::ttt_detail;

namespace {

using membound_test::rng;

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

// ttt_init's weights, then every tensor nudged, so that nothing sits at a special value (norm
// weights 1, biases and token offsets 0) and the inner model's weights are large enough that
// test-time learning changes the output visibly. Token offsets move by at most 0.1, so with
// b <= 4 no token scale is clamped unless a test asks for it.
ttt_weights test_weights(const ttt_config& c, rng& r) {
  ttt_weights w = ttt_init(c, r);
  const auto nudge = [&r](std::vector<double>& v, double scale) {
    for (double& e : v) e += r.uniform(-scale, scale);
  };
  nudge(w.wq, 0.3);
  nudge(w.wk, 0.3);
  nudge(w.wv, 0.3);
  nudge(w.ttt_norm_weight, 0.3);
  nudge(w.ttt_norm_bias, 0.3);
  nudge(w.w1, 0.3);
  nudge(w.b1, 0.2);
  nudge(w.w2, 0.2);
  nudge(w.b2, 0.2);
  nudge(w.lr_weight, 0.3);
  nudge(w.lr_bias, 0.5);
  nudge(w.token_offset, 0.1);
  nudge(w.post_norm_weight, 0.3);
  nudge(w.post_norm_bias, 0.3);
  nudge(w.wg, 0.3);
  nudge(w.wo, 0.3);
  return w;
}

double loss(const ttt_config& c, const ttt_weights& w, const std::vector<double>& x,
            const std::vector<double>& G) {
  const std::vector<double> out = ttt_forward(c, w, x).out;
  double L = 0.0;
  for (std::size_t i = 0; i < out.size(); ++i) L += out[i] * G[i];
  return L;
}

// Central differences of L = Σ out ⊙ G with respect to every entry of `param` (a reference into
// x or one of w's vectors), step h = 1e-5 · max(1, |θ|).
std::vector<double> fd_grad(const ttt_config& c, ttt_weights& w, std::vector<double>& x,
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

// The gradient check on one configuration. clamp_at: a mini-batch index whose token scale is
// forced to 0 by a negative offset (none when >= b).
void check_gradients(const ttt_config& c, std::uint64_t seed, std::size_t clamp_at = 1000) {
  rng r{seed};
  ttt_weights w = test_weights(c, r);
  if (clamp_at < c.mini_batch) w.token_offset[clamp_at] = -1.0 / double(clamp_at + 1) - 0.4;
  std::vector<double> x = r.fill(c.batch * c.seq * c.width, 1.0);
  const std::vector<double> G = r.fill(x.size(), 1.0);  // dL/d(out)

  // Test-time learning matters here: without it (base_lr = 0) the output moves by >= 1 %.
  {
    ttt_config frozen = c;
    frozen.base_lr = 0.0;
    const double moved = rel_err(ttt_forward(c, w, x).out, ttt_forward(frozen, w, x).out);
    INFO("output change from test-time learning " << moved);
    CHECK(moved > 1e-2);
  }

  const ttt_gradients g = ttt_reference_gradients(c, w, x, G);

  // Tolerance 1e-6 relative to each tensor's largest entry. The dual numbers are exact to
  // rounding; the central difference with h = 1e-5 has truncation error h²/6·|L'''| ~ 1e-11 and
  // rounding error ~ eps·|L|/h ~ 1e-11 absolute, so agreement lands around 1e-10..1e-8; a wrong
  // path is O(1).
  std::vector<std::string> names{"x"};
  std::vector<std::vector<double>*> params{&x};
  std::vector<const std::vector<double>*> analytic{&g.dx};
  for_each_ttt_tensor(w, [&](const char* name, std::vector<double>& t) {
    names.emplace_back(name);
    params.push_back(&t);
  });
  for_each_ttt_tensor(g.dw, [&](const char*, const std::vector<double>& t) {
    analytic.push_back(&t);
  });
  REQUIRE(params.size() == analytic.size());
  for (std::size_t k = 0; k < params.size(); ++k) {
    INFO("d" << names[k]);
    REQUIRE(analytic[k]->size() == params[k]->size());
    if (params[k]->empty()) continue;  // w2/b2 for linear, wg without the gate
    const std::vector<double> fd = fd_grad(c, w, x, G, *params[k]);
    CHECK(max_abs(*analytic[k]) > 1e-4);  // the comparison is not between two zeros
    const double e = rel_err(*analytic[k], fd);
    INFO("relative error " << e);
    CHECK(e <= 1e-6);
  }
  if (clamp_at < c.mini_batch) {
    // The clamped scale passes no gradient to its offset.
    CHECK(g.dw.token_offset[clamp_at] == 0.0);
  }
  if (c.seq < c.mini_batch) {
    // Offsets of positions the sequence never reaches get none either.
    for (std::size_t i = c.seq; i < c.mini_batch; ++i) CHECK(g.dw.token_offset[i] == 0.0);
  }
}

// The paper's dual form (Sun et al. 2024, Sec. 2.5; ttt-lm-pytorch's prefill path), computed per
// mini-batch with matrices and never forming a per-token W_t:
//   η[i, s] = token_scale[i]·lr[s] (s ≤ i), Attn = tril(XQ·XKᵀ)
//   linear: G = ∂ℓ/∂Z at W_0 (rows = tokens),
//           Z̄ = XQ·W1 + b1 − (η ⊙ Attn)·G − η·G,  W1' = W1 − (η[n-1] ⊙ XK)ᵀ·G,
//           b1' = b1 − η[n-1]·G
//   mlp:    G2 = ∂ℓ/∂Z2, G1 = (G2·W2ᵀ) ⊙ gelu'(Z1),
//           Z̄1 = XQ·W1 + b1 − (η ⊙ tril(XQ·XKᵀ))·G1 − η·G1,  X̄2 = gelu(Z̄1),
//           Z̄2 = X̄2·W2 + b2 − (η ⊙ tril(X̄2·X2ᵀ))·G2 − η·G2, and the same last-row updates.
//   ttt_out = XQ + LN(Z̄ or Z̄2).
// Reads the forward's xq/xk/xv/lr/token_scale; returns ttt_out [B, T, C] and, in `w_after`, the
// inner weights after the last complete mini-batch, laid out as the state's w1, b1, w2, b2.
std::vector<double> dual_form(const ttt_config& c, const ttt_weights& w,
                              const ttt_forward_result& f,
                              std::vector<std::vector<double>>& w_after) {
  const std::size_t B = c.batch, T = c.seq, C = c.width, H = c.heads, D = c.head_dim(),
                    F = c.hidden(), b = c.mini_batch;
  const bool mlp = c.kind == ttt_kind::mlp;
  std::vector<double> out(B * T * C);
  w_after.assign(4, {});
  for (std::size_t bi = 0; bi < B; ++bi)
    for (std::size_t h = 0; h < H; ++h) {
      const std::size_t bh = bi * H + h;
      const double* gamma = &w.ttt_norm_weight[h * D];
      const double* beta = &w.ttt_norm_bias[h * D];
      const auto XQ = [&](std::size_t t, std::size_t d) { return f.xq[(bh * T + t) * D + d]; };
      const auto XK = [&](std::size_t t, std::size_t d) { return f.xk[(bh * T + t) * D + d]; };
      const auto XV = [&](std::size_t t, std::size_t d) { return f.xv[(bh * T + t) * D + d]; };
      std::vector<double> W1(w.w1.begin() + long(h * D * F), w.w1.begin() + long((h + 1) * D * F));
      std::vector<double> b1(w.b1.begin() + long(h * F), w.b1.begin() + long((h + 1) * F));
      std::vector<double> W2, b2;
      if (mlp) {
        W2.assign(w.w2.begin() + long(h * F * D), w.w2.begin() + long((h + 1) * F * D));
        b2.assign(w.b2.begin() + long(h * D), w.b2.begin() + long((h + 1) * D));
      }
      for (std::size_t start = 0; start < T; start += b) {
        const std::size_t n = std::min(b, T - start);
        std::vector<double> eta(n * n, 0.0);
        for (std::size_t i = 0; i < n; ++i)
          for (std::size_t s = 0; s <= i; ++s)
            eta[i * n + s] = f.token_scale[start + i] * f.lr[bh * T + start + s];
        // Z1 = XK·W1 + b1 [n, F]; mlp: X2 = gelu(Z1), Z2 = X2·W2 + b2 [n, D]
        std::vector<double> Z1(n * F), X2, Z2;
        for (std::size_t s = 0; s < n; ++s)
          for (std::size_t k = 0; k < F; ++k) {
            double a = b1[k];
            for (std::size_t d = 0; d < D; ++d) a += XK(start + s, d) * W1[d * F + k];
            Z1[s * F + k] = a;
          }
        if (mlp) {
          X2.resize(n * F);
          Z2.resize(n * D);
          for (std::size_t e = 0; e < n * F; ++e) X2[e] = td::gelu(Z1[e]);
          for (std::size_t s = 0; s < n; ++s)
            for (std::size_t d = 0; d < D; ++d) {
              double a = b2[d];
              for (std::size_t k = 0; k < F; ++k) a += X2[s * F + k] * W2[k * D + d];
              Z2[s * D + d] = a;
            }
        }
        // G_out = ∂ℓ/∂(f's output) [n, D], G1 = ∂ℓ/∂Z1 [n, F]
        const std::vector<double>& Zout = mlp ? Z2 : Z1;
        std::vector<double> Gout(n * D), G1(n * F);
        for (std::size_t s = 0; s < n; ++s) {
          std::vector<double> target(D);
          for (std::size_t d = 0; d < D; ++d) target[d] = XV(start + s, d) - XK(start + s, d);
          const std::vector<double> g =
              td::ln_l2_grad(&Zout[s * D], target.data(), gamma, beta, D, c.ttt_norm_eps);
          std::copy(g.begin(), g.end(), Gout.begin() + long(s * D));
        }
        if (mlp) {
          for (std::size_t s = 0; s < n; ++s)
            for (std::size_t k = 0; k < F; ++k) {
              double a = 0.0;
              for (std::size_t d = 0; d < D; ++d) a += Gout[s * D + d] * W2[k * D + d];
              G1[s * F + k] = a * td::gelu_grad(Z1[s * F + k]);
            }
        } else {
          G1 = Gout;
        }
        // Z̄1 [n, F]
        std::vector<double> Zbar1(n * F);
        for (std::size_t i = 0; i < n; ++i)
          for (std::size_t k = 0; k < F; ++k) {
            double a = b1[k];
            for (std::size_t d = 0; d < D; ++d) a += XQ(start + i, d) * W1[d * F + k];
            for (std::size_t s = 0; s <= i; ++s) {
              double attn = 0.0;
              for (std::size_t d = 0; d < D; ++d) attn += XQ(start + i, d) * XK(start + s, d);
              a -= eta[i * n + s] * (attn + 1.0) * G1[s * F + k];
            }
            Zbar1[i * F + k] = a;
          }
        std::vector<double> Zbar = Zbar1;  // [n, D] for linear (F = D)
        if (mlp) {
          std::vector<double> X2bar(n * F);
          for (std::size_t e = 0; e < n * F; ++e) X2bar[e] = td::gelu(Zbar1[e]);
          Zbar.assign(n * D, 0.0);
          for (std::size_t i = 0; i < n; ++i)
            for (std::size_t d = 0; d < D; ++d) {
              double a = b2[d];
              for (std::size_t k = 0; k < F; ++k) a += X2bar[i * F + k] * W2[k * D + d];
              for (std::size_t s = 0; s <= i; ++s) {
                double attn = 0.0;
                for (std::size_t k = 0; k < F; ++k) attn += X2bar[i * F + k] * X2[s * F + k];
                a -= eta[i * n + s] * (attn + 1.0) * Gout[s * D + d];
              }
              Zbar[i * D + d] = a;
            }
        }
        for (std::size_t i = 0; i < n; ++i) {
          const std::vector<double> y =
              td::layer_norm(&Zbar[i * D], gamma, beta, D, c.ttt_norm_eps);
          for (std::size_t d = 0; d < D; ++d)
            out[(bi * T + start + i) * C + h * D + d] = XQ(start + i, d) + y[d];
        }
        if (n == b) {  // the last row of η updates the weights for the next mini-batch
          for (std::size_t s = 0; s < n; ++s) {
            const double e = eta[(n - 1) * n + s];
            for (std::size_t d = 0; d < D; ++d)
              for (std::size_t k = 0; k < F; ++k)
                W1[d * F + k] -= e * XK(start + s, d) * G1[s * F + k];
            for (std::size_t k = 0; k < F; ++k) b1[k] -= e * G1[s * F + k];
            if (mlp) {
              for (std::size_t k = 0; k < F; ++k)
                for (std::size_t d = 0; d < D; ++d)
                  W2[k * D + d] -= e * X2[s * F + k] * Gout[s * D + d];
              for (std::size_t d = 0; d < D; ++d) b2[d] -= e * Gout[s * D + d];
            }
          }
        }
      }
      w_after[0].insert(w_after[0].end(), W1.begin(), W1.end());
      w_after[1].insert(w_after[1].end(), b1.begin(), b1.end());
      w_after[2].insert(w_after[2].end(), W2.begin(), W2.end());
      w_after[3].insert(w_after[3].end(), b2.begin(), b2.end());
    }
  return out;
}

// Token t of x [B, T, C] as [B, C].
std::vector<double> token(const ttt_config& c, const std::vector<double>& x, std::size_t T,
                          std::size_t t) {
  std::vector<double> x_t(c.batch * c.width);
  for (std::size_t bi = 0; bi < c.batch; ++bi)
    for (std::size_t k = 0; k < c.width; ++k) x_t[bi * c.width + k] = x[(bi * T + t) * c.width + k];
  return x_t;
}

void check_state_equal(const ttt_state& a, const ttt_state& b, double tol) {
  CHECK(a.position == b.position);
  const std::vector<double>* av[] = {&a.w1, &a.b1, &a.w2, &a.b2, &a.gw1, &a.gb1, &a.gw2, &a.gb2};
  const std::vector<double>* bv[] = {&b.w1, &b.b1, &b.w2, &b.b2, &b.gw1, &b.gb1, &b.gw2, &b.gb2};
  for (std::size_t k = 0; k < 8; ++k) {
    INFO("state tensor " << k);
    REQUIRE(av[k]->size() == bv[k]->size());
    // G is exactly zero after a complete mini-batch: compare absolutely then.
    CHECK(rel_err(*av[k], *bv[k]) <= tol);
  }
}

// Stepping every token from make_ttt_state against the full forward; then a prefill of the first
// `prefix` tokens by ttt_forward continued by ttt_step.
void check_stepping(const ttt_config& c, std::uint64_t seed, std::size_t prefix) {
  rng r{seed};
  const ttt_weights w = test_weights(c, r);
  const std::vector<double> x = r.fill(c.batch * c.seq * c.width, 1.0);
  const ttt_forward_result f = ttt_forward(c, w, x);
  const std::size_t T = c.seq, C = c.width;

  ttt_state s = make_ttt_state(c, w);
  std::vector<double> stepped(f.out.size());
  for (std::size_t t = 0; t < T; ++t) {
    const std::vector<double> o = ttt_step(c, w, s, token(c, x, T, t));
    for (std::size_t bi = 0; bi < c.batch; ++bi)
      for (std::size_t k = 0; k < C; ++k) stepped[(bi * T + t) * C + k] = o[bi * C + k];
  }
  CHECK(rel_err(stepped, f.out) <= 1e-12);
  check_state_equal(s, f.state, 1e-12);

  ttt_config pc = c;
  pc.seq = prefix;
  std::vector<double> xp(c.batch * prefix * C);
  for (std::size_t bi = 0; bi < c.batch; ++bi)
    for (std::size_t t = 0; t < prefix; ++t)
      for (std::size_t k = 0; k < C; ++k) xp[(bi * prefix + t) * C + k] = x[(bi * T + t) * C + k];
  ttt_state ps = ttt_forward(pc, w, xp).state;
  CHECK(ps.position == prefix);
  double worst = 0.0;
  for (std::size_t t = prefix; t < T; ++t) {
    const std::vector<double> o = ttt_step(c, w, ps, token(c, x, T, t));
    worst = std::max(worst, rel_err(o, token(c, f.out, T, t)));
  }
  CHECK(worst <= 1e-12);
  check_state_equal(ps, f.state, 1e-12);
}

ttt_config small(ttt_kind kind, bool gate, std::size_t batch, std::size_t seq, std::size_t width,
                 std::size_t heads, std::size_t b) {
  ttt_config c;
  c.batch = batch;
  c.seq = seq;
  c.width = width;
  c.heads = heads;
  c.mini_batch = b;
  c.kind = kind;
  c.use_gate = gate;
  return c;
}

}  // namespace

TEST_CASE("ttt reference: dual numbers give exact derivatives") {
  using td::dual;
  // A composite of every operation and function the forward uses, against central differences.
  const auto f = [](auto v) {
    using S = decltype(v);
    const S a = td::exp(v) * td::sqrt(v) / (S(1.0) + v) - td::log(v) * td::sigmoid(v);
    S b = td::tanh(a) + td::gelu(v) * td::gelu_grad(-v);
    b += S(2.0) * v;
    b -= v * v;
    b *= S(0.5);
    b /= S(1.0) + v * v;
    return -b + td::clamp_min(v - S(0.2), 0.0);
  };
  for (double v : {0.3, 0.7, 1.3, 2.9}) {
    const dual d = f(dual(v, 1.0));
    CHECK(d.v == f(v));
    const double h = 1e-6, fd = (f(v + h) - f(v - h)) / (2 * h);
    CHECK(std::abs(d.d - fd) <= 1e-8 * std::max(1.0, std::abs(fd)));
  }
  // The clamp passes nothing below its bound, and the derivative 1 above it.
  CHECK(td::clamp_min(dual(-0.5, 1.0), 0.0).d == 0.0);
  CHECK(td::clamp_min(dual(-0.5, 1.0), 0.0).v == 0.0);
  CHECK(td::clamp_min(dual(0.5, 1.0), 0.0).d == 1.0);
  // σ stays finite far out on both sides.
  CHECK(td::sigmoid(-800.0) == 0.0);
  CHECK(td::sigmoid(800.0) == 1.0);
}

TEST_CASE("ttt reference: gelu' and the inner gradient match finite differences") {
  for (double v : {-3.0, -0.7, 0.0, 0.4, 2.5}) {
    const double h = 1e-6;
    const double fd = (td::gelu(v + h) - td::gelu(v - h)) / (2 * h);
    CHECK(std::abs(td::gelu_grad(v) - fd) <= 1e-9);
  }
  CHECK(td::gelu(1.0) == doctest::Approx(0.8411919906082768).epsilon(1e-15));  // torch, tanh

  for (ttt_kind kind : {ttt_kind::linear, ttt_kind::mlp}) {
    INFO((kind == ttt_kind::mlp ? "mlp" : "linear"));
    const std::size_t D = 6, F = kind == ttt_kind::mlp ? 24 : 6;
    rng r{77};
    td::inner_params<double> p;
    p.w1 = r.fill(D * F, 0.5);
    p.b1 = r.fill(F, 0.3);
    if (kind == ttt_kind::mlp) {
      p.w2 = r.fill(F * D, 0.5);
      p.b2 = r.fill(D, 0.3);
    }
    const std::vector<double> k = r.fill(D, 1.0), target = r.fill(D, 1.0),
                              gamma = r.fill(D, 1.0), beta = r.fill(D, 0.5);
    const td::inner_params<double> g =
        td::inner_grad(kind, D, F, p, k.data(), target.data(), gamma.data(), beta.data(), 1e-6);
    td::inner_params<double> q = p;
    std::vector<double>* qs[] = {&q.w1, &q.b1, &q.w2, &q.b2};
    const std::vector<double>* gs[] = {&g.w1, &g.b1, &g.w2, &g.b2};
    for (std::size_t t = 0; t < 4; ++t) {
      REQUIRE(qs[t]->size() == gs[t]->size());
      std::vector<double> fd(qs[t]->size());
      for (std::size_t e = 0; e < fd.size(); ++e) {
        const double saved = (*qs[t])[e], h = 1e-6;
        (*qs[t])[e] = saved + h;
        const double lp = td::inner_loss(kind, D, F, q, k.data(), target.data(), gamma.data(),
                                         beta.data(), 1e-6);
        (*qs[t])[e] = saved - h;
        const double lm = td::inner_loss(kind, D, F, q, k.data(), target.data(), gamma.data(),
                                         beta.data(), 1e-6);
        (*qs[t])[e] = saved;
        fd[e] = (lp - lm) / (2 * h);
      }
      if (fd.empty()) continue;
      CHECK(max_abs(*gs[t]) > 1e-3);
      CHECK(rel_err(*gs[t], fd) <= 1e-7);
    }
  }
}

TEST_CASE("ttt reference: RoPE rotates interleaved pairs at position t mod b") {
  // D = 4, base 100: pair (0, 1) turns by p radians, pair (2, 3) by p/10.
  std::vector<double> v{1.0, 2.0, 3.0, 4.0};
  td::rope(v.data(), 4, 0, 100.0);
  CHECK(v == std::vector<double>{1.0, 2.0, 3.0, 4.0});
  td::rope(v.data(), 4, 2, 100.0);
  const double c0 = std::cos(2.0), s0 = std::sin(2.0), c1 = std::cos(0.2), s1 = std::sin(0.2);
  CHECK(v[0] == doctest::Approx(1.0 * c0 - 2.0 * s0).epsilon(1e-15));
  CHECK(v[1] == doctest::Approx(2.0 * c0 + 1.0 * s0).epsilon(1e-15));
  CHECK(v[2] == doctest::Approx(3.0 * c1 - 4.0 * s1).epsilon(1e-15));
  CHECK(v[3] == doctest::Approx(4.0 * c1 + 3.0 * s1).epsilon(1e-15));

  // In the layer the position restarts with every mini-batch: tokens t and t + b with the same
  // input get the same rotated q and k, and the first token of each mini-batch is not rotated.
  ttt_config c = small(ttt_kind::linear, false, 1, 7, 8, 2, 3);
  rng r{5};
  const ttt_weights w = test_weights(c, r);
  std::vector<double> x = r.fill(c.seq * c.width, 1.0);
  for (std::size_t k = 0; k < c.width; ++k) x[4 * c.width + k] = x[1 * c.width + k];  // t=4 ≡ 1
  const ttt_forward_result f = ttt_forward(c, w, x);
  const std::size_t D = c.head_dim(), T = c.seq;
  for (std::size_t h = 0; h < c.heads; ++h)
    for (std::size_t d = 0; d < D; ++d) {
      CHECK(f.xq[(h * T + 4) * D + d] == f.xq[(h * T + 1) * D + d]);
      CHECK(f.xk[(h * T + 4) * D + d] == f.xk[(h * T + 1) * D + d]);
      // t = 3 starts a mini-batch: q is x·Wq unrotated.
      double q = 0.0;
      for (std::size_t k = 0; k < c.width; ++k)
        q += x[3 * c.width + k] * w.wq[k * c.width + h * D + d];
      CHECK(f.xq[(h * T + 3) * D + d] == doctest::Approx(q).epsilon(1e-14));
    }
}

TEST_CASE("ttt reference: dual-number gradients match central finite differences") {
  SUBCASE("linear, no gate, B=2 T=7 b=4 (last mini-batch of 3)") {
    check_gradients(small(ttt_kind::linear, false, 2, 7, 16, 2, 4), 1);
  }
  SUBCASE("linear, gate, T=8 b=4, token scale clamped at index 1") {
    check_gradients(small(ttt_kind::linear, true, 1, 8, 16, 2, 4), 2, 1);
  }
  SUBCASE("mlp, no gate, B=2 T=6 b=4") {
    check_gradients(small(ttt_kind::mlp, false, 2, 6, 16, 2, 4), 3);
  }
  SUBCASE("mlp, gate, T=7 b=3 C=8, token scale clamped at index 2") {
    check_gradients(small(ttt_kind::mlp, true, 1, 7, 8, 2, 3), 4, 2);
  }
  SUBCASE("b = 1: online gradient descent, linear and mlp") {
    check_gradients(small(ttt_kind::linear, true, 1, 5, 8, 2, 1), 5);
    check_gradients(small(ttt_kind::mlp, false, 1, 4, 8, 2, 1), 6);
  }
  SUBCASE("T < b: one incomplete mini-batch, mlp with gate") {
    check_gradients(small(ttt_kind::mlp, true, 2, 3, 8, 2, 4), 7);
  }
  SUBCASE("one head") {
    ttt_config c = small(ttt_kind::linear, false, 1, 6, 8, 1, 4);
    c.base_lr = 3.0;
    check_gradients(c, 8);
  }
}

TEST_CASE("ttt reference: the primal per-token form equals the dual form") {
  const auto check = [](const ttt_config& c, std::uint64_t seed) {
    rng r{seed};
    const ttt_weights w = test_weights(c, r);
    const std::vector<double> x = r.fill(c.batch * c.seq * c.width, 1.0);
    const ttt_forward_result f = ttt_forward(c, w, x);
    std::vector<std::vector<double>> w_after;
    const std::vector<double> dual_out = dual_form(c, w, f, w_after);
    CHECK(rel_err(f.ttt_out, dual_out) <= 1e-12);
    CHECK(rel_err(f.state.w1, w_after[0]) <= 1e-12);
    CHECK(rel_err(f.state.b1, w_after[1]) <= 1e-12);
    CHECK(rel_err(f.state.w2, w_after[2]) <= 1e-12);
    CHECK(rel_err(f.state.b2, w_after[3]) <= 1e-12);
  };
  for (ttt_kind kind : {ttt_kind::linear, ttt_kind::mlp}) {
    INFO((kind == ttt_kind::mlp ? "mlp" : "linear"));
    check(small(kind, false, 2, 16, 16, 2, 4), 11);  // four complete mini-batches
    check(small(kind, true, 2, 13, 16, 4, 4), 12);   // the last one has a single token
    check(small(kind, false, 1, 20, 32, 2, 16), 13); // upstream's b = 16, then 4 tokens
    check(small(kind, false, 1, 5, 8, 2, 1), 14);    // b = 1
  }
}

TEST_CASE("ttt reference: without test-time learning each token sees the initial weights") {
  for (ttt_kind kind : {ttt_kind::linear, ttt_kind::mlp}) {
    ttt_config c = small(kind, false, 2, 9, 16, 2, 4);
    c.base_lr = 0.0;
    rng r{21};
    const ttt_weights w = test_weights(c, r);
    const std::vector<double> x = r.fill(c.batch * c.seq * c.width, 1.0);
    const ttt_forward_result f = ttt_forward(c, w, x);
    const std::size_t D = c.head_dim(), F = c.hidden(), T = c.seq, C = c.width;
    std::vector<double> want(f.ttt_out.size());
    for (std::size_t bi = 0; bi < c.batch; ++bi)
      for (std::size_t h = 0; h < c.heads; ++h) {
        const td::inner_params<double> p = td::initial_inner(c, w, h);
        for (std::size_t t = 0; t < T; ++t) {
          const double* xq = &f.xq[((bi * c.heads + h) * T + t) * D];
          const std::vector<double> y =
              td::layer_norm(td::inner_apply(kind, D, F, p, xq).out.data(),
                             &w.ttt_norm_weight[h * D], &w.ttt_norm_bias[h * D], D, 1e-6);
          for (std::size_t d = 0; d < D; ++d) want[(bi * T + t) * C + h * D + d] = xq[d] + y[d];
        }
      }
    CHECK(rel_err(f.ttt_out, want) <= 1e-14);
  }
}

TEST_CASE("ttt reference: stepping token by token reproduces the full forward") {
  SUBCASE("linear, no gate, T=11 b=4") {
    check_stepping(small(ttt_kind::linear, false, 2, 11, 16, 2, 4), 31, 6);
  }
  SUBCASE("linear, gate, T=12 b=4 (complete mini-batches), prefix on a boundary") {
    check_stepping(small(ttt_kind::linear, true, 2, 12, 16, 2, 4), 32, 8);
  }
  SUBCASE("mlp, no gate, T=10 b=3") {
    check_stepping(small(ttt_kind::mlp, false, 2, 10, 16, 2, 3), 33, 4);
  }
  SUBCASE("mlp, gate, T=21 b=16") {
    check_stepping(small(ttt_kind::mlp, true, 1, 21, 16, 4, 16), 34, 17);
  }
  SUBCASE("b = 1") {
    check_stepping(small(ttt_kind::mlp, true, 2, 5, 8, 2, 1), 35, 2);
  }
}

TEST_CASE("ttt reference: a negative token offset clamps the token scale at 0") {
  for (ttt_kind kind : {ttt_kind::linear, ttt_kind::mlp}) {
    ttt_config c = small(kind, false, 1, 10, 8, 2, 4);
    rng r{41};
    ttt_weights w = test_weights(c, r);
    w.token_offset[1] = -0.9;  // 1/2 − 0.9 < 0
    w.token_offset[3] = -0.25; // 1/4 − 1/4 = 0 exactly: on the boundary, still 0
    const std::vector<double> x = r.fill(c.batch * c.seq * c.width, 1.0);
    const ttt_forward_result f = ttt_forward(c, w, x);
    for (std::size_t t : {1u, 3u, 5u, 7u, 9u}) CHECK(f.token_scale[t] == 0.0);
    for (std::size_t t : {0u, 2u, 4u, 6u, 8u}) CHECK(f.token_scale[t] > 0.0);

    // A zero scale means token 1 (in the first mini-batch) sees W_0 = the initial weights, and
    // token 3 ends the mini-batch with W_3 = W_0: the second mini-batch starts from them again.
    ttt_config frozen = c;
    frozen.base_lr = 0.0;
    const ttt_forward_result g = ttt_forward(frozen, w, x);
    const std::size_t C = c.width;
    for (std::size_t t : {1u, 3u, 5u, 7u})
      for (std::size_t k = 0; k < C; ++k)
        CHECK(f.ttt_out[t * C + k] == doctest::Approx(g.ttt_out[t * C + k]).epsilon(1e-14));
    CHECK(rel_err(f.state.w1, make_ttt_state(c, w).w1) <= 1e-15);

    // Stepping clamps the same way.
    ttt_state s = make_ttt_state(c, w);
    double worst = 0.0;
    for (std::size_t t = 0; t < c.seq; ++t)
      worst = std::max(worst, rel_err(ttt_step(c, w, s, token(c, x, c.seq, t)),
                                      token(c, f.out, c.seq, t)));
    CHECK(worst <= 1e-12);
  }
}

TEST_CASE("ttt reference: initialisation follows upstream") {
  ttt_config c = small(ttt_kind::mlp, true, 1, 1, 64, 4, 16);
  rng r{51};
  const ttt_weights w = ttt_init(c, r);
  CHECK_NOTHROW(ttt_forward(c, w, std::vector<double>(c.width, 0.5)));
  const auto mean_sd = [](const std::vector<double>& v) {
    double m = 0.0, q = 0.0;
    for (double e : v) m += e;
    m /= double(v.size());
    for (double e : v) q += (e - m) * (e - m);
    return std::pair{m, std::sqrt(q / double(v.size()))};
  };
  for (const std::vector<double>* t : {&w.wq, &w.wk, &w.wv, &w.wo, &w.wg, &w.w1, &w.w2}) {
    const auto [m, sd] = mean_sd(*t);
    CHECK(std::abs(m) < 0.002);
    CHECK(sd == doctest::Approx(0.02).epsilon(0.05));
  }
  const auto [lm, lsd] = mean_sd(w.lr_weight);
  CHECK(std::abs(lm) < 0.005);
  CHECK(lsd == doctest::Approx(0.02).epsilon(0.15));
  const auto all = [](const std::vector<double>& v, double x) {
    return std::all_of(v.begin(), v.end(), [x](double e) { return e == x; });
  };
  CHECK(all(w.b1, 0.0));
  CHECK(all(w.b2, 0.0));
  CHECK(all(w.lr_bias, 0.0));
  CHECK(all(w.token_offset, 0.0));
  CHECK(all(w.ttt_norm_weight, 1.0));
  CHECK(all(w.ttt_norm_bias, 0.0));
  CHECK(all(w.post_norm_weight, 1.0));
  CHECK(all(w.post_norm_bias, 0.0));
  CHECK(w.token_offset.size() == 16);

  rng r2{51};
  CHECK(ttt_init(c, r2).w2 == w.w2);  // deterministic
  ttt_config lin = small(ttt_kind::linear, false, 1, 1, 64, 4, 16);
  const ttt_weights wl = ttt_init(lin, r2);
  CHECK(wl.w1.size() == 4 * 16 * 16);
  CHECK(wl.w2.empty());
  CHECK(wl.b2.empty());
  CHECK(wl.wg.empty());
}

TEST_CASE("ttt reference: bad arguments throw typed errors naming the argument") {
  const ttt_config good = small(ttt_kind::mlp, true, 2, 5, 16, 2, 4);
  rng r{61};
  const ttt_weights w = test_weights(good, r);
  const std::vector<double> x = r.fill(good.batch * good.seq * good.width, 1.0);
  const auto expect = [](const std::function<void()>& call, const std::string& argument) {
    INFO("argument " << argument);
    bool thrown = false;
    try {
      call();
    } catch (const membound::invalid_argument& e) {
      thrown = true;
      CHECK(e.argument() == argument);
      CHECK(std::string(e.what()).find(argument) != std::string::npos);
    }
    CHECK(thrown);
  };
  const auto with = [&](auto mutate) {
    ttt_config c = good;
    mutate(c);
    return c;
  };
  expect([&] { ttt_forward(with([](ttt_config& c) { c.batch = 0; }), w, x); }, "config.batch");
  expect([&] { ttt_forward(with([](ttt_config& c) { c.seq = 0; }), w, {}); }, "config.seq");
  expect([&] { ttt_forward(with([](ttt_config& c) { c.width = 0; }), w, x); }, "config.width");
  expect([&] { ttt_forward(with([](ttt_config& c) { c.heads = 3; }), w, x); }, "config.heads");
  expect([&] { ttt_forward(with([](ttt_config& c) { c.heads = 0; }), w, x); }, "config.heads");
  expect([&] { ttt_forward(with([](ttt_config& c) { c.heads = 16; }), w, x); }, "config.width");
  expect([&] { ttt_forward(with([](ttt_config& c) { c.mini_batch = 0; }), w, x); },
         "config.mini_batch");
  expect([&] { ttt_forward(with([](ttt_config& c) { c.kind = ttt_kind(7); }), w, x); },
         "config.kind");
  expect([&] { ttt_forward(with([](ttt_config& c) { c.base_lr = -1.0; }), w, x); },
         "config.base_lr");
  expect([&] { ttt_forward(with([](ttt_config& c) { c.base_lr = NAN; }), w, x); },
         "config.base_lr");
  expect([&] { ttt_forward(with([](ttt_config& c) { c.rope_base = 0.0; }), w, x); },
         "config.rope_base");
  expect([&] { ttt_forward(with([](ttt_config& c) { c.ttt_norm_eps = 0.0; }), w, x); },
         "config.ttt_norm_eps");
  expect([&] { ttt_forward(with([](ttt_config& c) { c.post_norm_eps = -1.0; }), w, x); },
         "config.post_norm_eps");
  // Weights laid out for another config.
  expect([&] { ttt_forward(with([](ttt_config& c) { c.kind = ttt_kind::linear; }), w, x); },
         "weights.w1");
  expect([&] { ttt_forward(with([](ttt_config& c) { c.use_gate = false; }), w, x); },
         "weights.wg");
  expect([&] { ttt_forward(with([](ttt_config& c) { c.mini_batch = 5; }), w, x); },
         "weights.token_offset");
  {
    ttt_weights bad = w;
    bad.b2.pop_back();
    expect([&] { ttt_forward(good, bad, x); }, "weights.b2");
    bad = w;
    bad.lr_weight.push_back(0.0);
    expect([&] { ttt_reference_gradients(good, bad, x, x); }, "weights.lr_weight");
  }
  expect([&] { ttt_forward(good, w, std::vector<double>(x.size() - 1)); }, "x");
  expect([&] { ttt_reference_gradients(good, w, x, std::vector<double>(3)); }, "dy");
  expect([&] { make_ttt_state(with([](ttt_config& c) { c.mini_batch = 0; }), w); },
         "config.mini_batch");
  expect([&] { (void)ttt_init(with([](ttt_config& c) { c.heads = 5; }), r); }, "config.heads");

  // ttt_step checks everything before it touches the state.
  ttt_state s = make_ttt_state(good, w);
  const ttt_state before = s;
  expect([&] { ttt_step(good, w, s, std::vector<double>(good.width)); }, "x_t");
  ttt_state short_state = s;
  short_state.gw2.pop_back();
  expect([&] { ttt_step(good, w, short_state, token(good, x, good.seq, 0)); }, "state.gw2");
  ttt_state other = make_ttt_state(with([](ttt_config& c) { c.batch = 1; }), w);
  expect([&] { ttt_step(good, w, other, token(good, x, good.seq, 0)); }, "state.w1");
  CHECK(s.position == before.position);
  CHECK(s.w1 == before.w1);
  CHECK(s.gw1 == before.gw1);
}
