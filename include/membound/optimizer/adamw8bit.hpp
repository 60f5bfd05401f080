// AdamW with 8-bit moments (Dettmers et al., "8-bit Optimizers via Block-wise Quantization";
// bitsandbytes' AdamW8bit is the reference for the semantics): m and v are kept as one byte per
// parameter, in blocks of Block elements that each carry an fp32 absmax scale. A step
// dequantizes a block, takes the ordinary AdamW step on it in fp32 (adamw_step, the same math as
// adamw<S>), and quantizes the new moments with the block's new absmax. The parameter update uses
// the fp32 moments before they are requantized, as bitsandbytes does.
//
// The quantization map is bitsandbytes' dynamic (non-linear) one, not a linear one: v spans
// many decades inside a block (it is g², so a 10x smaller gradient is a 100x smaller v), and a
// linear 8-bit code would round every v below absmax/255 to 0, making m/(√v + ε) blow up for
// exactly the parameters with small gradients. The dynamic map spends its codes on decades: 7
// decades (10⁻⁶..1 of absmax), with 2^i (signed, m) or 2^(i+1) (unsigned, v) evenly spaced
// codes in decade i, plus 0 and 1. A value is coded by the nearest code (ties to the lower one),
// deterministically (no stochastic rounding). The map here is computed in double and rounded to
// fp32 once; bitsandbytes builds it with fp32 linspace, so a code may differ in its last bit.
//
// Not bitsandbytes': tensors of fewer than 4096 elements keep 8-bit state here too (bitsandbytes
// keeps them in 32 bits), so that state_bytes depends on n only; blocks run over the flat range
// the state covers, so a block may hold the end of one tensor and the start of the next (each
// element keeps its tensor's weight decay). Under ZeRO-1 the blocks start at the rank's shard,
// so a sharded run quantizes the same elements together only where shard sizes are multiples of
// Block.
//
// State layout over n parameters, nb = ⌈n / Block⌉ blocks (state_bytes(n) bytes, aligned to 4):
//   fp32 master[n]     (16-bit storage only, as adamw<S>)
//   fp32 absmax_m[nb], fp32 absmax_v[nb]
//   uint8 m[n], uint8 v[n]  (codes into the signed and unsigned maps)
// so 2 bytes per parameter, 8 per block, and 4 per parameter of masters for bf16/fp16 (adamw<S>
// keeps 8 or 12).
//
// Each block is one task of the pool and is computed by one thread in element order, so the
// result is bit for bit the same for any number of threads.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>

#include "membound/core/checked_math.hpp"
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/core/element_math.hpp"
#include "membound/core/error.hpp"
#include "membound/core/format.hpp"
#include "membound/core/parallel.hpp"
#include "membound/optimizer/optimizer_policy.hpp"

MEMBOUND_NAMESPACE_BEGIN

// A 256-entry 8-bit quantization map: code[q] sorted ascending, and the fp32 midpoints between
// neighbours that decide which code a value takes.
struct quantization_map {
  std::array<float, 256> code{};
  std::array<float, 255> mid{};

  // The code nearest x (x / absmax, in [-1, 1]); a tie goes to the lower code. NaN gives code 0.
  std::uint8_t quantize(float x) const noexcept {
    // The number of midpoints below x, by binary search.
    std::size_t lo = 0, hi = mid.size();
    while (lo < hi) {
      const std::size_t m = (lo + hi) / 2;
      if (mid[m] < x) lo = m + 1;
      else hi = m;
    }
    return static_cast<std::uint8_t>(lo);
  }
  float operator[](std::uint8_t q) const noexcept { return code[q]; }
  // The largest distance of a value in [code[0], 1] from its code: half the widest gap.
  double max_error() const noexcept {
    double e = 0;
    for (std::size_t k = 0; k + 1 < code.size(); ++k) e = std::max(e, (static_cast<double>(code[k + 1]) - code[k]) / 2);
    return e;
  }
};

namespace detail {
// bitsandbytes' dynamic map with 7 exponent levels over 8 bits (see the header comment).
inline quantization_map make_dynamic_map(bool is_signed) {
  double v[256];
  std::size_t k = 0;
  double decade = 1e-6;
  for (int i = 0; i < 7; ++i, decade *= 10) {
    const std::size_t items = std::size_t{1} << (is_signed ? i : i + 1);
    for (std::size_t j = 0; j < items; ++j) {
      // The middle of the j-th of `items` equal parts of [0.1, 1].
      const double mean = 0.1 + 0.9 * (static_cast<double>(j) + 0.5) / static_cast<double>(items);
      v[k++] = decade * mean;
      if (is_signed) v[k++] = -decade * mean;
    }
  }
  v[k++] = 0.0;
  v[k++] = 1.0;
  std::sort(v, v + k);
  quantization_map m;
  for (std::size_t q = 0; q < 256; ++q) m.code[q] = static_cast<float>(v[q]);
  for (std::size_t q = 0; q < 255; ++q) m.mid[q] = (m.code[q] + m.code[q + 1]) * 0.5f;
  return m;
}
}  // namespace detail

