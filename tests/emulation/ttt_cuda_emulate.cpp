// Host emulation of backend/cuda/ttt.cuh's kernels, for a machine without a GPU. Built and run by
// `tests/emulation/cuda_emulate.py ttt`, which compiles the kernels' text (backend/cuda/ttt_sizes.inl,
// ttt_kernels.inl, what nvcc compiles) here as plain C++: __global__/__device__ vanish, threadIdx is
// a thread_local, each CTA of the inner loop's kernels (forward, backward and the decoding step)
// runs as 32 host threads (one warp; 64 where it says) with __syncthreads a barrier
// (cta_threads.hpp; under -fsanitize=thread a missing barrier shows as a data race) and a lane
// group's row_sums a rendezvous of its warp's threads; every other kernel runs one thread per CTA.
// A host copy of the launchers' sequence (naive fp32 loops for the cuBLASLt GEMMs) drives them:
// - against the fp32 CPU layer on the same inputs: the saved checkpoints, y, dx and the decoded
//   outputs (normwise 1e-5);
// - against the CPU layer in float64: y, dx and every gradient (5e-5, see run());
// - bit for bit across G, the inner loop's placements (shared memory: a buffer of the launch's
//   exact size per CTA) and 64 threads against 32;
// - packed sequences the same way, against the CPU layer's packed call;
// - the tensor-core products (mma_strip below, from the PTX ISA's fragment layouts) at head_dim 16,
//   12 (padded tiles and steps) and 64.
// What it cannot check: the launchers themselves (copied here by hand), cuBLASLt, the bf16 paths,
// CUB's block reductions (one thread here), row_sums' shuffles (replayed, not shuffled), and
// anything about the real device.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>
#include <algorithm>
#include <memory>
#include <limits>
#include "membound/membound.hpp"

#include "cta_threads.hpp"
#include "host_gemm.hpp"

struct dim3e { unsigned x; };
static thread_local dim3e threadIdx{0}, blockIdx{0};
static dim3e blockDim{1};
static emu_support::barrier* g_bar = nullptr;
#define __global__
#define __device__
#define __noinline__
#define __launch_bounds__(...)
#define __shared__ static
#define __syncthreads() g_bar->arrive_and_wait()

