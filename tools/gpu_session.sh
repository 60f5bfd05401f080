#!/usr/bin/env bash
# One lent-GPU call under a deadline: steps in priority order, each under its own timeout cut to
# the time left, results packed after every step into $OUT (the device tool brings back at most
# 8 files, so everything goes into one results.tgz beside summary.txt). A step the deadline leaves
# no room for is listed as not run, never as passed.
#
#   bash tools/stage_gpu_binaries.sh                       # here: binaries + libraries, packed
#   # on the GPU machine, carrying .device_pack, first unpack it (the line the stage script prints):
#   mkdir -p .device_deps && tar -xJf .device_pack/bin.txz -C .device_deps &&
#     tar -xzf .device_pack/lib.tgz -C .device_deps && cp .device_pack/python_deps.tgz .device_deps/
#   OUT=... bash tools/gpu_session.sh --prebuilt .device_deps/bin --deadline 480 \
#       --steps "tests train long soak bench_ttt peer_model"
#   OUT=... bash tools/gpu_session.sh --prebuilt .device_deps/bin --deadline 200 --steps sanitizers
#   # or build there (minutes of device time; .device_deps from tools/stage_device_deps.sh gives
#   # the headers the machine lacks):
#   OUT=... bash tools/gpu_session.sh --build 90 --deadline 570 --steps "tests train"
#   # (1243 s of nvcc summed over the CUDA files on the 2-core machine: only where a call may run long)
#
# Steps: train_ab (the example with and without --trace, and adamw8bit, 12 steps each),
# torch_allocator (the Python package built there in the background, then
# tests/python/gpu_torch_allocator.py), torch_ops (the same build, then tests/python/test_ops_cuda.py), bench_kernels (bench_cuda_kernels and the model step at T = 2048, and their *_before
# builds when carried), tests (each GPU test program, one at a time: they compare cudaMemGetInfo), nccl (the
# NCCL communicator's test, fp32 to fp16, and the device trainer's plumbing over NCCL, one rank, no MPI), train (the
# example trainer: default (attention's mma.sync kernels), the WMMA/SIMT fallback, 8-bit AdamW, memory taken by someone else,
# packed paragraphs), bench_ttt (and bench_cuda_ttt_before when carried), bench_mamba,
# bench_model (bench_cuda_*), bench_model_wmma (bench_cuda_model's T = 2048 step with --attention-kernels=wmma), bench_attn (bench_cuda_attention: the SIMT, WMMA and mma.sync kernels at
# T = 2048, 8192), peer_sdpa (PyTorch's SDPA on those shapes), peer_ttt, peer_model, peer_maxseq (PyTorch on the same GPU: ttt_peer.py,
# model_cuda_peer.py, its --max-seq), long (train --seq max under --long-budget, with its trace for the plot),
# soak (2,000 steps, reserved bytes after the first step and the most after it in the report),
# profile (ncu: the model step's time by kernel, tools/kernel_breakdown.py; the TTT inner kernels),
# sanitizers (--tools, default memcheck and racecheck, of every test case in its own process, --jobs at a
# time), bench_all (every bench_cuda_* program, whole).
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root" || exit 1
prebuilt=""
deadline=540
steps="tests train nccl bench_attn peer_sdpa long soak profile bench_ttt peer_model bench_model_wmma peer_maxseq bench_mamba bench_model peer_ttt"
jobs=8
tests="test_cuda_trainer test_cuda_data_parallel test_cuda_model test_cuda_ttt test_cuda_mamba test_cuda_gemm test_cuda_model_kernels
       test_cuda_attention test_cuda_mlp test_cuda_lm_head test_cuda_backend test_cuda_memory"
long_budget=2GiB
build_arch=""
tools="memcheck racecheck"
while (($#)); do
  case "$1" in
    --prebuilt) prebuilt="$(cd "$2" && pwd)"; shift 2 ;;
    --build) build_arch="$2"; shift 2 ;;
    --tools) tools="$2"; shift 2 ;;
    --deadline) deadline="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --jobs) jobs="$2"; shift 2 ;;
    --tests) tests="$2"; shift 2 ;;
    --long-budget) long_budget="$2"; shift 2 ;;
    *) echo "gpu_session.sh: unknown argument '$1' (expected --prebuilt DIR or --build ARCH, --deadline S," \
            "--steps LIST, --jobs N, --tests LIST, --tools LIST, --long-budget SIZE)" >&2
       exit 2 ;;
  esac
