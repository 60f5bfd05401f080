// Host emulation of the model's bandwidth-bound device kernels (backend/cuda/model_kernels.inl:
// RMSNorm forward, apply and backward, the elementwise maps, the embedding gather, the fused
// cross-entropy, the gradient norm's first pass, AdamW's step), for a machine without a GPU. Built and run by
// `tests/emulation/cuda_emulate.py model`, which compiles the kernels' own text (the file nvcc
// compiles) as plain C++: __global__/__device__ vanish, each CTA runs its threads on a team of
// host threads (cta_threads.hpp), one CTA after another, __syncthreads a barrier, a warp's lane
// exchange a rendezvous of its 32 threads (under -fsanitize=thread a missing barrier shows as a
// data race). The launch configurations are the launchers' (backend/cuda/model.cuh), copied here.
//
// Checks, for float and bf16 storage: every kernel against the CPU backend (backend/cpu/model.hpp,
// sum_squares): float within 2e-6 relative (1e-4 for RMSNorm's dx and dg, sums of many terms in
// another order), bf16 within one rounding (2^-8 relative) of it; the exact ones (add, convert,
// gather) bit for bit; the 16-byte path (Vec) and the grouped element path give the same bits on
// the same aligned data (one order of sums whatever the alignment; RMSNorm's forward takes rows
// that are not whole groups element by element, strided); AdamW bit for bit adamw_step per element over segments with
// gaps and unaligned offsets, clipping through the device norm, the skip flag; apply reproduces
// the forward's bits; a grid-stride loop over several blocks; tails shorter than a group;
// in-place SwiGLU backward; ignore_target rows; a bad token.
// What it cannot check: the launchers themselves, 16-byte access on a real device, timing.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "membound/membound.hpp"

#include "cta_threads.hpp"

struct dim3e {
  unsigned x = 0, y = 1, z = 1;
};
static thread_local dim3e threadIdx, blockIdx;
static dim3e gridDim, blockDim;
static emu_support::barrier* g_bar = nullptr;
#define __global__
#define __device__
#define __launch_bounds__(...)
#define __shared__ static
#define __syncthreads() g_bar->arrive_and_wait()

namespace emu {
using namespace membound;
using std::isfinite;

// The live test buffers' byte ranges: every access is checked against them (a kernel that reads
// or writes past its buffer's n fails here, even where the buffer's padding would hide it).
static std::vector<std::pair<const unsigned char*, const unsigned char*>> g_buffers;
inline void need_inside(const void* p, std::size_t bytes, const char* what) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (const auto& r : g_buffers) {
    if (b >= r.first && b + bytes <= r.second) return;
  }
  std::fprintf(stderr, "%s: an access outside every buffer\n", what);
  std::abort();
}

template <class S>
inline float ld(const S* p, std::size_t i) {
  need_inside(p + i, sizeof(S), "ld");
  return to_accum<float>(p[i]);
}
template <class S>
inline void st(S* p, std::size_t i, float v) {
  need_inside(p + i, sizeof(S), "st");
  p[i] = from_accum<S>(v);  // round to nearest even, as the device's st
}
struct raw16 {
  unsigned x, y, z, w;
};
template <unsigned W, class S>
inline void ld_vec(const S* p, std::size_t i, float (&v)[W]) {
  static_assert(W * sizeof(S) % 16 == 0);
  if (reinterpret_cast<std::uintptr_t>(p + i) % 16 != 0) {
    std::fprintf(stderr, "ld_vec: unaligned address\n");
    std::abort();
  }
  need_inside(p + i, W * sizeof(S), "ld_vec");
  for (unsigned k = 0; k < W; ++k) v[k] = ld(p, i + k);
}
template <unsigned W, class S>
inline void st_vec(S* p, std::size_t i, const float (&v)[W]) {
  static_assert(W * sizeof(S) % 16 == 0);
  if (reinterpret_cast<std::uintptr_t>(p + i) % 16 != 0) {
    std::fprintf(stderr, "st_vec: unaligned address\n");
    std::abort();
  }
  need_inside(p + i, W * sizeof(S), "st_vec");
  for (unsigned k = 0; k < W; ++k) st(p, i + k, v[k]);
}

