// Element-wise math that the CPU backend and the CUDA kernels share: SiLU and its derivative,
// softplus (Mamba's Δ), the SwiGLU gate forward and backward, and one AdamW step on one element. One definition for both
// backends, so a GPU result differs from the CPU's only by the order of sums and the device's
// exp/sqrt, never by a formula. Host-only header (no CUDA include); under nvcc every function is
// __host__ __device__.
//
//   A act = swiglu(a, b);                       // silu(a)·b
//   swiglu_backward(a, b, dact, da, db);         // ∂/∂a and ∂/∂b of dact·silu(a)·b
//   const auto k = adamw_coefficients<float>::at(t, lr, beta1, beta2, eps, wd, decay);
//   adamw_step(k, grad, m, v, p);                // p updated in place
#pragma once

#include <cmath>
#include <cstdint>

#include "membound/core/config.hpp"

MEMBOUND_NAMESPACE_BEGIN

namespace detail {
// std::exp and std::sqrt are host functions; the device pass uses CUDA's float/double overloads.
template <typename A>
MEMBOUND_HOST_DEVICE inline A exp_of(A v) {
#if MEMBOUND_DEVICE_PASS
  return ::exp(v);
#else
  return std::exp(v);
#endif
}
template <typename A>
MEMBOUND_HOST_DEVICE inline A log1p_of(A v) {
#if MEMBOUND_DEVICE_PASS
  return ::log1p(v);
#else
  return std::log1p(v);
#endif
}
template <typename A>
MEMBOUND_HOST_DEVICE inline A expm1_of(A v) {
#if MEMBOUND_DEVICE_PASS
  return ::expm1(v);
#else
  return std::expm1(v);
#endif
}
template <typename A>
MEMBOUND_HOST_DEVICE inline A sqrt_of(A v) {
#if MEMBOUND_DEVICE_PASS
  return ::sqrt(v);
#else
  return std::sqrt(v);
#endif
}
}  // namespace detail

// The logistic sigmoid 1/(1 + e^-v).
template <typename A>
MEMBOUND_HOST_DEVICE inline A sigmoid(A v) {
  return A(1) / (A(1) + detail::exp_of(-v));
}

// SiLU (swish): v·sigmoid(v), as v/(1 + e^-v) (one division, no sigmoid rounding first).
template <typename A>
MEMBOUND_HOST_DEVICE inline A silu(A v) {
  return v / (A(1) + detail::exp_of(-v));
}

// d silu / dv = σ(v)·(1 + v·(1 − σ(v))).
template <typename A>
MEMBOUND_HOST_DEVICE inline A silu_grad(A v) {
  const A s = sigmoid(v);
  return s * (A(1) + v * (A(1) - s));
}

// softplus log(1 + e^v), without overflow for large v (the CPU Mamba's formula).
template <typename A>
MEMBOUND_HOST_DEVICE inline A softplus(A v) {
  return v > A(0) ? v + detail::log1p_of(detail::exp_of(-v)) : detail::log1p_of(detail::exp_of(v));
}

// d softplus / dv = σ(v), from the output alone: 1 − e^(−softplus(v)) = −expm1(−out).
template <typename A>
MEMBOUND_HOST_DEVICE inline A softplus_grad_from_output(A out) {
  return -detail::expm1_of(-out);
}

// The SwiGLU gate: silu(a)·b.
template <typename A>
MEMBOUND_HOST_DEVICE inline A swiglu(A a, A b) {
  return silu(a) * b;
}

// Backward of act = silu(a)·b given dact: da = dact·b·silu'(a), db = dact·silu(a) (the latter as
// dact·a·σ(a), sharing the one exp). da and db may alias each other's inputs: all reads come first.
template <typename A>
MEMBOUND_HOST_DEVICE inline void swiglu_backward(A a, A b, A dact, A& da, A& db) {
  const A s = sigmoid(a);
  const A ga = dact * b * s * (A(1) + a * (A(1) - s));
  const A gb = dact * a * s;
  da = ga;
  db = gb;
}

// The per-step constants of AdamW with decoupled weight decay and bias correction, in the moment
// type T, computed once on the host in double and rounded once (both backends use these values).
template <typename T>
struct adamw_coefficients {
  T b1, b2;     // β1, β2
  T step;       // lr / (1 − β1^t): the bias-corrected first moment's step size
  T inv_b2t;    // 1 / (1 − β2^t)
  T eps;
  T wd;         // lr·λ when the parameter decays, else 0

  // At step t (1-based).
  static adamw_coefficients at(std::uint64_t t, double lr, double beta1, double beta2, double eps,
                               double weight_decay, bool decay) {
    const double b1t = 1.0 - std::pow(beta1, static_cast<double>(t));
    const double b2t = 1.0 - std::pow(beta2, static_cast<double>(t));
    adamw_coefficients k;
    k.b1 = static_cast<T>(beta1);
    k.b2 = static_cast<T>(beta2);
    k.step = static_cast<T>(lr / b1t);
    k.inv_b2t = static_cast<T>(1.0 / b2t);
    k.eps = static_cast<T>(eps);
    k.wd = decay ? static_cast<T>(lr * weight_decay) : T(0);
    return k;
  }
};

// One AdamW update of one parameter p with gradient g (already multiplied by the gradient scale):
// m ← β1·m + (1−β1)·g, v ← β2·v + (1−β2)·g², p ← p − lr·λ·p, p ← p − step·m/(√(v/(1−β2^t)) + ε).
template <typename T>
MEMBOUND_HOST_DEVICE inline void adamw_step(const adamw_coefficients<T>& k, T g, T& m, T& v, T& p) {
  m = k.b1 * m + (T(1) - k.b1) * g;
  v = k.b2 * v + (T(1) - k.b2) * g * g;
  p -= k.wd * p;
  p -= k.step * m / (detail::sqrt_of(v * k.inv_b2t) + k.eps);
}

// GELU, tanh form (ttt-lm-pytorch's, the TTT layers' inner MLP and gate), and its first two
// derivatives: the one definition for the CUDA TTT kernels and cpu::gelu_tanh (backend/cpu/ttt.hpp).
namespace detail {
template <typename A>
MEMBOUND_HOST_DEVICE inline A tanh_of(A v) {
#if MEMBOUND_DEVICE_PASS
  return ::tanh(v);
#else
  return std::tanh(v);
#endif
}
}  // namespace detail
template <typename A>
MEMBOUND_HOST_DEVICE inline A gelu_tanh_f(A x) {
  const A c = A(0.7978845608028654), a = A(0.044715);
  return A(0.5) * x * (A(1) + detail::tanh_of(c * (x + a * x * x * x)));
}
template <typename A>
MEMBOUND_HOST_DEVICE inline A gelu_tanh_d1(A x) {
  const A c = A(0.7978845608028654), a = A(0.044715);
  const A t = detail::tanh_of(c * (x + a * x * x * x)), u1 = c * (A(1) + A(3) * a * x * x);
  return A(0.5) * (A(1) + t) + A(0.5) * x * (A(1) - t * t) * u1;
}
template <typename A>
MEMBOUND_HOST_DEVICE inline A gelu_tanh_d2(A x) {
  const A c = A(0.7978845608028654), a = A(0.044715);
  const A t = detail::tanh_of(c * (x + a * x * x * x)), u1 = c * (A(1) + A(3) * a * x * x);
  const A u2 = A(6) * a * c * x;
  return (A(1) - t * t) * (u1 - x * t * u1 * u1 + A(0.5) * x * u2);
}

MEMBOUND_NAMESPACE_END
