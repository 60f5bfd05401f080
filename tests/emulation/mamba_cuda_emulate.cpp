// Host emulation of backend/cuda/mamba.cuh's kernels, for a machine without a GPU. Built and
// run by `tests/emulation/cuda_emulate.py mamba`, which compiles the kernels (backend/cuda/mamba_kernels.inl)
// and the chunk sizes they share with the launchers (mamba_sizes.inl), nvcc's text, here as
// plain C++: __global__/__device__ vanish, threadIdx/blockIdx are thread_locals. A kernel with
// __syncthreads (the scans' chunk-local passes and their outputs, whose lanes share a tile's SiLU
// through shared memory) runs its cpb·Ns threads as host threads, one CTA after another,
// __syncthreads a barrier (cta_threads.hpp) (under -fsanitize=thread a missing barrier shows as a
// data race); every barrier-free kernel (the combines over chunks, the reductions, the conv) runs
// one thread at a time. A host copy of the launchers'
// sequence (naive fp32 loops for the cuBLASLt GEMMs) drives them, forward then backward, against
// the CPU layer (mamba<scan_chunk<L>>, cpu_backend) on the same inputs: out, the saved chunk-entry
// states, dx and the nine gradients within 1e-5 (normwise) of the fp32 block, with each side's
// distance to the fp64 block reported; y from the backward's rerun (phase C on the saved states)
// bit for bit the forward's; recompute and save_all bit for bit the same. Every buffer has the
// launchers' exact size (the ΣΔ scratch from mamba_chunk_sum_elements), so --sanitize address sees
// an overrun. The channels per CTA (cpb) are the launchers' (mamba_channels_per_block) unless
// argv[1] caps them (the kernels take cpb as an argument). What it cannot check: the launchers
// themselves (copied here by hand), cuBLASLt, the bf16/fp16 paths, the device's expf, warps, and
// anything about speed. Packed sequences: the same, against the CPU layer's packed call.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <vector>

#include "membound/layers/mamba.hpp"
#include "membound/core/element_math.hpp"
#include "membound/core/parallel.hpp"

#include "cta_threads.hpp"
#include "host_gemm.hpp"

struct dim3e {
  unsigned x = 1, y = 1, z = 1;
};
static thread_local dim3e threadIdx, blockIdx;
static dim3e blockDim, gridDim;
static emu_support::barrier* g_bar = nullptr;
#define __global__
#define __device__
#define __noinline__
#define __launch_bounds__(...)
#define __shared__ static
#define __syncthreads() g_bar->arrive_and_wait()

namespace emu {
using membound::packed_sequences;
template <class S> inline float ld(const S* p, std::size_t i) { return p[i]; }
template <class S> inline void st(S* p, std::size_t i, float v) { p[i] = v; }
#include "membound/backend/cuda/mamba_sizes.inl"
#include "membound/backend/cuda/mamba_kernels.inl"
}  // namespace emu

namespace mb = membound;
using namespace emu;
using std::size_t;

// A kernel without barriers: every (block, thread) in turn on this thread.
void launch_seq(dim3e grid, unsigned nt, const std::function<void()>& f) {
  gridDim = grid;
  blockDim = dim3e{nt, 1, 1};
  emu_support::barrier one(1);
  g_bar = &one;
  for (unsigned by = 0; by < grid.y; ++by)
    for (unsigned bx = 0; bx < grid.x; ++bx)
      for (unsigned t = 0; t < nt; ++t) {
        blockIdx = dim3e{bx, by, 0};
        threadIdx = dim3e{t, 0, 0};
        f();
      }
}
// One thread per element of a grid-stride kernel.
void launch_flat(size_t total, const std::function<void()>& f) {
  launch_seq(dim3e{static_cast<unsigned>(std::max<size_t>(total, 1)), 1, 1}, 1, f);
}
// A kernel with barriers: its nt threads on a kept team of host threads (cta_threads.hpp), running the CTAs one after another
// (a barrier between CTAs: __shared__ is one static array here).
void launch_cta(dim3e grid, unsigned nt, const std::function<void()>& f) {
  gridDim = grid;
  blockDim = dim3e{nt, 1, 1};
  emu_support::barrier bar(nt);
  g_bar = &bar;
  emu_support::cta_team(nt).run([&](unsigned t) {
    threadIdx = dim3e{t, 0, 0};
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        blockIdx = dim3e{bx, by, 0};
        f();
        bar.arrive_and_wait();
      }
  });
}

