// The single-token decoding `step` of the Mamba block and the TTT layers on the CPU, fp32: one
// token per sequence for B sequences, the state carried from call to call (TTT folds its sums
// every b = 16 tokens, so a run averages over the mini-batch). Shapes as the layer benchmarks:
// Mamba mamba_shape::defaults at C = 768 (Di 1536, Ns 16, R 48), TTT C = 512, H = 8.
// Arguments: B, threads.
//
// Run: ./build/release/bench/bench_step [--benchmark_repetitions=5 ...]
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "membound/membound.hpp"

#include "benchmark_main.hpp"

namespace mb = membound;

namespace {

std::vector<float> random(std::size_t n, unsigned seed, float scale, float offset = 0.0f) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = offset + u(g);
  return v;
}

// The workspace and state, aligned to the 256 bytes the layers ask of a workspace base.
struct buffer {
  std::vector<std::byte> raw;
  void* p = nullptr;
  explicit buffer(std::size_t n) : raw(n + 256) {
    p = raw.data() + (256 - reinterpret_cast<std::uintptr_t>(raw.data()) % 256) % 256;
  }
};

// Steps one token of `width` values (B·C) per iteration, carrying the state `make` starts.
template <typename Layer, typename Shape, typename Make>
void time_steps(benchmark::State& state, const Shape& s, const typename Layer::weights& w,
                std::size_t width, mb::thread_pool& pool, Make&& make) {
  const std::size_t ws_bytes = Layer::step_workspace_bytes(s);
  buffer st_mem(Layer::state_bytes(s)), ws(ws_bytes);
  auto st = make(st_mem.p, Layer::state_bytes(s));
  const auto x = random(width, 20, 1.0f);
  std::vector<float> y(width);
  for (auto _ : state) {
    Layer::step(s, w, st, x.data(), y.data(), ws.p, ws_bytes, pool);
    benchmark::DoNotOptimize(y.data());
  }
  state.counters["ws KiB"] = double(ws_bytes) / 1024.0;
}

void mamba_step(benchmark::State& state) {
  using block = mb::mamba<mb::fp32_precision>;
  const auto B = static_cast<std::size_t>(state.range(0));
  mb::thread_pool pool(static_cast<std::size_t>(state.range(1)));
  const auto s = mb::mamba_shape::defaults(B, 1, 768);
  const std::size_t C = s.d_model, Di = s.d_inner, Ns = s.d_state, R = s.dt_rank, K = s.d_conv;
  const float sc = 0.5f / std::sqrt(float(C));
  const auto in_proj = random(C * 2 * Di, 1, sc), conv_w = random(Di * K, 2, 0.5f),
             conv_b = random(Di, 3, 0.1f), x_proj = random(Di * (R + 2 * Ns), 4, sc),
             dt_proj = random(R * Di, 5, sc), dt_bias = random(Di, 6, 0.5f, -3.0f),
             a_log = random(Di * Ns, 7, 0.5f, 1.0f), d = random(Di, 8, 0.5f, 1.0f),
             out_proj = random(Di * C, 9, sc);
  const block::weights w{in_proj.data(), conv_w.data(), conv_b.data(), x_proj.data(), dt_proj.data(),
                         dt_bias.data(), a_log.data(),  d.data(),      out_proj.data()};
  time_steps<block>(state, s, w, B * C, pool,
                    [&](void* p, std::size_t n) { return block::make_state(s, p, n); });
}

template <bool Mlp>
void ttt_step(benchmark::State& state) {
  using layer = mb::basic_ttt<Mlp, mb::fp32_precision>;
  const auto B = static_cast<std::size_t>(state.range(0));
  mb::thread_pool pool(static_cast<std::size_t>(state.range(1)));
  mb::ttt_shape s{B, 1, 512, 8};
  const std::size_t C = s.width, H = s.heads, D = s.head_dim(), F = Mlp ? 4 * D : D, b = 16;
  const float sc = 0.5f / std::sqrt(float(C));
  const auto wq = random(C * C, 1, sc), wk = random(C * C, 2, sc), wv = random(C * C, 3, sc),
             nw = random(H * D, 4, sc, 1.0f), nb = random(H * D, 5, sc),
             w1 = random(H * D * F, 6, 2 * sc), b1 = random(H * F, 7, sc),
             lr_w = random(H * C, 8, 4 * sc), lr_b = random(H, 9, 0.5f), tok = random(b, 10, 0.2f),
             post_w = random(C, 11, sc, 1.0f), post_b = random(C, 12, sc),
             wo = random(C * C, 13, sc), w2 = random(Mlp ? H * F * D : 1, 14, sc),
             b2 = random(Mlp ? H * D : 1, 15, sc);
  const typename layer::weights w{wq.data(),   wk.data(),   wv.data(),     nw.data(),
                                  nb.data(),   w1.data(),   b1.data(),     lr_w.data(),
                                  lr_b.data(), tok.data(),  post_w.data(), post_b.data(),
                                  nullptr,     wo.data(),   Mlp ? w2.data() : nullptr,
                                  Mlp ? b2.data() : nullptr};
  time_steps<layer>(state, s, w, B * C, pool,
                    [&](void* p, std::size_t n) { return layer::make_state(s, w, p, n); });
}

void shapes(benchmark::internal::Benchmark* b) {
  for (const long batch : {1, 8})
    for (const long threads : {1, 2}) b->Args({batch, threads});
  b->ArgNames({"B", "threads"})->Unit(benchmark::kMicrosecond);
}

BENCHMARK(mamba_step)->Apply(shapes);
BENCHMARK(ttt_step<false>)->Name("ttt_linear_step")->Apply(shapes);
BENCHMARK(ttt_step<true>)->Name("ttt_mlp_step")->Apply(shapes);

}  // namespace

int main(int argc, char** argv) { return bench_flags::benchmark_main(argc, argv); }
