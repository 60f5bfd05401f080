// CPU kernels of the Mamba block: the causal depthwise convolution, softplus/SiLU, and the
// chunked selective scan forward and backward. Everything works in the accumulator type A on
// buffers carved from the caller's saved bytes (by layers/mamba.hpp) and workspace (by
// backend_kernels<cpu_backend, mamba_shape> below); nothing allocates.
//
// Layouts (row-major, n = b·T + t): xz [N, 2·Di] (x half, then z half); c, u, Δ, y [N, Di];
// x_dbl [N, R + 2·Ns] (dt_low, B, C); A = −exp(A_log) and dA [Di, Ns]; saved chunk states
// [B, chunks − 1, Di, Ns] (the state entering every chunk but the first, which starts at 0).
//
// The scan runs one task per block of scan_channels channels (a fixed partition, so results do
// not depend on the thread count), each sweeping every batch row and time step in order. Inside a
// task the state is held as [group of scan_lanes channels][d_state][lane], so the update runs
// across channels in vector registers (exp included, vmath::exp), with no horizontal sums.
#pragma once

#include <algorithm>
#include <cmath>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <type_traits>

#include "membound/backend/cpu/gemm.hpp"
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/core/parallel.hpp"
#include "membound/memory/workspace.hpp"
#include "membound/policy/backend.hpp"
#include "membound/shape/mamba_shape.hpp"

MEMBOUND_NAMESPACE_BEGIN

