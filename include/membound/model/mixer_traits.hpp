// How a block drives its sequence mixer: the mixer's shape from the model's sizes, its parameter
// tensors (name, size, initialization) in the order of its `weights` struct, the binding of a
// flat parameter list to that struct, and its identity: the family and every policy or fixed
// setting that changes what it computes (a checkpoint's fingerprint compares it); for a sequence
// mixer, its decoding state (sizes, start, one step over the model's bytes). One specialization
// per layer family; a new mixer plugs into blocks by providing one.
#pragma once

#include <array>
#include <cmath>
#include <cstddef>
#include <string>
#include <type_traits>

#include "membound/core/checked_math.hpp"
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/core/format.hpp"
#include "membound/layers/attention.hpp"
#include "membound/layers/mamba.hpp"
#include "membound/layers/moe_mlp.hpp"
#include "membound/layers/swiglu_mlp.hpp"
#include "membound/layers/ttt.hpp"
#include "membound/model/model_config.hpp"

MEMBOUND_NAMESPACE_BEGIN

template <typename Mixer>
struct mixer_traits;  // no definition: see the concept below for what to provide

// What a block needs from a mixer type. A type without a mixer_traits specialization fails here
// with the name of this concept in the message.
template <typename M>
concept block_mixer = requires {
  typename mixer_traits<M>::shape_type;
  { mixer_traits<M>::param_count } -> std::convertible_to<std::size_t>;
  { mixer_traits<M>::name } -> std::convertible_to<const char*>;
  { mixer_traits<M>::identity(model_config{}) } -> std::convertible_to<std::string>;
  typename M::storage_type;
  typename M::accum_type;
};

namespace detail {
// Weights are drawn N(0, 0.02²) as GPT-2 and llm.c do; output projections the same (the model is
// shallow enough that the residual scaling does not matter for the tests' conditioning).
inline constexpr double init_std = 0.02;

// "bf16/fp32": storage, then accumulation, by type (bf16 and fp16 have the same size).
template <typename Layer>
std::string precision_identity() {
  return std::string(dtype_name<typename Layer::storage_type>()) + "/" +
         std::string(dtype_name<typename Layer::accum_type>());
}
}  // namespace detail

template <typename... P>
struct mixer_traits<attention<P...>> {
  using layer = attention<P...>;
  using shape_type = attention_shape;
  using S = typename layer::storage_type;
  // A local_attention layer is its own block type: its parameters are named after it, and a
  // pattern mixes it with global layers.
  static constexpr const char* name = layer::local ? "local_attention" : "attention";
  static constexpr std::size_t param_count = 4;

  // The tiles set the order of the online softmax's sums; a local layer's window sets its keys.
  // The checkpoint policy is left out on purpose: save_all keeps the q, k, v that recompute would
  // rebuild bit for bit, so it changes memory only and a resumed run may switch it.
  static std::string identity(const model_config& c) {
    return std::string(name) + "<" + detail::precision_identity<layer>() + ", tiles " +
           std::to_string(layer::tiles::q_tile) + "x" + std::to_string(layer::tiles::kv_tile) +
           ", causal" + (layer::local ? ", window " + std::to_string(c.attention_window) : std::string()) +
           ", rope>";
  }

  static constexpr shape_type shape(const model_config& c, batch_shape b) noexcept {
    shape_type s;
    s.batch = b.batch;
    s.seq = b.seq;
    s.d_model = c.width;
    s.heads = c.heads;
    s.kv_heads = c.kv();
    s.head_dim = c.heads == 0 ? 0 : c.width / c.heads;
    s.causal = true;
    s.rope_base = c.rope_base;
    s.window = layer::local ? c.attention_window : 0;
    s.offsets = b.offsets;
    s.sequences = b.sequences;
    return s;
  }
  static constexpr std::array<param_spec, param_count> params(const shape_type& s) noexcept {
    const std::size_t HD = sat_mul(s.heads, s.head_dim), KD = sat_mul(s.kv_heads, s.head_dim), C = s.d_model;
    return {{{"wq", sat_mul(C, HD), param_init::normal, detail::init_std, 0},
             {"wk", sat_mul(C, KD), param_init::normal, detail::init_std, 0},
             {"wv", sat_mul(C, KD), param_init::normal, detail::init_std, 0},
             {"wo", sat_mul(HD, C), param_init::normal, detail::init_std, 0}}};
  }
  template <typename T>
  static auto bind(const std::array<T*, param_count>& p) noexcept {
    if constexpr (std::is_const_v<T>) {
      return typename layer::weights{p[0], p[1], p[2], p[3]};
    } else {
      return typename layer::gradients{p[0], p[1], p[2], p[3]};
    }
  }

