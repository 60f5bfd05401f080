#include <doctest/doctest.h>

#include <limits>

#include <atomic>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "../support/fake_caching_allocator.hpp"
#include "membound/memory/budget.hpp"
#include "membound/memory/caching_allocator.hpp"
#include "membound/memory/synchronized.hpp"
#include "membound/memory/system_allocator.hpp"

using namespace membound;
using membound_test::fake_caching_allocator;

namespace {

constexpr std::size_t KiB = 1024, MiB = 1024 * 1024;

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// Everything but failed_allocations, which a refusal is meant to bump.
void check_same_except_failures(const memory_stats& a, const memory_stats& b) {
  CHECK(a.requested == b.requested);
  CHECK(a.peak_requested == b.peak_requested);
  CHECK(a.allocated == b.allocated);
  CHECK(a.peak_allocated == b.peak_allocated);
  CHECK(a.reserved == b.reserved);
  CHECK(a.peak_reserved == b.peak_reserved);
  CHECK(a.allocations == b.allocations);
  CHECK(a.deallocations == b.deallocations);
  CHECK(a.upstream_allocations == b.upstream_allocations);
  CHECK(a.upstream_deallocations == b.upstream_deallocations);
  CHECK(a.largest_free_block == b.largest_free_block);
  for (memory_tag t : all_memory_tags) {
    CHECK(a.tag(t).current == b.tag(t).current);
    CHECK(a.tag(t).peak == b.tag(t).peak);
  }
}

template <typename F>
oom_report expect_oom(F&& f) {
  try {
    f();
  } catch (const out_of_memory& e) {
    CHECK(std::string(e.what()) == e.report().message());
    return e.report();
  }
  FAIL("expected out_of_memory");
  return {};
}

template <typename F>
invalid_argument expect_invalid(F&& f) {
  try {
    f();
  } catch (const invalid_argument& e) {
    return e;
  }
  FAIL("expected invalid_argument");
  return invalid_argument("", "", "", "");
}


}  // namespace

static_assert(check_allocator<budget_allocator<system_allocator>>());
static_assert(budgeted<budget_allocator<system_allocator>>);
static_assert(budget_allocator<system_allocator>::space == memory_space::host);
static_assert(!caching_allocator_like<budget_allocator<system_allocator>>);
static_assert(reports_growth<budget_allocator<system_allocator>>);
static_assert(caching_allocator_like<budget_allocator<fake_caching_allocator>>);
static_assert(caching_allocator_like<budget_allocator<caching_allocator<>>>);
// Budgets stack: the outer one sees the inner's growth and cache.
static_assert(reports_growth<budget_allocator<budget_allocator<caching_allocator<>>>>);

TEST_CASE("budget over system_allocator: the cap holds exactly, refusal changes nothing") {
  budget_allocator<system_allocator> b(10000);
  CHECK(b.limit() == 10000);
  void* act = b.allocate(4000, 256, memory_tag::activations);
  void* w = b.allocate(2000, 256, memory_tag::weights);
  CHECK(b.usage() == 6000);
  CHECK(b.headroom() == 4000);

  const memory_stats before = b.stats();
  const oom_report r = expect_oom([&] { (void)b.allocate(5000, 256, memory_tag::activations); });

  // Field by field.
  CHECK(r.source == "budget");
  CHECK(r.requested == 5000);
  CHECK(r.growth_needed == 5000);
  CHECK(r.budget == 10000);
  CHECK(r.free_under_budget == 4000);
  CHECK(r.allocated == 6000);
  CHECK(r.reserved_unallocated == 0);
  CHECK(r.largest_free_block == 0);
  CHECK(r.external == 0);
  CHECK(r.tag_current[index_of(memory_tag::activations)] == 4000);
  CHECK(r.tag_peak[index_of(memory_tag::activations)] == 4000);
  CHECK(r.tag_current[index_of(memory_tag::weights)] == 2000);
  CHECK(r.tag_peak[index_of(memory_tag::weights)] == 2000);
  for (memory_tag t : {memory_tag::gradients, memory_tag::optimizer, memory_tag::workspace,
                       memory_tag::other}) {
    CHECK(r.tag_current[index_of(t)] == 0);
    CHECK(r.tag_peak[index_of(t)] == 0);
  }
  CHECK(r.detail.empty());
  // need = growth - free = 1000 B; activations are the largest holder; raise to 6000 + 5000.
  CHECK(contains(r.hint, "activations hold the most"));
  CHECK(contains(r.hint, "recompute schedule"));
  CHECK(contains(r.hint, "free at least 1000 B"));
  CHECK(contains(r.hint, "raise the budget to at least " + format_bytes(11000)));
  CHECK(contains(r.hint, "(11000 B)"));

  const std::string m = r.message();
  for (const std::string& figure :
       {format_bytes(5000), format_bytes(10000), format_bytes(4000), format_bytes(6000),
        format_bytes(0), format_bytes(4000, false), format_bytes(2000, false)}) {
    CHECK_MESSAGE(contains(m, figure), figure);
  }
  CHECK(contains(m, r.hint));

  // Exactly unchanged, but for the refusal count.
  const memory_stats after = b.stats();
  check_same_except_failures(before, after);
  CHECK(after.failed_allocations == before.failed_allocations + 1);
  CHECK(b.usage() == 6000);

  // Up to the limit exactly is fine; one byte more is not.
  void* rest = b.allocate(4000, 256, memory_tag::other);
  CHECK(b.usage() == 10000);
  CHECK(b.headroom() == 0);
  CHECK_THROWS_AS((void)b.allocate(1, 256, memory_tag::other), out_of_memory);
  CHECK(b.allocate(0, 256, memory_tag::other) == nullptr);

  b.deallocate(rest, 4000, 256, memory_tag::other);
  b.deallocate(w, 2000, 256, memory_tag::weights);
  b.deallocate(act, 4000, 256, memory_tag::activations);
  CHECK(b.usage() == 0);
  CHECK(b.stats().failed_allocations == 2);
}