// One warp's rendezvous: each lane posts its value, waits, reads its partner's, waits again.
struct warp_state {
  emu_support::barrier bar{32};
  double v[32];
};
static warp_state* g_warps = nullptr;
static unsigned char* g_smem = nullptr;
inline unsigned char* model_smem() { return g_smem; }

template <class T>
inline T lane_xor(T v, unsigned mask) {
  warp_state& w = g_warps[threadIdx.x / 32];
  const unsigned lane = threadIdx.x % 32;
  w.v[lane] = static_cast<double>(v);  // float and double both round-trip exactly
  w.bar.arrive_and_wait();
  const T r = static_cast<T>(w.v[lane ^ mask]);
  w.bar.arrive_and_wait();
  return r;
}

#include "membound/backend/cuda/model_sizes.inl"
#include "membound/backend/cuda/model_kernels.inl"
}  // namespace emu

namespace mb = membound;

static int fails = 0;
static int checks = 0;

// Every CTA of a 1-D grid, one after another, on a team of `block` host threads.
template <class F>
void launch(unsigned grid, unsigned block, std::size_t smem_bytes, F kernel) {
  gridDim = {grid, 1, 1};
  blockDim = {block, 1, 1};
  for (unsigned x = 0; x < grid; ++x) {
    std::unique_ptr<unsigned char[]> smem(new unsigned char[smem_bytes + 16]);
    std::memset(smem.get(), 0xff, smem_bytes + 16);  // NaN bits: a read before a write shows
    emu::g_smem = smem.get();
    emu_support::barrier bar(block);
    g_bar = &bar;
    std::vector<emu::warp_state> warps((block + 31) / 32);
    emu::g_warps = warps.data();
    emu_support::cta_team(block).run([&](unsigned t) {
      threadIdx = {t, 0, 0};
      blockIdx = {x, 0, 0};
      kernel();
    });
  }
}

unsigned grid_groups(std::size_t n, std::size_t G, std::size_t threads) {  // model.cuh's grid_for_groups
  const std::size_t b = ((n + G - 1) / G + threads - 1) / threads;
  return static_cast<unsigned>(b == 0 ? 1 : (b < 65536 ? b : 65536));
}
unsigned row_ctas(std::size_t N) { return static_cast<unsigned>((N + emu::row_warps - 1) / emu::row_warps); }

// A 16-byte-aligned buffer of n values (the device's allocations are 256-byte aligned).
template <class T>
struct buf {
  std::vector<T> store;
  T* p;
  std::size_t n;
  explicit buf(std::size_t count) : store(count + 16), n(count) {
    auto a = reinterpret_cast<std::uintptr_t>(store.data());
    p = store.data() + ((16 - a % 16) % 16) / sizeof(T);
    emu::g_buffers.emplace_back(reinterpret_cast<const unsigned char*>(p), reinterpret_cast<const unsigned char*>(p + n));
  }
  buf(const std::vector<T>& v) : buf(v.size()) { std::copy(v.begin(), v.end(), p); }
  buf(const buf&) = delete;
  buf& operator=(const buf&) = delete;
  ~buf() {
    for (auto it = emu::g_buffers.begin(); it != emu::g_buffers.end(); ++it) {
      if (it->first == reinterpret_cast<const unsigned char*>(p)) {
        emu::g_buffers.erase(it);
        break;
      }
    }
  }
  std::vector<T> vec() const { return std::vector<T>(p, p + n); }
};

template <class S>
std::vector<S> rnd(std::size_t n, unsigned seed, float lo = -1.0f, float hi = 1.0f) {
  std::vector<S> v(n);
  unsigned s = seed * 2654435761u + 7;
  for (auto& x : v) {
    s = s * 1664525u + 1013904223u;
    x = mb::from_accum<S>(lo + (hi - lo) * (static_cast<float>(s >> 8) / 16777216.0f));
  }
  return v;
}

template <class T>
double val(T v) {
  if constexpr (std::is_same_v<T, double>) {
    return v;
  } else {
    return static_cast<double>(mb::to_accum<float>(v));
  }
}