  // Decoding (model::decode_step): the KV cache of max_len positions (the window's under one).
  static constexpr std::size_t decode_state_bytes(const shape_type& s, std::size_t max_len) noexcept {
    return layer::kv_cache_bytes(s, max_len);
  }
  static constexpr std::size_t decode_workspace_bytes(const shape_type& s, std::size_t max_len,
                                                      std::size_t threads) noexcept {
    return layer::step_workspace_bytes(s, max_len, threads);
  }
  // Nothing to write: a cache is empty at length 0. Checks the bytes.
  static void start_decoding(const shape_type& s, const typename layer::weights&, void* data, std::size_t bytes,
                             std::size_t max_len, typename layer::executor&) {
    (void)layer::make_kv_cache(s, data, bytes, max_len);
  }
  static void decode_step(const shape_type& s, const typename layer::weights& w, void* data, std::size_t bytes,
                          std::size_t max_len, std::size_t position, const S* x_t, S* y_t, void* workspace,
                          std::size_t workspace_size, typename layer::executor& ex) {
    typename layer::kv_cache cache{data, bytes, max_len, position};
    layer::step(s, w, cache, x_t, y_t, workspace, workspace_size, ex);
  }
};

template <typename... P>
struct mixer_traits<mamba<P...>> {
  using layer = mamba<P...>;
  using shape_type = mamba_shape;
  using S = typename layer::storage_type;
  static constexpr const char* name = "mamba";
  static constexpr std::size_t param_count = 9;

  // The scan chunk, and the settings mamba_shape::defaults fixes (not the model_config's): state
  // size, convolution width, expansion. The checkpoint policy changes memory only (see attention).
  static std::string identity(const model_config& c) {
    const shape_type s = shape(c, {1, 1});
    const std::size_t expand = s.d_model == 0 ? 0 : s.d_inner / s.d_model;
    return std::string(name) + "<" + detail::precision_identity<layer>() + ", scan chunk " +
           std::to_string(layer::chunk) + ", d_state " + std::to_string(s.d_state) + ", d_conv " +
           std::to_string(s.d_conv) + ", expand " + std::to_string(expand) + ">";
  }

  static constexpr shape_type shape(const model_config& c, batch_shape b) noexcept {
    shape_type s = mamba_shape::defaults(b.batch, b.seq, c.width);
    s.offsets = b.offsets;
    s.sequences = b.sequences;
    return s;
  }
  static constexpr std::array<param_spec, param_count> params(const shape_type& s) noexcept {
    const std::size_t C = s.d_model, Di = s.d_inner, Ns = s.d_state, R = s.dt_rank;
    // conv taps: mamba_simple leaves nn.Conv1d's default, uniform ±1/√K; a normal of the same
    // variance (1/(3K)) keeps our initializer set small.
    const double conv_std = 1.0 / std::sqrt(3.0 * static_cast<double>(s.d_conv));
    const double dt_std = 1.0 / std::sqrt(static_cast<double>(R));  // dt_init "random", scaled
    return {{{"in_proj", sat_mul(sat_mul(C, 2), Di), param_init::normal, detail::init_std, 0},
             {"conv_w", sat_mul(Di, s.d_conv), param_init::normal, conv_std, 0},
             {"conv_b", Di, param_init::constant, 0.0, 0},
             {"x_proj", sat_mul(Di, sat_add(R, sat_mul(2, Ns))), param_init::normal, detail::init_std, 0},
             {"dt_proj", sat_mul(R, Di), param_init::normal, dt_std / std::sqrt(3.0), 0},
             {"dt_bias", Di, param_init::mamba_dt_bias, 0.0, 0},
             {"a_log", sat_mul(Di, Ns), param_init::mamba_a_log, 0.0, Ns},
             {"d", Di, param_init::constant, 1.0, 0},
             {"out_proj", sat_mul(Di, C), param_init::normal, detail::init_std, 0}}};
  }
  template <typename T>
  static auto bind(const std::array<T*, param_count>& p) noexcept {
    if constexpr (std::is_const_v<T>) {
      return typename layer::weights{p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], p[8]};
    } else {
      return typename layer::gradients{p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], p[8]};
    }
  }
  // Decoding: the convolution's last inputs and the scan's state, whatever the length.
  static constexpr std::size_t decode_state_bytes(const shape_type& s, std::size_t) noexcept {
    return layer::state_bytes(s);
  }
  static constexpr std::size_t decode_workspace_bytes(const shape_type& s, std::size_t, std::size_t) noexcept {
    return layer::step_workspace_bytes(s);
  }
  // Zeroed on the executor (a device state on its stream).
  static void start_decoding(const shape_type& s, const typename layer::weights&, void* data, std::size_t bytes,
                             std::size_t, typename layer::executor& ex) {
    (void)layer::make_state(s, data, bytes, ex);
  }
  static void decode_step(const shape_type& s, const typename layer::weights& w, void* data, std::size_t bytes,
                          std::size_t, std::size_t position, const S* x_t, S* y_t, void* workspace,
                          std::size_t workspace_size, typename layer::executor& ex) {
    typename layer::state st{data, bytes, position};
    layer::step(s, w, st, x_t, y_t, workspace, workspace_size, ex);
  }
};