done
[[ -n "$prebuilt" || -n "$build_arch" ]] ||
  { echo "gpu_session.sh: give --prebuilt DIR (tools/stage_gpu_binaries.sh) or --build ARCH (e.g. 90)" >&2; exit 2; }
out="${OUT:-$root/build/gpu/session}"
work="$(mktemp -d)"
mkdir -p "$out"
start=$SECONDS

deps="$root/.device_deps/usr/lib/x86_64-linux-gnu"
lt="$(find /usr/local/cuda* /usr/lib /usr/local/lib -name 'libcublasLt.so.13' 2> /dev/null | head -1)"
export LD_LIBRARY_PATH="$deps${lt:+:$(dirname "$lt")}:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="$PATH:/usr/local/cuda/bin" PYTHONUNBUFFERED=1
# libcudnn.so.9 for attention's cuDNN path (dlopened, never linked): PyTorch's wheel brings it. Found,
# test_cuda_attention's cuDNN case must load it and run its forwards on it (MEMBOUND_EXPECT_CUDNN).
cudnn_lib="$(python3 -c 'import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], "lib"))' 2> /dev/null)"
if [[ -n "$cudnn_lib" && -e "$cudnn_lib/libcudnn.so.9" ]]; then
  export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$cudnn_lib" MEMBOUND_EXPECT_CUDNN=1
fi

pack() {
  cp "$work/summary.txt" "$out/summary.txt" 2> /dev/null
  # Logs may still grow (sanitizer jobs): tar's exit 1 ("file changed as we read it") is fine.
  tar -C "$work" --warning=no-file-changed -czf "$out/results.tgz.tmp" .
  (($? <= 1)) && mv "$out/results.tgz.tmp" "$out/results.tgz"
}
left() { echo $((deadline - (SECONDS - start) - 10)); }
# step NAME TIMEOUT CMD...: runs CMD with its output in NAME.log, under min(TIMEOUT, time left).
step() {
  local name="$1" limit="$2"; shift 2
  local l; l=$(left)
  if ((l < 15)); then
    printf '%-40s %s\n' "$name" "not run (deadline)" >> "$work/summary.txt"; return
  fi
  ((limit > l)) && limit=$l
  local t0=$SECONDS rc
  # Line-buffered, so a step killed at its limit leaves every line it printed.
  timeout -k 5 "$limit" stdbuf -oL -eL "$@" > "$work/$name.log" 2>&1
  rc=$?
  local verdict="ok" errors
  case $rc in
    0) # Google Benchmark exits 0 when a benchmark calls SkipWithError: count those.
       errors=$(grep -c 'ERROR OCCURRED' "$work/$name.log")
       ((errors > 0)) && verdict="ran, but $errors benchmark(s) reported ERROR OCCURRED" ;;
    77) verdict="SKIPPED (no device)" ;;
    124|137) verdict="TIMED OUT after ${limit}s" ;;
    *) verdict="FAILED (exit $rc)" ;;
  esac
  printf '%-40s %s in %d s\n' "$name" "$verdict" $((SECONDS - t0)) | tee -a "$work/summary.txt"
  pack
}