using emu_support::mm;
using emu_support::mm_at;
using emu_support::mm_bt;

struct lcg {
  std::uint32_t s;
  float next() {
    s = s * 1664525u + 1013904223u;
    return 2.0f * static_cast<float>(s >> 8) / static_cast<float>(1u << 24) - 1.0f;
  }
};
// test_cuda_mamba's problem: Δ in about [0.05, 1], A in [−Ns, −1].
struct problem {
  mb::mamba_shape s;
  std::vector<float> w[9], x, dout, g0[9];
};
enum { in_proj, conv_w, conv_b, x_proj, dt_proj, dt_bias, a_log, dskip, out_proj };
const char* wname[9] = {"in_proj", "conv_w", "conv_b", "x_proj", "dt_proj",
                        "dt_bias", "a_log",  "d",      "out_proj"};
problem make_problem(const mb::mamba_shape& s, std::uint32_t seed) {
  lcg r{seed * 2654435761u + 11};
  const size_t N = s.batch * s.seq, C = s.d_model, Di = s.d_inner, Ns = s.d_state;
  const size_t R = s.dt_rank, K = s.d_conv;
  auto fill = [&](size_t n, float scale, float off) {
    std::vector<float> v(n);
    for (auto& e : v) e = off + scale * r.next();
    return v;
  };
  problem p;
  p.s = s;
  p.w[in_proj] = fill(C * 2 * Di, 1.0f / std::sqrt(float(C)), 0);
  p.w[conv_w] = fill(Di * K, 0.5f, 0);
  p.w[conv_b] = fill(Di, 0.2f, 0);
  p.w[x_proj] = fill(Di * (R + 2 * Ns), 1.5f / std::sqrt(float(Di)), 0);
  p.w[dt_proj] = fill(R * Di, 0.5f / std::sqrt(float(R)), 0);
  p.w[dt_bias] = fill(Di, 1.0f, -1.0f);
  p.w[a_log].resize(Di * Ns);
  for (size_t i = 0; i < Di; ++i)
    for (size_t j = 0; j < Ns; ++j) p.w[a_log][i * Ns + j] = std::log(float(j + 1)) + 0.3f * r.next();
  p.w[dskip] = fill(Di, 0.5f, 1.0f);
  p.w[out_proj] = fill(Di * C, 1.0f / std::sqrt(float(Di)), 0);
  p.x = fill(N * C, 1.0f, 0);
  p.dout = fill(N * C, 1.0f, 0);
  // The gradients start at 0: some (dt_proj's at small T) are ~1e-4 of a typical weight, and on
  // top of a nonzero start the rounding of the sum would hide them. (The += paths are the
  // unchanged reductions; test_cuda_mamba checks them on the device.)
  for (int i = 0; i < 9; ++i) p.g0[i].assign(p.w[i].size(), 0.0f);
  return p;
}

struct outputs {
  std::vector<float> out, states, dx, g[9];
};
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
void check_bits(const char* what, const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size() ||
      (!a.empty() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) != 0)) {
    std::printf("  FAIL %s: not bit-identical\n", what);
    ++fails;
  }
}

