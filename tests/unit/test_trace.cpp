#include <doctest/doctest.h>

#include <array>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "../support/fake_caching_allocator.hpp"
#include "membound/memory/budget.hpp"
#include "membound/memory/caching_allocator.hpp"
#include "membound/memory/system_allocator.hpp"
#include "membound/memory/trace.hpp"

using namespace membound;
using json = nlohmann::json;
using membound_test::fake_caching_allocator;
using tag_bytes = std::array<std::size_t, memory_tag_count>;

static_assert(check_allocator<traced_allocator<system_allocator>>());
static_assert(!caching_allocator_like<traced_allocator<system_allocator>>);
static_assert(caching_allocator_like<traced_allocator<caching_allocator<>>>);
static_assert(reports_growth<traced_allocator<caching_allocator<>>>);
static_assert(!budgeted<traced_allocator<caching_allocator<>>>);
static_assert(budgeted<traced_allocator<budget_allocator<caching_allocator<>>>>);
// A budget over a traced stack sees the same growth and cache controls.
static_assert(caching_allocator_like<budget_allocator<traced_allocator<fake_caching_allocator>>>);

namespace {

// A file in the temp directory, removed at the end of the test.
struct temp_file {
  std::filesystem::path path;
  explicit temp_file(const std::string& name) {
    std::random_device rd;
    path = std::filesystem::temp_directory_path() /
           ("membound_" + name + "_" + std::to_string(rd()) + ".json");
  }
  ~temp_file() {
    std::error_code ec;
    std::filesystem::remove(path, ec);
  }
};

json load(const std::filesystem::path& p) {
  std::ifstream f(p);
  REQUIRE(f.good());
  return json::parse(f);
}

json to_json(const trace_recorder& rec) {
  std::ostringstream os;
  rec.write_chrome_trace(os);
  return json::parse(os.str());
}

std::vector<tag_bytes> counters(const json& doc) {
  std::vector<tag_bytes> out;
  for (const json& e : doc.at("traceEvents")) {
    if (e.at("ph") != "C" || e.at("name") == "reserved") continue;
    CHECK(e.at("name") == "memory by tag");
    tag_bytes b{};
    for (memory_tag t : all_memory_tags) {
      b[index_of(t)] = e.at("args").at(std::string(to_string(t))).get<std::size_t>();
    }
    CHECK(e.at("args").size() == memory_tag_count);
    out.push_back(b);
  }
  return out;
}

tag_bytes tags(std::initializer_list<std::pair<memory_tag, std::size_t>> l) {
  tag_bytes b{};
  for (auto [t, n] : l) b[index_of(t)] = n;
  return b;
}

}  // namespace

TEST_CASE("trace: a recorded sequence becomes a valid Chrome trace with exact counters") {
  trace_recorder rec(64);
  CHECK(rec.capacity() == 64);
  traced_allocator<system_allocator> a(rec);

  void* w = a.allocate(100, 256, memory_tag::weights);
  void* x = a.allocate(200, 256, memory_tag::activations);
  const std::string mark_name = "step 1 \"warm\"\\ end\n\ttab \x01 caf\xc3\xa9";
  rec.mark(mark_name);
  a.deallocate(w, 100, 256, memory_tag::weights);
  void* y = a.allocate(50, 256, memory_tag::activations);
  rec.record_pressure(check_point::after_backward, pressure_level::normal,
                      pressure_level::warning, 920, 1000);
  a.deallocate(x, 200, 256, memory_tag::activations);
  a.deallocate(y, 50, 256, memory_tag::activations);
  CHECK(a.allocate(0, 256, memory_tag::weights) == nullptr);  // nothing to record
  a.deallocate(nullptr, 0, 256, memory_tag::weights);

  REQUIRE(rec.size() == 8);
  CHECK(rec.dropped() == 0);
  CHECK(rec[0].kind == trace_event_kind::allocation);
  CHECK(rec[0].bytes == 100);
  CHECK(rec[0].address == reinterpret_cast<std::uintptr_t>(w));
  CHECK(rec[0].tag_current == 100);
  CHECK(rec[2].kind == trace_event_kind::mark);
  CHECK(rec[2].name == mark_name);
  CHECK(rec[3].kind == trace_event_kind::deallocation);
  CHECK(rec[3].tag_current == 0);
  CHECK(rec[4].tag_current == 250);
  CHECK(rec[5].kind == trace_event_kind::pressure);
  CHECK(rec[5].level == pressure_level::warning);
  CHECK(rec[5].usage == 920);
  CHECK(rec.current(memory_tag::activations) == 0);

  temp_file file("sequence");
  rec.save_chrome_trace(file.path.string());
  const json doc = load(file.path);

  REQUIRE(doc.is_object());
  REQUIRE(doc.at("traceEvents").is_array());
  CHECK(doc.at("displayTimeUnit") == "ms");
  CHECK(doc.at("otherData").at("retained_events") == 8);
  CHECK(doc.at("otherData").at("dropped_events") == 0);
  CHECK(doc.at("otherData").at("capacity") == 64);

  int metadata = 0, instants = 0;
  double last_ts = -1.0;
  for (const json& e : doc.at("traceEvents")) {
    const std::string ph = e.at("ph");
    CHECK((ph == "M" || ph == "C" || ph == "i"));
    CHECK(e.at("pid") == 1);
    if (ph == "M") {
      ++metadata;
      CHECK((e.at("name") == "process_name" || e.at("name") == "thread_name"));
      CHECK(e.at("args").at("name").is_string());
      continue;
    }
    const double ts = e.at("ts").get<double>();
    CHECK(ts >= last_ts);  // non-decreasing
    last_ts = ts;
    if (ph == "i") {
      ++instants;
      CHECK(e.at("s") == "g");
    }
  }
  CHECK(metadata == 2);
  CHECK(instants == 2);

  // One counter for the window start, then one per allocation or free, with running totals.
  using enum memory_tag;
  const std::vector<tag_bytes> expected{
      tags({}),
      tags({{weights, 100}}),
      tags({{weights, 100}, {activations, 200}}),
      tags({{activations, 200}}),
      tags({{activations, 250}}),
      tags({{activations, 50}}),
      tags({}),
  };
  CHECK(counters(doc) == expected);

  // The mark and the pressure change, in order, with their fields.
  std::vector<json> inst;
  for (const json& e : doc.at("traceEvents")) {
    if (e.at("ph") == "i") inst.push_back(e);
  }
  REQUIRE(inst.size() == 2);
  CHECK(inst[0].at("cat") == "mark");
  CHECK(inst[0].at("name").get<std::string>() == mark_name);  // escaped and read back intact
  CHECK(inst[1].at("cat") == "pressure");
  CHECK(inst[1].at("name") == "pressure warning");
  CHECK(inst[1].at("args").at("from") == "normal");
  CHECK(inst[1].at("args").at("to") == "warning");
  CHECK(inst[1].at("args").at("check_point") == "after_backward");
  CHECK(inst[1].at("args").at("usage") == 920);
  CHECK(inst[1].at("args").at("limit") == 1000);
}

