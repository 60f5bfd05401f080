// The contract every allocator policy keeps, checked over all of them with one set of typed tests.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "membound/membound.hpp"

using namespace membound;

using caching = caching_allocator<system_allocator>;
using arena = expandable_arena<host_virtual_memory>;
using budget_over_caching = budget_allocator<caching>;
using budget_over_arena = budget_allocator<arena>;
using budget_over_system = budget_allocator<system_allocator>;
using traced_caching = traced_allocator<caching>;
using synchronized_caching = synchronized<caching>;
using faulty_system = fault_injecting<system_allocator>;

TYPE_TO_STRING(system_allocator);
TYPE_TO_STRING(caching);
TYPE_TO_STRING(arena);
TYPE_TO_STRING(budget_over_caching);
TYPE_TO_STRING(budget_over_arena);
TYPE_TO_STRING(budget_over_system);
TYPE_TO_STRING(traced_caching);
TYPE_TO_STRING(synchronized_caching);
TYPE_TO_STRING(faulty_system);

namespace {

trace_recorder& shared_recorder() {
  static trace_recorder r(1 << 12);
  return r;
}

// One way to build each policy with enough room for the tests below.
template <typename A>
struct policy_factory;  // the primary template stays undefined: a new policy needs an entry here
template <> struct policy_factory<system_allocator> { static system_allocator make() { return {}; } };
template <> struct policy_factory<caching> { static caching make() { return caching{}; } };
template <> struct policy_factory<arena> {
  static arena make() { return arena(expandable_arena_options{std::size_t{1} << 32}); }
};
template <> struct policy_factory<budget_over_caching> {
  static budget_over_caching make() { return budget_over_caching(std::size_t{1} << 30); }
};
template <> struct policy_factory<budget_over_arena> {
  static budget_over_arena make() {
    return budget_over_arena(std::size_t{1} << 30, expandable_arena_options{std::size_t{1} << 32});
  }
};
template <> struct policy_factory<budget_over_system> {
  static budget_over_system make() { return budget_over_system(std::size_t{1} << 30); }
};
template <> struct policy_factory<traced_caching> {
  static traced_caching make() { return traced_caching(shared_recorder()); }
};
template <> struct policy_factory<synchronized_caching> {
  static synchronized_caching make() { return synchronized_caching{}; }
};
template <> struct policy_factory<faulty_system> { static faulty_system make() { return {}; } };

void check_invariants(const memory_stats& s) {
  CHECK(s.requested <= s.allocated);
  CHECK(s.allocated <= s.reserved);
  CHECK(s.peak_requested >= s.requested);
  CHECK(s.peak_allocated >= s.allocated);
  CHECK(s.peak_reserved >= s.reserved);
  CHECK(s.largest_free_block <= s.free_bytes());
  std::size_t by_tag = 0;
  for (memory_tag t : all_memory_tags) {
    by_tag += s.tag(t).current;
    CHECK(s.tag(t).peak >= s.tag(t).current);
  }
  CHECK(by_tag == s.requested);
  CHECK(s.fragmentation() >= 0.0);
  CHECK(s.fragmentation() <= 1.0);
}

}  // namespace

#define MEMBOUND_ALL_POLICIES                                                           \
  system_allocator, caching, arena, budget_over_caching, budget_over_arena,            \
      budget_over_system, traced_caching, synchronized_caching, faulty_system

TEST_CASE_TEMPLATE("every policy models the allocator concept", A, MEMBOUND_ALL_POLICIES) {
  static_assert(allocator<A>);
  static_assert(check_allocator<A>());
  CHECK(A::space == memory_space::host);
}

TEST_CASE_TEMPLATE("zero bytes gives nullptr and freeing it is a no-op", A, MEMBOUND_ALL_POLICIES) {
  A a = policy_factory<A>::make();
  void* p = a.allocate(0, default_alignment, memory_tag::other);
  CHECK(p == nullptr);
  a.deallocate(p, 0, default_alignment, memory_tag::other);
  CHECK(a.stats().requested == 0);
}

