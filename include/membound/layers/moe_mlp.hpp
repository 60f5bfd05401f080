// A mixture-of-experts feed-forward (Switch, GShard, Mixtral): a router picks k of E SwiGLU
// experts per token, a capacity bounds the rows each expert computes, and the gates mix the
// experts' outputs. The same front end as swiglu_mlp:
//
//   using moe = membound::moe_mlp<membound::fp32_precision>;
//   membound::moe_shape s{.batch = 1, .seq = T, .width = C, .hidden = F, .experts = 8, .top_k = 2,
//                         .capacity_factor = 1.25, .aux_loss_weight = 0.01};
//   membound::moe_stats st;
//   moe::forward(s, w, x, y, saved, moe::saved_bytes(s), ws, fws, pool, &st);  // st.dropped ...
//   moe::backward(s, w, x, saved, saved_bytes, dy, dx, grads, ws, bws, pool);
//
// Memory does not depend on the routing: every buffer holds moe_rows(s) expert rows, the most
// any routing can send (every choice, or every slot when the capacity binds), so the sizes below
// are exact for the worst router and the same for every other. backend/cpu/moe.hpp says what one
// call computes (router, top-k, dispatch order, drops, combine) and how backward runs.
//
// On cuda_backend (moe_mlp<P, cuda_backend>, include membound/backend/cuda.cuh and compile with
// nvcc) every pointer is device memory and backend/cuda/moe.cuh runs the same steps. Expert parallelism over ranks would plug in at the
// dispatch: the grouped buffer's per-expert row ranges are what an all-to-all would exchange.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string_view>

#include "membound/backend/cpu/moe.hpp"  // backend_kernels<cpu_backend, moe_shape>, moe_stats
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/core/parallel.hpp"
#include "membound/core/type_list.hpp"
#include "membound/layers/layer_support.hpp"
#include "membound/memory/workspace.hpp"
#include "membound/policy/backend.hpp"
#include "membound/policy/policy_set.hpp"
#include "membound/policy/precision.hpp"
#include "membound/shape/moe_shape.hpp"

MEMBOUND_NAMESPACE_BEGIN

// The mixture-of-experts feed-forward (see the file comment); Policies set the precision.
template <typename... Policies>
class moe_mlp {
 public:
  using policies = policy_set<type_list<fp32_precision, cpu_backend>, Policies...>;
  using precision = get_policy<policies, precision_kind>;
  using backend = get_policy<policies, backend_kind>;
  using executor = typename backend::executor;
  using storage_type = typename precision::storage_type;
  using accum_type = typename precision::accum_type;

 private:
  using S = storage_type;
  using A = accum_type;
  using kernels = backend_kernels<backend, moe_shape>;
  using routing = typename kernels::template routing<A>;

