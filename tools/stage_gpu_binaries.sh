#!/usr/bin/env bash
# Builds here, for one architecture, everything a lent GPU machine runs (the GPU tests, the GPU
# benchmarks, the example trainer with its device module, the NCCL test when NCCL is found), then
# stages the Debian packages (tools/stage_device_deps.sh) and packs what travels into
# .device_pack (ignored by git): bin.txz (the stripped binaries, xz: 62 MiB of them packed into
# 7.7 MiB on 2026-11-29, under the device tool's 64 MiB carry limit), lib.tgz (the Debian
# libraries they load) and python_deps.tgz (Eigen's headers and CMake files, for the Python
# package that gpu_session.sh's torch_allocator and torch_ops steps build there, and pytest):
#
#   bash tools/stage_gpu_binaries.sh [ARCH] [--before DIR]   # default 90-real (H100, H200)
#   # --before DIR: a build of an earlier commit (e.g. a git worktree's build/gpu) whose
#   # bench_cuda_kernels, bench_cuda_model and bench_cuda_ttt travel too, as *_before, for a
#   # before/after in one call
#   # then, on the GPU machine (carry .device_pack):
#   mkdir -p .device_deps && tar -xJf .device_pack/bin.txz -C .device_deps &&
#     tar -xzf .device_pack/lib.tgz -C .device_deps && cp .device_pack/python_deps.tgz .device_deps/ &&
#     { [ ! -f .device_pack/peer_sdists.tgz ] || tar -xzf .device_pack/peer_sdists.tgz -C .device_deps; }
#   OUT=/tmp/g bash tools/gpu_session.sh --prebuilt .device_deps/bin --deadline 470
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
arch="90-real"
before=""
while (($#)); do
  case "$1" in
    --before) before="$(cd "$2" && pwd)"; shift 2 ;;
    *) arch="$1"; shift ;;
  esac
done
build="$root/build/gpu"
cd "$root"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$arch" \
  -DMEMBOUND_REQUIRE_CUDA=ON > /dev/null
targets=(train)
for f in tests/cuda/test_*.cu bench/bench_cuda_*.cu; do targets+=("$(basename "$f" .cu)"); done
if ninja -C "$build" -t targets all 2>/dev/null | grep -q '^test_nccl_communicator:'; then
  targets+=(test_nccl_communicator test_nccl_trainer train_cuda_nccl)
fi
ninja -C "$build" -j "${JOBS:-2}" "${targets[@]}"
bash tools/stage_device_deps.sh
bin="$root/.device_deps/bin"
mkdir -p "$bin"
for t in "${targets[@]}"; do
  for dir in tests bench examples; do
    if [[ -x "$build/$dir/$t" ]]; then cp "$build/$dir/$t" "$bin/"; fi
  done
done
cp "$build/examples/libtrain_cuda.so" "$bin/"
if [[ -f "$build/examples/libtrain_cuda_nccl.so" ]]; then cp "$build/examples/libtrain_cuda_nccl.so" "$bin/"; fi
# The Debian libraries the binaries load that a GPU image may lack: an allow-list (OpenMPI's, for
# train, which links MPI and initializes it only under mpirun; hwloc, libevent, libudev beneath it), so
# that nothing of the driver's, CUDA's or the system's shadows the GPU machine's own.
lib="$root/.device_deps/usr/lib/x86_64-linux-gnu"
mkdir -p "$lib"
for f in "$bin"/*; do { ldd "$f" 2> /dev/null || true; }; done |
  awk '$3 ~ /^\/(usr\/)?lib\/x86_64-linux-gnu\// {print $3}' | sort -u |
  { grep -E '/lib(mpi|open-rte|open-pal|hwloc|event_core|event_pthreads|udev)[^/]*\.so' || true; } |
  while read -r f; do cp -L "$f" "$lib/"; done
# Symbols are not needed there.
strip --strip-unneeded "$bin"/*
if [[ -n "$before" ]]; then
  for b in bench_cuda_kernels bench_cuda_model bench_cuda_ttt; do
    [[ -x "$before/bench/$b" ]] || continue  # bench_cuda_ttt: a build from 2026-11-29 on
    strip --strip-unneeded "$before/bench/$b" -o "$bin/${b}_before"
  done
fi
pack="$root/.device_pack"
mkdir -p "$pack"
tar -C "$root/.device_deps" -cJf "$pack/bin.txz" bin
tar -C "$root/.device_deps" -czf "$pack/lib.tgz" usr/lib
# pytest and its pure-Python dependencies for the torch_ops step (the lent image has no pytest).
pylib="$root/.device_deps/pylib"
rm -rf "$pylib" && mkdir -p "$pylib"
python3 - "$pylib" <<'PY'
import importlib, os, shutil, sys
for name in ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pygments"):
    try:  # pygments only from pytest 8.4
        path = os.path.dirname(importlib.import_module(name).__file__)
    except ImportError:
        continue
    shutil.copytree(path, os.path.join(sys.argv[1], name), ignore=shutil.ignore_patterns("__pycache__"))
PY
tar -C "$root/.device_deps" -czf "$pack/python_deps.tgz" usr/include/eigen3 usr/share/eigen3 pylib
# The honest PyTorch peer's Mamba kernels, as source (PyPI has no binary): gpu_session.sh builds
# them there for sm_90 in the background (tools/build_peer_kernels.sh); 250 KB.
sdists="$root/.device_deps/peer_sdists"
rm -rf "$sdists" && mkdir -p "$sdists"
if python3 -m pip download --quiet --no-deps --no-build-isolation --no-binary :all: -d "$sdists" \
     mamba-ssm==2.3.2.post1 causal-conv1d==1.7.0; then
  tar -C "$root/.device_deps" -czf "$pack/peer_sdists.tgz" peer_sdists
else
  echo "stage_gpu_binaries.sh: mamba-ssm's or causal-conv1d's source did not download (pip's error above): the" \
       "honest peer will use its compiled scan, not mamba_ssm" >&2
fi
exclude="$root/.git/info/exclude"
grep -qx '/.device_pack/' "$exclude" 2> /dev/null || echo '/.device_pack/' >> "$exclude"
kib=$(du -s --apparent-size -B1K "$pack" | cut -f1)
echo "stage_gpu_binaries.sh: $(ls "$bin" | wc -l) files in $bin for sm ${arch%%-*}, packed in $pack: carry .device_pack ($((kib / 1024)) MiB)"
if ((kib > 48 * 1024)); then
  echo "stage_gpu_binaries.sh: the pack leaves too little of the device tool's 64 MiB for the working tree" >&2
  exit 1
fi
