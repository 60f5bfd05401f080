// The block engine shared by caching_allocator and expandable_arena: blocks carved out of
// segments (contiguous address ranges), best-fit free-block indexes, split and coalesce.
//
// Placement rule: the oldest segment that has a fitting free block, and inside it the best fit
// by (size, address), taking the segment's free tail (the free block at its end) only when no
// other block fits. Oldest-first across segments is what makes a repeated sequence of requests
// settle after one pass: segments created during the first pass are younger than every segment
// the first pass used before creating them, so the second pass finds the same blocks in the same
// places, and finds each new segment fully free exactly where the first pass created it. (With
// best fit across all segments, an untouched new segment could be a better fit for an earlier
// request, shift every later placement and force yet another segment.) Tail-last does the same
// for an arena that grows at its end, and keeps untouched memory together so it can be released.
//
// Addresses are plain integers: the pool only does arithmetic on them and never touches the
// memory, so it serves device memory exactly as it serves host memory.
//
// Streams: each segment belongs to one stream (an opaque integer, 0 for owners without streams).
// All its blocks inherit it, so blocks never coalesce across streams, and best_fit(n, stream)
// only looks at that stream's segments.
//
// Exception safety: every mutating operation either completes or throws with the pool
// unchanged (strong guarantee), and the operations an allocator runs on its release paths
// (free_block, shrink_segment, remove_segment) never allocate and never throw.
//
// No heap traffic in a steady state: a block keeps, for its whole life, one node of the free
// index and one node of the live map; exactly one of them is in its container at any time (the
// free-index node while the block is free, the live-map node while it is allocated) and the other
// is parked in the block. Blocks that disappear in a merge go to a spare list with their nodes,
// and a split takes its new block from there. Once a workload has been seen, allocate and free
// only move nodes between containers.
//
// Not thread-safe; the owning allocator documents its own threading rules.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <memory>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "membound/core/config.hpp"
#include "membound/core/error.hpp"
#include "membound/core/memory_tag.hpp"

MEMBOUND_NAMESPACE_BEGIN

namespace detail {

class block_pool {
 public:
  struct segment;
  struct block;

 private:
  // Orders free blocks by (size, address): lower_bound on a size gives the best fit, and among
  // equal sizes the lowest address, which keeps placement deterministic.
  struct size_key {
    std::size_t size;
    std::uintptr_t addr;
  };
  struct by_size_then_addr {
    using is_transparent = void;
    static size_key key(const block* b) noexcept;
    static size_key key(const size_key& k) noexcept { return k; }
    template <typename L, typename R>
    bool operator()(const L& l, const R& r) const noexcept {
      const size_key a = key(l), b = key(r);
      return a.size < b.size || (a.size == b.size && a.addr < b.addr);
    }
  };
  using free_index = std::set<block*, by_size_then_addr>;
  using live_index = std::unordered_map<std::uintptr_t, block*>;

 public:
  struct block {
    std::uintptr_t addr = 0;
    std::size_t size = 0;        // bytes of the block (a multiple of the owner's granule)
    bool free = true;
    std::size_t requested = 0;   // caller's bytes, valid while allocated
    std::size_t alignment = 0;   // caller's alignment, valid while allocated
    memory_tag tag = memory_tag::other;
    segment* seg = nullptr;
    block* prev = nullptr;       // address-order neighbours within the segment
    block* next = nullptr;
    free_index::node_type parked;    // this block's free-index node while it is allocated
    live_index::node_type live_node;  // this block's live-map node while it is free

    void* ptr() const noexcept { return reinterpret_cast<void*>(addr); }
  };

  struct segment {
    std::uintptr_t base = 0;
    std::size_t size = 0;
    memory_tag tag = memory_tag::other;  // the owner's note, e.g. the tag it gave the upstream
    std::uintptr_t stream = 0;           // the stream every block of this segment is used on
    block* first = nullptr;
    block* last = nullptr;
    free_index free;  // this segment's free blocks

    void* ptr() const noexcept { return reinterpret_cast<void*>(base); }
    bool fully_free() const noexcept { return first == nullptr || (first == last && first->free); }
    // Bytes of the free block that ends the segment, 0 when the last block is in use.
    std::size_t free_tail() const noexcept { return last != nullptr && last->free ? last->size : 0; }
    std::size_t largest_free() const noexcept { return free.empty() ? 0 : (*free.rbegin())->size; }

