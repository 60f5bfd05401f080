// Randomized stress over the block-pool allocators: canaries in every block, no overlaps, exact
// statistics against an independent tally, exact growth_for, and nothing left at the end.
#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <vector>

#include "membound/memory/caching_allocator.hpp"
#include "membound/memory/expandable_arena.hpp"
#include "membound/memory/host_virtual_memory.hpp"
#include "membound/memory/system_allocator.hpp"

using namespace membound;

using caching = caching_allocator<system_allocator>;
using arena = expandable_arena<host_virtual_memory>;
TYPE_TO_STRING(caching);
TYPE_TO_STRING(arena);

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

template <typename A>
struct factory;
template <>
struct factory<caching> {
  static caching make() { return caching{}; }
  static std::size_t held(const caching& a) { return a.upstream().stats().reserved; }
};
template <>
struct factory<arena> {
  static arena make() { return arena(expandable_arena_options{std::size_t{4} << 30}); }
  static std::size_t held(const arena& a) { return a.committed(); }
};

struct live_block {
  unsigned char* p;
  std::size_t n, align;
  memory_tag tag;
  std::uint64_t id;
};

// The block id in the first bytes, then a byte derived from it: a block overwritten by a
// neighbour, or handed out twice, no longer matches.
unsigned char fill_byte(std::uint64_t id) { return static_cast<unsigned char>(id * 131 + 17); }

void write_canary(const live_block& b) {
  const std::size_t head = b.n < sizeof b.id ? b.n : sizeof b.id;
  std::memcpy(b.p, &b.id, head);
  if (b.n > head) std::memset(b.p + head, fill_byte(b.id), b.n - head);
}

bool canary_intact(const live_block& b) {
  const std::size_t head = b.n < sizeof b.id ? b.n : sizeof b.id;
  if (std::memcmp(b.p, &b.id, head) != 0) return false;
  if (b.n == head) return true;
  // All bytes after the head equal: the first one matches and each equals its successor.
  return b.p[head] == fill_byte(b.id) &&
         (b.n - head == 1 || std::memcmp(b.p + head, b.p + head + 1, b.n - head - 1) == 0);
}

struct tally {
  std::size_t requested = 0;
  std::array<std::size_t, memory_tag_count> by_tag{};
  std::size_t live = 0;

  void check(const memory_stats& s) const {
    REQUIRE(s.requested == requested);
    for (memory_tag t : all_memory_tags) REQUIRE(s.tag(t).current == by_tag[index_of(t)]);
    REQUIRE(s.allocations - s.deallocations == live);
    REQUIRE(s.allocated >= s.requested);
    REQUIRE(s.reserved >= s.allocated);
    REQUIRE(s.largest_free_block <= s.free_bytes());
    REQUIRE(s.failed_allocations == 0);
  }
};

template <typename A>
void run_stress(std::uint64_t seed, int operations) {
  A a = factory<A>::make();
  std::mt19937_64 rng(seed);
  std::vector<live_block> live;
  std::map<std::uintptr_t, std::uintptr_t> ranges;  // start -> end of every live block
  tally expected;
  std::uint64_t next_id = 1;

  auto release_one = [&](std::size_t k) {
    const live_block b = live[k];
    REQUIRE(canary_intact(b));
    a.deallocate(b.p, b.n, b.align, b.tag);
    ranges.erase(reinterpret_cast<std::uintptr_t>(b.p));
    expected.requested -= b.n;
    expected.by_tag[index_of(b.tag)] -= b.n;
    --expected.live;
    live[k] = live.back();
    live.pop_back();
  };

  for (int op = 0; op < operations; ++op) {
    const unsigned dice = static_cast<unsigned>(rng() % 100);
    if (dice < 2) {
      a.release_cached();
    } else if (!live.empty() && (live.size() > 120 || dice < 47)) {
      release_one(rng() % live.size());
    } else {
      // Log-uniform from 1 B to 4 MiB: mostly small, some spanning many granules.
      const double e = std::uniform_real_distribution<double>(0.0, 22.0)(rng);
      const auto n = static_cast<std::size_t>(std::exp2(e));
      const std::size_t align = std::size_t{1} << (rng() % 10);
      const memory_tag tag = all_memory_tags[rng() % memory_tag_count];
      const std::size_t growth = a.growth_for(n, align);
      const std::size_t reserved = a.stats().reserved;
      auto* p = static_cast<unsigned char*>(a.allocate(n, align, tag));
      REQUIRE(p != nullptr);
      REQUIRE(a.stats().reserved - reserved == growth);
      const auto start = reinterpret_cast<std::uintptr_t>(p);
      REQUIRE(start % align == 0);
      const auto end = start + n;
      auto after = ranges.lower_bound(start);
      REQUIRE((after == ranges.end() || after->first >= end));
      if (after != ranges.begin()) REQUIRE(std::prev(after)->second <= start);
      ranges.emplace(start, end);
      live.push_back({p, n, align, tag, next_id++});
      write_canary(live.back());
      expected.requested += n;
      expected.by_tag[index_of(tag)] += n;
      ++expected.live;
    }
    expected.check(a.stats());
    if (op % 64 == 0) REQUIRE(a.check_invariants());
  }

  while (!live.empty()) release_one(rng() % live.size());
  expected.check(a.stats());
  REQUIRE(a.check_invariants());
  a.release_cached();
  CHECK(a.stats().reserved == 0);
  CHECK(a.stats().allocated == 0);
  CHECK(a.stats().largest_free_block == 0);
  CHECK(factory<A>::held(a) == 0);
  CHECK(a.stats().peak_reserved >= a.stats().peak_allocated);
}

}  // namespace

TEST_CASE_TEMPLATE("allocator stress: random sizes, alignments, tags and free order", A, caching,
                   arena) {
  for (std::uint64_t seed : {1u, 42u, 20240611u}) {
    CAPTURE(seed);
    run_stress<A>(seed, 3000);
  }
}
