// Diagnostic, not built by CMake: how accurately each cuBLASLt candidate algorithm computes a
// 16-bit GEMM on this GPU. For every candidate the heuristic returns (no split-K reduction), runs
// D = A·B with bf16 or fp16 inputs and outputs of the input type and of fp32, against the exact
// product in double, and prints per candidate:
//   fp32 out: max |D − exact| / (Σ|a||b|)            (fp32 accumulation: ~1e-7 or less)
//   16-bit out: elements not equal to exact rounded to nearest, and the worst error in ulps
//               (a correctly rounded fp32 sum gives 0 or a handful at ties/near-ties, ≤ 0.5 ulp)
//   nvcc -std=c++17 -arch=sm_90 -O2 tools/cuda_gemm_numerics.cu -lcublasLt -o gemm_numerics
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x) do { auto s_ = (x); if ((int)s_ != 0) { std::printf("%s:%d %s -> %d\n", __FILE__, __LINE__, #x, (int)s_); std::exit(1); } } while (0)

template <typename T> float to_f(T v);
template <> float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> float to_f(__half v) { return __half2float(v); }
template <> float to_f(float v) { return v; }
template <typename T> T from_d(double v);
template <> __nv_bfloat16 from_d(double v) { return __float2bfloat16_rn((float)v); }
template <> __half from_d(double v) { return __float2half_rn((float)v); }
template <> float from_d(double v) { return (float)v; }
template <typename T> cudaDataType_t dt();
template <> cudaDataType_t dt<__nv_bfloat16>() { return CUDA_R_16BF; }
template <> cudaDataType_t dt<__half>() { return CUDA_R_16F; }
template <> cudaDataType_t dt<float>() { return CUDA_R_32F; }

// Exact-in-double rounding to a 16-bit type (double -> float is exact enough for these values:
// the exact sum of ≤1000 products of 8/11-bit numbers fits in a double, and float -> 16-bit
// double rounding only matters at exact ties, which we count separately as "near ties").
template <typename T, typename Out>
void run(int m, int n, int k, unsigned seed) {
  std::vector<T> a(m * k), b(k * n);
  std::srand(seed);
  for (auto& v : a) v = from_d<T>(2.0 * std::rand() / RAND_MAX - 1.0);
  for (auto& v : b) v = from_d<T>(2.0 * std::rand() / RAND_MAX - 1.0);
  std::vector<double> exact(m * n, 0), scale(m * n, 0);
  for (int j = 0; j < n; ++j)
    for (int i = 0; i < m; ++i)
      for (int p = 0; p < k; ++p) {
        const double x = to_f(a[i + p * m]), y = to_f(b[p + j * k]);
        exact[i + j * m] += x * y;
        scale[i + j * m] += std::abs(x * y);
      }
  T *da, *db; Out* dd; void* ws;
  const size_t wsb = 32 << 20;
  CK(cudaMalloc(&da, a.size() * sizeof(T))); CK(cudaMalloc(&db, b.size() * sizeof(T)));
  CK(cudaMalloc(&dd, m * n * sizeof(Out))); CK(cudaMalloc(&ws, wsb));
  CK(cudaMemcpy(da, a.data(), a.size() * sizeof(T), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(db, b.data(), b.size() * sizeof(T), cudaMemcpyHostToDevice));
  cublasLtHandle_t lt; CK(cublasLtCreate(&lt));
  cublasLtMatmulDesc_t desc; CK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasLtMatrixLayout_t la, lb, ld;
  CK(cublasLtMatrixLayoutCreate(&la, dt<T>(), m, k, m));
  CK(cublasLtMatrixLayoutCreate(&lb, dt<T>(), k, n, k));
  CK(cublasLtMatrixLayoutCreate(&ld, dt<Out>(), m, n, m));
  cublasLtMatmulPreference_t pref; CK(cublasLtMatmulPreferenceCreate(&pref));
  uint64_t wsu = wsb; CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsu, sizeof(wsu)));
  uint32_t none = CUBLASLT_REDUCTION_SCHEME_NONE;
  CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &none, sizeof(none)));
  cublasLtMatmulHeuristicResult_t res[32]; int found = 0;
  CK(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, ld, ld, pref, 32, res, &found));
  std::printf("%s in, %s out, m=%d n=%d k=%d: %d candidates\n", dt<T>() == CUDA_R_16BF ? "bf16" : "fp16",
              dt<Out>() == CUDA_R_32F ? "fp32" : "16-bit", m, n, k, found);
  for (int c = 0; c < found; ++c) {
    int32_t id = 0, split = 0; uint32_t tile = 0, red = 0; uint64_t flags = 0; size_t w = 0;
    cublasLtMatmulAlgoConfigGetAttribute(&res[c].algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof(id), &w);
    cublasLtMatmulAlgoConfigGetAttribute(&res[c].algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile), &w);
    cublasLtMatmulAlgoConfigGetAttribute(&res[c].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split, sizeof(split), &w);
    cublasLtMatmulAlgoConfigGetAttribute(&res[c].algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &red, sizeof(red), &w);
    cublasLtMatmulAlgoCapGetAttribute(&res[c].algo, CUBLASLT_ALGO_CAP_NUMERICAL_IMPL_FLAGS, &flags, sizeof(flags), &w);
    std::vector<Out> d(m * n);
    for (auto& v : d) v = from_d<Out>(NAN);
    CK(cudaMemcpy(dd, d.data(), d.size() * sizeof(Out), cudaMemcpyHostToDevice));
    const float alpha = 1, beta = 0;
    const int st = cublasLtMatmul(lt, desc, &alpha, da, la, db, lb, &beta, dd, ld, dd, ld, &res[c].algo, ws, wsb, 0);
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(d.data(), dd, d.size() * sizeof(Out), cudaMemcpyDeviceToHost));
    double worst_scaled = 0, worst_ulps = 0; int wrong = 0;
    for (int i = 0; i < m * n; ++i) {
      const double got = to_f(d[i]);
      worst_scaled = std::fmax(worst_scaled, std::abs(got - exact[i]) / (scale[i] + 1e-30));
      if (dt<Out>() != CUDA_R_32F) {
        const double rn = to_f(from_d<Out>(exact[i]));
        if (got != rn || std::isnan(got)) ++wrong;
        const int e = std::ilogb(std::abs(exact[i]) + 1e-30);
        const double ulp = std::ldexp(1.0, e - (dt<Out>() == CUDA_R_16BF ? 7 : 10));
        worst_ulps = std::fmax(worst_ulps, std::abs(got - exact[i]) / ulp);
      }
    }
    std::printf("  cand %2d status %d algo %3d tile %3u split %d red %u flags 0x%llx ws %zu: "
                "max err/scale %.3g, not RN %d of %d, worst %.2f ulp\n",
                c, st, id, tile, split, red, (unsigned long long)flags, res[c].workspaceSize,
                worst_scaled, wrong, m * n, worst_ulps);
  }
  cudaFree(da); cudaFree(db); cudaFree(dd); cudaFree(ws);
}

int main() {
  run<__nv_bfloat16, __nv_bfloat16>(96, 64, 128, 1);
  run<__nv_bfloat16, float>(96, 64, 128, 1);
  run<__half, __half>(96, 64, 128, 2);
  run<__half, float>(96, 64, 128, 2);
  run<__nv_bfloat16, __nv_bfloat16>(40, 32, 1000, 3);
  run<__nv_bfloat16, float>(40, 32, 1000, 3);
  return 0;
}
