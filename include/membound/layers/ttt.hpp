// The TTT-Linear layer (Sun et al. 2024; the TTTLinear module of test-time-training/
// ttt-lm-pytorch without the shared-QK convolution), trained inside a memory budget. Per head h
// (D = width / heads) and mini-batch of b tokens (the chunking policy ttt_mini_batch<b>):
//   XQ, XK, XV = x·Wq, x·Wk, x·Wv; RoPE on interleaved pairs of XQ, XK at position t mod b
//   inner model f(k) = k·W + w (W [D, D], w [D], starting from the learned W1, b1)
//   inner loss ½‖LN_h(f(XK_t)) − (XV_t − XK_t)‖², all gradients of a mini-batch taken at its
//   starting (W, w); token i uses W_i = W − Σ_{s≤i} η[i, s]·∇ℓ_s with
//   η[i, s] = max(0, 1/(i+1) + tok_offset[i]) · base_lr · σ(x_s·lr_w[h] + lr_b[h]) / D
//   out_t = XQ_t + LN_h(f(XQ_t; W_t)); heads concatenated; post LayerNorm over the width;
//   optional gate GELU_tanh(x·Wg) ⊙; then ·Wo.
// Forward runs the dual form (no per-token W ever exists) and keeps, per (batch, head), the inner
// state at the start of every G-th mini-batch (the checkpoint policy ttt_checkpoint_groups<G>;
// ttt_checkpoint_all keeps only the first) plus the heads' output before the post norm. Backward
// recomputes q, k, v from x and each group's states from its checkpoint, then runs the
// hand-derived reverse of the inner loop. All weights are [in, out], row-major (y = x·W).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <string>
#include <type_traits>

#include "membound/backend/cpu/linalg.hpp"
#include "membound/backend/cpu/ttt_cpu.hpp"
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/core/error.hpp"
#include "membound/core/parallel.hpp"
#include "membound/core/type_list.hpp"
#include "membound/layers/layer_support.hpp"
#include "membound/memory/workspace.hpp"
#include "membound/policy/checkpoint.hpp"
#include "membound/policy/chunking.hpp"
#include "membound/policy/policy_set.hpp"
#include "membound/policy/precision.hpp"

MEMBOUND_NAMESPACE_BEGIN

struct ttt_shape {
  std::size_t batch = 1;  // B
  std::size_t seq = 1;    // T (step ignores it)
  std::size_t width = 0;  // C
  std::size_t heads = 0;  // H, divides C; D = C / H
  bool use_gate = false;
  double base_lr = 1.0;
  double rope_base = 10000.0;
  constexpr std::size_t head_dim() const noexcept { return heads == 0 ? 0 : width / heads; }
};

template <typename... Policies>
class ttt_linear {
 public:
  using policies = policy_set<type_list<fp32_precision, ttt_mini_batch<16>, ttt_checkpoint_groups<4>>,
                              Policies...>;
  using precision = get_policy<policies, precision_kind>;
  using chunking = get_policy<policies, chunking_kind>;
  using checkpoint = get_policy<policies, checkpoint_kind>;
  static_assert(is_ttt_mini_batch_v<chunking>,
                "membound: ttt_linear takes ttt_mini_batch<b> as its chunking policy "
                "(attention_tiles and scan_chunk belong to attention and Mamba).");
  static_assert(is_ttt_checkpoint_groups_v<checkpoint>,
                "membound: ttt_linear takes ttt_checkpoint_groups<G> (or ttt_checkpoint_all) as its "
                "checkpoint policy.");
  using storage_type = typename precision::storage_type;
  using accum_type = typename precision::accum_type;
  static_assert(std::is_same_v<accum_type, float> || std::is_same_v<accum_type, double>,
                "membound: ttt_linear accumulates its inner W in float or double.");
  static constexpr std::size_t mini_batch = chunking::mini_batch;
  static constexpr std::size_t group = checkpoint::group_size;

 private:
  using S = storage_type;
  using A = accum_type;
  static constexpr bool widened = !std::is_same_v<S, A>;
  static constexpr std::size_t mb = mini_batch;
  static constexpr A ln_eps = A(1e-6);

 public:
  // ---- Checks --------------------------------------------------------------------------------
  static constexpr layer_support can_implement(const ttt_shape& s) noexcept {
    auto no = [](const char* arg, const char* expected, double actual) {
      return layer_support{false, arg, expected, actual};
    };
    const auto d = [](std::size_t v) { return static_cast<double>(v); };
    if (s.batch == 0) return no("shape.batch", "at least 1", 0.0);
    if (s.seq == 0) return no("shape.seq", "at least 1", 0.0);
    if (s.heads == 0) return no("shape.heads", "at least 1", 0.0);
    if (s.width == 0 || s.width % s.heads != 0 || (s.width / s.heads) % 2 != 0) {
      return no("shape.width", "a positive multiple of shape.heads with an even head_dim",
                d(s.width));
    }
    if (!(s.base_lr >= 0.0) || !(s.base_lr < std::numeric_limits<double>::infinity())) {
      return no("shape.base_lr", "finite and at least 0", s.base_lr);
    }
    if (!(s.rope_base > 0.0) || !(s.rope_base < std::numeric_limits<double>::infinity())) {
      return no("shape.rope_base", "a finite value above 0", s.rope_base);
    }
    return {};
  }
  static void check(const ttt_shape& s) {
    const layer_support r = can_implement(s);
    if (!r.ok) {
      const std::string a = r.argument;
      detail::throw_unsupported(r, a == "shape.base_lr" || a == "shape.rope_base",
                                "Fix the ttt_shape before sizing or running the layer");
    }
  }

  // ---- Memory known before running ------------------------------------------------------------
  static constexpr std::size_t mini_batches(const ttt_shape& s) noexcept {
    return cpu::blocks(s.seq, mb);
  }
  // Checkpoints per (batch, head): ceil(mini-batches / G).
  static constexpr std::size_t checkpoints(const ttt_shape& s) noexcept {
    return cpu::blocks(mini_batches(s), group);
  }
  static constexpr std::size_t saved_bytes(const ttt_shape& s) noexcept {
    const std::size_t b[] = {ckpt_bytes(s), bytes_of<S>(rows(s), s.width)};
    return detail::fits_layout(b) ? saved_layout(s).size() : std::numeric_limits<std::size_t>::max();
  }
  // Of saved_bytes, the inner-state checkpoints: B·H·ceil(ceil(T/b)/G)·(D² + D) accumulators.
  static constexpr std::size_t saved_state_bytes(const ttt_shape& s) noexcept { return ckpt_bytes(s); }
  static constexpr std::size_t forward_workspace_bytes(const ttt_shape& s,
                                                       std::size_t threads) noexcept {
    const std::size_t b[] = {w_acc_bytes(s), wide(s), task_scratch(s, threads, false)};
    return detail::fits_layout(b) ? forward_layout(s, threads).size()
                                  : std::numeric_limits<std::size_t>::max();
  }
  static constexpr std::size_t backward_workspace_bytes(const ttt_shape& s,
                                                        std::size_t threads) noexcept {
    const std::size_t b[] = {w_acc_bytes(s), wide(s), partial_bytes(s),
                             task_scratch(s, threads, true)};
    return detail::fits_layout(b) ? backward_layout(s, threads).size()
                                  : std::numeric_limits<std::size_t>::max();
  }
  // Decoding state per (batch, head): the mini-batch's starting W, w and the running
  // Σ lr_s·XK_sᵀ·G_s, Σ lr_s·G_s of its tokens so far, in the accumulator type.
  static constexpr std::size_t state_bytes(const ttt_shape& s) noexcept {
    const std::size_t D = s.head_dim();
    return bytes_of<A>(s.batch, s.heads, 2 * (D * D + D));
  }
  static constexpr std::size_t step_workspace_bytes(const ttt_shape& s) noexcept {
    ttt_shape one = s;
    one.seq = 1;
    const std::size_t b[] = {w_acc_bytes(one), wide(one)};
    return detail::fits_layout(b) ? forward_layout(one, 1, true).size()
                                  : std::numeric_limits<std::size_t>::max();
  }

