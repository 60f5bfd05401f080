// Shadows of allocator stacks: the same bookkeeping over addresses that are never backed, so
// that the reserve a known sequence of requests takes on a stack is known before any memory
// exists. The planner replays a training step's requests through the shadow of the caller's
// stack (model/reserve_plan.hpp) to predict the reserved peak: the bytes a budget over a caching
// allocator or an arena really counts, rounding and segments included.
//
// A shadow is exact because the allocators' bookkeeping never reads or writes block memory
// (detail/block_pool.hpp): the shadow makes the same decisions in the same order and keeps the
// same statistics. Layers that do not change the reserve (traced_allocator, fault_injecting)
// are dropped; a stack with a layer that has no shadow has no reserve prediction
// (has_shadow<A> is false) and plans fall back to the requested bytes.
//
//   auto s = membound::make_shadow(alloc);   // std::unique_ptr<shadow_t<decltype(alloc)>>
//   void* p = s->allocate(1 << 20, 64, membound::memory_tag::activations);  // no memory behind p
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "membound/core/config.hpp"
#include "membound/core/error.hpp"
#include "membound/memory/allocator.hpp"
#include "membound/memory/budget.hpp"
#include "membound/memory/caching_allocator.hpp"
#include "membound/memory/expandable_arena.hpp"
#include "membound/memory/fault_injection.hpp"
#include "membound/memory/memory_stats.hpp"
#include "membound/memory/system_allocator.hpp"
#include "membound/memory/trace.hpp"

MEMBOUND_NAMESPACE_BEGIN

namespace detail {
// Addresses far from where a real process maps memory on x86-64 and AArch64 Linux, handed out
// upwards and never dereferenced.
inline constexpr std::uintptr_t shadow_address_base = std::uintptr_t{1} << 44;
}  // namespace detail

// The shadow of a leaf allocator: distinct aligned addresses, the same statistics, no memory.
// Guaranteed: the alignment the leaf's memory always has; a request for more reserves
// alignment − Guaranteed more (cuda_device_allocator: cudaMalloc's 256). The default, no
// over-allocation, is system_allocator's reserve (its requests).
template <memory_space Space = memory_space::host, std::size_t Guaranteed = std::numeric_limits<std::size_t>::max()>
class address_only_allocator {
 public:
  static constexpr memory_space space = Space;
  static constexpr std::size_t max_alignment = std::size_t{1} << 21;

  address_only_allocator() = default;
  address_only_allocator(const address_only_allocator&) = delete;
  address_only_allocator& operator=(const address_only_allocator&) = delete;

  void* allocate(std::size_t bytes, std::size_t alignment = default_alignment,
                 memory_tag tag = memory_tag::other) {
    detail::check_alignment(alignment, max_alignment, "address_only_allocator");
    detail::check_tag(tag);
    if (bytes == 0) return nullptr;
    const std::uintptr_t p = align_up(next_, alignment);
    const std::size_t reserved = growth_for(bytes, alignment);
    if (p < next_ || reserved < bytes || reserved > std::numeric_limits<std::uintptr_t>::max() - p) {
      stats_.on_failure();
      oom_report r;
      r.source = "address_only_allocator";
      r.requested = bytes;
      r.growth_needed = reserved;
      fill_usage(r, stats_.stats());
      r.detail = "the shadow's address range is exhausted";
      r.hint = "check the size computation that produced this request";
      throw out_of_memory(std::move(r));
    }
    next_ = p + reserved;
    stats_.on_reserve(reserved);
    stats_.on_allocate(bytes, reserved, tag);
    return reinterpret_cast<void*>(p);
  }
  void deallocate(void* p, std::size_t bytes, std::size_t alignment = default_alignment,
                  memory_tag tag = memory_tag::other) noexcept {
    if (p == nullptr) return;
    const std::size_t reserved = growth_for(bytes, alignment);
    stats_.on_deallocate(bytes, reserved, tag);
    stats_.on_release(reserved);
  }
  std::size_t growth_for(std::size_t bytes, std::size_t alignment) const noexcept {
    return bytes == 0 || alignment <= Guaranteed ? bytes : bytes + (alignment - Guaranteed);
  }
  memory_stats stats() const noexcept { return stats_.stats(); }
  void reset_peaks() noexcept { stats_.reset_peaks(); }
  // The statistics only: where the next address falls is not part of the state a prediction may
  // depend on (a real leaf's addresses are the system's), and every new one lies above all
  // earlier ones, so two states that differ only in it make the same decisions above the leaf.
  void append_state(std::vector<std::uint64_t>& out) const { stats_.append_state(out); }

