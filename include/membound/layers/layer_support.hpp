// What every layer front end shares: can_implement's answer, the argument checks that name what
// is wrong, carving the caller's saved/workspace bytes, and overflow-safe size arithmetic.
//
// Every layer runs on the caller's buffers and the caller's executor (on cuda_backend, its
// stream: cuda_executor(stream, device) borrows one). A CUDA project's __nv_bfloat16* / __half*
// buffers have the bits of the layers' bf16 / fp16 storage and pass as they are through
// storage_ptr (backend/cuda/interop.cuh); memory for them and for saved/workspace bytes should
// come from the allocator as the executor's stream sees it (stream_view, memory/stream.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

#include "membound/core/checked_math.hpp"
#include "membound/core/argument_checks.hpp"
#include "membound/core/config.hpp"
#include "membound/core/error.hpp"
#include "membound/core/format.hpp"
#include "membound/memory/workspace.hpp"
#include "membound/shape/packed_sequences.hpp"

MEMBOUND_NAMESPACE_BEGIN

// can_implement's answer: which argument fails, what it expected and what it got. Never throws.
struct layer_support {
  bool ok = true;
  const char* argument = "";
  const char* expected = "";
  double actual = 0.0;
  constexpr explicit operator bool() const noexcept { return ok; }
};

namespace detail {

// The layers' size sums saturate with the rest of the library's (core/checked_math.hpp).
using ::membound::sat_add;
using ::membound::sat_mul;

// Throws invalid_argument for a failed can_implement answer; `real_valued` arguments print
// their value as a real number, the others as a signed whole number (whole_text).
inline void throw_unsupported(const layer_support& r, bool real_valued, const char* what_to_do) {
  throw invalid_argument(r.argument, r.expected, real_valued ? std::to_string(r.actual) : whole_text(r.actual),
                         what_to_do);
}

// A shape's packed sequences (shape/packed_sequences.hpp) as can_implement's answer (every
// layer takes them on both backends): check_packing's verdict. A shape with `sequences` set and
// no offsets sizes a call for any packing of its tokens into that many sequences (a plan made
// before the data exists): accepted here, and forward and backward refuse it (need_offsets),
// since they need to know where each sequence starts.
constexpr layer_support packing_support(const std::int32_t* offsets, std::size_t sequences,
                                        std::size_t batch, std::size_t seq) noexcept {
  if (offsets == nullptr && batch != 1) {
    return layer_support{false, "shape.batch", "1 with packed sequences (they share one token axis)",
                         static_cast<double>(batch)};
  }
  if (offsets == nullptr) return {};
  const packing_check r = check_packing(offsets, sequences, batch, seq);
  return layer_support{r.ok, r.argument, r.expected, r.actual};
}

// Forward and backward run packed sequences only with their offsets: a shape that has
// `sequences` and no offsets only sizes the call (packing_support).
inline void need_offsets(const std::int32_t* offsets, std::size_t sequences) {
  if (sequences != 0 && offsets == nullptr) {
    throw invalid_argument("shape.offsets", "the offsets of the shape.sequences packed sequences",
                           "nullptr",
                           "A shape without offsets sizes a packed call; set them to run it");
  }
}

// Decoding takes one sequence per batch row: a packed shape is refused before check(), which
// would measure its offsets against shape.seq (which decoding ignores).
inline void refuse_packed_decoding(const std::int32_t* offsets, std::size_t sequences,
                                   const char* what_to_do) {
  if (offsets != nullptr || sequences != 0) {
    throw invalid_argument(offsets != nullptr ? "shape.offsets" : "shape.sequences", "none for decoding",
                           "packed sequences", what_to_do);
  }
}

// carve, but the errors name `name` (saved, workspace, state...).
template <std::size_t N>
workspace_view<N> carve_named(const workspace_layout<N>& layout, std::size_t need, void* base,
                              std::size_t bytes, const char* name) {
  need_space(base, bytes, need, name);
  need_aligned(base, layout.alignment(), name);
  return carve(layout, base, bytes);
}

// The backend carves the workspace; the front checks its size and base first against the
// backend's own figure, as carve_named does (workspace_too_small naming "workspace", then the
// 256-byte alignment of every layout's slots), so a short or misaligned workspace is refused the
// same way on every backend, a SIZE_MAX requirement included.
inline void check_workspace_size(std::size_t need, void* workspace, std::size_t workspace_size) {
  need_space(workspace, workspace_size, need, "workspace");
  need_aligned(workspace, default_alignment, "workspace");
}

}  // namespace detail

MEMBOUND_NAMESPACE_END
