// membound._core: the C++ planner for a model described at run time, for Python.
//
// A model here is the example trainer's: an embedding, a pattern of TTT-Linear, attention, Mamba
// and TTT-MLP blocks chosen by name, and the LM head, at fp32, bf16 or fp16. The plan is made by
// the same calls the trainer makes (fit, or make_plan with a fixed schedule, and the reserve of
// its allocator stack replayed through a shadow), so its table is the C++ table to the byte.
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

namespace nb = nanobind;
namespace mb = membound;

namespace {

template <typename P>
using hybrid = mb::hybrid_model<P>;

// adamw8bit at the example trainer's block (2048), named by a one-parameter template.
template <typename S>
using adamw8bit_2048 = mb::adamw8bit<S, 2048>;

// What Python asks for; every field already checked there.
struct request {
  std::vector<std::string> layers;
  std::size_t vocab = 256, width = 0, heads = 0, kv_heads = 0, mlp_hidden = 0, window = 0;
  std::size_t experts = 8, top_k = 2;   // attention_moe blocks' mixture (model_config::moe)
  double capacity = 1.25, aux = 0.01;
  std::size_t batch = 1, seq = 1, budget = 0, threads = 1, prefer_below = 0;
  std::size_t sequences = 0;    // packed rows: at most this many sequences per row of seq tokens
  std::size_t max_tokens = 0;   // fit_tokens: the row length is chosen up to this (seq is ignored)
  std::size_t multiple = 64;    // fit_tokens: the row length's step
  std::string precision = "fp32";  // fp32 | bf16 | fp16
  std::string allocator = "arena";  // arena | caching | none
  std::string optimizer = "adamw";  // adamw | adamw8bit | none
  std::string offload = "none";     // none | auto | optimizer | activations | all (train's --offload)
  std::size_t host_budget = 0;      // the host space's budget (0: none)
  // Data parallel over MPI ranks (train under mpirun): rank `rank` of `ranks`, ZeRO stage `zero`,
  // overlapped exchanges; batch is the whole step's, each rank planning batch / ranks of it.
  std::size_t ranks = 1, rank = 0, zero = 0;
  bool overlap = false;
  std::string schedule = "auto";    // auto | none | full | every | binomial (schedule_param: K or S)
  std::size_t schedule_param = 0;
  std::vector<std::size_t> head_chunks{256, 64};
};

// The plan and the model's own figures beside it.
struct plan_result {
  mb::training_plan plan;
  std::size_t parameters = 0;  // the model's parameter count (without alignment padding)
  std::string model_line;      // "4 blocks (ttt_linear,attention,...), width 128, 4 heads, fp32"
};

mb::schedule_choice schedule_of(const request& r) {
  using K = mb::schedule_choice::kind;
  if (r.schedule == "none") return {K::none, 0};
  if (r.schedule == "full") return {K::full, 0};
  if (r.schedule == "every") return {K::every, r.schedule_param};
  if (r.schedule == "binomial") return {K::binomial, r.schedule_param};
  throw mb::invalid_argument("schedule", "auto, none, full, every:K or binomial:S", r.schedule, "e.g. schedule=\"auto\"");
}

// Calls f with the reserve of the stack Python named (a shadow of it replays the plan's
// requests; the stack must live while the reserve function is used).
template <typename Model, typename F>
plan_result with_reserve(const Model& m, const request& r, F&& f) {
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

template <typename P, template <typename> class Opt>
plan_result plan_for(const request& r) {
  using net = hybrid<P>;
  std::vector<std::size_t> pattern;
  for (const std::string& name : r.layers) {
    const std::size_t k = net::mixer_index(name);
    if (k == net::block_types) {
      throw mb::invalid_argument("layers", "names among ttt_linear, ttt_mlp, attention, mamba, local_attention, attention_moe", name,
                                 "e.g. layers=[\"ttt_linear\", \"attention\"]");
    }
    pattern.push_back(k);
  }
  mb::model_config cfg;
  cfg.vocab = r.vocab;
  cfg.width = r.width;
  cfg.heads = r.heads;
  cfg.kv_heads = r.kv_heads;
  cfg.mlp_hidden = r.mlp_hidden;
  cfg.attention_window = r.window;
  cfg.moe.experts = r.experts;
  cfg.moe.top_k = r.top_k;
  cfg.moe.capacity_factor = r.capacity;
  cfg.moe.aux_loss_weight = r.aux;
  const net m(cfg, pattern);
  mb::batch_shape batch{r.batch / r.ranks, r.seq, r.sequences};  // this rank's share
  const bool count_optimizer = r.optimizer != "none";
  // As the example trainer over ranks: the optimizer shard under ZeRO-1 and above, the exchange's
  // plan options with mpi_communicator's sizes (mpi_world: no MPI needed to plan a rank).
  const std::size_t shard =
      r.ranks > 1 && r.zero >= 1 ? mb::shard_of(m.parameter_elements(), r.ranks, r.rank).size() : 0;
  const mb::gradient_shards exchange =
      mb::gradient_exchange_of<typename net::storage_type>(mb::mpi_world{r.ranks, r.rank}, r.zero, r.overlap);
  plan_result out = with_reserve(m, r, [&](const mb::reserve_function& reserve) {
    plan_result o;
    if (r.schedule == "auto") {
      mb::fit_options fo;
      fo.threads = r.threads;
      fo.optimizer_elements = shard;
      fo.gradients = exchange;
      fo.optimizer = count_optimizer;
      fo.optimizer_policy = mb::optimizer_of<Opt<typename net::storage_type>>();
      fo.head_chunks = r.head_chunks;
      fo.reserve = reserve;
      fo.offload = {r.offload == "auto" || r.offload == "optimizer" || r.offload == "all", 0, r.host_budget,
                    r.offload == "activations" || r.offload == "all"};
      fo.offload_mode = r.offload == "auto" ? mb::fit_options::offload_choice::when_needed
                                            : mb::fit_options::offload_choice::always;
      if (r.max_tokens != 0) {
        // As the example trainer's --pack with --seq max: the longest row under the line when one
        // fits there, else under the budget; then fit's plan for the batch of such rows.
        mb::fit_options rows = fo;
        try {
          // A line at or above the budget is none (as fit ignores it).
          if (r.prefer_below == 0 || r.prefer_below >= r.budget) throw mb::budget_too_small(r.budget, 0);
          batch.seq =
              mb::fit_tokens(m, r.max_tokens, r.sequences, r.prefer_below, rows, r.multiple, batch.batch).micro.seq;
        } catch (const mb::host_budget_too_small&) {
          batch.seq = mb::fit_tokens(m, r.max_tokens, r.sequences, r.budget, rows, r.multiple, batch.batch).micro.seq;
        } catch (const mb::budget_too_small&) {
          batch.seq = mb::fit_tokens(m, r.max_tokens, r.sequences, r.budget, rows, r.multiple, batch.batch).micro.seq;
        }
      }
      fo.prefer_below = r.prefer_below;
      o.plan = mb::fit(m, batch, r.budget, fo);
    } else {
      mb::plan_options po;
      po.threads = r.threads;
      po.optimizer_elements = shard;
      po.gradients = exchange;
      po.optimizer = count_optimizer;
      po.optimizer_policy = mb::optimizer_of<Opt<typename net::storage_type>>();
      po.head_chunk = r.head_chunks.front();
      po.offload = {r.offload == "optimizer" || r.offload == "all", 0, r.host_budget,
                    r.offload == "activations" || r.offload == "all"};
      o.plan = mb::make_plan(m, batch, schedule_of(r), po, r.budget);
      if (reserve) o.plan.reserved_peak = reserve(o.plan);
      // As the example trainer: auto offloads when the state does not fit beside the step.
      if (!o.plan.fits() && r.offload == "auto") {
        po.offload = {true, 0, r.host_budget};
        o.plan = mb::make_plan(m, batch, schedule_of(r), po, r.budget);
        if (reserve) o.plan.reserved_peak = reserve(o.plan);
      }
      if (!o.plan.device_fits()) throw mb::budget_too_small(r.budget, o.plan.budgeted_peak());
      if (!o.plan.host_fits()) throw mb::host_budget_too_small(r.host_budget, o.plan.host_peak(), r.budget);
    }
    return o;
  });
  std::size_t named = 0;
  for (const mb::param_entry& e : m.parameters()) named += e.count;
  out.parameters = named;
  std::string names;
  for (const std::string& n : r.layers) names += (names.empty() ? "" : ",") + n;
  out.model_line = std::to_string(r.layers.size()) + " blocks (" + names + "), width " + std::to_string(r.width) +
                   ", " + std::to_string(r.heads) + " heads, " + r.precision;
  return out;
}

template <template <typename> class Opt>
plan_result plan_with(const request& r) {
  if (r.precision == "bf16") return plan_for<mb::bf16_precision, Opt>(r);
  if (r.precision == "fp16") return plan_for<mb::fp16_precision, Opt>(r);
  if (r.precision == "fp32") return plan_for<mb::fp32_precision, Opt>(r);
  throw mb::invalid_argument("precision", "fp32, bf16 or fp16", r.precision, "e.g. precision=\"bf16\"");
}

plan_result make(const request& r) {
  if (r.optimizer == "adamw8bit") return plan_with<adamw8bit_2048>(r);
  return plan_with<mb::adamw>(r);
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
      .def_rw("head_chunks", &request::head_chunks);

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
  m.def("version", [] {
    return std::to_string(MEMBOUND_VERSION_MAJOR) + "." + std::to_string(MEMBOUND_VERSION_MINOR) + "." +
           std::to_string(MEMBOUND_VERSION_PATCH);
  });
}
