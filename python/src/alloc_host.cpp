// The framework allocator over host memory: the same service as the CUDA one (alloc_cuda.cpp),
// with system memory below the caching allocator and the others' bytes set by hand
// (membound_alloc_set_others), so that its budget, stream pools, pressure levels, refusals and
// threads are tested on a machine without a GPU (tests/python/test_framework_allocator.py).
#include <cstdint>
#include <optional>
#include <string>

#include "framework_allocator.hpp"
#include "membound/memory/system_allocator.hpp"

namespace {

// system_allocator has no device: the index only picks the stack.
struct host_upstream : membound::system_allocator {
  explicit host_upstream(int) {}
};
// Nothing measured: the others' bytes are what set_others said.
struct no_probe {
  template <typename Budget>
  std::optional<std::size_t> operator()(int, const Budget&) const {
    return std::nullopt;
  }
};

using service_type = membound_python::framework_allocator<host_upstream, no_probe>;

// Never destroyed: the framework may free from its own static destructors, after ours would run.
service_type& service() {
  static service_type& s = *new service_type;
  return s;
}
// A host "stream" is any integer: blocks are pooled per value, as on a device.
membound::stream_id stream_from(void* stream) { return reinterpret_cast<membound::stream_id>(stream); }

}  // namespace

#include "framework_allocator_hooks.inl"
