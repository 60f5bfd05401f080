// Workspace carving, in the style of CUB's temporary storage and llm.c's single buffer: an
// operation declares the scratch slots it needs, the layout packs them (slots that are never
// live at the same time share bytes), and the caller hands one buffer that is carved into
// pointers. Operations then never allocate, so their memory is known before they run.
//
// The two-phase convention (CUB's):
//   void op(void* workspace, std::size_t& bytes, ...);
//   op(nullptr, bytes, ...);        // query: writes the bytes needed, does nothing else
//   op(buffer, bytes, ...);         // run inside buffer, which holds at least `bytes`
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <utility>

#include "membound/core/config.hpp"
#include "membound/core/error.hpp"
#include "membound/memory/allocator.hpp"
#include "membound/core/memory_tag.hpp"

MEMBOUND_NAMESPACE_BEGIN

namespace detail {

// Slots this large would overflow a layout's placement: the size functions of the layers and of
// both backends report SIZE_MAX for them instead (a request no budget serves) and stay noexcept.
inline constexpr std::size_t huge_slot = std::numeric_limits<std::size_t>::max() / 32;

template <std::size_t N>
constexpr bool fits_layout(const std::size_t (&bytes)[N]) noexcept {
  for (std::size_t b : bytes)
    if (b >= huge_slot) return false;
  return true;
}

}  // namespace detail

// Inclusive [first, last] phase indices during which a slot holds live data.
struct slot_lifetime {
  std::size_t first = 0;  // the first phase the slot is live in
  std::size_t last = 0;   // the last one (inclusive)

  // Whether the two are live in a common phase, so their slots cannot share bytes.
  constexpr bool overlaps(const slot_lifetime& o) const noexcept {
    return first <= o.last && o.first <= last;
  }
};

// Scratch slots packed into one buffer, slots of disjoint lifetimes sharing bytes. A fixed array
// of MaxSlots, so a layout is built and sized in constant expressions.
template <std::size_t MaxSlots>
class workspace_layout {
  static_assert(MaxSlots > 0, "membound: a workspace_layout needs room for at least one slot.");

 public:
  // The most slots add() accepts.
  static constexpr std::size_t max_slots = MaxSlots;

  // Returns the slot's index. By default every slot lives in phase 0, so none share bytes.
  constexpr std::size_t add(std::size_t bytes, std::size_t alignment = default_alignment,
                            slot_lifetime lifetime = {}) {
    if (count_ == MaxSlots) {
      throw invalid_argument("slot", "at most " + std::to_string(MaxSlots) + " slots",
                             std::to_string(MaxSlots + 1),
                             "Raise the MaxSlots template argument of workspace_layout");
    }
    if (!is_power_of_two(alignment)) {
      throw invalid_argument("alignment", "a power of two", std::to_string(alignment),
                             "Pass e.g. membound::default_alignment (256)");
    }
    if (lifetime.first > lifetime.last) {
      throw invalid_argument("lifetime", "first <= last (an inclusive phase range)",
                             "[" + std::to_string(lifetime.first) + ", " +
                                 std::to_string(lifetime.last) + "]",
                             "Give the first and last phase in which the slot is live, e.g. {0, 2}");
    }
    // Every slot ends below the sum of all (bytes + alignment), so bounding that sum rules out
    // overflow in the placement.
    constexpr std::size_t max = std::numeric_limits<std::size_t>::max();
    if (bytes > max - alignment || worst_case_ > max - (bytes + alignment)) {
      // Named after the larger of the two, which is the one that overflowed.
      throw invalid_argument(bytes >= alignment ? "bytes" : "alignment",
                             "slots whose bytes plus alignment sum to less than SIZE_MAX",
                             std::to_string(bytes) + " B aligned to " + std::to_string(alignment),
                             "Check the size computation of this slot (an overflow or a negative "
                             "value converted to std::size_t)");
    }
    worst_case_ += bytes + alignment;
    slots_[count_] = slot{bytes, alignment, lifetime, 0};
    if (alignment > alignment_) alignment_ = alignment;
    ++count_;
    place();
    return count_ - 1;
  }

