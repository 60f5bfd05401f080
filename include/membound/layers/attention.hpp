// The attention layer: causal or bidirectional multi-head attention with GQA/MQA and RoPE, whose
// memory is known before it runs. Semantics are those of tests/support/attention_reference.hpp:
//   q = x·Wq, k = x·Wk, v = x·Wv (W is [in, out], row-major), RoPE rotate-half on q and k at
//   position t, head h reads kv head h / (H / Hkv), S = q·kᵀ/√D, P = softmax (causal mask),
//   o = P·v with heads concatenated, y = o·Wo; lse is the natural-log logsumexp of S's rows.
//   shape.window = W > 0 keeps only keys i − W + 1 .. i (causal; |i − j| < W bidirectional):
//   Mistral-style sliding-window attention in O(T·W) work, decoding over a ring of W positions.
//   shape.offsets packs variable-length sequences on one token axis (FlashAttention's varlen):
//   each attends inside itself from RoPE position 0, as if run alone. The offsets are host
//   memory on both backends (checks and plans read them); the CUDA backend copies them into its
//   workspace on every call (packed_offsets_bytes of it).
//
//   using attn = membound::attention<membound::bf16_precision>;
//   attn::check(shape);                                          // throws, naming the argument
//   std::size_t saved = attn::saved_bytes(shape);                // kept from forward for backward
//   std::size_t fws = attn::forward_workspace_bytes(shape, pool.size());
//   attn::forward(shape, w, x, y, saved_buf, saved, ws, fws, pool);
//   attn::backward(shape, w, x, saved_buf, saved, dy, dx, grads, ws, bws, pool);
//
// Forward keeps only O ([B, T, H·D], storage) and lse ([B, H, T], accumulator); backward
// recomputes q, k, v from x and every score tile from q, k and lse, so no T×T matrix ever
// exists and every buffer grows linearly in T. The recompute policy chooses what q, k, v cost:
// `recompute` (the default) projects them again in backward, `save_all` keeps them (rotated, in
// the accumulator type, so backward sees forward's exact values) for 2·(H + 2·Hkv)·D more bytes
// per token in fp32 and no recomputation. Nothing allocates: all scratch is carved from
// the caller's workspace (CUB-style: query the size, then run), with slots of disjoint lifetimes
// sharing bytes; on the CPU that includes every GEMM's packing buffers (threads × the largest
// per-thread need of the pass, so size with the pool's thread count) and the RoPE table
// ([T, D] cos/sin, made once per call).
//
// This file is the front: checks, sizes, the saved and cache layouts, and one call into
// backend_kernels<backend, attention_shape>, the same call for every backend. The host's kernels
// and workspace layouts are backend/cpu/attention.hpp's; with cuda_backend in the policies
// (attention<bf16_precision, cuda_backend>) every pointer is device memory, the executor is a
// cuda_executor, and they are backend/cuda/attention.cuh's (include
// membound/backend/cuda.cuh, compile with nvcc). The device ignores `threads` and the tiles.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <algorithm>
#include <string>
#include <type_traits>

#include "membound/backend/cpu/attention.hpp"  // backend_kernels<cpu_backend, attention_shape>
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/core/error.hpp"
#include "membound/core/parallel.hpp"
#include "membound/core/type_list.hpp"
#include "membound/shape/attention_shape.hpp"
#include "membound/layers/layer_support.hpp"
#include "membound/memory/workspace.hpp"
#include "membound/policy/recompute.hpp"
#include "membound/policy/attention_span.hpp"
#include "membound/policy/backend.hpp"
#include "membound/policy/chunking.hpp"
#include "membound/policy/policy_set.hpp"
#include "membound/policy/precision.hpp"

MEMBOUND_NAMESPACE_BEGIN

// What attention::can_implement answers (layer_support under the layer's own name).
using attention_support = layer_support;