namespace emu {
// One warp's rendezvous: each lane posts its value and waits; then reads and waits again (so the
// next post never overwrites a value still being read).
struct warp_state {
  emu_support::barrier bar{32};
  float v[4][32];  // up to 4 values a lane
  // a lane's mma_strip fragments (4 + 2·NT floats a step), in two sets used in turn: a lane posts into
  // one only after the warp's previous rendezvous, which every lane reaches after its last read
  // of that set, so one rendezvous a tile suffices
  std::vector<float> frag[2][32];
  unsigned turn[32] = {};
};
static warp_state* g_warps = nullptr;
using membound::packed_sequences;
using membound::gelu_tanh_f;
using membound::gelu_tanh_d1;
using membound::gelu_tanh_d2;
template <class S> inline float ld(const S* p, std::size_t i) { return p[i]; }
template <class S> inline void st(S* p, std::size_t i, float v) { p[i] = v; }
namespace detail {
constexpr unsigned row_threads = 1;
struct op_sum {};
template <class T, unsigned N> struct block_allreduce {
  struct storage {};
  template <class Op> static T run(T v, Op, storage&) { return v; }
};
}  // namespace detail
// ttt.cuh's row_sums (for m = 4, 2, 1: v[k] += lane_xor(v[k], m)) in one rendezvous of the warp
// instead of one per shuffle: each lane replays its group's butterfly over the posted values,
// the same additions in the same order, so the same bits. A rendezvous per shuffle made this
// emulation minutes long.
constexpr unsigned row_lanes = 8, rows_per_warp = 32 / row_lanes;
template <unsigned N>
inline void row_sums(float (&v)[N]) {
  static_assert(N <= 4, "warp_state holds 4 values a lane");
  warp_state& w = g_warps[threadIdx.x / 32];
  const unsigned lane = threadIdx.x % 32, base = lane - lane % row_lanes;
  for (unsigned k = 0; k < N; ++k) w.v[k][lane] = v[k];
  w.bar.arrive_and_wait();
  for (unsigned k = 0; k < N; ++k) {
    float t[row_lanes], u[row_lanes];
    for (unsigned l = 0; l < row_lanes; ++l) t[l] = w.v[k][base + l];
    for (unsigned m = row_lanes / 2; m >= 1; m /= 2) {
      for (unsigned l = 0; l < row_lanes; ++l) u[l] = t[l] + t[l ^ m];
      std::copy_n(u, row_lanes, t);
    }
    v[k] = t[lane % row_lanes];
  }
  w.bar.arrive_and_wait();
}
// ttt.cuh's mma_strip in one rendezvous of the warp per strip (one barrier): each lane gathers its
// fragments of every step through the kernels' own frag (block_strips' layout), posts them, and
// sums its outputs from every lane's posts by the PTX ISA's m16n8k8 layouts, written here from the
// ISA and not from the kernels: a(r, k) is lane (r mod 8)·4 + k mod 4's register [r ≥ 8] +
// 2·[k ≥ 4], b(k, n) lane 4n + k mod 4's [k ≥ 4], and d[q] is (g + 8·[q ≥ 2], 2t + q mod 2).
// Each step is mma_strip's three products a tile: operands split as cvt.rna.tf32 does (nearest,
// ties away, 10 mantissa bits), hi·hi into d, lo·hi then hi·lo into ds, each product's 8 terms
// and its accumulator summed in double and rounded once; d + ds at the end. The device's tensor
// cores add in their own order and rounding: its bits differ from these by rounding (the tests
// bound both against float64).
inline float tf32_rna(float x) {
  if (!std::isfinite(x)) return x;
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  u = (u + 0x1000u) & 0xffffe000u;
  std::memcpy(&x, &u, 4);
  return x;
}
template <unsigned NT, class Frag>
inline void mma_strip(float (&d)[NT][4], unsigned ksteps, Frag frag) {
  warp_state& w = g_warps[threadIdx.x / 32];
  const unsigned lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, per = 4 + 2 * NT;
  const std::vector<float>* posts = w.frag[w.turn[lane]];
  std::vector<float>& mine = w.frag[w.turn[lane]][lane];
  w.turn[lane] ^= 1u;
  mine.resize(ksteps * per);
  for (unsigned s = 0; s < ksteps; ++s) {
    float a[4], b[NT][2];
    frag(s, a, b);
    std::copy_n(a, 4, &mine[s * per]);
    for (unsigned n = 0; n < NT; ++n) std::copy_n(b[n], 2, &mine[s * per + 4 + 2 * n]);
  }
  w.bar.arrive_and_wait();
  const auto A = [&](unsigned s, unsigned r, unsigned k) {
    return posts[(r % 8) * 4 + k % 4][s * per + (r >= 8) + 2 * (k >= 4)];
  };
  const auto B = [&](unsigned s, unsigned tile, unsigned k, unsigned n) {
    return posts[4 * n + k % 4][s * per + 4 + 2 * tile + (k >= 4)];
  };
  for (unsigned tile = 0; tile < NT; ++tile)
    for (unsigned q = 0; q < 4; ++q) {
      const unsigned r = g + 8 * (q >= 2), n = 2 * t + q % 2;
      float ds = 0.0f;
      for (unsigned s = 0; s < ksteps; ++s) {
        for (int part = 0; part < 3; ++part) {  // lo·hi, hi·lo into ds; hi·hi into d
          float& c = part < 2 ? ds : d[tile][q];
          double acc = c;
          for (unsigned k = 0; k < 8; ++k) {
            const float x = A(s, r, k), y = B(s, tile, k, n);
            const float xh = tf32_rna(x), yh = tf32_rna(y);
            const float xp = part == 0 ? tf32_rna(x - xh) : xh, yp = part == 1 ? tf32_rna(y - yh) : yh;
            acc += double(xp) * double(yp);
          }
          c = static_cast<float>(acc);
        }
      }
      d[tile][q] += ds;
    }
}
constexpr unsigned ttt_inner_threads = 1, ttt_backward_threads = 1;
// The CTA's dynamic shared memory: its own buffer of exactly the launch's size (ASan sees a
// carve past it), shared by the CTA's threads.
static float* g_smem = nullptr;
inline float* ttt_smem() { return g_smem; }
#include "membound/backend/cuda/ttt_sizes.inl"
#include "membound/backend/cuda/ttt_kernels.inl"
}  // namespace emu

namespace mb = membound;
using namespace emu;

