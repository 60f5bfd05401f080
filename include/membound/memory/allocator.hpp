// The allocator concept every membound allocator policy models, with readable diagnostics.
//
// Required members (A is the allocator, a an lvalue of it):
//   void* a.allocate(std::size_t bytes, std::size_t alignment, memory_tag tag);
//       Returns storage aligned to `alignment` (a power of two), nullptr when bytes == 0.
//       Throws membound::out_of_memory when it cannot, membound::invalid_argument on bad input;
//       either way its state is unchanged.
//   void a.deallocate(void* p, std::size_t bytes, std::size_t alignment, memory_tag tag);
//       Sized deallocation, as std::pmr does it: the same bytes, alignment and tag as allocate.
//   memory_stats a.stats() const;
//   static constexpr memory_space space;  // host or device
//
// Optional members, detected and used by adaptors when present:
//   void a.release_cached();                 hand free cached memory back to the upstream
//   std::size_t a.growth_for(bytes, alignment) const;
//       bytes the reserve would grow by to serve this request (0 when a free block fits);
//       lets a budget refuse a request before any upstream call.
//   void a.reset_peaks();                    restart peak statistics from current values
//   void a.set_reserve_limit(std::size_t bytes);
//       a ceiling on the reserve, set by a budget above: rather than cross it with a preferred
//       (larger) segment, the allocator grows by just what the request needs.
#pragma once

#include <concepts>
#include <cstddef>
#include <limits>
#include <type_traits>

#include "membound/core/checked_math.hpp"
#include "membound/core/config.hpp"
#include "membound/core/error.hpp"
#include "membound/memory/memory_stats.hpp"
#include "membound/core/memory_tag.hpp"

MEMBOUND_NAMESPACE_BEGIN

// 256 bytes, as CUB uses for temporary storage: enough for every vector width and for TMA.
inline constexpr std::size_t default_alignment = 256;

namespace detail {
template <typename A>
concept has_allocate = requires(A& a, std::size_t n, memory_tag t) {
  { a.allocate(n, n, t) } -> std::same_as<void*>;
};
template <typename A>
concept has_deallocate = requires(A& a, void* p, std::size_t n, memory_tag t) {
  a.deallocate(p, n, n, t);
};
template <typename A>
concept has_stats = requires(const A& a) {
  { a.stats() } -> std::convertible_to<memory_stats>;
};
template <typename A>
concept has_space = requires {
  { A::space } -> std::convertible_to<memory_space>;
};
}  // namespace detail

// What every membound allocator policy models: the required members listed at the top.
template <typename A>
concept allocator = detail::has_allocate<A> && detail::has_deallocate<A> &&
                    detail::has_stats<A> && detail::has_space<A>;

// An allocator that caches free memory and can give it back (release_cached).
template <typename A>
concept caching_allocator_like = allocator<A> && requires(A& a) { a.release_cached(); };

// An allocator that predicts how much its reserve would grow (growth_for): what a budget needs.
template <typename A>
concept reports_growth = allocator<A> && requires(const A& a, std::size_t n) {
  { a.growth_for(n, n) } -> std::convertible_to<std::size_t>;
};

// An allocator of host memory, which the CPU reads and writes.
template <typename A>
concept host_allocator = allocator<A> && (A::space == memory_space::host);

// Use as `static_assert(check_allocator<Upstream>())` in templates that take an allocator: the
// compiler then prints the one sentence that names the missing member, not a concept dump.
template <typename A>
consteval bool check_allocator() {
  static_assert(detail::has_allocate<A>,
                "membound: this type is not an allocator: it needs a member function "
                "`void* allocate(std::size_t bytes, std::size_t alignment, membound::memory_tag tag)`.");
  static_assert(detail::has_deallocate<A>,
                "membound: this type is not an allocator: it needs a member function "
                "`void deallocate(void* p, std::size_t bytes, std::size_t alignment, "
                "membound::memory_tag tag)`.");
  static_assert(detail::has_stats<A>,
                "membound: this type is not an allocator: it needs a member function "
                "`membound::memory_stats stats() const`.");
  static_assert(detail::has_space<A>,
                "membound: this type is not an allocator: it needs a member "
                "`static constexpr membound::memory_space space` (host or device).");
  return allocator<A>;
}

