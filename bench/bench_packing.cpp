// Packed rows against batches padded to their longest sequence, on the same variable-length
// samples at the same token budget per micro-batch. The samples are the paragraphs of --data
// (runs of lines between blank lines, 2 to ~1300 bytes in tiny-shakespeare), in corpus order.
// A micro-batch holds at most --tokens tokens:
//   packed: rows of --tokens tokens holding at most --sequences paragraphs each (token_packing:
//           best-fit decreasing; a paragraph longer than a row is cut into row-long pieces), one
//           row per micro-batch;
//   padded: paragraphs in corpus order, as many per micro-batch as fit when each is padded to
//           the longest of the micro-batch (B · L_max <= tokens), what a padding loader does; a
//           paragraph longer than the budget is truncated to it (its tail is lost).
// Each micro-batch runs forward, loss and backward (schedule none, fp32, the example trainer's
// 4-block hybrid at C = 128, 4 heads) under a budget allocator. Reported per mode: micro-batches,
// tokens run, data tokens (the targets that count), their share, wall time, data tokens per
// second, the largest plan peak and the measured peak, and the tokens truncated. One run, so the
// ratio compares measurements taken side by side (best of --reps for each).
//
// Run: ./build/release/bench/bench_packing [--paragraphs N] [--tokens N] [--sequences N] [--threads N] [--reps N]
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <span>
#include <string>
#include <vector>

#include "bench_flags.hpp"
#include "membound/membound.hpp"
#include "membound/model/planner.hpp"

namespace mb = membound;
using P = mb::fp32_precision;
using net = mb::model<mb::embedding<P>, mb::block<mb::ttt_linear<P>>, mb::block<mb::attention<P>>,
                      mb::block<mb::mamba<P>>, mb::block<mb::attention<P>>, mb::lm_head<P>>;

namespace {

double mib(std::size_t b) { return static_cast<double>(b) / (1024.0 * 1024.0); }

// A micro-batch: its shape (offsets inside when packed), ids, and how many targets count.
struct micro_batch {
  mb::batch_shape shape;
  std::vector<std::int32_t> offsets, tokens, targets;
  std::size_t data = 0;
};

struct totals {
  std::size_t batches = 0, tokens = 0, data = 0, truncated = 0, plan_peak = 0, measured_peak = 0;
  double seconds = 0;
};

// Runs every micro-batch once (plans made beforehand, per distinct shape, outside the timing).
totals run_all(const net& m, std::vector<micro_batch>& mbs, std::size_t threads) {
  totals t;
  mb::thread_pool pool(threads);
  // Weights, gradients and AdamW's state from the budget allocator too, as a trainer holds them:
  // its peak is then comparable with the plans' (which count all three).
  mb::budget_allocator<mb::system_allocator> alloc(std::size_t{1} << 34);
  const std::size_t wb = m.weight_bytes();
  auto* w = static_cast<float*>(alloc.allocate(wb, mb::default_alignment, mb::memory_tag::weights));
  auto* g = static_cast<float*>(alloc.allocate(wb, mb::default_alignment, mb::memory_tag::gradients));
  m.init_weights(w, 1);
  std::fill(g, g + m.parameter_elements(), 0.0f);
  mb::plan_options o;
  o.threads = threads;
  o.head_chunk = 256;
  std::vector<std::pair<mb::batch_shape, mb::training_plan>> plans;
  for (const micro_batch& b : mbs) {
    const auto it = std::find_if(plans.begin(), plans.end(), [&](const auto& p) { return p.first == b.shape; });
    if (it == plans.end()) plans.emplace_back(b.shape, mb::make_plan(m, b.shape, mb::schedules::none{}, o));
  }
  const std::size_t ob = plans.front().second.optimizer;
  void* opt = alloc.allocate(ob, mb::default_alignment, mb::memory_tag::optimizer);
  const auto t0 = std::chrono::steady_clock::now();
  for (micro_batch& b : mbs) {
    const mb::training_plan& p =
        std::find_if(plans.begin(), plans.end(), [&](const auto& q) { return q.first == b.shape; })->second;
    mb::batch_shape s = b.shape;
    if (s.packed()) s.offsets = b.offsets.data();
    (void)m.forward_backward(w, g, b.tokens.data(), b.targets.data(), s, p.ops, p.head_chunk, 1.0, alloc, pool);
    t.plan_peak = std::max(t.plan_peak, p.peak_bytes);
    t.tokens += b.shape.tokens();
    t.data += b.data;
  }
  t.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  t.batches = mbs.size();
  t.measured_peak = alloc.stats().peak_requested;
  alloc.deallocate(opt, ob, mb::default_alignment, mb::memory_tag::optimizer);
  alloc.deallocate(g, wb, mb::default_alignment, mb::memory_tag::gradients);
  alloc.deallocate(w, wb, mb::default_alignment, mb::memory_tag::weights);
  return t;
}

}  // namespace

