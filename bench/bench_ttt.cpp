// The TTT-Linear and TTT-MLP layers against naive primal paths, on this machine, in one run so
// that every ratio compares measurements taken side by side:
//   - first a check on each naive layer: ours (fp32, G = 4) and the naive layer on one small shape
//     (B = 1, T = 256, C = 512, H = 8), y, dx and every parameter gradient compared (both fp32:
//     they differ in summation order only, so they agree to ~1e-5 relative or one of them is
//     wrong; tolerance 1e-4, measured ≤ 1.1e-5 for TTT-Linear and ≤ 4.8e-6 for TTT-MLP. Leaving
//     out the GELU's second-derivative term of the MLP's hand backward alone shows up as 5.7e-3);
//   - for T in {1024, 4096}, width C = 512 with H = 8 heads (D = 64), mini-batch b = 16, B = 1,
//     no gate, fp32 and bf16 storage: forward and forward+backward of membound::ttt_linear under
//     the checkpoint policies ttt_state_groups<1>, <4> and ttt_state_groups_all (G = 1, 4,
//     all), and of the naive TTT-Linear layer;
//   - the same for membound::ttt_mlp (F = 4·D = 256) and the naive TTT-MLP layer.
//
// The naive TTT-Linear layer is the PRIMAL form, in fp32, as a user writes it from the paper:
// per (batch, head) and token t of a mini-batch starting at W_0, it takes the token's inner
// gradient at W_0 (the LayerNorm-fused L2 loss), keeps the running sum S_t = Σ_{s≤t} lr_s·∇ℓ_s
// (η[t, s] = tok_t·lr_s, so this is the primal form without re-summing the mini-batch per token),
// and MATERIALIZES the token's own inner weights W_t = W_0 − tok_t·S_t (D×D) and w_t, then
// applies them to XQ_t (plain loops: GEMVs and rank-1 updates, vectorized by the compiler). The
// projections, RoPE, post norm and output projection use the same library kernels as ours
// (membound::cpu::matmul and its transposes, cpu::rope_pairs, cpu::ln_row), so only the inner
// loop and what is kept differ.
//   forward only:     every W_t is written to a per-thread [b, D, D] buffer and dropped at the
//                     end of its mini-batch (an inference forward keeps no per-token W).
//   forward+backward: the naive forward keeps EVERY per-token W_t and w_t, [B, H, T, D, D] fp32
//                     (512 MiB at T = 4096), plus q, k, v, the rates, the heads' output and the
//                     post norm's x̂ and σ; its backward is the hand-written reverse of the primal
//                     form (per mini-batch, in reverse: recompute the inner gradients at W_0 and
//                     the running sums S_t, then per token dW_t = XQ_tᵀ·dZbar_t, suffix sums of
//                     −tok_t·dW_t for the gradients' adjoints, the inner loss's second-order
//                     backward), reading the stored W_t. Checked against ours before the table.
// The naive TTT-MLP layer is the same scheme for the inner model f(x) = GELU_tanh(x·W1 + b1)·W2 +
// b2 (cpu::gelu_tanh, the library's GELU and its derivatives): per (batch, head) and token t, at
// the mini-batch's Θ_0 = (W1, b1, W2, b2), z1 = XK_t·W1 + b1, x2 = gelu(z1), z2 = x2·W2 + b2,
// g2 = ∂ℓ/∂z2 (the LayerNorm-fused L2 loss), g1 = (W2·g2) ⊙ gelu'(z1); running sums of
// lr_t·(XK_t ⊗ g1, g1, x2 ⊗ g2, g2); the token's Θ_t = Θ_0 − tok_t·S_t materialized
// (W1_t [D, F], b1_t [F], W2_t [F, D], b2_t [D]: 2·64·256 + 320 floats, ~129 KiB) and applied to
// XQ_t (gelu(XQ_t·W1_t + b1_t)·W2_t + b2_t, then the inner LayerNorm).
//   forward only:     every Θ_t in a per-thread [b, E] buffer (E = 2·D·F + F + D), dropped at
//                     the end of its mini-batch.
//   forward+backward: every per-token Θ_t kept, [B, H, T, E] fp32 (1.0 GiB at T = 1024, 4.0 GiB at
//                     T = 4096); its backward is the full hand-written reverse of the primal form,
//                     as for TTT-Linear: per mini-batch in reverse, recompute the keys' z1, x2,
//                     g2, g1 at Θ_0 and the running sums S_t; per token in reverse, the query's
//                     path through the stored Θ_t (with the query's zq1, xq2, zq2:
//                     dΘ_t = (XQ ⊗ dzq1, dzq1, xq2 ⊗ dzq2, dzq2), dXQ), dtok_t = −⟨S_t, dΘ_t⟩, the
//                     suffix sum R = Σ −tok·dΘ for the increments' adjoint lr_t·R (→ dlr, dXK,
//                     dg1, dg2, dx2), then the backward of g1 = (W2·g2) ⊙ gelu'(z1) (gelu'' and
//                     dW2_0), of g2 (the inner loss's second order, shared with TTT-Linear), of
//                     z2, x2 and z1 into dΘ_0, dXK, dXV, dγ, dβ. Checked against ours before the
//                     table. The table skips it ("-" in its naive columns, with a line saying why)
//                     where those per-token states would exceed half of MemAvailable when the row
//                     starts; 4.0 GiB at T = 4096 fits the 24 GiB machine this was written on, so
//                     it ran there.
// The naive layers' bf16 rows widen the bf16 inputs and weights to fp32 and round the outputs
// and gradients once, as ours does.
//
// Columns:
//   ms          best of --reps repetitions of one call (the machine is shared; the minimum is
//               the least noisy). A call allocates saved + workspace from a system_allocator,
//               runs forward (and backward into the caller's dx and gradients) and frees them;
//               the naive call allocates its buffers the same way. The three G rows of a shape
//               and the naive call are timed in turn, rep by rep, after one warm-up each.
//   tok/s       B·T / ms
//   naive ms    the naive layer's best time (shared by the three G rows of a shape)
//   x naive     naive ms / ms
//   peak MiB    ours' own memory beyond inputs, outputs, weights and gradients, read from the
//               allocator statistics: saved + the larger workspace (ours' fwd rows still
//               allocate and write `saved`, as a training forward does)
//   saved MiB   of that, what forward keeps for backward: the inner states at the start of every
//               G-th mini-batch (B·H·ceil(T/(b·G))·(D² + D) fp32 for TTT-Linear,
//               ·(2·D·F + F + D) for TTT-MLP) and the heads' output [B·T, C] in the storage type
//   ckpt MiB    of saved, the inner-state checkpoints alone: what G trades against recomputation
//   naive MiB   the naive layer's peak from its allocator statistics
//
// Run: /tmp/tbench-build/bench/bench_ttt [--threads N] [--reps N] [--max-seq T] [--quick]
//   --quick: T = 1024 only; --max-seq 0: the two checks only. Build (Release, -march=native,
//   which the project's CMake adds to benchmarks by default):
//   cmake -S . -B /tmp/tbench-build -G Ninja -DCMAKE_BUILD_TYPE=Release
//         -DMEMBOUND_BUILD_TESTS=OFF -DMEMBOUND_ENABLE_CUDA=OFF  (one line)
//   cmake --build /tmp/tbench-build --target bench_ttt
#include <benchmark/benchmark.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "bench_flags.hpp"
#include "membound/membound.hpp"

namespace mb = membound;
using clock_type = std::chrono::steady_clock;