// The CPU layer (fp32, or fp64 as the reference both fp32 sides are measured against), one thread.
template <size_t L, class Ckpt, class P = mb::fp32_precision>
outputs run_cpu(const problem& p) {
  using Block = mb::mamba<P, mb::scan_chunk<L>, Ckpt>;
  using V = typename P::storage_type;
  const mb::mamba_shape& s = p.s;
  const size_t N = s.batch * s.seq, C = s.d_model;
  auto conv = [](const std::vector<float>& v) { return std::vector<V>(v.begin(), v.end()); };
  auto back = [](const V* q, size_t n) { return std::vector<float>(q, q + n); };
  mb::thread_pool pool(1);
  const size_t sb = Block::saved_bytes(s);
  const size_t wsb = std::max(Block::forward_workspace_bytes(s, 1), Block::backward_workspace_bytes(s, 1));
  std::vector<double> savedv(sb / 8 + 64), wsv(wsb / 8 + 64);
  auto al = [](std::vector<double>& v) {
    void* q = v.data();
    size_t sp = v.size() * 8;
    return std::align(256, 1, q, sp);
  };
  void* svp = al(savedv);
  void* wsp = al(wsv);
  std::vector<V> wv[9], gv[9];
  for (int i = 0; i < 9; ++i) {
    wv[i] = conv(p.w[i]);
    gv[i] = conv(p.g0[i]);
  }
  const std::vector<V> x = conv(p.x), dout = conv(p.dout);
  std::vector<V> out(N * C), dx(N * C);
  typename Block::weights w{wv[0].data(), wv[1].data(), wv[2].data(), wv[3].data(), wv[4].data(),
                            wv[5].data(), wv[6].data(), wv[7].data(), wv[8].data()};
  typename Block::gradients g{gv[0].data(), gv[1].data(), gv[2].data(), gv[3].data(), gv[4].data(),
                              gv[5].data(), gv[6].data(), gv[7].data(), gv[8].data()};
  Block::forward(s, w, x.data(), out.data(), svp, sb, wsp, wsb, pool);
  outputs r;
  r.states = back(Block::saved_states(s, svp), Block::saved_state_bytes(s) / sizeof(V));
  Block::backward(s, w, x.data(), svp, sb, dout.data(), dx.data(), g, wsp, wsb, pool);
  r.out = back(out.data(), out.size());
  r.dx = back(dx.data(), dx.size());
  for (int i = 0; i < 9; ++i) r.g[i] = back(gv[i].data(), gv[i].size());
  return r;
}