TEST_CASE("trace: the ring buffer wraps and counters stay exact") {
  constexpr std::size_t capacity = 7;
  trace_recorder rec(capacity);
  traced_allocator<system_allocator> a(rec);
  std::mt19937 rng(42);
  struct live {
    void* p;
    std::size_t bytes;
    memory_tag tag;
  };
  std::vector<live> blocks;
  tag_bytes truth{};
  std::size_t events = 0;
  for (int i = 0; i < 200; ++i) {
    if (blocks.empty() || rng() % 3 != 0) {
      const memory_tag t = all_memory_tags[rng() % memory_tag_count];
      const std::size_t n = 1 + rng() % 5000;
      blocks.push_back({a.allocate(n, 64, t), n, t});
      truth[index_of(t)] += n;
    } else {
      const std::size_t k = rng() % blocks.size();
      a.deallocate(blocks[k].p, blocks[k].bytes, 64, blocks[k].tag);
      truth[index_of(blocks[k].tag)] -= blocks[k].bytes;
      blocks.erase(blocks.begin() + static_cast<std::ptrdiff_t>(k));
    }
    ++events;
    if (i % 37 == 0) {
      rec.mark("m");
      ++events;
    }

    // Rebuilt from the baseline and the retained events, the counters are the true totals.
    tag_bytes rebuilt{};
    for (memory_tag t : all_memory_tags) rebuilt[index_of(t)] = rec.baseline(t);
    for (const trace_event& e : rec.events()) {
      if (e.kind == trace_event_kind::allocation) rebuilt[index_of(e.tag)] += e.bytes;
      if (e.kind == trace_event_kind::deallocation) rebuilt[index_of(e.tag)] -= e.bytes;
    }
    REQUIRE(rebuilt == truth);
  }
  CHECK(rec.size() == capacity);
  CHECK(rec.dropped() == events - capacity);

  const json doc = to_json(rec);
  const std::vector<tag_bytes> c = counters(doc);
  REQUIRE(!c.empty());
  tag_bytes base{};
  for (memory_tag t : all_memory_tags) base[index_of(t)] = rec.baseline(t);
  CHECK(c.front() == base);
  CHECK(c.back() == truth);
  CHECK(doc.at("otherData").at("dropped_events") == events - capacity);

  // clear() starts a new window from the running totals.
  rec.clear();
  CHECK(rec.size() == 0);
  CHECK(rec.dropped() == 0);
  for (memory_tag t : all_memory_tags) CHECK(rec.baseline(t) == truth[index_of(t)]);
  CHECK(counters(to_json(rec)) == std::vector<tag_bytes>{truth});

  for (auto& b : blocks) a.deallocate(b.p, b.bytes, 64, b.tag);
  for (memory_tag t : all_memory_tags) CHECK(rec.current(t) == 0);
}