static int bench_main(int argc, char** argv) {
  std::size_t paragraphs = 600, tokens = 1024, sequences = 64, threads = 2;
  int reps = 2;
  std::string data = MEMBOUND_BENCH_DATA;
  bench_flags::args a(argc, argv,
                      "usage: bench_packing [--paragraphs N] [--tokens N] [--sequences N] [--threads N] [--reps N] "
                      "[--data FILE]");
  while (a.next()) {
    if (a.is("--paragraphs")) paragraphs = a.whole(1, 1u << 20);
    else if (a.is("--tokens")) tokens = a.whole(2, 1u << 16);
    else if (a.is("--sequences")) sequences = a.whole(1, 4096);
    else if (a.is("--threads")) threads = a.whole(1, 256);
    else if (a.is("--reps")) reps = static_cast<int>(a.whole(1, 100));
    else if (a.is("--data")) data = a.text();
    else a.unknown();
  }
  std::ifstream in(data, std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!in.good() && !in.eof()) throw mb::invalid_argument("--data", "a readable text file", data, "Pass --data FILE");
  std::vector<std::int32_t> ids(text.size());
  for (std::size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
  // Paragraphs with their closing new line, as the example trainer's --pack takes them.
  std::vector<std::span<const std::int32_t>> samples;
  std::vector<std::size_t> lengths;
  for (std::size_t i = 0; i < ids.size() && samples.size() < paragraphs;) {
    while (i < ids.size() && ids[i] == '\n') ++i;
    const std::size_t b = i;
    while (i < ids.size() && !(ids[i] == '\n' && (i + 1 == ids.size() || ids[i + 1] == '\n'))) ++i;
    if (i < ids.size()) ++i;
    if (i - b >= 2) {
      samples.emplace_back(ids.data() + b, i - b);
      lengths.push_back(i - b);
    }
  }
  if (samples.empty()) throw mb::invalid_argument("--data", "paragraphs of at least 2 bytes", data, "Pass a text");

  // Packed rows.
  const mb::token_packing pack(lengths, tokens, sequences);
  std::vector<micro_batch> packed(pack.rows());
  for (std::size_t r = 0; r < pack.rows(); ++r) {
    micro_batch& b = packed[r];
    b.shape = {1, tokens, sequences};
    b.offsets.resize(sequences + 1);
    b.tokens.resize(tokens);
    b.targets.resize(tokens);
    pack.write(r, [&](std::size_t i) { return samples[i]; },
               mb::packed_row{b.tokens.data(), b.targets.data(), b.offsets.data(), tokens, sequences});
    b.data = mb::counted_targets(b.targets.data(), b.targets.size());
  }
  // Padded to the longest of each micro-batch, in corpus order; truncated to the budget.
  std::vector<micro_batch> padded;
  std::size_t truncated = 0;
  for (std::size_t i = 0; i < samples.size();) {
    std::size_t longest = 0, n = 0;
    while (i + n < samples.size()) {
      const std::size_t l = std::max(longest, std::min(lengths[i + n], tokens));
      if ((n + 1) * l > tokens) break;
      longest = l;
      ++n;
    }
    micro_batch b;
    b.shape = {n, longest};
    b.tokens.assign(n * longest, '\n');
    b.targets.assign(n * longest, mb::ignore_target);
    for (std::size_t k = 0; k < n; ++k) {
      const auto s = samples[i + k];
      const std::size_t keep = std::min(s.size(), tokens);
      truncated += s.size() - keep;
      for (std::size_t j = 0; j < keep; ++j) {
        b.tokens[k * longest + j] = s[j];
        if (j + 1 < keep) b.targets[k * longest + j] = s[j + 1];
      }
      b.data += keep - 1;
    }
    padded.push_back(std::move(b));
    i += n;
  }

  mb::model_config c;
  c.vocab = 256;
  c.width = 128;
  c.heads = 4;
  const net m(c);
  totals best_packed, best_padded;
  best_packed.seconds = best_padded.seconds = 1e300;
  for (int rep = 0; rep <= reps; ++rep) {  // rep 0 warms up
    const totals p = run_all(m, packed, threads), q = run_all(m, padded, threads);
    if (rep == 0) continue;
    if (p.seconds < best_packed.seconds) best_packed = p;
    if (q.seconds < best_padded.seconds) best_padded = q;
  }
  best_padded.truncated = truncated;
  std::printf("%zu paragraphs of --data (%zu to %zu bytes, %zu in all), at most %zu tokens per micro-batch; "
              "4-block hybrid C = 128, fp32, %zu threads, best of %d\n",
              samples.size(), *std::min_element(lengths.begin(), lengths.end()),
              *std::max_element(lengths.begin(), lengths.end()), pack.tokens(), tokens, threads, reps);
  std::printf("%-8s %8s %10s %10s %7s %9s %12s %12s %12s %10s\n", "mode", "batches", "tokens", "data", "share",
              "time s", "data tok/s", "plan peak", "measured", "truncated");
  for (const auto& [name, t] : {std::pair{"packed", best_packed}, std::pair{"padded", best_padded}}) {
    std::printf("%-8s %8zu %10zu %10zu %6.1f%% %9.3f %12.0f %9.2f MiB %9.2f MiB %10zu\n", name, t.batches, t.tokens,
                t.data, 100.0 * static_cast<double>(t.data) / static_cast<double>(t.tokens), t.seconds,
                static_cast<double>(t.data) / t.seconds, mib(t.plan_peak), mib(t.measured_peak), t.truncated);
  }
  std::printf("packed / padded, data tokens per second: %.2fx\n",
              (static_cast<double>(best_packed.data) / best_packed.seconds) /
                  (static_cast<double>(best_padded.data) / best_padded.seconds));
  return 0;
}

int main(int argc, char** argv) {
  return bench_flags::run([&] { return bench_main(argc, argv); });
}
