// Memory traces: a bounded recorder of allocation, free, pressure and mark events, an allocator
// adaptor that feeds it, and a writer for the Chrome trace-event JSON that Perfetto
// (ui.perfetto.dev) and chrome://tracing open.
//
//   trace_recorder rec(1 << 16);
//   traced_allocator<caching_allocator<>> a(rec);
//   ... train a step ...
//   rec.save_chrome_trace("step.json");  // one counter track "memory by tag", pressure instants
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <new>
#include <ostream>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "membound/core/config.hpp"
#include "membound/core/error.hpp"
#include "membound/core/file_io.hpp"
#include "membound/memory/allocator.hpp"
#include "membound/memory/stream.hpp"
#include "membound/memory/memory_stats.hpp"
#include "membound/core/memory_tag.hpp"
#include "membound/core/check_point.hpp"
#include "membound/core/pressure_level.hpp"

MEMBOUND_NAMESPACE_BEGIN

enum class trace_event_kind : std::uint8_t { allocation, deallocation, pressure, mark, reserve };

constexpr std::string_view to_string(trace_event_kind k) noexcept {
  switch (k) {
    case trace_event_kind::allocation: return "allocation";
    case trace_event_kind::deallocation: return "deallocation";
    case trace_event_kind::pressure: return "pressure";
    case trace_event_kind::mark: return "mark";
    case trace_event_kind::reserve: return "reserve";
  }
  return "invalid";
}

struct trace_event {
  trace_event_kind kind = trace_event_kind::mark;
  memory_tag tag = memory_tag::other;               // allocation, deallocation
  std::size_t bytes = 0;                            // allocation, deallocation: requested bytes
  std::uintptr_t address = 0;                       // allocation, deallocation
  std::uint64_t timestamp_ns = 0;                   // steady_clock, since the recorder was made
  std::size_t tag_current = 0;                      // the tag's live bytes after this event
  pressure_level level = pressure_level::normal;    // pressure: the new level
  pressure_level previous = pressure_level::normal; // pressure: the level before
  check_point point = check_point::before_forward;  // pressure: where it was observed
  std::size_t usage = 0, limit = 0;                 // pressure: footprint and budget then
  std::string name;                                 // mark
  // The allocator's reserved bytes after this event, when the recorder was told (traced_allocator
  // tells it); unknown_reserved otherwise. Absolute, so it survives the ring wrapping.
  std::size_t reserved = unknown_reserved;
  static constexpr std::size_t unknown_reserved = static_cast<std::size_t>(-1);
};

namespace detail {

// JSON string contents: quotes, backslashes and control characters escaped; invalid UTF-8
// replaced by U+FFFD, because one bad byte makes the whole trace unreadable to a JSON parser.
inline void append_json_escaped(std::string& out, std::string_view s) {
  static constexpr char hex[] = "0123456789abcdef";
  const auto* b = reinterpret_cast<const unsigned char*>(s.data());
  const std::size_t n = s.size();
  std::size_t i = 0;
  while (i < n) {
    const unsigned char c = b[i];
    if (c < 0x80) {
      switch (c) {
        case '"': out += "\\\""; break;
        case '\\': out += "\\\\"; break;
        case '\b': out += "\\b"; break;
        case '\f': out += "\\f"; break;
        case '\n': out += "\\n"; break;
        case '\r': out += "\\r"; break;
        case '\t': out += "\\t"; break;
        default:
          if (c < 0x20) {
            out += "\\u00";
            out += hex[c >> 4];
            out += hex[c & 0xf];
          } else {
            out += static_cast<char>(c);
          }
      }
      ++i;
      continue;
    }
    // Well-formed sequences as Unicode Table 3-7 lists them (no overlongs, no surrogates).
    std::size_t len = 0;
    unsigned char lo = 0x80, hi = 0xbf;
    if (c >= 0xc2 && c <= 0xdf) {
      len = 2;
    } else if (c >= 0xe0 && c <= 0xef) {
      len = 3;
      if (c == 0xe0) lo = 0xa0;
      if (c == 0xed) hi = 0x9f;
    } else if (c >= 0xf0 && c <= 0xf4) {
      len = 4;
      if (c == 0xf0) lo = 0x90;
      if (c == 0xf4) hi = 0x8f;
    }
    bool ok = len != 0 && i + len <= n;
    for (std::size_t k = 1; ok && k < len; ++k) {
      const unsigned char cc = b[i + k];
      ok = k == 1 ? (cc >= lo && cc <= hi) : (cc >= 0x80 && cc <= 0xbf);
    }
    if (ok) {
      out.append(s.data() + i, len);
      i += len;
    } else {
      out += "\\ufffd";
      ++i;
    }
  }
}

inline void append_json_string(std::string& out, std::string_view s) {
  out += '"';
  append_json_escaped(out, s);
  out += '"';
}

// Microseconds with nanosecond digits: the trace format's unit, without float rounding.
inline void append_timestamp_us(std::string& out, std::uint64_t ns) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%llu.%03u", static_cast<unsigned long long>(ns / 1000),
                static_cast<unsigned>(ns % 1000));
  out += buf;
}

}  // namespace detail

