// The Mamba-1 block against the naive path, on this machine, in one run so that every ratio
// compares measurements taken side by side:
//   - this machine's memory bandwidth, measured first: a STREAM triad a[i] = b[i] + q·c[i] over
//     three 128 MiB double arrays (12× a 32 MiB L3), one contiguous slice per thread of the pool,
//     each slice first touched by its thread, best of 10 (5 with --quick). Bytes counted the
//     STREAM way, 24 per element (two reads, one write; the write-allocate read a cache makes is
//     not counted, so the figure is what a kernel that streams its operands once can reach);
//   - the selective scan alone (cpu::scan_forward, cpu::scan_backward, fp32 accumulators, on the
//     block's shapes and chunk), as effective bytes/s over the compulsory traffic, as a fraction
//     of the bandwidth above. Bytes counted (4 per float):
//       forward   read u, Δ [N, Di], B, C [N, 2·Ns]; write y [N, Di] and the saved chunk-entry
//                 states [(T/chunk − 1), Di, Ns]
//       backward  read u, Δ, dy [N, Di], B, C [N, 2·Ns], the saved states; write y (recomputed,
//                 the gate needs it), du, dΔ [N, Di] and the per-channel-block partial sums of
//                 dB, dC [Di/64, N, 2·Ns]
//     each once: the re-reads of B and C by every 64-channel block and the per-thread scratch
//     (a chunk of recomputed states, L2-resident) are not counted. The scan computes one exp per
//     state element per step, so it is expected to be compute-bound; "G upd/s" (state-element
//     updates per second, N·Di·Ns / time) says how fast it runs in those units;
//   - for T in {1024, 4096, 16384}, d_model C in {256, 768} (mamba_shape::defaults: Di = 2·C,
//     Ns = 16, K = 4, R = ceil(C/16)), scan chunk in {64, 256}, fp32 and bf16 storage, B = 1:
//     forward and forward+backward of membound::mamba (checkpoint policy `recompute`) and of
//     the naive block; and, for one shape, the `save_all` policy beside `recompute`.
//
// The naive block is the reference algorithm in fp32 as a user writes it: the same projections
// (membound::cpu::matmul and its transposes) and the same depthwise-conv kernels, so only the scan
// and what is kept differ: a per-step scan (plain loops, one std::exp per element, parallel over
// blocks of 64 channels) that stores every state h [B, T, Di, Ns] for backward, and a reverse
// scan over the stored states (dB, dC partial sums per channel block, reduced afterwards). It
// keeps every intermediate (xz, c, u, x_dbl, dt, Δ, h, y, g). Its bf16 rows widen the bf16 inputs
// and weights to fp32 and round the outputs once, as ours does. Its peak is B·T·Di·Ns·4 bytes and
// more; a row whose naive peak would exceed 6 GiB prints "—" for it (none does at these shapes:
// the largest, T = 16384, C = 768, forward+backward, needs about 2.9 GiB, 1.5 GiB of it h).
//
// Columns of the block table:
//   ms          best of the repetitions of one call (the machine is shared; the minimum is the
//               least noisy). A call allocates saved + workspace from a system_allocator, runs
//               forward (and backward) and frees them; the naive call allocates its buffers the
//               same way. The two chunk rows and the naive call are timed in turn, rep by rep.
//   tokens/s    B·T / time
//   x naive     naive time / ours (the naive time is shared by the two chunk rows of a shape)
//   peak MiB    ours' own memory beyond inputs, outputs, weights and gradients, read from the
//               allocator statistics: saved + workspace
//   naive MiB   the same for the naive block (its stored h dominates)
//   saved MiB   of ours' peak, what forward keeps for backward
// Before the tables, ours and the naive block are run on one shape and their outputs and
// gradients compared (both fp32; they differ only in summation order): a check on the naive.
//
// Run: ./build/release/bench/bench_mamba [--threads N] [--reps N] [--max-seq T] [--quick]
//   --quick: T = 1024 only (save_all shape T = 1024), fewer bandwidth repetitions.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "bench_flags.hpp"
#include "membound/membound.hpp"

namespace mb = membound;
using clock_type = std::chrono::steady_clock;

