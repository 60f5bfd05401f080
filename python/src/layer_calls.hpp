// The layer calls behind membound._layers (host) and membound._layers_cuda (device), over raw
// pointers: a call described at run time (spec) becomes the C++ layer, its shape and its weights
// struct, for the host backend or, with cuda_backend as an extra policy, the CUDA one. Nothing here
// knows Python or CUDA: layers.cpp instantiates it with the host's thread pools, layer_calls_cuda.cu
// with cuda_executor (under nvcc); layers_module.hpp checks the arrays and binds either.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "membound/membound.hpp"

namespace membound_python {

namespace mb = membound;

// One layer call as Python describes it; every field is checked by the layer's own check().
struct spec {
  std::string kind = "attention";  // attention | mamba | ttt_linear | ttt_mlp
  std::string dtype = "float32";   // float32 | float64 | bfloat16 (accumulating in float)
  std::size_t batch = 1, seq = 1, width = 0;
  std::size_t heads = 0, kv_heads = 0, head_dim = 0, window = 0;  // attention (heads: TTT too)
  bool causal = true;
  double rope_base = 10000.0;                                     // attention, TTT
  std::size_t d_inner = 0, d_state = 16, d_conv = 4, dt_rank = 0;  // mamba
  bool use_gate = false;                                          // TTT
  double base_lr = 1.0;
  std::size_t mini_batch = 16;
  std::size_t sequences = 0;  // packed sequences on one token axis (batch 1); 0: one per batch row
  std::size_t threads = 1;  // the host pool's size (its per-thread scratch is in the workspace)
  int device = 0;                // CUDA: the device of the call's tensors
  std::uintptr_t stream = 0;     // CUDA: the framework's current stream (0: its legacy default)
};

// A parameter in membound's layout ([in, out] matrices, row-major).
struct param {
  std::string name;
  std::vector<std::size_t> dims;
  std::size_t elements() const {
    std::size_t n = 1;
    for (std::size_t d : dims) n = mb::sat_mul(n, d);  // saturated: no array has SIZE_MAX elements
    return n;
  }
};

// The TTT mini-batch sizes the ops are built for: the layer's mini-batch is a compile-time policy
// (ttt_mini_batch<b>), so each size is one more instantiation of both TTT layers at each dtype.
// 16 is ttt-lm-pytorch's mini_batch_size; the others cover the TTT paper's ablations and video
// models' 64.
using ttt_mini_batch_sizes = std::index_sequence<1, 2, 4, 8, 16, 32, 64>;

template <std::size_t... Bs>
constexpr bool is_built_mini_batch(std::size_t b, std::index_sequence<Bs...>) {
  return ((b == Bs) || ...);
}

template <std::size_t... Bs>
std::vector<std::size_t> built_mini_batches(std::index_sequence<Bs...>) {
  return {Bs...};
}

inline std::size_t checked_mini_batch(const spec& s) {
  if (!is_built_mini_batch(s.mini_batch, ttt_mini_batch_sizes{})) {
    throw mb::invalid_argument("mini_batch", "1, 2, 4, 8, 16, 32 or 64 (the sizes the torch ops are built for)",
                               std::to_string(s.mini_batch),
                               "Use one of those, or the C++ layer with ttt_mini_batch<b> for another size");
  }
  return s.mini_batch;
}

// ---- The four families: shape, parameters, and the weight/gradient structs by name ----------------

// The shapes; offsets: the packed sequences' S + 1 offsets, or nullptr (unpacked, or a packed call
// only sized: the layers size the worst case of any packing of the tokens into spec.sequences).
inline mb::attention_shape attention_shape_of(const spec& s, const std::int32_t* offsets) {
  mb::attention_shape a;
  a.offsets = offsets, a.sequences = s.sequences;
  a.batch = s.batch, a.seq = s.seq, a.d_model = s.width, a.heads = s.heads, a.kv_heads = s.kv_heads;
  a.head_dim = s.head_dim, a.causal = s.causal, a.rope_base = s.rope_base, a.window = s.window;
  return a;
}
inline mb::mamba_shape mamba_shape_of(const spec& s, const std::int32_t* offsets) {
  mb::mamba_shape m;
  m.offsets = offsets, m.sequences = s.sequences;
  m.batch = s.batch, m.seq = s.seq, m.d_model = s.width, m.d_inner = s.d_inner, m.d_state = s.d_state;
  m.d_conv = s.d_conv, m.dt_rank = s.dt_rank;
  return m;
}
inline mb::ttt_shape ttt_shape_of(const spec& s, const std::int32_t* offsets) {
  (void)checked_mini_batch(s);
  mb::ttt_shape t;
  t.offsets = offsets, t.sequences = s.sequences;
  t.batch = s.batch, t.seq = s.seq, t.width = s.width, t.heads = s.heads, t.use_gate = s.use_gate;
  t.base_lr = s.base_lr, t.rope_base = s.rope_base;
  return t;
}

inline std::vector<param> parameters_of(const spec& s) {
  if (s.kind == "attention") {
    const std::size_t C = s.width, HD = s.heads * s.head_dim, KD = s.kv_heads * s.head_dim;
    return {{"wq", {C, HD}}, {"wk", {C, KD}}, {"wv", {C, KD}}, {"wo", {HD, C}}};
  }
  if (s.kind == "mamba") {
    const std::size_t C = s.width, Di = s.d_inner, N = s.d_state, R = s.dt_rank;
    return {{"in_proj", {C, 2 * Di}}, {"conv_w", {Di, s.d_conv}}, {"conv_b", {Di}},
            {"x_proj", {Di, R + 2 * N}}, {"dt_proj", {R, Di}}, {"dt_bias", {Di}},
            {"a_log", {Di, N}}, {"d", {Di}}, {"out_proj", {Di, C}}};
  }
  if (s.kind == "ttt_linear" || s.kind == "ttt_mlp") {
    const bool mlp = s.kind == "ttt_mlp";
    const std::size_t C = s.width, H = s.heads, D = H == 0 ? 0 : C / H, F = mlp ? 4 * D : D;
    std::vector<param> p{{"wq", {C, C}},         {"wk", {C, C}},     {"wv", {C, C}},
                         {"ttt_norm_w", {H, D}}, {"ttt_norm_b", {H, D}}, {"w1", {H, D, F}},
                         {"b1", {H, F}},         {"lr_w", {H, C}},   {"lr_b", {H}},
                         {"tok_offset", {checked_mini_batch(s)}}, {"post_w", {C}}, {"post_b", {C}}};
    if (s.use_gate) p.push_back({"wg", {C, C}});
    p.push_back({"wo", {C, C}});
    if (mlp) {
      p.push_back({"w2", {H, F, D}});
      p.push_back({"b2", {H, D}});
    }
    return p;
  }
  throw mb::invalid_argument("kind", "attention, mamba, ttt_linear or ttt_mlp", s.kind, "Name one of the four layers");
}

// Pointers by parameter name, in parameters_of's order.
template <typename P>
struct named {
  const std::vector<param>& params;
  const std::vector<P>& ptrs;
  P operator()(const char* name) const {
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (params[i].name == name) return ptrs[i];
    }
    return nullptr;  // an optional parameter the spec leaves out (TTT's wg, w2, b2)
  }
};

