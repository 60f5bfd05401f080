// The attention layer against the naive path, on this machine, in one run so that every ratio
// compares measurements taken side by side:
//   - this machine's FMA peak (fp32), measured first by a register-only FMA loop on every thread;
//   - for T in {512, 1024, 2048, 4096}, D in {64, 128}, causal, fp32 and bf16 storage (and fp32
//     under the save_all checkpoint policy, forward+backward only): forward and
//     forward+backward of membound::attention (B = 1, H = Hkv = 8, C = H·D) and of the naive
//     layer (the same projections and RoPE, then the T×T scores materialized, softmax, P·V:
//     PyTorch's math path, what a user writes by hand).
//
// Columns:
//   ms          best of the repetitions (the machine is shared; the minimum is the least noisy)
//   attn GF/s   the count: 4·B·H·T²·D for forward, halved when causal; 2.5× that more
//               for backward. Projections are not counted here.
//   all GF/s    every multiply-add of the layer, projections included (2·B·T·C·(2·H·D + 2·Hkv·D)
//               forward, twice that backward). The honest utilization figure.
//   %peak       all GF/s as a fraction of the measured FMA peak on the same threads.
//   x naive     naive time / ours.
//   peak MiB    the layer's own memory beyond its inputs, outputs, weights and gradients, read
//               from the allocator statistics (ours: saved + workspace; naive: its buffers).
//   naive MiB   the same for the naive layer.
//   saved MiB   of ours' peak, what forward keeps for backward: the bytes a model holds per layer
//               between its forward and backward passes.
//
// Run: ./build/release/bench/bench_attention [--threads N] [--reps N] [--max-seq T] [--min-seq T]
//                                            [--dim D] [--fp32-only] [--no-naive] [--quick] [--window W]
// (--no-naive: the naive layer is not run; its columns read 0. --window W: ours runs a causal
// sliding window of W, the attn GF/s count the band's pairs only, and the comparison columns are
// membound's own full causal attention at the same shape, in the same run: "x naive" reads full
// time / windowed time, "naive MiB" the full layer's peak.)
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "bench_flags.hpp"
#include "membound/membound.hpp"

#include "fma_peak.hpp"

namespace mb = membound;
using membound_bench::fma_peak_gflops;
using membound_bench::isa;
using clock_type = std::chrono::steady_clock;

namespace {

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

template <typename T>
void fill_random(std::vector<T>& v, std::uint64_t seed, double scale) {
  std::uint64_t s = seed;
  for (auto& e : v) {
    s += 0x9E3779B97F4A7C15ull;  // splitmix64
    std::uint64_t z = s;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const double u = static_cast<double>(z >> 11) * 0x1.0p-53 * 2.0 - 1.0;
    e = mb::from_accum<T>(static_cast<float>(u * scale));
  }
}

// The caller's tensors: inputs, outputs, weights and gradients (not counted in either peak).
template <typename S>
struct layer_io {
  std::vector<S> x, y, dy, dx, wq, wk, wv, wo, gq, gk, gv, go;
  explicit layer_io(const mb::attention_shape& s) {
    const std::size_t N = s.batch * s.seq, C = s.d_model, HD = s.heads * s.head_dim,
                      KD = s.kv_heads * s.head_dim;
    x.resize(N * C);
    y.resize(N * C);
    dy.resize(N * C);
    dx.resize(N * C);
    wq.resize(C * HD);
    wk.resize(C * KD);
    wv.resize(C * KD);
    wo.resize(HD * C);
    gq.resize(C * HD);
    gk.resize(C * KD);
    gv.resize(C * KD);
    go.resize(HD * C);
    fill_random(x, 1, 1.0);
    fill_random(dy, 2, 1.0);
    const double ws = 1.0 / std::sqrt(static_cast<double>(C));
    fill_random(wq, 3, ws);
    fill_random(wk, 4, ws);
    fill_random(wv, 5, ws);
    fill_random(wo, 6, 1.0 / std::sqrt(static_cast<double>(HD)));
  }
};

// ---- Ours ------------------------------------------------------------------------------------
template <typename Attn>
struct ours {
  using S = typename Attn::storage_type;
  static std::size_t run(const mb::attention_shape& s, layer_io<S>& io, bool backward,
                         mb::thread_pool& pool) {
    mb::system_allocator alloc;
    const std::size_t th = pool.size();
    {
      tracked saved(alloc, Attn::saved_bytes(s));
      {
        tracked ws(alloc, Attn::forward_workspace_bytes(s, th));
        Attn::forward(s, {io.wq.data(), io.wk.data(), io.wv.data(), io.wo.data()}, io.x.data(),
                      io.y.data(), saved.p, saved.bytes, ws.p, ws.bytes, pool);
      }
      if (backward) {
        tracked ws(alloc, Attn::backward_workspace_bytes(s, th));
        Attn::backward(s, {io.wq.data(), io.wk.data(), io.wv.data(), io.wo.data()}, io.x.data(),
                       saved.p, saved.bytes, io.dy.data(), io.dx.data(),
                       {io.gq.data(), io.gk.data(), io.gv.data(), io.go.data()}, ws.p, ws.bytes,
                       pool);
      }
    }
    return alloc.stats().peak_requested;
  }
};

// ---- The naive layer -------------------------------------------------------------------------
// Same projections and RoPE as ours (the library's kernels), then per (b, h) the whole T×T score
// matrix as one Eigen product, a masked softmax kept for backward, and P·V. Backward: dV = Pᵀ·dO,
// dP = dO·Vᵀ, dS = P ⊙ (dP − rowsum(dP ⊙ P)), dQ = dS·K/√D, dK = dSᵀ·Q/√D.
template <typename S>
struct naive {
  using A = float;
  using mat = Eigen::Matrix<A, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using cmap = Eigen::Map<const mat, Eigen::Unaligned, Eigen::OuterStride<>>;
  using map = Eigen::Map<mat, Eigen::Unaligned, Eigen::OuterStride<>>;