template <class F> void launch(std::size_t grid, F f) {
  blockDim.x = 1;
  threadIdx.x = 0;
  emu_support::barrier bar(1);
  g_bar = &bar;
  for (std::size_t b = 0; b < grid; ++b) { blockIdx.x = static_cast<unsigned>(b); f(); }
}
// One CTA of nt threads (whole warps) at a time (a kept team, cta_threads.hpp), __syncthreads a
// barrier (races show under TSan).
unsigned g_nt = 32;
template <class F> void launch_cta(std::size_t grid, std::size_t smem_bytes, F f) {
  const unsigned nt = g_nt;
  blockDim.x = nt;
  for (std::size_t b = 0; b < grid; ++b) {
    std::unique_ptr<float[]> sm(new float[smem_bytes / sizeof(float) + (smem_bytes == 0)]);
    g_smem = smem_bytes ? sm.get() : nullptr;
    emu_support::barrier bar(nt);
    g_bar = &bar;
    std::vector<warp_state> warps(nt / 32);
    g_warps = warps.data();
    emu_support::cta_team(nt).run([&](unsigned t) {
      threadIdx.x = t;
      blockIdx.x = static_cast<unsigned>(b);
      f();
    });
  }
  blockDim.x = 1;
}
using emu_support::mm;
using emu_support::mm_at;
using emu_support::mm_bt;

struct W { std::vector<float> wq, wk, wv, nw, nb, w1, b1, lr_w, lr_b, tok, post_w, post_b, wg, wo, w2, b2; };
std::vector<float> rnd(size_t n, unsigned seed, float scale, float off = 0) {
  std::vector<float> v(n ? n : 1); unsigned s = seed * 2654435761u + 7;
  for (auto& x : v) { s = s * 1664525u + 1013904223u; x = off + scale * (float(s >> 8) / 16777216.0f - 0.5f); }
  return v;
}
double rel(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, sc = 1e-2; for (size_t i = 0; i < a.size(); ++i) { d = std::max(d, (double)std::fabs(a[i]-b[i])); sc = std::max(sc, (double)std::fabs(b[i])); }
  return d / sc;
}
int fails = 0;
void check(const char* what, const std::vector<float>& got, const std::vector<float>& want, double tol) {
  const double e = rel(got, want);
  if (!(e <= tol)) { std::printf("  FAIL %s: %.3g\n", what, e); ++fails; }
  else if (e > tol / 10) std::printf("  %s: %.3g\n", what, e);
}

struct Out { std::vector<float> y, dx, dec; std::vector<std::vector<float>> g; };
struct Ref { std::vector<double> y, dx; std::vector<std::vector<double>> g; };
double rel64(const std::vector<float>& a, const std::vector<double>& b) {
  double d = 0, sc = 1e-2; for (size_t i = 0; i < a.size(); ++i) { d = std::max(d, std::fabs(a[i]-b[i])); sc = std::max(sc, std::fabs(b[i])); }
  return d / sc;
}
double g_worst64 = 0;
void check64(const char* what, const std::vector<float>& got, const std::vector<double>& want, double tol) {
  const double e = rel64(got, want);
  g_worst64 = std::max(g_worst64, e);
  if (!(e <= tol)) { std::printf("  FAIL %s against float64: %.3g\n", what, e); ++fails; }
}

