// policy_grid: one model (flags as the example trainer's), a grid of policy combinations, and per
// point the plan's predicted peak, the measured peak (requested and reserved, from the budget
// allocator's statistics over the trainer's stack), the time of a full optimizer step (median,
// min and max over --repetitions; by default in interleaved rounds, each running every point
// once after its own warm-up step), tokens/s and the recompute FLOPs. The
// Pareto front over (time, measured peak) among the points that fit, and fit()'s choice, are
// marked; table on stdout, optional CSV, JSON and SVG.
//
//   ./build/release/bench/policy_grid --quick
//   ./build/release/bench/policy_grid --layers ttt,attn --width 64 --budget 24MiB --json g.json --svg g.svg
//
// The grid:
//   compile time  the lists of bench/grid_policies.hpp: precision (fp32, bf16, fp16), attention
//                 tiles and recompute policy (recompute, save_all), Mamba scan chunk and recompute policy, TTT
//                 mini-batch and state groups; the base (each list's first entry) and each
//                 other entry one axis at a time (--vary picks the axes; axes no block of --layers
//                 takes are skipped)
//   schedule      none, full, every:K, binomial:S (--quick: every:2, binomial:1; else every K from
//                 2 to the depth, S from 1 to depth - 1) and the planner's DP at three budgets
//                 (--budget, 3/4 and 1/2 of it; without one, 3/4 and 1/2 of the `none` peak)
//   micro-batch   divisors of --batch (--quick: the batch and half of it), gradient accumulation
//                 keeping the effective batch
//   logit chunk   256 and 64 rows (fit()'s own candidates)
// plus fit()'s choice for each variant when it is not already a point. --config FILE gives the
// model and grid flags as a JSON object instead.
//
// With --budget, a point whose predicted (reserved) peak is over the budget is reported with
// fits = false and NOT run (its measured fields are null in JSON, empty in CSV). Without --budget
// every point fits and runs under a budget of its own predicted reserve.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "../examples/cli_checks.hpp"
#include "grid_policies.hpp"
#include "membound/membound.hpp"

namespace mb = membound;

