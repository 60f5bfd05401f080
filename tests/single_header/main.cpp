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

  // The attention layer instantiated here too, so that nvcc's host pass compiles its kernels:
  // a tiny fp32 forward, backward and decoding step must produce finite numbers.
  {
    using attn = mb::attention<mb::attention_tiles<8, 8>>;
    mb::attention_shape s;
    s.batch = 1;
    s.seq = 5;
    s.d_model = 8;
    s.heads = 2;
    s.kv_heads = 1;
    s.head_dim = 8;
    EXPECT(attn::can_implement(s).ok);
    mb::thread_pool pool(2);
    float w[8 * 16 + 2 * 8 * 8 + 16 * 8], x[5 * 8], y[5 * 8], dx[5 * 8], g[sizeof(w) / 4] = {};
    for (unsigned i = 0; i < sizeof(w) / 4; ++i) w[i] = static_cast<float>(i % 7) * 0.05f - 0.15f;
    for (unsigned i = 0; i < 40; ++i) x[i] = static_cast<float>(i % 5) * 0.2f - 0.4f;
    const attn::weights wt{w, w + 128, w + 192, w + 256};
    const attn::gradients gt{g, g + 128, g + 192, g + 256};
    mb::system_allocator a;
    const std::size_t sb = attn::saved_bytes(s), fb = attn::forward_workspace_bytes(s, 2),
                      bb = attn::backward_workspace_bytes(s, 2);
    void* saved = a.allocate(sb, 256, mb::memory_tag::activations);
    void* ws = a.allocate(bb > fb ? bb : fb, 256, mb::memory_tag::workspace);
    attn::forward(s, wt, x, y, saved, sb, ws, fb, pool);
    attn::backward(s, wt, x, saved, sb, y, dx, gt, ws, bb, pool);
    bool finite = true;
    for (float e : dx) finite = finite && e == e;
    EXPECT(finite);
    const std::size_t cb = attn::kv_cache_bytes(s, 4), stb = attn::step_workspace_bytes(s, 4, 2);
    void* cache_bytes = a.allocate(cb, 256, mb::memory_tag::activations);
    void* step_ws = a.allocate(stb, 256, mb::memory_tag::workspace);
    attn::kv_cache cache = attn::make_kv_cache(s, cache_bytes, cb, 4);
    float y_t[8];
    attn::step(s, wt, cache, x, y_t, step_ws, stb, pool);
    EXPECT(cache.length == 1);
    // Position 0 sees only itself, as the forward's first row does.
    EXPECT(y_t[0] - y[0] < 1e-5f && y[0] - y_t[0] < 1e-5f);
    a.deallocate(step_ws, stb, 256, mb::memory_tag::workspace);
    a.deallocate(cache_bytes, cb, 256, mb::memory_tag::activations);
    a.deallocate(ws, bb > fb ? bb : fb, 256, mb::memory_tag::workspace);
    a.deallocate(saved, sb, 256, mb::memory_tag::activations);
  }

  if (failures == 0) std::printf("single header OK (membound %d.%d.%d)\n", mb::version.major,
                                 mb::version.minor, mb::version.patch);
  return failures == 0 ? 0 : 1;
}
