// Chunking policies: how far a layer walks the sequence in one step, which sets the size of its
// tiles and per-chunk state. All three share one kind, so a layer takes one of them; each layer
// checks it got its own variety (is_attention_tiles_v, is_scan_chunk_v, is_ttt_mini_batch_v).
#pragma once

#include <cstddef>

#include "membound/core/config.hpp"
#include "membound/policy/policy_kind.hpp"

MEMBOUND_NAMESPACE_BEGIN

MEMBOUND_POLICY_KIND(chunking_kind, "chunking");

// Attention tiles: QTile query rows against KVTile key/value rows at a time. Multiples of 8, the
// row granularity of tensor-core fragments and of 16-byte bf16/fp16 vector loads.
template <std::size_t QTile, std::size_t KVTile>
struct attention_tiles {
  static_assert(QTile > 0 && QTile % 8 == 0,
                "membound: attention_tiles<QTile, KVTile>: QTile must be a positive multiple of 8 "
                "(the tensor-core fragment granularity), e.g. 64.");
  static_assert(KVTile > 0 && KVTile % 8 == 0,
                "membound: attention_tiles<QTile, KVTile>: KVTile must be a positive multiple of "
                "8 (the tensor-core fragment granularity), e.g. 64.");

  using policy_kind = chunking_kind;
  static constexpr std::size_t q_tile = QTile;
  static constexpr std::size_t kv_tile = KVTile;
};

// Mamba: the selective scan runs Chunk time steps per chunk and carries the state between chunks.
template <std::size_t Chunk>
struct scan_chunk {
  static_assert(Chunk > 0,
                "membound: scan_chunk<Chunk>: Chunk (time steps per scan chunk) must be at least "
                "1, e.g. 64.");

  using policy_kind = chunking_kind;
  static constexpr std::size_t chunk = Chunk;
};

// TTT: the inner model takes one gradient step per MiniBatch tokens.
template <std::size_t MiniBatch>
struct ttt_mini_batch {
  static_assert(MiniBatch > 0,
                "membound: ttt_mini_batch<MiniBatch>: MiniBatch (tokens per inner-loop step) must "
                "be at least 1; the TTT paper uses 16 (default_ttt_mini_batch).");

  using policy_kind = chunking_kind;
  static constexpr std::size_t mini_batch = MiniBatch;
};

using default_ttt_mini_batch = ttt_mini_batch<16>;

template <typename T>
inline constexpr bool is_attention_tiles_v = false;
template <std::size_t Q, std::size_t KV>
inline constexpr bool is_attention_tiles_v<attention_tiles<Q, KV>> = true;

template <typename T>
inline constexpr bool is_scan_chunk_v = false;
template <std::size_t C>
inline constexpr bool is_scan_chunk_v<scan_chunk<C>> = true;

template <typename T>
inline constexpr bool is_ttt_mini_batch_v = false;
template <std::size_t M>
inline constexpr bool is_ttt_mini_batch_v<ttt_mini_batch<M>> = true;

MEMBOUND_NAMESPACE_END