  static std::size_t run(const mb::attention_shape& s, layer_io<S>& io, bool backward,
                         mb::thread_pool& pool) {
    namespace cpu = mb::cpu;
    mb::system_allocator alloc;
    const std::size_t B = s.batch, T = s.seq, C = s.d_model, H = s.heads, Hkv = s.kv_heads,
                      D = s.head_dim, N = B * T, HD = H * D, KD = Hkv * D, group = H / Hkv;
    const auto ti = [](std::size_t v) { return static_cast<Eigen::Index>(v); };
    const A scale = 1.0f / std::sqrt(static_cast<A>(D));
    constexpr bool widened = !std::is_same_v<S, A>;
    // Widened copies (bf16) exist for ours too; the naive path needs the same ones.
    tracked xw(alloc, widened ? N * C * sizeof(A) : 0);
    tracked ww(alloc, widened ? (2 * C * HD + 2 * C * KD) * sizeof(A) : 0);
    const A *xa, *wq, *wk, *wv, *wo;
    if constexpr (widened) {
      cpu::widen(io.x.data(), N * C, xw.as<A>());
      A* w = ww.as<A>();
      cpu::widen(io.wq.data(), C * HD, w);
      cpu::widen(io.wk.data(), C * KD, w + C * HD);
      cpu::widen(io.wv.data(), C * KD, w + C * HD + C * KD);
      cpu::widen(io.wo.data(), HD * C, w + C * HD + 2 * C * KD);
      xa = xw.as<A>();
      wq = w;
      wk = w + C * HD;
      wv = w + C * HD + C * KD;
      wo = w + C * HD + 2 * C * KD;
    } else {
      xa = io.x.data();
      wq = io.wq.data();
      wk = io.wk.data();
      wv = io.wv.data();
      wo = io.wo.data();
    }
    tracked q(alloc, N * HD * sizeof(A)), k(alloc, N * KD * sizeof(A)), v(alloc, N * KD * sizeof(A));
    tracked p(alloc, B * H * T * T * sizeof(A)), o(alloc, N * HD * sizeof(A));
    tracked y(alloc, N * C * sizeof(A));
    cpu::matmul(pool, xa, wq, q.as<A>(), N, C, HD, false);
    cpu::matmul(pool, xa, wk, k.as<A>(), N, C, KD, false);
    cpu::matmul(pool, xa, wv, v.as<A>(), N, C, KD, false);
    cpu::rope_rows(pool, q.as<A>(), N, T, H, D, s.rope_base, 0, false);
    cpu::rope_rows(pool, k.as<A>(), N, T, Hkv, D, s.rope_base, 0, false);
    pool.parallel_for(B * H, [&](std::size_t task, std::size_t) {
      const std::size_t b = task / H, h = task % H, g = h / group;
      const cmap Q(q.as<A>() + b * T * HD + h * D, ti(T), ti(D), Eigen::OuterStride<>(ti(HD)));
      const cmap K(k.as<A>() + b * T * KD + g * D, ti(T), ti(D), Eigen::OuterStride<>(ti(KD)));
      const cmap V(v.as<A>() + b * T * KD + g * D, ti(T), ti(D), Eigen::OuterStride<>(ti(KD)));
      map P(p.as<A>() + task * T * T, ti(T), ti(T), Eigen::OuterStride<>(ti(T)));
      map O(o.as<A>() + b * T * HD + h * D, ti(T), ti(D), Eigen::OuterStride<>(ti(HD)));
      P.noalias() = scale * (Q * K.transpose());
      for (Eigen::Index i = 0; i < ti(T); ++i) {
        if (s.causal) P.row(i).tail(ti(T) - i - 1).setConstant(-INFINITY);
        const A m = P.row(i).maxCoeff();
        P.row(i) = (P.row(i).array() - m).exp();
        P.row(i) /= P.row(i).sum();
      }
      O.noalias() = P * V;
    });
    cpu::matmul(pool, static_cast<const A*>(o.as<A>()), wo, y.as<A>(), N, HD, C, false);
    if constexpr (widened) cpu::narrow(static_cast<const A*>(y.as<A>()), N * C, io.y.data());
    else std::memcpy(io.y.data(), y.p, N * C * sizeof(A));
    if (!backward) return alloc.stats().peak_requested;

    tracked dyw(alloc, widened ? N * C * sizeof(A) : 0);
    const A* dya;
    if constexpr (widened) {
      cpu::widen(io.dy.data(), N * C, dyw.as<A>());
      dya = dyw.as<A>();
    } else {
      dya = io.dy.data();
    }
    tracked d_out(alloc, N * HD * sizeof(A)), dq(alloc, N * HD * sizeof(A));
    tracked dk(alloc, N * KD * sizeof(A)), dv(alloc, N * KD * sizeof(A));
    tracked dp(alloc, pool.size() * T * T * sizeof(A));  // one dP per thread
    tracked dw(alloc, C * HD * sizeof(A)), dxa(alloc, N * C * sizeof(A));
    cpu::matmul_bt(pool, dya, wo, d_out.as<A>(), N, C, HD, false);
    std::memset(dk.p, 0, dk.bytes);
    std::memset(dv.p, 0, dv.bytes);
    // Heads of one kv group write the same dK, dV: one task per (b, kv head) keeps it race-free.
    pool.parallel_for(B * Hkv, [&](std::size_t task, std::size_t thread) {
      const std::size_t b = task / Hkv, g = task % Hkv;
      const cmap K(k.as<A>() + b * T * KD + g * D, ti(T), ti(D), Eigen::OuterStride<>(ti(KD)));
      const cmap V(v.as<A>() + b * T * KD + g * D, ti(T), ti(D), Eigen::OuterStride<>(ti(KD)));
      map dK(dk.as<A>() + b * T * KD + g * D, ti(T), ti(D), Eigen::OuterStride<>(ti(KD)));
      map dV(dv.as<A>() + b * T * KD + g * D, ti(T), ti(D), Eigen::OuterStride<>(ti(KD)));
      map dP(dp.as<A>() + thread * T * T, ti(T), ti(T), Eigen::OuterStride<>(ti(T)));
      for (std::size_t h = g * group; h < (g + 1) * group; ++h) {
        const cmap Q(q.as<A>() + b * T * HD + h * D, ti(T), ti(D), Eigen::OuterStride<>(ti(HD)));
        const cmap dO(d_out.as<A>() + b * T * HD + h * D, ti(T), ti(D),
                      Eigen::OuterStride<>(ti(HD)));
        map dQ(dq.as<A>() + b * T * HD + h * D, ti(T), ti(D), Eigen::OuterStride<>(ti(HD)));
        const cmap P(p.as<A>() + (b * H + h) * T * T, ti(T), ti(T), Eigen::OuterStride<>(ti(T)));
        dV.noalias() += P.transpose() * dO;
        dP.noalias() = dO * V.transpose();
        for (Eigen::Index i = 0; i < ti(T); ++i) {
          const A delta = (dP.row(i).array() * P.row(i).array()).sum();
          dP.row(i) = P.row(i).array() * (dP.row(i).array() - delta);
        }
        dQ.noalias() = scale * (dP * K);
        dK.noalias() += scale * (dP.transpose() * Q);
      }
    });
    cpu::rope_rows(pool, dq.as<A>(), N, T, H, D, s.rope_base, 0, true);
    cpu::rope_rows(pool, dk.as<A>(), N, T, Hkv, D, s.rope_base, 0, true);
    const auto wgrad = [&](const A* a, const A* d, S* g, std::size_t K, std::size_t M) {
      cpu::matmul_at(pool, a, d, dw.as<A>(), N, K, M, false);
      cpu::narrow_add(static_cast<const A*>(dw.as<A>()), K * M, g);
    };
    wgrad(xa, dq.as<A>(), io.gq.data(), C, HD);
    wgrad(xa, dk.as<A>(), io.gk.data(), C, KD);
    wgrad(xa, dv.as<A>(), io.gv.data(), C, KD);
    wgrad(o.as<A>(), dya, io.go.data(), HD, C);
    cpu::matmul_bt(pool, static_cast<const A*>(dq.as<A>()), wq, dxa.as<A>(), N, HD, C, false);
    cpu::matmul_bt(pool, static_cast<const A*>(dk.as<A>()), wk, dxa.as<A>(), N, KD, C, true);
    cpu::matmul_bt(pool, static_cast<const A*>(dv.as<A>()), wv, dxa.as<A>(), N, KD, C, true);
    cpu::narrow(static_cast<const A*>(dxa.as<A>()), N * C, io.dx.data());
    return alloc.stats().peak_requested;
  }
};

// ---- The table -------------------------------------------------------------------------------
struct options {
  std::size_t threads = mb::thread_pool::default_threads();
  int reps = 3;
  std::size_t max_seq = 4096;
  std::size_t min_seq = 0;
  std::size_t dim = 0;       // 0: both head dims
  bool fp32_only = false;
  bool no_naive = false;     // skip the naive layer (its T×T buffers are slow at T = 4096)
  bool quick = false;
  std::size_t window = 0;    // > 0: ours with this sliding window, against ours without
};

template <typename F>
double best_ms(int reps, F&& f) {
  double best = 1e300;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = clock_type::now();
    f();
    best = std::min(best, std::chrono::duration<double, std::milli>(clock_type::now() - t0).count());
  }
  return best;
}

