// Generation: a model decoding one token at a time (model::decode_step, each block carrying its
// state) against the same model recomputing the whole prefix for every token
// (model::next_token_logits over tokens 0..t, what the example trainer's sampler did before it
// decoded). The example's hybrid (TTT-Linear, attention, Mamba, attention; C = 128, 4 heads, fp32,
// 256 byte ids) and the same with both attention layers local (window --window). Reported: the
// seconds to feed --tokens tokens to --batch sequences each way, their ratio, and the decoding
// state's bytes at several max_len (the local model's are the same at any length). One run, so
// the ratios compare measurements taken side by side. No external peer: PyTorch has no decoding
// for this hybrid to compare with.
//
// Run: ./build/release/bench/bench_decode [--tokens N] [--batch N] [--window N] [--threads N]
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "bench_flags.hpp"
#include "membound/membound.hpp"

namespace mb = membound;
using P = mb::fp32_precision;
using hybrid_net = mb::model<mb::embedding<P>, mb::block<mb::ttt_linear<P>>, mb::block<mb::attention<P>>,
                             mb::block<mb::mamba<P>>, mb::block<mb::attention<P>>, mb::lm_head<P>>;
using local_net = mb::model<mb::embedding<P>, mb::block<mb::ttt_linear<P>>,
                            mb::block<mb::attention<P, mb::local_attention>>, mb::block<mb::mamba<P>>,
                            mb::block<mb::attention<P, mb::local_attention>>, mb::lm_head<P>>;

namespace {

double mib(std::size_t b) { return static_cast<double>(b) / (1024.0 * 1024.0); }

struct result {
  double decode_s = 0, prefix_s = 0, max_diff = 0;
};

template <typename Model>
result run(const Model& m, std::size_t batch, std::size_t tokens, std::size_t threads) {
  const std::size_t V = m.config().vocab;
  mb::thread_pool pool(threads);
  mb::budget_allocator<mb::system_allocator> alloc(std::size_t{1} << 36);
  const std::size_t wb = m.weight_bytes();
  auto* w = static_cast<float*>(alloc.allocate(wb, mb::default_alignment, mb::memory_tag::weights));
  m.init_weights(w, 1);
  // Token t of sequence s at [s · tokens + t]: byte-like ids from a fixed recurrence.
  std::vector<std::int32_t> ids(batch * tokens);
  std::uint32_t r = 5;
  for (auto& v : ids) v = static_cast<std::int32_t>((r = r * 1664525u + 1013904223u) >> 24);
  std::vector<double> decoded(batch * V), prefix(batch * V);
  result res;

  const std::size_t sb = m.decode_state_bytes(batch, tokens), wsb = m.decode_workspace_bytes(batch, tokens, threads);
  void* state = alloc.allocate(sb, mb::default_alignment, mb::memory_tag::activations);
  void* ws = alloc.allocate(wsb, mb::default_alignment, mb::memory_tag::workspace);
  std::vector<std::int32_t> column(batch);
  auto t0 = std::chrono::steady_clock::now();
  auto d = m.start_decoding(w, state, sb, batch, tokens, pool);
  for (std::size_t t = 0; t < tokens; ++t) {
    for (std::size_t s = 0; s < batch; ++s) column[s] = ids[s * tokens + t];
    m.decode_step(w, d, column.data(), decoded.data(), ws, wsb, pool);  // logits at every token, as sampling needs
  }
  res.decode_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  alloc.deallocate(ws, wsb, mb::default_alignment, mb::memory_tag::workspace);
  alloc.deallocate(state, sb, mb::default_alignment, mb::memory_tag::activations);

  t0 = std::chrono::steady_clock::now();
  std::vector<std::int32_t> head;
  for (std::size_t t = 0; t < tokens; ++t) {
    head.resize(batch * (t + 1));
    for (std::size_t s = 0; s < batch; ++s)
      std::copy_n(ids.begin() + static_cast<std::ptrdiff_t>(s * tokens), t + 1,
                  head.begin() + static_cast<std::ptrdiff_t>(s * (t + 1)));
    m.next_token_logits(w, head.data(), {batch, t + 1}, prefix.data(), alloc, pool);
  }
  res.prefix_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (std::size_t k = 0; k < prefix.size(); ++k) res.max_diff = std::max(res.max_diff, std::abs(prefix[k] - decoded[k]));
  alloc.deallocate(w, wb, mb::default_alignment, mb::memory_tag::weights);
  return res;
}

}  // namespace

static int bench_main(int argc, char** argv) {
  std::size_t tokens = 512, batch = 1, window = 64, threads = 2;
  bench_flags::args a(argc, argv, "usage: bench_decode [--tokens N] [--batch N] [--window N] [--threads N]");
  while (a.next()) {
    if (a.is("--tokens")) tokens = a.whole(1, 1u << 16);
    else if (a.is("--batch")) batch = a.whole(1, 256);
    else if (a.is("--window")) window = a.whole(1, 1u << 20);
    else if (a.is("--threads")) threads = a.whole(1, 256);
    else a.unknown();
  }
  mb::model_config c;
  c.vocab = 256;
  c.width = 128;
  c.heads = 4;
  c.attention_window = window;
  const hybrid_net hybrid(c);
  const local_net local(c);
  std::printf("4 blocks (ttt, attn, mamba, attn), C = 128, 4 heads, fp32, %zu sequence(s) x %zu tokens, %zu threads\n",
              batch, tokens, threads);
  std::printf("%-26s %12s %14s %8s %12s\n", "model", "decode s", "re-forward s", "ratio", "max |diff|");
  const auto row = [&](const char* name, const result& r) {
    std::printf("%-26s %12.3f %14.3f %7.1fx %12.2e\n", name, r.decode_s, r.prefix_s, r.prefix_s / r.decode_s,
                r.max_diff);
  };
  row("global attention", run(hybrid, batch, tokens, threads));
  char label[64];
  std::snprintf(label, sizeof label, "local attention (W %zu)", window);
  row(label, run(local, batch, tokens, threads));
  std::printf("decoding state for %zu sequence(s):\n%-12s %16s %16s\n", batch, "max_len", "global MiB", "local MiB");
  for (std::size_t L : {std::size_t{1} << 10, std::size_t{1} << 16, std::size_t{1} << 20})
    std::printf("%-12zu %16.2f %16.2f\n", L, mib(hybrid.decode_state_bytes(batch, L)), mib(local.decode_state_bytes(batch, L)));
  return 0;
}

int main(int argc, char** argv) {
  return bench_flags::run([&] { return bench_main(argc, argv); });
}