// Whether x is a valid alignment: a power of two (0 is not).
constexpr bool is_power_of_two(std::size_t x) noexcept { return x != 0 && (x & (x - 1)) == 0; }

// x rounded up to a multiple of alignment, a power of two.
constexpr std::size_t align_up(std::size_t x, std::size_t alignment) noexcept {
  return (x + alignment - 1) & ~(alignment - 1);
}

namespace detail {
// Shared argument checks, so every policy rejects the same inputs with the same words.
inline void check_alignment(std::size_t alignment, std::size_t max_alignment, const char* who) {
  if (!is_power_of_two(alignment) || alignment > max_alignment) {
    throw invalid_argument("alignment", "a power of two no larger than " +
                                            std::to_string(max_alignment) + " for " + who,
                           std::to_string(alignment),
                           "Pass a power-of-two alignment, e.g. membound::default_alignment (256)");
  }
}
inline void check_tag(memory_tag tag) {
  if (!is_valid(tag)) {
    throw invalid_argument("tag", "one of the membound::memory_tag values",
                           std::to_string(static_cast<unsigned>(tag)),
                           "Pass memory_tag::other when no category fits");
  }
}
}  // namespace detail

// What a pressure monitor needs from a budget: the footprint it counts and the cap on it.
// Adaptors above a budget (traced_allocator, synchronized) forward both, so they model it too.
template <typename B>
concept budgeted = requires(const B& b) {
  { b.usage() } -> std::convertible_to<std::size_t>;
  { b.limit() } -> std::convertible_to<std::size_t>;
};

namespace detail {

// The memory core's names for core/checked_math.hpp's.
constexpr std::size_t saturating_add(std::size_t a, std::size_t b) noexcept { return sat_add(a, b); }
constexpr std::size_t saturating_sub(std::size_t a, std::size_t b) noexcept { return sat_sub(a, b); }

// An upstream that declares its largest alignment gets it checked here, before growth_for sees
// the request; otherwise any power of two passes and the upstream judges it.
template <typename A>
constexpr std::size_t max_alignment_of() noexcept {
  if constexpr (requires {
                  { A::max_alignment } -> std::convertible_to<std::size_t>;
                }) {
    return A::max_alignment;
  } else {
    return std::size_t{1} << (std::numeric_limits<std::size_t>::digits - 1);
  }
}

template <typename A>
concept has_reset_peaks = requires(A& a) { a.reset_peaks(); };
template <typename A>
concept has_reserve_limit = requires(A& a, std::size_t n) { a.set_reserve_limit(n); };
template <typename A>
concept has_headroom = requires(const A& a) {
  { a.headroom() } -> std::convertible_to<std::size_t>;
};
template <typename A>
concept has_external = requires(const A& a) {
  { a.external() } -> std::convertible_to<std::size_t>;
};
template <typename A>
concept has_set_limit = requires(A& a, std::size_t n) { a.set_limit(n); };
template <typename A>
concept has_set_external = requires(A& a, std::size_t n) { a.set_external(n); };

}  // namespace detail

// Copies the usage part of an out-of-memory report from an allocator's statistics.
inline void fill_usage(oom_report& r, const memory_stats& s) noexcept {
  r.allocated = s.allocated;
  r.reserved_unallocated = s.free_bytes();
  r.largest_free_block = s.largest_free_block;
  for (memory_tag t : all_memory_tags) {
    r.tag_current[index_of(t)] = s.tag(t).current;
    r.tag_peak[index_of(t)] = s.tag(t).peak;
  }
}

MEMBOUND_NAMESPACE_END
