// TFLOP/s of the attention core on the GPU (backend/cuda/attention.cuh): the flash forward
// kernel, and forward + backward (the dK/dV pass and the dQ pass), on rotated fp32 q, k, v, counted
// as FlashAttention counts: 4·B·H·T²·D forward, halved when causal; backward 2.5× forward.
// The projections (cuBLASLt GEMMs) are not timed here: bench_cuda_gemm covers them.
//
// fwd_*/fwdbwd_* time the fp32 SIMT kernels; *_wmma_bf16_* the first bf16 path (the WMMA forward,
// and the SIMT backward, now the fallback); *_mma_bf16_* attention_mma.cuh's mma.sync kernels
// (forward, dK/dV and dQ with fragments in registers, the bf16 default); *_cudnn_bf16_* cuDNN's fused
// flash attention (backend/cuda/cudnn_attention.cuh, where the build has it) on bf16 q, k, v, with its
// deterministic backward, and *_cudnn_atomic_bf16_* with its default one (atomic dQ, what PyTorch's
// cuDNN SDPA backend runs). Same shapes and data in one run, so the ratios between them hold on a
// noisy machine. No cp.async/TMA yet; bench/peers/sdpa_peer.py
// prints PyTorch's SDPA on the same shapes for the side-by-side. Without a device each benchmark
// is skipped.
#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <unordered_map>

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

__global__ void fill_kernel(float* p, std::size_t n, std::uint32_t seed) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    const std::uint32_t h = (static_cast<std::uint32_t>(i) ^ seed) * 2654435761u;
    p[i] = static_cast<float>(h >> 16) / 65536.0f - 0.5f;
  }
}

struct device_floats {
  float* p = nullptr;
  device_floats(std::size_t n, cudaStream_t s, std::uint32_t seed) {
    mb::cuda_check(cudaMalloc(&p, n * sizeof(float)), "cudaMalloc");
    fill_kernel<<<1024, 256, 0, s>>>(p, n, seed);
    mb::cuda_executor::check_launch("fill_kernel");
  }
  ~device_floats() { (void)cudaFree(p); }
  device_floats(const device_floats&) = delete;
  device_floats& operator=(const device_floats&) = delete;
};

// simt: fp32 O, the SIMT forward and backward; wmma: bf16 O, the WMMA forward, the SIMT backward;
// once() after a warm-up call (module load, smem attribute), each iteration timed by events on
// the executor's stream; TFLOP/s as FlashAttention counts: 4·BH·T²·D forward, halved when causal,
// backward 2.5× forward.
template <typename Once>
void timed_tflops(benchmark::State& state, const mb::cuda_executor& ex, Once&& once, std::size_t bh, std::size_t T,
                  std::size_t D, bool causal, bool with_backward) {
  once();
  ex.synchronize();
  cudaEvent_t start = nullptr, stop = nullptr;
  mb::cuda_check(cudaEventCreate(&start), "cudaEventCreate");
  mb::cuda_check(cudaEventCreate(&stop), "cudaEventCreate");
  double seconds = 0.0;
  std::size_t iters = 0;
  for (auto _ : state) {
    mb::cuda_check(cudaEventRecord(start, ex.stream()), "cudaEventRecord");
    once();
    mb::cuda_check(cudaEventRecord(stop, ex.stream()), "cudaEventRecord");
    mb::cuda_check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0.0f;
    mb::cuda_check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    state.SetIterationTime(ms / 1e3);
    seconds += ms / 1e3;
    ++iters;
  }
  (void)cudaEventDestroy(start);
  (void)cudaEventDestroy(stop);
  double flops = 4.0 * static_cast<double>(bh) * static_cast<double>(T) * static_cast<double>(T) *
                 static_cast<double>(D) * (causal ? 0.5 : 1.0);
  if (with_backward) flops *= 3.5;
  if (seconds > 0.0) state.counters["TFLOP/s"] = flops * static_cast<double>(iters) / seconds / 1e12;
}

