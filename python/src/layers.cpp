// membound._layers: the layers' forward and backward over the caller's host arrays (DLPack), for
// membound.ops, the torch custom ops. Nothing here allocates but the thread pools: the op asks
// sizes() for the saved and workspace bytes (the layers' own size functions), allocates them and
// the outputs with its framework's allocator, and passes them in. The arrays are checked here
// (dtype, element counts, byte sizes) and again by the layer fronts, whose typed errors cross as
// membound.InvalidArgument naming the argument.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "errors.hpp"
#include "membound/membound.hpp"

namespace nb = nanobind;
namespace mb = membound;

namespace {

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
  std::size_t threads = 1;  // the host pool's size (its per-thread scratch is in the workspace)
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

std::size_t checked_mini_batch(const spec& s) {
  if (!is_built_mini_batch(s.mini_batch, ttt_mini_batch_sizes{})) {
    throw mb::invalid_argument("mini_batch", "1, 2, 4, 8, 16, 32 or 64 (the sizes the torch ops are built for)",
                               std::to_string(s.mini_batch),
                               "Use one of those, or the C++ layer with ttt_mini_batch<b> for another size");
  }
  return s.mini_batch;
}

// ---- The four families: shape, parameters, and the weight/gradient structs by name ----------------

mb::attention_shape attention_shape_of(const spec& s) {
  mb::attention_shape a;
  a.batch = s.batch, a.seq = s.seq, a.d_model = s.width, a.heads = s.heads, a.kv_heads = s.kv_heads;
  a.head_dim = s.head_dim, a.causal = s.causal, a.rope_base = s.rope_base, a.window = s.window;
  return a;
}
mb::mamba_shape mamba_shape_of(const spec& s) {
  mb::mamba_shape m;
  m.batch = s.batch, m.seq = s.seq, m.d_model = s.width, m.d_inner = s.d_inner, m.d_state = s.d_state;
  m.d_conv = s.d_conv, m.dt_rank = s.dt_rank;
  return m;
}
mb::ttt_shape ttt_shape_of(const spec& s) {
  (void)checked_mini_batch(s);
  mb::ttt_shape t;
  t.batch = s.batch, t.seq = s.seq, t.width = s.width, t.heads = s.heads, t.use_gate = s.use_gate;
  t.base_lr = s.base_lr, t.rope_base = s.rope_base;
  return t;
}

std::vector<param> parameters_of(const spec& s) {
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

// ---- Thread pools, one per size, each used by one call at a time ---------------------------------

struct pool_slot {
  std::mutex busy;
  std::unique_ptr<mb::thread_pool> pool;
};

pool_slot& pool_for(std::size_t threads) {
  static std::mutex table_lock;
  // Leaked on purpose: no destructor joins the workers at exit while another thread is in a call.
  static auto& table = *new std::map<std::size_t, std::unique_ptr<pool_slot>>;
  const std::lock_guard<std::mutex> guard(table_lock);
  std::unique_ptr<pool_slot>& slot = table[threads];
  if (!slot) {
    auto made = std::make_unique<pool_slot>();
    made->pool = std::make_unique<mb::thread_pool>(threads);  // throws invalid_argument for 0
    slot = std::move(made);
  }
  return *slot;
}

// ---- Arrays ----------------------------------------------------------------------------------------

using array = nb::ndarray<nb::device::cpu, nb::c_contig>;

template <typename S>
constexpr nb::dlpack::dtype dtype_of() {
  if constexpr (std::is_same_v<S, mb::bf16>) {
    return {static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1};
  } else {
    return nb::dtype<S>();
  }
}

std::size_t bytes_of(const array& a) { return a.size() * a.itemsize(); }

template <typename S>
S* data_of(const array& a, const std::string& argument, std::size_t elements, const char* dtype) {
  if (a.dtype() != dtype_of<S>()) {
    throw mb::invalid_argument(argument, std::string("a contiguous host tensor of ") + dtype, "another dtype",
                               "Pass every tensor of one call in the layer's dtype");
  }
  if (a.size() != elements) {
    throw mb::invalid_argument(argument, std::to_string(elements) + " elements", std::to_string(a.size()),
                               "Shape it as membound.ops.parameters() and the layer's shape say");
  }
  return static_cast<S*>(a.data());
}

// A byte buffer the layer checks itself: its size (workspace_too_small) and its 256-byte alignment
// (membound.ops hands in aligned views).
std::pair<void*, std::size_t> bytes_in(const array& a) { return {a.data(), bytes_of(a)}; }

// ---- The calls, per precision ------------------------------------------------------------------------

// f for TTT-Linear's or TTT-MLP's instantiation at the spec's mini-batch (one of Bs).
template <typename P, bool Mlp, typename F, std::size_t B, std::size_t... Rest>
decltype(auto) with_ttt(const spec& s, F&& f, std::index_sequence<B, Rest...>) {
  if constexpr (sizeof...(Rest) > 0) {
    if (s.mini_batch != B) return with_ttt<P, Mlp>(s, f, std::index_sequence<Rest...>{});
  }
  const mb::ttt_shape shape = ttt_shape_of(s);  // refuses a mini-batch that is not built
  using C = mb::ttt_mini_batch<B>;
  using L = std::conditional_t<Mlp, mb::ttt_mlp<P, C>, mb::ttt_linear<P, C>>;
  return f.template operator()<L, ttt_fields>(shape);
}

// Calls f.template operator()<Layer, Fields>(shape) for the spec's layer at precision P.
template <typename P, typename F>
decltype(auto) with_layer(const spec& s, F&& f) {
  if (s.kind == "attention") {
    using L = mb::attention<P>;
    return f.template operator()<L, attention_fields>(attention_shape_of(s));
  }
  if (s.kind == "mamba") {
    using L = mb::mamba<P>;
    return f.template operator()<L, mamba_fields>(mamba_shape_of(s));
  }
  if (s.kind == "ttt_linear") return with_ttt<P, false>(s, f, ttt_mini_batch_sizes{});
  if (s.kind == "ttt_mlp") return with_ttt<P, true>(s, f, ttt_mini_batch_sizes{});
  (void)parameters_of(s);  // throws, naming `kind`
  throw mb::invalid_argument("kind", "attention, mamba, ttt_linear or ttt_mlp", s.kind, "Name one of the four layers");
}

template <typename F>
decltype(auto) with_precision(const spec& s, F&& f) {
  if (s.dtype == "float32") return with_layer<mb::fp32_precision>(s, f);
  if (s.dtype == "float64") return with_layer<mb::fp64_precision>(s, f);
  if (s.dtype == "bfloat16") return with_layer<mb::bf16_precision>(s, f);
  throw mb::invalid_argument("dtype", "float32, float64 or bfloat16", s.dtype, "Cast the input and the parameters");
}

std::tuple<std::size_t, std::size_t, std::size_t> sizes(const spec& s) {
  return with_precision(s, [&]<typename L, typename>(const auto& shape) {
    L::check(shape);
    return std::tuple{L::saved_bytes(shape), L::forward_workspace_bytes(shape, s.threads),
                      L::backward_workspace_bytes(shape, s.threads)};
  });
}

template <typename S>
std::vector<S*> pointers(const std::vector<param>& params, const std::vector<array>& arrays, const char* argument,
                         const char* dtype) {
  if (arrays.size() != params.size()) {
    throw mb::invalid_argument(argument, std::to_string(params.size()) + " tensors (membound.ops.parameters())",
                               std::to_string(arrays.size()), "Pass every parameter of the layer, in its order");
  }
  std::vector<S*> out;
  for (std::size_t i = 0; i < params.size(); ++i) {
    out.push_back(data_of<S>(arrays[i], std::string(argument) + "[" + std::to_string(i) + "] (" + params[i].name + ")",
                             params[i].elements(), dtype));
  }
  return out;
}

std::size_t tokens_by_width(const spec& s) { return mb::sat_mul(mb::sat_mul(s.batch, s.seq), s.width); }

// The parameter arrays, each checked, as the layer's weights struct.
template <typename L, typename Fields>
typename L::weights weights_of(const spec& s, const std::vector<param>& params, const std::vector<array>& weights) {
  using S = typename L::storage_type;
  const auto w = pointers<S>(params, weights, "weights", s.dtype.c_str());
  const std::vector<const S*> cw(w.begin(), w.end());
  return Fields::template make<typename L::weights>(named<const S*>{params, cw});
}

// What every call checks first: the shape, the parameters (as the layer's weights) and x.
template <typename L, typename Fields>
std::pair<typename L::weights, const typename L::storage_type*> checked_inputs(const spec& s, const auto& shape,
                                                                             const std::vector<param>& params,
                                                                             const std::vector<array>& weights,
                                                                             const array& x) {
  using S = typename L::storage_type;
  L::check(shape);
  return {weights_of<L, Fields>(s, params, weights), data_of<S>(x, "x", tokens_by_width(s), s.dtype.c_str())};
}

void forward(const spec& s, const array& x, const std::vector<array>& weights, const array& y, const array& saved,
             const array& workspace) {
  const std::vector<param> params = parameters_of(s);
  with_precision(s, [&]<typename L, typename Fields>(const auto& shape) {
    using S = typename L::storage_type;
    const auto [wts, xp] = checked_inputs<L, Fields>(s, shape, params, weights, x);
    S* yp = data_of<S>(y, "y", tokens_by_width(s), s.dtype.c_str());
    const auto [svp, sv] = bytes_in(saved);
    const auto [wsp, ws] = bytes_in(workspace);
    pool_slot& slot = pool_for(s.threads);
    const nb::gil_scoped_release no_gil;
    const std::lock_guard<std::mutex> guard(slot.busy);
    L::forward(shape, wts, xp, yp, svp, sv, wsp, ws, *slot.pool);
  });
}

void backward(const spec& s, const array& x, const std::vector<array>& weights, const array& saved, const array& dy,
              const array& dx, const std::vector<array>& grads, const array& workspace) {
  const std::vector<param> params = parameters_of(s);
  with_precision(s, [&]<typename L, typename Fields>(const auto& shape) {
    using S = typename L::storage_type;
    const auto [wts, xp] = checked_inputs<L, Fields>(s, shape, params, weights, x);
    const auto g = pointers<S>(params, grads, "grads", s.dtype.c_str());
    const std::size_t n = tokens_by_width(s);
    const S* dyp = data_of<S>(dy, "dy", n, s.dtype.c_str());
    S* dxp = data_of<S>(dx, "dx", n, s.dtype.c_str());
    const auto [svp, sv] = bytes_in(saved);
    const auto [wsp, ws] = bytes_in(workspace);
    const auto gs = Fields::template make<typename L::gradients>(named<S*>{params, g});
    pool_slot& slot = pool_for(s.threads);
    const nb::gil_scoped_release no_gil;
    const std::lock_guard<std::mutex> guard(slot.busy);
    L::backward(shape, wts, xp, svp, sv, dyp, dxp, gs, wsp, ws, *slot.pool);
  });
}

// ---- Decoding: one token per sequence, the state in the caller's bytes -----------------------------------

// (state bytes, step workspace bytes): attention's KV cache for max_len positions (a ring of the
// window's under a window), Mamba's conv and scan state, TTT's inner state and running sums.
std::tuple<std::size_t, std::size_t> decode_sizes(const spec& s, std::size_t max_len) {
  return with_precision(s, [&]<typename L, typename>(const auto& shape) {
    L::check(shape);
    if constexpr (requires { L::kv_cache_bytes(shape, max_len); }) {
      return std::tuple{L::kv_cache_bytes(shape, max_len), L::step_workspace_bytes(shape, max_len, s.threads)};
    } else {
      return std::tuple{L::state_bytes(shape), L::step_workspace_bytes(shape)};
    }
  });
}

// Starts the state in `state`: an empty cache, a zero Mamba state, TTT's inner model from its weights.
void decode_reset(const spec& s, const std::vector<array>& weights, const array& state, std::size_t max_len) {
  const std::vector<param> params = parameters_of(s);
  with_precision(s, [&]<typename L, typename Fields>(const auto& shape) {
    L::check(shape);
    // The weights are checked here for every layer, so that a wrong one is refused before any step.
    [[maybe_unused]] const auto wts = weights_of<L, Fields>(s, params, weights);
    const auto [sp, sb] = bytes_in(state);
    if constexpr (requires { L::kv_cache_bytes(shape, max_len); }) {
      (void)L::make_kv_cache(shape, sp, sb, max_len);  // checks; an empty cache needs no bytes written
    } else if constexpr (requires { L::make_state(shape, sp, sb); }) {
      (void)L::make_state(shape, sp, sb);
    } else {
      (void)L::make_state(shape, wts, sp, sb);
    }
  });
}

// y_t = layer(x_t) at `position` (tokens decoded since the reset); the state advances.
void decode_step(const spec& s, const std::vector<array>& weights, const array& state, std::size_t position,
                 std::size_t max_len, const array& x_t, const array& y_t, const array& workspace) {
  const std::vector<param> params = parameters_of(s);
  with_precision(s, [&]<typename L, typename Fields>(const auto& shape) {
    using S = typename L::storage_type;
    const auto wts = weights_of<L, Fields>(s, params, weights);
    L::check(shape);
    const std::size_t n = mb::sat_mul(s.batch, s.width);
    const S* xp = data_of<S>(x_t, "x_t", n, s.dtype.c_str());
    S* yp = data_of<S>(y_t, "y_t", n, s.dtype.c_str());
    const auto [sp, sb] = bytes_in(state);
    const auto [wsp, ws] = bytes_in(workspace);
    pool_slot& slot = pool_for(s.threads);
    const nb::gil_scoped_release no_gil;
    const std::lock_guard<std::mutex> guard(slot.busy);
    if constexpr (requires { L::kv_cache_bytes(shape, max_len); }) {
      typename L::kv_cache cache{sp, sb, max_len, position};
      L::step(shape, wts, cache, xp, yp, wsp, ws, *slot.pool);
    } else {
      typename L::state st{sp, sb, position};
      L::step(shape, wts, st, xp, yp, wsp, ws, *slot.pool);
    }
  });
}

}  // namespace

NB_MODULE(_layers, m) {
  m.doc() = "membound's layers over caller-owned host arrays (use membound.ops)";
  membound_python::translate_errors();

  nb::class_<spec>(m, "Spec")
      .def(nb::init<>())
      .def_rw("kind", &spec::kind)
      .def_rw("dtype", &spec::dtype)
      .def_rw("batch", &spec::batch)
      .def_rw("seq", &spec::seq)
      .def_rw("width", &spec::width)
      .def_rw("heads", &spec::heads)
      .def_rw("kv_heads", &spec::kv_heads)
      .def_rw("head_dim", &spec::head_dim)
      .def_rw("window", &spec::window)
      .def_rw("causal", &spec::causal)
      .def_rw("rope_base", &spec::rope_base)
      .def_rw("d_inner", &spec::d_inner)
      .def_rw("d_state", &spec::d_state)
      .def_rw("d_conv", &spec::d_conv)
      .def_rw("dt_rank", &spec::dt_rank)
      .def_rw("use_gate", &spec::use_gate)
      .def_rw("base_lr", &spec::base_lr)
      .def_rw("mini_batch", &spec::mini_batch)
      .def_rw("threads", &spec::threads);

  m.def("parameters", [](const spec& s) {
    std::vector<std::pair<std::string, std::vector<std::size_t>>> out;
    for (const param& p : parameters_of(s)) out.emplace_back(p.name, p.dims);
    return out;
  }, nb::arg("spec"), "(name, dims) of each parameter in membound's order and layout ([in, out] matrices).");
  m.def("sizes", &sizes, nb::arg("spec"),
        "(saved, forward workspace, backward workspace) bytes of one call, from the layer's size functions.");
  // Outputs never converted: a copy would take the results and be dropped.
  m.def("forward", &forward, nb::arg("spec"), nb::arg("x"), nb::arg("weights"), nb::arg("y").noconvert(),
        nb::arg("saved").noconvert(), nb::arg("workspace").noconvert(),
        "y = layer(x); fills `saved` (saved_bytes, 256-byte aligned) for backward.");
  m.def("backward", &backward, nb::arg("spec"), nb::arg("x"), nb::arg("weights"), nb::arg("saved"), nb::arg("dy"),
        nb::arg("dx").noconvert(), nb::arg("grads").noconvert(), nb::arg("workspace").noconvert(),
        "dx from dy (overwritten); the parameter gradients added (+=) to `grads`.");
  m.def("decode_sizes", &decode_sizes, nb::arg("spec"), nb::arg("max_len"),
        "(state, step workspace) bytes of single-token decoding (max_len: attention's cache positions).");
  m.def("decode_reset", &decode_reset, nb::arg("spec"), nb::arg("weights"), nb::arg("state").noconvert(),
        nb::arg("max_len"), "Starts the decoding state in `state` (TTT's from the weights).");
  m.def("decode_step", &decode_step, nb::arg("spec"), nb::arg("weights"), nb::arg("state").noconvert(),
        nb::arg("position"), nb::arg("max_len"), nb::arg("x_t"), nb::arg("y_t").noconvert(),
        nb::arg("workspace").noconvert(), "y_t = layer(x_t) at `position`; the state advances.");
  m.attr("ttt_mini_batches") = built_mini_batches(ttt_mini_batch_sizes{});
}