// The attention layer (see the file comment); Policies override the defaults in any order.
template <typename... Policies>
class attention {
 public:
  // Precision, tiles, recompute policy and backend: the defaults, overridden by Policies.
  using policies =
      policy_set<type_list<fp32_precision, attention_tiles<64, 64>, recompute, global_attention,
                           cpu_backend>,
                 Policies...>;
  // cpu_backend (the default) or cuda_backend: where the pointers live and whose kernels run.
  using backend = get_policy<policies, backend_kind>;
  using executor = typename backend::executor;  // thread_pool, or cuda_executor
  // Storage and accumulator types (fp32_precision by default).
  using precision = get_policy<policies, precision_kind>;
  // The CPU kernels' query and key/value tile sizes (attention_tiles<64, 64> by default).
  using tiles = get_policy<policies, chunking_kind>;
  // `recompute` (project q, k, v again in backward) or `save_all` (keep them in `saved`).
  using recompute_policy = get_policy<policies, recompute_kind>;
  // global_attention (the default: shape.window as given) or local_attention (a window required;
  // in a model, model_config::attention_window).
  using span = get_policy<policies, attention_span_kind>;
  // Whether span is local_attention.
  static constexpr bool local = std::is_same_v<span, local_attention>;
  // The former name of recompute_policy, kept so that old code still compiles (with a warning).
  using checkpoint [[deprecated("membound: a layer's checkpoint policy is now its recompute_policy")]] =
      recompute_policy;
  static_assert(is_attention_tiles_v<tiles>,
                "membound: attention takes attention_tiles<QTile, KVTile> as its chunking policy "
                "(scan_chunk and ttt_mini_batch belong to Mamba and TTT).");
  static_assert(std::is_same_v<recompute_policy, recompute> || std::is_same_v<recompute_policy, save_all>,
                "membound: attention takes `recompute` (keep O and lse, project q, k, v again in "
                "backward) or `save_all` (keep q, k, v too) as its recompute policy; "
                "ttt_state_groups belongs to the TTT layer.");
  // Element type of x, y, the weights and the gradients.
  using storage_type = typename precision::storage_type;
  // Type the kernels accumulate in; lse is saved in it.
  using accum_type = typename precision::accum_type;

 private:
  using S = storage_type;
  using A = accum_type;
  static constexpr bool keep_qkv = std::is_same_v<recompute_policy, save_all>;
  using kernels = backend_kernels<backend, attention_shape>;

 public:
  // ---- Checks --------------------------------------------------------------------------------
  // Whether the shape can run, and if not which field fails and why. Never throws.
  static constexpr attention_support can_implement(const attention_shape& s) noexcept {
    auto no = [](const char* arg, const char* expected, double actual) {
      return attention_support{false, arg, expected, actual};
    };
    const auto d = [](std::size_t v) { return static_cast<double>(v); };
    if (s.batch == 0) return no("shape.batch", "at least 1", 0.0);
    if (s.seq == 0) return no("shape.seq", "at least 1", 0.0);
    if (s.d_model == 0) return no("shape.d_model", "at least 1", 0.0);
    if (s.heads == 0) return no("shape.heads", "at least 1", 0.0);
    if (s.kv_heads == 0) return no("shape.kv_heads", "at least 1", 0.0);
    if (s.head_dim == 0 || s.head_dim % 8 != 0 || s.head_dim > 256) {
      return no("shape.head_dim", "a multiple of 8 up to 256", d(s.head_dim));
    }
    if (s.heads % s.kv_heads != 0) {
      return no("shape.kv_heads", "a divisor of shape.heads", d(s.kv_heads));
    }
    if (local && s.window == 0) {
      return no("shape.window", "at least 1 (a local_attention layer)", 0.0);
    }
    if (s.offsets != nullptr || s.sequences != 0) {
      const attention_support r = detail::packing_support(s.offsets, s.sequences, s.batch, s.seq);
      if (!r.ok) return r;
    }
    // NaN fails the first comparison, +inf the second.
    if (!(s.rope_base > 0.0) || !(s.rope_base < std::numeric_limits<double>::infinity())) {
      return no("shape.rope_base", "a finite value above 0", s.rope_base);
    }
    return {};
  }

