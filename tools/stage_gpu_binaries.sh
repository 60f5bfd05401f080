#!/usr/bin/env bash
# Builds here, for one architecture, everything a lent GPU machine runs (the GPU tests, the GPU
# benchmarks, the example trainer with its device module, the NCCL test when NCCL is found), then
# stages the Debian packages (tools/stage_device_deps.sh) and copies the binaries into
# .device_deps/bin, so that the GPU machine spends its minutes running, not compiling:
#
#   bash tools/stage_gpu_binaries.sh [ARCH]          # default 90-real (H100, H200)
#   # then, on the GPU machine (carry .device_deps/bin and .device_deps/usr/lib: the headers under
#   # .device_deps/usr/include are for --build only, and the device tool carries 64 MiB at most):
#   OUT=/tmp/g bash tools/gpu_session.sh --prebuilt .device_deps/bin --deadline 470
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
arch="${1:-90-real}"
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
# Symbols are not needed there, and the carry limit is tight (69 MiB unstripped on 2026-11-27).
strip --strip-unneeded "$bin"/*
kib=$(du -s --apparent-size -B1K "$bin" "$lib" | awk '{s += $1} END {print s}')
echo "stage_gpu_binaries.sh: $(ls "$bin" | wc -l) files in $bin for sm ${arch%%-*};" \
     "carry .device_deps/bin and .device_deps/usr/lib: $((kib / 1024)) MiB"
if ((kib > 64 * 1024)); then
  echo "stage_gpu_binaries.sh: over the device tool's 64 MiB carry limit: stage fewer targets" >&2
  exit 1
fi
