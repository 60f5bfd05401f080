// CPU kernels of the Mamba block: the causal depthwise convolution, softplus/SiLU, and the
// chunked selective scan forward and backward. Everything works in the accumulator type A on
// buffers the front end (layers/mamba.hpp) has carved; nothing allocates.
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
#include <type_traits>

#include "membound/backend/cpu/linalg.hpp"
#include "membound/core/config.hpp"
#include "membound/core/dtype.hpp"
#include "membound/core/parallel.hpp"
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
constexpr std::size_t scan_backward_scratch(std::size_t chunk, std::size_t d_state) noexcept {
  return (chunk + 4) * scan_channels * d_state + 2 * d_state * max_scan_lanes + scan_channels +
         8 * max_scan_lanes;
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

// c[n, i] = bias[i] + Σ_k w[i, k] · xi[b, t − (K−1) + k, i], xi read with row stride ldx (it is
// the x half of xz). Zero before the sequence's start.
template <typename A>
void causal_conv(thread_pool& pool, const mamba_shape& s, const A* xi, std::size_t ldx,
                 const A* w, const A* bias, A* c) {
  const std::size_t T = s.seq, Di = s.d_inner, K = s.d_conv, N = s.batch * T;
  pool.parallel_for(blocks(N, row_block), [&](std::size_t blk, std::size_t) {
    const std::size_t r0 = blk * row_block, r1 = std::min(N, r0 + row_block);
    for (std::size_t n = r0; n < r1; ++n) {
      const std::size_t t = n % T;
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
      for (std::size_t t = 0; t < T; ++t) {
        const std::size_t n = b * T + t;
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
          if (t + K - 1 - k < T) {  // dxi: xi at t fed output t + K−1 − k through tap k
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
  pool.parallel_for(blocks(Di, scan_channels), [&](std::size_t blk, std::size_t thread) {
    const std::size_t i0 = blk * scan_channels, ni = std::min(scan_channels, Di - i0);
    const std::size_t G = blocks(ni, W), gs = Ns * W;
    A* hs = scratch + thread * scan_backward_scratch(Lc, Ns);  // [Lc + 1][G][Ns][W]: entry, then
    A* dh = hs + (Lc + 1) * bs;                                 // the state after each step
    A* at = dh + bs;
    A* dav = at + bs;                     // dA sums [G][Ns][W]
    A* pb = dav + bs;                     // dB lane sums [Ns][W]
    A* pc = pb + Ns * max_scan_lanes;     // dC lane sums [Ns][W]
    A* ddv = pc + Ns * max_scan_lanes;    // dD sums [G·W]
    A* pad = ddv + scan_channels;         // padded rows of a partial group
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
          std::copy(hc - bs, hc - bs + G * gs, hc);
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
            scan_group_back_step(lanes_of(dy + n * Di + ch, nw, pad),
                                 lanes_of(u + n * Di + ch, nw, pad + W),
                                 lanes_of(delta + n * Di + ch, nw, pad + 2 * W),
                                 lanes_of(dskip + ch, nw, pad + 3 * W), hg, hg - bs,
                                 static_cast<const A*>(at + g * gs), bt, ct, Ns, dh + g * gs,
                                 dav + g * gs, pb, pc, ddv + g * W, ddo, duo);
            if (nw != W) {
              std::copy(ddo, ddo + nw, ddelta + n * Di + ch);
              std::copy(duo, duo + nw, du + n * Di + ch);
            }
          }
          lane_sums(pb, Ns, pblk + n * 2 * Ns);
          lane_sums(pc, Ns, pblk + n * 2 * Ns + Ns);
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

MEMBOUND_NAMESPACE_END