  // Throws invalid_argument naming the failing field, as can_implement reports it.
  static void check(const attention_shape& s) {
    const attention_support r = can_implement(s);
    if (!r.ok) {
      const bool window = std::string(r.argument) == "shape.window";
      detail::throw_unsupported(r, std::string(r.argument) == "shape.rope_base",
                                window ? "Set the window (in a model: model_config::attention_window)"
                                       : "Fix the attention_shape before sizing or running the layer");
    }
  }

  // ---- Memory known before running ------------------------------------------------------------
  // Elements of Wq, Wk, Wv and Wo together.
  static constexpr std::size_t weight_elements(const attention_shape& s) noexcept {
    return attention_weight_elements(s);
  }

  // O ([B, T, H·D], storage) and lse ([B, H, T], accumulator: fp64 keeps a double lse so that
  // backward recomputes P to fp64 accuracy).
  static constexpr std::size_t saved_bytes(const attention_shape& s) noexcept {
    const std::size_t b[] = {o_bytes(s), lse_bytes(s), q_bytes(s), kv_bytes(s)};
    return detail::fits_layout(b) ? saved_layout(s).size() : std::numeric_limits<std::size_t>::max();
  }
  // Scratch bytes forward needs for `threads` CPU threads (the pool's size; the device ignores it).
  static constexpr std::size_t forward_workspace_bytes(const attention_shape& s,
                                                       std::size_t threads) noexcept {
    return kernels::template forward_workspace_bytes<S, A, tiles>(s, keep_qkv, threads);
  }
  // Scratch bytes backward needs for `threads` CPU threads.
  static constexpr std::size_t backward_workspace_bytes(const attention_shape& s,
                                                        std::size_t threads) noexcept {
    return kernels::template backward_workspace_bytes<S, A, tiles>(s, keep_qkv, threads);
  }
  // Rotated keys then values, each [B, Hkv, slots, D] in storage_type: slots = max_len, or the
  // window W when shape.window is below max_len (a ring of the last W positions: flat at any
  // length, so max_len may be as large as the generation can run).
  static constexpr std::size_t kv_cache_bytes(const attention_shape& s,
                                              std::size_t max_len) noexcept {
    const std::size_t half = bytes_of<S>(s.batch, s.kv_heads, kv_cache_slots(s, max_len), s.head_dim);
    return detail::sat_add(half, half);
  }
  // Scratch bytes one decoding step needs with a cache for max_len positions.
  static constexpr std::size_t step_workspace_bytes(const attention_shape& s, std::size_t max_len,
                                                    std::size_t threads) noexcept {
    return kernels::template step_workspace_bytes<S, A, tiles>(s, kv_cache_slots(s, max_len), threads);
  }

  // The layer's parameters, read only: [in, out] matrices, row-major, in storage_type.
  struct weights {
    const S* wq;  // [C, H·D]
    const S* wk;  // [C, Hkv·D]
    const S* wv;  // [C, Hkv·D]
    const S* wo;  // [H·D, C]
  };
  // Where backward adds (+=) the weight gradients, shaped as `weights`: the caller zeroes them.
  struct gradients {
    S* wq;  // dL/dWq, [C, H·D]
    S* wk;  // dL/dWk, [C, Hkv·D]
    S* wv;  // dL/dWv, [C, Hkv·D]
    S* wo;  // dL/dWo, [H·D, C]
  };

  // A KV cache over the caller's bytes (kv_cache_bytes(shape, max_len) of them, aligned to
  // storage_type): rotated keys [B, Hkv, slots, D], then values, slots = kv_cache_slots(shape,
  // max_len); position p lives in slot p mod slots. `length` positions have been decoded; the
  // next step runs at position `length`. Reset by setting length = 0.
  struct kv_cache {
    void* data = nullptr;     // the caller's bytes, aligned to storage_type
    std::size_t bytes = 0;    // size of data; at least kv_cache_bytes(shape, max_len)
    std::size_t max_len = 0;  // positions the cache can decode (it keeps the last W under a window)
    std::size_t length = 0;   // positions decoded; the next step writes position `length`

