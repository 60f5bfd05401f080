// The Mamba block on cuda_backend (backend/cuda/mamba.cuh), bf16 storage:
//   scan:    the forward scan's kernels alone (chunk-local pass, combine over chunks, outputs;
//            Δ, u = SiLU(c), B, C and z in; y ⊙ SiLU(z) and the chunk-entry states out) at
//            d_state 16: GB/s of the bytes it must move against a
//            device-to-device copy of the same bytes in the same run (`of_copy`; the issue's target
//            is ≥ 0.5), and state updates per second (B·T·Di·Ns per call).
//   block:   mamba<bf16_precision, scan_chunk<128>, cuda_backend> forward, and forward + backward,
//            tokens/s at T = 1k … 64k, C = 768 and 2048 (batch 1), with the saved and workspace
//            bytes as counters (what the planner reserves).
//   decode:  step() tokens/s at batch 1 and 64.
// The PyTorch reference block (selective_scan_ref) runs from bench/peers/mamba_cuda_peer.py on the
// same GPU. Without a device each benchmark is skipped.
#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "membound/backend/cuda.cuh"

#include "benchmark_main.hpp"

namespace mb = membound;
namespace gpu = membound::gpu;

namespace {

bool have_device() {
  int count = 0;
  const bool ok = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
  (void)cudaGetLastError();
  return ok;
}

// offset + scale·U[−1, 1), from a hash of the index: non-zero, finite, reproducible.
template <typename S>
__global__ void fill_kernel(S* p, std::size_t n, std::uint32_t seed, float scale, float offset) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    const std::uint32_t h = (static_cast<std::uint32_t>(i) ^ (seed * 0x9e3779b9u)) * 2654435761u;
    gpu::detail::st(p, i, offset + scale * (static_cast<float>(h >> 8) / 8388608.0f - 1.0f));
  }
}

template <typename T>
struct device_array {
  T* p = nullptr;
  std::size_t n = 0;
  explicit device_array(std::size_t count) : n(count) {
    mb::cuda_check(cudaMalloc(&p, (n == 0 ? 1 : n) * sizeof(T)), "cudaMalloc");
  }
  device_array(std::size_t count, cudaStream_t s, std::uint32_t seed, float scale, float offset = 0)
      : device_array(count) {
    fill_kernel<<<1024, 256, 0, s>>>(p, n, seed, scale, offset);
    mb::cuda_executor::check_launch("fill_kernel");
  }
  ~device_array() { (void)cudaFree(p); }
  device_array(const device_array&) = delete;
  device_array& operator=(const device_array&) = delete;
};

template <typename F>
double seconds_on_stream(cudaStream_t s, int reps, F&& f) {
  cudaEvent_t start = nullptr, stop = nullptr;
  mb::cuda_check(cudaEventCreate(&start), "cudaEventCreate");
  mb::cuda_check(cudaEventCreate(&stop), "cudaEventCreate");
  mb::cuda_check(cudaEventRecord(start, s), "cudaEventRecord");
  for (int r = 0; r < reps; ++r) f();
  mb::cuda_check(cudaEventRecord(stop, s), "cudaEventRecord");
  mb::cuda_check(cudaEventSynchronize(stop), "cudaEventSynchronize");
  float ms = 0;
  mb::cuda_check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
  (void)cudaEventDestroy(start);
  (void)cudaEventDestroy(stop);
  return static_cast<double>(ms) * 1e-3 / reps;
}

using S = mb::bf16;
using block = mb::mamba<mb::bf16_precision, mb::scan_chunk<128>, mb::cuda_backend>;

// The block's parameters and gradients on the device.
struct params {
  device_array<S> in_proj, conv_w, conv_b, x_proj, dt_proj, dt_bias, a_log, d, out_proj;
  device_array<S> g_in_proj, g_conv_w, g_conv_b, g_x_proj, g_dt_proj, g_dt_bias, g_a_log, g_d,
      g_out_proj;
  params(const mb::mamba_shape& s, cudaStream_t st)
      : in_proj(s.d_model * 2 * s.d_inner, st, 1, 0.03f),
        conv_w(s.d_inner * s.d_conv, st, 2, 0.3f),
        conv_b(s.d_inner, st, 3, 0.1f),
        x_proj(s.d_inner * (s.dt_rank + 2 * s.d_state), st, 4, 0.02f),
        dt_proj(s.dt_rank * s.d_inner, st, 5, 0.1f),
        dt_bias(s.d_inner, st, 6, 0.5f, -2.0f),
        a_log(s.d_inner * s.d_state, st, 7, 0.5f, 1.0f),
        d(s.d_inner, st, 8, 0.2f, 1.0f),
        out_proj(s.d_inner * s.d_model, st, 9, 0.02f),
        g_in_proj(in_proj.n), g_conv_w(conv_w.n), g_conv_b(conv_b.n), g_x_proj(x_proj.n),
        g_dt_proj(dt_proj.n), g_dt_bias(dt_bias.n), g_a_log(a_log.n), g_d(d.n),
        g_out_proj(out_proj.n) {
    for (auto* g : {&g_in_proj, &g_conv_w, &g_conv_b, &g_x_proj, &g_dt_proj, &g_dt_bias, &g_a_log,
                    &g_d, &g_out_proj}) {
      mb::cuda_check(cudaMemsetAsync(g->p, 0, g->n * sizeof(S), st), "cudaMemsetAsync");
    }
  }
  block::weights weights() const {
    return {in_proj.p, conv_w.p, conv_b.p, x_proj.p, dt_proj.p, dt_bias.p, a_log.p, d.p, out_proj.p};
  }
  block::gradients gradients() const {
    return {g_in_proj.p, g_conv_w.p, g_conv_b.p, g_x_proj.p, g_dt_proj.p,
            g_dt_bias.p, g_a_log.p,  g_d.p,      g_out_proj.p};
  }
};

