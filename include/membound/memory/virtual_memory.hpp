// The virtual-memory backend concept: reserve an address range once, then back parts of it with
// physical memory and give them back, without the range ever moving. expandable_arena builds on
// it so that a growing pool never has to copy or fragment.
//
// Required members (VM is the backend, vm an lvalue of it; all sizes in bytes):
//
//   static constexpr membound::memory_space space;
//       Where committed memory lives (host or device).
//
//   std::size_t vm.granularity() const;
//       The commit unit: a power of two, the same for the object's whole lifetime. Every size and
//       offset below is a multiple of it. (CUDA: cuMemGetAllocationGranularity with
//       CU_MEM_ALLOC_GRANULARITY_RECOMMENDED or MINIMUM, typically 2 MiB; host: >= the page size.)
//
//   void* vm.reserve(std::size_t bytes);
//       Reserves `bytes` of address space, with no physical memory behind it, and returns its start,
//       aligned to granularity(). `bytes` is a nonzero multiple of granularity(). Throws
//       membound::out_of_memory when the address space is exhausted, invalid_argument for a bad
//       size, backend_error for any other failure; nothing is reserved then.
//       (CUDA: cuMemAddressReserve(&ptr, bytes, granularity, 0, 0).)
//
//   void vm.commit(void* p, std::size_t bytes);
//       Backs [p, p + bytes) with physical memory, readable and writable by the memory space's
//       owner. The range lies inside one reservation, is not committed yet, and p and bytes are
//       multiples of granularity(). Throws membound::out_of_memory when there is not enough physical
//       memory (report: requested = growth_needed = bytes, detail names the failing call), or
//       backend_error for any other failure. Strong guarantee: on a throw nothing in the range is
//       committed (undo partial work, e.g. cuMemRelease a handle that could not be mapped).
//       (CUDA: cuMemCreate physical memory, cuMemMap it at p, cuMemSetAccess read/write for the
//       device; keep the handles so that decommit can unmap and release them.)
//
//   void vm.decommit(void* p, std::size_t bytes) noexcept;
//       Gives the physical memory of [p, p + bytes) back; the range stays reserved and may be
//       committed again. The range is committed and granularity-aligned, but need not match the
//       pieces it was committed in: any granule-aligned committed range must be accepted (it
//       may start inside an earlier commit or span several). Contents are lost.
//       (CUDA: cuMemUnmap cannot split a mapping, so map one handle per granule and here
//       cuMemUnmap + cuMemRelease the handles of the range's granules.)
//
//   void vm.release(void* p, std::size_t bytes) noexcept;
//       Returns a whole reservation (p and bytes exactly as reserve gave and got them) after every
//       committed part of it was decommitted. (CUDA: cuMemAddressFree.)
//
// How expandable_arena uses a backend: one reserve at construction and one release at
// destruction; commits only at the end of the committed prefix [start, start + committed);
// decommits only a suffix of that prefix, which may begin inside an earlier commit.
#pragma once

#include <concepts>
#include <cstddef>

#include "membound/core/config.hpp"
#include "membound/core/memory_tag.hpp"

MEMBOUND_NAMESPACE_BEGIN

namespace detail {
template <typename VM>
concept vm_has_space = requires {
  { VM::space } -> std::convertible_to<memory_space>;
};
template <typename VM>
concept vm_has_granularity = requires(const VM& vm) {
  { vm.granularity() } -> std::convertible_to<std::size_t>;
};
template <typename VM>
concept vm_has_reserve = requires(VM& vm, std::size_t n) {
  { vm.reserve(n) } -> std::same_as<void*>;
};
template <typename VM>
concept vm_has_commit = requires(VM& vm, void* p, std::size_t n) { vm.commit(p, n); };
template <typename VM>
concept vm_has_decommit = requires(VM& vm, void* p, std::size_t n) {
  { vm.decommit(p, n) } noexcept;
};
template <typename VM>
concept vm_has_release = requires(VM& vm, void* p, std::size_t n) {
  { vm.release(p, n) } noexcept;
};
}  // namespace detail

template <typename VM>
concept virtual_memory_backend = detail::vm_has_space<VM> && detail::vm_has_granularity<VM> &&
                                 detail::vm_has_reserve<VM> && detail::vm_has_commit<VM> &&
                                 detail::vm_has_decommit<VM> && detail::vm_has_release<VM>;

// Use as `static_assert(check_virtual_memory<VM>())`: the compiler then prints the sentence that
// names the missing member instead of a concept dump.
template <typename VM>
consteval bool check_virtual_memory() {
  static_assert(detail::vm_has_space<VM>,
                "membound: this type is not a virtual-memory backend: it needs a member "
                "`static constexpr membound::memory_space space` (host or device).");
  static_assert(detail::vm_has_granularity<VM>,
                "membound: this type is not a virtual-memory backend: it needs a member function "
                "`std::size_t granularity() const`.");
  static_assert(detail::vm_has_reserve<VM>,
                "membound: this type is not a virtual-memory backend: it needs a member function "
                "`void* reserve(std::size_t bytes)`.");
  static_assert(detail::vm_has_commit<VM>,
                "membound: this type is not a virtual-memory backend: it needs a member function "
                "`void commit(void* p, std::size_t bytes)`.");
  static_assert(detail::vm_has_decommit<VM>,
                "membound: this type is not a virtual-memory backend: it needs a member function "
                "`void decommit(void* p, std::size_t bytes) noexcept`.");
  static_assert(detail::vm_has_release<VM>,
                "membound: this type is not a virtual-memory backend: it needs a member function "
                "`void release(void* p, std::size_t bytes) noexcept`.");
  return virtual_memory_backend<VM>;
}

MEMBOUND_NAMESPACE_END
