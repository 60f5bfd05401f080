// Balanced shards of n elements over N ranks: what ZeRO's sharded state (the optimizer's under
// ZeRO-1, the gradients' too under ZeRO-2) and the communicators' reduce-scatters agree on. Every
// rank computes every rank's range from (n, N) alone.
#pragma once

#include <cstddef>

#include "membound/core/config.hpp"

MEMBOUND_NAMESPACE_BEGIN

// The elements [begin, end) of n that rank r of N owns: balanced, the first n % N ranks one
// longer, no padding.
struct shard_range {
  std::size_t begin = 0, end = 0;
  constexpr std::size_t size() const noexcept { return end - begin; }
};
constexpr shard_range shard_of(std::size_t n, std::size_t ranks, std::size_t r) noexcept {
  const std::size_t q = n / ranks, rem = n % ranks;
  const std::size_t begin = r * q + (r < rem ? r : rem);
  return {begin, begin + q + (r < rem ? 1 : 0)};
}
// The longest shard of n over N ranks (the receive buffer holds N of them).
constexpr std::size_t max_shard(std::size_t n, std::size_t ranks) noexcept {
  return n / ranks + (n % ranks != 0 ? 1 : 0);
}
// The part of [lo, hi) that s holds, as an absolute range (empty: begin == end == lo).
constexpr shard_range overlap(shard_range s, std::size_t lo, std::size_t hi) noexcept {
  const std::size_t b = s.begin > lo ? s.begin : lo, e = s.end < hi ? s.end : hi;
  return b < e ? shard_range{b, e} : shard_range{lo, lo};
}

MEMBOUND_NAMESPACE_END
