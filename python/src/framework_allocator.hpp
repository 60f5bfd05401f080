// A budgeted allocator behind C hooks, for a framework that takes its allocations from functions
// it loads by name (PyTorch's torch.cuda.memory.CUDAPluggableAllocator: malloc(size, device,
// stream) and free(ptr, size, device, stream)).
//
// Per device, one stack: budget_allocator<caching_allocator<Upstream>>, stream-ordered (a block
// freed on a stream is reused by that stream only), every byte counted against the budget, the
// bytes others hold on the device (Probe: the CUDA context, other processes) counted too. After
// each call that changes the reserve, the usage is classified by the pressure monitor's thresholds
// and a change of level is delivered to a C callback (up and down), outside the lock (so with
// several threads, events may arrive in another order than the levels changed). A refused
// request returns nullptr; the refusal's report (membound's out_of_memory message, every field) is
// kept for the
// caller to read; the hook PyTorch calls throws it instead (PyTorch does not check for nullptr).
// Thread-safe: one mutex, as the framework allocates from any thread.
//
// Nothing here throws across the C boundary: each hook (framework_allocator_hooks.inl) catches
// and records.
//
// The snapshot (snapshot_json) is PyTorch's torch.cuda.memory._snapshot() layout, so its tools
// read it (membound.torch.snapshot() pickles it for PyTorch's memory viewer): per device, the
// segments the caching allocator holds from its upstream with their live and free blocks, and,
// once record_history(max_entries) has turned it on, the last max_entries events (alloc,
// free_requested, free_completed, segment_alloc, segment_free, oom) with their time.
#pragma once

#include <algorithm>
#include <cstddef>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "membound/core/pressure_level.hpp"
#include "membound/memory/budget.hpp"
#include "membound/memory/caching_allocator.hpp"
#include "membound/memory/stream.hpp"
#include "membound/monitor/pressure_monitor.hpp"

namespace membound_python {

namespace mb = membound;

// The callback's arguments: the device, the previous and the new level (0 normal, 1 warning,
// 2 critical, 3 emergency), the budget's usage and limit in bytes.
using pressure_callback = void (*)(int device, int previous, int level, std::uint64_t usage, std::uint64_t limit);

// Figures of one device's stack, for the stats hook (a fixed layout: a C array of 12 values).
enum stat_index : int {
  stat_requested,
  stat_peak_requested,
  stat_reserved,
  stat_peak_reserved,
  stat_limit,
  stat_external,
  stat_allocations,
  stat_deallocations,
  stat_refusals,
  stat_upstream_allocations,
  stat_level,
  stat_cached,     // reserved but free: what empty_cache gives back
  stat_bad_frees,  // frees that matched no live block (every device)
  stat_count
};

// One event of PyTorch's memory history (torch.cuda.memory._record_memory_history).
struct trace_entry {
  const char* action;  // alloc, free_requested, free_completed, segment_alloc, segment_free, oom
  std::uintptr_t addr;
  std::size_t size;
  std::uintptr_t stream;
  std::int64_t time_us;
  std::size_t device_free;  // oom: what the budget had left
};

// What one device's stack holds, for the snapshot: the segments from the upstream, the live
// blocks, and the history when it is on.
struct device_book {
  std::map<std::uintptr_t, std::pair<std::size_t, std::uintptr_t>> segments;  // address -> bytes, stream
  std::map<std::uintptr_t, std::pair<std::size_t, std::uintptr_t>> blocks;  // address -> bytes, stream
  std::deque<trace_entry> trace;
  std::size_t max_entries = 0;  // 0: no history
  std::uintptr_t stream = 0;    // the stream of the request in progress (a new segment's)

