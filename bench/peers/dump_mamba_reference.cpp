// Dumps the naive Mamba-1 reference (tests/support/mamba_reference.hpp) on a few random blocks,
// with its inputs, to JSON for bench/peers/mamba_reference_check.py to rebuild in PyTorch. Not
// part of the build or of ctest; compiled by hand:
//   g++ -std=c++20 -O2 -I include bench/peers/dump_mamba_reference.cpp -o /tmp/dump_mamba
//   /tmp/dump_mamba > /tmp/mamba_reference.json
// nlohmann_json prints doubles with 17 significant digits, so they read back bit-exact.
#include <cstdint>
#include <iostream>
#include <vector>

#include <nlohmann/json.hpp>

#include "../../tests/support/mamba_reference.hpp"
#include "../../tests/support/test_rng.hpp"

using namespace membound::reference;

namespace {

// mamba_init's weights (with the given dt range), then every tensor nudged by a uniform amount,
// so that nothing sits at a special value (a_log = log(n+1) and d = 1 exactly, dt_proj bounded by
// R^-0.5) and a layout mix-up cannot hide behind a symmetry.
mamba_weights perturbed_weights(const mamba_config& c, membound_test::rng& r, double dt_min,
                                double dt_max) {
  mamba_weights w = mamba_init(c, r, dt_min, dt_max);
  const auto nudge = [&r](std::vector<double>& v, double scale) {
    for (double& e : v) e += r.uniform(-scale, scale);
  };
  nudge(w.in_proj, 0.1);
  nudge(w.conv_w, 0.1);
  nudge(w.conv_b, 0.1);
  nudge(w.x_proj, 0.2);
  nudge(w.dt_proj, 0.3);
  nudge(w.dt_bias, 0.3);
  nudge(w.a_log, 0.3);
  nudge(w.d, 0.5);
  nudge(w.out_proj, 0.1);
  return w;
}

nlohmann::json run_case(const char* name, const mamba_config& c, double dt_min, double dt_max,
                        std::uint64_t seed) {
  membound_test::rng r{seed};
  const mamba_weights w = perturbed_weights(c, r, dt_min, dt_max);
  const std::size_t B = c.batch, T = c.seq, C = c.d_model, Di = c.d_inner, N = c.d_state;
  const std::vector<double> x = r.fill(B * T * C, 1.5);
  const std::vector<double> dy = r.fill(x.size(), 1.0);
  const mamba_forward_result f = mamba_forward(c, w, x);
  const mamba_grads g = mamba_backward(c, w, x, f, dy);

  nlohmann::json j;
  j["name"] = name;
  j["config"] = {{"batch", c.batch},     {"seq", c.seq},         {"d_model", c.d_model},
                 {"d_inner", c.d_inner}, {"d_state", c.d_state}, {"d_conv", c.d_conv},
                 {"dt_rank", c.dt_rank}};
  // Weights in our layout (y = x·W, W [in, out]; nn.Linear.weight is the transpose).
  j["in_proj"] = w.in_proj;    // [C, 2*Di]
  j["conv_w"] = w.conv_w;      // [Di, K]
  j["conv_b"] = w.conv_b;      // [Di]
  j["x_proj"] = w.x_proj;      // [Di, R + 2N]
  j["dt_proj"] = w.dt_proj;    // [R, Di]
  j["dt_bias"] = w.dt_bias;    // [Di]
  j["a_log"] = w.a_log;        // [Di, N]
  j["d"] = w.d;                // [Di]
  j["out_proj"] = w.out_proj;  // [Di, C]
  j["x"] = x;                  // [B, T, C]
  j["dy"] = dy;                // [B, T, C]
  j["out"] = f.out;            // [B, T, C]
  std::vector<double> h_last(B * Di * N);  // [B, Di, N] the scan's state after the last token
  for (std::size_t b = 0; b < B; ++b)
    for (std::size_t e = 0; e < Di * N; ++e)
      h_last[b * Di * N + e] = f.h[(b * T + T - 1) * Di * N + e];
  j["h_last"] = h_last;
  j["dx"] = g.dx;
  j["d_in_proj"] = g.d_in_proj;
  j["d_conv_w"] = g.d_conv_w;
  j["d_conv_b"] = g.d_conv_b;
  j["d_x_proj"] = g.d_x_proj;
  j["d_dt_proj"] = g.d_dt_proj;
  j["d_dt_bias"] = g.d_dt_bias;
  j["d_a_log"] = g.d_a_log;
  j["d_d"] = g.d_d;
  j["d_out_proj"] = g.d_out_proj;

  // The same sequence token by token from a zeroed state: outputs [B, T, C] and the final state.
  mamba_state s = make_mamba_state(c);
  std::vector<double> step_out(x.size());
  for (std::size_t t = 0; t < T; ++t) {
    std::vector<double> x_t(B * C);
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t k = 0; k < C; ++k) x_t[b * C + k] = x[(b * T + t) * C + k];
    const std::vector<double> out_t = mamba_step(c, w, s, x_t);
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t k = 0; k < C; ++k) step_out[(b * T + t) * C + k] = out_t[b * C + k];
  }
  j["step_out"] = step_out;
  j["step_conv_state"] = s.conv;  // [B, Di, K-1]
  j["step_ssm_state"] = s.ssm;    // [B, Di, N]
  return j;
}

}  // namespace

int main() {
  using cfg = mamba_config;
  nlohmann::json cases = nlohmann::json::array();
  // Upstream defaults for d_model 16: expand 2, d_state 16, d_conv 4, dt_rank ceil(16/16) = 1,
  // dt in [0.001, 0.1].
  cases.push_back(run_case("defaults C=16", cfg{2, 9, 16, 32, 16, 4, 1}, 0.001, 0.1, 1));
  // Odd sizes everywhere; dt up to 1, so the state decays within a few tokens.
  cases.push_back(run_case("odd C=5 Di=7 N=3 K=3 R=2", cfg{3, 11, 5, 7, 3, 3, 2}, 0.05, 1.0, 2));
  cases.push_back(run_case("K=1 N=1", cfg{1, 6, 3, 6, 1, 1, 1}, 0.01, 0.5, 3));
  cases.push_back(run_case("T=1", cfg{2, 1, 8, 16, 4, 4, 1}, 0.001, 0.1, 4));
  cases.push_back(run_case("T=2 < K-1", cfg{2, 2, 6, 12, 5, 4, 3}, 0.01, 0.5, 5));
  cases.push_back(run_case("long T=64 C=24 R=2", cfg{2, 64, 24, 48, 8, 4, 2}, 0.001, 0.1, 6));
  std::cout << cases.dump() << "\n";
}
