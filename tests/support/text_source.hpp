// The host trainer tests' learnable stream: a repeating phrase with a little noise over `vocab`
// ids; each request's window of Seq tokens (and its next-token targets) is drawn from the
// request's random bits, as the example trainer draws its windows. Stateless, so a resumed run,
// another rank or another placement of the optimizer draws what the uninterrupted run would.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "membound/train/data_source.hpp"

namespace membound_test {

template <std::size_t Seq>
struct text_source {
  std::vector<std::int32_t> text;
  explicit text_source(std::size_t vocab) {
    std::uint32_t s = 7;
    for (std::size_t i = 0; i < 4000; ++i) {
      s = s * 1664525u + 1013904223u;
      const bool noise = (s >> 24) % 10 == 0;
      text.push_back(static_cast<std::int32_t>(noise ? (s >> 8) % vocab : (i * 7 + i / 13) % vocab));
    }
  }
  void operator()(const membound::sequence_request& r, std::int32_t* x, std::int32_t* y) const {
    const std::size_t at = r.random % (text.size() - Seq - 1);
    for (std::size_t t = 0; t < Seq; ++t) {
      x[t] = text[at + t];
      y[t] = text[at + t + 1];
    }
  }
};

}  // namespace membound_test
