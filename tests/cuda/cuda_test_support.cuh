// The harness of the GPU tests: CHECK without aborting, typed-exception checks, the CPU-vs-GPU
// comparisons, and a main() that reports "SKIPPED: no CUDA device" with exit code 77 (ctest's
// SKIP_RETURN_CODE) on a machine without one, so the suite never passes silently there.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <exception>
#include <iterator>
#include <limits>
#include <new>
#include <string>
#include <vector>

#include "membound/backend/cuda.cuh"

namespace mbt {

inline int failures = 0;

#define CHECK(cond)                                                                  \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++::mbt::failures;                                                             \
    }                                                                                \
  } while (0)

// Runs `body` and checks that it throws E; returns the exception's message.
template <typename E, typename F>
std::string expect_throw(F&& body, const char* what, int line) {
  try {
    body();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "line %d: %s threw the wrong type: %s\n", line, what, e.what());
    ++failures;
    return {};
  }
  std::fprintf(stderr, "line %d: %s did not throw\n", line, what);
  ++failures;
  return {};
}
#define EXPECT_THROW(E, stmt) ::mbt::expect_throw<E>([&] { stmt; }, #stmt, __LINE__)

// The normwise relative error max|got − want| / max(max|want|, floor), the metric of the CPU
// layer tests (tests/support/layer_test_util.hpp's rel_err), checked against `tolerance`; the
// worst element is printed with its index when it fails. Elementwise relative errors are the
// wrong yardstick for layer outputs: they are cancelling sums whose rounding scales with their
// terms, not with the (often tiny) result, and the first run on a GPU (H200, 2026-11-26) showed
// fp32 layers at 2e-5..1.6e-4 elementwise but ≤ 7.8e-7 normwise. `floor` is the smallest scale
// used, for an all-zero `want`. Every call prints its measured error, the figures notes quote.
inline bool close_normwise(const char* name, const std::vector<double>& got,
                           const std::vector<double>& want, double tolerance, double floor = 1e-6) {
  if (got.size() != want.size()) {
    std::fprintf(stderr, "%s: %zu values, expected %zu\n", name, got.size(), want.size());
    ++failures;
    return false;
  }
  double diff = 0, scale = floor;
  std::size_t at = 0;
  bool nan = false;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double d = std::abs(got[i] - want[i]);
    if (std::isnan(d)) nan = true;
    if (d > diff || (std::isnan(d) && !nan)) at = i;
    if (d > diff) diff = d;
    scale = std::max(scale, std::abs(want[i]));
  }
  const double error = nan ? std::numeric_limits<double>::quiet_NaN() : diff / scale;
  std::printf("  %s: normwise relative error %.3g (tolerance %.3g)\n", name, error, tolerance);
  if (!(error <= tolerance)) {  // NaN fails
    std::fprintf(stderr,
                 "%s: normwise relative error %.3g, worst at [%zu] (got %.9g, want %.9g, scale "
                 "%.3g), tolerance %.3g\n",
                 name, error, at, got.empty() ? 0.0 : got[at], want.empty() ? 0.0 : want[at],
                 scale, tolerance);
    ++failures;
    return false;
  }
  return true;
}

// Largest |got − want| / (|want| + floor) over two host arrays, printed with its name and index
// when it is above `tolerance`. floor keeps values near zero from dominating a relative check.
// For elementwise kernels, whose every output is its own short computation; layer outputs are
// compared with close_normwise.
inline bool close(const char* name, const std::vector<double>& got, const std::vector<double>& want,
                  double tolerance, double floor = 1e-6) {
  if (got.size() != want.size()) {
    std::fprintf(stderr, "%s: %zu values, expected %zu\n", name, got.size(), want.size());
    ++failures;
    return false;
  }
  double worst = 0;
  std::size_t at = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double e = std::abs(got[i] - want[i]) / (std::abs(want[i]) + floor);
    if (!(e <= worst)) {  // NaN counts as the worst
      worst = e;
      at = i;
      if (std::isnan(e)) break;
    }
  }
  std::printf("  %s: worst relative error %.3g (tolerance %.3g, floor %.3g)\n", name, worst,
              tolerance, floor);
  if (!(worst <= tolerance)) {
    std::fprintf(stderr, "%s: relative error %.3g at [%zu] (got %.9g, want %.9g), tolerance %.3g\n",
                 name, worst, at, got[at], want[at], tolerance);
    ++failures;
    return false;
  }
  return true;
}

// A device buffer for tests: allocated with cudaMalloc outside any membound allocator (the tests
// compare the library against plain CUDA), freed on scope exit.
template <typename T>
class device_buffer {
 public:
  explicit device_buffer(std::size_t n) : n_(n) {
    if (n_ != 0) membound::cuda_check(cudaMalloc(&p_, n_ * sizeof(T)), "cudaMalloc");
  }
  explicit device_buffer(const std::vector<T>& host) : device_buffer(host.size()) { upload(host); }
  ~device_buffer() {
    if (p_ != nullptr) (void)cudaFree(p_);
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  T* get() const noexcept { return p_; }
  std::size_t size() const noexcept { return n_; }
  // cudaMemcpy runs on the legacy default stream, which does not order against the library's
  // non-blocking streams (and a pageable upload may return before its DMA lands): both copies
  // wait for the whole device, so a test's upload is complete before the next launch on any
  // stream, and a download sees every launch before it.
  void upload(const std::vector<T>& host) {
    membound::cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    membound::cuda_check(cudaMemcpy(p_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice),
                         "cudaMemcpy");
    membound::cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
  std::vector<T> download() const {
    std::vector<T> host(n_);
    membound::cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    membound::cuda_check(cudaMemcpy(host.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost),
                         "cudaMemcpy");
    return host;
  }

 private:
  T* p_ = nullptr;
  std::size_t n_ = 0;
};

// Host bytes aligned to 256 (membound::default_alignment), as the CPU layers' saved and
// workspace buffers must be: the CPU reference side of a GPU test.
class host_buffer {
 public:
  explicit host_buffer(std::size_t n)
      : p_(static_cast<std::uint8_t*>(::operator new(n == 0 ? 1 : n, std::align_val_t{256}))),
        n_(n) {
    std::memset(p_, 0, n == 0 ? 1 : n);
  }
  ~host_buffer() { ::operator delete(p_, std::align_val_t{256}); }
  host_buffer(const host_buffer&) = delete;
  host_buffer& operator=(const host_buffer&) = delete;
  std::uint8_t* data() const noexcept { return p_; }
  std::size_t size() const noexcept { return n_; }

 private:
  std::uint8_t* p_;
  std::size_t n_;
};

// Largest |value|: the scale a cancelling sum's rounding is measured against.
inline double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double e : v) m = std::max(m, std::abs(e));
  return m;
}

