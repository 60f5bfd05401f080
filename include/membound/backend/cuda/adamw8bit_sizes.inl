// The 8-bit AdamW step's runs of parameters and block sizes.
// A fragment, not a header: model.cuh includes it inside namespace membound::gpu, and
// tests/emulation/adamw8bit_cuda_emulate.cpp includes the same text inside its emulation namespace,
// where the CUDA built-ins are host threads (tests/emulation/cuda_emulate.py adamw8bit). One text, compiled
// by nvcc and by the emulation: change the kernels here.
// Runs of parameters one launch takes (adjacent spans with the same decay merged first): a model
// has a few per block.
inline constexpr std::size_t adamw8bit_max_spans = 1024;
inline constexpr unsigned adamw8bit_threads = 256;

// The step's tables, a kernel parameter: both maps (codes and midpoints), the codes of 0, and the
// spans as [first, end) with their decay.
struct adamw8bit_tables {
  float code_m[256], code_v[256], mid_m[255], mid_v[255];
  std::uint64_t first[adamw8bit_max_spans], end[adamw8bit_max_spans];
  std::uint8_t decay[adamw8bit_max_spans];
  unsigned spans;
  std::uint8_t zero_m, zero_v;
};
static_assert(sizeof(adamw8bit_tables) + 512 <= 32764,
              "membound: adamw8bit_tables is a kernel parameter: it and the kernel's other arguments must "
              "stay within CUDA's 32,764 bytes; lower adamw8bit_max_spans");

// The nearest code to x among the 255 midpoints (ties to the lower code; NaN → 0), as
// quantization_map::quantize.
MEMBOUND_HOST_DEVICE inline std::uint8_t nearest_code(const float* mid, float x) {
  unsigned lo = 0, hi = 255;
  while (lo < hi) {
    const unsigned m = (lo + hi) / 2;
    if (mid[m] < x) lo = m + 1;
    else hi = m;
  }
  return static_cast<std::uint8_t>(lo);
}

// The tables for one step: the maps, and the spans with adjacent runs of one decay merged.
// Throws invalid_argument when more than adamw8bit_max_spans runs remain.
inline adamw8bit_tables adamw8bit_tables_for(std::span<const param_span> spans) {
  adamw8bit_tables tb{};
  const quantization_map& qm = signed_dynamic_map();
  const quantization_map& qv = unsigned_dynamic_map();
  for (std::size_t q = 0; q < 256; ++q) {
    tb.code_m[q] = qm.code[q];
    tb.code_v[q] = qv.code[q];
  }
  for (std::size_t q = 0; q < 255; ++q) {
    tb.mid_m[q] = qm.mid[q];
    tb.mid_v[q] = qv.mid[q];
  }
  tb.zero_m = qm.quantize(0.0f);
  tb.zero_v = qv.quantize(0.0f);
  std::size_t runs = 0;
  for (const param_span& s : spans) {
    if (s.count == 0) continue;
    if (runs > 0 && tb.end[runs - 1] == s.first && (tb.decay[runs - 1] != 0) == s.decay) {
      tb.end[runs - 1] += s.count;
      continue;
    }
    if (runs == adamw8bit_max_spans) {
      throw invalid_argument("spans", "at most " + std::to_string(adamw8bit_max_spans) +
                                          " runs of parameters with one decay (adjacent spans merged)",
                             "more", "Step this model with adamw on the device, or order its tensors so that "
                                     "those with weight decay are adjacent");
    }
    tb.first[runs] = s.first;
    tb.end[runs] = s.first + s.count;
    tb.decay[runs] = s.decay ? 1 : 0;
    ++runs;
  }
  tb.spans = static_cast<unsigned>(runs);
  return tb;
}
