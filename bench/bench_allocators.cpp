// Allocator policies under two workloads, all in one run so ratios are comparable:
//   1. allocate/free latency against malloc/free, at three sizes and in a batch pattern;
//   2. a training-like fragmentation scenario, reporting reserved / peak-requested bytes.
//
// Run: ./build/release/bench/bench_allocators --benchmark_counters_tabular=true
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdlib>
#include <random>
#include <vector>

#include "membound/membound.hpp"

#include "benchmark_main.hpp"

namespace mb = membound;

namespace {

// malloc as the policies see it: the baseline every ratio is taken against.
struct malloc_policy {
  static constexpr mb::memory_space space = mb::memory_space::host;
  void* allocate(std::size_t bytes, std::size_t alignment, mb::memory_tag) {
    return std::aligned_alloc(alignment, mb::align_up(bytes, alignment));
  }
  void deallocate(void* p, std::size_t, std::size_t, mb::memory_tag) { std::free(p); }
  mb::memory_stats stats() const { return {}; }
};

using caching = mb::caching_allocator<mb::system_allocator>;
using arena = mb::expandable_arena<mb::host_virtual_memory>;
using budget_caching = mb::budget_allocator<caching>;

template <typename A>
A make() {
  if constexpr (std::is_same_v<A, budget_caching>) {
    return A(std::size_t{8} << 30);
  } else {
    return A();
  }
}

// Steady state of one size: after warm-up, a cache serves every request without upstream calls.
template <typename A>
void BM_alloc_free(benchmark::State& state) {
  A a = make<A>();
  const auto bytes = static_cast<std::size_t>(state.range(0));
  for (auto _ : state) {
    void* p = a.allocate(bytes, mb::default_alignment, mb::memory_tag::activations);
    benchmark::DoNotOptimize(p);
    a.deallocate(p, bytes, mb::default_alignment, mb::memory_tag::activations);
  }
  state.SetItemsProcessed(state.iterations());
}

// 64 live blocks of mixed sizes freed in reverse: exercises best-fit, split and coalesce.
template <typename A>
void BM_batch_mixed(benchmark::State& state) {
  A a = make<A>();
  std::mt19937_64 rng(42);
  std::vector<std::size_t> sizes(64);
  for (auto& s : sizes) s = std::size_t{256} << (rng() % 14);  // 256 B .. 2 MiB
  std::vector<void*> ptrs(sizes.size());
  for (auto _ : state) {
    for (std::size_t i = 0; i < sizes.size(); ++i)
      ptrs[i] = a.allocate(sizes[i], mb::default_alignment, mb::memory_tag::activations);
    for (std::size_t i = sizes.size(); i-- > 0;)
      a.deallocate(ptrs[i], sizes[i], mb::default_alignment, mb::memory_tag::activations);
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(sizes.size()));
}

#define MEMBOUND_LATENCY(A, name)                                                          \
  BENCHMARK(BM_alloc_free<A>)->Name("alloc_free/" name)->Arg(256)->Arg(64 << 10)->Arg(4 << 20); \
  BENCHMARK(BM_batch_mixed<A>)->Name("batch64_mixed/" name)

MEMBOUND_LATENCY(malloc_policy, "malloc");
MEMBOUND_LATENCY(mb::system_allocator, "system");
MEMBOUND_LATENCY(caching, "caching");
MEMBOUND_LATENCY(arena, "expandable_arena");
MEMBOUND_LATENCY(budget_caching, "budget<caching>");

// A training loop in allocation terms. Weights live forever; each step draws a sequence length
// (variable-length batches are what fragments PyTorch's cache), allocates per-layer activations
// in forward with attention scratch freed at once, then in backward frees activations in reverse
// while gradient buffers appear on the first step and optimizer state on the first update: long-
// lived blocks landing between short-lived ones, the classic fragmentation pattern.
template <typename A>
void BM_training_fragmentation(benchmark::State& state) {
  constexpr std::size_t layers = 12, width = 768, batch = 8, max_t = 1024, vocab = 50304;
  constexpr std::size_t f = sizeof(float);
  constexpr std::size_t al = mb::default_alignment;
  using mb::memory_tag;
  for (auto _ : state) {
    A a = make<A>();
    std::mt19937_64 rng(7);
    struct block { void* p; std::size_t n; memory_tag t; };
    auto alloc = [&](std::size_t n, memory_tag t) { return block{a.allocate(n, al, t), n, t}; };
    auto release = [&](const block& b) { a.deallocate(b.p, b.n, al, b.t); };

    std::vector<block> weights, grads, optim;
    weights.push_back(alloc(vocab * width * f, memory_tag::weights));
    for (std::size_t l = 0; l < layers; ++l) {
      weights.push_back(alloc(4 * width * width * f, memory_tag::weights));   // qkv + out
      weights.push_back(alloc(8 * width * width * f, memory_tag::weights));   // mlp
      weights.push_back(alloc(2 * width * f, memory_tag::weights));           // norms
    }
    for (int step = 0; step < 20; ++step) {
      const std::size_t t = max_t / 4 + rng() % (3 * max_t / 4 + 1);
      const std::size_t tok = batch * t;
      std::vector<block> acts;
      for (std::size_t l = 0; l < layers; ++l) {
        acts.push_back(alloc(tok * width * f, memory_tag::activations));      // norm out
        acts.push_back(alloc(3 * tok * width * f, memory_tag::activations));  // q, k, v
        block scratch = alloc(tok * 64 * f + 4096, memory_tag::workspace);    // attention tiles
        acts.push_back(alloc(tok * width * f, memory_tag::activations));      // attention out
        release(scratch);
        acts.push_back(alloc(4 * tok * width * f, memory_tag::activations));  // mlp hidden
        acts.push_back(alloc(tok * width * f, memory_tag::activations));      // residual
      }
      block logits = alloc(tok / 8 * vocab * f, memory_tag::activations);     // chunked loss
      release(logits);
      for (std::size_t i = acts.size(); i-- > 0;) {
        if (step == 0 && i % 5 == 0) {
          const std::size_t w = grads.size() + 1;
          if (w < weights.size()) grads.push_back(alloc(weights[w].n, memory_tag::gradients));
        }
        block dscratch = alloc(acts[i].n, memory_tag::workspace);             // d(activation)
        release(acts[i]);
        release(dscratch);
      }
      if (step == 0) {
        grads.insert(grads.begin(), alloc(weights[0].n, memory_tag::gradients));
        for (const block& w : weights) {
          optim.push_back(alloc(w.n, memory_tag::optimizer));                 // Adam m
          optim.push_back(alloc(w.n, memory_tag::optimizer));                 // Adam v
        }
      }
    }
    const mb::memory_stats s = a.stats();
    state.counters["peak_requested_MiB"] = static_cast<double>(s.peak_requested) / (1 << 20);
    state.counters["peak_reserved_MiB"] = static_cast<double>(s.peak_reserved) / (1 << 20);
    state.counters["reserved_over_requested"] =
        static_cast<double>(s.peak_reserved) / static_cast<double>(s.peak_requested);
    state.counters["reserved_over_allocated"] =
        static_cast<double>(s.peak_reserved) / static_cast<double>(s.peak_allocated);
    state.counters["upstream_calls"] = static_cast<double>(s.upstream_calls());
    for (auto* v : {&optim, &grads, &weights})
      for (const block& b : *v) release(b);
  }
}

BENCHMARK(BM_training_fragmentation<caching>)
    ->Name("training_fragmentation/caching")->Unit(benchmark::kMillisecond)->Iterations(1);
BENCHMARK(BM_training_fragmentation<arena>)
    ->Name("training_fragmentation/expandable_arena")->Unit(benchmark::kMillisecond)->Iterations(1);
BENCHMARK(BM_training_fragmentation<mb::system_allocator>)
    ->Name("training_fragmentation/system")->Unit(benchmark::kMillisecond)->Iterations(1);

}  // namespace

int main(int argc, char** argv) { return bench_flags::benchmark_main(argc, argv); }
