// One training step of the example trainer's model (examples/train.cpp), timed, for
// bench/peers/model_peer.py's comparison with the same model in PyTorch. Not part of ctest.
//
//   model_peer_runner [--data FILE] [--layers ttt,attn,mamba,attn] [--width 128] [--heads 4]
//                     [--seq 128] [--batch 8] [--budget 32MiB] [--schedule auto|none|full]
//                     [--threads 2] [--warmup 2] [--reps 5] [--dump-weights PATH]
//
// What the trainer builds, with its defaults: model<embedding, block_pattern<ttt_linear,
// attention, mamba, ttt_mlp>, lm_head> in fp32, vocab 256 (bytes), the allocator stack
// budget<traced<expandable_arena<host_virtual_memory>>> at page granularity, the plan fit()
// chooses for the budget (auto) or make_plan's fixed schedule, and membound::trainer with the
// trainer's AdamW (betas 0.9/0.95, eps 1e-8, weight decay 0.1), cosine learning rate (3e-3 ->
// 3e-4, 30 warm-up steps of 200), clip 1 and pressure_monitor<all_check_points>. One step is
// trainer::step: every micro-batch's forward, loss and backward, the global norm, the clip and
// AdamW.
//
// Data: the first 9/10 of --data as bytes, as the trainer splits it. Unlike the trainer (random
// windows from its generator) sequence k of the run starts at splitmix64(k) mod (n - T - 1), a
// rule model_peer.py repeats, so that both sides train on the same batches step by step.
//
// stdout: one JSON object. ms: the wall times of the --reps steps after --warmup steps (the
// trainer's own step_result::ms); losses: every step's mean loss (warm-up included); params;
// plan; predicted_peak_bytes / measured_peak_bytes (the budget allocator's peak of requested
// bytes: weights, gradients, AdamW state, activations and workspace), reserved_peak_bytes (what
// the arena held), baseline_rss_bytes (the process before the trainer exists: code, data, thread
// pool) and peak_rss_bytes (VmHWM at the end, the whole process; the same figure as getrusage's
// ru_maxrss). --dump-weights PATH writes the initial weights (fp32, the flat layout) to PATH and
// their table (name, offset, count) into the JSON, for model_peer.py --check.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "membound/membound.hpp"

#ifndef MEMBOUND_PEER_SOURCE_DIR
#define MEMBOUND_PEER_SOURCE_DIR "."
#endif

namespace mb = membound;
using P = mb::fp32_precision;
using net = mb::hybrid_model<P>;

