// A block: h = x + Mixer(RMSNorm(x)), then y = h + FFN(RMSNorm(h)), the feed-forward the dense
// SwiGLU MLP (swiglu_ffn, the default) or a mixture of SwiGLU experts (moe_ffn). Each half is a `part`
// (pre-norm, layer, residual) with its own forward, backward and size functions; the block adds
// the three forward modes a checkpoint schedule needs (see model/schedule.hpp):
//   advance - x -> y, keeping nothing (the layers' saved tensors live in the workspace);
//   tape    - x -> y, keeping `saved` for backward;
//   retape  - x -> saved only (y is computed in the workspace and dropped).
// Every mode computes the same values in the same order, so a recomputed block's saved tensors
// are bit-identical to the ones a taped forward keeps, and every schedule gives the same
// gradients. Sizes are pure functions of the shape; nothing here allocates.
#pragma once

#include <array>
#include <cstddef>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>

#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/core/parallel.hpp"
#include "membound/layers/layer_support.hpp"
#include "membound/memory/workspace.hpp"
#include "membound/model/glue.hpp"
#include "membound/model/mixer_traits.hpp"

MEMBOUND_NAMESPACE_BEGIN

enum class forward_mode : unsigned char { advance, tape, retape };

namespace detail {

// Pre-norm residual around one layer: y = x + L(RMSNorm(x)).
template <typename Layer>
struct part {
  using traits = mixer_traits<Layer>;
  using shape_type = typename traits::shape_type;
  using S = typename Layer::storage_type;
  using A = typename Layer::accum_type;
  using glue = model_glue_of<typename Layer::backend>;
  using executor = typename Layer::executor;
  static constexpr std::size_t param_count = traits::param_count + 1;  // norm scale first
  static constexpr bool reports_stats = std::is_same_v<shape_type, moe_shape>;

  struct dims {
    std::size_t rows = 0, width = 0;
    double eps = 1e-5;
    shape_type layer{};
  };
  using weight_ptrs = std::array<const S*, param_count>;
  using grad_ptrs = std::array<S*, param_count>;

  static constexpr std::size_t act_bytes(const dims& d) noexcept { return bytes_of<S>(d.rows, d.width); }
  static constexpr std::size_t rstd_bytes(const dims& d) noexcept { return bytes_of<A>(d.rows); }

  enum saved_slot : std::size_t { s_rstd, s_layer };
  static constexpr workspace_layout<2> saved_layout(const dims& d) {
    workspace_layout<2> l;
    l.add(rstd_bytes(d));
    l.add(Layer::saved_bytes(d.layer));
    return l;
  }
  static constexpr std::size_t saved_bytes(const dims& d) { return saved_layout(d).size(); }

  // keep: the rstd and the layer's saved tensors go to `saved`; otherwise to the workspace.
  // Phases: 0 the norm, 1 the layer, 2 the residual add.
  enum forward_slot : std::size_t { f_n, f_rstd, f_saved, f_ws, f_m };
  static constexpr workspace_layout<5> forward_layout(const dims& d, std::size_t threads, bool keep) {
    workspace_layout<5> l;
    l.add(act_bytes(d), default_alignment, {0, 1});
    l.add(keep ? 0 : rstd_bytes(d), default_alignment, {0, 0});
    l.add(keep ? 0 : Layer::saved_bytes(d.layer), default_alignment, {1, 1});
    l.add(Layer::forward_workspace_bytes(d.layer, threads), default_alignment, {1, 1});
    l.add(act_bytes(d), default_alignment, {1, 2});
    return l;
  }
  // Phases: 0 the norm again (from x and rstd), 1 the layer's backward, 2 the norm's backward.
  enum backward_slot : std::size_t { b_n, b_ws, b_dn, b_partial };
  static constexpr workspace_layout<4> backward_layout(const dims& d, std::size_t threads) {
    workspace_layout<4> l;
    l.add(act_bytes(d), default_alignment, {0, 1});
    l.add(Layer::backward_workspace_bytes(d.layer, threads), default_alignment, {1, 1});
    l.add(act_bytes(d), default_alignment, {1, 2});
    l.add(glue::template norm_backward_scratch_bytes<A, S>(d.rows, d.width), default_alignment, {2, 2});
    return l;
  }

