// A mixture of experts against the dense MLP with the same active parameters per token: two
// attention blocks (C = 128, 4 heads, fp32), their feed-forward either the dense SwiGLU MLP of
// hidden width 2·F, or E SwiGLU experts of width F with top-2 routing (the same 2·3·C·F weights
// touched per token, plus the router's C·E), at capacity factor 1.25 (Switch's default: some
// choices dropped) and without a capacity (every choice computed). One micro-batch forward, loss
// and backward (schedule none) on windows of --data, timed as the best of --reps after a warm-up.
// Reported per mode: parameters, active feed-forward parameters per token, tokens per second,
// the plan's peak and the measured one (the budget allocator's), and the choices dropped. One
// run, so the ratios compare measurements taken side by side.
//
// Run: ./build/release/bench/bench_moe [--batch N] [--seq N] [--experts N] [--threads N] [--reps N] [--data FILE]
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "bench_flags.hpp"
#include "membound/membound.hpp"
#include "membound/model/planner.hpp"

namespace mb = membound;
using P = mb::fp32_precision;
using dense_net = mb::model<mb::embedding<P>, mb::block<mb::attention<P>>, mb::block<mb::attention<P>>, mb::lm_head<P>>;
using moe_net = mb::model<mb::embedding<P>, mb::block<mb::attention<P>, mb::moe_ffn>,
                          mb::block<mb::attention<P>, mb::moe_ffn>, mb::lm_head<P>>;

namespace {

double mib(std::size_t b) { return static_cast<double>(b) / (1024.0 * 1024.0); }

struct result {
  std::size_t params = 0, plan_peak = 0, measured_peak = 0, dropped = 0, choices = 0;
  double seconds = 1e300;
};

template <typename Model>
result run(const Model& m, mb::batch_shape b, const std::vector<std::int32_t>& x,
           const std::vector<std::int32_t>& y, std::size_t threads, int reps) {
  result r;
  mb::thread_pool pool(threads);
  mb::plan_options o;
  o.threads = threads;
  o.head_chunk = 256;
  const mb::training_plan p = mb::make_plan(m, b, mb::schedules::none{}, o);
  // Weights, gradients and AdamW's state from the budget allocator, as the plan counts them.
  mb::budget_allocator<mb::system_allocator> alloc(std::size_t{1} << 36);
  const std::size_t wb = m.weight_bytes();
  auto* w = static_cast<float*>(alloc.allocate(wb, mb::default_alignment, mb::memory_tag::weights));
  auto* g = static_cast<float*>(alloc.allocate(wb, mb::default_alignment, mb::memory_tag::gradients));
  void* opt = alloc.allocate(p.optimizer, mb::default_alignment, mb::memory_tag::optimizer);
  m.init_weights(w, 1);
  std::fill(g, g + m.parameter_elements(), 0.0f);
  mb::moe_stats st;
  for (int rep = 0; rep <= reps; ++rep) {  // rep 0 warms up
    const auto t0 = std::chrono::steady_clock::now();
    (void)m.forward_backward(w, g, x.data(), y.data(), b, p.ops, p.head_chunk, 1.0, alloc, pool, {}, &st);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (rep > 0) r.seconds = std::min(r.seconds, s);
  }
  r.params = m.parameter_elements();
  r.plan_peak = p.peak_bytes;
  r.measured_peak = alloc.stats().peak_requested;
  r.dropped = st.dropped;
  r.choices = st.choices;
  alloc.deallocate(opt, p.optimizer, mb::default_alignment, mb::memory_tag::optimizer);
  alloc.deallocate(g, wb, mb::default_alignment, mb::memory_tag::gradients);
  alloc.deallocate(w, wb, mb::default_alignment, mb::memory_tag::weights);
  return r;
}

}  // namespace