template <typename S, typename Attn>
void rows(const char* precision_name, const options& opt, double peak, mb::thread_pool& pool,
          bool backward_only = false) {
  const std::size_t seqs[] = {512, 1024, 2048, 4096};
  const std::size_t dims[] = {64, 128};
  for (std::size_t D : dims) {
    for (std::size_t T : seqs) {
      if (T > opt.max_seq || T < opt.min_seq || (opt.quick && T > 1024)) continue;
      if (opt.dim != 0 && D != opt.dim) continue;
      mb::attention_shape s;
      s.batch = 1;
      s.seq = T;
      s.heads = 8;
      s.kv_heads = 8;
      s.head_dim = D;
      s.d_model = s.heads * D;
      s.causal = true;
      layer_io<S> io(s);
      const mb::attention_shape full = s;
      s.window = opt.window;
      // The pairs the band keeps (T²/2 causal, as before, without a window).
      const double pairs = opt.window == 0 ? double(T) * double(T) * 0.5 : mb::attention_pairs(s);
      const double attn_fwd = 4.0 * s.batch * s.heads * pairs * double(D);
      // The comparison: the naive layer, or under --window ours on every key.
      const auto other = [&](bool bwd) {
        return opt.window != 0 ? ours<Attn>::run(full, io, bwd, pool) : naive<S>::run(s, io, bwd, pool);
      };
      const double proj_fwd = 2.0 * double(s.batch * T) * double(s.d_model) *
                              double(2 * s.heads * D + 2 * s.kv_heads * D);
      for (bool bwd : {false, true}) {
        if (backward_only && !bwd) continue;
        std::size_t ours_peak = 0, naive_peak = 0;
        // Warm-up (first touch of every page), then alternate so both see the same machine.
        ours_peak = ours<Attn>::run(s, io, bwd, pool);
        if (!opt.no_naive) naive_peak = other(bwd);
        double t_ours = 1e300, t_naive = 1e300;
        for (int r = 0; r < opt.reps; ++r) {
          t_ours = std::min(t_ours, best_ms(1, [&] { ours<Attn>::run(s, io, bwd, pool); }));
          if (!opt.no_naive)
            t_naive = std::min(t_naive, best_ms(1, [&] { other(bwd); }));
        }
        if (opt.no_naive) t_naive = 0;
        const double attn_flops = attn_fwd * (bwd ? 3.5 : 1.0);
        const double all_flops = attn_flops + proj_fwd * (bwd ? 3.0 : 1.0);
        const double gf_attn = attn_flops / (t_ours * 1e6), gf_all = all_flops / (t_ours * 1e6);
        std::printf("| %5zu | %3zu | %-13s | %-7s | %9.2f | %9.1f | %8.1f | %5.1f%% | %7.2f | %8.1f | "
                    "%9.1f | %9.1f |\n",
                    T, D, precision_name, bwd ? "fwd+bwd" : "fwd", t_ours, gf_attn, gf_all,
                    100.0 * gf_all / peak, t_naive / t_ours, double(ours_peak) / (1 << 20),
                    double(naive_peak) / (1 << 20), double(Attn::saved_bytes(s)) / (1 << 20));
        std::fflush(stdout);
      }
    }
  }
}

}  // namespace

