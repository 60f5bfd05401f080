// The attention layer: causal or bidirectional multi-head attention with GQA/MQA and RoPE, whose
// memory is known before it runs. Semantics are those of tests/support/attention_reference.hpp:
//   q = x·Wq, k = x·Wk, v = x·Wv (W is [in, out], row-major), RoPE rotate-half on q and k at
//   position t, head h reads kv head h / (H / Hkv), S = q·kᵀ/√D, P = softmax (causal mask),
//   o = P·v with heads concatenated, y = o·Wo; lse is the natural-log logsumexp of S's rows.
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
// exists and every buffer grows linearly in T. The checkpoint policy chooses what q, k, v cost:
// `recompute` (the default) projects them again in backward, `save_all` keeps them (rotated, in
// the accumulator type, so backward sees forward's exact values) for 2·(H + 2·Hkv)·D more bytes
// per token in fp32 and no recomputation. Nothing allocates: all scratch is carved from
// the caller's workspace (CUB-style: query the size, then run), with slots of disjoint lifetimes
// sharing bytes; on the CPU that includes every GEMM's packing buffers (threads × the largest
// per-thread need of the pass, so size with the pool's thread count) and the RoPE table
// ([T, D] cos/sin, made once per call). The kernels are in backend/cpu/attention_cpu.hpp.
//
// With cuda_backend in the policies (attention<bf16_precision, cuda_backend>) every pointer is
// device memory, the executor is a cuda_executor, and the kernels and the device workspace
// layouts are backend/cuda/attention_cuda.cuh's (include membound/backend/cuda.cuh, compile with
// nvcc). Same checks, same saved layout, same kv cache layout; the size functions keep their
// signatures and ignore `threads`.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <algorithm>
#include <string>
#include <type_traits>

#include "membound/backend/cpu/attention_cpu.hpp"
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/core/error.hpp"
#include "membound/core/parallel.hpp"
#include "membound/core/type_list.hpp"
#include "membound/shape/attention_shape.hpp"
#include "membound/layers/layer_support.hpp"
#include "membound/memory/workspace.hpp"
#include "membound/policy/checkpoint.hpp"
#include "membound/policy/backend.hpp"
#include "membound/policy/chunking.hpp"
#include "membound/policy/policy_set.hpp"
#include "membound/policy/precision.hpp"

MEMBOUND_NAMESPACE_BEGIN

using attention_support = layer_support;

template <typename... Policies>
class attention {
 public:
  using policies =
      policy_set<type_list<fp32_precision, attention_tiles<64, 64>, recompute, cpu_backend>,
                 Policies...>;
  using backend = get_policy<policies, backend_kind>;
  using executor = typename backend::executor;  // thread_pool, or cuda_executor
  using precision = get_policy<policies, precision_kind>;
  using tiles = get_policy<policies, chunking_kind>;
  using checkpoint = get_policy<policies, checkpoint_kind>;
  static_assert(is_attention_tiles_v<tiles>,
                "membound: attention takes attention_tiles<QTile, KVTile> as its chunking policy "
                "(scan_chunk and ttt_mini_batch belong to Mamba and TTT).");
  static_assert(std::is_same_v<checkpoint, recompute> || std::is_same_v<checkpoint, save_all>,
                "membound: attention takes `recompute` (keep O and lse, project q, k, v again in "
                "backward) or `save_all` (keep q, k, v too) as its checkpoint policy; "
                "ttt_checkpoint_groups belongs to the TTT layer.");
  using storage_type = typename precision::storage_type;
  using accum_type = typename precision::accum_type;

 private:
  using S = storage_type;
  using A = accum_type;
  static constexpr bool widened = !std::is_same_v<S, A>;  // bf16/fp16: convert to A first
  static constexpr std::size_t qt = tiles::q_tile, kt = tiles::kv_tile;
  static constexpr bool keep_qkv = std::is_same_v<checkpoint, save_all>;
  // With cuda_backend every pointer is device memory and the kernels are
  // backend/cuda/attention_cuda.cuh's; the size functions keep the CPU's signatures and ignore
  // `threads` on the device.
  static constexpr bool on_cpu = is_cpu_backend_v<backend>;
  using device = backend_kernels<backend, attention_shape>;

