// Host emulation of the device adamw8bit step (backend/cuda/model.cuh), for a machine
// without a GPU. Built and run by `tests/emulation/cuda_emulate.py adamw8bit`, which compiles the kernel
// (backend/cuda/adamw8bit_kernels.inl) and its tables, constants and host table builder
// (adamw8bit_sizes.inl), the same text nvcc compiles, here as plain C++: __global__/__device__ vanish, each CTA runs its threads on
// a team of host threads (cta_threads.hpp), one CTA after another, __syncthreads a barrier (cta_threads.hpp) (under -fsanitize=thread a
// missing barrier in the absmax reduction shows as a data race). A host copy of the launcher drives
// it against adamw8bit<S, Block>::update on the CPU over several steps, from the same initial state:
// the whole state (masters, absmax scales, codes) and the weights must be the CPU's bit for bit (one
// compiler, no FMA contraction on either side; on a GPU nvcc's FMAs may move the last bit of a
// moment, see the header). Cases: fp32 and bf16 storage, Block 64 (64 threads per CTA) and 2048
// (256), n not a multiple of Block, spans with gaps (padding keeps its weight and moments but is
// requantized), both decays, adjacent spans of one decay merged, a zero gradient block, and the
// typed refusal of more than adamw8bit_max_spans runs. What it cannot check: the launcher itself
// (copied by hand), the kernel-parameter size on a real device, and anything about speed.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "membound/membound.hpp"

#include "cta_threads.hpp"

struct dim3e {
  unsigned x = 0;
};
static thread_local dim3e threadIdx, blockIdx;
static emu_support::barrier* g_bar = nullptr;
#define __global__
#define __device__
#define __launch_bounds__(...)
#define __shared__ static
#define __syncthreads() g_bar->arrive_and_wait()

namespace emu {
using namespace membound;
template <class S> inline float ld(const S* p, std::size_t i) { return to_accum<float>(p[i]); }
template <class S> inline void st(S* p, std::size_t i, float v) { p[i] = from_accum<S>(v); }
#include "membound/backend/cuda/adamw8bit_sizes.inl"
#include "membound/backend/cuda/adamw8bit_kernels.inl"
}  // namespace emu

namespace mb = membound;

static int fails = 0;

// The launcher's sequence (backend/cuda/model.cuh's adamw8bit_update) on host threads.
template <class S, std::size_t Block>
void device_step(S* w, const S* g, void* state, std::size_t n, std::span<const mb::param_span> spans,
                 const mb::optimizer_step& s) {
  using opt = mb::adamw8bit<S, Block>;
  const mb::adamw_config& c = s.config;
  const auto kd = mb::adamw_coefficients<float>::at(s.t, s.lr, c.beta1, c.beta2, c.eps, c.weight_decay, true);
  const auto kn = mb::adamw_coefficients<float>::at(s.t, s.lr, c.beta1, c.beta2, c.eps, c.weight_decay, false);
  const typename opt::view p = opt::parts(state, n);
  const emu::adamw8bit_tables tb = emu::adamw8bit_tables_for(spans);
  constexpr unsigned threads = Block < emu::adamw8bit_threads ? unsigned(Block) : emu::adamw8bit_threads;
  for (std::size_t b = 0; b < opt::blocks(n); ++b) {
    emu_support::barrier bar(threads);
    g_bar = &bar;
    emu_support::cta_team(threads).run([&](unsigned t) {
      threadIdx.x = t;
      blockIdx.x = static_cast<unsigned>(b);
      emu::adamw8bit_kernel<S, unsigned(Block)>(w, g, p.master, p.absmax_m, p.absmax_v, p.m, p.v, n, tb, kd, kn,
                                                static_cast<float>(s.grad_scale), nullptr);
    });
  }
}

float rnd(unsigned& s, float scale) {
  s = s * 1664525u + 1013904223u;
  return scale * (static_cast<float>(s >> 8) / 16777216.0f - 0.5f);
}

template <class S, std::size_t Block>
void run(const char* name, std::size_t n, std::vector<mb::param_span> spans, int steps) {
  using opt = mb::adamw8bit<S, Block>;
  unsigned seed = 12345u + static_cast<unsigned>(n);
  std::vector<S> w0(n), g(n);
  for (auto& x : w0) x = mb::from_accum<S>(rnd(seed, 2.0f));
  std::vector<unsigned char> sc(opt::state_bytes(n)), sd;
  opt::init(w0.data(), n, sc.data(), sc.size());
  sd = sc;
  std::vector<S> wc = w0, wd = w0;
  mb::thread_pool pool(1);
  for (int t = 1; t <= steps; ++t) {
    // Gradients over decades (v spans them), a block of zeros in the second step.
    for (std::size_t i = 0; i < n; ++i) {
      const float mag = std::pow(10.0f, -static_cast<float>(i % 7));
      g[i] = mb::from_accum<S>(t == 2 && i < Block ? 0.0f : rnd(seed, mag));
    }
    mb::optimizer_step st;
    st.t = static_cast<std::uint64_t>(t);
    st.lr = 1e-2;
    st.grad_scale = t == 3 ? 0.5 : 1.0;
    st.config = mb::adamw_config{1e-2, 0.9, 0.95, 1e-8, 0.1};
    opt::update(wc.data(), g.data(), sc.data(), n, spans, st, pool);
    device_step<S, Block>(wd.data(), g.data(), sd.data(), n, spans, st);
  }
  const bool same_state = sc == sd;
  const bool same_w = std::memcmp(wc.data(), wd.data(), n * sizeof(S)) == 0;
  std::printf("  %-44s n=%-6zu Block=%-5zu steps=%d: state %s, weights %s\n", name, n, Block, steps,
              same_state ? "bit-identical" : "DIFFERS", same_w ? "bit-identical" : "DIFFER");
  if (!same_state || !same_w) ++fails;
}

int main() {
  std::printf("adamw8bit on the device, emulated, against adamw8bit::update on the CPU\n");
  // Spans with a gap (padding), both decays, two adjacent of one decay (merged by the launcher).
  const std::vector<mb::param_span> mixed{{0, 700, true}, {700, 300, true}, {1000, 37, false}, {1100, 2000, true},
                                          {3100, 900, false}};
  run<float, 64>("fp32, mixed spans", 4000, mixed, 4);
  run<mb::bf16, 64>("bf16 (fp32 masters), mixed spans", 4000, mixed, 4);
  run<float, 2048>("fp32, Block 2048, mixed spans", 4000, mixed, 3);
  run<mb::bf16, 2048>("bf16, Block 2048, one span", 5000, {{0, 5000, true}}, 3);
  run<float, 64>("fp32, a short last block", 130, {{0, 130, false}}, 3);
  // More runs than one launch takes: a typed refusal naming the argument.
  std::vector<mb::param_span> many;
  for (std::size_t k = 0; k < emu::adamw8bit_max_spans + 1; ++k) many.push_back({2 * k, 1, k % 2 == 0});
  try {
    (void)emu::adamw8bit_tables_for(many);
    std::printf("  FAIL: %zu runs were not refused\n", many.size());
    ++fails;
  } catch (const mb::invalid_argument& e) {
    std::printf("  %zu runs refused: %.60s...\n", many.size(), e.what());
  }
  std::printf("%s (%d failures)\n", fails ? "FAILED" : "all passed", fails);
  return fails ? 1 : 0;
}
