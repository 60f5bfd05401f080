// The TTT layers (Sun et al. 2024; the TTTLinear and TTTMLP modules of test-time-training/
// ttt-lm-pytorch without the shared-QK convolution), trained inside a memory budget. Per head h
// (D = width / heads) and mini-batch of b tokens (the chunking policy ttt_mini_batch<b>):
//   XQ, XK, XV = x·Wq, x·Wk, x·Wv; RoPE on interleaved pairs of XQ, XK at position t mod b
//   inner model, starting from learned weights: TTT-Linear f(k) = k·W1 + b1 (W1 [D, D]);
//   TTT-MLP f(k) = GELU_tanh(k·W1 + b1)·W2 + b2 (W1 [D, 4D], W2 [4D, D]); the dual form applies
//   to each layer in turn, with the first layer's output gradient taken through the second
//   inner loss ½‖LN_h(f(XK_t)) − (XV_t − XK_t)‖², all gradients of a mini-batch taken at its
//   starting (W, w); token i uses W_i = W − Σ_{s≤i} η[i, s]·∇ℓ_s with
//   η[i, s] = max(0, 1/(i+1) + tok_offset[i]) · base_lr · σ(x_s·lr_w[h] + lr_b[h]) / D
//   out_t = XQ_t + LN_h(f(XQ_t; W_t)); heads concatenated; post LayerNorm over the width;
//   optional gate GELU_tanh(x·Wg) ⊙; then ·Wo.
// Forward runs the dual form (no per-token W ever exists) and keeps, per (batch, head), the inner
// state at the start of every G-th mini-batch (the recompute policy ttt_state_groups<G>;
// ttt_state_groups_all keeps only the first) plus the heads' output before the post norm. Backward
// recomputes q, k, v from x and each group's states from its saved state, then runs the
// hand-derived reverse of the inner loop. All weights are [in, out], row-major (y = x·W).
// Packed sequences (ttt_shape::offsets, either backend): each starts from W1, b1 with mini-batches and RoPE
// positions of its own, as if run alone; saved_bytes is the worst case over packings of the totals.
// This file is the front (checks, sizes, the saved and state layouts) and makes one call into
// backend_kernels<backend, ttt_shape> for every backend: backend/cpu/ttt.hpp on the host.
// With cuda_backend in the policies every pointer is device memory, the executor is a
// cuda_executor and forward, step and the state run backend/cuda/ttt.cuh's kernels (include
// membound/backend/cuda.cuh, compile with nvcc); saved_bytes and state_bytes are the same, the
// workspace is the device's own (backward too: the same recomputation from the saved states).
#pragma once

#include <cstddef>
#include <limits>
#include <string>
#include <type_traits>

#include "membound/backend/cpu/ttt.hpp"  // backend_kernels<cpu_backend, ttt_shape>
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/core/error.hpp"
#include "membound/core/parallel.hpp"
#include "membound/core/type_list.hpp"
#include "membound/layers/layer_support.hpp"
#include "membound/memory/workspace.hpp"
#include "membound/policy/backend.hpp"
#include "membound/policy/recompute.hpp"
#include "membound/policy/chunking.hpp"
#include "membound/policy/policy_set.hpp"
#include "membound/policy/precision.hpp"
#include "membound/shape/ttt_shape.hpp"

MEMBOUND_NAMESPACE_BEGIN