// The maps m and v use (built once, thread-safe).
inline const quantization_map& signed_dynamic_map() {
  static const quantization_map m = detail::make_dynamic_map(true);
  return m;
}
inline const quantization_map& unsigned_dynamic_map() {
  static const quantization_map m = detail::make_dynamic_map(false);
  return m;
}

template <typename S, std::size_t Block = 2048>
class adamw8bit {
  static_assert(Block >= 64 && Block <= 4096 && (Block & (Block - 1)) == 0,
                "membound: adamw8bit<S, Block>: Block must be a power of two in [64, 4096] (bitsandbytes uses "
                "2048 or 256)");

 public:
  using storage_type = S;
  static constexpr bool has_master = !std::is_same_v<S, float> && !std::is_same_v<S, double>;
  // The arithmetic of a step (the moments are dequantized to it).
  using compute_type = std::conditional_t<std::is_same_v<S, double>, double, float>;
  static constexpr std::size_t block = Block;
  static constexpr std::string_view name = "adamw8bit";

  static std::string description() {
    return "AdamW 8-bit m, v (blocks of " + std::to_string(Block) + ", dynamic map, fp32 absmax)" +
           (has_master ? " + fp32 masters" : "");
  }

  static constexpr std::size_t blocks(std::size_t n) noexcept { return n / Block + (n % Block != 0 ? 1 : 0); }
  static constexpr std::size_t state_bytes(std::size_t n) noexcept {
    return sat_add(has_master ? bytes_of<float>(n) : 0, sat_mul(bytes_of<float>(blocks(n)), 2), sat_mul(n, 2));
  }

  // Views of the state's parts.
  struct view {
    float* master;
    float* absmax_m;
    float* absmax_v;
    std::uint8_t* m;
    std::uint8_t* v;
  };
  static view parts(void* state, std::size_t n) noexcept {
    auto* b = static_cast<std::byte*>(state);
    view p{};
    p.master = has_master ? reinterpret_cast<float*>(b) : nullptr;
    b += has_master ? bytes_of<float>(n) : 0;
    p.absmax_m = reinterpret_cast<float*>(b);
    p.absmax_v = p.absmax_m + blocks(n);
    b += 2 * bytes_of<float>(blocks(n));
    p.m = reinterpret_cast<std::uint8_t*>(b);
    p.v = p.m + n;
    return p;
  }

  // Zero moments (every code the map's 0, scales 0), masters copied from the weights.
  static void init(const S* w, std::size_t n, void* state, std::size_t bytes) {
    detail::check_state_buffer(state, bytes, state_bytes(n));
    const view p = parts(state, n);
    for (std::size_t b = 0; b < blocks(n); ++b) p.absmax_m[b] = p.absmax_v[b] = 0.0f;
    std::memset(p.m, signed_dynamic_map().quantize(0.0f), n);
    std::memset(p.v, unsigned_dynamic_map().quantize(0.0f), n);
    if constexpr (has_master) {
      for (std::size_t i = 0; i < n; ++i) p.master[i] = to_accum<float>(w[i]);
    }
  }

  // One step over the n elements the state covers: the spans (in order, inside [0, n)) say which
  // elements take a step and which of those decay.
  static void update(S* w, const S* g, void* state, std::size_t n, std::span<const param_span> spans,
                     const optimizer_step& s, thread_pool& pool) {
    update_range(w, g, state, n, 0, n, spans, s, pool);
  }