 private:
  std::uintptr_t next_ = detail::shadow_address_base;
  stats_tracker stats_;
};

// The shadow of a virtual-memory backend: the same granularity, an address range that is
// reserved in name only, commits that cost nothing.
template <memory_space Space = memory_space::host>
class address_only_vm {
 public:
  static constexpr memory_space space = Space;
  explicit address_only_vm(std::size_t granularity) : granularity_(granularity) {}
  std::size_t granularity() const noexcept { return granularity_; }
  void* reserve(std::size_t bytes) {
    const std::uintptr_t p = align_up(detail::shadow_address_base, granularity_);
    if (bytes > std::numeric_limits<std::uintptr_t>::max() - p) {
      throw invalid_argument("capacity", "an address range the shadow can represent", format_bytes(bytes),
                             "Use a smaller expandable_arena_options::capacity");
    }
    return reinterpret_cast<void*>(p);
  }
  void commit(void*, std::size_t) {}
  void decommit(void*, std::size_t) noexcept {}
  void release(void*, std::size_t) noexcept {}

 private:
  std::size_t granularity_;
};

// shadow_traits<A>: `type` (the shadow stack), `args(a)` (its constructor arguments, read from the
// real stack's settings) and `sync(s, a)` (state that is set after construction, such as a
// budget's external bytes). No primary definition: a stack with an unknown layer has no shadow.
template <typename A>
struct shadow_traits;

template <typename A>
concept has_shadow = requires(const A& a) {
  typename shadow_traits<A>::type;
  shadow_traits<A>::args(a);
};

template <typename A>
using shadow_t = typename shadow_traits<A>::type;

// What a shadow keeps of its stack's limits: all of them (same), or all but the arenas' address
// ranges (unbounded_capacity). reserve_model asks the latter what a plan would reserve under a
// larger budget, since a stack made for that budget sizes its arena from it too (the example
// trainers do): the least budget a user is told must be one that works once the stack is remade.
enum class shadow_scope { same, unbounded_capacity };

// shadow_traits<A>::args(a, scope) where a layer takes the scope (an arena, the layers above
// one), else args(a).
template <typename A>
auto shadow_args(const A& a, shadow_scope scope) {
  if constexpr (requires { shadow_traits<A>::args(a, scope); }) return shadow_traits<A>::args(a, scope);
  else return shadow_traits<A>::args(a);
}

template <>
struct shadow_traits<system_allocator> {
  using type = address_only_allocator<memory_space::host>;
  static std::tuple<> args(const system_allocator&) { return {}; }
  static void sync(type&, const system_allocator&) noexcept {}
};

template <memory_space S, std::size_t G>
struct shadow_traits<address_only_allocator<S, G>> {
  using type = address_only_allocator<S, G>;
  static std::tuple<> args(const address_only_allocator<S, G>&) { return {}; }
  static void sync(type&, const address_only_allocator<S, G>&) noexcept {}
};

template <typename U>
  requires has_shadow<U>
struct shadow_traits<caching_allocator<U>> {
  using type = caching_allocator<shadow_t<U>>;
  static auto args(const caching_allocator<U>& a, shadow_scope scope = shadow_scope::same) {
    return std::tuple_cat(std::tuple<caching_options>{a.options()}, shadow_args(a.upstream(), scope));
  }
  static void sync(type& s, const caching_allocator<U>& a) {
    s.set_reserve_limit(a.reserve_limit());
    if (const memory_layout* l = a.layout()) s.set_layout(*l);
    shadow_traits<U>::sync(s.upstream(), a.upstream());
  }
};

template <typename VM>
struct shadow_traits<expandable_arena<VM>> {
  using type = expandable_arena<address_only_vm<VM::space>>;
  // unbounded_capacity: 64 TiB of address space in name (whole granules), never less than a's.
  static auto args(const expandable_arena<VM>& a, shadow_scope scope = shadow_scope::same) {
    std::size_t capacity = a.capacity();
    if (scope == shadow_scope::unbounded_capacity) {
      capacity = std::max(capacity, (std::size_t{1} << 46) / a.granularity() * a.granularity());
    }
    return std::tuple<expandable_arena_options, std::size_t>{expandable_arena_options{capacity}, a.granularity()};
  }
  static void sync(type&, const expandable_arena<VM>&) noexcept {}
};