// The CPU layer in float64 on the same inputs: y, dx and every gradient (from zero).
template <bool Mlp, size_t MB, size_t G>
Ref reference64(const mb::ttt_shape& s, const std::vector<const std::vector<float>*>& wl,
                const std::vector<float>& x, const std::vector<float>& dy) {
  using L = mb::basic_ttt<Mlp, mb::fp64_precision, mb::ttt_mini_batch<MB>, mb::ttt_state_groups<G>>;
  std::vector<std::vector<double>> w, g;
  for (const auto* v : wl) { w.emplace_back(v->begin(), v->end()); g.emplace_back(v->size(), 0.0); }
  typename L::weights lw{w[0].data(), w[1].data(), w[2].data(), w[3].data(), w[4].data(), w[5].data(), w[6].data(),
      w[7].data(), w[8].data(), w[9].data(), w[10].data(), w[11].data(), w[12].data(), w[13].data()};
  typename L::gradients lg{g[0].data(), g[1].data(), g[2].data(), g[3].data(), g[4].data(), g[5].data(), g[6].data(),
      g[7].data(), g[8].data(), g[9].data(), g[10].data(), g[11].data(), g[12].data(), g[13].data()};
  if (Mlp) { lw.w2 = w[14].data(); lw.b2 = w[15].data(); lg.w2 = g[14].data(); lg.b2 = g[15].data(); }
  mb::thread_pool pool(1);
  const size_t sb = L::saved_bytes(s), wsb = std::max(L::forward_workspace_bytes(s, 1), L::backward_workspace_bytes(s, 1));
  std::vector<double> saved(sb / 8 + 64), ws(wsb / 8 + 64);
  auto al = [](std::vector<double>& v) { void* p = v.data(); size_t sp = v.size() * 8; return std::align(256, 1, p, sp); };
  void* svp = al(saved); void* wsp = al(ws);
  const std::vector<double> xd(x.begin(), x.end()), dyd(dy.begin(), dy.end());
  Ref r{std::vector<double>(x.size()), std::vector<double>(x.size()), {}};
  L::forward(s, lw, xd.data(), r.y.data(), svp, sb, wsp, wsb, pool);
  L::backward(s, lw, xd.data(), svp, sb, dyd.data(), r.dx.data(), lg, wsp, wsb, pool);
  r.g = std::move(g);
  return r;
}
// Bit for bit (the decoded outputs where both runs decoded).
bool same(const Out& p, const Out& q) {
  return p.y == q.y && p.dx == q.dx && p.g == q.g && (p.dec.empty() || q.dec.empty() || p.dec == q.dec);
}

