// Built with only single_include/ on the include path (g++, and as .cu with nvcc): the
// amalgamated header must stand alone and behave like the multi-header library.
#include <membound/membound.hpp>

#include <cstdint>
#include <cstdio>

namespace mb = membound;

static int failures = 0;
#define EXPECT(cond)                                              \
  do {                                                            \
    if (!(cond)) {                                                \
      std::fprintf(stderr, "%s:%d: FAILED: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                 \
    }                                                             \
  } while (0)

int main() {
  EXPECT(mb::version.major == MEMBOUND_VERSION_MAJOR);
  EXPECT(mb::version.minor == MEMBOUND_VERSION_MINOR);

  mb::system_allocator sys;
  void* p = sys.allocate(1000, 4096, mb::memory_tag::weights);
  EXPECT(reinterpret_cast<std::uintptr_t>(p) % 4096 == 0);
  EXPECT(sys.stats().tag(mb::memory_tag::weights).current == 1000);
  sys.deallocate(p, 1000, 4096, mb::memory_tag::weights);
  EXPECT(sys.stats().requested == 0);

  // The cache serves the second request from the first one's segment: one upstream call.
  mb::caching_allocator<> cache;
  void* a = cache.allocate(4096, 256, mb::memory_tag::activations);
  cache.deallocate(a, 4096, 256, mb::memory_tag::activations);
  void* b = cache.allocate(4096, 256, mb::memory_tag::activations);
  EXPECT(a == b);
  EXPECT(cache.upstream().stats().upstream_allocations == 1);
  cache.deallocate(b, 4096, 256, mb::memory_tag::activations);

  try {
    (void)sys.allocate(16, 3, mb::memory_tag::other);
    EXPECT(false);
  } catch (const mb::invalid_argument& e) {
    EXPECT(e.argument() == "alignment");
  }

  if (failures == 0) std::printf("single header OK (membound %d.%d.%d)\n", mb::version.major,
                                 mb::version.minor, mb::version.patch);
  return failures == 0 ? 0 : 1;
}
