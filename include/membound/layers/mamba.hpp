// The Mamba-1 block (Gu & Dao 2023; the `Mamba` module of state-spaces/mamba with its reference
// path), whose saved memory is set by the scan chunk, not by the sequence length. Semantics are
// those of tests/support/mamba_reference.hpp (W is [in, out], row-major: y = x·W):
//   xz = x·in_proj -> xi, z;  c = causal depthwise conv(xi) + conv_b;  u = SiLU(c)
//   x_dbl = u·x_proj -> dt_low [R], B [Ns], C [Ns];  Δ = softplus(dt_low·dt_proj + dt_bias)
//   h_t = exp(Δ_t·A) ⊙ h_{t−1} + Δ_t·B_t·u_t,  A = −exp(A_log);  y_t = C_t·h_t + D ⊙ u_t
//   out = (y ⊙ SiLU(z))·out_proj
//
//   using block = membound::mamba<membound::bf16_precision, membound::scan_chunk<128>>;
//   block::check(shape);                                       // throws, naming the argument
//   std::size_t saved = block::saved_bytes(shape);             // kept from forward for backward
//   block::forward(shape, w, x, out, saved_buf, saved, ws, block::forward_workspace_bytes(shape, t), pool);
//   block::backward(shape, w, x, saved_buf, saved, dout, dx, grads, ws, bws, pool);
//
// Forward keeps xz, x_dbl (storage type) and the scan state entering every chunk after the first
// (accumulator type): O(B·Di·Ns·T/chunk) state bytes, not O(B·Di·Ns·T). Backward recomputes the
// states inside each chunk from its entry state and runs the reverse scan. The recompute policy
// mirrors mamba_ssm's checkpoint_lvl: `recompute` (default, lvl 1) recomputes the conv output and
// Δ in backward, `save_all` (lvl 0) keeps them. Values forward stores (xz, the conv output, x_dbl,
// Δ) are rounded to the storage type once and then used as stored, so both policies give the
// same gradients bit for bit. The scan state is accumulated in the accumulator type (float or
// double). Nothing allocates: every buffer is carved from the caller's saved/workspace bytes.
//
// This file is the front (checks, sizes, the saved and state layouts) and makes one call into
// backend_kernels<backend, mamba_shape> for every backend: backend/cpu/mamba.hpp on the host.
// With cuda_backend in the policies every pointer is device memory, the executor is a
// cuda_executor and the kernels are backend/cuda/mamba.cuh's (include membound/backend/cuda.cuh
// and compile with nvcc). saved_bytes and saved_state_bytes are the same (the same states are
// saved, in the same place); the workspaces are the device's own and hold cuBLASLt's; the thread
// count the size functions take is ignored there. The decoding state lives on the device: make it
// and reset it with the executor overloads.
#pragma once

#include <cstddef>
#include <limits>
#include <type_traits>

#include "membound/backend/cpu/mamba.hpp"  // backend_kernels<cpu_backend, mamba_shape>
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/core/error.hpp"
#include "membound/core/parallel.hpp"
#include "membound/core/type_list.hpp"
#include "membound/layers/layer_support.hpp"
#include "membound/shape/mamba_shape.hpp"
#include "membound/memory/workspace.hpp"
#include "membound/policy/backend.hpp"
#include "membound/policy/recompute.hpp"
#include "membound/policy/chunking.hpp"
#include "membound/policy/policy_set.hpp"
#include "membound/policy/precision.hpp"

MEMBOUND_NAMESPACE_BEGIN

// The Mamba-1 block (see the file comment); Policies override the defaults in any order.
template <typename... Policies>
class mamba {
 public:
  // Precision, scan chunk, recompute policy and backend: the defaults, overridden by Policies.
  using policies =
      policy_set<type_list<fp32_precision, scan_chunk<128>, recompute, cpu_backend>, Policies...>;
  // Storage and accumulator types (fp32_precision by default).
  using precision = get_policy<policies, precision_kind>;
  // cpu_backend (the default) or cuda_backend: where the pointers live and whose kernels run.
  using backend = get_policy<policies, backend_kind>;
  using executor = typename backend::executor;  // thread_pool, or cuda_executor
  // scan_chunk<L>: tokens per scan chunk, which sets how many scan states forward saves.
  using chunking = get_policy<policies, chunking_kind>;
  // `recompute` (the conv output and Δ again in backward) or `save_all` (keep them in `saved`).
  using recompute_policy = get_policy<policies, recompute_kind>;
  // The former name of recompute_policy, kept so that old code still compiles (with a warning).
  using checkpoint [[deprecated("membound: a layer's checkpoint policy is now its recompute_policy")]] =
      recompute_policy;
  static_assert(is_scan_chunk_v<chunking>,
                "membound: mamba takes scan_chunk<L> as its chunking policy (attention_tiles and "
                "ttt_mini_batch belong to attention and TTT).");
  static_assert(std::is_same_v<recompute_policy, recompute> || std::is_same_v<recompute_policy, save_all>,
                "membound: mamba takes `recompute` (mamba_ssm checkpoint_lvl 1: recompute the conv "
                "output and delta in backward) or `save_all` (lvl 0: keep them) as its recompute "
                "policy; ttt_state_groups belongs to the TTT layer.");
  // Element type of x, out, the weights and the gradients.
  using storage_type = typename precision::storage_type;
  // Type of the scan state (float or double), saved and decoding states included.
  using accum_type = typename precision::accum_type;
  static_assert(std::is_same_v<accum_type, float> || std::is_same_v<accum_type, double>,
                "membound: mamba accumulates its scan state in float or double; choose a "
                "precision whose accumulator is one of them.");

