// The C hooks over one framework_allocator. The including file defines, before including this:
//   service_type                 its framework_allocator<...>
//   service()                    the instance (never destroyed)
//   stream_from(void* stream)    the stream_id of a framework's stream handle
// The names are the same in every variant (host, cuda): each is a shared library of its own.
#include <stdexcept>
#include <string>

#define MEMBOUND_HOOK extern "C" __attribute__((visibility("default")))

// 0, or 1 with last_error saying which argument was wrong.
MEMBOUND_HOOK int membound_alloc_configure(std::uint64_t budget, double warning, double critical, double emergency) {
  try {
    service().configure(budget, membound::pressure_thresholds{warning, critical, emergency});
    return 0;
  } catch (const std::exception& e) {
    service().note_error(e.what());
    return 1;
  }
}
MEMBOUND_HOOK void membound_alloc_set_callback(membound_python::pressure_callback cb) { service().set_callback(cb); }
// PyTorch's CUDAPluggableAllocator signatures: malloc(size, device, stream), free(ptr, size, device, stream).
// PyTorch wraps whatever malloc returns without checking for nullptr, and takes a C++ exception
// from it as the error (it reaches Python as a RuntimeError with this message): so a refusal
// throws membound's report here. Only for PyTorch: an exception must not reach ctypes.
MEMBOUND_HOOK void* membound_alloc_malloc(std::size_t size, int device, void* stream) {
  void* p = service().allocate(size, device, stream_from(stream));
  if (p == nullptr && size != 0) {
    const std::string& refusal = service_type::thread_refusal();
    throw std::runtime_error(refusal.empty() ? "membound: allocation failed: " + service().last_error() : refusal);
  }
  return p;
}
// The same request for callers that check the result (ctypes, C): nullptr when refused.
MEMBOUND_HOOK void* membound_alloc_try_malloc(std::size_t size, int device, void* stream) {
  return service().allocate(size, device, stream_from(stream));
}
MEMBOUND_HOOK void membound_alloc_free(void* p, std::size_t size, int device, void* /*stream*/) {
  service().deallocate(p, size, device);
}
MEMBOUND_HOOK int membound_alloc_record_stream(void* p, int device, void* stream) {
  return service().record_stream(p, device, stream_from(stream)) ? 0 : 1;
}
MEMBOUND_HOOK void membound_alloc_empty_cache() { service().empty_cache(); }
// Fills out[membound_python::stat_count]; 1 for a device never used.
MEMBOUND_HOOK int membound_alloc_stats(int device, std::uint64_t* out) { return service().stats(device, out) ? 0 : 1; }
MEMBOUND_HOOK int membound_alloc_stat_count() { return membound_python::stat_count; }
MEMBOUND_HOOK void membound_alloc_set_others(int device, std::uint64_t bytes) { service().set_others(device, bytes); }
// The last refusal's out-of-memory report and the last other error, valid until the next call
// from the same thread.
MEMBOUND_HOOK const char* membound_alloc_last_refusal() {
  thread_local std::string s;
  s = service().last_refusal();
  return s.c_str();
}
MEMBOUND_HOOK const char* membound_alloc_last_error() {
  thread_local std::string s;
  s = service().last_error();
  return s.c_str();
}

MEMBOUND_HOOK void membound_alloc_record_history(std::uint64_t max_entries) {
  service().record_history(static_cast<std::size_t>(max_entries));
}
// The snapshot as JSON (torch.cuda.memory._snapshot()'s layout), valid until the next call from the
// same thread.
MEMBOUND_HOOK const char* membound_alloc_snapshot() {
  thread_local std::string s;
  try {
    s = service().snapshot_json();
  } catch (const std::exception& e) {
    service().note_error(e.what());
    s.clear();
  }
  return s.c_str();
}

#undef MEMBOUND_HOOK