// A ring buffer of the most recent events. Recording allocation, free and pressure events never
// allocates and never throws: the storage is reserved up front. When full, the oldest event is
// overwritten and folded into a per-tag baseline, so counters rebuilt from the retained events
// (baseline, then each event in order) are exact however many were dropped.
//
// Not thread-safe, like the allocators; share one behind synchronized<> or one per thread.
class trace_recorder {
 public:
  // The most events one recorder keeps: their storage is reserved up front (about 100 bytes
  // each, 1.6 GiB at this size) and a saved trace takes some 160 bytes per event.
  static constexpr std::size_t max_capacity = std::size_t{1} << 24;

  // Throws invalid_argument for a capacity of 0 or above max_capacity, out_of_memory when the
  // host cannot hold the ring.
  explicit trace_recorder(std::size_t capacity) : capacity_(checked_capacity(capacity)) {
    try {
      events_.reserve(capacity_);
    } catch (const std::bad_alloc&) {
      detail::throw_host_out_of_memory(
          "trace_recorder", capacity_ * sizeof(trace_event),
          "the ring of " + std::to_string(capacity_) +
              " events does not fit in host memory: pass a smaller capacity");
    }
  }

  trace_recorder(const trace_recorder&) = delete;
  trace_recorder& operator=(const trace_recorder&) = delete;

  void record_allocation(memory_tag tag, std::size_t bytes, const void* address,
                         std::size_t reserved = trace_event::unknown_reserved) noexcept {
    std::size_t& cur = current_[index_of(tag)];
    cur += bytes;
    trace_event e;
    e.kind = trace_event_kind::allocation;
    e.tag = tag;
    e.bytes = bytes;
    e.address = reinterpret_cast<std::uintptr_t>(address);
    e.tag_current = cur;
    e.reserved = reserved;
    push(std::move(e));
  }

  // The reserve changed without an allocation or free (e.g. release_cached()).
  void record_reserved(std::size_t reserved) noexcept {
    trace_event e;
    e.kind = trace_event_kind::reserve;
    e.reserved = reserved;
    push(std::move(e));
  }

  void record_deallocation(memory_tag tag, std::size_t bytes, const void* address,
                           std::size_t reserved = trace_event::unknown_reserved) noexcept {
    record_deallocation(tag, bytes, reinterpret_cast<std::uintptr_t>(address), reserved);
  }
  // By address value: callers that record after the free must not hold a freed pointer.
  void record_deallocation(memory_tag tag, std::size_t bytes, std::uintptr_t address,
                           std::size_t reserved = trace_event::unknown_reserved) noexcept {
    std::size_t& cur = current_[index_of(tag)];
    // Floored: a block allocated before tracing started may be freed while tracing.
    cur = cur > bytes ? cur - bytes : 0;
    trace_event e;
    e.kind = trace_event_kind::deallocation;
    e.tag = tag;
    e.bytes = bytes;
    e.address = address;
    e.tag_current = cur;
    e.reserved = reserved;
    push(std::move(e));
  }

  // Called by a pressure monitor when its level changes.
  void record_pressure(check_point point, pressure_level previous, pressure_level level,
                       std::size_t usage, std::size_t limit) noexcept {
    trace_event e;
    e.kind = trace_event_kind::pressure;
    e.point = point;
    e.previous = previous;
    e.level = level;
    e.usage = usage;
    e.limit = limit;
    push(std::move(e));
  }

