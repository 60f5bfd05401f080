// The model's own ops (RMSNorm, the residual add, the embedding's gather and scatter) on the
// backend its layers run on. block and model call them through model_glue_of<Backend>, so one
// schedule, one allocation order and one plan serve both backends:
//   cpu_backend   backend_kernels<cpu_backend, model_glue> (backend/cpu/model.hpp, over a
//                 thread_pool);
//   cuda_backend  backend_kernels<cuda_backend, model_glue> (backend/cuda/model.cuh, over
//                 a cuda_executor: every pointer is device memory, nothing synchronizes).
// Every function takes the accumulation type A first; the norm's backward scratch is sized by
// norm_backward_scratch_bytes<A, S>(N, C), the exact bytes of that backend's row-block partials.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "membound/backend/cpu/model.hpp"
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/core/parallel.hpp"
#include "membound/policy/backend.hpp"

MEMBOUND_NAMESPACE_BEGIN

// Naming backend_kernels<B, model_glue> does not instantiate it: a host-only translation unit
// that uses a CUDA model gets backend_kernels' sentence only when it calls into it.
template <typename Backend>
using model_glue_of = backend_kernels<Backend, model_glue>;

MEMBOUND_NAMESPACE_END
