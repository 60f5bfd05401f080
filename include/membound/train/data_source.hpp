// What the trainer asks its data for and the generator behind it (one part of the trainer,
// train/trainer.hpp): a run's data position and random state are a checkpoint's, so a resumed run
// draws the same sequences.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>

#include "membound/core/config.hpp"

MEMBOUND_NAMESPACE_BEGIN

// splitmix64: the whole generator is one 64-bit word, so a checkpoint holds it exactly.
struct random_state {
  std::uint64_t state = 0;
  std::uint64_t next() noexcept {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  friend constexpr bool operator==(const random_state&, const random_state&) = default;
};

// What the trainer asks its data for, one sequence at a time: `index` counts the sequences of the
// run (the data position), `random` is 64 fresh bits from the run's generator. A source that
// samples windows uses `random`; one that walks the data in order uses `index`.
struct sequence_request {
  std::uint64_t index = 0;
  std::uint64_t random = 0;
};

// source(request, tokens, targets) writes T token ids and T next-token targets.
template <typename F>
concept sequence_source = std::invocable<F&, const sequence_request&, std::int32_t*, std::int32_t*>;

// One packed row to fill (a trainer whose effective batch_shape has sequences): `seq` token ids
// and targets, and the offsets of at most `sequences` sequences laid end to end
// (shape/packed_sequences.hpp): sequences + 1 entries, 0 first, seq last, never decreasing, so a
// row of fewer sequences repeats seq (empty ones). Give each sequence's last token
// ignore_target (its next token is another sequence's), and padding tokens too.
struct packed_row {
  std::int32_t* tokens = nullptr;
  std::int32_t* targets = nullptr;
  std::int32_t* offsets = nullptr;
  std::size_t seq = 0;
  std::size_t sequences = 0;
};

// source(request, row) fills one packed row; `index` counts rows.
template <typename F>
concept packed_source = std::invocable<F&, const sequence_request&, const packed_row&>;

// What a trainer's step and evaluate take: rows of one sequence each, or packed rows.
template <typename F>
concept data_source = sequence_source<F> || packed_source<F>;

MEMBOUND_NAMESPACE_END