// The TTT layers (see the file comment): Mlp picks TTT-MLP over TTT-Linear. Users name them
// ttt_linear<...> and ttt_mlp<...> (below); Policies override the defaults in any order.
template <bool Mlp, typename... Policies>
class basic_ttt {
 public:
  // Precision, mini-batch, state groups and backend: the defaults, overridden by Policies.
  using policies = policy_set<
      type_list<fp32_precision, ttt_mini_batch<16>, ttt_state_groups<4>, cpu_backend>,
      Policies...>;
  // cpu_backend (the default) or cuda_backend: where the pointers live and whose kernels run.
  using backend = get_policy<policies, backend_kind>;
  using executor = typename backend::executor;  // thread_pool, or cuda_executor
  // Storage and accumulator types (fp32_precision by default).
  using precision = get_policy<policies, precision_kind>;
  // ttt_mini_batch<b>: tokens per inner-loop mini-batch.
  using chunking = get_policy<policies, chunking_kind>;
  // ttt_state_groups<G>: forward saves the inner state every G mini-batches, backward recomputes
  // the rest.
  using recompute_policy = get_policy<policies, recompute_kind>;
  // The former name of recompute_policy, kept so that old code still compiles (with a warning).
  using checkpoint [[deprecated("membound: a layer's checkpoint policy is now its recompute_policy")]] =
      recompute_policy;
  static_assert(is_ttt_mini_batch_v<chunking>,
                "membound: a TTT layer takes ttt_mini_batch<b> as its chunking policy "
                "(attention_tiles and scan_chunk belong to attention and Mamba).");
  static_assert(is_ttt_state_groups_v<recompute_policy>,
                "membound: a TTT layer takes ttt_state_groups<G> (or ttt_state_groups_all) as its "
                "recompute policy.");
  // Element type of x, y, the weights and the gradients.
  using storage_type = typename precision::storage_type;
  // Type of the inner W (float or double), saved and decoding states included.
  using accum_type = typename precision::accum_type;
  static_assert(std::is_same_v<accum_type, float> || std::is_same_v<accum_type, double>,
                "membound: a TTT layer accumulates its inner W in float or double.");
  // Tokens per inner-loop mini-batch (ttt_mini_batch<b>).
  static constexpr std::size_t mini_batch = chunking::mini_batch;
  // Mini-batches per saved inner state (ttt_state_groups<G>).
  static constexpr std::size_t group = recompute_policy::group_size;
  // True for TTT-MLP, false for TTT-Linear.
  static constexpr bool is_mlp = Mlp;
  // The inner model's hidden width F (D for TTT-Linear, 4·D for TTT-MLP) and its state size:
  // W1 [D, F], b1 [F] (then W2 [F, D], b2 [D] for TTT-MLP), contiguous.
  static constexpr std::size_t hidden(const ttt_shape& s) noexcept { return ttt_hidden(s, Mlp); }
  // Elements of one head's inner state: W1, b1 (and W2, b2 for TTT-MLP).
  static constexpr std::size_t inner_elements(const ttt_shape& s) noexcept {
    return ttt_inner_elements(s, Mlp);
  }

 private:
  using S = storage_type;
  using A = accum_type;
  static constexpr std::size_t mb = mini_batch;
  using kernels = backend_kernels<backend, ttt_shape>;