TEST_CASE("budget hint names the policy of the largest holder, with exact bytes") {
  SUBCASE("weights: precision policy") {
    budget_allocator<system_allocator> b(10000);
    void* p = b.allocate(8000, 256, memory_tag::weights);
    const oom_report r = expect_oom([&] { (void)b.allocate(3000, 256, memory_tag::activations); });
    CHECK(contains(r.hint, "weights hold the most"));
    CHECK(contains(r.hint, "precision policy"));
    CHECK(contains(r.hint, "bf16"));
    CHECK(contains(r.hint, "free at least 1000 B"));
    CHECK(contains(r.hint, "(4000 B), enough"));  // half of 8000
    CHECK(contains(r.hint, "smaller model"));
    CHECK(contains(r.hint, "raise the budget to at least " + format_bytes(11000)));
    b.deallocate(p, 8000, 256, memory_tag::weights);
  }
  SUBCASE("optimizer state: precision policy, not enough alone") {
    budget_allocator<system_allocator> b(10000);
    void* p = b.allocate(3000, 256, memory_tag::optimizer);
    const oom_report r = expect_oom([&] { (void)b.allocate(9000, 256, memory_tag::weights); });
    CHECK(contains(r.hint, "optimizer hold the most"));
    CHECK(contains(r.hint, "free at least " + format_bytes(2000)));
    CHECK(contains(r.hint, "not enough on its own"));
    CHECK(contains(r.hint, "(12000 B)"));
    b.deallocate(p, 3000, 256, memory_tag::optimizer);
  }
  SUBCASE("workspace: chunking policy") {
    budget_allocator<system_allocator> b(10000);
    void* p = b.allocate(7000, 256, memory_tag::workspace);
    void* q = b.allocate(1000, 256, memory_tag::activations);
    const oom_report r = expect_oom([&] { (void)b.allocate(2500, 256, memory_tag::workspace); });
    CHECK(contains(r.hint, "workspace hold the most"));
    CHECK(contains(r.hint, "chunking policy"));
    CHECK(contains(r.hint, "free at least 500 B"));
    CHECK(contains(r.hint, "(10500 B)"));
    b.deallocate(q, 1000, 256, memory_tag::activations);
    b.deallocate(p, 7000, 256, memory_tag::workspace);
  }
  SUBCASE("other: free what holds it") {
    budget_allocator<system_allocator> b(10000);
    void* p = b.allocate(9000, 256, memory_tag::other);
    const oom_report r = expect_oom([&] { (void)b.allocate(2000, 256, memory_tag::weights); });
    CHECK(contains(r.hint, "other hold the most"));
    CHECK(contains(r.hint, "of what holds it"));
    CHECK(contains(r.hint, "free at least 1000 B"));
    b.deallocate(p, 9000, 256, memory_tag::other);
  }
  SUBCASE("nothing held: the request alone is too large") {
    budget_allocator<system_allocator> b(1000);
    const oom_report r = expect_oom([&] { (void)b.allocate(1500, 256, memory_tag::workspace); });
    CHECK(r.free_under_budget == 1000);
    CHECK(contains(r.hint, "the request alone"));
    CHECK(contains(r.hint, "chunking policy"));
    CHECK(contains(r.hint, "raise the budget to at least " + format_bytes(1500)));
  }
}

