// A checkpoint's fingerprint and run settings as name=value fields (one part of the trainer,
// train/trainer.hpp): the fields, their differences, exact text for doubles, the layout checksum
// and the parser of a file's section.
#pragma once

#include <bit>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "membound/core/config.hpp"
#include "membound/train/checkpoint_file.hpp"

MEMBOUND_NAMESPACE_BEGIN

// One entry of a checkpoint's fingerprint: a name ("storage", "config.rope_base", "blocks.2")
// and its value as text. Doubles carry their bit pattern, so equal text means equal bits.
struct fingerprint_field {
  std::string name;
  std::string value;
  friend bool operator==(const fingerprint_field&, const fingerprint_field&) = default;
};


// A run setting that differs between a checkpoint and the trainer loading it.
struct run_field_change {
  std::string field, saved, current;
  friend bool operator==(const run_field_change&, const run_field_change&) = default;
};

namespace detail {
// The fields of `saved` (a checkpoint's) and `now` (this trainer's) that differ, in now's order,
// then those only the checkpoint has. A field on one side only counts where
// counts_missing(name, missing_from_saved) says so; its absent side reads "(none)".
template <typename CountsMissing>
std::vector<run_field_change> field_differences(const std::vector<fingerprint_field>& saved,
                                                const std::vector<fingerprint_field>& now, CountsMissing counts_missing) {
  const auto find = [](const std::vector<fingerprint_field>& f, const std::string& name) -> const fingerprint_field* {
    for (const fingerprint_field& e : f)
      if (e.name == name) return &e;
    return nullptr;
  };
  std::vector<run_field_change> d;
  for (const fingerprint_field& e : now) {
    const fingerprint_field* s = find(saved, e.name);
    if (s == nullptr) {
      if (counts_missing(e.name, true)) d.push_back({e.name, "(none)", e.value});
    } else if (s->value != e.value) {
      d.push_back({e.name, s->value, e.value});
    }
  }
  for (const fingerprint_field& s : saved) {
    if (find(now, s.name) == nullptr && counts_missing(s.name, false)) d.push_back({s.name, s.value, "(none)"});
  }
  return d;
}
}  // namespace detail


namespace detail {
// "1e-05 (0x3ee4f8b588e368f1)": the shortest text that reads back the same, and the bits.
inline std::string exact_text(double v) {
  char buf[40];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  char bits[24];
  std::snprintf(bits, sizeof bits, "%016llx", static_cast<unsigned long long>(std::bit_cast<std::uint64_t>(v)));
  return std::string(buf, r.ptr) + " (0x" + bits + ")";
}

// FNV-1a, 64 bits: a checksum of the parameter layout, not a defence against forgery (the
// file's CRC and the other fields do the rest).
struct fnv1a {
  std::uint64_t h = 0xcbf29ce484222325ULL;
  void bytes(const void* p, std::size_t n) noexcept {
    const auto* b = static_cast<const unsigned char*>(p);
    for (std::size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 0x100000001b3ULL;
  }
  void u64(std::uint64_t v) noexcept {
    unsigned char b[8];
    for (int i = 0; i < 8; ++i) b[i] = static_cast<unsigned char>(v >> (8 * i));
    bytes(b, 8);
  }
};

// "name=value" lines; a section that is not that is corrupt.
inline std::vector<fingerprint_field> parse_fingerprint(const std::string& text, const std::string& path,
                                                       const std::string& section = "fingerprint") {
  std::vector<fingerprint_field> f;
  std::size_t at = 0, line = 1;
  while (at < text.size()) {
    const std::size_t end = text.find('\n', at);
    if (end == std::string::npos) throw corrupt_checkpoint(path, "its " + section + " does not end with a new line");
    const std::string l = text.substr(at, end - at);
    const std::size_t eq = l.find('=');
    if (eq == std::string::npos || eq == 0) {
      throw corrupt_checkpoint(path, "line " + std::to_string(line) + " of its " + section + " is not name=value");
    }
    fingerprint_field e{l.substr(0, eq), l.substr(eq + 1)};
    for (const fingerprint_field& g : f) {
      if (g.name == e.name) throw corrupt_checkpoint(path, "its " + section + " names '" + e.name + "' twice");
    }
    f.push_back(std::move(e));
    at = end + 1;
    ++line;
  }
  return f;
}
}  // namespace detail

MEMBOUND_NAMESPACE_END
