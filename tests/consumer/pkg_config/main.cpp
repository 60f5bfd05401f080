// A project without CMake: compiled with `pkg-config --cflags membound` only.
#include <membound/memory/budget.hpp>
#include <membound/memory/system_allocator.hpp>

#include <cstdio>

int main() {
  membound::budget_allocator<membound::system_allocator> a(1 << 20);
  void* p = a.allocate(4096);
  a.deallocate(p, 4096);
  const bool ok = p != nullptr && a.stats().peak_requested == 4096 && a.stats().requested == 0;
  std::printf("consumer_pkg_config: %s\n", ok ? "OK" : "FAILED");
  return ok ? 0 : 1;
}
