// membound's example trainer: a byte-level hybrid language model (TTT, attention, Mamba blocks)
// trained on tiny-shakespeare (or any text file) inside a memory budget. Before step 1 it prints
// the plan; the loop is membound::trainer (train/trainer.hpp), every step allocates from a hard
// budget allocator whose measured peak is checked against the plan's prediction, and a pressure
// monitor retries a step under a stricter plan when memory runs short.
//
//   ./build/release/examples/train                                  # the default run
//   ./build/release/examples/train --budget 256MiB --layers ttt,attn,mamba,attn --schedule auto
//   ./build/release/examples/train --steps 50 --save-every 25 --checkpoint /tmp/run.ckpt
//   ./build/release/examples/train --resume /tmp/run.ckpt --steps 100 --report run.json
//   ./build/release/examples/train --steps 60 --foreign 10MiB@30 --trace t.json  # pressure at step 30
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

#include <sys/ioctl.h>
#include <unistd.h>

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
  std::size_t warmup = 30, eval_every = 50, eval_sequences = 32, sample = 200, save_every = 0, stop_after = 0;
  std::uint64_t seed = 1;
  std::string checkpoint = "train.ckpt", resume, report, trace, foreign;
};

// "512MiB", "2GiB", "1e9", "300000000B" -> bytes.
std::size_t parse_bytes(const std::string& s, const char* flag = "--budget") {
  std::size_t pos = 0;
  double v = 0;
  try {
    v = std::stod(s, &pos);
  } catch (const std::exception&) {
    throw mb::invalid_argument(flag, "a size such as 512MiB, 2GiB or 1000000", s, "Give a number with an optional unit");
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
  else throw mb::invalid_argument(flag, "a unit among B, KiB, MiB, GiB, KB, MB, GB", unit, std::string("e.g. ") + flag + " 512MiB");
  if (!(v > 0)) throw mb::invalid_argument(flag, "a positive size", s, std::string("e.g. ") + flag + " 512MiB");
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

// "8MiB@20": bytes someone else takes from the budget at step 20 (to watch the monitor act).
struct foreign_load {
  std::size_t bytes = 0;
  std::uint64_t at_step = 0;
};
foreign_load parse_foreign(const std::string& s) {
  const std::size_t at = s.find('@');
  if (at == std::string::npos) {
    throw mb::invalid_argument("--foreign", "SIZE@STEP, e.g. 8MiB@20", s, "Give a size and the step it arrives at");
  }
  foreign_load f;
  f.bytes = parse_bytes(s.substr(0, at), "--foreign");
  try {
    const std::string n = s.substr(at + 1);
    if (n.empty() || n.find_first_not_of("0123456789") != std::string::npos) throw std::invalid_argument(n);
    f.at_step = std::stoull(n);
    if (f.at_step == 0) throw std::invalid_argument(n);
  } catch (const std::exception&) {
    throw mb::invalid_argument("--foreign", "SIZE@STEP, e.g. 8MiB@20", s, "The part after @ is a step number, 1 or more");
  }
  return f;
}

double mib(std::size_t b) { return static_cast<double>(b) / (1024.0 * 1024.0); }

std::string human_rate(double tok_s) {
  char b[32];
  if (tok_s >= 1e6) std::snprintf(b, sizeof b, "%.2fM", tok_s / 1e6);
  else if (tok_s >= 1e3) std::snprintf(b, sizeof b, "%.1fk", tok_s / 1e3);
  else std::snprintf(b, sizeof b, "%.0f", tok_s);
  return b;
}

// Random windows of the training text (from the trainer's generator, so a resumed run draws the
// same ones) and fixed windows of the validation text.
struct windows {
  const std::vector<std::int32_t>* text;
  std::size_t seq;
  void operator()(const mb::sequence_request& r, std::int32_t* x, std::int32_t* y) const {
    const std::size_t at = r.random % (text->size() - seq - 1);
    for (std::size_t t = 0; t < seq; ++t) {
      x[t] = (*text)[at + t];
      y[t] = (*text)[at + t + 1];
    }
  }
};

// One step's line: plain for logs, or a bar redrawn in place on a terminal.
class progress {
 public:
  explicit progress(std::size_t total) : total_(total), tty_(isatty(fileno(stdout)) != 0) {}
  void step(const mb::step_result& r, std::size_t used, std::size_t peak, std::size_t budget) {
    char line[256];
    std::snprintf(line, sizeof line,
                  "step %5llu/%zu  loss %.4f  lr %.2e  |g| %6.3f%s  %6.1f ms  %6s tok/s  mem %.1f/%.1f of %.0f MiB  %s",
                  static_cast<unsigned long long>(r.step), total_, r.loss, r.lr, r.grad_norm,
                  r.applied ? "" : " (skipped)", r.ms, human_rate(static_cast<double>(r.tokens) / (r.ms / 1000.0)).c_str(),
                  mib(used), mib(peak), mib(budget), std::string(mb::to_string(r.pressure)).c_str());
    if (!tty_) {
      std::printf("%s\n", line);
      return;
    }
    // The same fields, tighter, so that the bar and memory fit an 80-column terminal.
    std::snprintf(line, sizeof line, "%llu/%zu loss %.4f lr %.1e |g| %.2f%s %.0fms %s tok/s mem %.1f/%.1f/%.0fMiB %s",
                  static_cast<unsigned long long>(r.step), total_, r.loss, r.lr, r.grad_norm, r.applied ? "" : " skip",
                  r.ms, human_rate(static_cast<double>(r.tokens) / (r.ms / 1000.0)).c_str(), mib(used), mib(peak),
                  mib(budget), std::string(mb::to_string(r.pressure)).c_str());
    constexpr std::size_t width = 12;
    const std::size_t done = total_ == 0 ? width : std::min<std::size_t>(width, r.step * width / total_);
    std::string bar = "[" + std::string(done, '#') + std::string(width - done, '.') + "] " + line;
    // A wrapped line cannot be redrawn with \r: cut it to the terminal's width.
    winsize ws{};
    if (ioctl(fileno(stdout), TIOCGWINSZ, &ws) == 0 && ws.ws_col > 1 && bar.size() >= ws.ws_col) bar.resize(ws.ws_col - 1u);
    std::printf("\r\033[K%s", bar.c_str());
    std::fflush(stdout);
    open_ = true;
  }
  // A line that stays (eval, a change of plan): ends the bar's line first.
  void note(const std::string& s) {
    if (open_) std::printf("\n");
    open_ = false;
    std::printf("%s\n", s.c_str());
  }
  void finish() {
    if (open_) std::printf("\n");
    open_ = false;
  }

 private:
  std::size_t total_;
  bool tty_;
  bool open_ = false;
};

template <typename P>
int run(const options& o, const std::vector<std::int32_t>& text) {
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
  const foreign_load foreign = o.foreign.empty() ? foreign_load{} : parse_foreign(o.foreign);
  if (foreign.bytes >= budget) {
    throw mb::invalid_argument("--foreign", "less than the budget (" + mb::format_bytes(budget, false) + ")",
                               mb::format_bytes(foreign.bytes, false), "Take less, or raise --budget");
  }

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
  const mb::pressure_thresholds thresholds{};

  mb::trainer_options to;
  to.adam = mb::adamw_config{o.lr, 0.9, 0.95, 1e-8, o.weight_decay};
  to.lr = mb::cosine_lr{o.lr, o.min_lr, o.warmup, o.steps};
  to.clip = o.clip;
  to.seed = o.seed;
  mb::trainer t(m, eff, plan, alloc, pool, to, mb::pressure_monitor<mb::all_check_points>(thresholds));
  t.monitor().attach(recorder);
  if (!o.resume.empty()) {
    const bool same_plan = t.load(o.resume);
    std::printf("resumed from %s at step %llu%s\n", o.resume.c_str(), static_cast<unsigned long long>(t.steps_done()),
                same_plan ? "" : " (its plan does not fit this budget; continuing under the plan above)");
  }

  const std::size_t split = text.size() * 9 / 10;
  const std::vector<std::int32_t> train(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(split));
  const std::vector<std::int32_t> val(text.begin() + static_cast<std::ptrdiff_t>(split), text.end());
  windows train_src{&train, o.seq}, val_src{&val, o.seq};
  auto eval = [&] { return t.evaluate(val_src, o.eval_sequences, o.seed); };

  progress bar(o.steps);
  char line[160];
  const double first_eval = eval();
  std::snprintf(line, sizeof line, "step %5llu/%zu  eval loss %.4f", static_cast<unsigned long long>(t.steps_done()),
                o.steps, first_eval);
  bar.note(line);
  double last_loss = 0, last_eval = first_eval, total_ms = 0;
  std::size_t tokens_done = 0, skipped = 0, replans = 0;
  const std::uint64_t stop = o.stop_after == 0 ? o.steps : std::min<std::uint64_t>(o.steps, t.steps_done() + o.stop_after);
  bool foreign_taken = false;
  while (t.steps_done() < stop) {
    // ">=": a run resumed past STEP takes the bytes at once, as the uninterrupted run held them.
    if (foreign.bytes != 0 && !foreign_taken && t.steps_done() + 1 >= foreign.at_step) {
      foreign_taken = true;
      if (foreign.bytes > alloc.headroom()) {
        throw mb::invalid_argument("--foreign", "at most the budget's headroom between steps, " +
                                                    mb::format_bytes(alloc.headroom(), false),
                                   mb::format_bytes(foreign.bytes, false), "Take less, or raise --budget");
      }
      alloc.set_external(foreign.bytes);
      // In the trace as tag "other", so that a plot shows what the budget is shared with.
      recorder.record_allocation(mb::memory_tag::other, foreign.bytes, nullptr);
      bar.note("step " + std::to_string(t.steps_done() + 1) + ": " + mb::format_bytes(foreign.bytes, false) +
               " of the budget are now held by something else (--foreign)");
    }
    const mb::step_result r = t.step(train_src);
    for (const mb::replan_event& e : r.replans) {
      bar.note(e.describe());
      ++replans;
    }
    total_ms += r.ms;
    tokens_done += r.tokens;
    last_loss = r.loss;
    skipped += r.applied ? 0 : 1;
    const auto st = alloc.stats();
    bar.step(r, alloc.usage(), st.peak_requested, budget);
    if (o.eval_every != 0 && r.step % o.eval_every == 0) {
      last_eval = eval();
      std::snprintf(line, sizeof line, "step %5llu/%zu  eval loss %.4f", static_cast<unsigned long long>(r.step),
                    o.steps, last_eval);
      bar.note(line);
    }
    // --stop-after always saves where it stops, so that --resume can continue.
    if ((o.save_every != 0 && r.step % o.save_every == 0) || (o.stop_after != 0 && r.step == stop)) {
      t.save(o.checkpoint);
      bar.note("saved " + o.checkpoint);
    }
  }
  bar.finish();
  if (o.eval_every == 0 || t.steps_done() % o.eval_every != 0) last_eval = eval();

  if (o.sample > 0) {
    std::vector<std::int32_t> ctx(val.begin(), val.begin() + 32);
    std::vector<double> logits(256);
    mb::random_state rs{o.seed};
    std::string out;
    for (std::size_t i = 0; i < o.sample; ++i) {
      const std::size_t T = std::min<std::size_t>(ctx.size(), o.seq);
      m.next_token_logits(t.weights(), ctx.data() + (ctx.size() - T), {1, T}, logits.data(), alloc, pool);
      double mx = -1e300, z = 0;
      for (double l : logits) mx = std::max(mx, l);
      for (double& l : logits) z += (l = std::exp((l - mx) / 0.8));
      double u = static_cast<double>(rs.next() >> 11) * 0x1.0p-53 * z;
      std::size_t v = 0;
      while (v + 1 < 256 && (u -= logits[v]) > 0) ++v;
      ctx.push_back(static_cast<std::int32_t>(v));
      out.push_back(static_cast<char>(v));
    }
    std::printf("\nsample:\n%s\n\n", out.c_str());
  }

  const auto st = alloc.stats();
  const std::size_t predicted = t.largest_predicted_peak();
  std::printf("eval loss %.4f -> %.4f; measured peak %.2f MiB <= predicted %.2f MiB <= budget %.2f MiB: %s\n",
              first_eval, last_eval, mib(st.peak_requested), mib(predicted), mib(budget),
              st.peak_requested <= predicted && predicted <= budget ? "yes" : "NO");
  if (!o.report.empty()) {
    const mb::training_plan& p = t.plan();
    nlohmann::json j;
    j["budget_bytes"] = budget;
    j["predicted_peak_bytes"] = predicted;
    j["measured_peak_bytes"] = st.peak_requested;
    j["steps"] = t.steps_done();
    j["final_train_loss"] = last_loss;
    j["initial_eval_loss"] = first_eval;
    j["final_eval_loss"] = last_eval;
    j["tokens_per_second"] = total_ms > 0 ? static_cast<double>(tokens_done) / (total_ms / 1000.0) : 0.0;
    j["skipped_steps"] = skipped;
    j["replans"] = replans;
    j["foreign_bytes"] = alloc.external();
    j["loss_scale"] = t.loss_scaling_on() ? t.scaler().scale : 1.0;
    j["thresholds"] = {{"warning", thresholds.warning}, {"critical", thresholds.critical},
                       {"emergency", thresholds.emergency}};
    j["plan"] = {{"weights", p.weights},       {"gradients", p.gradients},
                 {"optimizer", p.optimizer},   {"activations", p.activations},
                 {"workspace", p.workspace},   {"peak", p.peak_bytes},
                 {"peak_phase", p.peak_phase}, {"micro_batch", p.micro.batch},
                 {"accumulation", p.accumulation}, {"schedule", p.schedule.name()}};
    j["policies"] = {{"precision", o.precision}, {"schedule", p.schedule.name()},
                     {"head_chunk", p.head_chunk}, {"layers", o.layers}, {"threads", o.threads},
                     {"loss_scaling", t.loss_scaling_on()}, {"allocator", "budget<traced<system>>"},
                     {"monitor", "pressure_monitor<all_check_points>"}};
    std::ofstream(o.report) << j.dump(2) << "\n";
  }
  if (!o.trace.empty()) recorder.save_chrome_trace(o.trace);
  return st.peak_requested <= predicted ? 0 : 3;
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
  app.add_option("--precision", o.precision, "fp32, bf16, or fp16 (with dynamic loss scaling)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  app.add_option("--schedule", o.schedule, "auto (the planner's fit), none, full, every:K, binomial:S");
  app.add_option("--threads", o.threads, "CPU threads");
  app.add_option("--lr", o.lr, "peak learning rate");
  app.add_option("--warmup", o.warmup, "warm-up steps");
  app.add_option("--eval-every", o.eval_every, "steps between validation losses (0: at the end only)");
  app.add_option("--eval-sequences", o.eval_sequences, "validation sequences per evaluation");
  app.add_option("--sample", o.sample, "characters to sample at the end");
  app.add_option("--seed", o.seed, "random seed");
  app.add_option("--save-every", o.save_every, "steps between checkpoints (0: none)");
  app.add_option("--checkpoint", o.checkpoint, "where --save-every writes");
  app.add_option("--resume", o.resume, "checkpoint to resume from");
  app.add_option("--stop-after", o.stop_after,
                 "stop after this many steps of this invocation, saving to --checkpoint (the schedule still spans --steps; --resume it later)");
  app.add_option("--report", o.report, "write a JSON report here");
  app.add_option("--trace", o.trace, "write the Chrome trace of memory by tag here (plot it with plot_memory)");
  app.add_option("--foreign", o.foreign, "SIZE@STEP: something else takes SIZE of the budget from STEP on");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::fprintf(stderr, "error: %s (see --help)\n", e.what());
    return 1;
  }
  try {
    std::ifstream in(o.data, std::ios::binary);
    if (!in) throw mb::invalid_argument("--data", "a readable text file", o.data, "Pass --data FILE");
    const std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    // A tenth is held out for validation; the sample at the end starts from 32 of its bytes.
    if (s.size() / 10 < std::max<std::size_t>(o.seq + 2, 33)) {
      throw mb::invalid_argument("--data", "at least 10·max(seq + 2, 33) bytes (a tenth is held out for validation)",
                                 std::to_string(s.size()) + " bytes", "Use a longer file or a shorter --seq");
    }
    std::vector<std::int32_t> text(s.size());
    for (std::size_t i = 0; i < s.size(); ++i) text[i] = static_cast<unsigned char>(s[i]);
    if (o.precision == "bf16") return run<mb::bf16_precision>(o, text);
    if (o.precision == "fp16") return run<mb::fp16_precision>(o, text);
    return run<mb::fp32_precision>(o, text);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
