#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string_view>
#include <type_traits>

#include "membound/core/dtype.hpp"
#include "membound/core/type_list.hpp"
#include "membound/policy/recompute.hpp"
#include "membound/policy/chunking.hpp"
#include "membound/policy/policy_set.hpp"
#include "membound/policy/precision.hpp"

using namespace membound;

namespace {

constexpr std::uint16_t bits(bf16 x) { return std::bit_cast<std::uint16_t>(x); }
constexpr std::uint16_t bits(fp16 x) { return std::bit_cast<std::uint16_t>(x); }
constexpr float f32(std::uint32_t b) { return std::bit_cast<float>(b); }
constexpr std::uint32_t bits32(float x) { return std::bit_cast<std::uint32_t>(x); }
bool is_nan_bits(bf16 x) { return (bits(x) & 0x7f80) == 0x7f80 && (bits(x) & 0x007f) != 0; }
bool is_nan_bits(fp16 x) { return (bits(x) & 0x7c00) == 0x7c00 && (bits(x) & 0x03ff) != 0; }

// --- dtype: concepts, names, bytes ------------------------------------------------------------
static_assert(storage_scalar<float> && storage_scalar<double> && storage_scalar<bf16> &&
              storage_scalar<fp16>);
static_assert(!storage_scalar<int> && !storage_scalar<long double> &&
              !storage_scalar<const float> && !storage_scalar<float&>);
static_assert(accumulation_scalar<float> && accumulation_scalar<double>);
static_assert(!accumulation_scalar<bf16> && !accumulation_scalar<fp16> && !accumulation_scalar<int>);

static_assert(dtype_name<float>() == "fp32" && dtype_name<double>() == "fp64" &&
              dtype_name<bf16>() == "bf16" && dtype_name<fp16>() == "fp16");
static_assert(dtype_bytes<float> == 4 && dtype_bytes<double> == 8 && dtype_bytes<bf16> == 2 &&
              dtype_bytes<fp16> == 2);

static_assert(bytes_of<bf16>(4, 8, 16) == 1024);
static_assert(bytes_of<float>() == 4);  // no extents: one element
static_assert(bytes_of<double>(0, 1000) == 0);
static_assert(bytes_of<std::int32_t>(std::size_t{3}, 5u) == 60);  // any sizeof-able type
constexpr std::size_t size_max = std::numeric_limits<std::size_t>::max();
static_assert(bytes_of<double>(std::size_t{1} << 61) == size_max);      // 2^64 saturates
static_assert(bytes_of<bf16>(std::size_t{1} << 40, std::size_t{1} << 40) == size_max);
static_assert(bytes_of<bf16>(std::size_t{1} << 40, std::size_t{1} << 40, 0) == 0);
static_assert(bytes_of<fp16>(-1) == size_max);  // a negative extent never wraps to a small size
static_assert(elements_in<bf16>(1025) == 512 && elements_in<double>(7) == 0);

// The double path is integer arithmetic, so it also runs at compile time.
static_assert(bits(from_accum<bf16>(1.0)) == 0x3f80);
static_assert(bits(from_accum<fp16>(-2.0)) == 0xc000);
static_assert(std::is_same_v<decltype(to_accum<float>(bf16{})), float>);
static_assert(std::is_same_v<decltype(from_accum<fp16>(1.0f)), fp16>);

// --- policies ---------------------------------------------------------------------------------
static_assert(std::is_same_v<fp32_precision::storage_type, float> &&
              std::is_same_v<fp32_precision::accum_type, float>);
static_assert(std::is_same_v<bf16_precision::storage_type, bf16> &&
              std::is_same_v<bf16_precision::accum_type, float>);
static_assert(std::is_same_v<fp16_precision::storage_type, fp16> &&
              std::is_same_v<fp16_precision::accum_type, float>);
static_assert(std::is_same_v<fp64_precision::storage_type, double> &&
              std::is_same_v<fp64_precision::accum_type, double>);
static_assert(std::is_same_v<precision<bf16, double>::accum_type, double>);  // narrow in wide: ok
static_assert(bf16_precision::storage_bytes(3, 5) == 30 && bf16_precision::accum_bytes(3, 5) == 60);
static_assert(is_precision_v<bf16_precision> && !is_precision_v<float>);

static_assert(std::string_view(precision_kind::name) == "precision");
static_assert(std::string_view(chunking_kind::name) == "chunking");
static_assert(std::string_view(recompute_kind::name) == "recompute");
static_assert(std::is_same_v<bf16_precision::policy_kind, precision_kind>);
static_assert(std::is_same_v<attention_tiles<64, 64>::policy_kind, chunking_kind>);
static_assert(std::is_same_v<scan_chunk<64>::policy_kind, chunking_kind>);
static_assert(std::is_same_v<ttt_mini_batch<16>::policy_kind, chunking_kind>);
static_assert(std::is_same_v<save_all::policy_kind, recompute_kind>);
static_assert(std::is_same_v<recompute::policy_kind, recompute_kind>);
static_assert(std::is_same_v<ttt_state_groups<4>::policy_kind, recompute_kind>);

static_assert(policy<fp32_precision> && policy<attention_tiles<64, 128>> && policy<scan_chunk<1>> &&
              policy<default_ttt_mini_batch> && policy<save_all> && policy<recompute> &&
              policy<ttt_state_groups<1>>);
static_assert(!policy<int> && !policy<float> && !policy<precision_kind>);
struct fake_kind_only {
  using policy_kind = int;  // has a policy_kind, but not a kind tag
};
static_assert(!policy<fake_kind_only>);
static_assert(policy_kind_tag<precision_kind> && !policy_kind_tag<int>);

static_assert(attention_tiles<64, 128>::q_tile == 64 && attention_tiles<64, 128>::kv_tile == 128);
static_assert(attention_tiles<8, 8>::q_tile == 8);
static_assert(scan_chunk<256>::chunk == 256 && scan_chunk<1>::chunk == 1);
static_assert(ttt_mini_batch<4>::mini_batch == 4);
static_assert(std::is_same_v<default_ttt_mini_batch, ttt_mini_batch<16>>);
static_assert(ttt_state_groups<1>::group_size == 1 && ttt_state_groups<8>::group_size == 8);

static_assert(is_attention_tiles_v<attention_tiles<16, 32>> && !is_attention_tiles_v<scan_chunk<16>>);
static_assert(is_scan_chunk_v<scan_chunk<16>> && !is_scan_chunk_v<ttt_mini_batch<16>>);
static_assert(is_ttt_mini_batch_v<default_ttt_mini_batch> && !is_ttt_mini_batch_v<scan_chunk<16>>);
static_assert(is_ttt_state_groups_v<ttt_state_groups<2>> && !is_ttt_state_groups_v<recompute>);

// The names from before "checkpoint" meant a checkpoint file only: deprecated aliases of the same types.
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#endif
static_assert(std::is_same_v<checkpoint_kind, recompute_kind>);
static_assert(std::is_same_v<ttt_checkpoint_groups<4>, ttt_state_groups<4>>);
static_assert(std::is_same_v<ttt_checkpoint_all, ttt_state_groups_all>);
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

// --- policy_set -------------------------------------------------------------------------------
// The header's example.
static_assert(std::is_same_v<policy_set<type_list<fp32_precision, attention_tiles<64, 64>>,
                                        bf16_precision>::get<precision_kind>,
                             bf16_precision>);

using attention_defaults = type_list<fp32_precision, attention_tiles<64, 64>, recompute>;

// Nothing given: every kind is its default.
using none = policy_set<attention_defaults>;
static_assert(std::is_same_v<none::get<precision_kind>, fp32_precision>);
static_assert(std::is_same_v<none::get<chunking_kind>, attention_tiles<64, 64>>);
static_assert(std::is_same_v<none::get<recompute_kind>, recompute>);
static_assert(!none::is_given<precision_kind>);
static_assert(std::is_same_v<none::resolved, attention_defaults>);

// One given: that kind changes, the others stay.
using one = policy_set<attention_defaults, save_all>;
static_assert(std::is_same_v<one::get<recompute_kind>, save_all>);
static_assert(std::is_same_v<one::get<precision_kind>, fp32_precision>);
static_assert(one::is_given<recompute_kind> && !one::is_given<chunking_kind>);

// All given, in every order: the same result.
template <typename... Ps>
constexpr bool resolves_to_the_same() {
  using set = policy_set<attention_defaults, Ps...>;
  return std::is_same_v<typename set::template get<precision_kind>, bf16_precision> &&
         std::is_same_v<typename set::template get<chunking_kind>, attention_tiles<128, 32>> &&
         std::is_same_v<typename set::template get<recompute_kind>, save_all> &&
         std::is_same_v<typename set::resolved,
                        type_list<bf16_precision, attention_tiles<128, 32>, save_all>>;
}
static_assert(resolves_to_the_same<bf16_precision, attention_tiles<128, 32>, save_all>());
static_assert(resolves_to_the_same<bf16_precision, save_all, attention_tiles<128, 32>>());
static_assert(resolves_to_the_same<attention_tiles<128, 32>, bf16_precision, save_all>());
static_assert(resolves_to_the_same<attention_tiles<128, 32>, save_all, bf16_precision>());
static_assert(resolves_to_the_same<save_all, bf16_precision, attention_tiles<128, 32>>());
static_assert(resolves_to_the_same<save_all, attention_tiles<128, 32>, bf16_precision>());

// How a layer reads its policies in a template, where the set is a dependent type.
template <typename... Policies>
struct ttt_layer_like {
  using policies = policy_set<type_list<fp32_precision, default_ttt_mini_batch,
                                        ttt_state_groups<1>>,
                              Policies...>;
  using prec = get_policy<policies, precision_kind>;
  static constexpr std::size_t mini_batch = get_policy<policies, chunking_kind>::mini_batch;
  static constexpr std::size_t group_size = get_policy<policies, recompute_kind>::group_size;
};
static_assert(ttt_layer_like<>::mini_batch == 16 && ttt_layer_like<>::group_size == 1);
static_assert(ttt_layer_like<ttt_state_groups<4>, ttt_mini_batch<8>>::mini_batch == 8);
static_assert(ttt_layer_like<ttt_state_groups<4>, ttt_mini_batch<8>>::group_size == 4);
static_assert(std::is_same_v<ttt_layer_like<fp64_precision>::prec, fp64_precision>);

// A layer with no policies at all is a valid set.
static_assert(std::is_same_v<policy_set<type_list<>>::resolved, type_list<>>);

}  // namespace

