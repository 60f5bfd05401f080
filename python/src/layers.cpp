// membound._layers: the layers' forward, backward and decoding over the caller's host arrays
// (DLPack), for membound.ops, the torch custom ops. The calls are layer_calls.hpp's, the module
// layers_module.hpp's; this file gives them the host's thread pools.
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "layers_module.hpp"

namespace mp = membound_python;

namespace {

// ---- Thread pools, one per size, each used by one call at a time ---------------------------------

struct pool_slot {
  std::mutex busy;
  std::unique_ptr<mp::mb::thread_pool> pool;
};

pool_slot& pool_for(std::size_t threads) {
  static std::mutex table_lock;
  // Leaked on purpose: no destructor joins the workers at exit while another thread is in a call.
  static auto& table = *new std::map<std::size_t, std::unique_ptr<pool_slot>>;
  const std::lock_guard<std::mutex> guard(table_lock);
  std::unique_ptr<pool_slot>& slot = table[threads];
  if (!slot) {
    auto made = std::make_unique<pool_slot>();
    made->pool = std::make_unique<mp::mb::thread_pool>(threads);  // throws invalid_argument for 0
    slot = std::move(made);
  }
  return *slot;
}

// Runs f(pool) on the spec's pool, alone on it.
template <typename F>
void on_pool(const mp::spec& s, F&& f) {
  pool_slot& slot = pool_for(s.threads);
  const std::lock_guard<std::mutex> guard(slot.busy);
  f(*slot.pool);
}

using calls = mp::layer_calls<>;

struct host_calls {
  static void check(const mp::spec& s, const std::int32_t* offsets) { calls::check(s, offsets); }
  static std::tuple<std::size_t, std::size_t, std::size_t> sizes(const mp::spec& s) { return calls::sizes(s); }
  static std::tuple<std::size_t, std::size_t> decode_sizes(const mp::spec& s, std::size_t max_len) {
    return calls::decode_sizes(s, max_len);
  }
  static void forward(const mp::spec& s, const std::int32_t* offsets, const void* x, const std::vector<const void*>& w,
                      void* y, mp::bytes saved, mp::bytes ws) {
    on_pool(s, [&](auto& pool) { calls::forward(s, offsets, x, w, y, saved, ws, pool); });
  }
  static void backward(const mp::spec& s, const std::int32_t* offsets, const void* x, const std::vector<const void*>& w,
                       mp::bytes saved, const void* dy, void* dx, const std::vector<void*>& g, mp::bytes ws) {
    on_pool(s, [&](auto& pool) { calls::backward(s, offsets, x, w, saved, dy, dx, g, ws, pool); });
  }
  static void decode_reset(const mp::spec& s, const std::vector<const void*>& w, mp::bytes state, std::size_t max_len) {
    on_pool(s, [&](auto& pool) { calls::decode_reset(s, w, state, max_len, pool); });
  }
  static void decode_step(const mp::spec& s, const std::vector<const void*>& w, mp::bytes state, std::size_t position,
                          std::size_t max_len, const void* x_t, void* y_t, mp::bytes ws) {
    on_pool(s, [&](auto& pool) { calls::decode_step(s, w, state, position, max_len, x_t, y_t, ws, pool); });
  }
};

}  // namespace

NB_MODULE(_layers, m) {
  m.doc() = "membound's layers over caller-owned host arrays (use membound.ops)";
  mp::translate_errors();
  mp::bind_layers<host_calls, nanobind::device::cpu>(m, "host");
}
