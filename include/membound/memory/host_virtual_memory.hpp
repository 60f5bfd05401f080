// host_virtual_memory: the virtual_memory_backend for host memory, on POSIX mmap.
//   reserve  = mmap(PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE), trimmed to alignment
//   commit   = mprotect(PROT_READ | PROT_WRITE)
//   decommit = madvise(MADV_DONTNEED) + mprotect(PROT_NONE)
//   release  = munmap
// PROT_NONE on uncommitted parts makes a stray access fault at once instead of silently growing
// the footprint. Linux and other POSIX systems only.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "membound/core/config.hpp"
#include "membound/core/error.hpp"
#include "membound/memory/allocator.hpp"
#include "membound/core/memory_tag.hpp"
#include "membound/memory/virtual_memory.hpp"

MEMBOUND_NAMESPACE_BEGIN

class host_virtual_memory {
 public:
  static constexpr memory_space space = memory_space::host;
  // 2 MiB, a transparent huge page: commits of this size can be backed by huge pages.
  static constexpr std::size_t default_granularity = std::size_t{2} << 20;

  // granularity: a power of two, at least the system page size.
  explicit host_virtual_memory(std::size_t granularity = default_granularity)
      : granularity_(granularity) {
    const std::size_t page = page_size();
    if (!is_power_of_two(granularity) || granularity < page) {
      throw invalid_argument("granularity",
                             "a power of two no smaller than the page size (" +
                                 std::to_string(page) + ")",
                             std::to_string(granularity), "Use the default of 2 MiB");
    }
  }

  std::size_t granularity() const noexcept { return granularity_; }

  // Reserves address space aligned to granularity(): maps granularity() extra bytes and unmaps
  // the unaligned head and tail.
  void* reserve(std::size_t bytes) {
    check_multiple("bytes", bytes, "reserve");
    if (bytes > SIZE_MAX - granularity_) fail_oom("mmap", ENOMEM, bytes);
    const std::size_t span = bytes + granularity_;
    void* raw = ::mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED) {
      const int e = errno;
      if (e == ENOMEM) fail_oom("mmap(PROT_NONE, MAP_NORESERVE)", e, bytes);
      throw backend_error("mmap(PROT_NONE, MAP_NORESERVE)", e, std::strerror(e));
    }
    const auto start = reinterpret_cast<std::uintptr_t>(raw);
    const std::uintptr_t aligned = align_up(start, granularity_);
    const std::size_t head = aligned - start, tail = span - head - bytes;
    // Trimming cannot fail for ranges we just mapped; if it did, the bytes stay reserved harmlessly.
    if (head != 0) ::munmap(raw, head);
    if (tail != 0) ::munmap(reinterpret_cast<void*>(aligned + bytes), tail);
    try {
      ranges_.push_back({aligned, bytes});
    } catch (...) {
      ::munmap(reinterpret_cast<void*>(aligned), bytes);
      throw;
    }
    return reinterpret_cast<void*>(aligned);
  }

  void commit(void* p, std::size_t bytes) {
    check_multiple("p", reinterpret_cast<std::uintptr_t>(p), "commit");
    check_multiple("bytes", bytes, "commit");
    check_reserved(p, bytes);  // else mprotect's ENOMEM would pass for an out-of-memory
    if (::mprotect(p, bytes, PROT_READ | PROT_WRITE) != 0) {
      const int e = errno;
      if (e == ENOMEM) fail_oom("mprotect(PROT_READ|PROT_WRITE)", e, bytes);
      throw backend_error("mprotect(PROT_READ|PROT_WRITE)", e, std::strerror(e));
    }
  }

  // MADV_DONTNEED drops the pages now (a private anonymous mapping reads back as zeros);
  // PROT_NONE then makes stray accesses fault. Failures cannot be reported from a noexcept
  // release path and leave at worst memory that stays resident until release.
  void decommit(void* p, std::size_t bytes) noexcept {
    ::madvise(p, bytes, MADV_DONTNEED);
    ::mprotect(p, bytes, PROT_NONE);
  }

  void release(void* p, std::size_t bytes) noexcept {
    ::munmap(p, bytes);
    const auto base = reinterpret_cast<std::uintptr_t>(p);
    std::erase_if(ranges_, [base](const range& r) { return r.base == base; });
  }

  static std::size_t page_size() noexcept {
    const long v = ::sysconf(_SC_PAGESIZE);
    return v > 0 ? static_cast<std::size_t>(v) : 4096;
  }

 private:
  struct range {
    std::uintptr_t base;
    std::size_t size;
  };

  void check_reserved(void* p, std::size_t bytes) const {
    const auto at = reinterpret_cast<std::uintptr_t>(p);
    for (const range& r : ranges_) {
      if (at >= r.base && at - r.base <= r.size && bytes <= r.size - (at - r.base)) return;
    }
    char buf[32];
    std::snprintf(buf, sizeof buf, "%p", p);
    throw invalid_argument("p", "a range inside one reserved by this host_virtual_memory's "
                                "reserve() and not yet released",
                           std::string(buf) + " + " + std::to_string(bytes) + " B",
                           "Commit only addresses returned by reserve(), within the reserved size");
  }

  void check_multiple(const char* argument, std::size_t v, const char* call) const {
    if (v == 0 || v % granularity_ != 0) {
      throw invalid_argument(argument,
                             std::string("a nonzero multiple of the granularity (") +
                                 std::to_string(granularity_) + ") for host_virtual_memory::" + call,
                             std::to_string(v), "Round to granularity()");
    }
  }

  [[noreturn]] static void fail_oom(const char* call, int e, std::size_t bytes) {
    oom_report r;
    r.source = "host_virtual_memory";
    r.requested = r.growth_needed = bytes;
    r.detail = std::string(call) + " failed: " + std::strerror(e) + " (errno " + std::to_string(e) + ")";
    r.hint = "the host cannot back this much memory: check ulimit -v, vm.overcommit_memory and "
             "vm.max_map_count, or lower the capacity or the workload";
    throw out_of_memory(std::move(r));
  }

  std::size_t granularity_;
  std::vector<range> ranges_;  // what reserve() handed out, so commit can reject foreign ranges
};

static_assert(check_virtual_memory<host_virtual_memory>());

MEMBOUND_NAMESPACE_END