namespace {

struct options {
  std::string layers = "ttt,attn,mamba,attn";
  std::vector<std::string> blocks = {"ttt_linear", "attention", "mamba", "attention"};
  std::size_t width = 128, heads = 4, seq = 128, batch = 8, threads = 2, repetitions = 3;
  std::optional<std::size_t> budget;
  std::string budget_label = "--budget";  // the flag, or the --config key it came from
  bool quick = false;
  bool interleave = true;
  bool rank_by_min = false;  // --statistic min  // one timed step per point per round, --repetitions rounds
  std::vector<std::string> vary;  // compile-time axes to vary from the base (grid::axes names)
  std::string csv, json, svg;
  bool varies(const char* axis) const { return std::find(vary.begin(), vary.end(), axis) != vary.end(); }
  grid::block_kinds kinds() const {
    grid::block_kinds k;
    for (const std::string& b : blocks) {
      k.attention |= b == "attention";
      k.mamba |= b == "mamba";
      k.ttt |= b.starts_with("ttt");
    }
    return k;
  }
};

// The flags' texts: from the command line, else from --config's JSON file.
struct flag_texts {
  std::map<std::string, std::string> text;
  std::set<std::string> configured;  // flags whose text came from --config
  const CLI::App* app = nullptr;     // none: the --config file's own texts (see read_config)
  bool on_line(const std::string& flag) const { return app != nullptr && app->count(flag) > 0; }
  bool given(const std::string& flag) const { return on_line(flag) || configured.count(flag) > 0; }
  const std::string& operator[](const std::string& flag) const { return text.at(flag); }
  // The name an error message gives: the flag, or the key of --config's file.
  std::string label(const std::string& flag) const {
    return on_line(flag) ? flag : "--config key \"" + flag.substr(2) + "\"";
  }
};

// --config FILE: a JSON object whose keys are the model and grid flags without the dashes, e.g.
// {"layers": "ttt,attn", "width": 64, "seq": 256, "budget": "24MiB"}. A flag on the command line
// overrides its key. Returns the file's own texts (no command line), which main checks as a
// whole, as strictly as the command line, before the merged flags: a bad key is refused by name
// even where a flag overrides it.
flag_texts read_config(flag_texts& f) {
  namespace cc = cli_checks;
  const std::string& path = f["--config"];
  cc::input_file("--config", path, "Pass a JSON file such as {\"layers\": \"attn,mamba\", \"width\": 64}");
  std::ifstream in(path, std::ios::binary);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {  // syntax, and numbers past a double (1e400)
    throw mb::invalid_argument("--config", "a JSON object of model and grid settings", cc::in_quotes(path) + ": " + e.what(),
                               "Fix the file's JSON");
  }
  static const std::set<std::string> keys = {"layers", "width", "heads", "seq", "batch", "threads", "budget",
                                             "repetitions", "vary", "order", "statistic"};
  if (!j.is_object()) {
    throw mb::invalid_argument("--config", "a JSON object", cc::in_quotes(path) + " holds a " + j.type_name(),
                               "Write the settings as {\"key\": value, ...}");
  }
  flag_texts own;
  for (const auto& [key, value] : j.items()) {
    if (keys.count(key) == 0) {
      std::string known;
      for (const std::string& k : keys) known += (known.empty() ? "" : ", ") + k;
      throw mb::invalid_argument("--config", "keys among " + known, cc::in_quotes(path) + " has " + cc::in_quotes(key),
                                 "Remove or rename the key");
    }
    const std::string flag = "--" + key;
    // Checked even when the command line overrides it: a malformed file is not silently kept.
    static const std::map<std::string, std::string> example = {
        {"layers", "\"attn,mamba\""}, {"vary", "\"none\""}, {"order", "\"sequential\""},
        {"statistic", "\"min\""}};  // budget: a size as text ("32MiB") or a whole number of bytes
    const auto e = example.find(key);
    std::string text;
    if (value.is_string()) {
      text = value.get<std::string>();
    } else if (value.is_number_unsigned() && e == example.end()) {
      text = std::to_string(value.get<std::uint64_t>());
    } else {
      throw mb::invalid_argument("--config", "key \"" + key + "\" to be " + (e == example.end() ? "a whole number" : "a string"),
                                 cc::in_quotes(path) + " has " + value.dump(),
                                 "Write e.g. \"" + key + "\": " + (e == example.end() ? std::string("64") : e->second));
    }
    own.text[flag] = text;
    own.configured.insert(flag);
    if (f.on_line(flag)) continue;
    f.text[flag] = text;
    f.configured.insert(flag);
  }
  return own;
}

options checked_options(const flag_texts& f) {
  namespace cc = cli_checks;
  options o;
  const auto whole = [&](const char* flag, std::size_t& to, std::uint64_t lo, std::uint64_t hi) {
    if (f.given(flag)) to = cc::whole(f.label(flag), f[flag], lo, hi, flag + (" " + std::to_string(to)));
  };
  if (f.given("--backend")) {
    // The grid times the trainer's step on the CPU backend; on a GPU the model is timed by bench_cuda_model.
    if (f["--backend"] != "cpu") {
      throw mb::invalid_argument(f.label("--backend"), "cpu (the grid runs on the CPU backend; bench_cuda_model times the GPU)",
                                 cc::in_quotes(f["--backend"]), "Leave --backend out, or pass --backend cpu");
    }
  }
  whole("--threads", o.threads, 1, 256);
  whole("--width", o.width, 1, 16384);
  whole("--heads", o.heads, 1, 1024);
  if (o.width % o.heads != 0) {
    throw mb::invalid_argument(f.label("--heads"), "a divisor of the width (" + std::to_string(o.width) + ")",
                               std::to_string(o.heads), "Choose --width and --heads so that width / heads is the head size");
  }
  whole("--seq", o.seq, 1, 1u << 20);
  whole("--batch", o.batch, 1, 1u << 16);
  whole("--repetitions", o.repetitions, 1, 1000);
  if (f.given("--layers")) {
    o.layers = f["--layers"];
    o.blocks.clear();
    std::size_t at = 0;
    do {
      const std::size_t comma = std::min(o.layers.find(',', at), o.layers.size());
      const std::string name = o.layers.substr(at, comma - at);
      const std::string full = name == "ttt" ? "ttt_linear" : name == "attn" ? "attention" : name;
      if (full != "ttt_linear" && full != "ttt_mlp" && full != "attention" && full != "mamba") {
        throw mb::invalid_argument(f.label("--layers"), "a comma-separated list of ttt, ttt_mlp, attn, mamba (no empty names)",
                                   cc::in_quotes(o.layers) + " (block " + std::to_string(o.blocks.size() + 1) + ": " +
                                       cc::in_quotes(name) + ")",
                                   "e.g. --layers ttt,attn,mamba,attn");
      }
      o.blocks.push_back(full);
      at = comma + 1;
    } while (at <= o.layers.size());
    if (o.blocks.size() > 128) {
      throw mb::invalid_argument(f.label("--layers"), "at most 128 blocks", std::to_string(o.blocks.size()), "List fewer blocks");
    }
  }
  if (f.given("--budget")) {
    o.budget_label = f.label("--budget");
    o.budget = cc::size(o.budget_label, f["--budget"], "--budget 64MiB");
  }
  grid::for_each_axis([&]<typename Axis>() { o.vary.emplace_back(Axis::name); });
  if (f.given("--vary")) {
    const std::string& text = f["--vary"];
    std::vector<std::string> chosen;
    if (text != "none") {
      std::size_t at = 0;
      do {
        const std::size_t comma = std::min(text.find(',', at), text.size());
        const std::string name = text.substr(at, comma - at);
        if (std::find(o.vary.begin(), o.vary.end(), name) == o.vary.end()) {
          throw mb::invalid_argument(f.label("--vary"), "none, or a comma-separated list of " + grid::axis_names(),
                                     cc::in_quotes(text) + (name == text ? "" : " (" + cc::in_quotes(name) + ")"),
                                     "e.g. --vary precision,attention_recompute");
        }
        chosen.push_back(name);
        at = comma + 1;
      } while (at <= text.size());
    }
    o.vary = std::move(chosen);
  }
  o.quick = f.given("--quick");
  if (f.given("--statistic")) {
    o.rank_by_min = cc::one_of(f.label("--statistic"), f["--statistic"], {"median", "min"}) == "min";
  }
  if (f.given("--order")) {
    o.interleave = cc::one_of(f.label("--order"), f["--order"], {"interleaved", "sequential"}) == "interleaved";
  }
  if (f.given("--csv")) cc::output_file("--csv", o.csv = f["--csv"]);
  if (f.given("--json")) cc::output_file("--json", o.json = f["--json"]);
  if (f.given("--svg")) cc::output_file("--svg", o.svg = f["--svg"]);
  cc::distinct("--json", o.json, "--csv", o.csv);
  cc::distinct("--svg", o.svg, "--csv", o.csv);
  cc::distinct("--svg", o.svg, "--json", o.json);
  return o;
}

// One point of the grid, planned and (when it fits) measured.
struct point {
  std::string precision;  // the precision's label: fp32, bf16, fp16
  std::string variant;    // the compile-time combination: the precision and the slot off the base
  std::string axis;       // the compile-time axis this variant varies ("" for the base)
  std::vector<std::pair<std::string, std::string>> policies;  // every slot, by axis name
  void (*runner)(const struct options&, point&) = nullptr;
  mb::training_plan plan;
  std::size_t predicted = 0, predicted_reserved = 0;
  bool fits = true, ran = false, pareto = false, fit_choice = false;
  std::size_t measured = 0, measured_reserved = 0;
  double ms = 0;  // the ranking time: the median, or the min with --statistic min
  double ms_median = 0, ms_min = 0, ms_max = 0, tokens_per_s = 0;
  std::vector<double> samples;  // the timed steps' milliseconds
  std::size_t tokens = 0;       // per optimizer step
  double recompute_flops = 0;  // per optimizer step: per micro-batch times the accumulation
  std::string schedule() const { return plan.schedule.name(); }
};

double mib(std::size_t b) { return static_cast<double>(b) / (1024.0 * 1024.0); }

// Random tokens from the trainer's per-sequence random number (the data do not change the time).
struct random_tokens {
  std::size_t seq;
  void operator()(const mb::sequence_request& r, std::int32_t* x, std::int32_t* y) const {
    std::uint64_t s = r.random | 1;
    for (std::size_t t = 0; t < seq; ++t) {
      s = s * 6364136223846793005ULL + 1442695040888963407ULL;
      x[t] = static_cast<std::int32_t>((s >> 33) % 256);
      y[t] = static_cast<std::int32_t>((s >> 41) % 256);
    }
  }
};

// Points done and an estimate of the time left (the mean time per point so far), on a terminal only.
class progress {
 public:
  explicit progress(std::size_t total)
      : total_(total), tty_(isatty(fileno(stderr)) != 0), start_(std::chrono::steady_clock::now()) {}
  void tick(const std::string& what) {
    if (!tty_) {
      ++done_;
      return;
    }
    constexpr std::size_t width = 24;
    const std::size_t filled = total_ == 0 ? width : done_ * width / total_;
    std::string left = "";
    if (done_ > 0) {
      const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
      const double rest = elapsed / static_cast<double>(done_) * static_cast<double>(total_ - done_);
      char b[32];
      std::snprintf(b, sizeof b, ", %.0f s left", rest);
      left = b;
    }
    std::fprintf(stderr, "\r\033[K[%s%s] %zu/%zu%s %s", std::string(filled, '#').c_str(),
                 std::string(width - filled, '.').c_str(), done_, total_, left.c_str(), what.c_str());
    std::fflush(stderr);
    ++done_;
  }
  void finish() {
    if (tty_ && done_ > 0) std::fprintf(stderr, "\r\033[K");
  }

