// The example trainer on a GPU (train --device cuda), built as a module (libtrain_cuda.so) that
// train loads only when it looks for a GPU, so a CPU run maps none of the CUDA libraries. The
// same model family, flags, plan table,
// step line, report and memory trace as the CPU run in train.cpp, on a cuda_executor over a hard
// budget of device memory. The stack is a budget over the expandable arena on cuMem (2 MiB
// granules), traced: the planner replays the run's requests through its shadow, so the plan
// states the reserve before step 1. What the CUDA runtime holds outside the stack (the context,
// the executor's cuBLASLt handle) is measured with cudaMemGetInfo and shown as a line of the table.
// At every check point a probe reads the device's free memory: bytes someone else takes on the
// GPU become the budget's external bytes, and the step is retried under a plan that fits beside
// them (--foreign SIZE@STEP takes SIZE of real device memory with cudaMalloc to show it).
//
//   ./build/release/examples/train --device cuda                    # 12 blocks, width 768, bf16, 8 GiB
//   ./build/release/examples/train --device cuda --budget 0.9 --seq 8192
//   ./build/release/examples/train --device cuda --steps 60 --foreign 2GiB@30 --trace t.json
//
// Built twice: libtrain_cuda.so trains on one GPU (local_communicator); libtrain_cuda_nccl.so
// (target train_cuda_nccl, where NCCL and MPI were found) is what train loads over several ranks: one
// GPU per rank (the rank's place on its node picks the device), nccl_communicator over the ranks
// with --timeout as its watchdog's, each rank planning for its share of the sequences and, with
// --zero 1, its shard of the optimizer state. A separate module so that a one-GPU run never needs
// libnccl. MEMBOUND_EXAMPLE_NCCL=1 makes a process without mpirun load it too (one rank, NCCL's
// one-process communicator: how a machine with one GPU and no mpirun runs that path).
//
//   mpirun -np 2 ./build/release/examples/train --device cuda --zero 1 --timeout 120
#include <cuda_runtime_api.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "membound/backend/cuda.cuh"
#include "membound/model/hybrid.hpp"
#if MEMBOUND_TRAIN_CUDA_NCCL
#include "membound/nccl.cuh"
#endif
#include "train_common.hpp"

namespace train_example {
namespace {

// Device memory someone else holds (--foreign): a real cudaMalloc outside the budget.
class foreign_block {
 public:
  foreign_block() = default;
  foreign_block(const foreign_block&) = delete;
  foreign_block& operator=(const foreign_block&) = delete;
  ~foreign_block() {
    if (p_ != nullptr) (void)cudaFree(p_);
  }
  void take(std::size_t bytes) { mb::cuda_check(cudaMalloc(&p_, bytes), "cudaMalloc (--foreign)"); }

