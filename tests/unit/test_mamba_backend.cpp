// The host side of mamba's backend dispatch (the device side is tests/cuda/test_cuda_mamba.cu):
// the shared element math the CUDA kernels use (softplus and its gradient from the output) agrees
// with the CPU block's formulas, cpu_backend is the default and changes nothing, and the executor
// overloads of make_state/reset that the device path needs behave as the plain ones on the CPU.
#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <type_traits>
#include <vector>

#include "../support/layer_test_util.hpp"
#include "membound/membound.hpp"

using membound::mamba;
using membound::mamba_shape;

TEST_CASE("element_math softplus equals the CPU mamba's softplus, and σ from the output") {
  for (double v = -30.0; v <= 30.0; v += 0.37) {
    INFO(v);
    CHECK(membound::softplus(v) == membound::cpu::softplus(v));
    const float f = static_cast<float>(v);
    CHECK(membound::softplus(f) == membound::cpu::softplus(f));
    // d softplus / dv = σ(v) = 1 − e^(−softplus(v)): what the backward uses, from Δ alone.
    const double out = membound::softplus(v);
    CHECK(membound::softplus_grad_from_output(out) ==
          doctest::Approx(membound::sigmoid(v)).epsilon(1e-12));
  }
  CHECK(std::isfinite(membound::softplus(1000.0f)));
  CHECK(membound::softplus(-1000.0f) == 0.0f);
}

TEST_CASE("mamba: cpu_backend is the default and its executor is the thread pool") {
  static_assert(std::is_same_v<mamba<>::backend, membound::cpu_backend>);
  static_assert(std::is_same_v<mamba<membound::bf16_precision>::executor, membound::thread_pool>);
  static_assert(std::is_same_v<mamba<membound::cpu_backend, membound::scan_chunk<8>>::backend,
                               membound::cpu_backend>);
  // Naming the backend changes no size.
  mamba_shape s = mamba_shape::defaults(2, 37, 16);
  using plain = mamba<membound::scan_chunk<8>>;
  using named = mamba<membound::scan_chunk<8>, membound::cpu_backend>;
  CHECK(plain::saved_bytes(s) == named::saved_bytes(s));
  CHECK(plain::forward_workspace_bytes(s, 3) == named::forward_workspace_bytes(s, 3));
  CHECK(plain::backward_workspace_bytes(s, 3) == named::backward_workspace_bytes(s, 3));
  CHECK(plain::step_workspace_bytes(s) == named::step_workspace_bytes(s));
}

TEST_CASE("mamba: make_state and reset with the executor zero the state as the plain ones do") {
  using block = mamba<>;
  mamba_shape s = mamba_shape::defaults(2, 1, 8);
  s.d_state = 4;
  membound::thread_pool pool(1);
  membound_test::aligned_buffer buf(block::state_bytes(s));
  float* p = static_cast<float*>(buf.get());
  const std::size_t n = block::state_bytes(s) / sizeof(float);
  for (std::size_t i = 0; i < n; ++i) p[i] = 1.0f;
  block::state st = block::make_state(s, buf.get(), buf.bytes, pool);
  bool zero = true;
  for (std::size_t i = 0; i < n; ++i) zero = zero && p[i] == 0.0f;
  CHECK(zero);
  st.position = 5;
  for (std::size_t i = 0; i < n; ++i) p[i] = 2.0f;
  block::reset(s, st, pool);
  CHECK(st.position == 0);
  zero = true;
  for (std::size_t i = 0; i < n; ++i) zero = zero && p[i] == 0.0f;
  CHECK(zero);
  CHECK_THROWS_AS(block::make_state(s, buf.get(), buf.bytes - 1, pool), membound::workspace_too_small);
}