// level: how much of the inner loop's working set the launch puts on chip, as a device limit
// would: 0 nothing, 1 the rows, 2 the rows and the running state, 3 everything (as much as fits),
// 4 the running state alone.
// decode: also the decoding step, token by token (on the runs that say so: it is a third of the
// emulation's time).
template <bool Mlp, size_t MB, size_t G>
Out run(const mb::ttt_shape& s, int level = 3, bool decode = false) {
  using L = mb::basic_ttt<Mlp, mb::fp32_precision, mb::ttt_mini_batch<MB>, mb::ttt_state_groups<G>>;
  const size_t B = s.batch, T = s.seq, C = s.width, H = s.heads, D = s.head_dim(), F = Mlp ? 4*D : D, N = B*T;
  const size_t SZ = Mlp ? 2*D*F + F + D : D*D + D;
  W w{rnd(C*C,1,.3f), rnd(C*C,2,.3f), rnd(C*C,3,.3f), rnd(H*D,4,.1f,1), rnd(H*D,5,.1f), rnd(H*D*F,6,.2f),
      rnd(H*F,7,.1f), rnd(H*C,8,.2f), rnd(H,9,.5f), rnd(MB,10,.05f), rnd(C,11,.1f,1), rnd(C,12,.1f),
      rnd(C*C,13,.3f), rnd(C*C,14,.3f), rnd(Mlp?H*F*D:1,15,.2f), rnd(Mlp?H*D:1,16,.1f)};
  auto x = rnd(N*C, 20, 1), dy = rnd(N*C, 22, 1);
  std::vector<std::vector<float>*> wl{&w.wq,&w.wk,&w.wv,&w.nw,&w.nb,&w.w1,&w.b1,&w.lr_w,&w.lr_b,&w.tok,&w.post_w,&w.post_b,&w.wg,&w.wo,&w.w2,&w.b2};
  std::vector<std::vector<float>> g0; for (unsigned i = 0; i < 16; ++i) g0.push_back(rnd(wl[i]->size(), 60+i, .05f));
  typename L::weights lw{w.wq.data(), w.wk.data(), w.wv.data(), w.nw.data(), w.nb.data(), w.w1.data(), w.b1.data(),
      w.lr_w.data(), w.lr_b.data(), w.tok.data(), w.post_w.data(), w.post_b.data(), w.wg.data(), w.wo.data()};
  if (Mlp) { lw.w2 = w.w2.data(); lw.b2 = w.b2.data(); }
  // CPU layer
  mb::thread_pool pool(1);
  const size_t sb = L::saved_bytes(s), wsb = std::max(L::forward_workspace_bytes(s,1), L::backward_workspace_bytes(s,1));
  std::vector<float> savedc(sb/4 + 64), wsc(wsb/4 + 64);
  auto al = [](std::vector<float>& v){ void* p = v.data(); size_t sp = v.size()*4; return std::align(256, 1, p, sp); };
  void* svp = al(savedc); void* wsp = al(wsc);
  std::vector<float> yc(N*C), dxc(N*C); auto gc = g0;
  typename L::gradients lg{gc[0].data(),gc[1].data(),gc[2].data(),gc[3].data(),gc[4].data(),gc[5].data(),gc[6].data(),
      gc[7].data(),gc[8].data(),gc[9].data(),gc[10].data(),gc[11].data(),gc[12].data(),gc[13].data()};
  if (Mlp) { lg.w2 = gc[14].data(); lg.b2 = gc[15].data(); }
  L::forward(s, lw, x.data(), yc.data(), svp, sb, wsp, wsb, pool);
  // the saved layout puts the larger slot first (workspace_layout: larger slots first)
  const size_t ckb = L::saved_state_bytes(s), ob = N * C * 4;
  const float* ckp = static_cast<float*>(svp) + (ckb >= ob ? 0 : (ob + 255) / 256 * 256 / 4);
  std::vector<float> ck_before(ckp, ckp + ckb / 4);
  L::backward(s, lw, x.data(), svp, sb, dy.data(), dxc.data(), lg, wsp, wsb, pool);

  // Emulated device forward (the launcher's sequence)
  const packed_sequences pk = s.packing();  // host memory here, the device copy on a GPU
  const size_t rows_n = pk.packed() ? s.sequences : B;  // the inner loop's rows: one CTA per (row, head)
  const size_t nmb = T / MB + (T % MB != 0), ncp = mb::ttt_saved_states(s, MB, G), gsz = std::min(G, nmb);
  std::vector<float> q(N*C), k(N*C), v(N*C), lr(N*H), sig(N*H), tok(MB), ckpt(B*H*ncp*SZ), o(N*C), pn(N*C), y(N*C), gpre(N*C);
  auto project = [&]{
    mm(x.data(), w.wq.data(), q.data(), N, C, C, false); mm(x.data(), w.wk.data(), k.data(), N, C, C, false);
    mm(x.data(), w.wv.data(), v.data(), N, C, C, false);
    const size_t pairs = N*H*(D/2);
    launch(pairs, [&]{ rope_kernel(q.data(), N, T, H, D, s.rope_base, MB, MB, false, pk); });
    launch(pairs, [&]{ rope_kernel(k.data(), N, T, H, D, s.rope_base, MB, MB, false, pk); });
    mm_bt(x.data(), w.lr_w.data(), lr.data(), N, C, H, false);
    const float scale = float(s.base_lr / double(D));
    launch(std::max(N*H, MB), [&]{ rates_kernel<float>(lr.data(), w.lr_b.data(), N, H, scale, w.tok.data(), tok.data(), MB, sig.data()); });
  };
  project();
  {
    std::vector<float> scratch(rows_n*H*ttt_forward_elements(SZ, D, F, MB, Mlp));
    const size_t rows = ttt_forward_rows(D, F, MB, Mlp);
    const size_t lim = level == 0 ? 0 : level == 1 ? rows*4 : level == 2 ? (rows+SZ)*4 : level == 4 ? SZ*4 : size_t(-1);
    const auto pl = ttt_placement(rows, SZ, 0, lim);
    if (pl.place != (level == 0 ? 0u : level == 1 ? 1u : level == 4 ? 2u : 3u)) { std::printf("  FAIL forward placement %u at level %d\n", pl.place, level); ++fails; }
    const inner_args a{q.data(), k.data(), v.data(), lr.data(), tok.data(), T, H, D, F, SZ, MB, G, ncp, nmb, 1e-6f, pl.place, pk};
    launch_cta(rows_n*H, pl.shared_bytes, [&]{ ttt_forward_kernel<Mlp, float>(a, w.nw.data(), w.nb.data(), w.w1.data(), w.b1.data(), w.w2.data(), w.b2.data(), o.data(), ckpt.data(), scratch.data()); });
    const float* gp = nullptr;
    if (s.use_gate) { mm(x.data(), w.wg.data(), gpre.data(), N, C, C, false); gp = gpre.data(); }
    launch(N, [&]{ ttt_post_norm_kernel<float>(o.data(), w.post_w.data(), w.post_b.data(), gp, pn.data(), C, 1e-6f); });
    mm(pn.data(), w.wo.data(), y.data(), N, C, C, false);
  }
  // the saved buffer against the CPU's
  std::vector<float> ck_c(ck_before.begin(), ck_before.begin() + B*H*ncp*SZ);
  check("saved checkpoints", ckpt, ck_c, 1e-5);
  check("y", y, yc, 1e-5);
  // Emulated device backward (the launcher's sequence)
  Out r; r.y = y; r.g = g0;
  std::vector<float> dx(N*C), dpn(N*C), xh(N*C), d_o(N*C), dq(N*C), dk(N*C), dv(N*C), pns(N*C), dlr(N*H);
  std::vector<float> part(rows_n*H*ttt_partial_elements(SZ, D, MB)), bscr(rows_n*H*ttt_backward_scratch_elements(SZ, D, F, MB, gsz, Mlp));
  std::fill(q.begin(), q.end(), 0.f); std::fill(k.begin(), k.end(), 0.f); project();
  mm_bt(dy.data(), w.wo.data(), dpn.data(), N, C, C, false);
  float* gp = nullptr;
  if (s.use_gate) { mm(x.data(), w.wg.data(), gpre.data(), N, C, C, false); gp = gpre.data(); }
  launch(N, [&]{ ttt_post_norm_backward_kernel<float>(o.data(), w.post_w.data(), w.post_b.data(), gp, dpn.data(), pns.data(), xh.data(), d_o.data(), C, 1e-6f); });
  mm_at(pns.data(), dy.data(), r.g[13].data(), N, C, C, true);
  if (s.use_gate) { mm_at(x.data(), gpre.data(), r.g[12].data(), N, C, C, true); mm_bt(gpre.data(), w.wg.data(), dx.data(), N, C, C, false); }
  else std::fill(dx.begin(), dx.end(), 0.f);
  launch(C, [&]{ ttt_post_params_kernel<float>(dpn.data(), xh.data(), N, C, r.g[10].data(), r.g[11].data()); });
  const size_t brows = ttt_backward_rows(D, F, MB, Mlp);
  const size_t blim = level == 0 ? 0 : level == 1 ? brows*4 : level == 2 ? (brows+2*SZ)*4 : level == 4 ? 2*SZ*4 : size_t(-1);
  const auto bpl = ttt_placement(brows, 2*SZ, gsz*SZ, blim);
  if (bpl.place != (level == 0 ? 0u : level == 1 ? 1u : level == 2 ? 3u : level == 4 ? 2u : 7u)) { std::printf("  FAIL backward placement %u at level %d\n", bpl.place, level); ++fails; }
  const backward_args ba{q.data(), k.data(), v.data(), lr.data(), tok.data(), d_o.data(), ckpt.data(), dq.data(), dk.data(), dv.data(), dlr.data(),
                         part.data(), bscr.data(), T, H, D, F, SZ, MB, G, gsz, ncp, nmb, 1e-6f, bpl.place, pk};
  launch_cta(rows_n*H, bpl.shared_bytes, [&]{ ttt_backward_kernel<Mlp, float>(ba, w.nw.data(), w.nb.data()); });
  ttt_grad_targets<float> tg{r.g[5].data(), r.g[6].data(), Mlp ? r.g[14].data() : nullptr, Mlp ? r.g[15].data() : nullptr, r.g[3].data(), r.g[4].data(), r.g[9].data()};
  launch(H*(SZ+2*D) + MB, [&]{ ttt_reduce_partials_kernel<float>(part.data(), rows_n, H, D, F, SZ, MB, w.tok.data(), tg); });
  launch(N*H, [&]{ ttt_rate_grad_kernel(dlr.data(), lr.data(), sig.data(), N*H); });
  launch(H*C + H, [&]{ ttt_rate_params_kernel<float>(dlr.data(), x.data(), N, H, C, r.g[7].data(), r.g[8].data()); });
  launch(N*C, [&]{ ttt_rate_dx_kernel<float>(dlr.data(), w.lr_w.data(), N, H, C, dx.data()); });
  const size_t pairs = N*H*(D/2);
  launch(pairs, [&]{ rope_kernel(dq.data(), N, T, H, D, s.rope_base, MB, MB, true, pk); });
  launch(pairs, [&]{ rope_kernel(dk.data(), N, T, H, D, s.rope_base, MB, MB, true, pk); });
  const float* gr[3] = {dq.data(), dk.data(), dv.data()}; const float* ws[3] = {w.wq.data(), w.wk.data(), w.wv.data()};
  for (int i = 0; i < 3; ++i) { mm_at(x.data(), gr[i], r.g[i].data(), N, C, C, true); mm_bt(gr[i], ws[i], dx.data(), N, C, C, true); }
  r.dx = dx;
  check("dx", dx, dxc, 1e-5);
  const char* names[16] = {"wq","wk","wv","nw","nb","w1","b1","lr_w","lr_b","tok","post_w","post_b","wg","wo","w2","b2"};
  // The gradients (and y, dx again) against the layer in float64. Some are sums over every token
  // with cancellation (lr_b: 2.2e-5 between the fp32 CPU layer and float64), so the emulation's
  // sums, in another order than the CPU's, are held to 5e-5 against the exact values instead of
  // 1e-5 against the fp32 CPU layer's roundings (measured: 4.7e-6 at worst).
  {
    const Ref ref = reference64<Mlp, MB, G>(s, std::vector<const std::vector<float>*>(wl.begin(), wl.end()), x, dy);
    const double tol = 5e-5;
    check64("y", y, ref.y, tol);
    check64("dx", dx, ref.dx, tol);
    for (int i = 0; i < (Mlp ? 16 : 14); ++i) {
      std::vector<float> a = r.g[i];
      for (size_t e = 0; e < a.size(); ++e) a[e] -= g0[i][e];
      check64(names[i], a, ref.g[i], tol);
    }
  }
  // Emulated decoding (the step launcher's sequence), token by token from the reset state, against
  // the CPU layer's step on the same tokens.
  if (decode) {
    std::vector<float> cst(L::state_bytes(s) / 4 + 1), cws(L::step_workspace_bytes(s) / 4 + 64);
    void* cwp = al(cws);
    auto st = L::make_state(s, lw, cst.data(), L::state_bytes(s));
    std::vector<float> state(B*H*2*SZ), sscr(B*H*ttt_step_elements(SZ, D, F, Mlp));
    launch(B*H, [&]{ ttt_reset_kernel<float>(state.data(), H, D, F, SZ, Mlp, w.w1.data(), w.b1.data(), w.w2.data(), w.b2.data()); });
    std::vector<float> xt(B*C), yc_t(B*C), qt(B*C), kt(B*C), vt(B*C), lrt(B*H), tokt(MB), ot(B*C), pnt(B*C), yt(B*C), gt(B*C), want;
    const float scale = float(s.base_lr / double(D));
    for (size_t t = 0; t < T; ++t) {
      for (size_t b = 0; b < B; ++b) std::copy_n(x.data() + (b*T + t)*C, C, xt.data() + b*C);
      L::step(s, lw, st, xt.data(), yc_t.data(), cwp, L::step_workspace_bytes(s), pool);
      want.insert(want.end(), yc_t.begin(), yc_t.end());
      const unsigned i = static_cast<unsigned>(t % MB);
      mm(xt.data(), w.wq.data(), qt.data(), B, C, C, false); mm(xt.data(), w.wk.data(), kt.data(), B, C, C, false);
      mm(xt.data(), w.wv.data(), vt.data(), B, C, C, false);
      launch(B*H*(D/2), [&]{ rope_kernel(qt.data(), B, 1, H, D, s.rope_base, MB, i, false, packed_sequences{}); });
      launch(B*H*(D/2), [&]{ rope_kernel(kt.data(), B, 1, H, D, s.rope_base, MB, i, false, packed_sequences{}); });
      mm_bt(xt.data(), w.lr_w.data(), lrt.data(), B, C, H, false);
      launch(std::max(B*H, MB), [&]{ rates_kernel<float>(lrt.data(), w.lr_b.data(), B, H, scale, w.tok.data(), tokt.data(), MB); });
      const inner_args sa{qt.data(), kt.data(), vt.data(), lrt.data(), tokt.data(), 1, H, D, F, SZ, MB, 1, 1, 1, 1e-6f, 0, {}};
      launch_cta(B*H, 0, [&]{ ttt_step_kernel<Mlp, float>(sa, i, w.nw.data(), w.nb.data(), state.data(), ot.data(), sscr.data()); });
      const float* gp = nullptr;
      if (s.use_gate) { mm(xt.data(), w.wg.data(), gt.data(), B, C, C, false); gp = gt.data(); }
      launch(B, [&]{ ttt_post_norm_kernel<float>(ot.data(), w.post_w.data(), w.post_b.data(), gp, pnt.data(), C, 1e-6f); });
      mm(pnt.data(), w.wo.data(), yt.data(), B, C, C, false);
      r.dec.insert(r.dec.end(), yt.begin(), yt.end());
    }
    check("decoding y", r.dec, want, 1e-5);
  }
  return r;
}

