// Deterministic test data shared by the test suites.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace membound_test {

// splitmix64: the same numbers with every standard library (std:: distributions are not).
struct rng {
  std::uint64_t s;
  std::uint64_t next() {
    std::uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform(double lo, double hi) {
    return lo + (hi - lo) * static_cast<double>(next() >> 11) * 0x1.0p-53;
  }
  // In [0, n) (0 for n = 0): random sizes and choices for randomized tests.
  std::size_t below(std::size_t n) { return static_cast<std::size_t>(next() % (n == 0 ? 1 : n)); }
  std::vector<double> fill(std::size_t n, double scale) {
    std::vector<double> v(n);
    for (double& e : v) e = uniform(-scale, scale);
    return v;
  }
};

}  // namespace membound_test