namespace {

std::uint64_t splitmix64(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

struct windows {
  const std::vector<std::int32_t>* text;
  std::size_t seq;
  void operator()(const mb::sequence_request& r, std::int32_t* x, std::int32_t* y) const {
    const std::size_t at = splitmix64(r.index) % (text->size() - seq - 1);
    for (std::size_t t = 0; t < seq; ++t) {
      x[t] = (*text)[at + t];
      y[t] = (*text)[at + t + 1];
    }
  }
};

std::size_t parse_size(const std::string& s) {
  std::size_t pos = 0;
  const unsigned long long v = std::stoull(s, &pos);
  const std::string unit = s.substr(pos);
  if (unit.empty() || unit == "B") return v;
  if (unit == "KiB") return v << 10;
  if (unit == "MiB") return v << 20;
  if (unit == "GiB") return v << 30;
  throw std::invalid_argument("--budget: a size such as 32MiB, not '" + s + "'");
}

}  // namespace

int main(int argc, char** argv) {
  std::string data = MEMBOUND_PEER_SOURCE_DIR "/examples/data/tinyshakespeare.txt";
  std::string layers = "ttt,attn,mamba,attn", schedule = "auto", dump;
  std::size_t width = 128, heads = 4, seq = 128, batch = 8, threads = 2, budget = std::size_t{32} << 20;
  int warmup = 2, reps = 5;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--help" || a == "-h") {
        std::printf("usage: model_peer_runner [--data F] [--layers L] [--width N] [--heads N] [--seq N] [--batch N] "
                    "[--threads N] [--budget SIZE] [--schedule S] [--warmup N] [--reps N] [--dump-weights F]\n");
        return 0;
      }
      if (i + 1 >= argc) throw std::invalid_argument(a + ": needs a value");
      const std::string v = argv[++i];
      if (a == "--data") data = v;
      else if (a == "--layers") layers = v;
      else if (a == "--width") width = std::stoul(v);
      else if (a == "--heads") heads = std::stoul(v);
      else if (a == "--seq") seq = std::stoul(v);
      else if (a == "--batch") batch = std::stoul(v);
      else if (a == "--threads") threads = std::stoul(v);
      else if (a == "--budget") budget = parse_size(v);
      else if (a == "--schedule") schedule = v;
      else if (a == "--warmup") warmup = std::stoi(v);
      else if (a == "--reps") reps = std::stoi(v);
      else if (a == "--dump-weights") dump = v;
      else throw std::invalid_argument("unknown argument " + a);
    }
    if (reps < 1 || warmup < 0) throw std::invalid_argument("--reps at least 1, --warmup at least 0");

    std::ifstream in(data, std::ios::binary);
    if (!in) throw std::invalid_argument("--data: cannot open " + data);
    const std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::vector<std::int32_t> train(s.size() * 9 / 10);
    for (std::size_t i = 0; i < train.size(); ++i) train[i] = static_cast<unsigned char>(s[i]);
    if (train.size() < seq + 2) throw std::invalid_argument("--data: shorter than --seq");

    std::vector<std::size_t> pattern;
    for (std::size_t at = 0; at <= layers.size();) {
      const std::size_t comma = std::min(layers.find(',', at), layers.size());
      const std::string n = layers.substr(at, comma - at);
      pattern.push_back(net::mixer_index(n == "ttt" ? "ttt_linear" : n == "attn" ? "attention" : n));
      if (pattern.back() == net::block_types) throw std::invalid_argument("--layers: unknown block " + n);
      at = comma + 1;
    }
    mb::model_config cfg;
    cfg.vocab = 256;
    cfg.width = width;
    cfg.heads = heads;
    const net m(cfg, pattern);
    const mb::batch_shape eff{batch, seq};

    mb::thread_pool pool(threads);
    const mb::process_memory_info baseline = mb::process_memory();

    // The trainer's stack, plan and options (examples/train.cpp).
    mb::trace_recorder recorder(4096);
    const std::size_t page = mb::host_virtual_memory::page_size();
    const std::size_t capacity = mb::align_up(std::min<std::size_t>(budget, std::size_t{1} << 40), page);
    using stack = mb::budget_allocator<mb::traced_allocator<mb::expandable_arena<mb::host_virtual_memory>>>;
    stack alloc(budget, recorder, mb::expandable_arena_options{capacity}, page);
    const mb::reserve_function reserve = mb::reserve_model(m, alloc);
    mb::training_plan plan;
    if (schedule == "auto") {
      mb::fit_options fo;
      fo.threads = threads;
      fo.reserve = reserve;
      plan = mb::fit(m, eff, budget, fo);
    } else {
      using K = mb::schedule_choice::kind;
      const mb::schedule_choice c{schedule == "none" ? K::none : K::full, 0};
      if (schedule != "none" && schedule != "full") throw std::invalid_argument("--schedule: auto, none or full");
      mb::plan_options po;
      po.threads = threads;
      plan = mb::make_plan(m, eff, c, po, budget);
      plan.reserved_peak = reserve(plan);
      if (!plan.fits()) throw mb::budget_too_small(budget, plan.budgeted_peak());
    }
    mb::trainer_options to;
    to.adam = mb::adamw_config{3e-3, 0.9, 0.95, 1e-8, 0.1};
    to.lr = mb::cosine_lr{3e-3, 3e-4, 30, 200};
    to.clip = 1.0;
    to.seed = 1;
    mb::trainer t(m, eff, plan, alloc, pool, to, mb::pressure_monitor<mb::all_check_points>(mb::pressure_thresholds{}));

    nlohmann::json j;
    if (!dump.empty()) {
      std::ofstream out(dump, std::ios::binary);
      out.write(reinterpret_cast<const char*>(t.weights()), static_cast<std::streamsize>(m.weight_bytes()));
      if (!out) throw std::runtime_error("--dump-weights: cannot write " + dump);
      nlohmann::json table = nlohmann::json::array();
      for (const mb::param_entry& e : m.parameters()) table.push_back({e.name, e.offset, e.count, e.decay});
      j["weights_table"] = table;
    }

    windows src{&train, seq};
    std::vector<double> ms, losses;
    for (int k = 0; k < warmup + reps; ++k) {
      const mb::step_result r = t.step(src);
      losses.push_back(r.loss);
      if (k >= warmup) ms.push_back(r.ms);
      if (!r.replans.empty()) j["replanned"] = true;
    }
    const auto st = alloc.stats();
    const mb::process_memory_info end = mb::process_memory();
    j["side"] = "ours";
    j["ms"] = ms;
    j["losses"] = losses;
    j["tokens_per_step"] = eff.tokens();
    j["params"] = m.parameter_count();
    j["plan"] = mb::plan_summary(t.plan());
    j["predicted_peak_bytes"] = t.largest_predicted_peak();
    j["measured_peak_bytes"] = st.peak_requested;
    j["reserved_peak_bytes"] = st.peak_reserved;
    j["baseline_rss_bytes"] = baseline.rss;
    j["peak_rss_bytes"] = end.peak_rss;
    j["threads"] = threads;
    std::cout << j.dump() << "\n";
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "model_peer_runner: %s\n", e.what());
    return 1;
  }
}
