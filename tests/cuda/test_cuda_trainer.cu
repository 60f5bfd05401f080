// membound::trainer on cuda_backend: the same training loop as on the CPU (gradient accumulation,
// clipping, cosine LR, AdamW with its state on the device) for a hybrid of all four mixers
// (TTT-Linear, attention with grouped-query heads, Mamba, TTT-MLP). Checked here:
//   - the CPU and GPU runs of one model from the same seed and data agree in fp32 over 20 steps
//     (the tolerance is below);
//   - the same seed gives the same loss curve and weights on the device, bit for bit;
//   - adamw8bit (its device kernel, the CPU's state layout) agrees with the CPU trainer's the same
//     way, repeats its bits, and its peak is the prediction;
//   - the peak of requested bytes measured through the device budget equals the largest
//     predicted peak, to the byte, and the reserved peak stays within the reserve the plan states;
//   - save, load and go on equals the uninterrupted run bit for bit; a corrupted checkpoint is
//     refused with the trainer unchanged; a CPU checkpoint resumes on the device;
//   - optimizer offload (the state in pinned host memory, the update on the host) agrees with the
//     in-place run, both spaces' peaks are their predictions, its checkpoint loads in place;
//   - a bad token id is refused on the host before the upload, with nothing consumed;
//   - memory taken by someone else (a real cudaMalloc outside the budget, counted as the budget's
//     external bytes) makes the next step retry under a stricter plan that fits beside it, and
//     device_others_probe (what foreign_memory_monitor reads at its check points) sees it.
// Without a device it exits 77 (skipped) after its host part (the device model's plan: step
// buffers, the reserve replay's request for them), which runs everywhere.
//
// Tolerance of the CPU/GPU agreement (fp32, relative, per step's loss): one step's loss agrees
// within 1e-5 (test_cuda_model: sums in other orders, the device's expf/logf). AdamW divides each
// update by the gradient's own running scale, so an element whose gradient is a cancelling sum near
// zero can move by a different fraction of the learning rate on each side, and those differences
// feed the next steps: the curves may drift apart slowly. 1e-3 per step over 20 steps at lr 1e-2
// is the bound stated here; the run prints the largest difference measured.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "cuda_test_support.cuh"
#include "../support/small_models.hpp"

#include "membound/memory/budget.hpp"
#include "membound/memory/caching_allocator.hpp"
#include "membound/memory/system_allocator.hpp"
#include "membound/model/planner.hpp"
#include "membound/model/reserve_plan.hpp"
#include "membound/monitor/foreign_memory_monitor.hpp"
#include "membound/monitor/pressure_monitor.hpp"
#include "membound/train/trainer.hpp"

namespace mb = membound;

namespace {

template <typename P, typename B>
using hybrid = mb::model<mb::embedding<P>, mb::block<mb::ttt_linear<P, B>>, mb::block<mb::attention<P, B>>,
                         mb::block<mb::mamba<P, B>>, mb::block<mb::ttt_mlp<P, B>>, mb::lm_head<P, B>>;
using P = mb::fp32_precision;
using cpu_model = hybrid<P, mb::cpu_backend>;
using gpu_model = hybrid<P, mb::cuda_backend>;

using device_budget = mb::budget_allocator<mb::caching_allocator<mb::cuda_device_allocator>>;
using host_budget = mb::budget_allocator<mb::system_allocator>;
constexpr std::size_t budget_bytes = std::size_t{1} << 30;

constexpr mb::batch_shape effective{4, 40};  // T = 40: TTT's last mini-batch is short

mb::model_config config() {
  mb::model_config c;
  c.vocab = 72;
  c.width = 64;
  c.heads = 4;
  c.kv_heads = 2;
  return c;
}

// A learnable stream: a repeating phrase with a little noise; windows drawn from the request's
// random bits (as the example trainer does). Stateless, so a resumed run draws what the
// uninterrupted one would.
struct text_source {
  std::vector<std::int32_t> text;
  std::int32_t poison = -1;  // when >= 0, every id of request 0 of the next call is this
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
      x[t] = poison >= 0 ? poison : text[at + t];
      y[t] = text[at + t + 1];
    }
  }
};

