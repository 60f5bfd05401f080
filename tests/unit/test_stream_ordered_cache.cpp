// caching_allocator's stream ordering, on a fake upstream whose events complete when the test
// says so: same-stream reuse is immediate, other streams never see the block, record_stream
// defers reuse until every recorded event is done, blocks never coalesce across streams, the
// cache keeps segments with pending blocks, planned mode serves one stream, and an upstream
// without events behaves exactly as before.
#include <doctest/doctest.h>

#include <cstdint>
#include <map>
#include <optional>
#include <vector>

#include "membound/memory/budget.hpp"
#include "membound/memory/caching_allocator.hpp"
#include "membound/memory/fault_injection.hpp"
#include "membound/memory/synchronized.hpp"
#include "membound/memory/trace.hpp"
#include "membound/memory/stream.hpp"
#include "membound/memory/system_allocator.hpp"

using namespace membound;

namespace {

constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t MiB = std::size_t{1} << 20;

// Never-backed device addresses (the allocator must not touch block memory) plus events that
// stay "not done" until complete(stream) marks those recorded on that stream so far.
class fake_stream_upstream {
 public:
  static constexpr memory_space space = memory_space::device;

  void* allocate(std::size_t bytes, std::size_t alignment, memory_tag) {
    if (refuse_) {
      oom_report r;
      r.source = "fake";
      r.requested = bytes;
      throw out_of_memory(std::move(r));
    }
    next_ = align_up(next_, alignment);
    void* p = reinterpret_cast<void*>(next_);
    next_ += bytes;
    stats_.on_reserve(bytes);
    ++segments_;
    return p;
  }
  void deallocate(void*, std::size_t bytes, std::size_t, memory_tag) noexcept {
    stats_.on_release(bytes);
    --segments_;
  }
  memory_stats stats() const noexcept { return stats_.stats(); }

  event_id create_event() {
    const event_id e = ++last_event_;
    events_[e] = {host_stream, false, false};
    ++created;
    return e;
  }
  void record_event(event_id e, stream_id s) {
    events_.at(e).stream = s;
    events_.at(e).recorded = true;
  }
  bool event_done(event_id e) {
    ++queries;
    return events_.at(e).done;
  }
  void destroy_event(event_id e) {
    events_.erase(e);
    ++destroyed;
  }

  // Everything queued on `s` so far has run.
  void complete(stream_id s) {
    for (auto& [e, ev] : events_) {
      if (ev.recorded && ev.stream == s) ev.done = true;
    }
  }
  std::size_t events_recorded_on(stream_id s) const {
    std::size_t n = 0;
    for (const auto& [e, ev] : events_) n += ev.recorded && ev.stream == s ? 1 : 0;
    return n;
  }
  std::size_t live_events() const { return events_.size(); }
  std::size_t live_segments() const { return segments_; }
  void set_refuse(bool r) { refuse_ = r; }

  std::size_t created = 0, destroyed = 0, queries = 0;

 private:
  struct event {
    stream_id stream;
    bool recorded, done;
  };
  std::uintptr_t next_ = std::uintptr_t{1} << 44;
  std::map<event_id, event> events_;
  event_id last_event_ = 0;
  std::size_t segments_ = 0;
  bool refuse_ = false;
  stats_tracker stats_;
};

static_assert(stream_event_source<fake_stream_upstream>);
static_assert(!stream_event_source<system_allocator>);

constexpr stream_id stream_a = 0x1000;
constexpr stream_id stream_b = 0x2000;
constexpr stream_id stream_c = 0x3000;

using cache = caching_allocator<fake_stream_upstream>;

}  // namespace

TEST_CASE("stream-ordered cache: a freed block is reused at once on its own stream") {
  cache a;
  void* p = a.allocate(100 * KiB, 256, memory_tag::activations, stream_a);
  a.deallocate(p, 100 * KiB, 256, memory_tag::activations);
  CHECK(a.pending_blocks() == 0);
  CHECK(a.growth_for(100 * KiB, 256, stream_a) == 0);
  void* q = a.allocate(100 * KiB, 256, memory_tag::activations, stream_a);
  CHECK(q == p);
  CHECK(a.upstream().created == 0);  // no event for plain same-stream use
  a.deallocate(q, 100 * KiB, 256, memory_tag::activations);
  CHECK(a.check_invariants());
}

