// Device memory on a real GPU: caching_allocator<cuda_device_allocator> is stream-ordered (a
// block used on another stream is not handed out again while a kernel there still writes it),
// pinned host memory round-trips through the device, cudaMemGetInfo feeds a budget's external
// bytes, and a budget over the CUDA expandable arena counts what the arena commits. Without a
// device it prints why and exits 77 (ctest: skipped).
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cuda_test_support.cuh"

namespace mb = membound;
using mbt::failures;

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

// Spins for `cycles` clock cycles, then fills out[0, n) with `value`: a writer that is still
// running long after the host has moved on.
__global__ void spin_then_fill(std::uint32_t* out, std::size_t n, std::uint32_t value, long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
    __nanosleep(1000);
  }
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += std::size_t{gridDim.x} * blockDim.x) {
    out[i] = value;
  }
}

void launch_spin_fill(void* p, std::size_t bytes, std::uint32_t value, long long cycles, cudaStream_t s) {
  spin_then_fill<<<64, 256, 0, s>>>(static_cast<std::uint32_t*>(p), bytes / sizeof(std::uint32_t), value, cycles);
  mb::cuda_check(cudaGetLastError(), "spin_then_fill launch");
}

bool holds(const void* device_ptr, std::size_t bytes, std::uint32_t value) {
  std::vector<std::uint32_t> host(bytes / sizeof(std::uint32_t), 0);
  if (cudaMemcpy(host.data(), device_ptr, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) return false;
  for (std::uint32_t v : host) {
    if (v != value) return false;
  }
  return true;
}

// About a quarter of a second of spinning at the device's clock rate.
long long long_spin_cycles() {
  int khz = 0;
  if (cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0) != cudaSuccess || khz <= 0) {
    (void)cudaGetLastError();
    khz = 1500000;
  }
  return static_cast<long long>(khz) * 250;
}