TEST_CASE("budget: external bytes count against the cap") {
  budget_allocator<system_allocator> b(10000);
  void* p = b.allocate(2000, 256, memory_tag::activations);
  b.set_external(7000);
  CHECK(b.external() == 7000);
  CHECK(b.usage() == 9000);
  CHECK(b.headroom() == 1000);

  const oom_report r = expect_oom([&] { (void)b.allocate(1500, 256, memory_tag::activations); });
  CHECK(r.external == 7000);
  CHECK(r.free_under_budget == 1000);
  CHECK(contains(r.hint, "external memory"));
  CHECK(contains(r.hint, "free at least 500 B"));
  CHECK(contains(r.hint, "(10500 B)"));
  CHECK(contains(r.message(), "external " + format_bytes(7000)));

  // More external bytes than fit: refused, value unchanged.
  const oom_report e = expect_oom([&] { b.set_external(8500); });
  CHECK(e.source == "budget (external bytes)");
  CHECK(e.requested == 1500);
  CHECK(b.external() == 7000);

  b.set_external(0);
  void* q = b.allocate(1500, 256, memory_tag::activations);
  CHECK(b.usage() == 3500);
  b.deallocate(q, 1500, 256, memory_tag::activations);
  b.deallocate(p, 2000, 256, memory_tag::activations);
}

TEST_CASE("budget: limit validation") {
  CHECK(expect_invalid([] { budget_allocator<system_allocator> b(0); }).argument() == "limit");

  budget_allocator<system_allocator> b(10000);
  CHECK(expect_invalid([&] { b.set_limit(0); }).argument() == "limit");
  void* p = b.allocate(6000, 256, memory_tag::weights);

  const invalid_argument e = expect_invalid([&] { b.set_limit(5000); });
  CHECK(e.argument() == "limit");
  CHECK(contains(e.what_to_do(), "Free 1000 B"));
  CHECK(b.limit() == 10000);

  b.set_limit(6000);  // exactly the usage
  CHECK(b.headroom() == 0);
  CHECK_THROWS_AS((void)b.allocate(1, 256, memory_tag::other), out_of_memory);
  b.set_limit(20000);
  void* q = b.allocate(14000, 256, memory_tag::weights);
  CHECK(b.usage() == 20000);

  // Bad alignment and tag are named, and leave the statistics alone.
  const memory_stats s = b.stats();
  CHECK(expect_invalid([&] { (void)b.allocate(8, 3, memory_tag::other); }).argument() ==
        "alignment");
  CHECK(expect_invalid([&] { (void)b.allocate(8, 8, static_cast<memory_tag>(99)); }).argument() ==
        "tag");
  check_same_except_failures(s, b.stats());
  CHECK(b.stats().failed_allocations == s.failed_allocations);

  b.deallocate(q, 14000, 256, memory_tag::weights);
  b.deallocate(p, 6000, 256, memory_tag::weights);
}

TEST_CASE("budget over a caching upstream: the cache is released before refusing") {
  budget_allocator<fake_caching_allocator> b(4096, std::size_t{1024});
  std::vector<void*> ps;
  for (int i = 0; i < 3; ++i) ps.push_back(b.allocate(1000, 256, memory_tag::activations));
  CHECK(b.usage() == 3072);
  b.deallocate(ps[1], 1000, 256, memory_tag::activations);
  b.deallocate(ps[2], 1000, 256, memory_tag::activations);
  CHECK(b.usage() == 3072);  // cached bytes still count
  CHECK(b.growth_for(1000, 256) == 0);
  CHECK(b.growth_for(2000, 256) == 2048);

  // Cached reuse costs no headroom.
  void* again = b.allocate(900, 256, memory_tag::activations);
  CHECK(b.usage() == 3072);
  CHECK(b.upstream().release_calls() == 0);
  b.deallocate(again, 900, 256, memory_tag::activations);

  // 3072 + 2048 > 4096: the two cached blocks go back, then it fits.
  void* big = b.allocate(2000, 256, memory_tag::activations);
  CHECK(b.upstream().release_calls() == 1);
  CHECK(b.stats().upstream_deallocations == 2);
  CHECK(b.usage() == 3072);
  CHECK(b.stats().failed_allocations == 0);

  // Still over after releasing: refused, with the release tried once more.
  const oom_report r = expect_oom([&] { (void)b.allocate(1500, 256, memory_tag::weights); });
  CHECK(b.upstream().release_calls() == 2);
  CHECK(r.growth_needed == 2048);
  CHECK(r.free_under_budget == 1024);
  CHECK(r.allocated == 3072);
  CHECK(r.reserved_unallocated == 0);
  CHECK(contains(r.hint, "free at least " + format_bytes(1024)));
  CHECK(contains(r.hint, "(5120 B)"));
  CHECK(b.usage() == 3072);

  b.release_cached();
  CHECK(b.upstream().release_calls() == 3);
  b.deallocate(big, 2000, 256, memory_tag::activations);
  b.deallocate(ps[0], 1000, 256, memory_tag::activations);
}