namespace {

constexpr double MiB = 1024.0 * 1024.0;
constexpr std::size_t MBATCH = 16;  // b: ttt_mini_batch<16>, the layer's default
constexpr float ln_eps = 1e-6f;     // the layer's inner and post LayerNorm eps

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

// splitmix64 -> uniform in [-scale, scale), plus an offset.
template <typename T>
void fill_random(std::vector<T>& v, std::uint64_t seed, double scale, double offset = 0.0) {
  std::uint64_t s = seed * 0x2545F4914F6CDD1Dull;
  for (auto& e : v) {
    s += 0x9E3779B97F4A7C15ull;
    std::uint64_t z = s;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const double u = static_cast<double>(z >> 11) * 0x1.0p-53 * 2.0 - 1.0;
    e = mb::from_accum<T>(static_cast<float>(offset + u * scale));
  }
}

// The layer's tensors in the order of ttt_linear::weights (and gradients).
constexpr int n_w = 16;
const char* const w_names[n_w] = {"wq",   "wk",   "wv",         "ttt_norm_w", "ttt_norm_b",
                                  "w1",   "b1",   "lr_w",       "lr_b",       "tok_offset",
                                  "post_w", "post_b", "wg",     "wo",         "w2", "b2"};
enum widx : int { Wq, Wk, Wv, NormW, NormB, W1, B1, LrW, LrB, Tok, PostW, PostB, Wg, Wo, W2, B2 };

// mlp: TTT-MLP's inner model (W1 [D, 4D], W2 [4D, D]); otherwise w2 and b2 are empty.
std::array<std::size_t, n_w> weight_sizes(const mb::ttt_shape& s, bool mlp) {
  const std::size_t C = s.width, H = s.heads, D = s.head_dim(), F = mlp ? 4 * D : D;
  return {C * C, C * C, C * C, H * D, H * D, H * D * F, H * F, H * C, H, MBATCH, C, C,
          s.use_gate ? C * C : 0, C * C, mlp ? H * F * D : 0, mlp ? H * D : 0};
}

// The caller's tensors: inputs, outputs, weights and gradients (not counted in either peak).
// Values as the unit tests draw them: every tensor U(±0.5/sqrt(C)), scales near 1, the inner W1
// doubled and the rate gate's weights ×4 so that test-time learning changes the output, rate
// biases U(±0.5), token offsets U(±0.2); x, dy U(±1).
template <typename S>
struct layer_io {
  std::vector<S> x, y, dy, dx;
  std::array<std::vector<S>, n_w> w, g;
  explicit layer_io(const mb::ttt_shape& s, bool mlp = false) {
    const std::size_t N = s.batch * s.seq * s.width;
    x.resize(N);
    y.resize(N);
    dy.resize(N);
    dx.resize(N);
    fill_random(x, 1, 1.0);
    fill_random(dy, 2, 1.0);
    const auto sizes = weight_sizes(s, mlp);
    const double sc = 0.5 / std::sqrt(static_cast<double>(s.width));
    for (int i = 0; i < n_w; ++i) {
      w[i].resize(sizes[i]);
      g[i].assign(sizes[i], mb::from_accum<S>(0.0f));
      fill_random(w[i], 10 + i, sc);
    }
    fill_random(w[NormW], 30, sc, 1.0);
    fill_random(w[PostW], 31, sc, 1.0);
    fill_random(w[W1], 32, 2 * sc);
    fill_random(w[LrW], 33, 4 * sc);
    fill_random(w[LrB], 34, 0.5);
    fill_random(w[Tok], 35, 0.2);
  }
  void zero_grads() {
    for (auto& v : g) std::fill(v.begin(), v.end(), mb::from_accum<S>(0.0f));
  }
};

template <typename Layer, typename S>
typename Layer::weights weights_of(const layer_io<S>& io) {
  const auto& w = io.w;
  return {w[0].data(), w[1].data(), w[2].data(),  w[3].data(),  w[4].data(),
          w[5].data(), w[6].data(), w[7].data(),  w[8].data(),  w[9].data(),
          w[10].data(), w[11].data(), w[12].empty() ? nullptr : w[12].data(), w[13].data(),
          w[14].empty() ? nullptr : w[14].data(), w[15].empty() ? nullptr : w[15].data()};
}
template <typename Layer, typename S>
typename Layer::gradients gradients_of(layer_io<S>& io) {
  auto& g = io.g;
  return {g[0].data(), g[1].data(), g[2].data(),  g[3].data(),  g[4].data(),
          g[5].data(), g[6].data(), g[7].data(),  g[8].data(),  g[9].data(),
          g[10].data(), g[11].data(), g[12].empty() ? nullptr : g[12].data(), g[13].data(),
          g[14].empty() ? nullptr : g[14].data(), g[15].empty() ? nullptr : g[15].data()};
}

// ---- Ours ------------------------------------------------------------------------------------
template <typename Layer>
struct ours {
  using S = typename Layer::storage_type;
  static std::size_t run(const mb::ttt_shape& s, layer_io<S>& io, bool backward,
                         mb::thread_pool& pool) {
    mb::system_allocator alloc;
    const std::size_t th = pool.size();
    const auto wv = weights_of<Layer>(io);
    {
      tracked saved(alloc, Layer::saved_bytes(s));
      {
        tracked ws(alloc, Layer::forward_workspace_bytes(s, th));
        Layer::forward(s, wv, io.x.data(), io.y.data(), saved.p, saved.bytes, ws.p, ws.bytes,
                       pool);
      }
      if (backward) {
        tracked ws(alloc, Layer::backward_workspace_bytes(s, th));
        Layer::backward(s, wv, io.x.data(), saved.p, saved.bytes, io.dy.data(), io.dx.data(),
                        gradients_of<Layer>(io), ws.p, ws.bytes, pool);
      }
    }
    return alloc.stats().peak_requested;
  }
};

// ---- The naive layers: primal form, per-token inner weights materialized ----------------------
// Mlp = false: TTT-Linear, per-token W_t [D, D] and w_t [D] in two buffers. Mlp = true: TTT-MLP,
// the per-token state (W1_t [D, F], b1_t [F], W2_t [F, D], b2_t [D], F = 4·D) in one block of E
// elements per token, and the running sums in the same layout.
template <typename S, bool Mlp = false>
struct naive {
  using A = float;
  using gelu = mb::cpu::gelu_tanh<A>;
  static constexpr bool widened = !std::is_same_v<S, A>;

  // G = ∇_z ½‖γ x̂(z) + β − (v − k)‖² for one token: z [D] in, x̂ and σ kept, g [D] out.
  static A inner_grad(const A* z, const A* kr, const A* vr, const A* gamma, const A* beta,
                      std::size_t D, A* xh, A* g) {
    const A sg = mb::cpu::ln_row(z, D, ln_eps, xh);
    A a = 0, c = 0;
    for (std::size_t j = 0; j < D; ++j) {
      g[j] = (gamma[j] * xh[j] + beta[j] - (vr[j] - kr[j])) * gamma[j];
      a += g[j];
      c += g[j] * xh[j];
    }
    a /= static_cast<A>(D);
    c /= static_cast<A>(D);
    for (std::size_t j = 0; j < D; ++j) g[j] = (g[j] - a - xh[j] * c) / sg;
    return sg;
  }
  // The reverse of inner_grad (the inner loss's second order): given dg = dL/dg for g at x̂ (xr)
  // and σ (s1), accumulates dγ, dβ (pgam, pbet), dk (+= into dkr), dv (−= into dvr) and writes
  // dz = dL/dz. res, dxh: [D] scratch.
  static void inner_grad_backward(const A* xr, A s1, const A* gs, const A* dg, const A* kr,
                                  const A* vr, const A* gamma, const A* beta, std::size_t D,
                                  A* res, A* dxh, A* pgam, A* pbet, A* dkr, A* dvr, A* dz) {
    const A invD = A(1) / static_cast<A>(D);
    A cc = 0, m1 = 0, m2 = 0, dsig = 0;
    for (std::size_t j = 0; j < D; ++j) {
      res[j] = gamma[j] * xr[j] + beta[j] - (vr[j] - kr[j]);
      cc += res[j] * gamma[j] * xr[j];
      m1 += dg[j];
      m2 += dg[j] * xr[j];
      dsig -= dg[j] * gs[j];
    }
    cc *= invD;
    const A sdx = m2;
    m1 *= invD;
    m2 *= invD;
    dsig /= s1;
    for (std::size_t j = 0; j < D; ++j) {
      const A gx = res[j] * gamma[j];
      const A dgx = (dg[j] - m1 - xr[j] * m2) / s1;
      const A dr = dgx * gamma[j];
      pgam[j] += dgx * res[j] + dr * xr[j];
      pbet[j] += dr;
      dvr[j] -= dr;
      dkr[j] += dr;
      dxh[j] = -(dg[j] * cc) / s1 - sdx / s1 * gx * invD + dr * gamma[j];
    }
    mb::cpu::ln_row_backward(xr, s1, static_cast<const A*>(dxh), dsig, D, dz);
  }
  // out[c] = bias[c] + Σ_a v[a]·W[a, c]   (v·W, W [n, m] row-major)
  static void vec_mat(const A* v, const A* W, const A* bias, std::size_t n, std::size_t m,
                      A* out) {
    for (std::size_t c = 0; c < m; ++c) out[c] = bias ? bias[c] : A(0);
    for (std::size_t a = 0; a < n; ++a) {
      const A va = v[a];
      const A* row = W + a * m;
      for (std::size_t c = 0; c < m; ++c) out[c] += va * row[c];
    }
  }
  // out[a] (+)= Σ_c W[a, c]·v[c]   (W·v, W [n, m] row-major)
  static void mat_vec(const A* W, const A* v, std::size_t n, std::size_t m, A* out,
                      bool accumulate) {
    for (std::size_t a = 0; a < n; ++a) {
      const A* row = W + a * m;
      A acc = 0;
      for (std::size_t c = 0; c < m; ++c) acc += row[c] * v[c];
      out[a] = accumulate ? out[a] + acc : acc;
    }
  }
  // TTT-MLP: head h's initial state (W1, b1, W2, b2 of the weights) into one block of E.
  static void load_inner(const A* const* w, std::size_t h, std::size_t D, std::size_t F, A* st) {
    std::copy(w[W1] + h * D * F, w[W1] + (h + 1) * D * F, st);
    std::copy(w[B1] + h * F, w[B1] + (h + 1) * F, st + D * F);
    std::copy(w[W2] + h * F * D, w[W2] + (h + 1) * F * D, st + D * F + F);
    std::copy(w[B2] + h * D, w[B2] + (h + 1) * D, st + 2 * D * F + F);
  }