// mma: bf16 O, the mma.sync forward and backward.
enum class path { simt, wmma, mma };
template <unsigned DM>
void bm_attention(benchmark::State& state, std::size_t D, bool causal, bool with_backward,
                  path kernels = path::simt) {
  if (!have_device()) {
    state.SkipWithError("no CUDA device");
    return;
  }
  const std::size_t T = static_cast<std::size_t>(state.range(0));
  const std::size_t H = 16, B = (16384 / T) > 0 ? 16384 / T : 1;  // 16k tokens per batch
  const mb::attention_shape s{B, T, H * D, H, H, D, causal, 10000.0};
  mb::cuda_executor ex;
  const std::size_t n = B * T * H * D, rows = B * H * T;
  device_floats q(n, ex.stream(), 1), k(n, ex.stream(), 2), v(n, ex.stream(), 3),
      dout(n, ex.stream(), 4), o(n, ex.stream(), 5), lse(rows, ex.stream(), 6),
      delta(rows, ex.stream(), 7), dq(n, ex.stream(), 8), dk(n, ex.stream(), 9),
      dv(n, ex.stream(), 10);
  if (kernels == path::mma) {  // where the device cannot run them, say so rather than abort
    const bool runs = gpu::detail::use_mma<mb::bf16>(ex, D);  // the executor's default asks for them
    if (!runs) {
      state.SkipWithError("the mma.sync kernels need sm_80 and their shared memory on this device");
      return;
    }
  }
  mb::bf16* o16 = nullptr;
  if (kernels != path::simt) mb::cuda_check(cudaMalloc(&o16, n * sizeof(mb::bf16)), "cudaMalloc");
  const mb::attention_band band = mb::band_of(s);  // unpacked: no offsets to stage
  auto once = [&] {
    if (kernels == path::mma) {
      gpu::detail::launch_forward_mma<mb::bf16, DM>(ex, s, q.p, k.p, v.p, o16, lse.p, band);
      if (with_backward) {
        gpu::detail::launch_backward_mma<mb::bf16, DM>(ex, s, q.p, k.p, v.p, dout.p, lse.p,
                                                       delta.p, dq.p, dk.p, dv.p, band);
      }
      return;
    }
    if (kernels == path::wmma) {
      gpu::detail::launch_forward_wmma<mb::bf16, DM>(ex, s, q.p, k.p, v.p, o16, lse.p, band);
    } else {
      gpu::detail::launch_forward<float, DM>(ex, s, q.p, k.p, v.p, o.p, lse.p, band);
    }
    if (with_backward) {
      gpu::detail::launch_backward<DM>(ex, s, q.p, k.p, v.p, dout.p, lse.p, delta.p, dq.p, dk.p,
                                       dv.p, band);
    }
  };
  timed_tflops(state, ex, once, B * H, T, D, causal, with_backward);
  if (o16 != nullptr) (void)cudaFree(o16);
}

void fwd_d64(benchmark::State& st, bool causal) { bm_attention<64>(st, 64, causal, false); }
void fwd_d128(benchmark::State& st, bool causal) { bm_attention<128>(st, 128, causal, false); }
void fwdbwd_d64(benchmark::State& st, bool causal) { bm_attention<64>(st, 64, causal, true); }
void fwdbwd_d128(benchmark::State& st, bool causal) { bm_attention<128>(st, 128, causal, true); }
void fwd_wmma_bf16_d64(benchmark::State& st, bool causal) {
  bm_attention<64>(st, 64, causal, false, path::wmma);
}
void fwd_wmma_bf16_d128(benchmark::State& st, bool causal) {
  bm_attention<128>(st, 128, causal, false, path::wmma);
}
void fwdbwd_wmma_bf16_d64(benchmark::State& st, bool causal) {
  bm_attention<64>(st, 64, causal, true, path::wmma);
}
void fwdbwd_wmma_bf16_d128(benchmark::State& st, bool causal) {
  bm_attention<128>(st, 128, causal, true, path::wmma);
}
void fwd_mma_bf16_d64(benchmark::State& st, bool causal) {
  bm_attention<64>(st, 64, causal, false, path::mma);
}
void fwd_mma_bf16_d128(benchmark::State& st, bool causal) {
  bm_attention<128>(st, 128, causal, false, path::mma);
}
void fwdbwd_mma_bf16_d64(benchmark::State& st, bool causal) {
  bm_attention<64>(st, 64, causal, true, path::mma);
}
void fwdbwd_mma_bf16_d128(benchmark::State& st, bool causal) {
  bm_attention<128>(st, 128, causal, true, path::mma);
}