  // A named instant ("step 3", "eval"), shown as a global marker in the viewer.
  void mark(std::string_view name) {
    trace_event e;
    e.kind = trace_event_kind::mark;
    try {
      e.name.assign(name.data(), name.size());  // the only step that can throw; nothing changed yet
    } catch (const std::bad_alloc&) {
      detail::throw_host_out_of_memory("trace_recorder::mark", name.size(),
                                       "the mark's name is copied into the trace: pass a shorter one");
    }
    push(std::move(e));
  }

  std::size_t size() const noexcept { return events_.size(); }
  std::size_t capacity() const noexcept { return capacity_; }
  bool empty() const noexcept { return events_.empty(); }
  // Events overwritten because the buffer was full, since construction or the last clear().
  std::uint64_t dropped() const noexcept { return dropped_; }

  // The i-th retained event, oldest first.
  const trace_event& operator[](std::size_t i) const noexcept {
    return events_[(head_ + i) % events_.size()];
  }
  const trace_event& event(std::size_t i) const {
    if (i >= events_.size()) {
      throw invalid_argument("i", "an index below size() = " + std::to_string(events_.size()),
                             std::to_string(i),
                             "Events are indexed oldest first from 0; older ones were dropped "
                             "when the ring was full (see dropped())");
    }
    return (*this)[i];
  }
  // A copy of the retained events, oldest first.
  std::vector<trace_event> events() const {
    std::vector<trace_event> out;
    out.reserve(events_.size());
    for (std::size_t i = 0; i < events_.size(); ++i) out.push_back((*this)[i]);
    return out;
  }

  // A tag's live bytes just before the oldest retained event.
  std::size_t baseline(memory_tag tag) const noexcept { return baseline_[index_of(tag)]; }
  // A tag's live bytes after the newest event.
  std::size_t current(memory_tag tag) const noexcept { return current_[index_of(tag)]; }

  // Starts a new window: events go, the running totals become the baseline, dropped() restarts.
  void clear() noexcept {
    events_.clear();
    head_ = 0;
    dropped_ = 0;
    baseline_ = current_;
  }

