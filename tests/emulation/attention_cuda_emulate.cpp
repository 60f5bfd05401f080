// Host emulation of backend/cuda/attention_mma.cuh's tensor-core kernels (forward, dQ, dK/dV), for
// a machine without a GPU. Built and run by `tests/emulation/cuda_emulate.py attention`, which compiles the
// kernels' text (backend/cuda/attention_mma_sizes.inl, attention_mma_kernels.inl) here as plain C++:
// each CTA runs on a team of 128 host threads (cta_threads.hpp; threadIdx a thread_local, __syncthreads a barrier (cta_threads.hpp)), and
// the warp-level operations are emulated per warp of 32 threads: mma.sync.m16n8k16 gathers the
// 32 lanes' registers and computes each lane's D elements from the PTX ISA's fragment layouts
// (A row-major 16×16, B 16×8, C/D 16×8, low half of a register first), __shfl_xor_sync exchanges
// through the same rendezvous. Under -fsanitize=thread a missing barrier is a data race; under
// --sanitize address every buffer has its exact size, so an index past one shows.
//
// Checked, against a double-precision attention on the same (storage-rounded) inputs, for bf16
// and fp16 operands: o, lse (forward), dq, dk, dv (backward, given the reference lse and Δ), at
// shapes with T = 1, T a multiple of the tile and not, head_dim 8 to 128 (both DM), MHA, GQA and
// MQA, causal and bidirectional, sliding windows (tiles outside the band skipped, edges inside
// tiles, W = 2; bf16), packed sequences (bf16), batch 2; repeats bit-identical (bf16). What it cannot check: that the
// device's mma.sync matches the ISA's layouts as emulated here, its accumulation order, expf,
// the launchers, occupancy and speed. None of it replaces a GPU run.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "membound/membound.hpp"

#include "cta_threads.hpp"

struct dim3e {
  unsigned x, y, z;
};
static thread_local dim3e threadIdx{0, 0, 0}, blockIdx{0, 0, 0};
static emu_support::barrier* g_cta_bar = nullptr;
#define __global__
#define __device__
#define __launch_bounds__(...)
#define __syncthreads() g_cta_bar->arrive_and_wait()

namespace emu {
using membound::bf16;
using membound::fp16;

template <class S>
inline void st(S* p, std::size_t i, float v) {
  p[i] = static_cast<S>(v);  // Eigen's float -> bf16/fp16: round to nearest even, as the device's st
}
template <bool Bf16>
inline std::uint16_t half_bits(float v) {
  if constexpr (Bf16) {
    return std::bit_cast<std::uint16_t>(bf16(v));
  } else {
    return std::bit_cast<std::uint16_t>(fp16(v));
  }
}
template <bool Bf16>
inline float from_bits(std::uint32_t u) {
  const auto h = static_cast<std::uint16_t>(u & 0xffffu);
  if constexpr (Bf16) {
    return static_cast<float>(std::bit_cast<bf16>(h));
  } else {
    return static_cast<float>(std::bit_cast<fp16>(h));
  }
}

// One warp's rendezvous: each lane posts its registers, waits, reads what it needs, waits again
// (so the next post never overwrites a value still being read).
struct warp_state {
  emu_support::barrier bar{32};
  std::uint32_t a[32][4];
  std::uint32_t b[32][2];
  float f[32];
};
static warp_state* g_warps = nullptr;
static unsigned char* g_smem = nullptr;
inline unsigned char* attn_mma_smem() { return g_smem; }

inline float lane_xor(float v, unsigned mask) {
  warp_state& w = g_warps[threadIdx.x / 32];
  const unsigned lane = threadIdx.x % 32;
  w.f[lane] = v;
  w.bar.arrive_and_wait();
  const float r = w.f[lane ^ mask];
  w.bar.arrive_and_wait();
  return r;
}

template <bool Bf16>
inline void mma_16816(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                      std::uint32_t b1) {
  warp_state& w = g_warps[threadIdx.x / 32];
  const unsigned lane = threadIdx.x % 32;
  std::memcpy(w.a[lane], a, sizeof a);
  w.b[lane][0] = b0;
  w.b[lane][1] = b1;
  w.bar.arrive_and_wait();
  // A(r, k): lane 4·(r mod 8) + (k mod 8)/2, register (r >= 8) + 2·(k >= 8), half k mod 2.
  auto A = [&](unsigned r, unsigned k) {
    const std::uint32_t u = w.a[4 * (r % 8) + (k % 8) / 2][(r >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)];
    return from_bits<Bf16>((k & 1) ? u >> 16 : u);
  };
  // B(k, n): lane 4·n + (k mod 8)/2, register (k >= 8), half k mod 2.
  auto B = [&](unsigned k, unsigned n) {
    const std::uint32_t u = w.b[4 * n + (k % 8) / 2][k >= 8 ? 1 : 0];
    return from_bits<Bf16>((k & 1) ? u >> 16 : u);
  };
  const unsigned gr = lane >> 2, tq = lane & 3;
  for (unsigned e = 0; e < 4; ++e) {
    const unsigned r = gr + 8 * (e >> 1), c = 2 * tq + (e & 1);
    float acc = d[e];
    for (unsigned k = 0; k < 16; ++k) acc += A(r, k) * B(k, c);  // products exact in fp32
    d[e] = acc;
  }
  w.bar.arrive_and_wait();
}

namespace gpu {
#include "membound/backend/cuda/attention_mma_sizes.inl"
}  // namespace gpu
using namespace gpu;
using membound::attention_band;
#include "membound/backend/cuda/attention_mma_kernels.inl"
}  // namespace emu