  static std::size_t run(const mb::ttt_shape& s, layer_io<S>& io, bool backward,
                         mb::thread_pool& pool) {
    namespace cpu = mb::cpu;
    mb::system_allocator alloc;
    const std::size_t B = s.batch, T = s.seq, C = s.width, H = s.heads, D = s.head_dim(),
                      N = B * T, DD = D * D, th = pool.size(), nmb = cpu::blocks(T, MBATCH);
    // F: the inner hidden width; E: the per-token state in the wst buffer (MLP: W1, b1, W2, b2;
    // linear: W alone, its w_t in bst); offsets of the MLP's tensors inside a block of E.
    const std::size_t F = Mlp ? 4 * D : D, E = Mlp ? 2 * D * F + F + D : DD;
    const std::size_t ob1 = D * F, oW2 = ob1 + F, ob2 = oW2 + F * D;
    const auto sizes = weight_sizes(s, Mlp);
    std::size_t wtotal = 0;
    for (std::size_t n : sizes) wtotal += n;
    // Widened copies (bf16) exist for ours too; the naive path needs the same ones.
    tracked wbuf(alloc, widened ? wtotal * sizeof(A) : 0);
    tracked xw(alloc, widened ? N * C * sizeof(A) : 0);
    A* cursor = wbuf.as<A>();
    const auto take = [&](const std::vector<S>& v) -> const A* {
      if constexpr (widened) {
        cpu::widen(v.data(), v.size(), cursor);
        const A* r = cursor;
        cursor += v.size();
        return r;
      } else {
        return v.data();
      }
    };
    const A* w[n_w];
    for (int i = 0; i < n_w; ++i) w[i] = take(io.w[i]);
    const A* xa;
    if constexpr (widened) {
      cpu::widen(io.x.data(), N * C, xw.as<A>());
      xa = xw.as<A>();
    } else {
      xa = io.x.data();
    }

    // Projections, RoPE (inside each mini-batch), the rate gate, the token scales.
    tracked q(alloc, N * C * sizeof(A)), k(alloc, N * C * sizeof(A)), v(alloc, N * C * sizeof(A));
    tracked lr(alloc, N * H * sizeof(A)), sig(alloc, N * H * sizeof(A));
    cpu::matmul(pool, xa, w[Wq], q.as<A>(), N, C, C, false);
    cpu::matmul(pool, xa, w[Wk], k.as<A>(), N, C, C, false);
    cpu::matmul(pool, xa, w[Wv], v.as<A>(), N, C, C, false);
    cpu::rope_pairs(pool, q.as<A>(), N, T, H, D, s.rope_base, MBATCH, false);
    cpu::rope_pairs(pool, k.as<A>(), N, T, H, D, s.rope_base, MBATCH, false);
    cpu::matmul_bt(pool, xa, w[LrW], sig.as<A>(), N, C, H, false);
    const A lr_scale = static_cast<A>(s.base_lr / static_cast<double>(D));
    for (std::size_t n = 0; n < N; ++n)
      for (std::size_t h = 0; h < H; ++h) {
        A& e = sig.as<A>()[n * H + h];
        e = A(1) / (A(1) + std::exp(-(e + w[LrB][h])));
        lr.as<A>()[n * H + h] = lr_scale * e;
      }
    A tok[MBATCH];
    for (std::size_t i = 0; i < MBATCH; ++i)
      tok[i] = std::max(A(0), A(1) / static_cast<A>(i + 1) + w[Tok][i]);

    // The inner loop, primal form. Forward+backward keeps every per-token state; forward alone
    // keeps one mini-batch's per thread.
    const bool keep = backward;
    tracked wst(alloc, (keep ? B * H * T : th * MBATCH) * E * sizeof(A));
    tracked bst(alloc, Mlp ? 0 : (keep ? B * H * T : th * MBATCH) * D * sizeof(A));
    const std::size_t per_f = Mlp ? 2 * E + 6 * F + 4 * D : 2 * DD + 6 * D;
    tracked fscr(alloc, th * per_f * sizeof(A));
    tracked o(alloc, N * C * sizeof(A));
    const A* Q = q.as<A>();
    const A* Kp = k.as<A>();
    const A* V = v.as<A>();
    const A* LR = lr.as<A>();
    pool.parallel_for(B * H, [&](std::size_t task, std::size_t thread) {
      const std::size_t b = task / H, h = task % H;
      if constexpr (Mlp) {
        A* T0 = fscr.as<A>() + thread * per_f;  // Θ_0 = (W1, b1, W2, b2) of the mini-batch
        A* Ssum = T0 + E;  // Σ_{s≤t} lr_s·∇ℓ_s(Θ_0), same layout
        A* z1 = Ssum + E;  // [F] each
        A* x2 = z1 + F;
        A* ev = x2 + F;
        A* g1 = ev + F;
        A* zq1 = g1 + F;
        A* xq2 = zq1 + F;
        A* z2 = xq2 + F;  // [D] each
        A* xh = z2 + D;
        A* g2 = xh + D;
        A* zq2 = g2 + D;
        A* Tt = keep ? wst.as<A>() + task * T * E : wst.as<A>() + thread * MBATCH * E;
        const A* gamma = w[NormW] + h * D;
        const A* beta = w[NormB] + h * D;
        load_inner(w, h, D, F, T0);
        for (std::size_t m = 0; m < nmb; ++m) {
          const std::size_t t0 = m * MBATCH, K = std::min(MBATCH, T - t0);
          std::fill(Ssum, Ssum + E, A(0));
          A* Ti = nullptr;
          for (std::size_t i = 0; i < K; ++i) {
            const std::size_t row = b * T + t0 + i;
            const A* qr = Q + row * C + h * D;
            const A* kr = Kp + row * C + h * D;
            const A* vr = V + row * C + h * D;
            const A lri = LR[row * H + h];
            // The token's inner gradients at Θ_0: z1 = k·W1 + b1, x2 = gelu(z1),
            // z2 = x2·W2 + b2, g2 = ∂ℓ/∂z2, g1 = ∂ℓ/∂z1 = (W2·g2) ⊙ gelu'(z1).
            vec_mat(kr, T0, T0 + ob1, D, F, z1);
            for (std::size_t f = 0; f < F; ++f) x2[f] = gelu::f(z1[f]);
            vec_mat(x2, T0 + oW2, T0 + ob2, F, D, z2);
            inner_grad(z2, kr, vr, gamma, beta, D, xh, g2);
            mat_vec(T0 + oW2, g2, F, D, ev, false);
            for (std::size_t f = 0; f < F; ++f) g1[f] = ev[f] * gelu::d1(z1[f]);
            // Running sums: lr·(k ⊗ g1, g1, x2 ⊗ g2, g2).
            for (std::size_t a = 0; a < D; ++a) {
              const A ka = lri * kr[a];
              A* Sa = Ssum + a * F;
              for (std::size_t f = 0; f < F; ++f) Sa[f] += ka * g1[f];
            }
            for (std::size_t f = 0; f < F; ++f) Ssum[ob1 + f] += lri * g1[f];
            for (std::size_t f = 0; f < F; ++f) {
              const A xf = lri * x2[f];
              A* Sf = Ssum + oW2 + f * D;
              for (std::size_t c = 0; c < D; ++c) Sf[c] += xf * g2[c];
            }
            for (std::size_t c = 0; c < D; ++c) Ssum[ob2 + c] += lri * g2[c];
            // Θ_t = Θ_0 − tok_t·S_t, materialized, then applied to XQ_t.
            Ti = Tt + (keep ? t0 + i : i) * E;
            for (std::size_t e = 0; e < E; ++e) Ti[e] = T0[e] - tok[i] * Ssum[e];
            vec_mat(qr, Ti, Ti + ob1, D, F, zq1);
            for (std::size_t f = 0; f < F; ++f) xq2[f] = gelu::f(zq1[f]);
            vec_mat(xq2, Ti + oW2, Ti + ob2, F, D, zq2);
            mb::cpu::ln_row(zq2, D, ln_eps, xh);
            A* out = o.as<A>() + row * C + h * D;
            for (std::size_t c = 0; c < D; ++c) out[c] = qr[c] + gamma[c] * xh[c] + beta[c];
          }
          std::copy(Ti, Ti + E, T0);  // the last token's Θ starts the next mini-batch
        }
        return;
      }
      A* W0 = fscr.as<A>() + thread * per_f;
      A* Ssum = W0 + DD;   // Σ_{s≤t} lr_s·k_s⊗g_s
      A* w0 = Ssum + DD;
      A* sb = w0 + D;   // Σ_{s≤t} lr_s·g_s
      A* z = sb + D;
      A* xh = z + D;
      A* g = xh + D;
      A* zb = g + D;
      A* Wt = keep ? wst.as<A>() + task * T * DD : wst.as<A>() + thread * MBATCH * DD;
      A* wt = keep ? bst.as<A>() + task * T * D : bst.as<A>() + thread * MBATCH * D;
      const A* gamma = w[NormW] + h * D;
      const A* beta = w[NormB] + h * D;
      std::copy(w[W1] + h * DD, w[W1] + (h + 1) * DD, W0);
      std::copy(w[B1] + h * D, w[B1] + (h + 1) * D, w0);
      for (std::size_t m = 0; m < nmb; ++m) {
        const std::size_t t0 = m * MBATCH, K = std::min(MBATCH, T - t0);
        std::fill(Ssum, Ssum + DD, A(0));
        std::fill(sb, sb + D, A(0));
        A *Wi = nullptr, *wi = nullptr;
        for (std::size_t i = 0; i < K; ++i) {
          const std::size_t row = b * T + t0 + i;
          const A* qr = Q + row * C + h * D;
          const A* kr = Kp + row * C + h * D;
          const A* vr = V + row * C + h * D;
          const A lri = LR[row * H + h];
          vec_mat(kr, W0, w0, D, D, z);  // the token's inner gradient at W_0
          inner_grad(z, kr, vr, gamma, beta, D, xh, g);
          for (std::size_t a = 0; a < D; ++a) {
            const A ka = lri * kr[a];
            for (std::size_t c = 0; c < D; ++c) Ssum[a * D + c] += ka * g[c];
          }
          for (std::size_t c = 0; c < D; ++c) sb[c] += lri * g[c];
          Wi = Wt + (keep ? t0 + i : i) * DD;  // W_t = W_0 − tok_t·S_t, materialized
          wi = wt + (keep ? t0 + i : i) * D;
          for (std::size_t e = 0; e < DD; ++e) Wi[e] = W0[e] - tok[i] * Ssum[e];
          for (std::size_t c = 0; c < D; ++c) wi[c] = w0[c] - tok[i] * sb[c];
          vec_mat(qr, Wi, wi, D, D, zb);
          mb::cpu::ln_row(zb, D, ln_eps, xh);
          A* out = o.as<A>() + row * C + h * D;
          for (std::size_t c = 0; c < D; ++c) out[c] = qr[c] + gamma[c] * xh[c] + beta[c];
        }
        std::copy(Wi, Wi + DD, W0);  // the last token's W starts the next mini-batch
        std::copy(wi, wi + D, w0);
      }
    });

    // Post norm and output projection.
    tracked pn(alloc, N * C * sizeof(A)), xhp(alloc, N * C * sizeof(A)), rsig(alloc, N * sizeof(A));
    cpu::for_rows(pool, N, [&](std::size_t n) {
      A* xr = xhp.as<A>() + n * C;
      rsig.as<A>()[n] = cpu::ln_row(o.as<A>() + n * C, C, ln_eps, xr);
      for (std::size_t j = 0; j < C; ++j)
        pn.as<A>()[n * C + j] = xr[j] * w[PostW][j] + w[PostB][j];
    });
    tracked yw(alloc, widened ? N * C * sizeof(A) : 0);
    if constexpr (widened) {
      cpu::matmul(pool, static_cast<const A*>(pn.as<A>()), w[Wo], yw.as<A>(), N, C, C, false);
      cpu::narrow(static_cast<const A*>(yw.as<A>()), N * C, io.y.data());
    } else {
      cpu::matmul(pool, static_cast<const A*>(pn.as<A>()), w[Wo], io.y.data(), N, C, C, false);
    }
    if (!backward) return alloc.stats().peak_requested;

    // ---- Backward ----------------------------------------------------------------------------
    tracked dyw(alloc, widened ? N * C * sizeof(A) : 0);
    const A* dya;
    if constexpr (widened) {
      cpu::widen(io.dy.data(), N * C, dyw.as<A>());
      dya = dyw.as<A>();
    } else {
      dya = io.dy.data();
    }
    tracked wtmp(alloc, C * C * sizeof(A)), dpn(alloc, N * C * sizeof(A)),
        d_o(alloc, N * C * sizeof(A));
    const auto add_grad = [&](const A* src, std::size_t n, int which) {
      cpu::narrow_add(src, n, io.g[which].data());
    };
    // y = pn·Wo
    cpu::matmul_at(pool, static_cast<const A*>(pn.as<A>()), dya, wtmp.as<A>(), N, C, C, false);
    add_grad(wtmp.as<A>(), C * C, Wo);
    cpu::matmul_bt(pool, dya, w[Wo], dpn.as<A>(), N, C, C, false);
    // Post norm: d(post_w) = Σ dpn ⊙ x̂, d(post_b) = Σ dpn, then the LayerNorm backward.
    {
      std::vector<A> dpw(C, A(0)), dpb(C, A(0));
      for (std::size_t n = 0; n < N; ++n)
        for (std::size_t j = 0; j < C; ++j) {
          dpw[j] += dpn.as<A>()[n * C + j] * xhp.as<A>()[n * C + j];
          dpb[j] += dpn.as<A>()[n * C + j];
        }
      add_grad(dpw.data(), C, PostW);
      add_grad(dpb.data(), C, PostB);
    }
    cpu::for_rows(pool, N, [&](std::size_t n) {
      A* dxh = d_o.as<A>() + n * C;
      for (std::size_t j = 0; j < C; ++j) dxh[j] = dpn.as<A>()[n * C + j] * w[PostW][j];
      cpu::ln_row_backward(xhp.as<A>() + n * C, rsig.as<A>()[n], static_cast<const A*>(dxh), A(0),
                           C, dxh);
    });

    // The inner loop backwards, per (b, h), mini-batches in reverse, reading the stored
    // per-token states.
    tracked dq(alloc, N * C * sizeof(A)), dk(alloc, N * C * sizeof(A)), dv(alloc, N * C * sizeof(A));
    tracked dlr(alloc, N * H * sizeof(A));
    // Per task: the inner state's gradient (linear: dW1, db1; MLP: dW1, db1, dW2, db2), dγ, dβ,
    // dtok.
    const std::size_t EI = Mlp ? E : DD + D;
    const std::size_t pe = EI + 2 * D + MBATCH;
    tracked part(alloc, B * H * pe * sizeof(A));
    const std::size_t per_b =
        Mlp ? MBATCH * E + 5 * E + MBATCH * (4 * F + 2 * D + 1) + 12 * F + 12 * D
            : MBATCH * DD + MBATCH * D * 4 + MBATCH + 4 * DD + 14 * D;
    tracked bscr(alloc, th * per_b * sizeof(A));
    const A* DO = d_o.as<A>();
    pool.parallel_for(B * H, [&](std::size_t task, std::size_t thread) {
      const std::size_t b = task / H, h = task % H;
      if constexpr (Mlp) {
        A* Sst = bscr.as<A>() + thread * per_b;  // [K, E] running sums S_i
        A* R = Sst + MBATCH * E;                 // Σ_{i≥s} −tok_i·dΘ_i
        A* dTi = R + E;                          // dL/dΘ_i
        A* dTn = dTi + E;                        // dL/dΘ_0 of the next mini-batch
        A* dT0 = dTn + E;                        // dL/dΘ_0 of this one
        A* Tin = dT0 + E;                        // the head's initial Θ
        A* z1s = Tin + E;                        // [K, F] z1 of the keys
        A* x2s = z1s + MBATCH * F;               // [K, F] gelu(z1)
        A* es = x2s + MBATCH * F;                // [K, F] W2·g2
        A* g1s = es + MBATCH * F;                // [K, F] ∂ℓ/∂z1
        A* xh2s = g1s + MBATCH * F;              // [K, D] x̂ of z2
        A* g2s = xh2s + MBATCH * D;              // [K, D] ∂ℓ/∂z2
        A* sig2 = g2s + MBATCH * D;              // [K]    σ of z2
        A* zq1 = sig2 + MBATCH;                  // [F] each
        A* xq2 = zq1 + F;
        A* dxq2 = xq2 + F;
        A* dzq1 = dxq2 + F;
        A* kR1 = dzq1 + F;
        A* R2g = kR1 + F;
        A* dg1 = R2g + F;
        A* dx2 = dg1 + F;
        A* de = dx2 + F;
        A* dz1 = de + F;
        A* zq2 = dz1 + F;  // [D] each
        A* xhq = zq2 + D;
        A* rowd = xhq + D;
        A* dzq2 = rowd + D;
        A* R1g = dzq2 + D;
        A* xR2 = R1g + D;
        A* dg2 = xR2 + D;
        A* dz2 = dg2 + D;
        A* res = dz2 + D;
        A* dxh = res + D;
        A* tmp = dxh + D;
        A* pt = part.as<A>() + task * pe;
        A* pgam = pt + E;
        A* pbet = pgam + D;
        A* ptok = pbet + D;
        std::fill(pt, pt + pe, A(0));
        std::fill(dTn, dTn + E, A(0));
        load_inner(w, h, D, F, Tin);
        const A* gamma = w[NormW] + h * D;
        const A* beta = w[NormB] + h * D;
        const A* Tst = wst.as<A>() + task * T * E;
        for (std::size_t m = nmb; m-- > 0;) {
          const std::size_t t0 = m * MBATCH, K = std::min(MBATCH, T - t0);
          const A* T0 = m == 0 ? Tin : Tst + (t0 - 1) * E;
          const A* W1_0 = T0;
          const A* W2_0 = T0 + oW2;
          // Recompute the keys' inner gradients at Θ_0 and the running sums S_i.
          for (std::size_t i = 0; i < K; ++i) {
            const std::size_t row = b * T + t0 + i;
            const A* kr = Kp + row * C + h * D;
            const A* vr = V + row * C + h * D;
            const A lri = LR[row * H + h];
            A* z1 = z1s + i * F;
            A* x2 = x2s + i * F;
            A* ev = es + i * F;
            A* g1 = g1s + i * F;
            A* g2 = g2s + i * D;
            vec_mat(kr, W1_0, T0 + ob1, D, F, z1);
            for (std::size_t f = 0; f < F; ++f) x2[f] = gelu::f(z1[f]);
            vec_mat(x2, W2_0, T0 + ob2, F, D, zq2);  // z2 (zq2 as scratch)
            sig2[i] = inner_grad(zq2, kr, vr, gamma, beta, D, xh2s + i * D, g2);
            mat_vec(W2_0, g2, F, D, ev, false);
            for (std::size_t f = 0; f < F; ++f) g1[f] = ev[f] * gelu::d1(z1[f]);
            A* Si = Sst + i * E;
            const A* Sp = i ? Si - E : nullptr;
            for (std::size_t a = 0; a < D; ++a) {
              const A ka = lri * kr[a];
              for (std::size_t f = 0; f < F; ++f)
                Si[a * F + f] = (Sp ? Sp[a * F + f] : A(0)) + ka * g1[f];
            }
            for (std::size_t f = 0; f < F; ++f)
              Si[ob1 + f] = (Sp ? Sp[ob1 + f] : A(0)) + lri * g1[f];
            for (std::size_t f = 0; f < F; ++f) {
              const A xf = lri * x2[f];
              for (std::size_t c = 0; c < D; ++c)
                Si[oW2 + f * D + c] = (Sp ? Sp[oW2 + f * D + c] : A(0)) + xf * g2[c];
            }
            for (std::size_t c = 0; c < D; ++c)
              Si[ob2 + c] = (Sp ? Sp[ob2 + c] : A(0)) + lri * g2[c];
          }
          std::fill(R, R + E, A(0));
          std::fill(dT0, dT0 + E, A(0));
          for (std::size_t i = K; i-- > 0;) {
            const std::size_t t = t0 + i, row = b * T + t;
            const A* qr = Q + row * C + h * D;
            const A* kr = Kp + row * C + h * D;
            const A* vr = V + row * C + h * D;
            const A* dout = DO + row * C + h * D;
            A* dqr = dq.as<A>() + row * C + h * D;
            A* dkr = dk.as<A>() + row * C + h * D;
            A* dvr = dv.as<A>() + row * C + h * D;
            const A lri = LR[row * H + h];
            const A* Ti = Tst + t * E;
            // out = XQ + γ ⊙ x̂(zq2) + β, zq2 = gelu(XQ·W1_t + b1_t)·W2_t + b2_t
            vec_mat(qr, Ti, Ti + ob1, D, F, zq1);
            for (std::size_t f = 0; f < F; ++f) xq2[f] = gelu::f(zq1[f]);
            vec_mat(xq2, Ti + oW2, Ti + ob2, F, D, zq2);
            const A sgq = mb::cpu::ln_row(zq2, D, ln_eps, xhq);
            for (std::size_t c = 0; c < D; ++c) {
              pgam[c] += dout[c] * xhq[c];
              pbet[c] += dout[c];
              rowd[c] = dout[c] * gamma[c];
            }
            mb::cpu::ln_row_backward(xhq, sgq, static_cast<const A*>(rowd), A(0), D, dzq2);
            mat_vec(Ti + oW2, dzq2, F, D, dxq2, false);
            for (std::size_t f = 0; f < F; ++f) dzq1[f] = dxq2[f] * gelu::d1(zq1[f]);
            mat_vec(Ti, dzq1, D, F, dqr, false);
            for (std::size_t c = 0; c < D; ++c) dqr[c] += dout[c];
            // dΘ_t = (XQ ⊗ dzq1, dzq1, xq2 ⊗ dzq2, dzq2) (+ the next mini-batch's dΘ_0 at the
            // last token)
            const bool last = i + 1 == K;
            for (std::size_t a = 0; a < D; ++a)
              for (std::size_t f = 0; f < F; ++f) dTi[a * F + f] = qr[a] * dzq1[f];
            for (std::size_t f = 0; f < F; ++f) dTi[ob1 + f] = dzq1[f];
            for (std::size_t f = 0; f < F; ++f)
              for (std::size_t c = 0; c < D; ++c) dTi[oW2 + f * D + c] = xq2[f] * dzq2[c];
            for (std::size_t c = 0; c < D; ++c) dTi[ob2 + c] = dzq2[c];
            if (last)
              for (std::size_t e = 0; e < E; ++e) dTi[e] += dTn[e];
            // Θ_t = Θ_0 − tok_t·S_t: dtok_t, dΘ_0 directly, and the suffix sum for the S's.
            const A* Si = Sst + i * E;
            A dt = 0;
            for (std::size_t e = 0; e < E; ++e) dt += Si[e] * dTi[e];
            ptok[i] -= dt;
            for (std::size_t e = 0; e < E; ++e) {
              dT0[e] += dTi[e];
              R[e] -= tok[i] * dTi[e];
            }
            // Token s = t's increments lr_s·(k ⊗ g1, g1, x2 ⊗ g2, g2) enter every S_i with
            // i ≥ s: their adjoint is lr_s·R.
            const A* z1 = z1s + i * F;
            const A* x2 = x2s + i * F;
            const A* ev = es + i * F;
            const A* g1 = g1s + i * F;
            const A* g2 = g2s + i * D;
            mat_vec(R, g1, D, F, R1g, false);             // R1·g1
            vec_mat(kr, R, R + ob1, D, F, kR1);           // kᵀ·R1 + r1
            mat_vec(R + oW2, g2, F, D, R2g, false);       // R2·g2
            vec_mat(x2, R + oW2, R + ob2, F, D, xR2);     // x2ᵀ·R2 + r2
            A dl = 0;
            for (std::size_t a = 0; a < D; ++a) dl += kr[a] * R1g[a];
            for (std::size_t f = 0; f < F; ++f) dl += R[ob1 + f] * g1[f] + x2[f] * R2g[f];
            for (std::size_t c = 0; c < D; ++c) dl += R[ob2 + c] * g2[c];
            dlr.as<A>()[row * H + h] = dl;
            for (std::size_t f = 0; f < F; ++f) {
              dg1[f] = lri * kR1[f];
              dx2[f] = lri * R2g[f];
            }
            for (std::size_t c = 0; c < D; ++c) {
              dg2[c] = lri * xR2[c];
              dkr[c] = lri * R1g[c];
              dvr[c] = 0;
            }
            // g1 = e ⊙ gelu'(z1), e = W2_0·g2: de, dz1 (second derivative), dW2_0, dg2.
            for (std::size_t f = 0; f < F; ++f) {
              de[f] = dg1[f] * gelu::d1(z1[f]);
              dz1[f] = dg1[f] * ev[f] * gelu::d2(z1[f]);
            }
            for (std::size_t f = 0; f < F; ++f)
              for (std::size_t c = 0; c < D; ++c) dT0[oW2 + f * D + c] += de[f] * g2[c];
            vec_mat(de, W2_0, nullptr, F, D, tmp);
            for (std::size_t c = 0; c < D; ++c) dg2[c] += tmp[c];
            // g2 = ∇_z2 ½‖γ x̂ + β − (v − k)‖²: its backward (the inner loss's second order).
            inner_grad_backward(xh2s + i * D, sig2[i], g2, dg2, kr, vr, gamma, beta, D, res, dxh,
                                pgam, pbet, dkr, dvr, dz2);
            // z2 = x2·W2_0 + b2_0, x2 = gelu(z1), z1 = XK·W1_0 + b1_0
            mat_vec(W2_0, dz2, F, D, dx2, true);
            for (std::size_t f = 0; f < F; ++f)
              for (std::size_t c = 0; c < D; ++c) dT0[oW2 + f * D + c] += x2[f] * dz2[c];
            for (std::size_t c = 0; c < D; ++c) dT0[ob2 + c] += dz2[c];
            for (std::size_t f = 0; f < F; ++f) dz1[f] += dx2[f] * gelu::d1(z1[f]);
            mat_vec(W1_0, dz1, D, F, dkr, true);
            for (std::size_t a = 0; a < D; ++a)
              for (std::size_t f = 0; f < F; ++f) dT0[a * F + f] += kr[a] * dz1[f];
            for (std::size_t f = 0; f < F; ++f) dT0[ob1 + f] += dz1[f];
          }
          std::copy(dT0, dT0 + E, dTn);
        }
        std::copy(dTn, dTn + E, pt);
        return;
      }
      A* Sst = bscr.as<A>() + thread * per_b;  // [K, D, D] running sums S_i
      A* sst = Sst + MBATCH * DD;              // [K, D]
      A* xh1 = sst + MBATCH * D;               // [K, D] x̂ of Z1
      A* gm = xh1 + MBATCH * D;                // [K, D] inner gradients g_s
      A* sig1 = gm + MBATCH * D;               // [K]
      A* R = sig1 + MBATCH;                    // [D, D] Σ_{i≥s} −tok_i·dW_i
      A* dWi = R + DD;
      A* dWn = dWi + DD;                       // dL/dW_0 of the next mini-batch
      A* dW0 = dWn + DD;                       // dL/dW_0 of this one
      A* r = dW0 + DD;
      A* dwi = r + D;
      A* dwn = dwi + D;
      A* dw0 = dwn + D;
      A* z = dw0 + D;
      A* xhb = z + D;
      A* rowd = xhb + D;
      A* dzb = rowd + D;
      A* Rg = dzb + D;
      A* Rtk = Rg + D;
      A* dg = Rtk + D;
      A* res = dg + D;
      A* dxh = res + D;
      A* dz1 = dxh + D;
      A* pt = part.as<A>() + task * pe;
      A* pW1 = pt;
      A* pb1 = pW1 + DD;
      A* pgam = pb1 + D;
      A* pbet = pgam + D;
      A* ptok = pbet + D;
      std::fill(pt, pt + pe, A(0));
      std::fill(dWn, dWn + DD, A(0));
      std::fill(dwn, dwn + D, A(0));
      const A* gamma = w[NormW] + h * D;
      const A* beta = w[NormB] + h * D;
      const A* Wst = wst.as<A>() + task * T * DD;
      const A* bsv = bst.as<A>() + task * T * D;
      for (std::size_t m = nmb; m-- > 0;) {
        const std::size_t t0 = m * MBATCH, K = std::min(MBATCH, T - t0);
        const A* W0 = m == 0 ? w[W1] + h * DD : Wst + (t0 - 1) * DD;
        const A* w0 = m == 0 ? w[B1] + h * D : bsv + (t0 - 1) * D;
        // Recompute the inner gradients at W_0 and the running sums S_i, s_i.
        for (std::size_t i = 0; i < K; ++i) {
          const std::size_t row = b * T + t0 + i;
          const A* kr = Kp + row * C + h * D;
          const A* vr = V + row * C + h * D;
          const A lri = LR[row * H + h];
          vec_mat(kr, W0, w0, D, D, z);
          sig1[i] = inner_grad(z, kr, vr, gamma, beta, D, xh1 + i * D, gm + i * D);
          A* Si = Sst + i * DD;
          A* si = sst + i * D;
          const A* gi = gm + i * D;
          for (std::size_t a = 0; a < D; ++a) {
            const A ka = lri * kr[a];
            for (std::size_t c = 0; c < D; ++c)
              Si[a * D + c] = (i ? Si[a * D + c - DD] : A(0)) + ka * gi[c];
          }
          for (std::size_t c = 0; c < D; ++c) si[c] = (i ? si[c - D] : A(0)) + lri * gi[c];
        }
        std::fill(R, R + DD, A(0));
        std::fill(r, r + D, A(0));
        std::fill(dW0, dW0 + DD, A(0));
        std::fill(dw0, dw0 + D, A(0));
        for (std::size_t i = K; i-- > 0;) {
          const std::size_t t = t0 + i, row = b * T + t;
          const A* qr = Q + row * C + h * D;
          const A* kr = Kp + row * C + h * D;
          const A* vr = V + row * C + h * D;
          const A* dout = DO + row * C + h * D;
          A* dqr = dq.as<A>() + row * C + h * D;
          A* dkr = dk.as<A>() + row * C + h * D;
          A* dvr = dv.as<A>() + row * C + h * D;
          const A lri = LR[row * H + h];
          const A* Wi = Wst + t * DD;
          const A* wi = bsv + t * D;
          // out = XQ + γ ⊙ x̂(Zbar) + β, Zbar = XQ·W_t + w_t
          vec_mat(qr, Wi, wi, D, D, z);
          const A sgb = mb::cpu::ln_row(z, D, ln_eps, xhb);
          for (std::size_t c = 0; c < D; ++c) {
            pgam[c] += dout[c] * xhb[c];
            pbet[c] += dout[c];
            rowd[c] = dout[c] * gamma[c];
          }
          mb::cpu::ln_row_backward(xhb, sgb, static_cast<const A*>(rowd), A(0), D, dzb);
          mat_vec(Wi, dzb, D, D, dqr, false);
          for (std::size_t c = 0; c < D; ++c) dqr[c] += dout[c];
          // dW_t = XQ_tᵀ·dZbar_t (+ the next mini-batch's dW_0 at the last token)
          const bool last = i + 1 == K;
          for (std::size_t a = 0; a < D; ++a)
            for (std::size_t c = 0; c < D; ++c)
              dWi[a * D + c] = qr[a] * dzb[c] + (last ? dWn[a * D + c] : A(0));
          for (std::size_t c = 0; c < D; ++c) dwi[c] = dzb[c] + (last ? dwn[c] : A(0));
          // W_t = W_0 − tok_t·S_t: dtok_t, dW_0 directly, and the suffix sum for the S's.
          const A* Si = Sst + i * DD;
          const A* si = sst + i * D;
          A dt = 0;
          for (std::size_t e = 0; e < DD; ++e) dt += Si[e] * dWi[e];
          for (std::size_t c = 0; c < D; ++c) dt += si[c] * dwi[c];
          ptok[i] -= dt;
          for (std::size_t e = 0; e < DD; ++e) {
            dW0[e] += dWi[e];
            R[e] -= tok[i] * dWi[e];
          }
          for (std::size_t c = 0; c < D; ++c) {
            dw0[c] += dwi[c];
            r[c] -= tok[i] * dwi[c];
          }
          // Token s = t's gradient k_s ⊗ g_s (and g_s for w) enters every S_i with i ≥ s, with
          // weight lr_s: its adjoint is lr_s·R (lr_s·r).
          const A* gs = gm + i * D;
          mat_vec(R, gs, D, D, Rg, false);   // R·g
          vec_mat(kr, R, r, D, D, Rtk);      // kᵀ·R + r
          A dl = 0;
          for (std::size_t a = 0; a < D; ++a) dl += kr[a] * Rg[a];
          for (std::size_t c = 0; c < D; ++c) dl += r[c] * gs[c];
          dlr.as<A>()[row * H + h] = dl;
          for (std::size_t c = 0; c < D; ++c) {
            dg[c] = lri * Rtk[c];
            dkr[c] = lri * Rg[c];
            dvr[c] = 0;
          }
          // g = ∇_Z1 ½‖γ x̂ + β − (v − k)‖²: its backward (the inner loss's second order).
          inner_grad_backward(xh1 + i * D, sig1[i], gs, dg, kr, vr, gamma, beta, D, res, dxh, pgam,
                              pbet, dkr, dvr, dz1);
          // Z1 = XK·W_0 + w_0
          mat_vec(W0, dz1, D, D, dkr, true);
          for (std::size_t a = 0; a < D; ++a)
            for (std::size_t c = 0; c < D; ++c) dW0[a * D + c] += kr[a] * dz1[c];
          for (std::size_t c = 0; c < D; ++c) dw0[c] += dz1[c];
        }
        std::copy(dW0, dW0 + DD, dWn);
        std::copy(dw0, dw0 + D, dwn);
      }
      std::copy(dWn, dWn + DD, pW1);
      std::copy(dwn, dwn + D, pb1);
    });

    // Per-(b, h) partials: the inner state (W1, b1, and W2, b2 for the MLP), γ, β per head
    // (summed over the batch), token offsets over all.
    {
      std::vector<A> gw1(H * D * F, A(0)), gb1(H * F, A(0)), gw2(Mlp ? H * F * D : 0, A(0)),
          gb2(Mlp ? H * D : 0, A(0)), gga(H * D, A(0)), gbe(H * D, A(0)), gtok(MBATCH, A(0));
      for (std::size_t task = 0; task < B * H; ++task) {
        const std::size_t h = task % H;
        const A* pt = part.as<A>() + task * pe;
        for (std::size_t e = 0; e < D * F; ++e) gw1[h * D * F + e] += pt[e];
        for (std::size_t f = 0; f < F; ++f) gb1[h * F + f] += pt[ob1 + f];
        if constexpr (Mlp) {
          for (std::size_t e = 0; e < F * D; ++e) gw2[h * F * D + e] += pt[oW2 + e];
          for (std::size_t c = 0; c < D; ++c) gb2[h * D + c] += pt[ob2 + c];
        }
        for (std::size_t c = 0; c < D; ++c) {
          gga[h * D + c] += pt[EI + c];
          gbe[h * D + c] += pt[EI + D + c];
        }
        for (std::size_t i = 0; i < MBATCH; ++i) gtok[i] += pt[EI + 2 * D + i];
      }
      for (std::size_t i = 0; i < MBATCH; ++i)
        if (!(A(1) / static_cast<A>(i + 1) + w[Tok][i] > A(0))) gtok[i] = 0;  // clamp_min
      add_grad(gw1.data(), H * D * F, W1);
      add_grad(gb1.data(), H * F, B1);
      if constexpr (Mlp) {
        add_grad(gw2.data(), H * F * D, W2);
        add_grad(gb2.data(), H * D, B2);
      }
      add_grad(gga.data(), H * D, NormW);
      add_grad(gbe.data(), H * D, NormB);
      add_grad(gtok.data(), MBATCH, Tok);
    }
    // The rate gate: lr = base·σ(pre)/D, dpre = dlr·lr·(1 − σ).
    tracked dxa(alloc, N * C * sizeof(A));
    {
      A* dpre = dlr.as<A>();
      for (std::size_t e = 0; e < N * H; ++e) dpre[e] *= lr.as<A>()[e] * (A(1) - sig.as<A>()[e]);
      cpu::matmul_at(pool, static_cast<const A*>(dpre), xa, wtmp.as<A>(), N, H, C, false);
      add_grad(wtmp.as<A>(), H * C, LrW);
      std::vector<A> glb(H, A(0));
      for (std::size_t n = 0; n < N; ++n)
        for (std::size_t h = 0; h < H; ++h) glb[h] += dpre[n * H + h];
      add_grad(glb.data(), H, LrB);
      cpu::matmul(pool, static_cast<const A*>(dpre), w[LrW], dxa.as<A>(), N, H, C, false);
    }
    // RoPE's transpose, the projections' weight gradients, dx.
    cpu::rope_pairs(pool, dq.as<A>(), N, T, H, D, s.rope_base, MBATCH, true);
    cpu::rope_pairs(pool, dk.as<A>(), N, T, H, D, s.rope_base, MBATCH, true);
    const std::pair<const A*, int> proj[] = {{dq.as<A>(), Wq}, {dk.as<A>(), Wk}, {dv.as<A>(), Wv}};
    for (const auto& [d, which] : proj) {
      cpu::matmul_at(pool, xa, d, wtmp.as<A>(), N, C, C, false);
      add_grad(wtmp.as<A>(), C * C, which);
      cpu::matmul_bt(pool, d, w[which], dxa.as<A>(), N, C, C, true);
    }
    cpu::narrow(static_cast<const A*>(dxa.as<A>()), N * C, io.dx.data());
    return alloc.stats().peak_requested;
  }
};

// ---- The check on the naive layer -------------------------------------------------------------
double rel_err(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(got[i]) - want[i]));
    scale = std::max(scale, std::abs(static_cast<double>(want[i])));
  }
  const double e = scale > 0 ? diff / scale : diff;
  return e == e ? e : INFINITY;
}