TEST_CASE("stream-ordered cache: another stream never gets a block of this stream") {
  cache a;
  void* p = a.allocate(100 * KiB, 256, memory_tag::other, stream_a);
  a.deallocate(p, 100 * KiB, 256, memory_tag::other);
  // The free 2 MiB small segment belongs to stream a: stream b needs a segment of its own.
  CHECK(a.growth_for(100 * KiB, 256, stream_b) == 2 * MiB);
  void* q = a.allocate(100 * KiB, 256, memory_tag::other, stream_b);
  CHECK(q != p);
  CHECK(a.stats().reserved == 4 * MiB);
  CHECK(a.upstream().live_segments() == 2);
  // And back on stream a, its own block again.
  void* r = a.allocate(100 * KiB, 256, memory_tag::other, stream_a);
  CHECK(r == p);
  a.deallocate(q, 100 * KiB, 256, memory_tag::other);
  a.deallocate(r, 100 * KiB, 256, memory_tag::other);
  CHECK(a.check_invariants());
}

TEST_CASE("stream-ordered cache: record_stream holds the block until every event is done") {
  cache a;
  fake_stream_upstream& up = a.upstream();
  void* p = a.allocate(64 * KiB, 256, memory_tag::other, stream_a);
  a.record_stream(p, stream_b);
  a.record_stream(p, stream_c);
  a.record_stream(p, stream_b);  // already recorded: no second event
  a.record_stream(p, stream_a);  // its own stream: nothing to wait for
  CHECK(up.created == 0);        // events are made at free time, not before
  a.deallocate(p, 64 * KiB, 256, memory_tag::other);
  CHECK(up.created == 2);
  CHECK(up.events_recorded_on(stream_b) == 1);
  CHECK(up.events_recorded_on(stream_c) == 1);
  CHECK(a.pending_blocks() == 1);
  CHECK(a.pending_bytes() == 64 * KiB);
  CHECK(a.stats().allocated == 0);  // the caller's bytes are gone; the block is not free yet
  CHECK(a.check_invariants());

  // Not reusable, not even on its own stream: a request there goes to what is left of the
  // segment (the block was split off its front).
  void* q = a.allocate(64 * KiB, 256, memory_tag::other, stream_a);
  CHECK(q != p);
  a.deallocate(q, 64 * KiB, 256, memory_tag::other);

  // A double free of a pending block is refused.
  CHECK_THROWS_AS(a.deallocate(p, 64 * KiB, 256, memory_tag::other), invalid_argument);
  CHECK_THROWS_AS(a.record_stream(p, stream_b), invalid_argument);

  up.complete(stream_b);
  CHECK(a.process_events() == 0);  // stream c is still running
  CHECK(a.pending_blocks() == 1);
  up.complete(stream_c);
  CHECK(a.process_events() == 1);
  CHECK(a.pending_blocks() == 0);
  CHECK(a.pending_bytes() == 0);
  CHECK(up.destroyed == 2);
  CHECK(up.live_events() == 0);
  CHECK(a.check_invariants());

  // Reusable again, on its own stream, and the segment coalesced back into one free block.
  CHECK(a.stats().largest_free_block == 2 * MiB);
  void* r = a.allocate(64 * KiB, 256, memory_tag::other, stream_a);
  CHECK(r == p);
  a.deallocate(r, 64 * KiB, 256, memory_tag::other);
  CHECK(up.created == 2);  // the mark went with the block's old life
}

TEST_CASE("stream-ordered cache: allocate polls pending blocks before growing") {
  cache a;
  fake_stream_upstream& up = a.upstream();
  // A block that fills its whole large segment, so nothing else on stream a fits.
  void* p = a.allocate(12 * MiB, 512, memory_tag::other, stream_a);
  CHECK(a.stats().reserved == 12 * MiB);
  a.record_stream(p, stream_b);
  a.deallocate(p, 12 * MiB, 512, memory_tag::other);
  CHECK(a.growth_for(12 * MiB, 512, stream_a) == 12 * MiB);  // still pending
  up.complete(stream_b);
  // The const overload does not poll (it may over-predict); the non-const one agrees with allocate.
  CHECK(std::as_const(a).growth_for(12 * MiB, 512, stream_a) == 12 * MiB);
  CHECK(a.growth_for(12 * MiB, 512, stream_a) == 0);
  CHECK(a.pending_blocks() == 0);

  a.record_stream(p = a.allocate(12 * MiB, 512, memory_tag::other, stream_a), stream_b);
  a.deallocate(p, 12 * MiB, 512, memory_tag::other);
  up.complete(stream_b);
  const std::size_t queries = up.queries;
  void* q = a.allocate(12 * MiB, 512, memory_tag::other, stream_a);  // polls, no new segment
  CHECK(up.queries > queries);
  CHECK(q == p);
  CHECK(a.stats().reserved == 12 * MiB);
  a.deallocate(q, 12 * MiB, 512, memory_tag::other);
  CHECK(a.check_invariants());
}

