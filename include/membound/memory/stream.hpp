// Streams and events as the memory core sees them: opaque integers, so that caching_allocator
// can be stream-ordered (like PyTorch's CUDA caching allocator) without including a CUDA header.
// A CUDA upstream passes reinterpret_cast<stream_id>(cudaStream_t); host upstreams use
// host_stream only.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "membound/core/config.hpp"
#include "membound/core/error.hpp"
#include "membound/core/memory_tag.hpp"
#include "membound/memory/allocator.hpp"

MEMBOUND_NAMESPACE_BEGIN

// A stream as the allocators see it: a cudaStream_t cast to an integer, or host_stream.
using stream_id = std::uintptr_t;
// A point in a stream that an upstream can query (a cudaEvent_t cast to an integer).
using event_id = std::uintptr_t;

// The default (legacy) stream of a device, and the only stream of host memory.
inline constexpr stream_id host_stream = 0;

// An upstream whose memory is used by asynchronous streams, and which can mark points in them:
//   event_id create_event();                       a fresh (or recycled) event
//   void record_event(event_id, stream_id);        completes once the stream's prior work has
//   bool event_done(event_id);                     non-blocking query
//   void destroy_event(event_id);                  gives the event back (may recycle it)
// caching_allocator uses it to defer reuse of a block freed while other streams still use it
// (record_stream). Upstreams without it (host memory) have nothing to wait for.
template <typename U>
concept stream_event_source = requires(U& u, event_id e, stream_id s) {
  { u.create_event() } -> std::same_as<event_id>;
  u.record_event(e, s);
  { u.event_done(e) } -> std::convertible_to<bool>;
  u.destroy_event(e);
};

// An allocator that serves requests per stream (caching_allocator, and the wrappers above it):
//   void* allocate(bytes, alignment, tag, stream);  growth_for(bytes, alignment, stream);
//   record_stream(p, stream).
template <typename A>
concept stream_ordered_allocator =
    requires(A& a, void* p, std::size_t n, memory_tag t, stream_id s) {
      { a.allocate(n, n, t, s) } -> std::same_as<void*>;
      { a.growth_for(n, n, s) } -> std::convertible_to<std::size_t>;
      a.record_stream(p, s);
    };

namespace detail {

// The wrappers (budget, traced, synchronized, fault injection) take a stream whatever their
// upstream is, so one stack type reads the same on host and device; a stream other than
// host_stream over an upstream without streams would silently lose the ordering, so it is refused.
inline void check_host_stream(stream_id stream, const char* who) {
  if (stream == host_stream) return;
  throw invalid_argument(
      "stream", std::string("host_stream (0): the allocator under ") + who + " has no streams",
      std::to_string(stream),
      "Put a stream-ordered allocator (caching_allocator<cuda_device_allocator>) under it, or "
      "allocate without a stream");
}

template <typename U>
void* allocate_on(U& u, std::size_t bytes, std::size_t alignment, memory_tag tag, stream_id stream,
                  const char* who) {
  if constexpr (stream_ordered_allocator<U>) {
    return u.allocate(bytes, alignment, tag, stream);
  } else {
    check_host_stream(stream, who);
    return u.allocate(bytes, alignment, tag);
  }
}

// U may be const: a const upstream's growth_for does not poll events (see caching_allocator).
template <typename U>
std::size_t growth_on(U& u, std::size_t bytes, std::size_t alignment, stream_id stream,
                      const char* who) {
  if constexpr (requires { u.growth_for(bytes, alignment, stream); }) {
    return u.growth_for(bytes, alignment, stream);
  } else {
    check_host_stream(stream, who);
    return u.growth_for(bytes, alignment);
  }
}

}  // namespace detail

// The stream an executor's work is ordered on: a device executor's stream() (a cudaStream_t,
// reinterpret_cast as cuda_device_allocator::to_stream_id does), host_stream for the host.
template <typename Executor>
stream_id stream_of(const Executor& ex) noexcept {
  if constexpr (requires { ex.stream(); }) {
    return reinterpret_cast<stream_id>(ex.stream());
  } else {
    return host_stream;
  }
}

// An allocator as the work of one stream sees it: allocate(bytes, alignment, tag) is served on
// that stream. Blocks then belong to the stream that uses them, so a block freed while kernels
// on the stream may still read it is reused only by later work of the same stream (ordered after
// them), never handed to another stream early; work on other streams goes through
// record_stream. membound's model and trainer allocate through one, bound to their executor's
// stream; a caller's own buffers for a layer should too (examples/01_cuda_layer.cu):
//   stream_view mem(alloc, stream_of(ex));   void* x = mem.allocate(bytes);
// Over an allocator without streams (system_allocator, an arena, plain cudaMalloc/cudaFree whose
// free synchronizes) there is nothing to order: the view serves host_stream, as before.
// It refers to `a`, which must outlive it.
template <typename A>
class stream_view {
 public:
  // Host or device: the allocator's memory.
  static constexpr memory_space space = A::space;
  // Whether A serves requests per stream; if not, the view serves host_stream.
  static constexpr bool ordered = stream_ordered_allocator<A>;

  // A view of `a` serving `stream` (host_stream when `a` has no streams).
  stream_view(A& a, stream_id stream) noexcept : a_(&a), stream_(ordered ? stream : host_stream) {}

  // A block used by the view's stream; reused only by that stream's later work once freed.
  void* allocate(std::size_t bytes, std::size_t alignment = default_alignment,
                 memory_tag tag = memory_tag::other) {
    if constexpr (ordered) {
      return a_->allocate(bytes, alignment, tag, stream_);
    } else {
      return a_->allocate(bytes, alignment, tag);
    }
  }
  // Gives the block back: the same bytes, alignment and tag as allocate.
  // As noexcept as A's: a caching allocator's refusal of a wrong free still reaches the caller.
  void deallocate(void* p, std::size_t bytes, std::size_t alignment = default_alignment,
                  memory_tag tag = memory_tag::other) noexcept(noexcept(std::declval<A&>().deallocate(p, bytes,
                                                                                                    alignment, tag))) {
    a_->deallocate(p, bytes, alignment, tag);
  }
  // Bytes the next allocate would grow the allocator's reserve by, on the view's stream.
  std::size_t growth_for(std::size_t bytes, std::size_t alignment) const
    requires requires(A& a) { a.growth_for(bytes, alignment); }
  {
    if constexpr (ordered) {
      return a_->growth_for(bytes, alignment, stream_);
    } else {
      return a_->growth_for(bytes, alignment);
    }
  }
  // The allocator's statistics (all streams together).
  memory_stats stats() const noexcept { return a_->stats(); }
  // The stream requests are served on (host_stream over an allocator without streams).
  stream_id stream() const noexcept { return stream_; }
  // The allocator the view serves from.
  A& upstream() const noexcept { return *a_; }

 private:
  A* a_;
  stream_id stream_;
};

MEMBOUND_NAMESPACE_END