// max |a − b| / max(|b|, floor) within tol.
template <class T, class U>
void close(const char* what, const std::vector<T>& a, const std::vector<U>& b, double tol, double floor = 1e-3) {
  ++checks;
  double worst = 0;
  std::size_t at = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = std::abs(val(a[i]) - val(b[i])) / std::max(std::abs(val(b[i])), floor);
    if (!(d <= worst)) {
      worst = d;
      at = i;
    }
  }
  if (a.size() != b.size() || !(worst <= tol)) {
    ++fails;
    std::printf("FAIL %s: %g at %zu (tolerance %g)\n", what, worst, at, tol);
  }
}
template <class T>
void same(const char* what, const std::vector<T>& a, const std::vector<T>& b) {
  ++checks;
  if (a.size() != b.size() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) != 0) {
    ++fails;
    std::printf("FAIL %s: not bit-identical\n", what);
  }
}
void expect(const char* what, bool ok) {
  ++checks;
  if (!ok) {
    ++fails;
    std::printf("FAIL %s\n", what);
  }
}

template <class S>
constexpr double tol() {
  return std::is_same_v<S, float> ? 2e-6 : 1.0 / 256;
}

// --- RMSNorm --------------------------------------------------------------------------------------

template <class S>
struct rms_out {
  std::vector<S> y, y_apply, dx, dg;
  std::vector<float> rstd;
};

// W: the forward launcher's row path (row_path_for): G when C is a whole number of groups, else 1;
// the backward takes groups always (as its launcher).
template <class S, unsigned W, bool Vec>
rms_out<S> rms_device(const std::vector<S>& x, const std::vector<S>& g, const std::vector<S>& dy,
                           const std::vector<S>& res, const std::vector<S>& dg0, std::size_t N, std::size_t C,
                           bool residual = true) {
  buf<S> bx(x), bg(g), bdy(dy), bres(res), by(N * C), bya(N * C), bdx(N * C), bdg(dg0);
  buf<float> brstd(N), part(emu::rmsnorm_backward_partials(N) * C);
  launch(row_ctas(N), emu::row_cta_threads, 0, [&] {
    emu::rmsnorm_rows_kernel<W, Vec>(bx.p, bg.p, by.p, brstd.p, N, C, 1e-5f, true);
  });
  launch(row_ctas(N), emu::row_cta_threads, 0, [&] {
    emu::rmsnorm_rows_kernel<W, Vec>(bx.p, bg.p, bya.p, brstd.p, N, C, 0.0f, false);
  });
  const std::size_t blocks = emu::rmsnorm_backward_partials(N);
  launch(static_cast<unsigned>(blocks), emu::row_cta_threads, emu::rmsnorm_backward_smem_bytes<S>(C), [&] {
    emu::rmsnorm_backward_rows_kernel<emu::group_of<S>, Vec>(bx.p, bg.p, brstd.p, bdy.p, residual ? bres.p : nullptr,
                                                              bdx.p, part.p, N, C);
  });
  // rmsnorm_dweight_kernel (model.cuh): dg[c] += Σ_b partial[b][c], the blocks in order.
  for (std::size_t c = 0; c < C; ++c) {
    float s = 0;
    for (std::size_t b = 0; b < blocks; ++b) s += part.p[b * C + c];
    bdg.p[c] = mb::from_accum<S>(mb::to_accum<float>(bdg.p[c]) + s);
  }
  return {by.vec(), bya.vec(), bdx.vec(), bdg.vec(), brstd.vec()};
}