if [[ -n "$build_arch" ]]; then
  # Configure and build every GPU test, benchmark and the example trainer here, then run them as if
  # prebuilt. Headers the machine lacks (Eigen, doctest, CLI11, ...) come from .device_deps. The
  # logs are packed every 20 s while it builds, so a call cut short still brings back how far it got.
  bdir="$root/build/gpu-session-$build_arch"
  prebuilt="$bdir/all"
  [[ -d "$root/.device_deps/usr" ]] && export CMAKE_PREFIX_PATH="$root/.device_deps/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  targets=()
  for f in tests/cuda/test_*.cu bench/bench_cuda_*.cu; do targets+=("$(basename "$f" .cu)"); done
  t0=$SECONDS
  limit=$(left)
  if ((limit < 60)); then
    printf '%-40s %s\n' "build (sm $build_arch)" "not run (deadline)" | tee -a "$work/summary.txt"; pack; exit 1
  fi
  (
    timeout "$limit" cmake -S . -B "$bdir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMEMBOUND_REQUIRE_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES="$build_arch-real" > "$work/configure.log" 2>&1 || exit 1
    # The NCCL test exists only where MPI and NCCL were found.
    ninja -C "$bdir" -t targets all 2> /dev/null | grep -q '^test_nccl_communicator:' &&
      targets+=(test_nccl_communicator test_nccl_trainer train_cuda_nccl)
    l=$(left)
    ((l >= 10)) || exit 1
    timeout "$l" cmake --build "$bdir" -j "$(nproc)" --target "${targets[@]}" train train_cuda > "$work/build.log" 2>&1
  ) &
  builder=$!
  while kill -0 "$builder" 2> /dev/null; do sleep 20; pack; done
  if wait "$builder"; then
    mkdir -p "$prebuilt"
    find "$bdir/tests" "$bdir/bench" "$bdir/examples" -maxdepth 1 -type f \( -name 'test_cuda_*' -o \
      -name 'test_nccl_*' -o -name 'bench_cuda_*' -o -name train -o -name 'libtrain_cuda*.so' \) \
      -exec cp {} "$prebuilt/" \;
    printf '%-40s %s in %d s\n' "build (sm $build_arch)" "ok" $((SECONDS - t0)) | tee -a "$work/summary.txt"
    pack
  else
    printf '%-40s %s in %d s\n' "build (sm $build_arch)" "FAILED or out of time (configure.log, build.log)" \
      $((SECONDS - t0)) | tee -a "$work/summary.txt"
    grep -m 40 -E 'error|Error' "$work/configure.log" "$work/build.log"
    pack
    exit 1
  fi
fi

# torch_allocator and torch_ops need the Python package built for this machine's CPython (3.12 on
# the lent image; a build here targets another): configure and build it in the background from the
# start, so the compile (the CUDA layers' nvcc unit: 177 s of one core on the 2-core machine)
# overlaps the GPU steps before them. Eigen and pytest come from .device_deps/python_deps.tgz
# (tools/stage_gpu_binaries.sh), nanobind from the machine's Python.
# Two results: py_build.rc (the planner and the allocator, for torch_allocator) first, then
# py_layers.rc (the host and CUDA layers, for torch_ops), so that the allocator's step never waits
# for the layers' nvcc unit.
pybuild="" pylayers=""
pyprefix="$(mktemp -d)"
if [[ " $steps " == *" torch_allocator "* || " $steps " == *" torch_ops "* ]]; then
  pybuild="$work/py_build.rc" pylayers="$work/py_layers.rc"
  [[ -f "$root/.device_deps/python_deps.tgz" ]] && tar -C "$pyprefix" -xzf "$root/.device_deps/python_deps.tgz"
  (
    cmake -S "$root" -B "$root/build/gpu-python" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMEMBOUND_BUILD_PYTHON=ON \
      -DMEMBOUND_BUILD_TESTS=OFF -DMEMBOUND_BUILD_EXAMPLES=OFF -DMEMBOUND_BUILD_BENCHMARKS=OFF \
      -DMEMBOUND_BUILD_DOCS=OFF -DMEMBOUND_ENABLE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real -DMEMBOUND_ENABLE_MPI=OFF \
      -DPython_EXECUTABLE="$(command -v python3)" -DCMAKE_PREFIX_PATH="$pyprefix/usr" > "$work/py_build.log" 2>&1 &&
      cmake --build "$root/build/gpu-python" -j "$(nproc)" --target _core membound_alloc_cuda >> "$work/py_build.log" 2>&1
    echo $? > "$pybuild.tmp" && mv "$pybuild.tmp" "$pybuild"
    cmake --build "$root/build/gpu-python" -j "$(nproc)" --target _layers _layers_cuda >> "$work/py_build.log" 2>&1
    echo $? > "$pylayers.tmp" && mv "$pylayers.tmp" "$pylayers"
  ) &