// Ours (fp32, G = 4) and the naive layer on one shape: y, dx and every parameter gradient.
// Both fp32 with different summation orders on O(1) values; 1e-4 relative (to each tensor's
// largest element) is ~100x their rounding, and a missing term or wrong sign is O(1e-2) or more.
template <bool Mlp>
bool check_naive(mb::thread_pool& pool) {
  mb::ttt_shape s;
  s.batch = 1;
  s.seq = 256;
  s.width = 512;
  s.heads = 8;
  using layer = mb::basic_ttt<Mlp, mb::fp32_precision, mb::ttt_state_groups<4>>;
  layer_io<float> a(s, Mlp), b(s, Mlp);
  ours<layer>::run(s, a, true, pool);
  naive<float, Mlp>::run(s, b, true, pool);
  double worst = std::max(rel_err(b.y, a.y), rel_err(b.dx, a.dx));
  std::printf("check %s: naive vs ours (fp32, T=%zu C=%zu H=%zu, G=4), max|naive - ours| / "
              "max|ours|: y %.1e, dx %.1e",
              Mlp ? "TTT-MLP" : "TTT-Linear", s.seq, s.width, s.heads, rel_err(b.y, a.y),
              rel_err(b.dx, a.dx));
  for (int i = 0; i < n_w; ++i) {
    if (a.g[i].empty()) continue;
    const double e = rel_err(b.g[i], a.g[i]);
    worst = std::max(worst, e);
    std::printf(", %s %.1e", w_names[i], e);
  }
  const bool ok = worst <= 1e-4;
  std::printf("\ncheck %s: %s (tolerance 1e-4)\n", Mlp ? "TTT-MLP" : "TTT-Linear",
              ok ? "ok" : "FAIL");
  return ok;
}