  std::uint64_t now_ns() const noexcept {
    return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                          std::chrono::steady_clock::now() - origin_)
                                          .count());
  }

  // Chrome trace-event JSON: metadata names, one counter "memory by tag" at the window start and
  // at every allocation and free, global instants for pressure changes and marks. Timestamps in
  // microseconds since the recorder was made.
  void write_chrome_trace(std::ostream& os) const {
    const std::string out = chrome_trace_json();
    os.write(out.data(), static_cast<std::streamsize>(out.size()));
  }

  // The same, to a file, atomically as checkpoints are (see core/file_io.hpp): a failed save
  // leaves any earlier file at `path` as it was. Throws file_error naming the path (a folder, a
  // missing folder, no permission, a full disk), out_of_memory when the JSON does not fit.
  void save_chrome_trace(const std::string& path) const {
    std::string json;
    try {
      json = chrome_trace_json();
    } catch (const std::bad_alloc&) {
      detail::throw_host_out_of_memory("trace_recorder::save_chrome_trace",
                                       256 + events_.size() * 160,
                                       "the trace is built in host memory before it is written: "
                                       "free host memory or record fewer events");
    }
    const detail::byte_range part{json.data(), json.size()};
    detail::write_file_atomically(path, "path", "Chrome trace", std::span(&part, 1));
  }

 private:
  std::string chrome_trace_json() const {
    std::string out;
    out.reserve(256 + events_.size() * 160);
    out += "{\"traceEvents\":[\n";
    out += R"({"name":"process_name","ph":"M","ts":0,"pid":1,"tid":0,"args":{"name":"membound"}},)";
    out += '\n';
    out += R"({"name":"thread_name","ph":"M","ts":0,"pid":1,"tid":1,"args":{"name":"memory"}})";

    std::array<std::size_t, memory_tag_count> running = baseline_;
    const std::uint64_t start_ns = events_.empty() ? 0 : (*this)[0].timestamp_ns;
    append_counter(out, start_ns, running);
    for (std::size_t i = 0; i < events_.size(); ++i) {
      const trace_event& e = (*this)[i];
      switch (e.kind) {
        case trace_event_kind::allocation:
        case trace_event_kind::deallocation:
          running[index_of(e.tag)] = e.tag_current;
          append_counter(out, e.timestamp_ns, running);
          append_reserved(out, e);
          break;
        case trace_event_kind::reserve: append_reserved(out, e); break;
        case trace_event_kind::pressure: append_pressure(out, e); break;
        case trace_event_kind::mark: append_mark(out, e); break;
      }
    }

    out += "\n],\"displayTimeUnit\":\"ms\",\"otherData\":{\"producer\":\"membound ";
    out += std::to_string(version.major) + "." + std::to_string(version.minor) + "." +
           std::to_string(version.patch) + "\"";
    out += ",\"capacity\":" + std::to_string(capacity_);
    out += ",\"retained_events\":" + std::to_string(events_.size());
    out += ",\"dropped_events\":" + std::to_string(dropped_);
    out += "}}\n";
    return out;
  }

  static std::size_t checked_capacity(std::size_t capacity) {
    if (capacity == 0 || capacity > max_capacity) {
      throw invalid_argument("capacity",
                             "between 1 and " + std::to_string(max_capacity) +
                                 " events (trace_recorder::max_capacity)",
                             std::to_string(capacity),
                             "Pass how many recent events to keep, e.g. 1 << 16; older ones are "
                             "folded into the baseline, so a small ring still gives exact counters");
    }
    return capacity;
  }

  void push(trace_event&& e) noexcept {
    e.timestamp_ns = now_ns();
    if (events_.size() < capacity_) {
      events_.push_back(std::move(e));  // within the reserved storage: no allocation
      return;
    }
    trace_event& oldest = events_[head_];
    if (oldest.kind == trace_event_kind::allocation ||
        oldest.kind == trace_event_kind::deallocation) {
      // Events are in order, so the oldest event's total is the tag's value before the new oldest.
      baseline_[index_of(oldest.tag)] = oldest.tag_current;
    }
    oldest = std::move(e);
    head_ = (head_ + 1) % capacity_;
    ++dropped_;
  }

  static void append_counter(std::string& out, std::uint64_t ns,
                             const std::array<std::size_t, memory_tag_count>& bytes) {
    out += ",\n{\"name\":\"memory by tag\",\"cat\":\"memory\",\"ph\":\"C\",\"ts\":";
    detail::append_timestamp_us(out, ns);
    out += ",\"pid\":1,\"tid\":1,\"args\":{";
    for (memory_tag t : all_memory_tags) {
      if (t != all_memory_tags[0]) out += ',';
      detail::append_json_string(out, to_string(t));
      out += ':';
      out += std::to_string(bytes[index_of(t)]);
    }
    out += "}}";
  }

  // A second counter track beside the tags: the gap between it and their sum is the cache and
  // fragmentation, which is what a person opening the trace usually came to find.
  static void append_reserved(std::string& out, const trace_event& e) {
    if (e.reserved == trace_event::unknown_reserved) return;
    out += ",\n{\"name\":\"reserved\",\"cat\":\"memory\",\"ph\":\"C\",\"ts\":";
    detail::append_timestamp_us(out, e.timestamp_ns);
    out += ",\"pid\":1,\"tid\":1,\"args\":{\"bytes\":";
    out += std::to_string(e.reserved);
    out += "}}";
  }

  static void append_pressure(std::string& out, const trace_event& e) {
    out += ",\n{\"name\":";
    detail::append_json_string(out, std::string("pressure ") + std::string(to_string(e.level)));
    out += ",\"cat\":\"pressure\",\"ph\":\"i\",\"s\":\"g\",\"ts\":";
    detail::append_timestamp_us(out, e.timestamp_ns);
    out += ",\"pid\":1,\"tid\":1,\"args\":{\"check_point\":";
    detail::append_json_string(out, to_string(e.point));
    out += ",\"from\":";
    detail::append_json_string(out, to_string(e.previous));
    out += ",\"to\":";
    detail::append_json_string(out, to_string(e.level));
    out += ",\"usage\":" + std::to_string(e.usage) + ",\"limit\":" + std::to_string(e.limit) + "}}";
  }

  static void append_mark(std::string& out, const trace_event& e) {
    out += ",\n{\"name\":";
    detail::append_json_string(out, e.name);
    out += ",\"cat\":\"mark\",\"ph\":\"i\",\"s\":\"g\",\"ts\":";
    detail::append_timestamp_us(out, e.timestamp_ns);
    out += ",\"pid\":1,\"tid\":1}";
  }

  std::size_t capacity_;
  std::vector<trace_event> events_;  // ring storage; events_[head_] is the oldest once full
  std::size_t head_ = 0;
  std::uint64_t dropped_ = 0;
  std::array<std::size_t, memory_tag_count> baseline_{};
  std::array<std::size_t, memory_tag_count> current_{};
  std::chrono::steady_clock::time_point origin_ = std::chrono::steady_clock::now();
};

