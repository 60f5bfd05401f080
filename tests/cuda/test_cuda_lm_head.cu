// lm_head<P, cuda_backend> against lm_head<P> (the CPU backend) on the same inputs in the same
// process: the summed loss, dx, and dnorm and dW accumulated onto nonzero gradients, for fp32 and
// bf16 storage, chunks of 1, 7 and at least the row count, and vocabularies that are not a multiple
// of 8; loss() against loss_backward's loss; bit-identical repeats; no device memory beyond the
// caller's (cudaMemGetInfo around a warm call); typed errors; a bad device target gives a NaN loss
// and no fault. Without a device it exits 77 (skipped).
//
// Tolerances, |got − want| / (|want| + floor) with floor = 5e-2 · max|want| of the array (values
// far below the array's largest are judged against it: their error comes from sums whose terms
// are that large, not from their own size):
//   fp32: TF32 is off, so both sides do fp32 products, the softmax in fp32 and the loss in double,
//         with sums in another order and the device's expf/logf: 1e-5 relative (loss: 1e-6).
//   bf16: inputs and the rounded xn are the same bf16 on both sides (up to a rare rounding flip
//         from rstd's last bit); the device rounds each chunk's dlogits to bf16 (2^-9 relative)
//         where the CPU keeps them in fp32, then dxn, dx, dnorm and dW are rounded to bf16 once on
//         both sides (one bf16 ulp is up to 2^-7 relative): 4e-2, the MLP's bound (loss: 1e-3).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cuda_test_support.cuh"

namespace mb = membound;