// ---- The table -------------------------------------------------------------------------------
struct options {
  std::size_t threads = mb::thread_pool::default_threads();
  int reps = 3;
  std::size_t max_seq = 4096;
  bool quick = false;
};

template <typename F>
double time_ms(F&& f) {
  const auto t0 = clock_type::now();
  f();
  return std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
}

// MemAvailable from /proc/meminfo, in bytes (0 if unreadable).
std::size_t mem_available() {
  std::FILE* f = std::fopen("/proc/meminfo", "r");
  if (!f) return 0;
  char line[256];
  std::size_t kb = 0;
  while (std::fgets(line, sizeof line, f)) {
    if (std::sscanf(line, "MemAvailable: %zu kB", &kb) == 1) break;
  }
  std::fclose(f);
  return kb * 1024;
}

// The naive layer's per-token states for forward+backward: B·H·T·(D² + D) (linear) or
// B·H·T·(2·D·F + F + D) (MLP) fp32, the bulk of its memory.
std::size_t naive_state_bytes(const mb::ttt_shape& s, bool mlp) {
  const std::size_t D = s.head_dim(), F = mlp ? 4 * D : D;
  return s.batch * s.heads * s.seq * (mlp ? 2 * D * F + F + D : D * D + D) * sizeof(float);
}