template <typename U>
  requires has_shadow<U>
struct shadow_traits<budget_allocator<U>> {
  using type = budget_allocator<shadow_t<U>>;
  static auto args(const budget_allocator<U>& a, shadow_scope scope = shadow_scope::same) {
    return std::tuple_cat(std::tuple<std::size_t>{a.limit()}, shadow_args(a.upstream(), scope));
  }
  static void sync(type& s, const budget_allocator<U>& a) {
    shadow_traits<U>::sync(s.upstream(), a.upstream());
    s.set_external(a.external());  // after the upstream: it pushes the reserve limit down
  }
};

// Layers that record or inject faults do not change what is reserved: their shadow is their
// upstream's.
template <typename U>
  requires has_shadow<U>
struct shadow_traits<traced_allocator<U>> {
  using type = shadow_t<U>;
  static auto args(const traced_allocator<U>& a, shadow_scope scope = shadow_scope::same) {
    return shadow_args(a.upstream(), scope);
  }
  static void sync(type& s, const traced_allocator<U>& a) { shadow_traits<U>::sync(s, a.upstream()); }
};
template <typename U>
  requires has_shadow<U>
struct shadow_traits<fault_injecting<U>> {
  using type = shadow_t<U>;
  static auto args(const fault_injecting<U>& a, shadow_scope scope = shadow_scope::same) {
    return shadow_args(a.upstream(), scope);
  }
  static void sync(type& s, const fault_injecting<U>& a) { shadow_traits<U>::sync(s, a.upstream()); }
};

// A fresh shadow of `a`'s stack with its settings (options, capacity, granularity, budget limit
// and external bytes), holding nothing: what `a` would do from empty. With
// shadow_scope::unbounded_capacity its arenas have room for any plan (see shadow_scope).
template <typename A>
std::unique_ptr<shadow_t<A>> make_shadow(const A& a, shadow_scope scope = shadow_scope::same) {
  static_assert(has_shadow<A>,
                "membound: make_shadow: this allocator stack has a layer with no shadow. "
                "Specialize membound::shadow_traits for it (type, args, sync), or plan with "
                "requested bytes only.");
  auto s = std::apply([](auto&&... x) { return std::make_unique<shadow_t<A>>(x...); }, shadow_args(a, scope));
  shadow_traits<A>::sync(*s, a);
  return s;
}

// A stack whose every layer can write down the state that decides its next answers
// (append_state): two stacks with equal keys give the same answers to the same requests from
// then on. The planner uses it to stop replaying identical micro-batches once the stack is back
// where it started (replay_run in model/reserve_plan.hpp).
template <typename A>
constexpr bool has_state_key() {
  if constexpr (!requires(const A& a, std::vector<std::uint64_t>& v) { a.append_state(v); }) {
    return false;
  } else if constexpr (requires(const A& a) { a.upstream(); }) {
    return has_state_key<std::remove_cvref_t<decltype(std::declval<const A&>().upstream())>>();
  } else {
    return true;
  }
}

// The state key of a stack, layer by layer from the top (has_state_key<A>() must hold).
template <typename A>
void allocator_state_key(const A& a, std::vector<std::uint64_t>& out) {
  a.append_state(out);
  if constexpr (requires { a.upstream(); }) allocator_state_key(a.upstream(), out);
}

namespace detail {
// Lifts every budget in a stack (for a shadow: how much a plan would reserve with no cap).
template <typename A>
void lift_budgets(A& a) {
  if constexpr (requires { a.set_limit(std::size_t{}); a.limit(); }) a.set_limit(std::numeric_limits<std::size_t>::max());
  if constexpr (requires { a.upstream(); }) lift_budgets(a.upstream());
}
// The smallest budget limit in a stack, and the external bytes counted against it (SIZE_MAX, 0
// when there is no budget).
template <typename A>
std::pair<std::size_t, std::size_t> tightest_budget(const A& a) {
  std::pair<std::size_t, std::size_t> r{std::numeric_limits<std::size_t>::max(), 0};
  if constexpr (requires { a.limit(); a.external(); }) r = {a.limit(), a.external()};
  if constexpr (requires { a.upstream(); }) {
    const auto u = tightest_budget(a.upstream());
    if (u.first < r.first) r = u;
  }
  return r;
}
}  // namespace detail

MEMBOUND_NAMESPACE_END