// The device launchers' sequence (forward, then backward), kernels emulated.
unsigned g_cpb_cap = 0;  // 0: the launchers' cpb
outputs run_emu(const problem& p, size_t L, bool keep, std::vector<float>* y_fwd,
                std::vector<float>* y_bwd) {
  const mb::mamba_shape& s = p.s;
  const size_t B = s.batch, T = s.seq, N = B * T, C = s.d_model, Di = s.d_inner, Ns = s.d_state;
  const size_t R = s.dt_rank, K = s.d_conv, ldx = R + 2 * Ns;
  const size_t nch = mamba_chunks(T, L);
  const packed_sequences pk = s.packing();  // host memory here, the device copy on a GPU
  size_t cpb = mamba_channels_per_block(Ns);
  if (g_cpb_cap != 0) cpb = std::min<size_t>(cpb, g_cpb_cap);
  const unsigned nt = static_cast<unsigned>(cpb * Ns);
  const unsigned nchb = static_cast<unsigned>(mamba_blocks(Di, cpb));
  const float* w[9];
  for (int i = 0; i < 9; ++i) w[i] = p.w[i].data();
  // saved (exact sizes: ASan sees an overrun)
  std::vector<float> xz(N * 2 * Di), xdbl(N * ldx), states(B * (nch - 1) * Di * Ns);
  std::vector<float> saved_c(keep ? N * Di : 0), saved_delta(keep ? N * Di : 0);
  outputs r;
  r.out.resize(N * C);
  {  // forward
    std::vector<float> c(N * Di), u(N * Di), dt(N * Di), delta(N * Di), gated(N * Di);
    std::vector<float> dsum(mamba_chunk_sum_elements(B, T, L, Di));
    float* cp = keep ? saved_c.data() : c.data();
    float* dp = keep ? saved_delta.data() : delta.data();
    mm(p.x.data(), w[in_proj], xz.data(), N, C, 2 * Di, false);
    launch_flat(N * Di, [&] { conv_silu_kernel<float>(xz.data(), w[conv_w], w[conv_b], cp, u.data(), N, T, Di, K, true, pk); });
    mm(u.data(), w[x_proj], xdbl.data(), N, Di, ldx, false);
    mm(xdbl.data(), w[dt_proj], dt.data(), N, R, Di, false, ldx, Di, Di);
    launch_flat(N * Di, [&] { delta_kernel<float>(dt.data(), w[dt_bias], dp, N, Di); });
    if (nch > 1) {
      launch_cta(dim3e{static_cast<unsigned>(nchb * (nch - 1)), static_cast<unsigned>(B), 1}, nt, [&] {
        scan_chunk_local_kernel<float>(cp, dp, xdbl.data(), w[a_log], T, Di, Ns, R, L, cpb,
                                       states.data(), dsum.data(), pk);
      });
      if (nch > 2)
        launch_flat(B * Di * Ns, [&] {
          scan_chunk_combine_kernel<float>(w[a_log], dsum.data(), states.data(), B, nch, Di, Ns);
        });
    }
    launch_cta(dim3e{static_cast<unsigned>(nchb * nch), static_cast<unsigned>(B), 1}, nt, [&] {
      scan_forward_kernel<float>(xz.data(), cp, dp, xdbl.data(), w[a_log], w[dskip], T, Di, Ns, R,
                                 L, cpb, states.data(), gated.data(), nullptr, nullptr, pk);
    });
    mm(gated.data(), w[out_proj], r.out.data(), N, Di, C, false);
    if (y_fwd) *y_fwd = gated;
  }
  r.states = states;
  // backward
  r.dx.resize(N * C);
  for (int i = 0; i < 9; ++i) r.g[i] = p.g0[i];
  std::vector<float> c(N * Di), u(N * Di), dt(N * Di), delta(N * Di), dg(N * Di), gated(N * Di);
  std::vector<float> dxz(N * 2 * Di), carry(B * nch * Di * Ns);
  std::vector<float> bdsum(mamba_chunk_sum_elements(B, T, L, Di));
  const size_t nblk = mamba_blocks(Di, mamba_scan_channels);
  std::vector<float> part(nblk * N * 2 * Ns), small(B * nch * Di * 2), du(N * Di), ddt(N * Di);
  std::vector<float> dxdbl(N * ldx);
  const size_t nrb = mamba_blocks(N, mamba_conv_rows);
  std::vector<float> cpart(nrb * Di * (K + 1));
  float* cp;
  float* dp;
  if (keep) {
    cp = saved_c.data();
    dp = saved_delta.data();
    launch_flat(N * Di, [&] { conv_silu_kernel<float>(xz.data(), w[conv_w], w[conv_b], cp, u.data(), N, T, Di, K, false, pk); });
  } else {
    cp = c.data();
    dp = delta.data();
    launch_flat(N * Di, [&] { conv_silu_kernel<float>(xz.data(), w[conv_w], w[conv_b], cp, u.data(), N, T, Di, K, true, pk); });
    mm(xdbl.data(), w[dt_proj], dt.data(), N, R, Di, false, ldx, Di, Di);
    launch_flat(N * Di, [&] { delta_kernel<float>(dt.data(), w[dt_bias], dp, N, Di); });
  }
  mm_bt(p.dout.data(), w[out_proj], dg.data(), N, C, Di, false);
  launch_cta(dim3e{static_cast<unsigned>(nchb * nch), static_cast<unsigned>(B), 1}, nt, [&] {
    scan_forward_kernel<float>(xz.data(), cp, dp, xdbl.data(), w[a_log], w[dskip], T, Di, Ns, R, L,
                               cpb, states.data(), gated.data(), dg.data(), dxz.data(), pk);
  });
  if (y_bwd) *y_bwd = gated;
  mm_at(gated.data(), p.dout.data(), r.g[out_proj].data(), N, Di, C, true);
  if (nch > 1) {  // the reverse scan: A' (chunk-local dL/dh, ΣΔ), B' (the carry over chunks), C'
    launch_cta(dim3e{static_cast<unsigned>(nchb * (nch - 1)), static_cast<unsigned>(B), 1}, nt, [&] {
      scan_backward_local_kernel<float>(xz.data(), dp, xdbl.data(), w[a_log], dg.data(), T, Di, Ns,
                                        R, L, cpb, carry.data(), bdsum.data(), pk);
    });
    if (nch > 2)
      launch_flat(B * Di * Ns, [&] {
        scan_backward_combine_kernel<float>(w[a_log], bdsum.data(), carry.data(), B, nch, Di, Ns);
      });
  }
  launch_cta(dim3e{static_cast<unsigned>(nblk * nch), static_cast<unsigned>(B), 1}, nt, [&] {
    scan_backward_kernel<float>(xz.data(), cp, dp, xdbl.data(), w[a_log], w[dskip], states.data(),
                                carry.data(), dg.data(), T, Di, Ns, R, L, cpb, ddt.data(), du.data(),
                                part.data(), small.data(), pk);
  });
  launch_flat(N * 2 * Ns, [&] { reduce_bc_kernel<float>(part.data(), dxdbl.data(), N, Ns, R, nblk); });
  launch_flat(Di * (Ns + 2), [&] {
    reduce_small_kernel<float>(carry.data(), small.data(), w[a_log], r.g[a_log].data(),
                               r.g[dskip].data(), r.g[dt_bias].data(), B * nch, Di, Ns);
  });
  mm_at(xdbl.data(), ddt.data(), r.g[dt_proj].data(), N, R, Di, true, ldx, Di, Di);
  mm_bt(ddt.data(), w[dt_proj], dxdbl.data(), N, Di, R, false, Di, Di, ldx);
  mm_at(u.data(), dxdbl.data(), r.g[x_proj].data(), N, Di, ldx, true);
  mm_bt(dxdbl.data(), w[x_proj], du.data(), N, ldx, Di, true);
  launch_flat(N * Di, [&] { conv_backward_data_kernel<float>(du.data(), cp, w[conv_w], dxz.data(), N, T, Di, K, pk); });
  launch_seq(dim3e{static_cast<unsigned>(mamba_blocks(Di, 128)), static_cast<unsigned>(nrb), 1}, 128, [&] {
    conv_backward_weight_kernel<float>(du.data(), cp, xz.data(), cpart.data(), N, T, Di, K, pk);
  });
  launch_flat(Di * (K + 1), [&] {
    conv_reduce_kernel<float>(cpart.data(), r.g[conv_w].data(), r.g[conv_b].data(), nrb, Di, K);
  });
  mm_at(p.x.data(), dxz.data(), r.g[in_proj].data(), N, C, 2 * Di, true);
  mm_bt(dxz.data(), w[in_proj], r.dx.data(), N, 2 * Di, C, false);
  return r;
}