    // Best fit of at least n bytes in this segment, the free tail only when nothing else fits.
    block* best_fit(std::size_t n) const noexcept {
      auto it = free.lower_bound(size_key{n, 0});
      if (it == free.end()) return nullptr;
      if (*it != last) return *it;
      auto other = std::next(it);
      return other != free.end() ? *other : *it;
    }
  };

  block_pool() = default;
  block_pool(const block_pool&) = delete;
  block_pool& operator=(const block_pool&) = delete;
  ~block_pool() { clear(); }

  // ---- queries -------------------------------------------------------------------------------

  // Where a request of n bytes goes (see the placement rule above), or nullptr when no free
  // block fits. O(segments + log blocks).
  block* best_fit(std::size_t n) const noexcept {
    for (const auto& s : segments_) {
      if (s->largest_free() >= n) return s->best_fit(n);
    }
    return nullptr;
  }
  // The same, among the segments of one stream only.
  block* best_fit(std::size_t n, std::uintptr_t stream) const noexcept {
    for (const auto& s : segments_) {
      if (s->stream == stream && s->largest_free() >= n) return s->best_fit(n);
    }
    return nullptr;
  }
  std::size_t largest_free() const noexcept {
    std::size_t m = 0;
    for (const auto& s : segments_) m = s->largest_free() > m ? s->largest_free() : m;
    return m;
  }

  // The allocated block that starts at p, or nullptr (free blocks and interior pointers are not
  // found: they are never valid arguments to deallocate).
  block* find_live(const void* p) const noexcept {
    auto it = live_.find(reinterpret_cast<std::uintptr_t>(p));
    return it == live_.end() ? nullptr : it->second;
  }
  bool empty() const noexcept { return segments_.empty(); }

  // Every segment (oldest first) and its blocks in address order: the whole state placement
  // depends on (the indexes and the spare list follow from it or decide nothing).
  void append_state(std::vector<std::uint64_t>& out) const {
    out.push_back(segments_.size());
    for (const auto& s : segments_) {
      out.insert(out.end(), {s->base, s->size, static_cast<std::uint64_t>(s->tag), s->stream});
      for (const block* b = s->first; b != nullptr; b = b->next) {
        out.insert(out.end(), {b->addr, b->size, std::uint64_t{b->free}});
        if (!b->free) out.insert(out.end(), {b->requested, b->alignment, static_cast<std::uint64_t>(b->tag)});
      }
      out.push_back(~std::uint64_t{0});  // the segment's end
    }
  }

  // ---- segments ------------------------------------------------------------------------------

  // Adds [base, base+size) as the youngest segment, holding one free block (none when size is 0).
  segment* add_segment(void* base, std::size_t size, memory_tag tag, std::uintptr_t stream = 0) {
    auto seg = std::make_unique<segment>();
    seg->base = reinterpret_cast<std::uintptr_t>(base);
    seg->size = size;
    seg->tag = tag;
    seg->stream = stream;
    block* b = nullptr;
    try {
      // Geometric growth (reserve(size + 1) would copy the vector on every new segment).
      if (segments_.size() == segments_.capacity()) segments_.reserve(2 * segments_.size() + 4);
      if (size != 0) {
        b = take_spare();
        b->addr = seg->base;
        b->size = size;
        b->seg = seg.get();
        insert_free(seg.get(), b);
      }
    } catch (...) {
      if (b != nullptr) recycle(b);
      throw;
    }
    segments_.push_back(std::move(seg));  // cannot throw after the reserve
    segment* s = segments_.back().get();
    if (b != nullptr) s->first = s->last = b;
    return s;
  }

  // Extends a segment by `bytes` at its end. The new bytes merge into a free last block, or
  // become a new free block when the last block is in use.
  void grow_segment(segment* s, std::size_t bytes) {
    if (bytes == 0) return;
    block* tail = s->last;
    if (tail != nullptr && tail->free) {
      auto node = s->free.extract(tail);  // re-keyed in place: no allocation
      tail->size += bytes;
      s->free.insert(std::move(node));
    } else {
      block* b = take_spare();
      b->addr = s->base + s->size;
      b->size = bytes;
      b->seg = s;
      try {
        insert_free(s, b);  // nothing is linked yet
      } catch (...) {
        recycle(b);
        throw;
      }
      link_after(s, tail, b);
    }
    s->size += bytes;
  }

  // Removes `bytes` from the end of a segment; the segment's last block must be free and at
  // least that large.
  void shrink_segment(segment* s, std::size_t bytes) noexcept {
    if (bytes == 0) return;
    block* tail = s->last;
    auto node = s->free.extract(tail);
    if (tail->size == bytes) {
      tail->parked = std::move(node);
      unlink(tail);
      recycle(tail);
    } else {
      tail->size -= bytes;
      s->free.insert(std::move(node));
    }
    s->size -= bytes;
  }