 private:
  using S = storage_type;
  using A = accum_type;
  static constexpr bool keep_conv_delta = std::is_same_v<recompute_policy, save_all>;
  static constexpr std::size_t L = chunking::chunk;
  using kernels = backend_kernels<backend, mamba_shape>;

 public:
  // Tokens per scan chunk (scan_chunk<L>): forward saves the state entering each chunk after the
  // first.
  static constexpr std::size_t chunk = L;

  // ---- Checks --------------------------------------------------------------------------------
  // Whether the shape can run, and if not which field fails and why. Never throws.
  static constexpr layer_support can_implement(const mamba_shape& s) noexcept {
    auto no = [](const char* arg, const char* expected, double actual) {
      return layer_support{false, arg, expected, actual};
    };
    const auto d = [](std::size_t v) { return static_cast<double>(v); };
    if (s.batch == 0) return no("shape.batch", "at least 1", 0.0);
    if (s.seq == 0) return no("shape.seq", "at least 1", 0.0);
    if (s.d_model == 0) return no("shape.d_model", "at least 1", 0.0);
    if (s.d_inner == 0) return no("shape.d_inner", "at least 1 (mamba_shape::defaults: 2·d_model)", 0.0);
    if (s.d_state == 0 || s.d_state > cpu::max_d_state) {
      return no("shape.d_state", "between 1 and 256", d(s.d_state));
    }
    if (s.d_conv == 0) return no("shape.d_conv", "at least 1", 0.0);
    if (s.dt_rank == 0) return no("shape.dt_rank", "at least 1 (mamba_shape::defaults: ceil(d_model / 16))", 0.0);
    if (s.offsets != nullptr || s.sequences != 0) {
      return detail::packing_support(s.offsets, s.sequences, s.batch, s.seq);
    }
    return {};
  }

  // Throws invalid_argument naming the failing field, as can_implement reports it.
  static void check(const mamba_shape& s) {
    const layer_support r = can_implement(s);
    if (!r.ok) {
      detail::throw_unsupported(r, false, "Fix the mamba_shape before sizing or running the block");
    }
  }

  // ---- Memory known before running ------------------------------------------------------------
  // Parameter elements, in the order of `weights`.
  static constexpr std::size_t weight_elements(const mamba_shape& s) noexcept {
    return mamba_weight_elements(s);
  }

  // Bytes forward keeps for backward: xz, x_dbl, the chunk-entry states (c and Δ too under
  // save_all).
  static constexpr std::size_t saved_bytes(const mamba_shape& s) noexcept {
    const std::size_t b[] = {xz_bytes(s), xdbl_bytes(s), states_bytes(s), inner_s_bytes(s)};
    return detail::fits_layout(b) ? saved_layout(s).size() : std::numeric_limits<std::size_t>::max();
  }
  // Of saved_bytes, the chunk-entry scan states: B · (ceil(T / chunk) − 1) · Di · Ns accumulators.
  static constexpr std::size_t saved_state_bytes(const mamba_shape& s) noexcept {
    return states_bytes(s);
  }
  // Scratch bytes forward needs for `threads` CPU threads (the pool's size; the device ignores it).
  static constexpr std::size_t forward_workspace_bytes(const mamba_shape& s,
                                                       std::size_t threads) noexcept {
    return kernels::template forward_workspace_bytes<S, A>(s, L, keep_conv_delta, threads);
  }
  // Scratch bytes backward needs for `threads` CPU threads.
  static constexpr std::size_t backward_workspace_bytes(const mamba_shape& s,
                                                        std::size_t threads) noexcept {
    return kernels::template backward_workspace_bytes<S, A>(s, L, keep_conv_delta, threads);
  }
  // The decoding state: conv [B, Di, K − 1] (the last K − 1 inputs, oldest first), then the scan
  // state [B, Di, Ns], in the accumulator type. Constant in the sequence length.
  static constexpr std::size_t state_bytes(const mamba_shape& s) noexcept {
    return bytes_of<A>(s.batch, s.d_inner, s.d_conv - 1 + s.d_state);
  }
  // Scratch bytes one decoding step needs.
  static constexpr std::size_t step_workspace_bytes(const mamba_shape& s) noexcept {
    return kernels::template step_workspace_bytes<S, A>(s);
  }