    // Start of the rotated keys, [B, Hkv, slots, D].
    S* keys() const noexcept { return static_cast<S*>(data); }
    // Start of the values, half_elements (B·Hkv·slots·D) past the keys.
    S* values(std::size_t half_elements) const noexcept { return keys() + half_elements; }
  };

  // An empty cache over the caller's bytes; throws if they are too few or misaligned.
  static kv_cache make_kv_cache(const attention_shape& s, void* data, std::size_t bytes,
                                std::size_t max_len) {
    check(s);
    if (max_len == 0) {
      throw invalid_argument("max_len", "at least 1", "0",
                             "A cache holds at least the position being generated");
    }
    const std::size_t need = kv_cache_bytes(s, max_len);
    if (data == nullptr || bytes < need) {
      throw workspace_too_small("cache", need, data == nullptr ? 0 : bytes);
    }
    detail::need_aligned(data, alignof(S), "cache");
    return kv_cache{data, bytes, max_len, 0};
  }

  // Where forward put lse ([B, H, T], accum_type) inside `saved`: for tests and diagnostics.
  static const A* saved_lse(const attention_shape& s, const void* saved) {
    return static_cast<const A*>(static_cast<const void*>(static_cast<const std::byte*>(saved) +
                                                          saved_layout(s).offset(s_lse)));
  }

  // ---- Forward -------------------------------------------------------------------------------
  // y = attention(x) for the whole sequence; keeps O and lse (and q, k, v under save_all) in
  // `saved` for backward. Checks every argument before writing anything.
  static void forward(const attention_shape& s, const weights& w, const S* x, S* y, void* saved,
                      std::size_t saved_size, void* workspace, std::size_t workspace_size,
                      executor& ex) {
    check(s);
    detail::need_offsets(s.offsets, s.sequences);
    check_weights(w);
    detail::need_pointer(x, "x");
    detail::need_pointer(y, "y");
    const auto sv = detail::carve_named(saved_layout(s), saved_bytes(s), saved, saved_size, "saved");
    detail::check_workspace_size(forward_workspace_bytes(s, workspace_threads(ex)), workspace, workspace_size);
    // Nothing below throws: every output is written after every check.
    kernels::template forward<S, A, tiles>(s, w.wq, w.wk, w.wv, w.wo, x, y, sv.template get<S>(s_o),
                                           sv.template get<A>(s_lse), kept(sv, s_q), kept(sv, s_k),
                                           kept(sv, s_v), workspace, workspace_size, ex);
  }

  // ---- Backward ------------------------------------------------------------------------------
  // dx from dy (overwritten), and the weight gradients added to `g`, from forward's `saved`.
  static void backward(const attention_shape& s, const weights& w, const S* x, const void* saved,
                       std::size_t saved_size, const S* dy, S* dx, const gradients& g,
                       void* workspace, std::size_t workspace_size, executor& ex) {
    check(s);
    detail::need_offsets(s.offsets, s.sequences);
    check_weights(w);
    detail::need_pointer(x, "x");
    detail::need_pointer(dy, "dy");
    detail::need_pointer(dx, "dx");
    detail::need_pointer(g.wq, "gradients.wq");
    detail::need_pointer(g.wk, "gradients.wk");
    detail::need_pointer(g.wv, "gradients.wv");
    detail::need_pointer(g.wo, "gradients.wo");
    const auto sv = detail::carve_named(saved_layout(s), saved_bytes(s), const_cast<void*>(saved),
                                        saved_size, "saved");
    detail::check_workspace_size(backward_workspace_bytes(s, workspace_threads(ex)), workspace, workspace_size);
    kernels::template backward<S, A, tiles>(
        s, w.wq, w.wk, w.wv, w.wo, x, static_cast<const S*>(sv.template get<S>(s_o)),
        static_cast<const A*>(sv.template get<A>(s_lse)), kept(sv, s_q), kept(sv, s_k),
        kept(sv, s_v), dy, dx, g.wq, g.wk, g.wv, g.wo, workspace, workspace_size, ex);
  }

