// The sizes of one attention layer call, shared by the front end (layers/attention.hpp) and the
// backends' kernels (backend/cpu/attention.hpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "membound/core/config.hpp"
#include "membound/shape/packed_sequences.hpp"

MEMBOUND_NAMESPACE_BEGIN

struct attention_shape {
  std::size_t batch = 1;     // B
  std::size_t seq = 1;       // T (step ignores it: the cache holds the positions)
  std::size_t d_model = 0;   // C
  std::size_t heads = 0;     // H, query heads
  std::size_t kv_heads = 0;  // Hkv, divides H: head h reads kv head h / (H / Hkv)
  std::size_t head_dim = 0;  // D, a multiple of 8 up to 256
  bool causal = true;
  double rope_base = 10000.0;
  // Sliding window W (0: none). Causal: query i sees keys i − W + 1 .. i, W of them with itself,
  // as FlashAttention's window_size = (W − 1, 0) and Mistral's sliding_window = W; bidirectional:
  // keys with |i − j| < W. Any W ≥ 1 is valid; W ≥ T changes nothing.
  std::size_t window = 0;
  // Packed variable-length sequences (nullptr: none; shape/packed_sequences.hpp): `sequences`
  // sequences end to end on one token axis (batch 1, seq their total), sequence s at tokens
  // [offsets[s], offsets[s + 1]). Each attends only inside itself and its RoPE positions restart
  // at 0: packed equals each sequence run alone, with no padding.
  const std::int32_t* offsets = nullptr;
  std::size_t sequences = 0;
};

// Which keys each query sees: the causal mask, the window and the packed sequences' bounds as
// ranges, so a tiled kernel skips every tile outside the band (O(T·W) work) and masks only the
// tiles that cross its edges. Every query sees at least itself. The ends are monotone in the
// position, so a tile's range is the union of its first and last rows' ranges. Shared by the CPU
// and CUDA kernels.
struct attention_band {
  std::size_t seq = 1;
  std::size_t window = 0;
  bool causal = true;
  packed_sequences packing{};  // the shape's packed sequences, or none

  MEMBOUND_HOST_DEVICE constexpr bool sees(std::size_t i, std::size_t j) const noexcept {
    return key_begin(i) <= j && j < key_end(i);
  }
  // First key query i sees.
  MEMBOUND_HOST_DEVICE constexpr std::size_t key_begin(std::size_t i) const noexcept {
    const std::size_t w = window != 0 && i >= window ? i - window + 1 : 0;
    const std::size_t s = packing.packed() && i < seq ? packing.begin_of(i) : 0;
    return w > s ? w : s;
  }
  // One past the last key query i sees.
  MEMBOUND_HOST_DEVICE constexpr std::size_t key_end(std::size_t i) const noexcept {
    if (causal || i >= seq) return i + 1 < seq ? i + 1 : seq;
    return window_end(i);
  }
  // First query that sees key j.
  MEMBOUND_HOST_DEVICE constexpr std::size_t query_begin(std::size_t j) const noexcept {
    return causal ? j : key_begin(j);  // the bidirectional band is symmetric
  }
  // One past the last query that sees key j.
  MEMBOUND_HOST_DEVICE constexpr std::size_t query_end(std::size_t j) const noexcept {
    return window_end(j);
  }
  // Token i's position in its sequence (its RoPE position): i − its start when packed.
  MEMBOUND_HOST_DEVICE constexpr std::size_t position(std::size_t i) const noexcept {
    return packing.packed() ? i - packing.begin_of(i) : i;
  }

 private:
  // One past the last key (or query) within the window of token j and inside its sequence.
  MEMBOUND_HOST_DEVICE constexpr std::size_t window_end(std::size_t j) const noexcept {
    std::size_t e = window != 0 && j < seq && window < seq - j ? j + window : seq;
    if (packing.packed() && j < seq) {
      const std::size_t s = packing.end_of(j);
      e = e < s ? e : s;
    }
    return e;
  }
};

constexpr attention_band band_of(const attention_shape& s) noexcept {
  return attention_band{s.seq, s.window, s.causal,
                        packed_sequences{s.offsets, s.offsets == nullptr ? 0 : s.sequences}};
}

// Positions a decoding cache keeps for max_len positions: all of them, or the window's last W
// (a ring: position p lives in slot p mod W), so decoding memory stays flat at any length.
constexpr std::size_t kv_cache_slots(const attention_shape& s, std::size_t max_len) noexcept {
  return s.window != 0 && s.window < max_len ? s.window : max_len;
}

// (query, key) pairs one sequence's attention computes: T(T + 1)/2 causal, T² bidirectional,
// fewer under a window. For FLOP counts.
constexpr double attention_pairs(const attention_shape& s) noexcept {
  // Rows before the window fills, then the rows with a full window, in closed form.
  const std::size_t T = s.seq;
  const std::size_t W = s.window == 0 || s.window > T ? T : s.window;
  const double t = static_cast<double>(T), w = static_cast<double>(W);
  if (s.causal) return w * (w + 1.0) / 2.0 + (t - w) * w;
  // Query i sees keys in [i − W + 1, i + W − 1] ∩ [0, T): 2W − 1 less the clipped ends.
  return t * (2.0 * w - 1.0) - (w - 1.0) * w;
}

// Parameter elements: Wq [C, H·D], Wk and Wv [C, Hkv·D], Wo [H·D, C].
constexpr std::size_t attention_weight_elements(const attention_shape& s) noexcept {
  const std::size_t HD = s.heads * s.head_dim, KD = s.kv_heads * s.head_dim;
  return s.d_model * HD + 2 * s.d_model * KD + HD * s.d_model;
}

MEMBOUND_NAMESPACE_END
