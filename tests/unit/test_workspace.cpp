#include <doctest/doctest.h>

#include <cstdint>
#include <cstdlib>
#include <new>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include "membound/memory/budget.hpp"
#include "membound/memory/system_allocator.hpp"
#include "membound/memory/workspace.hpp"

using namespace membound;

// Counts every plain operator new in this program, so a test can prove a region allocates nothing.
// GCC 12 at -O1 inlines std::allocator's new and this delete into one function and then reports
// the malloc/free pair behind them as mismatched new/delete (-Wmismatched-new-delete): they match,
// both replaced here.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
namespace {
std::size_t heap_allocations = 0;
}
void* operator new(std::size_t n) {
  ++heap_allocations;
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace {

// --- compile-time layouts ---------------------------------------------------------------------
constexpr workspace_layout<3> three_live_slots() {
  workspace_layout<3> l;
  l.add(1000);  // all in phase 0: nothing shares
  l.add(100);
  l.add(10);
  return l;
}
static_assert(three_live_slots().size() == 1290);  // 1000 @0, 100 @1024, 10 @1280
static_assert(three_live_slots().offset(1) == 1024);
static_assert(three_live_slots().offset(2) == 1280);
static_assert(three_live_slots().alignment() == default_alignment);

constexpr workspace_layout<3> shared_slots() {
  workspace_layout<3> l;
  l.add(1000, 256, {0, 0});
  l.add(600, 256, {1, 1});  // never live with the first: same bytes
  l.add(300, 256, {0, 1});  // live with both: after the larger one
  return l;
}
static_assert(shared_slots().size() == 1324);
static_assert(shared_slots().offset(0) == 0 && shared_slots().offset(1) == 0);
static_assert(shared_slots().offset(2) == 1024);

constexpr workspace_layout<3> unshared_slots() {
  workspace_layout<3> l;
  l.add(1000, 256, {0, 1});
  l.add(600, 256, {1, 1});
  l.add(300, 256, {0, 1});
  return l;
}
static_assert(unshared_slots().size() == 2092);

// Larger slots are placed first whatever the order they were added in.
constexpr std::size_t small_first_size() {
  workspace_layout<2> l;
  l.add(8, 8);
  l.add(4096, 4096);
  return l.size();
}
static_assert(small_first_size() == 4104);

// --- a two-phase operation, CUB/llm.c style ----------------------------------------------------
// out[i] = (x[0] + ... + x[i]) / (x[0] + ... + x[n-1]), accumulated in double.
// Phase 0 widens x, phase 1 sums, phase 2 scales: the scaled floats reuse the widened bytes.
constexpr workspace_layout<3> prefix_layout(std::size_t n) {
  workspace_layout<3> l;
  l.add(n * sizeof(double), default_alignment, {0, 1});  // widened
  l.add(n * sizeof(double), default_alignment, {1, 2});  // prefix sums
  l.add(n * sizeof(float), default_alignment, {2, 2});   // scaled
  return l;
}
static_assert(prefix_layout(100).size() == 1824);

void normalized_prefix_sum(void* workspace, std::size_t& bytes, std::span<const float> x,
                           std::span<float> out) {
  const workspace_layout<3> layout = prefix_layout(x.size());
  if (workspace == nullptr) {
    bytes = layout.size();
    return;
  }
  const auto ws = carve(layout, workspace, bytes);
  double* wide = ws.get<double>(0);
  double* sums = ws.get<double>(1);
  float* scaled = ws.get<float>(2);
  for (std::size_t i = 0; i < x.size(); ++i) wide[i] = x[i];
  double run = 0.0;
  for (std::size_t i = 0; i < x.size(); ++i) sums[i] = run += wide[i];
  for (std::size_t i = 0; i < x.size(); ++i) scaled[i] = static_cast<float>(sums[i] / run);
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = scaled[i];
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

struct aligned_buffer {
  std::size_t bytes;
  void* p;
  explicit aligned_buffer(std::size_t n) : bytes(n), p(::operator new(n, std::align_val_t{4096})) {}
  ~aligned_buffer() { ::operator delete(p, std::align_val_t{4096}); }
  std::byte* at(std::size_t off) const { return static_cast<std::byte*>(p) + off; }
};

}  // namespace

TEST_CASE("workspace: every carved pointer is aligned and inside the buffer") {
  workspace_layout<5> l;
  const std::size_t a = l.add(10, 16);
  const std::size_t b = l.add(100, 64);
  const std::size_t c = l.add(7, 256);
  const std::size_t d = l.add(1000, 4096);
  const std::size_t e = l.add(3, 1);
  CHECK(l.slots() == 5);
  CHECK(l.alignment() == 4096);

  aligned_buffer buf(l.size());
  const auto ws = carve(l, buf.p, buf.bytes);
  for (std::size_t s : {a, b, c, d, e}) {
    const auto addr = reinterpret_cast<std::uintptr_t>(ws.get<std::byte>(s));
    CHECK(addr % l.slot_alignment(s) == 0);
    CHECK(ws.get<std::byte>(s) + l.slot_bytes(s) <= buf.at(l.size()));
    CHECK(ws.get<std::byte>(s) >= buf.at(0));
  }
  CHECK(ws.get<std::uint64_t>(b) != nullptr);
  CHECK(ws.span<std::uint32_t>(b).size() == 25);
  CHECK(ws.data() == buf.p);
  CHECK(ws.size() == buf.bytes);
}

TEST_CASE("workspace: greedy placement never overlaps live slots (random layouts)") {
  std::mt19937 rng(7);
  for (int round = 0; round < 300; ++round) {
    workspace_layout<12> l;
    const std::size_t n = 1 + rng() % 12;
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t first = rng() % 5;
      l.add(rng() % 3000, std::size_t{1} << (rng() % 10), {first, first + rng() % 3});
    }
    std::size_t end = 0;
    for (std::size_t i = 0; i < n; ++i) {
      CHECK(l.offset(i) % l.slot_alignment(i) == 0);
      end = std::max(end, l.offset(i) + l.slot_bytes(i));
      for (std::size_t j = i + 1; j < n; ++j) {
        if (!l.lifetime(i).overlaps(l.lifetime(j))) continue;
        const bool disjoint = l.offset(i) + l.slot_bytes(i) <= l.offset(j) ||
                              l.offset(j) + l.slot_bytes(j) <= l.offset(i);
        REQUIRE(disjoint);
      }
    }
    CHECK(l.size() == end);
  }
}

// largest_gap against a byte map: the range it returns holds no live slot's byte, and no longer
// range of such bytes exists (random layouts, random live subsets, overlapping lifetimes too).
TEST_CASE("workspace: largest_gap is the longest run of bytes no live slot holds") {
  std::mt19937 rng(11);
  for (int round = 0; round < 300; ++round) {
    workspace_layout<10> l;
    const std::size_t n = 1 + rng() % 10;
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t first = rng() % 3;
      l.add(rng() % 4 == 0 ? 0 : rng() % 2000, std::size_t{1} << (rng() % 9), {first, first + rng() % 2});
    }
    std::vector<std::size_t> live;
    for (std::size_t i = 0; i < n; ++i) {
      if (rng() % 2 == 0) live.push_back(i);
    }
    std::vector<char> held(l.size(), 0);
    for (const std::size_t i : live) {
      for (std::size_t b = 0; b < l.slot_bytes(i); ++b) held[l.offset(i) + b] = 1;
    }
    std::size_t longest = 0, run = 0;
    for (const char h : held) {
      run = h ? 0 : run + 1;
      longest = std::max(longest, run);
    }
    const auto gap = l.largest_gap(live);
    REQUIRE(gap.bytes == longest);
    REQUIRE(gap.offset + gap.bytes <= l.size());
    for (std::size_t b = 0; b < gap.bytes; ++b) REQUIRE(held[gap.offset + b] == 0);
  }
  // In the order slots lie, not the order they were added: the second (larger) slot lies first.
  workspace_layout<3> l;
  const std::size_t small = l.add(256), large = l.add(1024), last = l.add(512);
  CHECK(l.offset(large) == 0);
  const std::size_t live[] = {small};
  const auto g = l.largest_gap(live);
  CHECK(g.offset == 0);
  CHECK(g.bytes == l.offset(small));  // the large slot's and the last one's bytes before it
  CHECK(g.bytes >= l.slot_bytes(large) + l.slot_bytes(last));
  // More live entries than the layout has slots (one listed twice): named, not an overrun.
  const std::size_t twice[] = {small, large, last, small};
  CHECK_THROWS_AS(l.largest_gap(twice), invalid_argument);
}