// One table's rows: TTT-Linear (Mlp = false) or TTT-MLP, ours under G = 1, 4, all and the naive
// layer. The naive fwd+bwd is skipped ("-") when its per-token states would take more than half
// of MemAvailable (the machine is shared).
template <typename Prec, bool Mlp>
void rows(const char* precision_name, const options& opt, mb::thread_pool& pool) {
  using S = typename Prec::storage_type;
  using g1 = mb::basic_ttt<Mlp, Prec, mb::ttt_mini_batch<MBATCH>, mb::ttt_state_groups<1>>;
  using g4 = mb::basic_ttt<Mlp, Prec, mb::ttt_mini_batch<MBATCH>, mb::ttt_state_groups<4>>;
  using gall = mb::basic_ttt<Mlp, Prec, mb::ttt_mini_batch<MBATCH>, mb::ttt_state_groups_all>;
  using nv = naive<S, Mlp>;
  for (std::size_t T : {std::size_t{1024}, std::size_t{4096}}) {
    if (T > opt.max_seq || (opt.quick && T > 1024)) continue;
    mb::ttt_shape s;
    s.batch = 1;
    s.seq = T;
    s.width = 512;
    s.heads = 8;
    layer_io<S> io(s, Mlp);
    for (bool bwd : {false, true}) {
      const bool run_naive = !bwd || naive_state_bytes(s, Mlp) <= mem_available() / 2;
      // Warm-up (first touch of every page; the peaks), then alternate so all see the same machine.
      std::size_t peak[3];
      peak[0] = ours<g1>::run(s, io, bwd, pool);
      peak[1] = ours<g4>::run(s, io, bwd, pool);
      peak[2] = ours<gall>::run(s, io, bwd, pool);
      const std::size_t naive_peak = run_naive ? nv::run(s, io, bwd, pool) : 0;
      double t[3] = {1e300, 1e300, 1e300}, tn = 1e300;
      for (int r = 0; r < opt.reps; ++r) {
        t[0] = std::min(t[0], time_ms([&] { ours<g1>::run(s, io, bwd, pool); }));
        t[1] = std::min(t[1], time_ms([&] { ours<g4>::run(s, io, bwd, pool); }));
        t[2] = std::min(t[2], time_ms([&] { ours<gall>::run(s, io, bwd, pool); }));
        if (run_naive) tn = std::min(tn, time_ms([&] { nv::run(s, io, bwd, pool); }));
        io.zero_grads();  // values do not matter here; keep them bounded
      }
      const char* gname[3] = {"1", "4", "all"};
      const std::size_t saved[3] = {g1::saved_bytes(s), g4::saved_bytes(s), gall::saved_bytes(s)};
      const std::size_t ckpt[3] = {g1::saved_state_bytes(s), g4::saved_state_bytes(s),
                                   gall::saved_state_bytes(s)};
      for (int i = 0; i < 3; ++i) {
        std::printf("| %4zu | %-4s | %3s | %-7s | %8.1f | %8.0f | ", T, precision_name, gname[i],
                    bwd ? "fwd+bwd" : "fwd", t[i], double(s.batch * T) / (t[i] * 1e-3));
        if (run_naive) std::printf("%9.1f | %7.2f | ", tn, tn / t[i]);
        else std::printf("%9s | %7s | ", "-", "-");
        std::printf("%8.1f | %9.2f | %8.2f | ", double(peak[i]) / MiB, double(saved[i]) / MiB,
                    double(ckpt[i]) / MiB);
        if (run_naive) std::printf("%9.1f |\n", double(naive_peak) / MiB);
        else std::printf("%9s |\n", "-");
      }
      if (!run_naive) {
        std::printf("(naive fwd+bwd skipped at T=%zu: its per-token states, %.0f MiB, exceed half "
                    "of MemAvailable, %.0f MiB)\n",
                    T, double(naive_state_bytes(s, Mlp)) / MiB, double(mem_available()) / MiB);
      }
      std::fflush(stdout);
    }
  }
}

}  // namespace