fi

# The honest PyTorch peer's Mamba kernels (mamba_ssm, causal_conv1d) built for this machine's torch
# in the background from the sources stage_gpu_binaries.sh carried (tools/build_peer_kernels.sh);
# peer_model waits for them a while, else runs the peer's compiled scan and says so.
peer_site="$work/peer_site" peer_rc=""
if [[ " $steps " == *" peer_model "* && -d "$root/.device_deps/peer_sdists" ]]; then
  peer_rc="$work/peer_kernels.rc"
  ( MAX_JOBS=$(( $(nproc) / 2 > 0 ? $(nproc) / 2 : 1 )) bash "$root/tools/build_peer_kernels.sh" \
      "$root/.device_deps/peer_sdists" "$peer_site" 90 > "$work/peer_kernels.log" 2>&1
    echo $? > "$peer_rc.tmp" && mv "$peer_rc.tmp" "$peer_rc" ) &
fi

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > "$work/gpu.txt" 2>&1
echo "== $(tail -1 "$work/gpu.txt")" | tee -a "$work/summary.txt"
data="$root/examples/data/tinyshakespeare.txt"
train=(--device cuda --data "$data" --eval-every 0 --sample 64)

for s in $steps; do
  case "$s" in
    tests)
      for t in $tests; do step "$t" 100 "$prebuilt/$t"; done ;;
    train)
      step train 120 "$prebuilt/train" "${train[@]}" --steps 30 --report "$work/train.json" --trace "$work/train_trace.json"
      step train_wmma 120 "$prebuilt/train" "${train[@]}" --steps 30 --attention-kernels wmma \
        --report "$work/train_wmma.json" --trace "$work/train_wmma_trace.json"
      # Exit 0 is not enough: the same seed's loss must follow the default kernels' (bf16 sums in
      # another order: within 3% after 30 steps).
      python3 - "$work/train.json" "$work/train_wmma.json" >> "$work/summary.txt" 2>&1 <<'PY'
import json, sys
try:
    ja, jb = (json.load(open(f)) for f in sys.argv[1:3])
    a, b = ja["final_train_loss"], jb["final_train_loss"]
    d = abs(b - a) / abs(a)
    # What ran, not what was asked for.
    ran = (ja["policies"].get("attention_kernels", "?"), jb["policies"].get("attention_kernels", "?"))
    verdict = "ok" if d <= 0.03 else "MISMATCH (over 3%)"
    if ran != ("mma", "wmma"):
        verdict = f"NOT COMPARED: the runs ran {ran[0]} and {ran[1]}"
    print(f"{'train_wmma loss vs train':<40} {b:.4f} vs {a:.4f}: {d:.2%} {verdict};"
          f" tokens/s {jb['tokens_per_second']:.0f} vs {ja['tokens_per_second']:.0f} (train ran first)")
except Exception as e:  # a report missing: its step failed, and says so above
    print(f"{'train_wmma loss vs train':<40} not compared ({e})")
PY
      tail -1 "$work/summary.txt"
      # cuDNN's attention (where libtrain_cuda was built with it), its atomic backward (the deterministic
      # one wants a B·H·T² workspace before cuDNN 9.25; test_cuda_attention covers it): the same loss
      # within 3%, and the report's cudnn field says how many calls cuDNN ran and why the others did not.
      step train_cudnn 120 "$prebuilt/train" "${train[@]}" --steps 30 --attention-kernels cudnn-atomic \
        --report "$work/train_cudnn.json"
      python3 - "$work/train.json" "$work/train_cudnn.json" >> "$work/summary.txt" 2>&1 <<'PY'
