// What the trainer's checkpoints hold and how their files are named (one part of the trainer,
// train/trainer.hpp; the container, sections and CRC, is train/checkpoint_file.hpp).
//
// A whole checkpoint is one file: the format, the fingerprint and run settings as name=value
// lines, the weights, the optimizer's saved state, the counters (step, updates, generator, data
// position, loss scale), the plan's choices and the tolerance of an emergency. A sharded one
// (ZeRO-1/2) is one such file per rank, holding the rank's slice of the weights and its optimizer
// state, named "<path>.step-<step>.rank-<r>-of-<N>" beside `path`, and a manifest at `path` naming
// them. The trainer decides what to do with what is read (the fingerprint, the plan, the ranks'
// agreement); this file only writes, reads and checks the bytes.
#pragma once

#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <system_error>
#include <vector>

#include "membound/core/config.hpp"
#include "membound/core/shard.hpp"
#include "membound/train/checkpoint_file.hpp"
#include "membound/train/data_source.hpp"
#include "membound/train/fingerprint.hpp"
#include "membound/train/trainer_errors.hpp"

MEMBOUND_NAMESPACE_BEGIN

// 2: the fingerprint names its fields ("name=value" lines); 1 was an unnamed list of sizes.
inline constexpr std::uint64_t checkpoint_format_version = 2;

// What a step depends on besides the weights and the optimizer state.
struct checkpoint_counters {
  std::uint64_t steps = 0, updates = 0, position = 0;
  random_state rng{};
  double loss_scale = 1;
  std::uint64_t loss_scale_clean_steps = 0;
};

// The plan a checkpoint was written under, as its choices: a loading trainer makes it again.
struct checkpoint_plan_choices {
  std::uint64_t micro_batch = 0, accumulation = 0, head_chunk = 0, schedule_kind = 0, schedule_param = 0;
};

// An emergency the run tolerates because no plan gets under it: the plan's peak, the bytes others
// held and the budget then (all 0 in files from before it was recorded, or when none).
struct checkpoint_tolerance {
  std::uint64_t peak = 0, foreign = 0, limit = 0;
};

// One checkpoint file's contents. weights and optimizer: host memory (a device trainer's copies).
struct checkpoint_contents {
  std::vector<fingerprint_field> fingerprint, run_settings;
  const void* weights = nullptr;
  std::size_t weight_bytes = 0;
  std::span<const std::byte> optimizer;
  checkpoint_counters counters;
  checkpoint_plan_choices plan;
  checkpoint_tolerance tolerated;
};

namespace detail {
inline std::string fields_text(const std::vector<fingerprint_field>& f) {
  std::string text;
  for (const fingerprint_field& e : f) text += e.name + "=" + e.value + "\n";
  return text;
}
inline std::string folder_of(const std::string& path) {
  const std::size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? std::string{} : path.substr(0, slash + 1);
}
inline std::string base_of(const std::string& path) {
  const std::size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}
}  // namespace detail

// Adds every section of one checkpoint file to cw (the caller commits it).
inline void write_checkpoint_state(checkpoint_writer& cw, const checkpoint_contents& c) {
  cw.add_value<std::uint64_t>("format", checkpoint_format_version);
  const std::string fp = detail::fields_text(c.fingerprint);
  cw.add("fingerprint", fp.data(), fp.size());
  const std::string run = detail::fields_text(c.run_settings);
  cw.add("run", run.data(), run.size());
  cw.add("weights", c.weights, c.weight_bytes);
  cw.add("optimizer", c.optimizer.data(), c.optimizer.size());
  cw.add_value<std::uint64_t>("step", c.counters.steps);
  cw.add_value<std::uint64_t>("updates", c.counters.updates);
  cw.add_value<std::uint64_t>("rng", c.counters.rng.state);
  cw.add_value<std::uint64_t>("data_position", c.counters.position);
  cw.add_value<double>("loss_scale", c.counters.loss_scale);
  cw.add_value<std::uint64_t>("loss_scale_clean_steps", c.counters.loss_scale_clean_steps);
  const std::uint64_t pl[5] = {c.plan.micro_batch, c.plan.accumulation, c.plan.head_chunk, c.plan.schedule_kind,
                               c.plan.schedule_param};
  cw.add("plan", pl, sizeof pl);
  const std::uint64_t tol[3] = {c.tolerated.peak, c.tolerated.foreign, c.tolerated.limit};
  cw.add("tolerated", tol, sizeof tol);
}

