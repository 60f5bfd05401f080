// Naive double-precision reference for one attention layer: the yardstick the tiled (flash-style)
// implementation is checked against. Test support, not library code.
//
// Written to be obviously right rather than fast, in the spirit of llm.c's reference path: plain
// loops over row-major std::vector<double>, every shape in a comment, the full T x T softmax
// materialized, the backward derived by hand step by step.
//
// The layer (what a user knows, so that weights exported from ours reproduce PyTorch's
// F.scaled_dot_product_attention in float64):
//   x  [B, T, C]                        C = d_model
//   q = x·Wq  [B, T, H·D]   Wq [C, H·D]     y = x·W convention: W is [in, out], row-major,
//   k = x·Wk  [B, T, Hkv·D] Wk [C, Hkv·D]   so W[c][j] = w[c * out + j]. (nn.Linear stores the
//   v = x·Wv  [B, T, Hkv·D] Wv [C, Hkv·D]   transpose: Linear.weight = Wᵀ.) No biases.
//   RoPE (rotate-half, LLaMA/GPT-NeoX) on every head of q and k, at position t + position_offset.
//   head h reads kv head h / (H / Hkv)  (GQA; MQA when Hkv = 1; MHA when Hkv = H)
//   S = q·kᵀ / sqrt(D)  [T, T] per (b, h), key j > query i masked when causal
//   lse = log Σ_j exp(S[i][j])  [B, H, T]  (natural log, over unmasked keys)
//   P = exp(S - lse)  (softmax over keys),  O = P·v  [T, D] per (b, h)
//   o = heads concatenated  [B, T, H·D],  y = o·Wo  [B, T, C]   Wo [H·D, C]
#pragma once

#include <cmath>
#include <cstddef>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "membound/core/error.hpp"

