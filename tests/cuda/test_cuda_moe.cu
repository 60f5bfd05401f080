// moe_mlp<P, cuda_backend> against moe_mlp<P> (the CPU backend) on the same inputs in the same
// process: y, dx, the four weight gradients (accumulated onto nonzero starting values) and the
// forward's statistics (the drops and the fullest expert's rows exactly, the balancing loss);
// top-1 and top-2, capacity that binds and that does not, an adversarial router that sends every
// token to expert 0 (drops at capacity, idle experts); bit-identical repeats; no device memory
// beyond the caller's; typed errors. Without a device it exits 77 (skipped).
//
// Tolerances, normwise (mbt::close_normwise), floor 1e-2:
//   fp32: TF32 off; sums in other orders (cuBLASLt's blocking, the device's expf in the softmax):
//         1e-5, the other fp32 layers' bound.
//   bf16: the CUDA layer rounds the values that feed a GEMM to bf16 where the CPU keeps fp32
//         (backend/cuda/moe.cuh), as the SwiGLU MLP does: 4e-2 on y, 6.25e-2 (16·2^-8) on the
//         gradients, test_cuda_mlp's and the TTT tests' bounds. The routing itself is fp32 on both
//         sides; a near tie between two experts could choose differently, so the inputs keep the
//         router's margins wide (its weights scaled up).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "cuda_test_support.cuh"

namespace mb = membound;