  // A range is whole blocks: the moments are quantized per block.
  static constexpr std::size_t range_granule = Block;
  // update over [first, first + count), whole blocks (first a multiple of Block, count one too or
  // ending at n): w and g hold that range (w[0] is element first); the spans are update's, over
  // [0, n). The same bits as update for those blocks.
  static void update_range(S* w, const S* g, void* state, std::size_t n, std::size_t first, std::size_t count,
                           std::span<const param_span> spans, const optimizer_step& s, thread_pool& pool) {
    detail::check_param_spans(spans, n);
    detail::check_update_range(first, count, n, range_granule);
    using T = compute_type;
    const view p = parts(state, n);
    const quantization_map& qm = signed_dynamic_map();
    const quantization_map& qv = unsigned_dynamic_map();
    const adamw_config& c = s.config;
    const auto kd = adamw_coefficients<T>::at(s.t, s.lr, c.beta1, c.beta2, c.eps, c.weight_decay, true);
    const auto kn = adamw_coefficients<T>::at(s.t, s.lr, c.beta1, c.beta2, c.eps, c.weight_decay, false);
    const T gs = static_cast<T>(s.grad_scale);
    const std::size_t b0 = first / Block;
    pool.parallel_for(blocks(count), [&](std::size_t bb, std::size_t) {
      const std::size_t b = b0 + bb;
      const std::size_t i0 = b * Block, i1 = std::min(first + count, i0 + Block);
      T mf[Block], vf[Block];
      const T am = p.absmax_m[b], av = p.absmax_v[b];
      T new_am = 0, new_av = 0;
      // The first span reaching past i0 (spans are sorted by first).
      std::size_t k = static_cast<std::size_t>(
          std::upper_bound(spans.begin(), spans.end(), i0,
                           [](std::size_t i, const param_span& sp) { return i < sp.first + sp.count; }) -
          spans.begin());
      for (std::size_t i = i0; i < i1; ++i) {
        while (k < spans.size() && spans[k].first + spans[k].count <= i) ++k;
        T m = static_cast<T>(qm[p.m[i]]) * am;
        T v = static_cast<T>(qv[p.v[i]]) * av;
        // An element in no span (padding between tensors) keeps its weight and its moments.
        if (k < spans.size() && spans[k].first <= i) {
          T w_i = has_master ? static_cast<T>(p.master[i]) : to_accum<T>(w[i - first]);
          adamw_step(spans[k].decay ? kd : kn, to_accum<T>(g[i - first]) * gs, m, v, w_i);
          if constexpr (has_master) p.master[i] = static_cast<float>(w_i);
          w[i - first] = from_accum<S>(w_i);
        }
        mf[i - i0] = m;
        vf[i - i0] = v;
        new_am = std::max(new_am, std::abs(m));
        new_av = std::max(new_av, v);
      }
      // The scales are stored in fp32: quantize against the stored value, so dequantizing gives
      // back code·absmax exactly as it was meant.
      const float sm = static_cast<float>(new_am), sv = static_cast<float>(new_av);
      const std::uint8_t zm = qm.quantize(0.0f), zv = qv.quantize(0.0f);
      for (std::size_t i = i0; i < i1; ++i) {
        p.m[i] = sm > 0 ? qm.quantize(static_cast<float>(mf[i - i0] / static_cast<T>(sm))) : zm;
        p.v[i] = sv > 0 ? qv.quantize(static_cast<float>(vf[i - i0] / static_cast<T>(sv))) : zv;
      }
      p.absmax_m[b] = sm;
      p.absmax_v[b] = sv;
    });
  }

  static std::span<const std::byte> save_state(const void* state, std::size_t n) noexcept {
    return {static_cast<const std::byte*>(state), state_bytes(n)};
  }
  // Checks the scales (finite, not negative) and the masters (finite) first, then copies. Every
  // byte is a valid code.
  static void load_state(std::span<const std::byte> from, void* state, std::size_t n) {
    if (from.size() != state_bytes(n)) {
      throw invalid_argument("optimizer state", format_bytes(state_bytes(n)) + " (" + description() + ")",
                             format_bytes(from.size()), "Load a state saved by the same policy for the same parameters");
    }
    const auto f = [&](std::size_t i) {
      float x;
      std::memcpy(&x, from.data() + i * sizeof(float), sizeof x);
      return x;
    };
    const std::size_t masters = has_master ? n : 0;
    if constexpr (has_master) {  // (a loop to 0 would be a pointless comparison to nvcc's front end)
      for (std::size_t i = 0; i < masters; ++i) {
        if (!std::isfinite(f(i))) {
          throw invalid_argument("optimizer state", "finite fp32 masters", "master " + std::to_string(i) + " is not",
                                 "The state is corrupt: load another checkpoint");
        }
      }
    }
    for (std::size_t b = 0; b < 2 * blocks(n); ++b) {
      const float x = f(masters + b);
      if (!(x >= 0) || !std::isfinite(x)) {
        throw invalid_argument("optimizer state", "finite absmax scales >= 0",
                               std::string(b < blocks(n) ? "m" : "v") + " scale of block " +
                                   std::to_string(b % blocks(n)) + " = " + std::to_string(x),
                               "The state is corrupt: load another checkpoint");
      }
    }
    std::memcpy(state, from.data(), from.size());
  }
};

// Whether O is some adamw8bit<S, Block> (the device trainer steps it with its own kernel).
template <typename O>
inline constexpr bool is_adamw8bit_v = false;
template <typename S, std::size_t Block>
inline constexpr bool is_adamw8bit_v<adamw8bit<S, Block>> = true;

MEMBOUND_NAMESPACE_END
