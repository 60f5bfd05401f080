// The over-alignment bookkeeping the CUDA device and pinned allocators share
// (memory/over_alignment.hpp), on host memory: growth_for is exactly what an allocation reserves,
// the pointer handed out is aligned and inside the reserved block, release gives back the block
// and its reserved bytes (and forgets it), and guaranteed alignments take no record.
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "membound/memory/over_alignment.hpp"

namespace mb = membound;

TEST_CASE("over_aligned_blocks: growth, placement and release") {
  using blocks = mb::detail::over_aligned_blocks<256>;
  CHECK(blocks::growth_for(0, 4096) == 0);
  CHECK(blocks::growth_for(100, 64) == 100);
  CHECK(blocks::growth_for(100, 256) == 100);
  CHECK(blocks::growth_for(100, 4096) == 100 + 4096 - 256);

  blocks b;
  for (const std::size_t alignment : {std::size_t{256}, std::size_t{512}, std::size_t{4096}, std::size_t{1} << 21}) {
    for (const std::size_t bytes : {std::size_t{1}, std::size_t{1000}, std::size_t{1} << 20}) {
      const std::size_t reserved = blocks::growth_for(bytes, alignment);
      // An upstream block at an address that is 256-aligned but no more, the worst case.
      std::vector<unsigned char> arena(reserved + 3 * alignment);
      auto base = reinterpret_cast<std::uintptr_t>(arena.data());
      base = (base + 2 * alignment - 1) / (2 * alignment) * (2 * alignment) + 256;
      if (alignment == 256) base -= 256;
      void* raw = reinterpret_cast<void*>(base);
      void* p = b.place(raw, reserved, alignment);
      const auto at = reinterpret_cast<std::uintptr_t>(p);
      CHECK(at % alignment == 0);
      CHECK(at >= base);
      CHECK(at + bytes <= base + reserved);  // the bytes handed out lie inside what was reserved
      CHECK(b.recorded() == (alignment > 256 ? 1u : 0u));
      const auto [back, back_reserved] = b.release(p, bytes, alignment);
      CHECK(back == raw);
      CHECK(back_reserved == reserved);
      CHECK(b.recorded() == 0);
    }
  }
}
