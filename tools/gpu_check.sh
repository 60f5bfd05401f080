#!/usr/bin/env bash
# The GPU job in one call, for a machine with a CUDA device: build the GPU tests and benchmarks,
# run the GPU suite, run every GPU test under compute-sanitizer (memcheck, racecheck, initcheck,
# synccheck), run the GPU benchmarks, and print a summary table last.
#
#   bash tools/stage_device_deps.sh              # here, where the Debian packages are
#   # on the GPU machine, carrying .device_deps:
#   OUT=/some/dir bash tools/gpu_check.sh [--arch 90] [--no-sanitizers] [--no-bench]
#
# Logs and benchmark JSON go to $OUT (default build/gpu/out). Exit status: 0 when every step
# passed, 1 when one failed; a step that could not run (no device, no compute-sanitizer) is
# reported as such in the summary, never as passed.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
arch=native
sanitize=1
bench=1
while (($#)); do
  case "$1" in
    --arch) arch="$2"; shift 2 ;;
    --no-sanitizers) sanitize=0; shift ;;
    --no-bench) bench=0; shift ;;
    *) echo "gpu_check.sh: unknown argument '$1' (expected --arch N, --no-sanitizers, --no-bench)" >&2; exit 2 ;;
  esac
done
out="${OUT:-$root/build/gpu/out}"
mkdir -p "$out"
build="$root/build/gpu"

deps="$root/.device_deps/usr"
if [[ -d "$deps" ]]; then
  export CMAKE_PREFIX_PATH="$deps${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  export LD_LIBRARY_PATH="$deps/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export PATH="$PATH:/usr/local/cuda/bin"

summary=()
status=0
note() { summary+=("$(printf '%-44s %s' "$1" "$2")"); }
fail() { note "$1" "FAILED ($2)"; status=1; }

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1 ||
  echo "nvidia-smi failed" >> "$out/gpu.txt"

echo "== configure ($arch)"
if ! cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMEMBOUND_REQUIRE_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES="$arch" -DMEMBOUND_BUILD_EXAMPLES=OFF > "$out/configure.log" 2>&1; then
  tail -30 "$out/configure.log"
  echo "gpu_check.sh: configure failed (log: $out/configure.log)" >&2
  exit 1
fi

tests=()
for f in tests/cuda/test_*.cu; do tests+=("$(basename "$f" .cu)"); done
benches=()
for f in bench/*.cu; do [[ -e "$f" ]] && benches+=("$(basename "$f" .cu)"); done

echo "== build ${tests[*]} ${benches[*]}"
if ! cmake --build "$build" -j "$(nproc)" --target "${tests[@]}" "${benches[@]}" > "$out/build.log" 2>&1; then
  grep -E "error|Error" "$out/build.log" | head -40
  echo "gpu_check.sh: build failed (log: $out/build.log)" >&2
  exit 1
fi
note build "ok (${#tests[@]} tests, ${#benches[@]} benchmarks, sm $arch)"

echo "== ctest -L gpu"
# Exit 77 is ctest's skip: on a machine without a device the suite is reported skipped, not passed.
ctest --test-dir "$build" -L gpu --output-on-failure > "$out/ctest_gpu.log" 2>&1
rc=$?
tail -15 "$out/ctest_gpu.log"
if grep -q "Skipped" "$out/ctest_gpu.log"; then
  fail "ctest -L gpu" "tests skipped: no usable device, see ctest_gpu.log"
elif ((rc != 0)); then
  fail "ctest -L gpu" "see ctest_gpu.log"
else
  note "ctest -L gpu" "passed"
fi

if ((sanitize)); then
  if command -v compute-sanitizer > /dev/null; then
    for t in "${tests[@]}"; do
      for tool in memcheck racecheck initcheck synccheck; do
        log="$out/sanitizer_${t}_${tool}.log"
        extra=()
        [[ $tool == memcheck ]] && extra=(--leak-check full)
        # --error-exitcode makes a finding fail the step even when the test itself passes.
        if compute-sanitizer --tool "$tool" "${extra[@]}" --error-exitcode 3 \
             "$build/tests/$t" > "$log" 2>&1; then
          note "$t $tool" "clean"
        else
          fail "$t $tool" "$(grep -m1 -E 'ERROR SUMMARY|error' "$log" | cut -c1-60)"
        fi
      done
    done
  else
    fail "compute-sanitizer" "not found on PATH"
  fi
fi

if ((bench)); then
  for b in "${benches[@]}"; do
    if "$build/bench/$b" --benchmark_repetitions=5 --benchmark_report_aggregates_only=true \
         --benchmark_counters_tabular=true --benchmark_out="$out/$b.json" \
         --benchmark_out_format=json > "$out/$b.txt" 2>&1; then
      note "$b" "ran ($b.txt, $b.json)"
    else
      fail "$b" "see $b.txt"
    fi
  done
fi

echo
echo "== summary ($(head -2 "$out/gpu.txt" | tail -1))"
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
exit $status