static int bench_main(int argc, char** argv) {
  std::size_t batch = 4, seq = 256, experts = 8, threads = 2;
  int reps = 3;
  std::string data = MEMBOUND_BENCH_DATA;
  bench_flags::args a(argc, argv,
                      "usage: bench_moe [--batch N] [--seq N] [--experts N] [--threads N] [--reps N] [--data FILE]");
  while (a.next()) {
    if (a.is("--batch")) batch = a.whole(1, 1024);
    else if (a.is("--seq")) seq = a.whole(2, 1u << 16);
    else if (a.is("--experts")) experts = a.whole(2, 256);
    else if (a.is("--threads")) threads = a.whole(1, 256);
    else if (a.is("--reps")) reps = static_cast<int>(a.whole(1, 100));
    else if (a.is("--data")) data = a.text();
    else a.unknown();
  }
  std::ifstream in(data, std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (text.size() < batch * seq + 1) {
    throw mb::invalid_argument("--data", "a readable text of at least batch · seq + 1 bytes", data,
                               "Pass --data FILE, or a smaller --batch or --seq");
  }
  // Consecutive windows from the start of the text, each target the next byte.
  const mb::batch_shape b{batch, seq};
  std::vector<std::int32_t> x(b.tokens()), y(b.tokens());
  for (std::size_t i = 0; i < b.tokens(); ++i) {
    x[i] = static_cast<unsigned char>(text[i]);
    y[i] = static_cast<unsigned char>(text[i + 1]);
  }

  mb::model_config c;
  c.vocab = 256;
  c.width = 128;
  c.heads = 4;
  const std::size_t F = c.hidden() / 2;  // each expert half the dense width: top-2 touches as many weights
  mb::model_config dense = c;
  dense.mlp_hidden = 2 * F;
  mb::model_config moe = c;
  moe.moe.experts = experts;
  moe.moe.top_k = 2;
  moe.moe.hidden = F;
  moe.moe.capacity_factor = 1.25;
  mb::model_config open = moe;
  open.moe.capacity_factor = 0.0;

  const result rd = run(dense_net(dense), b, x, y, threads, reps);
  const result rc = run(moe_net(moe), b, x, y, threads, reps);
  const result ro = run(moe_net(open), b, x, y, threads, reps);
  const double C = static_cast<double>(c.width);
  std::printf("2 attention blocks, C = 128, 4 heads, fp32, batch %zu x %zu tokens, %zu threads, best of %d\n", batch,
              seq, threads, reps);
  std::printf("%-22s %10s %12s %11s %12s %12s %9s\n", "feed-forward", "params", "active FFN", "tokens/s", "plan peak",
              "measured", "dropped");
  const auto row = [&](const char* name, const result& r, double active) {
    std::printf("%-22s %10zu %12.0f %11.0f %8.2f MiB %8.2f MiB %8.1f%%\n", name, r.params, active,
                static_cast<double>(b.tokens()) / r.seconds, mib(r.plan_peak), mib(r.measured_peak),
                r.choices == 0 ? 0.0 : 100.0 * static_cast<double>(r.dropped) / static_cast<double>(r.choices));
  };
  const double Fd = static_cast<double>(F);
  char label[64];
  std::snprintf(label, sizeof label, "dense SwiGLU F=%zu", 2 * F);
  row(label, rd, 3.0 * C * 2.0 * Fd);
  std::snprintf(label, sizeof label, "%zu experts top-2 c1.25", experts);
  row(label, rc, 2.0 * 3.0 * C * Fd + C * static_cast<double>(experts));
  std::snprintf(label, sizeof label, "%zu experts top-2 open", experts);
  row(label, ro, 2.0 * 3.0 * C * Fd + C * static_cast<double>(experts));
  std::printf("tokens/s against dense: capacity 1.25 %.2fx, no capacity %.2fx; peak against dense: %.2fx, %.2fx\n",
              rd.seconds / rc.seconds, rd.seconds / ro.seconds,
              static_cast<double>(rc.plan_peak) / static_cast<double>(rd.plan_peak),
              static_cast<double>(ro.plan_peak) / static_cast<double>(rd.plan_peak));
  return 0;
}

int main(int argc, char** argv) {
  return bench_flags::run([&] { return bench_main(argc, argv); });
}
