// One micro-batch of the hybrid model on the device (model<..., cuda_backend>::forward_backward:
// embedding, every block's forward under the plan's schedule, the fused LM head and loss, every
// backward): tokens/s, the model FLOP utilisation against the device's dense bf16 peak, and the
// budget's measured peak of requested bytes beside the plan's prediction. The model is the one
// issue 17 names as a GPU default: 12 blocks of width 768 (12 heads of 64) repeating TTT-Linear,
// attention, Mamba, attention; vocab 256 (bytes); batch 1; bf16 storage, fp32 accumulation;
// T = 2k, 4k (bm_step only: model_cuda_peer.py's default run compares 2k and 4k) and 8k. The plan
// is fit()'s for an 8 GiB budget (weights, gradients, AdamW state and the step buffers allocated as
// the trainer holds them). bm_step times one micro-batch with CUDA
// events on the executor's stream; bm_train_step times whole optimizer steps of membound::trainer
// on the device (the same micro-batch, then the gradient norm, clipping and AdamW; host wall time
// of trainer::step, which synchronizes at the loss and the norm), with the trainer's measured
// peak beside its prediction. Without a device every benchmark is skipped.
//
//   ./build/release/bench/bench_cuda_model --benchmark_min_time=0.05 --benchmark_format=json
//   ./build/release/bench/bench_cuda_model --attention-kernels=wmma  # attention's fallback kernels (default mma)
//
// The PyTorch side of the same step: bench/peers/model_peer.py --device cuda --ours-cuda PATH.
#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "membound/backend/cuda.cuh"
#include "membound/memory/budget.hpp"
#include "membound/memory/caching_allocator.hpp"
#include "membound/model/planner.hpp"
#include "membound/train/trainer.hpp"

#include "benchmark_main.hpp"

namespace mb = membound;

