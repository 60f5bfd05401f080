// Dumps the naive TTT reference (tests/support/ttt_reference.hpp) on a few random layers, with
// its inputs, to JSON for bench/peers/ttt_reference_check.py to rebuild in PyTorch. Built with
// the benchmarks (bench/CMakeLists.txt builds every peers/*.cpp), or by hand:
//   g++ -std=c++20 -O2 -I include bench/peers/dump_ttt_reference.cpp -o /tmp/dump_ttt
//   /tmp/dump_ttt > /tmp/ttt_reference.json
// nlohmann_json prints doubles with 17 significant digits, so they read back bit-exact.
#include <cstdint>
#include <iostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "../../tests/support/test_rng.hpp"
#include "../../tests/support/ttt_reference.hpp"

using namespace membound::reference;

namespace {

// ttt_init's weights, then (scale > 0) every tensor nudged by a uniform amount of that scale, so
// that nothing sits at a special value (norm weights 1, biases and token offsets 0) and a layout
// mix-up cannot hide behind a symmetry; the inner model's weights get enough size for test-time
// learning to change the output visibly. Token offsets move by at most 0.1·scale.
ttt_weights perturbed_weights(const ttt_config& c, membound_test::rng& r, double scale) {
  ttt_weights w = ttt_init(c, r);
  if (scale == 0.0) return w;
  const auto nudge = [&r, scale](std::vector<double>& v, double s) {
    for (double& e : v) e += r.uniform(-s * scale, s * scale);
  };
  nudge(w.wq, 0.3);
  nudge(w.wk, 0.3);
  nudge(w.wv, 0.3);
  nudge(w.ttt_norm_weight, 0.3);
  nudge(w.ttt_norm_bias, 0.3);
  nudge(w.w1, 0.3);
  nudge(w.b1, 0.2);
  nudge(w.w2, 0.2);
  nudge(w.b2, 0.2);
  nudge(w.lr_weight, 0.3);
  nudge(w.lr_bias, 0.5);
  nudge(w.token_offset, 0.1);
  nudge(w.post_norm_weight, 0.3);
  nudge(w.post_norm_bias, 0.3);
  nudge(w.wg, 0.3);
  nudge(w.wo, 0.3);
  return w;
}

// A config in one line: the fields the cases vary.
ttt_config config(ttt_kind kind, bool gate, std::size_t batch, std::size_t seq, std::size_t width,
                  std::size_t heads, std::size_t mini_batch, double base_lr = 1.0) {
  ttt_config c;
  c.batch = batch;
  c.seq = seq;
  c.width = width;
  c.heads = heads;
  c.mini_batch = mini_batch;
  c.kind = kind;
  c.use_gate = gate;
  c.base_lr = base_lr;
  return c;
}

// clamp_at < b: that position's token offset is set so its token scale is clamped at 0.
nlohmann::json run_case(const std::string& name, const ttt_config& c, double nudge,
                        std::uint64_t seed, std::size_t clamp_at = 1000) {
  membound_test::rng r{seed};
  ttt_weights w = perturbed_weights(c, r, nudge);
  if (clamp_at < c.mini_batch) w.token_offset[clamp_at] = -1.0 / double(clamp_at + 1) - 0.3;
  const std::size_t B = c.batch, T = c.seq, C = c.width;
  const std::vector<double> x = r.fill(B * T * C, 1.0);
  const std::vector<double> dy = r.fill(x.size(), 1.0);
  const ttt_forward_result f = ttt_forward(c, w, x);
  const ttt_gradients g = ttt_reference_gradients(c, w, x, dy);

  nlohmann::json j;
  j["name"] = name;
  j["config"] = {{"batch", c.batch},
                 {"seq", c.seq},
                 {"width", c.width},
                 {"heads", c.heads},
                 {"mini_batch", c.mini_batch},
                 {"kind", c.kind == ttt_kind::mlp ? "mlp" : "linear"},
                 {"use_gate", c.use_gate},
                 {"base_lr", c.base_lr},
                 {"rope_base", c.rope_base},
                 {"ttt_norm_eps", c.ttt_norm_eps},
                 {"post_norm_eps", c.post_norm_eps}};
  // Weights in our layout (y = x·W, W [in, out]; nn.Linear.weight is the transpose), under the
  // names of for_each_ttt_tensor; their gradients under "d_" + name.
  for_each_ttt_tensor(w, [&](const char* n, const std::vector<double>& t) { j[n] = t; });
  for_each_ttt_tensor(g.dw, [&](const char* n, const std::vector<double>& t) {
    j[std::string("d_") + n] = t;
  });
  j["x"] = x;              // [B, T, C]
  j["dy"] = dy;            // [B, T, C]
  j["out"] = f.out;        // [B, T, C]
  j["ttt_out"] = f.ttt_out;  // [B, T, C] before post_norm
  j["dx"] = g.dx;          // [B, T, C]

  // The same sequence token by token from make_ttt_state: outputs [B, T, C] and the final state
  // (W_0 of the current mini-batch and the accumulated G, [B, H, ...]).
  ttt_state s = make_ttt_state(c, w);
  std::vector<double> step_out(x.size());
  for (std::size_t t = 0; t < T; ++t) {
    std::vector<double> x_t(B * C);
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t k = 0; k < C; ++k) x_t[b * C + k] = x[(b * T + t) * C + k];
    const std::vector<double> out_t = ttt_step(c, w, s, x_t);
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t k = 0; k < C; ++k) step_out[(b * T + t) * C + k] = out_t[b * C + k];
  }
  j["step_out"] = step_out;
  j["state_w1"] = s.w1;
  j["state_b1"] = s.b1;
  j["state_w2"] = s.w2;
  j["state_b2"] = s.b2;
  j["state_gw1"] = s.gw1;
  j["state_gb1"] = s.gb1;
  j["state_gw2"] = s.gw2;
  j["state_gb2"] = s.gb2;
  return j;
}

}  // namespace

int main() {
  const ttt_kind lin = ttt_kind::linear, mlp = ttt_kind::mlp;
  nlohmann::json cases = nlohmann::json::array();
  cases.push_back(run_case("linear b=4 T=10 (last 2)", config(lin, false, 2, 10, 16, 2, 4), 1, 1));
  cases.push_back(run_case("linear gate b=4 T=16", config(lin, true, 2, 16, 16, 2, 4), 1, 2));
  cases.push_back(run_case("mlp b=4 T=11 (last 3)", config(mlp, false, 2, 11, 16, 2, 4), 1, 3));
  cases.push_back(run_case("mlp gate b=16 T=12 < b", config(mlp, true, 1, 12, 16, 2, 16), 1, 4));
  cases.push_back(run_case("mlp gate C=32 H=4 b=8 T=20 clamp@2",
                           config(mlp, true, 1, 20, 32, 4, 8), 1, 5, 2));
  cases.push_back(run_case("linear gate b=1 T=5", config(lin, true, 2, 5, 8, 2, 1), 1, 6));
  cases.push_back(run_case("linear upstream init b=16 T=20", config(lin, false, 1, 20, 16, 2, 16),
                           0, 7));
  cases.push_back(run_case("mlp upstream init lr=8 b=4 T=9", config(mlp, true, 1, 9, 16, 2, 4, 8.0),
                           0, 8));
  std::cout << cases.dump() << "\n";
}
