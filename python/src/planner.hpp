// The planner behind membound.plan, fit and fit_tokens: a model of the example trainer's blocks
// (an embedding, TTT-Linear, attention, Mamba, TTT-MLP and local-attention blocks chosen by name,
// the LM head) planned by the calls the trainer makes (fit, or make_plan with a fixed schedule, and
// the reserve of its allocator stack replayed through a shadow). Plain C++ without nanobind, so
// that the host planner (core.cpp) and the device planner (planner_cuda.cu, an nvcc unit: the
// CUDA layers' sizes live in .cuh headers) share it; neither touches a device.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "membound/membound.hpp"

namespace membound_python {

namespace mb = membound;

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
  std::string device = "cpu";       // cpu | cuda: the backend whose layers the model runs
};

// The plan and the model's own figures beside it.
struct plan_result {
  mb::training_plan plan;
  std::size_t parameters = 0;  // the model's parameter count (without alignment padding)
  std::string model_line;      // "4 blocks (ttt_linear,attention,...), width 128, 4 heads, fp32"
};

inline mb::schedule_choice schedule_of(const request& r) {
  using K = mb::schedule_choice::kind;
  if (r.schedule == "none") return {K::none, 0};
  if (r.schedule == "full") return {K::full, 0};
  if (r.schedule == "every") return {K::every, r.schedule_param};
  if (r.schedule == "binomial") return {K::binomial, r.schedule_param};
  throw mb::invalid_argument("schedule", "auto, none, full, every:K or binomial:S", r.schedule, "e.g. schedule=\"auto\"");
}

// The plan for the model of hybrid<P> (a model of the example trainer's blocks on one backend)
// with optimizer Opt; with_reserve(m, r, f) calls f with the reserve of the stack r names.
template <template <typename> class Hybrid, typename P, template <typename> class Opt, typename WithReserve>
plan_result plan_for(const request& r, WithReserve&& with_reserve) {
  using net = Hybrid<P>;
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

// The plan for r at its precision and optimizer.
template <template <typename> class Hybrid, typename WithReserve>
plan_result plan_any(const request& r, WithReserve&& with_reserve) {
  const auto with = [&]<template <typename> class Opt>() {
    if (r.precision == "bf16") return plan_for<Hybrid, mb::bf16_precision, Opt>(r, with_reserve);
    if (r.precision == "fp16") return plan_for<Hybrid, mb::fp16_precision, Opt>(r, with_reserve);
    if (r.precision == "fp32") return plan_for<Hybrid, mb::fp32_precision, Opt>(r, with_reserve);
    throw mb::invalid_argument("precision", "fp32, bf16 or fp16", r.precision, "e.g. precision=\"bf16\"");
  };
  if (r.optimizer == "adamw8bit") return with.template operator()<adamw8bit_2048>();
  return with.template operator()<mb::adamw>();
}

// The device planner (planner_cuda.cu), where the package was built with nvcc.
plan_result make_plan_cuda(const request& r);

}  // namespace membound_python
