// Memory layouts and the caching allocator's planned mode:
//   - make_layout never places two blocks that are alive at the same time on the same bytes, its
//     extent is at least the most bytes alive at once and, on random chain-shaped and random
//     lifetimes, close to it; malformed sequences are refused by name;
//   - the planned mode serves a sequence that follows the layout from two exact-size segments
//     (reserve = the extents), and a sequence that strays (other sizes, other order, an abandoned
//     step) from the ordinary path without ever sharing bytes: every block is filled with its own
//     pattern and checked before it is freed;
//   - set_layout is refused while the cycle is live, for another prefix once it exists, and
//     without caching_options::planned, each time with nothing changed.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "membound/memory/caching_allocator.hpp"
#include "membound/memory/planned_layout.hpp"
#include "membound/memory/system_allocator.hpp"

#include "../support/test_rng.hpp"

namespace mb = membound;

namespace {

using membound_test::rng;

// A random sequence in which every block is freed again: `live` blocks at most at once.
std::vector<mb::recorded_request> random_cycle(rng& r, std::size_t n, std::size_t max_live, std::size_t max_bytes) {
  std::vector<mb::recorded_request> q;
  std::vector<mb::recorded_request> live;
  std::uint32_t id = 0;
  for (std::size_t k = 0; k < n; ++k) {
    if (!live.empty() && (live.size() >= max_live || r.below(2) == 0)) {
      const std::size_t i = r.below(live.size());
      mb::recorded_request f = live[i];
      f.free = true;
      q.push_back(f);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      mb::recorded_request a{id++, false, 1 + r.below(max_bytes), static_cast<mb::memory_tag>(r.below(3))};
      q.push_back(a);
      live.push_back(a);
    }
  }
  for (auto& f : live) {
    f.free = true;
    q.push_back(f);
  }
  return q;
}

void check_layout(const std::vector<mb::recorded_request>& cycle, const mb::memory_layout& l) {
  // Lifetimes back from the sequence, then every pair alive together is disjoint in space.
  struct span_ {
    std::size_t from, to, offset, size;
  };
  std::vector<span_> s;
  std::vector<std::size_t> of(cycle.size() + 1, SIZE_MAX);
  for (std::size_t k = 0; k < cycle.size(); ++k) {
    if (!cycle[k].free) {
      const mb::planned_slot& slot = l.cycle[s.size()];
      CHECK(slot.bytes == cycle[k].bytes);
      CHECK(slot.offset % mb::memory_layout::slot_alignment == 0);
      of[cycle[k].id] = s.size();
      s.push_back({k, 0, slot.offset, mb::align_up(slot.bytes, 512)});
    } else {
      s[of[cycle[k].id]].to = k;
    }
  }
  for (std::size_t i = 0; i < s.size(); ++i) {
    CHECK(s[i].offset + s[i].size <= l.cycle_extent);
    for (std::size_t j = i + 1; j < s.size(); ++j) {
      const bool together = s[i].from < s[j].to && s[j].from < s[i].to;
      const bool share = s[i].offset < s[j].offset + s[j].size && s[j].offset < s[i].offset + s[i].size;
      if (together && share) FAIL_CHECK("blocks " << i << " and " << j << " share bytes while both live");
    }
  }
  CHECK(l.cycle_extent >= l.cycle_live_peak);
}

}  // namespace

TEST_CASE("layout: no two blocks alive together share bytes; the extent is near the live peak") {
  rng r{7};
  double worst = 1.0;
  for (int t = 0; t < 200; ++t) {
    const auto cycle = random_cycle(r, 20 + r.below(200), 2 + r.below(30), 1 + r.below(1 << 20));
    const mb::memory_layout l = mb::make_layout({}, cycle);
    check_layout(cycle, l);
    worst = std::max(worst, static_cast<double>(l.cycle_extent) / static_cast<double>(l.cycle_live_peak));
  }
  // Random lifetimes are the hard case for any placement; a training step's chain is gentler
  // (test_reserve_plan measures those: within 3%).
  MESSAGE("random lifetimes: worst extent / live peak " << worst);
  CHECK(worst < 1.6);
}

