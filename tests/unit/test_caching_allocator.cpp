#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "membound/memory/caching_allocator.hpp"
#include "membound/memory/fault_injection.hpp"
#include "membound/memory/system_allocator.hpp"

using namespace membound;

namespace {

constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t MiB = std::size_t{1} << 20;

std::uintptr_t addr(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

// Hands out addresses that are never backed by memory: proves the allocator never touches block
// memory, as it must not for device upstreams.
class fake_device_allocator {
 public:
  static constexpr memory_space space = memory_space::device;
  void* allocate(std::size_t bytes, std::size_t alignment, memory_tag) {
    next_ = align_up(next_, alignment);
    void* p = reinterpret_cast<void*>(next_);
    next_ += bytes;
    stats_.on_reserve(bytes);
    return p;
  }
  void deallocate(void*, std::size_t bytes, std::size_t, memory_tag) noexcept {
    stats_.on_release(bytes);
  }
  memory_stats stats() const noexcept { return stats_.stats(); }

 private:
  std::uintptr_t next_ = std::uintptr_t{1} << 44;
  stats_tracker stats_;
};

// Reports every upstream byte still outstanding into a counter that outlives the allocator.
class ledger_allocator {
 public:
  static constexpr memory_space space = memory_space::host;
  explicit ledger_allocator(std::size_t* outstanding) : outstanding_(outstanding) {}
  void* allocate(std::size_t bytes, std::size_t alignment, memory_tag tag) {
    void* p = inner_.allocate(bytes, alignment, tag);
    *outstanding_ += bytes;
    return p;
  }
  void deallocate(void* p, std::size_t bytes, std::size_t alignment, memory_tag tag) noexcept {
    inner_.deallocate(p, bytes, alignment, tag);
    *outstanding_ -= bytes;
  }
  memory_stats stats() const noexcept { return inner_.stats(); }

 private:
  system_allocator inner_;
  std::size_t* outstanding_;
};

}  // namespace

TEST_CASE("caching_allocator: requests round to 512-byte size classes") {
  caching_allocator<> a;
  CHECK(a.round_size(1) == 512);
  CHECK(a.round_size(512) == 512);
  CHECK(a.round_size(513) == 1024);
  CHECK(a.round_size(3 * MiB + 1) == 3 * MiB + 512);  // divisions off: only the granule

  void* p = a.allocate(1, 1, memory_tag::weights);
  CHECK(a.stats().requested == 1);
  CHECK(a.stats().allocated == 512);
  CHECK(a.stats().tag(memory_tag::weights).current == 1);
  a.deallocate(p, 1, 1, memory_tag::weights);
  CHECK(a.stats().allocated == 0);
}

TEST_CASE("caching_allocator: roundup_power2_divisions rounds large requests to steps") {
  caching_options o;
  o.roundup_power2_divisions = 4;
  caching_allocator<> a(o);
  CHECK(a.round_size(1300 * KiB) == 1536 * KiB);      // 1 MiB..2 MiB in steps of 256 KiB
  CHECK(a.round_size(3 * MiB + 1) == 3 * MiB + 512 * KiB);  // 2..4 MiB in steps of 512 KiB
  CHECK(a.round_size(4 * MiB) == 4 * MiB);            // a power of two stays
  CHECK(a.round_size(1000) == 1024);                  // the small pool is not affected
  CHECK(a.round_size(MiB) == MiB);

  o.roundup_power2_divisions = 4096;  // steps below the granule fall back to 512
  caching_allocator<> b(o);
  CHECK(b.round_size(MiB + 1) == MiB + 512);
}

TEST_CASE("caching_allocator: options are validated, naming the field") {
  auto field_of = [](caching_options o) -> std::string {
    try {
      caching_allocator<> a(o);
    } catch (const invalid_argument& e) {
      return e.argument();
    }
    return "";
  };
  caching_options o;
  o.roundup_power2_divisions = 3;
  CHECK(field_of(o) == "caching_options::roundup_power2_divisions");
  o = {};
  o.small_request_limit = 3 * MiB;
  CHECK(field_of(o) == "caching_options::small_request_limit");
  o = {};
  o.small_segment_size = 1000;
  CHECK(field_of(o) == "caching_options::small_segment_size");
  o = {};
  o.large_segment_limit = 30 * MiB;
  CHECK(field_of(o) == "caching_options::large_segment_limit");
  o = {};
  o.large_segment_size = 0;
  CHECK(field_of(o) == "caching_options::large_segment_size");
  o = {};
  o.segment_rounding = 3 * MiB;
  CHECK(field_of(o) == "caching_options::segment_rounding");
  o = {};
  o.segment_alignment = 256;
  CHECK(field_of(o) == "caching_options::segment_alignment");
  CHECK(field_of(caching_options{}).empty());
}

TEST_CASE("caching_allocator: small and large pools use their own segment sizes") {
  caching_allocator<> a;
  auto reserved = [&] { return a.stats().reserved; };

  void* s1 = a.allocate(1, 256, memory_tag::other);
  CHECK(reserved() == 2 * MiB);  // small pool segment
  void* s2 = a.allocate(MiB, 256, memory_tag::other);
  CHECK(reserved() == 2 * MiB);  // 1 MiB is still small and fits the same segment

  void* l1 = a.allocate(MiB + 1, 256, memory_tag::other);
  CHECK(reserved() == 22 * MiB);  // large pool: a shared 20 MiB segment
  void* l2 = a.allocate(10 * MiB - 512, 256, memory_tag::other);
  CHECK(reserved() == 22 * MiB);  // below 10 MiB: shares the 20 MiB segment
  void* l3 = a.allocate(10 * MiB, 256, memory_tag::other);
  CHECK(reserved() == 32 * MiB);  // 10 MiB and up: a segment of its own
  void* l4 = a.allocate(15 * MiB + 1, 256, memory_tag::other);
  CHECK(reserved() == 48 * MiB);  // rounded up to 2 MiB: 16 MiB
  CHECK(a.stats().upstream_allocations == 4);
  CHECK(a.upstream().stats().reserved == 48 * MiB);

  // Free large space never serves small requests: a full small segment needs a new one.
  a.deallocate(l2, 10 * MiB - 512, 256, memory_tag::other);
  std::vector<void*> small;
  for (int i = 0; i < 3; ++i) small.push_back(a.allocate(512 * KiB, 256, memory_tag::other));
  CHECK(reserved() == 50 * MiB);

  for (void* p : small) a.deallocate(p, 512 * KiB, 256, memory_tag::other);
  a.deallocate(s1, 1, 256, memory_tag::other);
  a.deallocate(s2, MiB, 256, memory_tag::other);
  a.deallocate(l1, MiB + 1, 256, memory_tag::other);
  a.deallocate(l3, 10 * MiB, 256, memory_tag::other);
  a.deallocate(l4, 15 * MiB + 1, 256, memory_tag::other);
  CHECK(a.check_invariants());
}

TEST_CASE("caching_allocator: best fit picks the smallest hole that fits") {
  caching_allocator<> a;
  const auto t = memory_tag::activations;
  void* h64 = a.allocate(64 * KiB, 256, t);
  void* g1 = a.allocate(4 * KiB, 256, t);
  void* h32 = a.allocate(32 * KiB, 256, t);
  void* g2 = a.allocate(4 * KiB, 256, t);
  a.deallocate(h64, 64 * KiB, 256, t);
  a.deallocate(h32, 32 * KiB, 256, t);
  // Holes of 64 KiB and 32 KiB plus the big free tail: 30 KiB goes to the 32 KiB hole.
  void* p = a.allocate(30 * KiB, 256, t);
  CHECK(p == h32);
  void* q = a.allocate(60 * KiB, 256, t);
  CHECK(q == h64);
  CHECK(a.stats().upstream_allocations == 1);
  for (auto [ptr, n] : {std::pair{p, 30 * KiB}, {q, 60 * KiB}, {g1, 4 * KiB}, {g2, 4 * KiB}}) {
    a.deallocate(ptr, n, 256, t);
  }
  CHECK(a.check_invariants());
}

TEST_CASE("caching_allocator: split on allocate, coalesce on free") {
  caching_allocator<> a;
  const auto t = memory_tag::other;
  void* x = a.allocate(100 * KiB, 512, t);
  void* y = a.allocate(100 * KiB, 512, t);
  void* z = a.allocate(100 * KiB, 512, t);
  CHECK(addr(y) == addr(x) + 100 * KiB);  // split: consecutive blocks of one segment
  CHECK(addr(z) == addr(y) + 100 * KiB);
  CHECK(a.stats().largest_free_block == 2 * MiB - 300 * KiB);

  a.deallocate(y, 100 * KiB, 512, t);
  CHECK(a.stats().largest_free_block == 2 * MiB - 300 * KiB);
  a.deallocate(x, 100 * KiB, 512, t);  // merges with y's hole: one 200 KiB block
  void* w = a.allocate(200 * KiB, 512, t);
  CHECK(w == x);
  a.deallocate(w, 200 * KiB, 512, t);
  a.deallocate(z, 100 * KiB, 512, t);  // everything merges back into one block
  CHECK(a.stats().largest_free_block == 2 * MiB);
  CHECK(a.stats().fragmentation() == 0.0);
  CHECK(a.check_invariants());
}

TEST_CASE("caching_allocator: large blocks are not split into slivers of 1 MiB or less") {
  caching_allocator<> a;
  const auto t = memory_tag::other;
  void* p = a.allocate(9 * MiB + 512 * KiB, 512, t);
  void* q = a.allocate(9 * MiB + 512 * KiB, 512, t);  // 1 MiB remainder stays in the block
  CHECK(a.stats().requested == 19 * MiB);
  CHECK(a.stats().allocated == 20 * MiB);
  CHECK(a.stats().largest_free_block == 0);
  a.deallocate(q, 9 * MiB + 512 * KiB, 512, t);
  a.deallocate(p, 9 * MiB + 512 * KiB, 512, t);
  CHECK(a.stats().largest_free_block == 20 * MiB);

  caching_options o;
  o.large_split_above = 0;
  caching_allocator<> b(o);
  p = b.allocate(9 * MiB + 512 * KiB, 512, t);
  q = b.allocate(9 * MiB + 512 * KiB, 512, t);
  CHECK(b.stats().allocated == 19 * MiB);
  CHECK(b.stats().largest_free_block == MiB);
  b.deallocate(p, 9 * MiB + 512 * KiB, 512, t);
  b.deallocate(q, 9 * MiB + 512 * KiB, 512, t);
}

TEST_CASE("caching_allocator: release_cached returns only fully free segments") {
  caching_allocator<> a;
  const auto t = memory_tag::other;
  void* s = a.allocate(KiB, 256, t);
  void* h = a.allocate(12 * MiB, 256, t);  // a segment of its own, filled exactly
  void* l = a.allocate(2 * MiB, 256, t);   // so this one needs a shared 20 MiB segment
  CHECK(a.stats().reserved == 2 * MiB + 20 * MiB + 12 * MiB);
  a.deallocate(l, 2 * MiB, 256, t);
  a.deallocate(h, 12 * MiB, 256, t);
  const auto before = a.stats();
  a.release_cached();
  CHECK(a.stats().reserved == 2 * MiB);  // the small segment holds s
  CHECK(a.stats().upstream_deallocations == before.upstream_deallocations + 2);
  CHECK(a.upstream().stats().reserved == 2 * MiB);
  CHECK(a.stats().largest_free_block == 2 * MiB - KiB);
  a.deallocate(s, KiB, 256, t);
  a.release_cached();
  CHECK(a.stats().reserved == 0);
  CHECK(a.stats().largest_free_block == 0);
  CHECK(a.upstream().stats().reserved == 0);
  // Still usable afterwards.
  void* again = a.allocate(KiB, 256, t);
  CHECK(again != nullptr);
  a.deallocate(again, KiB, 256, t);
}

TEST_CASE("caching_allocator: a repeated training step makes no upstream calls after the first") {
  caching_allocator<> a;
  std::vector<std::size_t> weights{3 * MiB, 512 * KiB, 40 * MiB, 7 * KiB, 12 * MiB};
  std::vector<void*> w;
  for (std::size_t n : weights) w.push_back(a.allocate(n, 256, memory_tag::weights));

  std::vector<std::size_t> acts{300 * KiB, 2 * MiB + 100, 64 * KiB, 9 * MiB, 1000, 15 * MiB, 700 * KiB,
                                4 * MiB};
  auto step = [&] {
    std::vector<void*> live;
    for (std::size_t n : acts) live.push_back(a.allocate(n, 256, memory_tag::activations));
    void* scratch = a.allocate(6 * MiB, 512, memory_tag::workspace);
    a.deallocate(scratch, 6 * MiB, 512, memory_tag::workspace);
    for (std::size_t i = acts.size(); i-- > 0;) {  // backward frees in reverse
      void* g = a.allocate(acts[i] / 2 + 1, 256, memory_tag::gradients);
      a.deallocate(live[i], acts[i], 256, memory_tag::activations);
      a.deallocate(g, acts[i] / 2 + 1, 256, memory_tag::gradients);
    }
  };
  step();
  const std::uint64_t calls = a.stats().upstream_calls();
  CHECK(calls > 0);
  for (int i = 0; i < 20; ++i) step();
  CHECK(a.stats().upstream_calls() == calls);
  CHECK(a.upstream().stats().upstream_calls() == calls);
  for (std::size_t i = 0; i < w.size(); ++i) a.deallocate(w[i], weights[i], 256, memory_tag::weights);
  CHECK(a.check_invariants());
}

TEST_CASE("caching_allocator: random repeated steps settle after the first") {
  // Oldest-segment-first placement makes this hold for any step that frees what it allocates.
  std::mt19937_64 rng(2024);
  for (int script = 0; script < 25; ++script) {
    caching_allocator<> a;
    std::vector<void*> kept;
    for (int i = 0; i < 3; ++i) {
      kept.push_back(a.allocate((std::size_t{1} << (rng() % 24)) + 1, 256, memory_tag::weights));
    }
    struct op {
      bool alloc;
      std::size_t index, bytes;
    };
    std::vector<op> script_ops;
    std::vector<std::size_t> open_blocks;
    std::size_t count = 0;
    for (int i = 0; i < 60; ++i) {
      if (!open_blocks.empty() && rng() % 3 == 0) {
        const std::size_t k = rng() % open_blocks.size();
        script_ops.push_back({false, open_blocks[k], 0});
        open_blocks.erase(open_blocks.begin() + static_cast<std::ptrdiff_t>(k));
      } else {
        const auto n = static_cast<std::size_t>(std::exp2(std::uniform_real_distribution<double>(0, 25)(rng)));
        script_ops.push_back({true, count, n});
        open_blocks.push_back(count++);
      }
    }
    std::shuffle(open_blocks.begin(), open_blocks.end(), rng);
    for (std::size_t k : open_blocks) script_ops.push_back({false, k, 0});
    std::vector<std::size_t> bytes(count);
    for (const op& o : script_ops) if (o.alloc) bytes[o.index] = o.bytes;

    auto step = [&] {
      std::vector<void*> ptr(count);
      for (const op& o : script_ops) {
        if (o.alloc) ptr[o.index] = a.allocate(o.bytes, 256, memory_tag::activations);
        else a.deallocate(ptr[o.index], bytes[o.index], 256, memory_tag::activations);
      }
    };
    step();
    const auto calls = a.stats().upstream_calls();
    for (int i = 0; i < 3; ++i) step();
    CHECK(a.stats().upstream_calls() == calls);
    CHECK(a.check_invariants());
  }
}

TEST_CASE("caching_allocator: upstream out_of_memory releases the cache and retries once") {
  caching_allocator<fault_injecting<system_allocator>> a;
  const auto t = memory_tag::activations;
  void* s = a.allocate(KiB, 256, t);  // call 1: small segment
  a.deallocate(s, KiB, 256, t);       // cached, fully free
  CHECK(a.stats().reserved == 2 * MiB);

  // One failure: the cache is released, the retry succeeds.
  a.upstream().fail_on({2});
  void* l = a.allocate(3 * MiB, 256, t);
  CHECK(l != nullptr);
  CHECK(a.upstream().calls() == 3);
  CHECK(a.stats().reserved == 20 * MiB);
  CHECK(a.stats().upstream_deallocations == 1);
  CHECK(a.stats().failed_allocations == 0);

  // Two failures in a row: a clean out_of_memory from this allocator.
  a.upstream().fail_on({4, 5});
  const auto before = a.stats();
  try {
    (void)a.allocate(30 * MiB, 256, memory_tag::weights);
    FAIL("expected out_of_memory");
  } catch (const out_of_memory& e) {
    const oom_report& r = e.report();
    CHECK(r.source == "caching_allocator");
    CHECK(r.requested == 30 * MiB);  // the upstream's request: the segment
    CHECK(r.detail == "injected failure on call 5");
    CHECK(r.allocated == 3 * MiB);
    CHECK(r.reserved_unallocated == 17 * MiB);
    CHECK(r.largest_free_block == 17 * MiB);
    CHECK(r.tag_current[index_of(t)] == 3 * MiB);
    CHECK(r.tag_current[index_of(memory_tag::weights)] == 0);
  }
  const auto after = a.stats();
  CHECK(after.failed_allocations == before.failed_allocations + 1);
  CHECK(after.requested == before.requested);
  CHECK(after.allocated == before.allocated);
  CHECK(after.reserved == before.reserved);  // nothing cached was free to release
  CHECK(after.allocations == before.allocations);
  CHECK(a.check_invariants());

  // Keeps working.
  void* m = a.allocate(30 * MiB, 256, memory_tag::weights);
  CHECK(m != nullptr);
  a.deallocate(m, 30 * MiB, 256, memory_tag::weights);
  a.deallocate(l, 3 * MiB, 256, t);
  a.release_cached();
  CHECK(a.upstream().stats().reserved == 0);
}

TEST_CASE("caching_allocator: bad deallocate arguments are named and change nothing") {
  caching_allocator<> a;
  void* p = a.allocate(1000, 256, memory_tag::weights);
  void* q = a.allocate(5 * MiB, 512, memory_tag::optimizer);
  const auto before = a.stats();
  auto argument_of = [&](auto&& call) -> std::string {
    try {
      call();
    } catch (const invalid_argument& e) {
      return e.argument();
    }
    return "";
  };
  CHECK(argument_of([&] { a.deallocate(static_cast<char*>(p) + 512, 1000, 256, memory_tag::weights); }) == "p");
  int on_stack = 0;
  CHECK(argument_of([&] { a.deallocate(&on_stack, 4, 256, memory_tag::weights); }) == "p");
  CHECK(argument_of([&] { a.deallocate(nullptr, 1000, 256, memory_tag::weights); }) == "p");
  CHECK(argument_of([&] { a.deallocate(p, 999, 256, memory_tag::weights); }) == "bytes");
  CHECK(argument_of([&] { a.deallocate(p, 1000, 128, memory_tag::weights); }) == "alignment");
  CHECK(argument_of([&] { a.deallocate(p, 1000, 256, memory_tag::gradients); }) == "tag");
  CHECK(argument_of([&] { a.deallocate(q, 5 * MiB, 512, static_cast<memory_tag>(42)); }) == "tag");
  CHECK((a.stats() == before));
  CHECK(a.check_invariants());

  a.deallocate(p, 1000, 256, memory_tag::weights);
  CHECK(argument_of([&] { a.deallocate(p, 1000, 256, memory_tag::weights); }) == "p");  // double free
  a.deallocate(nullptr, 0, 256, memory_tag::weights);  // no-op
  a.deallocate(q, 5 * MiB, 512, memory_tag::optimizer);
  CHECK(a.stats().requested == 0);
}

TEST_CASE("caching_allocator: bad allocate arguments are named and change nothing") {
  caching_allocator<> a;
  void* p = a.allocate(100, 256, memory_tag::other);
  const auto before = a.stats();
  try {
    (void)a.allocate(100, 1024, memory_tag::other);
    FAIL("expected invalid_argument");
  } catch (const invalid_argument& e) {
    CHECK(e.argument() == "alignment");
  }
  try {
    (void)a.allocate(100, 3, memory_tag::other);
    FAIL("expected invalid_argument");
  } catch (const invalid_argument& e) {
    CHECK(e.argument() == "alignment");
  }
  try {
    (void)a.allocate(100, 256, static_cast<memory_tag>(9));
    FAIL("expected invalid_argument");
  } catch (const invalid_argument& e) {
    CHECK(e.argument() == "tag");
  }
  CHECK_THROWS_AS((void)a.growth_for(100, 4096), invalid_argument);
  CHECK(a.allocate(0, 256, memory_tag::other) == nullptr);
  CHECK((a.stats() == before));
  CHECK_THROWS_AS((void)a.allocate(SIZE_MAX - 10, 256, memory_tag::other), out_of_memory);
  CHECK(a.stats().failed_allocations == 1);
  CHECK(a.stats().requested == before.requested);
  CHECK(a.growth_for(SIZE_MAX - 10, 256) == SIZE_MAX);
  a.deallocate(p, 100, 256, memory_tag::other);
}

TEST_CASE("caching_allocator: growth_for predicts the reserve growth exactly") {
  for (std::size_t divisions : {std::size_t{0}, std::size_t{4}}) {
    caching_options o;
    o.roundup_power2_divisions = divisions;
    caching_allocator<> a(o);
    std::mt19937_64 rng(1234 + divisions);
    struct live_block {
      void* p;
      std::size_t n, align;
    };
    std::vector<live_block> live;
    for (int i = 0; i < 1500; ++i) {
      if (!live.empty() && (live.size() > 60 || rng() % 2 == 0)) {
        const std::size_t k = rng() % live.size();
        a.deallocate(live[k].p, live[k].n, live[k].align, memory_tag::other);
        live[k] = live.back();
        live.pop_back();
        continue;
      }
      if (rng() % 50 == 0) a.release_cached();
      // Log-uniform sizes from 1 B to 32 MiB hit every pool and segment rule.
      const double e = std::uniform_real_distribution<double>(0.0, 25.0)(rng);
      const std::size_t n = static_cast<std::size_t>(std::exp2(e));
      const std::size_t align = std::size_t{1} << (rng() % 10);
      const std::size_t predicted = a.growth_for(n, align);
      const std::size_t reserved = a.stats().reserved;
      void* p = a.allocate(n, align, memory_tag::other);
      REQUIRE(a.stats().reserved - reserved == predicted);
      CHECK(addr(p) % align == 0);
      live.push_back({p, n, align});
    }
    for (auto& b : live) a.deallocate(b.p, b.n, b.align, memory_tag::other);
    CHECK(a.check_invariants());
  }
}

TEST_CASE("caching_allocator: works over a device upstream without touching block memory") {
  caching_allocator<fake_device_allocator> a;
  static_assert(caching_allocator<fake_device_allocator>::space == memory_space::device);
  std::vector<std::pair<void*, std::size_t>> live;
  for (std::size_t n : {std::size_t{100}, 5 * MiB, 300 * KiB, 12 * MiB, std::size_t{7}}) {
    live.emplace_back(a.allocate(n, 512, memory_tag::activations), n);
  }
  for (auto [p, n] : live) a.deallocate(p, n, 512, memory_tag::activations);
  a.release_cached();
  CHECK(a.upstream().stats().reserved == 0);
  CHECK(a.check_invariants());
}

TEST_CASE("caching_allocator: destruction returns every segment, even with live blocks") {
  std::size_t outstanding = 0;
  {
    caching_allocator<ledger_allocator> a(caching_options{}, &outstanding);
    (void)a.allocate(1000, 256, memory_tag::other);      // deliberately never freed
    (void)a.allocate(11 * MiB, 256, memory_tag::other);  // likewise
    void* p = a.allocate(2 * MiB, 256, memory_tag::other);
    a.deallocate(p, 2 * MiB, 256, memory_tag::other);
    CHECK(outstanding == 2 * MiB + 12 * MiB + 20 * MiB);
  }
  CHECK(outstanding == 0);
}
