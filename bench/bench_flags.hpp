// The benchmark programs' own flags, checked as the examples check theirs (examples/cli_checks.hpp):
// a value is a whole number in the flag's range, a flag without its value or an unknown flag is
// refused by name, --help prints the usage, and any error (a flag's, or the library's refusal of a
// shape) is one `error:` line and exit 1 before any work.
//
//   return bench_flags::run([&] {
//     bench_flags::args a(argc, argv, "usage: bench_x [--threads N] [--quick]");
//     while (a.next()) {
//       if (a.is("--threads")) threads = a.whole(1, 1024);
//       else if (a.is("--quick")) quick = true;
//       else a.unknown();
//     }
//     ...  // the benchmark
//     return 0;
//   });
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <utility>

#include "../examples/cli_checks.hpp"
#include "membound/core/error.hpp"

namespace bench_flags {

class args {
 public:
  args(int argc, char** argv, std::string usage)
      : argc_(argc), argv_(argv), usage_(std::move(usage)), todo_("Flags: " + usage_.substr(0, usage_.find('\n'))) {}

  // Moves to the next argument; false at the end. --help and -h print the usage and exit 0.
  bool next() {
    if (++i_ >= argc_) return false;
    flag_ = argv_[i_];
    if (flag_ == "--help" || flag_ == "-h") {
      std::printf("%s\n", usage_.c_str());
      std::exit(0);
    }
    return true;
  }
  bool is(const char* flag) const { return flag_ == flag; }
  const std::string& flag() const noexcept { return flag_; }

  // The current flag's value as text, or as a whole number in [lo, hi].
  std::string text() {
    if (i_ + 1 >= argc_ || std::string(argv_[i_ + 1]).starts_with("--")) {
      throw membound::invalid_argument(flag_, "a value after it", "none", todo_);
    }
    return argv_[++i_];
  }
  std::uint64_t whole(std::uint64_t lo, std::uint64_t hi) {
    const std::string v = text();
    return cli_checks::whole(flag_, v, lo, hi, flag_ + " " + std::to_string(lo));
  }
  [[noreturn]] void unknown() const {
    throw membound::invalid_argument(flag_, "a flag of this program", "unknown", todo_);
  }

 private:
  int argc_;
  char** argv_;
  std::string usage_, todo_;  // todo_: the usage's first line, for one-line errors
  int i_ = 0;
  std::string flag_;
};

// Runs the program's body: any exception is its one `error:` line and exit 1.
template <typename Body>
int run(Body&& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}

}  // namespace bench_flags