TEST_CASE("layout: the prefix is packed in order, and malformed sequences are refused by name") {
  const std::vector<mb::recorded_request> prefix{{0, false, 1000, mb::memory_tag::weights},
                                                 {1, false, 512, mb::memory_tag::gradients}};
  const mb::memory_layout l = mb::make_layout(prefix, {});
  REQUIRE(l.prefix.size() == 2);
  CHECK(l.prefix[0].offset == 0);
  CHECK(l.prefix[1].offset == 1024);
  CHECK(l.prefix_extent == 1536);
  auto refused = [](std::vector<mb::recorded_request> p, std::vector<mb::recorded_request> c, const char* arg) {
    try {
      (void)mb::make_layout(p, c);
      FAIL_CHECK("accepted");
    } catch (const mb::invalid_argument& e) {
      CHECK(e.argument().find(arg) != std::string::npos);
    }
  };
  refused({{0, true, 8, mb::memory_tag::weights}}, {}, "prefix[0]");
  refused({}, {{0, false, 8, mb::memory_tag::other}}, "cycle");                                  // never freed
  refused({}, {{0, true, 8, mb::memory_tag::other}}, "cycle[0]");                                // freed, never made
  refused({}, {{0, false, 8, mb::memory_tag::other}, {0, false, 8, mb::memory_tag::other}}, "cycle[1]");  // twice
  refused({}, {{0, false, SIZE_MAX, mb::memory_tag::other}, {0, true, SIZE_MAX, mb::memory_tag::other}},
          "request bytes");
}

namespace {

// Runs `q` on a, filling each block with a pattern of its id and checking it before the free.
template <typename A>
void run_checked(A& a, const std::vector<mb::recorded_request>& q, std::vector<void*>& ptr) {
  for (const auto& r : q) {
    if (r.id >= ptr.size()) ptr.resize(r.id + 1, nullptr);
    const auto pattern = static_cast<unsigned char>(r.id * 37 + 11);
    if (!r.free) {
      ptr[r.id] = a.allocate(r.bytes, mb::default_alignment, r.tag);
      REQUIRE(reinterpret_cast<std::uintptr_t>(ptr[r.id]) % mb::default_alignment == 0);
      std::memset(ptr[r.id], pattern, r.bytes);
    } else {
      const auto* p = static_cast<const unsigned char*>(ptr[r.id]);
      const bool intact = std::all_of(p, p + r.bytes, [&](unsigned char c) { return c == pattern; });
      CHECK(intact);
      a.deallocate(ptr[r.id], r.bytes, mb::default_alignment, r.tag);
      ptr[r.id] = nullptr;
    }
  }
}

mb::caching_allocator<mb::system_allocator> planned_cache() {
  mb::caching_options o;
  o.planned = true;
  return mb::caching_allocator<mb::system_allocator>(o);
}

}  // namespace

TEST_CASE("planned mode: a sequence that follows the layout takes exactly the layout's extents") {
  rng r{11};
  for (int t = 0; t < 40; ++t) {
    const std::vector<mb::recorded_request> prefix{{1000, false, 3000 + r.below(100000), mb::memory_tag::weights},
                                                   {1001, false, 5000, mb::memory_tag::optimizer}};
    const auto cycle = random_cycle(r, 50 + r.below(100), 2 + r.below(10), 1 + r.below(300000));
    const mb::memory_layout l = mb::make_layout(prefix, cycle);
    auto a = planned_cache();
    a.set_layout(l);
    std::vector<void*> ptr;
    run_checked(a, prefix, ptr);
    for (int step = 0; step < 3; ++step) run_checked(a, cycle, ptr);
    const std::size_t hits = a.planned_hits();
    CHECK(hits == prefix.size() + 3 * l.cycle.size());
    CHECK(a.stats().peak_reserved == l.prefix_extent + l.cycle_extent);
    CHECK(a.stats().upstream_allocations == 2);
    for (const auto& p : prefix) a.deallocate(ptr[p.id], p.bytes, mb::default_alignment, p.tag);
    a.release_cached();
    CHECK(a.stats().reserved == 0);
  }
}

