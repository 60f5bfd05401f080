// What the example trainer's two halves share: the checked flags, the data windows, the step line,
// and the device run's entry points. train.cpp runs on the CPU (and under mpirun); train_cuda.cu,
// compiled by nvcc when the build has CUDA, runs the same loop on a GPU (--device cuda).
#pragma once

#include <algorithm>
#include <functional>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>
#include <sys/ioctl.h>
#include <unistd.h>

#include "cli_checks.hpp"
#include "membound/membound.hpp"

#ifndef MEMBOUND_SOURCE_DIR
#define MEMBOUND_SOURCE_DIR "."
#endif

namespace train_example {

namespace mb = membound;

// --optimizer adamw8bit: the default block (2048), named by a one-parameter template.
template <typename S>
using adamw8bit_2048 = mb::adamw8bit<S, 2048>;

struct foreign_load {  // --foreign SIZE@STEP: bytes someone else takes from the budget from STEP on
  std::size_t bytes = 0;
  std::uint64_t at_step = 0;
};

// The run as the flags describe it, every value checked (checked_options below).
struct options {
  std::string data = MEMBOUND_SOURCE_DIR "/examples/data/tinyshakespeare.txt";
  std::size_t budget = std::size_t{32} << 20;
  std::string layers = "ttt,attn,mamba,attn";
  std::vector<std::string> blocks = {"ttt_linear", "attention", "mamba", "attention"};  // layers, full names
  std::size_t width = 128, heads = 4, seq = 128, batch = 8, steps = 200, threads = 2;
  std::size_t window = 0;  // --window: W of the swa (sliding-window attention) blocks
  std::size_t experts = 8, top_k = 2;  // --experts, --top-k: the attn_moe blocks' mixture
  double capacity = 1.25, aux = 0.01;  // --capacity, --aux: its capacity factor, balancing-loss weight
  std::size_t pack = 0;    // --pack S: paragraphs packed into rows of --seq tokens, at most S per row (0: windows)
  std::size_t zero = 0;  // ZeRO stage over MPI ranks (one process: 1 is 0)
  std::size_t overlap = 0;  // 1: each block's gradient exchange overlaps the next block's backward
  std::size_t timeout = 0;  // seconds any collective may take under mpirun; 0: no limit
  std::string precision = "fp32";
  std::string optimizer = "adamw";
  // --offload: none, auto (the optimizer's state on the host only when no plan fits --budget with
  // it), optimizer (always); --host-budget: the host space's budget (0: none).
  std::string offload = "none";
  std::size_t host_budget = 0;
  std::string schedule = "auto";
  std::optional<mb::schedule_choice> fixed_schedule;  // empty: auto, the planner's fit
  double lr = 3e-3, min_lr = 3e-4, weight_decay = 0.1, clip = 1.0;
  std::size_t warmup = 30, eval_every = 50, eval_sequences = 32, sample = 200, save_every = 0, stop_after = 0;
  std::uint64_t seed = 1;
  std::string checkpoint = "train.ckpt", resume, report, trace;
  foreign_load foreign;
  // cpu, or cuda: the run on a GPU (train_cuda.cu). The default is cuda when the build has CUDA
  // and a device is visible, with the GPU's defaults below (apply_device_defaults).
  std::string device = "cpu";
  double budget_fraction = 0;  // --budget 0.9: that fraction of the device's memory (cuda only)
  bool seq_max = false;        // --seq max: the longest length fit() admits under the emergency line (cuda, or --pack)
  std::size_t plan_only = 0;   // --plan-only 1: print the plan (and --seq max's length) and stop
  std::size_t accept_changes = 0;  // --resume under flags that change the run: refused (0) or taken (1)
  std::string attention_kernels = "mma";  // cuda, bf16: mma (mma.sync, the default), wmma (the fallback), cudnn, cudnn-atomic
  bool saves() const { return save_every != 0 || stop_after != 0; }
};

// Each thread has its own workspace: with many, fewer threads is a way out of a budget too.
inline std::string fewer_threads(const options& o) {
  return o.threads > 2 ? " Or lower --threads (" + std::to_string(o.threads) + " now: each thread has its own workspace)."
                       : "";
}

// The library refuses what the flags could not know alone: a shape a block does not take (TTT: an
// even head size; attention: a multiple of 8 up to 256) or a budget no plan fits. Its refusal is
// given back under the flags that set it. Call inside a catch block.
[[noreturn]] inline void rethrow_under_flags(const options& o) {
  try {
    throw;
  } catch (const mb::budget_too_small& e) {
    throw mb::invalid_argument("--budget", e.expected(), e.actual(),
                               e.what_to_do() +
                                   (o.offload == "none" && o.device == "cpu"
                                        ? "; or --offload auto (the optimizer's state in a host space beside it)"
                                        : "") +
                                   fewer_threads(o));
  } catch (const mb::host_budget_too_small& e) {
    throw mb::invalid_argument("--host-budget", e.expected(), e.actual(),
                               "Raise --host-budget to at least " + mb::format_bytes(e.host_minimum(), false) +
                                   ", or --budget so that the optimizer's state fits beside the step, or "
                                   "--optimizer adamw8bit");
  } catch (const mb::invalid_argument& e) {
    const std::string& a = e.argument();
    if (a == "shape.capacity_factor") {  // attn_moe blocks: no slot per expert at these tokens
      throw mb::invalid_argument("--capacity", e.expected(), e.actual(),
                                 "Raise --capacity, or give each micro-batch more tokens (--seq, --batch), or "
                                 "--capacity 0 (no limit)");
    }
    const bool shape = a.starts_with("config.") || a.starts_with("shape.");
    if (!shape || (a.find("width") == a.npos && a.find("head") == a.npos && a.find("d_model") == a.npos)) throw;
    throw mb::invalid_argument("--width and --heads",
                               "a shape every block of --layers " + o.layers + " takes (" + e.argument() + ": " +
                                   e.expected() + ")",
                               "width " + std::to_string(o.width) + ", heads " + std::to_string(o.heads) +
                                   " (head size " + std::to_string(o.width / o.heads) + ")",
                               "e.g. --width 128 --heads 4");
  }
}
// A step that found no plan fitting beside the bytes others hold (--foreign's, and on a GPU the
// context's and other processes'): the budget must grow by what the least plan lacks, or
// --foreign take that much less. `budget`: the whole budget in bytes. Anything else is rethrown
// as it is. Call inside a catch block.
[[noreturn]] inline void rethrow_mid_run(const options& o, std::size_t budget, bool foreign_taken) {
  try {
    throw;
  } catch (const mb::budget_too_small& e) {
    // e.budget() is the room left beside the others' bytes; e.minimum() the least plan's peak.
    const std::size_t lacking = e.minimum() > e.budget() ? e.minimum() - e.budget() : 0;
    // Exact byte counts, as the flags take them (a SIZE is a whole number of bytes).
    const auto as_flag = [](std::size_t b) { return std::to_string(b) + "B (" + mb::format_bytes(b, false) + ")"; };
    std::string todo = "Raise --budget to at least " + as_flag(mb::sat_add(budget, lacking));
    if (foreign_taken && o.foreign.bytes > lacking) {
      todo += ", or take at most " + as_flag(o.foreign.bytes - lacking) + " with --foreign (" +
              mb::format_bytes(o.foreign.bytes, false) + " from step " + std::to_string(o.foreign.at_step) + " now)";
    }
    throw mb::invalid_argument(foreign_taken ? "--budget and --foreign" : "--budget", e.expected(), e.actual(),
                               todo + "." + fewer_threads(o));
  }
}

template <typename F>
auto under_flags(const options& o, F make) -> decltype(make()) {
  try {
    return make();
  } catch (...) {
    rethrow_under_flags(o);
  }
}

inline double mib(std::size_t b) { return static_cast<double>(b) / (1024.0 * 1024.0); }

// The end of a run with --offload: the host space's measured peak against the largest prediction
// of the plans it ran under (the offloaded state and its staging buffers, made before step 1 and
// kept, and the block inputs a step offloads: measured = predicted exactly); empty without one.
inline std::string host_space_line(std::size_t measured, std::size_t predicted, std::size_t host_budget,
                                   const char* what) {
  if (predicted == 0) return {};
  char line[256];
  std::snprintf(line, sizeof line, "host space (%s): measured peak %.2f MiB %s predicted %.2f MiB%s: %s", what,
                mib(measured), measured == predicted ? "=" : "<=", mib(predicted),
                host_budget != 0 ? (" <= --host-budget " + mb::format_bytes(host_budget, false)).c_str() : "",
                measured <= predicted ? "yes" : "NO");
  return line;
}

// "  moe drop 3.1% aux 0.0213": the choices a mixture of experts dropped, and its balancing loss.
inline std::string moe_text(const mb::moe_stats& m) {
  char s[64];
  std::snprintf(s, sizeof s, "  moe drop %.1f%% aux %.4f",
                100.0 * static_cast<double>(m.dropped) / static_cast<double>(m.choices), m.aux_loss);
  return s;
}

inline std::string human_rate(double tok_s) {
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

// The text's paragraphs (runs of lines between blank lines), each with the new line that ends
// it: the variable-length samples --pack trains on.
struct paragraphs {
  const std::vector<std::int32_t>* text;
  std::vector<std::size_t> begin, lengths;
  explicit paragraphs(const std::vector<std::int32_t>& t) : text(&t) {
    const std::size_t n = t.size();
    std::size_t i = 0;
    while (i < n) {
      while (i < n && t[i] == '\n') ++i;  // blank lines between paragraphs
      if (i == n) break;
      const std::size_t b = i;
      while (i < n && !(t[i] == '\n' && (i + 1 == n || t[i + 1] == '\n'))) ++i;
      if (i < n) ++i;  // the paragraph's last new line
      begin.push_back(b);
      lengths.push_back(i - b);
    }
  }
  std::span<const std::int32_t> operator()(std::size_t k) const { return {text->data() + begin[k], lengths[k]}; }
};

// The longest packed row worth fitting (--pack with --seq max): the `pack` longest paragraphs of
// the training text (its first nine tenths) end to end, a longer row could only hold padding; a
// multiple of 64 from 64 to 65536.
inline std::size_t longest_useful_row(const std::vector<std::int32_t>& text, std::size_t pack) {
  const std::vector<std::int32_t> train(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(text.size() * 9 / 10));
  std::vector<std::size_t> longest = paragraphs(train).lengths;
  std::sort(longest.begin(), longest.end(), std::greater<>());
  std::size_t most = 0;
  for (std::size_t k = 0; k < std::min(pack, longest.size()); ++k) most += longest[k];
  return std::clamp<std::size_t>((most + 63) / 64 * 64, 64, 65536);
}

// Packed rows of paragraphs (--pack): a row drawn from the trainer's generator, as windows are.
struct packed_rows {
  const mb::token_packing* pack;
  const paragraphs* samples;
  void operator()(const mb::sequence_request& r, const mb::packed_row& row) const {
    pack->write(r.random % pack->rows(), *samples, row, '\n');
  }
};

// The byte-level hybrid the flags describe (--layers, --width, --heads, --window and the
// mixture's --experts, --top-k, --capacity, --aux), as either trainer builds it.
template <typename Net>
Net model_of(const options& o) {
  std::vector<std::size_t> pattern;
  for (const std::string& name : o.blocks) pattern.push_back(Net::mixer_index(name));
  mb::model_config cfg;
  cfg.vocab = 256;
  cfg.width = o.width;
  cfg.heads = o.heads;
  cfg.attention_window = o.window;
  cfg.moe.experts = o.experts;
  cfg.moe.top_k = o.top_k;
  cfg.moe.capacity_factor = o.capacity;
  cfg.moe.aux_loss_weight = o.aux;
  return Net(cfg, pattern);
}

// --pack's data: the training and validation texts' paragraphs packed into rows of `seq` tokens, at
// most `pack` each; refused by name when either text has none, else the packing's line printed.
// The texts must outlive it.
struct packed_corpus {
  paragraphs train_par, val_par;
  mb::token_packing train_pack, val_pack;
  packed_corpus(const std::vector<std::int32_t>& train, const std::vector<std::int32_t>& val, std::size_t seq,
                std::size_t pack)
      : train_par(train), val_par(val), train_pack(train_par.lengths, seq, pack), val_pack(val_par.lengths, seq, pack) {
    if (train_pack.rows() == 0 || val_pack.rows() == 0) {
      throw mb::invalid_argument("--data", "paragraphs of at least 2 bytes in the training text and in its last tenth",
                                 std::to_string(train_pack.rows()) + " and " + std::to_string(val_pack.rows()) +
                                     " packed rows",
                                 "Use a text of paragraphs separated by blank lines, or leave --pack out");
    }
    std::printf("packed: %zu paragraphs into %zu rows of %zu tokens, at most %zu per row, %.1f%% of the tokens data "
                "(%zu padding); validation %zu rows\n",
                train_par.lengths.size(), train_pack.rows(), seq, pack, 100.0 * train_pack.efficiency(),
                train_pack.padding(), val_pack.rows());
  }
  packed_rows train_source() const { return {&train_pack, &train_par}; }
  packed_rows val_source() const { return {&val_pack, &val_par}; }
};

// One step's line: plain for logs, or a bar redrawn in place on a terminal.
class progress {
 public:
  explicit progress(std::size_t total) : total_(total), tty_(isatty(fileno(stdout)) != 0 && !under_mpirun()) {}
  // OpenMPI gives each rank a terminal even when mpirun's own output goes to a file: under it,
  // plain lines, so that a logged run keeps every step.
  static bool under_mpirun() {
    return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMIX_RANK") != nullptr ||
           std::getenv("PMI_SIZE") != nullptr;
  }
  void step(const mb::step_result& r, std::size_t used, std::size_t peak, std::size_t budget) {
    char line[256];
    std::snprintf(line, sizeof line,
                  "step %5llu/%zu  loss %.4f  lr %.2e  |g| %6.3f%s  %6.1f ms  %6s tok/s  mem %.1f/%.1f of %.0f MiB  %s",
                  static_cast<unsigned long long>(r.step), total_, r.loss, r.lr, r.grad_norm,
                  r.applied ? "" : " (skipped)", r.ms, human_rate(static_cast<double>(r.tokens) / (r.ms / 1000.0)).c_str(),
                  mib(used), mib(peak), mib(budget), std::string(mb::to_string(r.pressure)).c_str());
    // A mixture of experts: the share of its choices the capacity dropped, and the balancing loss
    // inside `loss` (summed over the step's micro-batches and blocks).
    const std::string moe = r.moe.choices == 0 ? std::string{} : moe_text(r.moe);
    if (!tty_) {
      std::printf("%s%s\n", line, moe.c_str());
      return;
    }
    // The same fields, tighter, so that the bar and memory fit an 80-column terminal.
    std::snprintf(line, sizeof line, "%llu/%zu loss %.4f lr %.1e |g| %.2f%s %.0fms %s tok/s mem %.1f/%.1f/%.0fMiB %s",
                  static_cast<unsigned long long>(r.step), total_, r.loss, r.lr, r.grad_norm, r.applied ? "" : " skip",
                  r.ms, human_rate(static_cast<double>(r.tokens) / (r.ms / 1000.0)).c_str(), mib(used), mib(peak),
                  mib(budget), std::string(mb::to_string(r.pressure)).c_str());
    constexpr std::size_t width = 12;
    const std::size_t done = total_ == 0 ? width : std::min<std::size_t>(width, r.step * width / total_);
    std::string bar = "[" + std::string(done, '#') + std::string(width - done, '.') + "] " + line + moe;
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

// The most bytes a plan's peak may reach and stay under the pressure monitor's emergency
// threshold of `budget` (fit_options::prefer_below): a plan over it would have its first step
// abandoned for a stricter one.
inline std::size_t emergency_line(std::size_t budget) {
  const double at = std::ceil(mb::pressure_thresholds{}.emergency * static_cast<double>(budget));
  return at >= 1 && at < static_cast<double>(budget) ? static_cast<std::size_t>(at) - 1 : 0;
}

// Under mpirun, before MPI_Abort: a rank that stops because another failed (rank_failed, or
// rank_cannot_start naming it) waits a moment, so that the failing rank's own line, which says
// why, is printed before the first abort ends every rank.
inline void let_failing_rank_speak(const std::exception& e) {
  if (dynamic_cast<const mb::rank_failed*>(&e) != nullptr || dynamic_cast<const mb::rank_cannot_start*>(&e) != nullptr) {
    std::this_thread::sleep_for(std::chrono::seconds(2));
  }
}

// The trainer's options from the flags. Its checkpoints record the run's settings (lr schedule,
// clip, weight decay: trainer::run_settings) and, as run tags, what the library cannot see: the
// text trained on, by a digest, and the seed, which picks the evaluation windows. A resume under
// other flags is then refused by name (resume_from) instead of silently being another run.
inline mb::trainer_options trainer_options_of(const options& o, const std::vector<std::int32_t>& text) {
  mb::trainer_options to;
  to.adam = mb::adamw_config{o.lr, 0.9, 0.95, 1e-8, o.weight_decay};
  to.lr = mb::cosine_lr{o.lr, o.min_lr, o.warmup, o.steps};
  to.clip = o.clip;
  to.seed = o.seed;
  to.replan_under_pressure = true;  // over ranks the ranks agree on the retry and the stricter plan
  to.zero = o.zero;
  std::uint64_t h = 0xcbf29ce484222325ULL;  // FNV-1a over the bytes: a digest to tell texts apart, not a defence
  for (const std::int32_t byte : text) h = (h ^ static_cast<std::uint8_t>(byte)) * 0x100000001b3ULL;
  char digest[64];
  std::snprintf(digest, sizeof digest, "fnv1a %016llx of %zu bytes", static_cast<unsigned long long>(h), text.size());
  to.run_tags = {{"data", digest}, {"seed", std::to_string(o.seed)}};
  return to;
}

// The flag that sets a run setting of the trainer (run_settings, or a tag of trainer_options_of).
inline std::string flag_of_setting(const std::string& field) {
  return field == "lr.peak"             ? "--lr"
         : field == "lr.min_lr"         ? "--min-lr"
         : field == "lr.warmup"         ? "--warmup"
         : field == "lr.total"          ? "--steps"
         : field == "adam.weight_decay" ? "--weight-decay"
         : field == "clip"              ? "--clip"
         : field == "tag.data"          ? "--data"
         : field == "tag.seed"          ? "--seed"
                                        : "";
}
// A setting's value as a flag takes it: "0.003 (0x3f689374bc6a7efa)" as 0.003.
inline std::string plain_setting(const std::string& v) { return v.substr(0, v.find(" (0x")); }

// The changed settings as flags, as saved (`saved`) or as now: "--lr 0.003, --steps 16".
inline std::string describe_changes(const std::vector<mb::run_field_change>& changes, bool saved) {
  std::string s;
  for (const mb::run_field_change& c : changes) {
    const std::string flag = flag_of_setting(c.field);
    const std::string& v = saved ? c.saved : c.current;
    s += (s.empty() ? "" : ", ") + (flag.empty() ? c.field : flag) + " " +
         (c.field == "tag.data" ? "of a text with " + v : plain_setting(v));
  }
  return s;
}

// --resume: load the checkpoint into t (any error under the flag's name) and say where it goes on.
template <typename Trainer>
void resume_from(Trainer& t, const options& o) {
  if (o.resume.empty()) return;
  bool same_plan = false;
  const std::string planned = mb::plan_summary(t.plan());
  try {
    same_plan = t.load(o.resume, {.changes = o.accept_changes != 0 ? mb::run_changes::accept : mb::run_changes::refuse});
  } catch (const mb::checkpoint_run_changed& e) {
    // The first changed flag names the error; every change is listed.
    const mb::run_field_change& c = e.changes().front();
    const std::string flag = flag_of_setting(c.field);
    std::string advice = "Pass the flags of the run that wrote it to continue that run bit for bit";
    if (!flag.empty() && c.field != "tag.data") advice += " (" + flag + " " + plain_setting(c.saved) + ")";
    advice += ", or --accept-changes 1 to go on under these";
    throw mb::invalid_argument(flag.empty() ? "--resume" : flag,
                               describe_changes(e.changes(), true) + ", as the run that wrote --resume's checkpoint",
                               describe_changes(e.changes(), false), advice);
  } catch (const mb::checkpoint_mismatch& e) {
    // The library says "build the trainer as..."; here the model is built from flags: name them.
    const std::string& f = e.field();
    const std::string flag = f.starts_with("config.width")     ? "--width"
                             : f.starts_with("config.heads")   ? "--heads"
                             : f == "storage"                  ? "--precision"
                             : f == "sequence_length"          ? "--seq"
                             : f == "optimizer.shard"          ? "--zero and mpirun -np"
                             : f.starts_with("optimizer")      ? "--optimizer"
                             : f == "effective_batch"          ? "--batch"
                             : f == "zero" || f == "ranks"     ? "--zero and mpirun -np"
                             : f == "depth" || f.starts_with("blocks.") || f.starts_with("parameters.")
                                 ? "--layers, --width and --heads"
                                 : "";
    throw mb::invalid_argument("--resume", "a checkpoint of this model that can be read", cli_checks::inner(e),
                               flag.empty() ? "Pass the flags of the run that wrote it"
                                            : "Pass the flags of the run that wrote it (" + flag + ": " + e.saved() + ")");
  } catch (const mb::error& e) {
    throw mb::invalid_argument("--resume", "a checkpoint of this model that can be read", cli_checks::inner(e), "");
  }
  if (t.steps_done() > o.steps) {
    throw mb::invalid_argument("--steps", "at least the " + std::to_string(t.steps_done()) + " steps of --resume",
                               std::to_string(o.steps), "Raise --steps to continue the run");
  }
  std::printf("resumed from %s at step %llu%s\n", o.resume.c_str(), static_cast<unsigned long long>(t.steps_done()),
              same_plan ? "" : " (its plan is not restored: written by another world size, or over this budget; "
                               "continuing under the plan above)");
  // The checkpoint's plan (one a pressure replan chose, say) replaces the one printed above.
  if (same_plan && mb::plan_summary(t.plan()) != planned) {
    std::printf("its plan is restored in place of the one above:\n%s\n", t.plan().table().c_str());
  }
  if (!t.changed_at_load().empty()) {
    std::printf("continuing under changed settings (--accept-changes 1): %s; it was written with %s\n",
                describe_changes(t.changed_at_load(), false).c_str(), describe_changes(t.changed_at_load(), true).c_str());
  }
}

// The line of an evaluation at `step`.
// What the step loop counted, for the report: the same fields on both devices.
struct run_tally {
  double first_eval = 0, last_eval = 0, last_loss = 0, total_ms = 0;
  std::size_t tokens = 0, skipped = 0, replans = 0;
  std::uint64_t last_eval_step = 0;  // the step of the last evaluation in the loop (0: none)
  mb::moe_stats moe{};               // the mixture blocks' counts summed over the run's steps
};
// stopped_by: null after a whole run, else the error that ended it (the report then covers the
// steps before it, and no final evaluation ran).
inline void add_run_fields(nlohmann::json& j, const run_tally& r, std::uint64_t steps, const char* stopped_by) {
  j["steps"] = steps;
  if (stopped_by != nullptr) j["stopped_by"] = stopped_by;
  else j["stopped_by"] = nullptr;
  // No step in this invocation (a resume at --steps): no train loss to report.
  if (r.total_ms > 0) j["final_train_loss"] = r.last_loss;
  else j["final_train_loss"] = nullptr;
  j["initial_eval_loss"] = r.first_eval;
  if (stopped_by == nullptr) {
    j["final_eval_loss"] = r.last_eval;
  } else {
    j["final_eval_loss"] = nullptr;
    if (r.last_eval_step > 0) {
      j["last_eval_loss"] = r.last_eval;
      j["last_eval_step"] = r.last_eval_step;
    }
  }
  j["tokens_per_second"] = r.total_ms > 0 ? static_cast<double>(r.tokens) / (r.total_ms / 1000.0) : 0.0;
  j["skipped_steps"] = r.skipped;
  j["replans"] = r.replans;
  // A mixture of experts (attn_moe blocks): what the capacity dropped over the run, summed over
  // its steps, micro-batches and blocks (the step lines give each step's share and balancing loss).
  if (r.moe.choices != 0) {
    j["moe"] = {{"choices", r.moe.choices},
                {"dropped_choices", r.moe.dropped},
                {"dropped_fraction", static_cast<double>(r.moe.dropped) / static_cast<double>(r.moe.choices)},
                {"tokens", r.moe.tokens},
                {"tokens_dropped", r.moe.tokens_dropped},
                {"max_expert_rows", r.moe.max_expert_rows}};
  }
}

inline std::string eval_line(std::uint64_t step, const options& o, double loss) {
  char line[96];
  std::snprintf(line, sizeof line, "step %5llu/%zu  eval loss %.4f", static_cast<unsigned long long>(step), o.steps,
                loss);
  return line;
}

// --save-every and --stop-after: t.save(--checkpoint) after `step` when they ask for it.
template <typename Trainer>
void save_if_due(Trainer& t, const options& o, std::uint64_t step, std::uint64_t stop, progress& bar) {
  // --save-every also saves after the last step, so the end of a run is never left unsaved.
  if (!((o.save_every != 0 && (step % o.save_every == 0 || step == o.steps)) || (o.stop_after != 0 && step == stop))) {
    return;
  }
  try {
    t.save(o.checkpoint);
  } catch (const mb::error& e) {
    throw mb::invalid_argument("--checkpoint", "a file that can be written", cli_checks::inner(e), "");
  }
  bar.note("saved " + o.checkpoint);
}

// A test hook (tests/mpi/killed_rank.py): MEMBOUND_EXAMPLE_KILL=RANK:STEP makes that rank
// SIGKILL itself after that step (after its save, if any), as kill -9 would. Checked with the
// flags (checked_options): a malformed value is a one-line error naming the variable, not a
// hook that silently never fires.
struct kill_request {
  std::uint64_t rank = 0, step = 0;
};
inline std::optional<kill_request> kill_request_from_environment() {
  const char* name = "MEMBOUND_EXAMPLE_KILL";
  const std::optional<std::string> v = cli_checks::environment(name);
  if (!v) return std::nullopt;
  const std::size_t colon = v->find(':');
  if (colon == std::string::npos) {
    throw mb::invalid_argument(name, "RANK:STEP (two whole numbers)", cli_checks::in_quotes(*v),
                               std::string("e.g. ") + name + "=1:7, or unset it");
  }
  const std::string example = std::string(name) + "=1:7";
  kill_request k;
  k.rank = cli_checks::whole(name, v->substr(0, colon), 0, std::numeric_limits<std::uint32_t>::max(), example);
  k.step = cli_checks::whole(name, v->substr(colon + 1), 1, std::numeric_limits<std::uint64_t>::max(), example);
  return k;
}
inline void kill_if_asked(std::size_t rank, std::uint64_t step) {
  const std::optional<kill_request> k = kill_request_from_environment();
  if (k && k->rank == rank && k->step == step) {
    std::fprintf(stderr, "MEMBOUND_EXAMPLE_KILL: rank %zu kills itself after step %llu\n", rank,
                 static_cast<unsigned long long>(step));
    std::fflush(stderr);
    ::kill(::getpid(), SIGKILL);
  }
}

// MEMBOUND_EXAMPLE_NCCL=1: a GPU run in one process goes through NCCL too (0 or unset: not).
inline bool nccl_asked_from_environment() {
  const std::optional<std::string> v = cli_checks::environment("MEMBOUND_EXAMPLE_NCCL");
  return v && cli_checks::one_of("MEMBOUND_EXAMPLE_NCCL", *v, {"1", "0"}, "=") == "1";
}

// --sample: o.sample bytes drawn at temperature 0.8 from 32 bytes of `val` on, with the run's
// seed, decoded one byte at a time by `d` (a trainer's decoder: step(ids, logits), restart(),
// length(), max_len(); 256 logits). When d is full it starts again from the last half of its
// context: the model never sees more than the max_len() tokens it was trained on.
template <typename Decoder>
std::string sample_text(const std::vector<std::int32_t>& val, const options& o, Decoder& d) {
  const std::size_t L = d.max_len();
  std::vector<std::int32_t> ctx(val.begin(), val.begin() + static_cast<std::ptrdiff_t>(std::min<std::size_t>(32, L)));
  std::vector<double> logits(256);
  // From position 0: ctx's last n tokens, the logits after the last.
  auto feed_last = [&](std::size_t n) {
    d.restart();
    for (std::size_t i = ctx.size() - n; i < ctx.size(); ++i) d.step(&ctx[i], i + 1 == ctx.size() ? logits.data() : nullptr);
  };
  feed_last(ctx.size());
  mb::random_state rs{o.seed};
  std::string out;
  for (std::size_t i = 0; i < o.sample; ++i) {
    double mx = -1e300, z = 0;
    for (double l : logits) mx = std::max(mx, l);
    for (double& l : logits) z += (l = std::exp((l - mx) / 0.8));
    double u = static_cast<double>(rs.next() >> 11) * 0x1.0p-53 * z;
    std::size_t v = 0;
    while (v + 1 < 256 && (u -= logits[v]) > 0) ++v;
    ctx.push_back(static_cast<std::int32_t>(v));
    // Printed to a terminal: a control byte (ESC, BEL, ... of a model trained on binary data) is
    // shown as \xNN rather than obeyed; new lines and tabs stay.
    if ((v < 0x20 && v != '\n' && v != '\t') || v == 0x7f) {
      char esc[16];
      std::snprintf(esc, sizeof esc, "\\x%02x", static_cast<unsigned>(v));
      out += esc;
    } else {
      out.push_back(static_cast<char>(v));
    }
    if (i + 1 == o.sample) break;
    if (d.length() == L) {
      feed_last(std::max<std::size_t>(1, L / 2));
    } else {
      d.step(&ctx.back(), logits.data());
    }
  }
  return out;
}

// What a run on a GPU trains unless told otherwise: 12 blocks of width 768 repeating TTT-Linear,
// attention, Mamba, attention, bf16, 2k tokens, inside 8 GiB of the device.
inline void apply_device_defaults(options& o) {
  o.width = 768;
  o.heads = 12;
  o.layers = "ttt,attn,mamba,attn,ttt,attn,mamba,attn,ttt,attn,mamba,attn";
  o.blocks.clear();
  for (int k = 0; k < 3; ++k) {
    for (const char* b : {"ttt_linear", "attention", "mamba", "attention"}) o.blocks.push_back(b);
  }
  o.seq = 2048;
  o.batch = 8;
  o.precision = "bf16";
  o.budget = std::size_t{8} << 30;
  o.eval_sequences = 8;
}

// The device half: train_cuda.cu, built as the module libtrain_cuda.so when the build has CUDA
// (MEMBOUND_EXAMPLE_CUDA) and loaded by train.cpp on first use (these three, defined there).
// Whether a CUDA device can be used here (false when the module or the driver cannot be loaded),
// and its memory in bytes.
bool cuda_device_present();
std::size_t cuda_device_memory();
// The run on the GPU: the same flags, plan table, step line, report and trace as the CPU run.
int run_on_device(const options& o, const std::vector<std::int32_t>& text);
// The same over ranks, one GPU each (libtrain_cuda_nccl.so: NCCL between the GPUs); refused with
// the target to build where that module is missing.
int run_on_device_ranks(const options& o, const std::vector<std::int32_t>& text);

}  // namespace train_example
