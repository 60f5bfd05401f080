// Scalar types: what tensors are stored in (storage_scalar), what sums are carried in
// (accumulation_scalar), and conversions between them that round exactly once.
//
//   float acc = to_accum<float>(x);        // exact: an accumulator is at least as wide
//   bf16 y = from_accum<bf16>(acc);        // one round-to-nearest-even
//   std::size_t b = bytes_of<bf16>(batch, seq, width);   // for size functions
#pragma once

#include <bit>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string_view>
#include <type_traits>

// Under nvcc, Eigen 3.4's own headers warn (#20012: __host__ __device__ on defaulted functions),
// which fails builds with `-Werror all-warnings`; the suppression ends with the include.
// (Eigen under nvcc also needs --expt-relaxed-constexpr, or it warns #20015, which no pragma
// reaches: that flag belongs on the command line.)
#if defined(__NVCC__)
#pragma nv_diagnostic push
#pragma nv_diag_suppress 20012
#endif
#include <Eigen/Core>
#if defined(__NVCC__)
#pragma nv_diagnostic pop
#endif

#include "membound/core/config.hpp"

MEMBOUND_NAMESPACE_BEGIN

// Eigen's types: plain g++ compiles them, and the CPU backend's Eigen kernels take them as-is.
using bf16 = Eigen::bfloat16;
using fp16 = Eigen::half;

// Sizes and bit-level conversions below rely on these; a toolchain that breaks them must fail here.
static_assert(sizeof(bf16) == 2 && sizeof(fp16) == 2 && std::is_trivially_copyable_v<bf16> &&
                  std::is_trivially_copyable_v<fp16>,
              "membound: bf16 and fp16 must be 2-byte trivially copyable types.");
static_assert(std::numeric_limits<float>::is_iec559 && std::numeric_limits<double>::is_iec559,
              "membound: the conversions assume IEEE-754 float and double.");

template <typename T>
concept storage_scalar = std::same_as<T, float> || std::same_as<T, double> ||
                         std::same_as<T, bf16> || std::same_as<T, fp16>;

// bf16 and fp16 are not here on purpose: their 8 or 11 significant bits lose the sums.
template <typename T>
concept accumulation_scalar = std::same_as<T, float> || std::same_as<T, double>;

template <storage_scalar T>
constexpr std::string_view dtype_name() noexcept {
  if constexpr (std::same_as<T, float>) {
    return "fp32";
  } else if constexpr (std::same_as<T, double>) {
    return "fp64";
  } else if constexpr (std::same_as<T, bf16>) {
    return "bf16";
  } else {
    return "fp16";
  }
}

template <storage_scalar T>
inline constexpr std::size_t dtype_bytes = sizeof(T);

// Bytes of an array of T with these extents (their product; none means one element). Saturates
// at SIZE_MAX, so an absurd shape (an overflow, a negative extent converted to std::size_t)
// becomes a request no budget serves, never a small wrapped-around one.
template <typename T>
constexpr std::size_t bytes_of(std::convertible_to<std::size_t> auto... extents) noexcept {
  constexpr std::size_t max = std::numeric_limits<std::size_t>::max();
  const std::size_t dims[] = {static_cast<std::size_t>(extents)..., 1};  // 1: never empty
  std::size_t bytes = sizeof(T);
  for (std::size_t e : dims) bytes = (e != 0 && bytes > max / e) ? max : bytes * e;
  return bytes;
}

// How many T fit in a buffer of `bytes` (the inverse of bytes_of, rounded down).
template <typename T>
constexpr std::size_t elements_in(std::size_t bytes) noexcept {
  return bytes / sizeof(T);
}

