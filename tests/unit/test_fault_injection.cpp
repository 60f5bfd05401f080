// Every upstream call of a scripted workload is made to fail in turn: the failing allocate must
// throw a clean out_of_memory, the allocator must stay consistent and keep working, and nothing
// may leak.
#include <doctest/doctest.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "membound/memory/caching_allocator.hpp"
#include "membound/memory/expandable_arena.hpp"
#include "membound/memory/fault_injection.hpp"
#include "membound/memory/host_virtual_memory.hpp"
#include "membound/memory/system_allocator.hpp"

using namespace membound;

namespace {

constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t MiB = std::size_t{1} << 20;

using caching = caching_allocator<fault_injecting<system_allocator>>;
using arena = expandable_arena<fault_injecting_vm<host_virtual_memory>>;

struct op {
  enum kind_t { alloc, free, release } kind;
  int id = 0;
  std::size_t bytes = 0;
  memory_tag tag = memory_tag::other;
};

// A training-like script: weights, a forward pass with mixed sizes, a release in the middle,
// reverse frees, and allocations big enough to need fresh segments or commits throughout.
std::vector<op> script() {
  std::vector<op> s;
  int id = 0;
  auto a = [&](std::size_t n, memory_tag t) {
    s.push_back({op::alloc, id++, n, t});
    return id - 1;
  };
  auto f = [&](int i) { s.push_back({op::free, i}); };
  const int w1 = a(3 * MiB, memory_tag::weights);
  const int w2 = a(700 * KiB, memory_tag::weights);
  const int w3 = a(12 * MiB, memory_tag::weights);
  const int o1 = a(6 * MiB, memory_tag::optimizer);
  std::vector<int> acts;
  for (std::size_t n : {300 * KiB, 2 * MiB, 5000 * std::size_t{1}, 9 * MiB, 1500 * KiB, 11 * MiB}) {
    acts.push_back(a(n, memory_tag::activations));
  }
  const int ws = a(4 * MiB + 1, memory_tag::workspace);
  f(ws);
  s.push_back({op::release});
  for (auto it = acts.rbegin(); it != acts.rend(); ++it) {
    const int g = a(2 * MiB + 3, memory_tag::gradients);
    f(*it);
    f(g);
  }
  s.push_back({op::release});
  const int late = a(25 * MiB, memory_tag::activations);
  const int tiny = a(100, memory_tag::other);
  f(w2);
  f(late);
  std::vector<int> ramp;  // enough to need several more segments / commits
  for (int i = 0; i < 10; ++i) {
    ramp.push_back(a(i % 2 == 0 ? 7 * MiB : 900 * KiB, memory_tag::activations));
  }
  for (std::size_t i = 0; i < ramp.size(); i += 2) f(ramp[i]);
  s.push_back({op::release});
  for (std::size_t i = 1; i < ramp.size(); i += 2) f(ramp[i]);
  (void)w1, (void)w3, (void)o1, (void)tiny;  // stay live until the end
  return s;
}

struct tally {
  std::size_t requested = 0, live = 0;
  std::array<std::size_t, memory_tag_count> by_tag{};
  std::uint64_t failures = 0;