  struct weights {
    const S* wq;         // [C, C]
    const S* wk;         // [C, C]
    const S* wv;         // [C, C]
    const S* ttt_norm_w; // [H, D]   the inner LayerNorm's scale
    const S* ttt_norm_b; // [H, D]   and shift
    const S* w1;         // [H, D, D] the inner W at the start of the sequence
    const S* b1;         // [H, D]
    const S* lr_w;       // [H, C]   learning-rate gate
    const S* lr_b;       // [H]
    const S* tok_offset; // [b]      learnable offset of the token scales 1/(i+1)
    const S* post_w;     // [C]      post LayerNorm
    const S* post_b;     // [C]
    const S* wg;         // [C, C]   the gate (read only when shape.use_gate)
    const S* wo;         // [C, C]
  };
  struct gradients {  // accumulated (+=); gradients.wg is touched only when shape.use_gate
    S *wq, *wk, *wv, *ttt_norm_w, *ttt_norm_b, *w1, *b1, *lr_w, *lr_b, *tok_offset, *post_w,
        *post_b, *wg, *wo;
  };
  static constexpr std::size_t weight_elements(const ttt_shape& s) noexcept {
    const std::size_t C = s.width, H = s.heads, D = s.head_dim();
    return 5 * C * C + 2 * H * D + H * D * D + H * D + H * C + H + mb + 2 * C;
  }

  struct state {
    void* data = nullptr;
    std::size_t bytes = 0;
    std::size_t position = 0;  // tokens consumed since reset
  };
  // The state starts from the layer's W1, b1 (so it needs the weights).
  static state make_state(const ttt_shape& s, const weights& w, void* data, std::size_t bytes) {
    check(s);
    if (data == nullptr || bytes < state_bytes(s)) {
      throw workspace_too_small("state", state_bytes(s), data == nullptr ? 0 : bytes);
    }
    detail::check_aligned(data, alignof(A), "state");
    detail::not_null(w.w1, "weights.w1");
    detail::not_null(w.b1, "weights.b1");
    state st{data, bytes, 0};
    reset(s, w, st);
    return st;
  }
  static void reset(const ttt_shape& s, const weights& w, state& st) {
    const std::size_t D = s.head_dim(), per = 2 * (D * D + D);
    A* p = static_cast<A*>(st.data);
    for (std::size_t b = 0; b < s.batch; ++b)
      for (std::size_t h = 0; h < s.heads; ++h) {
        A* q = p + (b * s.heads + h) * per;
        cpu::widen(w.w1 + h * D * D, D * D, q);
        cpu::widen(w.b1 + h * D, D, q + D * D);
        std::fill(q + D * D + D, q + per, A(0));
      }
    st.position = 0;
  }

  // ---- Forward -------------------------------------------------------------------------------
  static void forward(const ttt_shape& s, const weights& w, const S* x, S* y, void* saved,
                      std::size_t saved_size, void* workspace, std::size_t workspace_size,
                      thread_pool& pool) {
    check(s);
    check_weights(s, w);
    detail::not_null(x, "x");
    detail::not_null(y, "y");
    const std::size_t threads = pool.size();
    const auto sv = detail::carve_named(saved_layout(s), saved_bytes(s), saved, saved_size, "saved");
    const auto ws = detail::carve_named(forward_layout(s, threads),
                                        forward_workspace_bytes(s, threads), workspace,
                                        workspace_size, "workspace");
    const std::size_t N = rows(s), C = s.width;
    const wptrs wa = widen_weights(s, w, ws.template get<A>(f_w));
    const A* xa = widen_or_alias(x, N * C, ws.template get<A>(f_x));
    A* q = ws.template get<A>(f_q);
    A* k = ws.template get<A>(f_k);
    A* v = ws.template get<A>(f_v);
    A* lr = ws.template get<A>(f_lr);
    A* sig = ws.template get<A>(f_sig);
    A* tok = ws.template get<A>(f_tok);
    project(s, xa, wa, q, k, v, lr, sig, tok, pool);

    // The inner loop, one task per (b, h); its output rounded through storage into `saved`.
    S* o_s = sv.template get<S>(s_o);
    A* o = accum_target(o_s, ws.template get<A>(f_o));
    inner_forward(s, q, k, v, lr, tok, wa, o, sv.template get<A>(s_ckpt),
                  ws.template get<A>(f_scratch), pool);
    if constexpr (widened) {
      cpu::narrow(static_cast<const A*>(o), N * C, o_s);
      cpu::widen(static_cast<const S*>(o_s), N * C, o);
    }
    // Post norm, gate, output projection (pn reuses q's slot).
    A* pn = q;
    post_norm(s, o, wa, pn, nullptr, nullptr, pool);
    if (s.use_gate) {
      A* gpre = k;
      cpu::matmul(pool, xa, wa.wg, gpre, N, C, C, false);
      cpu::for_rows(pool, N, [&](std::size_t n) {
        for (std::size_t j = 0; j < C; ++j) pn[n * C + j] *= gelu(gpre[n * C + j]);
      });
    }
    A* ya = accum_target(y, ws.template get<A>(f_y));
    cpu::matmul(pool, static_cast<const A*>(pn), wa.wo, ya, N, C, C, false);
    if constexpr (widened) cpu::narrow(static_cast<const A*>(ya), N * C, y);
  }