template <class S>
void rmsnorm_case(std::size_t N, std::size_t C) {
  mb::thread_pool pool(1);
  const auto x = rnd<S>(N * C, 1), g = rnd<S>(C, 2, 0.5f, 1.5f), dy = rnd<S>(N * C, 3), res = rnd<S>(N * C, 4);
  const auto dg0 = rnd<S>(C, 5);
  std::vector<S> y(N * C), dx(N * C), dg = dg0;
  std::vector<float> rstd(N), part(mb::cpu::row_partials(N, C));
  mb::cpu::rmsnorm_forward<float>(pool, x.data(), g.data(), y.data(), rstd.data(), N, C, 1e-5);
  mb::cpu::rmsnorm_backward<float>(pool, x.data(), g.data(), rstd.data(), dy.data(), res.data(), dx.data(),
                                   dg.data(), part.data(), N, C);
  constexpr unsigned G = emu::group_of<S>;
  const bool grouped = C % G == 0;
  const auto e = grouped ? rms_device<S, G, false>(x, g, dy, res, dg0, N, C)
                         : rms_device<S, 1, false>(x, g, dy, res, dg0, N, C);
  char what[96];
  const auto name = [&](const char* s) {
    std::snprintf(what, sizeof what, "rmsnorm %s (%s, N %zu, C %zu)", s, sizeof(S) == 4 ? "fp32" : "bf16", N, C);
    return what;
  };
  close(name("y"), e.y, y, tol<S>());
  close(name("rstd"), e.rstd, rstd, 2e-6);
  // dx subtracts x·rstd³·dot/C from rstd·dy·g, dg sums N rows: sums of many terms in another
  // order, so within ~C·u of the terms' size (u = 6e-8), not of the result's: 1e-4 (the GPU test's).
  const double dtol = std::is_same_v<S, float> ? 1e-4 : tol<S>();
  close(name("dx"), e.dx, dx, dtol, 1e-2);
  close(name("dg"), e.dg, dg, dtol, 1e-2);
  same(name("apply == forward"), e.y_apply, e.y);
  if (grouped) {
    const auto v = rms_device<S, G, true>(x, g, dy, res, dg0, N, C);
    same(name("16-byte path y"), v.y, e.y);
    same(name("16-byte path rstd"), v.rstd, e.rstd);
    same(name("16-byte path dx"), v.dx, e.dx);
    same(name("16-byte path dg"), v.dg, e.dg);
  }
  // No residual (nullptr): dx alone, against the CPU's without one.
  std::vector<S> dx0(N * C), dg1 = dg0;
  mb::cpu::rmsnorm_backward<float>(pool, x.data(), g.data(), rstd.data(), dy.data(), static_cast<const S*>(nullptr),
                                   dx0.data(), dg1.data(), part.data(), N, C);
  const auto n0 = grouped ? rms_device<S, G, false>(x, g, dy, res, dg0, N, C, false)
                          : rms_device<S, 1, false>(x, g, dy, res, dg0, N, C, false);
  close(name("dx without a residual"), n0.dx, dx0, dtol, 1e-2);
}

// --- Elementwise maps, check_finite, the norm's first pass ----------------------------------------------------

template <class S, bool Vec>
void elementwise_run(std::size_t n, unsigned grid, unsigned block, std::vector<S>& sum, std::vector<float>& act,
                     std::vector<S>& act_s, std::vector<float>& da, std::vector<float>& db, std::vector<S>& conv,
                     std::vector<float>& db_inplace, const std::vector<S>& a, const std::vector<S>& b,
                     const std::vector<float>& d) {
  buf<S> ba(a), bb(b), bsum(n), bact_s(n), bconv(n);
  buf<float> bact(n), bda(n), bdb(n), bd(d), binp(d), bda2(n);
  launch(grid, block, 0, [&] { emu::add_kernel<Vec>(ba.p, bb.p, bsum.p, n); });
  launch(grid, block, 0, [&] { emu::swiglu_forward_kernel<Vec>(ba.p, bb.p, bact.p, n); });
  launch(grid, block, 0, [&] { emu::swiglu_forward_kernel<Vec>(ba.p, bb.p, bact_s.p, n); });
  launch(grid, block, 0, [&] {
    emu::swiglu_backward_kernel<Vec>(ba.p, bb.p, static_cast<const float*>(bd.p), bda.p, bdb.p, n);
  });
  launch(grid, block, 0, [&] {
    emu::swiglu_backward_kernel<Vec>(ba.p, bb.p, static_cast<const float*>(binp.p), bda2.p, binp.p, n);
  });
  launch(grid, block, 0, [&] { emu::convert_kernel<Vec>(static_cast<const float*>(bd.p), bconv.p, n); });
  sum = bsum.vec();
  act = bact.vec();
  act_s = bact_s.vec();
  da = bda.vec();
  db = bdb.vec();
  conv = bconv.vec();
  db_inplace = binp.vec();
  same("swiglu backward in place (da)", bda2.vec(), da);
}

