// Strict checks of command-line values, shared by the examples (train, plot_memory, memory_tour).
// Each refusal is a membound::invalid_argument naming the flag, what was expected and what to do,
// so a tool prints it as one `error:` line (one_line) and exits 1. Nothing here writes a file.
//
// The grammar is deliberately narrow, so that no value means something the user did not write:
//   whole  decimal digits only: no sign, space, "0x", exponent or fraction ("-1" is refused, never
//          wrapped to 2^64 - 1), within the flag's range.
//   real   a decimal number as std::from_chars reads it (no leading "+", space or hex), finite,
//          within the flag's range: "nan", "inf" and "1e999" are refused.
//   size   DIGITS[.DIGITS][e[+-]DIGITS] then at once an optional unit, case as written here:
//          B, KiB, MiB, GiB, TiB (powers of 1024) or KB, MB, GB, TB (powers of 1000); no unit is
//          bytes. "5 MiB" (a space), "+5", "0x10", "inf" are refused. The value is computed
//          exactly and must be a whole number of bytes from 1 to 2^64 - 1: "0.5KiB" is 512 bytes,
//          "0.5" and "1.3KiB" are refused, "1e30GiB" is too large.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>

#include "membound/core/error.hpp"
#include "membound/core/file_io.hpp"

namespace cli_checks {

// Appends, not "'" + std::string(s): GCC 12 at -O3 reports a false -Wrestrict in that operator+
// once inlined into a large translation unit (nvcc's host pass of train_cuda.cu).
inline std::string in_quotes(std::string_view s) {
  std::string r;
  r.reserve(s.size() + 2);
  r += '\'';
  r.append(s);
  r += '\'';
  return r;
}

// The message as one line: a newline in a user's value (or a library's text) would make two.
inline std::string one_line(std::string s) {
  for (char& c : s)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = ' ';
  return s;
}

// A library's message quoted inside another error, without its own "membound: " prefix.
inline std::string inner(const std::exception& e) {
  const std::string m = e.what();
  return m.starts_with("membound: ") ? m.substr(10) : m;
}

inline bool all_digits(std::string_view s) {
  return !s.empty() && s.find_first_not_of("0123456789") == std::string_view::npos;
}

// Each check takes an example of a good use, e.g. "--warmup 30", for the error's last sentence.

// A whole number in [lo, hi]; `bound` says where a limit comes from, e.g. " (at most --steps)".
inline std::uint64_t whole(std::string_view flag, std::string_view text, std::uint64_t lo, std::uint64_t hi,
                           const std::string& example, const std::string& bound = {}) {
  const std::string f(flag);
  const std::string expected = "a whole number from " + std::to_string(lo) + " to " + std::to_string(hi) + bound;
  const std::string todo = "e.g. " + example;
  std::uint64_t v = 0;
  if (!all_digits(text)) throw membound::invalid_argument(f, expected + ", digits only", in_quotes(text), todo);
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc{} || end != text.data() + text.size() || v < lo || v > hi) {
    throw membound::invalid_argument(f, expected, in_quotes(text), todo);
  }
  return v;
}

// A finite number in [lo, hi], or (lo, hi] when lo_open.
inline double real(std::string_view flag, std::string_view text, double lo, double hi, bool lo_open,
                   const std::string& example) {
  const std::string f(flag);
  char range[96];
  std::snprintf(range, sizeof range, "a finite number in %c%g, %g]", lo_open ? '(' : '[', lo, hi);
  double v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  const bool parsed = !text.empty() && ec == std::errc{} && end == text.data() + text.size();
  if (!parsed || !std::isfinite(v) || v < lo || (lo_open && v == lo) || v > hi) {
    throw membound::invalid_argument(f, range, in_quotes(text), "e.g. " + example);
  }
  return v;
}