namespace cpu {

// Channels per scan task.
inline constexpr std::size_t scan_channels = 64;
// The largest d_state (a bound the checks enforce; the kernels themselves take any).
inline constexpr std::size_t max_d_state = 256;
// Channels per vector group: one 64-byte row of accumulators (16 floats, 8 doubles): one AVX-512
// register, two AVX2 ones, four SSE ones. The scan keeps its state as [d_state][lanes] per group,
// so every operation is a vertical one across channels (no horizontal sums in the forward).
template <typename A>
inline constexpr std::size_t scan_lanes = 64 / sizeof(A);
inline constexpr std::size_t max_scan_lanes = 16;  // scan_lanes<float>: sizes the scratch

constexpr std::size_t scan_chunks(std::size_t T, std::size_t L) noexcept { return blocks(T, L); }

// Accumulator elements of per-thread scratch. Forward: the block's state and A (transposed to
// [group][d_state][lanes]) and padded rows for a partial last group. Backward: the states of a
// whole chunk plus its entry state (recomputed from the saved one), the running dL/dh, A and the
// dA sums, lane sums of dB and dC, the dD sums and padded rows.
constexpr std::size_t scan_forward_scratch(std::size_t d_state) noexcept {
  return 2 * scan_channels * d_state + 4 * max_scan_lanes;
}
// Packed sequences add one zero group state: the state before a sequence's first token.
constexpr std::size_t scan_backward_scratch(std::size_t chunk, std::size_t d_state,
                                            bool packed = false) noexcept {
  return (chunk + 4) * scan_channels * d_state + 2 * d_state * max_scan_lanes + scan_channels +
         8 * max_scan_lanes + (packed ? d_state * max_scan_lanes : 0);
}

template <typename A>
using vec_map = Eigen::Map<Eigen::Array<A, Eigen::Dynamic, 1>>;
template <typename A>
vec_map<A> vec(A* p, std::size_t n) {
  return vec_map<A>(p, static_cast<Eigen::Index>(n));
}
template <typename A>
A sigmoid(A v) {
  return A(1) / (A(1) + std::exp(-v));
}
template <typename A>
A silu(A v) {
  return v * sigmoid(v);
}
template <typename A>
A silu_grad(A v) {  // d/dv v·σ(v) = σ(v)·(1 + v·(1 − σ(v)))
  const A s = sigmoid(v);
  return s * (A(1) + v * (A(1) - s));
}
template <typename A>
A softplus(A v) {  // log(1 + e^v) without overflow for large v
  return v > A(0) ? v + std::log1p(std::exp(-v)) : std::log1p(std::exp(v));
}

// Branch-free elementary functions written as plain arithmetic (selects, integer bit casts), so
// that a loop calling them is vectorized by the compiler for whatever -march it builds with; the
// scalar std:: versions above are not (libm calls). Accuracy ~1–2 ulp.
namespace vmath {
// e^x: x = n·ln2 + r, |r| <= ln2/2 (Cody–Waite split of ln2), e^r by a polynomial (Cephes' for
// float, Taylor to r^13 for double: truncation < 5e-18), 2^n built in the exponent bits. Inputs
// above the clamp return e^clamp (finite; only σ of very negative values sees them), below the
// underflow clamp 0.
template <typename A>
inline A exp(A x) {
  if constexpr (std::is_same_v<A, float>) {
    constexpr float hi = 88.0f, lo = -87.33654f, magic = 12582912.0f;  // 1.5·2^23
    const float xc = x > hi ? hi : (x < lo ? lo : x);
    const float t = xc * 1.44269504088896341f + magic;  // round(x·log2 e) in the low bits
    const float n = t - magic;
    const std::int32_t ni = std::bit_cast<std::int32_t>(t) - std::bit_cast<std::int32_t>(magic);
    float r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const float v = p * std::bit_cast<float>((ni + 127) << 23);
    return x < lo ? 0.0f : v;
  } else {
    static_assert(std::is_same_v<A, double>, "membound: vmath::exp takes float or double");
    constexpr double hi = 709.0, lo = -708.39, magic = 6755399441055744.0;  // 1.5·2^52
    const double xc = x > hi ? hi : (x < lo ? lo : x);
    const double t = xc * 1.4426950408889634074 + magic;
    const double n = t - magic;
    const std::int64_t ni = std::bit_cast<std::int64_t>(t) - std::bit_cast<std::int64_t>(magic);
    double r = xc - n * 6.93145751953125e-1;
    r = r - n * 1.42860682030941723212e-6;
    double p = 1.0 / 6227020800.0;  // 1/13!
    p = p * r + 1.0 / 479001600.0;
    p = p * r + 1.0 / 39916800.0;
    p = p * r + 1.0 / 3628800.0;
    p = p * r + 1.0 / 362880.0;
    p = p * r + 1.0 / 40320.0;
    p = p * r + 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * (r * r) + r + 1.0;
    const double v = p * std::bit_cast<double>((ni + 1023) << 52);
    return x < lo ? 0.0 : v;
  }
}
// log(1 + e) for e in [0, 1] (softplus' argument). float: 1 + e = 2^k·m, m in [√½, √2],
// log m = 2·atanh(s), s = (m − 1)/(m + 1), |s| <= 0.172, odd series to s^9, plus the rounding
// of 1 + e (c/m). double: std::log1p (fp64 is not the speed target; it stays libm-exact).
template <typename A>
inline A log1p_unit(A e) {
  if constexpr (std::is_same_v<A, float>) {
    const float m0 = 1.0f + e;
    const float c0 = e - (m0 - 1.0f);  // what the rounding of 1 + e lost (exact)
    const bool big = m0 > 1.41421356f;
    const float m = big ? m0 * 0.5f : m0, c = big ? c0 * 0.5f : c0, k = big ? 1.0f : 0.0f;
    const float f = m - 1.0f;  // exact
    const float s = f / (2.0f + f), z = s * s;
    const float q = z * (0.33333333f + z * (0.2f + z * (0.14285715f + z * 0.11111111f)));
    return k * 0.693147180559945f + (2.0f * s + 2.0f * s * q + c / m);
  } else {
    return std::log1p(e);
  }
}
template <typename A>
inline A sigmoid(A v) {
  return A(1) / (A(1) + vmath::exp(-v));
}
template <typename A>
inline A silu(A v) {
  return v * vmath::sigmoid(v);
}
template <typename A>
inline A silu_grad(A v) {
  const A s = vmath::sigmoid(v);
  return s * (A(1) + v * (A(1) - s));
}
template <typename A>
inline A softplus(A v) {  // max(v, 0) + log(1 + e^−|v|): no overflow
  const A a = v < A(0) ? -v : v;
  return (v > A(0) ? v : A(0)) + vmath::log1p_unit(vmath::exp(-a));
}
}  // namespace vmath

// Rounds A values through storage S in place: a value that forward stores is used as stored, so
// backward's recomputation and the kept copy agree bit for bit. A no-op when S is A.
template <typename S, typename A>
void round_through(A* p, std::size_t n) {
  if constexpr (!std::is_same_v<S, A>) {
    for (std::size_t i = 0; i < n; ++i) p[i] = to_accum<A>(from_accum<S>(p[i]));
  } else {
    (void)p;
    (void)n;
  }
}

// One 64-byte register of lanes (GCC/Clang vector extensions; the compiler lowers it to what
// -march has: one AVX-512 register, two AVX2, four SSE). Held in a variable, an accumulator stays
// in registers across the state loop (a plain array would round-trip through memory every state,
// a store-to-load chain that costs more than the exp). Without the extensions the kernels below
// fall back to plain loops over the lanes; so do translation units compiled by nvcc, whose
// front end (cudafe++, CUDA 13.0) crashes on this code.
#if defined(__GNUC__) && !defined(__CUDACC__) && !defined(MEMBOUND_SCAN_NO_VECTOR_EXT)
#define MEMBOUND_SCAN_VECTOR_EXT 1
template <typename A>
struct lanes;
template <>
struct lanes<float> {
  typedef float v __attribute__((vector_size(64)));
  typedef std::int32_t m __attribute__((vector_size(64)));
};
template <>
struct lanes<double> {
  typedef double v __attribute__((vector_size(64)));
  typedef std::int64_t m __attribute__((vector_size(64)));
};
template <typename A>
using vreg = typename lanes<A>::v;
template <typename A>
using vmask = typename lanes<A>::m;
// Vectors go in and out by reference only: passing a 64-byte vector by value has a different ABI
// with and without AVX-512 (GCC and Clang warn, -Wpsabi), and these are inlined anyway.
template <typename A>
[[gnu::always_inline]] inline void vload(vreg<A>& v, const A* p) {
  std::memcpy(&v, p, sizeof v);
}
template <typename A>
[[gnu::always_inline]] inline void vstore(A* p, const vreg<A>& v) {
  std::memcpy(p, &v, sizeof v);
}
// x = m ? a : x, lane by lane (m: all ones or zero per lane, as comparisons give).
template <typename A>
[[gnu::always_inline]] inline void vblend(vreg<A>& x, const vmask<A>& m, const vreg<A>& a) {
  x = (vreg<A>)((m & (vmask<A>)a) | (~m & (vmask<A>)x));
}
// x = vmath::exp(x) lane by lane: the same constants and steps. The scan's arguments Δ·a are
// never positive (Δ = softplus(·) >= 0, a = −exp(A_log) < 0): `nonpositive` skips the upper clamp.
template <typename A, bool nonpositive = false>
[[gnu::always_inline]] inline void vexp(vreg<A>& x) {
  using V = vreg<A>;
  using M = vmask<A>;
  if constexpr (std::is_same_v<A, float>) {
    const V hi = V{} + 88.0f, lo = V{} + -87.33654f, magic = V{} + 12582912.0f;
    const M under = x < lo;
    V xc = x;
    if constexpr (!nonpositive) vblend<A>(xc, xc > hi, hi);
    vblend<A>(xc, under, lo);
    const V t = xc * 1.44269504088896341f + magic;
    const V n = t - magic;
    const M ni = (M)t - (M)magic;
    V r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    V p = V{} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    x = p * (V)((ni + 127) << 23);
    vblend<A>(x, under, V{});
  } else {
    const V hi = V{} + 709.0, lo = V{} + -708.39, magic = V{} + 6755399441055744.0;
    const M under = x < lo;
    V xc = x;
    if constexpr (!nonpositive) vblend<A>(xc, xc > hi, hi);
    vblend<A>(xc, under, lo);
    const V t = xc * 1.4426950408889634074 + magic;
    const V n = t - magic;
    const M ni = (M)t - (M)magic;
    V r = xc - n * 6.93145751953125e-1;
    r = r - n * 1.42860682030941723212e-6;
    V p = V{} + 1.0 / 6227020800.0;
    p = p * r + 1.0 / 479001600.0;
    p = p * r + 1.0 / 39916800.0;
    p = p * r + 1.0 / 3628800.0;
    p = p * r + 1.0 / 362880.0;
    p = p * r + 1.0 / 40320.0;
    p = p * r + 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * (r * r) + r + 1.0;
    x = p * (V)((ni + 1023) << 52);
    vblend<A>(x, under, V{});
  }
}
#endif

// The two group kernels have two bodies (vector extensions, or plain loops under nvcc): each
// lives in its own inline namespace, so a program linking a g++ and an nvcc translation unit gets
// two distinct functions instead of one name with two definitions (an ODR violation).
#ifdef MEMBOUND_SCAN_VECTOR_EXT
inline namespace scan_vector_ext {
#else
inline namespace scan_plain_loops {
#endif

// One step of one group of W = scan_lanes<A> channels: for every state s,
//   h[s][w] = exp(Δ[w]·a[s][w])·h[s][w] + Δ[w]·u[w]·B[s],  y[w] = Σ_s C[s]·h[s][w] + D[w]·u[w]
// (the sum in state order), vectorized across the channels. The forward, the backward's
// recomputation and decoding all call this one out-of-line function, so they run the same
// instructions and agree bit for bit.
template <typename A>
[[gnu::noinline]] void scan_group_step(A* __restrict h, const A* __restrict at,
                                       const A* __restrict d, const A* __restrict u,
                                       const A* __restrict dskip, const A* __restrict b,
                                       const A* __restrict c, std::size_t ns,
                                       A* __restrict y) {
  constexpr std::size_t W = scan_lanes<A>;
#ifdef MEMBOUND_SCAN_VECTOR_EXT
  vreg<A> dv, uv, dsk, acc{};
  vload(dv, d);
  vload(uv, u);
  vload(dsk, dskip);
  const vreg<A> du = dv * uv;
  for (std::size_t s = 0; s < ns; ++s) {
    vreg<A> e, hs;
    vload(e, at + s * W);
    vload(hs, h + s * W);
    e *= dv;
    vexp<A, true>(e);
    const vreg<A> v = e * hs + du * b[s];
    vstore(h + s * W, v);
    acc += c[s] * v;
  }
  vstore(y, vreg<A>(acc + dsk * uv));
#else
  A du[W], acc[W];
  for (std::size_t w = 0; w < W; ++w) {
    du[w] = d[w] * u[w];
    acc[w] = A(0);
  }
  for (std::size_t s = 0; s < ns; ++s) {
    A* __restrict hs = h + s * W;
    const A* __restrict as = at + s * W;
    const A bs = b[s], cs = c[s];
    for (std::size_t w = 0; w < W; ++w) {
      const A v = vmath::exp(as[w] * d[w]) * hs[w] + du[w] * bs;
      hs[w] = v;
      acc[w] += cs * v;
    }
  }
  for (std::size_t w = 0; w < W; ++w) y[w] = acc[w] + dskip[w] * u[w];
#endif
}

// One reverse step of one group: with dL/dy g, u, Δ, D on the lanes, the group's state after
// (h) and before (hp) the step, A (at), B and C of the row; updates the running dL/dh (dh), the
// dA sums (da), the dB and dC lane sums (pb, pc) and the dD lane sums (ddv); writes dΔ and du.
template <typename A>
[[gnu::noinline]] void scan_group_back_step(
    const A* __restrict g, const A* __restrict u, const A* __restrict d,
    const A* __restrict dskip, const A* __restrict h, const A* __restrict hp,
    const A* __restrict at, const A* __restrict b, const A* __restrict c, std::size_t ns,
    A* __restrict dh, A* __restrict da, A* __restrict pb, A* __restrict pc, A* __restrict ddv,
    A* __restrict ddelta, A* __restrict du) {
  constexpr std::size_t W = scan_lanes<A>;
#ifdef MEMBOUND_SCAN_VECTOR_EXT
  vreg<A> gv, uv, dv, dsk, dd, ddt{}, dub{};
  vload(gv, g);
  vload(uv, u);
  vload(dv, d);
  vload(dsk, dskip);
  vload(dd, ddv);
  vstore(ddv, vreg<A>(dd + gv * uv));
  const vreg<A> duv = dv * uv;
  for (std::size_t s = 0; s < ns; ++s) {
    const std::size_t j = s * W;
    vreg<A> a, dhj, hj, hpj, pcj, pbj, daj;
    vload(a, at + j);
    vload(dhj, dh + j);
    vload(hj, h + j);
    vload(hpj, hp + j);
    vload(pcj, pc + j);
    vload(pbj, pb + j);
    vload(daj, da + j);
    dhj += gv * c[s];  // y_t = C_t·h_t
    vstore(pc + j, vreg<A>(pcj + gv * hj));
    vreg<A> e = a * dv;
    vexp<A, true>(e);
    const vreg<A> eh = e * hpj;
    ddt += dhj * (a * eh + b[s] * uv);
    vstore(da + j, vreg<A>(daj + dhj * dv * eh));
    dub += dhj * b[s];
    vstore(pb + j, vreg<A>(pbj + dhj * duv));
    vstore(dh + j, vreg<A>(dhj * e));  // h_t depends on h_{t−1} through exp(Δ_t·a)
  }
  vstore(ddelta, ddt);
  vstore(du, vreg<A>(gv * dsk + dv * dub));
#else
  A ddt[W], dub[W], duv[W];
  for (std::size_t w = 0; w < W; ++w) {
    ddv[w] += g[w] * u[w];
    ddt[w] = A(0);
    dub[w] = A(0);
    duv[w] = d[w] * u[w];
  }
  for (std::size_t s = 0; s < ns; ++s)
    for (std::size_t w = 0; w < W; ++w) {
      const std::size_t j = s * W + w;
      const A dhj = dh[j] + g[w] * c[s];
      pc[j] += g[w] * h[j];
      const A e = vmath::exp(at[j] * d[w]), eh = e * hp[j];
      ddt[w] += dhj * (at[j] * eh + b[s] * u[w]);
      da[j] += dhj * d[w] * eh;
      dub[w] += dhj * b[s];
      pb[j] += dhj * duv[w];
      dh[j] = dhj * e;
    }
  for (std::size_t w = 0; w < W; ++w) {
    ddelta[w] = ddt[w];
    du[w] = g[w] * dskip[w] + d[w] * dub[w];
  }
#endif
}
}  // inline namespace scan_vector_ext / scan_plain_loops

// A [Di, Ns] -> at [Ns][W] for the channels ch0 .. ch0 + nw (lanes past nw get 0: with Δ = 0 on
// those lanes their state stays 0).
template <typename A>
void transpose_in(const A* src, std::size_t ch0, std::size_t nw, std::size_t ns, A* dst) {
  constexpr std::size_t W = scan_lanes<A>;
  for (std::size_t s = 0; s < ns; ++s)
    for (std::size_t w = 0; w < W; ++w) dst[s * W + w] = w < nw ? src[(ch0 + w) * ns + s] : A(0);
}
template <typename A>
void transpose_out(const A* src, std::size_t nw, std::size_t ns, A* dst) {  // [Ns][W] -> [nw, Ns]
  constexpr std::size_t W = scan_lanes<A>;
  for (std::size_t w = 0; w < nw; ++w)
    for (std::size_t s = 0; s < ns; ++s) dst[w * ns + s] = src[s * W + w];
}
// The row slice p[0 .. nw) as a full group: p itself when nw == W, else a zero-padded copy.
template <typename A>
const A* lanes_of(const A* p, std::size_t nw, A* pad) {
  constexpr std::size_t W = scan_lanes<A>;
  if (nw == W) return p;
  for (std::size_t w = 0; w < W; ++w) pad[w] = w < nw ? p[w] : A(0);
  return pad;
}

// Token n's position in its sequence: t = n mod T, or n − its start under packed sequences.
inline std::size_t position_in_sequence(const mamba_shape& s, std::size_t n) noexcept {
  const packed_sequences pk = s.packing();
  return pk.packed() ? n - pk.begin_of(n) : n % s.seq;
}
// One past the last token of n's sequence, on the [B·T] token axis.
inline std::size_t sequence_end(const mamba_shape& s, std::size_t n) noexcept {
  const packed_sequences pk = s.packing();
  return pk.packed() ? pk.end_of(n) : (n / s.seq + 1) * s.seq;
}

// c[n, i] = bias[i] + Σ_k w[i, k] · xi[b, t − (K−1) + k, i], xi read with row stride ldx (it is
// the x half of xz). Zero before the sequence's start (each packed sequence's own).
template <typename A>
void causal_conv(thread_pool& pool, const mamba_shape& s, const A* xi, std::size_t ldx,
                 const A* w, const A* bias, A* c) {
  const std::size_t T = s.seq, Di = s.d_inner, K = s.d_conv, N = s.batch * T;
  pool.parallel_for(blocks(N, row_block), [&](std::size_t blk, std::size_t) {
    const std::size_t r0 = blk * row_block, r1 = std::min(N, r0 + row_block);
    for (std::size_t n = r0; n < r1; ++n) {
      const std::size_t t = position_in_sequence(s, n);
      A* out = c + n * Di;
      std::copy(bias, bias + Di, out);
      for (std::size_t k = 0; k < K; ++k) {
        if (t + k < K - 1) continue;  // before the sequence's start
        const A* src = xi + (n + k + 1 - K) * ldx;
        for (std::size_t i = 0; i < Di; ++i) out[i] += w[i * K + k] * src[i];
      }
    }
  });
}

// The convolution's transpose: dxi[b, t', i] = Σ_k w[i, k] · dc[b, t' + K−1 − k, i] (written with
// row stride lddx), dw[i, k] = Σ_{b,t} dc · xi[t − (K−1) + k], dbias[i] = Σ dc (both written).
// One task per channel block, so the sums over b and t run in a fixed order.
template <typename A>
void causal_conv_backward(thread_pool& pool, const mamba_shape& s, const A* xi, std::size_t ldx,
                          const A* w, const A* dc, A* dxi, std::size_t lddx, A* dw, A* dbias) {
  const std::size_t B = s.batch, T = s.seq, Di = s.d_inner, K = s.d_conv;
  pool.parallel_for(blocks(Di, scan_channels), [&](std::size_t blk, std::size_t) {
    const std::size_t i0 = blk * scan_channels, i1 = std::min(Di, i0 + scan_channels);
    for (std::size_t i = i0; i < i1; ++i) {
      std::fill(dw + i * K, dw + (i + 1) * K, A(0));
      dbias[i] = A(0);
    }
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t t0 = 0; t0 < T; ++t0) {
        const std::size_t n = b * T + t0;
        // Position in the sequence, and the tokens left in it from n on.
        const std::size_t t = position_in_sequence(s, n), left = sequence_end(s, n) - n;
        const A* g = dc + n * Di;
        A* out = dxi + n * lddx;
        for (std::size_t i = i0; i < i1; ++i) {
          dbias[i] += g[i];
          out[i] = A(0);
        }
        for (std::size_t k = 0; k < K; ++k) {
          if (t + k >= K - 1) {  // dw: tap k saw xi at t − (K−1) + k
            const A* src = xi + (n + k + 1 - K) * ldx;
            for (std::size_t i = i0; i < i1; ++i) dw[i * K + k] += g[i] * src[i];
          }
          if (K - 1 - k < left) {  // dxi: xi at t fed output t + K−1 − k (in its sequence) through tap k
            const A* later = dc + (n + K - 1 - k) * Di;
            for (std::size_t i = i0; i < i1; ++i) out[i] += w[i * K + k] * later[i];
          }
        }
      }
  });
}

// Selective scan forward over chunks of L steps: y[n, i] = C_t·h_t[i] + D[i]·u[n, i]. When
// `states` is not null, the state entering chunk c (c ≥ 1) is stored at states[b, c − 1].
// One task per block of scan_channels channels; inside it, per time step, the block's groups of
// scan_lanes channels in turn (state [group][Ns][lanes], L1-resident).
template <typename A>
void scan_forward(thread_pool& pool, const mamba_shape& s, std::size_t L, const A* u,
                  const A* delta, const A* xdbl, const A* a, const A* dskip, A* y, A* states,
                  A* scratch) {
  constexpr std::size_t W = scan_lanes<A>;
  const std::size_t B = s.batch, T = s.seq, Di = s.d_inner, Ns = s.d_state, R = s.dt_rank;
  const std::size_t ldx = R + 2 * Ns, nch = scan_chunks(T, L);
  const packed_sequences pk = s.packing();
  pool.parallel_for(blocks(Di, scan_channels), [&](std::size_t blk, std::size_t thread) {
    const std::size_t i0 = blk * scan_channels, ni = std::min(scan_channels, Di - i0);
    const std::size_t G = blocks(ni, W), gs = Ns * W;  // groups, elements per group state
    A* h = scratch + thread * scan_forward_scratch(Ns);  // [G][Ns][W]
    A* at = h + scan_channels * Ns;                      // [G][Ns][W]
    A* pad = at + scan_channels * Ns;                    // Δ, u, D, y of a partial group
    const auto width = [&](std::size_t g) { return std::min(W, ni - g * W); };
    for (std::size_t g = 0; g < G; ++g) transpose_in(a, i0 + g * W, width(g), Ns, at + g * gs);
    for (std::size_t b = 0; b < B; ++b) {
      std::fill(h, h + G * gs, A(0));
      for (std::size_t t = 0; t < T; ++t) {
        const std::size_t n = b * T + t;
        if (states != nullptr && t > 0 && t % L == 0) {
          A* dst = states + ((b * (nch - 1) + t / L - 1) * Di + i0) * Ns;
          for (std::size_t g = 0; g < G; ++g) transpose_out(h + g * gs, width(g), Ns, dst + g * W * Ns);
        }
        if (pk.packed() && t > 0 && pk.begin_of(n) == n) std::fill(h, h + G * gs, A(0));  // a new sequence
        const A* bt = xdbl + n * ldx + R;
        for (std::size_t g = 0; g < G; ++g) {
          const std::size_t ch = i0 + g * W, nw = width(g);
          A* yo = nw == W ? y + n * Di + ch : pad + 3 * W;
          scan_group_step(h + g * gs, at + g * gs, lanes_of(delta + n * Di + ch, nw, pad),
                          lanes_of(u + n * Di + ch, nw, pad + W),
                          lanes_of(dskip + ch, nw, pad + 2 * W), bt, bt + Ns, Ns, yo);
          if (nw != W) std::copy(yo, yo + nw, y + n * Di + ch);
        }
      }
    }
  });
}

// Per state s, the sum of x[s][0 .. W) in a fixed pairwise order, into out[s] (x is clobbered).
// Halving the width each pass keeps every pass a vertical, vectorizable one.
template <typename A>
void lane_sums(A* x, std::size_t ns, A* out) {
  constexpr std::size_t W = scan_lanes<A>;
  for (std::size_t half = W / 2; half >= 1; half /= 2)
    for (std::size_t s = 0; s < ns; ++s)
      for (std::size_t w = 0; w < half; ++w) x[s * W + w] += x[s * W + w + half];
  for (std::size_t s = 0; s < ns; ++s) out[s] = x[s * W];
}

// Selective scan backward. Per chunk, last to first: recompute the chunk's states from its saved
// entry state (forward order, through scan_group_step, so they equal forward's), then run the
// reverse recurrence with the running dL/dh. Given dy = dL/dy [N, Di], writes y (recomputed),
// du (the scan's part), dΔ, dA [Di, Ns] and dD [Di], and per channel block the partial sums of
// dB and dC into part[blk, N, 2·Ns] (reduced by reduce_bc in a fixed order). Vectorized across
// channels as the forward; the sums over channels (dB, dC) are per-lane sums over the block's
// groups, then lane_sums.
template <typename A>
void scan_backward(thread_pool& pool, const mamba_shape& s, std::size_t L, const A* u,
                   const A* delta, const A* xdbl, const A* a, const A* dskip, const A* states,
                   const A* dy, A* y, A* du, A* ddelta, A* da, A* dd, A* part, A* scratch) {
  constexpr std::size_t W = scan_lanes<A>;
  const std::size_t B = s.batch, T = s.seq, Di = s.d_inner, Ns = s.d_state, R = s.dt_rank;
  const std::size_t ldx = R + 2 * Ns, nch = scan_chunks(T, L), N = B * T;
  const std::size_t Lc = std::min(L, T);  // states per chunk actually held
  const std::size_t bs = scan_channels * Ns;  // elements of one block state
  const packed_sequences pk = s.packing();
  // A packed sequence's first token: its state starts at 0 and no gradient crosses to the token
  // before it (another sequence's last).
  const auto starts = [&](std::size_t n, std::size_t t) { return pk.packed() && t > 0 && pk.begin_of(n) == n; };
  pool.parallel_for(blocks(Di, scan_channels), [&](std::size_t blk, std::size_t thread) {
    const std::size_t i0 = blk * scan_channels, ni = std::min(scan_channels, Di - i0);
    const std::size_t G = blocks(ni, W), gs = Ns * W;
    A* hs = scratch + thread * scan_backward_scratch(Lc, Ns, pk.packed());  // [Lc + 1][G][Ns][W]: entry, then
    A* dh = hs + (Lc + 1) * bs;                                 // the state after each step
    A* at = dh + bs;
    A* dav = at + bs;                     // dA sums [G][Ns][W]
    A* pb = dav + bs;                     // dB lane sums [Ns][W]
    A* pc = pb + Ns * max_scan_lanes;     // dC lane sums [Ns][W]
    A* ddv = pc + Ns * max_scan_lanes;    // dD sums [G·W]
    A* pad = ddv + scan_channels;         // padded rows of a partial group
    A* zero = pad + 8 * max_scan_lanes;   // packed: the group state before a sequence starts
    if (pk.packed()) std::fill(zero, zero + gs, A(0));
    A* pblk = part + blk * N * 2 * Ns;
    const auto width = [&](std::size_t g) { return std::min(W, ni - g * W); };
    for (std::size_t g = 0; g < G; ++g) transpose_in(a, i0 + g * W, width(g), Ns, at + g * gs);
    std::fill(dav, dav + G * gs, A(0));
    std::fill(ddv, ddv + G * W, A(0));
    for (std::size_t b = 0; b < B; ++b) {
      std::fill(dh, dh + G * gs, A(0));
      for (std::size_t c = nch; c-- > 0;) {
        const std::size_t t0 = c * L, t1 = std::min(T, t0 + L);
        const auto state_at = [&](std::size_t t) { return hs + (t + 1 - t0) * bs; };  // after t
        if (c == 0) {
          std::fill(hs, hs + G * gs, A(0));
        } else {
          const A* entry = states + (b * (nch - 1) + c - 1) * Di * Ns;  // [Di, Ns]
          for (std::size_t g = 0; g < G; ++g)
            transpose_in(entry, i0 + g * W, width(g), Ns, hs + g * gs);
        }
        for (std::size_t t = t0; t < t1; ++t) {
          const std::size_t n = b * T + t;
          A* hc = state_at(t);
          if (starts(n, t)) {
            std::fill(hc, hc + G * gs, A(0));
          } else {
            std::copy(hc - bs, hc - bs + G * gs, hc);
          }
          const A* bt = xdbl + n * ldx + R;
          for (std::size_t g = 0; g < G; ++g) {
            const std::size_t ch = i0 + g * W, nw = width(g);
            A* yo = nw == W ? y + n * Di + ch : pad + 3 * W;
            scan_group_step(hc + g * gs, at + g * gs, lanes_of(delta + n * Di + ch, nw, pad),
                            lanes_of(u + n * Di + ch, nw, pad + W),
                            lanes_of(dskip + ch, nw, pad + 2 * W), bt, bt + Ns, Ns, yo);
            if (nw != W) std::copy(yo, yo + nw, y + n * Di + ch);
          }
        }
        for (std::size_t t = t1; t-- > t0;) {
          const std::size_t n = b * T + t;
          const A* bt = xdbl + n * ldx + R;
          const A* ct = bt + Ns;
          std::fill(pb, pb + gs, A(0));
          std::fill(pc, pc + gs, A(0));
          for (std::size_t g = 0; g < G; ++g) {
            const std::size_t ch = i0 + g * W, nw = width(g);
            A* ddo = nw == W ? ddelta + n * Di + ch : pad + 4 * W;
            A* duo = nw == W ? du + n * Di + ch : pad + 5 * W;
            const A* hg = state_at(t) + g * gs;
            const A* before = starts(n, t) ? static_cast<const A*>(zero) : hg - bs;
            scan_group_back_step(lanes_of(dy + n * Di + ch, nw, pad),
                                 lanes_of(u + n * Di + ch, nw, pad + W),
                                 lanes_of(delta + n * Di + ch, nw, pad + 2 * W),
                                 lanes_of(dskip + ch, nw, pad + 3 * W), hg, before,
                                 static_cast<const A*>(at + g * gs), bt, ct, Ns, dh + g * gs,
                                 dav + g * gs, pb, pc, ddv + g * W, ddo, duo);
            if (nw != W) {
              std::copy(ddo, ddo + nw, ddelta + n * Di + ch);
              std::copy(duo, duo + nw, du + n * Di + ch);
            }
          }
          lane_sums(pb, Ns, pblk + n * 2 * Ns);
          lane_sums(pc, Ns, pblk + n * 2 * Ns + Ns);
          if (starts(n, t)) std::fill(dh, dh + G * gs, A(0));  // nothing flows into the sequence before
        }
      }
    }
    for (std::size_t g = 0; g < G; ++g) {
      transpose_out(dav + g * gs, width(g), Ns, da + (i0 + g * W) * Ns);
      std::copy(ddv + g * W, ddv + g * W + width(g), dd + i0 + g * W);
    }
  });
}

// dB, dC [N, Ns] each, written into x_dbl's gradient at columns R and R + Ns (row stride ldx):
// the per-block partials summed in block order.
template <typename A>
void reduce_bc(thread_pool& pool, const mamba_shape& s, const A* part, A* dxdbl) {
  const std::size_t N = s.batch * s.seq, Di = s.d_inner, Ns = s.d_state, R = s.dt_rank;
  const std::size_t ldx = R + 2 * Ns, nblk = blocks(Di, scan_channels);
  pool.parallel_for(blocks(N, row_block), [&](std::size_t rb, std::size_t) {
    const std::size_t r0 = rb * row_block, r1 = std::min(N, r0 + row_block);
    for (std::size_t n = r0; n < r1; ++n) {
      A* out = dxdbl + n * ldx + R;
      std::copy(part + n * 2 * Ns, part + (n + 1) * 2 * Ns, out);
      for (std::size_t blk = 1; blk < nblk; ++blk) {
        const A* p = part + (blk * N + n) * 2 * Ns;
        for (std::size_t j = 0; j < 2 * Ns; ++j) out[j] += p[j];
      }
    }
  });
}

}  // namespace cpu