// The forward scan's kernels alone, at d_state 16, against a device copy of the same bytes.
void bm_scan(benchmark::State& state) {
  if (!have_device()) {
    state.SkipWithError("no CUDA device");
    return;
  }
  const std::size_t B = 1, T = static_cast<std::size_t>(state.range(0)), Di = 4096, Ns = 16, R = 128;
  const std::size_t L = 128, N = B * T, ldx = R + 2 * Ns;
  mb::cuda_executor ex;
  const cudaStream_t st = ex.stream();
  device_array<S> xz(N * 2 * Di, st, 1, 1.0f), c(N * Di, st, 2, 1.0f), delta(N * Di, st, 3, 0.2f, 0.3f);
  device_array<S> xdbl(N * ldx, st, 4, 1.0f), a_log(Di * Ns, st, 5, 0.5f, 1.0f), dskip(Di, st, 6, 0.2f, 1.0f);
  device_array<S> gated(N * Di);
  const std::size_t nch = gpu::mamba_chunks(T, L);
  device_array<float> states(B * (nch - 1) * Di * Ns + 1);
  device_array<float> dsum(gpu::mamba_chunk_sum_elements(B, T, L, Di) + 1);
  const std::size_t cpb = gpu::mamba_channels_per_block(Ns), nchb = gpu::mamba_blocks(Di, cpb);
  const unsigned threads = static_cast<unsigned>(cpb * Ns);
  // The launcher's three kernels: chunk-local states, the combine over chunks, the outputs.
  const auto scan = [&] {
    if (nch > 1) {
      const dim3 grid_a(static_cast<unsigned>(nchb * (nch - 1)), static_cast<unsigned>(B));
      gpu::mamba_detail::scan_chunk_local_kernel<<<grid_a, threads, 0, st>>>(
          static_cast<const S*>(c.p), static_cast<const S*>(delta.p), static_cast<const S*>(xdbl.p),
          static_cast<const S*>(a_log.p), T, Di, Ns, R, L, cpb, states.p, dsum.p, mb::packed_sequences{});
      mb::cuda_executor::check_launch("scan_chunk_local_kernel");
    }
    if (nch > 2) {
      gpu::mamba_detail::scan_chunk_combine_kernel<<<gpu::mamba_detail::grid_for(B * Di * Ns), 256, 0, st>>>(
          static_cast<const S*>(a_log.p), static_cast<const float*>(dsum.p), states.p, B, nch, Di, Ns);
      mb::cuda_executor::check_launch("scan_chunk_combine_kernel");
    }
    const dim3 grid(static_cast<unsigned>(nchb * nch), static_cast<unsigned>(B));
    gpu::mamba_detail::scan_forward_kernel<<<grid, threads, 0, st>>>(
        xz.p, c.p, delta.p, xdbl.p, a_log.p, dskip.p, T, Di, Ns, R, L, cpb,
        static_cast<const float*>(states.p), gated.p, static_cast<const float*>(nullptr),
        static_cast<S*>(nullptr), mb::packed_sequences{});
    mb::cuda_executor::check_launch("scan_forward_kernel");
  };
  // What the scan must move: z, c, Δ in; B, C in; the gated y out; the chunk states out. (The
  // chunked scan reads c, Δ and B twice and the states three times more: this counts them once,
  // so GB/s stays comparable with the serial kernel's figures.)
  const double bytes = static_cast<double>(N * Di * 4 * sizeof(S) + N * 2 * Ns * sizeof(S) +
                                           (states.n - 1) * sizeof(float));
  device_array<unsigned char> src(static_cast<std::size_t>(bytes) / 2 + 1), dst(static_cast<std::size_t>(bytes) / 2 + 1);
  const auto copy = [&] {
    mb::cuda_check(cudaMemcpyAsync(dst.p, src.p, src.n, cudaMemcpyDeviceToDevice, st), "cudaMemcpyAsync");
  };
  scan();
  copy();
  ex.synchronize();
  double total = 0;
  for (auto _ : state) {
    const double sec = seconds_on_stream(st, 5, scan);
    state.SetIterationTime(sec);
    total += sec;
  }
  const double per = total / static_cast<double>(state.iterations());
  const double copy_s = seconds_on_stream(st, 5, copy);
  const double gbs = bytes / per / 1e9, copy_gbs = 2.0 * static_cast<double>(src.n) / copy_s / 1e9;
  state.counters["GB/s"] = gbs;
  state.counters["copy_GB/s"] = copy_gbs;
  state.counters["of_copy"] = gbs / copy_gbs;
  state.counters["state_updates/s"] = static_cast<double>(N * Di * Ns) / per;
  state.counters["threads"] = static_cast<double>(B * nch * Di * Ns);
}

