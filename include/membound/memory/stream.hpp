// Streams and events as the memory core sees them: opaque integers, so that caching_allocator
// can be stream-ordered (like PyTorch's CUDA caching allocator) without including a CUDA header.
// A CUDA upstream passes reinterpret_cast<stream_id>(cudaStream_t); host upstreams use
// host_stream only.
#pragma once

#include <concepts>
#include <cstdint>

#include "membound/core/config.hpp"

MEMBOUND_NAMESPACE_BEGIN

using stream_id = std::uintptr_t;
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

MEMBOUND_NAMESPACE_END
