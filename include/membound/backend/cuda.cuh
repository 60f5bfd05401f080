// membound with its CUDA backend: the host umbrella plus every backend/cuda header.
// Needs the CUDA toolkit headers, CUDA::cudart and CUDA::cublasLt; no driver library is linked
// (see cuda_check.cuh).
#pragma once

#include "membound/membound.hpp"

#include "membound/backend/cuda/cuda_check.cuh"
#include "membound/backend/cuda/interop.cuh"
#include "membound/backend/cuda/cuda_backend.cuh"
#include "membound/backend/cuda/cuda_allocator.cuh"
#include "membound/backend/cuda/cuda_virtual_memory.cuh"
#include "membound/backend/cuda/cuda_pinned_allocator.cuh"
#include "membound/backend/cuda/cuda_memory_info.cuh"
#include "membound/backend/cuda/gemm.cuh"
#include "membound/backend/cuda/model.cuh"
#include "membound/backend/cuda/mlp.cuh"
#include "membound/backend/cuda/moe.cuh"
#include "membound/backend/cuda/lm_head.cuh"
#include "membound/backend/cuda/attention.cuh"
#include "membound/backend/cuda/mamba.cuh"
#include "membound/backend/cuda/ttt.cuh"