// The Mamba block on the host: the same calls as backend_kernels<cuda_backend, mamba_shape>
// (backend/cuda/mamba.cuh), which layers/mamba.hpp makes without knowing which backend runs
// them. L is the layer's scan_chunk; `keep` its save_all (then c and Δ live in `saved`, and
// saved.c is not null). The front has checked every argument and the workspace's size; this
// carves the workspace and runs, in the accumulator type A (bf16/fp16 storage is widened into
// workspace slots first).
template <>
struct backend_kernels<cpu_backend, mamba_shape> {
  template <typename S, typename A>
  static constexpr std::size_t forward_workspace_bytes(const mamba_shape& s, std::size_t /*L*/,
                                                       bool /*keep*/, std::size_t threads) noexcept {
    using P = pass<S, A>;
    const std::size_t b[] = {P::w_acc_bytes(s), P::xz_acc_bytes(s), P::inner_bytes(s),
                             P::xdbl_acc_bytes(s),
                             bytes_of<A>(threads, cpu::scan_forward_scratch(s.d_state)),
                             P::forward_gemm_bytes(s, threads)};
    return detail::fits_layout(b) ? P::forward_layout(s, threads).size() : too_large;
  }
  template <typename S, typename A>
  static constexpr std::size_t backward_workspace_bytes(const mamba_shape& s, std::size_t L,
                                                        bool keep, std::size_t threads) noexcept {
    using P = pass<S, A>;
    const std::size_t b[] = {P::w_acc_bytes(s), P::xz_acc_bytes(s), P::inner_bytes(s),
                             P::part_bytes(s),
                             bytes_of<A>(threads, cpu::scan_backward_scratch(std::min(L, s.seq),
                                                                             s.d_state, s.sequences != 0)),
                             P::backward_gemm_bytes(s, threads)};
    return detail::fits_layout(b) ? P::backward_layout(s, L, keep, threads).size() : too_large;
  }
  template <typename S, typename A>
  static constexpr std::size_t step_workspace_bytes(const mamba_shape& s) noexcept {
    return pass<S, A>::step_layout(s).size();
  }

