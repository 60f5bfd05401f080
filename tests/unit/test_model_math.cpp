// The element math both backends share (core/element_math.hpp) against double-precision formulas
// and central finite differences: SiLU, its derivative, the SwiGLU gate and its backward, and one
// AdamW step (written out from Loshchilov & Hutter, bias correction included).
//
// Tolerances: in double the formulas differ from the references only by rounding order (1e-14
// relative); in float by a few ulps (2^-23 each) through exp: 1e-6. The finite differences use
// h = 1e-5 in double, whose truncation error (h²·f'''/6) stays below 1e-9.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>

#include "membound/core/element_math.hpp"
#include "membound/optimizer/adamw.hpp"

namespace mb = membound;

namespace {

double rel(double got, double want, double floor = 1e-12) {
  return std::abs(got - want) / (std::abs(want) + floor);
}

constexpr double points[] = {-30.0, -8.5, -3.0, -1.0, -0.25, 0.0, 1e-7, 0.3, 1.0, 2.5, 7.0, 25.0};

}  // namespace

TEST_CASE("silu and swiglu match the double formulas") {
  for (double v : points) {
    const double want = v / (1.0 + std::exp(-v));
    CHECK(rel(mb::silu(v), want) < 1e-14);
    CHECK(rel(static_cast<double>(mb::silu(static_cast<float>(v))), want, 1e-30) < 1e-6);
    for (double b : {-2.0, 0.5, 3.0}) {
      CHECK(rel(mb::swiglu(v, b), want * b) < 1e-14);
      CHECK(rel(static_cast<double>(mb::swiglu(static_cast<float>(v), static_cast<float>(b))), want * b, 1e-30) <
            2e-6);
    }
    CHECK(rel(mb::sigmoid(v), 1.0 / (1.0 + std::exp(-v))) < 1e-14);
  }
}

TEST_CASE("silu_grad and swiglu_backward match finite differences") {
  const double h = 1e-5;
  for (double a : points) {
    const double fd = (mb::silu(a + h) - mb::silu(a - h)) / (2 * h);
    CHECK(std::abs(mb::silu_grad(a) - fd) < 1e-9);
    for (double b : {-1.5, 0.75, 2.0}) {
      const double dact = 0.625;
      double da = 0, db = 0;
      mb::swiglu_backward(a, b, dact, da, db);
      const double fda = dact * (mb::swiglu(a + h, b) - mb::swiglu(a - h, b)) / (2 * h);
      const double fdb = dact * (mb::swiglu(a, b + h) - mb::swiglu(a, b - h)) / (2 * h);
      CHECK(std::abs(da - fda) < 1e-9);
      CHECK(std::abs(db - fdb) < 1e-9);
      CHECK(rel(da, dact * b * mb::silu_grad(a)) < 1e-13);
      CHECK(rel(db, dact * mb::silu(a)) < 1e-13);
      float fa = 0, fb = 0;
      mb::swiglu_backward(static_cast<float>(a), static_cast<float>(b), static_cast<float>(dact), fa, fb);
      CHECK(std::abs(fa - da) <= 1e-6 * (std::abs(da) + 1e-6));
      CHECK(std::abs(fb - db) <= 1e-6 * (std::abs(db) + 1e-6));
    }
  }
}

TEST_CASE("swiglu_backward reads before it writes, so outputs may alias the input") {
  double d = 0.5, other = 0;
  mb::swiglu_backward(1.25, -0.5, d, other, d);  // db lands on dact's variable
  double da = 0, db = 0;
  mb::swiglu_backward(1.25, -0.5, 0.5, da, db);
  CHECK(other == da);
  CHECK(d == db);
}

TEST_CASE("adamw_step is AdamW with decoupled decay and bias correction") {
  const double lr = 3e-3, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
  for (bool decay : {true, false}) {
    double m = 0, v = 0, p = 0.7;  // double: the step itself, compared with the written-out formula
    double rm = 0, rv = 0, rp = 0.7;
    for (std::uint64_t t = 1; t <= 5; ++t) {
      const double g = 0.3 * std::sin(static_cast<double>(t)) - 0.05;
      const auto k = mb::adamw_coefficients<double>::at(t, lr, b1, b2, eps, wd, decay);
      mb::adamw_step(k, g, m, v, p);
      rm = b1 * rm + (1 - b1) * g;
      rv = b2 * rv + (1 - b2) * g * g;
      const double mhat = rm / (1 - std::pow(b1, double(t))), vhat = rv / (1 - std::pow(b2, double(t)));
      rp = rp - (decay ? lr * wd * rp : 0.0) - lr * mhat / (std::sqrt(vhat) + eps);
      CHECK(rel(m, rm) < 1e-14);
      CHECK(rel(v, rv) < 1e-14);
      // eps sits outside the corrected √v, as in the reference; the step folds 1/(1−β1^t) into lr.
      CHECK(rel(p, rp) < 1e-12);
    }
  }
}

TEST_CASE("the CPU optimizer runs the shared step") {
  // adamw<float>::update over 3 values equals adamw_step applied to each, bit for bit.
  float w[3] = {0.5f, -1.25f, 2.0f};
  const float g[3] = {0.1f, -0.3f, 0.02f};
  alignas(4) unsigned char state[mb::adamw<float>::state_bytes(3)];
  mb::adamw<float>::init(w, 3, state, sizeof(state));
  mb::thread_pool pool(1);
  mb::adamw_config c;
  mb::adamw<float>::update(w, g, state, 3, 0, 3, 1, 1e-2, c, true, 0.5, pool);
  const auto k = mb::adamw_coefficients<float>::at(1, 1e-2, c.beta1, c.beta2, c.eps, c.weight_decay, true);
  const float w0[3] = {0.5f, -1.25f, 2.0f};
  for (int i = 0; i < 3; ++i) {
    float m = 0, v = 0, p = w0[i];
    mb::adamw_step(k, g[i] * 0.5f, m, v, p);
    CHECK(p == w[i]);
  }
}