TEST_CASE("stream-ordered cache: blocks never coalesce across streams") {
  caching_options o;
  o.small_segment_size = 4 * KiB;
  o.small_request_limit = 4 * KiB;
  cache a(o);
  fake_stream_upstream& up = a.upstream();
  // Segments from a bump allocator are adjacent in address space; each belongs to one stream.
  void* pa = a.allocate(4 * KiB, 512, memory_tag::other, stream_a);
  void* pb = a.allocate(4 * KiB, 512, memory_tag::other, stream_b);
  CHECK(reinterpret_cast<std::uintptr_t>(pb) == reinterpret_cast<std::uintptr_t>(pa) + 4 * KiB);
  a.deallocate(pa, 4 * KiB, 512, memory_tag::other);
  a.deallocate(pb, 4 * KiB, 512, memory_tag::other);
  // Two free 4 KiB blocks, adjacent, but of different streams: no 8 KiB block anywhere.
  CHECK(a.stats().largest_free_block == 4 * KiB);
  // Within one segment, a pending block does not merge with its free neighbours until it is done.
  caching_options o2;
  cache c(o2);
  void* x = c.allocate(8 * KiB, 512, memory_tag::other, stream_a);
  void* y = c.allocate(8 * KiB, 512, memory_tag::other, stream_a);
  c.record_stream(x, stream_b);
  c.deallocate(x, 8 * KiB, 512, memory_tag::other);
  c.deallocate(y, 8 * KiB, 512, memory_tag::other);
  CHECK(c.stats().largest_free_block == 2 * MiB - 8 * KiB);
  c.upstream().complete(stream_b);
  c.process_events();
  CHECK(c.stats().largest_free_block == 2 * MiB);
  CHECK(c.check_invariants());
  CHECK(a.check_invariants());
  (void)up;
}

TEST_CASE("stream-ordered cache: release_cached keeps segments holding pending blocks") {
  cache a;
  fake_stream_upstream& up = a.upstream();
  void* p = a.allocate(100 * KiB, 256, memory_tag::other, stream_a);
  void* q = a.allocate(3 * MiB, 512, memory_tag::other, stream_a);
  a.record_stream(p, stream_b);
  a.deallocate(p, 100 * KiB, 256, memory_tag::other);
  a.deallocate(q, 3 * MiB, 512, memory_tag::other);
  CHECK(up.live_segments() == 2);
  a.release_cached();  // the large segment is fully free; the small one holds a pending block
  CHECK(up.live_segments() == 1);
  CHECK(a.stats().reserved == 2 * MiB);
  CHECK(a.pending_blocks() == 1);
  CHECK(a.check_invariants());
  up.complete(stream_b);
  a.release_cached();  // polls first: the block is done, so its segment goes too
  CHECK(a.pending_blocks() == 0);
  CHECK(up.live_segments() == 0);
  CHECK(a.stats().reserved == 0);
  CHECK(up.live_events() == 0);
}

TEST_CASE("stream-ordered cache: out of memory names the pending bytes") {
  cache a;
  fake_stream_upstream& up = a.upstream();
  void* p = a.allocate(100 * KiB, 256, memory_tag::other, stream_a);
  a.record_stream(p, stream_b);
  a.deallocate(p, 100 * KiB, 256, memory_tag::other);
  up.set_refuse(true);
  try {
    (void)a.allocate(100 * KiB, 256, memory_tag::other, stream_c);
    FAIL("expected out_of_memory");
  } catch (const out_of_memory& e) {
    CHECK(e.report().hint.find("wait for other streams") != std::string::npos);
  }
  CHECK(a.pending_blocks() == 1);
  CHECK(up.live_segments() == 1);
  up.set_refuse(false);
  up.complete(stream_b);
  CHECK(a.process_events() == 1);
  CHECK(a.check_invariants());
}

TEST_CASE("stream-ordered cache: the destructor waits for pending events and frees everything") {
  // The fake's events are done at once here, so the wait ends; the count shows they were given back.
  std::size_t created = 0;
  {
    cache a;
    void* p = a.allocate(100 * KiB, 256, memory_tag::other, stream_a);
    a.record_stream(p, stream_b);
    a.deallocate(p, 100 * KiB, 256, memory_tag::other);
    a.upstream().complete(stream_b);
    created = a.upstream().created;
    CHECK(a.upstream().live_events() == 1);
  }
  CHECK(created == 1);
}

