// Must NOT compile: a budget can only refuse before the upstream call when the upstream predicts
// its growth, so budget_allocator over an allocator without growth_for must say so
// (tests/CMakeLists.txt matches the sentence).
#include "membound/memory/budget.hpp"
#include "membound/memory/system_allocator.hpp"

struct no_growth_for {
  static constexpr membound::memory_space space = membound::memory_space::host;
  void* allocate(std::size_t n, std::size_t a, membound::memory_tag t) { return inner.allocate(n, a, t); }
  void deallocate(void* p, std::size_t n, std::size_t a, membound::memory_tag t) {
    inner.deallocate(p, n, a, t);
  }
  membound::memory_stats stats() const { return inner.stats(); }
  membound::system_allocator inner;
};

int main() { membound::budget_allocator<no_growth_for> b(1024); }