  static auto layer_weights(const weight_ptrs& p) noexcept {
    std::array<const S*, traits::param_count> q{};
    for (std::size_t i = 0; i < q.size(); ++i) q[i] = p[i + 1];
    return traits::bind(q);
  }
  static auto layer_grads(const grad_ptrs& p) noexcept {
    std::array<S*, traits::param_count> q{};
    for (std::size_t i = 0; i < q.size(); ++i) q[i] = p[i + 1];
    return traits::bind(q);
  }

  // y = x + L(RMSNorm(x)). `saved` is used only when keep. A layer that reports what it did
  // (moe_mlp's moe_stats) writes into `stats` when it is given.
  static void forward(const dims& d, const weight_ptrs& w, const S* x, S* y, void* saved,
                      void* workspace, bool keep, executor& ex, moe_stats* stats = nullptr) {
    const std::size_t threads = workspace_threads(ex);
    const auto fl = forward_layout(d, threads, keep);
    const auto ws = carve(fl, workspace, fl.size());
    S* n = ws.template get<S>(f_n);
    A* rstd;
    void* lsaved;
    if (keep) {
      const auto sl = saved_layout(d);
      const auto sv = carve(sl, saved, sl.size());
      rstd = sv.template get<A>(s_rstd);
      lsaved = sv.template get<std::byte>(s_layer);
    } else {
      rstd = ws.template get<A>(f_rstd);
      lsaved = ws.template get<std::byte>(f_saved);
    }
    glue::template rmsnorm_forward<A>(ex, x, w[0], n, rstd, d.rows, d.width, d.eps);
    S* m = ws.template get<S>(f_m);
    void* lws = ws.template get<std::byte>(f_ws);
    const std::size_t lwsb = Layer::forward_workspace_bytes(d.layer, threads);
    if constexpr (reports_stats) {
      Layer::forward(d.layer, layer_weights(w), n, m, lsaved, Layer::saved_bytes(d.layer), lws, lwsb, ex, stats);
    } else {
      (void)stats;
      Layer::forward(d.layer, layer_weights(w), n, m, lsaved, Layer::saved_bytes(d.layer), lws, lwsb, ex);
    }
    glue::template add_rows<A>(ex, x, m, y, d.rows, d.width);
  }

  // ---- Decoding: one token per row, the layer's state carried in `state` -----------------------
  // Phases: 0 the norm, 1 the layer's step, 2 the residual add (as forward's, without saved).
  enum decode_slot : std::size_t { d_n, d_rstd, d_ws, d_m };
  static constexpr workspace_layout<4> decode_layout(const dims& d, std::size_t max_len, std::size_t threads) {
    workspace_layout<4> l;
    l.add(act_bytes(d), default_alignment, {0, 1});
    l.add(rstd_bytes(d), default_alignment, {0, 0});
    l.add(traits::decode_workspace_bytes(d.layer, max_len, threads), default_alignment, {1, 1});
    l.add(act_bytes(d), default_alignment, {1, 2});
    return l;
  }
  // y = x + L.step(RMSNorm(x)) at `position`; d.rows = the sequences, d.layer's batch the same.
  static void decode_step(const dims& d, const weight_ptrs& w, void* state, std::size_t state_size,
                          std::size_t max_len, std::size_t position, const S* x, S* y, void* workspace,
                          executor& ex) {
    const std::size_t threads = workspace_threads(ex);
    const auto dl = decode_layout(d, max_len, threads);
    const auto ws = carve(dl, workspace, dl.size());
    S* n = ws.template get<S>(d_n);
    S* m = ws.template get<S>(d_m);
    glue::template rmsnorm_forward<A>(ex, x, w[0], n, ws.template get<A>(d_rstd), d.rows, d.width, d.eps);
    traits::decode_step(d.layer, layer_weights(w), state, state_size, max_len, position, n, m,
                        ws.template get<std::byte>(d_ws), traits::decode_workspace_bytes(d.layer, max_len, threads), ex);
    glue::template add_rows<A>(ex, x, m, y, d.rows, d.width);
  }