template <bool Mlp, typename... P>
struct mixer_traits<basic_ttt<Mlp, P...>> {
  using layer = basic_ttt<Mlp, P...>;
  using shape_type = ttt_shape;
  using S = typename layer::storage_type;
  static constexpr const char* name = Mlp ? "ttt_mlp" : "ttt_linear";
  static constexpr std::size_t param_count = Mlp ? 16 : 14;

  // The inner model (the name), its mini-batch (one inner step per b tokens) and the gate. The
  // checkpoint groups change memory only: a group's states are recomputed bit for bit.
  static std::string identity(const model_config& c) {
    return std::string(name) + "<" + detail::precision_identity<layer>() + ", mini-batch " +
           std::to_string(layer::mini_batch) + (shape(c, {1, 1}).use_gate ? ", gated" : ", no gate") + ">";
  }

  static constexpr shape_type shape(const model_config& c, batch_shape b) noexcept {
    shape_type s;
    s.batch = b.batch;
    s.seq = b.seq;
    s.width = c.width;
    s.heads = c.heads;
    s.use_gate = false;
    s.base_lr = c.ttt_base_lr;
    s.rope_base = c.rope_base;
    s.offsets = b.offsets;
    s.sequences = b.sequences;
    return s;
  }
  static constexpr std::array<param_spec, param_count> params(const shape_type& s) noexcept {
    const std::size_t C = s.width, H = s.heads, D = s.head_dim(), F = layer::hidden(s);
    const std::size_t b = layer::mini_batch;
    // The gate is unused (use_gate = false) but the layer's weights name it: zero elements.
    std::array<param_spec, param_count> p{};
    const param_spec common[14] = {
        {"wq", sat_mul(C, C), param_init::normal, detail::init_std, 0},
        {"wk", sat_mul(C, C), param_init::normal, detail::init_std, 0},
        {"wv", sat_mul(C, C), param_init::normal, detail::init_std, 0},
        {"ttt_norm_w", sat_mul(H, D), param_init::constant, 1.0, 0},
        {"ttt_norm_b", sat_mul(H, D), param_init::constant, 0.0, 0},
        {"w1", sat_mul(sat_mul(H, D), F), param_init::normal, detail::init_std, 0},
        {"b1", sat_mul(H, F), param_init::constant, 0.0, 0},
        {"lr_w", sat_mul(H, C), param_init::normal, detail::init_std, 0},
        {"lr_b", H, param_init::constant, 0.0, 0},
        {"tok_offset", b, param_init::constant, 0.0, 0},
        {"post_w", C, param_init::constant, 1.0, 0},
        {"post_b", C, param_init::constant, 0.0, 0},
        {"wg", 0, param_init::constant, 0.0, 0},
        {"wo", sat_mul(C, C), param_init::normal, detail::init_std, 0}};
    for (std::size_t i = 0; i < 14; ++i) p[i] = common[i];
    if constexpr (Mlp) {
      p[14] = {"w2", sat_mul(sat_mul(H, F), D), param_init::normal, detail::init_std, 0};
      p[15] = {"b2", sat_mul(H, D), param_init::constant, 0.0, 0};
    }
    return p;
  }
  template <typename T>
  static auto bind(const std::array<T*, param_count>& p) noexcept {
    using R = std::conditional_t<std::is_const_v<T>, typename layer::weights,
                                 typename layer::gradients>;
    R r{};
    r.wq = p[0];
    r.wk = p[1];
    r.wv = p[2];
    r.ttt_norm_w = p[3];
    r.ttt_norm_b = p[4];
    r.w1 = p[5];
    r.b1 = p[6];
    r.lr_w = p[7];
    r.lr_b = p[8];
    r.tok_offset = p[9];
    r.post_w = p[10];
    r.post_b = p[11];
    r.wg = p[12];
    r.wo = p[13];
    if constexpr (Mlp) {
      r.w2 = p[14];
      r.b2 = p[15];
    }
    return r;
  }
  // Decoding: the inner model and the running sums of its mini-batch, whatever the length.
  static constexpr std::size_t decode_state_bytes(const shape_type& s, std::size_t) noexcept {
    return layer::state_bytes(s);
  }
  static constexpr std::size_t decode_workspace_bytes(const shape_type& s, std::size_t, std::size_t) noexcept {
    return layer::step_workspace_bytes(s);
  }
  // The inner model starts from the layer's W1, b1 (W2, b2), written on the executor.
  static void start_decoding(const shape_type& s, const typename layer::weights& w, void* data, std::size_t bytes,
                             std::size_t, typename layer::executor& ex) {
    (void)layer::make_state(s, w, data, bytes, ex);
  }
  static void decode_step(const shape_type& s, const typename layer::weights& w, void* data, std::size_t bytes,
                          std::size_t, std::size_t position, const S* x_t, S* y_t, void* workspace,
                          std::size_t workspace_size, typename layer::executor& ex) {
    typename layer::state st{data, bytes, position};
    layer::step(s, w, st, x_t, y_t, workspace, workspace_size, ex);
  }
};

