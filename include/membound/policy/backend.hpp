// Backend policy: where a layer's kernels run and what drives them. It is chosen like precision or
// chunking, in the same policy set, and changes nothing in the call shape: the size functions are
// the same and the last argument of forward/backward/step is the backend's executor.
//
//   membound::swiglu_mlp<bf16_precision>                 // cpu_backend: executor is thread_pool
//   membound::swiglu_mlp<bf16_precision, cuda_backend>   // executor is cuda_executor (a stream
//                                                        // and its cuBLASLt handle)
//
// cuda_backend is declared in membound/backend/cuda/cuda_backend.cuh: host headers name only the
// backend_kind and cpu_backend, so they never need a CUDA header. A layer finds the code of a
// backend through backend_kernels<Backend, Shape>, which backend/cpu/*.hpp and backend/cuda/*.cuh
// specialize (docs/architecture.md).
#pragma once

#include <concepts>

#include "membound/core/config.hpp"
#include "membound/core/parallel.hpp"
#include "membound/core/memory_tag.hpp"
#include "membound/policy/policy_kind.hpp"

MEMBOUND_NAMESPACE_BEGIN

MEMBOUND_POLICY_KIND(backend_kind, "backend");

// A backend names its executor (what the caller passes to run kernels), the memory space its
// buffers live in (every pointer given to a layer with this backend is in that space) and a name
// for messages and plan tables.
template <typename B>
concept backend_policy = policy<B> && std::same_as<typename B::policy_kind, backend_kind> &&
                         requires {
                           typename B::executor;
                           { B::space } -> std::convertible_to<memory_space>;
                           { B::name } -> std::convertible_to<const char*>;
                         };

// The host backend: Eigen over the caller's buffers, parallel over a thread_pool.
struct cpu_backend {
  using policy_kind = backend_kind;
  using executor = thread_pool;
  static constexpr memory_space space = memory_space::host;
  static constexpr const char* name = "cpu";
};
static_assert(backend_policy<cpu_backend>);

template <typename B>
inline constexpr bool is_cpu_backend_v = std::same_as<B, cpu_backend>;

// The key of the model's own ops on a backend (RMSNorm, the residual add, the embedding's gather
// and scatter, the trainer's moves): backend_kernels<Backend, model_glue>. Declared here so that
// the backends, which never see model/, can specialize it (backend/cpu/model.hpp,
// backend/cuda/model.cuh).
struct model_glue;

// The code of `Layer` on `Backend`. Only declared here: backend/cpu/*.hpp and backend/cuda/*.cuh
// define the specializations, so a host-only translation unit that names cuda_backend gets the
// sentence below instead of an incomplete-type error deep inside a layer.
template <typename Backend, typename Layer>
struct backend_kernels {
  static_assert(dependent_false<Backend, Layer>,
                "membound: this layer has no kernels for the chosen backend in this translation "
                "unit. For cuda_backend, include \"membound/backend/cuda.cuh\" and compile the file "
                "with nvcc; for the host, use cpu_backend (the default).");
};

MEMBOUND_NAMESPACE_END