  // ---- Backward ------------------------------------------------------------------------------
  static void backward(const ttt_shape& s, const weights& w, const S* x, const void* saved,
                       std::size_t saved_size, const S* dy, S* dx, const gradients& g,
                       void* workspace, std::size_t workspace_size, thread_pool& pool) {
    check(s);
    check_weights(s, w);
    detail::not_null(x, "x");
    detail::not_null(dy, "dy");
    detail::not_null(dx, "dx");
    check_gradients(s, g);
    const std::size_t threads = pool.size();
    const auto sv = detail::carve_named(saved_layout(s), saved_bytes(s), const_cast<void*>(saved),
                                        saved_size, "saved");
    const auto ws = detail::carve_named(backward_layout(s, threads),
                                        backward_workspace_bytes(s, threads), workspace,
                                        workspace_size, "workspace");
    const std::size_t N = rows(s), C = s.width, H = s.heads, D = s.head_dim(), B = s.batch;
    const wptrs wa = widen_weights(s, w, ws.template get<A>(b_w));
    const A* xa = widen_or_alias(x, N * C, ws.template get<A>(b_x));
    A* q = ws.template get<A>(b_q);
    A* k = ws.template get<A>(b_k);
    A* v = ws.template get<A>(b_v);
    A* lr = ws.template get<A>(b_lr);
    A* sig = ws.template get<A>(b_sig);
    A* tok = ws.template get<A>(b_tok);
    project(s, xa, wa, q, k, v, lr, sig, tok, pool);
    const A* o = widen_or_alias(static_cast<const S*>(sv.template get<S>(s_o)), N * C,
                                ws.template get<A>(b_o));
    const A* dya = widen_or_alias(dy, N * C, ws.template get<A>(b_dy));
    A* tmp = ws.template get<A>(b_wtmp);
    A* dxa = ws.template get<A>(b_dx);

    // Output projection, gate and post norm, backwards. pn: the post norm's output; xh: its x̂.
    A* pn = ws.template get<A>(b_pn);
    A* xh = ws.template get<A>(b_xh);
    A* rsig = ws.template get<A>(b_rsig);
    post_norm(s, o, wa, pn, xh, rsig, pool);
    A* dpn = ws.template get<A>(b_dpn);
    cpu::matmul_bt(pool, dya, wa.wo, dpn, N, C, C, false);  // dL/d(gated)
    if (s.use_gate) {
      A* gpre = ws.template get<A>(b_gpre);
      cpu::matmul(pool, xa, wa.wg, gpre, N, C, C, false);
      // gated = pn ⊙ gelu(gpre): dgpre = dgated ⊙ pn ⊙ gelu'(gpre), then dpn = dgated ⊙ gelu.
      cpu::for_rows(pool, N, [&](std::size_t n) {
        for (std::size_t j = 0; j < C; ++j) {
          const std::size_t e = n * C + j;
          const A gl = gelu(gpre[e]), dgated = dpn[e];
          dpn[e] = dgated * gl;
          gpre[e] = dgated * pn[e] * gelu_grad(gpre[e]);  // now dgpre
          pn[e] *= gl;                                     // now the gated value
        }
      });
      weight_grad(pool, static_cast<const A*>(pn), dya, g.wo, tmp, N, C, C);
      weight_grad(pool, xa, static_cast<const A*>(gpre), g.wg, tmp, N, C, C);
      cpu::matmul_bt(pool, static_cast<const A*>(gpre), wa.wg, dxa, N, C, C, false);
    } else {
      weight_grad(pool, static_cast<const A*>(pn), dya, g.wo, tmp, N, C, C);
      std::fill(dxa, dxa + N * C, A(0));
    }
    // Post norm: pn = x̂ ⊙ post_w + post_b. d(post_w) = Σ dpn ⊙ x̂, d(post_b) = Σ dpn.
    A* small = ws.template get<A>(b_small);
    column_sums_product(pool, static_cast<const A*>(dpn), static_cast<const A*>(xh), N, C, small,
                        small + C);
    add_grad(small, C, g.post_w);
    add_grad(small + C, C, g.post_b);
    A* d_o = ws.template get<A>(b_do);
    cpu::for_rows(pool, N, [&](std::size_t n) {
      A* dxh = d_o + n * C;  // dL/dx̂, then dL/do in place
      for (std::size_t j = 0; j < C; ++j) dxh[j] = dpn[n * C + j] * wa.post_w[j];
      A tmp_row_m1 = 0, tmp_row_m2 = 0;
      for (std::size_t j = 0; j < C; ++j) {
        tmp_row_m1 += dxh[j];
        tmp_row_m2 += dxh[j] * xh[n * C + j];
      }
      tmp_row_m1 /= static_cast<A>(C);
      tmp_row_m2 /= static_cast<A>(C);
      for (std::size_t j = 0; j < C; ++j)
        dxh[j] = (dxh[j] - tmp_row_m1 - xh[n * C + j] * tmp_row_m2) / rsig[n];
    });

    // The inner loop backwards: dq, dk, dv, dlr and per-(b, h) partial parameter gradients.
    A* dq = ws.template get<A>(b_dq);
    A* dk = ws.template get<A>(b_dk);
    A* dv = ws.template get<A>(b_dv);
    A* dlr = ws.template get<A>(b_dlr);
    A* part = ws.template get<A>(b_part);
    inner_backward(s, q, k, v, lr, tok, wa, sv.template get<A>(s_ckpt), d_o, dq, dk, dv, dlr,
                   part, ws.template get<A>(b_scratch), pool);

    // Partials summed over the batch in order: W1, b1, γ, β per head, then the token offsets.
    const std::size_t per = part_elements(s);
    A* sum = small;  // [per]
    for (std::size_t j = 0; j < per; ++j) {
      A acc = 0;
      for (std::size_t b = 0; b < B; ++b) acc += part[b * per + j];
      sum[j] = acc;
    }
    add_grad(sum, H * D * D, g.w1);
    add_grad(sum + H * D * D, H * D, g.b1);
    add_grad(sum + H * D * D + H * D, H * D, g.ttt_norm_w);
    add_grad(sum + H * D * D + 2 * H * D, H * D, g.ttt_norm_b);
    A* dtok = sum + H * D * D + 3 * H * D;  // [H, mb]: summed over heads, masked by the clamp
    for (std::size_t i = 0; i < mb; ++i) {
      A acc = 0;
      for (std::size_t h = 0; h < H; ++h) acc += dtok[h * mb + i];
      const A raw = A(1) / static_cast<A>(i + 1) + wa.tok_offset[i];
      dtok[i] = raw > A(0) ? acc : A(0);  // clamp_min(·, 0): no gradient where clamped
    }
    add_grad(dtok, mb, g.tok_offset);

    // The learning-rate gate: lr = base·σ(pre)/D, so dpre = dlr · lr · (1 − σ).
    cpu::for_rows(pool, N, [&](std::size_t n) {
      for (std::size_t h = 0; h < H; ++h) dlr[n * H + h] *= lr[n * H + h] * (A(1) - sig[n * H + h]);
    });
    if constexpr (widened) {
      cpu::matmul_at(pool, static_cast<const A*>(dlr), xa, tmp, N, H, C, false);
      cpu::narrow_add(static_cast<const A*>(tmp), H * C, g.lr_w);
    } else {
      cpu::matmul_at(pool, static_cast<const A*>(dlr), xa, g.lr_w, N, H, C, true);
    }
    column_sums_product(pool, static_cast<const A*>(dlr), static_cast<const A*>(nullptr), N, H,
                        sum, nullptr);
    add_grad(sum, H, g.lr_b);
    cpu::matmul(pool, static_cast<const A*>(dlr), wa.lr_w, dxa, N, H, C, true);

    // RoPE's transpose, then the projections.
    cpu::rope_pairs(pool, dq, N, s.seq, H, D, s.rope_base, mb, true);
    cpu::rope_pairs(pool, dk, N, s.seq, H, D, s.rope_base, mb, true);
    weight_grad(pool, xa, static_cast<const A*>(dq), g.wq, tmp, N, C, C);
    weight_grad(pool, xa, static_cast<const A*>(dk), g.wk, tmp, N, C, C);
    weight_grad(pool, xa, static_cast<const A*>(dv), g.wv, tmp, N, C, C);
    cpu::matmul_bt(pool, static_cast<const A*>(dq), wa.wq, dxa, N, C, C, true);
    cpu::matmul_bt(pool, static_cast<const A*>(dk), wa.wk, dxa, N, C, C, true);
    cpu::matmul_bt(pool, static_cast<const A*>(dv), wa.wv, dxa, N, C, C, true);
    cpu::narrow(static_cast<const A*>(dxa), N * C, dx);
  }