TEST_CASE("workspace: too small, null and misaligned buffers are typed errors") {
  const workspace_layout<3> l = shared_slots();
  aligned_buffer buf(l.size() + 256);

  try {
    (void)carve(l, buf.p, l.size() - 1);
    FAIL("expected workspace_too_small");
  } catch (const workspace_too_small& e) {
    CHECK(e.argument() == "workspace");
    CHECK(e.required() == 1324);
    CHECK(e.given() == 1323);
  }
  try {
    (void)carve(l, nullptr, 1 << 20);
    FAIL("expected workspace_too_small");
  } catch (const workspace_too_small& e) {
    CHECK(e.argument() == "workspace");
    CHECK(e.given() == 0);
  }
  try {
    (void)carve(l, buf.at(16), l.size());
    FAIL("expected invalid_argument");
  } catch (const invalid_argument& e) {
    CHECK(e.argument() == "workspace");
    CHECK(dynamic_cast<const workspace_too_small*>(&e) == nullptr);  // misaligned, not small
    CHECK(e.expected().find("256") != std::string::npos);
  }

  // An empty layout needs no buffer at all.
  const workspace_layout<1> empty;
  CHECK(empty.size() == 0);
  CHECK(carve(empty, nullptr, 0).data() == nullptr);

  // Exactly the size is enough.
  CHECK(carve(l, buf.p, l.size()).get<char>(2) == static_cast<char*>(buf.p) + 1024);
}