TEST_CASE("stream-ordered cache: planned mode serves the layout's stream only") {
  caching_options o;
  o.planned = true;
  cache a(o);
  const std::vector<recorded_request> cycle{{1, false, 1000, memory_tag::activations},
                                            {1, true, 1000, memory_tag::activations}};
  a.set_layout(make_layout({}, cycle), stream_a);
  try {
    (void)a.allocate(1000, 256, memory_tag::activations, stream_b);
    FAIL("expected invalid_argument");
  } catch (const invalid_argument& e) {
    CHECK(e.argument() == "stream");
  }
  CHECK_THROWS_AS((void)a.growth_for(1000, 256, stream_b), invalid_argument);
  void* p = a.allocate(1000, 256, memory_tag::activations, stream_a);
  CHECK(a.planned_hits() == 1);
  a.record_stream(p, stream_a);  // its own stream: fine
  try {
    a.record_stream(p, stream_b);
    FAIL("expected invalid_argument");
  } catch (const invalid_argument& e) {
    CHECK(e.argument() == "stream");
  }
  // The stream cannot move while a planned block is live.
  try {
    a.set_layout(make_layout({}, cycle), stream_b);
    FAIL("expected invalid_argument");
  } catch (const invalid_argument& e) {
    CHECK(e.argument() == "stream");
  }
  a.deallocate(p, 1000, 256, memory_tag::activations);
  a.set_layout(make_layout({}, cycle), stream_b);
  void* q = a.allocate(1000, 256, memory_tag::activations, stream_b);
  CHECK(a.planned_hits() == 2);
  a.deallocate(q, 1000, 256, memory_tag::activations);
}

TEST_CASE("stream-ordered cache: a host upstream without events is unchanged") {
  caching_allocator<system_allocator> a;
  void* p = a.allocate(100 * KiB, 256, memory_tag::other);
  a.record_stream(p, stream_b);  // nothing to wait for on the host: only p is checked
  a.deallocate(p, 100 * KiB, 256, memory_tag::other);
  CHECK(a.pending_blocks() == 0);
  CHECK(a.process_events() == 0);
  void* q = a.allocate(100 * KiB, 256, memory_tag::other);
  CHECK(q == p);
  CHECK(a.growth_for(100 * KiB, 256) == 0);
  a.deallocate(q, 100 * KiB, 256, memory_tag::other);
  CHECK_THROWS_AS(a.record_stream(q, stream_b), invalid_argument);
  a.release_cached();
  CHECK(a.stats().reserved == 0);
  CHECK(a.check_invariants());
}

TEST_CASE("stream-ordered cache: budget, traced, synchronized and fault injection pass the stream on") {
  // The stack a GPU trainer uses; every layer must keep the stream, or ordering is lost silently.
  using stack = budget_allocator<traced_allocator<fault_injecting<cache>>>;
  static_assert(stream_ordered_allocator<cache>);
  static_assert(stream_ordered_allocator<stack>);
  static_assert(stream_ordered_allocator<synchronized<stack>>);
  trace_recorder rec(64);
  stack a(16 * MiB, rec);
  auto& inner = a.upstream().upstream().upstream();
  void* p = a.allocate(64 * KiB, 256, memory_tag::activations, stream_a);
  a.deallocate(p, 64 * KiB, 256, memory_tag::activations);
  // The block stays with stream a: stream b has to grow, and the budget sees that growth.
  CHECK(a.growth_for(64 * KiB, 256, stream_a) == 0);
  CHECK(a.growth_for(64 * KiB, 256, stream_b) == 2 * MiB);
  void* q = a.allocate(64 * KiB, 256, memory_tag::activations, stream_b);
  CHECK(q != p);
  a.record_stream(q, stream_c);
  a.deallocate(q, 64 * KiB, 256, memory_tag::activations);
  CHECK(inner.pending_blocks() == 1);
  inner.upstream().complete(stream_c);
  CHECK(inner.process_events() == 1);
  CHECK(a.stats().reserved == 4 * MiB);
}

TEST_CASE("stream-ordered cache: a wrapper over an allocator without streams refuses a stream") {
  budget_allocator<system_allocator> a(1 * MiB);
  static_assert(!stream_ordered_allocator<system_allocator>);
  void* p = a.allocate(4 * KiB, 64, memory_tag::other, host_stream);
  a.deallocate(p, 4 * KiB, 64, memory_tag::other);
  try {
    (void)a.allocate(4 * KiB, 64, memory_tag::other, stream_a);
    FAIL("a stream over system_allocator was accepted");
  } catch (const invalid_argument& e) {
    CHECK(e.argument() == "stream");
    CHECK(std::string(e.what()).find("budget_allocator") != std::string::npos);
  }
  CHECK_THROWS_AS((void)a.growth_for(4 * KiB, 64, stream_a), invalid_argument);
  CHECK(a.stats().allocated == 0);
  CHECK(a.stats().reserved == 0);
}