  // dx = dy + RMSNorm'ᵀ(L'ᵀ(dy)); gradients accumulate.
  static void backward(const dims& d, const weight_ptrs& w, const grad_ptrs& g, const S* x,
                       const void* saved, const S* dy, S* dx, void* workspace, executor& ex) {
    const std::size_t threads = workspace_threads(ex);
    const auto bl = backward_layout(d, threads);
    const auto ws = carve(bl, workspace, bl.size());
    const auto sl = saved_layout(d);
    const auto sv = carve(sl, const_cast<void*>(saved), sl.size());
    const A* rstd = sv.template get<A>(s_rstd);
    S* n = ws.template get<S>(b_n);
    glue::template rmsnorm_apply<A>(ex, x, w[0], rstd, n, d.rows, d.width);
    S* dn = ws.template get<S>(b_dn);
    Layer::backward(d.layer, layer_weights(w), n, sv.template get<std::byte>(s_layer), Layer::saved_bytes(d.layer), dy,
                    dn, layer_grads(g), ws.template get<std::byte>(b_ws), Layer::backward_workspace_bytes(d.layer, threads),
                    ex);
    glue::template rmsnorm_backward<A>(ex, x, w[0], rstd, dn, dy, dx, g[0], ws.template get<std::byte>(b_partial),
                                       d.rows, d.width);
  }
};

}  // namespace detail

// A block's feed-forward: the layer template it instantiates with the mixer's precision and
// backend. swiglu_ffn, the dense SwiGLU MLP, is the default; moe_ffn takes model_config::moe.
struct swiglu_ffn {
  template <typename Precision, typename Backend>
  using layer = swiglu_mlp<Precision, Backend>;
};
struct moe_ffn {
  template <typename Precision, typename Backend>
  using layer = moe_mlp<Precision, Backend>;
};
template <typename F>
concept block_feed_forward = requires { typename F::template layer<fp32_precision, cpu_backend>; };

namespace detail {
template <typename Mixer, typename FeedForward>
struct block_name {
  static constexpr const char* value = mixer_traits<Mixer>::name;
};
template <typename Mixer>
struct block_name<Mixer, moe_ffn> {
  static constexpr std::size_t n = std::char_traits<char>::length(mixer_traits<Mixer>::name);
  static constexpr std::array<char, n + 5> chars = [] {
    std::array<char, n + 5> a{};
    for (std::size_t i = 0; i < n; ++i) a[i] = mixer_traits<Mixer>::name[i];
    const char suffix[] = "_moe";
    for (std::size_t i = 0; i < 5; ++i) a[n + i] = suffix[i];
    return a;
  }();
  static constexpr const char* value = chars.data();
};
}  // namespace detail

// The user's spelling: block<ttt_linear<>>, block<attention<bf16_precision>>, block<mamba<>>,
// block<attention<>, moe_ffn> (a mixture-of-experts feed-forward).
template <block_mixer Mixer, block_feed_forward FeedForward = swiglu_ffn>
class block {
 public:
  using mixer = Mixer;
  using feed_forward = FeedForward;
  using storage_type = typename Mixer::storage_type;
  using accum_type = typename Mixer::accum_type;
  // The MLP runs where the mixer runs; so does the block's glue (model/glue.hpp).
  using backend = typename Mixer::backend;
  using executor = typename backend::executor;
  using mlp = typename FeedForward::template layer<precision<storage_type, accum_type>, backend>;

 private:
  using S = storage_type;
  using A = accum_type;
  using part1 = detail::part<Mixer>;
  using part2 = detail::part<mlp>;
  static constexpr bool decodes = requires(const typename part1::shape_type& s) {
    mixer_traits<Mixer>::decode_state_bytes(s, std::size_t{});
  };