TEST_CASE("workspace: bad layout input is named and leaves the layout unchanged") {
  workspace_layout<2> l;
  l.add(100, 8);
  l.add(50, 1);
  const std::size_t size = l.size();
  CHECK(expect_invalid([&] { l.add(10); }).argument() == "slot");
  workspace_layout<4> m;
  m.add(64);
  CHECK(expect_invalid([&] { m.add(10, 3); }).argument() == "alignment");
  CHECK(expect_invalid([&] { m.add(10, 0); }).argument() == "alignment");
  CHECK(expect_invalid([&] { m.add(10, 8, {2, 1}); }).argument() == "lifetime");
  CHECK(expect_invalid([&] { m.add(SIZE_MAX - 4, 8); }).argument() == "bytes");
  CHECK(m.slots() == 1);
  CHECK(m.size() == 64);
  CHECK(l.size() == size);
  CHECK(expect_invalid([&] { (void)l.offset(2); }).argument() == "slot");

  aligned_buffer buf(size);
  const auto ws = carve(l, buf.p, size);
  CHECK(expect_invalid([&] { (void)ws.get<double>(1); }).argument() == "T");  // 1-aligned slot
  CHECK(expect_invalid([&] { (void)ws.get<char>(5); }).argument() == "slot");
  {
    workspace_layout<4> big;
    big.add(16, std::size_t{1} << 63);
    CHECK(expect_invalid([&] { big.add(16, std::size_t{1} << 63); }).argument() == "alignment");
    CHECK(big.slots() == 1);
  }
}

