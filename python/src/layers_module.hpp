// The body of membound._layers (host arrays) and membound._layers_cuda (CUDA arrays): checks every
// array a call receives (dtype, element counts, device) and hands the layer's calls raw pointers.
// Nothing here allocates: the op asks sizes() for the saved and workspace bytes (the layers' own size
// functions), allocates them and the outputs with its framework's allocator, and passes them in.
// The arrays are checked here and again by the layer fronts, whose typed errors cross as
// membound.InvalidArgument naming the argument.
//
// Calls: the backend's entry points (layers.cpp for the host, layer_calls_cuda.hpp for CUDA), each
// a static function over a spec and raw pointers that runs the call on the backend's executor.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "errors.hpp"
#include "layer_calls.hpp"

namespace membound_python {

template <typename Device>
using array_on = nb::ndarray<Device, nb::c_contig>;

inline nb::dlpack::dtype dlpack_dtype(const std::string& dtype) {
  if (dtype == "float64") return nb::dtype<double>();
  if (dtype == "bfloat16") return {static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1};
  return nb::dtype<float>();  // float32: the only other dtype a checked spec names
}

// Checks one backend's arrays; `where` names the memory in messages ("host", "CUDA").
template <typename Device>
struct arrays {
  using array = array_on<Device>;
  const spec& s;
  const char* where;

  // CUDA: every array on the call's device (spec.device, where the layer launches).
  void check_device(const array& a, const std::string& argument) {
    if constexpr (!std::is_same_v<Device, nb::device::cpu>) {
      if (a.device_id() != s.device) {
        throw mb::invalid_argument(argument, "a tensor on cuda:" + std::to_string(s.device) + " (spec.device)",
                                   "cuda:" + std::to_string(a.device_id()),
                                   "Move every tensor of one call to one device");
      }
    }
  }

  void* data(const array& a, const std::string& argument, std::size_t elements) {
    if (a.dtype() != dlpack_dtype(s.dtype)) {
      throw mb::invalid_argument(argument, std::string("a contiguous ") + where + " tensor of " + s.dtype,
                                 "another dtype", "Pass every tensor of one call in the layer's dtype");
    }
    if (a.size() != elements) {
      throw mb::invalid_argument(argument, std::to_string(elements) + " elements", std::to_string(a.size()),
                                 "Shape it as membound.ops.parameters() and the layer's shape say");
    }
    check_device(a, argument);
    return a.data();
  }

  // A byte buffer the layer checks itself: its size (workspace_too_small) and its 256-byte alignment
  // (membound.ops hands in aligned views).
  bytes raw(const array& a, const std::string& argument) {
    check_device(a, argument);
    return {a.data(), a.size() * a.itemsize()};
  }