// --- rounding, against hand-computed bit patterns ---------------------------------------------
// Each row is checked through both paths: from float (Eigen's conversion) and from the same value
// as a double (membound's single rounding). The value is exact in both, so the results must agree.
struct rounding_case {
  std::uint32_t input;  // float bits
  std::uint16_t expected;
  const char* what;
};

TEST_CASE("float and double round to bf16 to nearest, ties to even") {
  const rounding_case cases[] = {
      {0x3f800000, 0x3f80, "1"},
      {0x3f808000, 0x3f80, "1 + 2^-8: a tie, rounds down to the even 0x3f80"},
      {0x3f818000, 0x3f82, "1 + 3*2^-8: a tie, rounds up to the even 0x3f82"},
      {0x3f808001, 0x3f81, "just above the tie"},
      {0x3f807fff, 0x3f80, "just below the tie"},
      {0xbf808000, 0xbf80, "-(1 + 2^-8): ties to even by magnitude"},
      {0x40490fdb, 0x4049, "pi"},
      {0x7f7f7fff, 0x7f7f, "just below the overflow threshold: largest finite"},
      {0x7f7f8000, 0x7f80, "the overflow threshold (a tie): to inf"},
      {0x7f7fffff, 0x7f80, "FLT_MAX: to inf"},
      {0x7f800000, 0x7f80, "inf"},
      {0xff800000, 0xff80, "-inf"},
      {0x00000000, 0x0000, "0"},
      {0x80000000, 0x8000, "-0"},
      {0x00008000, 0x0000, "subnormal tie: rounds to the even 0"},
      {0x00018000, 0x0002, "subnormal tie: rounds to the even 2"},
      {0x00010000, 0x0001, "smallest bf16 subnormal"},
      {0x007f8000, 0x0080, "largest subnormal tie: carries into the smallest normal"},
      {0x7fc00000, 0x7fc0, "quiet NaN"},
      {0xffc00000, 0xffc0, "negative quiet NaN"},
      {0x7f800001, 0x7fc0, "signaling NaN: stays NaN (truncation would make it inf)"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.what);
    const float f = f32(c.input);
    CHECK(bits(from_accum<bf16>(f)) == c.expected);
    CHECK(bits(from_accum<bf16>(static_cast<double>(f))) == c.expected);
  }
}