 public:
  // The mixer's name, "_moe" after it with a mixture of experts ("attention_moe"): the block's
  // name in parameter names, plan tables and model::mixer_index.
  static constexpr const char* name = detail::block_name<Mixer, FeedForward>::value;
  static constexpr std::size_t param_count = part1::param_count + part2::param_count;

  // What this block computes, as text: two blocks with the same identity (whatever their C++
  // types) read the same weights the same way. "attention<bf16/fp32, tiles 64x64, causal, rope>
  // + swiglu<bf16/fp32>".
  static std::string identity(const model_config& c) {
    return mixer_traits<Mixer>::identity(c) + " + " + mixer_traits<mlp>::identity(c);
  }
  using weight_ptrs = std::array<const S*, param_count>;
  using grad_ptrs = std::array<S*, param_count>;

  struct dims {
    typename part1::dims p1;
    typename part2::dims p2;
    batch_shape shape;
    std::size_t width = 0;
  };
  static constexpr dims make_dims(const model_config& c, batch_shape b) {
    dims d;
    d.shape = b;
    d.width = c.width;
    d.p1 = {b.tokens(), c.width, c.norm_eps, mixer_traits<Mixer>::shape(c, b)};
    d.p2 = {b.tokens(), c.width, c.norm_eps, mixer_traits<mlp>::shape(c, b)};
    return d;
  }
  // The feed-forward's FLOPs on the block's shape (a mixture's: its worst routing, moe_rows).
  static constexpr double feed_forward_flops(const dims& d) noexcept {
    return mixer_traits<mlp>::flops(d.p2.layer);
  }
  // Backward weighs a mixture's balancing loss as the model weighs the step's loss (its
  // loss_scale); nothing for a dense block.
  static constexpr void scale_aux_loss(dims& d, double loss_scale) noexcept {
    if constexpr (part2::reports_stats) {
      d.p2.layer.aux_loss_weight *= loss_scale;
    } else {
      (void)d;
      (void)loss_scale;
    }
  }

  // A mixture computes every choice (inference: model::next_token_logits); a dense block is as it is.
  static constexpr void without_capacity(dims& d) noexcept {
    if constexpr (part2::reports_stats) {
      d.p2.layer.capacity_factor = 0.0;
    } else {
      (void)d;
    }
  }

  // ---- Decoding: one token per sequence (model::decode_step) -----------------------------------
  // The dims of a decoding step over `batch` sequences: one position each; a mixture computes
  // every choice (as next_token_logits: a lone token would otherwise find no slot).
  static constexpr dims decode_dims(const model_config& c, std::size_t batch) {
    dims d = make_dims(c, {batch, 1});
    without_capacity(d);
    return d;
  }
  // The mixer's state for sequences up to max_len positions (a KV cache; Mamba's and TTT's are
  // the same at any length).
  static constexpr std::size_t decode_state_bytes(const dims& d, std::size_t max_len) {
    static_assert(decodes, "membound: decoding through block<M> needs mixer_traits<M>::decode_state_bytes, "
                           "decode_workspace_bytes, start_decoding and decode_step (see model/mixer_traits.hpp).");
    return mixer_traits<Mixer>::decode_state_bytes(d.p1.layer, max_len);
  }
  // Phase 0 the mixer half (its state stepped), phase 1 the MLP half (forward over one row each).
  enum decode_slot : std::size_t { d_h, d_p1, d_p2 };
  static constexpr workspace_layout<3> decode_layout(const dims& d, std::size_t max_len, std::size_t threads) {
    workspace_layout<3> l;
    l.add(activation_bytes(d), default_alignment, {0, 1});
    l.add(part1::decode_layout(d.p1, max_len, threads).size(), default_alignment, {0, 0});
    l.add(part2::forward_layout(d.p2, threads, false).size(), default_alignment, {1, 1});
    return l;
  }
  static constexpr std::size_t decode_workspace_bytes(const dims& d, std::size_t max_len, std::size_t threads) {
    return decode_layout(d, max_len, threads).size();
  }
  // The mixer's state over decode_state_bytes(d, max_len) bytes at `state`, ready for position 0.
  static void start_decoding(const dims& d, const weight_ptrs& w, void* state, std::size_t state_size,
                             std::size_t max_len, executor& ex) {
    mixer_traits<Mixer>::start_decoding(d.p1.layer, part1::layer_weights(first(w)), state, state_size, max_len, ex);
  }
  // y [B, C] from x [B, C] at `position` (< max_len), the mixer's state advanced by one.
  static void decode_step(const dims& d, const weight_ptrs& w, void* state, std::size_t state_size,
                          std::size_t max_len, std::size_t position, const S* x, S* y, void* workspace,
                          executor& ex) {
    const std::size_t threads = workspace_threads(ex);
    const auto dl = decode_layout(d, max_len, threads);
    const auto ws = carve(dl, workspace, dl.size());
    S* h = ws.template get<S>(d_h);
    part1::decode_step(d.p1, first(w), state, state_size, max_len, position, x, h, ws.template get<std::byte>(d_p1), ex);
    part2::forward(d.p2, second(w), h, y, nullptr, ws.template get<std::byte>(d_p2), false, ex);
  }