TEST_CASE_TEMPLATE("alignment is honoured and memory is writable", A, MEMBOUND_ALL_POLICIES) {
  A a = policy_factory<A>::make();
  struct live { void* p; std::size_t n, al; memory_tag t; };
  std::vector<live> blocks;
  std::size_t expected_requested = 0;
  for (std::size_t al : {1u, 8u, 64u, 256u, 512u}) {
    for (std::size_t n : {1u, 100u, 4096u, 70000u, 3u << 20}) {
      const memory_tag t = all_memory_tags[blocks.size() % memory_tag_count];
      void* p = a.allocate(n, al, t);
      REQUIRE(p != nullptr);
      CHECK(reinterpret_cast<std::uintptr_t>(p) % al == 0);
      std::memset(p, 0xAB, n);
      blocks.push_back({p, n, al, t});
      expected_requested += n;
      CHECK(a.stats().requested == expected_requested);
    }
  }
  check_invariants(a.stats());
  CHECK(a.stats().allocations == blocks.size());
  for (const live& b : blocks) a.deallocate(b.p, b.n, b.al, b.t);
  CHECK(a.stats().requested == 0);
  CHECK(a.stats().allocated == 0);
  CHECK(a.stats().deallocations == blocks.size());
  CHECK(a.stats().peak_requested == expected_requested);
  check_invariants(a.stats());
  if constexpr (caching_allocator_like<A>) {
    a.release_cached();
    CHECK(a.stats().reserved == 0);
  }
}

TEST_CASE_TEMPLATE("bad alignment and bad tag are typed errors that change nothing", A,
                   MEMBOUND_ALL_POLICIES) {
  A a = policy_factory<A>::make();
  void* keep = a.allocate(1000, 256, memory_tag::weights);
  const memory_stats before = a.stats();
  for (std::size_t bad : {0u, 3u, 96u}) {
    try {
      (void)a.allocate(64, bad, memory_tag::other);
      FAIL("expected invalid_argument for alignment " << bad);
    } catch (const invalid_argument& e) {
      CHECK(e.argument() == "alignment");
    }
  }
  try {
    (void)a.allocate(64, 256, static_cast<memory_tag>(200));
    FAIL("expected invalid_argument for tag");
  } catch (const invalid_argument& e) {
    CHECK(e.argument() == "tag");
  }
  const memory_stats after = a.stats();
  CHECK(after.requested == before.requested);
  CHECK(after.allocated == before.allocated);
  CHECK(after.reserved == before.reserved);
  CHECK(after.allocations == before.allocations);
  a.deallocate(keep, 1000, 256, memory_tag::weights);
}

TEST_CASE_TEMPLATE("growth_for predicts the reserve growth exactly", A, MEMBOUND_ALL_POLICIES) {
  if constexpr (reports_growth<A>) {
    A a = policy_factory<A>::make();
    struct live { void* p; std::size_t n; };
    std::vector<live> blocks;
    std::uint64_t x = 12345;
    for (int i = 0; i < 200; ++i) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      const std::size_t n = 1 + (x >> 33) % (6u << 20);
      if (!blocks.empty() && (x >> 13) % 3 == 0) {
        a.deallocate(blocks.back().p, blocks.back().n, 256, memory_tag::activations);
        blocks.pop_back();
        continue;
      }
      const std::size_t predicted = a.growth_for(n, 256);
      const std::size_t reserved_before = a.stats().reserved;
      blocks.push_back({a.allocate(n, 256, memory_tag::activations), n});
      CHECK(a.stats().reserved - reserved_before == predicted);
    }
    for (const live& b : blocks) a.deallocate(b.p, b.n, 256, memory_tag::activations);
  }
}

TEST_CASE_TEMPLATE("reset_peaks restarts peaks from current values", A, MEMBOUND_ALL_POLICIES) {
  if constexpr (requires(A& a) { a.reset_peaks(); }) {
    A a = policy_factory<A>::make();
    void* big = a.allocate(1 << 20, 256, memory_tag::activations);
    void* small = a.allocate(1 << 10, 256, memory_tag::weights);
    a.deallocate(big, 1 << 20, 256, memory_tag::activations);
    a.reset_peaks();
    CHECK(a.stats().peak_requested == (1u << 10));
    CHECK(a.stats().tag(memory_tag::activations).peak == 0);
    a.deallocate(small, 1 << 10, 256, memory_tag::weights);
  }
}
