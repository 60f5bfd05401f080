// Typed errors. Each names the argument or resource, what was expected, and what to do.
// Every membound error derives from membound::error so callers can catch the whole family.
#pragma once

#include <array>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <utility>

#include "membound/core/config.hpp"
#include "membound/core/format.hpp"
#include "membound/core/memory_tag.hpp"

MEMBOUND_NAMESPACE_BEGIN

class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A caller passed something malformed. Nothing was modified.
class invalid_argument : public error {
 public:
  invalid_argument(std::string argument, std::string expected, std::string actual,
                   std::string what_to_do)
      : error(compose(argument, expected, actual, what_to_do)),
        argument_(std::move(argument)),
        expected_(std::move(expected)),
        actual_(std::move(actual)),
        what_to_do_(std::move(what_to_do)) {}

  const std::string& argument() const noexcept { return argument_; }
  const std::string& expected() const noexcept { return expected_; }
  const std::string& actual() const noexcept { return actual_; }
  const std::string& what_to_do() const noexcept { return what_to_do_; }

 protected:
  // For subclasses whose message reads better in their own words; the fields are the same.
  struct own_message {};
  // Fields by reference: the message is usually made from them in the same call.
  invalid_argument(own_message, const std::string& message, const std::string& argument,
                   const std::string& expected, const std::string& actual,
                   const std::string& what_to_do)
      : error(message),
        argument_(argument),
        expected_(expected),
        actual_(actual),
        what_to_do_(what_to_do) {}

 private:
  static std::string compose(const std::string& argument, const std::string& expected,
                             const std::string& actual, const std::string& what_to_do) {
    std::string m = "membound: invalid argument '" + argument + "': expected " + expected;
    if (!actual.empty()) m += ", got " + actual;
    if (!what_to_do.empty()) m += ". " + what_to_do;
    return m;
  }
  std::string argument_, expected_, actual_, what_to_do_;
};

// A workspace handed to an operation is missing or smaller than its size query said.
class workspace_too_small : public invalid_argument {
 public:
  workspace_too_small(std::string argument, std::size_t required, std::size_t given)
      : invalid_argument(std::move(argument), "at least " + format_bytes(required),
                         format_bytes(given),
                         "Query the size first (pass nullptr to get the bytes) and hand a buffer "
                         "at least that large"),
        required_(required),
        given_(given) {}
  std::size_t required() const noexcept { return required_; }
  std::size_t given() const noexcept { return given_; }

 private:
  std::size_t required_, given_;
};

// A file the library was asked to read or write cannot be used for that: missing, a directory
// or a device where a regular file belongs, without permission, in a folder that does not exist,
// on a full disk. argument() is the parameter that named it ("path"), path() the file itself;
// error_number() is the errno of the failing call, 0 when the problem was found without one.
class file_error : public invalid_argument {
 public:
  file_error(const std::string& argument, const std::string& path, const std::string& expected,
             const std::string& actual, const std::string& what_to_do, int error_number = 0)
      : invalid_argument(own_message{},
                         "membound: file '" + path + "' (argument '" + argument +
                             "'): expected " + expected + ", got " + actual + ". " + what_to_do,
                         argument, expected, actual, what_to_do),
        path_(path),
        error_number_(error_number) {}

  const std::string& path() const noexcept { return path_; }
  int error_number() const noexcept { return error_number_; }

 protected:
  file_error(own_message tag, const std::string& message, const std::string& argument,
             const std::string& path, const std::string& expected, const std::string& actual,
             const std::string& what_to_do, int error_number = 0)
      : invalid_argument(tag, message, argument, expected, actual, what_to_do),
        path_(path),
        error_number_(error_number) {}

 private:
  std::string path_;
  int error_number_;
};