// Records every successful allocate and deallocate of its upstream into a recorder. A failed
// allocation throws before anything is recorded, so traces hold only real blocks.
template <typename Upstream>
class traced_allocator {
  static_assert(check_allocator<Upstream>());

 public:
  static constexpr memory_space space = Upstream::space;

  template <typename... Args>
  explicit traced_allocator(trace_recorder& recorder, Args&&... upstream_args)
      : recorder_(&recorder), upstream_(std::forward<Args>(upstream_args)...) {}

  traced_allocator(const traced_allocator&) = delete;
  traced_allocator& operator=(const traced_allocator&) = delete;

  void* allocate(std::size_t bytes, std::size_t alignment = default_alignment,
                 memory_tag tag = memory_tag::other, stream_id stream = host_stream) {
    void* p = detail::allocate_on(upstream_, bytes, alignment, tag, stream, "traced_allocator");
    if (p != nullptr) recorder_->record_allocation(tag, bytes, p, upstream_.stats().reserved);
    return p;
  }

  void deallocate(void* p, std::size_t bytes, std::size_t alignment = default_alignment,
                  memory_tag tag = memory_tag::other) noexcept(noexcept(
      std::declval<Upstream&>().deallocate(p, bytes, alignment, tag))) {
    if (p == nullptr) return;
    // The address is kept as a number: p must not be read once freed, and the event is recorded
    // only after the upstream accepted the free (it throws on a pointer it does not own).
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    upstream_.deallocate(p, bytes, alignment, tag);
    recorder_->record_deallocation(tag, bytes, address, upstream_.stats().reserved);
  }

  memory_stats stats() const { return upstream_.stats(); }

  // Forwarded where the upstream has them, so a traced stack keeps its budget and cache controls.
  void release_cached() requires caching_allocator_like<Upstream> {
    upstream_.release_cached();
    recorder_->record_reserved(upstream_.stats().reserved);
  }
  std::size_t growth_for(std::size_t bytes, std::size_t alignment,
                         stream_id stream = host_stream) const
    requires reports_growth<Upstream>
  {
    return detail::growth_on(upstream_, bytes, alignment, stream, "traced_allocator");
  }
  // Non-const: reaches the upstream's non-const growth_for where it has one (a stream-ordered
  // caching_allocator polls its pending blocks there, as its allocate does, so the prediction is
  // exact rather than an over-estimate that makes a budget release the whole cache).
  std::size_t growth_for(std::size_t bytes, std::size_t alignment, stream_id stream = host_stream)
    requires reports_growth<Upstream>
  {
    return detail::growth_on(upstream_, bytes, alignment, stream, "traced_allocator");
  }
  void record_stream(void* p, stream_id stream) requires stream_ordered_allocator<Upstream> {
    upstream_.record_stream(p, stream);
  }
  void reset_peaks() requires detail::has_reset_peaks<Upstream> { upstream_.reset_peaks(); }
  void set_reserve_limit(std::size_t bytes) requires detail::has_reserve_limit<Upstream> {
    upstream_.set_reserve_limit(bytes);
  }
  std::size_t limit() const requires budgeted<Upstream> { return upstream_.limit(); }
  void set_limit(std::size_t bytes) requires detail::has_set_limit<Upstream> {
    upstream_.set_limit(bytes);
  }
  std::size_t usage() const requires budgeted<Upstream> { return upstream_.usage(); }
  std::size_t headroom() const requires detail::has_headroom<Upstream> {
    return upstream_.headroom();
  }
  std::size_t external() const requires detail::has_external<Upstream> {
    return upstream_.external();
  }
  void set_external(std::size_t bytes) requires detail::has_set_external<Upstream> {
    upstream_.set_external(bytes);
  }

  trace_recorder& recorder() const noexcept { return *recorder_; }
  Upstream& upstream() noexcept { return upstream_; }
  const Upstream& upstream() const noexcept { return upstream_; }

 private:
  trace_recorder* recorder_;
  Upstream upstream_;
};

MEMBOUND_NAMESPACE_END
