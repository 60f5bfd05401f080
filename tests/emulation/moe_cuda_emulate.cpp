// Host emulation of backend/cuda/moe.cuh's kernels, for a machine without a GPU. Built and run by
// `tests/emulation/cuda_emulate.py moe`, which compiles the kernels' text (backend/cuda/moe_kernels.inl,
// what nvcc compiles) here as plain C++: __global__ vanishes, the CUDA built-ins are globals, and
// every kernel (none has a barrier) runs each (block, thread) of the launcher's grid in turn on
// this thread, so every grid-stride loop is walked as the device's threads would split it. A host
// copy of moe.cuh's launch sequence (naive fp32 loops for the cuBLASLt GEMMs, the per-expert row
// ranges read back as the launcher reads them) drives them, forward then backward, against the CPU
// layer (moe_mlp<fp32_precision>, cpu_backend) on the same inputs: y, dx and the four gradients
// within 1e-5 (normwise), and the statistics (the drops and the most rows an expert kept exactly,
// the balancing loss within 1e-6). The SwiGLU and the GEMMs are plain loops here (the model's
// kernels have their own emulation). Cases: top-1 and top-2, with
// and without renormalisation, capacity that binds and that does not, an adversarial router that
// sends every token's first choice to expert 0 (drops at its capacity, checked to happen), the
// balancing loss on and off. Under --sanitize address every buffer has its exact size. What it cannot
// check: the launchers themselves (copied here by hand), cuBLASLt, bf16/fp16, the device.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "membound/layers/moe_mlp.hpp"

#include "host_gemm.hpp"

struct dim3e {
  unsigned x = 1, y = 1, z = 1;
};
static dim3e threadIdx, blockIdx, blockDim, gridDim;
#define __global__
#define __device__

namespace emu {
template <class S> inline float ld(const S* p, std::size_t i) { return p[i]; }
template <class S> inline void st(S* p, std::size_t i, float v) { p[i] = v; }
#include "membound/backend/cuda/moe_kernels.inl"
}  // namespace emu

namespace mb = membound;
using namespace emu;
using std::size_t;

// The launcher's grid (moe.cuh's grid_for: blocks of 256 threads) walked block by block, thread by
// thread.
void launch(size_t n, unsigned threads, const std::function<void()>& f) {
  const unsigned blocks = static_cast<unsigned>(std::max<size_t>(1, (n + threads - 1) / threads));
  gridDim = dim3e{blocks, 1, 1};
  blockDim = dim3e{threads, 1, 1};
  for (unsigned b = 0; b < blocks; ++b)
    for (unsigned t = 0; t < threads; ++t) {
      blockIdx = dim3e{b, 0, 0};
      threadIdx = dim3e{t, 0, 0};
      f();
    }
}
void launch_grid(size_t n, const std::function<void()>& f) { launch(n, 256, f); }
void launch_one(const std::function<void()>& f) { launch(1, 1, f); }

using emu_support::mm;
using emu_support::mm_at;
using emu_support::mm_bt;

void swiglu(const float* a, const float* b, float* act, size_t n) {
  for (size_t i = 0; i < n; ++i) act[i] = mb::silu(a[i]) * b[i];
}
void swiglu_back(const float* a, const float* b, const float* dact, float* da, float* db, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const float d = dact[i];
    db[i] = d * mb::silu(a[i]);
    da[i] = d * b[i] * mb::silu_grad(a[i]);
  }
}

struct lcg {
  std::uint32_t s;
  float next() {
    s = s * 1664525u + 1013904223u;
    return 2.0f * static_cast<float>(s >> 8) / static_cast<float>(1u << 24) - 1.0f;
  }
};

struct problem {
  mb::moe_shape s;
  std::vector<float> wr, wg, wu, wd, x, dy;
};
problem make_problem(const mb::moe_shape& s, std::uint32_t seed, bool one_expert) {
  lcg r{seed * 2654435761u + 11};
  const size_t N = s.tokens(), C = s.width, F = s.hidden, E = s.experts;
  auto fill = [&](size_t n, float scale) {
    std::vector<float> v(n);
    for (auto& e : v) e = scale * r.next();
    return v;
  };
  problem p{s, fill(C * E, 1.0f), fill(E * C * F, 0.5f), fill(E * C * F, 0.5f), fill(E * F * C, 0.5f),
            fill(N * C, 1.0f), fill(N * C, 1.0f)};
  if (one_expert) {  // a constant first feature and a router that reads it for expert 0 alone
    for (size_t t = 0; t < N; ++t) p.x[t * C] = 1.0f;
    for (size_t e = 0; e < E; ++e) p.wr[e] = e == 0 ? 20.0f : 0.0f;
  }
  return p;
}