// Everything a person needs to understand an out-of-memory, as fields (for tools and tests) and
// as one message (for logs). A budget of 0 means "no budget: the upstream itself failed".
struct oom_report {
  std::string source;                  // which allocator refused: "budget", "system", ...
  std::size_t requested = 0;           // bytes the caller asked for
  std::size_t growth_needed = 0;       // bytes the reserved pool would have had to grow by
  std::size_t budget = 0;              // hard cap in bytes, 0 when none
  std::size_t free_under_budget = 0;   // budget - reserved - external
  std::size_t allocated = 0;           // bytes in live blocks
  std::size_t reserved_unallocated = 0;  // reserved bytes not in live blocks (cache, holes)
  std::size_t largest_free_block = 0;  // largest block servable without growing
  std::size_t external = 0;            // bytes held outside this allocator but counted against it
  std::array<std::size_t, memory_tag_count> tag_current{};  // requested bytes per tag
  std::array<std::size_t, memory_tag_count> tag_peak{};
  std::string hint;                    // which policy to change and by how much
  std::string detail;                  // upstream's own words (errno, CUDA error), may be empty

  std::string message() const {
    std::string m = "membound: out of memory in " + source + ": requested " + format_bytes(requested);
    if (growth_needed == static_cast<std::size_t>(-1)) {
      m += " (no reserve can serve it)";  // the upstream's marker for an impossible size
    } else if (growth_needed != requested) {
      m += " (needs " + format_bytes(growth_needed) + " of new reserve)";
    }
    if (budget != 0) {
      m += "; budget " + format_bytes(budget) + ", free under budget " +
           format_bytes(free_under_budget);
    }
    m += "\n  allocated " + format_bytes(allocated) + ", reserved but unallocated " +
         format_bytes(reserved_unallocated) + ", largest free block " +
         format_bytes(largest_free_block);
    if (external != 0) m += ", external " + format_bytes(external);
    m += "\n  by tag (current / peak):";
    for (memory_tag t : all_memory_tags) {
      m += std::string(" ") + std::string(to_string(t)) + " " +
           format_bytes(tag_current[index_of(t)], false) + " / " +
           format_bytes(tag_peak[index_of(t)], false) + ";";
    }
    if (!detail.empty()) m += "\n  upstream: " + detail;
    if (!hint.empty()) m += "\n  hint: " + hint;
    return m;
  }
};

class out_of_memory : public error {
 public:
  explicit out_of_memory(oom_report report) : error(report.message()), report_(std::move(report)) {}
  const oom_report& report() const noexcept { return report_; }

 private:
  oom_report report_;
};

// The host space (trainer_options::host: offloaded block inputs) could not serve a step's
// request: not the device's memory, so a trainer does not answer it with a stricter device plan.
// report() is the host allocator's.
class host_space_exhausted : public error {
 public:
  explicit host_space_exhausted(oom_report report)
      : error("membound: the host space ran out mid-step (" + report.message() +
              "); the plan's host peak was checked against the host allocator's budget when the plan was "
              "adopted, so something else took host space since: give the host space its own budget"),
        report_(std::move(report)) {}
  const oom_report& report() const noexcept { return report_; }

 private:
  oom_report report_;
};

namespace detail {
// A host allocation outside the allocators (a buffer the library sizes itself) failed.
[[noreturn]] inline void throw_host_out_of_memory(std::string source, std::size_t bytes,
                                                  std::string hint) {
  oom_report r;
  r.source = std::move(source);
  r.requested = r.growth_needed = bytes;
  r.detail = "std::bad_alloc from the host heap";
  r.hint = std::move(hint);
  throw out_of_memory(std::move(r));
}
}  // namespace detail

// A backend call (mmap, CUDA driver) failed for a reason other than lack of memory.
class backend_error : public error {
 public:
  backend_error(std::string call, int code, std::string detail,
                std::string what_to_do = "This is the backend's own failure, not a membound "
                                         "limit: check the device and driver state, and report it "
                                         "with this message if it persists")
      : error("membound: " + call + " failed with code " + std::to_string(code) + ": " + detail +
              ". " + what_to_do),
        call_(std::move(call)),
        code_(code),
        what_to_do_(std::move(what_to_do)) {}
  const std::string& call() const noexcept { return call_; }
  int code() const noexcept { return code_; }
  const std::string& what_to_do() const noexcept { return what_to_do_; }

 private:
  std::string call_;
  int code_;
  std::string what_to_do_;
};

MEMBOUND_NAMESPACE_END