  void record(const char* action, std::uintptr_t addr, std::size_t size, std::uintptr_t on_stream,
              std::size_t device_free = 0) {
    if (max_entries == 0) return;
    const auto now = std::chrono::system_clock::now().time_since_epoch();
    trace.push_back({action, addr, size, on_stream,
                     std::chrono::duration_cast<std::chrono::microseconds>(now).count(), device_free});
    while (trace.size() > max_entries) trace.pop_front();
  }
};

// The upstream under the caching allocator, telling the book about every segment it hands out
// and takes back.
template <typename Upstream>
struct booked : Upstream {
  using Upstream::Upstream;
  device_book* book = nullptr;

  // The book is a record, never a reason to fail: an event it cannot store (bad_alloc, also inside
  // the caching allocator's noexcept release and destructor) is dropped.
  void* allocate(std::size_t bytes, std::size_t alignment, mb::memory_tag tag) {
    void* p = Upstream::allocate(bytes, alignment, tag);
    if (book != nullptr && p != nullptr) {
      try {
        book->segments[reinterpret_cast<std::uintptr_t>(p)] = {bytes, book->stream};
        book->record("segment_alloc", reinterpret_cast<std::uintptr_t>(p), bytes, book->stream);
      } catch (...) {
      }
    }
    return p;
  }
  void deallocate(void* p, std::size_t bytes, std::size_t alignment, mb::memory_tag tag) {
    if (book != nullptr && p != nullptr) {
      const auto it = book->segments.find(reinterpret_cast<std::uintptr_t>(p));
      const std::uintptr_t stream = it == book->segments.end() ? 0 : it->second.second;
      if (it != book->segments.end()) book->segments.erase(it);
      try {
        book->record("segment_free", reinterpret_cast<std::uintptr_t>(p), bytes, stream);
      } catch (...) {
      }
    }
    Upstream::deallocate(p, bytes, alignment, tag);
  }
};

// Upstream: the device allocator (constructed from the device index). Probe(device, budget):
// the bytes others hold on that device, or nullopt where nothing is measured.
template <typename Upstream, typename Probe>
class framework_allocator {
 public:
  using stack = mb::budget_allocator<mb::caching_allocator<booked<Upstream>>>;

  // Before the first allocation: the budget per device and the thresholds (fractions of it).
  // Refused (invalid_argument naming the field) with blocks live, or for a zero budget or
  // thresholds out of order; the previous configuration then stays.
  void configure(std::size_t budget, mb::pressure_thresholds t) {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (budget == 0) {
      throw mb::invalid_argument("budget", "at least 1 byte per device", "0", "e.g. budget=\"24GiB\"");
    }
    const mb::pressure_monitor<> check(t);  // validates the thresholds, naming the one that is wrong
    for (const auto& [device, d] : devices_) {
      if (d->alloc.stats().requested != 0) {
        throw mb::invalid_argument("budget", "a configuration made before any block is allocated",
                                   "a change with blocks live on device " + std::to_string(device),
                                   "Configure once, before the framework's first allocation");
      }
    }
    devices_.clear();
    budget_ = budget;
    thresholds_ = check.thresholds();
  }
  bool configured() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return budget_ != 0;
  }

  void set_callback(pressure_callback cb) {
    const std::lock_guard<std::mutex> lock(mutex_);
    callback_ = cb;
  }