mb::trainer_options options() {
  mb::trainer_options o;
  o.seed = 3;
  o.lr = mb::cosine_lr{1e-2, 1e-3, 2, 20};
  o.clip = 1.0;
  return o;
}

// Two micro-batches of 2 per step (accumulation), no recompute; the optimizer's state counted.
template <typename Model, typename Optimizer = mb::adamw<typename Model::storage_type>>
mb::training_plan plan_for(const Model& m, mb::schedule_choice s = {mb::schedule_choice::kind::none, 0},
                           std::size_t threads = 1) {
  mb::plan_options o;
  o.threads = threads;
  o.head_chunk = 16;
  o.accumulation = 2;
  o.optimizer_policy = mb::optimizer_of<Optimizer>();
  return mb::make_plan(m, {2, effective.seq}, s, o);
}

template <typename T>
std::vector<T> download(const T* src, std::size_t n) {
  std::vector<T> v(n);
  mb::cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  mb::cuda_check(cudaMemcpy(v.data(), src, n * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy");
  return v;
}

struct run_result {
  std::vector<double> losses;
  std::vector<std::uint8_t> weights;
  std::size_t measured_peak = 0, predicted_peak = 0, reserved_peak = 0, predicted_reserve = 0;
};

run_result run_device(std::size_t steps, mb::schedule_choice s = {mb::schedule_choice::kind::none, 0},
                      bool print_plan = false) {
  const gpu_model m(config());
  mb::cuda_executor ex;
  device_budget alloc(budget_bytes);
  text_source src;
  run_result r;
  {
    mb::trainer<gpu_model, device_budget> t(m, effective, plan_for(m, s), alloc, ex, options());
    if (print_plan) std::fputs(t.plan().table().c_str(), stdout);
    for (std::size_t k = 0; k < steps; ++k) r.losses.push_back(t.step(src).loss);
    r.weights = mbt::to_bytes(download(t.weights(), t.parameter_elements()));
    // Every block of the trainer is served on its executor's stream (safe stream defaults).
    CHECK(alloc.upstream().block_stream(t.weights()) == mb::stream_of(ex));
    r.predicted_peak = t.largest_predicted_peak();
    r.predicted_reserve = t.largest_predicted_reserve();
  }
  r.measured_peak = alloc.stats().peak_requested;
  r.reserved_peak = alloc.stats().peak_reserved;
  CHECK(alloc.stats().requested == 0);  // every byte given back
  return r;
}

void against_cpu() {
  constexpr std::size_t steps = 20;
  const run_result g = run_device(steps, {mb::schedule_choice::kind::none, 0}, true);
  const cpu_model cm(config());
  mb::thread_pool pool(2);
  host_budget alloc(budget_bytes);
  text_source src;
  std::vector<double> want;
  {
    mb::trainer<cpu_model, host_budget> t(cm, effective, plan_for(cm, {mb::schedule_choice::kind::none, 0}, 2), alloc,
                                          pool, options());
    for (std::size_t k = 0; k < steps; ++k) want.push_back(t.step(src).loss);
  }
  for (std::size_t k = 0; k < steps; ++k) std::printf("  step %2zu: cpu %.9f  gpu %.9f\n", k + 1, want[k], g.losses[k]);
  mbt::close("step 1's loss, device vs cpu", {g.losses[0]}, {want[0]}, 1e-5);
  mbt::close("20 steps' losses, device vs cpu", g.losses, want, 1e-3);
  CHECK(g.losses.back() < g.losses.front());  // it learns
}

// adamw8bit on the device (its own kernel over the CPU's state layout): the CPU and GPU runs agree
// as adamw's do (a moment that differs in its last bit may take the neighbouring code, one step of
// the dynamic map, which the bound absorbs); the same seed gives the same bits; the measured peak
// is the prediction, which counts the 8-bit state (2 bytes per parameter + scales).
void adamw8bit_against_cpu() {
  using opt_gpu = mb::adamw8bit<float, 256>;
  constexpr std::size_t steps = 20;
  const auto device_run = [&] {
    const gpu_model m(config());
    mb::cuda_executor ex;
    device_budget alloc(budget_bytes);
    text_source src;
    run_result r;
    {
      mb::trainer<gpu_model, device_budget, mb::null_monitor, mb::local_communicator, opt_gpu> t(
          m, effective, plan_for<gpu_model, opt_gpu>(m), alloc, ex, options());
      for (std::size_t k = 0; k < steps; ++k) r.losses.push_back(t.step(src).loss);
      r.weights = mbt::to_bytes(download(t.weights(), t.parameter_elements()));
      r.predicted_peak = t.largest_predicted_peak();
    }
    r.measured_peak = alloc.stats().peak_requested;
    return r;
  };
  const run_result g = device_run(), g2 = device_run();
  const cpu_model cm(config());
  mb::thread_pool pool(2);
  host_budget alloc(budget_bytes);
  text_source src;
  std::vector<double> want;
  {
    mb::trainer<cpu_model, host_budget, mb::null_monitor, mb::local_communicator, mb::adamw8bit<float, 256>> t(
        cm, effective, plan_for<cpu_model, mb::adamw8bit<float, 256>>(cm, {mb::schedule_choice::kind::none, 0}, 2),
        alloc, pool, options());
    for (std::size_t k = 0; k < steps; ++k) want.push_back(t.step(src).loss);
  }
  for (std::size_t k = 0; k < steps; k += 4) std::printf("  step %2zu: cpu %.9f  gpu %.9f\n", k + 1, want[k], g.losses[k]);
  mbt::close("adamw8bit: step 1's loss, device vs cpu", {g.losses[0]}, {want[0]}, 1e-5);
  // The first 8 steps within 1e-3, as fp32's 20; all 20 within 5e-2. An 8-bit code whose value
  // lands on the other side of a rounding boundary (device and CPU sum in other orders: the
  // last bits of a gradient differ) moves its weight by a whole quantization step, absmax/127,
  // where fp32 moves it by an ulp: from there the two runs are two trainings, not one. Seen on
  // the H200, 2026-11-29: 1.4e-5 at step 5, 8e-5 at 13, then 4.1e-3 at 17 and 7.7e-3 at 20.
  // A wiring fault (a span skipped, a wrong scale) shows from step 2 on, far past 1e-3. The
  // kernel itself is the CPU's bit for bit (tests/emulation, adamw8bit).
  const std::size_t early = 8;
  mbt::close("adamw8bit: 8 steps' losses, device vs cpu",
             std::vector<double>(g.losses.begin(), g.losses.begin() + early),
             std::vector<double>(want.begin(), want.begin() + early), 1e-3);
  mbt::close("adamw8bit: 20 steps' losses, device vs cpu", g.losses, want, 5e-2);
  CHECK(g.losses.back() < g.losses.front());
  CHECK(g.weights == g2.weights);
  std::printf("  adamw8bit: measured peak %zu B, predicted %zu B\n", g.measured_peak, g.predicted_peak);
  CHECK(g.measured_peak == g.predicted_peak);
}

void repeatable_and_exact() {
  const run_result a = run_device(4), b = run_device(4);
  CHECK(a.weights == b.weights);
  for (std::size_t k = 0; k < a.losses.size(); ++k) CHECK(mbt::same_bits(a.losses[k], b.losses[k]));
  std::printf("  measured peak %zu B, predicted %zu B; reserved peak %zu B, stated reserve %zu B\n", a.measured_peak,
              a.predicted_peak, a.reserved_peak, a.predicted_reserve);
  CHECK(a.measured_peak == a.predicted_peak);
  CHECK(a.reserved_peak <= a.predicted_reserve);
  // Every schedule: the same bits as none (the step's arithmetic does not depend on what is kept).
  for (const mb::schedule_choice s : {mb::schedule_choice{mb::schedule_choice::kind::full, 0},
                                      mb::schedule_choice{mb::schedule_choice::kind::every, 2}}) {
    const run_result r = run_device(4, s);
    std::printf("  %s: measured peak %zu B, predicted %zu B\n", s.name().c_str(), r.measured_peak, r.predicted_peak);
    CHECK(r.measured_peak == r.predicted_peak);
    CHECK(r.weights == a.weights);
  }
}

void resume_and_corruption() {
  const std::string path = "test_cuda_trainer.ckpt";
  const gpu_model m(config());
  mb::cuda_executor ex;
  device_budget alloc(budget_bytes);
  text_source src;
  const run_result whole = run_device(6);
  {
    mb::trainer<gpu_model, device_budget> t(m, effective, plan_for(m), alloc, ex, options());
    for (int k = 0; k < 3; ++k) (void)t.step(src);
    t.save(path);
  }
  {
    mb::trainer<gpu_model, device_budget> t(m, effective, plan_for(m), alloc, ex, options());
    (void)t.load(path);
    std::vector<double> rest;
    for (int k = 0; k < 3; ++k) rest.push_back(t.step(src).loss);
    for (int k = 0; k < 3; ++k) CHECK(mbt::same_bits(rest[k], whole.losses[3 + k]));
    CHECK(mbt::to_bytes(download(t.weights(), t.parameter_elements())) == whole.weights);

    // One flipped byte in the middle of the file: refused, nothing of the trainer changed.
    std::vector<char> bytes;
    {
      std::ifstream in(path, std::ios::binary);
      bytes.assign(std::istreambuf_iterator<char>(in), {});
    }
    bytes[bytes.size() / 2] ^= 0x5a;
    const std::string bad = "test_cuda_trainer_bad.ckpt";
    std::ofstream(bad, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    const std::uint64_t steps = t.steps_done();
    EXPECT_THROW(mb::corrupt_checkpoint, (void)t.load(bad));
    CHECK(t.steps_done() == steps);
    CHECK(mbt::to_bytes(download(t.weights(), t.parameter_elements())) == whole.weights);
    std::remove(bad.c_str());
  }
  std::remove(path.c_str());
}

// Optimizer offload on the device (ZeRO-Offload's placement): AdamW's state and two staging
// buckets in pinned host memory, the update on the host (the CPU optimizer's arithmetic) bucket
// by bucket. Against the in-place device run: the same tolerance as against the CPU trainer (the
// update's arithmetic is the CPU's, the gradients the device's); both spaces' measured peaks equal
// their predictions; an offloaded run's checkpoint loads into an in-place trainer byte for byte.
void offloaded_optimizer() {
  constexpr std::size_t steps = 20, bucket = 4096;  // many buckets, the last one short
  const std::string path = "test_cuda_trainer_offload.ckpt";
  const run_result in_place = run_device(steps);
  const gpu_model m(config());
  mb::cuda_executor ex;
  device_budget alloc(budget_bytes);
  mb::budget_allocator<mb::cuda_pinned_allocator> pinned(budget_bytes);
  text_source src;
  mb::trainer_options o = options();
  o.host = mb::host_allocator_ref(pinned);
  mb::plan_options po;
  po.head_chunk = 16;
  po.accumulation = 2;
  po.optimizer_policy = mb::optimizer_of<mb::adamw<float>>();
  po.offload = {true, bucket, 0};
  const mb::training_plan plan =
      mb::make_plan(m, {2, effective.seq}, mb::schedule_choice{mb::schedule_choice::kind::none, 0}, po);
  CHECK(plan.offload_optimizer && plan.optimizer == 0 && plan.host_peak() > 0);
  CHECK(m.parameter_elements() > 4 * bucket);
  std::vector<double> losses;
  std::vector<std::uint8_t> weights, state;
  std::size_t host_predicted = 0, predicted = 0;
  {
    mb::trainer<gpu_model, device_budget> t(m, effective, plan, alloc, ex, o);
    for (std::size_t k = 0; k < steps; ++k) losses.push_back(t.step(src).loss);
    weights = mbt::to_bytes(download(t.weights(), t.parameter_elements()));
    const auto* h = static_cast<const std::uint8_t*>(t.optimizer_state());  // host memory: read in place
    state.assign(h, h + mb::adamw<float>::state_bytes(t.parameter_elements()));
    host_predicted = t.largest_predicted_host_peak();
    predicted = t.largest_predicted_peak();
    t.save(path);
  }
  for (std::size_t k = 0; k < steps; k += 4) {
    std::printf("  step %2zu: in place %.9f  offloaded %.9f\n", k + 1, in_place.losses[k], losses[k]);
  }
  mbt::close("offloaded: step 1's loss, against in place", {losses[0]}, {in_place.losses[0]}, 1e-5);
  mbt::close("offloaded: 20 steps' losses, against in place", losses, in_place.losses, 1e-3);
  std::printf("  offloaded: device measured %zu B, predicted %zu B; host (pinned) measured %zu B, predicted %zu B\n",
              alloc.stats().peak_requested, predicted, pinned.stats().peak_requested, host_predicted);
  CHECK(alloc.stats().peak_requested == predicted);
  CHECK(pinned.stats().peak_requested == host_predicted);
  CHECK(pinned.stats().requested == 0 && alloc.stats().requested == 0);  // every byte given back
  {  // the checkpoint into an in-place trainer: its weights and its device state are the saved bytes
    mb::trainer<gpu_model, device_budget> t(m, effective, plan_for(m), alloc, ex, options());
    (void)t.load(path);
    CHECK(mbt::to_bytes(download(t.weights(), t.parameter_elements())) == weights);
    const std::vector<std::uint8_t> loaded =
        download(static_cast<const std::uint8_t*>(t.optimizer_state()), state.size());
    CHECK(loaded == state);
  }
  std::remove(path.c_str());
}

// A CPU run's checkpoint goes on on the device (the same state layout, byte for byte): the next
// step's loss is the CPU run's next step's within one step's fp32 tolerance.
void cpu_checkpoint_on_device() {
  const std::string path = "test_cuda_trainer_cpu.ckpt";
  const cpu_model cm(config());
  mb::thread_pool pool(2);
  host_budget halloc(budget_bytes);
  text_source src;
  double cpu_next = 0;
  {
    mb::trainer<cpu_model, host_budget> t(cm, effective, plan_for(cm, {mb::schedule_choice::kind::none, 0}, 2), halloc,
                                          pool, options());
    for (int k = 0; k < 3; ++k) (void)t.step(src);
    t.save(path);
    cpu_next = t.step(src).loss;
  }
  const gpu_model gm(config());
  mb::cuda_executor ex;
  device_budget alloc(budget_bytes);
  mb::trainer<gpu_model, device_budget> t(gm, effective, plan_for(gm), alloc, ex, options());
  (void)t.load(path);
  CHECK(t.steps_done() == 3);
  mbt::close("step 4 after a CPU checkpoint, device vs cpu", {t.step(src).loss}, {cpu_next}, 1e-5);
  std::remove(path.c_str());
}

void bad_token_refused() {
  const gpu_model m(config());
  mb::cuda_executor ex;
  device_budget alloc(budget_bytes);
  text_source src;
  mb::trainer<gpu_model, device_budget> t(m, effective, plan_for(m), alloc, ex, options());
  (void)t.step(src);
  const std::uint64_t pos = t.data_position();
  const auto w0 = mbt::to_bytes(download(t.weights(), t.parameter_elements()));
  src.poison = 72;  // the vocabulary's size: one past the last id
  const std::string msg = EXPECT_THROW(mb::invalid_argument, (void)t.step(src));
  CHECK(msg.find("tokens[0]") != std::string::npos);
  CHECK(t.data_position() == pos);
  CHECK(t.steps_done() == 1);
  CHECK(mbt::to_bytes(download(t.weights(), t.parameter_elements())) == w0);
  src.poison = -1;
  (void)t.step(src);
  CHECK(t.steps_done() == 2);
}

// Another holder takes real device memory; the budget learns it as external bytes (what a monitor
// reading cudaMemGetInfo reports) and the trainer retries under a plan that fits beside it. A
// budget over cudaMalloc itself (no cache): its reserve is the requested bytes at cudaMalloc's
// 256-byte granularity, so plans with less recompute really do reserve more.
void pressure_retry() {
  using plain_budget = mb::budget_allocator<mb::cuda_device_allocator>;
  const gpu_model m(config());
  mb::cuda_executor ex;
  text_source src;
  const mb::training_plan none = plan_for(m);
  mb::plan_options o;
  o.head_chunk = 16;
  o.accumulation = 4;
  const mb::training_plan small = mb::make_plan(m, {1, effective.seq}, mb::schedule_choice{mb::schedule_choice::kind::full, 0}, o);
  plain_budget alloc(budget_bytes);
  const auto reserve = mb::reserve_model(m, alloc);
  const std::size_t r_none = reserve(none), r_small = reserve(small);
  std::printf("  reserve: none %zu B, full at micro-batch 1 %zu B\n", r_none, r_small);
  CHECK(r_small < r_none);
  // none at 90% of the limit; the foreign bytes leave room under the limit for the smaller plan but
  // not for none. (Not the emergency threshold: the monitor reads usage at its check points, and
  // the peak lies inside an op's workspace, between them; on an H200 a foreign figure aimed at the
  // threshold was never seen at a check point, and the step ran on under none.)
  const std::size_t limit = r_none / 9 * 10;
  alloc.set_limit(limit);
  mb::trainer<gpu_model, plain_budget, mb::pressure_monitor<>> t(m, effective, none, alloc, ex, options(),
                                                                 mb::pressure_monitor<>{});
  (void)t.step(src);
  CHECK(t.plan().schedule.k == mb::schedule_choice::kind::none);
  const std::size_t foreign = limit - r_none + (r_none - r_small) / 2;
  mbt::device_buffer<std::uint8_t> taken(foreign);  // real device memory, outside the budget
  alloc.set_external(foreign);
  const mb::step_result r = t.step(src);
  std::printf("  foreign %zu B; replans: %zu; plan now %s x %zu, reserved peak %zu B of %zu B beside them\n", foreign,
              r.replans.size(), t.plan().schedule.name().c_str(), t.plan().micro.batch, t.plan().budgeted_peak(),
              limit - foreign);
  for (const mb::replan_event& e : r.replans) std::printf("    %s\n", e.describe().c_str());
  CHECK(!r.replans.empty());
  CHECK(t.plan().budgeted_peak() + foreign <= limit);
  CHECK(t.steps_done() == 2);
  CHECK(alloc.stats().peak_requested <= t.largest_predicted_peak());
}

// device_others_probe sees what another holder takes on the device (a real cudaMalloc outside
// the budget: at least its size, at most a few pages more), and not what the budget's own stack
// takes; foreign_memory_monitor puts the probe's figure into the budget at a check point.
void probe_sees_device_memory() {
  using plain_budget = mb::budget_allocator<mb::cuda_device_allocator>;
  plain_budget alloc(budget_bytes);
  const mb::device_others_probe probe{mb::cuda_current_device()};
  const std::size_t before = probe(alloc);
  constexpr std::size_t taken = std::size_t{64} << 20, slack = std::size_t{4} << 20;
  {
    mbt::device_buffer<std::uint8_t> other(taken);
    const std::size_t during = probe(alloc);
    void* mine = alloc.allocate(std::size_t{32} << 20, mb::default_alignment, mb::memory_tag::other);
    const std::size_t with_mine = probe(alloc);
    std::printf("  others: %zu B before, %zu B with 64 MiB taken outside, %zu B with 32 MiB more of ours\n", before,
                during, with_mine);
    CHECK(during >= before + taken);
    CHECK(during <= before + taken + slack);
    CHECK(with_mine <= during + slack);  // ours is not others' (cudaMalloc's rounding aside)
    mb::foreign_memory_monitor mon(mb::pressure_monitor<>{}, probe);
    (void)mon.check<mb::check_point::before_forward>(alloc);
    CHECK(alloc.external() >= before + taken);
    CHECK(mon.probes() == 1);
    alloc.deallocate(mine, std::size_t{32} << 20, mb::default_alignment, mb::memory_tag::other);
  }
}

// Host only (no device needed, so it runs wherever this builds, CI included): the plan of a device
// model holds the trainer's step buffers as persistent bytes, the same for every plan of the
// batch, and the reserve replay makes the trainer's request for them; a CPU model's plan has none.
void device_plan_on_host() {
  const gpu_model m(config());
  const mb::training_plan p = plan_for(m);
  const std::size_t tokens = effective.batch * effective.seq;  // micro-batch 2 × accumulation 2
  std::printf("device plan on the host: step buffers %zu B for %zu tokens\n", p.step_buffers, tokens);
  CHECK(p.step_buffers == mb::gpu::step_buffers(tokens, m.parameter_elements()).bytes);
  CHECK(p.step_buffers >= 2 * tokens * sizeof(std::int32_t) + sizeof(double));
  mb::plan_options o;
  o.head_chunk = 16;
  o.accumulation = 4;
  const mb::training_plan q =
      mb::make_plan(m, {1, effective.seq}, mb::schedule_choice{mb::schedule_choice::kind::full, 0}, o);
  CHECK(q.step_buffers == p.step_buffers);
  CHECK(p.timeline.front().live_before == p.weights + p.gradients + p.optimizer + p.step_buffers);
  CHECK(p.table().find("step buffers") != std::string::npos);
  const mb::run_requests r = mb::record_run(m, p);
  CHECK(r.prefix.size() == 4);
  if (r.prefix.size() == 4) {
    CHECK(r.prefix[3].bytes == p.step_buffers);
    CHECK(r.prefix[3].tag == mb::memory_tag::other);
  }
  const cpu_model cm(config());
  const mb::training_plan c = plan_for(cm, {mb::schedule_choice::kind::none, 0}, 2);
  CHECK(c.step_buffers == 0);
  CHECK(mb::record_run(cm, c).prefix.size() == 3);
}

}  // namespace

int main() {
  // The host part first: a failure there fails the test even without a device.
  device_plan_on_host();
  if (mbt::failures != 0) return 1;
  static const mbt::test_case cases[] = {
      {"trainer cuda_backend fp32: 20 steps agree with the CPU trainer", against_cpu},
      {"trainer cuda_backend: same seed same bits, measured peak = predicted", repeatable_and_exact},
      {"trainer cuda_backend adamw8bit: agrees with the CPU trainer, same bits, peak = predicted",
       adamw8bit_against_cpu},
      {"trainer cuda_backend: resume = uninterrupted, corrupt checkpoint refused", resume_and_corruption},
      {"trainer cuda_backend: a CPU checkpoint resumes on the device", cpu_checkpoint_on_device},
      {"trainer cuda_backend: optimizer offload to pinned memory agrees, both peaks = predicted", offloaded_optimizer},
      {"trainer cuda_backend: a bad token id is refused before the upload", bad_token_refused},
      {"trainer cuda_backend: foreign device memory makes the step retry under a stricter plan", pressure_retry},
      {"device_others_probe sees device memory taken outside the budget, not the budget's own", probe_sees_device_memory},
  };
  return mbt::run_suite("test_cuda_trainer", cases);
}
