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

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
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

// Whether `name` is the name of a shard file of a checkpoint at a path named `base`:
// "<base>.step-<digits>.rank-<digits>-of-<digits>" and nothing after it (a writer's temporary,
// "<name>.tmp...", is not one).
inline bool is_checkpoint_shard_name(const std::string& name, const std::string& base) {
  const auto digits = [&](std::size_t& at) {
    const std::size_t from = at;
    while (at < name.size() && name[at] >= '0' && name[at] <= '9') ++at;
    return at > from;
  };
  const auto word = [&](std::size_t& at, const char* w) {
    const std::string_view v(w);
    if (name.compare(at, v.size(), v) != 0) return false;
    at += v.size();
    return true;
  };
  std::size_t at = 0;
  return word(at, base.c_str()) && word(at, ".step-") && digits(at) && word(at, ".rank-") && digits(at) &&
         word(at, "-of-") && digits(at) && at == name.size();
}

// Removes the shard files beside `path` (is_checkpoint_shard_name of its file name) that `keep`
// does not name (paths as manifest_sources gives them; none for a whole checkpoint): what no
// checkpoint committed at `path` needs. Call it once the checkpoint that names `keep` is committed:
// a crash before leaves the previous checkpoint's files, one after leaves files the next call
// removes, so a committed manifest never loses a file it names. The temporaries a killed shard
// writer left go too, once their writer is gone. Best effort: a file that is gone
// already (removed by another rank sharing the folder) or cannot be removed is skipped, and the
// save or load that called it stands. Returns how many this call removed.
inline std::size_t remove_unreferenced_shards(const std::string& path, const std::vector<std::string>& keep) {
  namespace fs = std::filesystem;
  const std::string base = detail::base_of(path), folder = detail::folder_of(path);
  std::vector<std::string> kept;
  for (const std::string& k : keep) kept.push_back(detail::base_of(k));
  // Listed first, then removed; every step with an error_code, so that another rank removing the
  // same files meanwhile (a shared folder) ends the listing or skips a file, never throws.
  std::error_code ec;
  std::vector<fs::path> doomed;
  std::vector<std::string> written;  // shard files a writer left temporaries of
  for (fs::directory_iterator it(folder.empty() ? fs::path(".") : fs::path(folder), ec), end; !ec && it != end;
       it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (is_checkpoint_shard_name(name, base) && std::find(kept.begin(), kept.end(), name) == kept.end()) {
      doomed.push_back(it->path());
    }
    // A save killed while writing its shard left `<shard>.tmp.<pid>`: no later save or load of
    // `path` writes or reads that shard's name again, so its temporaries are cleared here, by
    // the rule every temporary goes by (its writer gone: remove_stale_temporaries).
    const std::size_t tmp = name.rfind(".tmp.");
    if (tmp != std::string::npos && is_checkpoint_shard_name(name.substr(0, tmp), base) &&
        detail::temporary_pid(name, name.substr(0, tmp)) != 0 &&
        std::find(written.begin(), written.end(), name.substr(0, tmp)) == written.end()) {
      written.push_back(name.substr(0, tmp));
    }
  }
  std::size_t removed = 0;
  for (const fs::path& f : doomed) removed += fs::remove(f, ec) ? 1 : 0;
  for (const std::string& shard : written) detail::remove_stale_temporaries(folder + shard);
  return removed;
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

// A file read through a manifest must hold what the manifest names it for: a shard file copied
// or renamed over another of the same size would otherwise load another rank's weights and
// state. f: the file's fingerprint (a whole checkpoint records no shard: [0, n) of one rank);
// ranks: the manifest's world size; n: the model's parameter elements.
inline void check_source_identity(const std::vector<fingerprint_field>& f, const checkpoint_source& s,
                                  std::size_t ranks, std::size_t n, const std::string& manifest) {
  const auto field = [&](const char* name) -> const std::string* {
    for (const fingerprint_field& e : f)
      if (e.name == name) return &e.value;
    return nullptr;
  };
  const std::string named = std::to_string(s.range.begin) + ".." + std::to_string(s.range.end);
  const std::string* held = field("optimizer.shard");
  const std::string holds = held != nullptr ? *held : "0.." + std::to_string(n);
  const std::string* of = field("ranks");
  const std::string world_of = of != nullptr ? *of : "1";
  if (holds != named || world_of != std::to_string(ranks)) {
    throw corrupt_checkpoint(s.file, "it holds parameters " + holds + " of a world of " + world_of +
                                         " rank(s), and its manifest '" + manifest + "' names it for " + named + " of " +
                                         std::to_string(ranks) + " (a shard file renamed or copied over another?)");
  }
}

// Re-sharding an elementwise optimizer state (`arrays` arrays of `element_bytes`-byte elements,
// each over a range of parameters, one after another): copies the part of `from` (the state over
// the parameters `from_range`) that overlaps `to_range` into `to` (the state over `to_range`), in
// every array. Nothing is written outside the overlap; none at all when the ranges are disjoint.
inline void copy_state_overlap(std::span<const std::byte> from, shard_range from_range, std::span<std::byte> to,
                               shard_range to_range, std::size_t arrays, std::size_t element_bytes) {
  const shard_range o = overlap(to_range, from_range.begin, from_range.end);
  if (o.size() == 0) return;
  for (std::size_t a = 0; a < arrays; ++a) {
    const std::size_t src = (a * from_range.size() + (o.begin - from_range.begin)) * element_bytes;
    const std::size_t dst = (a * to_range.size() + (o.begin - to_range.begin)) * element_bytes;
    std::memcpy(to.data() + dst, from.data() + src, o.size() * element_bytes);
  }
}

MEMBOUND_NAMESPACE_END