  // Total bytes, with slots of disjoint lifetimes sharing.
  constexpr std::size_t size() const noexcept { return size_; }
  // Slots added so far.
  constexpr std::size_t slots() const noexcept { return count_; }
  // The largest slot alignment: the base of a carved buffer must be aligned to it.
  constexpr std::size_t alignment() const noexcept { return alignment_; }

  // The slot's byte offset from the buffer's base (an index add() returned, or invalid_argument).
  constexpr std::size_t offset(std::size_t slot) const { return at(slot).offset; }
  // Bytes the slot was added with.
  constexpr std::size_t slot_bytes(std::size_t slot) const { return at(slot).bytes; }
  // Alignment the slot was added with.
  constexpr std::size_t slot_alignment(std::size_t slot) const { return at(slot).alignment; }
  // Phases the slot was added with.
  constexpr slot_lifetime lifetime(std::size_t slot) const { return at(slot).life; }

  // A range of a layout's bytes: [offset, offset + bytes).
  struct byte_range {
    std::size_t offset = 0;  // its first byte, from the buffer's base
    std::size_t bytes = 0;   // its length
  };
  // The longest byte range of [0, size()) that none of the non-empty slots in `live` (indices
  // add() returned, each once) overlaps: scratch for a callee (a library's workspace) while only
  // those slots hold data. By offset, not by order of addition: place() lays slots out largest
  // first.
  template <typename Slots>
  constexpr byte_range largest_gap(const Slots& live) const {
    std::array<byte_range, MaxSlots> taken{};
    std::size_t n = 0;
    for (const std::size_t i : live) {
      const slot& s = at(i);
      if (s.bytes == 0) continue;
      if (n == MaxSlots) {
        throw invalid_argument("live", "at most " + std::to_string(MaxSlots) + " non-empty slots",
                               "more (a slot listed twice?)", "List each live slot once");
      }
      taken[n++] = byte_range{s.offset, s.bytes};
    }
    for (std::size_t i = 1; i < n; ++i) {  // insertion sort by offset: constexpr and tiny n
      for (std::size_t j = i; j > 0 && taken[j - 1].offset > taken[j].offset; --j) {
        const byte_range t = taken[j];
        taken[j] = taken[j - 1];
        taken[j - 1] = t;
      }
    }
    byte_range best{};
    std::size_t from = 0;  // the first byte no slot seen so far holds
    for (std::size_t i = 0; i <= n; ++i) {
      const std::size_t to = i < n ? taken[i].offset : size_;
      if (to > from && to - from > best.bytes) best = byte_range{from, to - from};
      if (i < n && taken[i].offset + taken[i].bytes > from) from = taken[i].offset + taken[i].bytes;
    }
    return best;
  }

 private:
  struct slot {
    std::size_t bytes = 0;
    std::size_t alignment = 1;
    slot_lifetime life{};
    std::size_t offset = 0;
  };

  constexpr const slot& at(std::size_t i) const {
    if (i >= count_) {
      throw invalid_argument("slot", "an index below " + std::to_string(count_),
                             std::to_string(i), "Use the index add() returned");
    }
    return slots_[i];
  }