namespace membound::reference {

struct attention_config {
  std::size_t batch = 0;     // B
  std::size_t seq = 0;       // T (attention_step ignores it: the cache holds the positions)
  std::size_t d_model = 0;   // C
  std::size_t heads = 0;     // H, query heads
  std::size_t kv_heads = 0;  // Hkv, divides H
  std::size_t head_dim = 0;  // D, even (the layer itself will also require a multiple of 8, <= 256)
  bool causal = true;
  double rope_base = 10000.0;
  std::size_t window = 0;  // W > 0: only keys with |i − j| < W (and j ≤ i when causal)
};

struct attention_weights {
  std::vector<double> wq;  // [C, H·D]
  std::vector<double> wk;  // [C, Hkv·D]
  std::vector<double> wv;  // [C, Hkv·D]
  std::vector<double> wo;  // [H·D, C]
};

struct attention_forward_result {
  std::vector<double> y;    // [B, T, C]
  std::vector<double> lse;  // [B, H, T]    natural-log logsumexp of the scaled, masked scores
  std::vector<double> q;    // [B, H, T, D]   after RoPE
  std::vector<double> k;    // [B, Hkv, T, D] after RoPE
  std::vector<double> v;    // [B, Hkv, T, D]
  std::vector<double> p;    // [B, H, T, T]   softmax probabilities, exactly 0 where masked
  std::vector<double> o;    // [B, T, H·D]    attention output, heads concatenated, before Wo
  std::size_t position_offset = 0;  // RoPE position of token 0; backward rotates back with it
};

struct attention_grads {
  std::vector<double> dx;   // [B, T, C]
  std::vector<double> dwq;  // [C, H·D]
  std::vector<double> dwk;  // [C, Hkv·D]
  std::vector<double> dwv;  // [C, Hkv·D]
  std::vector<double> dwo;  // [H·D, C]
};

// Rotated keys and values of the positions already seen, for single-step (causal) inference.
struct attention_kv_cache {
  std::size_t max_len = 0;  // positions it can hold
  std::size_t length = 0;   // positions filled; the next attention_step is at position `length`
  std::vector<double> k;    // [B, Hkv, max_len, D] after RoPE
  std::vector<double> v;    // [B, Hkv, max_len, D]
};

namespace detail {

inline void require(bool ok, const char* argument, const std::string& expected,
                    const std::string& actual, const std::string& what_to_do) {
  if (!ok) throw membound::invalid_argument(argument, expected, actual, what_to_do);
}

inline void require_size(const std::vector<double>& v, std::size_t n, const char* argument,
                         const char* shape) {
  require(v.size() == n, argument, std::to_string(n) + " elements (" + shape + ")",
          std::to_string(v.size()), "Size the buffer from the attention_config it is used with");
}

inline void validate(const attention_config& c) {
  const std::string fix = "Fix the attention_config";
  require(c.batch > 0, "config.batch", "at least 1", std::to_string(c.batch), fix);
  require(c.seq > 0, "config.seq", "at least 1", std::to_string(c.seq), fix);
  require(c.d_model > 0, "config.d_model", "at least 1", std::to_string(c.d_model), fix);
  require(c.heads > 0, "config.heads", "at least 1", std::to_string(c.heads), fix);
  require(c.kv_heads > 0 && c.heads % c.kv_heads == 0, "config.kv_heads",
          "a divisor of config.heads (" + std::to_string(c.heads) + ")", std::to_string(c.kv_heads),
          "Every kv head must serve the same number of query heads");
  require(c.head_dim > 0 && c.head_dim % 2 == 0, "config.head_dim", "even and at least 2",
          std::to_string(c.head_dim), "RoPE rotates pairs (x[i], x[i + D/2])");
  require(std::isfinite(c.rope_base) && c.rope_base > 0.0, "config.rope_base",
          "finite and positive", std::to_string(c.rope_base), fix);
}

inline void validate(const attention_config& c, const attention_weights& w) {
  validate(c);
  const std::size_t C = c.d_model, HD = c.heads * c.head_dim, KD = c.kv_heads * c.head_dim;
  require_size(w.wq, C * HD, "weights.wq", "[C, H*D]");
  require_size(w.wk, C * KD, "weights.wk", "[C, Hkv*D]");
  require_size(w.wv, C * KD, "weights.wv", "[C, Hkv*D]");
  require_size(w.wo, HD * C, "weights.wo", "[H*D, C]");
}

// Whether query i sees key j: the causal mask and the sliding window, spelled out per pair.
inline bool visible(const attention_config& c, std::size_t i, std::size_t j) {
  if (c.causal && j > i) return false;
  const std::size_t distance = i > j ? i - j : j - i;
  return c.window == 0 || distance < c.window;
}

// out[n, m] = Σ_k a[n, k] · b[k, m]          a [N, K], b [K, M]
inline std::vector<double> matmul(const std::vector<double>& a, const std::vector<double>& b,
                                  std::size_t N, std::size_t K, std::size_t M) {
  std::vector<double> out(N * M, 0.0);
  for (std::size_t n = 0; n < N; ++n)
    for (std::size_t m = 0; m < M; ++m) {
      double s = 0.0;
      for (std::size_t k = 0; k < K; ++k) s += a[n * K + k] * b[k * M + m];
      out[n * M + m] = s;
    }
  return out;
}

// out[k, m] = Σ_n a[n, k] · b[n, m]   (aᵀ·b)  a [N, K], b [N, M]: a weight gradient
inline std::vector<double> matmul_at_b(const std::vector<double>& a, const std::vector<double>& b,
                                       std::size_t N, std::size_t K, std::size_t M) {
  std::vector<double> out(K * M, 0.0);
  for (std::size_t k = 0; k < K; ++k)
    for (std::size_t m = 0; m < M; ++m) {
      double s = 0.0;
      for (std::size_t n = 0; n < N; ++n) s += a[n * K + k] * b[n * M + m];
      out[k * M + m] = s;
    }
  return out;
}

// out[n, k] = Σ_m a[n, m] · b[k, m]   (a·bᵀ)  a [N, M], b [K, M]: an input gradient
inline std::vector<double> matmul_a_bt(const std::vector<double>& a, const std::vector<double>& b,
                                       std::size_t N, std::size_t M, std::size_t K) {
  std::vector<double> out(N * K, 0.0);
  for (std::size_t n = 0; n < N; ++n)
    for (std::size_t k = 0; k < K; ++k) {
      double s = 0.0;
      for (std::size_t m = 0; m < M; ++m) s += a[n * M + m] * b[k * M + m];
      out[n * K + k] = s;
    }
  return out;
}

}  // namespace detail

// RoPE, rotate-half form, on one head vector x[0, D), D even. For i in [0, D/2):
//   inv_freq_i = base^(-2i/D),  angle = position · inv_freq_i
//   (x1, x2) = (x[i], x[i + D/2])  ->  (x1·cos - x2·sin,  x2·cos + x1·sin)
// Each pair is rotated by +angle: an orthogonal map whose transpose (inverse = true) rotates by
// -angle. Backward uses the transpose.
inline void rope_rotate(std::span<double> x, std::size_t position, double base,
                        bool inverse = false) {
  detail::require(x.size() % 2 == 0, "x", "an even number of elements (head_dim)",
                  std::to_string(x.size()), "RoPE rotates pairs (x[i], x[i + D/2])");
  const std::size_t D = x.size(), half = D / 2;
  for (std::size_t i = 0; i < half; ++i) {
    const double inv_freq = std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(D));
    const double angle = static_cast<double>(position) * inv_freq * (inverse ? -1.0 : 1.0);
    const double c = std::cos(angle), s = std::sin(angle);
    const double x1 = x[i], x2 = x[i + half];
    x[i] = x1 * c - x2 * s;
    x[i + half] = x2 * c + x1 * s;
  }
}