// A file of another format is checkpoint_mismatch naming "format".
inline void check_checkpoint_format(const checkpoint_reader& r, const std::string& path) {
  if (const auto format = r.value<std::uint64_t>("format"); format != checkpoint_format_version) {
    const std::string saved = std::to_string(format), current = std::to_string(checkpoint_format_version);
    throw checkpoint_mismatch(
        path, "format", saved, current,
        "it is in checkpoint format " + saved + ", this build reads format " + current + " only" +
            (format < checkpoint_format_version
                 ? ": an older format, whose fingerprint neither named its fields nor told "
                   "bf16 from fp16, so this run cannot check it; resume it with the "
                   "membound that wrote it"
                 : ": a newer membound wrote it; resume it with that version"));
  }
}

// A section of name=value lines (the fingerprint, the run settings, a manifest), parsed; `label`
// names it in errors.
inline std::vector<fingerprint_field> read_checkpoint_fields(const checkpoint_reader& r, const std::string& section,
                                                            const std::string& path,
                                                            const std::string& label = "fingerprint") {
  std::string text(r.size(section), '\0');
  r.copy(section, text.data(), text.size());
  return detail::parse_fingerprint(text, path, label);
}

// What read_checkpoint_record finds: everything but the bytes and the fingerprint.
struct checkpoint_record {
  checkpoint_counters counters;
  checkpoint_plan_choices plan;
  checkpoint_tolerance tolerated;
  bool has_run_settings = false;  // files from before they were recorded have none
  std::vector<fingerprint_field> run_settings;
};

// The counters, the plan's choices, the tolerance and the run settings of a file; counters out of
// range are corrupt_checkpoint.
inline checkpoint_record read_checkpoint_record(const checkpoint_reader& r, const std::string& path) {
  checkpoint_record c;
  std::uint64_t pl[5];
  r.copy("plan", pl, sizeof pl);
  c.plan = {pl[0], pl[1], pl[2], pl[3], pl[4]};
  c.counters.steps = r.value<std::uint64_t>("step");
  c.counters.updates = r.value<std::uint64_t>("updates");
  std::uint64_t tol[3] = {0, 0, 0};
  if (r.has("tolerated") && r.size("tolerated") == sizeof tol) r.copy("tolerated", tol, sizeof tol);
  c.tolerated = {tol[0], tol[1], tol[2]};
  if (r.has("run")) {
    c.has_run_settings = true;
    c.run_settings = read_checkpoint_fields(r, "run", path, "run settings");
  }
  c.counters.rng = random_state{r.value<std::uint64_t>("rng")};
  c.counters.position = r.value<std::uint64_t>("data_position");
  c.counters.loss_scale = r.value<double>("loss_scale");
  c.counters.loss_scale_clean_steps = r.value<std::uint64_t>("loss_scale_clean_steps");
  if (!(c.counters.loss_scale > 0) || !std::isfinite(c.counters.loss_scale) || c.counters.updates > c.counters.steps) {
    throw corrupt_checkpoint(path, "its loss scale or step counters are out of range");
  }
  return c;
}

// ---- Sharded checkpoints ----------------------------------------------------------------------
// Rank r's shard file of the checkpoint at `path` written at step `steps` by `ranks` ranks, as
// its manifest names it (without the folder).
inline std::string checkpoint_shard_name(const std::string& path, std::uint64_t steps, std::size_t r, std::size_t ranks) {
  return detail::base_of(path) + ".step-" + std::to_string(steps) + ".rank-" + std::to_string(r) + "-of-" +
         std::to_string(ranks);
}
// The same, where it lies: beside `path`.
inline std::string checkpoint_shard_path(const std::string& path, std::uint64_t steps, std::size_t r, std::size_t ranks) {
  return detail::folder_of(path) + checkpoint_shard_name(path, steps, r, ranks);
}