  // Greedy, as memory planners do it: larger slots first (ties: stricter alignment, then order
  // of addition, so the result is deterministic), each at the lowest aligned offset that does
  // not collide with a placed slot whose lifetime overlaps. Recomputed on every add because a
  // larger newcomer changes the order; layouts are small.
  constexpr void place() {
    std::array<std::size_t, MaxSlots> order{};
    for (std::size_t i = 0; i < count_; ++i) order[i] = i;
    auto before = [&](std::size_t a, std::size_t b) {
      const slot& x = slots_[a];
      const slot& y = slots_[b];
      if (x.bytes != y.bytes) return x.bytes > y.bytes;
      if (x.alignment != y.alignment) return x.alignment > y.alignment;
      return a < b;
    };
    for (std::size_t i = 1; i < count_; ++i) {  // insertion sort: constexpr and tiny n
      const std::size_t v = order[i];
      std::size_t j = i;
      for (; j > 0 && before(v, order[j - 1]); --j) order[j] = order[j - 1];
      order[j] = v;
    }

    size_ = 0;
    // One spare entry: at most count_ − 1 ≤ MaxSlots − 1 are used, but GCC's -Warray-bounds
    // cannot see that bound through the loops (a false error at -O3 for workspace_layout<1>).
    std::array<std::size_t, MaxSlots + 1> conflicts{};
    for (std::size_t k = 0; k < count_; ++k) {
      slot& s = slots_[order[k]];
      // Placed, non-empty slots live at the same time as s, sorted by offset.
      std::size_t n = 0;
      for (std::size_t p = 0; p < k; ++p) {
        const slot& o = slots_[order[p]];
        if (o.bytes == 0 || !o.life.overlaps(s.life)) continue;
        std::size_t j = n++;
        for (; j > 0 && slots_[conflicts[j - 1]].offset > o.offset; --j) {
          conflicts[j] = conflicts[j - 1];
        }
        conflicts[j] = order[p];
      }
      std::size_t candidate = 0;
      for (std::size_t c = 0; c < n; ++c) {
        const slot& o = slots_[conflicts[c]];
        if (candidate + s.bytes <= o.offset) break;  // fits in the gap before o
        const std::size_t after = align_up(o.offset + o.bytes, s.alignment);
        if (after > candidate) candidate = after;
      }
      s.offset = candidate;
      if (candidate + s.bytes > size_) size_ = candidate + s.bytes;
    }
  }

  std::array<slot, MaxSlots> slots_{};
  std::size_t count_ = 0;
  std::size_t size_ = 0;
  std::size_t alignment_ = 1;
  std::size_t worst_case_ = 0;
};

// Pointers into one carved buffer. Holds a copy of the layout, so it may outlive it.
template <std::size_t MaxSlots>
class workspace_view {
 public:
  constexpr workspace_view() = default;
  // Unchecked: carve() checks the buffer against the layout first.
  constexpr workspace_view(const workspace_layout<MaxSlots>& layout, std::byte* base,
                           std::size_t bytes) noexcept
      : layout_(layout), base_(base), bytes_(bytes) {}

  // The slot's address as T*; throws invalid_argument if T needs more alignment than the slot has.
  template <typename T>
  T* get(std::size_t slot) const {
    const std::size_t a = layout_.slot_alignment(slot);  // also checks the index
    if (alignof(T) > a) {
      throw invalid_argument("T", "a type aligned to at most the slot's " + std::to_string(a) +
                                      " bytes",
                             "alignof(T) = " + std::to_string(alignof(T)),
                             "Add the slot with alignment >= alignof(T)");
    }
    if (base_ == nullptr) return nullptr;  // only for an empty layout
    return static_cast<T*>(static_cast<void*>(base_ + layout_.offset(slot)));
  }

  // The slot as elements of T (its bytes / sizeof(T), rounded down).
  template <typename T>
  std::span<T> span(std::size_t slot) const {
    return {get<T>(slot), layout_.slot_bytes(slot) / sizeof(T)};
  }

  // The carved buffer's base.
  void* data() const noexcept { return base_; }
  // The carved buffer's bytes (at least layout().size()).
  std::size_t size() const noexcept { return bytes_; }
  // The layout's copy the slots are found by.
  const workspace_layout<MaxSlots>& layout() const noexcept { return layout_; }

 private:
  workspace_layout<MaxSlots> layout_{};
  std::byte* base_ = nullptr;
  std::size_t bytes_ = 0;
};

// Checks the buffer against the layout and returns the view. A null base is accepted only for a
// layout of 0 bytes, where there is nothing to carve.
template <std::size_t MaxSlots>
workspace_view<MaxSlots> carve(const workspace_layout<MaxSlots>& layout, void* base,
                               std::size_t bytes) {
  const std::size_t need = layout.size();
  if (need != 0 && (base == nullptr || bytes < need)) {
    throw workspace_too_small("workspace", need, base == nullptr ? 0 : bytes);
  }
  const auto addr = reinterpret_cast<std::uintptr_t>(base);
  if (addr % layout.alignment() != 0) {
    throw invalid_argument("workspace",
                           "a base aligned to " + std::to_string(layout.alignment()) +
                               " bytes (the largest slot alignment)",
                           "an address " + std::to_string(addr % layout.alignment()) +
                               " bytes past such a boundary",
                           "Allocate the workspace with at least that alignment");
  }
  return workspace_view<MaxSlots>(layout, static_cast<std::byte*>(base), bytes);
}