 public:
  // ---- Checks --------------------------------------------------------------------------------
  // Whether the shape can run, and if not which field fails and why. Never throws.
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
    if (s.offsets != nullptr || s.sequences != 0) {
      return detail::packing_support(s.offsets, s.sequences, s.batch, s.seq);
    }
    return {};
  }
  // Throws invalid_argument naming the failing field, as can_implement reports it.
  static void check(const ttt_shape& s) {
    const layer_support r = can_implement(s);
    if (!r.ok) {
      const std::string a = r.argument;
      detail::throw_unsupported(r, a == "shape.base_lr" || a == "shape.rope_base",
                                "Fix the ttt_shape before sizing or running the layer");
    }
  }

  // ---- Memory known before running ------------------------------------------------------------
  // Mini-batches per sequence: ceil(T / b), the last one possibly partial.
  static constexpr std::size_t mini_batches(const ttt_shape& s) noexcept {
    return ttt_mini_batches(s, mb);
  }
  // Checkpoints per (batch, head): ceil(mini-batches / G); packed, the most any packing of
  // shape.seq tokens into shape.sequences sequences keeps (shape/ttt_shape.hpp).
  static constexpr std::size_t saved_states(const ttt_shape& s) noexcept {
    return ttt_saved_states(s, mb, group);
  }
  // Bytes forward keeps for backward: the saved inner states and the heads' output before the post
  // norm.
  static constexpr std::size_t saved_bytes(const ttt_shape& s) noexcept {
    const std::size_t b[] = {ckpt_bytes(s), bytes_of<S>(rows(s), s.width)};
    return detail::fits_layout(b) ? saved_layout(s).size() : std::numeric_limits<std::size_t>::max();
  }
  // Of saved_bytes, the saved inner states: B·H·saved_states·inner_elements.
  static constexpr std::size_t saved_state_bytes(const ttt_shape& s) noexcept { return ckpt_bytes(s); }
  // Scratch bytes forward needs for `threads` CPU threads (the pool's size; the device ignores it).
  static constexpr std::size_t forward_workspace_bytes(const ttt_shape& s,
                                                       std::size_t threads) noexcept {
    return kernels::template forward_workspace_bytes<Mlp, mb, S, A>(s, threads);
  }
  // Scratch bytes backward needs for `threads` CPU threads.
  static constexpr std::size_t backward_workspace_bytes(const ttt_shape& s,
                                                        std::size_t threads) noexcept {
    return kernels::template backward_workspace_bytes<Mlp, mb, group, S, A>(s, threads);
  }
  // Decoding state per (batch, head): the mini-batch's starting W, w and the running
  // Σ lr_s·XK_sᵀ·G_s, Σ lr_s·G_s of its tokens so far, in the accumulator type.
  static constexpr std::size_t state_bytes(const ttt_shape& s) noexcept {
    return bytes_of<A>(s.batch, s.heads, 2 * inner_elements(s));
  }
  // Scratch bytes one decoding step needs.
  static constexpr std::size_t step_workspace_bytes(const ttt_shape& s) noexcept {
    return kernels::template step_workspace_bytes<Mlp, mb, S, A>(s);
  }

  using weights = ttt_weights<S>;      // shape/ttt_shape.hpp: the parameters and their shapes
  using gradients = ttt_gradients<S>;  // accumulated (+=); wg only when shape.use_gate, w2 and b2
                                       // only for TTT-MLP

  // Parameter elements, in the order of `weights`.
  static constexpr std::size_t weight_elements(const ttt_shape& s) noexcept {
    return ttt_weight_elements(s, Mlp, mb);
  }

  // The decoding state over the caller's state_bytes(shape) bytes (aligned to accum_type).
  struct state {
    void* data = nullptr;      // the caller's bytes, aligned to accum_type
    std::size_t bytes = 0;     // size of data; at least state_bytes(shape)
    std::size_t position = 0;  // tokens consumed since reset
  };
  // The state starts from the layer's W1, b1 (so it needs the weights).
  static state make_state(const ttt_shape& s, const weights& w, void* data, std::size_t bytes) {
    static_assert(is_cpu_backend_v<backend>,
                  "membound: a device decoding state is written on the executor's stream: call "
                  "make_state(shape, weights, data, bytes, executor) for ttt<..., cuda_backend>.");
    check(s);
    if (data == nullptr || bytes < state_bytes(s)) {
      throw workspace_too_small("state", state_bytes(s), data == nullptr ? 0 : bytes);
    }
    detail::need_aligned(data, alignof(A), "state");
    check_weights(s, w);
    state st{data, bytes, 0};
    reset(s, w, st);
    return st;
  }
  // Per (b, h): the mini-batch's starting inner state, then the running sums of its tokens'
  // lr_s-weighted gradients, each inner_elements long.
  static void reset(const ttt_shape& s, const weights& w, state& st) {
    static_assert(is_cpu_backend_v<backend>,
                  "membound: a device decoding state is written on the executor's stream: call "
                  "reset(shape, weights, state, executor) for ttt<..., cuda_backend>.");
    kernels::template reset_state<Mlp, A>(s, w, static_cast<A*>(st.data));
    st.position = 0;
  }
  // The same on either backend with its executor: on the device the state is written on the
  // executor's stream (ordered before the steps that read it, never on the legacy stream).
  static state make_state(const ttt_shape& s, const weights& w, void* data, std::size_t bytes, executor& ex) {
    check(s);
    if (data == nullptr || bytes < state_bytes(s)) {
      throw workspace_too_small("state", state_bytes(s), data == nullptr ? 0 : bytes);
    }
    detail::need_aligned(data, alignof(A), "state");
    check_weights(s, w);
    state st{data, bytes, 0};
    reset(s, w, st, ex);
    return st;
  }
  // Restarts the state from the weights on the executor (a device state on its stream).
  static void reset(const ttt_shape& s, const weights& w, state& st, executor& ex) {
    kernels::template reset_state<Mlp, A>(s, w, static_cast<A*>(st.data), ex);
    st.position = 0;
  }

  // ---- Forward -------------------------------------------------------------------------------
  // y = ttt(x) for the whole sequence; keeps the inner states every G mini-batches and the heads'
  // output in `saved` for backward. Checks every argument before writing anything.
  static void forward(const ttt_shape& s, const weights& w, const S* x, S* y, void* saved,
                      std::size_t saved_size, void* workspace, std::size_t workspace_size,
                      executor& ex) {
    check(s);
    detail::need_offsets(s.offsets, s.sequences);
    check_weights(s, w);
    detail::need_pointer(x, "x");
    detail::need_pointer(y, "y");
    const auto sv = detail::carve_named(saved_layout(s), saved_bytes(s), saved, saved_size, "saved");
    detail::check_workspace_size(forward_workspace_bytes(s, workspace_threads(ex)), workspace,
                                 workspace_size);
    kernels::template forward<Mlp, mb, group, S, A>(s, w, x, y, sv.template get<A>(s_ckpt),
                                                    sv.template get<S>(s_o), workspace,
                                                    workspace_size, ex);
  }

 public:
  // ---- Backward ------------------------------------------------------------------------------
  // dx from dy (overwritten), and the weight gradients added to `g`, from forward's `saved`.
  static void backward(const ttt_shape& s, const weights& w, const S* x, const void* saved,
                       std::size_t saved_size, const S* dy, S* dx, const gradients& g,
                       void* workspace, std::size_t workspace_size, executor& ex) {
    check(s);
    detail::need_offsets(s.offsets, s.sequences);
    check_weights(s, w);
    detail::need_pointer(x, "x");
    detail::need_pointer(dy, "dy");
    detail::need_pointer(dx, "dx");
    check_gradients(s, g);
    const auto sv = detail::carve_named(saved_layout(s), saved_bytes(s), const_cast<void*>(saved),
                                        saved_size, "saved");
    detail::check_workspace_size(backward_workspace_bytes(s, workspace_threads(ex)), workspace,
                                 workspace_size);
    kernels::template backward<Mlp, mb, group, S, A>(
        s, w, x, static_cast<const A*>(sv.template get<A>(s_ckpt)),
        static_cast<const S*>(sv.template get<S>(s_o)), dy, dx, g, workspace, workspace_size, ex);
  }

 public:
  // ---- Decoding ------------------------------------------------------------------------------
  // One token per sequence: x_t [B, C] -> y_t [B, C] at position state.position. Token i of a
  // mini-batch uses W − tok_i·Σ_{s≤i} lr_s·XK_sᵀ·G_s (the dual form's row i); the mini-batch's
  // last token folds the sums into W. Checks everything before touching the state or y_t.
  static void step(const ttt_shape& s, const weights& w, state& st, const S* x_t, S* y_t,
                   void* workspace, std::size_t workspace_size, executor& ex) {
    detail::refuse_packed_decoding(s.offsets, s.sequences,
                                   "Decode each sequence as a batch row: its state carries its own past");
    check(s);
    check_weights(s, w);
    detail::need_pointer(x_t, "x_t");
    detail::need_pointer(y_t, "y_t");
    if (st.data == nullptr || st.bytes < state_bytes(s)) {
      throw workspace_too_small("state", state_bytes(s), st.data == nullptr ? 0 : st.bytes);
    }
    detail::need_aligned(st.data, alignof(A), "state");
    detail::check_workspace_size(step_workspace_bytes(s), workspace, workspace_size);
    kernels::template step<Mlp, mb, S, A>(s, w, static_cast<A*>(st.data), st.position % mb, x_t,
                                          y_t, workspace, workspace_size, ex);
    ++st.position;
  }

 private:
  static constexpr std::size_t rows(const ttt_shape& s) noexcept { return s.batch * s.seq; }
  static constexpr std::size_t ckpt_bytes(const ttt_shape& s) noexcept {
    return bytes_of<A>(s.batch * s.heads, saved_states(s), inner_elements(s));
  }

  enum saved_slot : std::size_t { s_ckpt, s_o };
  static constexpr workspace_layout<2> saved_layout(const ttt_shape& s) {
    workspace_layout<2> l;
    l.add(ckpt_bytes(s));
    l.add(bytes_of<S>(rows(s), s.width));
    return l;
  }

  static void check_weights(const ttt_shape& s, const weights& w) {
    detail::need_pointer(w.wq, "weights.wq");
    detail::need_pointer(w.wk, "weights.wk");
    detail::need_pointer(w.wv, "weights.wv");
    detail::need_pointer(w.ttt_norm_w, "weights.ttt_norm_w");
    detail::need_pointer(w.ttt_norm_b, "weights.ttt_norm_b");
    detail::need_pointer(w.w1, "weights.w1");
    detail::need_pointer(w.b1, "weights.b1");
    detail::need_pointer(w.lr_w, "weights.lr_w");
    detail::need_pointer(w.lr_b, "weights.lr_b");
    detail::need_pointer(w.tok_offset, "weights.tok_offset");
    detail::need_pointer(w.post_w, "weights.post_w");
    detail::need_pointer(w.post_b, "weights.post_b");
    if (s.use_gate) detail::need_pointer(w.wg, "weights.wg");
    detail::need_pointer(w.wo, "weights.wo");
    if (Mlp) {
      detail::need_pointer(w.w2, "weights.w2");
      detail::need_pointer(w.b2, "weights.b2");
    }
  }
  static void check_gradients(const ttt_shape& s, const gradients& g) {
    detail::need_pointer(g.wq, "gradients.wq");
    detail::need_pointer(g.wk, "gradients.wk");
    detail::need_pointer(g.wv, "gradients.wv");
    detail::need_pointer(g.ttt_norm_w, "gradients.ttt_norm_w");
    detail::need_pointer(g.ttt_norm_b, "gradients.ttt_norm_b");
    detail::need_pointer(g.w1, "gradients.w1");
    detail::need_pointer(g.b1, "gradients.b1");
    detail::need_pointer(g.lr_w, "gradients.lr_w");
    detail::need_pointer(g.lr_b, "gradients.lr_b");
    detail::need_pointer(g.tok_offset, "gradients.tok_offset");
    detail::need_pointer(g.post_w, "gradients.post_w");
    detail::need_pointer(g.post_b, "gradients.post_b");
    if (s.use_gate) detail::need_pointer(g.wg, "gradients.wg");
    detail::need_pointer(g.wo, "gradients.wo");
    if (Mlp) {
      detail::need_pointer(g.w2, "gradients.w2");
      detail::need_pointer(g.b2, "gradients.b2");
    }
  }
};

// TTT-Linear: the inner model is one linear map (W1 [D, D], b1 [D]).
template <typename... Policies>
using ttt_linear = basic_ttt<false, Policies...>;
// TTT-MLP: the inner model is GELU_tanh(k·W1 + b1)·W2 + b2 (W1 [D, 4D], W2 [4D, D]).
template <typename... Policies>
using ttt_mlp = basic_ttt<true, Policies...>;

MEMBOUND_NAMESPACE_END