  template <typename S, typename A>
  static void forward(const mamba_shape& s, std::size_t L, const mamba_weights<S>& w, const S* x,
                      S* out, const mamba_saved<S, A>& sv, void* workspace,
                      std::size_t workspace_size, thread_pool& ex) {
    pass<S, A>::forward(s, L, w, x, out, sv, workspace, workspace_size, ex);
  }
  template <typename S, typename A>
  static void backward(const mamba_shape& s, std::size_t L, const mamba_weights<S>& w, const S* x,
                       const mamba_saved<S, A>& sv, const S* dout, S* dx,
                       const mamba_gradients<S>& g, void* workspace, std::size_t workspace_size,
                       thread_pool& ex) {
    pass<S, A>::backward(s, L, w, x, sv, dout, dx, g, workspace, workspace_size, ex);
  }
  template <typename S, typename A>
  static void step(const mamba_shape& s, const mamba_weights<S>& w, A* state, const S* x_t,
                   S* out_t, void* workspace, std::size_t workspace_size, thread_pool& ex) {
    pass<S, A>::step(s, w, state, x_t, out_t, workspace, workspace_size, ex);
  }
  // Zeroes the decoding state: the host writes it at once (the device's overload takes its stream).
  static void reset_state(void* state, std::size_t bytes) noexcept {
    if (bytes != 0) std::memset(state, 0, bytes);
  }
  static void reset_state(void* state, std::size_t bytes, thread_pool&) noexcept {
    reset_state(state, bytes);
  }