  using weights = mamba_weights<S>;      // shape/mamba_shape.hpp: the parameters and their shapes
  using gradients = mamba_gradients<S>;  // accumulated (+=): the caller zeroes them

  // The decoding state over the caller's state_bytes(shape) bytes (aligned to accum_type).
  struct state {
    void* data = nullptr;      // the caller's bytes, aligned to accum_type
    std::size_t bytes = 0;     // size of data; at least state_bytes(shape)
    std::size_t position = 0;  // tokens consumed since reset
  };
  // A zeroed host state over the caller's bytes; throws if they are too few or misaligned.
  static state make_state(const mamba_shape& s, void* data, std::size_t bytes) {
    static_assert(is_cpu_backend_v<backend>,
                  "membound: a device decoding state is zeroed on the executor's stream: call "
                  "make_state(shape, data, bytes, executor) for mamba<..., cuda_backend>.");
    check(s);
    const std::size_t need = state_bytes(s);
    if (data == nullptr || bytes < need) throw workspace_too_small("state", need, data == nullptr ? 0 : bytes);
    detail::need_aligned(data, alignof(A), "state");
    state st{data, bytes, 0};
    reset(s, st);
    return st;
  }
  // The device state, zeroed on the executor's stream (cpu_backend: the same as above).
  static state make_state(const mamba_shape& s, void* data, std::size_t bytes, executor& ex) {
    check(s);
    const std::size_t need = state_bytes(s);
    if (data == nullptr || bytes < need) throw workspace_too_small("state", need, data == nullptr ? 0 : bytes);
    detail::need_aligned(data, alignof(A), "state");
    state st{data, bytes, 0};
    reset(s, st, ex);
    return st;
  }
  // Zeroes the state on the executor (a device state on its stream) to start new sequences.
  static void reset(const mamba_shape& s, state& st, executor& ex) {
    kernels::reset_state(st.data, state_bytes(s), ex);
    st.position = 0;
  }
  // Zeroes a host state to start new sequences.
  static void reset(const mamba_shape& s, state& st) {
    static_assert(is_cpu_backend_v<backend>,
                  "membound: a device decoding state is zeroed on the executor's stream: call "
                  "reset(shape, state, executor) for mamba<..., cuda_backend>.");
    kernels::reset_state(st.data, state_bytes(s));
    st.position = 0;
  }

  // ---- Forward -------------------------------------------------------------------------------
  // out = mamba(x) for the whole sequence; keeps what backward needs in `saved`. Checks every
  // argument before writing anything.
  static void forward(const mamba_shape& s, const weights& w, const S* x, S* out, void* saved,
                      std::size_t saved_size, void* workspace, std::size_t workspace_size,
                      executor& ex) {
    check(s);
    detail::need_offsets(s.offsets, s.sequences);
    check_weights(w);
    detail::need_pointer(x, "x");
    detail::need_pointer(out, "out");
    const auto sv = detail::carve_named(saved_layout(s), saved_bytes(s), saved, saved_size, "saved");
    detail::check_workspace_size(forward_workspace_bytes(s, workspace_threads(ex)), workspace,
                                 workspace_size);
    // Nothing below throws: every output is written after every check.
    kernels::template forward<S, A>(s, L, w, x, out, saved_view(sv), workspace, workspace_size, ex);
  }

  // ---- Backward ------------------------------------------------------------------------------
 public:
  // dx from dout (overwritten), and the weight gradients added to `g`, from forward's `saved`.
  static void backward(const mamba_shape& s, const weights& w, const S* x, const void* saved,
                       std::size_t saved_size, const S* dout, S* dx, const gradients& g,
                       void* workspace, std::size_t workspace_size, executor& ex) {
    check(s);
    detail::need_offsets(s.offsets, s.sequences);
    check_weights(w);
    detail::need_pointer(x, "x");
    detail::need_pointer(dout, "dout");
    detail::need_pointer(dx, "dx");
    check_gradients(g);
    const auto sv = detail::carve_named(saved_layout(s), saved_bytes(s), const_cast<void*>(saved),
                                        saved_size, "saved");
    detail::check_workspace_size(backward_workspace_bytes(s, workspace_threads(ex)), workspace,
                                 workspace_size);
    kernels::template backward<S, A>(s, L, w, x, saved_view(sv), dout, dx, g, workspace,
                                     workspace_size, ex);
  }

