// TFLOP/s of gpu::matmul / matmul_bt / matmul_at (backend/cuda/gemm.cuh) against a bare cuBLASLt
// call on the same shapes, in the same run, on the same stream.
//
// The bare call is what a caller without membound writes: descriptors built once, the
// heuristic's first choice with the same workspace cap and otherwise default preferences (every
// reduction scheme allowed, 256-byte alignment assumed), then cublasLtMatmul in a loop. The
// `ratio` counter is ours / bare in throughput: below 1 it is the price of the plan lookup and
// validation (small shapes) or of refusing split-K for bit-reproducibility (long K, small N·M).
//
// Counters: TFLOP/s (ours), bare_TFLOP/s, ratio. Without a device each benchmark is skipped.
#include <benchmark/benchmark.h>
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

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

// Non-zero data (tensor cores draw less power on zeros, which would flatter both sides).
template <typename T>
__device__ T from_float_device(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16(v);
  } else {
    return __float2half(v);
  }
}

template <typename Raw>
__global__ void fill_kernel(Raw* p, std::size_t n, std::uint32_t seed) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    const std::uint32_t h = (static_cast<std::uint32_t>(i) ^ seed) * 2654435761u;
    p[i] = from_float_device<Raw>(static_cast<float>(h >> 16) / 65536.0f - 0.5f);
  }
}

template <typename T>
using raw_t =
    std::conditional_t<std::is_same_v<T, float>, float,
                       std::conditional_t<std::is_same_v<T, mb::bf16>, __nv_bfloat16, __half>>;

template <typename T>
struct device_array {
  T* p = nullptr;
  explicit device_array(std::size_t n, cudaStream_t s, std::uint32_t seed) {
    mb::cuda_check(cudaMalloc(&p, n * sizeof(T)), "cudaMalloc");
    if constexpr (gpu::gemm_element<T>) {  // the workspace needs no contents
      fill_kernel<<<1024, 256, 0, s>>>(reinterpret_cast<raw_t<T>*>(p), n, seed);
      mb::cuda_executor::check_launch("fill_kernel");
    } else {
      (void)s;
      (void)seed;
    }
  }
  ~device_array() { (void)cudaFree(p); }
  device_array(const device_array&) = delete;
  device_array& operator=(const device_array&) = delete;
};

// The bare cuBLASLt call, in the same column-major swap as gemm.cuh (A = w, B = x, C = yᵀ).
template <typename T>
class bare_lt_gemm {
 public:
  bare_lt_gemm(cublasLtHandle_t lt, gpu::gemm_op op, std::size_t N, std::size_t K, std::size_t M,
               std::size_t workspace_cap) {
    const cudaDataType_t t = gpu::cuda_data_type_v<T>;
    mb::cublas_check(cublasLtMatmulDescCreate(&desc_, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                     "cublasLtMatmulDescCreate");
    cublasOperation_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_N;
    std::uint64_t ar = M, ac = K, br = K, bc = N, cr = M, cc = N;
    std::int64_t lda = static_cast<std::int64_t>(M), ldb = static_cast<std::int64_t>(K);
    if (op == gpu::gemm_op::bt) {
      ta = CUBLAS_OP_T;
      ar = K;
      ac = M;
      lda = static_cast<std::int64_t>(K);
    } else if (op == gpu::gemm_op::at) {
      tb = CUBLAS_OP_T;
      ar = M;
      ac = N;
      br = K;
      bc = N;
      cc = K;
      lda = static_cast<std::int64_t>(M);
      ldb = static_cast<std::int64_t>(K);
    }
    mb::cublas_check(
        cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)),
        "cublasLtMatmulDescSetAttribute");
    mb::cublas_check(
        cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)),
        "cublasLtMatmulDescSetAttribute");
    mb::cublas_check(cublasLtMatrixLayoutCreate(&a_, t, ar, ac, lda), "cublasLtMatrixLayoutCreate");
    mb::cublas_check(cublasLtMatrixLayoutCreate(&b_, t, br, bc, ldb), "cublasLtMatrixLayoutCreate");
    mb::cublas_check(cublasLtMatrixLayoutCreate(&c_, t, cr, cc, static_cast<std::int64_t>(cr)),
                     "cublasLtMatrixLayoutCreate");
    cublasLtMatmulPreference_t pref = nullptr;
    mb::cublas_check(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
    const std::uint64_t cap = workspace_cap;
    (void)cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &cap,
                                               sizeof(cap));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t s =
        cublasLtMatmulAlgoGetHeuristic(lt, desc_, a_, b_, c_, c_, pref, 1, &result, &found);
    (void)cublasLtMatmulPreferenceDestroy(pref);
    mb::cublas_check(s, "cublasLtMatmulAlgoGetHeuristic");
    if (found == 0) {
      throw mb::backend_error("cublasLtMatmulAlgoGetHeuristic", 0, "no algorithm (bare call)");
    }
    algo_ = result.algo;
  }
  ~bare_lt_gemm() {
    (void)cublasLtMatrixLayoutDestroy(c_);
    (void)cublasLtMatrixLayoutDestroy(b_);
    (void)cublasLtMatrixLayoutDestroy(a_);
    (void)cublasLtMatmulDescDestroy(desc_);
  }
  bare_lt_gemm(const bare_lt_gemm&) = delete;
  bare_lt_gemm& operator=(const bare_lt_gemm&) = delete;

  void run(const mb::cuda_executor& exec, const T* x, const T* w, T* y, void* ws,
           std::size_t ws_bytes) const {
    const float alpha = 1.0f, beta = 0.0f;
    mb::cublas_check(cublasLtMatmul(exec.lt(), desc_, &alpha, w, a_, x, b_, &beta, y, c_, y, c_,
                                    &algo_, ws, ws_bytes, exec.stream()),
                     "cublasLtMatmul");
  }

 private:
  cublasLtMatmulDesc_t desc_ = nullptr;
  cublasLtMatrixLayout_t a_ = nullptr, b_ = nullptr, c_ = nullptr;
  cublasLtMatmulAlgo_t algo_{};
};