 private:
  static constexpr std::size_t too_large = std::numeric_limits<std::size_t>::max();

  // One precision's passes: S storage, A accumulation.
  template <typename S, typename A>
  struct pass {
    static constexpr bool widened = !std::is_same_v<S, A>;

    static void forward(const mamba_shape& s, std::size_t L, const mamba_weights<S>& w, const S* x,
                        S* out, const mamba_saved<S, A>& sv, void* workspace,
                        std::size_t workspace_size, thread_pool& ex) {
      const std::size_t threads = ex.size();
      const auto ws = carve(forward_layout(s, threads), workspace, workspace_size);
      const std::span<std::byte> gs{ws.template get<std::byte>(f_gemm), forward_gemm_bytes(s, threads)};
      const std::size_t N = s.batch * s.seq, C = s.d_model, Di = s.d_inner;
      const std::size_t Ns = s.d_state, R = s.dt_rank, ldx = R + 2 * Ns;
      const wptrs wa = widen_weights(w, s, ws.template get<A>(f_w));
      const A* xa = cpu::widen_or_alias(x, N * C, ws.template get<A>(f_x));
      A* const a_neg = ws.template get<A>(f_a);
      negexp(wa.a_log, Di * Ns, a_neg);

      // Phase 0: xz = x·in_proj, stored (rounded) and used as stored.
      S* xz_s = sv.xz;
      A* xz = cpu::accum_target(xz_s, ws.template get<A>(f_xz));
      cpu::matmul(ex, xa, wa.in_proj, xz, N, C, 2 * Di, false, cpu::ld3{C, 2 * Di, 2 * Di}, gs);
      store(ex, xz, N * 2 * Di, xz_s);
      // c = conv(xi) + b, then u = SiLU(c) in place.
      A* u = ws.template get<A>(f_u);
      conv_forward(ex, s, xz, wa, u, sv.c);
      cpu::for_rows(ex, N, [&](std::size_t n) { silu_row(u + n * Di, Di); });

      // Phase 1: x_dbl = u·x_proj (stored), Δ = softplus(dt_low·dt_proj + dt_bias).
      S* xdbl_s = sv.xdbl;
      A* xdbl = cpu::accum_target(xdbl_s, ws.template get<A>(f_xdbl));
      cpu::matmul(ex, static_cast<const A*>(u), wa.x_proj, xdbl, N, Di, ldx, false,
                  cpu::ld3{Di, ldx, ldx}, gs);
      store(ex, xdbl, N * ldx, xdbl_s);
      A* delta = ws.template get<A>(f_delta);
      delta_forward(ex, s, xdbl, wa, delta, sv.delta,
                    gs);

      // Phase 2: the scan, keeping the chunk-entry states; then the gate, in place.
      A* y = ws.template get<A>(f_y);
      cpu::scan_forward(ex, s, L, static_cast<const A*>(u), static_cast<const A*>(delta),
                        static_cast<const A*>(xdbl), static_cast<const A*>(a_neg), wa.d, y,
                        sv.states, ws.template get<A>(f_scratch));
      cpu::for_rows(ex, N, [&](std::size_t n) { gate_row(y + n * Di, xz + n * 2 * Di + Di, Di); });

      // Phase 3: out = g·out_proj.
      A* oa = cpu::accum_target(out, ws.template get<A>(f_out));
      cpu::matmul(ex, static_cast<const A*>(y), wa.out_proj, oa, N, Di, C, false,
                  cpu::ld3{Di, C, C}, gs);
      if constexpr (widened) cpu::narrow(static_cast<const A*>(oa), N * C, out);
    }