template <typename... P>
struct mixer_traits<swiglu_mlp<P...>> {
  using layer = swiglu_mlp<P...>;
  using shape_type = mlp_shape;
  using S = typename layer::storage_type;
  static constexpr const char* name = "swiglu";
  static constexpr std::size_t param_count = 3;

  static std::string identity(const model_config&) {
    return std::string(name) + "<" + detail::precision_identity<layer>() + ">";
  }

  static constexpr shape_type shape(const model_config& c, batch_shape b) noexcept {
    return {b.batch, b.seq, c.width, c.hidden()};
  }
  // Forward FLOPs: three products of N × C × F.
  static constexpr double flops(const shape_type& s) noexcept {
    return 6.0 * static_cast<double>(s.batch * s.seq) * static_cast<double>(s.width) *
           static_cast<double>(s.hidden);
  }
  static constexpr std::array<param_spec, param_count> params(const shape_type& s) noexcept {
    return {{{"w_gate", sat_mul(s.width, s.hidden), param_init::normal, detail::init_std, 0},
             {"w_up", sat_mul(s.width, s.hidden), param_init::normal, detail::init_std, 0},
             {"w_down", sat_mul(s.hidden, s.width), param_init::normal, detail::init_std, 0}}};
  }
  template <typename T>
  static auto bind(const std::array<T*, param_count>& p) noexcept {
    if constexpr (std::is_const_v<T>) {
      return typename layer::weights{p[0], p[1], p[2]};
    } else {
      return typename layer::gradients{p[0], p[1], p[2]};
    }
  }
};

template <typename... P>
struct mixer_traits<moe_mlp<P...>> {
  using layer = moe_mlp<P...>;
  using shape_type = moe_shape;
  using S = typename layer::storage_type;
  static constexpr const char* name = "moe";
  static constexpr std::size_t param_count = 4;

  // Everything that changes what it computes: "moe<8 experts top-2 of swiglu 64, capacity
  // 1.25, renormalized, aux 0.01, bf16/fp32>".
  static std::string identity(const model_config& c) {
    return std::string(name) + "<" + std::to_string(c.moe.experts) + " experts top-" +
           std::to_string(c.moe.top_k) + " of swiglu " + std::to_string(c.expert_hidden()) +
           ", capacity " + shortest_text(c.moe.capacity_factor) +
           (c.moe.renormalize ? ", renormalized" : "") + ", aux " + shortest_text(c.moe.aux_loss_weight) +
           ", " + detail::precision_identity<layer>() + ">";
  }

  static constexpr shape_type shape(const model_config& c, batch_shape b) noexcept {
    return {b.batch, b.seq, c.width, c.expert_hidden(), c.moe.experts, c.moe.top_k,
            c.moe.capacity_factor, c.moe.renormalize, c.moe.aux_loss_weight};
  }
  // Forward FLOPs of the worst routing the capacity allows (moe_rows rows through the experts)
  // and the router's product.
  static constexpr double flops(const shape_type& s) noexcept {
    return 6.0 * static_cast<double>(moe_rows(s)) * static_cast<double>(s.width) * static_cast<double>(s.hidden) +
           2.0 * static_cast<double>(s.tokens()) * static_cast<double>(s.width) * static_cast<double>(s.experts);
  }
  static constexpr std::array<param_spec, param_count> params(const shape_type& s) noexcept {
    const std::size_t CF = sat_mul(s.width, s.hidden);
    return {{{"router", sat_mul(s.width, s.experts), param_init::normal, detail::init_std, 0},
             {"w_gate", sat_mul(s.experts, CF), param_init::normal, detail::init_std, 0},
             {"w_up", sat_mul(s.experts, CF), param_init::normal, detail::init_std, 0},
             {"w_down", sat_mul(s.experts, CF), param_init::normal, detail::init_std, 0}}};
  }
  template <typename T>
  static auto bind(const std::array<T*, param_count>& p) noexcept {
    if constexpr (std::is_const_v<T>) {
      return typename layer::weights{p[0], p[1], p[2], p[3]};
    } else {
      return typename layer::gradients{p[0], p[1], p[2], p[3]};
    }
  }
};

MEMBOUND_NAMESPACE_END
