// Must NOT compile: the type has everything an allocator needs except deallocate, and
// check_allocator must say exactly that (tests/CMakeLists.txt matches the sentence).
#include "membound/memory/allocator.hpp"

struct no_deallocate {
  static constexpr membound::memory_space space = membound::memory_space::host;
  void* allocate(std::size_t, std::size_t, membound::memory_tag) { return nullptr; }
  membound::memory_stats stats() const { return {}; }
};

static_assert(membound::check_allocator<no_deallocate>());

int main() {}
