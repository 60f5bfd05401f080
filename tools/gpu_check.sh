#!/usr/bin/env bash
# The GPU job in one call, for a machine with a CUDA device: build (or take prebuilt) GPU tests and
# benchmarks, run the GPU suite, run the tests under compute-sanitizer, run the GPU benchmarks, and
# print a summary table last.
#
#   bash tools/stage_device_deps.sh              # here, where the Debian packages are
#   # on the GPU machine, carrying .device_deps:
#   OUT=/some/dir bash tools/gpu_check.sh [--arch 90] [--no-sanitizers] [--no-bench] [--train-steps N]
#
# Device time is scarce (minutes per session), so the binaries can be built here with nvcc and
# carried instead of built there:
#   cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90-real
#   ninja -C build/gpu <test_cuda_* bench_cuda_*>; copy them into .device_deps/bin
#   OUT=... bash tools/gpu_check.sh --prebuilt .device_deps/bin --jobs 4 --timeout 120 \
#       --sanitizers "memcheck racecheck" --bench-args "--benchmark_min_time=0.05"
#
# Logs and benchmark JSON go to $OUT (default build/gpu/out). Exit status: 0 when every step
# passed, 1 when one failed; a step that could not run (no device, no compute-sanitizer, a
# timeout) is reported as such in the summary, never as passed.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
arch=native
sanitizers="memcheck racecheck initcheck synccheck"
bench=1
prebuilt=""
jobs=1
step_timeout=600
san_timeout=""
bench_args=()
train_steps=30  # the example trainer's runs on the device (0: none)
while (($#)); do
  case "$1" in
    --arch) arch="$2"; shift 2 ;;
    --no-sanitizers) sanitizers=""; shift ;;
    --sanitizers) sanitizers="$2"; shift 2 ;;
    --no-bench) bench=0; shift ;;
    --prebuilt) prebuilt="$(cd "$2" && pwd)"; shift 2 ;;
    --jobs) jobs="$2"; shift 2 ;;
    --timeout) step_timeout="$2"; shift 2 ;;
    --sanitizer-timeout) san_timeout="$2"; shift 2 ;;
    --bench-args) read -r -a bench_args <<< "$2"; shift 2 ;;
    --train-steps) train_steps="$2"; shift 2 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (expected --arch N, --prebuilt DIR, --jobs N," \
            "--timeout S, --sanitizer-timeout S, --sanitizers LIST, --no-sanitizers, --bench-args ARGS, --no-bench," \
            "--train-steps N)" >&2
       exit 2 ;;
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
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda/lib64"

summary=()
status=0
note() { summary+=("$(printf '%-44s %s' "$1" "$2")"); }
fail() { note "$1" "FAILED ($2)"; status=1; }

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1 ||
  echo "nvidia-smi failed" >> "$out/gpu.txt"

