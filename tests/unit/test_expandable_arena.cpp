#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "membound/memory/expandable_arena.hpp"
#include "membound/memory/fault_injection.hpp"
#include "membound/memory/host_virtual_memory.hpp"

using namespace membound;

namespace {

constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;

std::uintptr_t addr(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

template <typename F>
std::string argument_of(F&& call) {
  try {
    call();
  } catch (const invalid_argument& e) {
    return e.argument();
  }
  return "";
}

// A virtual-memory backend with no memory behind it: proves the arena never touches block memory,
// as it must not for device backends.
class fake_device_vm {
 public:
  static constexpr memory_space space = memory_space::device;
  std::size_t granularity() const { return 2 * MiB; }
  void* reserve(std::size_t) { return reinterpret_cast<void*>(std::uintptr_t{1} << 44); }
  void commit(void*, std::size_t bytes) { committed += bytes; }
  void decommit(void*, std::size_t bytes) noexcept { committed -= bytes; }
  void release(void*, std::size_t) noexcept {}
  std::size_t committed = 0;
};

using arena = expandable_arena<host_virtual_memory>;
using faulty_arena = expandable_arena<fault_injecting_vm<host_virtual_memory>>;

}  // namespace

static_assert(check_virtual_memory<host_virtual_memory>());
static_assert(check_virtual_memory<fault_injecting_vm<host_virtual_memory>>());
static_assert(check_allocator<arena>());
static_assert(caching_allocator_like<arena> && reports_growth<arena>);
static_assert(expandable_arena<fake_device_vm>::space == memory_space::device);

TEST_CASE("host_virtual_memory: reserve is granularity-aligned, commit makes it writable") {
  host_virtual_memory vm;
  CHECK(vm.granularity() == 2 * MiB);
  void* p = vm.reserve(8 * MiB);
  CHECK(addr(p) % (2 * MiB) == 0);
  vm.commit(p, 4 * MiB);
  std::memset(p, 0x5A, 4 * MiB);
  CHECK(static_cast<unsigned char*>(p)[4 * MiB - 1] == 0x5A);
  vm.decommit(static_cast<char*>(p) + 2 * MiB, 2 * MiB);
  vm.commit(static_cast<char*>(p) + 2 * MiB, 2 * MiB);
  CHECK(static_cast<unsigned char*>(p)[2 * MiB] == 0);  // decommitted pages come back zeroed
  CHECK(static_cast<unsigned char*>(p)[0] == 0x5A);     // the rest is untouched
  vm.decommit(p, 4 * MiB);
  vm.release(p, 8 * MiB);
}

TEST_CASE("host_virtual_memory: bad arguments are named, exhaustion is out_of_memory") {
  CHECK(argument_of([] { host_virtual_memory vm(3 * MiB); }) == "granularity");
  CHECK(argument_of([] { host_virtual_memory vm(512); }) == "granularity");  // below a page
  host_virtual_memory vm(64 * KiB);
  CHECK(vm.granularity() == 64 * KiB);
  CHECK(argument_of([&] { (void)vm.reserve(0); }) == "bytes");
  CHECK(argument_of([&] { (void)vm.reserve(100 * KiB); }) == "bytes");
  void* p = vm.reserve(256 * KiB);
  CHECK(argument_of([&] { vm.commit(static_cast<char*>(p) + 4096, 64 * KiB); }) == "p");
  CHECK(argument_of([&] { vm.commit(p, 1000); }) == "bytes");
  vm.release(p, 256 * KiB);
  try {
    (void)vm.reserve(std::size_t{1} << 62);  // more address space than any machine has
    FAIL("expected out_of_memory");
  } catch (const out_of_memory& e) {
    CHECK(e.report().source == "host_virtual_memory");
    CHECK(e.report().requested == std::size_t{1} << 62);
    CHECK(e.report().detail.find("mmap") != std::string::npos);
  }
}

TEST_CASE("expandable_arena: options and backend granularity are validated") {
  CHECK(argument_of([] { arena a(expandable_arena_options{3 * MiB}); }) ==
        "expandable_arena_options::capacity");
  CHECK(argument_of([] { arena a(expandable_arena_options{0}); }) ==
        "expandable_arena_options::capacity");
  CHECK(argument_of([] { arena a(expandable_arena_options{GiB}, std::size_t{100}); }) ==
        "granularity");
  arena a(expandable_arena_options{3 * 64 * KiB}, 64 * KiB);  // a granularity as constructor arg
  CHECK(a.capacity() == 192 * KiB);
  CHECK(a.granularity() == 64 * KiB);
  CHECK(a.committed() == 0);
  arena d;  // the default reserves 64 GiB of address space and commits nothing
  CHECK(d.capacity() == 64 * GiB);
  CHECK(d.stats().reserved == 0);
}

TEST_CASE("expandable_arena: blocks never move while the arena grows") {
  arena a(expandable_arena_options{GiB});
  struct live_block {
    unsigned char* p;
    std::size_t n;
  };
  std::vector<live_block> blocks;
  std::uintptr_t expected = addr(a.base());
  for (std::size_t i = 0; i < 40; ++i) {
    const std::size_t n = (i % 7 + 1) * 300 * KiB + i;
    auto* p = static_cast<unsigned char*>(a.allocate(n, 512, memory_tag::activations));
    CHECK(addr(p) == expected);  // carved in order from the start of the reservation
    expected += align_up(n, 512);
    std::memset(p, static_cast<int>(i + 1), n);
    blocks.push_back({p, n});
    for (std::size_t j = 0; j < blocks.size(); ++j) {  // earlier blocks are intact
      REQUIRE(blocks[j].p[0] == static_cast<unsigned char>(j + 1));
      REQUIRE(blocks[j].p[blocks[j].n - 1] == static_cast<unsigned char>(j + 1));
    }
  }
  CHECK(a.stats().upstream_allocations > 1);
  CHECK(a.check_invariants());
  for (auto& b : blocks) a.deallocate(b.p, b.n, 512, memory_tag::activations);
}

TEST_CASE("expandable_arena: growth is whole granules, exactly growth_for, and uses the free tail") {
  arena a(expandable_arena_options{GiB});
  const auto t = memory_tag::other;
  CHECK(a.growth_for(MiB, 256) == 2 * MiB);
  void* p = a.allocate(MiB, 256, t);
  CHECK(a.committed() == 2 * MiB);
  CHECK(a.stats().reserved == 2 * MiB);
  CHECK(a.growth_for(MiB, 256) == 0);  // the free 1 MiB tail fits
  // 3 MiB: the free 1 MiB tail plus 2 MiB of fresh granules, not 4 MiB.
  CHECK(a.growth_for(3 * MiB, 256) == 2 * MiB);
  void* q = a.allocate(3 * MiB, 256, t);
  CHECK(addr(q) == addr(p) + MiB);
  CHECK(a.committed() == 4 * MiB);
  CHECK(a.stats().upstream_allocations == 2);
  a.deallocate(p, MiB, 256, t);
  a.deallocate(q, 3 * MiB, 256, t);
  CHECK(a.stats().largest_free_block == 4 * MiB);

  std::mt19937_64 rng(7);
  struct live_block {
    void* p;
    std::size_t n, al;
  };
  std::vector<live_block> live;
  for (int i = 0; i < 1500; ++i) {
    if (!live.empty() && (live.size() > 60 || rng() % 2 == 0)) {
      const std::size_t k = rng() % live.size();
      a.deallocate(live[k].p, live[k].n, live[k].al, t);
      live[k] = live.back();
      live.pop_back();
      continue;
    }
    if (rng() % 40 == 0) a.release_cached();
    const auto n = static_cast<std::size_t>(std::exp2(std::uniform_real_distribution<double>(0, 24)(rng)));
    const std::size_t al = std::size_t{1} << (rng() % 10);
    const std::size_t predicted = a.growth_for(n, al);
    const std::size_t before = a.stats().reserved;
    void* b = a.allocate(n, al, t);
    const std::size_t grown = a.stats().reserved - before;
    REQUIRE(grown == predicted);
    REQUIRE(grown % a.granularity() == 0);
    REQUIRE(a.committed() == a.stats().reserved);
    CHECK(addr(b) % al == 0);
    live.push_back({b, n, al});
  }
  for (auto& b : live) a.deallocate(b.p, b.n, b.al, t);
  CHECK(a.check_invariants());
}

TEST_CASE("expandable_arena: release_cached decommits the free tail, memory is usable after") {
  arena a(expandable_arena_options{GiB});
  const auto t = memory_tag::workspace;
  void* small = a.allocate(MiB, 256, t);
  void* big = a.allocate(5 * MiB, 256, t);
  CHECK(a.committed() == 6 * MiB);
  a.deallocate(big, 5 * MiB, 256, t);
  a.release_cached();
  // The free tail starts at 1 MiB: the granule it starts in stays, [2 MiB, 6 MiB) goes back.
  CHECK(a.committed() == 2 * MiB);
  CHECK(a.stats().reserved == 2 * MiB);
  CHECK(a.stats().upstream_deallocations == 1);
  CHECK(a.stats().largest_free_block == MiB);
  a.release_cached();  // nothing more to give back
  CHECK(a.stats().upstream_deallocations == 1);

  CHECK(a.growth_for(4 * MiB, 256) == 4 * MiB);
  auto* again = static_cast<unsigned char*>(a.allocate(4 * MiB, 256, t));
  CHECK(again == static_cast<unsigned char*>(big));  // same address range, recommitted
  std::memset(again, 0xC3, 4 * MiB);
  CHECK(again[4 * MiB - 1] == 0xC3);
  a.deallocate(again, 4 * MiB, 256, t);
  a.deallocate(small, MiB, 256, t);
  a.release_cached();
  CHECK(a.committed() == 0);
  CHECK(a.stats().reserved == 0);
  CHECK(a.stats().largest_free_block == 0);
  CHECK(a.check_invariants());
}

TEST_CASE("expandable_arena: exceeding the capacity is out_of_memory with fields, state unchanged") {
  arena a(expandable_arena_options{8 * MiB});
  const auto t = memory_tag::weights;
  void* p = a.allocate(6 * MiB, 256, t);
  const auto before = a.stats();
  try {
    (void)a.allocate(3 * MiB, 256, memory_tag::gradients);
    FAIL("expected out_of_memory");
  } catch (const out_of_memory& e) {
    const oom_report& r = e.report();
    CHECK(r.source == "expandable_arena");
    CHECK(r.requested == 3 * MiB);
    CHECK(r.growth_needed == 4 * MiB);
    CHECK(r.budget == 8 * MiB);
    CHECK(r.free_under_budget == 2 * MiB);
    CHECK(r.allocated == 6 * MiB);
    CHECK(r.reserved_unallocated == 0);
    CHECK(r.tag_current[index_of(t)] == 6 * MiB);
    CHECK(r.hint.find("capacity") != std::string::npos);
  }
  try {
    (void)a.allocate(9 * MiB, 256, t);  // more than the whole reservation
    FAIL("expected out_of_memory");
  } catch (const out_of_memory& e) {
    CHECK(e.report().requested == 9 * MiB);
    CHECK(e.report().budget == 8 * MiB);
  }
  auto after = a.stats();
  CHECK(after.failed_allocations == before.failed_allocations + 2);
  after.failed_allocations = before.failed_allocations;
  CHECK((after == before));
  CHECK(a.committed() == 6 * MiB);
  void* q = a.allocate(2 * MiB, 256, t);  // exactly what is left still works
  CHECK(a.committed() == 8 * MiB);
  a.deallocate(q, 2 * MiB, 256, t);
  a.deallocate(p, 6 * MiB, 256, t);
  CHECK(a.check_invariants());
}

TEST_CASE("expandable_arena: a failed commit is out_of_memory from the arena, state unchanged") {
  faulty_arena a(expandable_arena_options{GiB});
  void* p = a.allocate(MiB, 256, memory_tag::other);  // commit 1
  a.vm().fail_on({2});
  const auto before = a.stats();
  try {
    (void)a.allocate(5 * MiB, 256, memory_tag::activations);
    FAIL("expected out_of_memory");
  } catch (const out_of_memory& e) {
    CHECK(e.report().source == "expandable_arena");
    CHECK(e.report().detail == "injected failure on call 2");
    CHECK(e.report().requested == 5 * MiB);
    CHECK(e.report().growth_needed == 4 * MiB);
    CHECK(e.report().allocated == MiB);
  }
  CHECK(a.stats().failed_allocations == before.failed_allocations + 1);
  CHECK(a.stats().reserved == before.reserved);
  CHECK(a.stats().allocations == before.allocations);
  CHECK(a.vm().committed_bytes() == 2 * MiB);
  void* q = a.allocate(5 * MiB, 256, memory_tag::activations);  // commit 3 succeeds
  CHECK(a.committed() == 6 * MiB);
  a.deallocate(q, 5 * MiB, 256, memory_tag::activations);
  a.deallocate(p, MiB, 256, memory_tag::other);
  a.release_cached();
  CHECK(a.vm().committed_bytes() == 0);
}

TEST_CASE("expandable_arena: bad arguments are named and change nothing") {
  arena a(expandable_arena_options{GiB});
  void* p = a.allocate(1000, 256, memory_tag::weights);
  const auto before = a.stats();
  CHECK(argument_of([&] { (void)a.allocate(10, 1024, memory_tag::other); }) == "alignment");
  CHECK(argument_of([&] { (void)a.allocate(10, 256, static_cast<memory_tag>(77)); }) == "tag");
  CHECK(argument_of([&] { a.deallocate(static_cast<char*>(p) + 512, 1000, 256, memory_tag::weights); }) == "p");
  CHECK(argument_of([&] { a.deallocate(p, 1001, 256, memory_tag::weights); }) == "bytes");
  CHECK(argument_of([&] { a.deallocate(p, 1000, 512, memory_tag::weights); }) == "alignment");
  CHECK(argument_of([&] { a.deallocate(p, 1000, 256, memory_tag::other); }) == "tag");
  CHECK(a.allocate(0, 256, memory_tag::other) == nullptr);
  a.deallocate(nullptr, 0, 256, memory_tag::other);
  CHECK((a.stats() == before));
  a.deallocate(p, 1000, 256, memory_tag::weights);
  CHECK(argument_of([&] { a.deallocate(p, 1000, 256, memory_tag::weights); }) == "p");
  CHECK(a.check_invariants());
}

TEST_CASE("expandable_arena: a repeated step commits nothing after the first") {
  std::mt19937_64 rng(99);
  for (int script = 0; script < 20; ++script) {
    arena a(expandable_arena_options{GiB});
    std::vector<std::size_t> sizes(30);
    for (auto& n : sizes) n = static_cast<std::size_t>(std::exp2(std::uniform_real_distribution<double>(0, 23)(rng)));
    std::vector<std::size_t> order(sizes.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), rng);
    void* keep = a.allocate(3 * MiB, 256, memory_tag::weights);
    auto step = [&] {
      std::vector<void*> live(sizes.size(), nullptr);
      std::size_t next_free = 0;
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        live[i] = a.allocate(sizes[i], 256, memory_tag::activations);
        if (i % 3 == 2) {  // interleave some frees, in a scripted order
          while (next_free < order.size() && live[order[next_free]] == nullptr) ++next_free;
          if (next_free < order.size()) {
            const std::size_t k = order[next_free++];
            a.deallocate(live[k], sizes[k], 256, memory_tag::activations);
            live[k] = reinterpret_cast<void*>(1);  // freed marker
          }
        }
      }
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        if (live[i] != reinterpret_cast<void*>(1)) a.deallocate(live[i], sizes[i], 256, memory_tag::activations);
      }
    };
    step();
    const auto calls = a.stats().upstream_calls();
    for (int i = 0; i < 3; ++i) step();
    CHECK(a.stats().upstream_calls() == calls);
    a.deallocate(keep, 3 * MiB, 256, memory_tag::weights);
  }
}