static int bench_main(int argc, char** argv) {
  options opt;
  bench_flags::args a(argc, argv,
                      "usage: bench_attention [--threads N] [--reps N] [--max-seq T] [--min-seq T] [--dim 0|64|128]\n"
                      "                       [--fp32-only] [--no-naive] [--quick] [--window W]\n"
                      "  attention layer vs the naive path; see the header of bench_attention.cpp");
  while (a.next()) {
    if (a.is("--threads")) opt.threads = static_cast<std::size_t>(a.whole(1, 1024));
    else if (a.is("--reps")) opt.reps = static_cast<int>(a.whole(1, 1000000));
    else if (a.is("--max-seq")) opt.max_seq = static_cast<std::size_t>(a.whole(1, std::size_t{1} << 20));
    else if (a.is("--min-seq")) opt.min_seq = static_cast<std::size_t>(a.whole(0, std::size_t{1} << 20));
    else if (a.is("--dim")) opt.dim = static_cast<std::size_t>(a.whole(0, 256));
    else if (a.is("--fp32-only")) opt.fp32_only = true;
    else if (a.is("--no-naive")) opt.no_naive = true;
    else if (a.is("--quick")) opt.quick = true;
    else if (a.is("--window")) opt.window = static_cast<std::size_t>(a.whole(1, std::size_t{1} << 20));
    else a.unknown();
  }
  if (opt.dim != 0 && opt.dim != 64 && opt.dim != 128) {
    throw membound::invalid_argument("--dim", "0 (both), 64 or 128", std::to_string(opt.dim), "e.g. --dim 64");
  }
  if (opt.min_seq > opt.max_seq) {
    throw membound::invalid_argument("--min-seq", "at most --max-seq (" + std::to_string(opt.max_seq) + ")",
                                     std::to_string(opt.min_seq), "Lower --min-seq or raise --max-seq");
  }
  mb::thread_pool pool(opt.threads);
  const double peak1 = fma_peak_gflops(1), peak = fma_peak_gflops(opt.threads);
  std::printf("FMA peak (%s, fp32): %.1f GFLOP/s on 1 thread, %.1f GFLOP/s on %zu threads\n", isa,
              peak1, peak, opt.threads);
  std::printf("B=1 H=Hkv=8 C=H*D causal%s, best of %d, %%peak of %zu-thread peak\n\n",
              opt.window ? (", sliding window " + std::to_string(opt.window) + " (vs membound's full causal)").c_str() : "",
              opt.reps, opt.threads);
  const char* vs = opt.window ? "x full | peak MiB | full MiB" : "x naive | peak MiB | naive MiB";
  std::printf("| T | D | policy | pass | ms | attn GF/s | all GF/s | %%peak | %s | saved MiB |\n"
              "|--:|--:|---|---|--:|--:|--:|--:|--:|--:|--:|--:|\n", vs);
  rows<float, mb::attention<mb::fp32_precision>>("fp32", opt, peak, pool);
  if (!opt.fp32_only) rows<mb::bf16, mb::attention<mb::bf16_precision>>("bf16", opt, peak, pool);
  // The checkpoint trade: keep q, k, v instead of projecting them again in backward.
  rows<float, mb::attention<mb::fp32_precision, mb::save_all>>("fp32 save_all", opt, peak, pool,
                                                               true);
  return 0;
}

// Any error, a flag's or the library's, is one `error:` line and exit 1.
int main(int argc, char** argv) {
  return bench_flags::run([&] { return bench_main(argc, argv); });
}
