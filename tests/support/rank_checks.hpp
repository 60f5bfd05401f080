// The check reporter of the multi-rank test programs (tests/mpi, tests/nccl): they run under
// mpiexec, a process per rank, without doctest. A failed check prints one line naming the rank
// and the check; main returns failures() != 0 after every rank is done.
//
//   membound_test::rank_checks::me = comm.rank();
//   check(t.steps_done() == 5, "resumed at step 5");
//   return membound_test::rank_checks::failures == 0 ? 0 : 1;
#pragma once

#include <cstddef>
#include <cstdio>
#include <string>

namespace membound_test::rank_checks {

inline int failures = 0;
inline std::size_t me = 0;      // this process's rank, for the failure lines
inline bool say_passed = false;  // rank 0 also prints "ok: ..." for each passing check

inline void check(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::fprintf(stderr, "rank %zu: FAIL: %s\n", me, what.c_str());
  } else if (say_passed && me == 0) {
    std::printf("ok: %s\n", what.c_str());
  }
}

}  // namespace membound_test::rank_checks