template <class S>
void elementwise_case(std::size_t n) {
  const auto a = rnd<S>(n, 11, -6.0f, 6.0f), b = rnd<S>(n, 12);
  const auto dv = rnd<float>(n, 13);
  std::vector<S> sum(n), conv(n);
  std::vector<float> act(n), da(n), db(n);
  for (std::size_t i = 0; i < n; ++i) {
    const float av = mb::to_accum<float>(a[i]), bv = mb::to_accum<float>(b[i]);
    sum[i] = mb::from_accum<S>(av + bv);
    act[i] = mb::swiglu(av, bv);
    mb::swiglu_backward(av, bv, dv[i], da[i], db[i]);
    conv[i] = mb::from_accum<S>(dv[i]);
  }
  std::vector<S> esum, eact_s, econv;
  std::vector<float> eact, eda, edb, einp;
  constexpr unsigned G = emu::group_of<S>;
  // The launchers' grid, then a small one whose threads loop over several groups each.
  for (unsigned pass = 0; pass < 2; ++pass) {
    const unsigned block = pass == 0 ? 256 : 64, grid = pass == 0 ? grid_groups(n, G, 256) : 2;
    elementwise_run<S, false>(n, grid, block, esum, eact, eact_s, eda, edb, econv, einp, a, b, dv);
    same("add (one rounding: exact)", esum, sum);
    same("convert (one rounding: exact)", econv, conv);
    close("swiglu act", eact, act, 2e-6);
    close("swiglu act (storage)", eact_s, act, tol<S>());
    close("swiglu da", eda, da, 2e-6);
    close("swiglu db", edb, db, 2e-6);
    same("swiglu backward in place (db)", einp, edb);
    std::vector<S> vsum, vact_s, vconv;
    std::vector<float> vact, vda, vdb, vinp;
    elementwise_run<S, true>(n, grid, block, vsum, vact, vact_s, vda, vdb, vconv, vinp, a, b, dv);
    same("16-byte path add", vsum, esum);
    same("16-byte path swiglu act", vact, eact);
    same("16-byte path swiglu act (storage)", vact_s, eact_s);
    same("16-byte path swiglu da", vda, eda);
    same("16-byte path swiglu db", vdb, edb);
    same("16-byte path convert", vconv, econv);
  }

  // check_finite: clean, then one inf in the last (partial) group, then a NaN in the middle.
  for (unsigned bad = 0; bad < 3; ++bad) {
    auto data = rnd<S>(n, 14);
    if (bad == 1) data[n - 1] = mb::from_accum<S>(INFINITY);
    if (bad == 2) data[n / 2] = mb::from_accum<S>(NAN);
    for (int vec = 0; vec < 2; ++vec) {
      buf<S> bd(data);
      buf<unsigned> flag(1);
      flag.p[0] = 0;
      if (vec) {
        launch(grid_groups(n, G, 256), 256, 0, [&] { emu::check_finite_kernel<true>(bd.p, n, flag.p); });
      } else {
        launch(grid_groups(n, G, 256), 256, 0, [&] { emu::check_finite_kernel<false>(bd.p, n, flag.p); });
      }
      expect(bad == 0 ? "check_finite: clean data" : "check_finite: a non-finite value", flag.p[0] == (bad ? 1u : 0u));
    }
  }

  // The norm's first pass (global_norm_blocks(n) CTAs) and norm_final_kernel's sum in order.
  const auto gv = rnd<S>(n, 15, -3.0f, 3.0f);
  mb::thread_pool pool(1);
  const double ref = mb::cpu::sum_squares(gv.data(), n, pool);
  std::vector<double> sums;
  for (int vec = 0; vec < 2; ++vec) {
    buf<S> bg(gv);
    const std::size_t blocks = emu::global_norm_blocks(n);
    buf<double> part(blocks);
    if (vec) {
      launch(static_cast<unsigned>(blocks), emu::norm_threads, 0, [&] { emu::norm_partial_kernel<true>(bg.p, n, part.p); });
    } else {
      launch(static_cast<unsigned>(blocks), emu::norm_threads, 0, [&] { emu::norm_partial_kernel<false>(bg.p, n, part.p); });
    }
    double s = 0;
    for (std::size_t i = 0; i < blocks; ++i) s += part.p[i];
    sums.push_back(s);
  }
  close("sum of squares", std::vector<double>{sums[0]}, std::vector<double>{ref}, 1e-13);
  same("16-byte path sum of squares", std::vector<double>{sums[1]}, std::vector<double>{sums[0]});
}