// The weights or the gradients struct (Out) of each family from pointers by name: both list the
// fields in the same order.
struct attention_fields {
  template <typename Out, typename P>
  static Out make(const named<P>& w) {
    return Out{w("wq"), w("wk"), w("wv"), w("wo")};
  }
};
struct mamba_fields {
  template <typename Out, typename P>
  static Out make(const named<P>& w) {
    return Out{w("in_proj"), w("conv_w"), w("conv_b"), w("x_proj"), w("dt_proj"), w("dt_bias"), w("a_log"),
               w("d"),       w("out_proj")};
  }
};
struct ttt_fields {
  template <typename Out, typename P>
  static Out make(const named<P>& w) {
    return Out{w("wq"),   w("wk"),   w("wv"),         w("ttt_norm_w"), w("ttt_norm_b"), w("w1"),
               w("b1"),   w("lr_w"), w("lr_b"),       w("tok_offset"), w("post_w"),     w("post_b"),
               w("wg"),   w("wo"),   w("w2"),         w("b2")};
  }
};


// Calls f.template operator()<Layer, Fields>(shape) for the spec's layer at precision P; Extra:
// nothing (the host backend) or cuda_backend.
template <typename P, typename... Extra>
struct layer_of {
  template <typename F, std::size_t B, std::size_t... Rest>
  static decltype(auto) ttt(const spec& s, const std::int32_t* offsets, F&& f, bool mlp,
                            std::index_sequence<B, Rest...>) {
    if constexpr (sizeof...(Rest) > 0) {
      if (s.mini_batch != B) return ttt(s, offsets, f, mlp, std::index_sequence<Rest...>{});
    }
    const mb::ttt_shape shape = ttt_shape_of(s, offsets);  // refuses a mini-batch that is not built
    using C = mb::ttt_mini_batch<B>;
    if (mlp) return f.template operator()<mb::ttt_mlp<P, C, Extra...>, ttt_fields>(shape);
    return f.template operator()<mb::ttt_linear<P, C, Extra...>, ttt_fields>(shape);
  }