TEST_CASE("float and double round to fp16 to nearest, ties to even") {
  const rounding_case cases[] = {
      {0x3f800000, 0x3c00, "1"},
      {0x3f801000, 0x3c00, "1 + 2^-11: a tie, rounds down to the even 0x3c00"},
      {0x3f803000, 0x3c02, "1 + 3*2^-11: a tie, rounds up to the even 0x3c02"},
      {0x3f801001, 0x3c01, "just above the tie"},
      {0x3f800fff, 0x3c00, "just below the tie"},
      {0xc0000000, 0xc000, "-2"},
      {0x477fe000, 0x7bff, "65504, the largest finite"},
      {0x477fefff, 0x7bff, "just below 65520"},
      {0x477ff000, 0x7c00, "65520: a tie between 65504 and 65536, rounds to inf"},
      {0x47800000, 0x7c00, "65536: overflow to inf"},
      {0x7f800000, 0x7c00, "inf"},
      {0xff800000, 0xfc00, "-inf"},
      {0x80000000, 0x8000, "-0"},
      {0x33800000, 0x0001, "2^-24, the smallest subnormal"},
      {0x33000000, 0x0000, "2^-25: a tie, rounds to the even 0"},
      {0x33000001, 0x0001, "just above 2^-25"},
      {0x33c00000, 0x0002, "3*2^-25: a tie, rounds to the even 2"},
      {0x387fe000, 0x0400, "1023.5*2^-24: a tie, carries into the smallest normal"},
      {0x2edbe6ff, 0x0000, "1e-10: underflow to 0"},
      {0x7fc00000, 0x7e00, "quiet NaN"},
      {0xffc00000, 0xfe00, "negative quiet NaN"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.what);
    const float f = f32(c.input);
    CHECK(bits(from_accum<fp16>(f)) == c.expected);
    CHECK(bits(from_accum<fp16>(static_cast<double>(f))) == c.expected);
  }
}