// Causal masking is relative to the chunk (key j > query i), whatever position_offset is; the
// offset moves only the RoPE positions (token t sits at position t + position_offset).
inline attention_forward_result attention_forward(const attention_config& cfg,
                                                  const attention_weights& w,
                                                  const std::vector<double>& x,
                                                  std::size_t position_offset = 0) {
  detail::validate(cfg, w);
  const std::size_t B = cfg.batch, T = cfg.seq, C = cfg.d_model, H = cfg.heads,
                    Hkv = cfg.kv_heads, D = cfg.head_dim;
  const std::size_t HD = H * D, KD = Hkv * D, group = H / Hkv;
  detail::require_size(x, B * T * C, "x", "[B, T, C]");
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));

  // Projections, batch and time flattened to B·T rows.
  const std::vector<double> q_raw = detail::matmul(x, w.wq, B * T, C, HD);  // [B, T, H·D]
  const std::vector<double> k_raw = detail::matmul(x, w.wk, B * T, C, KD);  // [B, T, Hkv·D]
  const std::vector<double> v_raw = detail::matmul(x, w.wv, B * T, C, KD);  // [B, T, Hkv·D]

  attention_forward_result r;
  r.position_offset = position_offset;
  r.q.assign(B * H * T * D, 0.0);
  r.k.assign(B * Hkv * T * D, 0.0);
  r.v.assign(B * Hkv * T * D, 0.0);
  r.p.assign(B * H * T * T, 0.0);
  r.lse.assign(B * H * T, 0.0);
  r.o.assign(B * T * HD, 0.0);

  // Split heads ([B, T, H·D] -> [B, H, T, D]) and rotate q and k.
  for (std::size_t b = 0; b < B; ++b)
    for (std::size_t t = 0; t < T; ++t) {
      for (std::size_t h = 0; h < H; ++h) {
        double* q = &r.q[((b * H + h) * T + t) * D];
        for (std::size_t d = 0; d < D; ++d) q[d] = q_raw[(b * T + t) * HD + h * D + d];
        rope_rotate(std::span<double>(q, D), t + position_offset, cfg.rope_base);
      }
      for (std::size_t g = 0; g < Hkv; ++g) {
        double* k = &r.k[((b * Hkv + g) * T + t) * D];
        double* v = &r.v[((b * Hkv + g) * T + t) * D];
        for (std::size_t d = 0; d < D; ++d) {
          k[d] = k_raw[(b * T + t) * KD + g * D + d];
          v[d] = v_raw[(b * T + t) * KD + g * D + d];
        }
        rope_rotate(std::span<double>(k, D), t + position_offset, cfg.rope_base);
      }
    }

  // Per (b, h): S = q·kᵀ·scale [T, T], masked softmax, O = P·v [T, D].
  for (std::size_t b = 0; b < B; ++b)
    for (std::size_t h = 0; h < H; ++h) {
      const std::size_t g = h / group;  // kv head
      const double* q = &r.q[(b * H + h) * T * D];    // [T, D]
      const double* k = &r.k[(b * Hkv + g) * T * D];  // [T, D]
      const double* v = &r.v[(b * Hkv + g) * T * D];  // [T, D]
      double* P = &r.p[(b * H + h) * T * T];          // [T, T]
      for (std::size_t i = 0; i < T; ++i) {
        std::vector<double> s(T);  // masked keys are skipped and keep P = 0
        double m = -std::numeric_limits<double>::infinity();
        for (std::size_t j = 0; j < T; ++j) {
          if (!detail::visible(cfg, i, j)) continue;
          double dot = 0.0;
          for (std::size_t d = 0; d < D; ++d) dot += q[i * D + d] * k[j * D + d];
          s[j] = dot * scale;
          if (s[j] > m) m = s[j];
        }
        double sum = 0.0;
        for (std::size_t j = 0; j < T; ++j)
          if (detail::visible(cfg, i, j)) sum += std::exp(s[j] - m);
        const double lse = m + std::log(sum);
        r.lse[(b * H + h) * T + i] = lse;
        for (std::size_t j = 0; j < T; ++j)
          if (detail::visible(cfg, i, j)) P[i * T + j] = std::exp(s[j] - lse);
        for (std::size_t d = 0; d < D; ++d) {
          double acc = 0.0;
          for (std::size_t j = 0; j < T; ++j) acc += P[i * T + j] * v[j * D + d];
          r.o[(b * T + i) * HD + h * D + d] = acc;  // heads concatenated: [B, T, H·D]
        }
      }
    }

  r.y = detail::matmul(r.o, w.wo, B * T, HD, C);  // [B, T, C]
  return r;
}