// --- Embedding gather -------------------------------------------------------------------------------

template <class S>
void embedding_case(std::size_t N, std::size_t C, std::size_t V) {
  mb::thread_pool pool(1);
  std::vector<std::int32_t> tok(N);
  for (std::size_t i = 0; i < N; ++i) tok[i] = static_cast<std::int32_t>((i * 7 + 3) % V);
  const auto table = rnd<S>(V * C, 22);
  std::vector<S> x(N * C);
  mb::cpu::embedding_gather(pool, tok.data(), table.data(), x.data(), N, C);
  for (int vec = 0; vec < 2; ++vec) {
    if (vec && C * sizeof(S) % 16 != 0) continue;
    buf<std::int32_t> bt(tok);
    buf<S> btab(table), bx(N * C);
    buf<unsigned> bad(1);
    bad.p[0] = 0;
    const auto run = [&] {
      if (vec) {
        launch(row_ctas(N), emu::row_cta_threads, 0,
               [&] { emu::embedding_gather_kernel<true>(bt.p, btab.p, bx.p, N, C, V, bad.p); });
      } else {
        launch(row_ctas(N), emu::row_cta_threads, 0,
               [&] { emu::embedding_gather_kernel<false>(bt.p, btab.p, bx.p, N, C, V, bad.p); });
      }
    };
    run();
    same("embedding gather (bits)", bx.vec(), x);
    expect("embedding gather: no bad token", bad.p[0] == 0);
    bt.p[N - 1] = static_cast<std::int32_t>(V);
    run();
    bool zero = true;
    for (std::size_t c = 0; c < C; ++c) zero = zero && mb::to_accum<float>(bx.p[(N - 1) * C + c]) == 0.0f;
    expect("embedding gather: a bad token is flagged and gives a zero row", bad.p[0] == 1 && zero);
  }
}

// --- Cross-entropy ----------------------------------------------------------------------------------