tests=()
for f in tests/cuda/test_*.cu; do tests+=("$(basename "$f" .cu)"); done
benches=()
for f in bench/*.cu; do [[ -e "$f" ]] && benches+=("$(basename "$f" .cu)"); done

if [[ -n "$prebuilt" ]]; then
  test_dir="$prebuilt"
  bench_dir="$prebuilt"
  note build "prebuilt ($prebuilt)"
else
  echo "== configure ($arch)"
  if ! cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMEMBOUND_REQUIRE_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES="$arch" -DMEMBOUND_BUILD_EXAMPLES=OFF > "$out/configure.log" 2>&1; then
    tail -30 "$out/configure.log"
    echo "gpu_check.sh: configure failed (log: $out/configure.log)" >&2
    exit 1
  fi
  echo "== build ${tests[*]} ${benches[*]}"
  if ! cmake --build "$build" -j "$(nproc)" --target "${tests[@]}" "${benches[@]}" > "$out/build.log" 2>&1; then
    grep -E "error|Error" "$out/build.log" | head -40
    echo "gpu_check.sh: build failed (log: $out/build.log)" >&2
    exit 1
  fi
  note build "ok (${#tests[@]} tests, ${#benches[@]} benchmarks, sm $arch)"
  test_dir="$build/tests"
  bench_dir="$build/bench"
fi

# Runs "name command..." lines, `jobs` at a time, each under the step timeout; writes
# $out/<name>.log and $out/<name>.rc.
run_parallel() {
  local running=0 name
  while read -r name cmd; do
    [[ -z "$name" ]] && continue
    ( start=$SECONDS; timeout "$step_timeout" bash -c "$cmd" > "$out/$name.log" 2>&1
      echo $? > "$out/$name.rc"; echo $((SECONDS - start)) > "$out/$name.seconds" ) &
    running=$((running + 1))
    if ((running >= jobs)); then wait -n; running=$((running - 1)); fi
  done
  wait
}

# One at a time, whatever --jobs says: the tests compare cudaMemGetInfo's free bytes before and
# after a call, which a neighbour on the device would move. --jobs is for the sanitizer runs.
echo "== GPU tests (${#tests[@]}, one at a time)"
sanitizer_jobs="$jobs"
jobs=1
for t in "${tests[@]}"; do echo "$t $test_dir/$t"; done | run_parallel
jobs="$sanitizer_jobs"
for t in "${tests[@]}"; do
  rc=$(cat "$out/$t.rc")
  case "$rc" in
    0) note "$t" "passed in $(cat "$out/$t.seconds") s" ;;
    77) fail "$t" "skipped: no usable device" ;;
    124) fail "$t" "timed out after ${step_timeout}s" ;;
    *) fail "$t" "exit $rc after $(cat "$out/$t.seconds") s, see $t.log" ;;
  esac
done

if [[ -n "$sanitizers" ]]; then
  if command -v compute-sanitizer > /dev/null; then
    echo "== compute-sanitizer ($sanitizers)"
    test_timeout="$step_timeout"
    step_timeout="${san_timeout:-$step_timeout}"
    for t in "${tests[@]}"; do
      for tool in $sanitizers; do
        extra=""
        # test_cuda_backend provokes a cudaMalloc failure on purpose (the typed out-of-memory
        # error); the library checks every API status itself, so the tool reports memory only.
        [[ $tool == memcheck ]] && extra="--leak-check full --report-api-errors no"
        # --error-exitcode makes a finding fail the step even when the test itself passes.
        echo "san_${t}_${tool} compute-sanitizer --tool $tool $extra --error-exitcode 3 $test_dir/$t"
      done
    done | run_parallel
    step_timeout="$test_timeout"
    for t in "${tests[@]}"; do
      for tool in $sanitizers; do
        log="$out/san_${t}_${tool}.log"
        rc=$(cat "$out/san_${t}_${tool}.rc")
        # The verdict is the tool's summary: a test that fails its own checks under the tool
        # (cudaMemGetInfo moves while other runs share the device) is still clean or not.
        verdict=$(grep -m1 -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | sed 's/=* *//')
        if [[ $rc == 124 ]]; then
          fail "$t $tool" "timed out after ${san_timeout:-$step_timeout}s (no verdict)"
        elif [[ $rc != 3 && $verdict =~ (": 0 errors"|": 0 hazards displayed (0 errors") ]]; then
          note "$t $tool" "clean ($verdict; test exit $rc)"
        else
          fail "$t $tool" "exit $rc: ${verdict:-no summary}"
        fi
      done
    done
  else
    fail "compute-sanitizer" "not found on PATH"
  fi
fi

if ((bench)); then
  echo "== benchmarks (one at a time)"
  for b in "${benches[@]}"; do
    if timeout "$step_timeout" "$bench_dir/$b" --benchmark_counters_tabular=true "${bench_args[@]}" \
         --benchmark_out="$out/$b.json" --benchmark_out_format=json > "$out/$b.txt" 2>&1; then
      note "$b" "ran ($b.txt, $b.json)"
    else
      fail "$b" "exit $?, see $b.txt"
    fi
  done
fi

# The example trainer on the device (when built: `train` in the prebuilt folder or build/gpu):
# the default GPU run, then the same with memory taken by someone else halfway (a real cudaMalloc),
# then with 8-bit AdamW, each with its report (measured vs predicted peak, reserved bytes after step 1 and later) and
# trace. Exit 3 from train means a measured peak over its prediction.
train_bin="${prebuilt:-$build/examples}/train"
if ((train_steps > 0)) && [[ -x "$train_bin" ]]; then
  echo "== example trainer on the device ($train_steps steps)"
  data="$root/examples/data/tinyshakespeare.txt"
  common=(--device cuda --data "$data" --steps "$train_steps" --eval-every 0 --sample 64)
  if timeout "$step_timeout" "$train_bin" "${common[@]}" --report "$out/train.json" --trace "$out/train_trace.json" \
       > "$out/train.txt" 2>&1; then
    note "train --device cuda" "ran (train.txt, train.json)"
  else
    fail "train --device cuda" "exit $?, see train.txt"
  fi
  half=$((train_steps / 2 > 0 ? train_steps / 2 : 1))
  if timeout "$step_timeout" "$train_bin" "${common[@]}" --budget 4GiB --foreign "1GiB@$half" \
       --report "$out/train_foreign.json" > "$out/train_foreign.txt" 2>&1; then
    note "train --device cuda --foreign 1GiB" "ran (train_foreign.txt, train_foreign.json)"
  else
    fail "train --device cuda --foreign 1GiB" "exit $?, see train_foreign.txt"
  fi
  # 8-bit AdamW on the device (its kernel over the CPU's state layout): the plan counts 2 bytes
  # per parameter of moments; the report says whether the measured peak kept to it.
  if timeout "$step_timeout" "$train_bin" "${common[@]}" --optimizer adamw8bit \
       --report "$out/train_adamw8bit.json" > "$out/train_adamw8bit.txt" 2>&1; then
    note "train --device cuda --optimizer adamw8bit" "ran (train_adamw8bit.txt, train_adamw8bit.json)"
  else
    fail "train --device cuda --optimizer adamw8bit" "exit $?, see train_adamw8bit.txt"
  fi
fi

echo
echo "== summary ($(head -2 "$out/gpu.txt" | tail -1))"
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
exit $status