TEST_CASE("budget: stranded free bytes give a fragmentation hint naming expandable_arena") {
  budget_allocator<fake_caching_allocator> b(5000, std::size_t{1024});
  std::vector<void*> ps;
  for (int i = 0; i < 4; ++i) ps.push_back(b.allocate(1024, 256, memory_tag::activations));
  for (int i = 1; i < 4; ++i) b.deallocate(ps[i], 1024, 256, memory_tag::activations);
  b.upstream().strand_cache(true);
  const memory_stats before = b.stats();

  // usage 4096, free 904, growth 2048: need 1144 <= 3072 unallocated, largest hole 1024 < 2048.
  const oom_report r = expect_oom([&] { (void)b.allocate(2048, 256, memory_tag::activations); });
  CHECK(r.requested == 2048);
  CHECK(r.growth_needed == 2048);
  CHECK(r.budget == 5000);
  CHECK(r.free_under_budget == 904);
  CHECK(r.allocated == 1024);
  CHECK(r.reserved_unallocated == 3072);
  CHECK(r.largest_free_block == 1024);
  CHECK(r.tag_current[index_of(memory_tag::activations)] == 1024);
  CHECK(r.tag_peak[index_of(memory_tag::activations)] == 4096);
  CHECK(contains(r.hint, "fragmentation"));
  CHECK(contains(r.hint, "expandable_arena"));
  CHECK(contains(r.hint, format_bytes(3072)));
  CHECK(contains(r.hint, "1144 B"));
  CHECK(contains(r.hint, "largest free block is " + format_bytes(1024)));
  CHECK(contains(r.hint, "(6144 B)"));
  CHECK(b.upstream().release_calls() == 1);
  check_same_except_failures(before, b.stats());

  b.upstream().strand_cache(false);
  b.deallocate(ps[0], 1024, 256, memory_tag::activations);
}

TEST_CASE("budget: an upstream that grows more than it predicted is caught and undone") {
  budget_allocator<fake_caching_allocator> b(1200, std::size_t{1024});
  b.upstream().lie_by(512);  // predicts 1024, takes 1536
  const oom_report r = expect_oom([&] { (void)b.allocate(1000, 256, memory_tag::weights); });
  CHECK(contains(r.detail, "growth_for"));
  CHECK(contains(r.detail, "wrong"));
  CHECK(contains(r.detail, "1536 B"));
  CHECK(r.growth_needed == 1536);
  CHECK(r.free_under_budget == 1200);
  CHECK(contains(r.message(), "upstream: " + r.detail));
  CHECK(b.upstream().live_blocks() == 0);
  CHECK(b.usage() == 0);
  CHECK(b.stats().requested == 0);
  CHECK(b.stats().failed_allocations == 1);
}

TEST_CASE("budget: a request no allocator can serve is refused at once, with the right advice") {
  budget_allocator<caching_allocator<>> b(1 * MiB);
  void* keep = b.allocate(1000, 256, memory_tag::weights);
  void* cached = b.allocate(1000, 256, memory_tag::activations);
  b.deallocate(cached, 1000, 256, memory_tag::activations);
  const memory_stats before = b.stats();
  const std::size_t huge = std::numeric_limits<std::size_t>::max() / 2;
  const oom_report r = expect_oom([&] { (void)b.allocate(huge, 256, memory_tag::weights); });
  CHECK(r.requested == huge);
  CHECK(contains(r.hint, "check the size computation"));
  CHECK(!contains(r.hint, "bf16"));              // no policy advice for an impossible size
  CHECK(contains(r.message(), "no reserve can serve it"));
  CHECK(!contains(r.message(), "PiB of new reserve"));
  check_same_except_failures(before, b.stats());  // the cache was not dropped for nothing
  CHECK(b.stats().failed_allocations == before.failed_allocations + 1);
  b.deallocate(keep, 1000, 256, memory_tag::weights);
}

