// The CUDA layers for membound._layers_cuda (layer_calls_cuda.hpp): layer_calls.hpp with
// cuda_backend, on one cuda_executor per (device, stream). An executor borrows the stream and
// owns a cuBLASLt handle and its plans, so it is kept for the next call on that stream; calls on one
// stream take turns on its executor. Nothing waits for the device: the work is ordered on the
// framework's stream like its own kernels.
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <utility>
#include <vector>

#include "layer_calls_cuda.hpp"
#include "membound/backend/cuda.cuh"

namespace membound_python::cuda_calls {

namespace {

using calls = layer_calls<mb::cuda_backend>;

struct executor_slot {
  std::mutex busy;
  std::unique_ptr<mb::cuda_executor> ex;
};

// The executor of the spec's device and stream, made at its first call. PyTorch's default stream
// is the legacy default stream (spec.stream 0): borrowed as such, so that our kernels are ordered
// with PyTorch's on every thread (a per-thread stream would be ordered with it, but not with
// another thread's).
executor_slot& executor_for(const spec& s) {
  static std::mutex table_lock;
  // Leaked on purpose: the runtime may be torn down before static destructors run.
  static auto& table = *new std::map<std::pair<int, std::uintptr_t>, std::unique_ptr<executor_slot>>;
  const std::lock_guard<std::mutex> guard(table_lock);
  std::unique_ptr<executor_slot>& slot = table[{s.device, s.stream}];
  if (!slot) {
    auto made = std::make_unique<executor_slot>();
    if (s.stream == 0) {
      made->ex = std::make_unique<mb::cuda_executor>(mb::cuda_executor::legacy_default_stream_t{}, s.device);
    } else {
      made->ex = std::make_unique<mb::cuda_executor>(reinterpret_cast<cudaStream_t>(s.stream), s.device);
    }
    slot = std::move(made);
  }
  return *slot;
}

// Runs f(executor) on the spec's device and stream, alone on its executor.
template <typename F>
void on_stream(const spec& s, F&& f) {
  executor_slot& slot = executor_for(s);
  const std::lock_guard<std::mutex> guard(slot.busy);
  const mb::cuda_device_guard device(s.device);
  f(*slot.ex);
}

}  // namespace

void check(const spec& s, const std::int32_t* offsets) { calls::check(s, offsets); }

std::tuple<std::size_t, std::size_t, std::size_t> sizes(const spec& s) { return calls::sizes(s); }

std::tuple<std::size_t, std::size_t> decode_sizes(const spec& s, std::size_t max_len) {
  return calls::decode_sizes(s, max_len);
}

void forward(const spec& s, const std::int32_t* offsets, const void* x, const std::vector<const void*>& w, void* y,
             bytes saved, bytes ws) {
  on_stream(s, [&](auto& ex) { calls::forward(s, offsets, x, w, y, saved, ws, ex); });
}

void backward(const spec& s, const std::int32_t* offsets, const void* x, const std::vector<const void*>& w,
              bytes saved, const void* dy, void* dx, const std::vector<void*>& g, bytes ws) {
  on_stream(s, [&](auto& ex) { calls::backward(s, offsets, x, w, saved, dy, dx, g, ws, ex); });
}

void decode_reset(const spec& s, const std::vector<const void*>& w, bytes state, std::size_t max_len) {
  on_stream(s, [&](auto& ex) { calls::decode_reset(s, w, state, max_len, ex); });
}

void decode_step(const spec& s, const std::vector<const void*>& w, bytes state, std::size_t position,
                 std::size_t max_len, const void* x_t, void* y_t, bytes ws) {
  on_stream(s, [&](auto& ex) { calls::decode_step(s, w, state, position, max_len, x_t, y_t, ws, ex); });
}

}  // namespace membound_python::cuda_calls
