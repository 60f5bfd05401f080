// Precision policy: the scalar type tensors are stored in and the one sums are carried in. A
// layer reads Storage, accumulates in Accum (to_accum, exact) and writes Storage back with one
// rounding (from_accum).
#pragma once

#include <concepts>
#include <cstddef>

#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/policy/policy_kind.hpp"

MEMBOUND_NAMESPACE_BEGIN

MEMBOUND_POLICY_KIND(precision_kind, "precision");

namespace detail {
template <typename Storage, typename Accum>
consteval bool check_precision() {
  static_assert(storage_scalar<Storage>,
                "membound: precision<Storage, Accum>: Storage must be float, double, "
                "membound::bf16 or membound::fp16.");
  static_assert(accumulation_scalar<Accum>,
                "membound: precision<Storage, Accum>: Accum must be float or double; a narrower "
                "accumulator (bf16, fp16) loses the sums. Accumulate in float, e.g. "
                "precision<bf16, float> (bf16_precision).");
  if constexpr (storage_scalar<Storage> && accumulation_scalar<Accum>) {
    static_assert(sizeof(Storage) <= sizeof(Accum),
                  "membound: precision<Storage, Accum>: Storage is wider than Accum (double "
                  "storage with float accumulation), so every read would round. Accumulate in "
                  "double (fp64_precision = precision<double, double>) or store in float "
                  "(fp32_precision).");
    return sizeof(Storage) <= sizeof(Accum);
  } else {
    return false;
  }
}
}  // namespace detail

// Storage must model storage_scalar and Accum accumulation_scalar, at least as wide as Storage.
// Checked by static_assert rather than in the template head, so that a wrong pair gets a
// sentence saying what to use instead of a constraint dump.
template <typename Storage, typename Accum>
struct precision {
  static_assert(detail::check_precision<Storage, Accum>());

  using policy_kind = precision_kind;
  using storage_type = Storage;
  using accum_type = Accum;

  // For size functions: bytes of a stored or an accumulator array with these extents.
  static constexpr std::size_t storage_bytes(
      std::convertible_to<std::size_t> auto... extents) noexcept {
    return bytes_of<Storage>(extents...);
  }
  static constexpr std::size_t accum_bytes(
      std::convertible_to<std::size_t> auto... extents) noexcept {
    return bytes_of<Accum>(extents...);
  }
};

using fp32_precision = precision<float, float>;
using bf16_precision = precision<bf16, float>;
using fp16_precision = precision<fp16, float>;
using fp64_precision = precision<double, double>;  // the reference that tests compare against

template <typename T>
inline constexpr bool is_precision_v = false;
template <typename Storage, typename Accum>
inline constexpr bool is_precision_v<precision<Storage, Accum>> = true;

MEMBOUND_NAMESPACE_END