  // ---- Decoding ------------------------------------------------------------------------------
  // One causal position per sequence: x_t [B, C] -> y_t [B, C] at position cache.length, whose
  // rotated key and value are appended to the cache. shape.seq is ignored. Checks everything
  // (including room in the cache) before touching the cache or y_t.
  static void step(const attention_shape& s, const weights& w, kv_cache& cache, const S* x_t,
                   S* y_t, void* workspace, std::size_t workspace_size, executor& ex) {
    detail::refuse_packed_decoding(s.offsets, s.sequences,
                                   "Decode each sequence as a batch row: its cache holds its own positions");
    check(s);
    if (!s.causal) {
      throw invalid_argument("shape.causal", "true", "false",
                             "Single-step decoding reproduces only causal attention");
    }
    check_weights(w);
    detail::need_pointer(x_t, "x_t");
    detail::need_pointer(y_t, "y_t");
    const std::size_t L = cache.max_len;
    if (L == 0 || cache.data == nullptr || cache.bytes < kv_cache_bytes(s, L)) {
      throw workspace_too_small("cache", kv_cache_bytes(s, L),
                                cache.data == nullptr ? 0 : cache.bytes);
    }
    detail::need_aligned(cache.data, alignof(S), "cache");
    if (cache.length >= L) {
      throw invalid_argument("cache", "room for one more position (max_len " + std::to_string(L) + ")",
                             "length " + std::to_string(cache.length),
                             "Make the cache with a larger max_len");
    }
    detail::check_workspace_size(step_workspace_bytes(s, L, workspace_threads(ex)), workspace, workspace_size);
    const std::size_t slots = kv_cache_slots(s, L);
    const std::size_t half = s.batch * s.kv_heads * slots * s.head_dim;
    kernels::template step<S, A, tiles>(s, w.wq, w.wk, w.wv, w.wo, cache.keys(), cache.values(half),
                                        slots, cache.length, x_t, y_t, workspace, workspace_size, ex);
    cache.length += 1;
  }

 private:
  // ---- Layouts (shared by the size functions and the carving) ----------------------------------
  static constexpr std::size_t o_bytes(const attention_shape& s) noexcept {
    return bytes_of<S>(s.batch, s.seq, s.heads, s.head_dim);
  }
  static constexpr std::size_t lse_bytes(const attention_shape& s) noexcept {
    return bytes_of<A>(s.batch, s.heads, s.seq);
  }
  static constexpr std::size_t q_bytes(const attention_shape& s) noexcept {
    return bytes_of<A>(s.batch, s.seq, s.heads, s.head_dim);
  }
  static constexpr std::size_t kv_bytes(const attention_shape& s) noexcept {
    return bytes_of<A>(s.batch, s.seq, s.kv_heads, s.head_dim);
  }
  // q, k, v: only under save_all (0 bytes otherwise).
  enum saved_slot : std::size_t { s_o, s_lse, s_q, s_k, s_v };
  static constexpr workspace_layout<5> saved_layout(const attention_shape& s) {
    workspace_layout<5> l;
    l.add(o_bytes(s));
    l.add(lse_bytes(s));
    l.add(keep_qkv ? q_bytes(s) : 0);
    l.add(keep_qkv ? kv_bytes(s) : 0);
    l.add(keep_qkv ? kv_bytes(s) : 0);
    return l;
  }

  // ---- Helpers -------------------------------------------------------------------------------
  // q, k or v kept in `saved` under save_all; nullptr under recompute.
  template <typename View>
  static A* kept(const View& sv, saved_slot slot) {
    if constexpr (keep_qkv) {
      return sv.template get<A>(slot);
    } else {
      (void)sv;
      (void)slot;
      return nullptr;
    }
  }
  static void check_weights(const weights& w) {
    detail::need_pointer(w.wq, "weights.wq");
    detail::need_pointer(w.wk, "weights.wk");
    detail::need_pointer(w.wv, "weights.wv");
    detail::need_pointer(w.wo, "weights.wo");
  }
};

MEMBOUND_NAMESPACE_END
