// What the device itself says about its memory (cudaMemGetInfo), and the bridge from it to a
// budget's external bytes: memory on the device that membound does not hold (the CUDA context,
// cuBLAS workspaces, another library's or another process's allocations) still fills the device,
// so the budget, and the pressure monitor that reads budget.usage(), must count it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "membound/backend/cuda/cuda_check.cuh"
#include "membound/core/config.hpp"
#include "membound/memory/allocator.hpp"

MEMBOUND_NAMESPACE_BEGIN

struct device_memory {
  std::size_t free = 0;   // bytes the device can still hand out
  std::size_t total = 0;  // bytes of device memory
  std::size_t used() const noexcept { return total >= free ? total - free : 0; }
};

// cudaMemGetInfo for `device` (the current device is restored afterwards). Creates the device's
// context if there is none yet, which itself takes some hundreds of MiB.
inline device_memory device_memory_info(int device) {
  cuda_device_guard guard(device);
  device_memory m;
  cuda_check(cudaMemGetInfo(&m.free, &m.total), "cudaMemGetInfo");
  return m;
}

// Bytes in use on the device that are not `held` (what our allocators reserved there). Saturates
// at 0: cudaMalloc rounds each allocation up (to 2 MiB pages for large ones), so our reserve can
// look slightly larger than the device's own count when nothing else is there.
inline std::size_t others_bytes(const device_memory& m, std::size_t held) noexcept {
  return detail::saturating_sub(m.used(), held);
}

// Sets budget.set_external to the device's used bytes minus what the budget's stack holds
// (budget.usage() - budget.external()), and returns that value. Call it between steps, or before
// a pressure_monitor check, so that usage() sees everything on the device. Throws out_of_memory
// (from set_external, after the budget released its cache) when the others already leave no room
// for what the stack holds; the external value is then unchanged.
template <typename Budget>
  requires detail::has_set_external<Budget> && detail::has_external<Budget> && budgeted<Budget>
std::size_t update_external_from_device(Budget& budget, int device) {
  const device_memory m = device_memory_info(device);
  const std::size_t held = detail::saturating_sub(budget.usage(), budget.external());
  const std::size_t others = others_bytes(m, held);
  budget.set_external(others);
  return others;
}

// The probe of foreign_memory_monitor (monitor/foreign_memory_monitor.hpp) on a device: at each
// check point, the device's used bytes that the budget's stack does not hold (the context, library
// workspaces, other processes), as update_external_from_device counts them.
struct device_others_probe {
  int device = 0;
  template <typename Budget>
    requires detail::has_external<Budget> && budgeted<Budget>
  std::size_t operator()(const Budget& budget) const {
    return others_bytes(device_memory_info(device), detail::saturating_sub(budget.usage(), budget.external()));
  }
};

// Device memory outside membound's allocators, measured once before training: `resident` is the
// device's used bytes once the context exists (our context, plus whatever other processes hold:
// cudaMemGetInfo cannot tell them apart, and the context cannot be measured before it exists);
// `setup` is what `setup` added on top (e.g. a cuda_executor: its stream and cuBLASLt handle, and
// the first GEMM's library state). A plan table shows both as "outside the stack".
struct runtime_memory {
  std::size_t resident = 0;
  std::size_t setup = 0;
  std::size_t total() const noexcept { return resident + setup; }
};
template <typename Setup>
runtime_memory measure_runtime_memory(int device, Setup&& setup) {
  cuda_device_guard guard(device);
  cuda_check(cudaFree(nullptr), "cudaFree(0)");  // makes the context if there is none
  runtime_memory r;
  r.resident = device_memory_info(device).used();
  setup();
  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  r.setup = detail::saturating_sub(device_memory_info(device).used(), r.resident);
  return r;
}

MEMBOUND_NAMESPACE_END
