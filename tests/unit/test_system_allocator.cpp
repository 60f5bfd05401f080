#include <doctest/doctest.h>

#include <cstdint>

#include "membound/memory/system_allocator.hpp"

using namespace membound;

TEST_CASE("system_allocator: aligned, counted per tag, zero bytes gives null") {
  system_allocator a;
  void* p = a.allocate(1000, 4096, memory_tag::weights);
  CHECK(reinterpret_cast<std::uintptr_t>(p) % 4096 == 0);
  CHECK(a.stats().tag(memory_tag::weights).current == 1000);
  CHECK(a.stats().reserved == 1000);
  CHECK(a.allocate(0, 256, memory_tag::other) == nullptr);
  a.deallocate(p, 1000, 4096, memory_tag::weights);
  CHECK(a.stats().requested == 0);
  CHECK(a.stats().tag(memory_tag::weights).peak == 1000);
  CHECK(a.stats().upstream_calls() == 2);
}

TEST_CASE("system_allocator: bad alignment is a typed error naming the argument") {
  system_allocator a;
  try {
    (void)a.allocate(10, 3, memory_tag::other);
    FAIL("expected invalid_argument");
  } catch (const invalid_argument& e) {
    CHECK(e.argument() == "alignment");
  }
  CHECK(a.stats().allocations == 0);
}