TEST_CASE("expandable_arena: works over a device backend without touching block memory") {
  expandable_arena<fake_device_vm> a(expandable_arena_options{GiB});
  void* p = a.allocate(3 * MiB, 512, memory_tag::activations);
  void* q = a.allocate(100, 512, memory_tag::activations);
  CHECK(a.vm().committed == 4 * MiB);
  a.deallocate(p, 3 * MiB, 512, memory_tag::activations);
  a.deallocate(q, 100, 512, memory_tag::activations);
  a.release_cached();
  CHECK(a.vm().committed == 0);
}

TEST_CASE("host_virtual_memory: committing outside a reservation names p, not out of memory") {
  host_virtual_memory vm;
  const std::size_t g = vm.granularity();
  void* base = vm.reserve(4 * g);
  vm.commit(base, g);
  static_cast<char*>(base)[0] = 1;  // committed memory is writable
  char* beyond = static_cast<char*>(base) + 4 * g;
  try {
    vm.commit(beyond, g);
    FAIL("expected invalid_argument");
  } catch (const invalid_argument& e) {
    CHECK(e.argument() == "p");
  }
  CHECK_THROWS_AS(vm.commit(static_cast<char*>(base) + 3 * g, 2 * g), invalid_argument);
  vm.decommit(base, g);
  vm.release(base, 4 * g);
  CHECK_THROWS_AS(vm.commit(base, g), invalid_argument);  // released: no longer ours
}
