// membound's example trainer: a byte-level hybrid language model (TTT, attention, Mamba blocks)
// trained on tiny-shakespeare (or any text file) inside a memory budget. Before step 1 it prints
// the plan; every step allocates from a hard budget allocator whose measured peak is checked
// against the plan's prediction.
//
//   ./build/release/examples/train                                  # the default run
//   ./build/release/examples/train --budget 256MiB --layers ttt,attn,mamba,attn --schedule auto
//   ./build/release/examples/train --steps 50 --save-every 25 --checkpoint /tmp/run.ckpt
//   ./build/release/examples/train --resume /tmp/run.ckpt --steps 100 --report run.json
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "membound/membound.hpp"

namespace mb = membound;

#ifndef MEMBOUND_SOURCE_DIR
#define MEMBOUND_SOURCE_DIR "."
#endif

namespace {

struct options {
  std::string data = MEMBOUND_SOURCE_DIR "/examples/data/tinyshakespeare.txt";
  std::string budget = "32MiB";
  std::string layers = "ttt,attn,mamba,attn";
  std::size_t width = 128, heads = 4, seq = 128, batch = 8, steps = 200, threads = 2;
  std::string precision = "fp32";
  std::string schedule = "auto";
  double lr = 3e-3, min_lr = 3e-4, weight_decay = 0.1, clip = 1.0;
  std::size_t warmup = 30, eval_every = 50, eval_batches = 8, sample = 200, save_every = 0;
  std::uint64_t seed = 1;
  std::string checkpoint = "train.ckpt", resume, report, trace;
};

// "512MiB", "2GiB", "1e9", "300000000B" -> bytes.
std::size_t parse_bytes(const std::string& s) {
  std::size_t pos = 0;
  double v = 0;
  try {
    v = std::stod(s, &pos);
  } catch (const std::exception&) {
    throw mb::invalid_argument("--budget", "a size such as 512MiB, 2GiB or 1000000", s, "Give a number with an optional unit");
  }
  const std::string unit = s.substr(pos);
  double m = 1;
  if (unit == "" || unit == "B") m = 1;
  else if (unit == "KiB") m = 1024.0;
  else if (unit == "MiB") m = 1024.0 * 1024;
  else if (unit == "GiB") m = 1024.0 * 1024 * 1024;
  else if (unit == "KB") m = 1e3;
  else if (unit == "MB") m = 1e6;
  else if (unit == "GB") m = 1e9;
  else throw mb::invalid_argument("--budget", "a unit among B, KiB, MiB, GiB, KB, MB, GB", unit, "e.g. --budget 512MiB");
  if (!(v > 0)) throw mb::invalid_argument("--budget", "a positive size", s, "e.g. --budget 512MiB");
  return static_cast<std::size_t>(v * m);
}

mb::schedule_choice parse_schedule(const std::string& s) {
  using K = mb::schedule_choice::kind;
  auto num = [&](std::size_t at) {
    try {
      return static_cast<std::size_t>(std::stoul(s.substr(at)));
    } catch (const std::exception&) {
      throw mb::invalid_argument("--schedule", "none, full, every:K, binomial:S or auto", s, "e.g. --schedule every:2");
    }
  };
  if (s == "none") return {K::none, 0};
  if (s == "full") return {K::full, 0};
  if (s.rfind("every:", 0) == 0) return {K::every, num(6)};
  if (s.rfind("binomial:", 0) == 0) return {K::binomial, num(9)};
  throw mb::invalid_argument("--schedule", "none, full, every:K, binomial:S or auto", s, "e.g. --schedule auto");
}

std::uint64_t mix(std::uint64_t a, std::uint64_t b) {
  std::uint64_t z = a * 0x9e3779b97f4a7c15ULL + b + 0x632be59bd9b4e019ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Batch k of a stream: B windows of T + 1 bytes at positions drawn from (seed, stream, k), so a
// resumed run sees the same data as an uninterrupted one.
void make_batch(const std::vector<std::int32_t>& text, std::size_t B, std::size_t T, std::uint64_t seed,
                std::uint64_t stream, std::uint64_t k, std::vector<std::int32_t>& x, std::vector<std::int32_t>& y) {
  x.resize(B * T);
  y.resize(B * T);
  const std::size_t span = text.size() - T - 1;
  for (std::size_t b = 0; b < B; ++b) {
    const std::size_t at = mix(mix(seed, stream), k * 1000003 + b) % span;
    for (std::size_t t = 0; t < T; ++t) {
      x[b * T + t] = text[at + t];
      y[b * T + t] = text[at + t + 1];
    }
  }
}

double mib(std::size_t b) { return static_cast<double>(b) / (1024.0 * 1024.0); }

template <typename P>
int run(const options& o, const std::vector<std::int32_t>& text) {
  using S = typename P::storage_type;
  using net = mb::model<mb::embedding<P>,
                        mb::block_pattern<mb::ttt_linear<P>, mb::attention<P>, mb::mamba<P>, mb::ttt_mlp<P>>,
                        mb::lm_head<P>>;
  std::vector<std::size_t> pattern;
  {
    std::stringstream ss(o.layers);
    std::string name;
    while (std::getline(ss, name, ',')) {
      const std::string full = name == "ttt" ? "ttt_linear" : name == "attn" ? "attention" : name;
      const std::size_t k = net::mixer_index(full);
      if (k == net::block_types) {
        throw mb::invalid_argument("--layers", "a comma-separated list of ttt, ttt_mlp, attn, mamba", name,
                                   "e.g. --layers ttt,attn,mamba,attn");
      }
      pattern.push_back(k);
    }
  }
  mb::model_config cfg;
  cfg.vocab = 256;
  cfg.width = o.width;
  cfg.heads = o.heads;
  const net m(cfg, pattern);
  const std::size_t budget = parse_bytes(o.budget);
  const mb::batch_shape eff{o.batch, o.seq};

  mb::training_plan plan;
  if (o.schedule == "auto") {
    mb::fit_options fo;
    fo.threads = o.threads;
    plan = mb::fit(m, eff, budget, fo);
  } else {
    mb::plan_options po;
    po.threads = o.threads;
    plan = mb::make_plan(m, eff, parse_schedule(o.schedule), po, budget);
    if (!plan.fits()) throw mb::budget_too_small(budget, plan.peak_bytes);
  }
  std::printf("model: %zu blocks (%s), width %zu, %zu heads, %s, %zu parameters\n", m.depth(), o.layers.c_str(),
              o.width, o.heads, o.precision.c_str(), m.parameter_count());
  std::printf("%s\n", plan.table().c_str());

  mb::trace_recorder recorder(1 << 20);
  mb::budget_allocator<mb::traced_allocator<mb::system_allocator>> alloc(budget, recorder);
  mb::thread_pool pool(o.threads);
  const std::size_t n = m.parameter_elements();
  S* w = static_cast<S*>(alloc.allocate(m.weight_bytes(), mb::default_alignment, mb::memory_tag::weights));
  S* g = static_cast<S*>(alloc.allocate(m.weight_bytes(), mb::default_alignment, mb::memory_tag::gradients));
  void* opt = alloc.allocate(plan.optimizer, mb::default_alignment, mb::memory_tag::optimizer);
  m.init_weights(w, o.seed);
  mb::adamw<S>::init(w, n, opt, plan.optimizer);
  std::uint64_t start = 0;
  if (!o.resume.empty()) {
    const mb::checkpoint_reader r(o.resume);
    if (r.value<std::uint64_t>("parameters") != n) throw mb::corrupt_checkpoint(o.resume, "it holds a different model");
    r.copy("weights", w, m.weight_bytes());
    r.copy("optimizer", opt, plan.optimizer);
    start = r.value<std::uint64_t>("step");
    std::printf("resumed from %s at step %llu\n", o.resume.c_str(), static_cast<unsigned long long>(start));
  }

  const std::size_t split = text.size() * 9 / 10;
  const std::vector<std::int32_t> train(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(split));
  const std::vector<std::int32_t> val(text.begin() + static_cast<std::ptrdiff_t>(split), text.end());
  const mb::cosine_lr sched{o.lr, o.min_lr, o.warmup, o.steps};
  const mb::adamw_config ac{o.lr, 0.9, 0.95, 1e-8, o.weight_decay};
  std::vector<std::int32_t> x, y;
  auto eval = [&] {
    double sum = 0;
    for (std::size_t k = 0; k < o.eval_batches; ++k) {
      make_batch(val, plan.micro.batch, o.seq, o.seed, 2, k, x, y);
      sum += m.forward_backward(w, g, x.data(), y.data(), plan.micro, plan.ops, plan.head_chunk, 1.0, alloc, pool);
    }
    std::memset(static_cast<void*>(g), 0, m.weight_bytes());
    return sum / static_cast<double>(o.eval_batches);
  };

  const double first_eval = eval();
  std::printf("step %5llu/%zu  eval loss %.4f\n", static_cast<unsigned long long>(start), o.steps, first_eval);
  double last_loss = 0, last_eval = first_eval, total_ms = 0;
  std::size_t tokens_done = 0;
  for (std::uint64_t step = start; step < o.steps; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    std::memset(static_cast<void*>(g), 0, m.weight_bytes());
    double loss = 0;
    for (std::size_t micro = 0; micro < plan.accumulation; ++micro) {
      make_batch(train, plan.micro.batch, o.seq, o.seed, 1, step * plan.accumulation + micro, x, y);
      loss += m.forward_backward(w, g, x.data(), y.data(), plan.micro, plan.ops, plan.head_chunk,
                                 1.0 / static_cast<double>(plan.accumulation), alloc, pool) /
              static_cast<double>(plan.accumulation);
    }
    const double norm = mb::global_norm(g, n, pool);
    const double scale = mb::clip_factor(norm, o.clip);
    const double lr = sched(step);
    for (const mb::param_entry& e : m.parameters())
      mb::adamw<S>::update(w, g, opt, n, e.offset, e.count, step + 1, lr, ac, e.decay, scale, pool);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    total_ms += ms;
    tokens_done += eff.tokens();
    last_loss = loss;
    const auto st = alloc.stats();
    std::printf("step %5llu/%zu  loss %.4f  lr %.2e  |g| %.3f  %6.1f ms  %7.0f tok/s  mem %.1f/%.1f MiB of %.0f MiB\n",
                static_cast<unsigned long long>(step + 1), o.steps, loss, lr, norm, ms,
                static_cast<double>(eff.tokens()) / (ms / 1000.0), mib(st.requested), mib(st.peak_requested), mib(budget));
    if (o.eval_every != 0 && (step + 1) % o.eval_every == 0) {
      last_eval = eval();
      std::printf("step %5llu/%zu  eval loss %.4f\n", static_cast<unsigned long long>(step + 1), o.steps, last_eval);
    }
    if (o.save_every != 0 && (step + 1) % o.save_every == 0) {
      mb::checkpoint_writer cw;
      cw.add_value<std::uint64_t>("parameters", n);
      cw.add_value<std::uint64_t>("step", step + 1);
      cw.add("weights", w, m.weight_bytes());
      cw.add("optimizer", opt, plan.optimizer);
      cw.commit(o.checkpoint);
      std::printf("saved %s\n", o.checkpoint.c_str());
    }
  }
  if (o.eval_every == 0 || o.steps % o.eval_every != 0) last_eval = eval();

  if (o.sample > 0) {
    std::vector<std::int32_t> ctx(val.begin(), val.begin() + 32);
    std::vector<double> logits(256);
    std::uint64_t rs = o.seed;
    std::string out;
    for (std::size_t i = 0; i < o.sample; ++i) {
      const std::size_t T = std::min<std::size_t>(ctx.size(), o.seq);
      m.next_token_logits(w, ctx.data() + (ctx.size() - T), {1, T}, logits.data(), alloc, pool);
      double mx = -1e300, z = 0;
      for (double l : logits) mx = std::max(mx, l);
      for (double& l : logits) z += (l = std::exp((l - mx) / 0.8));
      double u = static_cast<double>(mix(rs, i) >> 11) * 0x1.0p-53 * z;
      std::size_t v = 0;
      while (v + 1 < 256 && (u -= logits[v]) > 0) ++v;
      ctx.push_back(static_cast<std::int32_t>(v));
      out.push_back(static_cast<char>(v));
    }
    std::printf("\nsample:\n%s\n\n", out.c_str());
  }

  const auto st = alloc.stats();
  std::printf("eval loss %.4f -> %.4f; measured peak %.2f MiB <= predicted %.2f MiB <= budget %.2f MiB: %s\n",
              first_eval, last_eval, mib(st.peak_requested), mib(plan.peak_bytes), mib(budget),
              st.peak_requested <= plan.peak_bytes && plan.peak_bytes <= budget ? "yes" : "NO");
  if (!o.report.empty()) {
    nlohmann::json j;
    j["budget_bytes"] = budget;
    j["predicted_peak_bytes"] = plan.peak_bytes;
    j["measured_peak_bytes"] = st.peak_requested;
    j["steps"] = o.steps;
    j["final_train_loss"] = last_loss;
    j["initial_eval_loss"] = first_eval;
    j["final_eval_loss"] = last_eval;
    j["tokens_per_second"] = total_ms > 0 ? static_cast<double>(tokens_done) / (total_ms / 1000.0) : 0.0;
    j["plan"] = {{"weights", plan.weights},       {"gradients", plan.gradients},
                 {"optimizer", plan.optimizer},   {"activations", plan.activations},
                 {"workspace", plan.workspace},   {"peak_phase", plan.peak_phase},
                 {"micro_batch", plan.micro.batch}, {"accumulation", plan.accumulation}};
    j["policies"] = {{"precision", o.precision}, {"schedule", plan.schedule.name()},
                     {"head_chunk", plan.head_chunk}, {"layers", o.layers}, {"threads", o.threads}};
    std::ofstream(o.report) << j.dump(2) << "\n";
  }
  if (!o.trace.empty()) recorder.save_chrome_trace(o.trace);
  alloc.deallocate(opt, plan.optimizer, mb::default_alignment, mb::memory_tag::optimizer);
  alloc.deallocate(g, m.weight_bytes(), mb::default_alignment, mb::memory_tag::gradients);
  alloc.deallocate(w, m.weight_bytes(), mb::default_alignment, mb::memory_tag::weights);
  return st.peak_requested <= plan.peak_bytes ? 0 : 3;
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  CLI::App app{"membound example trainer: a byte-level hybrid language model inside a memory budget"};
  app.add_option("--data", o.data, "text file to train on");
  app.add_option("--budget", o.budget, "memory budget with a unit, e.g. 512MiB, 2GiB");
  app.add_option("--layers", o.layers, "block pattern: ttt, ttt_mlp, attn, mamba, comma-separated");
  app.add_option("--width", o.width, "model width");
  app.add_option("--heads", o.heads, "attention and TTT heads");
  app.add_option("--seq", o.seq, "sequence length");
  app.add_option("--batch", o.batch, "sequences per optimizer step");
  app.add_option("--steps", o.steps, "optimizer steps");
  app.add_option("--precision", o.precision, "fp32 or bf16")->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--schedule", o.schedule, "auto (the planner's fit), none, full, every:K, binomial:S");
  app.add_option("--threads", o.threads, "CPU threads");
  app.add_option("--lr", o.lr, "peak learning rate");
  app.add_option("--warmup", o.warmup, "warm-up steps");
  app.add_option("--eval-every", o.eval_every, "steps between validation losses (0: at the end only)");
  app.add_option("--sample", o.sample, "characters to sample at the end");
  app.add_option("--seed", o.seed, "random seed");
  app.add_option("--save-every", o.save_every, "steps between checkpoints (0: none)");
  app.add_option("--checkpoint", o.checkpoint, "where --save-every writes");
  app.add_option("--resume", o.resume, "checkpoint to resume from");
  app.add_option("--report", o.report, "write a JSON report here");
  app.add_option("--trace", o.trace, "write the Chrome trace of memory by tag here");
  CLI11_PARSE(app, argc, argv);
  try {
    std::ifstream in(o.data, std::ios::binary);
    if (!in) throw mb::invalid_argument("--data", "a readable text file", o.data, "Pass --data FILE");
    const std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (s.size() < 4 * (o.seq + 1)) throw mb::invalid_argument("--data", "at least 4·(seq + 1) bytes", std::to_string(s.size()) + " bytes", "Use a longer file or a shorter --seq");
    std::vector<std::int32_t> text(s.size());
    for (std::size_t i = 0; i < s.size(); ++i) text[i] = static_cast<unsigned char>(s[i]);
    return o.precision == "bf16" ? run<mb::bf16_precision>(o, text) : run<mb::fp32_precision>(o, text);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