 public:
  // Whether the shape can run, and if not which field fails and why. Never throws.
  static constexpr layer_support can_implement(const moe_shape& s) noexcept {
    if (s.batch == 0) return {false, "shape.batch", "at least 1", 0.0};
    if (s.seq == 0) return {false, "shape.seq", "at least 1", 0.0};
    if (s.width == 0) return {false, "shape.width", "at least 1", 0.0};
    if (s.hidden == 0) return {false, "shape.hidden", "at least 1", 0.0};
    if (s.experts == 0) return {false, "shape.experts", "at least 1", 0.0};
    if (s.experts > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max())) {
      return {false, "shape.experts", "below 2^31 (int32 expert indices)", static_cast<double>(s.experts)};
    }
    if (s.top_k != 1 && s.top_k != 2) {
      return {false, "shape.top_k", "1 or 2 experts per token", static_cast<double>(s.top_k)};
    }
    if (s.top_k > s.experts) {
      return {false, "shape.top_k", "at most shape.experts", static_cast<double>(s.top_k)};
    }
    // Row indices and offsets are int32: the tokens' choices must fit.
    constexpr std::size_t most = static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max());
    if (s.tokens() / s.batch != s.seq || s.tokens() > most / s.top_k) {
      return {false, "shape.seq", "batch · seq · top_k below 2^31 (int32 row indices)",
              static_cast<double>(s.seq)};
    }
    if (!finite_nonnegative(s.capacity_factor)) {
      return {false, "shape.capacity_factor", "a finite value >= 0 (0: no capacity limit)",
              s.capacity_factor};
    }
    if (moe_capacity(s) == 0) {
      return {false, "shape.capacity_factor",
              "a capacity of at least one token per expert: capacity_factor >= experts / "
              "(tokens · top_k)",
              s.capacity_factor};
    }
    if (!finite_nonnegative(s.aux_loss_weight)) {
      return {false, "shape.aux_loss_weight", "a finite value >= 0", s.aux_loss_weight};
    }
    return {};
  }
  // Throws invalid_argument naming the failing field, as can_implement reports it.
  static void check(const moe_shape& s) {
    const layer_support r = can_implement(s);
    const bool real = r.argument == std::string_view("shape.capacity_factor") ||
                      r.argument == std::string_view("shape.aux_loss_weight");
    if (!r.ok) detail::throw_unsupported(r, real, "Fix the moe_shape before sizing or running the layer");
  }

  // Elements of the router and the experts: C·E + E·3·C·F.
  static constexpr std::size_t weight_elements(const moe_shape& s) noexcept {
    return detail::sat_add(detail::sat_mul(s.width, s.experts),
                           detail::sat_mul(detail::sat_mul(s.experts, 3), detail::sat_mul(s.width, s.hidden)));
  }
  // Bytes forward keeps for backward: the routing (probabilities, choices, rows, gates, expert
  // offsets) and the experts' pre-activations for moe_rows(s) rows, whatever the routing.
  static constexpr std::size_t saved_bytes(const moe_shape& s) noexcept {
    const std::size_t b[] = {bytes_of<A>(s.tokens(), s.experts), bytes_of<S>(moe_rows(s), s.hidden)};
    return detail::fits_layout(b) ? saved_layout(s).size() : std::numeric_limits<std::size_t>::max();
  }
  // The GEMMs' packing buffers are per thread: size with the pool's thread count.
  static constexpr std::size_t forward_workspace_bytes(const moe_shape& s, std::size_t threads) noexcept {
    return kernels::template forward_workspace_bytes<S, A>(s, threads);
  }
  static constexpr std::size_t backward_workspace_bytes(const moe_shape& s, std::size_t threads) noexcept {
    return kernels::template backward_workspace_bytes<S, A>(s, threads);
  }

  // Row-major, storage_type: the router [C, E]; the experts stacked, expert e at e·C·F.
  struct weights {
    const S* router;  // [C, E]
    const S* w_gate;  // [E, C, F]
    const S* w_up;    // [E, C, F]
    const S* w_down;  // [E, F, C]
  };
  // Where backward adds (+=) the weight gradients, shaped as `weights`: the caller zeroes them.
  struct gradients {
    S* router;
    S* w_gate;
    S* w_up;
    S* w_down;
  };

  // y = MoE(x); keeps the routing and the pre-activations in `saved`; `stats` (optional) gets the
  // balancing loss and the drops. Checks every argument before writing.
  static void forward(const moe_shape& s, const weights& w, const S* x, S* y, void* saved,
                      std::size_t saved_size, void* workspace, std::size_t workspace_size,
                      executor& ex, moe_stats* stats = nullptr) {
    check(s);
    check_weights(w);
    detail::need_pointer(x, "x");
    detail::need_pointer(y, "y");
    const auto sv = detail::carve_named(saved_layout(s), saved_bytes(s), saved, saved_size, "saved");
    detail::check_workspace_size(forward_workspace_bytes(s, workspace_threads(ex)), workspace, workspace_size);
    kernels::template forward<S, A>(s, w.router, w.w_gate, w.w_up, w.w_down, x, y, routes(sv),
                                    sv.template get<S>(s_a), sv.template get<S>(s_b), workspace,
                                    workspace_size, ex, stats);
  }

  // dx from dy (overwritten), the weight gradients added to `g` (the balancing loss's included),
  // from forward's `saved`.
  static void backward(const moe_shape& s, const weights& w, const S* x, const void* saved,
                       std::size_t saved_size, const S* dy, S* dx, const gradients& g,
                       void* workspace, std::size_t workspace_size, executor& ex) {
    check(s);
    check_weights(w);
    detail::need_pointer(x, "x");
    detail::need_pointer(dy, "dy");
    detail::need_pointer(dx, "dx");
    detail::need_pointer(g.router, "gradients.router");
    detail::need_pointer(g.w_gate, "gradients.w_gate");
    detail::need_pointer(g.w_up, "gradients.w_up");
    detail::need_pointer(g.w_down, "gradients.w_down");
    const auto sv = detail::carve_named(saved_layout(s), saved_bytes(s), const_cast<void*>(saved),
                                        saved_size, "saved");
    detail::check_workspace_size(backward_workspace_bytes(s, workspace_threads(ex)), workspace, workspace_size);
    kernels::template backward<S, A>(s, w.router, w.w_gate, w.w_up, w.w_down, x, routes(sv),
                                     sv.template get<S>(s_a), sv.template get<S>(s_b), dy, dx,
                                     g.router, g.w_gate, g.w_up, g.w_down, workspace,
                                     workspace_size, ex);
  }

 private:
  static constexpr bool finite_nonnegative(double v) noexcept {
    return v >= 0.0 && v <= std::numeric_limits<double>::max();  // false for NaN and infinity
  }
  enum saved_slot : std::size_t { s_p, s_choice, s_row, s_g, s_off, s_a, s_b };
  static constexpr workspace_layout<7> saved_layout(const moe_shape& s) {
    const std::size_t N = s.tokens(), k = s.top_k;
    workspace_layout<7> l;
    l.add(bytes_of<A>(N, s.experts));
    l.add(bytes_of<std::int32_t>(N, k));
    l.add(bytes_of<std::int32_t>(N, k));
    l.add(bytes_of<A>(N, k));
    l.add(bytes_of<std::int32_t>(s.experts + 1));
    l.add(bytes_of<S>(moe_rows(s), s.hidden));
    l.add(bytes_of<S>(moe_rows(s), s.hidden));
    return l;
  }
  template <typename View>
  static routing routes(const View& sv) {
    return {sv.template get<A>(s_p), sv.template get<std::int32_t>(s_choice),
            sv.template get<std::int32_t>(s_row), sv.template get<A>(s_g),
            sv.template get<std::int32_t>(s_off)};
  }
  static void check_weights(const weights& w) {
    detail::need_pointer(w.router, "weights.router");
    detail::need_pointer(w.w_gate, "weights.w_gate");
    detail::need_pointer(w.w_up, "weights.w_up");
    detail::need_pointer(w.w_down, "weights.w_down");
  }
};

MEMBOUND_NAMESPACE_END