  void check(const memory_stats& s) const {
    REQUIRE(s.requested == requested);
    for (memory_tag t : all_memory_tags) REQUIRE(s.tag(t).current == by_tag[index_of(t)]);
    REQUIRE(s.allocations - s.deallocations == live);
    REQUIRE(s.failed_allocations == failures);
    REQUIRE(s.allocated >= s.requested);
    REQUIRE(s.reserved >= s.allocated);
  }
};

struct result {
  std::uint64_t script_calls = 0;  // upstream (or commit) calls the script made
  int thrown = 0;
};

// Writes both ends of a block: enough for ASan or a fault to catch a bad pointer, and cheap.
void touch(void* p, std::size_t n, int value) {
  const std::size_t k = n < 4096 ? n : 4096;
  std::memset(p, value, k);
  std::memset(static_cast<char*>(p) + n - k, value, k);
}

// Runs the script; `after_throw` may clear the injection plan. Frees of blocks whose allocation
// failed are skipped.
template <typename A, typename Injector, typename AfterThrow>
result run(A& a, Injector& inj, const char* source, AfterThrow after_throw) {
  const std::vector<op> ops = script();
  std::vector<void*> ptr(ops.size(), nullptr);
  std::vector<std::size_t> bytes(ops.size());
  std::vector<memory_tag> tags(ops.size());
  tally t;
  result r;
  for (const op& o : ops) {
    switch (o.kind) {
      case op::alloc: {
        bytes[o.id] = o.bytes;
        tags[o.id] = o.tag;
        try {
          ptr[o.id] = a.allocate(o.bytes, 256, o.tag);
          touch(ptr[o.id], o.bytes, o.id);
          t.requested += o.bytes;
          t.by_tag[index_of(o.tag)] += o.bytes;
          ++t.live;
        } catch (const out_of_memory& e) {
          ++r.thrown;
          ++t.failures;
          CHECK(e.report().source == source);
          CHECK(e.report().detail.rfind("injected failure on call ", 0) == 0);
          CHECK(e.report().allocated == a.stats().allocated);
          after_throw();
        }
        break;
      }
      case op::free:
        if (ptr[o.id] != nullptr) {
          a.deallocate(ptr[o.id], bytes[o.id], 256, tags[o.id]);
          ptr[o.id] = nullptr;
          t.requested -= bytes[o.id];
          t.by_tag[index_of(tags[o.id])] -= bytes[o.id];
          --t.live;
        }
        break;
      case op::release:
        a.release_cached();
        break;
    }
    t.check(a.stats());
    REQUIRE(a.check_invariants());
  }
  r.script_calls = inj.calls();
  // Later allocations still succeed.
  inj.clear();
  void* extra = a.allocate(30 * MiB, 512, memory_tag::other);
  touch(extra, 30 * MiB, 1);
  a.deallocate(extra, 30 * MiB, 512, memory_tag::other);
  // Free everything that is still live; nothing may stay behind.
  for (std::size_t i = 0; i < ptr.size(); ++i) {
    if (ptr[i] != nullptr) a.deallocate(ptr[i], bytes[i], 256, tags[i]);
  }
  a.release_cached();
  CHECK(a.stats().reserved == 0);
  CHECK(a.stats().requested == 0);
  return r;
}

}  // namespace

TEST_CASE("fault_injecting: counts calls, fails the chosen ones, forwards the rest") {
  fault_injecting<system_allocator> f;
  static_assert(check_allocator<fault_injecting<system_allocator>>());
  static_assert(reports_growth<fault_injecting<system_allocator>>);
  static_assert(!caching_allocator_like<fault_injecting<system_allocator>>);
  static_assert(caching_allocator_like<fault_injecting<caching_allocator<>>>);
  f.fail_on({2, 4});
  void* p = f.allocate(100, 64, memory_tag::weights);
  CHECK_THROWS_AS((void)f.allocate(100, 64, memory_tag::weights), out_of_memory);
  void* q = f.allocate(100, 64, memory_tag::weights);
  try {
    (void)f.allocate(5000, 64, memory_tag::gradients);
    FAIL("expected out_of_memory");
  } catch (const out_of_memory& e) {
    CHECK(e.report().source == "fault_injection");
    CHECK(e.report().detail == "injected failure on call 4");
    CHECK(e.report().requested == 5000);
    CHECK(e.report().tag_current[index_of(memory_tag::weights)] == 200);
  }
  CHECK(f.calls() == 4);
  CHECK(f.failures() == 2);
  CHECK(f.stats().failed_allocations == 2);
  CHECK(f.stats().reserved == 200);  // injected failures never reached the upstream
  f.fail_all_from(6);
  void* r = f.allocate(1, 64, memory_tag::other);  // call 5
  CHECK_THROWS_AS((void)f.allocate(1, 64, memory_tag::other), out_of_memory);
  CHECK_THROWS_AS((void)f.allocate(1, 64, memory_tag::other), out_of_memory);
  f.clear();
  void* s = f.allocate(1, 64, memory_tag::other);
  CHECK(f.calls() == 8);
  for (void* x : {p, q}) f.deallocate(x, 100, 64, memory_tag::weights);
  for (void* x : {r, s}) f.deallocate(x, 1, 64, memory_tag::other);
  CHECK(f.stats().reserved == 0);

  try {
    f.fail_on({3, 0});
    FAIL("expected invalid_argument");
  } catch (const invalid_argument& e) {
    CHECK(e.argument() == "call_indices");
  }
  try {
    f.fail_all_from(0);
    FAIL("expected invalid_argument");
  } catch (const invalid_argument& e) {
    CHECK(e.argument() == "k");
  }
}