  // Forgets a fully free segment; the caller gives its memory back.
  void remove_segment(segment* s) noexcept {
    for (auto it = segments_.begin(); it != segments_.end(); ++it) {
      if (it->get() == s) {
        delete_blocks(*s);
        segments_.erase(it);
        return;
      }
    }
  }

  // Calls release(segment&) for every fully free segment, then forgets it. release must not throw.
  template <typename F>
  void remove_free_segments(F&& release) noexcept {
    std::size_t kept = 0;
    for (std::size_t i = 0; i < segments_.size(); ++i) {
      if (segments_[i]->fully_free()) {
        release(*segments_[i]);
        delete_blocks(*segments_[i]);
        segments_[i].reset();
      } else {
        segments_[kept++] = std::move(segments_[i]);  // keeps the age order
      }
    }
    segments_.resize(kept);
  }

  // Calls release(segment&) for every segment, live blocks or not, and empties the pool.
  template <typename F>
  void remove_all_segments(F&& release) noexcept {
    for (auto& s : segments_) release(*s);
    clear();
  }

  // ---- blocks --------------------------------------------------------------------------------

  // Hands out the free block b for a request of n bytes (n <= b->size). The rest of b becomes a
  // new free block when it is at least min_split bytes; otherwise it stays inside b.
  block* allocate_block(block* b, std::size_t n, std::size_t min_split, std::size_t requested,
                        std::size_t alignment, memory_tag tag) {
    segment* s = b->seg;
    const std::size_t rest_size = b->size - n;
    block* rest = nullptr;
    bool rest_indexed = false;
    try {
      if (rest_size != 0 && rest_size >= min_split) {
        rest = take_spare();
        rest->addr = b->addr + n;
        rest->size = rest_size;
        rest->seg = s;
        insert_free(s, rest);  // keyed by its final (size, addr), distinct from b's
        rest_indexed = true;
      }
      // Grow the buckets here when the load factor says the insert would, so that in a steady
      // state the insert does not rehash. (An implementation may still rehash, e.g. on the first
      // insert; that can only throw, which the catch below undoes.) Checked by hand because
      // reserve() itself costs a prime-table search on every call.
      if (static_cast<float>(live_.size() + 1) >
          live_.max_load_factor() * static_cast<float>(live_.bucket_count())) {
        live_.reserve(live_.size() + 1);
      }
      if (b->live_node.empty()) {
        live_.emplace(b->addr, b);
      } else {
        b->live_node.key() = b->addr;
        b->live_node.mapped() = b;
        live_.insert(std::move(b->live_node));
      }
    } catch (...) {
      if (rest != nullptr) {
        if (rest_indexed) rest->parked = s->free.extract(rest);
        recycle(rest);
      }
      throw;
    }
    // Nothing below allocates or throws.
    b->parked = s->free.extract(b);
    b->free = false;
    b->requested = requested;
    b->alignment = alignment;
    b->tag = tag;
    if (rest != nullptr) {
      b->size = n;
      link_after(s, b, rest);
    }
    return b;
  }

  // Returns an allocated block to its segment's free index, merged with free neighbours.
  // Returns the merged free block.
  block* free_block(block* b) noexcept {
    segment* s = b->seg;
    b->live_node = live_.extract(b->addr);
    auto node = std::move(b->parked);
    b->free = true;
    b->requested = 0;
    b->alignment = 0;
    b->tag = memory_tag::other;
    if (block* p = b->prev; p != nullptr && p->free) {
      p->parked = s->free.extract(p);
      b->addr = p->addr;
      b->size += p->size;
      unlink(p);
      recycle(p);
    }
    if (block* n = b->next; n != nullptr && n->free) {
      n->parked = s->free.extract(n);
      b->size += n->size;
      unlink(n);
      recycle(n);
    }
    node.value() = b;
    s->free.insert(std::move(node));
    return b;
  }

  // ---- checking ------------------------------------------------------------------------------

