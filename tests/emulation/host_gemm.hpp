// The emulations' stand-ins for cuBLASLt: plain fp32 loops, sums in k order (emulation/cuda_emulate.py's
// programs check kernels, not GEMMs). nn: y[N,M] (+)= x[N,K]·w[K,M]; bt: w is [M,K]; at: g[K,M]
// (+)= x[N,K]ᵀ·d[N,M]. lx, lw, ly: row strides (cpu::ld3's order).
#pragma once

#include <cstddef>

namespace emu_support {

inline void mm(const float* x, const float* w, float* y, std::size_t N, std::size_t K, std::size_t M, bool acc,
               std::size_t lx, std::size_t lw, std::size_t ly) {
  for (std::size_t n = 0; n < N; ++n)
    for (std::size_t m = 0; m < M; ++m) {
      float a = 0;
      for (std::size_t k = 0; k < K; ++k) a += x[n * lx + k] * w[k * lw + m];
      y[n * ly + m] = acc ? y[n * ly + m] + a : a;
    }
}
inline void mm(const float* x, const float* w, float* y, std::size_t N, std::size_t K, std::size_t M, bool acc) {
  mm(x, w, y, N, K, M, acc, K, M, M);
}
inline void mm_bt(const float* x, const float* w, float* y, std::size_t N, std::size_t K, std::size_t M, bool acc,
                  std::size_t lx, std::size_t lw, std::size_t ly) {
  for (std::size_t n = 0; n < N; ++n)
    for (std::size_t m = 0; m < M; ++m) {
      float a = 0;
      for (std::size_t k = 0; k < K; ++k) a += x[n * lx + k] * w[m * lw + k];
      y[n * ly + m] = acc ? y[n * ly + m] + a : a;
    }
}
inline void mm_bt(const float* x, const float* w, float* y, std::size_t N, std::size_t K, std::size_t M, bool acc) {
  mm_bt(x, w, y, N, K, M, acc, K, K, M);
}
inline void mm_at(const float* x, const float* d, float* g, std::size_t N, std::size_t K, std::size_t M, bool acc,
                  std::size_t lx, std::size_t ldd, std::size_t lg) {
  for (std::size_t k = 0; k < K; ++k)
    for (std::size_t m = 0; m < M; ++m) {
      float a = 0;
      for (std::size_t n = 0; n < N; ++n) a += x[n * lx + k] * d[n * ldd + m];
      g[k * lg + m] = acc ? g[k * lg + m] + a : a;
    }
}
inline void mm_at(const float* x, const float* d, float* g, std::size_t N, std::size_t K, std::size_t M, bool acc) {
  mm_at(x, d, g, N, K, M, acc, K, M, M);
}

}  // namespace emu_support
