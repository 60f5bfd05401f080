// Packed variable-length sequences: S sequences laid end to end on one token axis (batch 1, seq
// their total), sequence s at tokens [offsets[s], offsets[s + 1]) (FlashAttention's cu_seqlens,
// Mamba's seq_idx in offset form). offsets has S + 1 entries, 0 first, the total last, never
// decreasing (empty sequences are allowed). Every layer that takes them restarts at each start
// (attention's keys and RoPE positions, Mamba's convolution and scan state, TTT's inner state,
// mini-batches and positions), so a packed batch computes what its sequences compute alone, with
// no padding. Shared by the shapes and the kernels of both backends.
#pragma once

#include <cstddef>
#include <cstdint>

#include "membound/core/config.hpp"

MEMBOUND_NAMESPACE_BEGIN

struct packed_sequences {
  const std::int32_t* offsets = nullptr;  // S + 1 entries, or nullptr: one sequence per batch row
  std::size_t count = 0;                  // S (0: not packed)

  MEMBOUND_HOST_DEVICE constexpr bool packed() const noexcept { return count != 0; }
  // Where token i's sequence starts and ends (i < the total).
  MEMBOUND_HOST_DEVICE constexpr std::size_t begin_of(std::size_t i) const noexcept {
    return static_cast<std::size_t>(offsets[index_of(i)]);
  }
  MEMBOUND_HOST_DEVICE constexpr std::size_t end_of(std::size_t i) const noexcept {
    return static_cast<std::size_t>(offsets[index_of(i) + 1]);
  }
  // The sequence holding token i: the last s with offsets[s] <= i (binary search; an empty
  // sequence shares its offset with the next one, which is the one that holds i).
  MEMBOUND_HOST_DEVICE constexpr std::size_t index_of(std::size_t i) const noexcept {
    std::size_t lo = 0, hi = count;  // offsets[lo] <= i < offsets[hi]
    while (hi - lo > 1) {
      const std::size_t mid = lo + (hi - lo) / 2;
      if (static_cast<std::size_t>(offsets[mid]) <= i) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    return lo;
  }
  // The sequences that start among tokens [t0, t0 + n) as a mask, bit t − t0 for a start at t
  // (n ≤ 32; 0 when not packed): a scan over a tile of steps resets its state where a bit is set.
  MEMBOUND_HOST_DEVICE constexpr std::uint32_t starts_in(std::size_t t0, std::size_t n) const noexcept {
    if (!packed()) return 0;
    std::uint32_t mask = 0;
    std::size_t q = index_of(t0);
    if (static_cast<std::size_t>(offsets[q]) < t0) ++q;  // the first start at or after t0
    for (; q < count && static_cast<std::size_t>(offsets[q]) < t0 + n; ++q) {
      mask |= std::uint32_t{1} << (static_cast<std::size_t>(offsets[q]) - t0);
    }
    return mask;
  }
};

// Bytes of the offsets of `sequences` packed sequences (S + 1 int32; 0 when not packed): the slot
// a device backend copies them into, part of the workspace a layer reports.
constexpr std::size_t packed_offsets_bytes(std::size_t sequences) noexcept {
  constexpr std::size_t most = ~std::size_t{0} / sizeof(std::int32_t) - 1;
  if (sequences > most) return ~std::size_t{0};  // SIZE_MAX: no workspace holds it
  return sequences == 0 ? 0 : (sequences + 1) * sizeof(std::int32_t);
}

// Whether `offsets` and `sequences` describe a token axis of `seq` tokens in batch 1, and if not
// the field at fault ("shape.offsets", "shape.sequences" or "shape.batch") and what it needed.
// O(sequences). A layer front turns the answer into its layer_support.
struct packing_check {
  bool ok = true;
  const char* argument = "";
  const char* expected = "";
  double actual = 0.0;
};
constexpr packing_check check_packing(const std::int32_t* offsets, std::size_t sequences,
                                      std::size_t batch, std::size_t seq) noexcept {
  const auto no = [](const char* arg, const char* expected, double actual) {
    return packing_check{false, arg, expected, actual};
  };
  if (offsets == nullptr) return no("shape.offsets", "the sequences' offsets (shape.sequences is set)", 0.0);
  if (sequences == 0) return no("shape.sequences", "at least 1 with shape.offsets", 0.0);
  if (batch != 1) {
    return no("shape.batch", "1 with packed sequences (they share one token axis)", static_cast<double>(batch));
  }
  if (offsets[0] != 0) return no("shape.offsets", "offsets[0] = 0", static_cast<double>(offsets[0]));
  for (std::size_t k = 0; k < sequences; ++k) {
    if (offsets[k + 1] < offsets[k]) {
      return no("shape.offsets", "never decreasing (sequence lengths of 0 or more)",
                static_cast<double>(offsets[k + 1]));
    }
  }
  if (static_cast<std::size_t>(offsets[sequences]) != seq) {
    return no("shape.offsets", "offsets[sequences] = shape.seq (the packed tokens)",
              static_cast<double>(offsets[sequences]));
  }
  return {};
}

MEMBOUND_NAMESPACE_END
