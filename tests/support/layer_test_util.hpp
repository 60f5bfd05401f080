// Helpers shared by the layer tests: aligned buffers for saved/workspace bytes, conversions
// between double and a storage type, and the relative error every tolerance is stated in.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <memory>
#include <new>
#include <vector>

#include <doctest/doctest.h>

#include "membound/core/dtype.hpp"

namespace membound_test {

// A buffer aligned to 256 bytes (membound::default_alignment), as carve requires.
struct aligned_buffer {
  struct deleter {
    void operator()(std::byte* p) const { ::operator delete(p, std::align_val_t{256}); }
  };
  std::unique_ptr<std::byte, deleter> p;
  std::size_t bytes = 0;
  explicit aligned_buffer(std::size_t n)
      : p(static_cast<std::byte*>(::operator new(n == 0 ? 1 : n, std::align_val_t{256}))),
        bytes(n) {}
  void* get() const { return p.get(); }
};

// max|a − b| / max|b| (absolute when b is all zeros).
inline double rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double d = 0.0, s = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    d = std::max(d, std::abs(a[i] - b[i]));
    s = std::max(s, std::abs(b[i]));
  }
  return s == 0.0 ? d : d / s;
}

template <typename S>
std::vector<S> to_storage(const std::vector<double>& v) {
  std::vector<S> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = membound::from_accum<S>(v[i]);
  return out;
}
template <typename S>
std::vector<double> to_double(const S* p, std::size_t n) {
  std::vector<double> out(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<double>(static_cast<float>(p[i]));
  return out;
}
template <>
inline std::vector<double> to_double<double>(const double* p, std::size_t n) {
  return std::vector<double>(p, p + n);
}
// The value a storage type holds for v (what the layer really sees as input).
template <typename S>
std::vector<double> rounded(const std::vector<double>& v) {
  const std::vector<S> s = to_storage<S>(v);
  return to_double(s.data(), s.size());
}

}  // namespace membound_test