TEST_CASE("workspace: the two-phase operation queries, then runs without allocating") {
  std::vector<float> x(100), out(100);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 7 + 1);

  std::size_t bytes = 0;
  normalized_prefix_sum(nullptr, bytes, x, out);
  CHECK(bytes == 1824);
  CHECK(out[99] == 0.0f);  // the query touched nothing

  aligned_buffer buf(bytes);
  const std::size_t before = heap_allocations;
  normalized_prefix_sum(buf.p, bytes, x, out);
  const std::size_t after = heap_allocations;
  CHECK(after == before);

  double run = 0.0, total = 0.0;
  for (float v : x) total += v;
  for (std::size_t i = 0; i < x.size(); ++i) {
    run += x[i];
    CHECK(out[i] == doctest::Approx(run / total));
  }
  CHECK(out[99] == 1.0f);

  // Too small a workspace is refused before anything is written.
  std::size_t small = bytes - 1;
  CHECK_THROWS_AS(normalized_prefix_sum(buf.p, small, x, out), workspace_too_small);
}

TEST_CASE("workspace: the allocator overload takes one tagged block and gives it back") {
  budget_allocator<system_allocator> b(1 << 20);
  std::vector<float> x{1, 2, 3, 4}, out(4);
  with_workspace(b, [&](void* ws, std::size_t& bytes) {
    normalized_prefix_sum(ws, bytes, x, out);
  });
  CHECK(out[3] == 1.0f);
  CHECK(out[0] == doctest::Approx(0.1));
  const memory_stats s = b.stats();
  CHECK(s.allocations == 1);
  CHECK(s.tag(memory_tag::workspace).peak == prefix_layout(4).size());
  CHECK(s.tag(memory_tag::workspace).current == 0);
  CHECK(b.usage() == 0);

  // Over budget: the allocation throws and the operation never runs.
  budget_allocator<system_allocator> tiny(64);
  int runs = 0;
  CHECK_THROWS_AS(with_workspace(tiny,
                                 [&](void* ws, std::size_t& bytes) {
                                   if (ws != nullptr) ++runs;
                                   normalized_prefix_sum(ws, bytes, x, out);
                                 }),
                  out_of_memory);
  CHECK(runs == 0);
}

TEST_CASE("scoped_allocation: owns one block, moves, frees once") {
  system_allocator a;
  {
    scoped_allocation<system_allocator> s(a, 512, 64, memory_tag::activations);
    REQUIRE(s);
    CHECK(reinterpret_cast<std::uintptr_t>(s.get()) % 64 == 0);
    CHECK(s.size() == 512);
    CHECK(s.tag() == memory_tag::activations);
    CHECK(a.stats().tag(memory_tag::activations).current == 512);

    scoped_allocation<system_allocator> moved(std::move(s));
    CHECK_FALSE(s);  // NOLINT(bugprone-use-after-move): moved-from is empty by contract
    CHECK(moved.as<float>() != nullptr);
    CHECK(a.stats().allocations == 1);

    scoped_allocation<system_allocator> other(a, 128);  // tagged workspace by default
    CHECK(a.stats().tag(memory_tag::workspace).current == 128);
    other = std::move(moved);  // frees other's block, takes moved's
    CHECK(a.stats().tag(memory_tag::workspace).current == 0);
    CHECK(a.stats().tag(memory_tag::activations).current == 512);
    CHECK(other.size() == 512);

    scoped_allocation<system_allocator> none;
    CHECK_FALSE(none);
    none.reset();
  }
  CHECK(a.stats().requested == 0);
  CHECK(a.stats().deallocations == 2);

  // Carving from an owned block.
  const workspace_layout<3> l = shared_slots();
  scoped_allocation<system_allocator> block(a, l.size(), l.alignment());
  const auto ws = carve(l, block);
  CHECK(ws.get<char>(1) == block.as<char>());
}