struct outputs {
  std::vector<float> y, dx, gwr, gwg, gwu, gwd, p, g;
  std::vector<std::int32_t> choice, row, off;
  mb::moe_stats stats;
};

outputs run_cpu(const problem& pr) {
  using L = mb::moe_mlp<mb::fp32_precision>;
  const mb::moe_shape& s = pr.s;
  const size_t N = s.tokens(), C = s.width;
  mb::thread_pool pool(1);
  const size_t sb = L::saved_bytes(s);
  const size_t wsb = std::max(L::forward_workspace_bytes(s, 1), L::backward_workspace_bytes(s, 1));
  std::vector<double> sv(sb / 8 + 64), wv(wsb / 8 + 64);
  auto al = [](std::vector<double>& v) {
    void* q = v.data();
    size_t sp = v.size() * 8;
    return std::align(256, 1, q, sp);
  };
  void* svp = al(sv);
  void* wsp = al(wv);
  outputs o;
  o.y.resize(N * C);
  o.dx.resize(N * C);
  o.gwr.assign(pr.wr.size(), 0.0f);
  o.gwg.assign(pr.wg.size(), 0.0f);
  o.gwu.assign(pr.wu.size(), 0.0f);
  o.gwd.assign(pr.wd.size(), 0.0f);
  const L::weights w{pr.wr.data(), pr.wg.data(), pr.wu.data(), pr.wd.data()};
  L::forward(s, w, pr.x.data(), o.y.data(), svp, sb, wsp, wsb, pool, &o.stats);
  L::backward(s, w, pr.x.data(), svp, sb, pr.dy.data(), o.dx.data(),
              {o.gwr.data(), o.gwg.data(), o.gwu.data(), o.gwd.data()}, wsp, wsb, pool);
  return o;
}