template <size_t L>
void run_case(const char* name, size_t B, size_t T, size_t C, size_t Di, size_t Ns, size_t K,
              size_t R, const std::vector<std::int32_t>& offsets = {}) {
  mb::mamba_shape s;
  if (!offsets.empty()) {
    s.offsets = offsets.data();
    s.sequences = offsets.size() - 1;
  }
  s.batch = B;
  s.seq = T;
  s.d_model = C;
  s.d_inner = Di;
  s.d_state = Ns;
  s.d_conv = K;
  s.dt_rank = R;
  std::printf("%s: B %zu T %zu Di %zu Ns %zu chunk %zu (%zu chunks)%s\n", name, B, T, Di, Ns, L,
              mamba_chunks(T, L), offsets.empty() ? "" : " packed");
  const problem p = make_problem(s, 7);
  const outputs want = run_cpu<L, mb::recompute>(p);
  const outputs want_keep = run_cpu<L, mb::save_all>(p);
  std::vector<float> yf, yb;
  const outputs got = run_emu(p, L, false, &yf, &yb);
  const outputs got_keep = run_emu(p, L, true, nullptr, nullptr);
  // Against the CPU's fp32 block: test_cuda_mamba's fp32 bound, 1e-5 (normwise per tensor). The
  // worst of each side against the fp64 block is reported: the chunk-parallel scan's rounding
  // should be no worse than the CPU's serial one.
  const outputs ref = run_cpu<L, mb::recompute, mb::fp64_precision>(p);
  double worst = 0, worst_dev = 0, worst_cpu = 0;
  auto cmp = [&](const char* what, const std::vector<float>& g, const std::vector<float>& w32,
                 const std::vector<float>& w64) {
    const double e = rel(g, w32);
    worst = std::max(worst, e);
    worst_dev = std::max(worst_dev, rel(g, w64));
    worst_cpu = std::max(worst_cpu, rel(w32, w64));
    if (!(e <= 1e-5)) {
      ++fails;
      std::printf("  FAIL %s: %.3g against the CPU (fp32)\n", what, e);
    }
  };
  cmp("out", got.out, want.out, ref.out);
  cmp("saved states", got.states, want.states, ref.states);
  cmp("dx", got.dx, want.dx, ref.dx);
  for (int i = 0; i < 9; ++i) {
    std::vector<float> a = got.g[i], b = want.g[i], c = ref.g[i];
    for (size_t e = 0; e < a.size(); ++e) {
      a[e] -= p.g0[i][e];
      b[e] -= p.g0[i][e];
      c[e] -= p.g0[i][e];
    }
    char what[64];
    std::snprintf(what, sizeof what, "d%s", wname[i]);
    cmp(what, a, b, c);
  }
  std::printf("  worst over out, states, dx, gradients: %.3g against the CPU (fp32); against "
              "fp64: %.3g here, %.3g the CPU\n", worst, worst_dev, worst_cpu);
  // The backward's y (phase C alone, on the saved states) is the forward's.
  check_bits("y in backward vs forward", yb, yf);
  // The recompute policy changes nothing (device and CPU alike).
  check_bits("save_all vs recompute: out", got_keep.out, got.out);
  check_bits("save_all vs recompute: states", got_keep.states, got.states);
  check_bits("save_all vs recompute: dx", got_keep.dx, got.dx);
  for (int i = 0; i < 9; ++i) check_bits("save_all vs recompute: a gradient", got_keep.g[i], got.g[i]);
  check_bits("cpu save_all vs recompute: dx", want_keep.dx, want.dx);
}

