// The device planner: planner.hpp's plans for the example trainer's blocks on cuda_backend (the
// CUDA layers' workspaces, cuBLASLt's included, and the device stack's reserve), as
// `train --device cuda --plan-only 1` makes them, less what that run measures outside the stack
// (the CUDA context, the executor): the budget here is the stack's. No device is touched: the
// layers' sizes are host functions (in .cuh headers, hence nvcc), and the reserve is replayed
// through shadows of the device stacks with the device's 2 MiB granule.
#include "membound/backend/cuda.cuh"
#include "planner.hpp"

namespace membound_python {

namespace {

template <typename P>
using device_hybrid = mb::hybrid_model<P, mb::cuda_backend>;

// The physical granule of cuMemCreate on NVIDIA GPUs (cuMemGetAllocationGranularity's minimum
// for device memory: 2 MiB on every one so far), which cuda_virtual_memory maps in.
constexpr std::size_t device_granule = std::size_t{2} << 20;

// Calls f with the reserve of the device stack r names: "arena" the GPU trainer's
// (budget<expandable_arena<cuda_virtual_memory>>, one range of the budget's whole granules),
// "caching" budget<caching_allocator<cuda_device_allocator>>, "none" the requested bytes.
template <typename Model, typename F>
plan_result with_device_reserve(const Model& m, const request& r, F&& f) {
  if (r.allocator == "caching") {
    mb::budget_allocator<mb::caching_allocator<mb::shadow_t<mb::cuda_device_allocator>>> alloc(r.budget);
    return f(mb::reserve_model(m, alloc));
  }
  if (r.allocator == "arena") {
    const std::size_t capacity = std::max(device_granule, r.budget / device_granule * device_granule);
    mb::budget_allocator<mb::expandable_arena<mb::address_only_vm<mb::memory_space::device>>> alloc(
        r.budget, mb::expandable_arena_options{capacity}, device_granule);
    return f(mb::reserve_model(m, alloc));
  }
  return f(mb::reserve_function{});
}

}  // namespace

plan_result make_plan_cuda(const request& r) {
  return plan_any<device_hybrid>(r, [](const auto& m, const request& q, auto&& f) {
    return with_device_reserve(m, q, f);
  });
}

}  // namespace membound_python