// moe.cuh's launch sequence, forward then backward; the routing also returned.
outputs run_emu(const problem& pr) {
  const mb::moe_shape& s = pr.s;
  const size_t N = s.tokens(), C = s.width, F = s.hidden, E = s.experts, k = s.top_k;
  const size_t R = mb::moe_rows(s), cap = mb::moe_capacity(s);
  const bool renorm = s.renormalize && k > 1;
  outputs o;
  // saved: the routing and the pre-activations, exact sizes
  o.p.resize(N * E);
  o.choice.resize(N * k);
  o.row.resize(N * k);
  o.g.resize(N * k);
  o.off.resize(E + 1);
  std::vector<float> a_s(R * F), b_s(R * F);
  {  // forward
    std::vector<std::int32_t> named(E);
    std::vector<moe_device_stats> dstats(1);
    std::vector<float> xg(R * C), act(R * F), yg(R * C);
    o.y.resize(N * C);
    mm(pr.x.data(), pr.wr.data(), o.p.data(), N, C, E, false);
    launch_grid(N, [&] { moe_route_kernel(o.p.data(), o.choice.data(), o.g.data(), N, E, k, renorm); });
    launch_grid(E, [&] { moe_dispatch_kernel(o.choice.data(), o.row.data(), o.off.data(), named.data(), N, E, k, cap); });
    launch_one([&] { moe_offsets_kernel(o.off.data(), E); });
    launch_grid(N * k, [&] { moe_rows_kernel(o.choice.data(), o.row.data(), o.off.data(), N * k); });
    launch_one([&] {
      moe_stats_kernel(o.p.data(), named.data(), o.row.data(), o.off.data(), N, E, k, s.aux_loss_weight,
                       dstats.data());
    });
    const moe_device_stats& h = dstats[0];
    o.stats = {h.aux, N * k, static_cast<size_t>(h.dropped), N, static_cast<size_t>(h.tokens_dropped),
               static_cast<size_t>(h.max_rows)};
    const std::vector<std::int32_t> off = o.off;  // the host copy
    const size_t kept = static_cast<size_t>(off[E]);
    launch_grid(N * k * C, [&] { moe_gather_kernel<float>(pr.x.data(), o.row.data(), xg.data(), N * k, k, C); });
    for (size_t e = 0; e < E; ++e) {
      const size_t r0 = off[e], n = off[e + 1] - r0;
      if (n == 0) continue;
      mm(xg.data() + r0 * C, pr.wg.data() + e * C * F, a_s.data() + r0 * F, n, C, F, false);
      mm(xg.data() + r0 * C, pr.wu.data() + e * C * F, b_s.data() + r0 * F, n, C, F, false);
    }
    swiglu(a_s.data(), b_s.data(), act.data(), kept * F);
    for (size_t e = 0; e < E; ++e) {
      const size_t r0 = off[e], n = off[e + 1] - r0;
      if (n == 0) continue;
      mm(act.data() + r0 * F, pr.wd.data() + e * F * C, yg.data() + r0 * C, n, F, C, false);
    }
    launch_grid(N * C, [&] { moe_combine_kernel<float>(yg.data(), o.row.data(), o.g.data(), o.y.data(), N, k, C); });
  }
  {  // backward (S = float: dx is the fp32 buffer itself, dl its own operand)
    const std::vector<std::int32_t> off = o.off;
    const size_t kept = static_cast<size_t>(off[E]);
    std::vector<float> xg(R * C), dyg(R * C), act(R * F), dact(R * F), db(R * F), u(R * F), dxg(R * C);
    std::vector<std::int32_t> src(R), named(E);
    std::vector<float> dg(N * k, 0.0f), dl(N * E);
    o.dx.resize(N * C);
    o.gwr.assign(pr.wr.size(), 0.0f);
    o.gwg.assign(pr.wg.size(), 0.0f);
    o.gwu.assign(pr.wu.size(), 0.0f);
    o.gwd.assign(pr.wd.size(), 0.0f);
    launch_grid(N * k * C, [&] { moe_gather_kernel<float>(pr.x.data(), o.row.data(), xg.data(), N * k, k, C); });
    launch_grid(N * k * C, [&] { moe_gather_kernel<float>(pr.dy.data(), o.row.data(), dyg.data(), N * k, k, C); });
    launch_grid(N * k, [&] { moe_sources_kernel(o.row.data(), src.data(), N * k); });
    swiglu(a_s.data(), b_s.data(), act.data(), kept * F);
    for (size_t e = 0; e < E; ++e) {
      const size_t r0 = off[e], n = off[e + 1] - r0;
      if (n == 0) continue;
      mm_bt(dyg.data() + r0 * C, pr.wd.data() + e * F * C, u.data() + r0 * F, n, C, F, false);
    }
    launch_grid(kept, [&] {
      moe_gate_backward_kernel<float>(u.data(), act.data(), src.data(), o.g.data(), dg.data(), dact.data(),
                                      dyg.data(), kept, F, C);
    });
    swiglu_back(a_s.data(), b_s.data(), dact.data(), dact.data(), db.data(), kept * F);
    const float* da = dact.data();
    for (size_t e = 0; e < E; ++e) {
      const size_t r0 = off[e], n = off[e + 1] - r0;
      if (n == 0) continue;
      mm_at(act.data() + r0 * F, dyg.data() + r0 * C, o.gwd.data() + e * F * C, n, F, C, true);
      mm_at(xg.data() + r0 * C, da + r0 * F, o.gwg.data() + e * C * F, n, C, F, true);
      mm_at(xg.data() + r0 * C, db.data() + r0 * F, o.gwu.data() + e * C * F, n, C, F, true);
      mm_bt(da + r0 * F, pr.wg.data() + e * C * F, dxg.data() + r0 * C, n, F, C, false);
      mm_bt(db.data() + r0 * F, pr.wu.data() + e * C * F, dxg.data() + r0 * C, n, F, C, true);
    }
    launch_grid(N * C, [&] { moe_scatter_back_kernel(dxg.data(), o.row.data(), o.dx.data(), N, k, C); });
    launch_grid(E, [&] { moe_count_kernel(o.choice.data(), named.data(), N * k, E); });
    const float aux_scale = static_cast<float>(s.aux_loss_weight * static_cast<double>(E) /
                                               (static_cast<double>(N) * static_cast<double>(N)));
    launch_grid(N, [&] {
      moe_router_backward_kernel(o.p.data(), o.choice.data(), o.g.data(), dg.data(), named.data(), aux_scale,
                                 dl.data(), N, E, k, renorm);
    });
    mm_at(pr.x.data(), dl.data(), o.gwr.data(), N, C, E, true);
    mm_bt(dl.data(), pr.wr.data(), o.dx.data(), N, E, C, true);
  }
  return o;
}

