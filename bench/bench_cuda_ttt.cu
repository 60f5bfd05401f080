// Tokens/s of basic_ttt<Mlp, P, cuda_backend> (TTT-Linear and TTT-MLP), bf16 and fp32, T = 2k
// and 8k, C = 1024 (H = 16, D = 64), b = 16, G = 4: forward alone, and forward + backward (one
// training step of the layer: the backward recomputes q, k, v and the groups' states, so it is
// the figure to set against PyTorch's forward + backward, bench/peers/ttt_peer.py). Timed with
// CUDA events on the layer's stream. Without a device each benchmark is skipped.
// The second argument is the inner loop's placement: 1 what the device allows on chip (the
// default), 0 nothing (cuda_executor::set_kernels({.ttt_shared_limit = 0}): every part through global scratch, the
// placement before on-chip existed; the same bits): the ratio of the two, in one run, is what
// keeping the working set on chip buys.
#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "membound/backend/cuda.cuh"

#include "benchmark_main.hpp"

namespace mb = membound;

namespace {

bool have_device() {
  int count = 0;
  const bool ok = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
  (void)cudaGetLastError();
  return ok;
}

// Small deterministic values, built on the host in storage type and uploaded once.
template <typename S>
S* upload(std::size_t n, std::uint32_t seed, float scale, float offset = 0.0f) {
  std::vector<S> h(n == 0 ? 1 : n);
  std::uint32_t s = seed * 2654435761u + 7;
  for (auto& v : h) {
    s = s * 1664525u + 1013904223u;
    v = mb::from_accum<S>(offset + scale * (static_cast<float>(s >> 8) / 16777216.0f - 0.5f));
  }
  void* p = nullptr;
  mb::cuda_check(cudaMalloc(&p, h.size() * sizeof(S)), "cudaMalloc");
  mb::cuda_check(cudaMemcpy(p, h.data(), h.size() * sizeof(S), cudaMemcpyHostToDevice), "cudaMemcpy");
  mb::cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");  // legacy-stream copy
  return static_cast<S*>(p);
}

template <bool Mlp, typename Precision, bool Backward>
void bm_layer(benchmark::State& state) {
  if (!have_device()) {
    state.SkipWithError("no CUDA device");
    return;
  }
  using layer = mb::basic_ttt<Mlp, Precision, mb::ttt_mini_batch<16>, mb::ttt_state_groups<4>,
                              mb::cuda_backend>;
  using S = typename layer::storage_type;
  const mb::ttt_shape s{1, static_cast<std::size_t>(state.range(0)), 1024, 16};
  const std::size_t N = s.batch * s.seq, C = s.width, H = s.heads, D = s.head_dim();
  const std::size_t F = layer::hidden(s);
  std::vector<void*> owned;
  auto up = [&](std::size_t n, std::uint32_t seed, float scale, float offset = 0.0f) {
    S* p = upload<S>(n, seed, scale, offset);
    owned.push_back(p);
    return static_cast<const S*>(p);
  };
  typename layer::weights w{up(C * C, 1, 0.05f), up(C * C, 2, 0.05f), up(C * C, 3, 0.05f),
                            up(H * D, 4, 0.1f, 1.0f), up(H * D, 5, 0.1f), up(H * D * F, 6, 0.05f),
                            up(H * F, 7, 0.1f), up(H * C, 8, 0.05f), up(H, 9, 0.5f),
                            up(16, 10, 0.05f), up(C, 11, 0.1f, 1.0f), up(C, 12, 0.1f),
                            up(C * C, 13, 0.05f), up(C * C, 14, 0.05f)};
  if constexpr (Mlp) {
    w.w2 = up(H * F * D, 15, 0.05f);
    w.b2 = up(H * D, 16, 0.1f);
  }
  const S* x = up(N * C, 20, 1.0f);
  S* y = upload<S>(N * C, 21, 0.0f);
  owned.push_back(y);
  const S* dy = up(N * C, 22, 1.0f);
  S* dx = upload<S>(N * C, 23, 0.0f);
  owned.push_back(dx);
  auto zeros = [&](std::size_t n) {
    S* p = upload<S>(n, 24, 0.0f);
    owned.push_back(p);
    return p;
  };
  typename layer::gradients g{zeros(C * C), zeros(C * C), zeros(C * C), zeros(H * D),
                              zeros(H * D), zeros(H * D * F), zeros(H * F), zeros(H * C),
                              zeros(H), zeros(16), zeros(C), zeros(C), zeros(C * C), zeros(C * C)};
  if constexpr (Mlp) {
    g.w2 = zeros(H * F * D);
    g.b2 = zeros(H * D);
  }
  const std::size_t saved_n = layer::saved_bytes(s), fws_n = layer::forward_workspace_bytes(s, 1);
  const std::size_t bws_n = Backward ? layer::backward_workspace_bytes(s, 1) : 0;
  const std::size_t ws_n = fws_n > bws_n ? fws_n : bws_n;
  void *saved = nullptr, *ws = nullptr;
  mb::cuda_check(cudaMalloc(&saved, saved_n), "cudaMalloc");
  mb::cuda_check(cudaMalloc(&ws, ws_n), "cudaMalloc");
  owned.push_back(saved);
  owned.push_back(ws);
  mb::cuda_executor ex;
  if (state.range(1) == 0) ex.set_kernels({.ttt_shared_limit = 0});
  cudaEvent_t start, stop;
  mb::cuda_check(cudaEventCreate(&start), "cudaEventCreate");
  mb::cuda_check(cudaEventCreate(&stop), "cudaEventCreate");
  const auto step = [&] {
    layer::forward(s, w, x, y, saved, saved_n, ws, fws_n, ex);
    if constexpr (Backward) layer::backward(s, w, x, saved, saved_n, dy, dx, g, ws, bws_n, ex);
  };
  step();  // warm-up (plans, module load)
  ex.synchronize();
  for (auto _ : state) {
    mb::cuda_check(cudaEventRecord(start, ex.stream()), "cudaEventRecord");
    step();
    mb::cuda_check(cudaEventRecord(stop, ex.stream()), "cudaEventRecord");
    mb::cuda_check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0.0f;
    mb::cuda_check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    state.SetIterationTime(static_cast<double>(ms) / 1e3);
  }
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(N), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["saved_MiB"] = static_cast<double>(saved_n) / (1 << 20);
  state.counters["workspace_MiB"] = static_cast<double>(ws_n) / (1 << 20);
  const auto chip = mb::backend_kernels<mb::cuda_backend, mb::ttt_shape>::on_chip<Mlp, 16, 4>(
      s, mb::gpu::ttt_detail::inner_shared_limit(ex));
  state.counters["fwd_shared_KiB"] = static_cast<double>(chip.forward.shared_bytes) / 1024;
  state.counters["bwd_shared_KiB"] = static_cast<double>(chip.backward.shared_bytes) / 1024;
  (void)cudaEventDestroy(start);
  (void)cudaEventDestroy(stop);
  for (void* p : owned) (void)cudaFree(p);
}

// {T, placement}: each length on chip (1) and through global memory (0), side by side.
void seq_2k_8k(benchmark::internal::Benchmark* b) {
  for (const std::int64_t T : {2048, 8192})
    for (const std::int64_t on_chip : {1, 0}) b->Args({T, on_chip});
}
void seq_2k(benchmark::internal::Benchmark* b) {
  for (const std::int64_t on_chip : {1, 0}) b->Args({2048, on_chip});
}

BENCHMARK_TEMPLATE(bm_layer, false, mb::bf16_precision, false)
    ->Name("ttt_linear_bf16_forward")->Apply(seq_2k_8k)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(bm_layer, false, mb::bf16_precision, true)
    ->Name("ttt_linear_bf16_forward_backward")->Apply(seq_2k_8k)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(bm_layer, true, mb::bf16_precision, false)
    ->Name("ttt_mlp_bf16_forward")->Apply(seq_2k_8k)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(bm_layer, true, mb::bf16_precision, true)
    ->Name("ttt_mlp_bf16_forward_backward")->Apply(seq_2k)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(bm_layer, false, mb::fp32_precision, false)
    ->Name("ttt_linear_fp32_forward")->Apply(seq_2k)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(bm_layer, false, mb::fp32_precision, true)
    ->Name("ttt_linear_fp32_forward_backward")->Apply(seq_2k)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(bm_layer, true, mb::fp32_precision, false)
    ->Name("ttt_mlp_fp32_forward")->Apply(seq_2k)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(bm_layer, true, mb::fp32_precision, true)
    ->Name("ttt_mlp_fp32_forward_backward")->Apply(seq_2k)->UseManualTime()->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) { return bench_flags::benchmark_main(argc, argv); }