// Seconds for `reps` launches of f on the stream, between two events.
template <typename F>
double time_on_stream(cudaStream_t s, int reps, F&& f) {
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
  return static_cast<double>(ms) * 1e-3;
}

template <typename T>
void bm_gemm(benchmark::State& state, gpu::gemm_op op, std::size_t N, std::size_t K,
             std::size_t M) {
  if (!have_device()) {
    state.SkipWithError("no CUDA device");
    return;
  }
  mb::cuda_executor exec;
  gpu::gemm_cache cache;
  const std::size_t ws_bytes = gpu::gemm_workspace_bytes(exec);
  device_array<unsigned char> ws(ws_bytes, exec.stream(), 0);
  // Row-major sizes as backend/cpu/gemm.hpp has them: x N×K; w K×M, M×K or (d) N×M; y N×M or K×M.
  const std::size_t w_elems = op == gpu::gemm_op::at ? N * M : K * M;
  const std::size_t y_elems = op == gpu::gemm_op::at ? K * M : N * M;
  device_array<T> x(N * K, exec.stream(), 1), w(w_elems, exec.stream(), 2);
  device_array<T> y(y_elems, exec.stream(), 3), y_bare(y_elems, exec.stream(), 4);
  const gpu::gemm_context ctx(exec, cache, ws.p, ws_bytes);
  const bare_lt_gemm<T> bare(exec.lt(), op, N, K, M, ws_bytes);

  const auto ours = [&] {
    switch (op) {
      case gpu::gemm_op::nn:
        gpu::matmul(ctx, x.p, w.p, y.p, N, K, M, false);
        break;
      case gpu::gemm_op::bt:
        gpu::matmul_bt(ctx, x.p, w.p, y.p, N, K, M, false);
        break;
      case gpu::gemm_op::at:
        gpu::matmul_at(ctx, x.p, w.p, y.p, N, K, M, false);
        break;
    }
  };
  const auto theirs = [&] { bare.run(exec, x.p, w.p, y_bare.p, ws.p, ws_bytes); };
  ours();  // plans (the heuristic runs once, outside the timing) and warms up
  theirs();
  exec.synchronize();

  const double flops =
      2.0 * static_cast<double>(N) * static_cast<double>(K) * static_cast<double>(M);
  const int reps = flops > 1e11 ? 5 : 50;
  double ours_s = 0, bare_s = 0;
  for (auto _ : state) {
    const double a = time_on_stream(exec.stream(), reps, ours);
    const double b = time_on_stream(exec.stream(), reps, theirs);
    ours_s += a;
    bare_s += b;
    state.SetIterationTime(a / reps);
  }
  const double n = static_cast<double>(state.iterations()) * reps;
  state.counters["TFLOP/s"] = flops * n / ours_s / 1e12;
  state.counters["bare_TFLOP/s"] = flops * n / bare_s / 1e12;
  state.counters["ratio"] = bare_s / ours_s;
  state.SetLabel(std::string(gpu::gemm_op_name(op)) + " " + std::string(mb::dtype_name<T>()));
}

// BENCHMARK_CAPTURE pastes the function's name into identifiers, so no template arguments there.
void bm_bf16(benchmark::State& state, gpu::gemm_op op, std::size_t N, std::size_t K,
             std::size_t M) {
  bm_gemm<mb::bf16>(state, op, N, K, M);
}
void bm_fp32(benchmark::State& state, gpu::gemm_op op, std::size_t N, std::size_t K,
             std::size_t M) {
  bm_gemm<float>(state, op, N, K, M);
}

// Square; a 7B-class layer at 8192 tokens (up projection, its input and weight gradients);
// decode-sized N; a weight gradient of a narrow projection (long K, where split-K would help).
#define MEMBOUND_GEMM_SHAPES(fn)                                                 \
  BENCHMARK_CAPTURE(fn, nn_4096x4096x4096, gpu::gemm_op::nn, 4096, 4096, 4096)   \
      ->UseManualTime()                                                          \
      ->Unit(benchmark::kMillisecond);                                           \
  BENCHMARK_CAPTURE(fn, nn_8192x4096x11008, gpu::gemm_op::nn, 8192, 4096, 11008) \
      ->UseManualTime()                                                          \
      ->Unit(benchmark::kMillisecond);                                           \
  BENCHMARK_CAPTURE(fn, bt_8192x11008x4096, gpu::gemm_op::bt, 8192, 11008, 4096) \
      ->UseManualTime()                                                          \
      ->Unit(benchmark::kMillisecond);                                           \
  BENCHMARK_CAPTURE(fn, at_8192x4096x11008, gpu::gemm_op::at, 8192, 4096, 11008) \
      ->UseManualTime()                                                          \
      ->Unit(benchmark::kMillisecond);                                           \
  BENCHMARK_CAPTURE(fn, nn_16x4096x4096, gpu::gemm_op::nn, 16, 4096, 4096)       \
      ->UseManualTime()                                                          \
      ->Unit(benchmark::kMicrosecond);                                           \
  BENCHMARK_CAPTURE(fn, at_65536x256x256, gpu::gemm_op::at, 65536, 256, 256)     \
      ->UseManualTime()                                                          \
      ->Unit(benchmark::kMicrosecond)

MEMBOUND_GEMM_SHAPES(bm_bf16);
MEMBOUND_GEMM_SHAPES(bm_fp32);

}  // namespace

int main(int argc, char** argv) { return bench_flags::benchmark_main(argc, argv); }