// A size in bytes (grammar above). Exact: the decimal digits, the exponent and the unit are kept
// as r · 2^p2 · 5^p5 with r prime to 10, so "fractional" and "too large" never depend on rounding.
inline std::uint64_t size(std::string_view flag, std::string_view text, const std::string& example) {
  const std::string f(flag), got = in_quotes(text), todo = "e.g. " + example;
  const auto refuse = [&](const std::string& expected) { return membound::invalid_argument(f, expected, got, todo); };
  const std::string grammar =
      "a size: a number and at once an optional unit among B, KiB, MiB, GiB, TiB, KB, MB, GB, TB "
      "(no sign, space or hex)";
  const auto digit = [&](std::size_t i) { return i < text.size() && text[i] >= '0' && text[i] <= '9'; };
  std::size_t i = 0;
  std::string sig;
  long long exp10 = 0;
  while (digit(i)) sig += text[i++];
  if (sig.empty()) throw refuse(grammar);
  if (i < text.size() && text[i] == '.') {
    if (!digit(++i)) throw refuse(grammar);
    for (; digit(i); ++i, --exp10) sig += text[i];
  }
  if (i < text.size() && (text[i] == 'e' || text[i] == 'E')) {
    bool negative = false;
    if (++i < text.size() && (text[i] == '+' || text[i] == '-')) negative = text[i++] == '-';
    if (!digit(i)) throw refuse(grammar);
    long long e = 0;
    // Saturated: an exponent this large is too large or fractional whatever the digits are.
    for (; digit(i); ++i) e = std::min<long long>(e * 10 + (text[i] - '0'), 1'000'000);
    exp10 += negative ? -e : e;
  }
  struct unit {
    std::string_view name;
    int p2, p5;
  };
  static constexpr unit units[] = {{"", 0, 0},   {"B", 0, 0},   {"KiB", 10, 0}, {"MiB", 20, 0}, {"GiB", 30, 0},
                                   {"TiB", 40, 0}, {"KB", 3, 3}, {"MB", 6, 6},   {"GB", 9, 9},   {"TB", 12, 12}};
  const std::string_view name = text.substr(i);
  const unit* u = nullptr;
  for (const unit& c : units)
    if (c.name == name) u = &c;
  if (u == nullptr) throw refuse(grammar);

  sig.erase(0, std::min(sig.find_first_not_of('0'), sig.size()));
  if (sig.empty()) throw refuse("a positive size, at least 1 byte");
  while (sig.back() == '0') {
    sig.pop_back();
    ++exp10;
  }
  if (sig.size() > 38) throw refuse("a size with at most 38 significant digits");
  __extension__ using u128 = unsigned __int128;  // 38 digits fit; __extension__: no -Wpedantic note
  u128 r = 0;
  for (char c : sig) r = r * 10 + static_cast<unsigned>(c - '0');
  long long p2 = u->p2 + exp10, p5 = u->p5 + exp10;
  for (; r % 2 == 0; r /= 2) ++p2;
  for (; r % 5 == 0; r /= 5) ++p5;
  if (p2 < 0 || p5 < 0) throw refuse("a whole number of bytes");
  constexpr u128 max = std::numeric_limits<std::uint64_t>::max();
  const std::string too_large = "at most 2^64 - 1 bytes (16 EiB)";
  if (r > max || p2 >= 64 || p5 >= 28) throw refuse(too_large);
  for (; p2 > 0; --p2)
    if ((r *= 2) > max) throw refuse(too_large);
  for (; p5 > 0; --p5)
    if ((r *= 5) > max) throw refuse(too_large);
  return static_cast<std::uint64_t>(r);
}

// One of a few words. `between`: how the example joins name and value ("=" for a variable).
inline std::string one_of(std::string_view flag, std::string_view text, std::initializer_list<std::string_view> words,
                          std::string_view between = " ") {
  std::string list;
  for (std::string_view w : words) {
    if (w == text) return std::string(text);
    list += (list.empty() ? "" : ", ") + std::string(w);
  }
  throw membound::invalid_argument(std::string(flag), "one of " + list, in_quotes(text),
                                   "e.g. " + std::string(flag) + std::string(between) + std::string(*words.begin()));
}

// An environment variable the program reads: its value (nullopt when unset), to be checked as a
// flag's is, with the variable's name standing for the flag in the one-line error.
inline std::optional<std::string> environment(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return std::nullopt;
  return std::string(v);
}

inline std::string reason(const std::error_code& ec) { return ec ? " (" + ec.message() + ")" : ""; }
inline std::string errno_reason(int e) { return e != 0 ? std::string(" (") + std::strerror(e) + ")" : ""; }

// A file to read, checked before any work: it exists, is a regular file (a device such as
// /dev/zero or a pipe would be read without end, or wait forever), can be read and is not empty.
inline void input_file(std::string_view flag, const std::string& path, const std::string& todo) {
  namespace fs = std::filesystem;
  const std::string f(flag);
  if (path.empty()) throw membound::invalid_argument(f, "a file path", "''", todo);
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (!fs::exists(st)) {
    throw membound::invalid_argument(f, "an existing file", in_quotes(path) + (ec ? reason(ec) : " (no such file)"),
                                     todo);
  }
  if (fs::is_directory(st)) throw membound::invalid_argument(f, "a file, not a folder", in_quotes(path), todo);
  if (!fs::is_regular_file(st)) {
    const char* kind = fs::is_fifo(st)       ? "a pipe"
                       : fs::is_socket(st)   ? "a socket"
                       : fs::is_character_file(st) || fs::is_block_file(st) ? "a device"
                                                                             : "not a regular file";
    throw membound::invalid_argument(f, "a regular file (pipes and devices are not read)",
                                     in_quotes(path) + " (" + kind + ")", todo);
  }
  if (::access(path.c_str(), R_OK) != 0) {
    throw membound::invalid_argument(f, "a readable file", in_quotes(path) + errno_reason(errno), todo);
  }
  if (fs::file_size(path, ec) == 0 && !ec) {
    throw membound::invalid_argument(f, "a non-empty file", in_quotes(path) + " (0 bytes)", todo);
  }
}

