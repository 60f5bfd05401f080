// swiglu_mlp<P, cuda_backend> against swiglu_mlp<P> (the CPU backend) on the same inputs in the
// same process: output, saved pre-activations, dx and the accumulated weight gradients, for fp32
// and bf16 storage; bit-identical repeats; no device memory beyond the caller's (cudaMemGetInfo
// around a warm forward + backward); typed errors. Without a device it exits 77 (skipped).
//
// Tolerances, |got − want| / (|want| + floor) with floor = 1e-2 (outputs are O(1)–O(10); the floor
// keeps cancellations near zero from dominating):
//   fp32: TF32 is off, so both sides do fp32 products and sums in another order: a few ulps per
//         GEMM over K ≤ 96, compounded over three GEMMs and SiLU: 1e-5 relative.
//   bf16: the device rounds act, dact, da and db to bf16 (2^-8 relative each) where the CPU keeps
//         fp32, and products chain up to three of them: 4e-2.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "cuda_test_support.cuh"

namespace mb = membound;

namespace {

using mbt::random_values;
using mbt::as_double;
using mbt::same_bits;
using mbt::from_bytes;
using mbt::to_bytes;

struct run_result {
  std::vector<std::uint8_t> y, saved, dx, gg, gu, gd;  // raw bytes, for bit comparisons
};

template <typename Precision>
void compare(const mb::mlp_shape& s, double tolerance) {
  using cpu_mlp = mb::swiglu_mlp<Precision>;
  using gpu_mlp = mb::swiglu_mlp<Precision, mb::cuda_backend>;
  using S = typename cpu_mlp::storage_type;
  const std::size_t N = s.batch * s.seq, C = s.width, F = s.hidden;
  const auto x = random_values<S>(N * C, 1, 1.0f);
  const auto wg = random_values<S>(C * F, 2, 0.3f);
  const auto wu = random_values<S>(C * F, 3, 0.3f);
  const auto wd = random_values<S>(F * C, 4, 0.3f);
  const auto dy = random_values<S>(N * C, 5, 1.0f);
  const auto g0 = random_values<S>(C * F, 6, 0.1f);  // gradients accumulate onto these

  // CPU reference.
  mb::thread_pool pool(1);
  std::vector<S> y_c(N * C), dx_c(N * C), gg_c = g0, gu_c = g0, gd_c = g0;
  mbt::host_buffer saved_c(cpu_mlp::saved_bytes(s));
  std::vector<std::uint8_t> ws_c(std::max(cpu_mlp::forward_workspace_bytes(s, 1),
                                          cpu_mlp::backward_workspace_bytes(s, 1)) + 256);
  void* wsp = ws_c.data();
  std::size_t wsn = ws_c.size();
  wsp = std::align(256, wsn - 256, wsp, wsn);
  const typename cpu_mlp::weights wc{wg.data(), wu.data(), wd.data()};
  cpu_mlp::forward(s, wc, x.data(), y_c.data(), saved_c.data(), saved_c.size(), wsp, wsn, pool);
  cpu_mlp::backward(s, wc, x.data(), saved_c.data(), saved_c.size(), dy.data(), dx_c.data(),
                    {gg_c.data(), gu_c.data(), gd_c.data()}, wsp, wsn, pool);

  // GPU, twice from the same state.
  mb::cuda_executor ex;
  mbt::device_buffer<S> dx_(x), dwg(wg), dwu(wu), dwd(wd), ddy(dy), dy_(N * C), ddx(N * C);
  mbt::device_buffer<S> dgg(g0), dgu(g0), dgd(g0);
  mbt::device_buffer<std::uint8_t> dsaved(gpu_mlp::saved_bytes(s));
  const std::size_t fws = gpu_mlp::forward_workspace_bytes(s, 1);
  const std::size_t bws = gpu_mlp::backward_workspace_bytes(s, 1);
  mbt::device_buffer<std::uint8_t> dws(std::max(fws, bws));
  const typename gpu_mlp::weights wgpu{dwg.get(), dwu.get(), dwd.get()};
  auto run = [&] {
    dgg.upload(g0);
    dgu.upload(g0);
    dgd.upload(g0);
    gpu_mlp::forward(s, wgpu, dx_.get(), dy_.get(), dsaved.get(), dsaved.size(), dws.get(), fws, ex);
    gpu_mlp::backward(s, wgpu, dx_.get(), dsaved.get(), dsaved.size(), ddy.get(), ddx.get(),
                      {dgg.get(), dgu.get(), dgd.get()}, dws.get(), bws, ex);
    ex.synchronize();
    return run_result{to_bytes(dy_.download()), dsaved.download(), to_bytes(ddx.download()),
                      to_bytes(dgg.download()), to_bytes(dgu.download()), to_bytes(dgd.download())};
  };
  const run_result first = run();

  // Lazy module loading may allocate on the first launch: measure the second.
  std::size_t free_before = 0, free_after = 0, total = 0;
  mb::cuda_check(cudaMemGetInfo(&free_before, &total), "cudaMemGetInfo");
  const run_result second = run();
  mb::cuda_check(cudaMemGetInfo(&free_after, &total), "cudaMemGetInfo");
  CHECK(free_after == free_before);

  CHECK(first.y == second.y);
  CHECK(first.saved == second.saved);
  CHECK(first.dx == second.dx);
  CHECK(first.gg == second.gg && first.gu == second.gu && first.gd == second.gd);

  constexpr double floor = 1e-2;
  mbt::close_normwise("y", as_double(from_bytes<S>(first.y)), as_double(y_c), tolerance, floor);
  mbt::close_normwise("saved a, b", as_double(from_bytes<S>(first.saved)),
             as_double(from_bytes<S>(saved_c)), tolerance, floor);
  mbt::close_normwise("dx", as_double(from_bytes<S>(first.dx)), as_double(dx_c), tolerance, floor);
  mbt::close_normwise("dWg", as_double(from_bytes<S>(first.gg)), as_double(gg_c), tolerance, floor);
  mbt::close_normwise("dWu", as_double(from_bytes<S>(first.gu)), as_double(gu_c), tolerance, floor);
  mbt::close_normwise("dWd", as_double(from_bytes<S>(first.gd)), as_double(gd_c), tolerance, floor);
}

void fp32_matches_cpu() {
  compare<mb::fp32_precision>({2, 37, 24, 64}, 1e-5);
  compare<mb::fp32_precision>({1, 1, 8, 16}, 1e-5);
  compare<mb::fp32_precision>({3, 5, 96, 40}, 1e-5);
}

void bf16_matches_cpu() {
  compare<mb::bf16_precision>({2, 37, 24, 64}, 4e-2);
  compare<mb::bf16_precision>({1, 16, 64, 96}, 4e-2);
}

void typed_errors() {
  using gpu_mlp = mb::swiglu_mlp<mb::fp32_precision, mb::cuda_backend>;
  const mb::mlp_shape s{1, 4, 8, 16};
  mb::cuda_executor ex;
  mbt::device_buffer<float> x(32), y(32), w(128);
  mbt::device_buffer<std::uint8_t> saved(gpu_mlp::saved_bytes(s));
  const std::size_t fws = gpu_mlp::forward_workspace_bytes(s, 1);
  mbt::device_buffer<std::uint8_t> ws(fws);
  const gpu_mlp::weights wt{w.get(), w.get(), w.get()};
  EXPECT_THROW(mb::workspace_too_small,
               gpu_mlp::forward(s, wt, x.get(), y.get(), saved.get(), saved.size(), ws.get(),
                                fws - 1, ex));
  EXPECT_THROW(mb::invalid_argument,
               gpu_mlp::forward(s, wt, nullptr, y.get(), saved.get(), saved.size(), ws.get(), fws,
                                ex));
  EXPECT_THROW(mb::invalid_argument, gpu_mlp::check({1, 4, 0, 16}));
  // The workspace holds cuBLASLt's on every architecture: the plan never depends on the device.
  CHECK(fws >= mb::gpu::gemm_workspace_bytes(ex));
}

}  // namespace

int main() {
  static const mbt::test_case cases[] = {
      {"swiglu_mlp cuda_backend fp32 equals the CPU backend", fp32_matches_cpu},
      {"swiglu_mlp cuda_backend bf16 within the stated bound", bf16_matches_cpu},
      {"swiglu_mlp cuda_backend typed errors", typed_errors},
  };
  return mbt::run_suite("test_cuda_mlp", cases);
}