TEST_CASE("a double rounds to bf16/fp16 once, not through float") {
  // 1 + 2^-8 + 2^-40 is above the bf16 tie 1 + 2^-8, so it rounds up. Through float, 2^-40 is
  // lost first and the tie then rounds down: Eigen's bf16(double) does that, from_accum must not.
  const double above_bf16_tie = 1.0 + 0x1p-8 + 0x1p-40;
  CHECK(bits(from_accum<bf16>(above_bf16_tie)) == 0x3f81);
  CHECK(bits(bf16(above_bf16_tie)) == 0x3f80);  // the double rounding this avoids

  const double above_fp16_tie = 1.0 + 0x1p-11 + 0x1p-40;
  CHECK(bits(from_accum<fp16>(above_fp16_tie)) == 0x3c01);
  CHECK(bits(fp16(above_fp16_tie)) == 0x3c00);

  const double above_subnormal_tie = 0x1p-25 + 0x1p-60;  // fp16: above the 0/2^-24 tie
  CHECK(bits(from_accum<fp16>(above_subnormal_tie)) == 0x0001);
  CHECK(bits(from_accum<fp16>(-above_subnormal_tie)) == 0x8001);
  CHECK(bits(from_accum<bf16>(-(1.0 + 0x1p-8 + 0x1p-40))) == 0xbf81);

  // Ranges only a double has.
  CHECK(bits(from_accum<bf16>(1e300)) == 0x7f80);
  CHECK(bits(from_accum<bf16>(-1e300)) == 0xff80);
  CHECK(bits(from_accum<fp16>(1e300)) == 0x7c00);
  CHECK(bits(from_accum<bf16>(1e-300)) == 0x0000);
  CHECK(bits(from_accum<fp16>(-1e-300)) == 0x8000);
  CHECK(bits(from_accum<bf16>(std::numeric_limits<double>::denorm_min())) == 0x0000);
  CHECK(bits(from_accum<bf16>(std::numeric_limits<double>::infinity())) == 0x7f80);
  CHECK(bits(from_accum<fp16>(-std::numeric_limits<double>::infinity())) == 0xfc00);
  CHECK(bits(from_accum<bf16>(std::numeric_limits<double>::quiet_NaN())) == 0x7fc0);
  CHECK(bits(from_accum<fp16>(std::numeric_limits<double>::quiet_NaN())) == 0x7e00);
  CHECK(bits(from_accum<bf16>(std::bit_cast<double>(std::uint64_t{0xfff0000000000001}))) ==
        0xffc0);  // a negative signaling NaN with a low payload stays a NaN

  // double to float is one IEEE rounding too.
  CHECK(from_accum<float>(1.0 + 0x1p-24) == 1.0f);                     // tie, down to even
  CHECK(from_accum<float>(1.0 + 3 * 0x1p-24) == 1.0f + 0x1p-22f);      // tie, up to even
  CHECK(from_accum<float>(1.0 + 0x1p-24 + 0x1p-40) == 1.0f + 0x1p-23f);  // above the tie
  CHECK(from_accum<double>(1.5f) == 1.5);
  CHECK(from_accum<float>(2.5f) == 2.5f);
}