double rel(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  double d = 0, sc = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double e = std::fabs(double(a[i]) - double(b[i]));
    d = std::isnan(e) ? INFINITY : std::max(d, e);
    sc = std::max(sc, std::fabs(double(b[i])));
  }
  return sc == 0 ? d : d / sc;
}

int fails = 0;
void run_case(const char* name, mb::moe_shape s, bool one_expert = false) {
  const problem p = make_problem(s, 7, one_expert);
  const outputs want = run_cpu(p), got = run_emu(p);
  double worst = 0;
  auto cmp = [&](const char* what, const std::vector<float>& g, const std::vector<float>& w) {
    const double e = rel(g, w);
    worst = std::max(worst, e);
    if (!(e <= 1e-5)) {
      ++fails;
      std::printf("  FAIL %s: %.3g against the CPU (fp32)\n", what, e);
    }
  };
  cmp("y", got.y, want.y);
  cmp("dx", got.dx, want.dx);
  cmp("d router", got.gwr, want.gwr);
  cmp("d w_gate", got.gwg, want.gwg);
  cmp("d w_up", got.gwu, want.gwu);
  cmp("d w_down", got.gwd, want.gwd);
  const mb::moe_stats& a = got.stats;
  const mb::moe_stats& b = want.stats;
  const bool same_counts = a.choices == b.choices && a.dropped == b.dropped && a.tokens == b.tokens &&
                           a.tokens_dropped == b.tokens_dropped && a.max_expert_rows == b.max_expert_rows;
  const double aux_err = std::fabs(a.aux_loss - b.aux_loss) / std::max(1e-30, std::fabs(b.aux_loss));
  if (!same_counts || !(aux_err <= 1e-6)) {
    ++fails;
    std::printf("  FAIL stats: dropped %zu/%zu, tokens dropped %zu/%zu, max rows %zu/%zu, aux %.9g/%.9g\n", a.dropped,
                b.dropped, a.tokens_dropped, b.tokens_dropped, a.max_expert_rows, b.max_expert_rows, a.aux_loss, b.aux_loss);
  }
  if (one_expert && a.dropped < s.tokens() - mb::moe_capacity(s)) {  // every first choice on expert 0
    ++fails;
    std::printf("  FAIL the adversarial router dropped %zu choices, expected at least %zu\n", a.dropped,
                s.tokens() - mb::moe_capacity(s));
  }
  std::printf("%s: N %zu E %zu k %zu capacity %zu, %zu of %zu choices dropped (%zu tokens), worst %.3g, aux %.6g\n",
              name, s.tokens(), s.experts, s.top_k, mb::moe_capacity(s), a.dropped, a.choices, a.tokens_dropped,
              worst, a.aux_loss);
}

int main() {
  mb::moe_shape s{.batch = 2, .seq = 19, .width = 12, .hidden = 20, .experts = 4, .top_k = 2,
                  .capacity_factor = 1.25, .aux_loss_weight = 0.01};
  run_case("top-2, capacity 1.25", s);
  s.capacity_factor = 0.6;
  run_case("top-2, capacity 0.6 (drops)", s);
  s.capacity_factor = 0;
  s.renormalize = false;
  run_case("top-2, no capacity, gates not renormalised", s);
  s = {.batch = 1, .seq = 23, .width = 8, .hidden = 16, .experts = 5, .top_k = 1, .capacity_factor = 1.0,
       .aux_loss_weight = 0.0};
  run_case("top-1, no balancing loss", s);
  s = {.batch = 1, .seq = 30, .width = 8, .hidden = 12, .experts = 6, .top_k = 2, .capacity_factor = 1.0,
       .aux_loss_weight = 0.02};
  run_case("every token to expert 0 (drops at capacity, idle experts)", s, true);
  std::printf("%s (%d failures)\n", fails ? "FAILED" : "all passed", fails);
  return fails ? 1 : 0;
}