  // ---- Decoding ------------------------------------------------------------------------------
  // One token per sequence: x_t [B, C] -> y_t [B, C] at position state.position. Token i of a
  // mini-batch uses W − tok_i·Σ_{s≤i} lr_s·XK_sᵀ·G_s (the dual form's row i); the mini-batch's
  // last token folds the sums into W. Checks everything before touching the state or y_t.
  static void step(const ttt_shape& s, const weights& w, state& st, const S* x_t, S* y_t,
                   void* workspace, std::size_t workspace_size, thread_pool& pool) {
    check(s);
    check_weights(s, w);
    detail::not_null(x_t, "x_t");
    detail::not_null(y_t, "y_t");
    if (st.data == nullptr || st.bytes < state_bytes(s)) {
      throw workspace_too_small("state", state_bytes(s), st.data == nullptr ? 0 : st.bytes);
    }
    detail::check_aligned(st.data, alignof(A), "state");
    ttt_shape one = s;
    one.seq = 1;
    const auto ws = detail::carve_named(forward_layout(one, 1, true), step_workspace_bytes(s), workspace,
                                        workspace_size, "workspace");
    const std::size_t B = s.batch, C = s.width, H = s.heads, D = s.head_dim();
    const std::size_t i = st.position % mb;
    const wptrs wa = widen_weights(s, w, ws.template get<A>(f_w));
    const A* xa = widen_or_alias(x_t, B * C, ws.template get<A>(f_x));
    A* q = ws.template get<A>(f_q);
    A* k = ws.template get<A>(f_k);
    A* v = ws.template get<A>(f_v);
    A* lr = ws.template get<A>(f_lr);
    A* sig = ws.template get<A>(f_sig);
    A* tok = ws.template get<A>(f_tok);
    project(one, xa, wa, q, k, v, lr, sig, tok, pool, i);
    A* o = ws.template get<A>(f_o);
    A* scratch = ws.template get<A>(f_scratch);  // [2·D + 2·D + D] per token and head
    const std::size_t per = 2 * (D * D + D);
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t h = 0; h < H; ++h) {
        A* W = static_cast<A*>(st.data) + (b * H + h) * per;
        A* wb = W + D * D;
        A* Wg = wb + D;
        A* wg = Wg + D * D;
        const A* qr = q + b * C + h * D;
        const A* kr = k + b * C + h * D;
        const A* vr = v + b * C + h * D;
        const A lr_t = lr[b * H + h];
        // G_t at the mini-batch's starting W (the inner gradient of this token).
        A* z1 = scratch;
        A* xh = z1 + D;
        A* gt = xh + D;
        A sigma;
        const cpu::ttt_minibatch<A> m{qr, kr, vr, 1, D, C, &lr_t, tok, wa.ttt_norm_w + h * D,
                                      wa.ttt_norm_b + h * D, ln_eps};
        cpu::ttt_inner_grad(m, W, wb, z1, xh, &sigma, gt);
        // Sums of this mini-batch so far, this token included.
        for (std::size_t a = 0; a < D; ++a)
          for (std::size_t c = 0; c < D; ++c) Wg[a * D + c] += lr_t * kr[a] * gt[c];
        for (std::size_t c = 0; c < D; ++c) wg[c] += lr_t * gt[c];
        // Zbar = XQ·(W − tok_i·Wg) + w − tok_i·wg, then out = XQ + LN(Zbar).
        A* zb = gt + D;
        for (std::size_t c = 0; c < D; ++c) {
          A acc = 0;
          for (std::size_t a = 0; a < D; ++a) acc += qr[a] * (W[a * D + c] - tok[i] * Wg[a * D + c]);
          zb[c] = acc + wb[c] - tok[i] * wg[c];
        }
        const A sz = cpu::ln_row(zb, D, ln_eps, xh);
        (void)sz;
        for (std::size_t c = 0; c < D; ++c)
          o[b * C + h * D + c] =
              qr[c] + wa.ttt_norm_w[h * D + c] * xh[c] + wa.ttt_norm_b[h * D + c];
        if (i == mb - 1) {  // the mini-batch ends: its last W starts the next
          for (std::size_t e = 0; e < D * D; ++e) W[e] -= tok[i] * Wg[e];
          for (std::size_t c = 0; c < D; ++c) wb[c] -= tok[i] * wg[c];
          std::fill(Wg, Wg + D * D + D, A(0));
        }
      }
    if constexpr (widened) {  // as forward: the heads' output is rounded through storage
      for (std::size_t e = 0; e < B * C; ++e) o[e] = to_accum<A>(from_accum<S>(o[e]));
    }
    A* pn = q;
    post_norm(one, o, wa, pn, nullptr, nullptr, pool);
    if (s.use_gate) {
      cpu::matmul(pool, xa, wa.wg, k, B, C, C, false);
      for (std::size_t e = 0; e < B * C; ++e) pn[e] *= gelu(k[e]);
    }
    A* ya = accum_target(y_t, ws.template get<A>(f_y));
    cpu::matmul(pool, static_cast<const A*>(pn), wa.wo, ya, B, C, C, false);
    if constexpr (widened) cpu::narrow(static_cast<const A*>(ya), B * C, y_t);
    ++st.position;
  }

 private:
  static constexpr std::size_t rows(const ttt_shape& s) noexcept { return s.batch * s.seq; }
  static constexpr std::size_t wide(const ttt_shape& s) noexcept {
    return bytes_of<A>(rows(s), s.width);
  }
  static constexpr std::size_t ckpt_bytes(const ttt_shape& s) noexcept {
    const std::size_t D = s.head_dim();
    return bytes_of<A>(s.batch * s.heads, checkpoints(s), D * D + D);
  }
  static constexpr std::size_t w_acc_bytes(const ttt_shape& s) noexcept {
    return widened ? bytes_of<A>(weight_elements(s)) : 0;
  }
  static constexpr std::size_t io_acc_bytes(const ttt_shape& s) noexcept {
    return widened ? wide(s) : 0;
  }
  static constexpr std::size_t group_in_use(const ttt_shape& s) noexcept {
    return std::min(group, mini_batches(s));
  }
  static constexpr std::size_t task_scratch(const ttt_shape& s, std::size_t threads,
                                            bool backward) noexcept {
    const std::size_t D = s.head_dim();
    return bytes_of<A>(threads, backward ? cpu::ttt_backward_scratch(D, mb, group_in_use(s))
                                         : cpu::ttt_forward_scratch(D, mb));
  }
  // Per batch row: dW1 [H, D, D], db1 [H, D], dγ [H, D], dβ [H, D], dtok [H, mb].
  static constexpr std::size_t part_elements(const ttt_shape& s) noexcept {
    const std::size_t H = s.heads, D = s.head_dim();
    return H * D * D + 3 * H * D + H * mb;
  }
  static constexpr std::size_t partial_bytes(const ttt_shape& s) noexcept {
    return bytes_of<A>(s.batch, part_elements(s));
  }

  enum saved_slot : std::size_t { s_ckpt, s_o };
  static constexpr workspace_layout<2> saved_layout(const ttt_shape& s) {
    workspace_layout<2> l;
    l.add(ckpt_bytes(s));
    l.add(bytes_of<S>(rows(s), s.width));
    return l;
  }

  // Phases: 0 projections, 1 inner loop, 2 post norm, gate and output projection.
  enum forward_slot : std::size_t {
    f_w, f_x, f_q, f_k, f_v, f_lr, f_sig, f_tok, f_scratch, f_o, f_y
  };
  // Decoding computes the heads' output in the workspace even when it is the accumulator type
  // (forward writes it straight into `saved`).
  static constexpr workspace_layout<11> forward_layout(const ttt_shape& s, std::size_t threads,
                                                       bool decoding = false) {
    const std::size_t N = rows(s), H = s.heads;
    workspace_layout<11> l;
    l.add(w_acc_bytes(s), default_alignment, {0, 2});
    l.add(io_acc_bytes(s), default_alignment, {0, 2});
    l.add(wide(s), default_alignment, {0, 2});
    l.add(wide(s), default_alignment, {0, 2});
    l.add(wide(s), default_alignment, {0, 1});
    l.add(bytes_of<A>(N, H), default_alignment, {0, 1});
    l.add(bytes_of<A>(N, H), default_alignment, {0, 1});
    l.add(bytes_of<A>(mb), default_alignment, {0, 1});
    l.add(task_scratch(s, threads, false), default_alignment, {1, 1});
    l.add(decoding ? wide(s) : io_acc_bytes(s), default_alignment, {1, 2});
    l.add(io_acc_bytes(s), default_alignment, {2, 2});
    return l;
  }

  // Phases: 0 projections, post norm and gate backwards; 1 inner loop backwards; 2 gradients
  // of the learning-rate gate and the projections, dx.
  enum backward_slot : std::size_t {
    b_w, b_x, b_q, b_k, b_v, b_lr, b_sig, b_tok, b_o, b_dy, b_pn, b_xh, b_rsig, b_dpn, b_gpre,
    b_small, b_do, b_dq, b_dk, b_dv, b_dlr, b_part, b_scratch, b_wtmp, b_dx
  };
  static constexpr workspace_layout<25> backward_layout(const ttt_shape& s, std::size_t threads) {
    const std::size_t N = rows(s), H = s.heads, C = s.width;
    workspace_layout<25> l;
    l.add(w_acc_bytes(s), default_alignment, {0, 2});
    l.add(io_acc_bytes(s), default_alignment, {0, 2});
    l.add(wide(s), default_alignment, {0, 1});  // q
    l.add(wide(s), default_alignment, {0, 1});  // k
    l.add(wide(s), default_alignment, {0, 1});  // v
    l.add(bytes_of<A>(N, H), default_alignment, {0, 2});
    l.add(bytes_of<A>(N, H), default_alignment, {0, 2});
    l.add(bytes_of<A>(mb), default_alignment, {0, 2});
    l.add(io_acc_bytes(s), default_alignment, {0, 0});  // o widened
    l.add(io_acc_bytes(s), default_alignment, {0, 0});  // dy widened
    l.add(wide(s), default_alignment, {0, 0});          // pn
    l.add(wide(s), default_alignment, {0, 0});          // x̂
    l.add(bytes_of<A>(N), default_alignment, {0, 0});   // σ per row
    l.add(wide(s), default_alignment, {0, 0});          // dpn
    l.add(s.use_gate ? wide(s) : 0, default_alignment, {0, 0});
    l.add(bytes_of<A>(std::max(2 * C, part_elements(s))), default_alignment, {0, 2});
    l.add(wide(s), default_alignment, {0, 1});          // d(o)
    l.add(wide(s), default_alignment, {1, 2});          // dq
    l.add(wide(s), default_alignment, {1, 2});          // dk
    l.add(wide(s), default_alignment, {1, 2});          // dv
    l.add(bytes_of<A>(N, H), default_alignment, {1, 2});
    l.add(partial_bytes(s), default_alignment, {1, 2});
    l.add(task_scratch(s, threads, true), default_alignment, {1, 1});
    l.add(widened ? bytes_of<A>(std::max(C * C, H * C)) : 0, default_alignment, {0, 2});
    l.add(wide(s), default_alignment, {0, 2});          // dx in A
    return l;
  }

  // ---- Helpers -------------------------------------------------------------------------------
  static A gelu(A v) {  // tanh form, as the reference implementation's gate
    const A c = A(0.7978845608028654), u = c * (v + A(0.044715) * v * v * v);
    return A(0.5) * v * (A(1) + std::tanh(u));
  }
  static A gelu_grad(A v) {
    const A c = A(0.7978845608028654), u = c * (v + A(0.044715) * v * v * v);
    const A t = std::tanh(u);
    return A(0.5) * (A(1) + t) + A(0.5) * v * (A(1) - t * t) * c * (A(1) + A(3 * 0.044715) * v * v);
  }

  struct wptrs {
    const A *wq, *wk, *wv, *ttt_norm_w, *ttt_norm_b, *w1, *b1, *lr_w, *lr_b, *tok_offset, *post_w,
        *post_b, *wg, *wo;
  };
  static wptrs widen_weights(const ttt_shape& s, const weights& w, A* slot) {
    if constexpr (widened) {
      const std::size_t C = s.width, H = s.heads, D = s.head_dim();
      A* p = slot;
      const auto take = [&](const S* src, std::size_t n) -> const A* {
        if (src == nullptr) return nullptr;
        cpu::widen(src, n, p);
        const A* out = p;
        p += n;
        return out;
      };
      wptrs r;
      r.wq = take(w.wq, C * C);
      r.wk = take(w.wk, C * C);
      r.wv = take(w.wv, C * C);
      r.ttt_norm_w = take(w.ttt_norm_w, H * D);
      r.ttt_norm_b = take(w.ttt_norm_b, H * D);
      r.w1 = take(w.w1, H * D * D);
      r.b1 = take(w.b1, H * D);
      r.lr_w = take(w.lr_w, H * C);
      r.lr_b = take(w.lr_b, H);
      r.tok_offset = take(w.tok_offset, mb);
      r.post_w = take(w.post_w, C);
      r.post_b = take(w.post_b, C);
      r.wg = s.use_gate ? take(w.wg, C * C) : nullptr;
      r.wo = take(w.wo, C * C);
      return r;
    } else {
      (void)s;
      (void)slot;
      return {w.wq, w.wk, w.wv, w.ttt_norm_w, w.ttt_norm_b, w.w1, w.b1, w.lr_w, w.lr_b,
              w.tok_offset, w.post_w, w.post_b, w.wg, w.wo};
    }
  }
  static void check_weights(const ttt_shape& s, const weights& w) {
    detail::not_null(w.wq, "weights.wq");
    detail::not_null(w.wk, "weights.wk");
    detail::not_null(w.wv, "weights.wv");
    detail::not_null(w.ttt_norm_w, "weights.ttt_norm_w");
    detail::not_null(w.ttt_norm_b, "weights.ttt_norm_b");
    detail::not_null(w.w1, "weights.w1");
    detail::not_null(w.b1, "weights.b1");
    detail::not_null(w.lr_w, "weights.lr_w");
    detail::not_null(w.lr_b, "weights.lr_b");
    detail::not_null(w.tok_offset, "weights.tok_offset");
    detail::not_null(w.post_w, "weights.post_w");
    detail::not_null(w.post_b, "weights.post_b");
    if (s.use_gate) detail::not_null(w.wg, "weights.wg");
    detail::not_null(w.wo, "weights.wo");
  }
  static void check_gradients(const ttt_shape& s, const gradients& g) {
    detail::not_null(g.wq, "gradients.wq");
    detail::not_null(g.wk, "gradients.wk");
    detail::not_null(g.wv, "gradients.wv");
    detail::not_null(g.ttt_norm_w, "gradients.ttt_norm_w");
    detail::not_null(g.ttt_norm_b, "gradients.ttt_norm_b");
    detail::not_null(g.w1, "gradients.w1");
    detail::not_null(g.b1, "gradients.b1");
    detail::not_null(g.lr_w, "gradients.lr_w");
    detail::not_null(g.lr_b, "gradients.lr_b");
    detail::not_null(g.tok_offset, "gradients.tok_offset");
    detail::not_null(g.post_w, "gradients.post_w");
    detail::not_null(g.post_b, "gradients.post_b");
    if (s.use_gate) detail::not_null(g.wg, "gradients.wg");
    detail::not_null(g.wo, "gradients.wo");
  }

  static const A* widen_or_alias(const S* src, std::size_t n, A* slot) {
    if constexpr (widened) {
      cpu::widen(src, n, slot);
      return slot;
    } else {
      (void)n;
      (void)slot;
      return src;
    }
  }
  static A* accum_target(S* caller, A* slot) {
    if constexpr (widened) {
      (void)caller;
      return slot;
    } else {
      (void)slot;
      return caller;
    }
  }

  // q, k, v (RoPE'd), lr = base·σ(pre)/D and σ itself [N, H], and the clamped token scales.
  // `position0` offsets the position inside the mini-batch (decoding).
  static void project(const ttt_shape& s, const A* xa, const wptrs& wa, A* q, A* k, A* v, A* lr,
                      A* sig, A* tok, thread_pool& pool, std::size_t position0 = 0) {
    const std::size_t N = rows(s), C = s.width, H = s.heads, D = s.head_dim();
    cpu::matmul(pool, xa, wa.wq, q, N, C, C, false);
    cpu::matmul(pool, xa, wa.wk, k, N, C, C, false);
    cpu::matmul(pool, xa, wa.wv, v, N, C, C, false);
    if (position0 == 0) {
      cpu::rope_pairs(pool, q, N, s.seq, H, D, s.rope_base, mb, false);
      cpu::rope_pairs(pool, k, N, s.seq, H, D, s.rope_base, mb, false);
    } else {  // one token per row at position position0 (seq is 1 here)
      rope_at(q, N, H, D, s.rope_base, position0);
      rope_at(k, N, H, D, s.rope_base, position0);
    }
    cpu::matmul_bt(pool, xa, wa.lr_w, sig, N, C, H, false);
    const A scale = static_cast<A>(s.base_lr / static_cast<double>(D));
    for (std::size_t n = 0; n < N; ++n)
      for (std::size_t h = 0; h < H; ++h) {
        A& e = sig[n * H + h];
        e = A(1) / (A(1) + std::exp(-(e + wa.lr_b[h])));
        lr[n * H + h] = scale * e;
      }
    for (std::size_t i = 0; i < mb; ++i)
      tok[i] = std::max(A(0), A(1) / static_cast<A>(i + 1) + wa.tok_offset[i]);
  }
  static void rope_at(A* x, std::size_t N, std::size_t H, std::size_t D, double base,
                      std::size_t position) {
    for (std::size_t n = 0; n < N; ++n)
      for (std::size_t i = 0; i < D / 2; ++i) {
        const double inv_freq = std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(D));
        const double angle = static_cast<double>(position) * inv_freq;
        const A c = static_cast<A>(std::cos(angle)), sn = static_cast<A>(std::sin(angle));
        for (std::size_t h = 0; h < H; ++h) {
          A* p = x + n * H * D + h * D + 2 * i;
          const A x1 = p[0], x2 = p[1];
          p[0] = x1 * c - x2 * sn;
          p[1] = x2 * c + x1 * sn;
        }
      }
  }

  // pn = LN_C(o)·post_w + post_b; keeps x̂ and σ per row when asked (backward).
  static void post_norm(const ttt_shape& s, const A* o, const wptrs& wa, A* pn, A* xh, A* rsig,
                        thread_pool& pool) {
    const std::size_t N = rows(s), C = s.width;
    cpu::for_rows(pool, N, [&](std::size_t n) {
      A* dst = xh ? xh + n * C : pn + n * C;
      const A sg = cpu::ln_row(o + n * C, C, ln_eps, dst);
      if (rsig) rsig[n] = sg;
      for (std::size_t j = 0; j < C; ++j) pn[n * C + j] = dst[j] * wa.post_w[j] + wa.post_b[j];
    });
  }

  // ---- The inner loop --------------------------------------------------------------------------
  static cpu::ttt_minibatch<A> minibatch(const ttt_shape& s, const A* q, const A* k, const A* v,
                                         const A* lr_row, const A* tok, const wptrs& wa,
                                         std::size_t b, std::size_t h, std::size_t t0) {
    const std::size_t C = s.width, D = s.head_dim(), K = std::min(mb, s.seq - t0);
    const std::size_t r = (b * s.seq + t0) * C + h * D;
    return cpu::ttt_minibatch<A>{q + r, k + r, v + r, K, D, C, lr_row, tok,
                                 wa.ttt_norm_w + h * D, wa.ttt_norm_b + h * D, ln_eps};
  }
  // The mini-batch's rates, gathered contiguous: lr[(b·T + t0 + s)·H + h].
  static void gather_lr(const ttt_shape& s, const A* lr, std::size_t b, std::size_t h,
                        std::size_t t0, std::size_t K, A* out) {
    for (std::size_t i = 0; i < K; ++i) out[i] = lr[(b * s.seq + t0 + i) * s.heads + h];
  }

  static void inner_forward(const ttt_shape& s, const A* q, const A* k, const A* v, const A* lr,
                            const A* tok, const wptrs& wa, A* o, A* ckpt, A* scratch,
                            thread_pool& pool) {
    const std::size_t H = s.heads, D = s.head_dim(), C = s.width, nmb = mini_batches(s);
    const std::size_t ncp = checkpoints(s), per = cpu::ttt_forward_scratch(D, mb);
    pool.parallel_for(s.batch * H, [&](std::size_t task, std::size_t thread) {
      const std::size_t b = task / H, h = task % H;
      A* W = scratch + thread * per;
      A* wb = W + D * D;
      A* z1 = wb + D;
      A* xh = z1 + mb * D;
      A* gm = xh + mb * D;
      A* zb = gm + mb * D;
      A* p = zb + mb * D;
      A* sig = p + mb * mb;
      A* lrm = sig + mb;
      A* att = lrm + mb;
      std::copy(wa.w1 + h * D * D, wa.w1 + (h + 1) * D * D, W);
      std::copy(wa.b1 + h * D, wa.b1 + (h + 1) * D, wb);
      for (std::size_t m = 0; m < nmb; ++m) {
        const std::size_t t0 = m * mb;
        if (m % group == 0) {
          A* dst = ckpt + (task * ncp + m / group) * (D * D + D);
          std::copy(W, W + D * D + D, dst);  // W and w are adjacent
        }
        const std::size_t K = std::min(mb, s.seq - t0);
        gather_lr(s, lr, b, h, t0, K, lrm);
        const auto mbt = minibatch(s, q, k, v, lrm, tok, wa, b, h, t0);
        cpu::ttt_inner_grad(mbt, W, wb, z1, xh, sig, gm);
        cpu::ttt_p_matrix(mbt, att, p);
        cpu::ttt_zbar(mbt, W, wb, p, gm, zb);
        for (std::size_t i = 0; i < K; ++i) {
          cpu::ln_row(zb + i * D, D, ln_eps, z1);  // z1 reused for x̂ of Zbar
          A* out = o + (b * s.seq + t0 + i) * C + h * D;
          const A* qr = mbt.q + i * C;
          for (std::size_t j = 0; j < D; ++j)
            out[j] = qr[j] + mbt.gamma[j] * z1[j] + mbt.beta[j];
        }
        cpu::ttt_update(mbt, gm, W, wb, zb);  // zb reused as scratch
      }
    });
  }

  // The inner loop backwards, per (b, h). d_o = dL/d(out) [N, C]. Writes dq, dk, dv [N, C] and
  // dlr [N, H]; part[b] gets this row's dW1, db1, dγ, dβ, dtok for head h.
  static void inner_backward(const ttt_shape& s, const A* q, const A* k, const A* v, const A* lr,
                             const A* tok, const wptrs& wa, const A* ckpt, const A* d_o, A* dq,
                             A* dk, A* dv, A* dlr, A* part, A* scratch, thread_pool& pool) {
    const std::size_t H = s.heads, D = s.head_dim(), C = s.width, T = s.seq;
    const std::size_t nmb = mini_batches(s), ncp = checkpoints(s), gsz = group_in_use(s);
    const std::size_t per = cpu::ttt_backward_scratch(D, mb, gsz), pe = part_elements(s);
    const std::size_t DD = D * D + D;
    pool.parallel_for(s.batch * H, [&](std::size_t task, std::size_t thread) {
      const std::size_t b = task / H, h = task % H;
      A* base = scratch + thread * per;
      A* states = base;                  // [gsz, D² + D]: W, w entering each mini-batch
      A* dW = states + gsz * DD;         // [D² + D]: dL/d(W, w) entering the next mini-batch
      A* dwb = dW + D * D;
      A* Wc = dW + DD;                   // [D² + D]: the running state during recomputation
      A* z1 = Wc + DD;
      A* xh1 = z1 + mb * D;              // x̂ of Z1
      A* gm = xh1 + mb * D;
      A* zb = gm + mb * D;
      A* xhb = zb + mb * D;              // x̂ of Zbar
      A* dzb = xhb + mb * D;
      A* dgm = dzb + mb * D;
      A* kdw = dgm + mb * D;             // XK·dW
      A* gdw = kdw + mb * D;             // G·dWᵀ
      A* dz1 = gdw + mb * D;
      A* tmpd = dz1 + mb * D;            // [mb, D] scratch
      A* att = tmpd + mb * D;            // [mb, mb]
      A* p = att + mb * mb;
      A* dp = p + mb * mb;
      A* sig1 = dp + mb * mb;            // σ of Z1 rows
      A* sigb = sig1 + mb;               // σ of Zbar rows
      A* lrm = sigb + mb;
      A* de = lrm + mb;
      A* rowd = de + mb;                 // [2D]
      A* pt = part + b * pe;             // this row's partials
      A* pW1 = pt + h * D * D;
      A* pb1 = pt + H * D * D + h * D;
      A* pgam = pt + H * D * D + H * D + h * D;
      A* pbet = pt + H * D * D + 2 * H * D + h * D;
      A* ptok = pt + H * D * D + 3 * H * D + h * mb;
      std::fill(pgam, pgam + D, A(0));
      std::fill(pbet, pbet + D, A(0));
      std::fill(ptok, ptok + mb, A(0));
      std::fill(dW, dW + DD, A(0));
      const A* gamma = wa.ttt_norm_w + h * D;
      for (std::size_t c = ncp; c-- > 0;) {
        const std::size_t m0 = c * group, m1 = std::min(nmb, m0 + gsz);
        // Recompute the group's entering states from its checkpoint.
        std::copy(ckpt + (task * ncp + c) * DD, ckpt + (task * ncp + c + 1) * DD, Wc);
        for (std::size_t m = m0; m < m1; ++m) {
          std::copy(Wc, Wc + DD, states + (m - m0) * DD);
          if (m + 1 == m1) break;  // the last one's update is not needed
          const std::size_t t0 = m * mb, K = std::min(mb, T - t0);
          gather_lr(s, lr, b, h, t0, K, lrm);
          const auto mbt = minibatch(s, q, k, v, lrm, tok, wa, b, h, t0);
          cpu::ttt_inner_grad(mbt, Wc, Wc + D * D, z1, xh1, sig1, gm);
          cpu::ttt_update(mbt, gm, Wc, Wc + D * D, tmpd);
        }
        for (std::size_t m = m1; m-- > m0;) {
          const std::size_t t0 = m * mb, K = std::min(mb, T - t0);
          const A* W = states + (m - m0) * DD;
          const A* wb = W + D * D;
          gather_lr(s, lr, b, h, t0, K, lrm);
          const auto mbt = minibatch(s, q, k, v, lrm, tok, wa, b, h, t0);
          cpu::ttt_inner_grad(mbt, W, wb, z1, xh1, sig1, gm);
          cpu::ttt_p_matrix(mbt, att, p);
          cpu::ttt_zbar(mbt, W, wb, p, gm, zb);
          const std::size_t r0 = (b * T + t0) * C + h * D;
          // out = XQ + γ ⊙ x̂(Zbar) + β
          for (std::size_t i = 0; i < K; ++i) {
            sigb[i] = cpu::ln_row(zb + i * D, D, mbt.eps, xhb + i * D);
            const A* dout = d_o + r0 + i * C;
            for (std::size_t j = 0; j < D; ++j) {
              pgam[j] += dout[j] * xhb[i * D + j];
              pbet[j] += dout[j];
              rowd[j] = dout[j] * gamma[j];
            }
            cpu::ln_row_backward(xhb + i * D, sigb[i], rowd, A(0), D, dzb + i * D);
            A* dqr = dq + r0 + i * C;
            std::copy(dout, dout + D, dqr);  // the residual XQ
          }
          auto dQ = cpu::view(dq + r0, K, D, C);
          auto dK = cpu::view(dk + r0, K, D, C);
          auto dV = cpu::view(dv + r0, K, D, C);
          dK.setZero();
          dV.setZero();
          const auto Q = cpu::cview(mbt.q, K, D, C);
          const auto Kx = cpu::cview(mbt.k, K, D, C);
          const auto DZb = cpu::cview(static_cast<const A*>(dzb), K, D, D);
          const auto Gm = cpu::cview(static_cast<const A*>(gm), K, D, D);
          const auto dWm = cpu::cview(static_cast<const A*>(dW), D, D, D);  // dL/dW'
          auto dWacc = cpu::view(dW, D, D, D);
          const auto Wm = cpu::cview(W, D, D, D);
          // The update W' = W − XKᵀ·diag(e)·G, w' = w − Σ e_s G_s, e_s = tok[K−1]·lr_s.
          auto KdW = cpu::view(kdw, K, D, D);
          cpu::gemm(KdW, Kx, dWm, A(1), false);
          auto GdWt = cpu::view(gdw, K, D, D);
          cpu::gemm(GdWt, Gm, dWm.transpose(), A(1), false);
          auto dG = cpu::view(dgm, K, D, D);
          for (std::size_t i = 0; i < K; ++i) {
            const A e = tok[K - 1] * lrm[i];
            A dei = 0;
            for (std::size_t j = 0; j < D; ++j) {
              dei -= kdw[i * D + j] * gm[i * D + j] + dwb[j] * gm[i * D + j];
              dgm[i * D + j] = -e * (kdw[i * D + j] + dwb[j]);
            }
            de[i] = dei;
            for (std::size_t j = 0; j < D; ++j) dK(static_cast<Eigen::Index>(i), static_cast<Eigen::Index>(j)) -= e * gdw[i * D + j];
            ptok[K - 1] += dei * lrm[i];
          }
          // Zbar = XQ·W + w − P·G: dXQ += dZbar·Wᵀ, dG −= Pᵀ·dZbar.
          cpu::gemm(dQ, DZb, Wm.transpose(), A(1), true);
          const auto Pm = cpu::cview(static_cast<const A*>(p), K, K, K);
          cpu::gemm(dG, Pm.transpose(), DZb, A(-1), true);
          // Zbar's other terms: the incoming state's gradient, W = W' + ... (dW is now dL/dW).
          cpu::gemm(dWacc, Q.transpose(), DZb, A(1), true);
          for (std::size_t i = 0; i < K; ++i)
            for (std::size_t j = 0; j < D; ++j) dwb[j] += dzb[i * D + j];
          // e_s = tok[K−1]·lr_s: de now becomes this mini-batch's dL/dlr, completed below.
          for (std::size_t i = 0; i < K; ++i) de[i] *= tok[K - 1];
          // dP = −dZbar·Gᵀ (lower triangle); P = η ⊙ (att + 1), η[i, s] = tok_i·lr_s.
          auto dP = cpu::view(dp, K, K, K);
          cpu::gemm(dP, DZb, Gm.transpose(), A(-1), false);
          for (std::size_t i = 0; i < K; ++i)
            for (std::size_t s2 = 0; s2 < K; ++s2) {
              if (s2 > i) {
                dp[i * K + s2] = 0;
                continue;
              }
              const A d = dp[i * K + s2], dEta = d * (att[i * K + s2] + A(1));
              ptok[i] += dEta * lrm[s2];
              de[s2] += dEta * tok[i];
              dp[i * K + s2] = d * tok[i] * lrm[s2];  // now dL/d(att)
            }
          for (std::size_t i = 0; i < K; ++i) dlr[(b * T + t0 + i) * H + h] = de[i];
          // att = XQ·XKᵀ (lower triangle).
          const auto dAtt = cpu::cview(static_cast<const A*>(dp), K, K, K);
          cpu::gemm(dQ, dAtt, Kx, A(1), true);
          cpu::gemm(dK, dAtt.transpose(), Q, A(1), true);
          // G = ∇_Z1 ½‖γ x̂ + β − (v − k)‖² through LN(Z1): its backward, row by row.
          const A* beta = wa.ttt_norm_b + h * D;
          const A invD = A(1) / static_cast<A>(D);
          for (std::size_t i = 0; i < K; ++i) {
            const A* xr = xh1 + i * D;
            const A* g_r = gm + i * D;
            const A* dg_r = dgm + i * D;
            A* r = rowd;
            A* dgx = rowd + D;
            A* dxh = tmpd + i * D;
            A a = 0, cc = 0, m1 = 0, m2 = 0, sdx = 0, dsig = 0;
            for (std::size_t j = 0; j < D; ++j) {
              r[j] = gamma[j] * xr[j] + beta[j] - (mbt.v[i * C + j] - mbt.k[i * C + j]);
              const A gx = r[j] * gamma[j];
              a += gx;
              cc += gx * xr[j];
              m1 += dg_r[j];
              m2 += dg_r[j] * xr[j];
              dsig -= dg_r[j] * g_r[j];
            }
            a *= invD;
            cc *= invD;
            sdx = m2;
            m1 *= invD;
            m2 *= invD;
            dsig /= sig1[i];
            (void)a;
            for (std::size_t j = 0; j < D; ++j) {
              const A gx = r[j] * gamma[j];
              dgx[j] = (dg_r[j] - m1 - xr[j] * m2) / sig1[i];
              dxh[j] = -(dg_r[j] * cc) / sig1[i] - sdx / sig1[i] * gx * invD;
              const A dr = dgx[j] * gamma[j];
              pgam[j] += dgx[j] * r[j] + dr * xr[j];
              pbet[j] += dr;
              dV(static_cast<Eigen::Index>(i), static_cast<Eigen::Index>(j)) -= dr;  // target = v − k
              dK(static_cast<Eigen::Index>(i), static_cast<Eigen::Index>(j)) += dr;
              dxh[j] += dr * gamma[j];
            }
            cpu::ln_row_backward(xr, sig1[i], dxh, dsig, D, dz1 + i * D);
          }
          // Z1 = XK·W + w.
          const auto DZ1 = cpu::cview(static_cast<const A*>(dz1), K, D, D);
          cpu::gemm(dK, DZ1, Wm.transpose(), A(1), true);
          cpu::gemm(dWacc, Kx.transpose(), DZ1, A(1), true);
          for (std::size_t i = 0; i < K; ++i)
            for (std::size_t j = 0; j < D; ++j) dwb[j] += dz1[i * D + j];
        }
      }
      std::copy(dW, dW + D * D, pW1);
      std::copy(dwb, dwb + D, pb1);
    });
  }

  // Σ_n a[n, j]·b[n, j] into out_ab and Σ_n a[n, j] into out_a (when not null); b may be null
  // (then out_ab gets Σ a). Column blocks in parallel, rows in order.
  static void column_sums_product(thread_pool& pool, const A* a, const A* b, std::size_t N,
                                  std::size_t M, A* out_ab, A* out_a) {
    pool.parallel_for(cpu::blocks(M, 64), [&](std::size_t blk, std::size_t) {
      const std::size_t j0 = blk * 64, j1 = std::min(M, j0 + 64);
      for (std::size_t j = j0; j < j1; ++j) {
        A ab = 0, s = 0;
        for (std::size_t n = 0; n < N; ++n) {
          ab += a[n * M + j] * (b ? b[n * M + j] : A(1));
          s += a[n * M + j];
        }
        out_ab[j] = ab;
        if (out_a) out_a[j] = s;
      }
    });
  }

  static void weight_grad(thread_pool& pool, const A* x, const A* d, S* g, A* tmp, std::size_t N,
                          std::size_t K, std::size_t M) {
    if constexpr (widened) {
      cpu::matmul_at(pool, x, d, tmp, N, K, M, false);
      cpu::narrow_add(static_cast<const A*>(tmp), K * M, g);
    } else {
      (void)tmp;
      cpu::matmul_at(pool, x, d, g, N, K, M, true);
    }
  }
  static void add_grad(const A* src, std::size_t n, S* g) {
    if constexpr (widened) {
      cpu::narrow_add(src, n, g);
    } else {
      for (std::size_t j = 0; j < n; ++j) g[j] += src[j];
    }
  }
};

MEMBOUND_NAMESPACE_END