TEST_CASE("trace: failed allocations are not recorded") {
  trace_recorder rec(16);
  traced_allocator<budget_allocator<system_allocator>> a(rec, std::size_t{1000});
  CHECK(a.limit() == 1000);
  void* p = a.allocate(800, 64, memory_tag::weights);
  CHECK_THROWS_AS((void)a.allocate(300, 64, memory_tag::weights), out_of_memory);
  CHECK_THROWS_AS((void)a.allocate(10, 3, memory_tag::weights), invalid_argument);
  CHECK(rec.size() == 1);
  CHECK(rec.current(memory_tag::weights) == 800);
  CHECK(a.stats().failed_allocations == 1);
  CHECK(a.usage() == 800);
  CHECK(a.headroom() == 200);
  a.set_limit(2000);
  CHECK(a.upstream().limit() == 2000);
  a.set_external(100);
  CHECK(a.external() == 100);
  a.deallocate(p, 800, 64, memory_tag::weights);
  CHECK(rec.size() == 2);
}

TEST_CASE("trace: forwards cache controls to a caching upstream") {
  trace_recorder rec(16);
  traced_allocator<fake_caching_allocator> a(rec, std::size_t{1024});
  void* p = a.allocate(1000, 64, memory_tag::activations);
  a.deallocate(p, 1000, 64, memory_tag::activations);
  CHECK(a.growth_for(1000, 64) == 0);
  CHECK(a.stats().reserved == 1024);
  a.release_cached();
  CHECK(a.upstream().release_calls() == 1);
  CHECK(a.stats().reserved == 0);
  a.reset_peaks();
  CHECK(a.stats().peak_reserved == 0);
  CHECK(&a.recorder() == &rec);
}

TEST_CASE("trace: bad input is a typed error naming the argument") {
  try {
    trace_recorder bad(0);
    FAIL("expected invalid_argument");
  } catch (const invalid_argument& e) {
    CHECK(e.argument() == "capacity");
  }

  trace_recorder rec(4);
  rec.mark("x");
  try {
    rec.save_chrome_trace("/nonexistent-membound-dir/sub/trace.json");
    FAIL("expected invalid_argument");
  } catch (const invalid_argument& e) {
    CHECK(e.argument() == "path");
    CHECK(std::string(e.what()).find("/nonexistent-membound-dir/sub/trace.json") !=
          std::string::npos);
  }
  CHECK(rec.size() == 1);
  CHECK_THROWS_AS((void)rec.event(1), invalid_argument);
  CHECK(rec.event(0).name == "x");
}

TEST_CASE("trace: strings are escaped and invalid UTF-8 is replaced") {
  trace_recorder rec(4);
  static constexpr char raw[] = "bad \xff byte, cut \xe2\x82 end, nul \0 here";
  static constexpr char clean[] =
      "bad \xef\xbf\xbd byte, cut \xef\xbf\xbd\xef\xbf\xbd end, nul \0 here";
  rec.mark(std::string_view(raw, sizeof raw - 1));
  rec.mark("\xf0\x9f\x98\x80 ok");
  const json doc = to_json(rec);
  std::vector<std::string> names;
  for (const json& e : doc.at("traceEvents")) {
    if (e.at("ph") == "i") names.push_back(e.at("name"));
  }
  REQUIRE(names.size() == 2);
  CHECK(names[0] == std::string(clean, sizeof clean - 1));
  CHECK(names[1] == "\xf0\x9f\x98\x80 ok");
}

TEST_CASE("trace: a traced allocator adds a reserved counter that follows its statistics") {
  trace_recorder rec(64);
  traced_allocator<caching_allocator<system_allocator>> a(rec);
  std::vector<std::size_t> truth;  // reserved after each recorded change, in order
  void* p = a.allocate(1000, 256, memory_tag::weights);          // new 2 MiB segment
  truth.push_back(a.stats().reserved);
  void* q = a.allocate(3u << 20, 256, memory_tag::activations);  // new 20 MiB segment
  truth.push_back(a.stats().reserved);
  a.deallocate(q, 3u << 20, 256, memory_tag::activations);       // cached: reserve unchanged
  truth.push_back(a.stats().reserved);
  a.release_cached();                                             // the 20 MiB segment goes back
  truth.push_back(a.stats().reserved);
  a.deallocate(p, 1000, 256, memory_tag::weights);
  truth.push_back(a.stats().reserved);
  CHECK(truth == std::vector<std::size_t>{2u << 20, 22u << 20, 22u << 20, 2u << 20, 2u << 20});

  std::vector<std::size_t> seen;
  const json doc = to_json(rec);  // a named document: at() on a temporary would dangle in the loop
  for (const json& e : doc.at("traceEvents")) {
    if (e.at("ph") == "C" && e.at("name") == "reserved") seen.push_back(e.at("args").at("bytes"));
  }
  CHECK(seen == truth);
  // Without the allocator, the recorder does not know the reserve and writes no such track.
  trace_recorder bare(8);
  bare.record_allocation(memory_tag::other, 10, nullptr);
  const json bare_doc = to_json(bare);
  for (const json& e : bare_doc.at("traceEvents")) CHECK(e.at("name") != "reserved");
}