namespace {

// Every CTA of a grid, one after another, each on the team of mma_threads host threads.
template <class F>
void launch(unsigned gx, unsigned gy, unsigned gz, std::size_t smem_bytes, F kernel) {
  for (unsigned z = 0; z < gz; ++z)
    for (unsigned y = 0; y < gy; ++y)
      for (unsigned x = 0; x < gx; ++x) {
        std::unique_ptr<unsigned char[]> smem(new unsigned char[smem_bytes]);
        std::memset(smem.get(), 0xff, smem_bytes);  // NaN-ish bits: a read before a write shows
        emu::g_smem = smem.get();
        emu_support::barrier bar(emu::gpu::mma_threads);
        g_cta_bar = &bar;
        std::vector<emu::warp_state> warps(emu::gpu::mma_threads / 32);
        emu::g_warps = warps.data();
        emu_support::cta_team(emu::gpu::mma_threads).run([&](unsigned t) {
          threadIdx = {t, 0, 0};
          blockIdx = {x, y, z};
          kernel();
        });
      }
}

struct shape {
  std::size_t B, T, H, Hkv, D;
  bool causal;
  std::size_t window = 0;  // sliding window W (0: none)
  const std::int32_t* offsets = nullptr;  // packed sequences (batch 1), or none
  std::size_t sequences = 0;
};

// The packed sequence holding token i, by a linear walk (the kernels binary-search).
std::size_t sequence_of(const shape& s, std::size_t i) {
  std::size_t q = 0;
  while (q + 1 < s.sequences && static_cast<std::size_t>(s.offsets[q + 1]) <= i) ++q;
  return q;
}

// Whether query i sees key j, spelled out per pair (the kernels read attention_band's ranges).
bool visible(const shape& s, std::size_t i, std::size_t j) {
  if (s.causal && j > i) return false;
  if (s.offsets != nullptr && sequence_of(s, i) != sequence_of(s, j)) return false;
  return s.window == 0 || (i > j ? i - j : j - i) < s.window;
}

std::vector<float> rnd(std::size_t n, unsigned seed, float scale) {
  std::vector<float> v(n);
  unsigned s = seed * 2654435761u + 7;
  for (auto& x : v) {
    s = s * 1664525u + 1013904223u;
    x = scale * (static_cast<float>(s >> 8) / 16777216.0f - 0.5f) * 2.0f;
  }
  return v;
}
template <class S>
void round_to(std::vector<float>& v) {
  for (auto& x : v) x = static_cast<float>(static_cast<S>(x));
}

// max |got - want| / max |want| (the GPU layer tests' normwise metric).
double normwise(const std::vector<double>& got, const std::vector<double>& want) {
  double d = 0, m = 1e-30;
  for (std::size_t i = 0; i < want.size(); ++i) {
    d = std::max(d, std::fabs(got[i] - want[i]));
    m = std::max(m, std::fabs(want[i]));
  }
  return d / m;
}
template <class T>
std::vector<double> widen(const std::vector<T>& v) {
  std::vector<double> r(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) r[i] = static_cast<double>(static_cast<float>(v[i]));
  return r;
}

int failures = 0;
void check(const char* what, const std::vector<double>& got, const std::vector<double>& want,
           double tol, double& worst) {
  const double e = normwise(got, want);
  worst = std::max(worst, e);
  if (!(e <= tol)) {
    std::printf("  FAIL %s: %.3g (tolerance %.3g)\n", what, e, tol);
    ++failures;
  }
}

template <class S, unsigned DM>
void run_shape(const shape& s, double tol, double& worst, bool repeat) {
  const std::size_t B = s.B, T = s.T, H = s.H, Hkv = s.Hkv, D = s.D, N = B * T;
  const std::size_t HD = H * D, KD = Hkv * D, group = H / Hkv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  auto q = rnd(N * HD, 1, 1.5f), k = rnd(N * KD, 2, 1.5f), v = rnd(N * KD, 3, 1.0f),
       dout = rnd(N * HD, 4, 1.0f);
  // Later keys grow, so the running max rises across tiles and the rescale is exercised.
  for (std::size_t n = 0; n < N; ++n)
    for (std::size_t c = 0; c < KD; ++c) k[n * KD + c] *= 1.0f + static_cast<float>(n % T) / 48.0f;
  round_to<S>(q), round_to<S>(k), round_to<S>(v), round_to<S>(dout);

  // Double-precision reference: o, lse, Δ = rowsum(dO ⊙ o), dq, dk, dv.
  std::vector<double> o_r(N * HD), lse_r(B * H * T), delta_r(B * H * T), dq_r(N * HD, 0.0),
      dk_r(N * KD, 0.0), dv_r(N * KD, 0.0);
  for (std::size_t b = 0; b < B; ++b)
    for (std::size_t h = 0; h < H; ++h) {
      const std::size_t g = h / group;
      for (std::size_t i = 0; i < T; ++i) {
        const std::size_t jn = T;  // masked keys keep p = 0
        std::vector<double> sc(jn, -INFINITY), p(jn, 0.0), dp(jn);
        double mx = -INFINITY;
        for (std::size_t j = 0; j < jn; ++j) {
          if (!visible(s, i, j)) continue;
          double a = 0;
          for (std::size_t d = 0; d < D; ++d)
            a += static_cast<double>(q[(b * T + i) * HD + h * D + d]) * k[(b * T + j) * KD + g * D + d];
          sc[j] = a * scale;
          mx = std::max(mx, sc[j]);
        }
        double sum = 0;
        for (std::size_t j = 0; j < jn; ++j)
          if (visible(s, i, j)) sum += p[j] = std::exp(sc[j] - mx);
        for (std::size_t j = 0; j < jn; ++j) p[j] /= sum;
        lse_r[(b * H + h) * T + i] = mx + std::log(sum);
        double delta = 0;
        for (std::size_t d = 0; d < D; ++d) {
          double a = 0;
          for (std::size_t j = 0; j < jn; ++j) a += p[j] * v[(b * T + j) * KD + g * D + d];
          o_r[(b * T + i) * HD + h * D + d] = a;
          delta += a * dout[(b * T + i) * HD + h * D + d];
        }
        delta_r[(b * H + h) * T + i] = delta;
        for (std::size_t j = 0; j < jn; ++j) {
          double a = 0;
          for (std::size_t d = 0; d < D; ++d)
            a += static_cast<double>(dout[(b * T + i) * HD + h * D + d]) * v[(b * T + j) * KD + g * D + d];
          const double ds = p[j] * (a - delta) * scale;
          for (std::size_t d = 0; d < D; ++d) {
            dq_r[(b * T + i) * HD + h * D + d] += ds * k[(b * T + j) * KD + g * D + d];
            dk_r[(b * T + j) * KD + g * D + d] += ds * q[(b * T + i) * HD + h * D + d];
            dv_r[(b * T + j) * KD + g * D + d] += p[j] * dout[(b * T + i) * HD + h * D + d];
          }
        }
      }
    }
  std::vector<float> lse_in(lse_r.begin(), lse_r.end()), delta_in(delta_r.begin(), delta_r.end());

  const unsigned blocks = static_cast<unsigned>((T + emu::gpu::mma_tile - 1) / emu::gpu::mma_tile);
  const float fscale = static_cast<float>(scale);
  const membound::attention_band band{T, s.window, s.causal,
                                      membound::packed_sequences{s.offsets, s.sequences}};
  struct out {
    std::vector<S> o;
    std::vector<float> lse, dq, dk, dv;
  };
  auto once = [&] {
    out r{std::vector<S>(N * HD), std::vector<float>(B * H * T), std::vector<float>(N * HD),
          std::vector<float>(N * KD), std::vector<float>(N * KD)};
    launch(blocks, static_cast<unsigned>(H), static_cast<unsigned>(B),
           emu::gpu::mma_forward_smem_bytes(DM), [&] {
             emu::flash_forward_mma_kernel<S, DM>(q.data(), k.data(), v.data(), r.o.data(),
                                                  r.lse.data(), T, H, Hkv, D, band, fscale);
           });
    launch(blocks, static_cast<unsigned>(Hkv), static_cast<unsigned>(B),
           emu::gpu::mma_dkdv_smem_bytes(DM), [&] {
             emu::flash_dkdv_mma_kernel<S, DM>(q.data(), k.data(), v.data(), dout.data(),
                                               lse_in.data(), delta_in.data(), r.dk.data(),
                                               r.dv.data(), T, H, Hkv, D, band, fscale);
           });
    launch(blocks, static_cast<unsigned>(H), static_cast<unsigned>(B),
           emu::gpu::mma_dq_smem_bytes(DM), [&] {
             emu::flash_dq_mma_kernel<S, DM>(q.data(), k.data(), v.data(), dout.data(),
                                             lse_in.data(), delta_in.data(), r.dq.data(), T, H, Hkv,
                                             D, band, fscale);
           });
    return r;
  };
  const out a = once();
  double w = 0;
  // lse is compared in absolute terms against the row's scale (lse ~ |scores|).
  check("o", widen(a.o), o_r, tol, w);
  check("lse", widen(a.lse), lse_r, tol, w);
  check("dq", widen(a.dq), dq_r, tol, w);
  check("dk", widen(a.dk), dk_r, tol, w);
  check("dv", widen(a.dv), dv_r, tol, w);
  if (repeat && T > 1) {  // a repeat: the same bits (no atomics, fixed orders)
    const out b2 = once();
    const bool same = std::memcmp(a.o.data(), b2.o.data(), a.o.size() * sizeof(S)) == 0 &&
                      a.lse == b2.lse && a.dq == b2.dq && a.dk == b2.dk && a.dv == b2.dv;
    if (!same) {
      std::printf("  FAIL repeat: not bit-identical\n");
      ++failures;
    }
  }
  std::printf("  B=%zu T=%zu H=%zu Hkv=%zu D=%zu %s W=%zu%s: worst %.3g\n", B, T, H, Hkv, D,
              s.causal ? "causal" : "bidirectional", s.window, s.offsets ? " packed" : "", w);
  worst = std::max(worst, w);
}

// Every shape, each run twice, for bf16 (full). fp16 (not full) differs only in the operand type's
// conversions and roundoff, which every element of every shape goes through: its six head and
// tile shapes once each, without the band shapes (the same index arithmetic) or the repeats (the
// same schedule), which took the emulation from 75 s to 130 s of CI.
template <class S>
void run_all(double tol, bool full) {
  double worst = 0;
  run_shape<S, 64>({1, 64, 1, 1, 64, true}, tol, worst, full);
  run_shape<S, 64>({1, 1, 1, 1, 8, true}, tol, worst, full);
  run_shape<S, 64>({1, 97, 2, 1, 40, true}, tol, worst, full);
  run_shape<S, 64>({2, 70, 2, 2, 64, false}, tol, worst, full);
  run_shape<S, 128>({1, 80, 2, 2, 128, true}, tol, worst, full);
  run_shape<S, 128>({1, 70, 4, 1, 96, false}, tol, worst, full);
  // Sliding windows over T 136 (three tiles): whole tiles outside the band skipped (query tile 2
  // never loads key tile 0; key tile 0's dK/dV never loads query tile 2; bidirectional W 30 the
  // same both ways), edges inside tiles, W 2 (W 1 makes dS exactly 0: a normwise error of
  // roundoff over 0). One head each: the emulation's time grows with every CTA.
  if (full) {
    run_shape<S, 64>({1, 136, 1, 1, 32, true, 40}, tol, worst, full);
    run_shape<S, 64>({1, 136, 1, 1, 16, false, 30}, tol, worst, full);
    run_shape<S, 64>({1, 70, 1, 1, 16, true, 2}, tol, worst, full);
    // Packed sequences of lengths 1, 63, 0, 40 and 32 over the same three tiles: tiles holding
    // several sequences (masked per pair), tiles outside a query tile's sequences skipped, an
    // empty sequence; causal, and bidirectional with a window inside the sequences.
    static const std::int32_t offsets[] = {0, 1, 64, 64, 104, 136};
    run_shape<S, 64>({1, 136, 1, 1, 16, true, 0, offsets, 5}, tol, worst, full);
    run_shape<S, 64>({1, 136, 1, 1, 16, false, 20, offsets, 5}, tol, worst, full);
  }
  std::printf("worst normwise error %.3g (tolerance %.3g)\n", worst, tol);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string which = argc > 1 ? argv[1] : "bf16";
  // Tolerances: P and dS are rounded to the operand type before the second products (unit
  // roundoff 2^-8 for bf16, 2^-11 for fp16), o to the storage type; each output sums up to T such
  // terms in fp32. Four units of roundoff, normwise.
  if (which == "bf16") {
    run_all<membound::bf16>(8 * 0x1p-9, true);
  } else if (which == "fp16") {
    run_all<membound::fp16>(8 * 0x1p-12, false);
  } else {
    std::printf("usage: emu bf16|fp16\n");
    return 2;
  }
  std::printf("%s: %s\n", which.c_str(), failures ? "FAILED" : "passed");
  return failures ? 1 : 0;
}