  // O(blocks) self-check for tests: blocks tile each segment in order, sizes are multiples of
  // granule, no two free blocks touch, each free index holds exactly its segment's free blocks,
  // and the live map exactly the allocated ones.
  bool check_invariants(std::size_t granule) const noexcept {
    std::size_t live_blocks = 0;
    for (const auto& s : segments_) {
      std::uintptr_t at = s->base;
      std::size_t free_blocks = 0;
      const block* prev = nullptr;
      for (const block* b = s->first; b != nullptr; prev = b, b = b->next) {
        if (b->seg != s.get() || b->prev != prev || b->addr != at || b->size == 0) return false;
        if (b->size % granule != 0) return false;
        if (b->free) {
          if (prev != nullptr && prev->free) return false;
          if (s->free.find(b) == s->free.end()) return false;
          ++free_blocks;
        } else {
          if (find_live(b->ptr()) != b || b->parked.empty() || b->requested > b->size) return false;
          ++live_blocks;
        }
        at += b->size;
      }
      if (prev != s->last || at != s->base + s->size || free_blocks != s->free.size()) return false;
    }
    return live_blocks == live_.size();
  }

 private:
  // A block for a split or a new segment: a spare one (with its nodes) when there is one.
  block* take_spare() {
    if (spare_ == nullptr) return new block();
    block* b = spare_;
    spare_ = b->next;
    b->next = nullptr;
    return b;
  }
  // An unlinked block goes to the spare list; its parked nodes go with it.
  void recycle(block* b) noexcept {
    b->addr = 0;
    b->size = 0;
    b->free = true;
    b->requested = 0;
    b->alignment = 0;
    b->tag = memory_tag::other;
    b->seg = nullptr;
    b->prev = nullptr;
    b->next = spare_;
    spare_ = b;
  }
  // Puts a free block into its segment's index, reusing its parked node when it has one.
  static void insert_free(segment* s, block* b) {
    if (b->parked.empty()) {
      s->free.insert(b);
    } else {
      b->parked.value() = b;
      s->free.insert(std::move(b->parked));
    }
  }
  static void link_after(segment* s, block* after, block* b) noexcept {
    b->prev = after;
    b->next = after != nullptr ? after->next : s->first;
    if (b->next != nullptr) b->next->prev = b; else s->last = b;
    if (after != nullptr) after->next = b; else s->first = b;
  }
  static void unlink(block* b) noexcept {
    segment* s = b->seg;
    if (b->prev != nullptr) b->prev->next = b->next; else s->first = b->next;
    if (b->next != nullptr) b->next->prev = b->prev; else s->last = b->prev;
  }
  // Deletes a segment's blocks (the segment itself stays); live ones leave the live map.
  void delete_blocks(segment& s) noexcept {
    for (block* b = s.first; b != nullptr;) {
      block* n = b->next;
      if (!b->free) live_.erase(b->addr);
      delete b;
      b = n;
    }
    s.first = s.last = nullptr;
    s.free.clear();
  }
  void clear() noexcept {
    for (auto& s : segments_) delete_blocks(*s);
    segments_.clear();
    live_.clear();
    while (spare_ != nullptr) {
      block* n = spare_->next;
      delete spare_;
      spare_ = n;
    }
  }

  live_index live_;
  block* spare_ = nullptr;  // recycled blocks, linked through next
  std::vector<std::unique_ptr<segment>> segments_;  // oldest first
};

inline block_pool::size_key block_pool::by_size_then_addr::key(const block* b) noexcept {
  return {b->size, b->addr};
}

// The checks a sized deallocate runs before it changes anything: b is what find_live(p) found.
// Throws invalid_argument naming the first argument that differs from what allocate got.
inline void check_deallocate(const block_pool::block* b, const void* p, std::size_t bytes,
                             std::size_t alignment, memory_tag tag, const char* who) {
  if (b == nullptr) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%p", p);
    throw invalid_argument("p", std::string("a pointer returned by this ") + who +
                                    "'s allocate and not yet deallocated",
                           buf, "Pass the pointer exactly as allocate returned it, once");
  }
  if (bytes != b->requested) {
    throw invalid_argument("bytes", "the size passed to allocate, " + std::to_string(b->requested),
                           std::to_string(bytes), "Deallocate with the same size as allocate");
  }
  if (alignment != b->alignment) {
    throw invalid_argument("alignment",
                           "the alignment passed to allocate, " + std::to_string(b->alignment),
                           std::to_string(alignment),
                           "Deallocate with the same alignment as allocate");
  }
  if (tag != b->tag) {
    throw invalid_argument(
        "tag", "the tag passed to allocate, " + std::string(to_string(b->tag)),
        is_valid(tag) ? std::string(to_string(tag)) : std::to_string(static_cast<unsigned>(tag)),
        "Deallocate with the same tag as allocate");
  }
}

}  // namespace detail

MEMBOUND_NAMESPACE_END