namespace {

// The kernel choices of every executor the benchmarks make (main sets them from the flags).
mb::gpu::kernel_choices run_kernels{};

using P = mb::bf16_precision;
using B = mb::cuda_backend;
using net = mb::model<mb::embedding<P>, mb::block_pattern<mb::ttt_linear<P, B>, mb::attention<P, B>, mb::mamba<P, B>>,
                      mb::lm_head<P, B>>;
using S = net::storage_type;

bool have_device() {
  int count = 0;
  const bool ok = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
  (void)cudaGetLastError();
  return ok;
}

// The datasheet's dense bf16 tensor-core peak of an sm_90 part (H100 / H200 SXM: 989 TFLOP/s);
// 0 (no MFU figure) on other devices. cuBLAS reaches ~790 on random data on these machines
// (/work/.library/device/KINDS.md), the practical ceiling to quote beside it.
double bf16_peak_flops() {
  int dev = 0, major = 0, minor = 0;
  (void)cudaGetDevice(&dev);
  (void)cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  (void)cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  return major == 9 && minor == 0 ? 989.4e12 : 0.0;
}

mb::model_config config() {
  mb::model_config c;
  c.vocab = 256;
  c.width = 768;
  c.heads = 12;
  return c;
}

void bm_step(benchmark::State& state) {
  if (!have_device()) {
    state.SkipWithError("no CUDA device");
    return;
  }
  const std::size_t T = static_cast<std::size_t>(state.range(0));
  const mb::batch_shape b{1, T};
  std::vector<std::size_t> pattern;
  for (std::size_t i = 0; i < 12; ++i) pattern.push_back(i % 4 == 0 ? 0 : i % 4 == 2 ? 2 : 1);
  const net m(config(), pattern);
  const std::size_t budget = std::size_t{8} << 30;
  // The executor (stream, cuBLASLt handle) is made inside the measurement of what the runtime
  // holds outside the stack: the plan table's "outside the stack" line, which the budget counts,
  // so the stack is fitted into the rest.
  std::optional<mb::cuda_executor> exec;
  const mb::runtime_memory rt = mb::measure_runtime_memory(mb::cuda_current_device(), [&] { exec.emplace(); });
  mb::cuda_executor& ex = *exec;
  ex.set_kernels(run_kernels);
  mb::training_plan p = mb::fit(m, b, budget > rt.total() ? budget - rt.total() : 0);
  const std::size_t n = m.parameter_elements(), wb = m.weight_bytes();
  p.budget = budget;
  p.outside_stack = rt.total();
  p.outside_note = "on the device before us (context, others) + the executor: cudaMemGetInfo";
  mb::budget_allocator<mb::caching_allocator<mb::cuda_device_allocator>> alloc(budget);
  std::fprintf(stderr, "T = %zu\n%s", T, p.table().c_str());
  mb::stream_view mem(alloc, mb::stream_of(ex));  // the trainer's persistent blocks are on its stream too
  S* w = static_cast<S*>(mem.allocate(wb, mb::default_alignment, mb::memory_tag::weights));
  S* g = static_cast<S*>(mem.allocate(wb, mb::default_alignment, mb::memory_tag::gradients));
  void* opt = p.optimizer == 0 ? nullptr : mem.allocate(p.optimizer, mb::default_alignment, mb::memory_tag::optimizer);
  void* sb = mem.allocate(p.step_buffers, mb::default_alignment, mb::memory_tag::other);  // as the trainer
  {
    std::vector<S> h(n);
    m.init_weights(h.data(), 1);
    mb::cuda_check(cudaMemcpy(w, h.data(), wb, cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  mb::cuda_check(cudaMemset(g, 0, wb), "cudaMemset");
  std::vector<std::int32_t> ids(b.tokens()), targets(b.tokens());
  std::uint32_t s = 12345;
  for (std::size_t i = 0; i < b.tokens(); ++i) {
    s = s * 1664525u + 1013904223u;
    ids[i] = static_cast<std::int32_t>((s >> 8) % 256);
    targets[i] = static_cast<std::int32_t>((s >> 16) % 256);
  }
  m.check_tokens(ids.data(), ids.size());
  std::int32_t *d_ids = nullptr, *d_targets = nullptr;
  mb::cuda_check(cudaMalloc(&d_ids, ids.size() * sizeof(std::int32_t)), "cudaMalloc");
  mb::cuda_check(cudaMalloc(&d_targets, ids.size() * sizeof(std::int32_t)), "cudaMalloc");
  mb::cuda_check(cudaMemcpy(d_ids, ids.data(), ids.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice), "cudaMemcpy");
  mb::cuda_check(cudaMemcpy(d_targets, targets.data(), ids.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice),
                 "cudaMemcpy");
  mb::cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");

  cudaEvent_t start, stop;
  mb::cuda_check(cudaEventCreate(&start), "cudaEventCreate");
  mb::cuda_check(cudaEventCreate(&stop), "cudaEventCreate");
  double loss = 0;
  for (auto _ : state) {
    mb::cuda_check(cudaEventRecord(start, ex.stream()), "cudaEventRecord");
    loss = m.forward_backward(w, g, d_ids, d_targets, p.micro, p.ops, p.head_chunk, 1.0, alloc, ex);
    mb::cuda_check(cudaEventRecord(stop, ex.stream()), "cudaEventRecord");
    mb::cuda_check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    mb::cuda_check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    state.SetIterationTime(static_cast<double>(ms) * 1e-3);
  }
  // Forward, recompute and backward (2× the forward): the model FLOPs of a step.
  const double flops = 3.0 * p.forward_flops + p.recompute_flops + 3.0 * m.head_flops(b);
  state.counters["tokens_per_s"] = benchmark::Counter(static_cast<double>(b.tokens()), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["model_TFLOPs"] = benchmark::Counter(flops * 1e-12, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["bf16_peak_TFLOPs"] = bf16_peak_flops() * 1e-12;  // MFU = model_TFLOPs / this
  state.counters["measured_peak_MiB"] = static_cast<double>(alloc.stats().peak_requested) / (1 << 20);
  state.counters["predicted_peak_MiB"] = static_cast<double>(p.peak_bytes) / (1 << 20);
  state.counters["measured_eq_predicted"] = alloc.stats().peak_requested == p.peak_bytes ? 1 : 0;
  state.counters["loss"] = loss;
  // 1 when attention ran the mma.sync kernels (--attention-kernels=mma and the device allows them).
  state.counters["attention_mma"] = mb::gpu::detail::use_mma<mb::bf16>(ex, 768 / 12) ? 1 : 0;
  state.SetLabel(p.schedule.name() + ", head chunk " + std::to_string(p.head_chunk));

  (void)cudaEventDestroy(start);
  (void)cudaEventDestroy(stop);
  (void)cudaFree(d_ids);
  (void)cudaFree(d_targets);
  alloc.deallocate(sb, p.step_buffers, mb::default_alignment, mb::memory_tag::other);
  if (opt != nullptr) alloc.deallocate(opt, p.optimizer, mb::default_alignment, mb::memory_tag::optimizer);
  alloc.deallocate(g, wb, mb::default_alignment, mb::memory_tag::gradients);
  alloc.deallocate(w, wb, mb::default_alignment, mb::memory_tag::weights);
}

// Whole optimizer steps of the trainer on the device: random byte windows (the request's bits).
void bm_train_step(benchmark::State& state) {
  if (!have_device()) {
    state.SkipWithError("no CUDA device");
    return;
  }
  const std::size_t T = static_cast<std::size_t>(state.range(0));
  const mb::batch_shape b{1, T};
  std::vector<std::size_t> pattern;
  for (std::size_t i = 0; i < 12; ++i) pattern.push_back(i % 4 == 0 ? 0 : i % 4 == 2 ? 2 : 1);
  const net m(config(), pattern);
  const std::size_t budget = std::size_t{8} << 30;
  using stack = mb::budget_allocator<mb::caching_allocator<mb::cuda_device_allocator>>;
  stack alloc(budget);
  mb::fit_options fo;
  fo.reserve = mb::reserve_model(m, alloc);
  const mb::training_plan p = mb::fit(m, b, budget, fo);
  mb::cuda_executor ex;
  ex.set_kernels(run_kernels);
  // Random bytes from the request's bits: each window's targets are its tokens shifted by one.
  const auto source = [T](const mb::sequence_request& r, std::int32_t* x, std::int32_t* y) {
    std::uint64_t s = r.random;
    const auto next = [&s] {
      s = s * 6364136223846793005ULL + 1442695040888963407ULL;
      return static_cast<std::int32_t>((s >> 33) % 256);
    };
    std::int32_t prev = next();
    for (std::size_t t = 0; t < T; ++t) {
      x[t] = prev;
      y[t] = prev = next();
    }
  };
  mb::trainer_options to;
  to.seed = 1;
  double loss = 0;
  {
    mb::trainer<net, stack> t(m, b, p, alloc, ex, to);
    (void)t.step(source);  // the first step makes the cache's segments
    for (auto _ : state) {
      const mb::step_result r = t.step(source);
      loss = r.loss;
      state.SetIterationTime(r.ms * 1e-3);
    }
    const double flops = 3.0 * (p.forward_flops + m.head_flops(b));
    state.counters["tokens_per_s"] =
        benchmark::Counter(static_cast<double>(b.tokens()), benchmark::Counter::kIsIterationInvariantRate);
    state.counters["model_TFLOPs"] = benchmark::Counter(flops * 1e-12, benchmark::Counter::kIsIterationInvariantRate);
    state.counters["bf16_peak_TFLOPs"] = bf16_peak_flops() * 1e-12;
    state.counters["measured_peak_MiB"] = static_cast<double>(alloc.stats().peak_requested) / (1 << 20);
    state.counters["predicted_peak_MiB"] = static_cast<double>(t.largest_predicted_peak()) / (1 << 20);
    state.counters["measured_eq_predicted"] = alloc.stats().peak_requested == t.largest_predicted_peak() ? 1 : 0;
    state.counters["reserved_peak_MiB"] = static_cast<double>(alloc.stats().peak_reserved) / (1 << 20);
    state.counters["predicted_reserve_MiB"] = static_cast<double>(t.largest_predicted_reserve()) / (1 << 20);
  }
  state.counters["loss"] = loss;
  // 1 when attention ran the mma.sync kernels (--attention-kernels=mma and the device allows them).
  state.counters["attention_mma"] = mb::gpu::detail::use_mma<mb::bf16>(ex, 768 / 12) ? 1 : 0;
  state.SetLabel(p.schedule.name() + ", head chunk " + std::to_string(p.head_chunk));
}

}  // namespace

BENCHMARK(bm_step)->Arg(2048)->Arg(4096)->Arg(8192)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(bm_train_step)->Arg(2048)->Arg(8192)->UseManualTime()->Unit(benchmark::kMillisecond);

// --attention-kernels=mma|wmma (ours, default mma, taken out before Google Benchmark parses the rest): which
// attention kernels the bf16 model runs (the executors' kernels().attention), reported in the context.
// --attention-kernels=wmma|mma is this program's own flag, checked as every benchmark's are
// (bench_flags.hpp: one `error:` line naming it, exit 1, before any CUDA call); Google
// Benchmark's flags go to it, and it refuses the ones it does not know.
int main(int argc, char** argv) {
  return bench_flags::run([&] {
    std::vector<char*> args;
    std::string kernels = "mma";  // the library's default
    for (int i = 0; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--attention-kernels" || a.rfind("--attention-kernels=", 0) == 0) {
        const bool joined = a.size() > 19;  // --attention-kernels=VALUE, else the next argument
        if (!joined && (i + 1 == argc || std::string(argv[i + 1]).starts_with("--"))) {
          throw membound::invalid_argument("--attention-kernels", "a value after it", "none",
                                           "e.g. --attention-kernels mma");
        }
        kernels = cli_checks::one_of("--attention-kernels", joined ? a.substr(20) : argv[++i], {"mma", "wmma"});
      } else {
        args.push_back(argv[i]);
      }
    }
    run_kernels.attention =
        kernels == "mma" ? mb::gpu::attention_kernels::tensor_core : mb::gpu::attention_kernels::simt_wmma;
    benchmark::AddCustomContext("attention_kernels", kernels);
    return bench_flags::benchmark_main(static_cast<int>(args.size()), args.data());
  });
}