    static void backward(const mamba_shape& s, std::size_t L, const mamba_weights<S>& w, const S* x,
                         const mamba_saved<S, A>& sv, const S* dout, S* dx,
                         const mamba_gradients<S>& g, void* workspace, std::size_t workspace_size,
                         thread_pool& ex) {
      const std::size_t threads = ex.size();
      const bool keep = sv.c != nullptr;
      const auto ws = carve(backward_layout(s, L, keep, threads), workspace, workspace_size);
      const std::span<std::byte> gs{ws.template get<std::byte>(b_gemm), backward_gemm_bytes(s, threads)};
      const std::size_t N = s.batch * s.seq, C = s.d_model, Di = s.d_inner, K = s.d_conv;
      const std::size_t Ns = s.d_state, R = s.dt_rank, ldx = R + 2 * Ns;
      const wptrs wa = widen_weights(w, s, ws.template get<A>(b_w));
      A* const a_neg = ws.template get<A>(b_a);
      negexp(wa.a_log, Di * Ns, a_neg);

      // Phase 0: the forward's values, as stored (or recomputed from what is stored).
      const A* xz = cpu::widen_or_alias(static_cast<const S*>(sv.xz), N * 2 * Di,
                                   ws.template get<A>(b_xz));
      const A* xdbl = cpu::widen_or_alias(static_cast<const S*>(sv.xdbl), N * ldx,
                                     ws.template get<A>(b_xdbl));
      const A* c;
      const A* delta;
      if (keep) {
        c = cpu::widen_or_alias(static_cast<const S*>(sv.c), N * Di,
                           ws.template get<A>(b_c));
        delta = cpu::widen_or_alias(static_cast<const S*>(sv.delta), N * Di,
                               ws.template get<A>(b_delta));
      } else {
        A* cw = ws.template get<A>(b_c);
        conv_forward(ex, s, xz, wa, cw, nullptr);
        A* dw = ws.template get<A>(b_delta);
        delta_forward(ex, s, xdbl, wa, dw, nullptr, gs);
        c = cw;
        delta = dw;
      }
      A* u = ws.template get<A>(b_u);
      cpu::for_rows(ex, N, [&](std::size_t n) {
        const A* cn = c + n * Di;
        A* un = u + n * Di;
        for (std::size_t i = 0; i < Di; ++i) un[i] = cpu::vmath::silu(cn[i]);
      });
      // dg = dout·out_projᵀ; the scan's output gradient dy = dg ⊙ SiLU(z).
      const A* dya = cpu::widen_or_alias(dout, N * C, ws.template get<A>(b_dout));
      A* dg = ws.template get<A>(b_dg);
      cpu::matmul_bt(ex, dya, wa.out_proj, dg, N, C, Di, false, cpu::ld3{C, C, Di}, gs);
      A* dys = ws.template get<A>(b_dys);
      cpu::for_rows(ex, N, [&](std::size_t n) {
        const A* z = xz + n * 2 * Di + Di;
        const A* dgn = dg + n * Di;
        A* dyn = dys + n * Di;
        for (std::size_t i = 0; i < Di; ++i) dyn[i] = dgn[i] * cpu::vmath::silu(z[i]);
      });

      // Phase 1: the reverse scan.
      A* y = ws.template get<A>(b_y);
      A* du = ws.template get<A>(b_du);
      A* ddelta = ws.template get<A>(b_ddelta);
      A* small = ws.template get<A>(b_small);
      A* da = small;                  // [Di, Ns] w.r.t. A
      A* dd = da + Di * Ns;           // [Di]
      A* dconv_w = dd + Di;           // [Di, K]
      A* dconv_b = dconv_w + Di * K;  // [Di]
      A* ddt_bias = dconv_b + Di;     // [Di]
      A* dxdbl = ws.template get<A>(b_dxdbl);
      cpu::scan_backward(ex, s, L, static_cast<const A*>(u), delta, xdbl,
                         static_cast<const A*>(a_neg), wa.d, sv.states,
                         static_cast<const A*>(dys), y, du, ddelta, da, dd,
                         ws.template get<A>(b_part), ws.template get<A>(b_scratch));
      cpu::reduce_bc(ex, s, static_cast<const A*>(ws.template get<A>(b_part)), dxdbl);

      // Phase 2: dz = dg ⊙ y ⊙ SiLU'(z) into dxz's z half; g = y ⊙ SiLU(z); dout_proj = gᵀ·dout.
      A* dxz = ws.template get<A>(b_dxz);
      cpu::for_rows(ex, N, [&](std::size_t n) {
        const A* z = xz + n * 2 * Di + Di;
        A* dz = dxz + n * 2 * Di + Di;
        const A* dgn = dg + n * Di;
        A* yn = y + n * Di;
        for (std::size_t i = 0; i < Di; ++i) {
          const A sg = cpu::vmath::sigmoid(z[i]);  // SiLU = z·σ, SiLU' = σ·(1 + z·(1 − σ))
          dz[i] = dgn[i] * yn[i] * (sg * (A(1) + z[i] * (A(1) - sg)));
          yn[i] *= z[i] * sg;
        }
      });
      A* tmp = ws.template get<A>(b_wtmp);
      weight_grad(ex, static_cast<const A*>(y), dya, g.out_proj, tmp, N, Di, C, gs);

      // Phase 3: dt = dt_low·dt_proj + dt_bias went through softplus, whose derivative σ(dt) is
      // 1 − exp(−Δ) = −expm1(−Δ): the gradient follows from Δ alone, as stored.
      cpu::for_rows(ex, N, [&](std::size_t n) {
        for (std::size_t i = 0; i < Di; ++i)
          ddelta[n * Di + i] *= -std::expm1(-delta[n * Di + i]);
      });
      column_sums(ex, static_cast<const A*>(ddelta), N, Di, ddt_bias);
      if constexpr (widened) {
        cpu::matmul_at(ex, xdbl, static_cast<const A*>(ddelta), tmp, N, R, Di, false,
                       cpu::ld3{ldx, Di, Di}, gs);
        cpu::narrow_add(static_cast<const A*>(tmp), R * Di, g.dt_proj);
      } else {
        cpu::matmul_at(ex, xdbl, static_cast<const A*>(ddelta), g.dt_proj, N, R, Di, true,
                       cpu::ld3{ldx, Di, Di}, gs);
      }
      cpu::matmul_bt(ex, static_cast<const A*>(ddelta), wa.dt_proj, dxdbl, N, Di, R, false,
                     cpu::ld3{Di, Di, ldx}, gs);

      // Phase 4: x_proj's gradients; dc = du ⊙ SiLU'(c); the convolution's transpose.
      weight_grad(ex, static_cast<const A*>(u), static_cast<const A*>(dxdbl), g.x_proj, tmp, N, Di,
                  ldx, gs);
      cpu::matmul_bt(ex, static_cast<const A*>(dxdbl), wa.x_proj, du, N, ldx, Di, true,
                     cpu::ld3{ldx, ldx, Di}, gs);
      cpu::for_rows(ex, N, [&](std::size_t n) {
        const A* cn = c + n * Di;
        A* dun = du + n * Di;
        for (std::size_t i = 0; i < Di; ++i) dun[i] *= cpu::vmath::silu_grad(cn[i]);
      });
      cpu::causal_conv_backward(ex, s, xz, 2 * Di, wa.conv_w, static_cast<const A*>(du), dxz,
                                2 * Di, dconv_w, dconv_b);

      // Phase 5: in_proj's gradients and dx = dxz·in_projᵀ.
      const A* xa = cpu::widen_or_alias(x, N * C, ws.template get<A>(b_x));
      weight_grad(ex, xa, static_cast<const A*>(dxz), g.in_proj, tmp, N, C, 2 * Di, gs);
      A* dxa = cpu::accum_target(dx, ws.template get<A>(b_dx));
      cpu::matmul_bt(ex, static_cast<const A*>(dxz), wa.in_proj, dxa, N, 2 * Di, C, false,
                     cpu::ld3{2 * Di, 2 * Di, C}, gs);
      if constexpr (widened) cpu::narrow(static_cast<const A*>(dxa), N * C, dx);

      // The small parameters, each rounded once into its gradient. dA_log = dA ⊙ A.
      for (std::size_t j = 0; j < Di * Ns; ++j) da[j] *= a_neg[j];
      cpu::add_grad(da, Di * Ns, g.a_log);
      cpu::add_grad(dd, Di, g.d);
      cpu::add_grad(dconv_w, Di * K, g.conv_w);
      cpu::add_grad(dconv_b, Di, g.conv_b);
      cpu::add_grad(ddt_bias, Di, g.dt_bias);
    }

    static void step(const mamba_shape& s, const mamba_weights<S>& w, A* state, const S* x_t,
                     S* out_t, void* workspace, std::size_t workspace_size, thread_pool& ex) {
      const auto ws = carve(step_layout(s), workspace, workspace_size);
      const std::size_t B = s.batch, C = s.d_model, Di = s.d_inner, K = s.d_conv;
      const std::size_t Ns = s.d_state, R = s.dt_rank, ldx = R + 2 * Ns;
      const wptrs wa = widen_weights(w, s, ws.template get<A>(st_w));
      A* a_neg = ws.template get<A>(st_a);
      negexp(wa.a_log, Di * Ns, a_neg);
      const A* xa = cpu::widen_or_alias(x_t, B * C, ws.template get<A>(st_x));
      A* xz = ws.template get<A>(st_xz);
      // The forward's GEMM, packing buffers per task (step_gemm_bytes: one set for B <= 256, none
      // for B = 1).
      const std::span<std::byte> gs{ws.template get<std::byte>(st_gemm), step_gemm_bytes(s)};
      constexpr auto per_task = cpu::scratch_slots::per_task;
      cpu::matmul(ex, xa, wa.in_proj, xz, B, C, 2 * Di, false, cpu::ld3{C, 2 * Di, 2 * Di}, gs,
                  per_task);
      cpu::round_through<S>(xz, B * 2 * Di);
      A* conv_state = state;                        // [B, Di, K − 1]
      A* ssm_state = conv_state + B * Di * (K - 1);   // [B, Di, Ns]
      A* u = ws.template get<A>(st_u);
      for (std::size_t b = 0; b < B; ++b)
        for (std::size_t i = 0; i < Di; ++i) {
          A* cs = conv_state + (b * Di + i) * (K - 1);
          const A xi = xz[b * 2 * Di + i];
          A c = wa.conv_b[i];
          for (std::size_t k = 0; k + 1 < K; ++k) c += wa.conv_w[i * K + k] * cs[k];
          c += wa.conv_w[i * K + K - 1] * xi;
          if (K > 1) {
            std::copy(cs + 1, cs + (K - 1), cs);
            cs[K - 2] = xi;
          }
          u[b * Di + i] = c;
        }
      cpu::round_through<S>(u, B * Di);
      for (std::size_t b = 0; b < B; ++b) silu_row(u + b * Di, Di);
      A* xdbl = ws.template get<A>(st_xdbl);
      cpu::matmul(ex, static_cast<const A*>(u), wa.x_proj, xdbl, B, Di, ldx, false,
                  cpu::ld3{Di, ldx, ldx}, gs, per_task);
      cpu::round_through<S>(xdbl, B * ldx);
      A* delta = ws.template get<A>(st_delta);
      cpu::matmul(ex, static_cast<const A*>(xdbl), wa.dt_proj, delta, B, R, Di, false,
                  cpu::ld3{ldx, Di, Di}, gs, per_task);
      for (std::size_t b = 0; b < B; ++b) softplus_row(delta + b * Di, wa.dt_bias, Di);
      cpu::round_through<S>(delta, B * Di);
      // The scan through the forward's own group kernel: the carried state [Di, Ns] is transposed
      // to the kernel's [Ns][lanes] and back, lanes past Di padded with zeros.
      A* y = ws.template get<A>(st_y);
      constexpr std::size_t W = cpu::scan_lanes<A>;
      A* hg = ws.template get<A>(st_scan);
      A* at = hg + Ns * W;
      A* pad = at + Ns * W;
      for (std::size_t b = 0; b < B; ++b) {
        const A* bt = xdbl + b * ldx + R;
        A* hb = ssm_state + b * Di * Ns;
        for (std::size_t ch = 0; ch < Di; ch += W) {
          const std::size_t nw = std::min(W, Di - ch);
          cpu::transpose_in(static_cast<const A*>(a_neg), ch, nw, Ns, at);
          cpu::transpose_in(static_cast<const A*>(hb), ch, nw, Ns, hg);
          A* yo = nw == W ? y + b * Di + ch : pad + 3 * W;
          cpu::scan_group_step(hg, static_cast<const A*>(at),
                               cpu::lanes_of(static_cast<const A*>(delta) + b * Di + ch, nw, pad),
                               cpu::lanes_of(static_cast<const A*>(u) + b * Di + ch, nw, pad + W),
                               cpu::lanes_of(wa.d + ch, nw, pad + 2 * W), bt, bt + Ns, Ns, yo);
          if (nw != W) std::copy(yo, yo + nw, y + b * Di + ch);
          cpu::transpose_out(static_cast<const A*>(hg), nw, Ns, hb + ch * Ns);
        }
        gate_row(y + b * Di, xz + b * 2 * Di + Di, Di);
      }
      A* oa = cpu::accum_target(out_t, ws.template get<A>(st_out));
      cpu::matmul(ex, static_cast<const A*>(y), wa.out_proj, oa, B, Di, C, false,
                  cpu::ld3{Di, C, C}, gs, per_task);
      if constexpr (widened) cpu::narrow(static_cast<const A*>(oa), B * C, out_t);
    }