// A step of R identical micro-batches, then a rest (an evaluation): one micro-batch's layout
// serves all R (memory_layout::repeats), so the layout's size does not grow with R, and the
// sequence, replayed in full and checked block by block, is served from it alone: every request a
// hit, the reserve the two extents, no bytes shared.
TEST_CASE("planned mode: one micro-batch's slots serve every identical one, then the rest") {
  rng r{17};
  for (int t = 0; t < 30; ++t) {
    const std::vector<mb::recorded_request> prefix{{5000, false, 3000 + r.below(100000), mb::memory_tag::weights}};
    const auto span = random_cycle(r, 20 + r.below(60), 2 + r.below(8), 1 + r.below(200000));
    auto rest = random_cycle(r, 10 + r.below(30), 2 + r.below(6), 1 + r.below(200000));
    for (auto& q : rest) q.id += 2000;  // the rest's ids follow the span's, as the recorder numbers them
    const std::size_t R = 1 + r.below(40);
    CAPTURE(R);
    const mb::memory_layout l = mb::make_layout(prefix, span, R, rest);
    const mb::memory_layout one = mb::make_layout({}, span), alone = mb::make_layout({}, rest);
    CHECK(l.repeats == R);
    CHECK(l.repeat_slots == one.cycle.size());
    CHECK(l.cycle.size() == one.cycle.size() + alone.cycle.size());
    CHECK(l.cycle_extent == std::max(one.cycle_extent, alone.cycle_extent));
    CHECK(mb::make_layout(prefix, span, R + 1000, rest).cycle == l.cycle);  // independent of R
    auto a = planned_cache();
    a.set_layout(l);
    std::vector<void*> ptr;
    run_checked(a, prefix, ptr);
    std::size_t requests = prefix.size();
    for (int step = 0; step < 2; ++step) {
      for (std::size_t k = 0; k < R; ++k) run_checked(a, span, ptr);
      run_checked(a, rest, ptr);
      requests += R * one.cycle.size() + alone.cycle.size();
    }
    CHECK(a.planned_hits() == requests);
    CHECK(a.stats().peak_reserved == l.prefix_extent + l.cycle_extent);
    CHECK(a.stats().upstream_allocations == 2);
    // A step abandoned inside the repeats, then retried: the trainer sets the layout again (its
    // retry adopts a plan), and the whole step is served from the layout. (Without that, a
    // layout cannot tell a new step's first micro-batch from the next copy: sizes alone decide.)
    for (std::size_t k = 0; k < (R + 1) / 2; ++k) run_checked(a, span, ptr);
    a.set_layout(l);
    const std::size_t before = a.planned_hits();
    for (std::size_t k = 0; k < R; ++k) run_checked(a, span, ptr);
    run_checked(a, rest, ptr);
    CHECK(a.planned_hits() - before == R * one.cycle.size() + alone.cycle.size());
    CHECK(a.check_invariants());
    for (const auto& p : prefix) a.deallocate(ptr[p.id], p.bytes, mb::default_alignment, p.tag);
    CHECK(a.stats().requested == 0);
  }
}

TEST_CASE("planned mode: requests that stray from the layout never share bytes") {
  rng r{13};
  std::size_t strayed = 0, served = 0;
  for (int t = 0; t < 60; ++t) {
    const auto cycle = random_cycle(r, 40 + r.below(80), 2 + r.below(8), 1 + r.below(200000));
    auto a = planned_cache();
    a.set_layout(mb::make_layout({}, cycle));
    std::vector<void*> ptr;
    run_checked(a, cycle, ptr);
    // Another sequence of the same sizes in another order, one with other sizes, and the layout's
    // own sequence cut short (an abandoned step: everything freed early, in reverse).
    auto shuffled = random_cycle(r, 40 + r.below(80), 2 + r.below(8), 1 + r.below(200000));
    run_checked(a, shuffled, ptr);
    std::vector<mb::recorded_request> cut(cycle.begin(), cycle.begin() + static_cast<std::ptrdiff_t>(cycle.size() / 2));
    std::vector<mb::recorded_request> live;
    for (const auto& q : cut) {
      if (!q.free) live.push_back(q);
      else std::erase_if(live, [&](const auto& x) { return x.id == q.id; });
    }
    for (auto it = live.rbegin(); it != live.rend(); ++it) cut.push_back({it->id, true, it->bytes, it->tag});
    run_checked(a, cut, ptr);
    run_checked(a, cycle, ptr);  // and the step again, from the layout
    std::size_t allocations = 0;
    for (const std::vector<mb::recorded_request>* seq : {&cycle, static_cast<const std::vector<mb::recorded_request>*>(&shuffled), static_cast<const std::vector<mb::recorded_request>*>(&cut), &cycle})
      for (const auto& q : *seq) allocations += q.free ? 0 : 1;
    strayed += allocations - a.planned_hits();
    served += allocations;
    CHECK(a.check_invariants());
    CHECK(a.stats().requested == 0);
  }
  MESSAGE(strayed << " of " << served << " requests strayed from their layouts (the ordinary path)");
  CHECK(strayed > 0);
}