static int bench_main(int argc, char** argv) {
  options opt;
  bench_flags::args a(argc, argv,
                      "usage: bench_ttt [--threads N] [--reps N] [--max-seq T] [--quick]\n"
                      "  TTT-Linear and TTT-MLP layers vs the naive primal paths; see the header of bench_ttt.cpp");
  while (a.next()) {
    if (a.is("--threads")) opt.threads = static_cast<std::size_t>(a.whole(1, 1024));
    else if (a.is("--reps")) opt.reps = static_cast<int>(a.whole(1, 1000000));
    else if (a.is("--max-seq")) opt.max_seq = static_cast<std::size_t>(a.whole(1, std::size_t{1} << 20));
    else if (a.is("--quick")) opt.quick = true;
    else a.unknown();
  }
  mb::thread_pool pool(opt.threads);
  std::printf("TTT-Linear and TTT-MLP: B=1 C=512 H=8 D=64 b=%zu, no gate; %zu threads, best of "
              "%d\n",
              MBATCH, opt.threads, opt.reps);
  const bool ok_linear = check_naive<false>(pool);
  const bool ok_mlp = check_naive<true>(pool);
  const char* header =
      "| T | prec | G | pass | ms | tok/s | naive ms | x naive | peak MiB | saved MiB | ckpt MiB | "
      "naive MiB |\n|--:|---|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|\n";
  std::printf("\nTTT-Linear. naive = primal form in fp32, per-token W_t [D, D] materialized; fwd: "
              "one mini-batch of W_t per thread; fwd+bwd: every W_t kept for its hand-written "
              "backward\n\n%s",
              header);
  rows<mb::fp32_precision, false>("fp32", opt, pool);
  rows<mb::bf16_precision, false>("bf16", opt, pool);
  std::printf("\nTTT-MLP (F = 4·D). naive = primal form in fp32, per-token W1_t [D, F], b1_t, "
              "W2_t [F, D], b2_t materialized; fwd: one mini-batch of them per thread; fwd+bwd: "
              "every one kept for its hand-written backward\n\n%s",
              header);
  rows<mb::fp32_precision, true>("fp32", opt, pool);
  rows<mb::bf16_precision, true>("bf16", opt, pool);
  return ok_linear && ok_mlp ? 0 : 1;
}

// Any error, a flag's or the library's, is one `error:` line and exit 1.
int main(int argc, char** argv) {
  return bench_flags::run([&] { return bench_main(argc, argv); });
}