int main(int argc, char** argv) {
  if (argc > 1) g_cpb_cap = static_cast<unsigned>(std::atoi(argv[1]));
  std::printf("channels per CTA: %s\n", g_cpb_cap ? argv[1] : "the launchers'");
  run_case<8>("T not a multiple of the chunk", 2, 37, 12, 20, 16, 4, 3);
  run_case<8>("T < chunk", 1, 5, 8, 20, 16, 4, 2);
  run_case<32>("two chunks (no combine)", 1, 33, 8, 10, 16, 4, 2);
  run_case<16>("T a multiple of the chunk", 2, 64, 8, 12, 4, 3, 2);
  run_case<1>("chunk 1, d_state 1, two backward blocks", 2, 9, 8, 70, 1, 4, 2);
  run_case<4>("d_state 5, d_conv 1", 1, 23, 8, 33, 5, 1, 1);
  run_case<8>("many chunks", 1, 203, 8, 6, 16, 4, 2);
  run_case<8>("T 1", 2, 1, 8, 20, 16, 3, 1);
  run_case<16>("T = chunk", 1, 16, 8, 9, 16, 4, 2);
  run_case<16>("T = chunk + 1, B 3", 3, 17, 8, 9, 16, 4, 2);
  // Chunks of more than mamba_backward_saved_states tiles: the reverse scan's runs of m > 1 tiles
  // (a tile's states recomputed through its run's earlier tiles), a last run cut short.
  run_case<256>("chunk 256: runs of 2 tiles, then a short chunk", 1, 300, 8, 5, 4, 4, 2);
  run_case<512>("T < chunk, 26 tiles (runs of 2, the last one short)", 2, 203, 8, 3, 16, 4, 2);
  run_case<1024>("one chunk of 125 tiles (runs of 8, the last of 5)", 1, 1000, 8, 3, 2, 4, 2);
  // Packed sequences (the CPU layer's packed call is the specification, itself equal to each
  // sequence alone in tests/unit): starts inside chunks and tiles, at a chunk's first step (the
  // carry cut exactly there), a chunk with two starts, sequences shorter than the conv (1, 2),
  // an empty one, one spanning several chunks (the carry between them kept).
  run_case<8>("packed: lengths 1, 2, 0, 13, 8, 20, 3", 1, 47, 8, 12, 16, 4, 2,
              {0, 1, 3, 3, 16, 24, 44, 47});
  run_case<16>("packed, chunk 16: lengths 40, 1, 30, 9", 1, 80, 8, 10, 4, 3, 2, {0, 40, 41, 71, 80});
  run_case<1>("packed, chunk 1: lengths 3, 6", 1, 9, 8, 6, 2, 4, 1, {0, 3, 9});
  run_case<256>("packed, chunk 256 (runs of 2 tiles): lengths 150, 150", 1, 300, 8, 5, 4, 4, 2,
                {0, 150, 300});
  std::printf("%s (%d failures)\n", fails ? "FAILED" : "all passed", fails);
  return fails ? 1 : 0;
}
