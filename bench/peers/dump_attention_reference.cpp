// Dumps the naive attention reference (tests/support/attention_reference.hpp) on a few random
// layers, with its inputs, to JSON for bench/peers/attention_reference_check.py to rebuild in
// PyTorch. Not part of the build or of ctest; compiled by hand:
//   g++ -std=c++20 -O2 -I include bench/peers/dump_attention_reference.cpp -o /tmp/dump_attention
//   /tmp/dump_attention > /tmp/attention_reference.json
// nlohmann_json prints doubles with 17 significant digits, so they read back bit-exact.
#include <cmath>
#include <cstdint>
#include <iostream>
#include <vector>

#include <nlohmann/json.hpp>

#include "../../tests/support/attention_reference.hpp"

using namespace membound::reference;

namespace {

struct rng {  // splitmix64, as in the unit test
  std::uint64_t s;
  std::vector<double> fill(std::size_t n, double scale) {
    std::vector<double> v(n);
    for (double& e : v) {
      std::uint64_t z = (s += 0x9e3779b97f4a7c15ull);
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      z ^= z >> 31;
      e = scale * (2.0 * static_cast<double>(z >> 11) * 0x1.0p-53 - 1.0);
    }
    return v;
  }
};

nlohmann::json run_case(const char* name, const attention_config& c, std::size_t offset,
                        std::uint64_t seed) {
  rng r{seed};
  const std::size_t C = c.d_model, HD = c.heads * c.head_dim, KD = c.kv_heads * c.head_dim;
  const double sc = 1.5 / std::sqrt(static_cast<double>(C));
  const attention_weights w{r.fill(C * HD, sc), r.fill(C * KD, sc), r.fill(C * KD, sc),
                            r.fill(HD * C, 1.0 / std::sqrt(static_cast<double>(HD)))};
  const std::vector<double> x = r.fill(c.batch * c.seq * C, 1.0);
  const std::vector<double> dy = r.fill(x.size(), 1.0);
  const attention_forward_result f = attention_forward(c, w, x, offset);
  const attention_grads g = attention_backward(c, w, x, f, dy);

  nlohmann::json j;
  j["name"] = name;
  j["config"] = {{"batch", c.batch},       {"seq", c.seq},           {"d_model", c.d_model},
                 {"heads", c.heads},       {"kv_heads", c.kv_heads}, {"head_dim", c.head_dim},
                 {"causal", c.causal},     {"rope_base", c.rope_base},
                 {"position_offset", offset}};
  j["wq"] = w.wq;  // [C, H*D], y = x·W (nn.Linear.weight is its transpose)
  j["wk"] = w.wk;
  j["wv"] = w.wv;
  j["wo"] = w.wo;
  j["x"] = x;
  j["dy"] = dy;
  j["y"] = f.y;
  j["lse"] = f.lse;  // [B, H, T]
  j["dx"] = g.dx;
  j["dwq"] = g.dwq;
  j["dwk"] = g.dwk;
  j["dwv"] = g.dwv;
  j["dwo"] = g.dwo;
  if (c.causal && offset == 0) {  // decode every position through the KV cache: [B, T, C]
    attention_kv_cache cache = make_attention_kv_cache(c, c.seq);
    std::vector<double> step_y(x.size());
    for (std::size_t t = 0; t < c.seq; ++t) {
      std::vector<double> x_t(c.batch * C);
      for (std::size_t b = 0; b < c.batch; ++b)
        for (std::size_t k = 0; k < C; ++k) x_t[b * C + k] = x[(b * c.seq + t) * C + k];
      const std::vector<double> y_t = attention_step(c, w, cache, x_t);
      for (std::size_t b = 0; b < c.batch; ++b)
        for (std::size_t k = 0; k < C; ++k) step_y[(b * c.seq + t) * C + k] = y_t[b * C + k];
    }
    j["step_y"] = step_y;
  }
  return j;
}

}  // namespace

int main() {
  using cfg = attention_config;
  nlohmann::json cases = nlohmann::json::array();
  cases.push_back(run_case("GQA causal", cfg{2, 7, 16, 4, 2, 8, true, 10000.0}, 0, 1));
  cases.push_back(run_case("GQA not causal", cfg{2, 7, 16, 4, 2, 8, false, 10000.0}, 0, 2));
  cases.push_back(run_case("MQA causal", cfg{2, 6, 16, 4, 1, 8, true, 10000.0}, 0, 3));
  cases.push_back(run_case("MHA T=1", cfg{3, 1, 16, 2, 2, 8, true, 10000.0}, 0, 4));
  cases.push_back(run_case("GQA D=64 base 5e5 offset 5", cfg{1, 33, 48, 6, 2, 64, true, 500000.0},
                           5, 5));
  cases.push_back(run_case("MQA D=256 causal", cfg{1, 9, 32, 2, 1, 256, true, 10000.0}, 0, 6));
  cases.push_back(run_case("MHA D=128 not causal", cfg{2, 17, 24, 3, 3, 128, false, 10000.0}, 0,
                           7));
  std::cout << cases.dump() << "\n";
}