TEST_CASE("Eigen's float path and the double path agree on every bf16 tie and a sweep of floats") {
  std::size_t checked = 0;
  const auto agree = [&checked](std::uint32_t b) {
    const float f = f32(b);
    const bf16 from_float = from_accum<bf16>(f);
    const bf16 from_double = from_accum<bf16>(static_cast<double>(f));
    const fp16 h_float = from_accum<fp16>(f);
    const fp16 h_double = from_accum<fp16>(static_cast<double>(f));
    ++checked;
    if (std::isnan(f)) {
      return is_nan_bits(from_float) && is_nan_bits(from_double) && is_nan_bits(h_float) &&
             is_nan_bits(h_double);
    }
    return bits(from_float) == bits(from_double) && bits(h_float) == bits(h_double);
  };
  std::size_t disagreements = 0;
  for (std::uint32_t hi = 0; hi < 0x10000; ++hi) {  // every bf16 tie, and its two neighbours
    for (std::uint32_t lo : {0x7fffu, 0x8000u, 0x8001u}) {
      if (!agree(hi << 16 | lo)) ++disagreements;
    }
  }
  for (std::uint32_t hi = 0; hi < 0x80000; ++hi) {  // every fp16-normal-range tie pattern
    for (std::uint32_t lo : {0x0fffu, 0x1000u, 0x1001u}) {
      if (!agree(hi << 13 | lo)) ++disagreements;
    }
  }
  for (std::uint64_t b = 0; b <= 0xffffffffu; b += 4093) {  // a sweep over all patterns
    if (!agree(static_cast<std::uint32_t>(b))) ++disagreements;
  }
  CHECK(checked > 2'500'000);
  CHECK(disagreements == 0);
}

TEST_CASE("to_accum is exact, and from_accum inverts it on every bf16 and fp16 value") {
  CHECK(to_accum<float>(std::bit_cast<bf16>(std::uint16_t{0x3f81})) == 1.0f + 0x1p-7f);
  CHECK(to_accum<double>(std::bit_cast<bf16>(std::uint16_t{0x3f81})) == 1.0 + 0x1p-7);
  CHECK(to_accum<float>(std::bit_cast<fp16>(std::uint16_t{0x3c01})) == 1.0f + 0x1p-10f);
  CHECK(to_accum<float>(std::bit_cast<fp16>(std::uint16_t{0x0001})) == 0x1p-24f);
  CHECK(to_accum<double>(std::bit_cast<fp16>(std::uint16_t{0x7bff})) == 65504.0);
  CHECK(std::isinf(to_accum<float>(std::bit_cast<bf16>(std::uint16_t{0xff80}))));
  CHECK(std::isnan(to_accum<double>(std::bit_cast<fp16>(std::uint16_t{0x7e00}))));
  CHECK(to_accum<double>(0.1f) == static_cast<double>(0.1f));
  CHECK(to_accum<double>(0.1) == 0.1);
  CHECK(bits32(to_accum<float>(-0.0f)) == 0x80000000u);

  std::size_t mismatches = 0;
  for (std::uint32_t b = 0; b < 0x10000; ++b) {
    const auto u = static_cast<std::uint16_t>(b);
    const bf16 x = std::bit_cast<bf16>(u);
    const fp16 h = std::bit_cast<fp16>(u);
    if (!is_nan_bits(x)) {
      if (bits(from_accum<bf16>(to_accum<float>(x))) != u) ++mismatches;
      if (bits(from_accum<bf16>(to_accum<double>(x))) != u) ++mismatches;
    }
    if (!is_nan_bits(h)) {
      if (bits(from_accum<fp16>(to_accum<float>(h))) != u) ++mismatches;
      if (bits(from_accum<fp16>(to_accum<double>(h))) != u) ++mismatches;
    }
  }
  CHECK(mismatches == 0);
}
