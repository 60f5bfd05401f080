#!/usr/bin/env python3
"""The benchmark programs' flags (bench/bench_flags.hpp, bench/benchmark_main.hpp): each malformed command line exits 1 with
one `error:` line naming the flag, before any work (a refusal takes milliseconds: 20 s means the
benchmark ran); --help prints the usage and exits 0.

usage: bench_flags_check.py BENCH_DIR"""
import os
import subprocess
import sys

BAD = {
    # Whole numbers in range, digits only; a flag needs its value; unknown flags are refused.
    "bench_model": [("--threads", ["--threads", "0"]), ("--threads", ["--threads", "99999999999999999999"]),
                    ("--reps", ["--reps", "-1"]), ("--reps", ["--reps"]), ("--bogus", ["--bogus"])],
    "bench_mamba": [("--max-seq", ["--max-seq", "abc"]), ("--threads", ["--threads", "99999999999999999999"]),
                    ("--max-seq", ["--max-seq", "0"]), ("--bogus", ["--bogus"])],
    "bench_ttt": [("--threads", ["--threads", "0"]), ("--max-seq", ["--max-seq", "1e30"]),
                  ("--reps", ["--reps", "--quick"])],
    "bench_attention": [("--threads", ["--threads", "-1"]), ("--threads", ["--threads", "abc"]),
                        ("--max-seq", ["--max-seq", "0"]), ("--max-seq", ["--max-seq", "1e30"]),
                        ("--min-seq", ["--min-seq", "512", "--max-seq", "64"]), ("--dim", ["--dim", "7"])],
    "bench_gemm": [("--threads", ["--threads", "0"]), ("--min-threads", ["--min-threads", "4", "--threads", "2"]),
                   ("--filter", ["--filter"])],
    "bench_data_parallel": [("STEPS", ["abc"]), ("STEPS", ["0"]), ("--bogus", ["5", "--bogus"])],
    "bench_packing": [("--tokens", ["--tokens", "1"]), ("--sequences", ["--sequences", "0"]),
                      ("--data", ["--data"]), ("--bogus", ["--bogus"])],
    "bench_moe": [("--experts", ["--experts", "1"]), ("--seq", ["--seq", "abc"]), ("--data", ["--data", "/nonexistent"]),
                  ("--bogus", ["--bogus"])],
    "bench_decode": [("--tokens", ["--tokens", "0"]), ("--window", ["--window", "abc"]), ("--batch", ["--batch"]),
                     ("--bogus", ["--bogus"])],
    # Google Benchmark's programs (bench/benchmark_main.hpp): its --benchmark_* flags go to it,
    # anything else is refused by name before a benchmark runs (no GPU needed to be refused).
    "bench_cuda_model": [("--attention-kernels", ["--attention-kernels=simt"]),
                         ("--attention-kernels", ["--attention-kernels"]),
                         ("--attention-kernels", ["--attention-kernels="]),
                         ("--attention-kernels", ["--attention-kernels", "--benchmark_list_tests"]),
                         ("--bogus", ["--attention-kernels", "wmma", "--bogus"])],
}
GOOGLE_BENCHMARK = ["bench_cuda_model", "bench_allocators", "bench_step", "bench_reserve", "bench_cuda_attention", "bench_cuda_gemm",
            "bench_cuda_kernels", "bench_cuda_mamba", "bench_cuda_ttt"]
for _gb in GOOGLE_BENCHMARK[1:]:
    BAD[_gb] = [("--bogus", ["--bogus"]), ("stray", ["stray"]), ("--threads", ["--benchmark_filter=x", "--threads", "2"])]


def main():
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[-1])
        return 2
    where = sys.argv[1]
    failures, tried = [], 0
    for prog, cases in BAD.items():
        path = os.path.join(where, prog)
        if not os.path.exists(path):
            path = os.path.join(where, "mpi", prog)
        if not os.path.exists(path):
            continue  # not built here (bench_data_parallel needs MPI)
        for flag, args in cases:
            tried += 1
            r = subprocess.run([path] + args, capture_output=True, text=True, timeout=20)
            lines = r.stderr.splitlines()
            problems = []
            if r.returncode != 1:
                problems.append(f"exit {r.returncode}, not 1")
            if len(lines) != 1 or not lines[0].startswith("error:"):
                problems.append(f"{len(lines)} stderr lines, not one 'error:' line")
            elif flag not in lines[0]:
                problems.append(f"the error does not name {flag}")
            if problems:
                failures.append(f"{prog} {' '.join(args)}: {'; '.join(problems)}\n    stderr: {r.stderr!r}")
        tried += 1
        r = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=20)
        help_says = "--benchmark_filter" if prog in GOOGLE_BENCHMARK else "usage:"
        if r.returncode != 0 or help_says not in r.stdout:
            failures.append(f"{prog} --help: exit {r.returncode}, stdout {r.stdout[:200]!r}")
    for f in failures:
        print("FAIL:", f)
    print(f"bench_flags_check: {tried} command lines, {len(failures)} failures")
    return 1 if failures or tried == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