// A file to write, checked before the work whose result it keeps, so that a long run is not lost
// at its end: the path names no folder and is a regular file or new (every output is replaced by
// a rename: write_file below, the trainer's checkpoints), and its folder exists and takes a new
// file, tried for real (a temporary made and removed: root passes access() in /proc, which takes
// none). `replaced` is kept for callers that said so; every output is now written that way.
inline void output_file(std::string_view flag, const std::string& path, [[maybe_unused]] bool replaced = true) {
  namespace fs = std::filesystem;
  const std::string f(flag), todo = "Create the folder first, or choose another path";
  if (path.empty()) throw membound::invalid_argument(f, "a file path", "''", "e.g. " + f + " out.json");
  std::error_code ec;
  const fs::path p(path);
  const fs::file_status st = fs::status(p, ec);
  if (fs::is_directory(st) || !p.has_filename()) {
    throw membound::invalid_argument(f, "a file path, not a folder", in_quotes(path), "Name a file inside the folder");
  }
  if (fs::exists(st) && !fs::is_regular_file(st)) {
    throw membound::invalid_argument(f, "a regular file or a new path (it is replaced by a rename)", in_quotes(path),
                                     "Choose a plain file path");
  }
  // A symbolic link's file is replaced where it lies (write_file_atomically): probe that folder.
  const fs::path real = fs::is_symlink(fs::symlink_status(p, ec)) ? fs::weakly_canonical(p, ec) : p;
  const fs::path dir = real.parent_path().empty() ? fs::path(".") : real.parent_path();
  const fs::file_status dst = fs::status(dir, ec);
  if (!fs::exists(dst)) {
    throw membound::invalid_argument(f, "a path in an existing folder",
                                     in_quotes(path) + " (no folder " + in_quotes(dir.string()) + ")", todo);
  }
  if (!fs::is_directory(dst)) {
    throw membound::invalid_argument(f, "a path in a folder", in_quotes(path) + " (" + in_quotes(dir.string()) +
                                     " is not a folder)", todo);
  }
  std::string probe = (dir / ".membound-write-probe-XXXXXX").string();
  const int fd = ::mkstemp(probe.data());
  if (fd < 0) {
    const int e = errno;
    throw membound::invalid_argument(f, "a path in a folder that takes new files", in_quotes(path) + errno_reason(e),
                                     e == ENOENT || e == EACCES || e == EPERM || e == EROFS
                                         ? "Choose a folder on a writable file system that this user may write to"
                                         : todo);
  }
  ::close(fd);
  ::unlink(probe.c_str());
}

// Refuses an output path that is another flag's file (an input it would overwrite, or an output
// that would overwrite it). Paths that do not exist yet are compared after resolving their folder.
inline void distinct(std::string_view flag, const std::string& path, std::string_view other_flag,
                     const std::string& other) {
  namespace fs = std::filesystem;
  if (path.empty() || other.empty()) return;
  std::error_code e0, e1, e2;
  bool same = fs::equivalent(path, other, e0);
  if (!same) {
    const fs::path a = fs::weakly_canonical(path, e1), b = fs::weakly_canonical(other, e2);
    same = !e1 && !e2 && a == b;
  }
  if (same) {
    throw membound::invalid_argument(std::string(flag), "a file other than " + std::string(other_flag) + "'s",
                                     in_quotes(path), "Choose another path");
  }
}

// Writes a file atomically (the library's write_file_atomically: a temporary in the same folder,
// fsync, rename over the path): a full disk or a vanished folder is a file_error naming the flag,
// and a file already at the path is left as it was, never truncated (a run's earlier report or
// trace survives a failed write).
inline void write_file(std::string_view flag, const std::string& path, const std::function<void(std::ostream&)>& fill) {
  std::ostringstream out(std::ios::binary);
  fill(out);
  const std::string bytes = std::move(out).str();
  const membound::detail::byte_range parts[] = {{bytes.data(), bytes.size()}};
  const std::string argument(flag);
  membound::detail::write_file_atomically(path, argument.c_str(), "result", parts);
}

}  // namespace cli_checks
