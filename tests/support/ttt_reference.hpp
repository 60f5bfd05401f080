// Naive double-precision reference for one TTT layer (Sun et al. 2024, "Learning to (Learn at
// Test Time): RNNs with Expressive Hidden States"): TTT-Linear and TTT-MLP, the yardstick the
// optimized layer (dual form, hand-derived backward, state groups) is checked against. Test
// support, not library code.
//
// Written to be obviously right rather than fast: plain loops over row-major std::vector<double>,
// every shape in a comment, and the PRIMAL form of the inner loop with an explicit weight W_t for
// every token. The backward is not derived by hand at all: the forward is a template on its
// scalar type and the gradients come from forward-mode dual numbers, one forward pass per input
// or parameter element (ttt_reference_gradients), which is exact to rounding.
//
// The layer (the semantics of TTTLinear / TTTMLP in test-time-training/ttt-lm-pytorch, ttt.py,
// without share_qk's convolutions and without pre_conv; line numbers refer to ttt.py there):
//   x  [B, T, C]                  C = width = H·D, H heads of D = C / H (even) features,
//                                 b = mini-batch size, F = D (linear) or 4·D (mlp).
//   XQ = x·Wq, XK = x·Wk, XV = x·Wv   [B, T, C], then split into heads [B, H, T, D]: head h is
//       columns [h·D, (h+1)·D). No biases (ttt.py l.640-645: nn.Linear(..., bias=False)).
//       y = x·W convention: W is [in, out], row-major (nn.Linear.weight = Wᵀ).
//   RoPE on XQ and XK, at position p = t mod b (l.869: position_ids % mini_batch_size), base
//       rope_base (10000), INTERLEAVED pairs: for j < D/2, θ_j = p · rope_base^(-2j/D),
//         out[2j]   = v[2j]·cos θ_j − v[2j+1]·sin θ_j
//         out[2j+1] = v[2j+1]·cos θ_j + v[2j]·sin θ_j.
//       (Upstream applies the HF rotate-half formula between permute_qk and undo_permute_qk,
//       l.222-243 and l.872-874; the permutation [D/2, 2] -> [2, D/2] turns rotate-half into
//       exactly this interleaved rotation. Upstream computes cos/sin in float32, l.351; here they
//       are double.) XV is not rotated.
//   Learning rate of source token s (get_eta, l.776-801):
//       lr[b, h, s] = base_lr · σ(x_s · lr_weight[h] + lr_bias[h]) / D
//       (a per-head vector over the raw layer input x, not over XK; the /D is inside lr).
//   Token scale of the target token at index i inside its mini-batch:
//       token_scale[i] = max(1/(i+1) + token_offset[i], 0)  (learnable_token_idx, clamp_min 0)
//       η[i, s] = token_scale[i] · lr[s]   for s ≤ i (both in the same mini-batch), 0 otherwise.
//   Inner model, per (b, h), parameters W = (W1 [D, F], b1 [F] [, W2 [F, D], b2 [D]]):
//       linear: f(k; W) = k·W1 + b1
//       mlp:    f(k; W) = gelu(k·W1 + b1)·W2 + b2,  gelu = GELU with the tanh approximation
//   Inner loss of token s:  ℓ_s(W) = ½ ‖LN_h(f(XK_s; W)) − (XV_s − XK_s)‖²   (XK_s after RoPE)
//       LN_h(z) = γ_h ⊙ (z − mean z) / sqrt(var z + ttt_norm_eps) + β_h, biased variance,
//       γ_h = ttt_norm_weight[h], β_h = ttt_norm_bias[h] (ln_fused_l2_bwd, l.478-505).
//   Mini-batch gradient descent: the tokens of a mini-batch [m·b, m·b + n) (n = b, or fewer for
//   the last one when b does not divide T) all take their gradient at the mini-batch's starting
//   weights W_0, and token i of it uses
//       W_i = W_0 − Σ_{s ≤ i} η[i, s] · ∇ℓ_s(W_0).
//   The last token's W_{b-1} is the next mini-batch's W_0; the first W_0 is (W1, b1, W2, b2) of
//   the weights, the same for every sequence of the batch.
//   ttt_out_t = XQ_t + LN_h(f(XQ_t; W_i))   per head, heads concatenated  [B, T, C]
//   normed = LayerNorm_C(ttt_out) with post_norm_weight/bias, eps post_norm_eps (l.637, l.910)
//   use_gate: gated = gelu(x·Wg) ⊙ normed (apply_gate, l.803-808; gelu with tanh), else normed
//   out = gated·Wo  [B, T, C]   (o_proj, no bias)
//
// The last mini-batch of a sequence whose length b does not divide simply has fewer tokens: its
// i, positions and token scales run from 0 as in any other (upstream computes it the same way,
// as a separate "reminder" call with mini_batch_size = T mod b, l.894-907, and slices
// token_idx[0 : T mod b], l.789). Where upstream's inner gradient uses gelu_bwd (l.509-512) with
// the rounded constants 0.79788456 and 0.1070322243, this reference uses the exact derivative of
// the tanh-GELU (sqrt(2/π) = 0.7978845608028654): a relative difference of about 1e-9 in gelu'.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "membound/core/error.hpp"
#include "test_rng.hpp"

namespace membound::reference {

enum class ttt_kind { linear, mlp };

struct ttt_config {
  std::size_t batch = 0;        // B
  std::size_t seq = 0;          // T (ttt_step ignores it: the state carries the past)
  std::size_t width = 0;        // C = H·D (hidden_size)
  std::size_t heads = 0;        // H, divides C; D = C / H must be even (RoPE pairs)
  std::size_t mini_batch = 16;  // b (mini_batch_size), >= 1
  ttt_kind kind = ttt_kind::linear;
  bool use_gate = false;
  double base_lr = 1.0;         // ttt_base_lr, finite and >= 0 (0: no test-time learning)
  double rope_base = 10000.0;   // rope_theta
  double ttt_norm_eps = 1e-6;   // the inner LayerNorm's eps (ln_fwd / ln_fused_l2_bwd default)
  double post_norm_eps = 1e-6;  // nn.LayerNorm(width, eps=1e-6)

