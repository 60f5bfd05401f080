#include <membound/membound.hpp>

#include <cstdio>

int main() {
  membound::system_allocator a;
  void* p = a.allocate(64, 64, membound::memory_tag::other);
  a.deallocate(p, 64, 64, membound::memory_tag::other);
  const bool ok = p != nullptr && a.stats().allocations == 1 && a.stats().requested == 0;
  std::printf("consumer: membound %d.%d.%d %s\n", membound::version.major,
              membound::version.minor, membound::version.patch, ok ? "OK" : "FAILED");
  return ok ? 0 : 1;
}