TEST_CASE("planned mode: set_layout is refused while the cycle is live, for a new prefix, and when not planned") {
  const std::vector<mb::recorded_request> prefix{{100, false, 4096, mb::memory_tag::weights}};
  const std::vector<mb::recorded_request> cycle{{0, false, 1024, mb::memory_tag::activations},
                                                {0, true, 1024, mb::memory_tag::activations}};
  const mb::memory_layout l = mb::make_layout(prefix, cycle);
  auto a = planned_cache();
  a.set_layout(l);
  void* w = a.allocate(4096, mb::default_alignment, mb::memory_tag::weights);
  void* x = a.allocate(1024, mb::default_alignment, mb::memory_tag::activations);
  CHECK(a.planned_hits() == 2);
  CHECK_THROWS_AS(a.set_layout(l), mb::invalid_argument);  // the cycle is live
  a.deallocate(x, 1024, mb::default_alignment, mb::memory_tag::activations);
  const std::vector<mb::recorded_request> prefix2{{100, false, 8192, mb::memory_tag::weights}};
  mb::memory_layout other = mb::make_layout(prefix2, cycle);
  CHECK_THROWS_AS(a.set_layout(other), mb::invalid_argument);  // the prefix exists
  CHECK(*a.layout() == l);
  // A wrong size or tag on a planned block is refused and the block stays live.
  CHECK_THROWS_AS(a.deallocate(w, 4095, mb::default_alignment, mb::memory_tag::weights), mb::invalid_argument);
  CHECK_THROWS_AS(a.deallocate(w, 4096, mb::default_alignment, mb::memory_tag::gradients), mb::invalid_argument);
  a.deallocate(w, 4096, mb::default_alignment, mb::memory_tag::weights);
  a.set_layout(other);  // the prefix was given back: a new one may be laid out
  mb::caching_allocator<mb::system_allocator> plain;
  CHECK_THROWS_AS(plain.set_layout(l), mb::invalid_argument);
  CHECK(plain.layout() == nullptr);
  // A hand-made layout whose repeated span or tail passes the cycle's end, or with no repeat, is
  // refused by the field's name and the layout in use stays.
  for (const char* field : {"layout.repeat_slots", "layout.tail_slots", "layout.repeats"}) {
    mb::memory_layout bad = other;
    if (std::string(field) == "layout.repeat_slots") bad.repeat_slots = bad.cycle.size() + 1;
    if (std::string(field) == "layout.tail_slots") bad.tail_slots = bad.cycle.size() + 1;
    if (std::string(field) == "layout.repeats") bad.repeats = 0;
    try {
      a.set_layout(bad);
      FAIL("set_layout took a bad ", field);
    } catch (const mb::invalid_argument& e) {
      CHECK(std::string(e.argument()) == field);
    }
    CHECK(*a.layout() == other);
  }
  // restart_tail points the cursor at the tail: a cycle of a 1024-byte block, then a 2048-byte
  // one (the tail) serves the tail again and again; without it the second would wrap to the
  // cycle's start, which it does not follow, and stray.
  const std::vector<mb::recorded_request> two{{0, false, 1024, mb::memory_tag::activations},
                                              {0, true, 1024, mb::memory_tag::activations},
                                              {1, false, 2048, mb::memory_tag::workspace},
                                              {1, true, 2048, mb::memory_tag::workspace}};
  mb::memory_layout tail = mb::make_layout(prefix2, two);
  tail.tail_slots = 1;
  for (const bool restart : {true, false}) {
    a.set_layout(tail);
    a.restart_cycle();
    void* x0 = a.allocate(1024, mb::default_alignment, mb::memory_tag::activations);
    a.deallocate(x0, 1024, mb::default_alignment, mb::memory_tag::activations);
    const std::size_t hits = a.planned_hits();
    for (int k = 0; k < 3; ++k) {
      if (restart) a.restart_tail();
      void* t = a.allocate(2048, mb::default_alignment, mb::memory_tag::workspace);
      a.deallocate(t, 2048, mb::default_alignment, mb::memory_tag::workspace);
    }
    CHECK(a.planned_hits() == hits + (restart ? 3 : 1));
  }
}
