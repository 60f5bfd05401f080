// membound: everything on the host side in one include. Host-only, so plain g++/clang++ can
// compile it; the CUDA backend is membound/backend/cuda.cuh (which includes this file too).
// tools/check_headers.py fails the tests when a host header is not reachable from here.
#pragma once

#include "membound/core/config.hpp"
#include "membound/core/error.hpp"
#include "membound/core/format.hpp"
#include "membound/core/type_list.hpp"
#include "membound/core/dtype.hpp"
#include "membound/core/parallel.hpp"

#include "membound/memory/memory_tag.hpp"
#include "membound/memory/memory_stats.hpp"
#include "membound/memory/allocator.hpp"
#include "membound/memory/system_allocator.hpp"
#include "membound/memory/caching_allocator.hpp"
#include "membound/memory/virtual_memory.hpp"
#include "membound/memory/host_virtual_memory.hpp"
#include "membound/memory/expandable_arena.hpp"
#include "membound/memory/budget.hpp"
#include "membound/memory/fault_injection.hpp"
#include "membound/memory/trace.hpp"
#include "membound/memory/workspace.hpp"
#include "membound/memory/synchronized.hpp"

#include "membound/monitor/check_point.hpp"
#include "membound/monitor/null_monitor.hpp"
#include "membound/monitor/pressure_level.hpp"
#include "membound/monitor/pressure_monitor.hpp"

#include "membound/policy/policy_kind.hpp"
#include "membound/policy/precision.hpp"
#include "membound/policy/chunking.hpp"
#include "membound/policy/checkpoint.hpp"
#include "membound/policy/policy_set.hpp"

#include "membound/layers/attention_shape.hpp"
#include "membound/backend/cpu/attention_cpu.hpp"
#include "membound/layers/attention.hpp"
#include "membound/layers/mamba_shape.hpp"
#include "membound/backend/cpu/linalg.hpp"
#include "membound/backend/cpu/mamba_cpu.hpp"
#include "membound/layers/mamba.hpp"
#include "membound/backend/cpu/ttt_cpu.hpp"
#include "membound/layers/ttt.hpp"
#include "membound/layers/layer_support.hpp"