    // ---- Sizes ---------------------------------------------------------------------------------
    static constexpr std::size_t rows(const mamba_shape& s) noexcept { return s.batch * s.seq; }
    static constexpr std::size_t inner_bytes(const mamba_shape& s) noexcept {  // [N, Di] in A
      return bytes_of<A>(rows(s), s.d_inner);
    }
    static constexpr std::size_t w_acc_bytes(const mamba_shape& s) noexcept {
      return widened ? bytes_of<A>(mamba_weight_elements(s)) : 0;
    }
    static constexpr std::size_t xz_acc_bytes(const mamba_shape& s) noexcept {
      return widened ? bytes_of<A>(rows(s), 2 * s.d_inner) : 0;
    }
    static constexpr std::size_t xdbl_acc_bytes(const mamba_shape& s) noexcept {
      return widened ? bytes_of<A>(rows(s), s.dt_rank + 2 * s.d_state) : 0;
    }
    static constexpr std::size_t io_acc_bytes(const mamba_shape& s) noexcept {  // x, out, dout, dx
      return widened ? bytes_of<A>(rows(s), s.d_model) : 0;
    }
    static constexpr std::size_t part_bytes(const mamba_shape& s) noexcept {
      return bytes_of<A>(blocks_of_channels(s), rows(s), 2 * s.d_state);
    }
    static constexpr std::size_t blocks_of_channels(const mamba_shape& s) noexcept {
      return cpu::blocks(s.d_inner, cpu::scan_channels);
    }
    // A conv output / Δ that backward reads straight from `saved` needs no workspace copy.
    static constexpr std::size_t recomputed_inner_bytes(const mamba_shape& s, bool keep) noexcept {
      return keep && !widened ? 0 : inner_bytes(s);
    }
    static constexpr std::size_t wtmp_bytes(const mamba_shape& s) noexcept {
      if (!widened) return 0;
      const std::size_t C = s.d_model, Di = s.d_inner, R = s.dt_rank, Ns = s.d_state;
      return bytes_of<A>(std::max({C * 2 * Di, Di * (R + 2 * Ns), R * Di, Di * C}));
    }

    // Packing buffers of the projections (one set per thread, sized for the largest product of the
    // pass; cpu::matmul's tasks each use their thread's slice).
    static constexpr std::size_t forward_gemm_bytes(const mamba_shape& s, std::size_t threads) noexcept {
      const std::size_t N = rows(s), C = s.d_model, Di = s.d_inner, R = s.dt_rank;
      const std::size_t ldx = R + 2 * s.d_state;
      return threads * std::max({cpu::matmul_thread_scratch_bytes<A>(N, C, 2 * Di),
                                 cpu::matmul_thread_scratch_bytes<A>(N, Di, ldx),
                                 cpu::matmul_thread_scratch_bytes<A>(N, R, Di),
                                 cpu::matmul_thread_scratch_bytes<A>(N, Di, C)});
    }
    static constexpr std::size_t backward_gemm_bytes(const mamba_shape& s, std::size_t threads) noexcept {
      const std::size_t N = rows(s), C = s.d_model, Di = s.d_inner, R = s.dt_rank;
      const std::size_t ldx = R + 2 * s.d_state;
      return threads * std::max({cpu::matmul_thread_scratch_bytes<A>(N, R, Di),       // Δ (recompute)
                                 cpu::matmul_thread_scratch_bytes<A>(N, C, Di),       // dg
                                 cpu::matmul_at_thread_scratch_bytes<A>(N, Di, C),    // d out_proj
                                 cpu::matmul_at_thread_scratch_bytes<A>(N, R, Di),    // d dt_proj
                                 cpu::matmul_thread_scratch_bytes<A>(N, Di, R),       // d dt_low
                                 cpu::matmul_at_thread_scratch_bytes<A>(N, Di, ldx),  // d x_proj
                                 cpu::matmul_thread_scratch_bytes<A>(N, ldx, Di),     // du
                                 cpu::matmul_at_thread_scratch_bytes<A>(N, C, 2 * Di),  // d in_proj
                                 cpu::matmul_thread_scratch_bytes<A>(N, 2 * Di, C)});   // dx
    }

    // Decoding's packing buffers, one set per 256-row task of its largest projection (its size
    // takes no thread count; cpu::scratch_slots::per_task), none for B = 1 (GEMVs).
    static constexpr std::size_t step_gemm_bytes(const mamba_shape& s) noexcept {
      const std::size_t B = s.batch, C = s.d_model, Di = s.d_inner, R = s.dt_rank;
      const std::size_t ldx = R + 2 * s.d_state;
      return std::max({cpu::matmul_task_scratch_bytes<A>(B, C, 2 * Di),
                       cpu::matmul_task_scratch_bytes<A>(B, Di, ldx),
                       cpu::matmul_task_scratch_bytes<A>(B, R, Di),
                       cpu::matmul_task_scratch_bytes<A>(B, Di, C)});
    }

    // Phases: 0 in_proj and conv, 1 x_proj and Δ, 2 scan and gate, 3 out_proj.
    enum forward_slot : std::size_t {
      f_w, f_a, f_x, f_xz, f_u, f_xdbl, f_delta, f_y, f_scratch, f_out, f_gemm
    };
    static constexpr workspace_layout<11> forward_layout(const mamba_shape& s, std::size_t threads) {
      workspace_layout<11> l;
      l.add(w_acc_bytes(s), default_alignment, {0, 3});
      l.add(bytes_of<A>(s.d_inner, s.d_state), default_alignment, {0, 3});
      l.add(io_acc_bytes(s), default_alignment, {0, 0});
      l.add(xz_acc_bytes(s), default_alignment, {0, 2});
      l.add(inner_bytes(s), default_alignment, {0, 2});
      l.add(xdbl_acc_bytes(s), default_alignment, {1, 2});
      l.add(inner_bytes(s), default_alignment, {1, 2});
      l.add(inner_bytes(s), default_alignment, {2, 3});
      l.add(bytes_of<A>(threads, cpu::scan_forward_scratch(s.d_state)), default_alignment, {2, 2});
      l.add(io_acc_bytes(s), default_alignment, {3, 3});
      l.add(forward_gemm_bytes(s, threads), default_alignment, {0, 3});
      return l;
    }