TEST_CASE("budget over caching_allocator: exact segment growth, release, fragmentation") {
  SUBCASE("segments count, cached segments are released before refusing") {
    budget_allocator<caching_allocator<>> b(21 * MiB);
    void* a = b.allocate(1 * MiB, 256, memory_tag::activations);
    CHECK(b.usage() == 2 * MiB);  // a 2 MiB small segment
    void* c = b.allocate(1 * MiB, 256, memory_tag::activations);
    CHECK(b.usage() == 2 * MiB);  // fits in the same segment
    b.deallocate(a, 1 * MiB, 256, memory_tag::activations);
    b.deallocate(c, 1 * MiB, 256, memory_tag::activations);
    CHECK(b.usage() == 2 * MiB);  // cached

    // 20 MiB needs a segment of its own: 2 + 20 > 21 until the cached segment goes back.
    CHECK(b.growth_for(20 * MiB, 256) == 20 * MiB);
    void* big = b.allocate(20 * MiB, 256, memory_tag::workspace);
    CHECK(b.usage() == 20 * MiB);
    CHECK(b.stats().upstream_deallocations == 1);
    b.deallocate(big, 20 * MiB, 256, memory_tag::workspace);
  }
  SUBCASE("free bytes stranded in another size class: fragmentation hint") {
    budget_allocator<caching_allocator<>> b(64 * MiB);
    void* a = b.allocate(2 * MiB, 256, memory_tag::activations);  // large pool, 20 MiB segment
    b.deallocate(a, 2 * MiB, 256, memory_tag::activations);
    void* big = b.allocate(4 * MiB, 256, memory_tag::workspace);  // same segment, 16 MiB free
    CHECK(b.usage() == 20 * MiB);
    b.set_limit(20 * MiB + 512 * KiB);

    const memory_stats before = b.stats();
    const oom_report r = expect_oom([&] { (void)b.allocate(1 * MiB, 256, memory_tag::weights); });
    CHECK(r.requested == 1 * MiB);
    CHECK(r.growth_needed == 1 * MiB);  // an exact segment, since 2 MiB would cross the limit
    CHECK(r.budget == 20 * MiB + 512 * KiB);
    CHECK(r.free_under_budget == 512 * KiB);
    CHECK(r.allocated == 4 * MiB);
    CHECK(r.reserved_unallocated == 16 * MiB);
    CHECK(r.largest_free_block == 16 * MiB);
    CHECK(r.tag_current[index_of(memory_tag::workspace)] == 4 * MiB);
    CHECK(r.tag_peak[index_of(memory_tag::activations)] == 2 * MiB);
    // 16 MiB are free in the large segment, but a small request never uses the large pool:
    // stranded bytes that would cover the shortfall, so the layout is what to change.
    CHECK(contains(r.hint, "fragmentation"));
    CHECK(contains(r.hint, "another size class"));
    CHECK(contains(r.hint, "expandable_arena"));
    CHECK(contains(r.hint, format_bytes(16 * MiB)));
    CHECK(contains(r.hint, "raise the budget to at least " + format_bytes(21 * MiB)));
    check_same_except_failures(before, b.stats());
    b.deallocate(big, 4 * MiB, 256, memory_tag::workspace);
  }
  SUBCASE("holes inside a live segment: fragmentation") {
    budget_allocator<caching_allocator<>> b(2 * MiB + 256 * KiB);
    std::vector<void*> ps;
    for (int i = 0; i < 8; ++i) ps.push_back(b.allocate(256 * KiB, 256, memory_tag::activations));
    CHECK(b.usage() == 2 * MiB);
    for (int i = 0; i < 8; i += 2) b.deallocate(ps[i], 256 * KiB, 256, memory_tag::activations);

    const oom_report r =
        expect_oom([&] { (void)b.allocate(512 * KiB, 256, memory_tag::activations); });
    CHECK(r.growth_needed == 512 * KiB);
    CHECK(r.free_under_budget == 256 * KiB);
    CHECK(r.allocated == 1 * MiB);
    CHECK(r.reserved_unallocated == 1 * MiB);
    CHECK(r.largest_free_block == 256 * KiB);
    CHECK(contains(r.hint, "fragmentation"));
    CHECK(contains(r.hint, "expandable_arena"));
    CHECK(contains(r.hint, format_bytes(2 * MiB + 512 * KiB)));
    for (int i = 1; i < 8; i += 2) b.deallocate(ps[i], 256 * KiB, 256, memory_tag::activations);
  }
}