namespace {

using mbt::random_values;
using mbt::as_double;
using mbt::same_bits;

void close_scaled(const char* name, const std::vector<double>& got, const std::vector<double>& want,
                  double tolerance) {
  mbt::close_normwise(name, got, want, tolerance, 5e-2 * mbt::max_abs(want) + std::numeric_limits<double>::min());
}

std::vector<std::int32_t> make_targets(std::size_t N, std::size_t V) {
  std::vector<std::int32_t> t(N);
  for (std::size_t i = 0; i < N; ++i) t[i] = static_cast<std::int32_t>((i * 13 + 5) % V);
  return t;
}

template <typename S>
struct gpu_result {
  double loss = 0, loss_only = 0;
  std::vector<S> dx, dnorm, dw;
};

template <typename Precision>
void compare(const mb::lm_head_shape& s, double tolerance, double loss_tolerance) {
  using cpu_head = mb::lm_head<Precision>;
  using gpu_head = mb::lm_head<Precision, mb::cuda_backend>;
  using S = typename cpu_head::storage_type;
  const std::size_t N = s.rows, C = s.width, V = s.vocab;
  const auto x = random_values<S>(N * C, 1, 1.0f);
  const auto norm = random_values<S>(C, 2, 0.5f, 1.0f);  // gains in [0.5, 1.5]
  const auto w = random_values<S>(V * C, 3, 0.5f);
  const auto dnorm0 = random_values<S>(C, 4, 0.1f);      // gradients accumulate onto these
  const auto dw0 = random_values<S>(V * C, 5, 0.1f);
  const auto targets = make_targets(N, V);
  const double scale = 1.0 / static_cast<double>(N);

  // CPU reference.
  mb::thread_pool pool(1);
  std::vector<S> dx_c(N * C), dnorm_c = dnorm0, dw_c = dw0;
  mbt::host_buffer hws(cpu_head::workspace_bytes(s, 1));
  const double loss_c = cpu_head::loss_backward(s, {norm.data(), w.data()}, x.data(), targets.data(),
                                                scale, dx_c.data(), {dnorm_c.data(), dw_c.data()},
                                                hws.data(), hws.size(), pool);

  // GPU, twice from the same state.
  mb::cuda_executor ex;
  mbt::device_buffer<S> d_x(x), d_norm(norm), d_w(w), d_dx(N * C), d_dnorm(dnorm0), d_dw(dw0);
  mbt::device_buffer<std::int32_t> d_t(targets);
  const std::size_t wsb = gpu_head::workspace_bytes(s, 1);
  mbt::device_buffer<std::uint8_t> d_ws(wsb);
  const typename gpu_head::weights wg{d_norm.get(), d_w.get()};
  auto run = [&] {
    d_dnorm.upload(dnorm0);
    d_dw.upload(dw0);
    gpu_result<S> r;
    r.loss = gpu_head::loss_backward(s, wg, d_x.get(), d_t.get(), scale, d_dx.get(),
                                     {d_dnorm.get(), d_dw.get()}, d_ws.get(), wsb, ex);
    r.dx = d_dx.download();
    r.dnorm = d_dnorm.download();
    r.dw = d_dw.download();
    r.loss_only = gpu_head::loss(s, wg, d_x.get(), d_t.get(), d_ws.get(), wsb, ex);
    CHECK(same_bits(d_dx.download(), r.dx));  // loss() leaves the gradients alone
    CHECK(same_bits(d_dnorm.download(), r.dnorm));
    CHECK(same_bits(d_dw.download(), r.dw));
    return r;
  };
  const gpu_result<S> first = run();

  // Lazy module loading may allocate on the first launch: measure the second.
  std::size_t free_before = 0, free_after = 0, total = 0;
  mb::cuda_check(cudaMemGetInfo(&free_before, &total), "cudaMemGetInfo");
  const gpu_result<S> second = run();
  mb::cuda_check(cudaMemGetInfo(&free_after, &total), "cudaMemGetInfo");
  CHECK(free_after == free_before);

  CHECK(same_bits(first.loss, second.loss));
  CHECK(same_bits(first.dx, second.dx));
  CHECK(same_bits(first.dnorm, second.dnorm));
  CHECK(same_bits(first.dw, second.dw));
  // loss() runs the same launches up to the gradients: the same value to the bit.
  CHECK(same_bits(first.loss_only, first.loss));

  mbt::close_normwise("loss", std::vector<double>{first.loss}, std::vector<double>{loss_c}, loss_tolerance, 0.0);
  close_scaled("dx", as_double(first.dx), as_double(dx_c), tolerance);
  close_scaled("dnorm", as_double(first.dnorm), as_double(dnorm_c), tolerance);
  close_scaled("dW", as_double(first.dw), as_double(dw_c), tolerance);
  // The gradient really was added: dW moved away from its starting values.
  CHECK(!same_bits(first.dw, dw0));
}

void fp32_matches_cpu() {
  // V = 101 and 203: not multiples of 8 (ld of the logits and of W's gradient not 16-byte multiples).
  for (std::size_t chunk : {std::size_t{1}, std::size_t{7}, std::size_t{37}, std::size_t{1000}}) {
    compare<mb::fp32_precision>({37, 24, 101, chunk, 1e-5}, 1e-5, 1e-6);
  }
  compare<mb::fp32_precision>({64, 64, 203, 7, 1e-5}, 1e-5, 1e-6);
  compare<mb::fp32_precision>({1, 8, 13, 1, 1e-5}, 1e-5, 1e-6);
}

void bf16_matches_cpu() {
  for (std::size_t chunk : {std::size_t{1}, std::size_t{7}, std::size_t{64}}) {
    compare<mb::bf16_precision>({37, 24, 101, chunk, 1e-5}, 4e-2, 1e-3);
  }
  compare<mb::bf16_precision>({48, 64, 203, 7, 1e-5}, 4e-2, 1e-3);
}

void sizes_and_typed_errors() {
  using gpu_head = mb::lm_head<mb::fp32_precision, mb::cuda_backend>;
  using bf_head = mb::lm_head<mb::bf16_precision, mb::cuda_backend>;
  mb::cuda_executor ex;
  // The workspace holds cuBLASLt's on every architecture, and one chunk of logits, never [N, V].
  const mb::lm_head_shape big{4096, 64, 50000, 128, 1e-5};
  CHECK(gpu_head::workspace_bytes(big, 1) >= mb::gpu::gemm_workspace_bytes(ex));
  CHECK(gpu_head::workspace_bytes(big, 1) <
        mb::gpu::gemm_workspace_bytes_max + std::size_t{4096} * 50000 * 4 / 8);
  // bf16 adds the S copy of the chunk's dlogits and the fp32 dW accumulator, and halves xn.
  CHECK(bf_head::workspace_bytes(big, 1) > gpu_head::workspace_bytes(big, 1));

  const mb::lm_head_shape s{4, 8, 10, 2, 1e-5};
  mbt::device_buffer<float> x(std::vector<float>(32, 0.5f)), norm(std::vector<float>(8, 1.0f)),
      w(std::vector<float>(80, 0.1f)), dx(32), dnorm(std::vector<float>(8, 0.0f)),
      dw(std::vector<float>(80, 0.0f));
  mbt::device_buffer<std::int32_t> t(std::vector<std::int32_t>{1, 2, 3, 4});
  const std::size_t wsb = gpu_head::workspace_bytes(s, 1);
  mbt::device_buffer<std::uint8_t> ws(wsb);
  const gpu_head::weights wt{norm.get(), w.get()};
  const gpu_head::gradients gr{dnorm.get(), dw.get()};
  EXPECT_THROW(mb::workspace_too_small,
               gpu_head::loss_backward(s, wt, x.get(), t.get(), 1.0, dx.get(), gr, ws.get(), wsb - 1, ex));
  EXPECT_THROW(mb::workspace_too_small, gpu_head::loss(s, wt, x.get(), t.get(), nullptr, wsb, ex));
  EXPECT_THROW(mb::invalid_argument,
               gpu_head::loss_backward(s, wt, nullptr, t.get(), 1.0, dx.get(), gr, ws.get(), wsb, ex));
  EXPECT_THROW(mb::invalid_argument,
               gpu_head::loss_backward(s, wt, x.get(), nullptr, 1.0, dx.get(), gr, ws.get(), wsb, ex));
  EXPECT_THROW(mb::invalid_argument,
               gpu_head::loss_backward(s, wt, x.get(), t.get(), std::nan(""), dx.get(), gr, ws.get(), wsb, ex));
  mb::lm_head_shape z = s;
  z.chunk = 0;
  EXPECT_THROW(mb::invalid_argument, gpu_head::check(z));
  EXPECT_THROW(mb::invalid_argument,
               gpu_head::loss(z, wt, x.get(), t.get(), ws.get(), wsb, ex));

  // Device targets are the caller's to check on the host; a bad one reads nothing out of bounds
  // and makes the loss NaN (run_suite's device sync after the case catches a fault).
  mbt::device_buffer<std::int32_t> bad(std::vector<std::int32_t>{1, 2, 10, -1});
  const double l = gpu_head::loss(s, wt, x.get(), bad.get(), ws.get(), wsb, ex);
  CHECK(std::isnan(l));
  EXPECT_THROW(mb::invalid_argument, gpu_head::check_targets(std::vector<std::int32_t>{1, 2, 10, -1}.data(), 4, 10));
}

}  // namespace

int main() {
  static const mbt::test_case cases[] = {
      {"lm_head cuda_backend fp32 equals the CPU backend", fp32_matches_cpu},
      {"lm_head cuda_backend bf16 within the stated bound", bf16_matches_cpu},
      {"lm_head cuda_backend sizes and typed errors", sizes_and_typed_errors},
  };
  return mbt::run_suite("test_cuda_lm_head", cases);
}