namespace {

using mbt::as_double;
using mbt::random_values;

struct inputs {
  mb::moe_shape s;
  std::vector<float> wr, wg, wu, wd, x, dy, g0r, g0g, g0u, g0d;
};

// bf16 values in float (both sides read the same rounded numbers); one_expert: a constant first
// feature and a router that reads it for expert 0 alone.
template <typename S>
inputs make_inputs(const mb::moe_shape& s, bool one_expert) {
  const std::size_t N = s.tokens(), C = s.width, F = s.hidden, E = s.experts;
  const auto f = [](const std::vector<S>& v) { return std::vector<float>(v.begin(), v.end()); };
  inputs in{s,
            f(random_values<S>(C * E, 1, 2.0f)),
            f(random_values<S>(E * C * F, 2, 0.3f)),
            f(random_values<S>(E * C * F, 3, 0.3f)),
            f(random_values<S>(E * F * C, 4, 0.3f)),
            f(random_values<S>(N * C, 5, 1.0f)),
            f(random_values<S>(N * C, 6, 1.0f)),
            f(random_values<S>(C * E, 7, 0.1f)),
            f(random_values<S>(E * C * F, 8, 0.1f)),
            f(random_values<S>(E * C * F, 9, 0.1f)),
            f(random_values<S>(E * F * C, 10, 0.1f))};
  if (one_expert) {  // the other features' logits spread far less than expert 0's margin of 20
    for (std::size_t t = 0; t < N; ++t) in.x[t * C] = 1.0f;
    for (std::size_t i = 0; i < C * E; ++i) in.wr[i] *= 0.05f;
    for (std::size_t e = 0; e < E; ++e) in.wr[e] = e == 0 ? 20.0f : 0.0f;
  }
  return in;
}

template <typename S>
std::vector<S> to(const std::vector<float>& v) {
  std::vector<S> r(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) r[i] = mb::from_accum<S>(v[i]);
  return r;
}

struct result {
  std::vector<double> y, dx, gr, gg, gu, gd;
  mb::moe_stats stats;
};

template <typename Layer>
result run_cpu(const inputs& in) {
  using S = typename Layer::storage_type;
  const mb::moe_shape& s = in.s;
  const std::size_t N = s.tokens(), C = s.width;
  mb::thread_pool pool(1);
  const auto wr = to<S>(in.wr), wg = to<S>(in.wg), wu = to<S>(in.wu), wd = to<S>(in.wd), x = to<S>(in.x),
             dy = to<S>(in.dy);
  auto gr = to<S>(in.g0r), gg = to<S>(in.g0g), gu = to<S>(in.g0u), gd = to<S>(in.g0d);
  std::vector<S> y(N * C), dx(N * C);
  mbt::host_buffer saved(Layer::saved_bytes(s));
  mbt::host_buffer ws(std::max(Layer::forward_workspace_bytes(s, 1), Layer::backward_workspace_bytes(s, 1)));
  const typename Layer::weights w{wr.data(), wg.data(), wu.data(), wd.data()};
  result r;
  Layer::forward(s, w, x.data(), y.data(), saved.data(), saved.size(), ws.data(), ws.size(), pool, &r.stats);
  Layer::backward(s, w, x.data(), saved.data(), saved.size(), dy.data(), dx.data(),
                  {gr.data(), gg.data(), gu.data(), gd.data()}, ws.data(), ws.size(), pool);
  r.y = as_double(y);
  r.dx = as_double(dx);
  r.gr = as_double(gr);
  r.gg = as_double(gg);
  r.gu = as_double(gu);
  r.gd = as_double(gd);
  return r;
}

template <typename Layer>
result run_gpu(const inputs& in, mb::cuda_executor& ex, bool* same_memory) {
  using S = typename Layer::storage_type;
  const mb::moe_shape& s = in.s;
  const std::size_t N = s.tokens(), C = s.width;
  mbt::device_buffer<S> wr(to<S>(in.wr)), wg(to<S>(in.wg)), wu(to<S>(in.wu)), wd(to<S>(in.wd)), x(to<S>(in.x)),
      dy(to<S>(in.dy)), gr(to<S>(in.g0r)), gg(to<S>(in.g0g)), gu(to<S>(in.g0u)), gd(to<S>(in.g0d)), y(N * C),
      dx(N * C);
  mbt::device_buffer<std::uint8_t> saved(Layer::saved_bytes(s));
  const std::size_t fws = Layer::forward_workspace_bytes(s, 1), bws = Layer::backward_workspace_bytes(s, 1);
  mbt::device_buffer<std::uint8_t> ws(std::max(fws, bws));
  const typename Layer::weights w{wr.get(), wg.get(), wu.get(), wd.get()};
  std::size_t free_before = 0, free_after = 0, total = 0;
  mb::cuda_check(cudaMemGetInfo(&free_before, &total), "cudaMemGetInfo");
  result r;
  Layer::forward(s, w, x.get(), y.get(), saved.get(), saved.size(), ws.get(), fws, ex, &r.stats);
  Layer::backward(s, w, x.get(), saved.get(), saved.size(), dy.get(), dx.get(), {gr.get(), gg.get(), gu.get(), gd.get()},
                  ws.get(), bws, ex);
  ex.synchronize();
  mb::cuda_check(cudaMemGetInfo(&free_after, &total), "cudaMemGetInfo");
  if (same_memory != nullptr) *same_memory = free_after == free_before;
  r.y = as_double(y.download());
  r.dx = as_double(dx.download());
  r.gr = as_double(gr.download());
  r.gg = as_double(gg.download());
  r.gu = as_double(gu.download());
  r.gd = as_double(gd.download());
  return r;
}

// The gradients' own parts (less the starting values), compared by their own norm.
std::vector<double> less(const std::vector<double>& g, const std::vector<float>& g0) {
  std::vector<double> d(g.size());
  for (std::size_t i = 0; i < g.size(); ++i) d[i] = g[i] - static_cast<double>(g0[i]);
  return d;
}

template <typename P>
void compare(const char* name, const mb::moe_shape& s, double tol_y, double tol_g, bool one_expert = false) {
  using cpu_l = mb::moe_mlp<P>;
  using gpu_l = mb::moe_mlp<P, mb::cuda_backend>;
  using S = typename cpu_l::storage_type;
  const inputs in = make_inputs<S>(s, one_expert);
  mb::cuda_executor ex;
  const result want = run_cpu<cpu_l>(in);
  run_gpu<gpu_l>(in, ex, nullptr);  // warm-up: cuBLASLt's plans, the kernels' modules
  bool same_memory = false;
  const result got = run_gpu<gpu_l>(in, ex, &same_memory);
  const result again = run_gpu<gpu_l>(in, ex, nullptr);
  std::printf("  %s\n", name);
  CHECK(same_memory);  // nothing beyond saved + workspace
  CHECK(got.y == again.y && got.dx == again.dx && got.gr == again.gr && got.gg == again.gg &&
        got.gu == again.gu && got.gd == again.gd);  // bit-identical repeats
  CHECK(got.stats.choices == want.stats.choices && got.stats.dropped == want.stats.dropped &&
        got.stats.tokens_dropped == want.stats.tokens_dropped &&
        got.stats.max_expert_rows == want.stats.max_expert_rows);
  CHECK(std::fabs(got.stats.aux_loss - want.stats.aux_loss) <= 1e-5 * std::max(1e-3, want.stats.aux_loss));
  if (one_expert) CHECK(want.stats.dropped >= s.tokens() - mb::moe_capacity(s));  // every first choice on expert 0
  std::printf("    %zu of %zu choices dropped, aux %.6g\n", got.stats.dropped, got.stats.choices, got.stats.aux_loss);
  constexpr double floor = 1e-2;
  mbt::close_normwise("y", got.y, want.y, tol_y, floor);
  mbt::close_normwise("dx", got.dx, want.dx, tol_g, floor);
  mbt::close_normwise("d router", less(got.gr, in.g0r), less(want.gr, in.g0r), tol_g, floor);
  mbt::close_normwise("d w_gate", less(got.gg, in.g0g), less(want.gg, in.g0g), tol_g, floor);
  mbt::close_normwise("d w_up", less(got.gu, in.g0u), less(want.gu, in.g0u), tol_g, floor);
  mbt::close_normwise("d w_down", less(got.gd, in.g0d), less(want.gd, in.g0d), tol_g, floor);
}

const mb::moe_shape top2{.batch = 2, .seq = 37, .width = 64, .hidden = 96, .experts = 8, .top_k = 2,
                         .capacity_factor = 1.25, .aux_loss_weight = 0.01};

void fp32_matches_cpu() {
  compare<mb::fp32_precision>("top-2, capacity 1.25", top2, 1e-5, 1e-5);
  mb::moe_shape s = top2;
  s.capacity_factor = 0.5;
  compare<mb::fp32_precision>("top-2, capacity 0.5 (drops)", s, 1e-5, 1e-5);
  s.capacity_factor = 0;
  s.renormalize = false;
  compare<mb::fp32_precision>("top-2, no capacity, gates as the router's", s, 1e-5, 1e-5);
  compare<mb::fp32_precision>("top-1",
                              {.batch = 1, .seq = 50, .width = 32, .hidden = 64, .experts = 4, .top_k = 1,
                               .capacity_factor = 1.0, .aux_loss_weight = 0.02},
                              1e-5, 1e-5);
}

void adversarial_routing() {
  compare<mb::fp32_precision>("every token to expert 0", top2, 1e-5, 1e-5, true);
}

void bf16_within_bound() {
  compare<mb::bf16_precision>("bf16, top-2, capacity 1.25", top2, 4e-2, 6.25e-2);
  compare<mb::bf16_precision>("bf16, every token to expert 0", top2, 4e-2, 6.25e-2, true);
}

void typed_errors() {
  using gpu_l = mb::moe_mlp<mb::fp32_precision, mb::cuda_backend>;
  mb::moe_shape s = top2;
  s.top_k = 3;
  EXPECT_THROW(mb::invalid_argument, gpu_l::check(s));
  s = top2;
  s.capacity_factor = 1e-9;  // not one slot per expert
  EXPECT_THROW(mb::invalid_argument, gpu_l::check(s));
  mb::cuda_executor ex;
  const std::size_t fws = gpu_l::forward_workspace_bytes(top2, 1);
  CHECK(fws >= mb::gpu::gemm_workspace_bytes(ex));
  mbt::device_buffer<float> x(top2.tokens() * top2.width), y(top2.tokens() * top2.width), w(1 << 20);
  mbt::device_buffer<std::uint8_t> saved(gpu_l::saved_bytes(top2)), ws(fws);
  const gpu_l::weights wt{w.get(), w.get(), w.get(), w.get()};
  EXPECT_THROW(mb::workspace_too_small,
               gpu_l::forward(top2, wt, x.get(), y.get(), saved.get(), saved.size(), ws.get(), fws - 1, ex));
  EXPECT_THROW(mb::invalid_argument,
               gpu_l::forward(top2, {nullptr, w.get(), w.get(), w.get()}, x.get(), y.get(), saved.get(), saved.size(),
                              ws.get(), fws, ex));
}

}  // namespace

int main() {
  static const mbt::test_case cases[] = {
      {"moe_mlp cuda_backend fp32 equals the CPU backend", fp32_matches_cpu},
      {"moe_mlp cuda_backend: every token to one expert (drops at capacity)", adversarial_routing},
      {"moe_mlp cuda_backend bf16 within the stated bound", bf16_within_bound},
      {"moe_mlp cuda_backend typed errors", typed_errors},
  };
  return mbt::run_suite("test_cuda_moe", cases);
}
