// model<..., cuda_backend> against the same model on cpu_backend, in the same process: one
// micro-batch's loss and every parameter's gradient, for a hybrid of all four mixers (TTT-Linear,
// attention with grouped-query heads, Mamba, TTT-MLP), fp32 and bf16 storage; on the device,
// every schedule gives the same bits as `none`, repeats give the same bits, loss() gives
// forward_backward's loss, and the peak of requested bytes measured through a device budget
// equals the plan's prediction to the byte, and the reserved peak of each device stack (budget
// over the caching allocator, plain and planned, and over the expandable arena) equals
// reserve_model's, to the byte; bad input is refused before anything is allocated.
// Without a device it exits 77 (skipped).
//
// Tolerances (normwise over each parameter tensor, close_normwise's metric):
//   fp32: both backends compute in fp32 with sums in other orders (cuBLASLt's tiles, CUB's
//         block reductions, the device's expf/logf, TTT's lane groups). The layer tests measured
//         ≤ 7.8e-7 per layer on an H200; a step chains eight layers forward and back, and small
//         gradients (norm scales, TTT's rates and token offsets) are sums of cancelling terms, so
//         the gradients are held against the CPU model in float64, where the fp32 CPU model
//         itself is 5.9e-5 off at worst (TTT-MLP's tok_offset; every other tensor ≤ 1.5e-5):
//         2e-4 per tensor. 1e-5 on the loss, against the fp32 CPU model.
//   bf16: every layer's output and gradient is rounded to bf16 once on both sides but from values
//         that differ in the last fp32 bits, and the device keeps some GEMM inputs in bf16 where
//         the CPU keeps fp32 (backend/cuda/mlp.cuh, backend/cuda/lm_head.cuh): 5e-2 per tensor (the layers' 4e-2
//         plus the chain), 1e-2 on the loss.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda_test_support.cuh"
#include "../support/small_models.hpp"

#include "membound/memory/budget.hpp"
#include "membound/memory/caching_allocator.hpp"
#include "membound/memory/system_allocator.hpp"
#include "membound/model/planner.hpp"
#include "membound/model/reserve_plan.hpp"

namespace mb = membound;

