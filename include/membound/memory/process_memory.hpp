// What the operating system says this process holds: the resident set now and at its peak, the
// numbers a user sees in `top`. A plan states what its allocator stack reserves; this is how a
// program checks that the process as a whole stays near it (the example trainer reports both).
//
//   membound::reset_peak_rss();                       // where supported: the peak restarts here
//   auto before = membound::process_memory();
//   ... train ...
//   auto after = membound::process_memory();          // after.peak_rss - before.rss: the run's growth
#pragma once

#include <cstddef>
#include <cstdio>
#include <cstring>

#include "membound/core/config.hpp"

MEMBOUND_NAMESPACE_BEGIN

struct process_memory_info {
  std::size_t rss = 0;       // resident bytes now
  std::size_t peak_rss = 0;  // the most resident bytes since start, or since reset_peak_rss()
  bool known = false;        // false where the system does not say (then both are 0)
};

// Reads /proc/self/status (VmRSS, VmHWM) on Linux; elsewhere reports nothing. (No <sys/resource.h>:
// it would put POSIX names such as stack_t into every includer's global namespace.)
inline process_memory_info process_memory() noexcept {
  process_memory_info m;
#if defined(__linux__)
  if (std::FILE* f = std::fopen("/proc/self/status", "r")) {
    char line[256];
    while (std::fgets(line, sizeof line, f) != nullptr) {
      unsigned long long kib = 0;
      if (std::sscanf(line, "VmRSS: %llu kB", &kib) == 1) m.rss = static_cast<std::size_t>(kib) * 1024;
      if (std::sscanf(line, "VmHWM: %llu kB", &kib) == 1) m.peak_rss = static_cast<std::size_t>(kib) * 1024;
    }
    std::fclose(f);
    m.known = m.rss != 0 && m.peak_rss != 0;
  }
#endif
  return m;
}

// Restarts the peak (VmHWM) at the current resident set, so that a later peak_rss belongs to what
// ran after this call. Linux 4.0 and later (/proc/self/clear_refs); returns false where it could
// not, and then peak_rss keeps counting from the start of the process.
inline bool reset_peak_rss() noexcept {
#if defined(__linux__)
  if (std::FILE* f = std::fopen("/proc/self/clear_refs", "w")) {
    const bool ok = std::fputs("5", f) >= 0;
    return std::fclose(f) == 0 && ok;
  }
#endif
  return false;
}

MEMBOUND_NAMESPACE_END