 private:
  void* p_ = nullptr;
};

// --seq max: the largest T, a multiple of 256, whose step fit() places in `budget` (reserve
// included; the caller passes the room under the monitor's emergency line) with `batch` sequences
// (this rank's share), no longer than the validation text allows. Plans grow with T, so a
// bisection over T / 256 finds it; 0 when not even 256 fits.
template <typename Model>
std::size_t largest_fitting_seq(const Model& m, std::size_t batch, std::size_t budget, const mb::fit_options& fo,
                                std::size_t text_bytes) {
  const auto fits = [&](std::size_t T) {
    try {
      (void)mb::fit(m, {batch, T}, budget, fo);
      return true;
    } catch (const mb::budget_too_small&) {
      return false;
    } catch (const mb::host_budget_too_small&) {  // --offload auto: the state fits neither space at T
      return false;
    }
  };
  // read_data holds out a tenth of the text and needs T + 2 bytes of it.
  const std::size_t hi_T = std::min<std::size_t>(std::size_t{1} << 20, text_bytes / 10 - 2);
  std::size_t lo = 0, hi = hi_T / 256;  // lo fits (0: nothing yet), hi + 1 does not
  while (lo < hi) {
    const std::size_t mid = lo + (hi - lo + 1) / 2;
    if (fits(mid * 256)) lo = mid;
    else hi = mid - 1;
  }
  return lo * 256;
}

// One micro-batch (forward, loss, backward) of `rows` sequences of 256 tokens on device memory of
// its own, given back before what is held outside the stack is measured. The CUDA runtime loads a
// kernel's module at its first launch (lazy loading, its default since CUDA 12.2) and keeps device
// memory for it; measured before any step ran, that memory was missing from the plan (the H200 run
// of 2026-11-29: 2 MiB more outside the stack at step 1, whose peak then crossed the emergency line
// and was retried). A step at another shape may still launch kernels this one did not (cuBLASLt
// chooses by size), and the gradient norm's and the optimizer's load at step 1; the monitor's probe
// sees those at its check points, as before. Skipped (false) when the micro-batch does not fit the
// budget (the real plan would not either) or the device.
template <typename Model>
bool load_step_kernels(const Model& m, std::size_t rows, std::size_t budget, mb::cuda_executor& ex) {
  using S = typename Model::storage_type;
  const mb::batch_shape b{rows, 256};
  mb::training_plan p;
  try {
    p = mb::fit(m, b, budget);
  } catch (const mb::budget_too_small&) {
    return false;
  }
  try {
    mb::budget_allocator<mb::caching_allocator<mb::cuda_device_allocator>> alloc(budget);
    mb::stream_view mem(alloc, mb::stream_of(ex));
    S* w = static_cast<S*>(mem.allocate(m.weight_bytes(), mb::default_alignment, mb::memory_tag::weights));
    S* g = static_cast<S*>(mem.allocate(m.weight_bytes(), mb::default_alignment, mb::memory_tag::gradients));
    auto* ids = static_cast<std::int32_t*>(mem.allocate(2 * b.tokens() * sizeof(std::int32_t), mb::default_alignment,
                                                        mb::memory_tag::other));
    // Zero weights and token 0 everywhere: finite, and the values do not choose the kernels.
    mb::cuda_check(cudaMemsetAsync(w, 0, m.weight_bytes(), ex.stream()), "cudaMemsetAsync");
    mb::cuda_check(cudaMemsetAsync(g, 0, m.weight_bytes(), ex.stream()), "cudaMemsetAsync");
    mb::cuda_check(cudaMemsetAsync(ids, 0, 2 * b.tokens() * sizeof(std::int32_t), ex.stream()), "cudaMemsetAsync");
    (void)m.forward_backward(w, g, ids, ids + b.tokens(), p.micro, p.ops, p.head_chunk, 1.0, mem, ex);
    mb::cuda_check(cudaStreamSynchronize(ex.stream()), "cudaStreamSynchronize");
    mem.deallocate(ids, 2 * b.tokens() * sizeof(std::int32_t), mb::default_alignment);
    mem.deallocate(g, m.weight_bytes(), mb::default_alignment);
    mem.deallocate(w, m.weight_bytes(), mb::default_alignment);
  } catch (const mb::out_of_memory&) {  // the device has less free than the budget: the plan says so later
    mb::cuda_check(cudaStreamSynchronize(ex.stream()), "cudaStreamSynchronize");
    return false;
  }  // the caching allocator gives its blocks back to the device at the end of the try block
  return true;
}

// Opt: the optimizer policy for P's storage (--optimizer): adamw or adamw8bit<S, 2048>.
// Comm: local_communicator (one GPU) or nccl_communicator (a GPU per rank).
template <typename P, template <typename> class Opt, typename Comm>
int run_device(const options& given, const std::vector<std::int32_t>& text, Comm& world) {
  options o = given;  // --seq max settles o.seq below
  using B = mb::cuda_backend;
  using net = mb::hybrid_model<P, B>;
  using S = typename net::storage_type;
  using optimizer = Opt<S>;
  const net m = under_flags(o, [&] { return model_of<net>(o); });
  const std::size_t budget = o.budget;
  const int device = mb::cuda_current_device();
  // Data parallel: each rank plans and runs its share of every step's sequences; with --zero 1
  // it plans for its shard of the optimizer state. The device exchange is blocking ZeRO-0/1.
  const std::size_t N = world.size();
  if (o.batch % N != 0) {
    throw mb::invalid_argument("--batch", "a multiple of the " + std::to_string(N) + " ranks", std::to_string(o.batch),
                               "Give every rank an equal share of the sequences per step");
  }
  if (N > 1 && o.zero >= 2) {
    throw mb::invalid_argument("--zero", "0 or 1 with --device cuda over ranks", std::to_string(o.zero),
                               "ZeRO-2 and 3 run on CPU ranks (--device cpu); on GPUs pass --zero 1");
  }
  if (N > 1 && o.overlap != 0) {
    throw mb::invalid_argument("--overlap", "0 with --device cuda over ranks", "1",
                               "The overlapped exchange runs on CPU ranks (--device cpu); on GPUs it is blocking: "
                               "pass --overlap 0");
  }
  const bool sharded = o.zero >= 1 && N > 1;
  const std::size_t shard = sharded ? mb::shard_of(m.parameter_elements(), N, world.rank()).size() : 0;
  const std::size_t share = o.batch / N;

  // Outside the stack, measured once: the context (and whatever others held then), then what the
  // executor's stream and cuBLASLt handle add.
  // The forward and backward kernels are loaded inside that measurement (load_step_kernels), so
  // the memory the runtime keeps for them is counted there too.
  std::optional<mb::cuda_executor> exec;
  bool kernels_loaded = false;
  const mb::runtime_memory outside = mb::measure_runtime_memory(device, [&] {
    exec.emplace(device);
    // The attention kernels of this run's executor (fp32 ignores the choice), before the
    // kernels are loaded.
    const bool cudnn = o.attention_kernels.starts_with("cudnn");
    exec->set_kernels({.attention = o.attention_kernels == "mma" ? mb::gpu::attention_kernels::tensor_core
                                    : cudnn                      ? mb::gpu::attention_kernels::cudnn
                                                                 : mb::gpu::attention_kernels::simt_wmma,
                       .cudnn_deterministic = o.attention_kernels != "cudnn-atomic"});
    kernels_loaded = load_step_kernels(m, 1, budget, *exec);
  });
  mb::cuda_executor& ex = *exec;
  // What attention runs (the report says this, not what --attention-kernels asked for): the
  // mma.sync kernels only where use_mma allows them, else the WMMA/SIMT ones, fp32 always SIMT.
  const std::size_t head_dim = o.width / o.heads;
  std::string attention_ran = "simt";
  if constexpr (!std::is_same_v<S, float>) {
    attention_ran = mb::gpu::detail::use_mma<S>(ex, head_dim) ? "mma" : (head_dim <= 128 ? "wmma" : "simt");
    // cuDNN: what it ran is counted per call (the cudnn line at the end), mma where it did not.
    if (ex.kernels().attention == mb::gpu::attention_kernels::cudnn && mb::gpu::cudnn_attention_report().compiled) {
      attention_ran = "cudnn, else " + attention_ran;
    }
  }

  mb::trace_recorder recorder(o.trace.empty() ? std::size_t{4096} : std::size_t{1} << 20);
  const std::size_t granule = mb::cuda_virtual_memory(device).granularity();
  const std::size_t total = mb::device_memory_info(device).total;
  // The arena's range: the budget, whole granules, never beyond the device.
  const std::size_t capacity = std::max(granule, std::min(budget, total) / granule * granule);
  using stack = mb::budget_allocator<mb::traced_allocator<mb::cuda_expandable_arena>>;
  stack alloc(budget, recorder, mb::expandable_arena_options{capacity}, device);
  // What others hold now (the context, the handle, other processes) is the budget's from the start,
  // so the stack plans into the rest: a plan that fits only without them would run out of memory
  // at its first peak (the trainer refuses one).
  const auto no_room = [&](std::size_t bytes) {
    return mb::invalid_argument("--budget", "more than the " + mb::format_bytes(bytes, false) +
                                                " the device already holds outside the stack (the CUDA context, others)",
                                mb::format_bytes(budget, false), "Raise --budget");
  };
  try {
    mb::update_external_from_device(alloc, device);
  } catch (const mb::out_of_memory&) {
    throw no_room(mb::device_others_probe{device}(alloc));
  }
  const std::size_t held = alloc.external();
  if (held >= budget) throw no_room(held);
  const std::size_t stack_budget = budget - held;
  // A plan refused for the stack's share is refused for the whole budget, with the least budget
  // that would do: the stack's least peak plus what is held outside it.
  const auto beside_held = [&](auto make) {
    try {
      return make();
    } catch (const mb::budget_too_small& e) {
      throw mb::budget_too_small(budget, mb::sat_add(e.minimum(), held),
                                 mb::format_bytes(held, false) + " of it held outside the stack: the CUDA context, "
                                                                 "the executor, others");
    }
  };
  const mb::reserve_function reserve = mb::reserve_model(m, alloc);
  // The monitor counts the bytes held outside the stack against the whole budget: a plan whose
  // peak crosses its emergency line is abandoned in step 1, so plans aim under it where one fits.
  const std::size_t line = emergency_line(budget);
  const std::size_t below_line = line > held ? line - held : 0;
  // Every fit of this run: the stack's reserve, this rank's optimizer shard, and --offload
  // optimizer|auto (the state and its staging buffers in pinned host memory: auto only when the
  // device cannot hold them).
  const auto fit_opts = [&] {
    mb::fit_options fo;
    fo.reserve = reserve;
    fo.optimizer_policy = mb::optimizer_of<optimizer>();
    fo.optimizer_elements = shard;
    fo.offload = {o.offload == "auto" || o.offload == "optimizer", 0, o.host_budget};
    fo.offload_mode = o.offload == "auto" ? mb::fit_options::offload_choice::when_needed
                                          : mb::fit_options::offload_choice::always;
    return fo;
  };
  if (o.seq_max && o.pack != 0) {
    // Packed rows: the most tokens per row (a multiple of 64, no longer than the --pack longest
    // training paragraphs end to end) whose plan fits under the line, else under the budget, as
    // the CPU run's --pack --seq max.
    const mb::fit_options fo = fit_opts();
    const std::size_t most = longest_useful_row(text, o.pack);
    bool under_line = below_line > 0;
    o.seq = under_flags(o, [&] { return beside_held([&] {
      if (under_line) {
        try {
          return mb::fit_tokens(m, most, o.pack, below_line, fo, 64, share).micro.seq;
        } catch (const mb::budget_too_small&) {
          under_line = false;
        } catch (const mb::host_budget_too_small&) {
          under_line = false;
        }
      }
      return mb::fit_tokens(m, most, o.pack, stack_budget, fo, 64, share).micro.seq;
    }); });
    std::printf("--seq max: %zu tokens per packed row, at most %zu paragraphs each (the most that fit %s)\n", o.seq,
                o.pack, under_line ? "under the monitor's emergency line" : "the budget, above the monitor's emergency line");
  } else if (o.seq_max) {
    const mb::fit_options fo = fit_opts();
    // The longest T under the line (the longest under the whole budget would sit above it: the H200
    // run of 2026-11-27 chose 1536 tokens at 99.9% of 2 GiB, and step 1 was retried); when not even
    // 256 tokens fit there, the longest under the budget.
    std::size_t room = below_line;
    o.seq = below_line > 0 ? under_flags(o, [&] { return largest_fitting_seq(m, share, room, fo, text.size()); }) : 0;
    const bool under_line = o.seq != 0;
    if (!under_line) {
      room = stack_budget;
      o.seq = under_flags(o, [&] { return largest_fitting_seq(m, share, room, fo, text.size()); });
    }
    if (o.seq == 0) {
      throw mb::invalid_argument("--seq", "max: a length of at least 256 that fits --budget less the " +
                                              mb::format_bytes(held, false) + " held outside the stack",
                                 "none fits", "Raise --budget, or lower --batch or --width");
    }
    const std::string where = under_line
                                  ? "the monitor's emergency line, " + mb::format_bytes(line, false) + " of the budget " +
                                        mb::format_bytes(budget, false)
                                  : "the budget " + mb::format_bytes(budget, false) + ", above the monitor's emergency line";
    std::printf("--seq max: %zu tokens, the longest multiple of 256 the planner fits in %s (%s, less %s held outside "
                "the stack) with %zu sequences per step%s\n",
                o.seq, mb::format_bytes(room, false).c_str(), where.c_str(), mb::format_bytes(held, false).c_str(),
                share, N > 1 ? " on each rank" : "");
  }
  // Packed (--pack): rows of --seq tokens holding at most --pack paragraphs each.
  const mb::batch_shape eff{o.batch, o.seq, o.pack};
  const mb::batch_shape rank_share{share, o.seq, o.pack};

  mb::training_plan plan = under_flags(o, [&] { return beside_held([&] {
    if (!o.fixed_schedule) {
      mb::fit_options fo = fit_opts();
      fo.prefer_below = below_line;
      return mb::fit(m, rank_share, stack_budget, fo);
    }
    mb::plan_options po;
    po.optimizer_policy = mb::optimizer_of<optimizer>();
    po.optimizer_elements = shard;
    po.offload = {o.offload == "optimizer", 0, o.host_budget};
    mb::training_plan p = mb::make_plan(m, rank_share, *o.fixed_schedule, po, stack_budget);
    p.reserved_peak = reserve(p);
    if (!p.device_fits() && o.offload == "auto") {  // the state beside it does not fit: on the host then
      po.offload = {true, 0, o.host_budget};
      p = mb::make_plan(m, rank_share, *o.fixed_schedule, po, stack_budget);
      p.reserved_peak = reserve(p);
    }
    if (!p.device_fits()) throw mb::budget_too_small(stack_budget, p.budgeted_peak());
    if (!p.host_fits()) throw mb::host_budget_too_small(o.host_budget, p.host_peak(), stack_budget);
    return p;
  }); });
  // The table shows the whole budget, with what is held outside the stack counted against it.
  plan.budget = budget;
  plan.outside_stack = held;
  plan.outside_note = "CUDA context " + mb::format_bytes(outside.resident, false) + " (with others' bytes then) + " +
                      "executor " + mb::format_bytes(outside.setup, false) +
                      (kernels_loaded ? " (with the forward and backward kernels a 256-token micro-batch loaded)"
                                      : "") +
                      ", cudaMemGetInfo";
  cudaDeviceProp prop{};
  mb::cuda_check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  std::printf("device: %s, %.1f GiB; budget %s%s\n", prop.name, static_cast<double>(total) / (1024.0 * 1024 * 1024),
              mb::format_bytes(budget, false).c_str(),
              o.budget_fraction > 0 ? (" (" + std::to_string(o.budget_fraction) + " of the device)").c_str() : "");
  std::printf("model: %zu blocks (%s), width %zu, %zu heads, %s, %zu parameters\n", m.depth(), o.layers.c_str(),
              o.width, o.heads, o.precision.c_str(), m.parameter_count());
  std::printf("attention kernels: %s (--attention-kernels %s)\n", attention_ran.c_str(), o.attention_kernels.c_str());
  std::printf("%s\n", plan.table().c_str());
  if (N > 1) {
    std::printf("data parallel: %zu ranks (%s, one GPU each), %zu of the %zu sequences per step each; %s; the plan "
                "above is rank 0's, each rank's line follows\n",
                N, world.name(), share, o.batch,
                sharded ? "each rank holds the whole model and its shard of the optimizer state (ZeRO-1)"
                        : "every rank holds the whole model and optimizer state (ZeRO-0)");
  }
  if (o.plan_only == 1) {
    // The trainer is not made, so no checkpoint is read: a plan it holds (a pressure replan's)
    // would replace this one when it fits.
    if (!o.resume.empty()) std::printf("--resume: not read with --plan-only; its own plan replaces this one if it fits\n");
    return 0;  // the plan (and --seq max's length) is what was asked for
  }

  const mb::pressure_thresholds thresholds{};
  const std::size_t split = text.size() * 9 / 10;
  const std::vector<std::int32_t> train(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(split));
  const std::vector<std::int32_t> val(text.begin() + static_cast<std::ptrdiff_t>(split), text.end());

  mb::trainer_options to = trainer_options_of(o, text);
  // The host space of --offload: pinned memory (the copies' other end) under --host-budget (none:
  // unbounded, measured all the same).
  mb::budget_allocator<mb::cuda_pinned_allocator> host_space(o.host_budget != 0 ? o.host_budget : SIZE_MAX);
  to.host = mb::host_allocator_ref(host_space);
  using monitor = mb::foreign_memory_monitor<mb::pressure_monitor<mb::all_check_points>, mb::device_others_probe>;
  mb::trainer<net, stack, monitor, Comm, optimizer> t(m, eff, plan, alloc, ex, to,
                                                      monitor(mb::pressure_monitor<mb::all_check_points>(thresholds),
                                                              mb::device_others_probe{device}),
                                                      world);
  const bool writer = world.rank() == 0;  // the report and trace: rank 0's
  // ZeRO-1 checkpoints are a collective: every rank writes its shard, rank 0 the manifest.
  const bool saver = writer || sharded;
  if (N > 1) std::printf("%s\n", mb::rank_memory_table(t.memory_of_ranks()).c_str());  // a collective
  t.monitor().inner().attach(recorder);
  resume_from(t, o);

  // The steps over either kind of source: random windows of the text, or packed rows of its
  // paragraphs (--pack).
  const auto train_with = [&](auto& train_src, auto& val_src) -> int {
  auto eval = [&] { return t.evaluate(val_src, o.eval_sequences, o.seed); };
  progress bar(o.steps);
  const double first_eval = eval();
  bar.note(eval_line(t.steps_done(), o, first_eval));
  double last_loss = 0, last_eval = first_eval, total_ms = 0;
  std::size_t tokens_done = 0, skipped = 0, replans = 0;
  mb::moe_stats moe_total{};  // the mixture blocks' counts over the run (the report's "moe")
  std::uint64_t last_eval_step = 0;  // the step of the last evaluation in the loop
  // Reserved bytes after each step: flat after the first step, or the stack creeps.
  std::size_t reserved_after_first = 0, reserved_max_later = 0;
  const std::uint64_t stop = o.stop_after == 0 ? o.steps : std::min<std::uint64_t>(o.steps, t.steps_done() + o.stop_after);
  foreign_block foreign;
  bool foreign_taken = false;
  const std::uint64_t first_step = t.steps_done() + 1;
  // Model FLOPs of a step (MFU's convention: forward and backward, recompute not counted), and
  // the mean seconds of this invocation's steps.
  const auto step_flops = [&] {
    return 3.0 * (t.plan().forward_flops + m.head_flops(t.plan().micro)) * static_cast<double>(t.plan().accumulation);
  };
  const auto seconds_per_step = [&] {
    return t.steps_done() >= first_step ? total_ms / 1000.0 / static_cast<double>(t.steps_done() - first_step + 1) : 0.0;
  };
  // The report and the trace: after the run, and also for the steps that ran when an error ends
  // it (no plan fits beside memory taken by others, another rank failed, a collective timed out),
  // so that what led to the error is kept. `st`: the stack's statistics of the training.
  const auto write_files = [&](const char* stopped_by, const auto& st) {
    if (!writer) return;
    if (!o.report.empty()) {
      const mb::training_plan& p = t.plan();
      const std::size_t predicted = t.largest_predicted_peak();
      const std::size_t predicted_reserve = t.largest_predicted_reserve();
      const double flops = step_flops();
      const double step_s = seconds_per_step();
      nlohmann::json j;
      j["device"] = prop.name;
      j["budget_bytes"] = budget;
      j["stack_budget_bytes"] = stack_budget;  // the budget less what was held outside the stack at the start
      j["predicted_peak_bytes"] = predicted;
      j["measured_peak_bytes"] = st.peak_requested;
      j["predicted_reserved_peak_bytes"] = predicted_reserve;
      j["measured_reserved_peak_bytes"] = st.peak_reserved;
      j["reserved_after_first_step_bytes"] = reserved_after_first;
      j["reserved_max_after_first_step_bytes"] = reserved_max_later;
      j["outside_stack_bytes"] = held;  // the budget's external bytes at the start (the plan's line)
      j["runtime_bytes"] = outside.total();  // of which: the context and the executor, as measured
      j["step_kernels_loaded"] = kernels_loaded;  // whether runtime_bytes holds forward's and backward's kernels
      if (const auto c = mb::gpu::cudnn_attention_report(); c.compiled) {  // attention's cuDNN path, this run
        j["cudnn"] = {{"loaded", c.loaded},           {"version", c.version},
                      {"library", c.library},         {"forward_calls", c.forward_calls},
                      {"backward_calls", c.backward_calls}, {"fallbacks", c.fallbacks},
                      {"last_fallback", c.last_fallback}};
      }
      j["ranks"] = N;
      j["zero"] = sharded ? 1 : 0;
      add_run_fields(j,
                     {first_eval, last_eval, last_loss, total_ms, tokens_done, skipped, replans, last_eval_step,
                      moe_total},
                     t.steps_done(), stopped_by);
      j["model_tflops_per_second"] = step_s > 0 ? flops / step_s / 1e12 : 0.0;
      j["foreign_bytes"] = alloc.external();
      j["loss_scale"] = t.loss_scaling_on() ? t.scaler().scale : 1.0;
      j["thresholds"] = {{"warning", thresholds.warning}, {"critical", thresholds.critical},
                         {"emergency", thresholds.emergency}};
      j["host"] = {{"offload_optimizer", p.offload_optimizer},
                   {"predicted_peak_bytes", t.largest_predicted_host_peak()},
                   {"measured_peak_bytes", host_space.stats().peak_requested},
                   {"budget_bytes", o.host_budget}};
      j["plan"] = {{"weights", p.weights},       {"gradients", p.gradients},
                   {"optimizer", p.optimizer},   {"step_buffers", p.step_buffers},
                   {"activations", p.activations},
                   {"workspace", p.workspace},   {"peak", p.peak_bytes},
                   {"reserved_peak", p.reserved_peak},
                   {"peak_phase", p.peak_phase}, {"micro_batch", p.micro.batch},
                   {"accumulation", p.accumulation}, {"schedule", p.schedule.name()}};
      j["policies"] = {{"precision", o.precision}, {"schedule", p.schedule.name()},
                       {"head_chunk", p.head_chunk}, {"layers", o.layers}, {"device", "cuda"},
                       {"attention_kernels", attention_ran},
                       {"loss_scaling", t.loss_scaling_on()},
                       {"allocator", "budget<traced<expandable_arena<cuda_virtual_memory>>>, " + std::to_string(granule) +
                                         " B granules"},
                       {"monitor", "foreign_memory_monitor<pressure_monitor<all_check_points>, device_others_probe>"}};
      cli_checks::write_file("--report", o.report, [&](std::ostream& os) { os << j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n"; });
    }
    if (!o.trace.empty()) {
      cli_checks::write_file("--trace", o.trace, [&](std::ostream& os) { recorder.write_chrome_trace(os); });
    }
  };
  try {
    while (t.steps_done() < stop) {
      if (o.foreign.bytes != 0 && !foreign_taken && t.steps_done() + 1 >= o.foreign.at_step) {
        foreign_taken = true;
        alloc.release_cached();  // the arena's free tail is nobody's: others can take it
        foreign.take(o.foreign.bytes);
        recorder.record_allocation(mb::memory_tag::other, o.foreign.bytes, nullptr);
        bar.note("step " + std::to_string(t.steps_done() + 1) + ": " + mb::format_bytes(o.foreign.bytes, false) +
                 " of device memory are now held by something else (--foreign: cudaMalloc outside the budget)");
      }
      const mb::step_result r = t.step(train_src);
      for (const mb::replan_event& e : r.replans) {
        bar.note(e.describe());
        ++replans;
      }
      total_ms += r.ms;
      tokens_done += r.tokens;
      moe_total += r.moe;
      last_loss = r.loss;
      skipped += r.applied ? 0 : 1;
      const auto st = alloc.stats();
      if (r.step == first_step) reserved_after_first = st.reserved;
      else reserved_max_later = std::max(reserved_max_later, st.reserved);
      bar.step(r, alloc.usage(), st.peak_requested, budget);
      if (o.eval_every != 0 && r.step % o.eval_every == 0) {
        last_eval = eval();
        last_eval_step = r.step;
        bar.note(eval_line(r.step, o, last_eval));
      }
      if (saver) save_if_due(t, o, r.step, stop, bar);
      kill_if_asked(world.rank(), r.step);
    }
  } catch (const std::exception&) {
    bar.finish();
    // The error as the command line names it (no plan fits any more: --budget, and --foreign
    // when its bytes were taken), in the report too.
    try {
      rethrow_mid_run(o, budget, foreign_taken);
    } catch (const std::exception& named) {
      try {
        write_files(named.what(), alloc.stats());
      } catch (const std::exception& w) {
        // The run's own error is the one to report; the files' is said beside it.
        std::fprintf(stderr, "train: the report or trace of the steps that ran was not written: %s\n", w.what());
      }
      throw;
    }
  }
  bar.finish();
  if (o.eval_every == 0 || t.steps_done() % o.eval_every != 0) last_eval = eval();

  // What the report and the checks below say is the training's: taken before the sample.
  const auto st = alloc.stats();
  // The sample is decoded on the device, one token at a time (the head's logits on the host), its
  // state, workspace and one-token buffer from the same stack.
  if (o.sample > 0) {
    void* id = alloc.allocate(sizeof(std::int32_t), mb::default_alignment, mb::memory_tag::other);
    try {
      const std::string out = t.decode(1, std::min<std::size_t>(256, o.seq), [&](auto& session) {
        // The sampler's host ids, one at a time to the device on the model's stream.
        struct uploading {
          decltype(session)& d;
          void* id;
          const net& m;
          mb::cuda_executor& ex;
          void step(const std::int32_t* host_id, double* logits) {
            m.check_tokens(host_id, 1);
            // On the model's stream, after the last step's reads of id; done before host_id may
            // move (the sampler's context grows): a copy from pageable memory may be deferred.
            mb::cuda_check(cudaMemcpyAsync(id, host_id, sizeof(std::int32_t), cudaMemcpyHostToDevice, ex.stream()),
                           "cudaMemcpyAsync (id)");
            ex.synchronize();
            d.step(static_cast<const std::int32_t*>(id), logits);
          }
          void restart() { d.restart(); }
          std::size_t length() const { return d.length(); }
          std::size_t max_len() const { return d.max_len(); }
        } up{session, id, m, ex};
        return sample_text(val, o, up);
      });
      std::printf("\nsample:\n%s\n\n", out.c_str());
    } catch (...) {
      alloc.deallocate(id, sizeof(std::int32_t), mb::default_alignment, mb::memory_tag::other);
      throw;
    }
    alloc.deallocate(id, sizeof(std::int32_t), mb::default_alignment, mb::memory_tag::other);
  }

  const std::size_t predicted = t.largest_predicted_peak();
  const std::size_t predicted_reserve = t.largest_predicted_reserve();
  const bool requested_ok = st.peak_requested <= predicted && predicted <= stack_budget;
  const bool reserve_ok = st.peak_reserved <= predicted_reserve && predicted_reserve <= stack_budget;
  const double flops = step_flops();
  const double step_s = seconds_per_step();
  std::printf("eval loss %.4f -> %.4f; measured peak %.2f MiB <= predicted %.2f MiB <= budget %.2f MiB less %.2f MiB "
              "outside the stack: %s\n",
              first_eval, last_eval, mib(st.peak_requested), mib(predicted), mib(budget), mib(held),
              requested_ok ? "yes" : "NO");
  std::printf("reserved by the arena: measured %.2f MiB <= predicted %.2f MiB: %s; after step 1 %.2f MiB, later at most "
              "%.2f MiB\n",
              mib(st.peak_reserved), mib(predicted_reserve), reserve_ok ? "yes" : "NO", mib(reserved_after_first),
              mib(reserved_max_later));
  // --offload: the optimizer's state and its staging buffers in the host space (pinned).
  const bool host_ok = host_space.stats().peak_requested <= t.largest_predicted_host_peak();
  const std::string host_line = host_space_line(host_space.stats().peak_requested, t.largest_predicted_host_peak(),
                                                o.host_budget, "--offload, pinned");
  if (!host_line.empty()) std::printf("%s\n", host_line.c_str());
  if (const auto c = mb::gpu::cudnn_attention_report(); c.compiled && o.attention_kernels.starts_with("cudnn")) {
    std::printf("cudnn: %s%s; attention calls on cuDNN: %llu forward, %llu backward; %llu on ours%s%s\n",
                c.loaded ? "cuDNN " : "", c.loaded ? std::to_string(c.version).c_str() : c.library.c_str(),
                static_cast<unsigned long long>(c.forward_calls), static_cast<unsigned long long>(c.backward_calls),
                static_cast<unsigned long long>(c.fallbacks), c.fallbacks > 0 ? " (last: " : "",
                c.fallbacks > 0 ? (c.last_fallback + ")").c_str() : "");
  }
  if (step_s > 0) {
    std::printf("%.0f tokens/s, %.1f model TFLOP/s per step (%.1f%% of 989 bf16 TFLOP/s)\n",
                static_cast<double>(tokens_done) / (total_ms / 1000.0), flops / step_s / 1e12,
                100.0 * flops / step_s / 989e12);
  }
  write_files(nullptr, st);
  return requested_ok && reserve_ok && host_ok ? 0 : 3;
  };
  if (o.pack == 0) {
    windows train_src{&train, o.seq}, val_src{&val, o.seq};
    return train_with(train_src, val_src);
  }
  const packed_corpus corpus(train, val, o.seq, o.pack);
  packed_rows train_src = corpus.train_source(), val_src = corpus.val_source();
  return train_with(train_src, val_src);
}

#if MEMBOUND_TRAIN_CUDA_NCCL
// The ranks of this run, one GPU each: under mpirun (train initialized MPI) MPI_COMM_WORLD's, the
// rank's place among the ranks of its node picking the device; without MPI one rank over NCCL's
// one-process communicator. Made before the plan, so NCCL's own device memory is among what the
// budget counts outside the stack.
mb::nccl_communicator& gpu_ranks(const options& o, std::optional<mb::nccl_communicator>& made) {
  const auto timeout = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::seconds(o.timeout));
  int ready = 0;
  if (MPI_Initialized(&ready) != MPI_SUCCESS || ready == 0) {
    made.emplace(mb::single_process, timeout);
    return *made;
  }
  MPI_Comm node = MPI_COMM_NULL;
  int local = 0, on_node = 1;
  const bool placed = MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node) == MPI_SUCCESS &&
                      MPI_Comm_rank(node, &local) == MPI_SUCCESS && MPI_Comm_size(node, &on_node) == MPI_SUCCESS;
  if (node != MPI_COMM_NULL) MPI_Comm_free(&node);
  if (!placed) throw mb::communication_error("MPI_Comm_split_type", 0, "could not find this rank's place on its node");
  int devices = 0;
  mb::cuda_check(cudaGetDeviceCount(&devices), "cudaGetDeviceCount");
  if (on_node > devices) {  // the same on every rank of the node: they all stop here
    throw mb::invalid_argument("mpirun -np", "at most one rank per GPU of a node (" + std::to_string(devices) + " here)",
                               std::to_string(on_node) + " ranks on this node",
                               "Start at most " + std::to_string(devices) + " ranks per node, or train on CPU ranks "
                               "with --device cpu");
  }
  mb::cuda_check(cudaSetDevice(local), "cudaSetDevice");
  made.emplace(MPI_COMM_WORLD, timeout);
  return *made;
}
#endif

int run_on_device_here(const options& o, const std::vector<std::int32_t>& text) {
  if (o.precision == "fp16") {
    throw mb::invalid_argument("--precision", "fp32 or bf16 with --device cuda", "fp16",
                               "This build's GPU trainer is compiled for fp32 and bf16: pass --precision bf16");
  }
#if MEMBOUND_TRAIN_CUDA_NCCL
  std::optional<mb::nccl_communicator> made;
  mb::nccl_communicator& world = gpu_ranks(o, made);
#else
  mb::local_communicator world;
#endif
  const auto with = [&]<template <typename> class Opt>() {
    if (o.precision == "bf16") return run_device<mb::bf16_precision, Opt>(o, text, world);
    return run_device<mb::fp32_precision, Opt>(o, text, world);
  };
#if MEMBOUND_TRAIN_CUDA_NCCL
  try {
    if (o.optimizer == "adamw8bit") return with.template operator()<adamw8bit_2048>();
    return with.template operator()<mb::adamw>();
  } catch (const std::exception& e) {
    // The other ranks may wait in a collective this rank will never join: end them all here,
    // before the communicator's destructor (without a timeout it would wait for them forever).
    if (world.size() > 1) {
      std::fprintf(stderr, "error: rank %zu: %s\n", world.rank(), cli_checks::one_line(e.what()).c_str());
      let_failing_rank_speak(e);
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    throw;
  }
#else
  if (o.optimizer == "adamw8bit") return with.template operator()<adamw8bit_2048>();
  return with.template operator()<mb::adamw>();
#endif
}

}  // namespace
}  // namespace train_example

// The module's entry points, found by train.cpp with dlsym (C names: no mangling to agree on).
// Exceptions cross back into train (the same compiler and C++ runtime built both).
extern "C" {
bool membound_train_cuda_present() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no device: not an error of this run
    return false;
  }
  return n > 0;
}
std::size_t membound_train_cuda_memory() {
  return membound::device_memory_info(membound::cuda_current_device()).total;
}
int membound_train_cuda_run(const train_example::options* o, const std::vector<std::int32_t>* text) {
  return train_example::run_on_device_here(*o, *text);
}
}