  // Throws invalid_argument naming the mixer's or the MLP's shape argument.
  static void check(const dims& d) {
    Mixer::check(d.p1.layer);
    mlp::check(d.p2.layer);
  }
  static constexpr layer_support can_implement(const dims& d) noexcept {
    const layer_support r = Mixer::can_implement(d.p1.layer);
    return r.ok ? mlp::can_implement(d.p2.layer) : r;
  }

  // Norm 1, the mixer's tensors, norm 2, the MLP's tensors.
  static constexpr std::array<param_spec, param_count> params(const dims& d) {
    std::array<param_spec, param_count> p{};
    p[0] = {"norm1", d.width, param_init::constant, 1.0, 0};
    const auto m = mixer_traits<Mixer>::params(d.p1.layer);
    for (std::size_t i = 0; i < m.size(); ++i) p[1 + i] = m[i];
    p[part1::param_count] = {"norm2", d.width, param_init::constant, 1.0, 0};
    const auto f = mixer_traits<mlp>::params(d.p2.layer);
    for (std::size_t i = 0; i < f.size(); ++i) p[part1::param_count + 1 + i] = f[i];
    return p;
  }

  // ---- Sizes ----------------------------------------------------------------------------------
  static constexpr std::size_t activation_bytes(const dims& d) noexcept {
    return bytes_of<S>(d.shape.tokens(), d.width);
  }
  enum saved_slot : std::size_t { s_p1, s_h, s_p2 };
  static constexpr workspace_layout<3> saved_layout(const dims& d) {
    workspace_layout<3> l;
    l.add(part1::saved_bytes(d.p1));
    l.add(activation_bytes(d));
    l.add(part2::saved_bytes(d.p2));
    return l;
  }
  static constexpr std::size_t saved_bytes(const dims& d) { return saved_layout(d).size(); }

