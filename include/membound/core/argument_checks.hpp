// The argument checks every public call makes, one family for the whole library: a buffer that
// is missing, misaligned or too small is a typed error naming the argument, what was expected and
// what to do (core/error.hpp), before anything runs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "membound/core/config.hpp"
#include "membound/core/error.hpp"

MEMBOUND_NAMESPACE_BEGIN

namespace detail {

// A buffer the call cannot run without (host or device memory: only its address is read).
inline void need_pointer(const void* p, const char* name) {
  if (p == nullptr) {
    throw invalid_argument(name, "a non-null pointer", "nullptr",
                           "Pass the buffer (its shape is in the function's header)");
  }
}

// A base address at a multiple of `alignment` bytes.
inline void need_aligned(const void* p, std::size_t alignment, const char* name) {
  const auto addr = reinterpret_cast<std::uintptr_t>(p);
  if (addr % alignment != 0) {
    throw invalid_argument(name, "a base aligned to " + std::to_string(alignment) + " bytes",
                           "an address " + std::to_string(addr % alignment) + " bytes past such a boundary",
                           "Allocate it with at least that alignment");
  }
}

// A buffer of at least `required` bytes (none needed when required is 0): workspace_too_small
// naming it otherwise.
inline void need_space(const void* p, std::size_t given, std::size_t required, const char* name) {
  if (required != 0 && (p == nullptr || given < required)) {
    throw workspace_too_small(name, required, p == nullptr ? 0 : given);
  }
}

}  // namespace detail

MEMBOUND_NAMESPACE_END