TEST_CASE("budgets stack: the inner budget's growth is what the outer one checks") {
  budget_allocator<budget_allocator<caching_allocator<>>> outer(3 * MiB, 100 * MiB);
  void* a = outer.allocate(1 * MiB, 256, memory_tag::weights);
  CHECK(outer.usage() == 2 * MiB);
  CHECK(outer.upstream().usage() == 2 * MiB);
  CHECK_THROWS_AS((void)outer.allocate(1536 * KiB, 256, memory_tag::weights), out_of_memory);
  CHECK(outer.upstream().stats().failed_allocations == 0);  // the inner one was never asked
  CHECK(outer.stats().failed_allocations == 1);
  outer.deallocate(a, 1 * MiB, 256, memory_tag::weights);
}

TEST_CASE("synchronized budget: shared between threads, the cap holds") {
  synchronized<budget_allocator<system_allocator>> shared(64 * KiB);
  static_assert(budgeted<synchronized<budget_allocator<system_allocator>>>);
  std::atomic<int> refused{0};
  std::atomic<bool> over{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      std::vector<void*> mine;
      for (int i = 0; i < 500; ++i) {
        try {
          mine.push_back(shared.allocate(1024, 64, memory_tag::activations));
        } catch (const out_of_memory&) {
          ++refused;
        }
        if (shared.usage() > shared.limit()) over = true;
        if (mine.size() > 20) {
          for (void* p : mine) shared.deallocate(p, 1024, 64, memory_tag::activations);
          mine.clear();
        }
      }
      for (void* p : mine) shared.deallocate(p, 1024, 64, memory_tag::activations);
    });
  }
  for (auto& th : threads) th.join();
  CHECK_FALSE(over.load());
  const memory_stats s = shared.stats();
  CHECK(s.allocations + s.failed_allocations == 2000);
  CHECK(s.failed_allocations == static_cast<std::uint64_t>(refused.load()));
  CHECK(s.allocations == s.deallocations);
  CHECK(shared.usage() == 0);
  CHECK(s.peak_reserved <= 64 * KiB);
  CHECK(shared.with_lock([](auto& b) { return b.headroom(); }) == 64 * KiB);
}

TEST_CASE("budget over caching: near the limit a request gets an exact segment, not a refusal") {
  constexpr std::size_t MiB = std::size_t{1} << 20;
  // Two 9 MiB blocks fill a 20 MiB large-pool segment up to a 2 MiB tail; 4 MiB of headroom stay.
  budget_allocator<caching_allocator<system_allocator>> b(24 * MiB);
  CHECK(b.upstream().reserve_limit() == 24 * MiB);
  void* w1 = b.allocate(9 * MiB, 256, memory_tag::weights);
  void* w2 = b.allocate(9 * MiB, 256, memory_tag::weights);
  REQUIRE(b.usage() == 20 * MiB);
  // A 3 MiB request does not fit the tail; the preferred 20 MiB segment would cross the budget,
  // so the cache grows by exactly the rounded request, and growth_for says so beforehand.
  CHECK(b.growth_for(3 * MiB, 256) == 3 * MiB);
  void* a = b.allocate(3 * MiB, 256, memory_tag::activations);
  CHECK(b.usage() == 23 * MiB);
  CHECK(b.stats().failed_allocations == 0);
  // Under the new limit the exact segment no longer fits either: a clean refusal.
  b.set_external(512 * 1024);
  CHECK(b.upstream().reserve_limit() == 24 * MiB - 512 * 1024);
  CHECK(b.growth_for(3 * MiB, 256) == 3 * MiB);  // the 2 MiB tail is too small
  CHECK_THROWS_AS((void)b.allocate(3 * MiB, 256, memory_tag::activations), out_of_memory);
  CHECK(b.usage() == 23 * MiB + 512 * 1024);
  b.deallocate(a, 3 * MiB, 256, memory_tag::activations);
  b.deallocate(w2, 9 * MiB, 256, memory_tag::weights);
  b.deallocate(w1, 9 * MiB, 256, memory_tag::weights);
}
