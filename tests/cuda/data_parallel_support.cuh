// What the device data-parallel tests share (test_cuda_data_parallel here, test_nccl_trainer in
// tests/nccl): a small hybrid model on the device, its data, options and plans, one process's
// run as the reference, and the comparisons.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "membound/backend/cuda.cuh"
#include "membound/membound.hpp"
#include "membound/memory/budget.hpp"
#include "membound/memory/caching_allocator.hpp"
#include "membound/model/planner.hpp"
#include "membound/train/trainer.hpp"

namespace mb = membound;

namespace dpt {

template <typename P>
using hybrid = mb::model<mb::embedding<P>, mb::block<mb::ttt_linear<P, mb::cuda_backend>>,
                         mb::block<mb::attention<P, mb::cuda_backend>>, mb::block<mb::mamba<P, mb::cuda_backend>>,
                         mb::lm_head<P, mb::cuda_backend>>;
using device_budget = mb::budget_allocator<mb::caching_allocator<mb::cuda_device_allocator>>;
inline constexpr std::size_t budget_bytes = std::size_t{1} << 30;
inline constexpr mb::batch_shape effective{4, 40};  // T = 40: TTT's last mini-batch is short
inline constexpr std::size_t steps = 8;

inline mb::model_config config() {
  mb::model_config c;
  c.vocab = 72;
  c.width = 64;
  c.heads = 4;
  c.kv_heads = 2;
  return c;
}

// A learnable stream: a repeating phrase with a little noise; windows drawn from the request's
// random bits, so every rank draws what one process would for the same request.
struct text_source {
  std::vector<std::int32_t> text;
  text_source() {
    std::uint32_t s = 7;
    for (std::size_t i = 0; i < 4000; ++i) {
      s = s * 1664525u + 1013904223u;
      const bool noise = (s >> 24) % 10 == 0;
      text.push_back(static_cast<std::int32_t>(noise ? (s >> 8) % 72 : (i * 7 + i / 13) % 72));
    }
  }
  void operator()(const mb::sequence_request& r, std::int32_t* x, std::int32_t* y) const {
    const std::size_t at = r.random % (text.size() - effective.seq - 1);
    for (std::size_t t = 0; t < effective.seq; ++t) {
      x[t] = text[at + t];
      y[t] = text[at + t + 1];
    }
  }
};

inline mb::trainer_options options(std::size_t zero, bool overlap = false) {
  mb::trainer_options o;
  o.zero = zero;
  o.overlap = overlap;
  o.seed = 3;
  o.lr = mb::cosine_lr{1e-2, 1e-3, 2, 20};
  o.clip = 1.0;
  o.replan_under_pressure = false;
  return o;
}

// Micro-batches of 1, `accumulation` per rank and step; `shard`: this rank's optimizer elements.
template <typename Model>
mb::training_plan plan_for(const Model& m, std::size_t accumulation, std::size_t shard) {
  mb::plan_options po;
  po.threads = 1;
  po.head_chunk = 16;
  po.accumulation = accumulation;
  po.optimizer_elements = shard;
  return mb::make_plan(m, mb::batch_shape{1, effective.seq}, mb::schedule_choice::of(mb::schedules::none{}), po);
}

struct run {
  std::vector<double> losses;
  std::vector<std::uint8_t> weights;
  std::size_t peak = 0, predicted = 0;
  bool all_returned = true;  // every device byte given back at the end
};

// The trainer's weights on the host (after everything enqueued on the device).
template <typename Trainer>
std::vector<std::uint8_t> weights_of(const Trainer& t) {
  std::vector<std::uint8_t> v(t.model().weight_bytes());
  mb::cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  mb::cuda_check(cudaMemcpy(v.data(), t.weights(), v.size(), cudaMemcpyDeviceToHost), "cudaMemcpy");
  return v;
}

// One process (local_communicator) running the whole effective batch: the reference.
template <typename Model>
run one_process(const Model& m) {
  mb::cuda_executor ex;
  device_budget alloc(budget_bytes);
  text_source src;
  run r;
  {
    mb::trainer<Model, device_budget> t(m, effective, plan_for(m, effective.batch, 0), alloc, ex, options(0));
    for (std::size_t k = 0; k < steps; ++k) r.losses.push_back(t.step(src).loss);
    r.weights = weights_of(t);
    r.predicted = t.largest_predicted_peak();
  }
  r.peak = alloc.stats().peak_requested;
  r.all_returned = alloc.stats().requested == 0;
  return r;
}

// Every rank of a data parallel run with `comm` (`ranks` of them): save_at != 0 saves to `path`
// after that many steps and continues in a fresh trainer that loads it. ZeRO-1's save is a
// collective (a shard each, rank 0's manifest); ZeRO-0's state is the same on every rank, so rank
// 0 writes it and the others wait to read it.
template <typename Model, typename Comm>
run rank_run(const Model& m, Comm& comm, std::size_t zero, std::size_t save_at = 0, const std::string& path = {}) {
  const std::size_t N = comm.size();
  const std::size_t shard = zero >= 1 && N > 1 ? mb::shard_of(m.parameter_elements(), N, comm.rank()).size() : 0;
  using trainer_t = mb::trainer<Model, device_budget, mb::null_monitor, Comm>;
  mb::cuda_executor ex;
  device_budget alloc(budget_bytes);
  text_source src;
  run r;
  {
    std::optional<trainer_t> t;
    const auto make = [&] {
      t.emplace(m, effective, plan_for(m, effective.batch / N, shard), alloc, ex, options(zero), mb::null_monitor{},
                comm);
    };
    make();
    for (std::size_t k = 0; k < steps; ++k) {
      if (save_at != 0 && k == save_at) {
        if (zero >= 1 || comm.rank() == 0) t->save(path);
        comm.control().barrier();
        t.reset();
        make();
        t->load(path);
      }
      r.losses.push_back(t->step(src).loss);
    }
    r.weights = weights_of(*t);
    r.predicted = t->largest_predicted_peak();
  }
  r.peak = alloc.stats().peak_requested;
  r.all_returned = alloc.stats().requested == 0;
  return r;
}

inline bool same_bits(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0);
}

inline double worst_gap(const std::vector<double>& a, const std::vector<double>& b) {
  double w = 0;
  for (std::size_t k = 0; k < a.size() && k < b.size(); ++k) w = std::max(w, std::abs(a[k] - b[k]) / std::abs(b[k]));
  return w;
}

}  // namespace dpt