  template <typename P>
  std::vector<P> list(const std::vector<param>& params, const std::vector<array>& given, const char* argument) {
    if (given.size() != params.size()) {
      throw mb::invalid_argument(argument, std::to_string(params.size()) + " tensors (membound.ops.parameters())",
                                 std::to_string(given.size()), "Pass every parameter of the layer, in its order");
    }
    std::vector<P> out;
    for (std::size_t i = 0; i < params.size(); ++i) {
      out.push_back(data(given[i], std::string(argument) + "[" + std::to_string(i) + "] (" + params[i].name + ")",
                         params[i].elements()));
    }
    return out;
  }
};

// The packed sequences' offsets: S + 1 int32 on the host (for either module: the layers read them
// on the host), present exactly when spec.sequences is S > 0.
using offsets_array = nb::ndarray<const std::int32_t, nb::ndim<1>, nb::device::cpu, nb::c_contig>;

inline const std::int32_t* offsets_of(const spec& s, const std::optional<offsets_array>& offsets) {
  if (s.sequences == 0) {
    if (offsets.has_value()) {
      throw mb::invalid_argument("offsets", "None (spec.sequences is 0: one sequence per batch row)", "an array",
                                 "Set spec.sequences to the packed sequences' count, or pass no offsets");
    }
    return nullptr;
  }
  if (!offsets.has_value() || offsets->size() != s.sequences + 1) {
    throw mb::invalid_argument("offsets", std::to_string(s.sequences + 1) + " int32 offsets (spec.sequences + 1)",
                               offsets.has_value() ? std::to_string(offsets->size()) : "None",
                               "Pass the sequences' starts and the total, 0 first (FlashAttention's cu_seqlens)");
  }
  return offsets->data();
}

inline std::size_t tokens_by_width(const spec& s) { return mb::sat_mul(mb::sat_mul(s.batch, s.seq), s.width); }

// The module's functions over Calls (see the top of this file) and arrays on Device.
template <typename Calls, typename Device>
void bind_layers(nb::module_& m, const char* where) {
  using array = array_on<Device>;
  using checked = arrays<Device>;

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
      .def_rw("sequences", &spec::sequences)
      .def_rw("threads", &spec::threads)
      .def_rw("device", &spec::device)
      .def_rw("stream", &spec::stream);

  m.def("parameters", [](const spec& s) {
    std::vector<std::pair<std::string, std::vector<std::size_t>>> out;
    for (const param& p : parameters_of(s)) out.emplace_back(p.name, p.dims);
    return out;
  }, nb::arg("spec"), "(name, dims) of each parameter in membound's order and layout ([in, out] matrices).");
  m.def("sizes", [](const spec& s) { return Calls::sizes(s); }, nb::arg("spec"),
        "(saved, forward workspace, backward workspace) bytes of one call, from the layer's size functions.");

  // What forward and backward check first, in this order: the layer's kind, the packed offsets,
  // the shape, the weights, x. Returns (offsets, weights, x).
  const auto inputs = [](checked& a, const std::optional<offsets_array>& offsets, const std::vector<array>& weights,
                         const array& x) {
    const std::vector<param> params = parameters_of(a.s);
    const std::int32_t* packed = offsets_of(a.s, offsets);
    Calls::check(a.s, packed);
    auto w = a.template list<const void*>(params, weights, "weights");
    const void* xp = a.data(x, "x", tokens_by_width(a.s));
    return std::tuple{packed, std::move(w), xp};
  };

  // Outputs never converted: a copy would take the results and be dropped.
  m.def("forward", [where, inputs](const spec& s, const array& x, const std::vector<array>& weights, const array& y,
                                   const array& saved, const array& workspace,
                                   const std::optional<offsets_array>& offsets) {
    checked a{s, where};
    const auto [packed, w, xp] = inputs(a, offsets, weights, x);
    void* yp = a.data(y, "y", tokens_by_width(s));
    const bytes sv = a.raw(saved, "saved"), ws = a.raw(workspace, "workspace");
    const nb::gil_scoped_release no_gil;
    Calls::forward(s, packed, xp, w, yp, sv, ws);
  }, nb::arg("spec"), nb::arg("x"), nb::arg("weights"), nb::arg("y").noconvert(), nb::arg("saved").noconvert(),
        nb::arg("workspace").noconvert(), nb::arg("offsets").none() = nb::none(),
        "y = layer(x); fills `saved` (saved_bytes, 256-byte aligned) for backward. offsets: the packed sequences' "
        "S + 1 int32 offsets when spec.sequences is S.");

  m.def("backward", [where, inputs](const spec& s, const array& x, const std::vector<array>& weights,
                                    const array& saved, const array& dy, const array& dx,
                                    const std::vector<array>& grads, const array& workspace,
                                    const std::optional<offsets_array>& offsets) {
    checked a{s, where};
    const auto [packed, w, xp] = inputs(a, offsets, weights, x);
    const auto g = a.template list<void*>(parameters_of(s), grads, "grads");
    const void* dyp = a.data(dy, "dy", tokens_by_width(s));
    void* dxp = a.data(dx, "dx", tokens_by_width(s));
    const bytes sv = a.raw(saved, "saved"), ws = a.raw(workspace, "workspace");
    const nb::gil_scoped_release no_gil;
    Calls::backward(s, packed, xp, w, sv, dyp, dxp, g, ws);
  }, nb::arg("spec"), nb::arg("x"), nb::arg("weights"), nb::arg("saved"), nb::arg("dy"), nb::arg("dx").noconvert(),
        nb::arg("grads").noconvert(), nb::arg("workspace").noconvert(), nb::arg("offsets").none() = nb::none(),
        "dx from dy (overwritten); the parameter gradients added (+=) to `grads`.");

  m.def("decode_sizes", [](const spec& s, std::size_t max_len) { return Calls::decode_sizes(s, max_len); },
        nb::arg("spec"), nb::arg("max_len"),
        "(state, step workspace) bytes of single-token decoding (max_len: attention's cache positions).");

  m.def("decode_reset", [where](const spec& s, const std::vector<array>& weights, const array& state,
                                std::size_t max_len) {
    const std::vector<param> params = parameters_of(s);
    Calls::check(s, nullptr);
    // The weights are checked here for every layer, so that a wrong one is refused before any step.
    checked a{s, where};
    const auto w = a.template list<const void*>(params, weights, "weights");
    const bytes st = a.raw(state, "state");
    const nb::gil_scoped_release no_gil;
    Calls::decode_reset(s, w, st, max_len);
  }, nb::arg("spec"), nb::arg("weights"), nb::arg("state").noconvert(), nb::arg("max_len"),
        "Starts the decoding state in `state` (TTT's from the weights).");

  m.def("decode_step", [where](const spec& s, const std::vector<array>& weights, const array& state,
                               std::size_t position, std::size_t max_len, const array& x_t, const array& y_t,
                               const array& workspace) {
    const std::vector<param> params = parameters_of(s);
    checked a{s, where};
    const auto w = a.template list<const void*>(params, weights, "weights");
    Calls::check(s, nullptr);
    const std::size_t n = mb::sat_mul(s.batch, s.width);
    const void* xp = a.data(x_t, "x_t", n);
    void* yp = a.data(y_t, "y_t", n);
    const bytes st = a.raw(state, "state"), ws = a.raw(workspace, "workspace");
    const nb::gil_scoped_release no_gil;
    Calls::decode_step(s, w, st, position, max_len, xp, yp, ws);
  }, nb::arg("spec"), nb::arg("weights"), nb::arg("state").noconvert(), nb::arg("position"), nb::arg("max_len"),
        nb::arg("x_t"), nb::arg("y_t").noconvert(), nb::arg("workspace").noconvert(),
        "y_t = layer(x_t) at `position`; the state advances.");

  m.attr("ttt_mini_batches") = built_mini_batches(ttt_mini_batch_sizes{});
}

}  // namespace membound_python