    // Phases: 0 forward values, dg and the scan's dy; 1 reverse scan; 2 gate and out_proj grads;
    // 3 Δ's projection grads; 4 x_proj and conv grads; 5 in_proj grads and dx.
    enum backward_slot : std::size_t {
      b_w, b_a, b_xz, b_xdbl, b_c, b_delta, b_u, b_dout, b_dg, b_dys, b_y, b_du, b_ddelta,
      b_small, b_part, b_scratch, b_dxdbl, b_dxz, b_wtmp, b_x, b_dx, b_gemm
    };
    static constexpr workspace_layout<22> backward_layout(const mamba_shape& s, std::size_t L,
                                                          bool keep, std::size_t threads) {
      const std::size_t Di = s.d_inner, Ns = s.d_state;
      workspace_layout<22> l;
      l.add(w_acc_bytes(s), default_alignment, {0, 5});
      l.add(bytes_of<A>(Di, Ns), default_alignment, {0, 5});
      l.add(xz_acc_bytes(s), default_alignment, {0, 4});
      l.add(xdbl_acc_bytes(s), default_alignment, {0, 3});
      l.add(recomputed_inner_bytes(s, keep), default_alignment, {0, 4});  // c
      l.add(recomputed_inner_bytes(s, keep), default_alignment, {0, 3});  // Δ
      l.add(inner_bytes(s), default_alignment, {0, 4});             // u
      l.add(io_acc_bytes(s), default_alignment, {0, 2});            // dout
      l.add(inner_bytes(s), default_alignment, {0, 2});             // dg
      l.add(inner_bytes(s), default_alignment, {0, 1});             // the scan's dy
      l.add(inner_bytes(s), default_alignment, {1, 2});             // y, then g
      l.add(inner_bytes(s), default_alignment, {1, 4});             // du, then dc
      l.add(inner_bytes(s), default_alignment, {1, 3});             // dΔ, then d(dt)
      l.add(bytes_of<A>(Di * (Ns + s.d_conv + 3)), default_alignment, {1, 5});
      l.add(part_bytes(s), default_alignment, {1, 1});
      l.add(bytes_of<A>(threads, cpu::scan_backward_scratch(std::min(L, s.seq), Ns, s.sequences != 0)),
            default_alignment, {1, 1});
      l.add(bytes_of<A>(rows(s), s.dt_rank + 2 * Ns), default_alignment, {1, 4});
      l.add(bytes_of<A>(rows(s), 2 * Di), default_alignment, {2, 5});
      l.add(wtmp_bytes(s), default_alignment, {2, 5});
      l.add(io_acc_bytes(s), default_alignment, {5, 5});  // x
      l.add(io_acc_bytes(s), default_alignment, {5, 5});  // dx
      // Every phase but the reverse scan runs a projection; phase 1 could share these bytes, but
      // the scan's part/scratch are the larger and a {0, 5} slot keeps the layout simple.
      l.add(backward_gemm_bytes(s, threads), default_alignment, {0, 5});
      return l;
    }

    enum step_slot : std::size_t {
      st_w, st_a, st_x, st_xz, st_u, st_xdbl, st_delta, st_y, st_out, st_scan, st_gemm
    };
    static constexpr workspace_layout<11> step_layout(const mamba_shape& s) {
      const std::size_t B = s.batch, Di = s.d_inner;
      workspace_layout<11> l;
      l.add(w_acc_bytes(s));
      l.add(bytes_of<A>(Di, s.d_state));
      l.add(widened ? bytes_of<A>(B, s.d_model) : 0);
      l.add(bytes_of<A>(B, 2 * Di));
      l.add(bytes_of<A>(B, Di));
      l.add(bytes_of<A>(B, s.dt_rank + 2 * s.d_state));
      l.add(bytes_of<A>(B, Di));
      l.add(bytes_of<A>(B, Di));
      l.add(widened ? bytes_of<A>(B, s.d_model) : 0);
      // One scan group's state and A ([Ns][lanes] each) and its padded rows.
      l.add(bytes_of<A>(2 * s.d_state + 4, cpu::scan_lanes<A>));
      l.add(step_gemm_bytes(s));
      return l;
    }

    struct wptrs {
      const A *in_proj, *conv_w, *conv_b, *x_proj, *dt_proj, *dt_bias, *a_log, *d, *out_proj;
    };
    static wptrs widen_weights(const mamba_weights<S>& w, const mamba_shape& s, A* slot) {
      if constexpr (widened) {
        const std::size_t C = s.d_model, Di = s.d_inner, Ns = s.d_state, R = s.dt_rank;
        A* p = slot;
        const auto take = [&](const S* src, std::size_t n) {
          cpu::widen(src, n, p);
          const A* out = p;
          p += n;
          return out;
        };
        wptrs r;
        r.in_proj = take(w.in_proj, C * 2 * Di);
        r.conv_w = take(w.conv_w, Di * s.d_conv);
        r.conv_b = take(w.conv_b, Di);
        r.x_proj = take(w.x_proj, Di * (R + 2 * Ns));
        r.dt_proj = take(w.dt_proj, R * Di);
        r.dt_bias = take(w.dt_bias, Di);
        r.a_log = take(w.a_log, Di * Ns);
        r.d = take(w.d, Di);
        r.out_proj = take(w.out_proj, Di * C);
        return r;
      } else {
        (void)s;
        (void)slot;
        return {w.in_proj, w.conv_w, w.conv_b, w.x_proj, w.dt_proj, w.dt_bias, w.a_log, w.d,
                w.out_proj};
      }
    }

    static void negexp(const A* a_log, std::size_t n, A* out) {
      for (std::size_t j = 0; j < n; ++j) out[j] = -std::exp(a_log[j]);
    }

    // Rounds an A buffer through storage and writes it to the S slot (a no-op for S = A, where the
    // buffer is the slot).
    static void store(thread_pool& ex, A* values, std::size_t n, S* slot) {
      if constexpr (widened) {
        (void)ex;
        cpu::narrow(static_cast<const A*>(values), n, slot);
        cpu::widen(static_cast<const S*>(slot), n, values);
      } else {
        (void)ex;
        (void)values;
        (void)n;
        (void)slot;
      }
    }

    // c = conv(xi) + conv_b into `c`, rounded through storage (and kept when `keep` is not null).
    static void conv_forward(thread_pool& ex, const mamba_shape& s, const A* xz, const wptrs& wa,
                             A* c, S* keep) {
      const std::size_t N = rows(s), Di = s.d_inner;
      cpu::causal_conv(ex, s, xz, 2 * Di, wa.conv_w, wa.conv_b, c);
      if (keep != nullptr) {
        cpu::narrow(static_cast<const A*>(c), N * Di, keep);
        if constexpr (widened) cpu::widen(static_cast<const S*>(keep), N * Di, c);
      } else {
        cpu::round_through<S>(c, N * Di);
      }
    }

    // Δ = softplus(dt_low·dt_proj + dt_bias), rounded through storage (kept when `keep` is set).
    static void delta_forward(thread_pool& ex, const mamba_shape& s, const A* xdbl,
                              const wptrs& wa, A* delta, S* keep, std::span<std::byte> gs) {
      const std::size_t N = rows(s), Di = s.d_inner, ldx = s.dt_rank + 2 * s.d_state;
      cpu::matmul(ex, xdbl, wa.dt_proj, delta, N, s.dt_rank, Di, false, cpu::ld3{ldx, Di, Di}, gs);
      cpu::for_rows(ex, N, [&](std::size_t n) { softplus_row(delta + n * Di, wa.dt_bias, Di); });
      if (keep != nullptr) {
        cpu::narrow(static_cast<const A*>(delta), N * Di, keep);
        if constexpr (widened) cpu::widen(static_cast<const S*>(keep), N * Di, delta);
      } else {
        cpu::round_through<S>(delta, N * Di);
      }
    }

    // g[K, M] += x[N, K]ᵀ·d[N, M] with packing buffers from the workspace; for bf16/fp16 through
    // tmp in A, rounded once per element.
    static void weight_grad(thread_pool& ex, const A* x, const A* d, S* g, A* tmp, std::size_t N,
                            std::size_t K, std::size_t M, std::span<std::byte> gs) {
      if constexpr (widened) {
        cpu::matmul_at(ex, x, d, tmp, N, K, M, false, cpu::ld3{K, M, M}, gs);
        cpu::narrow_add(static_cast<const A*>(tmp), K * M, g);
      } else {
        (void)tmp;
        cpu::matmul_at(ex, x, d, g, N, K, M, true, cpu::ld3{K, M, M}, gs);
      }
    }

    // The elementwise steps that decoding must reproduce bit for bit, shared by forward and step
    // (vmath: vectorized by the compiler).
    static void silu_row(A* v, std::size_t n) {
      for (std::size_t i = 0; i < n; ++i) v[i] = cpu::vmath::silu(v[i]);
    }
    static void softplus_row(A* v, const A* bias, std::size_t n) {
      for (std::size_t i = 0; i < n; ++i) v[i] = cpu::vmath::softplus(v[i] + bias[i]);
    }
    static void gate_row(A* y, const A* z, std::size_t n) {
      for (std::size_t i = 0; i < n; ++i) y[i] *= cpu::vmath::silu(z[i]);
    }

    // out[j] = Σ_n x[n, j], in row order per column block (thread-count independent).
    static void column_sums(thread_pool& ex, const A* x, std::size_t N, std::size_t M, A* out) {
      ex.parallel_for(cpu::blocks(M, cpu::scan_channels), [&](std::size_t blk, std::size_t) {
        const std::size_t j0 = blk * cpu::scan_channels, j1 = std::min(M, j0 + cpu::scan_channels);
        std::fill(out + j0, out + j1, A(0));
        for (std::size_t n = 0; n < N; ++n)
          for (std::size_t j = j0; j < j1; ++j) out[j] += x[n * M + j];
      });
    }
  };
};

MEMBOUND_NAMESPACE_END