  void* allocate(std::size_t bytes, int device, mb::stream_id stream) noexcept {
    thread_refusal().clear();
    std::optional<event> e;
    void* p = nullptr;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      try {
        state& d = state_of(device);
        try {
          // The others' bytes before the reserve grows: what the budget must leave them.
          if (d.alloc.growth_for(bytes, mb::default_alignment, stream) != 0) measure_others(d, device);
          d.book.stream = static_cast<std::uintptr_t>(stream);
          p = d.alloc.allocate(bytes, mb::default_alignment, mb::memory_tag::other, stream);
          if (p != nullptr) {
            d.book.blocks[reinterpret_cast<std::uintptr_t>(p)] = {bytes, static_cast<std::uintptr_t>(stream)};
            d.book.record("alloc", reinterpret_cast<std::uintptr_t>(p), bytes, static_cast<std::uintptr_t>(stream));
          }
        } catch (const mb::out_of_memory& oom) {
          const std::size_t used = d.alloc.stats().reserved + d.alloc.external();
          d.book.record("oom", 0, bytes, static_cast<std::uintptr_t>(stream),
                        d.alloc.limit() > used ? d.alloc.limit() - used : 0);
          ++d.refusals;
          last_refusal_ = oom.what();
          thread_refusal() = last_refusal_;
        }
        e = classify(d, device);
      } catch (const std::exception& x) {
        last_error_ = x.what();
      }
    }
    deliver(e);
    return p;
  }

  // A free that does not match a live block (another size, another device) changes nothing; it
  // is counted (stat_bad_frees) and described in last_error.
  void deallocate(void* p, std::size_t bytes, int device) noexcept {
    if (p == nullptr) return;
    std::optional<event> e;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      state* d = existing(device);
      try {
        if (d == nullptr) {
          throw mb::invalid_argument("device", "a device this allocator served", std::to_string(device),
                                     "Free a block with the device it was allocated on");
        }
        d->alloc.deallocate(p, bytes, mb::default_alignment, mb::memory_tag::other);
        // Stream-ordered: the block is free for its stream at once, so both events at once.
        const auto at = d->book.blocks.find(reinterpret_cast<std::uintptr_t>(p));
        const std::uintptr_t on = at == d->book.blocks.end() ? 0 : at->second.second;
        if (at != d->book.blocks.end()) d->book.blocks.erase(at);
        d->book.record("free_requested", reinterpret_cast<std::uintptr_t>(p), bytes, on);
        d->book.record("free_completed", reinterpret_cast<std::uintptr_t>(p), bytes, on);
        e = classify(*d, device);
      } catch (const std::exception& x) {
        ++bad_frees_;
        last_error_ = x.what();
      }
    }
    deliver(e);
  }

  // A live block used on another stream too: its reuse then waits for that stream's work.
  bool record_stream(void* p, int device, mb::stream_id stream) noexcept {
    const std::lock_guard<std::mutex> lock(mutex_);
    try {
      state* d = existing(device);
      if (d == nullptr) {
        throw mb::invalid_argument("device", "a device this allocator served", std::to_string(device),
                                   "Pass the device the block was allocated on");
      }
      d->alloc.record_stream(p, stream);
      return true;
    } catch (const std::exception& x) {
      last_error_ = x.what();
      return false;
    }
  }

  // Gives every device's cached (free) segments back to the upstream.
  void empty_cache() noexcept {
    std::map<int, event> changed;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      for (auto& [device, d] : devices_) {
        d->alloc.upstream().release_cached();
        if (auto e = classify(*d, device)) changed.emplace(device, *e);
      }
    }
    for (const auto& [device, e] : changed) deliver(e);
  }

  // The device's figures (stat_index order); false for a device never used.
  bool stats(int device, std::uint64_t* out) const noexcept {
    const std::lock_guard<std::mutex> lock(mutex_);
    const auto it = devices_.find(device);
    if (it == devices_.end()) return false;
    const state& d = *it->second;
    const mb::memory_stats s = d.alloc.stats();
    out[stat_requested] = s.requested;
    out[stat_peak_requested] = s.peak_requested;
    out[stat_reserved] = s.reserved;
    out[stat_peak_reserved] = s.peak_reserved;
    out[stat_limit] = d.alloc.limit();
    out[stat_external] = std::max(d.others, d.alloc.external());  // measured, even where the budget clamped it
    out[stat_allocations] = s.allocations;
    out[stat_deallocations] = s.deallocations;
    out[stat_refusals] = d.refusals;
    out[stat_upstream_allocations] = s.upstream_allocations;
    out[stat_level] = static_cast<std::uint64_t>(d.level);
    out[stat_cached] = s.reserved - s.allocated;
    out[stat_bad_frees] = bad_frees_;
    return true;
  }

  // The others' bytes on a device, set by hand (a test's stand-in for another process): then
  // classified and delivered as any change.
  void set_others(int device, std::size_t bytes) noexcept {
    std::optional<event> e;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      try {
        state& d = state_of(device);
        set_external(d, bytes);
        e = classify(d, device);
      } catch (const std::exception& x) {
        last_error_ = x.what();
      }
    }
    deliver(e);
  }

  // Keeps the last max_entries events of every device from now on (0: stops and forgets them), as
  // torch.cuda.memory._record_memory_history(max_entries=...) does.
  void record_history(std::size_t max_entries) {
    const std::lock_guard<std::mutex> lock(mutex_);
    history_ = max_entries;
    for (auto& [device, d] : devices_) {
      d->book.max_entries = max_entries;
      while (d->book.trace.size() > max_entries) d->book.trace.pop_front();
    }
  }

  // The snapshot in torch.cuda.memory._snapshot()'s layout, as JSON: {"segments": [...],
  // "device_traces": [[...] per device index up to the largest used]}. A segment's blocks are its
  // live blocks ("active_allocated", at the size requested: the caching allocator's rounding shows
  // as "inactive") and the gaps between them ("inactive"); no stack frames.
  std::string snapshot_json() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    std::string out = "{\"segments\": [";
    const auto num = [](auto v) { return std::to_string(v); };
    bool first_segment = true;
    for (const auto& [device, d] : devices_) {
      for (const auto& [base, segment] : d->book.segments) {
        const auto [size, stream] = segment;
        std::string blocks;
        std::size_t allocated = 0, at = base;
        const auto block = [&](std::uintptr_t addr, std::size_t bytes, const char* st) {
          blocks += std::string(blocks.empty() ? "" : ", ") + "{\"address\": " + num(addr) + ", \"size\": " +
                    num(bytes) + ", \"requested_size\": " + num(bytes) + ", \"state\": \"" + st +
                    "\", \"frames\": []}";
        };
        for (auto it = d->book.blocks.lower_bound(base); it != d->book.blocks.end() && it->first < base + size; ++it) {
          if (it->first > at) block(at, it->first - at, "inactive");
          block(it->first, it->second.first, "active_allocated");
          allocated += it->second.first;
          at = it->first + it->second.first;
        }
        if (at < base + size) block(at, base + size - at, "inactive");
        out += std::string(first_segment ? "" : ", ") + "{\"device\": " + num(device) + ", \"address\": " +
               num(base) + ", \"total_size\": " + num(size) + ", \"allocated_size\": " + num(allocated) +
               ", \"active_size\": " + num(allocated) + ", \"requested_size\": " + num(allocated) +
               ", \"stream\": " + num(stream) + ", \"segment_type\": \"" +
               (size <= (std::size_t{2} << 20) ? "small" : "large") +
               "\", \"segment_pool_id\": [0, 0], \"is_expandable\": false, \"frames\": [], \"blocks\": [" +
               blocks + "]}";
        first_segment = false;
      }
    }
    out += "], \"device_traces\": [";
    const int devices = devices_.empty() ? 0 : devices_.rbegin()->first + 1;
    for (int i = 0; i < devices; ++i) {
      out += i == 0 ? "[" : ", [";
      if (const auto it = devices_.find(i); it != devices_.end()) {
        bool first = true;
        for (const trace_entry& e : it->second->book.trace) {
          out += std::string(first ? "" : ", ") + "{\"action\": \"" + e.action + "\", \"addr\": " + num(e.addr) +
                 ", \"size\": " + num(e.size) + ", \"stream\": " + num(e.stream) + ", \"time_us\": " +
                 num(e.time_us) + ", \"frames\": []" +
                 (std::string(e.action) == "oom" ? ", \"device_free\": " + num(e.device_free) : std::string()) + "}";
          first = false;
        }
      }
      out += "]";
    }
    return out + "]}";
  }

  // The report of the last refusal on this thread's call (the throwing hook raises it).
  static std::string& thread_refusal() {
    thread_local std::string r;
    return r;
  }

  std::string last_refusal() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return last_refusal_;
  }
  std::string last_error() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return last_error_;
  }
  void note_error(std::string what) {
    const std::lock_guard<std::mutex> lock(mutex_);
    last_error_ = std::move(what);
  }

 private:
  struct state {
    state(std::size_t budget, int device, std::size_t history) : alloc(budget, mb::caching_options{}, device) {
      alloc.upstream().upstream().book = &book;
      book.max_entries = history;
    }
    device_book book;  // before alloc: the caching allocator gives its segments back through it
    stack alloc;
    mb::pressure_level level = mb::pressure_level::normal;
    std::uint64_t refusals = 0;
    std::size_t others = 0;  // what the probe or set_others said last (the budget may refuse it)
  };
  struct event {
    int device;
    mb::pressure_level previous, level;
    std::size_t usage, limit;
  };

  state* existing(int device) {
    const auto it = devices_.find(device);
    return it == devices_.end() ? nullptr : it->second.get();
  }

  state& state_of(int device) {
    if (budget_ == 0) {
      throw mb::invalid_argument("budget", "a configured allocator", "none",
                                 "Call configure (membound.torch.use_allocator does) before the first allocation");
    }
    if (device < 0) throw mb::invalid_argument("device", "a device index, 0 or more", std::to_string(device), "");
    auto it = devices_.find(device);
    if (it == devices_.end()) it = devices_.emplace(device, std::make_unique<state>(budget_, device, history_)).first;
    return *it->second;
  }

  // Before the reserve grows: the others' bytes measured now (or, without a probe, the last
  // figure set, which the budget may have clamped since).
  void measure_others(state& d, int device) {
    const std::optional<std::size_t> others = Probe{}(device, d.alloc);
    set_external(d, others ? *others : d.others);
  }
  // The budget refuses others' bytes past its headroom (after releasing its cache): then it
  // counts as many as leave no headroom, so that nothing more is granted while others hold the
  // rest; the level counts all of them: that is the pressure to report.
  void set_external(state& d, std::size_t bytes) {
    d.others = bytes;
    try {
      d.alloc.set_external(bytes);
    } catch (const mb::out_of_memory&) {
      const std::size_t reserved = d.alloc.stats().reserved;
      d.alloc.set_external(d.alloc.limit() > reserved ? d.alloc.limit() - reserved : 0);
    }
  }

  std::optional<event> classify(state& d, int device) {
    const std::size_t limit = d.alloc.limit();
    const std::size_t usage = d.alloc.stats().reserved + std::max(d.others, d.alloc.external());
    const mb::pressure_monitor<> m(thresholds_);
    const mb::pressure_level next = m.classify(usage, limit);
    if (next == d.level) return std::nullopt;
    const event e{device, d.level, next, usage, limit};
    d.level = next;
    return e;
  }

  void deliver(const std::optional<event>& e) noexcept {
    pressure_callback cb = nullptr;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      cb = callback_;
    }
    if (e && cb != nullptr) {
      cb(e->device, static_cast<int>(e->previous), static_cast<int>(e->level), e->usage, e->limit);
    }
  }

  mutable std::mutex mutex_;
  std::size_t budget_ = 0;
  mb::pressure_thresholds thresholds_{};
  pressure_callback callback_ = nullptr;
  std::map<int, std::unique_ptr<state>> devices_;
  std::uint64_t bad_frees_ = 0;
  std::size_t history_ = 0;  // record_history's max_entries, for devices used later too
  std::string last_refusal_, last_error_;
};

}  // namespace membound_python