#if defined(MEMBOUND_WITH_CUDNN)
// cuDNN's graphs on 16-bit tensors (what attention.cuh hands it), their workspace allocated here at
// the size cuDNN asks for (a counter), timed as the kernels above.
void bm_cudnn(benchmark::State& state, std::size_t D, bool causal, bool with_backward, bool deterministic) {
  if (!have_device()) {
    state.SkipWithError("no CUDA device");
    return;
  }
  const std::size_t T = static_cast<std::size_t>(state.range(0));
  const std::size_t H = 16, B = (16384 / T) > 0 ? 16384 / T : 1;
  const mb::attention_shape s{B, T, H * D, H, H, D, causal, 10000.0};
  mb::cuda_executor ex;
  ex.set_kernels({.attention = gpu::attention_kernels::cudnn, .cudnn_deterministic = deterministic});
  const std::size_t n = B * T * H * D, rows = B * H * T;
  const mb::attention_band band = mb::band_of(s);
  const std::size_t cap = std::size_t{4} << 30;  // the plan's slots bound it in attention.cuh; not here
  cudnnHandle_t h = nullptr;
  const auto fwd = gpu::cudnn_sdpa_plan<mb::bf16>(ex, s, band, false, cap, &h);
  const auto bwd = with_backward ? gpu::cudnn_sdpa_plan<mb::bf16>(ex, s, band, true, cap, &h) : nullptr;
  if (!fwd || (with_backward && !bwd)) {
    state.SkipWithError(("cuDNN does not run it: " + gpu::cudnn_attention_report().last_fallback).c_str());
    return;
  }
  device_floats f(n, ex.stream(), 1), lse(rows, ex.stream(), 6);
  mb::bf16* t16[8] = {};  // q, k, v, o, dO, dq, dk, dv
  for (auto*& p : t16) {
    mb::cuda_check(cudaMalloc(&p, n * sizeof(mb::bf16)), "cudaMalloc");
    gpu::convert(ex, static_cast<const float*>(f.p), p, n);
  }
  const std::size_t ws_bytes = static_cast<std::size_t>(std::max(fwd->workspace, bwd ? bwd->workspace : 0));
  void* ws = nullptr;
  if (ws_bytes > 0) mb::cuda_check(cudaMalloc(&ws, ws_bytes), "cudaMalloc");
  namespace cd = gpu::cudnn_detail;
  std::unordered_map<std::int64_t, void*> fpack{
      {cd::u_q, t16[0]}, {cd::u_k, t16[1]}, {cd::u_v, t16[2]}, {cd::u_o, t16[3]}, {cd::u_stats, lse.p}};
  std::unordered_map<std::int64_t, void*> bpack = fpack;
  bpack.insert({{cd::u_do, t16[4]}, {cd::u_dq, t16[5]}, {cd::u_dk, t16[6]}, {cd::u_dv, t16[7]}});
  auto once = [&] {
    cd::execute(ex, *fwd, h, fpack, ws, false);
    if (with_backward) cd::execute(ex, *bwd, h, bpack, ws, true);
  };
  timed_tflops(state, ex, once, B * H, T, D, causal, with_backward);
  for (auto* p : t16) (void)cudaFree(p);
  if (ws != nullptr) (void)cudaFree(ws);
  state.counters["workspace_MiB"] = static_cast<double>(ws_bytes) / (1024.0 * 1024.0);
  state.counters["cudnn_version"] = static_cast<double>(gpu::cudnn_attention_report().version);
}
void fwd_cudnn_bf16_d64(benchmark::State& st, bool causal) { bm_cudnn(st, 64, causal, false, true); }
void fwd_cudnn_bf16_d128(benchmark::State& st, bool causal) { bm_cudnn(st, 128, causal, false, true); }
void fwdbwd_cudnn_bf16_d64(benchmark::State& st, bool causal) { bm_cudnn(st, 64, causal, true, true); }
void fwdbwd_cudnn_bf16_d128(benchmark::State& st, bool causal) { bm_cudnn(st, 128, causal, true, true); }
void fwdbwd_cudnn_atomic_bf16_d64(benchmark::State& st, bool causal) { bm_cudnn(st, 64, causal, true, false); }
void fwdbwd_cudnn_atomic_bf16_d128(benchmark::State& st, bool causal) { bm_cudnn(st, 128, causal, true, false); }
#endif

}  // namespace

#define MEMBOUND_ATTN_BENCH(fn)                                                            \
  BENCHMARK_CAPTURE(fn, causal, true)->RangeMultiplier(2)->Range(512, 16384)->UseManualTime(); \
  BENCHMARK_CAPTURE(fn, full, false)->RangeMultiplier(2)->Range(512, 16384)->UseManualTime();
MEMBOUND_ATTN_BENCH(fwd_d64)
MEMBOUND_ATTN_BENCH(fwd_d128)
MEMBOUND_ATTN_BENCH(fwdbwd_d64)
MEMBOUND_ATTN_BENCH(fwdbwd_d128)
MEMBOUND_ATTN_BENCH(fwd_wmma_bf16_d64)
MEMBOUND_ATTN_BENCH(fwd_wmma_bf16_d128)
MEMBOUND_ATTN_BENCH(fwdbwd_wmma_bf16_d64)
MEMBOUND_ATTN_BENCH(fwdbwd_wmma_bf16_d128)
MEMBOUND_ATTN_BENCH(fwd_mma_bf16_d64)
MEMBOUND_ATTN_BENCH(fwd_mma_bf16_d128)
MEMBOUND_ATTN_BENCH(fwdbwd_mma_bf16_d64)
MEMBOUND_ATTN_BENCH(fwdbwd_mma_bf16_d128)
#if defined(MEMBOUND_WITH_CUDNN)
MEMBOUND_ATTN_BENCH(fwd_cudnn_bf16_d64)
MEMBOUND_ATTN_BENCH(fwd_cudnn_bf16_d128)
MEMBOUND_ATTN_BENCH(fwdbwd_cudnn_bf16_d64)
MEMBOUND_ATTN_BENCH(fwdbwd_cudnn_bf16_d128)
MEMBOUND_ATTN_BENCH(fwdbwd_cudnn_atomic_bf16_d64)
MEMBOUND_ATTN_BENCH(fwdbwd_cudnn_atomic_bf16_d128)
#endif

int main(int argc, char** argv) { return bench_flags::benchmark_main(argc, argv); }
