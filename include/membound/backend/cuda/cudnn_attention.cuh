// cuDNN's fused flash attention (SDPA forward with its row statistics, and its backward) as
// attention's GPU path, through the header-only cudnn_frontend graph API. Compiled only into a
// program built with MEMBOUND_WITH_CUDNN (CMake's membound::cudnn target defines it and finds the
// frontend's headers, from PyPI's nvidia-cudnn-frontend; tools/deps.sh installs it). Without it
// this header is empty and attention runs its own kernels.
//
// libcudnn is opened with dlopen on first use (libcudnn.so.9, or MEMBOUND_CUDNN_LIBRARY), never
// linked: one binary runs where cuDNN is absent (our kernels run, and the report says why) or
// lives elsewhere (PyTorch's wheel: put its nvidia/cudnn/lib on LD_LIBRARY_PATH; libcudnn opens
// its engine libraries by name, so their folder must be on the path even when
// MEMBOUND_CUDNN_LIBRARY names the file). Every unit of a program must agree on
// MEMBOUND_WITH_CUDNN: the executor's default choice and attention's launchers depend on it.
//
// The plan does not change with it: cuDNN reads and writes 16-bit tensors and its workspace, and
// attention.cuh carves all of them from slots its layouts already hold (the fp32 q/k/v/dO and
// dq/dk/dv slots, each large enough for two 16-bit copies). A cuDNN execution plan whose workspace
// exceeds the bytes that leaves is deselected; when none remains, or cuDNN cannot run the shape
// (packed sequences, a window, fp32 storage, save_all's fp32 q/k/v in the forward), our kernels
// run instead, and cudnn_attention_report() counts it with the reason. So the measured peak stays
// the predicted one whichever path runs.
//
// Determinism: cuDNN's default backward accumulates dQ with atomics, so repeats differ in the last
// bits. kernel_choices::cudnn_deterministic (the default) asks for its deterministic backward,
// which on Hopper takes a dP workspace of about B·H·T²·2 bytes (cudnn_frontend 1.32): where that
// does not fit the backward's free slots, ours runs. Set it to false to take cuDNN's faster
// backward and give up bit-identical repeats.
//
// State: one cuDNN handle per device and one built graph per (shape, direction, storage type),
// process-wide, behind one mutex (a cuDNN handle is not safe to use from two threads at once);
// graphs and handles live until the process exits. NEVER RAN ON A GPU as of 2026-11-30: it compiles
// here (CI) and its calls follow cudnn_frontend 1.32's headers; the first GPU session's
// test_cuda_attention cases check it against the CPU backend.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "membound/core/config.hpp"

MEMBOUND_NAMESPACE_BEGIN
namespace gpu {

// What the cuDNN path did in this process (all zero without MEMBOUND_WITH_CUDNN).
struct cudnn_attention_counts {
  bool compiled = false;     // the program was built with MEMBOUND_WITH_CUDNN
  bool loaded = false;       // libcudnn opened
  long version = 0;          // cudnnGetVersion() of the library that ran, e.g. 91900
  std::string library;       // the name dlopen took, or why it failed
  std::uint64_t forward_calls = 0, backward_calls = 0;  // attention calls cuDNN ran
  std::uint64_t fallbacks = 0;                          // calls that asked for it and ran ours
  std::string last_fallback;                            // why the last one did
};

}  // namespace gpu
MEMBOUND_NAMESPACE_END

#if MEMBOUND_CUDA_COMPILER && defined(MEMBOUND_WITH_CUDNN)

#include <dlfcn.h>

#include <cmath>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <vector>

// Dynamic loading (no link against libcudnn), and no JSON serialisation (which would bring the
// frontend's own copy of nlohmann/json into every unit); <cstring>: the frontend uses std::strlen
// without including it in that configuration.
#ifndef NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING
#define NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING
#endif
#ifndef CUDNN_FRONTEND_SKIP_JSON_LIB
#define CUDNN_FRONTEND_SKIP_JSON_LIB
#endif
#include <cstring>
#include <cudnn_frontend.h>

#include "membound/backend/cuda/cuda_backend.cuh"
#include "membound/backend/cuda/cuda_check.cuh"
#include "membound/core/dtype.hpp"
#include "membound/core/error.hpp"
#include "membound/shape/attention_shape.hpp"