namespace {

template <typename P, typename B>
using hybrid = mb::model<mb::embedding<P>, mb::block<mb::ttt_linear<P, B>>, mb::block<mb::attention<P, B>>,
                         mb::block<mb::mamba<P, B>>, mb::block<mb::ttt_mlp<P, B>>, mb::lm_head<P, B>>;
template <typename P>
using cpu_model = hybrid<P, mb::cpu_backend>;
template <typename P>
using gpu_model = hybrid<P, mb::cuda_backend>;

using device_budget = mb::budget_allocator<mb::caching_allocator<mb::cuda_device_allocator>>;
constexpr std::size_t budget_bytes = std::size_t{4} << 30;

mb::model_config config() {
  mb::model_config c;
  c.vocab = 72;  // not a multiple of 64: the head's last tile is partial
  c.width = 64;
  c.heads = 4;
  c.kv_heads = 2;
  return c;
}

using tokens = membound_test::token_data;
constexpr auto make_tokens = membound_test::make_token_data;

// Device copies of host arrays through the budget (weights, gradients: what a trainer holds), or
// outside it (tokens: the caller's upload buffers).
template <typename T>
void upload(T* dst, const T* src, std::size_t n) {
  mb::cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  mb::cuda_check(cudaMemcpy(dst, src, n * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy");
  mb::cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}
template <typename T>
std::vector<T> download(const T* src, std::size_t n) {
  std::vector<T> v(n);
  mb::cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");  // the executor's stream is non-blocking
  mb::cuda_check(cudaMemcpy(v.data(), src, n * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy");
  return v;
}

struct gpu_step {
  double loss = 0, eval_loss = 0;
  std::vector<std::uint8_t> grads;  // raw bytes: the bit comparisons
  std::size_t measured_peak = 0, live_after = 0;
};

// One micro-batch on the device under plan p, the weights and gradients allocated through the
// budget as a trainer would (the plan's base: weights, gradients, optimizer state, step buffers).
// k: the executor's kernel choices.
template <typename Model>
gpu_step run_gpu(const Model& m, const mb::training_plan& p, const std::vector<typename Model::storage_type>& w_host,
                 const tokens& t, bool with_eval = false, const mb::gpu::kernel_choices& k = {}) {
  using S = typename Model::storage_type;
  const std::size_t n = m.parameter_elements(), wb = m.weight_bytes();
  mbt::device_buffer<std::int32_t> ids(t.tokens), targets(t.targets);
  mb::cuda_executor ex;
  ex.set_kernels(k);
  device_budget alloc(budget_bytes);
  mb::stream_view mem(alloc, mb::stream_of(ex));  // as the trainer: every block on ex's stream
  S* w = static_cast<S*>(mem.allocate(wb, mb::default_alignment, mb::memory_tag::weights));
  S* g = static_cast<S*>(mem.allocate(wb, mb::default_alignment, mb::memory_tag::gradients));
  void* opt = p.optimizer == 0 ? nullptr : mem.allocate(p.optimizer, mb::default_alignment, mb::memory_tag::optimizer);
  // The trainer's step buffers (its token upload, the norm's partials), held as it holds them.
  void* sb = mem.allocate(p.step_buffers, mb::default_alignment, mb::memory_tag::other);
  upload(w, w_host.data(), n);
  mb::cuda_check(cudaMemset(g, 0, wb), "cudaMemset");
  mb::cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  gpu_step r;
  r.loss = m.forward_backward(w, g, ids.get(), targets.get(), p.micro, p.ops, p.head_chunk, 1.0, alloc, ex);
  r.measured_peak = alloc.stats().peak_requested;
  const auto gv = download(g, n);
  r.grads = mbt::to_bytes(gv);
  if (with_eval) r.eval_loss = m.loss(w, ids.get(), targets.get(), p.micro, p.head_chunk, alloc, ex);
  mb::cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  alloc.deallocate(sb, p.step_buffers, mb::default_alignment, mb::memory_tag::other);
  if (opt != nullptr) alloc.deallocate(opt, p.optimizer, mb::default_alignment, mb::memory_tag::optimizer);
  alloc.deallocate(g, wb, mb::default_alignment, mb::memory_tag::gradients);
  alloc.deallocate(w, wb, mb::default_alignment, mb::memory_tag::weights);
  r.live_after = alloc.stats().requested;
  return r;
}

template <typename Model>
std::vector<typename Model::storage_type> cpu_step(const Model& m, mb::batch_shape b, const std::vector<typename Model::storage_type>& w,
                                                   const tokens& t, double& loss) {
  using S = typename Model::storage_type;
  mb::plan_options o;
  o.threads = 2;
  o.head_chunk = 16;
  const mb::training_plan p = mb::make_plan(m, b, mb::schedules::none{}, o);
  std::vector<S> g(m.parameter_elements(), mb::from_accum<S>(0.0f));
  mb::system_allocator alloc;
  mb::thread_pool pool(2);
  loss = m.forward_backward(w.data(), g.data(), t.tokens.data(), t.targets.data(), b, p.ops, p.head_chunk, 1.0, alloc, pool);
  return g;
}

// The two models lay their parameters out identically (the layout depends on the shapes only).
template <typename P>
bool same_layout(const cpu_model<P>& c, const gpu_model<P>& d) {
  if (c.parameters().size() != d.parameters().size() || c.parameter_elements() != d.parameter_elements()) return false;
  for (std::size_t k = 0; k < c.parameters().size(); ++k) {
    const auto &a = c.parameters()[k], &e = d.parameters()[k];
    if (a.name != e.name || a.offset != e.offset || a.count != e.count) return false;
  }
  return true;
}

template <typename P>
void against_cpu(double tolerance, double loss_tolerance, const mb::gpu::kernel_choices& k = {}) {
  using S = typename P::storage_type;
  const mb::batch_shape b{2, 40};  // T = 40: TTT's last mini-batch is short, attention's last tile too
  const cpu_model<P> cm(config());
  const gpu_model<P> gm(config());
  CHECK(same_layout(cm, gm));
  std::vector<S> w(cm.parameter_elements());
  cm.init_weights(w.data(), 11);
  const tokens t = make_tokens(b, config().vocab, 5);

  double cpu_loss = 0;
  const std::vector<S> want = cpu_step(cm, b, w, t, cpu_loss);
  mb::plan_options o;
  o.head_chunk = 16;
  const mb::training_plan p = mb::make_plan(gm, b, mb::schedules::none{}, o);
  const gpu_step r = run_gpu(gm, p, w, t, true, k);
  const std::vector<S> got = mbt::from_bytes<S>(r.grads);

  std::printf("  loss: cpu %.9g, gpu %.9g (eval %.9g)\n", cpu_loss, r.loss, r.eval_loss);
  CHECK(std::abs(r.loss - cpu_loss) <= loss_tolerance * std::abs(cpu_loss));
  CHECK(mbt::same_bits(r.eval_loss, r.loss));  // loss() is forward_backward's loss, bit for bit
  // fp32: the exact gradients, from the CPU model in float64 over the same weights (its layout
  // differs: parameter by parameter).
  constexpr bool fp32 = std::is_same_v<P, mb::fp32_precision>;
  std::vector<double> exact;
  if constexpr (fp32) {
    const cpu_model<mb::fp64_precision> cm64(config());
    CHECK(cm64.parameters().size() == cm.parameters().size());
    for (std::size_t k = 0; k < cm.parameters().size(); ++k) {
      CHECK(cm64.parameters()[k].name == cm.parameters()[k].name);
      CHECK(cm64.parameters()[k].count == cm.parameters()[k].count);
    }
    std::vector<double> w64(cm64.parameter_elements(), 0.0);
    for (std::size_t k = 0; k < cm.parameters().size(); ++k)
      std::copy_n(w.begin() + static_cast<std::ptrdiff_t>(cm.parameters()[k].offset), cm.parameters()[k].count,
                  w64.begin() + static_cast<std::ptrdiff_t>(cm64.parameters()[k].offset));
    double loss64 = 0;
    const std::vector<double> g64 = cpu_step(cm64, b, w64, t, loss64);
    for (std::size_t k = 0; k < cm.parameters().size(); ++k) {
      const auto from = g64.begin() + static_cast<std::ptrdiff_t>(cm64.parameters()[k].offset);
      exact.insert(exact.end(), from, from + static_cast<std::ptrdiff_t>(cm.parameters()[k].count));
    }
  }
  std::size_t at = 0;  // in `exact`: the parameters one after another
  for (const mb::param_entry& e : cm.parameters()) {
    const std::vector<S> gs(got.begin() + static_cast<std::ptrdiff_t>(e.offset),
                            got.begin() + static_cast<std::ptrdiff_t>(e.offset + e.count));
    const std::vector<S> ws(want.begin() + static_cast<std::ptrdiff_t>(e.offset),
                            want.begin() + static_cast<std::ptrdiff_t>(e.offset + e.count));
    if constexpr (fp32) {
      const std::vector<double> xs(exact.begin() + static_cast<std::ptrdiff_t>(at),
                                   exact.begin() + static_cast<std::ptrdiff_t>(at + e.count));
      mbt::close_normwise(e.name.c_str(), mbt::as_double(gs), xs, tolerance);
    } else {
      mbt::close_normwise(e.name.c_str(), mbt::as_double(gs), mbt::as_double(ws), tolerance);
    }
    at += e.count;
  }
  CHECK(r.measured_peak == p.peak_bytes);
  CHECK(r.live_after == 0);
}

void fp32_against_cpu() { against_cpu<mb::fp32_precision>(2e-4, 1e-5); }
void bf16_against_cpu() { against_cpu<mb::bf16_precision>(5e-2, 1e-2); }

// Every schedule on the device: the same loss and gradient bits as `none`, and the budget's
// measured peak equal to each plan's prediction. A repeat of `none` gives the same bits.
template <typename P>
void schedules_on_device(const mb::gpu::kernel_choices& k = {}) {
  using S = typename P::storage_type;
  using K = mb::schedule_choice::kind;
  const mb::batch_shape b{2, 32};
  const gpu_model<P> m(config());
  std::vector<S> w(m.parameter_elements());
  m.init_weights(w.data(), 3);
  const tokens t = make_tokens(b, config().vocab, 9);
  mb::plan_options o;
  o.head_chunk = 24;
  const mb::training_plan base = mb::make_plan(m, b, mb::schedule_choice{K::none, 0}, o);
  const gpu_step ref = run_gpu(m, base, w, t, false, k);
  CHECK(ref.measured_peak == base.peak_bytes);
  const gpu_step again = run_gpu(m, base, w, t, false, k);
  CHECK(again.grads == ref.grads);
  CHECK(mbt::same_bits(again.loss, ref.loss));
  const std::vector<mb::schedule_choice> all{{K::full, 0}, {K::every, 2}, {K::every, 3}, {K::binomial, 1}, {K::binomial, 2}};
  for (const mb::schedule_choice& s : all) {
    const mb::training_plan p = mb::make_plan(m, b, s, o);
    const gpu_step r = run_gpu(m, p, w, t, false, k);
    std::printf("  %s: predicted peak %zu B, measured %zu B, same bits as none: %s\n", s.name().c_str(), p.peak_bytes,
                r.measured_peak, r.grads == ref.grads && mbt::same_bits(r.loss, ref.loss) ? "yes" : "no");
    CHECK(r.measured_peak == p.peak_bytes);
    CHECK(r.grads == ref.grads);
    CHECK(mbt::same_bits(r.loss, ref.loss));
    CHECK(r.live_after == 0);
  }
}
void fp32_schedules() { schedules_on_device<mb::fp32_precision>(); }

// A mixture of experts in a model on the device (attention with 4 experts, top-2, capacity 0.75:
// choices dropped; a Mamba block after it): the loss and every gradient against the CPU model's,
// the measured peak equal to the plan's (every buffer holds the routing's worst case, moe_rows),
// and every schedule the same bits as `none` (a recomputed block routes its tokens the same way).
template <typename P, typename B>
using moe_hybrid = mb::model<mb::embedding<P>, mb::block<mb::attention<P, B>, mb::moe_ffn>, mb::block<mb::mamba<P, B>>,
                             mb::lm_head<P, B>>;
void moe_model_against_cpu() {
  using P = mb::fp32_precision;
  using K = mb::schedule_choice::kind;
  mb::model_config c = config();
  c.moe.experts = 4;
  c.moe.top_k = 2;
  c.moe.capacity_factor = 0.75;
  c.moe.aux_loss_weight = 0.01;
  const mb::batch_shape b{2, 40};
  const moe_hybrid<P, mb::cpu_backend> cm(c);
  const moe_hybrid<P, mb::cuda_backend> gm(c);
  std::vector<float> w(cm.parameter_elements());
  cm.init_weights(w.data(), 11);
  const tokens t = make_tokens(b, c.vocab, 5);
  double cpu_loss = 0;
  const std::vector<float> want = cpu_step(cm, b, w, t, cpu_loss);
  mb::plan_options o;
  o.head_chunk = 16;
  const mb::training_plan base = mb::make_plan(gm, b, mb::schedule_choice{K::none, 0}, o);
  const gpu_step r = run_gpu(gm, base, w, t);
  const std::vector<float> got = mbt::from_bytes<float>(r.grads);
  std::printf("  loss (the balancing loss in it): cpu %.9g, gpu %.9g\n", cpu_loss, r.loss);
  CHECK(std::abs(r.loss - cpu_loss) <= 1e-5 * std::abs(cpu_loss));
  for (const mb::param_entry& e : cm.parameters()) {
    const std::vector<float> gs(got.begin() + static_cast<std::ptrdiff_t>(e.offset),
                                got.begin() + static_cast<std::ptrdiff_t>(e.offset + e.count));
    const std::vector<float> ws(want.begin() + static_cast<std::ptrdiff_t>(e.offset),
                                want.begin() + static_cast<std::ptrdiff_t>(e.offset + e.count));
    mbt::close_normwise(e.name.c_str(), mbt::as_double(gs), mbt::as_double(ws), 1e-4);
  }
  CHECK(r.measured_peak == base.peak_bytes);
  CHECK(r.live_after == 0);
  for (const mb::schedule_choice& s : {mb::schedule_choice{K::full, 0}, mb::schedule_choice{K::every, 2}}) {
    const mb::training_plan p = mb::make_plan(gm, b, s, o);
    const gpu_step q = run_gpu(gm, p, w, t);
    std::printf("  %s: predicted peak %zu B, measured %zu B\n", s.name().c_str(), p.peak_bytes, q.measured_peak);
    CHECK(q.measured_peak == p.peak_bytes);
    CHECK(q.grads == r.grads);
    CHECK(mbt::same_bits(q.loss, r.loss));
  }
}
void bf16_schedules() { schedules_on_device<mb::bf16_precision>(); }
// The two bf16 checks above run attention's default, the mma.sync kernels (attention_mma.cuh),
// where the device can (on sm_80 and up they must be the ones that run). This case runs them
// again on the fallback (WMMA forward, SIMT backward) that older devices and head_dim > 128 get:
// the same bounds, every schedule the same bits, measured = predicted (neither set of kernels
// takes memory of its own, so the plan does not change).
void bf16_fallback_attention() {
  mb::cuda_executor ex;
  int major = 0;
  mb::cuda_check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, ex.device()),
                 "cudaDeviceGetAttribute");
  CHECK(ex.kernels().attention == mb::gpu::attention_kernels::tensor_core);  // the default
  if (major >= 8) {
    CHECK(mb::gpu::detail::use_mma<mb::bf16>(ex, config().width / config().heads));  // the default really runs them
  } else {
    std::printf("  note: sm_%d: the tensor-core kernels need sm_80; the cases above ran the fallback\n", major * 10);
  }
  const mb::gpu::kernel_choices fallback{.attention = mb::gpu::attention_kernels::simt_wmma};
  ex.set_kernels(fallback);
  CHECK(!mb::gpu::detail::use_mma<mb::bf16>(ex, config().width / config().heads));
  against_cpu<mb::bf16_precision>(5e-2, 1e-2, fallback);
  schedules_on_device<mb::bf16_precision>(fallback);
}

// Two optimizer steps' requests and an evaluation on a device stack, as a trainer makes them
// (weights, gradients, optimizer state and step buffers first; no optimizer arithmetic runs).
template <typename Model, typename Alloc>
void run_training_requests(const Model& m, const mb::training_plan& p, Alloc& alloc, const tokens& t) {
  using S = typename Model::storage_type;
  mbt::device_buffer<std::int32_t> ids(t.tokens), targets(t.targets);
  mb::cuda_executor ex;
  // The model serves its blocks on ex's stream; the persistent blocks go there too, as the
  // trainer's do, so that one stream's pools hold the step (the plan's replay has one stream).
  mb::stream_view mem(alloc, mb::stream_of(ex));
  if constexpr (mb::has_planned_layer<Alloc>) {
    if (auto* layer = mb::planned_layer(alloc)) layer->set_layout(mb::plan_layout(m, p), mem.stream());
  }
  const std::size_t wb = m.weight_bytes();
  auto* w = static_cast<S*>(mem.allocate(wb, mb::default_alignment, mb::memory_tag::weights));
  auto* g = static_cast<S*>(mem.allocate(wb, mb::default_alignment, mb::memory_tag::gradients));
  void* o = mem.allocate(p.optimizer, mb::default_alignment, mb::memory_tag::optimizer);
  void* sb = mem.allocate(p.step_buffers, mb::default_alignment, mb::memory_tag::other);
  std::vector<S> h(m.parameter_elements());
  m.init_weights(h.data(), 5);
  upload(w, h.data(), h.size());
  mb::cuda_check(cudaMemset(g, 0, wb), "cudaMemset");
  mb::cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  for (int step = 0; step < 2; ++step) {
    for (std::size_t k = 0; k < p.accumulation; ++k)
      (void)m.forward_backward(w, g, ids.get(), targets.get(), p.micro, p.ops, p.head_chunk, 1.0, alloc, ex);
    (void)m.loss(w, ids.get(), targets.get(), p.micro, p.head_chunk, alloc, ex);
  }
  mb::cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  alloc.deallocate(sb, p.step_buffers, mb::default_alignment, mb::memory_tag::other);
  alloc.deallocate(o, p.optimizer, mb::default_alignment, mb::memory_tag::optimizer);
  alloc.deallocate(g, wb, mb::default_alignment, mb::memory_tag::gradients);
  alloc.deallocate(w, wb, mb::default_alignment, mb::memory_tag::weights);
}

// The reserve a plan states for a device stack is what that stack reserves: segments of the
// caching allocator (512-byte rounding, small and large pools, cudaMalloc's over-allocation for
// its 512-byte segment alignment) or the arena's granules, measured by the stack's own statistics.
void reserve_on_device_stacks() {
  using K = mb::schedule_choice::kind;
  const mb::batch_shape b{2, 32};
  const gpu_model<mb::bf16_precision> m(config());
  const tokens t = make_tokens(b, config().vocab, 4);
  auto check_stack = [&](const char* name, auto& alloc) {
    for (const mb::schedule_choice& s : {mb::schedule_choice{K::none, 0}, mb::schedule_choice{K::every, 2},
                                         mb::schedule_choice{K::full, 0}}) {
      for (std::size_t accumulation : {1, 2}) {
        mb::plan_options o;
        o.head_chunk = 16;
        o.accumulation = accumulation;
        mb::training_plan p = mb::make_plan(m, b, s, o);
        const std::size_t predicted = mb::reserve_model(m, alloc)(p);
        alloc.reset_peaks();
        run_training_requests(m, p, alloc, t);
        const auto st = alloc.stats();
        std::printf("  %s, %s, %zu micro-batch(es): requested peak %zu (plan %zu), reserved peak %zu (plan %zu)\n",
                    name, s.name().c_str(), accumulation, st.peak_requested, p.peak_bytes, st.peak_reserved, predicted);
        CHECK(st.peak_requested == p.peak_bytes);
        CHECK(st.peak_reserved == predicted);
        CHECK(st.requested == 0);
        if constexpr (requires { alloc.release_cached(); }) alloc.release_cached();
      }
    }
  };
  {
    device_budget a(budget_bytes);
    check_stack("budget<caching<cuda_device_allocator>>", a);
  }
  {
    mb::caching_options co;
    co.planned = true;
    mb::budget_allocator<mb::caching_allocator<mb::cuda_device_allocator>> a(budget_bytes, co);
    check_stack("budget<caching<cuda_device_allocator>, planned>", a);
  }
  {
    const std::size_t g = mb::cuda_virtual_memory{}.granularity();
    mb::budget_allocator<mb::cuda_expandable_arena> a(budget_bytes, mb::expandable_arena_options{(budget_bytes / g) * g});
    check_stack("budget<expandable_arena<cuda_virtual_memory>>", a);
  }
}

// A schedule that drops a backward is refused before anything is allocated; a budget one byte
// below the step's peak throws out_of_memory and gives every byte of the step back.
void bad_input() {
  const mb::batch_shape b{1, 16};
  const gpu_model<mb::fp32_precision> m(config());
  mb::plan_options o;
  o.head_chunk = 16;
  mb::training_plan p = mb::make_plan(m, b, mb::schedules::none{}, o);
  const tokens t = make_tokens(b, config().vocab, 1);
  mbt::device_buffer<std::int32_t> ids(t.tokens), targets(t.targets);
  mb::cuda_executor ex;
  const std::size_t wb = m.weight_bytes();
  {
    device_budget alloc(budget_bytes);
    void* w = alloc.allocate(wb, mb::default_alignment, mb::memory_tag::weights);
    void* g = alloc.allocate(wb, mb::default_alignment, mb::memory_tag::gradients);
    std::vector<mb::chain_op> ops = p.ops;
    ops.pop_back();  // the last backward
    EXPECT_THROW(mb::invalid_argument, m.forward_backward(static_cast<const float*>(w), static_cast<float*>(g), ids.get(),
                                                          targets.get(), b, ops, p.head_chunk, 1.0, alloc, ex));
    CHECK(alloc.stats().requested == 2 * wb);
    EXPECT_THROW(mb::invalid_argument, m.forward_backward(nullptr, static_cast<float*>(g), ids.get(), targets.get(), b,
                                                          p.ops, p.head_chunk, 1.0, alloc, ex));
    alloc.deallocate(g, wb, mb::default_alignment, mb::memory_tag::gradients);
    alloc.deallocate(w, wb, mb::default_alignment, mb::memory_tag::weights);
  }
  {
    device_budget alloc(p.peak_bytes - p.optimizer - 1);  // no optimizer state here
    void* w = alloc.allocate(wb, mb::default_alignment, mb::memory_tag::weights);
    void* g = alloc.allocate(wb, mb::default_alignment, mb::memory_tag::gradients);
    mb::cuda_check(cudaMemset(w, 0, wb), "cudaMemset");
    mb::cuda_check(cudaMemset(g, 0, wb), "cudaMemset");
    mb::cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    EXPECT_THROW(mb::out_of_memory, m.forward_backward(static_cast<const float*>(w), static_cast<float*>(g), ids.get(),
                                                         targets.get(), b, p.ops, p.head_chunk, 1.0, alloc, ex));
    CHECK(alloc.stats().requested == 2 * wb);
    alloc.deallocate(g, wb, mb::default_alignment, mb::memory_tag::gradients);
    alloc.deallocate(w, wb, mb::default_alignment, mb::memory_tag::weights);
  }
  // Host ids are checked by the caller before the upload, with the model's own check.
  std::vector<std::int32_t> bad = t.tokens;
  bad[3] = static_cast<std::int32_t>(config().vocab);
  const std::string msg = EXPECT_THROW(mb::invalid_argument, m.check_tokens(bad.data(), bad.size()));
  CHECK(msg.find("tokens[3]") != std::string::npos);
}

// The next-token logits (the example's sampling) on the device against the CPU model's, both
// sequences of a batch; every activation through the budget and given back.
template <typename P>
void next_token_logits_against_cpu(double tolerance) {
  using S = typename P::storage_type;
  const mb::batch_shape b{2, 40};
  const cpu_model<P> cm(config());
  const gpu_model<P> gm(config());
  std::vector<S> w(cm.parameter_elements());
  cm.init_weights(w.data(), 13);
  const tokens t = make_tokens(b, config().vocab, 9);
  std::vector<double> want(b.batch * config().vocab), got(want.size());
  {
    mb::system_allocator host;
    mb::thread_pool pool(2);
    cm.next_token_logits(w.data(), t.tokens.data(), b, want.data(), host, pool);
  }
  mbt::device_buffer<std::int32_t> ids(t.tokens);
  mb::cuda_executor ex;
  device_budget alloc(budget_bytes);
  auto* dw = static_cast<S*>(alloc.allocate(gm.weight_bytes(), mb::default_alignment, mb::memory_tag::weights));
  upload(dw, w.data(), w.size());
  gm.next_token_logits(dw, ids.get(), b, got.data(), alloc, ex);
  alloc.deallocate(dw, gm.weight_bytes(), mb::default_alignment, mb::memory_tag::weights);
  mbt::close_normwise("logits", got, want, tolerance);
  CHECK(alloc.stats().requested == 0);
}
// The layers' own bounds (fp32, bf16), as the gradients' comparison uses: the same sums in
// another order on the device.
void fp32_next_token_logits() { next_token_logits_against_cpu<mb::fp32_precision>(1e-4); }
void bf16_next_token_logits() { next_token_logits_against_cpu<mb::bf16_precision>(5e-2); }

// Decoding on the device, one token per sequence at a time, against the CPU model's decoding at
// every position of both sequences; the state and the workspace are the only bytes it takes
// besides the weights. Tolerances as next_token_logits'.
template <typename P>
void decoding_against_cpu(double tolerance) {
  using S = typename P::storage_type;
  const std::size_t B = 2, T = 21, V = config().vocab;  // 21: a partial TTT mini-batch at the end
  const cpu_model<P> cm(config());
  const gpu_model<P> gm(config());
  std::vector<S> w(cm.parameter_elements());
  cm.init_weights(w.data(), 13);
  const tokens t = make_tokens({B, T}, V, 9);
  std::vector<std::int32_t> columns(B * T);  // step k's tokens at [k·B, (k + 1)·B)
  for (std::size_t k = 0; k < T; ++k)
    for (std::size_t s = 0; s < B; ++s) columns[k * B + s] = t.tokens[s * T + k];
  std::vector<double> want(T * B * V), got(want.size());
  {
    mb::system_allocator host;
    mb::thread_pool pool(2);
    const std::size_t sb = cm.decode_state_bytes(B, T), wsb = cm.decode_workspace_bytes(B, T, pool.size());
    void* state = host.allocate(sb, mb::default_alignment);
    void* ws = host.allocate(wsb, mb::default_alignment);
    auto d = cm.start_decoding(w.data(), state, sb, B, T, pool);
    for (std::size_t k = 0; k < T; ++k) cm.decode_step(w.data(), d, &columns[k * B], &want[k * B * V], ws, wsb, pool);
    host.deallocate(ws, wsb, mb::default_alignment);
    host.deallocate(state, sb, mb::default_alignment);
  }
  mbt::device_buffer<std::int32_t> ids(columns);
  mb::cuda_executor ex;
  device_budget alloc(budget_bytes);
  const std::size_t wb = gm.weight_bytes(), sb = gm.decode_state_bytes(B, T), wsb = gm.decode_workspace_bytes(B, T, 1);
  auto* dw = static_cast<S*>(alloc.allocate(wb, mb::default_alignment, mb::memory_tag::weights));
  upload(dw, w.data(), w.size());
  void* state = alloc.allocate(sb, mb::default_alignment, mb::memory_tag::activations);
  void* ws = alloc.allocate(wsb, mb::default_alignment, mb::memory_tag::workspace);
  auto d = gm.start_decoding(dw, state, sb, B, T, ex);
  for (std::size_t k = 0; k < T; ++k) gm.decode_step(dw, d, ids.get() + k * B, &got[k * B * V], ws, wsb, ex);
  CHECK(alloc.stats().peak_requested == wb + sb + wsb);
  alloc.deallocate(ws, wsb, mb::default_alignment, mb::memory_tag::workspace);
  alloc.deallocate(state, sb, mb::default_alignment, mb::memory_tag::activations);
  alloc.deallocate(dw, wb, mb::default_alignment, mb::memory_tag::weights);
  mbt::close_normwise("decoded logits", got, want, tolerance);
}
void fp32_decoding() { decoding_against_cpu<mb::fp32_precision>(1e-4); }
void bf16_decoding() { decoding_against_cpu<mb::bf16_precision>(5e-2); }

}  // namespace

int main() {
  static const mbt::test_case cases[] = {
      {"model cuda_backend fp32 next_token_logits equals the CPU model's (the example's sample)", fp32_next_token_logits},
      {"model cuda_backend bf16 next_token_logits within bf16 bounds", bf16_next_token_logits},
      {"model cuda_backend fp32 decoding token by token equals the CPU model's decoding", fp32_decoding},
      {"model cuda_backend bf16 decoding within bf16 bounds", bf16_decoding},
      {"model cuda_backend fp32 equals the CPU model (loss, every gradient, peak)", fp32_against_cpu},
      {"model cuda_backend bf16 equals the CPU model within bf16 bounds", bf16_against_cpu},
      {"model cuda_backend fp32: every schedule the same bits, measured = predicted", fp32_schedules},
      {"model cuda_backend bf16: every schedule the same bits, measured = predicted", bf16_schedules},
      {"model cuda_backend bf16 on attention's fallback kernels (WMMA/SIMT): bounds, bits, measured = predicted",
       bf16_fallback_attention},
      {"model cuda_backend: reserve_model states each device stack's reserved peak", reserve_on_device_stacks},
      {"model cuda_backend with a mixture of experts equals the CPU model; every schedule the same bits, measured = predicted",
       moe_model_against_cpu},
      {"model cuda_backend refuses bad input and gives every byte back", bad_input},
  };
  return mbt::run_suite("test_cuda_model", cases);
}