struct test_case {
  const char* name;
  void (*run)();
};

// The main() of every GPU test file: skip (77) without a device, else run each case and print
// "name: ok|FAILED"; exit 1 when anything failed.
template <std::size_t N>
int run_suite(const char* suite, const test_case (&cases)[N]) {
  // MEMBOUND_TEST_LIST=FILE: the case names into FILE, one per line, and nothing run (no device
  // needed; a test's host part may print first), so that a sanitizer can run each case in its
  // own process (tools/gpu_session.sh); MEMBOUND_TEST_CASE=<name>: only the case of exactly that
  // name (exit 2 when none has it).
  if (const char* list = std::getenv("MEMBOUND_TEST_LIST"); list != nullptr && *list != '\0') {
    std::FILE* f = std::fopen(list, "w");
    if (f == nullptr) {
      std::fprintf(stderr, "%s: MEMBOUND_TEST_LIST: cannot write '%s'\n", suite, list);
      return 2;
    }
    for (const auto& t : cases) std::fprintf(f, "%s\n", t.name);
    return std::fclose(f) == 0 ? 0 : 2;
  }
  const char* only = std::getenv("MEMBOUND_TEST_CASE");
  if (only != nullptr && std::none_of(std::begin(cases), std::end(cases),
                                      [&](const test_case& t) { return std::string(t.name) == only; })) {
    std::fprintf(stderr, "%s: MEMBOUND_TEST_CASE names no case: '%s' (MEMBOUND_TEST_LIST=FILE lists them)\n", suite, only);
    return 2;
  }
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess || count == 0) {
    std::printf("SKIPPED: no CUDA device (%s): %s\n", suite,
                status != cudaSuccess ? cudaGetErrorString(status)
                                      : "cudaGetDeviceCount found 0 devices");
    return 77;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) {
    std::printf("%s on device 0: %s (sm_%d%d)\n", suite, prop.name, prop.major, prop.minor);
  }
  for (const auto& t : cases) {
    if (only != nullptr && std::string(t.name) != only) continue;
    const int before = failures;
    try {
      t.run();
      const cudaError_t sticky = cudaDeviceSynchronize();  // a kernel fault surfaces here
      if (sticky != cudaSuccess) {
        std::fprintf(stderr, "%s: device error after the case: %s\n", t.name,
                     cudaGetErrorString(sticky));
        ++failures;
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s: unexpected exception: %s\n", t.name, e.what());
      ++failures;
    }
    std::printf("%s: %s\n", t.name, failures == before ? "ok" : "FAILED");
  }
  return failures == 0 ? 0 : 1;
}

// ---- Host data for the CPU-vs-GPU comparisons, shared by the layer tests --------------------------
// n values in [offset − scale, offset + scale) from a fixed LCG, rounded to S.
template <typename S>
std::vector<S> random_values(std::size_t n, std::uint32_t seed, float scale, float offset = 0.0f) {
  std::vector<S> v(n);
  std::uint32_t s = seed * 2654435761u + 7;
  for (auto& x : v) {
    s = s * 1664525u + 1013904223u;
    const float u = static_cast<float>(s >> 8) / static_cast<float>(1u << 24);
    x = membound::from_accum<S>(offset + scale * (2.0f * u - 1.0f));
  }
  return v;
}
template <typename S>
std::vector<double> as_double(const std::vector<S>& v) {
  std::vector<double> d(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) d[i] = static_cast<double>(membound::to_accum<float>(v[i]));
  return d;
}
template <typename S>
bool same_bits(const std::vector<S>& a, const std::vector<S>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(S)) == 0);
}
inline bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof(double)) == 0; }
// Raw bytes and back, for bit comparisons of buffers of any element type.
template <typename T>
std::vector<std::uint8_t> to_bytes(const std::vector<T>& v) {
  std::vector<std::uint8_t> b(v.size() * sizeof(T));
  if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}
template <typename T>
std::vector<T> from_bytes(const std::uint8_t* p, std::size_t bytes) {
  std::vector<T> v(bytes / sizeof(T));
  if (!v.empty()) std::memcpy(v.data(), p, v.size() * sizeof(T));
  return v;
}
template <typename T>
std::vector<T> from_bytes(const std::vector<std::uint8_t>& b) {
  return from_bytes<T>(b.data(), b.size());
}
template <typename T>
std::vector<T> from_bytes(const host_buffer& b) {
  return from_bytes<T>(b.data(), b.size());
}

}  // namespace mbt