 public:
  // ---- Checks --------------------------------------------------------------------------------
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
    // NaN fails the first comparison, +inf the second.
    if (!(s.rope_base > 0.0) || !(s.rope_base < std::numeric_limits<double>::infinity())) {
      return no("shape.rope_base", "a finite value above 0", s.rope_base);
    }
    return {};
  }

  static void check(const attention_shape& s) {
    const attention_support r = can_implement(s);
    if (!r.ok) {
      detail::throw_unsupported(r, std::string(r.argument) == "shape.rope_base",
                                "Fix the attention_shape before sizing or running the layer");
    }
  }

  // ---- Memory known before running ------------------------------------------------------------
  static constexpr std::size_t weight_elements(const attention_shape& s) noexcept {
    const std::size_t HD = s.heads * s.head_dim, KD = s.kv_heads * s.head_dim;
    return s.d_model * HD + 2 * s.d_model * KD + HD * s.d_model;
  }

  // O ([B, T, H·D], storage) and lse ([B, H, T], accumulator: fp64 keeps a double lse so that
  // backward recomputes P to fp64 accuracy).
  static constexpr std::size_t saved_bytes(const attention_shape& s) noexcept {
    const std::size_t b[] = {o_bytes(s), lse_bytes(s), q_bytes(s), kv_bytes(s)};
    return detail::fits_layout(b) ? saved_layout(s).size() : std::numeric_limits<std::size_t>::max();
  }
  static constexpr std::size_t forward_workspace_bytes(const attention_shape& s,
                                                       std::size_t threads) noexcept {
    if constexpr (!on_cpu) return device::template forward_workspace_bytes<S>(s, keep_qkv);
    const std::size_t b[] = {x_acc_bytes(s), w_acc_bytes(s), q_bytes(s), kv_bytes(s),
                             bytes_of<A>(threads, cpu::forward_scratch(qt, kt, s.head_dim)),
                             y_acc_bytes(s), rope_bytes(s.seq, s.head_dim),
                             bytes_of<std::byte>(threads, forward_pack_bytes(s))};
    return detail::fits_layout(b) ? forward_layout(s, threads).size()
                                  : std::numeric_limits<std::size_t>::max();
  }
  static constexpr std::size_t backward_workspace_bytes(const attention_shape& s,
                                                        std::size_t threads) noexcept {
    if constexpr (!on_cpu) return device::template backward_workspace_bytes<S>(s, keep_qkv);
    const std::size_t b[] = {x_acc_bytes(s), w_acc_bytes(s), q_bytes(s), kv_bytes(s),
                             bytes_of<A>(threads, cpu::backward_scratch(qt, kt)),
                             y_acc_bytes(s), bytes_of<A>(s.d_model, s.heads * s.head_dim),
                             rope_bytes(s.seq, s.head_dim),
                             bytes_of<std::byte>(threads, backward_pack_bytes(s))};
    return detail::fits_layout(b) ? backward_layout(s, threads).size()
                                  : std::numeric_limits<std::size_t>::max();
  }
  // Rotated keys then values, each [B, Hkv, max_len, D] in storage_type.
  static constexpr std::size_t kv_cache_bytes(const attention_shape& s,
                                              std::size_t max_len) noexcept {
    const std::size_t half = bytes_of<S>(s.batch, s.kv_heads, max_len, s.head_dim);
    return detail::sat_add(half, half);
  }
  static constexpr std::size_t step_workspace_bytes(const attention_shape& s, std::size_t max_len,
                                                    std::size_t threads) noexcept {
    if constexpr (!on_cpu) return device::template step_workspace_bytes<S>(s, max_len);
    const std::size_t b[] = {w_acc_bytes(s), bytes_of<A>(threads, max_len),
                             bytes_of<A>(s.batch, s.heads, s.head_dim),
                             bytes_of<std::byte>(threads, step_pack_bytes(s))};
    return detail::fits_layout(b) ? step_layout(s, max_len, threads).size()
                                  : std::numeric_limits<std::size_t>::max();
  }

  struct weights {
    const S* wq;  // [C, H·D]
    const S* wk;  // [C, Hkv·D]
    const S* wv;  // [C, Hkv·D]
    const S* wo;  // [H·D, C]
  };
  struct gradients {  // accumulated (+=): the caller zeroes them
    S* wq;
    S* wk;
    S* wv;
    S* wo;
  };

  // A KV cache over the caller's bytes (kv_cache_bytes(shape, max_len) of them, aligned to
  // storage_type): rotated keys [B, Hkv, max_len, D], then values. `length` positions are
  // filled; the next step runs at position `length`. Reset by setting length = 0.
  struct kv_cache {
    void* data = nullptr;
    std::size_t bytes = 0;
    std::size_t max_len = 0;
    std::size_t length = 0;

    S* keys() const noexcept { return static_cast<S*>(data); }
    S* values(std::size_t half_elements) const noexcept { return keys() + half_elements; }
  };

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
    detail::check_aligned(data, alignof(S), "cache");
    return kv_cache{data, bytes, max_len, 0};
  }

  // Where forward put lse ([B, H, T], accum_type) inside `saved`: for tests and diagnostics.
  static const A* saved_lse(const attention_shape& s, const void* saved) {
    return static_cast<const A*>(static_cast<const void*>(static_cast<const std::byte*>(saved) +
                                                          saved_layout(s).offset(s_lse)));
  }

  // ---- Forward -------------------------------------------------------------------------------
  static void forward(const attention_shape& s, const weights& w, const S* x, S* y, void* saved,
                      std::size_t saved_size, void* workspace, std::size_t workspace_size,
                      executor& pool) {
    check(s);
    check_weights(w);
    detail::not_null(x, "x");
    detail::not_null(y, "y");
    const auto sv = detail::carve_named(saved_layout(s), saved_bytes(s), saved, saved_size, "saved");
    if constexpr (!on_cpu) {
      detail::carve_named(device_layout(forward_workspace_bytes(s, 0)), forward_workspace_bytes(s, 0),
                          workspace, workspace_size, "workspace");
      device::template forward<S, A>(s, w.wq, w.wk, w.wv, w.wo, x, y, sv.template get<S>(s_o),
                                     sv.template get<A>(s_lse), kept<A>(sv, s_q), kept<A>(sv, s_k),
                                     kept<A>(sv, s_v), workspace, workspace_size, pool);
    } else {
    const std::size_t threads = pool.size();
    const auto ws = detail::carve_named(forward_layout(s, threads), forward_workspace_bytes(s, threads),
                                workspace, workspace_size, "workspace");
    // Nothing below throws: every output is written after every check.
    const std::size_t B = s.batch, T = s.seq, C = s.d_model, N = B * T;
    const std::size_t HD = s.heads * s.head_dim;
    const A* xa = cpu::widen_or_alias(pool, x, N * C, ws.template get<A>(f_x));
    const wptrs wa = widen_weights(w, s, ws.template get<A>(f_w), pool);
    A* q = keep_qkv ? sv.template get<A>(s_q) : ws.template get<A>(f_q);
    A* k = keep_qkv ? sv.template get<A>(s_k) : ws.template get<A>(f_k);
    A* v = keep_qkv ? sv.template get<A>(s_v) : ws.template get<A>(f_v);
    const gemm_ws pk{ws.template get<std::byte>(f_gemm), threads * forward_pack_bytes(s)};
    A* table = ws.template get<A>(f_rope);
    cpu::rope_table(pool, table, T, s.head_dim, s.rope_base, 0);
    project_qkv(s, xa, wa, q, k, v, table, pk.span(), pool);

    S* o_saved = sv.template get<S>(s_o);
    A* o = cpu::accum_target(o_saved, ws.template get<A>(f_o));
    cpu::flash_forward(pool, s, qt, kt, q, k, v, o, sv.template get<A>(s_lse),
                       ws.template get<A>(f_scratch), pk.data);
    if constexpr (widened) cpu::narrow(pool, static_cast<const A*>(o), N * HD, o_saved);

    A* ya = cpu::accum_target(y, ws.template get<A>(f_y));
    cpu::matmul(pool, static_cast<const A*>(o), wa.o, ya, N, HD, C, false, cpu::ld3{HD, C, C},
                pk.span());
    if constexpr (widened) cpu::narrow(pool, static_cast<const A*>(ya), N * C, y);
    }
  }

  // ---- Backward ------------------------------------------------------------------------------
  static void backward(const attention_shape& s, const weights& w, const S* x, const void* saved,
                       std::size_t saved_size, const S* dy, S* dx, const gradients& g,
                       void* workspace, std::size_t workspace_size, executor& pool) {
    check(s);
    check_weights(w);
    detail::not_null(x, "x");
    detail::not_null(dy, "dy");
    detail::not_null(dx, "dx");
    detail::not_null(g.wq, "gradients.wq");
    detail::not_null(g.wk, "gradients.wk");
    detail::not_null(g.wv, "gradients.wv");
    detail::not_null(g.wo, "gradients.wo");
    const auto sv = detail::carve_named(saved_layout(s), saved_bytes(s), const_cast<void*>(saved),
                                saved_size, "saved");
    if constexpr (!on_cpu) {
      detail::carve_named(device_layout(backward_workspace_bytes(s, 0)),
                          backward_workspace_bytes(s, 0), workspace, workspace_size, "workspace");
      device::template backward<S, A>(
          s, w.wq, w.wk, w.wv, w.wo, x, static_cast<const S*>(sv.template get<S>(s_o)),
          static_cast<const A*>(sv.template get<A>(s_lse)), static_cast<const A*>(kept<A>(sv, s_q)),
          static_cast<const A*>(kept<A>(sv, s_k)), static_cast<const A*>(kept<A>(sv, s_v)), dy, dx,
          g.wq, g.wk, g.wv, g.wo, workspace, workspace_size, pool);
    } else {
    const std::size_t threads = pool.size();
    const auto ws = detail::carve_named(backward_layout(s, threads), backward_workspace_bytes(s, threads),
                                workspace, workspace_size, "workspace");
    const std::size_t B = s.batch, T = s.seq, C = s.d_model, N = B * T;
    const std::size_t HD = s.heads * s.head_dim, KD = s.kv_heads * s.head_dim;

    // Phase 0: q, k, v (kept, or projected again); dO = dy·Woᵀ and Δ = rowsum(dO ⊙ O).
    const A* xa = cpu::widen_or_alias(pool, x, N * C, ws.template get<A>(b_x));
    const wptrs wa = widen_weights(w, s, ws.template get<A>(b_w), pool);
    A* q = keep_qkv ? sv.template get<A>(s_q) : ws.template get<A>(b_q);
    A* k = keep_qkv ? sv.template get<A>(s_k) : ws.template get<A>(b_k);
    A* v = keep_qkv ? sv.template get<A>(s_v) : ws.template get<A>(b_v);
    const gemm_ws pk{ws.template get<std::byte>(b_gemm), threads * backward_pack_bytes(s)};
    A* table = ws.template get<A>(b_rope);
    cpu::rope_table(pool, table, T, s.head_dim, s.rope_base, 0);
    if constexpr (!keep_qkv) project_qkv(s, xa, wa, q, k, v, table, pk.span(), pool);
    const A* dya = cpu::widen_or_alias(pool, dy, N * C, ws.template get<A>(b_dy));
    const A* o = cpu::widen_or_alias(pool, static_cast<const S*>(sv.template get<S>(s_o)), N * HD,
                                     ws.template get<A>(b_o));
    const A* lse = sv.template get<A>(s_lse);
    A* d_out = ws.template get<A>(b_dout);
    A* delta = ws.template get<A>(b_delta);
    cpu::matmul_bt(pool, dya, wa.o, d_out, N, C, HD, false, cpu::ld3{C, C, HD}, pk.span());
    cpu::row_dot(pool, s, static_cast<const A*>(d_out), o, delta);

    // Phase 1: the tiled attention backward.
    A* dq = ws.template get<A>(b_dq);
    A* dk = ws.template get<A>(b_dk);
    A* dv = ws.template get<A>(b_dv);
    cpu::flash_backward(pool, s, qt, kt, static_cast<const A*>(q), static_cast<const A*>(k),
                        static_cast<const A*>(v), static_cast<const A*>(d_out), lse,
                        static_cast<const A*>(delta), dq, dk, dv, ws.template get<A>(b_scratch),
                        pk.data);

    // Phase 2: undo RoPE (its transpose) and the weight gradients.
    cpu::rope_rows(pool, dq, N, T, s.heads, s.head_dim, static_cast<const A*>(table), true);
    cpu::rope_rows(pool, dk, N, T, s.kv_heads, s.head_dim, static_cast<const A*>(table), true);
    A* tmp = ws.template get<A>(b_dw);
    cpu::weight_grad(pool, xa, static_cast<const A*>(dq), g.wq, tmp, N, C, HD, pk.span());
    cpu::weight_grad(pool, xa, static_cast<const A*>(dk), g.wk, tmp, N, C, KD, pk.span());
    cpu::weight_grad(pool, xa, static_cast<const A*>(dv), g.wv, tmp, N, C, KD, pk.span());
    cpu::weight_grad(pool, o, dya, g.wo, tmp, N, HD, C, pk.span());

    // Phase 3: dx = dq·Wqᵀ + dk·Wkᵀ + dv·Wvᵀ.
    A* dxa = cpu::accum_target(dx, ws.template get<A>(b_dx));
    cpu::matmul_bt(pool, static_cast<const A*>(dq), wa.q, dxa, N, HD, C, false,
                   cpu::ld3{HD, HD, C}, pk.span());
    cpu::matmul_bt(pool, static_cast<const A*>(dk), wa.k, dxa, N, KD, C, true,
                   cpu::ld3{KD, KD, C}, pk.span());
    cpu::matmul_bt(pool, static_cast<const A*>(dv), wa.v, dxa, N, KD, C, true,
                   cpu::ld3{KD, KD, C}, pk.span());
    if constexpr (widened) cpu::narrow(pool, static_cast<const A*>(dxa), N * C, dx);
    }
  }

  // ---- Decoding ------------------------------------------------------------------------------
  // One causal position per sequence: x_t [B, C] -> y_t [B, C] at position cache.length, whose
  // rotated key and value are appended to the cache. shape.seq is ignored. Checks everything
  // (including room in the cache) before touching the cache or y_t.
  static void step(const attention_shape& s, const weights& w, kv_cache& cache, const S* x_t,
                   S* y_t, void* workspace, std::size_t workspace_size, executor& pool) {
    check(s);
    if (!s.causal) {
      throw invalid_argument("shape.causal", "true", "false",
                             "Single-step decoding reproduces only causal attention");
    }
    check_weights(w);
    detail::not_null(x_t, "x_t");
    detail::not_null(y_t, "y_t");
    const std::size_t L = cache.max_len;
    if (L == 0 || cache.data == nullptr || cache.bytes < kv_cache_bytes(s, L)) {
      throw workspace_too_small("cache", kv_cache_bytes(s, L),
                                cache.data == nullptr ? 0 : cache.bytes);
    }
    detail::check_aligned(cache.data, alignof(S), "cache");
    if (cache.length >= L) {
      throw invalid_argument("cache", "room for one more position (max_len " + std::to_string(L) + ")",
                             "length " + std::to_string(cache.length),
                             "Make the cache with a larger max_len");
    }
    if constexpr (!on_cpu) {
      detail::carve_named(device_layout(step_workspace_bytes(s, L, 0)),
                          step_workspace_bytes(s, L, 0), workspace, workspace_size, "workspace");
      const std::size_t half = s.batch * s.kv_heads * L * s.head_dim;
      device::template step<S, A>(s, w.wq, w.wk, w.wv, w.wo, cache.keys(), cache.values(half), L,
                                  cache.length, x_t, y_t, workspace, workspace_size, pool);
      cache.length += 1;
    } else {
    const std::size_t threads = pool.size();
    const auto ws = detail::carve_named(step_layout(s, L, threads), step_workspace_bytes(s, L, threads),
                                workspace, workspace_size, "workspace");
    const std::size_t B = s.batch, C = s.d_model, Hkv = s.kv_heads, D = s.head_dim;
    const std::size_t HD = s.heads * D, KD = Hkv * D, t = cache.length;

    const A* xa = cpu::widen_or_alias(pool, x_t, B * C, ws.template get<A>(st_x));
    const wptrs wa = widen_weights(w, s, ws.template get<A>(st_w), pool);
    A* q = ws.template get<A>(st_q);
    A* k = ws.template get<A>(st_k);
    A* v = ws.template get<A>(st_v);
    const gemm_ws pk{ws.template get<std::byte>(st_gemm), threads * step_pack_bytes(s)};
    A* table = ws.template get<A>(st_rope);
    cpu::rope_table(pool, table, 1, D, s.rope_base, t);
    cpu::matmul(pool, xa, wa.q, q, B, C, HD, false, cpu::ld3{C, HD, HD}, pk.span());
    cpu::matmul(pool, xa, wa.k, k, B, C, KD, false, cpu::ld3{C, KD, KD}, pk.span());
    cpu::matmul(pool, xa, wa.v, v, B, C, KD, false, cpu::ld3{C, KD, KD}, pk.span());
    cpu::rope_rows(pool, q, B, 1, s.heads, D, static_cast<const A*>(table), false);
    cpu::rope_rows(pool, k, B, 1, Hkv, D, static_cast<const A*>(table), false);
    const std::size_t half = B * Hkv * L * D;
    S* ck = cache.keys();
    S* cv = cache.values(half);
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t g = 0; g < Hkv; ++g)
        for (std::size_t d = 0; d < D; ++d) {
          ck[((b * Hkv + g) * L + t) * D + d] = from_accum<S>(k[b * KD + g * D + d]);
          cv[((b * Hkv + g) * L + t) * D + d] = from_accum<S>(v[b * KD + g * D + d]);
        }
    cache.length = t + 1;
    A* o = ws.template get<A>(st_o);
    cpu::attend_cache(pool, s, L, t + 1, static_cast<const A*>(q), static_cast<const S*>(ck),
                      static_cast<const S*>(cv), o, ws.template get<A>(st_scratch));
    A* ya = cpu::accum_target(y_t, ws.template get<A>(st_y));
    cpu::matmul(pool, static_cast<const A*>(o), wa.o, ya, B, HD, C, false, cpu::ld3{HD, C, C},
                pk.span());
    if constexpr (widened) cpu::narrow(pool, static_cast<const A*>(ya), B * C, y_t);
    }
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
  // Accumulator copies that only bf16/fp16 storage needs (fp32/fp64 read the caller's buffers).
  static constexpr std::size_t x_acc_bytes(const attention_shape& s) noexcept {
    return widened ? bytes_of<A>(s.batch, s.seq, s.d_model) : 0;
  }
  static constexpr std::size_t w_acc_bytes(const attention_shape& s) noexcept {
    return widened ? bytes_of<A>(weight_elements(s)) : 0;
  }
  static constexpr std::size_t y_acc_bytes(const attention_shape& s) noexcept {
    return x_acc_bytes(s);
  }
  static constexpr std::size_t o_acc_bytes(const attention_shape& s) noexcept {
    return widened ? q_bytes(s) : 0;
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
  // q, k, v in the workspace: only under recompute.
  static constexpr std::size_t ws_q_bytes(const attention_shape& s) noexcept {
    return keep_qkv ? 0 : q_bytes(s);
  }
  static constexpr std::size_t ws_kv_bytes(const attention_shape& s) noexcept {
    return keep_qkv ? 0 : kv_bytes(s);
  }

  // Phases: 0 projections, 1 tiled attention, 2 output projection.
  // Per-thread packing bytes of every product of a pass (linalg.hpp's gemm with the caller's
  // buffers): the projections' row tasks and the flash kernel's tile products share one slot.
  static constexpr std::size_t forward_pack_bytes(const attention_shape& s) noexcept {
    const std::size_t N = s.batch * s.seq, C = s.d_model, HD = s.heads * s.head_dim;
    const std::size_t KD = s.kv_heads * s.head_dim;
    return std::max({cpu::matmul_thread_scratch_bytes<A>(N, C, HD),
                     cpu::matmul_thread_scratch_bytes<A>(N, C, KD),
                     cpu::matmul_thread_scratch_bytes<A>(N, HD, C),
                     cpu::flash_gemm_bytes<A>(qt, kt, s.head_dim)});
  }
  static constexpr std::size_t backward_pack_bytes(const attention_shape& s) noexcept {
    const std::size_t N = s.batch * s.seq, C = s.d_model, HD = s.heads * s.head_dim;
    const std::size_t KD = s.kv_heads * s.head_dim;
    return std::max({forward_pack_bytes(s), cpu::matmul_thread_scratch_bytes<A>(N, C, HD),
                     cpu::matmul_thread_scratch_bytes<A>(N, KD, C),
                     cpu::matmul_at_thread_scratch_bytes<A>(N, C, HD),
                     cpu::matmul_at_thread_scratch_bytes<A>(N, C, KD),
                     cpu::matmul_at_thread_scratch_bytes<A>(N, HD, C)});
  }
  static constexpr std::size_t step_pack_bytes(const attention_shape& s) noexcept {
    const std::size_t C = s.d_model, HD = s.heads * s.head_dim, KD = s.kv_heads * s.head_dim;
    return std::max({cpu::matmul_thread_scratch_bytes<A>(s.batch, C, HD),
                     cpu::matmul_thread_scratch_bytes<A>(s.batch, C, KD),
                     cpu::matmul_thread_scratch_bytes<A>(s.batch, HD, C)});
  }
  static constexpr std::size_t rope_bytes(std::size_t positions, std::size_t head_dim) noexcept {
    return bytes_of<A>(positions, head_dim);  // cpu::rope_table_elements, saturating
  }
  // The packing slot: a byte pointer and its size, as the span the products take.
  struct gemm_ws {
    std::byte* data;
    std::size_t bytes;
    std::span<std::byte> span() const noexcept { return {data, bytes}; }
  };

  // Phases: 0 projections, 1 tiled attention, 2 output projection.
  enum forward_slot : std::size_t {
    f_x, f_w, f_q, f_k, f_v, f_scratch, f_o, f_y, f_rope, f_gemm
  };
  static constexpr workspace_layout<10> forward_layout(const attention_shape& s,
                                                       std::size_t threads) {
    workspace_layout<10> l;
    l.add(x_acc_bytes(s), default_alignment, {0, 0});
    l.add(w_acc_bytes(s), default_alignment, {0, 2});
    l.add(ws_q_bytes(s), default_alignment, {0, 1});
    l.add(ws_kv_bytes(s), default_alignment, {0, 1});
    l.add(ws_kv_bytes(s), default_alignment, {0, 1});
    l.add(bytes_of<A>(threads, cpu::forward_scratch(qt, kt, s.head_dim)), default_alignment,
          {1, 1});
    l.add(o_acc_bytes(s), default_alignment, {1, 2});
    l.add(y_acc_bytes(s), default_alignment, {2, 2});
    l.add(rope_bytes(s.seq, s.head_dim), default_alignment, {0, 0});
    l.add(bytes_of<std::byte>(threads, forward_pack_bytes(s)), default_alignment, {0, 2});
    return l;
  }

  // Phases: 0 recompute q, k, v and dO, Δ; 1 tiled backward; 2 RoPE undo and weight gradients;
  // 3 dx.
  enum backward_slot : std::size_t {
    b_x, b_w, b_q, b_k, b_v, b_dy, b_o, b_dout, b_delta, b_dq, b_dk, b_dv, b_scratch, b_dw, b_dx,
    b_rope, b_gemm
  };
  static constexpr workspace_layout<18> backward_layout(const attention_shape& s,
                                                        std::size_t threads) {
    workspace_layout<18> l;
    l.add(x_acc_bytes(s), default_alignment, {0, 2});
    l.add(w_acc_bytes(s), default_alignment, {0, 3});
    l.add(ws_q_bytes(s), default_alignment, {0, 1});
    l.add(ws_kv_bytes(s), default_alignment, {0, 1});
    l.add(ws_kv_bytes(s), default_alignment, {0, 1});
    l.add(y_acc_bytes(s), default_alignment, {0, 2});  // dy
    l.add(o_acc_bytes(s), default_alignment, {0, 2});
    l.add(q_bytes(s), default_alignment, {0, 1});  // dO
    l.add(lse_bytes(s), default_alignment, {0, 1});  // Δ
    l.add(q_bytes(s), default_alignment, {1, 3});
    l.add(kv_bytes(s), default_alignment, {1, 3});
    l.add(kv_bytes(s), default_alignment, {1, 3});
    l.add(bytes_of<A>(threads, cpu::backward_scratch(qt, kt)), default_alignment, {1, 1});
    // One weight gradient at a time, in A before the rounded +=; Hkv·D <= H·D.
    l.add(widened ? bytes_of<A>(s.d_model, s.heads * s.head_dim) : 0, default_alignment, {2, 2});
    l.add(x_acc_bytes(s), default_alignment, {3, 3});  // dx
    l.add(rope_bytes(s.seq, s.head_dim), default_alignment, {0, 2});
    l.add(bytes_of<std::byte>(threads, backward_pack_bytes(s)), default_alignment, {0, 3});
    return l;
  }

  // Phases: 0 projections, 1 attention over the cache, 2 output projection.
  enum step_slot : std::size_t {
    st_x, st_w, st_q, st_k, st_v, st_scratch, st_o, st_y, st_rope, st_gemm
  };
  static constexpr workspace_layout<10> step_layout(const attention_shape& s, std::size_t max_len,
                                                    std::size_t threads) {
    workspace_layout<10> l;
    l.add(widened ? bytes_of<A>(s.batch, s.d_model) : 0, default_alignment, {0, 0});
    l.add(w_acc_bytes(s), default_alignment, {0, 2});
    l.add(bytes_of<A>(s.batch, s.heads, s.head_dim), default_alignment, {0, 1});
    l.add(bytes_of<A>(s.batch, s.kv_heads, s.head_dim), default_alignment, {0, 0});
    l.add(bytes_of<A>(s.batch, s.kv_heads, s.head_dim), default_alignment, {0, 0});
    l.add(bytes_of<A>(threads, max_len), default_alignment, {1, 1});
    l.add(bytes_of<A>(s.batch, s.heads, s.head_dim), default_alignment, {1, 2});
    l.add(widened ? bytes_of<A>(s.batch, s.d_model) : 0, default_alignment, {2, 2});
    l.add(rope_bytes(1, s.head_dim), default_alignment, {0, 0});
    l.add(bytes_of<std::byte>(threads, step_pack_bytes(s)), default_alignment, {0, 2});
    return l;
  }

  // ---- Helpers -------------------------------------------------------------------------------
  // The device backend carves its own workspace; the layer only checks the caller's size (the
  // typed workspace_too_small, as on the CPU) with a one-slot layout of that size.
  static constexpr workspace_layout<1> device_layout(std::size_t bytes) {
    workspace_layout<1> l;
    l.add(bytes);
    return l;
  }
  // q, k or v kept in `saved` under save_all; nullptr under recompute.
  template <typename T, typename View>
  static T* kept(const View& sv, saved_slot slot) {
    if constexpr (keep_qkv) {
      return sv.template get<T>(slot);
    } else {
      (void)sv;
      (void)slot;
      return nullptr;
    }
  }
  static void check_weights(const weights& w) {
    detail::not_null(w.wq, "weights.wq");
    detail::not_null(w.wk, "weights.wk");
    detail::not_null(w.wv, "weights.wv");
    detail::not_null(w.wo, "weights.wo");
  }



  struct wptrs {
    const A *q, *k, *v, *o;
  };
  // q, k, v = x·Wq, x·Wk, x·Wv, with RoPE on q and k: forward computes them, backward recomputes
  // them the same way (bit for bit, so P recomputed from the saved lse matches forward's).
  static void project_qkv(const attention_shape& s, const A* xa, const wptrs& wa, A* q, A* k, A* v,
                          const A* table, std::span<std::byte> packing, thread_pool& pool) {
    const std::size_t N = s.batch * s.seq, C = s.d_model;
    const std::size_t HD = s.heads * s.head_dim, KD = s.kv_heads * s.head_dim;
    cpu::matmul(pool, xa, wa.q, q, N, C, HD, false, cpu::ld3{C, HD, HD}, packing);
    cpu::matmul(pool, xa, wa.k, k, N, C, KD, false, cpu::ld3{C, KD, KD}, packing);
    cpu::matmul(pool, xa, wa.v, v, N, C, KD, false, cpu::ld3{C, KD, KD}, packing);
    cpu::rope_rows(pool, q, N, s.seq, s.heads, s.head_dim, table, false);
    cpu::rope_rows(pool, k, N, s.seq, s.kv_heads, s.head_dim, table, false);
  }

  static wptrs widen_weights(const weights& w, const attention_shape& s, A* slot,
                             thread_pool& pool) {
    const std::size_t C = s.d_model, HD = s.heads * s.head_dim, KD = s.kv_heads * s.head_dim;
    if constexpr (widened) {
      A* q = slot;
      A* k = q + C * HD;
      A* v = k + C * KD;
      A* o = v + C * KD;
      cpu::widen(pool, w.wq, C * HD, q);
      cpu::widen(pool, w.wk, C * KD, k);
      cpu::widen(pool, w.wv, C * KD, v);
      cpu::widen(pool, w.wo, HD * C, o);
      return {q, k, v, o};
    } else {
      (void)slot;
      (void)pool;
      (void)C;
      (void)HD;
      (void)KD;
      return {w.wq, w.wk, w.wv, w.wo};
    }
  }

};

MEMBOUND_NAMESPACE_END