  // Phase 0 the mixer half, phase 1 the MLP half.
  enum forward_slot : std::size_t { f_p1, f_h, f_p2, f_y };
  static constexpr workspace_layout<4> forward_layout(const dims& d, std::size_t threads,
                                                      forward_mode mode) {
    const bool keep = mode != forward_mode::advance;
    workspace_layout<4> l;
    l.add(part1::forward_layout(d.p1, threads, keep).size(), default_alignment, {0, 0});
    l.add(keep ? 0 : activation_bytes(d), default_alignment, {0, 1});
    l.add(part2::forward_layout(d.p2, threads, keep).size(), default_alignment, {1, 1});
    l.add(mode == forward_mode::retape ? activation_bytes(d) : 0, default_alignment, {1, 1});
    return l;
  }
  static constexpr std::size_t forward_workspace_bytes(const dims& d, std::size_t threads,
                                                       forward_mode mode) {
    return forward_layout(d, threads, mode).size();
  }
  // Phase 0 the MLP half, phase 1 the mixer half; dh lives across both.
  enum backward_slot : std::size_t { b_dh, b_p2, b_p1 };
  static constexpr workspace_layout<3> backward_layout(const dims& d, std::size_t threads) {
    workspace_layout<3> l;
    l.add(activation_bytes(d), default_alignment, {0, 1});
    l.add(part2::backward_layout(d.p2, threads).size(), default_alignment, {0, 0});
    l.add(part1::backward_layout(d.p1, threads).size(), default_alignment, {1, 1});
    return l;
  }
  static constexpr std::size_t backward_workspace_bytes(const dims& d, std::size_t threads) {
    return backward_layout(d, threads).size();
  }

  // ---- Run -------------------------------------------------------------------------------------
  // y: the output (ignored under retape, which computes it in the workspace); saved: the block's
  // saved_bytes (ignored under advance); stats (optional): what a mixture of experts did.
  static void forward(const dims& d, const weight_ptrs& w, const S* x, S* y, void* saved,
                      void* workspace, forward_mode mode, executor& ex, moe_stats* stats = nullptr) {
    const std::size_t threads = workspace_threads(ex);
    const bool keep = mode != forward_mode::advance;
    const auto fl = forward_layout(d, threads, mode);
    const auto ws = carve(fl, workspace, fl.size());
    S* h;
    void* sv1 = nullptr;
    void* sv2 = nullptr;
    if (keep) {
      const auto sl = saved_layout(d);
      const auto sv = carve(sl, saved, sl.size());
      h = sv.template get<S>(s_h);
      sv1 = sv.template get<std::byte>(s_p1);
      sv2 = sv.template get<std::byte>(s_p2);
    } else {
      h = ws.template get<S>(f_h);
    }
    if (mode == forward_mode::retape) y = ws.template get<S>(f_y);
    part1::forward(d.p1, first(w), x, h, sv1, ws.template get<std::byte>(f_p1), keep, ex);
    part2::forward(d.p2, second(w), h, y, sv2, ws.template get<std::byte>(f_p2), keep, ex, stats);
  }

  static void backward(const dims& d, const weight_ptrs& w, const grad_ptrs& g, const S* x,
                       const void* saved, const S* dy, S* dx, void* workspace, executor& ex) {
    const std::size_t threads = workspace_threads(ex);
    const auto bl = backward_layout(d, threads);
    const auto ws = carve(bl, workspace, bl.size());
    const auto sl = saved_layout(d);
    const auto sv = carve(sl, const_cast<void*>(saved), sl.size());
    S* dh = ws.template get<S>(b_dh);
    part2::backward(d.p2, second(w), second(g), sv.template get<S>(s_h), sv.template get<std::byte>(s_p2), dy, dh,
                    ws.template get<std::byte>(b_p2), ex);
    part1::backward(d.p1, first(w), first(g), x, sv.template get<std::byte>(s_p1), dh, dx, ws.template get<std::byte>(b_p1), ex);
  }

 private:
  template <typename T>
  static std::array<T*, part1::param_count> first(const std::array<T*, param_count>& p) noexcept {
    std::array<T*, part1::param_count> q{};
    for (std::size_t i = 0; i < q.size(); ++i) q[i] = p[i];
    return q;
  }
  template <typename T>
  static std::array<T*, part2::param_count> second(const std::array<T*, param_count>& p) noexcept {
    std::array<T*, part2::param_count> q{};
    for (std::size_t i = 0; i < q.size(); ++i) q[i] = p[part1::param_count + i];
    return q;
  }
};

template <typename T>
inline constexpr bool is_block_v = false;
template <typename M, typename F>
inline constexpr bool is_block_v<block<M, F>> = true;

MEMBOUND_NAMESPACE_END
