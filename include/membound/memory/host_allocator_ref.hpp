// A reference to a caller's host allocator whose type the holder does not name, as
// std::pmr::memory_resource* is for the standard library: what the trainer takes for the second
// memory space of an offloaded plan (trainer_options::host), so that the trainer's type stays
// the same with or without offload.
//
//   membound::budget_allocator<membound::system_allocator> host(8ull << 30);
//   membound::trainer_options o;  o.host = membound::host_allocator_ref(host);
//
// It refers, it does not own: the allocator must outlive every holder of the reference.
#pragma once

#include <cstddef>

#include "membound/core/config.hpp"
#include "membound/core/memory_tag.hpp"
#include "membound/memory/allocator.hpp"
#include "membound/memory/memory_stats.hpp"

MEMBOUND_NAMESPACE_BEGIN

class host_allocator_ref {
 public:
  // No allocator: empty() is true, and a plan that needs the host space is refused.
  host_allocator_ref() = default;

  template <typename A>
    requires host_allocator<A>
  explicit host_allocator_ref(A& a) noexcept
      : a_(&a),
        allocate_([](void* a, std::size_t n, std::size_t al, memory_tag t) { return static_cast<A*>(a)->allocate(n, al, t); }),
        deallocate_([](void* a, void* p, std::size_t n, std::size_t al, memory_tag t) {
          static_cast<A*>(a)->deallocate(p, n, al, t);
        }),
        stats_([](const void* a) -> memory_stats { return static_cast<const A*>(a)->stats(); }),
        limit_([](const void* a) -> std::size_t {
          if constexpr (budgeted<A>) return static_cast<const A*>(a)->limit();
          else return 0;
        }) {}

  // Whether no allocator is referred to.
  bool empty() const noexcept { return a_ == nullptr; }
  // The allocator's allocate; nullptr for 0 bytes, out_of_memory when it cannot.
  void* allocate(std::size_t bytes, std::size_t alignment, memory_tag tag) const {
    return allocate_(a_, bytes, alignment, tag);
  }
  // The allocator's sized deallocate.
  void deallocate(void* p, std::size_t bytes, std::size_t alignment, memory_tag tag) const {
    deallocate_(a_, p, bytes, alignment, tag);
  }
  // The allocator's statistics (its peak is what an offloaded plan's host peak is measured by).
  memory_stats stats() const { return stats_(a_); }
  // Whether it refers to the object at p (the trainer refuses its own allocator as the host space).
  bool refers_to(const void* p) const noexcept { return a_ == p; }
  // The allocator's budget when it has one (budget_allocator), else 0.
  std::size_t limit() const { return limit_(a_); }

 private:
  void* a_ = nullptr;
  void* (*allocate_)(void*, std::size_t, std::size_t, memory_tag) = nullptr;
  void (*deallocate_)(void*, void*, std::size_t, std::size_t, memory_tag) = nullptr;
  memory_stats (*stats_)(const void*) = nullptr;
  std::size_t (*limit_)(const void*) = nullptr;
};

MEMBOUND_NAMESPACE_END