// Gradients of L with respect to x and the four weights, given dy = dL/dy [B, T, C] and the
// forward's saved tensors.
inline attention_grads attention_backward(const attention_config& cfg, const attention_weights& w,
                                          const std::vector<double>& x,
                                          const attention_forward_result& fwd,
                                          const std::vector<double>& dy) {
  detail::validate(cfg, w);
  const std::size_t B = cfg.batch, T = cfg.seq, C = cfg.d_model, H = cfg.heads,
                    Hkv = cfg.kv_heads, D = cfg.head_dim;
  const std::size_t HD = H * D, KD = Hkv * D, group = H / Hkv;
  detail::require_size(x, B * T * C, "x", "[B, T, C]");
  detail::require_size(dy, B * T * C, "dy", "[B, T, C]");
  detail::require_size(fwd.q, B * H * T * D, "forward.q", "[B, H, T, D]");
  detail::require_size(fwd.k, B * Hkv * T * D, "forward.k", "[B, Hkv, T, D]");
  detail::require_size(fwd.v, B * Hkv * T * D, "forward.v", "[B, Hkv, T, D]");
  detail::require_size(fwd.p, B * H * T * T, "forward.p", "[B, H, T, T]");
  detail::require_size(fwd.o, B * T * HD, "forward.o", "[B, T, H*D]");
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));

  attention_grads g;
  // y = o·Wo:  dWo = oᵀ·dy [H·D, C],  do = dy·Woᵀ [B, T, H·D]
  g.dwo = detail::matmul_at_b(fwd.o, dy, B * T, HD, C);
  const std::vector<double> d_o = detail::matmul_a_bt(dy, w.wo, B * T, C, HD);

  std::vector<double> dq(B * H * T * D, 0.0);    // [B, H, T, D]   wrt rotated q
  std::vector<double> dk(B * Hkv * T * D, 0.0);  // [B, Hkv, T, D] wrt rotated k
  std::vector<double> dv(B * Hkv * T * D, 0.0);  // [B, Hkv, T, D]
  for (std::size_t b = 0; b < B; ++b)
    for (std::size_t h = 0; h < H; ++h) {
      const std::size_t kvh = h / group;
      const double* q = &fwd.q[(b * H + h) * T * D];      // [T, D]
      const double* k = &fwd.k[(b * Hkv + kvh) * T * D];  // [T, D]
      const double* v = &fwd.v[(b * Hkv + kvh) * T * D];  // [T, D]
      const double* P = &fwd.p[(b * H + h) * T * T];      // [T, T]
      double* dqh = &dq[(b * H + h) * T * D];
      double* dkh = &dk[(b * Hkv + kvh) * T * D];  // query heads sharing a kv head accumulate
      double* dvh = &dv[(b * Hkv + kvh) * T * D];
      for (std::size_t i = 0; i < T; ++i) {
        const std::size_t keys = T;  // masked keys have P = 0 and so dS = 0
        const double* doi = &d_o[(b * T + i) * HD + h * D];  // dO[i, :]  [D]
        // O = P·v:  dP[i][j] = dO[i]·v[j],  dv[j] += P[i][j]·dO[i]
        std::vector<double> dP(keys);
        for (std::size_t j = 0; j < keys; ++j) {
          double dot = 0.0;
          for (std::size_t d = 0; d < D; ++d) {
            dot += doi[d] * v[j * D + d];
            dvh[j * D + d] += P[i * T + j] * doi[d];
          }
          dP[j] = dot;
        }
        // Softmax over keys:  dS[i][j] = P[i][j] · (dP[i][j] - Σ_j' P[i][j']·dP[i][j'])
        double row = 0.0;
        for (std::size_t j = 0; j < keys; ++j) row += P[i * T + j] * dP[j];
        // S = scale·q·kᵀ:  dq[i] += scale·dS[i][j]·k[j],  dk[j] += scale·dS[i][j]·q[i]
        for (std::size_t j = 0; j < keys; ++j) {
          const double dS = P[i * T + j] * (dP[j] - row);
          for (std::size_t d = 0; d < D; ++d) {
            dqh[i * D + d] += scale * dS * k[j * D + d];
            dkh[j * D + d] += scale * dS * q[i * D + d];
          }
        }
      }
    }

  // Undo RoPE (its transpose: rotate by -angle) and merge heads back:
  //   dq [B, H, T, D] -> dq_raw [B, T, H·D];  dk, dv [B, Hkv, T, D] -> [B, T, Hkv·D]
  std::vector<double> dq_raw(B * T * HD, 0.0), dk_raw(B * T * KD, 0.0), dv_raw(B * T * KD, 0.0);
  for (std::size_t b = 0; b < B; ++b)
    for (std::size_t t = 0; t < T; ++t) {
      const std::size_t pos = t + fwd.position_offset;
      for (std::size_t h = 0; h < H; ++h) {
        double* src = &dq[((b * H + h) * T + t) * D];
        rope_rotate(std::span<double>(src, D), pos, cfg.rope_base, /*inverse=*/true);
        for (std::size_t d = 0; d < D; ++d) dq_raw[(b * T + t) * HD + h * D + d] = src[d];
      }
      for (std::size_t kvh = 0; kvh < Hkv; ++kvh) {
        double* src_k = &dk[((b * Hkv + kvh) * T + t) * D];
        rope_rotate(std::span<double>(src_k, D), pos, cfg.rope_base, /*inverse=*/true);
        const double* src_v = &dv[((b * Hkv + kvh) * T + t) * D];
        for (std::size_t d = 0; d < D; ++d) {
          dk_raw[(b * T + t) * KD + kvh * D + d] = src_k[d];
          dv_raw[(b * T + t) * KD + kvh * D + d] = src_v[d];
        }
      }
    }

  // q = x·Wq etc.:  dW = xᵀ·d(raw) [C, out],  dx = Σ d(raw)·Wᵀ [B, T, C]
  g.dwq = detail::matmul_at_b(x, dq_raw, B * T, C, HD);
  g.dwk = detail::matmul_at_b(x, dk_raw, B * T, C, KD);
  g.dwv = detail::matmul_at_b(x, dv_raw, B * T, C, KD);
  g.dx = detail::matmul_a_bt(dq_raw, w.wq, B * T, HD, C);
  const std::vector<double> dx_k = detail::matmul_a_bt(dk_raw, w.wk, B * T, KD, C);
  const std::vector<double> dx_v = detail::matmul_a_bt(dv_raw, w.wv, B * T, KD, C);
  for (std::size_t n = 0; n < B * T * C; ++n) g.dx[n] += dx_k[n] + dx_v[n];
  return g;
}