// The frontend's dynamic loading declares this handle extern and leaves its definition to the
// program; an inline definition keeps membound header-only (one object across translation units).
namespace cudnn_frontend {
inline void* cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

MEMBOUND_NAMESPACE_BEGIN
namespace gpu {
namespace cudnn_detail {

namespace fe = cudnn_frontend;

// One graph's identity: everything its tensors' shapes and options depend on.
struct sdpa_key {
  int device = 0;
  bool bf16 = true, backward = false, deterministic = true, causal = true;
  std::int64_t batch = 0, seq = 0, heads = 0, kv_heads = 0, head_dim = 0;
  std::int64_t workspace_cap = 0;  // deselects plans that want more
  auto tie() const {
    return std::tie(device, bf16, backward, deterministic, causal, batch, seq, heads, kv_heads,
                    head_dim, workspace_cap);
  }
  bool operator<(const sdpa_key& o) const { return tie() < o.tie(); }
};

struct sdpa_graph {
  std::shared_ptr<fe::graph::Graph> graph;  // null: cuDNN cannot run it (failure says why)
  std::int64_t workspace = 0;
  std::string failure;
};

// The tensors' uids in a graph's variant pack.
enum sdpa_uid : std::int64_t { u_q = 1, u_k, u_v, u_o, u_stats, u_do, u_dq, u_dk, u_dv };

struct sdpa_state {
  std::mutex m;
  bool tried = false;
  cudnn_attention_counts counts;
  std::map<int, cudnnHandle_t> handles;  // null: cudnnCreate failed there (handle_failure)
  std::string handle_failure;
  std::map<sdpa_key, std::shared_ptr<sdpa_graph>> graphs;
};
// Never destroyed: at exit libcudnn's own statics may be gone before ours, and destroying a graph
// calls into it (the frontend leaks its statics for the same reason).
inline sdpa_state& state() {
  static sdpa_state& s = *new sdpa_state;
  return s;
}

// Opens libcudnn once (the caller holds the mutex). False, with the reason in counts.library,
// when it is not there.
inline bool load_library(sdpa_state& st) {
  if (st.tried) return st.counts.loaded;
  st.tried = true;
  st.counts.compiled = true;
  const char* env = std::getenv("MEMBOUND_CUDNN_LIBRARY");
  const std::string name = env != nullptr && *env != '\0' ? env : "libcudnn.so.9";
  (void)dlerror();
  void* handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    st.counts.library = "dlopen(" + name + ") failed: " + (why != nullptr ? why : "unknown error") +
                        " (set MEMBOUND_CUDNN_LIBRARY to libcudnn.so.9's path, or add its folder "
                        "to LD_LIBRARY_PATH)";
    return false;
  }
  fe::cudnn_dlhandle = handle;
  // The frontend opens a CUDA runtime of its own (libcudart.so.12 before .13, the first found):
  // point it at the one this program runs on, where that is a shared library, by the variable it
  // reads, set only while it opens the runtime (here, once) so that child processes do not inherit it.
  Dl_info rt{};
  if (std::getenv("CUDNN_FRONTEND_CUDART_LIB_NAME") == nullptr &&
      dladdr(reinterpret_cast<void*>(&cudaGetDevice), &rt) != 0 && rt.dli_fname != nullptr &&
      std::string(rt.dli_fname).find("libcudart") != std::string::npos) {
    setenv("CUDNN_FRONTEND_CUDART_LIB_NAME", rt.dli_fname, 0);
    try {
      (void)fe::detail::loaded_cudart_version();
    } catch (const std::exception&) {  // it says so again, with the reason, at its first use
    }
    unsetenv("CUDNN_FRONTEND_CUDART_LIB_NAME");
  }
  try {
    st.counts.version = static_cast<long>(fe::detail::get_backend_version());
  } catch (const std::exception& e) {
    st.counts.library = name + " opened but cudnnGetVersion failed: " + e.what();
    return false;
  }
  st.counts.library = name;
  st.counts.loaded = true;
  return true;
}

// The device's handle, or null when cuDNN cannot make one there (a library too old for the driver,
// say): then our kernels run, and `why` says so. A failure is kept: no retry per call.
inline cudnnHandle_t handle_for(sdpa_state& st, int device, std::string& why) {
  auto it = st.handles.find(device);
  if (it == st.handles.end()) {
    const cuda_device_guard guard(device);
    cudnnHandle_t h = nullptr;
    const cudnnStatus_t status = fe::detail::create_handle(&h);
    it = st.handles.emplace(device, status == CUDNN_STATUS_SUCCESS ? h : nullptr).first;
    if (status != CUDNN_STATUS_SUCCESS) {
      st.handle_failure = "cudnnCreate on device " + std::to_string(device) + " failed with status " +
                          std::to_string(static_cast<int>(status));
    }
  }
  if (it->second == nullptr) why = st.handle_failure;
  return it->second;
}

inline std::shared_ptr<fe::graph::Tensor_attributes> tensor(fe::graph::Graph& g, const char* name,
                                                            std::int64_t uid,
                                                            std::vector<std::int64_t> dim,
                                                            std::vector<std::int64_t> stride,
                                                            bool fp32 = false) {
  auto a = fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(std::move(dim)).set_stride(
      std::move(stride));
  if (fp32) a.set_data_type(fe::DataType_t::FLOAT);
  return g.tensor(a);
}

// Builds the graph of `k` on `h` (the caller holds the mutex). Layouts: q, o, dO, dq are the
// layer's [B·T, H·D] rows (BSHD), k, v, dk, dv [B·T, Hkv·D]; the statistics are lse [B, H, T] in
// fp32, the log-sum-exp of the scaled scores, which our kernels write and read too.
inline std::shared_ptr<sdpa_graph> build(const sdpa_key& k, cudnnHandle_t h) {
  auto out = std::make_shared<sdpa_graph>();
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(k.bf16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const std::int64_t B = k.batch, T = k.seq, H = k.heads, Hk = k.kv_heads, D = k.head_dim;
  const std::vector<std::int64_t> qd{B, H, T, D}, qs{T * H * D, D, H * D, 1};
  const std::vector<std::int64_t> kd{B, Hk, T, D}, ks{T * Hk * D, D, Hk * D, 1};
  const std::vector<std::int64_t> sd{B, H, T, 1}, ss{H * T, T, 1, 1};
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  auto q = tensor(*g, "q", u_q, qd, qs), kk = tensor(*g, "k", u_k, kd, ks), v = tensor(*g, "v", u_v, kd, ks);
  if (!k.backward) {
    auto opt = fe::graph::SDPA_attributes().set_name("membound_sdpa").set_generate_stats(true).set_attn_scale(
        scale);
    if (k.causal) opt.set_causal_mask(true);
    auto [o, stats] = g->sdpa(q, kk, v, opt);
    o->set_output(true).set_dim(qd).set_stride(qs).set_uid(u_o);
    stats->set_output(true).set_data_type(fe::DataType_t::FLOAT).set_dim(sd).set_stride(ss).set_uid(u_stats);
  } else {
    auto o = tensor(*g, "o", u_o, qd, qs), d_o = tensor(*g, "dO", u_do, qd, qs);
    auto stats = tensor(*g, "stats", u_stats, sd, ss, true);
    auto opt = fe::graph::SDPA_backward_attributes()
                   .set_name("membound_sdpa_backward")
                   .set_attn_scale(scale)
                   .set_deterministic_algorithm(k.deterministic);
    if (k.causal) opt.set_causal_mask(true);
    auto [dq, dk, dv] = g->sdpa_backward(q, kk, v, o, d_o, stats, opt);
    dq->set_output(true).set_dim(qd).set_stride(qs).set_uid(u_dq);
    dk->set_output(true).set_dim(kd).set_stride(ks).set_uid(u_dk);
    dv->set_output(true).set_dim(kd).set_stride(ks).set_uid(u_dv);
  }
  const auto failed = [&](fe::error_t e, const char* step) {
    if (e.is_good()) return false;
    out->failure = std::string("cudnn_frontend ") + step + ": " + e.get_message();
    return true;
  };
  if (failed(g->validate(), "validate") || failed(g->build_operation_graph(h), "build_operation_graph") ||
      failed(g->create_execution_plans({fe::HeurMode_t::A}), "create_execution_plans")) {
    return out;
  }
  // This deselects on the engines' own workspace; the frontend adds its own (dQ's fp32
  // accumulator, a row vector) on top, which its public API does not give apart: the total is
  // checked below, and over the cap our kernels run (a smaller engine might have fit: not tried).
  g->deselect_workspace_greater_than(k.workspace_cap);
  if (failed(g->check_support(), "check_support (within the plan's workspace)") ||
      failed(g->build_plans(), "build_plans")) {
    return out;
  }
  std::int64_t bytes = 0;
  if (failed(g->get_workspace_size(bytes), "get_workspace_size")) return out;
  if (bytes > k.workspace_cap) {
    out->failure = "cuDNN's plan wants " + std::to_string(bytes) + " bytes of workspace, the plan's slots give " +
                   std::to_string(k.workspace_cap);
    return out;
  }
  out->graph = std::move(g);
  out->workspace = bytes;
  return out;
}

// Why cuDNN cannot run this call at all, or nullptr.
template <typename S>
const char* unsupported(const cuda_executor& ex, const attention_shape& s, const attention_band& band) {
  if (ex.kernels().attention != attention_kernels::cudnn) return "the executor asks for other kernels";
  if (band.packing.packed()) return "packed sequences";
  if (s.window != 0) return "a sliding window";
  if (s.head_dim % 8 != 0 || s.head_dim > 128) return "head_dim not a multiple of 8 up to 128";
  return nullptr;
}

// A built graph for `key`, or null with the fallback counted. Takes the mutex.
inline std::shared_ptr<sdpa_graph> graph_for(const cuda_executor& ex, const sdpa_key& key,
                                             cudnnHandle_t* handle) {
  sdpa_state& st = state();
  const std::lock_guard<std::mutex> lock(st.m);
  if (!load_library(st)) {
    ++st.counts.fallbacks;
    st.counts.last_fallback = st.counts.library;
    return nullptr;
  }
  std::string why;
  *handle = handle_for(st, ex.device(), why);
  if (*handle == nullptr) {
    ++st.counts.fallbacks;
    st.counts.last_fallback = why;
    return nullptr;
  }
  auto& g = st.graphs[key];
  if (!g) {
    const cuda_device_guard guard(ex.device());
    try {
      g = build(key, *handle);
    } catch (const std::exception& e) {  // the frontend throws where a symbol is missing, say
      g = std::make_shared<sdpa_graph>();
      g->failure = std::string("cudnn_frontend threw: ") + e.what();
    }
  }
  if (!g->graph) {
    ++st.counts.fallbacks;
    st.counts.last_fallback = g->failure;
    return nullptr;
  }
  return g;
}

// A call that asked for cuDNN (the executor's choice) and runs our kernels: counted, with why.
inline void note_fallback(const cuda_executor& ex, const char* why) {
  if (ex.kernels().attention != attention_kernels::cudnn) return;
  sdpa_state& st = state();
  const std::lock_guard<std::mutex> lock(st.m);
  ++st.counts.fallbacks;
  st.counts.last_fallback = why;
}

inline void execute(const cuda_executor& ex, const sdpa_graph& g, cudnnHandle_t h,
                    std::unordered_map<std::int64_t, void*>& pack, void* workspace, bool backward) {
  sdpa_state& st = state();
  const std::lock_guard<std::mutex> lock(st.m);
  const cuda_device_guard guard(ex.device());
  const cudnnStatus_t status = fe::detail::set_stream(h, ex.stream());
  if (status != CUDNN_STATUS_SUCCESS) {
    throw backend_error("cudnnSetStream", static_cast<int>(status), "could not bind the executor's stream");
  }
  fe::error_t e = g.graph->execute(h, pack, workspace);
  if (e.is_bad()) {
    throw backend_error(backward ? "cudnn sdpa_backward execute" : "cudnn sdpa execute",
                        static_cast<int>(e.get_code()), e.get_message());
  }
  ++(backward ? st.counts.backward_calls : st.counts.forward_calls);
}

}  // namespace cudnn_detail

inline cudnn_attention_counts cudnn_attention_report() {
  auto& st = cudnn_detail::state();
  const std::lock_guard<std::mutex> lock(st.m);
  cudnn_attention_counts c = st.counts;
  c.compiled = true;
  return c;
}

// The forward's plan, when cuDNN can run (s, band) within `workspace_cap` bytes; null otherwise
// (counted, with the reason). Nothing is written: the caller still holds its fp32 q, k, v.
template <typename S>
std::shared_ptr<cudnn_detail::sdpa_graph> cudnn_sdpa_plan(const cuda_executor& ex, const attention_shape& s,
                                                          const attention_band& band, bool backward,
                                                          std::size_t workspace_cap, cudnnHandle_t* handle) {
  static_assert(!std::is_same_v<S, float>, "membound: cuDNN's flash attention takes bf16/fp16 storage");
  if (const char* why = cudnn_detail::unsupported<S>(ex, s, band)) {
    cudnn_detail::note_fallback(ex, why);
    return nullptr;
  }
  cudnn_detail::sdpa_key key;
  key.device = ex.device();
  key.bf16 = std::is_same_v<S, bf16>;
  key.backward = backward;
  key.deterministic = ex.kernels().cudnn_deterministic;
  key.causal = s.causal;
  key.batch = static_cast<std::int64_t>(s.batch);
  key.seq = static_cast<std::int64_t>(s.seq);
  key.heads = static_cast<std::int64_t>(s.heads);
  key.kv_heads = static_cast<std::int64_t>(s.kv_heads);
  key.head_dim = static_cast<std::int64_t>(s.head_dim);
  key.workspace_cap = static_cast<std::int64_t>(workspace_cap);
  return cudnn_detail::graph_for(ex, key, handle);
}

}  // namespace gpu
MEMBOUND_NAMESPACE_END

#else  // without cuDNN: the report says so

MEMBOUND_NAMESPACE_BEGIN
namespace gpu {
inline cudnn_attention_counts cudnn_attention_report() { return {}; }
}  // namespace gpu
MEMBOUND_NAMESPACE_END

#endif