  // ---- Decoding ------------------------------------------------------------------------------
 public:
  // One token per sequence: x_t [B, C] -> out_t [B, C], carrying the conv and scan states.
  // shape.seq is ignored. Checks everything before touching the state or out_t.
  static void step(const mamba_shape& s, const weights& w, state& st, const S* x_t, S* out_t,
                   void* workspace, std::size_t workspace_size, executor& ex) {
    detail::refuse_packed_decoding(s.offsets, s.sequences,
                                   "Decode each sequence as a batch row: its state carries its own past");
    check(s);
    check_weights(w);
    detail::need_pointer(x_t, "x_t");
    detail::need_pointer(out_t, "out_t");
    if (st.data == nullptr || st.bytes < state_bytes(s)) {
      throw workspace_too_small("state", state_bytes(s), st.data == nullptr ? 0 : st.bytes);
    }
    detail::need_aligned(st.data, alignof(A), "state");
    detail::check_workspace_size(step_workspace_bytes(s), workspace, workspace_size);
    kernels::template step<S, A>(s, w, static_cast<A*>(st.data), x_t, out_t, workspace,
                                 workspace_size, ex);
    ++st.position;
  }

 private:
  // The backends' view of the saved buffers (c and Δ null unless save_all).
  template <typename SavedView>
  static mamba_saved<S, A> saved_view(const SavedView& sv) {
    return {sv.template get<S>(s_xz), sv.template get<S>(s_xdbl), sv.template get<A>(s_states),
            keep_conv_delta ? sv.template get<S>(s_c) : nullptr,
            keep_conv_delta ? sv.template get<S>(s_delta) : nullptr};
  }

 public:
  // Where forward put the chunk-entry states ([B, chunks − 1, Di, Ns], accum_type) inside
  // `saved`: for tests and diagnostics.
  static const A* saved_states(const mamba_shape& s, const void* saved) {
    return static_cast<const A*>(static_cast<const void*>(static_cast<const std::byte*>(saved) +
                                                          saved_layout(s).offset(s_states)));
  }

 private:
  // ---- Sizes ---------------------------------------------------------------------------------
  static constexpr std::size_t rows(const mamba_shape& s) noexcept { return s.batch * s.seq; }
  static constexpr std::size_t xz_bytes(const mamba_shape& s) noexcept {
    return bytes_of<S>(rows(s), 2 * s.d_inner);
  }
  static constexpr std::size_t xdbl_bytes(const mamba_shape& s) noexcept {
    return bytes_of<S>(rows(s), s.dt_rank + 2 * s.d_state);
  }
  static constexpr std::size_t states_bytes(const mamba_shape& s) noexcept {
    return bytes_of<A>(s.batch, cpu::scan_chunks(s.seq, L) - 1, s.d_inner, s.d_state);
  }
  static constexpr std::size_t inner_s_bytes(const mamba_shape& s) noexcept {  // c or Δ, kept
    return keep_conv_delta ? bytes_of<S>(rows(s), s.d_inner) : 0;
  }

  // ---- Layouts (shared by the size functions and the carving) ----------------------------------
  enum saved_slot : std::size_t { s_xz, s_xdbl, s_states, s_c, s_delta };
  static constexpr workspace_layout<5> saved_layout(const mamba_shape& s) {
    workspace_layout<5> l;
    l.add(xz_bytes(s));
    l.add(xdbl_bytes(s));
    l.add(states_bytes(s));
    l.add(inner_s_bytes(s));
    l.add(inner_s_bytes(s));
    return l;
  }

  // ---- Helpers -------------------------------------------------------------------------------
  static void check_weights(const weights& w) {
    detail::need_pointer(w.in_proj, "weights.in_proj");
    detail::need_pointer(w.conv_w, "weights.conv_w");
    detail::need_pointer(w.conv_b, "weights.conv_b");
    detail::need_pointer(w.x_proj, "weights.x_proj");
    detail::need_pointer(w.dt_proj, "weights.dt_proj");
    detail::need_pointer(w.dt_bias, "weights.dt_bias");
    detail::need_pointer(w.a_log, "weights.a_log");
    detail::need_pointer(w.d, "weights.d");
    detail::need_pointer(w.out_proj, "weights.out_proj");
  }
  static void check_gradients(const gradients& g) {
    detail::need_pointer(g.in_proj, "gradients.in_proj");
    detail::need_pointer(g.conv_w, "gradients.conv_w");
    detail::need_pointer(g.conv_b, "gradients.conv_b");
    detail::need_pointer(g.x_proj, "gradients.x_proj");
    detail::need_pointer(g.dt_proj, "gradients.dt_proj");
    detail::need_pointer(g.dt_bias, "gradients.dt_bias");
    detail::need_pointer(g.a_log, "gradients.a_log");
    detail::need_pointer(g.d, "gradients.d");
    detail::need_pointer(g.out_proj, "gradients.out_proj");
  }
};

MEMBOUND_NAMESPACE_END
