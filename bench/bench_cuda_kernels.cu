// Achieved bandwidth of the memory-bound model kernels (backend/cuda/model.cuh), bf16
// storage, against cudaMemcpyAsync device-to-device moving the same bytes in the same run: the
// `of_copy` counter is kernel GB/s over copy GB/s (1.0 = as fast as the copy engine path).
// Bytes are the essential traffic (each input read once, each output written once); scratch
// traffic (RMSNorm's dweight partials, the cross-entropy's extra passes) is not counted, so it
// shows up as a lower ratio. Times come from CUDA events on the executor's stream.
//
// Run: ./build/release/bench/bench_cuda_kernels   (skips every benchmark without a device)
#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "membound/backend/cuda.cuh"

#include "benchmark_main.hpp"

namespace mb = membound;
namespace mc = membound::gpu;

namespace {

bool have_device() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// A device allocation for the benchmark, zero-filled (bf16/float zero is all-zero bits).
struct dev_mem {
  void* p = nullptr;
  explicit dev_mem(std::size_t bytes) {
    mb::cuda_check(cudaMalloc(&p, bytes == 0 ? 1 : bytes), "cudaMalloc");
    mb::cuda_check(cudaMemset(p, 0, bytes == 0 ? 1 : bytes), "cudaMemset");
    mb::cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");  // legacy-stream memset
  }
  ~dev_mem() { (void)cudaFree(p); }
  dev_mem(const dev_mem&) = delete;
  dev_mem& operator=(const dev_mem&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

// Milliseconds of `launch` on the stream, by events.
template <typename F>
float time_ms(const mb::cuda_executor& ex, F&& launch) {
  cudaEvent_t a, b;
  mb::cuda_check(cudaEventCreate(&a), "cudaEventCreate");
  mb::cuda_check(cudaEventCreate(&b), "cudaEventCreate");
  mb::cuda_check(cudaEventRecord(a, ex.stream()), "cudaEventRecord");
  launch();
  mb::cuda_check(cudaEventRecord(b, ex.stream()), "cudaEventRecord");
  mb::cuda_check(cudaEventSynchronize(b), "cudaEventSynchronize");
  float ms = 0;
  mb::cuda_check(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
  (void)cudaEventDestroy(a);
  (void)cudaEventDestroy(b);
  return ms;
}

// Times `launch` (which moves `bytes`) per iteration, then a D2D copy moving the same bytes (half
// read, half written), and reports both rates.
template <typename F>
void measure(benchmark::State& state, const mb::cuda_executor& ex, double bytes, F&& launch) {
  launch();  // warm-up
  ex.synchronize();
  double kernel_s = 0;
  std::int64_t iters = 0;
  for (auto _ : state) {
    const double s = time_ms(ex, launch) / 1e3;
    state.SetIterationTime(s);
    kernel_s += s;
    ++iters;
  }
  const std::size_t half = static_cast<std::size_t>(bytes / 2);
  dev_mem src(half), dst(half);
  const auto copy = [&] {
    mb::cuda_check(cudaMemcpyAsync(dst.p, src.p, half, cudaMemcpyDeviceToDevice, ex.stream()), "cudaMemcpyAsync");
  };
  copy();
  double copy_s = 1e30;
  for (int r = 0; r < 20; ++r) {
    const double s = time_ms(ex, copy) / 1e3;
    copy_s = s < copy_s ? s : copy_s;
  }
  const double gbs = iters > 0 ? bytes * static_cast<double>(iters) / kernel_s / 1e9 : 0.0;
  const double copy_gbs = 2.0 * static_cast<double>(half) / copy_s / 1e9;
  state.counters["GB/s"] = gbs;
  state.counters["copy_GB/s"] = copy_gbs;
  state.counters["of_copy"] = copy_gbs > 0 ? gbs / copy_gbs : 0.0;
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * iters);
}

using S = mb::bf16;
constexpr std::size_t s_bytes = sizeof(S);

#define MB_NEED_DEVICE(state)                      \
  if (!have_device()) {                            \
    (state).SkipWithError("no CUDA device");       \
    return;                                        \
  }

void BM_rmsnorm_forward(benchmark::State& state) {
  MB_NEED_DEVICE(state);
  const std::size_t N = static_cast<std::size_t>(state.range(0)), C = static_cast<std::size_t>(state.range(1));
  mb::cuda_executor ex;
  dev_mem x(N * C * s_bytes), g(C * s_bytes), y(N * C * s_bytes), rstd(N * 4);
  measure(state, ex, 2.0 * N * C * s_bytes + 4.0 * N, [&] {
    mc::rmsnorm_forward(ex, x.as<S>(), g.as<S>(), y.as<S>(), rstd.as<float>(), N, C, 1e-5);
  });
}

void BM_rmsnorm_backward(benchmark::State& state) {
  MB_NEED_DEVICE(state);
  const std::size_t N = static_cast<std::size_t>(state.range(0)), C = static_cast<std::size_t>(state.range(1));
  mb::cuda_executor ex;
  const std::size_t wsb = mc::rmsnorm_backward_workspace_bytes(N, C);
  dev_mem x(N * C * s_bytes), g(C * s_bytes), dy(N * C * s_bytes), dx(N * C * s_bytes), dg(C * s_bytes),
      rstd(N * 4), ws(wsb);
  measure(state, ex, 3.0 * N * C * s_bytes + 4.0 * N, [&] {
    mc::rmsnorm_backward(ex, x.as<S>(), g.as<S>(), rstd.as<float>(), dy.as<S>(), static_cast<const S*>(nullptr),
                         dx.as<S>(), dg.as<S>(), ws.p, wsb, N, C);
  });
}

void BM_add_rows(benchmark::State& state) {
  MB_NEED_DEVICE(state);
  const std::size_t n = static_cast<std::size_t>(state.range(0));
  mb::cuda_executor ex;
  dev_mem a(n * s_bytes), b(n * s_bytes), y(n * s_bytes);
  measure(state, ex, 3.0 * n * s_bytes, [&] { mc::add_rows(ex, a.as<S>(), b.as<S>(), y.as<S>(), n); });
}

void BM_swiglu_forward(benchmark::State& state) {
  MB_NEED_DEVICE(state);
  const std::size_t n = static_cast<std::size_t>(state.range(0));
  mb::cuda_executor ex;
  dev_mem a(n * s_bytes), b(n * s_bytes), act(n * s_bytes);
  measure(state, ex, 3.0 * n * s_bytes, [&] { mc::swiglu_forward(ex, a.as<S>(), b.as<S>(), act.as<S>(), n); });
}

void BM_swiglu_backward(benchmark::State& state) {
  MB_NEED_DEVICE(state);
  const std::size_t n = static_cast<std::size_t>(state.range(0));
  mb::cuda_executor ex;
  dev_mem a(n * s_bytes), b(n * s_bytes), d(n * s_bytes), da(n * s_bytes);
  measure(state, ex, 5.0 * n * s_bytes, [&] {
    mc::swiglu_backward(ex, a.as<S>(), b.as<S>(), static_cast<const S*>(d.as<S>()), da.as<S>(), d.as<S>(), n);
  });
}

void BM_embedding_gather(benchmark::State& state) {
  MB_NEED_DEVICE(state);
  const std::size_t N = static_cast<std::size_t>(state.range(0)), C = static_cast<std::size_t>(state.range(1));
  const std::size_t V = 50257;
  mb::cuda_executor ex;
  std::vector<std::int32_t> ids(N);
  for (std::size_t i = 0; i < N; ++i) ids[i] = static_cast<std::int32_t>((i * 7919) % V);
  dev_mem tok(N * 4), table(V * C * s_bytes), x(N * C * s_bytes);
  mb::cuda_check(cudaMemcpy(tok.p, ids.data(), N * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
  mb::cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");  // legacy-stream copy
  measure(state, ex, 2.0 * N * C * s_bytes + 4.0 * N, [&] {
    mc::embedding_gather(ex, tok.as<std::int32_t>(), table.as<S>(), x.as<S>(), N, C, V);
  });
}

void BM_adamw(benchmark::State& state) {
  MB_NEED_DEVICE(state);
  const std::size_t n = static_cast<std::size_t>(state.range(0));
  mb::cuda_executor ex;
  const std::size_t sb = mb::adamw<S>::state_bytes(n);
  dev_mem w(n * s_bytes), g(n * s_bytes), st(sb);
  // Twelve segments of uneven size, alternating decay, as a model's parameter list.
  std::vector<mc::adamw_segment> segs;
  std::size_t at = 0;
  for (int i = 0; i < 12; ++i) {
    const std::size_t c = i == 11 ? n - at : n / 16 + static_cast<std::size_t>(i) * 7;
    segs.push_back({at, c, i % 2 == 0});
    at += c;
  }
  mb::adamw_config cfg;
  std::uint64_t t = 1;
  // w, m, v, master read and written, g read.
  measure(state, ex, static_cast<double>(n) * (2.0 * s_bytes + s_bytes + 2.0 * 12.0), [&] {
    mc::adamw_update(ex, w.as<S>(), g.as<S>(), st.p, sb, n, std::span<const mc::adamw_segment>(segs), t++, 1e-3, cfg);
  });
}

void BM_global_norm(benchmark::State& state) {
  MB_NEED_DEVICE(state);
  const std::size_t n = static_cast<std::size_t>(state.range(0));
  mb::cuda_executor ex;
  const std::size_t wsb = mc::global_norm_workspace_bytes(n);
  dev_mem g(n * s_bytes), norm(8), ws(wsb);
  measure(state, ex, static_cast<double>(n) * s_bytes,
          [&] { mc::global_norm(ex, g.as<S>(), n, norm.as<double>(), ws.p, wsb); });
}

void BM_check_finite(benchmark::State& state) {
  MB_NEED_DEVICE(state);
  const std::size_t n = static_cast<std::size_t>(state.range(0));
  mb::cuda_executor ex;
  dev_mem g(n * s_bytes), flag(4);
  measure(state, ex, static_cast<double>(n) * s_bytes,
          [&] { mc::check_finite(ex, g.as<S>(), n, flag.as<unsigned>()); });
}

void BM_cross_entropy(benchmark::State& state) {
  MB_NEED_DEVICE(state);
  const std::size_t R = static_cast<std::size_t>(state.range(0)), V = static_cast<std::size_t>(state.range(1));
  mb::cuda_executor ex;
  const std::size_t wsb = mc::cross_entropy_workspace_bytes(R);
  dev_mem logits(R * V * 4), tgt(R * 4), total(8), ws(wsb);
  measure(state, ex, 2.0 * R * V * 4, [&] {
    mc::cross_entropy_chunk(ex, logits.as<float>(), tgt.as<std::int32_t>(), R, V, 1.0 / static_cast<double>(R),
                            total.as<double>(), ws.p, wsb);
  });
}

}  // namespace

BENCHMARK(BM_rmsnorm_forward)->Args({8192, 1024})->Args({8191, 4099})->UseManualTime();
BENCHMARK(BM_rmsnorm_backward)->Args({8192, 1024})->Args({8191, 4099})->UseManualTime();
BENCHMARK(BM_add_rows)->Arg(1 << 24)->UseManualTime();
BENCHMARK(BM_swiglu_forward)->Arg(1 << 24)->UseManualTime();
BENCHMARK(BM_swiglu_backward)->Arg(1 << 24)->UseManualTime();
BENCHMARK(BM_embedding_gather)->Args({8192, 1024})->UseManualTime();
BENCHMARK(BM_adamw)->Arg(1 << 24)->UseManualTime();
BENCHMARK(BM_global_norm)->Arg(1 << 26)->UseManualTime();
BENCHMARK(BM_check_finite)->Arg(1 << 26)->UseManualTime();
BENCHMARK(BM_cross_entropy)->Args({256, 50257})->UseManualTime();

int main(int argc, char** argv) { return bench_flags::benchmark_main(argc, argv); }