// Owns one allocation from an allocator, for the overloads that take an allocator instead of a
// workspace. Move-only; gives the block back with the same bytes, alignment and tag.
template <typename Allocator>
class scoped_allocation {
  static_assert(check_allocator<Allocator>());

 public:
  scoped_allocation() noexcept = default;
  // Allocates from `a` (which must outlive it); throws what a.allocate throws.
  scoped_allocation(Allocator& a, std::size_t bytes, std::size_t alignment = default_alignment,
                    memory_tag tag = memory_tag::workspace)
      : alloc_(&a), ptr_(a.allocate(bytes, alignment, tag)), bytes_(bytes),
        alignment_(alignment), tag_(tag) {}

  // Takes o's block, leaving o empty.
  scoped_allocation(scoped_allocation&& o) noexcept
      : alloc_(o.alloc_),
        ptr_(std::exchange(o.ptr_, nullptr)),
        bytes_(std::exchange(o.bytes_, 0)),
        alignment_(o.alignment_),
        tag_(o.tag_) {}
  // Gives back the block held, then takes o's, leaving o empty.
  scoped_allocation& operator=(scoped_allocation&& o) noexcept {
    if (this != &o) {
      reset();
      alloc_ = o.alloc_;
      ptr_ = std::exchange(o.ptr_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
      alignment_ = o.alignment_;
      tag_ = o.tag_;
    }
    return *this;
  }
  scoped_allocation(const scoped_allocation&) = delete;
  scoped_allocation& operator=(const scoped_allocation&) = delete;
  ~scoped_allocation() { reset(); }

  // Gives the block back now, leaving this empty.
  void reset() noexcept {
    if (ptr_ != nullptr) alloc_->deallocate(ptr_, bytes_, alignment_, tag_);
    ptr_ = nullptr;
    bytes_ = 0;
  }

  // The block, or nullptr when empty.
  void* get() const noexcept { return ptr_; }
  // The block as T*.
  template <typename T>
  T* as() const noexcept {
    return static_cast<T*>(ptr_);
  }
  // Bytes requested; 0 when empty.
  std::size_t size() const noexcept { return bytes_; }
  // Alignment the block was requested with.
  std::size_t alignment() const noexcept { return alignment_; }
  // Tag the block was requested with.
  memory_tag tag() const noexcept { return tag_; }
  // Whether a block is held.
  explicit operator bool() const noexcept { return ptr_ != nullptr; }

 private:
  Allocator* alloc_ = nullptr;
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
  std::size_t alignment_ = default_alignment;
  memory_tag tag_ = memory_tag::workspace;
};

// Carves a scoped_allocation's block (its whole size) by the layout.
template <std::size_t MaxSlots, typename Allocator>
workspace_view<MaxSlots> carve(const workspace_layout<MaxSlots>& layout,
                               const scoped_allocation<Allocator>& storage) {
  return carve(layout, storage.get(), storage.size());
}

// Runs a two-phase operation `op(void* workspace, std::size_t& bytes)` with storage from an
// allocator: one query, one allocation (tagged workspace by default), one run. An operation that
// needs 0 bytes still gets a non-null 1-byte block, because a null workspace means "query".
template <typename Allocator, typename Op>
decltype(auto) with_workspace(Allocator& a, Op&& op, std::size_t alignment = default_alignment,
                              memory_tag tag = memory_tag::workspace) {
  std::size_t bytes = 0;
  op(static_cast<void*>(nullptr), bytes);
  scoped_allocation<Allocator> storage(a, bytes == 0 ? 1 : bytes, alignment, tag);
  return std::forward<Op>(op)(storage.get(), bytes);
}

MEMBOUND_NAMESPACE_END