import json, sys
try:
    ja, jb = (json.load(open(f)) for f in sys.argv[1:3])
    a, b = ja["final_train_loss"], jb["final_train_loss"]
    d = abs(b - a) / abs(a)
    c = jb.get("cudnn", {})
    print(f"{'train_cudnn loss vs train':<40} {b:.4f} vs {a:.4f}: {d:.2%} {'ok' if d <= 0.03 else 'MISMATCH (over 3%)'};"
          f" tokens/s {jb['tokens_per_second']:.0f} vs {ja['tokens_per_second']:.0f}; cuDNN {c.get('version')}"
          f" ran {c.get('forward_calls')} fwd / {c.get('backward_calls')} bwd, ours {c.get('fallbacks')}"
          f" (last: {c.get('last_fallback')})")
except Exception as e:
    print(f"{'train_cudnn loss vs train':<40} not compared ({e})")
PY
      tail -1 "$work/summary.txt"
      step train_adamw8bit 90 "$prebuilt/train" "${train[@]}" --steps 30 --optimizer adamw8bit \
        --report "$work/train_adamw8bit.json"
      step train_foreign 90 "$prebuilt/train" "${train[@]}" --steps 30 --budget 4GiB --foreign 1GiB@15 \
        --report "$work/train_foreign.json"
      # Packed paragraphs on the device (exit 0: measured peaks within the predictions).
      step train_packed 90 "$prebuilt/train" "${train[@]}" --steps 30 --pack 16 --seq 1024 \
        --report "$work/train_packed.json"
      # Optimizer offload to pinned memory (exit 0: both spaces' peaks within their predictions);
      # its tokens/s beside train's is the offload's step-time overhead (each chunk's host update
      # overlaps its neighbours' copies, all after the backward).
      step train_offload 120 "$prebuilt/train" "${train[@]}" --steps 30 --offload optimizer \
        --report "$work/train_offload.json" ;;
    bench_all)
      for f in "$prebuilt"/bench_cuda_*; do
        b="$(basename "$f")"
        step "$b" 120 "$f" --benchmark_min_time=0.05 --benchmark_counters_tabular=true \
          --benchmark_out="$work/$b.json" --benchmark_out_format=json
      done ;;
    bench_kernels)
      # The model's bandwidth-bound kernels against a device copy of the same bytes; where the
      # previous commit's builds were carried too (copied into the prebuilt folder as
      # bench_cuda_kernels_before, bench_cuda_model_before), those in the same call: a
      # before/after on one machine.
      for b in bench_cuda_kernels bench_cuda_kernels_before; do
        [[ -x "$prebuilt/$b" ]] || continue
        step "$b" 90 "$prebuilt/$b" --benchmark_min_time=0.1 --benchmark_counters_tabular=true \
          --benchmark_out="$work/$b.json" --benchmark_out_format=json
      done
      for b in bench_cuda_model bench_cuda_model_before; do
        [[ -x "$prebuilt/$b" ]] || continue
        step "${b/bench_cuda_model/model_step}" 90 "$prebuilt/$b" '--benchmark_filter=^bm_step/2048/' \
          --benchmark_min_time=0.05 --benchmark_counters_tabular=true
      done ;;
    bench_ttt|bench_mamba|bench_model)
      b="bench_cuda_${s#bench_}"
      step "$b" 120 "$prebuilt/$b" --benchmark_min_time=0.05 --benchmark_counters_tabular=true \
        --benchmark_out="$work/$b.json" --benchmark_out_format=json
      # The TTT kernels' before/after in one call (stage_gpu_binaries.sh --before).
      if [[ "$b" == bench_cuda_ttt && -x "$prebuilt/${b}_before" ]]; then
        step "${b}_before" 120 "$prebuilt/${b}_before" --benchmark_min_time=0.05 \
          --benchmark_counters_tabular=true --benchmark_out="$work/${b}_before.json" \
          --benchmark_out_format=json
      fi ;;
    bench_attn)
      step bench_cuda_attention 120 "$prebuilt/bench_cuda_attention" --benchmark_min_time=0.05 \
        '--benchmark_filter=(_bf16_d(64|128)/(causal|full)|^fwd(bwd)?_d(64|128)/causal)/(2048|8192)/' \
        --benchmark_counters_tabular=true --benchmark_out="$work/bench_cuda_attention.json" \
        --benchmark_out_format=json ;;
    peer_sdpa)
      step sdpa_peer 120 python3 bench/peers/sdpa_peer.py --dtype bf16 --reps 10 --seqs 2048 8192 ;;
    bench_model_wmma)
      # One micro-batch at T = 2048 with attention's fallback kernels, beside peer_model's default run.
      step bench_cuda_model_wmma 120 "$prebuilt/bench_cuda_model" --attention-kernels=wmma '--benchmark_filter=^bm_step/2048/' \
        --benchmark_min_time=0.05 --benchmark_counters_tabular=true ;;
    peer_ttt)
      step ttt_peer 120 python3 bench/peers/ttt_peer.py --device cuda --bench "$prebuilt/bench_cuda_ttt" ;;
    peer_model)
      # The honest peer (torch.compile, SDPA, mamba_ssm where it imports, else a compiled scan):
      # whole optimizer steps on both sides; its warm-up steps hold the compile.
      if [[ -n "$peer_rc" ]]; then
        for _ in $(seq 120); do [[ -f "$peer_rc" ]] && break; sleep 1; done
        echo "peer kernels (mamba_ssm for sm_90): $(cat "$peer_rc" 2> /dev/null || echo 'not built in time')" |
          tee -a "$work/summary.txt"
      fi
      peer_path="${PYTHONPATH:-}"
      [[ -n "$peer_rc" && "$(cat "$peer_rc" 2> /dev/null)" == 0 ]] && peer_path="$peer_site${PYTHONPATH:+:$PYTHONPATH}"
      PYTHONPATH="$peer_path" step model_cuda_peer 300 python3 bench/peers/model_cuda_peer.py \
        --ours "$prebuilt/bench_cuda_model" --seqs 2048 --optimizer --warmup 2 --reps 3 --timeout 240 ;;
    peer_maxseq)
      # The longest sequence each side trains in 4 GiB (ours from the planner; PyTorch checkpointed,
      # the honest peer's mixers eagerly: a compile per probed length would not fit the step's time).
      step model_cuda_peer_maxseq 300 python3 bench/peers/model_cuda_peer.py --max-seq 4 --train "$prebuilt/train" \
        --checkpoint --no-compile --timeout 60 ;;
    nccl)
      # The NCCL path with one rank and no MPI runtime (test_nccl_communicator started alone): NCCL
      # from wherever the machine has it (PyTorch's wheel carries one; 208 MB is too much to carry).
      # shellcheck disable=SC2046  # the site folders, split on purpose
      nccl="$(find /usr/local /usr/lib /opt $(python3 -c 'import site; print(*site.getsitepackages())' 2> /dev/null) \
                -name 'libnccl.so.2' 2> /dev/null | head -1)"
      if [[ -z "$nccl" ]]; then
        printf '%-40s %s\n' test_nccl_communicator "not run (no libnccl.so.2 on this machine)" | tee -a "$work/summary.txt"
      else
        for t in test_nccl_communicator test_nccl_trainer; do
          if [[ -x "$prebuilt/$t" ]]; then
            LD_LIBRARY_PATH="$(dirname "$nccl"):$LD_LIBRARY_PATH" step "$t" 120 "$prebuilt/$t"
          else
            printf '%-40s %s\n' "$t" "not built (it needs MPI and NCCL where it is compiled)" | tee -a "$work/summary.txt"
          fi
        done
        # The timeout's watchdog (a collective held past a 200 ms deadline), then the example's
        # NCCL module at one rank (MEMBOUND_EXAMPLE_NCCL=1: no mpirun needed) with ZeRO-1 and a timeout.
        if [[ -x "$prebuilt/test_nccl_communicator" ]]; then
          LD_LIBRARY_PATH="$(dirname "$nccl"):$LD_LIBRARY_PATH" step test_nccl_watchdog 60 \
            "$prebuilt/test_nccl_communicator" --watchdog
        fi
        if [[ -f "$prebuilt/libtrain_cuda_nccl.so" ]]; then
          MEMBOUND_EXAMPLE_NCCL=1 LD_LIBRARY_PATH="$(dirname "$nccl"):$LD_LIBRARY_PATH" step train_nccl 120 \
            "$prebuilt/train" "${train[@]}" --steps 10 --zero 1 --timeout 60 --report "$work/train_nccl.json"
        fi
      fi ;;
    profile)
      # Where one micro-batch of the model (B = 1, T = 2048) spends its GPU time, kernel by kernel
      # (ncu, one duration metric per launch; clocks left alone), then the TTT inner kernels'
      # occupancy, warp stalls and throughput (one launch each, ncu's full set).
      step profile_model 150 ncu --clock-control none --metrics gpu__time_duration.sum --csv --launch-count 6000 \
        "$prebuilt/bench_cuda_model" '--benchmark_filter=^bm_step/2048/' --benchmark_min_time=0.0001
      [[ -s "$work/profile_model.log" ]] && python3 tools/kernel_breakdown.py "$work/profile_model.log" --top 40 \
        > "$work/profile_model_breakdown.txt" 2>&1 && cat "$work/profile_model_breakdown.txt"
      for k in forward backward; do
        step "profile_ttt_$k" 90 ncu --clock-control none --set full -k "regex:ttt_${k}_kernel" --launch-count 1 \
          "$prebuilt/bench_cuda_ttt" "--benchmark_filter=^ttt_linear_bf16_forward_backward/2048/1/" \
          --benchmark_min_time=0.0001
      done ;;
    long)
      step train_long 150 "$prebuilt/train" "${train[@]}" --seq max --batch 1 --budget "$long_budget" --steps 6 \
        --warmup 1 --report "$work/train_long.json" --trace "$work/train_long_trace.json" ;;
    soak)
      step train_soak 150 "$prebuilt/train" "${train[@]}" --seq 256 --batch 1 --steps 2000 --warmup 30 \
        --report "$work/train_soak.json" ;;
    sanitizers)
      # Each test case in its own process (MEMBOUND_TEST_CASE, names from MEMBOUND_TEST_LIST), so
      # a slow program still gets verdicts for its quick cases; --jobs at a time, each under the
      # time left when it starts. The verdict is the tool's own summary line, read afterwards.
      running=0
      for t in $tests; do
        MEMBOUND_TEST_LIST="$work/cases_$t.txt" timeout 30 "$prebuilt/$t" > "$work/list_$t.log" 2>&1 ||
          : > "$work/cases_$t.txt"
        k=0
        while IFS= read -r c; do
          k=$((k + 1))
          for tool in $tools; do
            limit=$(left)
            if ((limit < 20)); then echo 124 > "$work/san_${t}_${k}_${tool}.rc"; continue; fi
            extra=()
            [[ $tool == memcheck ]] && extra=(--leak-check full --report-api-errors no)
            ( MEMBOUND_TEST_CASE="$c" timeout -k 5 "$limit" compute-sanitizer --tool "$tool" "${extra[@]}" \
                --error-exitcode 3 "$prebuilt/$t" > "$work/san_${t}_${k}_${tool}.log" 2>&1
              echo $? > "$work/san_${t}_${k}_${tool}.rc" ) &
            running=$((running + 1))
            if ((running >= jobs)); then wait -n; running=$((running - 1)); pack; fi
          done
        done < "$work/cases_$t.txt"
      done
      wait
      # Per program and tool: how many cases the tool found clean, with findings, or without a
      # verdict, and how many clean ones the test itself failed (its cudaMemGetInfo checks see the
      # other jobs on the device: a failure to read in the log, not the tool's).
      for t in $tests; do
        n=$(wc -l < "$work/cases_$t.txt")
        if ((n == 0)); then
          printf '%-40s %s\n' "san $t" "not listed (see list_$t.log)" | tee -a "$work/summary.txt"
          continue
        fi
        for tool in $tools; do
          clean=0 found=0 none=0 failing=0 which=""
          for ((k = 1; k <= n; k++)); do
            log="$work/san_${t}_${k}_${tool}.log"
            v=$(grep -m1 -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" 2> /dev/null | sed 's/=* *//')
            rc=$(cat "$work/san_${t}_${k}_${tool}.rc" 2> /dev/null)
            if [[ -z $v ]]; then none=$((none + 1)); which+=" $k?"
            elif [[ $v =~ (": 0 errors"|": 0 hazards displayed (0 errors") ]]; then
              clean=$((clean + 1))
              [[ $rc == 0 ]] || { failing=$((failing + 1)); which+=" $k(test exit $rc)"; }
            else found=$((found + 1)); which+=" $k!"
            fi
          done
          printf '%-40s %d cases: %d clean (%d of them failing their own checks), %d with findings, %d without a verdict%s\n' \
            "san $t $tool" "$n" "$clean" "$failing" "$found" "$none" "${which:+ (case numbers:$which; cases_$t.txt)}" |
            tee -a "$work/summary.txt"
        done
      done
      pack ;;
    train_ab)
      # The example's default run without and with --trace, then without again (order effects),
      # and with --optimizer adamw8bit, 12 steps each: what the trace and the optimizer cost a step.
      step train_ab_plain 60 "$prebuilt/train" "${train[@]}" --steps 12 --report "$work/train_ab_plain.json"
      step train_ab_trace 60 "$prebuilt/train" "${train[@]}" --steps 12 --report "$work/train_ab_trace.json" \
        --trace "$work/train_ab_trace_trace.json"
      step train_ab_plain2 60 "$prebuilt/train" "${train[@]}" --steps 12 --report "$work/train_ab_plain2.json"
      step train_ab_8bit 60 "$prebuilt/train" "${train[@]}" --steps 12 --optimizer adamw8bit \
        --report "$work/train_ab_8bit.json"
      for r in plain trace plain2 8bit; do
        python3 -c "import json,sys; j=json.load(open(sys.argv[1])); print(f\"{'train_ab_' + sys.argv[2]:<40} {j['tokens_per_second']:.0f} tokens/s\")" \
          "$work/train_ab_$r.json" "$r" 2> /dev/null | tee -a "$work/summary.txt"
      done ;;
    torch_allocator)
      # membound.torch.use_allocator under a real PyTorch training loop (tests/python/gpu_torch_allocator.py).
      while [[ -n "$pybuild" && ! -f "$pybuild" ]] && (($(left) > 60)); do sleep 2; done
      if [[ "$(cat "$pybuild" 2> /dev/null)" == 0 ]]; then
        PYTHONPATH="$root/build/gpu-python/python" step torch_allocator 120 python3 tests/python/gpu_torch_allocator.py "$work"
      else
        printf '%-40s %s\n' torch_allocator "not run (the Python build failed or did not finish: py_build.log)" |
          tee -a "$work/summary.txt"
      fi ;;
    torch_ops)
      # membound.ops on CUDA tensors against the CPU ops (tests/python/test_ops_cuda.py). The module is
      # imported first: one that does not load fails the step instead of skipping every test.
      while [[ -n "$pylayers" && ! -f "$pylayers" ]] && (($(left) > 60)); do sleep 2; done
      if [[ "$(cat "$pylayers" 2> /dev/null)" == 0 ]]; then
        PYTHONPATH="$root/build/gpu-python/python:$pyprefix/pylib" step torch_ops 240 bash -c \
          'python3 -c "import membound._layers_cuda" && python3 -m pytest -q -rs -p no:cacheprovider tests/python/test_ops_cuda.py'
        # The Python example under the budgeted allocator: TTT layers on CUDA tensors, the levels
        # acted on, a spike of 768 MiB from step 20 to 40 (examples/python/train_under_budget.py).
        PYTHONPATH="$root/build/gpu-python/python" step train_under_budget 120 python3 \
          examples/python/train_under_budget.py --steps 60
      else
        printf '%-40s %s\n' torch_ops "not run (the Python build failed or did not finish: py_build.log)" |
          tee -a "$work/summary.txt"
      fi ;;
    *) echo "gpu_session.sh: unknown step '$s'" >&2 ;;
  esac
done
pack
echo "gpu_session.sh: $((SECONDS - start)) s; results in $out/results.tgz"
