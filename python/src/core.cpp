// membound._core: the C++ planner for a model described at run time, for Python (planner.hpp:
// the example trainer's blocks, planned by the calls the trainer makes, so its table is the C++
// table to the byte). Host plans here; device plans (request.device "cuda") in planner_cuda.cu,
// linked in where the package is built with nvcc (MEMBOUND_PLAN_CUDA).
// Arguments arrive checked by membound/__init__.py; the library checks them again and its typed
// errors cross as membound.InvalidArgument / BudgetTooSmall / OutOfMemory with their fields.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

#include "errors.hpp"
#include "membound/membound.hpp"
#include "planner.hpp"

namespace nb = nanobind;
namespace mb = membound;

namespace {

using namespace membound_python;

template <typename P>
using hybrid = mb::hybrid_model<P>;

// Calls f with the reserve of the stack Python named (a shadow of it replays the plan's
// requests; the stack must live while the reserve function is used).
template <typename Model, typename F>
plan_result with_host_reserve(const Model& m, const request& r, F&& f) {
  if (r.allocator == "caching") {
    mb::budget_allocator<mb::caching_allocator<mb::system_allocator>> alloc(r.budget);
    return f(mb::reserve_model(m, alloc));
  }
  if (r.allocator == "arena") {
    // The example trainer's default stack: one reserved range committed a page at a time.
    const std::size_t page = mb::host_virtual_memory::page_size();
    const std::size_t capacity = mb::align_up(std::min<std::size_t>(r.budget, std::size_t{1} << 40), page);
    mb::budget_allocator<mb::expandable_arena<mb::host_virtual_memory>> alloc(
        r.budget, mb::expandable_arena_options{capacity}, page);
    return f(mb::reserve_model(m, alloc));
  }
  return f(mb::reserve_function{});  // "none": requested bytes only
}

plan_result make(const request& r) {
  if (r.device == "cuda") {
#if MEMBOUND_PLAN_CUDA
    return make_plan_cuda(r);
#else
    throw mb::invalid_argument("device", "cpu: this install was built without nvcc (no CUDA layers to plan)", r.device,
                               "Plan with device=\"cpu\", or reinstall where nvcc 12 or newer is found");
#endif
  }
  return plan_any<hybrid>(r, [](const auto& m, const request& q, auto&& f) { return with_host_reserve(m, q, f); });
}
}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "membound's C++ planner (use the functions of the membound package)";
  membound_python::translate_errors();

  nb::class_<request>(m, "Request")
      .def(nb::init<>())
      .def_rw("layers", &request::layers)
      .def_rw("vocab", &request::vocab)
      .def_rw("width", &request::width)
      .def_rw("heads", &request::heads)
      .def_rw("kv_heads", &request::kv_heads)
      .def_rw("mlp_hidden", &request::mlp_hidden)
      .def_rw("window", &request::window)
      .def_rw("experts", &request::experts)
      .def_rw("top_k", &request::top_k)
      .def_rw("capacity", &request::capacity)
      .def_rw("aux", &request::aux)
      .def_rw("batch", &request::batch)
      .def_rw("seq", &request::seq)
      .def_rw("sequences", &request::sequences)
      .def_rw("max_tokens", &request::max_tokens)
      .def_rw("multiple", &request::multiple)
      .def_rw("budget", &request::budget)
      .def_rw("threads", &request::threads)
      .def_rw("prefer_below", &request::prefer_below)
      .def_rw("precision", &request::precision)
      .def_rw("allocator", &request::allocator)
      .def_rw("optimizer", &request::optimizer)
      .def_rw("offload", &request::offload)
      .def_rw("host_budget", &request::host_budget)
      .def_rw("ranks", &request::ranks)
      .def_rw("rank", &request::rank)
      .def_rw("zero", &request::zero)
      .def_rw("overlap", &request::overlap)
      .def_rw("schedule", &request::schedule)
      .def_rw("schedule_param", &request::schedule_param)
      .def_rw("head_chunks", &request::head_chunks)
      .def_rw("device", &request::device);

  nb::class_<plan_result>(m, "PlanResult")
      .def_prop_ro("table", [](const plan_result& r) { return r.plan.table(); })
      .def_prop_ro("model_line", [](const plan_result& r) { return r.model_line; })
      .def_prop_ro("parameters", [](const plan_result& r) { return r.parameters; })
      .def_prop_ro("micro_batch", [](const plan_result& r) { return r.plan.micro.batch; })
      .def_prop_ro("seq", [](const plan_result& r) { return r.plan.micro.seq; })
      .def_prop_ro("sequences", [](const plan_result& r) { return r.plan.micro.sequences; })
      .def_prop_ro("accumulation", [](const plan_result& r) { return r.plan.accumulation; })
      .def_prop_ro("schedule", [](const plan_result& r) { return r.plan.schedule.name(); })
      .def_prop_ro("head_chunk", [](const plan_result& r) { return r.plan.head_chunk; })
      .def_prop_ro("threads", [](const plan_result& r) { return r.plan.threads; })
      .def_prop_ro("weights", [](const plan_result& r) { return r.plan.weights; })
      .def_prop_ro("gradients", [](const plan_result& r) { return r.plan.gradients; })
      .def_prop_ro("weight_gather", [](const plan_result& r) { return r.plan.weight_gather; })
      .def_prop_ro("optimizer", [](const plan_result& r) { return r.plan.optimizer; })
      .def_prop_ro("optimizer_policy", [](const plan_result& r) { return r.plan.optimizer_policy; })
      .def_prop_ro("offload_optimizer", [](const plan_result& r) { return r.plan.offload_optimizer; })
      .def_prop_ro("host_optimizer", [](const plan_result& r) { return r.plan.host_optimizer; })
      .def_prop_ro("host_staging", [](const plan_result& r) { return r.plan.host_staging; })
      .def_prop_ro("offload_bucket", [](const plan_result& r) { return r.plan.offload_bucket; })
      .def_prop_ro("host_activations", [](const plan_result& r) { return r.plan.host_activations; })
      .def_prop_ro("offloaded_bytes", [](const plan_result& r) { return r.plan.offloaded_bytes; })
      .def_prop_ro("host_peak", [](const plan_result& r) { return r.plan.host_peak(); })
      .def_prop_ro("host_budget", [](const plan_result& r) { return r.plan.host_budget; })
      .def_prop_ro("activations", [](const plan_result& r) { return r.plan.activations; })
      .def_prop_ro("workspace", [](const plan_result& r) { return r.plan.workspace; })
      .def_prop_ro("peak_bytes", [](const plan_result& r) { return r.plan.peak_bytes; })
      .def_prop_ro("reserved_peak", [](const plan_result& r) { return r.plan.reserved_peak; })
      .def_prop_ro("peak_phase", [](const plan_result& r) { return r.plan.peak_phase; })
      .def_prop_ro("budget", [](const plan_result& r) { return r.plan.budget; })
      .def_prop_ro("fits", [](const plan_result& r) { return r.plan.fits(); })
      .def_prop_ro("forward_flops", [](const plan_result& r) { return r.plan.forward_flops; })
      .def_prop_ro("recompute_flops", [](const plan_result& r) { return r.plan.recompute_flops; });

  // Without the GIL: a deep model's plan takes seconds, and other Python threads may run meanwhile.
  m.def("make_plan", &make, nb::arg("request"), nb::call_guard<nb::gil_scoped_release>(),
        "The plan for a checked request (membound.plan and membound.fit call it).");
  m.def("plans_devices", [] {
    return std::vector<std::string>{"cpu"
#if MEMBOUND_PLAN_CUDA
                                    , "cuda"
#endif
    };
  }, "The backends this install plans for: cpu, and cuda where it was built with nvcc.");
  m.def("version", [] {
    return std::to_string(MEMBOUND_VERSION_MAJOR) + "." + std::to_string(MEMBOUND_VERSION_MINOR) + "." +
           std::to_string(MEMBOUND_VERSION_PATCH);
  });
}