// Block forward (with_backward false) or forward + backward, tokens/s.
void bm_block(benchmark::State& state, bool with_backward) {
  if (!have_device()) {
    state.SkipWithError("no CUDA device");
    return;
  }
  const auto s = mb::mamba_shape::defaults(1, static_cast<std::size_t>(state.range(0)),
                                           static_cast<std::size_t>(state.range(1)));
  mb::cuda_executor ex;
  const cudaStream_t st = ex.stream();
  params p(s, st);
  const std::size_t N = s.batch * s.seq;
  device_array<S> x(N * s.d_model, st, 11, 1.0f), dout(N * s.d_model, st, 12, 1.0f);
  device_array<S> out(N * s.d_model), dx(N * s.d_model);
  const std::size_t saved_bytes = block::saved_bytes(s);
  const std::size_t fws = block::forward_workspace_bytes(s, 1), bws = block::backward_workspace_bytes(s, 1);
  device_array<unsigned char> saved(saved_bytes), ws(fws > bws ? fws : bws);
  const auto run = [&] {
    block::forward(s, p.weights(), x.p, out.p, saved.p, saved_bytes, ws.p, fws, ex);
    if (with_backward) {
      block::backward(s, p.weights(), x.p, saved.p, saved_bytes, dout.p, dx.p, p.gradients(), ws.p,
                      bws, ex);
    }
  };
  run();
  ex.synchronize();
  double total = 0;
  for (auto _ : state) {
    const double sec = seconds_on_stream(st, 2, run);
    state.SetIterationTime(sec);
    total += sec;
  }
  state.counters["tokens/s"] = static_cast<double>(N) * static_cast<double>(state.iterations()) / total;
  state.counters["saved_MiB"] = static_cast<double>(saved_bytes) / (1 << 20);
  state.counters["workspace_MiB"] = static_cast<double>(fws > bws ? fws : bws) / (1 << 20);
}
void bm_forward(benchmark::State& state) { bm_block(state, false); }
void bm_forward_backward(benchmark::State& state) { bm_block(state, true); }

// Decoding: one token per sequence per step.
void bm_decode(benchmark::State& state) {
  if (!have_device()) {
    state.SkipWithError("no CUDA device");
    return;
  }
  const auto s = mb::mamba_shape::defaults(static_cast<std::size_t>(state.range(0)), 1,
                                           static_cast<std::size_t>(state.range(1)));
  mb::cuda_executor ex;
  const cudaStream_t st = ex.stream();
  params p(s, st);
  device_array<S> x(s.batch * s.d_model, st, 13, 1.0f), out(s.batch * s.d_model);
  device_array<float> state_buf(block::state_bytes(s) / sizeof(float));
  device_array<unsigned char> ws(block::step_workspace_bytes(s));
  auto dec = block::make_state(s, state_buf.p, block::state_bytes(s), ex);
  const auto step = [&] {
    block::step(s, p.weights(), dec, x.p, out.p, ws.p, block::step_workspace_bytes(s), ex);
  };
  step();
  ex.synchronize();
  double total = 0;
  for (auto _ : state) {
    const double sec = seconds_on_stream(st, 20, step);
    state.SetIterationTime(sec);
    total += sec;
  }
  state.counters["tokens/s"] =
      static_cast<double>(s.batch) * static_cast<double>(state.iterations()) / total;
}

BENCHMARK(bm_scan)->Arg(4096)->Arg(65536)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(bm_forward)
    ->ArgsProduct({{1024, 4096, 16384, 65536}, {768, 2048}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(bm_forward_backward)
    ->ArgsProduct({{1024, 4096, 16384, 65536}, {768, 2048}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(bm_decode)
    ->ArgsProduct({{1, 64}, {768, 2048}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace

int main(int argc, char** argv) { return bench_flags::benchmark_main(argc, argv); }