namespace detail {

// Round-to-nearest-even of a double to a binary format with ExpBits exponent bits and ManBits
// fraction bits (bf16: 8, 7; fp16: 5, 10), returned as its bit pattern. Straight from the double:
// Eigen's bf16(double) and half(double) go through float and round twice, so
// 1 + 2^-8 + 2^-40 would land on the bf16 tie 1 + 2^-8 and round down instead of up.
template <int ExpBits, int ManBits>
constexpr std::uint16_t round_double_rne(double x) noexcept {
  constexpr int bias = (1 << (ExpBits - 1)) - 1;
  constexpr int max_field = (1 << ExpBits) - 1;  // the exponent field of inf and NaN
  constexpr std::uint64_t inf_bits = std::uint64_t{max_field} << ManBits;
  constexpr std::uint64_t quiet_bit = std::uint64_t{1} << (ManBits - 1);

  const std::uint64_t b = std::bit_cast<std::uint64_t>(x);
  const std::uint64_t sign = (b >> 63) << (ExpBits + ManBits);
  const int exp = static_cast<int>((b >> 52) & 0x7ff);
  const std::uint64_t frac = b & ((std::uint64_t{1} << 52) - 1);
  const auto out = [sign](std::uint64_t magnitude) {
    return static_cast<std::uint16_t>(sign | magnitude);
  };

  if (exp == 0x7ff) return out(frac == 0 ? inf_bits : inf_bits | quiet_bit);  // inf; quiet NaN
  // Zero, or a double subnormal: far below half the target's smallest subnormal.
  if (exp == 0) return out(0);

  const std::uint64_t sig = frac | (std::uint64_t{1} << 52);  // x = sig * 2^(exp - 1075)
  int field = exp - 1023 + bias;                               // the target's biased exponent
  if (field >= max_field) return out(inf_bits);                // at least twice the largest finite
  int shift = 52 - ManBits;                                    // fraction bits the target lacks
  if (field < 1) {  // below the normal range: count in steps of the smallest subnormal
    shift += 1 - field;
    field = 0;
  }
  if (shift > 53) return out(0);  // below half the smallest subnormal (sig < 2^53)

  std::uint64_t kept = sig >> shift;
  const std::uint64_t rest = sig & ((std::uint64_t{1} << shift) - 1);
  const std::uint64_t half = std::uint64_t{1} << (shift - 1);
  if (rest > half || (rest == half && (kept & 1) != 0)) ++kept;
  // kept carries the leading bit at position ManBits, so adding it to (field - 1) lets a
  // rounded-up significand carry into the exponent: the next binade, subnormal to normal, or inf.
  const std::uint64_t bits = (field == 0 ? 0 : std::uint64_t(field - 1) << ManBits) + kept;
  return out(bits >= inf_bits ? inf_bits : bits);
}

}  // namespace detail

// Exact: an accumulator is at least as wide as what it reads.
template <accumulation_scalar A, storage_scalar T>
constexpr A to_accum(T x) noexcept {
  static_assert(sizeof(T) <= sizeof(A),
                "membound: to_accum<float>(double) would round the double: accumulate in double "
                "(fp64_precision), or store in float.");
  if constexpr (std::same_as<T, A>) {
    return x;
  } else if constexpr (std::same_as<T, bf16> || std::same_as<T, fp16>) {
    return static_cast<A>(static_cast<float>(x));  // every bf16/fp16 value is a float
  } else {
    return static_cast<A>(x);  // float to double
  }
}

// One round-to-nearest-even (ties to even, overflow to inf, NaN stays a quiet NaN of that sign).
// From float, Eigen's conversions do it; from double, detail::round_double_rne, for the reason
// given there.
template <storage_scalar T, accumulation_scalar A>
constexpr T from_accum(A x) noexcept {
  if constexpr (std::same_as<T, A>) {
    return x;
  } else if constexpr (std::same_as<T, float> || std::same_as<T, double>) {
    return static_cast<T>(x);  // double to float is one IEEE rounding; float to double is exact
  } else if constexpr (std::same_as<A, float>) {
    return T(x);
  } else if constexpr (std::same_as<T, bf16>) {
    return std::bit_cast<bf16>(detail::round_double_rne<8, 7>(x));
  } else {
    return std::bit_cast<fp16>(detail::round_double_rne<5, 10>(x));
  }
}

MEMBOUND_NAMESPACE_END