// An empty cache for `max_len` positions of cfg.batch sequences.
inline attention_kv_cache make_attention_kv_cache(const attention_config& cfg,
                                                  std::size_t max_len) {
  detail::validate(cfg);
  detail::require(max_len > 0, "max_len", "at least 1", std::to_string(max_len),
                  "A cache holds at least the position being generated");
  attention_kv_cache c;
  c.max_len = max_len;
  c.k.assign(cfg.batch * cfg.kv_heads * max_len * cfg.head_dim, 0.0);
  c.v.assign(c.k.size(), 0.0);
  return c;
}

// One causal decoding step at position t = cache.length: x_t [B, C] -> y_t [B, C]. Appends the
// rotated k and the v of position t to the cache, then attends over positions 0..t. Checks
// everything before touching the cache.
inline std::vector<double> attention_step(const attention_config& cfg, const attention_weights& w,
                                          attention_kv_cache& cache,
                                          const std::vector<double>& x_t) {
  detail::validate(cfg, w);
  detail::require(cfg.causal, "config.causal", "true", "false",
                  "Single-step decoding reproduces only causal attention: a non-causal layer "
                  "needs every key before any output");
  const std::size_t B = cfg.batch, C = cfg.d_model, H = cfg.heads, Hkv = cfg.kv_heads,
                    D = cfg.head_dim;
  const std::size_t HD = H * D, KD = Hkv * D, group = H / Hkv, L = cache.max_len;
  detail::require_size(x_t, B * C, "x_t", "[B, C]");
  detail::require_size(cache.k, B * Hkv * L * D, "cache.k", "[B, Hkv, max_len, D]");
  detail::require_size(cache.v, B * Hkv * L * D, "cache.v", "[B, Hkv, max_len, D]");
  detail::require(cache.length < L, "cache", "room for one more position (max_len " +
                  std::to_string(L) + ")", "length " + std::to_string(cache.length),
                  "Make the cache with a larger max_len");
  const std::size_t t = cache.length;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));

  const std::vector<double> q_raw = detail::matmul(x_t, w.wq, B, C, HD);  // [B, H·D]
  const std::vector<double> k_raw = detail::matmul(x_t, w.wk, B, C, KD);  // [B, Hkv·D]
  const std::vector<double> v_raw = detail::matmul(x_t, w.wv, B, C, KD);  // [B, Hkv·D]

  // Append position t: cache[b, g, t, :]
  for (std::size_t b = 0; b < B; ++b)
    for (std::size_t g = 0; g < Hkv; ++g) {
      double* k = &cache.k[((b * Hkv + g) * L + t) * D];
      double* v = &cache.v[((b * Hkv + g) * L + t) * D];
      for (std::size_t d = 0; d < D; ++d) {
        k[d] = k_raw[b * KD + g * D + d];
        v[d] = v_raw[b * KD + g * D + d];
      }
      rope_rotate(std::span<double>(k, D), t, cfg.rope_base);
    }
  cache.length = t + 1;

  std::vector<double> o(B * HD, 0.0);  // [B, H·D]
  for (std::size_t b = 0; b < B; ++b)
    for (std::size_t h = 0; h < H; ++h) {
      std::vector<double> q(q_raw.begin() + static_cast<std::ptrdiff_t>(b * HD + h * D),
                            q_raw.begin() + static_cast<std::ptrdiff_t>(b * HD + h * D + D));
      rope_rotate(q, t, cfg.rope_base);
      const std::size_t g = h / group;
      const double* k = &cache.k[(b * Hkv + g) * L * D];  // [L, D], rows 0..t filled
      const double* v = &cache.v[(b * Hkv + g) * L * D];
      std::vector<double> s(t + 1);  // scores over keys 0..t
      double m = -std::numeric_limits<double>::infinity();
      for (std::size_t j = 0; j <= t; ++j) {
        double dot = 0.0;
        for (std::size_t d = 0; d < D; ++d) dot += q[d] * k[j * D + d];
        s[j] = dot * scale;
        if (s[j] > m) m = s[j];
      }
      double sum = 0.0;
      for (std::size_t j = 0; j <= t; ++j) sum += std::exp(s[j] - m);
      const double lse = m + std::log(sum);
      for (std::size_t j = 0; j <= t; ++j) {
        const double p = std::exp(s[j] - lse);
        for (std::size_t d = 0; d < D; ++d) o[b * HD + h * D + d] += p * v[j * D + d];
      }
    }
  return detail::matmul(o, w.wo, B, HD, C);  // [B, C]
}

}  // namespace membound::reference