void cross_entropy_case(std::size_t R, std::size_t V) {
  mb::thread_pool pool(1);
  auto logits = rnd<float>(R * V, 31, -8.0f, 8.0f);
  std::vector<std::int32_t> targets(R);
  for (std::size_t r = 0; r < R; ++r) targets[r] = static_cast<std::int32_t>((r * 131 + 5) % V);
  targets[3] = mb::ignore_target;
  targets[R - 1] = static_cast<std::int32_t>(V - 1);  // the last column: the last (maybe partial) group
  const float scale = 1.0f / 29.0f;
  std::vector<float> grad = logits;
  std::vector<double> row(R);
  mb::cpu::cross_entropy_chunk<float>(pool, grad.data(), targets.data(), R, V, scale, row.data());
  std::vector<std::vector<float>> outs;
  std::vector<std::vector<double>> losses;
  for (int vec = 0; vec < 2; ++vec) {
    if (vec && V % 4 != 0) continue;
    buf<float> bl(logits);
    buf<std::int32_t> bt(targets);
    buf<double> bloss(R);
    if (vec) {
      launch(static_cast<unsigned>(R), emu::xent_threads, 0,
             [&] { emu::cross_entropy_kernel<4, true>(bl.p, bt.p, V, scale, bloss.p); });
    } else {
      launch(static_cast<unsigned>(R), emu::xent_threads, 0,
             [&] { emu::cross_entropy_kernel<4, false>(bl.p, bt.p, V, scale, bloss.p); });
    }
    outs.push_back(bl.vec());
    losses.push_back(bloss.vec());
  }
  close("cross-entropy gradient", outs[0], grad, 1e-5, 1e-6);
  close("cross-entropy row losses", losses[0], row, 1e-6);
  if (outs.size() == 2) {
    same("16-byte path cross-entropy gradient", outs[1], outs[0]);
    same("16-byte path cross-entropy row losses", losses[1], losses[0]);
  }
  // A NaN logit spreads to its row's loss, also alone among −inf in the last group, where the
  // group's maximum (fmaxf) is −inf.
  if (V > 4) {
    auto poisoned = logits;
    for (std::size_t v = V - 4; v < V - 1; ++v) poisoned[v] = -INFINITY;
    poisoned[V - 1] = NAN;
    buf<float> bp(poisoned);
    buf<std::int32_t> btt(targets);
    buf<double> bpl(R);
    launch(static_cast<unsigned>(R), emu::xent_threads, 0,
           [&] { emu::cross_entropy_kernel<4, false>(bp.p, btt.p, V, scale, bpl.p); });
    expect("cross-entropy: a NaN logit (beside −inf) gives a NaN loss", std::isnan(bpl.p[0]) && std::isfinite(bpl.p[1]));
  }
  // A row whose target is out of range: NaN loss.
  auto bad = targets;
  bad[0] = static_cast<std::int32_t>(V);
  buf<float> bl(logits);
  buf<std::int32_t> bt(bad);
  buf<double> bloss(R);
  launch(static_cast<unsigned>(R), emu::xent_threads, 0,
         [&] { emu::cross_entropy_kernel<4, false>(bl.p, bt.p, V, scale, bloss.p); });
  expect("cross-entropy: a target outside [0, V) gives a NaN loss", std::isnan(bloss.p[0]));
}

// --- AdamW ------------------------------------------------------------------------------------------