  std::size_t head_dim() const { return heads == 0 ? 0 : width / heads; }  // D
  std::size_t hidden() const { return kind == ttt_kind::mlp ? 4 * head_dim() : head_dim(); }  // F
};

// Every tensor of the layer, in our layout: y = x·W with W [in, out] row-major (nn.Linear.weight
// is the transpose). The inner model's initial weights are already [in, out] upstream (Z = X@W1),
// so w1/w2 are upstream's W1/W2 as they are, flattened. S is double, or the dual number the
// gradients are computed with.
template <class S>
struct basic_ttt_weights {
  std::vector<S> wq;                // [C, C]     q_proj.weightᵀ
  std::vector<S> wk;                // [C, C]     k_proj.weightᵀ
  std::vector<S> wv;                // [C, C]     v_proj.weightᵀ
  std::vector<S> ttt_norm_weight;   // [H, D]     γ of the inner LayerNorm
  std::vector<S> ttt_norm_bias;     // [H, D]     β of the inner LayerNorm
  std::vector<S> w1;                // [H, D, F]  W1 (initial; F = D linear, 4D mlp)
  std::vector<S> b1;                // [H, F]     b1 (upstream [H, 1, F])
  std::vector<S> w2;                // [H, F, D]  W2, mlp only (empty for linear)
  std::vector<S> b2;                // [H, D]     b2, mlp only (upstream [H, 1, D]; empty: linear)
  std::vector<S> lr_weight;         // [H, C]     learnable_ttt_lr_weight (upstream [H, 1, C])
  std::vector<S> lr_bias;           // [H]        learnable_ttt_lr_bias (upstream [H, 1])
  std::vector<S> token_offset;      // [b]        learnable_token_idx
  std::vector<S> post_norm_weight;  // [C]
  std::vector<S> post_norm_bias;    // [C]
  std::vector<S> wg;                // [C, C]     g_proj.weightᵀ, use_gate only (empty otherwise)
  std::vector<S> wo;                // [C, C]     o_proj.weightᵀ
};
using ttt_weights = basic_ttt_weights<double>;

// Calls f(name, tensor) for every tensor of w, in the order of the struct (names as above).
template <class W, class Fn>
void for_each_ttt_tensor(W& w, Fn&& f) {
  f("wq", w.wq);
  f("wk", w.wk);
  f("wv", w.wv);
  f("ttt_norm_weight", w.ttt_norm_weight);
  f("ttt_norm_bias", w.ttt_norm_bias);
  f("w1", w.w1);
  f("b1", w.b1);
  f("w2", w.w2);
  f("b2", w.b2);
  f("lr_weight", w.lr_weight);
  f("lr_bias", w.lr_bias);
  f("token_offset", w.token_offset);
  f("post_norm_weight", w.post_norm_weight);
  f("post_norm_bias", w.post_norm_bias);
  f("wg", w.wg);
  f("wo", w.wo);
}

// What single-step inference carries from one token to the next, per (batch, head): the current
// mini-batch's starting weights W_0 and, because η[i, s] = token_scale[i] · lr[s], the single sum
// G = Σ_{s so far} lr[s] · ∇ℓ_s(W_0) (upstream's TTTCache *_states and *_grad, l.531-594). Token i
// then uses W_i = W_0 − token_scale[i] · G. The w2/b2 fields are empty for linear.
template <class S>
struct basic_ttt_state {
  std::size_t position = 0;  // tokens consumed; the next token has index position mod b
  std::vector<S> w1, b1;     // [B, H, D, F], [B, H, F]   W_0 of the current mini-batch
  std::vector<S> w2, b2;     // [B, H, F, D], [B, H, D]
  std::vector<S> gw1, gb1;   // [B, H, D, F], [B, H, F]   G, zero at a mini-batch's start
  std::vector<S> gw2, gb2;   // [B, H, F, D], [B, H, D]
};
using ttt_state = basic_ttt_state<double>;

template <class S>
struct basic_ttt_forward_result {
  std::vector<S> xq;           // [B, H, T, D]  after RoPE
  std::vector<S> xk;           // [B, H, T, D]  after RoPE
  std::vector<S> xv;           // [B, H, T, D]
  std::vector<S> lr;           // [B, H, T]     base_lr · σ(x·lr_weight[h] + lr_bias[h]) / D
  std::vector<S> token_scale;  // [T]           max(1/(i+1) + token_offset[i], 0), i = t mod b
  std::vector<S> ttt_out;      // [B, T, C]     XQ + LN_h(f(XQ; W_t)), heads concatenated
  std::vector<S> normed;       // [B, T, C]     post_norm(ttt_out)
  std::vector<S> gate;         // [B, T, C]     gelu(x·Wg) (empty without use_gate)
  std::vector<S> out;          // [B, T, C]     (gate ⊙ normed or normed)·Wo
  basic_ttt_state<S> state;    // after the last token: ttt_step continues from here
};
using ttt_forward_result = basic_ttt_forward_result<double>;

// dL/d(everything the forward reads) for L = Σ dy ⊙ out, written (=), not accumulated.
struct ttt_gradients {
  std::vector<double> dx;  // [B, T, C]
  ttt_weights dw;          // every tensor's gradient, in its tensor's layout (w2/b2/wg empty
                           // exactly where the weights' are)
};

namespace ttt_detail {

// ---- Forward-mode dual numbers: v + d·ε with ε² = 0. ------------------------------------------
// f(θ + ε·e) = f(θ) + ε·(∂f/∂θ · e): seeding d = 1 on one input and running the forward yields
// the exact derivative of every output along that input.
struct dual {
  double v = 0.0;  // value
  double d = 0.0;  // derivative along the seeded direction
  dual() = default;
  dual(double value, double deriv = 0.0) : v(value), d(deriv) {}  // NOLINT: constants convert
};
inline dual operator+(dual a, dual b) { return {a.v + b.v, a.d + b.d}; }
inline dual operator-(dual a, dual b) { return {a.v - b.v, a.d - b.d}; }
inline dual operator-(dual a) { return {-a.v, -a.d}; }
inline dual operator*(dual a, dual b) { return {a.v * b.v, a.d * b.v + a.v * b.d}; }
inline dual operator/(dual a, dual b) { return {a.v / b.v, (a.d * b.v - a.v * b.d) / (b.v * b.v)}; }
inline dual& operator+=(dual& a, dual b) { return a = a + b; }
inline dual& operator-=(dual& a, dual b) { return a = a - b; }
inline dual& operator*=(dual& a, dual b) { return a = a * b; }
inline dual& operator/=(dual& a, dual b) { return a = a / b; }

// The elementary functions, for double and dual alike, so that generic code calls exp(v) & co.
inline double exp(double v) { return std::exp(v); }
inline double log(double v) { return std::log(v); }
inline double sqrt(double v) { return std::sqrt(v); }
inline double tanh(double v) { return std::tanh(v); }
inline dual exp(dual a) {
  const double e = std::exp(a.v);
  return {e, a.d * e};
}
inline dual log(dual a) { return {std::log(a.v), a.d / a.v}; }
inline dual sqrt(dual a) {
  const double s = std::sqrt(a.v);
  return {s, a.d / (2.0 * s)};
}
inline dual tanh(dual a) {
  const double t = std::tanh(a.v);
  return {t, a.d * (1.0 - t * t)};
}
inline double value(double v) { return v; }
inline double value(dual a) { return a.v; }

// max(v, lo): the derivative is 0 where the clamp is active (value below lo), 1 otherwise.
template <class S>
S clamp_min(S v, double lo) {
  return value(v) < lo ? S(lo) : v;
}

// σ(v) = 1 / (1 + e^-v), without overflow for either sign.
template <class S>
S sigmoid(S v) {
  if (value(v) >= 0.0) return S(1.0) / (S(1.0) + exp(-v));
  const S e = exp(v);
  return e / (S(1.0) + e);
}

inline constexpr double gelu_c = 0.7978845608028654;  // sqrt(2/π)
inline constexpr double gelu_a = 0.044715;

// GELU, tanh approximation (F.gelu(v, approximate="tanh")):
//   gelu(v) = ½·v·(1 + tanh(c·(v + a·v³)))
template <class S>
S gelu(S v) {
  return S(0.5) * v * (S(1.0) + tanh(S(gelu_c) * (v + S(gelu_a) * v * v * v)));
}

// Its exact derivative: with u = c·(v + a·v³), t = tanh(u),
//   gelu'(v) = ½·(1 + t) + ½·v·(1 − t²)·c·(1 + 3a·v²)
template <class S>
S gelu_grad(S v) {
  const S t = tanh(S(gelu_c) * (v + S(gelu_a) * v * v * v));
  return S(0.5) * (S(1.0) + t) +
         S(0.5) * v * (S(1.0) - t * t) * S(gelu_c) * (S(1.0) + S(3.0 * gelu_a) * v * v);
}

// y = γ ⊙ (z − mean) / sqrt(var + eps) + β over n features (biased variance).
// z, gamma, beta [n]; returns [n].
template <class S>
std::vector<S> layer_norm(const S* z, const S* gamma, const S* beta, std::size_t n, double eps) {
  S mean(0.0);
  for (std::size_t k = 0; k < n; ++k) mean += z[k];
  mean /= S(static_cast<double>(n));
  S var(0.0);
  for (std::size_t k = 0; k < n; ++k) var += (z[k] - mean) * (z[k] - mean);
  var /= S(static_cast<double>(n));
  const S stdev = sqrt(var + S(eps));
  std::vector<S> y(n);
  for (std::size_t k = 0; k < n; ++k) y[k] = gamma[k] * ((z[k] - mean) / stdev) + beta[k];
  return y;
}

// ∂/∂z of ½‖LN(z) − target‖²  (z, target, gamma, beta [n]; returns [n]). With x̂ = (z − mean)/σ,
// σ = sqrt(var + eps), gy = LN(z) − target, gx̂ = gy ⊙ γ:
//   ∂/∂z = (n·gx̂ − Σ gx̂ − x̂·Σ(gx̂ ⊙ x̂)) / (n·σ)
// (the LayerNorm backward; checked against finite differences of the loss in the unit test).
template <class S>
std::vector<S> ln_l2_grad(const S* z, const S* target, const S* gamma, const S* beta,
                          std::size_t n, double eps) {
  S mean(0.0);
  for (std::size_t k = 0; k < n; ++k) mean += z[k];
  mean /= S(static_cast<double>(n));
  S var(0.0);
  for (std::size_t k = 0; k < n; ++k) var += (z[k] - mean) * (z[k] - mean);
  var /= S(static_cast<double>(n));
  const S stdev = sqrt(var + S(eps));
  std::vector<S> xhat(n), gxhat(n);
  S sum_g(0.0), sum_gx(0.0);
  for (std::size_t k = 0; k < n; ++k) {
    xhat[k] = (z[k] - mean) / stdev;
    gxhat[k] = (gamma[k] * xhat[k] + beta[k] - target[k]) * gamma[k];
    sum_g += gxhat[k];
    sum_gx += gxhat[k] * xhat[k];
  }
  const S nn(static_cast<double>(n));
  std::vector<S> g(n);
  for (std::size_t k = 0; k < n; ++k)
    g[k] = (nn * gxhat[k] - sum_g - xhat[k] * sum_gx) / (nn * stdev);
  return g;
}

// The inner model's parameters for one (batch, head), or a gradient of the same shape.
template <class S>
struct inner_params {
  std::vector<S> w1;  // [D, F]
  std::vector<S> b1;  // [F]
  std::vector<S> w2;  // [F, D] (mlp; empty for linear)
  std::vector<S> b2;  // [D]    (mlp; empty for linear)
};

// p −= scale·g, elementwise on every tensor. p and g [same shapes].
template <class S>
void subtract_scaled(inner_params<S>& p, const S& scale, const inner_params<S>& g) {
  for (std::size_t e = 0; e < p.w1.size(); ++e) p.w1[e] -= scale * g.w1[e];
  for (std::size_t e = 0; e < p.b1.size(); ++e) p.b1[e] -= scale * g.b1[e];
  for (std::size_t e = 0; e < p.w2.size(); ++e) p.w2[e] -= scale * g.w2[e];
  for (std::size_t e = 0; e < p.b2.size(); ++e) p.b2[e] -= scale * g.b2[e];
}

// f(k; p) with its intermediates. k [D]. z1 = k·W1 + b1 [F]; mlp: x2 = gelu(z1) [F],
// out = x2·W2 + b2 [D]; linear: x2 is empty and out = z1.
template <class S>
struct inner_eval {
  std::vector<S> z1, x2, out;
};

template <class S>
inner_eval<S> inner_apply(ttt_kind kind, std::size_t D, std::size_t F, const inner_params<S>& p,
                          const S* k) {
  inner_eval<S> e;
  e.z1.resize(F);
  for (std::size_t f = 0; f < F; ++f) {
    S s = p.b1[f];
    for (std::size_t d = 0; d < D; ++d) s += k[d] * p.w1[d * F + f];
    e.z1[f] = s;
  }
  if (kind == ttt_kind::linear) {
    e.out = e.z1;
    return e;
  }
  e.x2.resize(F);
  for (std::size_t f = 0; f < F; ++f) e.x2[f] = gelu(e.z1[f]);
  e.out.resize(D);
  for (std::size_t d = 0; d < D; ++d) {
    S s = p.b2[d];
    for (std::size_t f = 0; f < F; ++f) s += e.x2[f] * p.w2[f * D + d];
    e.out[d] = s;
  }
  return e;
}

// ℓ(p) = ½‖LN(f(k; p)) − target‖²  (k, target, gamma, beta [D]).
template <class S>
S inner_loss(ttt_kind kind, std::size_t D, std::size_t F, const inner_params<S>& p, const S* k,
             const S* target, const S* gamma, const S* beta, double eps) {
  const inner_eval<S> e = inner_apply(kind, D, F, p, k);
  const std::vector<S> y = layer_norm(e.out.data(), gamma, beta, D, eps);
  S l(0.0);
  for (std::size_t d = 0; d < D; ++d) l += S(0.5) * (y[d] - target[d]) * (y[d] - target[d]);
  return l;
}

// ∇_p ℓ(p), the chain rule through f:
//   g_out = ∂ℓ/∂out [D] (ln_l2_grad);
//   linear: ∂W1 = k ⊗ g_out, ∂b1 = g_out;
//   mlp:    ∂W2 = x2 ⊗ g_out, ∂b2 = g_out, g_z1 = (W2·g_out) ⊙ gelu'(z1) [F],
//           ∂W1 = k ⊗ g_z1, ∂b1 = g_z1.
template <class S>
inner_params<S> inner_grad(ttt_kind kind, std::size_t D, std::size_t F, const inner_params<S>& p,
                           const S* k, const S* target, const S* gamma, const S* beta,
                           double eps) {
  const inner_eval<S> e = inner_apply(kind, D, F, p, k);
  const std::vector<S> g_out = ln_l2_grad(e.out.data(), target, gamma, beta, D, eps);  // [D]
  std::vector<S> g_z1(F);
  inner_params<S> g;
  if (kind == ttt_kind::linear) {
    g_z1 = g_out;
  } else {
    g.w2.resize(F * D);
    for (std::size_t f = 0; f < F; ++f)
      for (std::size_t d = 0; d < D; ++d) g.w2[f * D + d] = e.x2[f] * g_out[d];
    g.b2 = g_out;
    for (std::size_t f = 0; f < F; ++f) {
      S s(0.0);
      for (std::size_t d = 0; d < D; ++d) s += p.w2[f * D + d] * g_out[d];
      g_z1[f] = s * gelu_grad(e.z1[f]);
    }
  }
  g.w1.resize(D * F);
  for (std::size_t d = 0; d < D; ++d)
    for (std::size_t f = 0; f < F; ++f) g.w1[d * F + f] = k[d] * g_z1[f];
  g.b1 = g_z1;
  return g;
}

// Interleaved RoPE on one head vector v [D] at `position` (see the file comment).
template <class S>
void rope(S* v, std::size_t D, std::size_t position, double base) {
  for (std::size_t j = 0; j < D / 2; ++j) {
    const double inv_freq =
        1.0 / std::pow(base, static_cast<double>(2 * j) / static_cast<double>(D));
    const double theta = static_cast<double>(position) * inv_freq;
    const double c = std::cos(theta), s = std::sin(theta);
    const S a = v[2 * j], b = v[2 * j + 1];
    v[2 * j] = a * S(c) - b * S(s);
    v[2 * j + 1] = b * S(c) + a * S(s);
  }
}

// out[n, m] = Σ_k a[n, k] · b[k, m]          a [N, K], b [K, M]
template <class S>
std::vector<S> matmul(const std::vector<S>& a, const std::vector<S>& b, std::size_t N,
                      std::size_t K, std::size_t M) {
  std::vector<S> out(N * M);
  for (std::size_t n = 0; n < N; ++n)
    for (std::size_t m = 0; m < M; ++m) {
      S s(0.0);
      for (std::size_t k = 0; k < K; ++k) s += a[n * K + k] * b[k * M + m];
      out[n * M + m] = s;
    }
  return out;
}

// The head h slice of the weights' initial inner parameters.
template <class S>
inner_params<S> initial_inner(const ttt_config& c, const basic_ttt_weights<S>& w, std::size_t h) {
  const std::size_t D = c.head_dim(), F = c.hidden();
  const auto part = [](const std::vector<S>& v, std::size_t first, std::size_t n) {
    return std::vector<S>(v.begin() + static_cast<std::ptrdiff_t>(first),
                          v.begin() + static_cast<std::ptrdiff_t>(first + n));
  };
  inner_params<S> p;
  p.w1 = part(w.w1, h * D * F, D * F);
  p.b1 = part(w.b1, h * F, F);
  if (c.kind == ttt_kind::mlp) {
    p.w2 = part(w.w2, h * F * D, F * D);
    p.b2 = part(w.b2, h * D, D);
  }
  return p;
}

// Copy p into the (batch, head) slot bh of a [B, H, ...] state tensor set (w = W_0 or G).
template <class S>
void store_inner(const inner_params<S>& p, std::size_t bh, std::vector<S>& w1, std::vector<S>& b1,
                 std::vector<S>& w2, std::vector<S>& b2) {
  std::copy(p.w1.begin(), p.w1.end(), w1.begin() + static_cast<std::ptrdiff_t>(bh * p.w1.size()));
  std::copy(p.b1.begin(), p.b1.end(), b1.begin() + static_cast<std::ptrdiff_t>(bh * p.b1.size()));
  std::copy(p.w2.begin(), p.w2.end(), w2.begin() + static_cast<std::ptrdiff_t>(bh * p.w2.size()));
  std::copy(p.b2.begin(), p.b2.end(), b2.begin() + static_cast<std::ptrdiff_t>(bh * p.b2.size()));
}

// Read the (batch, head) slot bh of a state tensor set, shaped like `like`.
template <class S>
inner_params<S> load_inner(const inner_params<S>& like, std::size_t bh, const std::vector<S>& w1,
                           const std::vector<S>& b1, const std::vector<S>& w2,
                           const std::vector<S>& b2) {
  const auto part = [bh](const std::vector<S>& v, std::size_t n) {
    return std::vector<S>(v.begin() + static_cast<std::ptrdiff_t>(bh * n),
                          v.begin() + static_cast<std::ptrdiff_t>((bh + 1) * n));
  };
  inner_params<S> p;
  p.w1 = part(w1, like.w1.size());
  p.b1 = part(b1, like.b1.size());
  p.w2 = part(w2, like.w2.size());
  p.b2 = part(b2, like.b2.size());
  return p;
}

// ---- Validation ----------------------------------------------------------------------------
inline void require(bool ok, const char* argument, const std::string& expected,
                    const std::string& actual, const std::string& what_to_do) {
  if (!ok) throw membound::invalid_argument(argument, expected, actual, what_to_do);
}

template <class S>
void require_size(const std::vector<S>& v, std::size_t n, const char* argument,
                  const char* shape) {
  require(v.size() == n, argument, std::to_string(n) + " elements (" + shape + ")",
          std::to_string(v.size()), "Size the buffer from the ttt_config it is used with");
}

inline std::string num(double v) { return std::to_string(v); }

// Everything but seq, which ttt_step does not use.
inline void validate_dims(const ttt_config& c) {
  const std::string fix = "Fix the ttt_config";
  require(c.batch > 0, "config.batch", "at least 1", std::to_string(c.batch), fix);
  require(c.width > 0, "config.width", "at least 1", std::to_string(c.width), fix);
  require(c.heads > 0 && c.width % c.heads == 0, "config.heads",
          "a divisor of config.width (" + std::to_string(c.width) + ")", std::to_string(c.heads),
          "Every head has D = width / heads features");
  require(c.head_dim() % 2 == 0, "config.width",
          "width / heads (" + std::to_string(c.heads) + " heads) even",
          std::to_string(c.width), "RoPE rotates pairs (v[2j], v[2j+1]) of each head");
  require(c.mini_batch > 0, "config.mini_batch", "at least 1", std::to_string(c.mini_batch), fix);
  require(c.kind == ttt_kind::linear || c.kind == ttt_kind::mlp, "config.kind",
          "ttt_kind::linear or ttt_kind::mlp", std::to_string(static_cast<int>(c.kind)), fix);
  require(std::isfinite(c.base_lr) && c.base_lr >= 0.0, "config.base_lr", "finite and >= 0",
          num(c.base_lr), "Upstream's ttt_base_lr is 1.0");
  require(std::isfinite(c.rope_base) && c.rope_base > 0.0, "config.rope_base",
          "finite and positive", num(c.rope_base), "Upstream's rope_theta is 10000");
  require(std::isfinite(c.ttt_norm_eps) && c.ttt_norm_eps > 0.0, "config.ttt_norm_eps",
          "finite and positive", num(c.ttt_norm_eps), "Upstream's is 1e-6");
  require(std::isfinite(c.post_norm_eps) && c.post_norm_eps > 0.0, "config.post_norm_eps",
          "finite and positive", num(c.post_norm_eps), "Upstream's is 1e-6");
}

template <class S>
void validate_weights(const ttt_config& c, const basic_ttt_weights<S>& w) {
  const std::size_t C = c.width, H = c.heads, D = c.head_dim(), F = c.hidden(), b = c.mini_batch;
  const bool mlp = c.kind == ttt_kind::mlp;
  require_size(w.wq, C * C, "weights.wq", "[C, C]");
  require_size(w.wk, C * C, "weights.wk", "[C, C]");
  require_size(w.wv, C * C, "weights.wv", "[C, C]");
  require_size(w.ttt_norm_weight, H * D, "weights.ttt_norm_weight", "[H, D]");
  require_size(w.ttt_norm_bias, H * D, "weights.ttt_norm_bias", "[H, D]");
  require_size(w.w1, H * D * F, "weights.w1", mlp ? "[H, D, 4D]" : "[H, D, D]");
  require_size(w.b1, H * F, "weights.b1", mlp ? "[H, 4D]" : "[H, D]");
  require_size(w.w2, mlp ? H * F * D : 0, "weights.w2", mlp ? "[H, 4D, D]" : "empty for linear");
  require_size(w.b2, mlp ? H * D : 0, "weights.b2", mlp ? "[H, D]" : "empty for linear");
  require_size(w.lr_weight, H * C, "weights.lr_weight", "[H, C]");
  require_size(w.lr_bias, H, "weights.lr_bias", "[H]");
  require_size(w.token_offset, b, "weights.token_offset", "[mini_batch]");
  require_size(w.post_norm_weight, C, "weights.post_norm_weight", "[C]");
  require_size(w.post_norm_bias, C, "weights.post_norm_bias", "[C]");
  require_size(w.wg, c.use_gate ? C * C : 0, "weights.wg",
               c.use_gate ? "[C, C]" : "empty without use_gate");
  require_size(w.wo, C * C, "weights.wo", "[C, C]");
}

template <class S>
void validate_state(const ttt_config& c, const basic_ttt_state<S>& s) {
  const std::size_t BH = c.batch * c.heads, D = c.head_dim(), F = c.hidden();
  const bool mlp = c.kind == ttt_kind::mlp;
  require_size(s.w1, BH * D * F, "state.w1", "[B, H, D, F]");
  require_size(s.b1, BH * F, "state.b1", "[B, H, F]");
  require_size(s.w2, mlp ? BH * F * D : 0, "state.w2", mlp ? "[B, H, F, D]" : "empty for linear");
  require_size(s.b2, mlp ? BH * D : 0, "state.b2", mlp ? "[B, H, D]" : "empty for linear");
  require_size(s.gw1, BH * D * F, "state.gw1", "[B, H, D, F]");
  require_size(s.gb1, BH * F, "state.gb1", "[B, H, F]");
  require_size(s.gw2, mlp ? BH * F * D : 0, "state.gw2", mlp ? "[B, H, F, D]" : "empty for linear");
  require_size(s.gb2, mlp ? BH * D : 0, "state.gb2", mlp ? "[B, H, D]" : "empty for linear");
}

inline void validate(const ttt_config& c, const ttt_weights& w) {
  validate_dims(c);
  require(c.seq > 0, "config.seq", "at least 1", std::to_string(c.seq), "Fix the ttt_config");
  validate_weights(c, w);
}

// A zeroed state for cfg.batch sequences starting at position 0 with W_0 = the weights' initial
// inner parameters (tiled over the batch).
template <class S>
basic_ttt_state<S> initial_state(const ttt_config& c, const basic_ttt_weights<S>& w) {
  const std::size_t B = c.batch, H = c.heads, D = c.head_dim(), F = c.hidden();
  const bool mlp = c.kind == ttt_kind::mlp;
  basic_ttt_state<S> s;
  s.w1.assign(B * H * D * F, S(0.0));
  s.b1.assign(B * H * F, S(0.0));
  s.w2.assign(mlp ? B * H * F * D : 0, S(0.0));
  s.b2.assign(mlp ? B * H * D : 0, S(0.0));
  s.gw1 = s.w1;
  s.gb1 = s.b1;
  s.gw2 = s.w2;
  s.gb2 = s.b2;
  for (std::size_t bi = 0; bi < B; ++bi)
    for (std::size_t h = 0; h < H; ++h)
      store_inner(initial_inner(c, w, h), bi * H + h, s.w1, s.b1, s.w2, s.b2);
  return s;
}

// ---- The forward, on any scalar type --------------------------------------------------------
template <class S>
basic_ttt_forward_result<S> forward(const ttt_config& c, const basic_ttt_weights<S>& w,
                                    const std::vector<S>& x) {
  const std::size_t B = c.batch, T = c.seq, C = c.width, H = c.heads, D = c.head_dim(),
                    F = c.hidden(), b = c.mini_batch;
  const std::size_t BT = B * T;
  basic_ttt_forward_result<S> f;

  // Projections [B, T, C], split into heads [B, H, T, D]; RoPE on q and k at position t mod b.
  const std::vector<S> q = matmul(x, w.wq, BT, C, C), k = matmul(x, w.wk, BT, C, C),
                       v = matmul(x, w.wv, BT, C, C);
  f.xq.resize(B * H * T * D);
  f.xk.resize(B * H * T * D);
  f.xv.resize(B * H * T * D);
  for (std::size_t bi = 0; bi < B; ++bi)
    for (std::size_t h = 0; h < H; ++h)
      for (std::size_t t = 0; t < T; ++t) {
        const std::size_t dst = ((bi * H + h) * T + t) * D, src = (bi * T + t) * C + h * D;
        for (std::size_t d = 0; d < D; ++d) {
          f.xq[dst + d] = q[src + d];
          f.xk[dst + d] = k[src + d];
          f.xv[dst + d] = v[src + d];
        }
        rope(f.xq.data() + dst, D, t % b, c.rope_base);
        rope(f.xk.data() + dst, D, t % b, c.rope_base);
      }

  // lr[b, h, t] = base_lr · σ(x_t · lr_weight[h] + lr_bias[h]) / D
  f.lr.resize(B * H * T);
  for (std::size_t bi = 0; bi < B; ++bi)
    for (std::size_t h = 0; h < H; ++h)
      for (std::size_t t = 0; t < T; ++t) {
        S s = w.lr_bias[h];
        for (std::size_t cc = 0; cc < C; ++cc)
          s += x[(bi * T + t) * C + cc] * w.lr_weight[h * C + cc];
        f.lr[(bi * H + h) * T + t] = S(c.base_lr) * sigmoid(s) / S(static_cast<double>(D));
      }

  // token_scale[t] = max(1/(i+1) + token_offset[i], 0), i = t mod b (the index in its mini-batch)
  f.token_scale.resize(T);
  for (std::size_t t = 0; t < T; ++t) {
    const std::size_t i = t % b;
    f.token_scale[t] =
        clamp_min(S(1.0 / static_cast<double>(i + 1)) + w.token_offset[i], 0.0);
  }

  // The inner loop, per (batch, head), mini-batch by mini-batch, in the primal form.
  f.ttt_out.resize(BT * C);
  f.state = initial_state(c, w);
  f.state.position = T;
  for (std::size_t bi = 0; bi < B; ++bi)
    for (std::size_t h = 0; h < H; ++h) {
      const std::size_t bh = bi * H + h;
      const S* gamma = w.ttt_norm_weight.data() + h * D;
      const S* beta = w.ttt_norm_bias.data() + h * D;
      const S* xq = f.xq.data() + bh * T * D;  // [T, D] of this (batch, head)
      const S* xk = f.xk.data() + bh * T * D;
      const S* xv = f.xv.data() + bh * T * D;
      const S* lr = f.lr.data() + bh * T;       // [T]
      inner_params<S> W0 = initial_inner(c, w, h);
      inner_params<S> G;  // Σ lr[s]·∇ℓ_s(W_0) over a last, incomplete mini-batch (for the state)
      for (std::size_t start = 0; start < T; start += b) {
        const std::size_t n = std::min(b, T - start);  // tokens in this mini-batch
        // ∇ℓ_s(W_0) for every token s of the mini-batch, all at the mini-batch's W_0.
        std::vector<inner_params<S>> grads(n);
        for (std::size_t s = 0; s < n; ++s) {
          const std::size_t t = start + s;
          std::vector<S> target(D);  // XV − XK
          for (std::size_t d = 0; d < D; ++d) target[d] = xv[t * D + d] - xk[t * D + d];
          grads[s] = inner_grad(c.kind, D, F, W0, xk + t * D, target.data(), gamma, beta,
                                c.ttt_norm_eps);
        }
        inner_params<S> W_last;
        for (std::size_t i = 0; i < n; ++i) {
          const std::size_t t = start + i;
          // W_i = W_0 − Σ_{s ≤ i} η[i, s]·∇ℓ_s(W_0),  η[i, s] = token_scale[i]·lr[s]
          inner_params<S> Wi = W0;
          for (std::size_t s = 0; s <= i; ++s) {
            const S eta = f.token_scale[t] * lr[start + s];
            subtract_scaled(Wi, eta, grads[s]);
          }
          const inner_eval<S> e = inner_apply(c.kind, D, F, Wi, xq + t * D);
          const std::vector<S> y = layer_norm(e.out.data(), gamma, beta, D, c.ttt_norm_eps);
          for (std::size_t d = 0; d < D; ++d)
            f.ttt_out[(bi * T + t) * C + h * D + d] = xq[t * D + d] + y[d];
          if (i + 1 == n) W_last = std::move(Wi);
        }
        if (n == b) {
          W0 = std::move(W_last);  // a complete mini-batch hands its last W to the next
        } else {
          // The sequence ends inside this mini-batch: the state keeps its W_0 and the sum G.
          G = W0;
          for (auto* t : {&G.w1, &G.b1, &G.w2, &G.b2}) std::fill(t->begin(), t->end(), S(0.0));
          for (std::size_t s = 0; s < n; ++s) subtract_scaled(G, -lr[start + s], grads[s]);
          store_inner(G, bh, f.state.gw1, f.state.gb1, f.state.gw2, f.state.gb2);
        }
      }
      store_inner(W0, bh, f.state.w1, f.state.b1, f.state.w2, f.state.b2);
    }

  // post_norm over the width, the optional gate, o_proj.
  f.normed.resize(BT * C);
  for (std::size_t r = 0; r < BT; ++r) {
    const std::vector<S> y = layer_norm(f.ttt_out.data() + r * C, w.post_norm_weight.data(),
                                        w.post_norm_bias.data(), C, c.post_norm_eps);
    std::copy(y.begin(), y.end(), f.normed.begin() + static_cast<std::ptrdiff_t>(r * C));
  }
  std::vector<S> gated = f.normed;  // [B, T, C]
  if (c.use_gate) {
    f.gate = matmul(x, w.wg, BT, C, C);
    for (std::size_t e = 0; e < BT * C; ++e) {
      f.gate[e] = gelu(f.gate[e]);
      gated[e] = f.gate[e] * f.normed[e];
    }
  }
  f.out = matmul(gated, w.wo, BT, C, C);
  return f;
}

// A standard normal from two uniforms (Box-Muller); 1 − u lies in (0, 1].
inline double normal(membound_test::rng& r) {
  const double u1 = r.uniform(0.0, 1.0), u2 = r.uniform(0.0, 1.0);
  return std::sqrt(-2.0 * std::log(1.0 - u1)) * std::cos(6.283185307179586 * u2);
}

inline std::vector<double> normals(membound_test::rng& r, std::size_t n, double stdev) {
  std::vector<double> v(n);
  for (double& e : v) e = stdev * normal(r);
  return v;
}

}  // namespace ttt_detail

// TTTLinear / TTTMLP's initialisation (inside TTTForCausalLM, whose _init_weights re-draws every
// nn.Linear), drawn from `r` in this order: wq, wk, wv, wo, wg (use_gate), lr_weight, w1, w2 (mlp).
//   wq, wk, wv, wo, wg: N(0, 0.02²)   (_init_weights, initializer_range 0.02, l.1339-1344)
//   lr_weight:          N(0, 0.02²)   (torch.normal(0, 0.02), l.674-683); lr_bias = 0 (l.684-692)
//   w1, w2:             N(0, 0.02²)   (torch.normal(0, 0.02), l.922 / l.1076-1078); b1 = b2 = 0
//   ttt_norm_weight = 1, ttt_norm_bias = 0   (nn.LayerNorm(D)'s, tiled over heads, l.694-699)
//   token_offset = 0                         (learnable_token_idx, l.622)
//   post_norm_weight = 1, post_norm_bias = 0 (nn.LayerNorm(width), l.637)
// Normals come from the rng's uniforms by Box-Muller (plain, not truncated, as upstream's normal_).
inline ttt_weights ttt_init(const ttt_config& cfg, membound_test::rng& r) {
  using ttt_detail::normals;
  ttt_detail::validate_dims(cfg);
  const std::size_t C = cfg.width, H = cfg.heads, D = cfg.head_dim(), F = cfg.hidden();
  const double sd = 0.02;
  ttt_weights w;
  w.wq = normals(r, C * C, sd);
  w.wk = normals(r, C * C, sd);
  w.wv = normals(r, C * C, sd);
  w.wo = normals(r, C * C, sd);
  if (cfg.use_gate) w.wg = normals(r, C * C, sd);
  w.lr_weight = normals(r, H * C, sd);
  w.lr_bias.assign(H, 0.0);
  w.w1 = normals(r, H * D * F, sd);
  w.b1.assign(H * F, 0.0);
  if (cfg.kind == ttt_kind::mlp) {
    w.w2 = normals(r, H * F * D, sd);
    w.b2.assign(H * D, 0.0);
  }
  w.ttt_norm_weight.assign(H * D, 1.0);
  w.ttt_norm_bias.assign(H * D, 0.0);
  w.token_offset.assign(cfg.mini_batch, 0.0);
  w.post_norm_weight.assign(C, 1.0);
  w.post_norm_bias.assign(C, 0.0);
  return w;
}

// The full forward over x [B, T, C], from the weights' initial inner parameters at position 0.
inline ttt_forward_result ttt_forward(const ttt_config& cfg, const ttt_weights& w,
                                      const std::vector<double>& x) {
  ttt_detail::validate(cfg, w);
  ttt_detail::require_size(x, cfg.batch * cfg.seq * cfg.width, "x", "[B, T, C]");
  return ttt_detail::forward(cfg, w, x);
}

// dL/dx and dL/d(every weight) for L = Σ dy ⊙ ttt_forward(cfg, w, x).out, by forward-mode dual
// numbers: for each element θ of x and of every weight tensor, one forward pass with θ seeded
// (derivative 1, every other input 0) gives d(out)/dθ exactly, and dL/dθ = Σ dy ⊙ d(out)/dθ.
// Slow (one full forward per element) and exact to rounding: no derivative is written by hand.
inline ttt_gradients ttt_reference_gradients(const ttt_config& cfg, const ttt_weights& w,
                                             const std::vector<double>& x,
                                             const std::vector<double>& dy) {
  using ttt_detail::dual;
  ttt_detail::validate(cfg, w);
  const std::size_t n = cfg.batch * cfg.seq * cfg.width;
  ttt_detail::require_size(x, n, "x", "[B, T, C]");
  ttt_detail::require_size(dy, n, "dy", "[B, T, C]");

  // Parallel lists: the dual copy of each input (x first, then every weight tensor in
  // for_each_ttt_tensor's order), the double it is copied from, and its gradient.
  std::vector<dual> xd;
  basic_ttt_weights<dual> wd;
  ttt_gradients g;
  g.dw = w;
  std::vector<std::vector<dual>*> params{&xd};
  std::vector<const std::vector<double>*> values{&x};
  std::vector<std::vector<double>*> grads{&g.dx};
  for_each_ttt_tensor(wd, [&](const char*, std::vector<dual>& t) { params.push_back(&t); });
  for_each_ttt_tensor(w, [&](const char*, const std::vector<double>& t) { values.push_back(&t); });
  for_each_ttt_tensor(g.dw, [&](const char*, std::vector<double>& t) { grads.push_back(&t); });
  for (std::size_t k = 0; k < params.size(); ++k) {
    params[k]->assign(values[k]->begin(), values[k]->end());  // derivative 0 everywhere
    grads[k]->assign(values[k]->size(), 0.0);
  }

  for (std::size_t k = 0; k < params.size(); ++k)
    for (std::size_t e = 0; e < params[k]->size(); ++e) {
      (*params[k])[e].d = 1.0;  // seed θ
      const basic_ttt_forward_result<dual> f = ttt_detail::forward(cfg, wd, xd);
      (*params[k])[e].d = 0.0;
      double s = 0.0;
      for (std::size_t i = 0; i < n; ++i) s += dy[i] * f.out[i].d;
      (*grads[k])[e] = s;
    }
  return g;
}

// A state for cfg.batch sequences at position 0: W_0 = the weights' initial inner parameters,
// G = 0 (what ttt_forward starts from).
inline ttt_state make_ttt_state(const ttt_config& cfg, const ttt_weights& w) {
  ttt_detail::validate_dims(cfg);
  ttt_detail::validate_weights(cfg, w);
  return ttt_detail::initial_state(cfg, w);
}

// One decoding step: x_t [B, C] -> out_t [B, C], the token at state.position. For each (batch,
// head), with i = position mod b:
//   G += lr_t·∇ℓ_t(W_0),  W_i = W_0 − token_scale[i]·G,  ttt_out_t = XQ_t + LN_h(f(XQ_t; W_i)),
// and when i = b − 1 the mini-batch is complete: W_0 = W_i, G = 0. Then post_norm, gate, o_proj.
// Stepping token by token from make_ttt_state reproduces ttt_forward (to rounding: the sum
// over s is grouped differently). Checks everything before touching the state.
inline std::vector<double> ttt_step(const ttt_config& cfg, const ttt_weights& w, ttt_state& state,
                                    const std::vector<double>& x_t) {
  using namespace ttt_detail;
  validate_dims(cfg);
  validate_weights(cfg, w);
  validate_state(cfg, state);
  const std::size_t B = cfg.batch, C = cfg.width, H = cfg.heads, D = cfg.head_dim(),
                    F = cfg.hidden(), b = cfg.mini_batch;
  require_size(x_t, B * C, "x_t", "[B, C]");

  const std::size_t i = state.position % b;
  const double token_scale =
      std::max(1.0 / static_cast<double>(i + 1) + w.token_offset[i], 0.0);
  const std::vector<double> q = matmul(x_t, w.wq, B, C, C), k = matmul(x_t, w.wk, B, C, C),
                            v = matmul(x_t, w.wv, B, C, C);  // [B, C]
  std::vector<double> ttt_out(B * C);
  for (std::size_t bi = 0; bi < B; ++bi)
    for (std::size_t h = 0; h < H; ++h) {
      const std::size_t bh = bi * H + h;
      const double* gamma = w.ttt_norm_weight.data() + h * D;
      const double* beta = w.ttt_norm_bias.data() + h * D;
      std::vector<double> xq(D), xk(D), target(D);
      for (std::size_t d = 0; d < D; ++d) {
        xq[d] = q[bi * C + h * D + d];
        xk[d] = k[bi * C + h * D + d];
      }
      rope(xq.data(), D, i, cfg.rope_base);
      rope(xk.data(), D, i, cfg.rope_base);
      for (std::size_t d = 0; d < D; ++d) target[d] = v[bi * C + h * D + d] - xk[d];
      double logit = w.lr_bias[h];
      for (std::size_t cc = 0; cc < C; ++cc) logit += x_t[bi * C + cc] * w.lr_weight[h * C + cc];
      const double lr = cfg.base_lr * sigmoid(logit) / static_cast<double>(D);

      const inner_params<double> like = initial_inner(cfg, w, h);
      const inner_params<double> W0 =
          load_inner(like, bh, state.w1, state.b1, state.w2, state.b2);
      inner_params<double> G = load_inner(like, bh, state.gw1, state.gb1, state.gw2, state.gb2);
      const inner_params<double> g =
          inner_grad(cfg.kind, D, F, W0, xk.data(), target.data(), gamma, beta, cfg.ttt_norm_eps);
      subtract_scaled(G, -lr, g);  // G += lr·∇ℓ_t(W_0)
      inner_params<double> Wi = W0;
      subtract_scaled(Wi, token_scale, G);  // W_i = W_0 − token_scale[i]·G
      const inner_eval<double> e = inner_apply(cfg.kind, D, F, Wi, xq.data());
      const std::vector<double> y = layer_norm(e.out.data(), gamma, beta, D, cfg.ttt_norm_eps);
      for (std::size_t d = 0; d < D; ++d) ttt_out[bi * C + h * D + d] = xq[d] + y[d];
      if (i + 1 == b) {
        store_inner(Wi, bh, state.w1, state.b1, state.w2, state.b2);
        for (auto* t : {&G.w1, &G.b1, &G.w2, &G.b2}) std::fill(t->begin(), t->end(), 0.0);
      }
      store_inner(G, bh, state.gw1, state.gb1, state.gw2, state.gb2);
    }
  ++state.position;

  std::vector<double> gated(B * C);
  for (std::size_t bi = 0; bi < B; ++bi) {
    const std::vector<double> y = layer_norm(ttt_out.data() + bi * C, w.post_norm_weight.data(),
                                             w.post_norm_bias.data(), C, cfg.post_norm_eps);
    std::copy(y.begin(), y.end(), gated.begin() + static_cast<std::ptrdiff_t>(bi * C));
  }
  if (cfg.use_gate) {
    const std::vector<double> gate = matmul(x_t, w.wg, B, C, C);
    for (std::size_t e = 0; e < B * C; ++e) gated[e] *= gelu(gate[e]);
  }
  return matmul(gated, w.wo, B, C, C);
}

}  // namespace membound::reference