namespace {

constexpr double MiB = 1024.0 * 1024.0;
constexpr double naive_limit_bytes = 6.0 * 1024 * 1024 * 1024;

// ---- Buffers through the library's allocator, so peaks come from its statistics ----------------
struct tracked {
  mb::system_allocator* alloc = nullptr;
  void* p = nullptr;
  std::size_t bytes = 0;
  tracked(mb::system_allocator& a, std::size_t n) : alloc(&a), bytes(n) {
    p = n ? a.allocate(n, mb::default_alignment, mb::memory_tag::workspace) : nullptr;
  }
  tracked(const tracked&) = delete;
  tracked& operator=(const tracked&) = delete;
  ~tracked() {
    if (p) alloc->deallocate(p, bytes, mb::default_alignment, mb::memory_tag::workspace);
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

template <typename F>
double time_ms(F&& f) {
  const auto t0 = clock_type::now();
  f();
  return std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
}

// ---- Memory bandwidth: STREAM triad ----------------------------------------------------------
double triad_gbps(mb::thread_pool& pool, int reps) {
  const std::size_t n = std::size_t(1) << 24;  // 16 Mi doubles = 128 MiB per array
  const std::size_t th = pool.size(), per = (n + th - 1) / th;
  mb::system_allocator alloc;
  tracked a(alloc, n * sizeof(double)), b(alloc, n * sizeof(double)), c(alloc, n * sizeof(double));
  double* pa = a.as<double>();
  double* pb = b.as<double>();
  double* pc = c.as<double>();
  pool.parallel_for(th, [&](std::size_t t, std::size_t) {  // first touch by the slice's owner
    const std::size_t i0 = std::min(n, t * per), i1 = std::min(n, i0 + per);
    for (std::size_t i = i0; i < i1; ++i) {
      pa[i] = 0.0;
      pb[i] = 1.0;
      pc[i] = 2.0;
    }
  });
  const double q = 3.0;
  double best = 1e300;
  for (int r = 0; r < reps; ++r) {
    best = std::min(best, time_ms([&] {
      pool.parallel_for(th, [&](std::size_t t, std::size_t) {
        const std::size_t i0 = std::min(n, t * per), i1 = std::min(n, i0 + per);
        for (std::size_t i = i0; i < i1; ++i) pa[i] = pb[i] + q * pc[i];
      });
    }));
    benchmark::DoNotOptimize(pa);
    benchmark::ClobberMemory();
  }
  return 3.0 * sizeof(double) * double(n) / (best * 1e-3) / 1e9;
}

// ---- Random data ------------------------------------------------------------------------------
struct splitmix {
  std::uint64_t s;
  double uniform() {  // [0, 1)
    s += 0x9E3779B97F4A7C15ull;
    std::uint64_t z = s;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return static_cast<double>(z >> 11) * 0x1.0p-53;
  }
  double sym(double scale) { return (2.0 * uniform() - 1.0) * scale; }
};

template <typename T>
void fill_uniform(std::vector<T>& v, std::uint64_t seed, double scale) {
  splitmix r{seed};
  for (auto& e : v) e = mb::from_accum<T>(static_cast<float>(r.sym(scale)));
}

// The caller's tensors: input, output, dy, dx, the nine weights (mamba_simple's initialisation:
// nn.Linear / nn.Conv1d defaults, dt log-uniform in [0.001, 0.1] through softplus⁻¹, S4D-real
// A_log = log(n + 1), D = 1) and their gradients. None is counted in either peak.
enum widx : std::size_t { w_in, w_conv, w_convb, w_x, w_dt, w_dtb, w_alog, w_d, w_out, n_weights };

template <typename S>
struct block_io {
  mb::mamba_shape s;
  std::vector<S> x, out, dy, dx;
  std::vector<S> w[n_weights], g[n_weights];

  static std::size_t weight_size(const mb::mamba_shape& s, std::size_t k) {
    const std::size_t C = s.d_model, Di = s.d_inner, Ns = s.d_state, R = s.dt_rank;
    const std::size_t sizes[n_weights] = {C * 2 * Di, Di * s.d_conv, Di, Di * (R + 2 * Ns),
                                          R * Di,     Di,            Di * Ns, Di, Di * C};
    return sizes[k];
  }

  explicit block_io(const mb::mamba_shape& shape) : s(shape) {
    const std::size_t N = s.batch * s.seq, C = s.d_model, Di = s.d_inner, Ns = s.d_state;
    x.resize(N * C);
    out.resize(N * C);
    dy.resize(N * C);
    dx.resize(N * C);
    for (std::size_t k = 0; k < n_weights; ++k) {
      w[k].resize(weight_size(s, k));
      g[k].assign(weight_size(s, k), mb::from_accum<S>(0.0f));
    }
    const auto isq = [](std::size_t n) { return 1.0 / std::sqrt(static_cast<double>(n)); };
    fill_uniform(x, 1, 1.0);
    fill_uniform(dy, 2, 1.0);
    fill_uniform(w[w_in], 3, isq(C));
    fill_uniform(w[w_conv], 4, isq(s.d_conv));
    fill_uniform(w[w_convb], 5, isq(s.d_conv));
    fill_uniform(w[w_x], 6, isq(Di));
    fill_uniform(w[w_dt], 7, isq(s.dt_rank));
    fill_uniform(w[w_out], 8, isq(Di));
    splitmix r{9};
    for (std::size_t i = 0; i < Di; ++i) {
      const double lo = std::log(0.001), hi = std::log(0.1);
      const double dt = std::exp(r.uniform() * (hi - lo) + lo);
      w[w_dtb][i] = mb::from_accum<S>(static_cast<float>(dt + std::log(-std::expm1(-dt))));
      w[w_d][i] = mb::from_accum<S>(1.0f);
      for (std::size_t n = 0; n < Ns; ++n)
        w[w_alog][i * Ns + n] = mb::from_accum<S>(static_cast<float>(std::log(double(n + 1))));
    }
  }

  void zero_grads() {
    for (auto& v : g) std::fill(v.begin(), v.end(), mb::from_accum<S>(0.0f));
  }
};

// ---- Ours ------------------------------------------------------------------------------------
template <typename Block>
struct ours {
  using S = typename Block::storage_type;
  static typename Block::weights weights(const block_io<S>& io) {
    return {io.w[w_in].data(),  io.w[w_conv].data(), io.w[w_convb].data(),
            io.w[w_x].data(),   io.w[w_dt].data(),   io.w[w_dtb].data(),
            io.w[w_alog].data(), io.w[w_d].data(),   io.w[w_out].data()};
  }
  static typename Block::gradients grads(block_io<S>& io) {
    return {io.g[w_in].data(),  io.g[w_conv].data(), io.g[w_convb].data(),
            io.g[w_x].data(),   io.g[w_dt].data(),   io.g[w_dtb].data(),
            io.g[w_alog].data(), io.g[w_d].data(),   io.g[w_out].data()};
  }
  static std::size_t run(block_io<S>& io, bool backward, mb::thread_pool& pool) {
    const mb::mamba_shape& s = io.s;
    mb::system_allocator alloc;
    const std::size_t th = pool.size();
    {
      tracked saved(alloc, Block::saved_bytes(s));
      {
        tracked ws(alloc, Block::forward_workspace_bytes(s, th));
        Block::forward(s, weights(io), io.x.data(), io.out.data(), saved.p, saved.bytes, ws.p,
                       ws.bytes, pool);
      }
      if (backward) {
        tracked ws(alloc, Block::backward_workspace_bytes(s, th));
        Block::backward(s, weights(io), io.x.data(), saved.p, saved.bytes, io.dy.data(),
                        io.dx.data(), grads(io), ws.p, ws.bytes, pool);
      }
    }
    return alloc.stats().peak_requested;
  }
};

// ---- The naive block -------------------------------------------------------------------------
template <typename S>
struct naive {
  using A = float;
  static constexpr bool widened = !std::is_same_v<S, A>;
  static constexpr std::size_t channels = 64;  // channels per scan task

  // An upper bound of its peak, to skip shapes that would not fit.
  static double estimate_bytes(const mb::mamba_shape& s, bool backward) {
    const double N = double(s.batch * s.seq), Di = double(s.d_inner), Ns = double(s.d_state),
                 C = double(s.d_model), P = double(s.dt_rank + 2 * s.d_state);
    double e = N * Di * Ns + N * (2 * Di + 7 * Di + P + 2 * C);
    if (backward) e += N * (2 * Di + 4 * Di + P + 2 * C) + (Di / channels + 1) * N * 2 * Ns;
    return 4.0 * e;
  }

  static std::size_t run(block_io<S>& io, bool backward, mb::thread_pool& pool) {
    namespace cpu = mb::cpu;
    const mb::mamba_shape& s = io.s;
    mb::system_allocator alloc;
    const std::size_t B = s.batch, T = s.seq, N = B * T, C = s.d_model, Di = s.d_inner,
                      Ns = s.d_state, K = s.d_conv, R = s.dt_rank, P = R + 2 * Ns;
    const std::size_t nblk = cpu::blocks(Di, channels), th = pool.size();
    const auto f4 = [](std::size_t n) { return n * sizeof(A); };

    // fp32 views of the weights and of x (copies for bf16, as ours makes).
    std::size_t wtotal = 0;
    for (std::size_t k = 0; k < n_weights; ++k) wtotal += block_io<S>::weight_size(s, k);
    tracked ww(alloc, widened ? f4(wtotal) : 0), xw(alloc, widened ? f4(N * C) : 0);
    const A* w[n_weights];
    const A* xa;
    if constexpr (widened) {
      A* p = ww.as<A>();
      for (std::size_t k = 0; k < n_weights; ++k) {
        cpu::widen(io.w[k].data(), io.w[k].size(), p);
        w[k] = p;
        p += io.w[k].size();
      }
      cpu::widen(io.x.data(), N * C, xw.as<A>());
      xa = xw.as<A>();
    } else {
      for (std::size_t k = 0; k < n_weights; ++k) w[k] = io.w[k].data();
      xa = io.x.data();
    }

    // Forward, keeping everything.
    tracked xz_(alloc, f4(N * 2 * Di)), c_(alloc, f4(N * Di)), u_(alloc, f4(N * Di));
    tracked xdbl_(alloc, f4(N * P)), dt_(alloc, f4(N * Di)), delta_(alloc, f4(N * Di));
    tracked a_(alloc, f4(Di * Ns)), h_(alloc, f4(N * Di * Ns)), y_(alloc, f4(N * Di));
    tracked g_(alloc, f4(N * Di)), outw(alloc, widened ? f4(N * C) : 0);
    A *xz = xz_.as<A>(), *c = c_.as<A>(), *u = u_.as<A>(), *xdbl = xdbl_.as<A>();
    A *dt = dt_.as<A>(), *delta = delta_.as<A>(), *a = a_.as<A>(), *h = h_.as<A>();
    A *y = y_.as<A>(), *g = g_.as<A>();
    cpu::matmul(pool, xa, w[w_in], xz, N, C, 2 * Di, false);
    cpu::causal_conv(pool, s, static_cast<const A*>(xz), 2 * Di, w[w_conv], w[w_convb], c);
    cpu::for_rows(pool, N, [&](std::size_t n) {
      for (std::size_t i = 0; i < Di; ++i) u[n * Di + i] = cpu::silu(c[n * Di + i]);
    });
    cpu::matmul(pool, static_cast<const A*>(u), w[w_x], xdbl, N, Di, P, false);
    cpu::matmul(pool, static_cast<const A*>(xdbl), w[w_dt], dt, N, R, Di, false,
                cpu::ld3{P, Di, Di});
    cpu::for_rows(pool, N, [&](std::size_t n) {
      for (std::size_t i = 0; i < Di; ++i) {
        dt[n * Di + i] += w[w_dtb][i];
        delta[n * Di + i] = cpu::softplus(dt[n * Di + i]);
      }
    });
    for (std::size_t j = 0; j < Di * Ns; ++j) a[j] = -std::exp(w[w_alog][j]);
    // The scan: h_t = exp(Δ_t·A) ⊙ h_{t−1} + Δ_t·B_t·u_t, every h_t stored; y_t = C_t·h_t + D·u_t.
    pool.parallel_for(nblk, [&](std::size_t blk, std::size_t) {
      const std::size_t i0 = blk * channels, i1 = std::min(Di, i0 + channels);
      for (std::size_t b = 0; b < B; ++b)
        for (std::size_t t = 0; t < T; ++t) {
          const std::size_t n = b * T + t;
          const A* Bt = xdbl + n * P + R;
          const A* Ct = Bt + Ns;
          for (std::size_t i = i0; i < i1; ++i) {
            const A dl = delta[n * Di + i], ui = u[n * Di + i];
            const A* hp = t > 0 ? h + ((n - 1) * Di + i) * Ns : nullptr;
            A* hc = h + (n * Di + i) * Ns;
            A acc = 0;
            for (std::size_t k = 0; k < Ns; ++k) {
              const A prev = hp ? hp[k] : A(0);
              const A hv = std::exp(dl * a[i * Ns + k]) * prev + dl * Bt[k] * ui;
              hc[k] = hv;
              acc += Ct[k] * hv;
            }
            y[n * Di + i] = acc + w[w_d][i] * ui;
          }
        }
    });
    cpu::for_rows(pool, N, [&](std::size_t n) {
      for (std::size_t i = 0; i < Di; ++i)
        g[n * Di + i] = y[n * Di + i] * cpu::silu(xz[n * 2 * Di + Di + i]);
    });
    if constexpr (widened) {
      cpu::matmul(pool, static_cast<const A*>(g), w[w_out], outw.as<A>(), N, Di, C, false);
      cpu::narrow(static_cast<const A*>(outw.as<A>()), N * C, io.out.data());
    } else {
      cpu::matmul(pool, static_cast<const A*>(g), w[w_out], io.out.data(), N, Di, C, false);
    }
    if (!backward) return alloc.stats().peak_requested;

    // Backward.
    tracked dyw(alloc, widened ? f4(N * C) : 0);
    const A* dya;
    if constexpr (widened) {
      cpu::widen(io.dy.data(), N * C, dyw.as<A>());
      dya = dyw.as<A>();
    } else {
      dya = io.dy.data();
    }
    std::size_t wmax = 0;
    for (std::size_t k = 0; k < n_weights; ++k) wmax = std::max(wmax, block_io<S>::weight_size(s, k));
    tracked dg_(alloc, f4(N * Di)), dys_(alloc, f4(N * Di)), dxz_(alloc, f4(N * 2 * Di));
    tracked du_(alloc, f4(N * Di)), ddelta_(alloc, f4(N * Di)), dxdbl_(alloc, f4(N * P));
    tracked part_(alloc, f4(nblk * N * 2 * Ns)), carry_(alloc, f4(th * channels * Ns));
    tracked small_(alloc, f4(Di * Ns + Di * K + 3 * Di)), wtmp_(alloc, f4(wmax));
    tracked dxw(alloc, widened ? f4(N * C) : 0);
    A *dg = dg_.as<A>(), *dys = dys_.as<A>(), *dxz = dxz_.as<A>(), *du = du_.as<A>();
    A *ddelta = ddelta_.as<A>(), *dxdbl = dxdbl_.as<A>(), *part = part_.as<A>();
    A* dA = small_.as<A>();
    A* dD = dA + Di * Ns;
    A* dconv_w = dD + Di;
    A* dconv_b = dconv_w + Di * K;
    A* ddt_bias = dconv_b + Di;
    A* wtmp = wtmp_.as<A>();
    const auto grad_into = [&](std::size_t k, const A* src) {
      cpu::narrow_add(src, io.g[k].size(), io.g[k].data());
    };

    cpu::matmul_bt(pool, dya, w[w_out], dg, N, C, Di, false);
    cpu::matmul_at(pool, static_cast<const A*>(g), dya, wtmp, N, Di, C, false);
    grad_into(w_out, wtmp);
    cpu::for_rows(pool, N, [&](std::size_t n) {
      for (std::size_t i = 0; i < Di; ++i) {
        const A z = xz[n * 2 * Di + Di + i];
        dys[n * Di + i] = dg[n * Di + i] * cpu::silu(z);
        dxz[n * 2 * Di + Di + i] = dg[n * Di + i] * y[n * Di + i] * cpu::silu_grad(z);
      }
    });
    // The reverse scan over the stored states.
    std::fill(dA, dA + Di * Ns + Di, A(0));
    pool.parallel_for(nblk, [&](std::size_t blk, std::size_t thread) {
      const std::size_t i0 = blk * channels, i1 = std::min(Di, i0 + channels);
      A* carry = carry_.as<A>() + thread * channels * Ns;  // dh_{t+1} ⊙ exp(Δ_{t+1}·A)
      for (std::size_t b = 0; b < B; ++b) {
        std::fill(carry, carry + channels * Ns, A(0));
        for (std::size_t t = T; t-- > 0;) {
          const std::size_t n = b * T + t;
          const A* Bt = xdbl + n * P + R;
          const A* Ct = Bt + Ns;
          A* pB = part + (blk * N + n) * 2 * Ns;
          A* pC = pB + Ns;
          std::fill(pB, pB + 2 * Ns, A(0));
          for (std::size_t i = i0; i < i1; ++i) {
            const A g_ = dys[n * Di + i], ui = u[n * Di + i], dl = delta[n * Di + i];
            const A* hc = h + (n * Di + i) * Ns;
            const A* hp = t > 0 ? h + ((n - 1) * Di + i) * Ns : nullptr;
            A* cr = carry + (i - i0) * Ns;
            dD[i] += g_ * ui;
            A du_acc = g_ * w[w_d][i], dd_acc = 0;
            for (std::size_t k = 0; k < Ns; ++k) {
              const A ak = a[i * Ns + k], e = std::exp(dl * ak);
              const A prev = hp ? hp[k] : A(0);
              pC[k] += g_ * hc[k];
              const A dh = g_ * Ct[k] + cr[k];
              const A da = dh * prev;
              dd_acc += da * e * ak + dh * Bt[k] * ui;
              dA[i * Ns + k] += da * e * dl;
              pB[k] += dh * dl * ui;
              du_acc += dh * dl * Bt[k];
              cr[k] = dh * e;
            }
            ddelta[n * Di + i] = dd_acc;
            du[n * Di + i] = du_acc;
          }
        }
      }
    });
    cpu::for_rows(pool, N, [&](std::size_t n) {  // dB, dC: the block partials summed
      A* out = dxdbl + n * P + R;
      std::fill(out, out + 2 * Ns, A(0));
      for (std::size_t blk = 0; blk < nblk; ++blk) {
        const A* p = part + (blk * N + n) * 2 * Ns;
        for (std::size_t j = 0; j < 2 * Ns; ++j) out[j] += p[j];
      }
    });
    // Δ = softplus(dt): ddt = dΔ ⊙ σ(dt); dt = dt_low·dt_proj + dt_bias.
    cpu::for_rows(pool, N, [&](std::size_t n) {
      for (std::size_t i = 0; i < Di; ++i) ddelta[n * Di + i] *= cpu::sigmoid(dt[n * Di + i]);
    });
    std::fill(ddt_bias, ddt_bias + Di, A(0));
    for (std::size_t n = 0; n < N; ++n)
      for (std::size_t i = 0; i < Di; ++i) ddt_bias[i] += ddelta[n * Di + i];
    cpu::matmul_at(pool, static_cast<const A*>(xdbl), static_cast<const A*>(ddelta), wtmp, N, R,
                   Di, false, cpu::ld3{P, Di, Di});
    grad_into(w_dt, wtmp);
    cpu::matmul_bt(pool, static_cast<const A*>(ddelta), w[w_dt], dxdbl, N, Di, R, false,
                   cpu::ld3{Di, Di, P});
    // x_dbl = u·x_proj; u = silu(c); c = conv(xi).
    cpu::matmul_at(pool, static_cast<const A*>(u), static_cast<const A*>(dxdbl), wtmp, N, Di, P,
                   false);
    grad_into(w_x, wtmp);
    cpu::matmul_bt(pool, static_cast<const A*>(dxdbl), w[w_x], du, N, P, Di, true);
    cpu::for_rows(pool, N, [&](std::size_t n) {
      for (std::size_t i = 0; i < Di; ++i) du[n * Di + i] *= cpu::silu_grad(c[n * Di + i]);
    });
    cpu::causal_conv_backward(pool, s, static_cast<const A*>(xz), 2 * Di, w[w_conv],
                              static_cast<const A*>(du), dxz, 2 * Di, dconv_w, dconv_b);
    // xz = x·in_proj.
    cpu::matmul_at(pool, xa, static_cast<const A*>(dxz), wtmp, N, C, 2 * Di, false);
    grad_into(w_in, wtmp);
    if constexpr (widened) {
      cpu::matmul_bt(pool, static_cast<const A*>(dxz), w[w_in], dxw.as<A>(), N, 2 * Di, C, false);
      cpu::narrow(static_cast<const A*>(dxw.as<A>()), N * C, io.dx.data());
    } else {
      cpu::matmul_bt(pool, static_cast<const A*>(dxz), w[w_in], io.dx.data(), N, 2 * Di, C,
                     false);
    }
    for (std::size_t j = 0; j < Di * Ns; ++j) dA[j] *= a[j];  // dA_log = dA ⊙ A
    grad_into(w_alog, dA);
    grad_into(w_d, dD);
    grad_into(w_conv, dconv_w);
    grad_into(w_convb, dconv_b);
    grad_into(w_dtb, ddt_bias);
    return alloc.stats().peak_requested;
  }
};

// ---- Check: ours against the naive block ------------------------------------------------------
double max_rel(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    diff = std::max(diff, std::abs(double(got[i]) - double(want[i])));
    scale = std::max(scale, std::abs(double(want[i])));
  }
  const double e = scale > 0 ? diff / scale : diff;
  return e == e ? e : 1e300;
}

template <typename Block>
bool check_against_naive(std::size_t T, std::size_t C, mb::thread_pool& pool) {
  const mb::mamba_shape s = mb::mamba_shape::defaults(1, T, C);
  block_io<float> a(s), b(s);
  ours<Block>::run(a, true, pool);
  naive<float>::run(b, true, pool);
  const char* names[n_weights] = {"d_in_proj", "d_conv_w", "d_conv_b", "d_x_proj", "d_dt_proj",
                                  "d_dt_bias", "d_a_log",  "d_d",      "d_out_proj"};
  double worst = std::max(max_rel(a.out, b.out), max_rel(a.dx, b.dx));
  char head[64];
  std::snprintf(head, sizeof head, "out %.1e, dx %.1e", max_rel(a.out, b.out), max_rel(a.dx, b.dx));
  std::string detail = head;
  for (std::size_t k = 0; k < n_weights; ++k) {
    const double e = max_rel(a.g[k], b.g[k]);
    worst = std::max(worst, e);
    char buf[64];
    std::snprintf(buf, sizeof buf, ", %s %.1e", names[k], e);
    detail += buf;
  }
  const bool ok = worst <= 1e-3;
  std::printf("Check, ours (chunk %zu) vs naive, fp32, T=%zu C=%zu: max|ours - naive| / max|naive| "
              "over out, dx and the nine gradients = %.2e (%s; both fp32, different summation "
              "orders)\n  %s\n\n",
              Block::chunk, T, C, worst, ok ? "ok" : "MISMATCH", detail.c_str());
  return ok;
}

// ---- Options, timing ---------------------------------------------------------------------------
struct options {
  std::size_t threads = mb::thread_pool::default_threads();
  int reps = 3;
  std::size_t max_seq = 16384;
  bool quick = false;
};

std::vector<std::size_t> seqs(const options& opt) {
  std::vector<std::size_t> r;
  for (std::size_t T : {1024, 4096, 16384})
    if (T <= opt.max_seq && !(opt.quick && T > 1024)) r.push_back(T);
  return r;
}
constexpr std::size_t models[] = {256, 768};

// ---- The scan alone -----------------------------------------------------------------------------
void scan_rows(const options& opt, double bw_gbps, mb::thread_pool& pool) {
  namespace cpu = mb::cpu;
  using A = float;
  for (std::size_t C : models) {
    for (std::size_t T : seqs(opt)) {
      const mb::mamba_shape s = mb::mamba_shape::defaults(1, T, C);
      const std::size_t N = s.batch * T, Di = s.d_inner, Ns = s.d_state, R = s.dt_rank,
                        P = R + 2 * Ns, th = pool.size(), nblk = cpu::blocks(Di, cpu::scan_channels);
      // Buffers aligned as the block's (carved from 256-byte aligned saved/workspace bytes):
      // Eigen peels unaligned heads of the state update with scalar exp calls, and std::vector's
      // 16-byte alignment would make this kernel about 2x slower than it is inside the block.
      mb::system_allocator alloc;
      const auto buf = [&](std::size_t n) { return std::make_unique<tracked>(alloc, n * sizeof(A)); };
      const auto u_ = buf(N * Di), delta_ = buf(N * Di), xdbl_ = buf(N * P), a_ = buf(Di * Ns),
                 dskip_ = buf(Di), y_ = buf(N * Di), dy_ = buf(N * Di), du_ = buf(N * Di),
                 ddelta_ = buf(N * Di), da_ = buf(Di * Ns), dd_ = buf(Di),
                 part_ = buf(nblk * N * 2 * Ns), fscratch_ = buf(th * cpu::scan_forward_scratch(Ns));
      A *u = u_->as<A>(), *delta = delta_->as<A>(), *xdbl = xdbl_->as<A>(), *a = a_->as<A>(),
        *dskip = dskip_->as<A>(), *y = y_->as<A>(), *dy = dy_->as<A>(), *du = du_->as<A>(),
        *ddelta = ddelta_->as<A>(), *da = da_->as<A>(), *dd = dd_->as<A>(), *part = part_->as<A>(),
        *fscratch = fscratch_->as<A>();
      splitmix r{11};
      for (std::size_t j = 0; j < N * Di; ++j) {
        u[j] = static_cast<A>(r.sym(1.0));
        delta[j] = static_cast<A>(0.001 + 0.099 * r.uniform());  // softplus(dt) at mamba_init
        dy[j] = static_cast<A>(r.sym(1.0));
      }
      for (std::size_t j = 0; j < N * P; ++j) xdbl[j] = static_cast<A>(r.sym(1.0));
      for (std::size_t i = 0; i < Di; ++i) {
        dskip[i] = 1.0f;
        for (std::size_t n = 0; n < Ns; ++n) a[i * Ns + n] = -static_cast<A>(n + 1);
      }
      for (std::size_t L : {std::size_t(64), std::size_t(256)}) {
        const std::size_t nch = cpu::scan_chunks(T, L), n_states = (nch - 1) * Di * Ns;
        const auto states_ = buf(n_states);
        const auto bscratch_ = buf(th * cpu::scan_backward_scratch(std::min(L, T), Ns));
        A *states = states_->as<A>(), *bscratch = bscratch_->as<A>();
        const auto fwd = [&] {
          cpu::scan_forward(pool, s, L, u, delta, xdbl, a, dskip, y, states, fscratch);
        };
        const auto bwd = [&] {
          cpu::scan_backward(pool, s, L, u, delta, xdbl, a, dskip, states, dy, y, du, ddelta, da,
                             dd, part, bscratch);
        };
        fwd();  // warm-up; also writes the states backward reads
        bwd();
        double tf = 1e300, tb = 1e300;
        for (int rep = 0; rep < opt.reps; ++rep) {
          tf = std::min(tf, time_ms(fwd));
          tb = std::min(tb, time_ms(bwd));
        }
        const double st = double(n_states);
        const double bytes_f = 4.0 * (3.0 * N * Di + 2.0 * N * Ns + st);
        const double bytes_b = 4.0 * (6.0 * N * Di + 2.0 * N * Ns + st + double(nblk * N * 2 * Ns));
        const double upd = double(N) * Di * Ns;
        const double gf = bytes_f / (tf * 1e6), gb = bytes_b / (tb * 1e6);
        std::printf("| %5zu | %3zu | %3zu | %8.2f | %6.2f | %5.1f%% | %6.2f | %8.2f | %6.2f | %5.1f%% "
                    "| %6.2f |\n",
                    T, C, L, tf, gf, 100.0 * gf / bw_gbps, upd / (tf * 1e6), tb, gb,
                    100.0 * gb / bw_gbps, upd / (tb * 1e6));
        std::fflush(stdout);
      }
    }
  }
}

// ---- The block table ------------------------------------------------------------------------------
void print_row(std::size_t T, std::size_t C, std::size_t chunk, const char* prec, bool bwd, double ms,
               double naive_ms, std::size_t peak, std::size_t naive_peak, std::size_t saved) {
  char ratio[32] = "—", nmib[32] = "—";
  if (naive_ms > 0) {
    std::snprintf(ratio, sizeof ratio, "%.2f", naive_ms / ms);
    std::snprintf(nmib, sizeof nmib, "%.1f", double(naive_peak) / MiB);
  }
  std::printf("| %5zu | %3zu | %3zu | %-13s | %-7s | %9.2f | %9.0f | %7s | %8.1f | %9s | %9.2f |\n", T, C,
              chunk, prec, bwd ? "fwd+bwd" : "fwd", ms, double(T) / (ms * 1e-3), ratio,
              double(peak) / MiB, nmib, double(saved) / MiB);
  std::fflush(stdout);
}

// Rows of one shape: the blocks of Blocks... (one row each) and the naive block, timed in turn.
template <typename S, typename... Blocks>
void shape_rows(std::size_t T, std::size_t C, const char* const* names, const options& opt,
                mb::thread_pool& pool, bool backward_only) {
  const mb::mamba_shape s = mb::mamba_shape::defaults(1, T, C);
  block_io<S> io(s);
  constexpr std::size_t nb = sizeof...(Blocks);
  for (bool bwd : {false, true}) {
    if (backward_only && !bwd) continue;
    const bool with_naive = naive<S>::estimate_bytes(s, bwd) <= naive_limit_bytes;
    std::size_t peaks[nb], naive_peak = 0;
    double best[nb], naive_best = 1e300;
    std::fill(best, best + nb, 1e300);
    {  // warm-up (first touch of every page), recording the peaks
      std::size_t k = 0;
      ((peaks[k++] = ours<Blocks>::run(io, bwd, pool)), ...);
      if (with_naive) naive_peak = naive<S>::run(io, bwd, pool);
    }
    for (int r = 0; r < opt.reps; ++r) {
      std::size_t k = 0;
      ((best[k] = std::min(best[k], time_ms([&] { ours<Blocks>::run(io, bwd, pool); })), ++k), ...);
      if (with_naive) naive_best = std::min(naive_best, time_ms([&] { naive<S>::run(io, bwd, pool); }));
    }
    std::size_t k = 0;
    ((print_row(T, C, Blocks::chunk, names[k], bwd, best[k], with_naive ? naive_best : 0.0, peaks[k],
                naive_peak, Blocks::saved_bytes(s)),
      ++k),
     ...);
  }
}

template <typename Prec>
void block_rows(const char* name, const options& opt, mb::thread_pool& pool) {
  using S = typename Prec::storage_type;
  const char* const names[] = {name, name};
  for (std::size_t C : models)
    for (std::size_t T : seqs(opt))
      shape_rows<S, mb::mamba<Prec, mb::scan_chunk<64>>, mb::mamba<Prec, mb::scan_chunk<256>>>(
          T, C, names, opt, pool, false);
}

const char* const table_header =
    "| T | C | chunk | prec | pass | ms | tokens/s | x naive | peak MiB | naive MiB | saved MiB |\n"
    "|--:|--:|--:|---|---|--:|--:|--:|--:|--:|--:|\n";

}  // namespace

static int bench_main(int argc, char** argv) {
  options opt;
  bench_flags::args a(argc, argv,
                      "usage: bench_mamba [--threads N] [--reps N] [--max-seq T] [--quick]\n"
                      "  Mamba block vs the naive path; see the header of bench_mamba.cpp");
  while (a.next()) {
    if (a.is("--threads")) opt.threads = static_cast<std::size_t>(a.whole(1, 1024));
    else if (a.is("--reps")) opt.reps = static_cast<int>(a.whole(1, 1000000));
    else if (a.is("--max-seq")) opt.max_seq = static_cast<std::size_t>(a.whole(1, std::size_t{1} << 20));
    else if (a.is("--quick")) opt.quick = true;
    else a.unknown();
  }
  mb::thread_pool pool(opt.threads);
  const double bw = triad_gbps(pool, opt.quick ? 5 : 10);
  std::printf("Memory bandwidth (STREAM triad, 3 x 128 MiB doubles, 24 B/element, %zu threads, best "
              "of %d): %.1f GB/s\n",
              opt.threads, opt.quick ? 5 : 10, bw);
  std::printf("mamba_shape::defaults: Di = 2C, Ns = 16, K = 4, R = ceil(C/16); B = 1; best of %d; "
              "%zu threads\n\n",
              opt.reps, opt.threads);

  const bool ok = check_against_naive<mb::mamba<mb::fp32_precision, mb::scan_chunk<256>>>(1024, 256,
                                                                                          pool);

  std::printf("Selective scan alone (fp32 accumulators; bytes: see the header; %%bw of %.1f GB/s; "
              "G upd/s = N*Di*Ns state updates per second)\n\n",
              bw);
  std::printf("| T | C | chunk | fwd ms | fwd GB/s | fwd %%bw | fwd G upd/s | bwd ms | bwd GB/s | "
              "bwd %%bw | bwd G upd/s |\n|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n");
  scan_rows(opt, bw, pool);

  std::printf("\nThe block (checkpoint policy recompute) vs the naive block\n\n%s", table_header);
  block_rows<mb::fp32_precision>("fp32", opt, pool);
  block_rows<mb::bf16_precision>("bf16", opt, pool);

  // The checkpoint trade on one shape: keep the conv output and Δ instead of recomputing them.
  const std::size_t T_trade = opt.quick ? 1024 : std::min<std::size_t>(4096, opt.max_seq);
  std::printf("\nCheckpoint trade, fp32, T = %zu, C = 768, chunk 256: recompute vs save_all, timed "
              "in turn with the naive block\n\n%s",
              T_trade, table_header);
  const char* const trade_names[] = {"fp32", "fp32 save_all"};
  shape_rows<float, mb::mamba<mb::fp32_precision, mb::scan_chunk<256>>,
             mb::mamba<mb::fp32_precision, mb::scan_chunk<256>, mb::save_all>>(T_trade, 768,
                                                                               trade_names, opt,
                                                                               pool, true);
  return ok ? 0 : 1;
}

// Any error, a flag's or the library's, is one `error:` line and exit 1.
int main(int argc, char** argv) {
  return bench_flags::run([&] { return bench_main(argc, argv); });
}