TEST_CASE("fault_injecting_vm: fails the chosen commits and tracks committed bytes") {
  fault_injecting_vm<host_virtual_memory> vm(std::size_t{64} << 10);
  CHECK(vm.granularity() == 64 * KiB);
  void* base = vm.reserve(MiB);
  vm.fail_on({2});
  vm.commit(base, 64 * KiB);
  try {
    vm.commit(static_cast<char*>(base) + 64 * KiB, 128 * KiB);
    FAIL("expected out_of_memory");
  } catch (const out_of_memory& e) {
    CHECK(e.report().source == "fault_injection");
    CHECK(e.report().detail == "injected failure on call 2");
    CHECK(e.report().requested == 128 * KiB);
  }
  CHECK(vm.committed_bytes() == 64 * KiB);
  vm.commit(static_cast<char*>(base) + 64 * KiB, 128 * KiB);
  CHECK(vm.calls() == 3);
  CHECK(vm.failures() == 1);
  vm.decommit(base, 192 * KiB);
  CHECK(vm.committed_bytes() == 0);
  vm.release(base, MiB);
}

TEST_CASE("fault injection sweep: caching_allocator survives every failing upstream call") {
  std::uint64_t calls = 0;
  {
    caching a;
    calls = run(a, a.upstream(), "caching_allocator", [] {}).script_calls;
    CHECK(a.upstream().stats().reserved == 0);
  }
  INFO("upstream calls in the script: ", calls);
  REQUIRE(calls >= 6);
  for (std::uint64_t k = 1; k <= calls; ++k) {
    CAPTURE(k);
    {
      // One failure: the release-and-retry absorbs it, nothing is thrown.
      caching a;
      a.upstream().fail_on({k});
      const result r = run(a, a.upstream(), "caching_allocator", [] {});
      CHECK(r.thrown == 0);
      CHECK(a.upstream().failures() == 1);
      CHECK(a.upstream().stats().reserved == 0);
    }
    {
      // Call k and every later one fail until the allocate has thrown: the retry fails too.
      caching a;
      a.upstream().fail_all_from(k);
      const result r = run(a, a.upstream(), "caching_allocator", [&] { a.upstream().clear(); });
      CHECK(r.thrown == 1);
      CHECK(a.upstream().failures() == 2);
      CHECK(a.upstream().stats().reserved == 0);
      CHECK(a.upstream().stats().upstream_allocations == a.upstream().stats().upstream_deallocations);
    }
  }
}

TEST_CASE("fault injection sweep: expandable_arena survives every failing commit") {
  const expandable_arena_options opts{std::size_t{1} << 30};
  std::uint64_t calls = 0;
  {
    arena a(opts);
    calls = run(a, a.vm(), "expandable_arena", [] {}).script_calls;
    CHECK(a.vm().committed_bytes() == 0);
  }
  INFO("commits in the script: ", calls);
  REQUIRE(calls >= 8);
  for (std::uint64_t k = 1; k <= calls; ++k) {
    CAPTURE(k);
    arena a(opts);
    a.vm().fail_on({k});
    const result r = run(a, a.vm(), "expandable_arena", [] {});
    CHECK(r.thrown == 1);
    CHECK(a.vm().committed_bytes() == 0);
    CHECK(a.committed() == 0);
  }
}