template <bool Mlp> void kind() {
  constexpr size_t all = size_t(-1);
  mb::ttt_shape s{2, 37, 32, 2};
  std::printf("%s gate 0\n", Mlp ? "mlp" : "linear");
  auto a = run<Mlp, 16, 1>(s, 3, true), b = run<Mlp, 16, 2>(s), c = run<Mlp, 16, all>(s);
  if (!same(a, b) || !same(a, c)) { std::printf("  FAIL not bit-identical across G\n"); ++fails; }
  // Placement moves bytes only: the global-memory paths give the on-chip one's bits.
  for (int level : {0, 1, 2, 4}) {
    std::printf("%s placement level %d\n", Mlp ? "mlp" : "linear", level);
    if (!same(a, run<Mlp, 16, 1>(s, level)) || !same(b, run<Mlp, 16, 2>(s, level))) {
      std::printf("  FAIL placement level %d changed bits\n", level); ++fails; }
  }
  s.use_gate = true;
  std::printf("%s gate 1\n", Mlp ? "mlp" : "linear");
  auto d = run<Mlp, 16, 1>(s, 3, true), e = run<Mlp, 16, all>(s);
  if (!same(d, e)) { std::printf("  FAIL not bit-identical across G (gate)\n"); ++fails; }
  std::printf("%s b=1\n", Mlp ? "mlp" : "linear");
  run<Mlp, 1, 2>({1, 7, 16, 2}, 3, true);
  std::printf("%s T<b\n", Mlp ? "mlp" : "linear");
  run<Mlp, 16, 4>({3, 5, 16, 1});
  // The tensor-core products' edges: head_dim 12 (no multiple of 8: every product pads its tiles
  // and steps) and 64 (the models' head: 8 steps a tile, more tiles than warps), a short last
  // mini-batch each.
  std::printf("%s head_dim 12\n", Mlp ? "mlp" : "linear");
  run<Mlp, 16, 1>({1, 21, 24, 2});
  std::printf("%s head_dim 64\n", Mlp ? "mlp" : "linear");
  run<Mlp, 16, 2>({1, 37, 64, 1});
  // Packed sequences of lengths 5, 0, 16, 17, 1, 9 (a partial mini-batch, an empty sequence, one
  // of exactly b, one of b + 1, a single token): each restarts the state from the weights, its
  // mini-batches and RoPE positions start with it, its saved states follow the earlier ones'.
  // G 1 and 2 (a group cut at a sequence's end) give the same bits; placement moves bytes only.
  static const std::int32_t offsets[] = {0, 5, 5, 21, 38, 39, 48};
  mb::ttt_shape p{1, 48, 32, 2};
  p.offsets = offsets;
  p.sequences = 6;
  std::printf("%s packed\n", Mlp ? "mlp" : "linear");
  auto pa = run<Mlp, 16, 1>(p), pb = run<Mlp, 16, 2>(p), pc = run<Mlp, 16, 1>(p, 0);
  if (!same(pa, pb) || !same(pa, pc)) { std::printf("  FAIL packed: not bit-identical across G or placement\n"); ++fails; }
  // The CTA's size changes no bits: two warps against one (the gate and the decoding step included).
  std::printf("%s 64 threads\n", Mlp ? "mlp" : "linear");
  g_nt = 64;
  const Out d64 = run<Mlp, 16, 1>(s, 3, true);
  g_nt = 32;
  if (!same(d, d64)) { std::printf("  FAIL 64 threads changed bits\n"); ++fails; }
}

int main() {
  std::printf("threads per CTA: %u (and 64 where it says)\n", g_nt);
  kind<false>();
  kind<true>();
  std::printf("worst against float64: %.3g\n", g_worst64);
  std::printf("%s (%d failures)\n", fails ? "FAILED" : "all passed", fails);
  return fails ? 1 : 0;
}