 private:
  std::size_t total_, done_ = 0;
  bool tty_;
  std::chrono::steady_clock::time_point start_;
};

using stack = mb::budget_allocator<mb::traced_allocator<mb::expandable_arena<mb::host_virtual_memory>>>;
constexpr std::size_t no_budget_limit = std::size_t{1} << 34;  // without --budget: what a plan may reserve

// The arena's address range for a budget: the budget in pages, at most 1 TiB (as the example
// trainer's). The whole range is reserved up front, so a budget of 100 TiB would ask the kernel
// for 100 TiB of address space, and one within a page of 2^64 would round to 0; no grid point
// commits a terabyte.
std::size_t arena_capacity(std::size_t limit, std::size_t page) {
  return mb::align_up(std::min<std::size_t>(limit, std::size_t{1} << 40), page);
}

// The library refuses what the flags could not know alone (a head size a block does not take).
template <typename F>
auto under_flags(const options& o, F make) -> decltype(make()) {
  try {
    return make();
  } catch (const mb::invalid_argument& e) {
    const std::string& a = e.argument();
    if (!(a.starts_with("config.") || a.starts_with("shape."))) throw;
    throw mb::invalid_argument("--width, --heads and --seq",
                               "a shape every block of --layers " + o.layers + " takes (" + a + ": " + e.expected() + ")",
                               "width " + std::to_string(o.width) + ", heads " + std::to_string(o.heads) + ", seq " +
                                   std::to_string(o.seq),
                               "e.g. --width 128 --heads 4 --seq 128");
  }
}

template <typename C>
void run_point(const options& o, point& q);

// Plans every point of one compile-time combination C (nothing runs yet) and marks fit()'s choice.
template <typename C>
void plan_points(const options& o, std::vector<point>& out, const std::string& axis, const std::string& label) {
  using net = typename grid::grid_model<C>::net;
  mb::model_config cfg;
  cfg.vocab = 256;
  cfg.width = o.width;
  cfg.heads = o.heads;
  std::vector<std::size_t> pattern;
  for (const std::string& name : o.blocks) pattern.push_back(net::mixer_index(name));
  const net m = under_flags(o, [&] { return net(cfg, pattern); });
  const mb::batch_shape eff{o.batch, o.seq};
  under_flags(o, [&] {
    m.check(eff);
    return 0;
  });
  const std::size_t limit = o.budget.value_or(no_budget_limit);
  const std::size_t page = mb::host_virtual_memory::page_size();
  mb::trace_recorder recorder(4096);
  // A stack like each point's run, for its reserve function (the shadow of its rounding).
  stack probe(limit, recorder, mb::expandable_arena_options{arena_capacity(limit, page)}, page);
  const mb::reserve_function reserve = mb::reserve_model(m, probe);

  using K = mb::schedule_choice::kind;
  const std::size_t L = m.depth();
  std::vector<mb::schedule_choice> schedules{{K::none, 0}, {K::full, 0}};
  if (o.quick) {
    if (L >= 2) schedules.push_back({K::every, 2});
    schedules.push_back({K::binomial, 1});
  } else {
    for (std::size_t k = 2; k <= L; ++k) schedules.push_back({K::every, k});
    for (std::size_t s = 1; s < std::max<std::size_t>(L, 2); ++s) schedules.push_back({K::binomial, s});
  }
  // The DP at a few budgets: --budget and 3/4 and 1/2 of it, or without one 3/4 and 1/2 of the
  // peak that saves everything (none) at the full batch.
  if (o.budget) {
    for (std::size_t b : {*o.budget, *o.budget / 4 * 3, *o.budget / 2}) schedules.push_back({K::budget, b});
  } else {
    const mb::training_plan keep_all = mb::make_plan(m, eff, mb::schedule_choice{K::none, 0}, mb::plan_options{o.threads});
    for (std::size_t b : {keep_all.peak_bytes / 4 * 3, keep_all.peak_bytes / 2}) schedules.push_back({K::budget, b});
  }
  std::vector<std::size_t> micro;
  for (std::size_t b = o.batch; b >= 1; --b) {
    if (o.batch % b != 0) continue;
    if (o.quick && b != o.batch && b != o.batch / 2) continue;
    micro.push_back(b);
  }
  const std::vector<std::size_t> chunks{256, 64};

  const std::size_t first = out.size();
  const auto add = [&](mb::training_plan p) {
    point q;
    q.precision = grid::policy_label<grid::at_t<C, 0>>::get();
    q.variant = label;
    q.axis = axis;
    grid::for_each_slot<C>([&](const char* name, std::string v) { q.policies.emplace_back(name, std::move(v)); });
    q.runner = &run_point<C>;
    if (p.reserved_peak == 0) p.reserved_peak = reserve(p);
    q.predicted = p.peak_bytes;
    q.predicted_reserved = p.budgeted_peak();
    q.fits = !o.budget || p.budgeted_peak() <= *o.budget;
    q.recompute_flops = p.recompute_flops * static_cast<double>(p.accumulation);
    q.plan = std::move(p);
    out.push_back(std::move(q));
  };
  for (std::size_t b : micro) {
    for (std::size_t chunk : chunks) {
      mb::plan_options po{o.threads, chunk, o.batch / b, true};
      for (const mb::schedule_choice& s : schedules) {
        try {
          mb::training_plan p = mb::make_plan(m, mb::batch_shape{b, o.seq}, s, po, o.budget.value_or(0));
          // The DP's answer when nothing meets the budget: a peak past any address space, no point.
          if (s.k == K::budget && mb::saturated(p.peak_bytes)) continue;
          add(std::move(p));
        } catch (const mb::invalid_argument&) {
          // The DP finds no plan under the budget at this micro-batch and chunk: no point.
          if (s.k != K::budget) throw;
        }
      }
    }
  }
  // fit()'s choice at the budget (without one, at the run's limit: it then takes the least recompute).
  mb::fit_options fo;
  fo.threads = o.threads;
  fo.reserve = reserve;
  std::optional<mb::training_plan> chosen;
  try {
    chosen = mb::fit(m, eff, limit, fo);
  } catch (const mb::budget_too_small&) {
  }
  if (!chosen) return;
  for (std::size_t i = first; i < out.size(); ++i) {
    const mb::training_plan& p = out[i].plan;
    if (p.schedule == chosen->schedule && p.micro.batch == chosen->micro.batch && p.head_chunk == chosen->head_chunk) {
      out[i].fit_choice = true;
      return;
    }
  }
  add(std::move(*chosen));
  out.back().fit_choice = true;
}

// Runs one point: a fresh stack under the budget (or its own reserve), one warm-up step and the
// repetitions, each a full optimizer step of the trainer.
template <typename C>
void run_point(const options& o, point& q) {
  using net = typename grid::grid_model<C>::net;
  mb::model_config cfg;
  cfg.vocab = 256;
  cfg.width = o.width;
  cfg.heads = o.heads;
  std::vector<std::size_t> pattern;
  for (const std::string& name : o.blocks) pattern.push_back(net::mixer_index(name));
  const net m(cfg, pattern);
  const std::size_t page = mb::host_virtual_memory::page_size();
  const std::size_t limit = o.budget.value_or(no_budget_limit);
  mb::trace_recorder recorder(4096);
  stack alloc(limit, recorder, mb::expandable_arena_options{arena_capacity(limit, page)}, page);
  mb::thread_pool pool(o.threads);
  mb::trainer_options to;
  to.replan_under_pressure = false;  // the point's plan, never another
  mb::trainer t(m, mb::batch_shape{o.batch, o.seq}, q.plan, alloc, pool, to);
  random_tokens src{o.seq};
  // Interleaved: this round's one timed step; sequential: every repetition, back to back.
  const std::size_t timed = o.interleave ? 1 : o.repetitions;
  for (std::size_t i = 0; i <= timed; ++i) {
    const mb::step_result r = t.step(src);
    if (!r.replans.empty()) throw mb::error("membound: policy_grid: the trainer changed the plan of a grid point");
    if (i > 0) {
      q.samples.push_back(r.ms);
      q.tokens = r.tokens;
    }
  }
  // Every round runs the same plan on a fresh stack: the peaks are the largest seen (and equal).
  const auto st = alloc.stats();
  q.measured = std::max(q.measured, st.peak_requested);
  q.measured_reserved = std::max(q.measured_reserved, st.peak_reserved);
  q.ran = true;
}

// Median, min and max of a point's timed steps; the time that ranks it is the median, or with
// --statistic min the least (on a machine whose load only ever adds time, the least is the one
// nearest the work itself).
void summarize(point& q, bool rank_by_min) {
  std::vector<double> ms = q.samples;
  std::sort(ms.begin(), ms.end());
  const std::size_t n = ms.size();
  q.ms_median = n % 2 == 1 ? ms[n / 2] : (ms[n / 2 - 1] + ms[n / 2]) / 2;
  q.ms_min = ms.front();
  q.ms_max = ms.back();
  q.ms = rank_by_min ? q.ms_min : q.ms_median;
  q.tokens_per_s = q.ms > 0 ? static_cast<double>(q.tokens) / (q.ms / 1000.0) : 0;
}

// The base and, for each axis in --vary that a block of --layers takes, its other entries.
void plan_all(const options& o, std::vector<point>& out) {
  const grid::block_kinds kinds = o.kinds();
  grid::for_each_variant([&]<typename C>(const char* axis, std::string label) {
    if (*axis != '\0') {
      if (!o.varies(axis)) return;
      bool applies = false;
      grid::for_each_axis([&]<typename Axis>() { applies |= std::string(Axis::name) == axis && Axis::applies(kinds); });
      if (!applies) return;
    }
    plan_points<C>(o, out, axis, label);
  });
}

void mark_pareto(std::vector<point>& pts) {
  for (point& p : pts) {
    if (!p.ran) continue;
    p.pareto = std::none_of(pts.begin(), pts.end(), [&](const point& q) {
      return q.ran && q.ms <= p.ms && q.measured <= p.measured && (q.ms < p.ms || q.measured < p.measured);
    });
  }
}

std::string micro_text(const point& p) {
  return std::to_string(p.plan.micro.batch) + "x" + std::to_string(p.plan.accumulation);
}

std::string table(const options& o, const std::vector<point>& pts) {
  std::string s;
  char line[256];
  std::snprintf(line, sizeof line, "%-22s %-17s %-6s %5s %10s %10s %10s %9s %19s %10s %10s %4s %s\n", "policies", "schedule",
                "microx", "chunk", "pred MiB", "meas MiB", "resv MiB", o.rank_by_min ? "ms min" : "ms median", "ms min-max", "tok/s", "recomp GF", "fits",
                "marks");
  s += line;
  for (const point& p : pts) {
    std::string marks;
    if (p.pareto) marks += "P";
    if (p.fit_choice) marks += "F";
    if (p.ran) {
      char range[40];
      std::snprintf(range, sizeof range, "%.1f-%.1f", p.ms_min, p.ms_max);
      std::snprintf(line, sizeof line, "%-22s %-17s %-6s %5zu %10.3f %10.3f %10.3f %9.1f %19s %10.0f %10.3f %4s %s\n",
                    p.variant.c_str(), p.schedule().c_str(), micro_text(p).c_str(), p.plan.head_chunk,
                    mib(p.predicted), mib(p.measured), mib(p.measured_reserved), p.ms, range, p.tokens_per_s,
                    p.recompute_flops / 1e9, "yes", marks.c_str());
    } else {
      std::snprintf(line, sizeof line, "%-22s %-17s %-6s %5zu %10.3f %10s %10s %9s %19s %10s %10.3f %4s %s\n",
                    p.variant.c_str(), p.schedule().c_str(), micro_text(p).c_str(), p.plan.head_chunk,
                    mib(p.predicted), "-", "-", "-", "-", "-", p.recompute_flops / 1e9, "NO", marks.c_str());
    }
    s += line;
  }
  return s;
}

std::string csv(const std::vector<point>& pts) {
  std::ostringstream os;
  os << "variant,precision,schedule,micro_batch,accumulation,logit_chunk,predicted_peak_bytes,predicted_reserved_peak_bytes,"
        "measured_peak_bytes,measured_reserved_peak_bytes,time_ms,time_ms_median,time_ms_min,time_ms_max,tokens_per_second,"
        "recompute_flops,fits,pareto,fit_choice\n";
  for (const point& p : pts) {
    os << p.variant << ',' << p.precision << ',' << p.schedule() << ',' << p.plan.micro.batch << ',' << p.plan.accumulation << ','
       << p.plan.head_chunk << ',' << p.predicted << ',' << p.predicted_reserved << ',';
    if (p.ran) {
      os << p.measured << ',' << p.measured_reserved << ',' << p.ms << ',' << p.ms_median << ',' << p.ms_min << ',' << p.ms_max << ','
         << p.tokens_per_s << ',';
    } else {
      os << ",,,,,,,";
    }
    os << p.recompute_flops << ',' << (p.fits ? "true" : "false") << ',' << (p.pareto ? "true" : "false") << ','
       << (p.fit_choice ? "true" : "false") << '\n';
  }
  return os.str();
}

nlohmann::json to_json(const options& o, const std::vector<point>& pts, double wall_s) {
  nlohmann::json j;
  j["model"] = {{"layers", o.layers}, {"width", o.width}, {"heads", o.heads}, {"seq", o.seq},
                {"batch", o.batch},   {"vocab", 256},     {"threads", o.threads}};
  j["budget_bytes"] = o.budget ? nlohmann::json(*o.budget) : nlohmann::json(nullptr);
  j["repetitions"] = o.repetitions;
  j["order"] = o.interleave ? "interleaved" : "sequential";
  j["statistic"] = o.rank_by_min ? "min" : "median";
  j["quick"] = o.quick;
  j["wall_seconds"] = wall_s;
  j["over_budget_points"] = "not run";
  nlohmann::json list = nlohmann::json::array();
  const auto or_null = [](bool ran, auto v) { return ran ? nlohmann::json(v) : nlohmann::json(nullptr); };
  for (const point& p : pts) {
    nlohmann::json policies = nlohmann::json::object();
    for (const auto& [axis, value] : p.policies) policies[axis] = value;
    list.push_back({{"variant", p.variant},
                    {"axis", p.axis},
                    {"policies", std::move(policies)},
                    {"precision", p.precision},
                    {"schedule", p.schedule()},
                    {"micro_batch", p.plan.micro.batch},
                    {"accumulation", p.plan.accumulation},
                    {"logit_chunk", p.plan.head_chunk},
                    {"predicted_peak_bytes", p.predicted},
                    {"predicted_reserved_peak_bytes", p.predicted_reserved},
                    {"measured_peak_bytes", or_null(p.ran, p.measured)},
                    {"measured_reserved_peak_bytes", or_null(p.ran, p.measured_reserved)},
                    {"time_ms", or_null(p.ran, p.ms)},
                    {"time_ms_median", or_null(p.ran, p.ms_median)},
                    {"time_ms_min", or_null(p.ran, p.ms_min)},
                    {"time_ms_max", or_null(p.ran, p.ms_max)},
                    {"tokens_per_second", or_null(p.ran, p.tokens_per_s)},
                    {"recompute_flops", p.recompute_flops},
                    {"fits", p.fits},
                    {"ran", p.ran},
                    {"pareto", p.pareto},
                    {"fit_choice", p.fit_choice}});
  }
  j["points"] = std::move(list);
  return j;
}

std::string xml_escape(const std::string& s) {
  std::string r;
  for (char c : s) {
    if (c == '&') r += "&amp;";
    else if (c == '<') r += "&lt;";
    else if (c == '>') r += "&gt;";
    else if (c == '"') r += "&quot;";
    else r += c;
  }
  return r;
}

// Time per step (y) against the measured peak (x), one colour per compile-time variant; points
// over the budget at their predicted peak as hollow red marks along the top; the Pareto front as
// a line through numbered points, spelled out in the legend (labels next to 200 points overlap);
// fit()'s choices ringed in green; the budget as a vertical line.
std::string svg(const options& o, const std::vector<point>& pts) {
  constexpr double W = 1240, left = 70, plot_right = 700, top = 30, bottom = 60, legend_x = 720;
  static constexpr const char* palette[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
                                            "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};
  std::vector<std::string> variants;
  for (const point& p : pts) {
    if (std::find(variants.begin(), variants.end(), p.variant) == variants.end()) variants.push_back(p.variant);
  }
  std::vector<const point*> front;
  for (const point& p : pts) {
    if (p.pareto) front.push_back(&p);
  }
  std::sort(front.begin(), front.end(), [](const point* a, const point* c) { return a->measured < c->measured; });
  // Tall enough for the legend: a title, the variants, two marks, a title, the front.
  const double H = std::max(560.0, top + 15.0 * static_cast<double>(variants.size() + front.size() + 6) + 40);
  const auto colour = [&](const point& p) {
    const auto i = static_cast<std::size_t>(std::find(variants.begin(), variants.end(), p.variant) - variants.begin());
    return palette[i % std::size(palette)];
  };
  // The memory axis spans the points and the budget, with a margin: from 0 the points crowd a corner.
  double xlo = 1e300, xhi = 0, ymax = 0;
  for (const point& p : pts) {
    const double x = mib(p.ran ? p.measured : p.predicted);
    xlo = std::min(xlo, x);
    xhi = std::max(xhi, x);
    if (p.ran) ymax = std::max(ymax, p.ms);  // the plotted statistic
  }
  if (o.budget) {
    xlo = std::min(xlo, mib(*o.budget));
    xhi = std::max(xhi, mib(*o.budget));
  }
  if (xlo > xhi) xlo = xhi = 0;
  const double pad = std::max((xhi - xlo) * 0.06, 0.05);
  xlo = std::max(0.0, xlo - pad);
  xhi += pad;
  ymax = ymax > 0 ? ymax * 1.1 : 1;
  const auto X = [&](double v) { return left + (v - xlo) / (xhi - xlo) * (plot_right - left); };
  const auto Y = [&](double v) { return H - bottom - v / ymax * (H - top - bottom); };
  std::ostringstream s;
  char b[768];
  s << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  std::snprintf(b, sizeof b,
                "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" "
                "font-family=\"sans-serif\" font-size=\"11\">\n",
                W, H, W, H);
  s << b << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  const std::string title = "policy_grid: " + o.layers + ", width " + std::to_string(o.width) + ", seq " +
                            std::to_string(o.seq) + ", batch " + std::to_string(o.batch) + ", " +
                            std::to_string(o.threads) + " threads";
  s << "<title>" << xml_escape(title) << "</title>\n";
  std::snprintf(b, sizeof b, "<text x=\"%.1f\" y=\"18\" font-size=\"13\">%s</text>\n", left, xml_escape(title).c_str());
  s << b;
  std::snprintf(b, sizeof b,
                "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"black\"/>\n"
                "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"black\"/>\n",
                left, H - bottom, plot_right, H - bottom, left, H - bottom, left, top);
  s << b;
  for (int i = 0; i <= 5; ++i) {
    const double xv = xlo + (xhi - xlo) * i / 5, yv = ymax * i / 5;
    std::snprintf(b, sizeof b,
                  "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%.2f</text>\n"
                  "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%.0f</text>\n",
                  X(xv), H - bottom + 16, xv, left - 6, Y(yv) + 4, yv);
    s << b;
  }
  std::snprintf(b, sizeof b,
                "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">measured peak (MiB, requested bytes)</text>\n"
                "<text x=\"16\" y=\"%.1f\" text-anchor=\"middle\" transform=\"rotate(-90 16 %.1f)\">time per optimizer "
                "step (ms, %s)</text>\n",
                (left + plot_right) / 2, H - 18, (top + H - bottom) / 2, (top + H - bottom) / 2, o.rank_by_min ? "least" : "median");
  s << b;
  if (o.budget) {
    std::snprintf(b, sizeof b,
                  "<line class=\"budget\" x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"red\" "
                  "stroke-dasharray=\"6 4\"/>\n<text x=\"%.1f\" y=\"%.1f\" fill=\"red\" text-anchor=\"end\">budget "
                  "%.1f MiB</text>\n",
                  X(mib(*o.budget)), top, X(mib(*o.budget)), H - bottom, X(mib(*o.budget)) - 4, H - bottom - 6,
                  mib(*o.budget));
    s << b;
  }
  const auto label = [](const point& p) {
    return p.variant + ", " + p.schedule() + ", " + micro_text(p) + ", chunk " + std::to_string(p.plan.head_chunk);
  };
  for (const point& p : pts) {
    if (p.ran) {
      std::snprintf(b, sizeof b,
                    "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"%s\" fill-opacity=\"0.75\"><title>%s: %.1f ms, "
                    "%.3f MiB</title></circle>\n",
                    X(mib(p.measured)), Y(p.ms), colour(p), xml_escape(label(p)).c_str(), p.ms, mib(p.measured));
    } else {
      std::snprintf(b, sizeof b,
                    "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"none\" stroke=\"red\"><title>%s: predicted %.3f "
                    "MiB, over the budget, not run</title></circle>\n",
                    X(mib(p.predicted)), top + 4, xml_escape(label(p)).c_str(), mib(p.predicted));
    }
    s << b;
  }
  for (const point& p : pts) {
    if (!p.fit_choice || !p.ran) continue;
    std::snprintf(b, sizeof b,
                  "<circle class=\"fit\" cx=\"%.1f\" cy=\"%.1f\" r=\"6\" fill=\"none\" stroke=\"#2ca02c\" "
                  "stroke-width=\"1.5\"><title>fit's choice: %s</title></circle>\n",
                  X(mib(p.measured)), Y(p.ms), xml_escape(label(p)).c_str());
    s << b;
  }
  if (!front.empty()) {
    s << "<polyline class=\"pareto\" fill=\"none\" stroke=\"black\" stroke-width=\"1.2\" points=\"";
    for (const point* p : front) {
      std::snprintf(b, sizeof b, "%.1f,%.1f ", X(mib(p->measured)), Y(p->ms));
      s << b;
    }
    s << "\"/>\n";
    for (std::size_t i = 0; i < front.size(); ++i) {
      std::snprintf(b, sizeof b, "<text x=\"%.1f\" y=\"%.1f\" font-weight=\"bold\">%zu</text>\n",
                    X(mib(front[i]->measured)) + 5, Y(front[i]->ms) + 14, i + 1);
      s << b;
    }
  }
  // The legend: the variants' colours, then the numbered front.
  double ly = top + 4;
  s << "<text x=\"" << legend_x << "\" y=\"" << ly << "\" font-weight=\"bold\">variants</text>\n";
  for (const std::string& v : variants) {
    ly += 15;
    const point* any = nullptr;
    for (const point& p : pts) {
      if (p.variant == v) {
        any = &p;
        break;
      }
    }
    std::snprintf(b, sizeof b,
                  "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"4\" fill=\"%s\"/><text x=\"%.1f\" y=\"%.1f\">%s</text>\n",
                  legend_x + 4, ly - 4, colour(*any), legend_x + 14, ly, xml_escape(v).c_str());
    s << b;
  }
  ly += 15;
  std::snprintf(b, sizeof b,
                "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"6\" fill=\"none\" stroke=\"#2ca02c\" stroke-width=\"1.5\"/>"
                "<text x=\"%.1f\" y=\"%.1f\">fit()'s choice</text>\n"
                "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"none\" stroke=\"red\"/>"
                "<text x=\"%.1f\" y=\"%.1f\">over the budget (predicted), not run</text>\n",
                legend_x + 4, ly - 4, legend_x + 14, ly, legend_x + 4, ly + 11, legend_x + 14, ly + 15);
  s << b;
  ly += 15;
  if (!front.empty()) {
    ly += 24;
    s << "<text x=\"" << legend_x << "\" y=\"" << ly << "\" font-weight=\"bold\">Pareto front</text>\n";
    for (std::size_t i = 0; i < front.size(); ++i) {
      ly += 15;
      std::snprintf(b, sizeof b, "<text x=\"%.1f\" y=\"%.1f\">%zu: %s: %.1f ms, %.2f MiB</text>\n", legend_x, ly,
                    i + 1, xml_escape(label(*front[i])).c_str(), front[i]->ms, mib(front[i]->measured));
      s << b;
    }
  }
  s << "</svg>\n";
  return s.str();
}

int run(const options& o) {
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<point> pts;
  plan_all(o, pts);
  if (o.budget && std::none_of(pts.begin(), pts.end(), [](const point& p) { return p.fits; })) {
    std::size_t least = SIZE_MAX;
    for (const point& p : pts) least = std::min(least, p.predicted_reserved);
    throw mb::invalid_argument(o.budget_label, "a budget at least one point of the grid fits (the least predicted peak is " +
                                                   mb::format_bytes(least, false) + ")",
                               mb::format_bytes(*o.budget, false), "Raise it, or leave it out");
  }
  std::size_t to_run = 0;
  for (const point& p : pts) to_run += p.fits ? 1 : 0;
  std::printf("policy_grid: %s, width %zu, %zu heads, seq %zu, batch %zu, %zu threads, budget %s; %zu points, %zu "
              "to run, %zu repetitions (%s)\n",
              o.layers.c_str(), o.width, o.heads, o.seq, o.batch, o.threads,
              o.budget ? mb::format_bytes(*o.budget, false).c_str() : "none", pts.size(), to_run, o.repetitions,
              o.interleave ? "interleaved rounds, each with its own warm-up step" : "back to back after one warm-up step");
  // Interleaved rounds spread a burst of load from elsewhere over every point's samples instead
  // of landing it on the few points that happen to run during it.
  const std::size_t rounds = o.interleave ? o.repetitions : 1;
  progress bar(to_run * rounds);
  for (std::size_t r = 0; r < rounds; ++r) {
    for (point& p : pts) {
      if (!p.fits) continue;
      bar.tick("round " + std::to_string(r + 1) + "/" + std::to_string(rounds) + ": " + p.variant + " " + p.schedule() +
               " " + micro_text(p) + " c" + std::to_string(p.plan.head_chunk));
      p.runner(o, p);
    }
  }
  bar.finish();
  for (point& p : pts) {
    if (p.ran) summarize(p, o.rank_by_min);
  }
  mark_pareto(pts);
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%s", table(o, pts).c_str());
  std::printf("marks: P = Pareto front over (%s time, measured peak) among points that ran; F = fit()'s choice%s\n",
              o.rank_by_min ? "least" : "median", o.budget ? "; fits NO = predicted reserved peak over --budget, not run" : "");
  // fit's choice against the fastest point that ran in its variant (fit chooses the run-time
  // axes only), and the base's choice against the fastest point of the whole grid.
  const auto name = [](const point& p) {
    return p.variant + " " + p.schedule() + " " + micro_text(p) + " c" + std::to_string(p.plan.head_chunk);
  };
  const point* fastest_all = nullptr;
  for (const point& p : pts) {
    if (p.ran && (!fastest_all || p.ms < fastest_all->ms)) fastest_all = &p;
  }
  for (const point& f : pts) {
    if (!f.fit_choice || !f.ran) continue;
    const point* fastest = nullptr;
    for (const point& p : pts) {
      if (p.ran && p.variant == f.variant && (!fastest || p.ms < fastest->ms)) fastest = &p;
    }
    std::printf("fit's choice %s: %.1f ms; the fastest point of %s (%s): %.1f ms; ratio %.2f\n", name(f).c_str(),
                f.ms, f.variant.c_str(), name(*fastest).c_str(), fastest->ms, f.ms / fastest->ms);
    if (f.axis.empty()) {
      std::printf("the fastest point of the whole grid: %s, %.1f ms; the base's fit choice takes %.2fx its time\n",
                  name(*fastest_all).c_str(), fastest_all->ms, f.ms / fastest_all->ms);
    }
  }
  // How far to trust a ranking: the spread of the repetitions, (max - min) / median, over points.
  std::vector<double> spread;
  for (const point& p : pts) {
    if (p.ran && p.ms_median > 0) spread.push_back((p.ms_max - p.ms_min) / p.ms_median);
  }
  if (!spread.empty() && o.repetitions > 1) {
    std::sort(spread.begin(), spread.end());
    std::printf("spread of the repetitions, (max - min) / median: median %.1f%%, 90th percentile %.1f%%, worst %.1f%%\n",
                100 * spread[spread.size() / 2], 100 * spread[spread.size() * 9 / 10], 100 * spread.back());
  }
  bool exact = true;
  for (const point& p : pts) exact = exact && (!p.ran || (p.measured == p.predicted && p.measured_reserved <= p.predicted_reserved));
  std::printf("measured peak == predicted peak at every point that ran: %s; wall time %.1f s\n", exact ? "yes" : "NO",
              wall);
  if (!o.csv.empty()) cli_checks::write_file("--csv", o.csv, [&](std::ostream& os) { os << csv(pts); });
  if (!o.json.empty())
    cli_checks::write_file("--json", o.json, [&](std::ostream& os) { os << to_json(o, pts, wall).dump(2) << "\n"; });
  if (!o.svg.empty()) cli_checks::write_file("--svg", o.svg, [&](std::ostream& os) { os << svg(o, pts); });
  return exact ? 0 : 3;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"policy_grid: time and measured peak of a model's training step over a grid of policies"};
  flag_texts f;
  f.app = &app;
  const auto flag = [&](const std::string& name, const std::string& type, const std::string& help) {
    app.add_option(name, f.text[name], help)->type_name(type);
  };
  flag("--layers", "LIST", "block pattern: ttt, ttt_mlp, attn, mamba, comma-separated (default ttt,attn,mamba,attn)");
  flag("--width", "1..16384", "model width (default 128)");
  flag("--heads", "1..1024", "attention and TTT heads, a divisor of --width (default 4)");
  flag("--seq", "1..2^20", "sequence length (default 128)");
  flag("--batch", "1..65536", "sequences per optimizer step (default 8)");
  flag("--threads", "1..256", "CPU threads (default 2)");
  flag("--budget", "SIZE", "memory budget, e.g. 32MiB; points over it are marked and not run (default: none)");
  flag("--repetitions", "1..1000", "timed steps per point (default 3; see --order)");
  flag("--vary", "LIST", "compile-time axes varied from the base, comma-separated, or none (default: all of " +
                             grid::axis_names() + ")");
  flag("--config", "FILE", "a JSON object of the settings above, keys without dashes (flags override it)");
  flag("--backend", "cpu", "where the step runs: cpu only (default; on a GPU, bench_cuda_model times the model)");
  flag("--order", "interleaved|sequential",
       "interleaved (default): --repetitions rounds, each a fresh warm-up and one timed step of every point; "
       "sequential: one warm-up, then every repetition of a point back to back");
  flag("--statistic", "median|min",
       "the time that ranks points, marks the Pareto front and is plotted (default median; min suits a loaded machine)");
  flag("--csv", "FILE", "write the points as CSV here");
  flag("--json", "FILE", "write the points as JSON here");
  flag("--svg", "FILE", "write a plot of time against measured peak here");
  bool quick_flag = false;
  app.add_flag("--quick", quick_flag, "a small grid: none, full, every:2, binomial:1 (+ DP at --budget), micro-batch batch and batch/2");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);
    std::fprintf(stderr, "error: %s (see --help)\n", cli_checks::one_line(e.what()).c_str());
    return 1;
  }
  try {
    if (f.on_line("--config")) (void)checked_options(read_config(f));  // the file on its own first
    return run(checked_options(f));
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "error: %s\n", cli_checks::one_line(e.what()).c_str());
    return 1;
  }
}
