// Runs membound's mixture of experts (moe_mlp<fp64_precision>, the CPU backend) on a few random
// layers without a capacity, top-2, renormalized (Mixtral's routing), and dumps inputs, weights,
// output, balancing loss and every gradient as JSON for bench/peers/moe_reference_check.py to
// compare with transformers' MixtralSparseMoeBlock. Built with the benchmarks (bench/CMakeLists.txt
// builds every peers/*.cpp), or by hand:
//   g++ -std=c++20 -O2 -I include bench/peers/dump_moe.cpp -o /tmp/dump_moe
//   /tmp/dump_moe > /tmp/moe.json
// nlohmann_json prints doubles with 17 significant digits, so they read back bit-exact.
#include <cstdint>
#include <iostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "membound/core/parallel.hpp"
#include "membound/layers/moe_mlp.hpp"
#include "membound/memory/allocator.hpp"
#include "membound/memory/system_allocator.hpp"

#include "../../tests/support/test_rng.hpp"

namespace mb = membound;
using moe = mb::moe_mlp<mb::fp64_precision>;

namespace {

// A buffer of `bytes` from the system allocator, aligned as the layer asks.
struct bytes_buffer {
  mb::system_allocator& a;
  std::size_t n;
  void* p;
  bytes_buffer(mb::system_allocator& alloc, std::size_t bytes) : a(alloc), n(bytes), p(alloc.allocate(bytes)) {}
  ~bytes_buffer() { a.deallocate(p, n); }
  bytes_buffer(const bytes_buffer&) = delete;
  bytes_buffer& operator=(const bytes_buffer&) = delete;
};

nlohmann::json run_case(const std::string& name, std::size_t batch, std::size_t seq, std::size_t width,
                        std::size_t hidden, std::size_t experts, double aux_weight, std::uint64_t seed) {
  mb::moe_shape s;
  s.batch = batch;
  s.seq = seq;
  s.width = width;
  s.hidden = hidden;
  s.experts = experts;
  s.top_k = 2;
  s.capacity_factor = 0.0;  // Mixtral computes every choice
  s.renormalize = true;
  s.aux_loss_weight = aux_weight;
  const std::size_t N = s.tokens(), C = width, F = hidden, E = experts;
  membound_test::rng r{seed};
  // Router logits of order 1, so that the top-2 choices are well apart from ties.
  const std::vector<double> router = r.fill(C * E, 1.0), w_gate = r.fill(E * C * F, 0.3),
                            w_up = r.fill(E * C * F, 0.3), w_down = r.fill(E * F * C, 0.3), x = r.fill(N * C, 1.0),
                            dy = r.fill(N * C, 1.0);
  std::vector<double> y(N * C), dx(N * C), g_router(C * E, 0.0), g_gate(E * C * F, 0.0), g_up(E * C * F, 0.0),
      g_down(E * F * C, 0.0);
  mb::thread_pool pool(1);
  mb::system_allocator sys;
  bytes_buffer saved(sys, moe::saved_bytes(s)), fws(sys, moe::forward_workspace_bytes(s, 1)),
      bws(sys, moe::backward_workspace_bytes(s, 1));
  const moe::weights w{router.data(), w_gate.data(), w_up.data(), w_down.data()};
  mb::moe_stats st;
  moe::forward(s, w, x.data(), y.data(), saved.p, saved.n, fws.p, fws.n, pool, &st);
  moe::backward(s, w, x.data(), saved.p, saved.n, dy.data(), dx.data(),
                {g_router.data(), g_gate.data(), g_up.data(), g_down.data()}, bws.p, bws.n, pool);

  nlohmann::json j;
  j["name"] = name;
  j["config"] = {{"batch", batch}, {"seq", seq}, {"width", C}, {"hidden", F}, {"experts", E}, {"top_k", 2},
                 {"aux_loss_weight", aux_weight}};
  // Our layout: y = x·W; router [C, E], w_gate and w_up [E, C, F], w_down [E, F, C].
  j["router"] = router;
  j["w_gate"] = w_gate;
  j["w_up"] = w_up;
  j["w_down"] = w_down;
  j["x"] = x;    // [B, T, C]
  j["dy"] = dy;  // [B, T, C]
  j["y"] = y;
  j["aux_loss"] = st.aux_loss;  // α · E · Σ f_e P_e
  j["dropped"] = st.dropped;
  // Backward of L = Σ y·dy + aux_loss (the layer adds the balancing loss's gradient itself).
  j["dx"] = dx;
  j["d_router"] = g_router;
  j["d_w_gate"] = g_gate;
  j["d_w_up"] = g_up;
  j["d_w_down"] = g_down;
  return j;
}

}  // namespace

int main() {
  nlohmann::json out = nlohmann::json::array();
  out.push_back(run_case("4 experts, B 2 x T 9, C 16, F 24", 2, 9, 16, 24, 4, 0.01, 11));
  out.push_back(run_case("8 experts, B 1 x T 33, C 32, F 20", 1, 33, 32, 20, 8, 0.02, 12));
  out.push_back(run_case("2 experts (every token takes both), B 3 x T 5, C 8, F 12", 3, 5, 8, 12, 2, 0.05, 13));
  std::cout << out.dump() << "\n";
  return 0;
}