struct stream_pair {
  cudaStream_t a = nullptr, b = nullptr;
  stream_pair() {
    mb::cuda_check(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    mb::cuda_check(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  }
  ~stream_pair() {
    (void)cudaStreamSynchronize(a);
    (void)cudaStreamSynchronize(b);
    (void)cudaStreamDestroy(a);
    (void)cudaStreamDestroy(b);
  }
  stream_pair(const stream_pair&) = delete;
  stream_pair& operator=(const stream_pair&) = delete;
};

void test_record_stream_defers_reuse() {
  stream_pair s;
  const mb::stream_id sa = mb::cuda_device_allocator::to_stream_id(s.a);
  const mb::stream_id sb = mb::cuda_device_allocator::to_stream_id(s.b);
  const std::size_t bytes = 4 * MiB;
  mb::caching_allocator<mb::cuda_device_allocator> cache;

  // Allocated on stream a, handed to a slow writer on stream b, freed at once.
  void* p = cache.allocate(bytes, 256, mb::memory_tag::activations, sa);
  launch_spin_fill(p, bytes, 0xB0B0B0B0u, long_spin_cycles(), s.b);
  cache.record_stream(p, sb);
  cache.deallocate(p, bytes, 256, mb::memory_tag::activations);
  const bool b_busy = cudaStreamQuery(s.b) == cudaErrorNotReady;
  (void)cudaGetLastError();
  CHECK(b_busy);  // a quarter second of spinning: the writer cannot be done yet
  CHECK(cache.pending_blocks() == 1);
  CHECK(cache.pending_bytes() >= bytes);

  // Stream a asks for the same size while b still writes: it must get other memory.
  void* q = cache.allocate(bytes, 256, mb::memory_tag::activations, sa);
  if (b_busy) CHECK(q != p);
  launch_spin_fill(q, bytes, 0xA0A0A0A0u, 0, s.a);
  // Stream b too gets other memory: the block belongs to stream a.
  void* r = cache.allocate(bytes, 256, mb::memory_tag::activations, sb);
  CHECK(r != p);
  mb::cuda_check(cudaStreamSynchronize(s.a), "cudaStreamSynchronize");
  mb::cuda_check(cudaStreamSynchronize(s.b), "cudaStreamSynchronize");
  CHECK(holds(p, bytes, 0xB0B0B0B0u));  // b's pattern was not overwritten early
  CHECK(holds(q, bytes, 0xA0A0A0A0u));

  // Once b is done, the block is reusable on stream a, and its event goes back to the pool.
  CHECK(cache.process_events() == 1);
  CHECK(cache.pending_blocks() == 0);
  CHECK(cache.upstream().spare_events() == 1);
  cache.deallocate(q, bytes, 256, mb::memory_tag::activations);
  cache.deallocate(r, bytes, 256, mb::memory_tag::activations);
  void* again = cache.allocate(bytes, 256, mb::memory_tag::activations, sa);
  CHECK(again == p || again == q);
  cache.deallocate(again, bytes, 256, mb::memory_tag::activations);
  CHECK(cache.check_invariants());
}

void test_same_stream_reuse_is_immediate() {
  stream_pair s;
  const mb::stream_id sa = mb::cuda_device_allocator::to_stream_id(s.a);
  const std::size_t bytes = 2 * MiB;
  mb::caching_allocator<mb::cuda_device_allocator> cache;
  void* p = cache.allocate(bytes, 256, mb::memory_tag::activations, sa);
  launch_spin_fill(p, bytes, 0x11111111u, long_spin_cycles() / 4, s.a);
  cache.deallocate(p, bytes, 256, mb::memory_tag::activations);  // no sync: stream order protects it
  void* q = cache.allocate(bytes, 256, mb::memory_tag::activations, sa);
  CHECK(q == p);
  CHECK(cache.pending_blocks() == 0);
  CHECK(cache.upstream().spare_events() == 0);  // no event was needed
  launch_spin_fill(q, bytes, 0x22222222u, 0, s.a);  // runs after the first writer, on the same stream
  mb::cuda_check(cudaStreamSynchronize(s.a), "cudaStreamSynchronize");
  CHECK(holds(q, bytes, 0x22222222u));
  cache.deallocate(q, bytes, 256, mb::memory_tag::activations);
  cache.release_cached();
  CHECK(cache.stats().reserved == 0);
}

void test_pinned_round_trip() {
  mb::cuda_pinned_allocator pinned;
  const std::size_t bytes = 3 * MiB;
  void* h = pinned.allocate(bytes, 4096, mb::memory_tag::other);
  void* back = pinned.allocate(bytes, 256, mb::memory_tag::other);
  CHECK(reinterpret_cast<std::uintptr_t>(h) % 4096 == 0);
  cudaPointerAttributes attr{};
  mb::cuda_check(cudaPointerGetAttributes(&attr, h), "cudaPointerGetAttributes");
  CHECK(attr.type == cudaMemoryTypeHost);  // page-locked, registered with CUDA
  std::memset(h, 0x5c, bytes);
  std::memset(back, 0, bytes);
  stream_pair s;
  mbt::device_buffer<unsigned char> d(bytes);
  mb::cuda_check(cudaMemcpyAsync(d.get(), h, bytes, cudaMemcpyHostToDevice, s.a), "cudaMemcpyAsync");
  mb::cuda_check(cudaMemcpyAsync(back, d.get(), bytes, cudaMemcpyDeviceToHost, s.a), "cudaMemcpyAsync");
  mb::cuda_check(cudaStreamSynchronize(s.a), "cudaStreamSynchronize");
  CHECK(std::memcmp(h, back, bytes) == 0);
  CHECK(pinned.stats().reserved == 2 * bytes + (4096 - 256));
  pinned.deallocate(h, bytes, 4096, mb::memory_tag::other);
  pinned.deallocate(back, bytes, 256, mb::memory_tag::other);
  CHECK(pinned.stats().reserved == 0);

  // Cached pinned staging buffers: the second request makes no cudaHostAlloc call.
  mb::caching_allocator<mb::cuda_pinned_allocator> cache;
  void* x = cache.allocate(MiB, 256, mb::memory_tag::other);
  cache.deallocate(x, MiB, 256, mb::memory_tag::other);
  void* y = cache.allocate(MiB, 256, mb::memory_tag::other);
  CHECK(x == y);
  CHECK(cache.upstream().stats().upstream_allocations == 1);
  cache.deallocate(y, MiB, 256, mb::memory_tag::other);
}

void test_memory_info_feeds_budget() {
  const int device = mb::cuda_current_device();
  const mb::device_memory before = mb::device_memory_info(device);
  CHECK(before.total > 0);
  CHECK(before.free <= before.total);

  using stack = mb::budget_allocator<mb::caching_allocator<mb::cuda_device_allocator>>;
  stack budget(before.total);
  void* p = budget.allocate(64 * MiB, 256, mb::memory_tag::activations);
  const mb::device_memory during = mb::device_memory_info(device);
  CHECK(during.free + 64 * MiB <= before.free + 2 * MiB);  // the device saw our segment

  const std::size_t others = mb::update_external_from_device(budget, device);
  CHECK(budget.external() == others);
  CHECK(others > 0);  // at least the CUDA context itself, which no allocator of ours holds
  CHECK(others <= during.used());
  CHECK(budget.usage() == others + budget.upstream().stats().reserved);
  CHECK(mb::others_bytes(during, during.used() + 1) == 0);  // saturates

  budget.deallocate(p, 64 * MiB, 256, mb::memory_tag::activations);
}

void test_budget_over_cuda_arena() {
  const std::size_t g = mb::cuda_virtual_memory{}.granularity();
  mb::budget_allocator<mb::cuda_expandable_arena> budget(4 * g, mb::expandable_arena_options{16 * g});
  void* a = budget.allocate(g, 256, mb::memory_tag::weights);
  void* b = budget.allocate(2 * g, 256, mb::memory_tag::activations);
  CHECK(budget.usage() == budget.upstream().committed());
  CHECK(budget.stats().reserved == 3 * g);
  CHECK(budget.stats().tag(mb::memory_tag::weights).current == g);
  CHECK(budget.stats().tag(mb::memory_tag::activations).current == 2 * g);
  CHECK(budget.upstream().vm().committed_bytes() == 3 * g);
  try {
    (void)budget.allocate(2 * g, 256, mb::memory_tag::activations);  // would commit past 4 g
    CHECK(false);
  } catch (const mb::out_of_memory& e) {
    CHECK(e.report().source == "budget");
    CHECK(e.report().budget == 4 * g);
  }
  CHECK(budget.stats().failed_allocations == 1);
  CHECK(budget.upstream().committed() == 3 * g);  // refused before any commit
  budget.deallocate(b, 2 * g, 256, mb::memory_tag::activations);
  budget.release_cached();
  CHECK(budget.usage() == g);
  CHECK(budget.upstream().vm().committed_bytes() == g);
  budget.deallocate(a, g, 256, mb::memory_tag::weights);
  CHECK(budget.upstream().check_invariants());
}

}  // namespace

// The hazard safe stream defaults close: an executor's kernel still writes a block the host has
// freed. Through the executor's stream_view the block stays with the executor's stream, so a
// request without a stream (the legacy stream's, as every plain allocate was before) gets other
// memory, and a synchronous copy into that memory cannot race the kernel.
void test_executor_view_keeps_freed_blocks_on_its_stream() {
  mb::cuda_executor ex;
  const std::size_t bytes = 4 * MiB;
  mb::budget_allocator<mb::caching_allocator<mb::cuda_device_allocator>> alloc(64 * MiB);
  mb::stream_view mem(alloc, mb::stream_of(ex));
  CHECK(mem.stream() == mb::cuda_device_allocator::to_stream_id(ex.stream()));
  void* p = mem.allocate(bytes);
  launch_spin_fill(p, bytes, 0xC0C0C0C0u, long_spin_cycles(), ex.stream());
  mem.deallocate(p, bytes);  // the kernel is still spinning
  const bool busy = cudaStreamQuery(ex.stream()) == cudaErrorNotReady;
  (void)cudaGetLastError();
  CHECK(busy);
  void* legacy = alloc.allocate(bytes);  // no stream: the legacy stream's pool
  CHECK(legacy != p);
  CHECK(alloc.upstream().block_stream(legacy) == mb::host_stream);
  mb::cuda_check(cudaMemset(legacy, 0, bytes), "cudaMemset");  // legacy stream, synchronous
  ex.synchronize();
  CHECK(holds(p, bytes, 0xC0C0C0C0u));  // the kernel's write landed where it was meant to
  CHECK(holds(legacy, bytes, 0u));
  void* again = mem.allocate(bytes);  // the executor's own later work: the same block at once
  CHECK(again == p);
  mem.deallocate(again, bytes);
  alloc.deallocate(legacy, bytes);
  alloc.upstream().release_cached();
  CHECK(alloc.stats().reserved == 0);
}

int main() {
  static constexpr mbt::test_case cases[] = {
      {"record_stream defers reuse across streams", test_record_stream_defers_reuse},
      {"same-stream reuse is immediate and ordered", test_same_stream_reuse_is_immediate},
      {"an executor's stream_view keeps freed blocks on its stream", test_executor_view_keeps_freed_blocks_on_its_stream},
      {"cuda_pinned_allocator round trip", test_pinned_round_trip},
      {"cudaMemGetInfo feeds the budget's external bytes", test_memory_info_feeds_budget},
      {"budget over cuda_expandable_arena", test_budget_over_cuda_arena}};
  return mbt::run_suite("test_cuda_memory", cases);
}