  template <typename F>
  static decltype(auto) with(const spec& s, const std::int32_t* offsets, F&& f) {
    if (s.kind == "attention") {
      return f.template operator()<mb::attention<P, Extra...>, attention_fields>(attention_shape_of(s, offsets));
    }
    if (s.kind == "mamba") {
      return f.template operator()<mb::mamba<P, Extra...>, mamba_fields>(mamba_shape_of(s, offsets));
    }
    if (s.kind == "ttt_linear" || s.kind == "ttt_mlp") {
      return ttt(s, offsets, f, s.kind == "ttt_mlp", ttt_mini_batch_sizes{});
    }
    (void)parameters_of(s);  // throws, naming `kind`
    throw mb::invalid_argument("kind", "attention, mamba, ttt_linear or ttt_mlp", s.kind, "Name one of the four layers");
  }
};

// The dtypes a backend runs: fp64 stays on the host (the CUDA kernels accumulate in float).
template <typename... Extra>
inline constexpr bool runs_fp64 = sizeof...(Extra) == 0;

template <typename... Extra, typename F>
decltype(auto) with_precision(const spec& s, const std::int32_t* offsets, F&& f) {
  if (s.dtype == "float32") return layer_of<mb::fp32_precision, Extra...>::with(s, offsets, f);
  if constexpr (runs_fp64<Extra...>) {
    if (s.dtype == "float64") return layer_of<mb::fp64_precision, Extra...>::with(s, offsets, f);
  }
  if (s.dtype == "bfloat16") return layer_of<mb::bf16_precision, Extra...>::with(s, offsets, f);
  if (!runs_fp64<Extra...> && s.dtype == "float64") {
    throw mb::invalid_argument("dtype", "float32 or bfloat16 on CUDA", s.dtype,
                               "Cast to float32 (float64 runs on CPU tensors only)");
  }
  throw mb::invalid_argument("dtype", "float32, float64 or bfloat16", s.dtype, "Cast the input and the parameters");
}

// A byte buffer the layer checks itself: its size (workspace_too_small) and its 256-byte alignment.
struct bytes {
  void* data = nullptr;
  std::size_t size = 0;
};

// The parameters as the layer's weights (const) or gradients struct, from pointers in
// parameters_of's order (already checked by the caller: count, dtype, elements).
template <typename Out, typename Fields, typename P>
Out fields_of(const std::vector<param>& params, const std::vector<P>& ptrs) {
  return Fields::template make<Out>(named<P>{params, ptrs});
}

// One backend's calls. Exec is the backend's executor: mb::thread_pool or mb::cuda_executor.
template <typename... Extra>
struct layer_calls {
  // L::check for the spec's layer (the typed errors name the shape's fields), with the packed
  // sequences' offsets when the call has them.
  static void check(const spec& s, const std::int32_t* offsets) {
    with_precision<Extra...>(s, offsets, [&]<typename L, typename>(const auto& shape) { L::check(shape); });
  }

  // (saved, forward workspace, backward workspace) bytes.
  static std::tuple<std::size_t, std::size_t, std::size_t> sizes(const spec& s) {
    return with_precision<Extra...>(s, nullptr, [&]<typename L, typename>(const auto& shape) {
      L::check(shape);
      return std::tuple{L::saved_bytes(shape), L::forward_workspace_bytes(shape, s.threads),
                        L::backward_workspace_bytes(shape, s.threads)};
    });
  }

  template <typename Exec>
  static void forward(const spec& s, const std::int32_t* offsets, const void* x, const std::vector<const void*>& weights,
                      void* y, bytes saved, bytes workspace, Exec& ex) {
    const std::vector<param> params = parameters_of(s);
    with_precision<Extra...>(s, offsets, [&]<typename L, typename Fields>(const auto& shape) {
      using S = typename L::storage_type;
      const auto w = fields_of<typename L::weights, Fields>(params, typed<const S>(weights));
      L::forward(shape, w, static_cast<const S*>(x), static_cast<S*>(y), saved.data, saved.size, workspace.data,
                 workspace.size, ex);
    });
  }