// Segments with gaps, an offset that is not a group multiple (its groups go element by element),
// counts that end inside a group and a segment longer than one CTA; clipping through the device
// norm, then a step that a set skip flag leaves undone. Against adamw_step per element, bit for bit.
template <class S>
void adamw_case(const std::vector<emu::adamw_segment>& segs) {
  constexpr bool has_master = !std::is_same_v<S, float>;
  const std::size_t n = 5000;
  const auto w0 = rnd<S>(n, 41), g = rnd<S>(n, 42);
  const auto m0 = rnd<float>(n, 43, -0.01f, 0.01f), v0 = rnd<float>(n, 44, 0.0f, 0.01f);
  const auto coeff = mb::adamw_coefficients<float>::at(3, 1e-3, 0.9, 0.95, 1e-8, 0.1, true);
  const double norm = 4.0, max_norm = 1.0, loss_scale = 2.0, grad_scale = 0.5;
  const float gs = static_cast<float>(max_norm / (norm / loss_scale) / loss_scale * grad_scale);
  // The reference: each listed element stepped once, the rest unchanged.
  std::vector<S> w = w0;
  std::vector<float> m = m0, v = v0, master(n);
  for (std::size_t i = 0; i < n; ++i) master[i] = mb::to_accum<float>(w0[i]);
  for (const auto& sg : segs) {
    auto k = coeff;
    k.wd = sg.decay ? coeff.wd : 0.0f;
    for (std::size_t i = sg.offset; i < sg.offset + sg.count; ++i) {
      float p = master[i];
      mb::adamw_step(k, mb::to_accum<float>(g[i]) * gs, m[i], v[i], p);
      master[i] = p;
      w[i] = mb::from_accum<S>(p);
    }
  }
  // The launcher's choice: the 16-byte path only when every segment's offset is a group multiple.
  bool aligned = true;
  for (const auto& sg : segs) aligned = aligned && sg.offset % emu::group_of<S> == 0;
  for (int vec = 0; vec < (aligned ? 2 : 1); ++vec) {
    const std::size_t per_block = vec ? emu::adamw_per_block<true, S> : emu::adamw_per_block<false, S>;
    for (int skip = 0; skip < 2; ++skip) {
      buf<S> bw(w0), bg(g);
      buf<float> state(3 * n);  // m, v, master: adamw<S>'s layout (the master only for 16-bit S)
      std::copy(m0.begin(), m0.end(), state.p);
      std::copy(v0.begin(), v0.end(), state.p + n);
      for (std::size_t i = 0; i < n; ++i) state.p[2 * n + i] = mb::to_accum<float>(w0[i]);
      buf<double> dnorm(std::vector<double>{norm});
      buf<unsigned> dskip(std::vector<unsigned>{static_cast<unsigned>(skip)});
      const auto batches = emu::adamw_batches(segs, per_block, coeff.wd);  // adamw_update's launches
      const emu::adamw_device_inputs dev{dnorm.p, max_norm, loss_scale, dskip.p};
      float* ms = state.p;
      float* vs = state.p + n;
      float* mas = has_master ? state.p + 2 * n : nullptr;
      for (const emu::adamw_batch& batch : batches) {
        const auto blocks = static_cast<unsigned>(batch.blocks);
        if (vec) {
          launch(blocks, emu::adamw_threads, 0,
                 [&] { emu::adamw_kernel<true>(bw.p, bg.p, ms, vs, mas, batch, coeff, grad_scale, dev); });
        } else {
          launch(blocks, emu::adamw_threads, 0,
                 [&] { emu::adamw_kernel<false>(bw.p, bg.p, ms, vs, mas, batch, coeff, grad_scale, dev); });
        }
      }
      const std::vector<float> gm(state.p, state.p + n), gv(state.p + n, state.p + 2 * n);
      const char* path = vec ? "adamw (16-byte path)" : "adamw";
      char what[96];
      if (skip) {
        std::snprintf(what, sizeof what, "%s: a set skip flag changes nothing", path);
        expect(what, std::memcmp(bw.p, w0.data(), n * sizeof(S)) == 0 && gm == m0 && gv == v0);
        continue;
      }
      std::snprintf(what, sizeof what, "%s weights", path);
      same(what, bw.vec(), w);
      std::snprintf(what, sizeof what, "%s first moments", path);
      same(what, gm, m);
      std::snprintf(what, sizeof what, "%s second moments", path);
      same(what, gv, v);
      if (has_master) {
        std::snprintf(what, sizeof what, "%s masters", path);
        same(what, std::vector<float>(state.p + 2 * n, state.p + 3 * n), master);
      }
    }
  }
}

int main() {
  for (std::size_t N : {37, 5}) {
    for (std::size_t C : {301, 256, 40}) {
      rmsnorm_case<float>(N, C);
      rmsnorm_case<mb::bf16>(N, C);
    }
  }
  for (std::size_t n : {1003, 1024, 5}) {
    elementwise_case<float>(n);
    elementwise_case<mb::bf16>(n);
  }
  embedding_case<float>(19, 12, 7);
  embedding_case<mb::bf16>(19, 24, 7);
  embedding_case<mb::bf16>(19, 13, 7);
  cross_entropy_case(13, 1001);
  cross_entropy_case(11, 1000);
  cross_entropy_case(3, 5);
  // Gaps, offsets off the groups, counts ending inside a group, a segment over several CTAs.
  const std::vector<emu::adamw_segment> ragged = {{0, 37, true}, {40, 2100, false}, {2141, 9, true}, {2160, 2840, true}};
  const std::vector<emu::adamw_segment> grouped = {{0, 37, true}, {40, 2100, false}, {2144, 9, true}, {2160, 2840, true}};
  adamw_case<float>(ragged);
  adamw_case<mb::bf16>(ragged);
  adamw_case<float>(grouped);
  adamw_case<mb::bf16>(grouped);
  // More segments than one launch takes, empty ones among the first 32: each stepped once.
  std::vector<emu::adamw_segment> many;
  for (std::size_t i = 0; i < 45; ++i) many.push_back({i * 100, i % 7 == 3 ? 0 : 90 + i % 5, i % 2 == 0});
  adamw_case<float>(many);
  adamw_case<mb::bf16>(many);
  std::printf("%s: %d of %d checks failed\n", fails ? "FAIL" : "ok", fails, checks);
  return fails ? 1 : 0;
}
