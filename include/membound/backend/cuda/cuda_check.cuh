// CUDA error checks and the driver entry points the virtual memory backend needs.
//
// Driver functions (cuMem*) are looked up through the runtime (cudaGetDriverEntryPointByVersion)
// instead of being linked: a program then needs only cudart, and one built on a machine without
// a driver still starts and can report "no device" instead of failing to load libcuda.so.1.
#pragma once

#include <cuda.h>  // driver types only; no symbol from libcuda is linked
#include <cuda_runtime_api.h>
#include <cudaTypedefs.h>

#include <cstddef>
#include <new>
#include <string>

#include "membound/core/config.hpp"
#include "membound/core/error.hpp"

MEMBOUND_NAMESPACE_BEGIN

// Throws backend_error naming the call; use for runtime calls whose failure is not an OOM.
inline void cuda_check(cudaError_t status, const char* call) {
  if (status == cudaSuccess) return;
  (void)cudaGetLastError();  // clear the non-sticky error so later checks do not see it again
  throw backend_error(call, static_cast<int>(status),
                      std::string(cudaGetErrorName(status)) + ": " + cudaGetErrorString(status));
}

namespace detail {
// The driver functions we call, resolved once per process.
struct cuda_driver_api {
  PFN_cuGetErrorString_v6000 get_error_string = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 mem_get_allocation_granularity = nullptr;
  PFN_cuMemAddressReserve_v10020 mem_address_reserve = nullptr;
  PFN_cuMemAddressFree_v10020 mem_address_free = nullptr;
  PFN_cuMemCreate_v10020 mem_create = nullptr;
  PFN_cuMemRelease_v10020 mem_release = nullptr;
  PFN_cuMemMap_v10020 mem_map = nullptr;
  PFN_cuMemUnmap_v10020 mem_unmap = nullptr;
  PFN_cuMemSetAccess_v10020 mem_set_access = nullptr;
};

template <typename Fn>
void load_driver_symbol(Fn& fn, const char* symbol) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
  // The ABI version of the typedefs above (all unchanged since CUDA 10.2) is what we ask for.
  const cudaError_t status = cudaGetDriverEntryPointByVersion(symbol, &p, 12000, cudaEnableDefault,
                                                              &found);
#else
  const cudaError_t status = cudaGetDriverEntryPoint(symbol, &p, cudaEnableDefault, &found);
#endif
  if (status != cudaSuccess || found != cudaDriverEntryPointSuccess || p == nullptr) {
    (void)cudaGetLastError();
    throw backend_error(std::string("cudaGetDriverEntryPoint(") + symbol + ")",
                        static_cast<int>(status),
                        status != cudaSuccess ? cudaGetErrorString(status)
                                              : "symbol not provided by the installed driver");
  }
  fn = reinterpret_cast<Fn>(p);
}

// Throws backend_error when the runtime cannot reach a driver (none installed, too old).
inline const cuda_driver_api& cuda_driver() {
  // A throwing initializer leaves the static uninitialized, so a later call tries again.
  static const cuda_driver_api api = [] {
    cuda_driver_api a;
    load_driver_symbol(a.get_error_string, "cuGetErrorString");
    load_driver_symbol(a.mem_get_allocation_granularity, "cuMemGetAllocationGranularity");
    load_driver_symbol(a.mem_address_reserve, "cuMemAddressReserve");
    load_driver_symbol(a.mem_address_free, "cuMemAddressFree");
    load_driver_symbol(a.mem_create, "cuMemCreate");
    load_driver_symbol(a.mem_release, "cuMemRelease");
    load_driver_symbol(a.mem_map, "cuMemMap");
    load_driver_symbol(a.mem_unmap, "cuMemUnmap");
    load_driver_symbol(a.mem_set_access, "cuMemSetAccess");
    return a;
  }();
  return api;
}

inline std::string cuda_driver_error_string(CUresult status) {
  const char* s = nullptr;
  if (cuda_driver().get_error_string(status, &s) != CUDA_SUCCESS || s == nullptr) {
    return "CUresult " + std::to_string(static_cast<int>(status));
  }
  return s;
}
}  // namespace detail

// Throws backend_error naming the driver call.
inline void cu_check(CUresult status, const char* call) {
  if (status == CUDA_SUCCESS) return;
  throw backend_error(call, static_cast<int>(status), detail::cuda_driver_error_string(status));
}

// Makes `device` current for one scope and restores the caller's device after: allocators
// bound to a device must not change which device the caller's later launches go to.
// cudaSetDevice is called even when the device is already current: since CUDA 12 it also makes
// the device's primary context current on this thread, which the cuMem* driver calls need.
class cuda_device_guard {
 public:
  explicit cuda_device_guard(int device) {
    cuda_check(cudaGetDevice(&previous_), "cudaGetDevice");
    cuda_check(cudaSetDevice(device), "cudaSetDevice");
    switched_ = previous_ != device;
  }
  // For noexcept paths (decommit, destructors): on failure the current device stays as it was.
  cuda_device_guard(int device, std::nothrow_t) noexcept {
    if (cudaGetDevice(&previous_) != cudaSuccess || cudaSetDevice(device) != cudaSuccess) {
      (void)cudaGetLastError();
      return;
    }
    switched_ = previous_ != device;
  }
  ~cuda_device_guard() {
    if (switched_) (void)cudaSetDevice(previous_);
  }
  cuda_device_guard(const cuda_device_guard&) = delete;
  cuda_device_guard& operator=(const cuda_device_guard&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

// The calling thread's current device, as a typed error when there is none.
inline int cuda_current_device() {
  int device = 0;
  cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  return device;
}

MEMBOUND_NAMESPACE_END