namespace {
// An executor whose work runs on a stream, as cuda_executor's does (stream() returns a pointer).
struct fake_stream_executor {
  void* s;
  void* stream() const noexcept { return s; }
};
struct host_executor {};
}  // namespace

TEST_CASE("stream_view: an executor's blocks stay with its stream until that stream's work is done") {
  // The hazard: work on the executor's stream may still use a block when the host frees it. A
  // request on another stream (the legacy one, another executor's) must not get it then.
  const fake_stream_executor ex{reinterpret_cast<void*>(stream_a)};
  CHECK(stream_of(ex) == stream_a);
  CHECK(stream_of(host_executor{}) == host_stream);
  budget_allocator<cache> alloc(64 * MiB);
  stream_view mem(alloc, stream_of(ex));
  static_assert(allocator<decltype(mem)>);
  CHECK(mem.stream() == stream_a);

  void* p = mem.allocate(100 * KiB, 256, memory_tag::activations);
  CHECK(alloc.upstream().block_stream(p) == stream_a);
  mem.deallocate(p, 100 * KiB, 256, memory_tag::activations);  // kernels of stream a may still read it
  CHECK(alloc.upstream().block_stream(p) == std::nullopt);     // free now
  // Without a stream (legacy) and on another stream: other memory.
  void* legacy = alloc.allocate(100 * KiB, 256, memory_tag::activations);
  void* other = alloc.allocate(100 * KiB, 256, memory_tag::activations, stream_b);
  CHECK(legacy != p);
  CHECK(other != p);
  CHECK(alloc.upstream().block_stream(legacy) == host_stream);
  // The executor's own later work gets it back at once: ordered after the work that used it.
  CHECK(mem.growth_for(100 * KiB, 256) == 0);
  void* again = mem.allocate(100 * KiB, 256, memory_tag::activations);
  CHECK(again == p);
  // Used on the legacy stream too (record_stream), it waits for that stream's events as well.
  alloc.record_stream(again, host_stream);
  mem.deallocate(again, 100 * KiB, 256, memory_tag::activations);
  CHECK(alloc.upstream().pending_blocks() == 1);
  void* busy = mem.allocate(100 * KiB, 256, memory_tag::activations);
  CHECK(busy != p);
  alloc.upstream().upstream().complete(host_stream);
  CHECK(alloc.upstream().process_events() == 1);
  void* done = mem.allocate(100 * KiB, 256, memory_tag::activations);
  CHECK(done == p);
  for (void* q : {legacy, other, busy, done}) alloc.deallocate(q, 100 * KiB, 256, memory_tag::activations);
  CHECK(alloc.stats().allocated == 0);
  CHECK(alloc.upstream().check_invariants());
}

TEST_CASE("stream_view: a wrong free still reaches the caller as the allocator's error") {
  // As noexcept as the allocator under it: the caching allocator's refusal is not a terminate.
  cache alloc;
  stream_view mem(alloc, stream_a);
  static_assert(!noexcept(mem.deallocate(nullptr, 1)));
  static_assert(noexcept(stream_view(*static_cast<system_allocator*>(nullptr), host_stream).deallocate(nullptr, 1)));
  void* p = mem.allocate(4 * KiB, 256, memory_tag::other);
  CHECK_THROWS_AS(mem.deallocate(p, 8 * KiB, 256, memory_tag::other), invalid_argument);
  mem.deallocate(p, 4 * KiB, 256, memory_tag::other);
  CHECK(alloc.stats().allocated == 0);
}

TEST_CASE("stream_view: over an allocator without streams it serves the host stream") {
  // Nothing to order there (system memory; an arena, or cudaMalloc/cudaFree whose free waits).
  budget_allocator<system_allocator> alloc(1 * MiB);
  stream_view mem(alloc, stream_a);
  CHECK(mem.stream() == host_stream);
  void* p = mem.allocate(4 * KiB, 64, memory_tag::other);
  CHECK(mem.stats().allocated == 4 * KiB);
  CHECK(mem.growth_for(4 * KiB, 64) == alloc.growth_for(4 * KiB, 64));
  mem.deallocate(p, 4 * KiB, 64, memory_tag::other);
  CHECK(alloc.stats().allocated == 0);
}