// The manifest of `ranks` shard files of n parameters (shard_of's ranges), committed at `path`.
inline void write_checkpoint_manifest(const std::string& path, std::size_t ranks, std::uint64_t steps, std::size_t n) {
  std::string text = "ranks=" + std::to_string(ranks) + "\nzero=1\nstep=" + std::to_string(steps) +
                     "\nparameters=" + std::to_string(n) + "\n";
  for (std::size_t r = 0; r < ranks; ++r) {
    const shard_range s = shard_of(n, ranks, r);
    text += "shard." + std::to_string(r) + "=" + std::to_string(s.begin) + ".." + std::to_string(s.end) + " " +
            checkpoint_shard_name(path, steps, r, ranks) + "\n";
  }
  checkpoint_writer cw;
  cw.add_value<std::uint64_t>("format", checkpoint_format_version);
  cw.add("manifest", text.data(), text.size());
  cw.commit(path);
}

inline std::vector<fingerprint_field> read_checkpoint_manifest(const checkpoint_reader& r, const std::string& path) {
  return read_checkpoint_fields(r, "manifest", path);
}

// A manifest's field; a missing one is corrupt_checkpoint.
inline std::string manifest_value(const std::vector<fingerprint_field>& f, const std::string& name,
                                  const std::string& path) {
  for (const fingerprint_field& e : f)
    if (e.name == name) return e.value;
  throw corrupt_checkpoint(path, "its manifest names no '" + name + "'");
}

// One file of a checkpoint and the parameters it holds (a shard file of a manifest, or a whole
// checkpoint: [0, n)).
struct checkpoint_source {
  shard_range range;
  std::string file;
};

// The files a manifest at `path` names, in rank order; they must tile the n parameters.
inline std::vector<checkpoint_source> manifest_sources(const std::vector<fingerprint_field>& f, const std::string& path,
                                                       std::size_t n) {
  const std::string ranks_text = manifest_value(f, "ranks", path);
  std::size_t ranks = 0;
  if (std::from_chars(ranks_text.data(), ranks_text.data() + ranks_text.size(), ranks).ec != std::errc{} || ranks == 0 ||
      ranks > (std::size_t{1} << 20)) {
    throw corrupt_checkpoint(path, "its manifest's ranks = '" + ranks_text + "' is not a world size");
  }
  if (manifest_value(f, "parameters", path) != std::to_string(n)) {
    throw checkpoint_mismatch(path, "parameters", manifest_value(f, "parameters", path), std::to_string(n),
                              "it was written for a model of " + manifest_value(f, "parameters", path) +
                                  " parameter elements, this one has " + std::to_string(n) +
                                  ". Build the trainer as the run that wrote it was built to resume it");
  }
  std::vector<checkpoint_source> src;
  std::size_t at = 0;
  for (std::size_t k = 0; k < ranks; ++k) {
    const std::string entry = manifest_value(f, "shard." + std::to_string(k), path);
    std::size_t b = 0, e = 0;
    const char* p = entry.data();
    const char* end = p + entry.size();
    auto r1 = std::from_chars(p, end, b);
    const bool dots = r1.ec == std::errc{} && end - r1.ptr > 2 && r1.ptr[0] == '.' && r1.ptr[1] == '.';
    auto r2 = dots ? std::from_chars(r1.ptr + 2, end, e) : r1;
    if (!dots || r2.ec != std::errc{} || r2.ptr == end || *r2.ptr != ' ' || r2.ptr + 1 == end || b != at || e < b ||
        e > n) {
      throw corrupt_checkpoint(path, "its shard " + std::to_string(k) + " is '" + entry +
                                         "', expected 'BEGIN..END FILE' starting at parameter " + std::to_string(at));
    }
    src.push_back({{b, e}, detail::folder_of(path) + std::string(r2.ptr + 1, end)});
    at = e;
  }
  if (at != n) throw corrupt_checkpoint(path, "its shards end at parameter " + std::to_string(at) + " of " + std::to_string(n));
  return src;
}

MEMBOUND_NAMESPACE_END