  template <typename Exec>
  static void backward(const spec& s, const std::int32_t* offsets, const void* x, const std::vector<const void*>& weights,
                       bytes saved, const void* dy, void* dx, const std::vector<void*>& grads, bytes workspace,
                       Exec& ex) {
    const std::vector<param> params = parameters_of(s);
    with_precision<Extra...>(s, offsets, [&]<typename L, typename Fields>(const auto& shape) {
      using S = typename L::storage_type;
      const auto w = fields_of<typename L::weights, Fields>(params, typed<const S>(weights));
      const auto g = fields_of<typename L::gradients, Fields>(params, typed<S>(grads));
      L::backward(shape, w, static_cast<const S*>(x), saved.data, saved.size, static_cast<const S*>(dy),
                  static_cast<S*>(dx), g, workspace.data, workspace.size, ex);
    });
  }

  // (state bytes, step workspace bytes) of single-token decoding: attention's KV cache for
  // max_len positions (a ring of the window's under a window), Mamba's conv and scan state, TTT's
  // inner state and running sums.
  static std::tuple<std::size_t, std::size_t> decode_sizes(const spec& s, std::size_t max_len) {
    return with_precision<Extra...>(s, nullptr, [&]<typename L, typename>(const auto& shape) {
      L::check(shape);
      if constexpr (requires { L::kv_cache_bytes(shape, max_len); }) {
        return std::tuple{L::kv_cache_bytes(shape, max_len), L::step_workspace_bytes(shape, max_len, s.threads)};
      } else {
        return std::tuple{L::state_bytes(shape), L::step_workspace_bytes(shape)};
      }
    });
  }

  // Starts the state: an empty cache, a zero Mamba state, TTT's inner model from its weights.
  template <typename Exec>
  static void decode_reset(const spec& s, const std::vector<const void*>& weights, bytes state, std::size_t max_len,
                           Exec& ex) {
    const std::vector<param> params = parameters_of(s);
    with_precision<Extra...>(s, nullptr, [&]<typename L, typename Fields>(const auto& shape) {
      using S = typename L::storage_type;
      L::check(shape);
      [[maybe_unused]] const auto w = fields_of<typename L::weights, Fields>(params, typed<const S>(weights));
      if constexpr (requires { L::kv_cache_bytes(shape, max_len); }) {
        (void)L::make_kv_cache(shape, state.data, state.size, max_len);  // an empty cache writes no bytes
      } else if constexpr (requires { L::make_state(shape, state.data, state.size, ex); }) {
        (void)L::make_state(shape, state.data, state.size, ex);
      } else if constexpr (requires { L::make_state(shape, state.data, state.size); }) {
        (void)L::make_state(shape, state.data, state.size);
      } else if constexpr (requires { L::make_state(shape, w, state.data, state.size, ex); }) {
        (void)L::make_state(shape, w, state.data, state.size, ex);
      } else {
        (void)L::make_state(shape, w, state.data, state.size);
      }
    });
  }

  // y_t = layer(x_t) at `position` (tokens decoded since the reset); the state advances.
  template <typename Exec>
  static void decode_step(const spec& s, const std::vector<const void*>& weights, bytes state, std::size_t position,
                          std::size_t max_len, const void* x_t, void* y_t, bytes workspace, Exec& ex) {
    const std::vector<param> params = parameters_of(s);
    with_precision<Extra...>(s, nullptr, [&]<typename L, typename Fields>(const auto& shape) {
      using S = typename L::storage_type;
      L::check(shape);
      const auto w = fields_of<typename L::weights, Fields>(params, typed<const S>(weights));
      const auto* xp = static_cast<const S*>(x_t);
      auto* yp = static_cast<S*>(y_t);
      if constexpr (requires { L::kv_cache_bytes(shape, max_len); }) {
        typename L::kv_cache cache{state.data, state.size, max_len, position};
        L::step(shape, w, cache, xp, yp, workspace.data, workspace.size, ex);
      } else {
        typename L::state st{state.data, state.size, position};
        L::step(shape, w, st, xp, yp, workspace.data, workspace.size, ex);
      }
    });
  }

 private:
  template <typename S, typename V>
  static std::vector<S*> typed(const std::vector<V*>& ptrs) {
    std::vector<S*> out;
    out.reserve(ptrs.size());
    for (V* p : ptrs) out.push_back(static_cast<S*>(p));
    return out;
  }
};

}  // namespace membound_python
