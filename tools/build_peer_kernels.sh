#!/usr/bin/env bash
# Builds the PyTorch peers' CUDA kernels that PyPI has only as source (mamba_ssm's selective scan,
# causal_conv1d) for one GPU architecture, against the python3 and torch where it runs, and
# installs them into a folder for PYTHONPATH. mamba_ssm imports einops, triton, huggingface_hub and
# transformers (the lent GPU image has them; elsewhere install them first). For the honest peer of
# bench/peers/model_cuda_peer.py (fast_mixers.py uses mamba_ssm's fused path when it imports).
# Nothing of theirs is kept in this
# repository: the source distributions come from PyPI (tools/stage_gpu_binaries.sh carries them).
#
#   bash tools/build_peer_kernels.sh SDIST_DIR TARGET_DIR [ARCH]     # ARCH default 90 (H100/H200)
#
# Upstream's setup.py compiles every architecture its nvcc knows (eight with nvcc 13, each
# .cu file once per architecture: tens of minutes); a wrapper around nvcc passes on only ARCH's
# -gencode pair, so each file compiles once. Needs torch with CUDA, nvcc of torch's CUDA major
# version, ninja (parallel jobs: MAX_JOBS, default the machine's cores).
set -euo pipefail
if (($# < 2)) || [[ ! -d "$1" ]]; then
  echo "usage: bash tools/build_peer_kernels.sh SDIST_DIR TARGET_DIR [ARCH]  (SDIST_DIR: the folder of" \
       "mamba_ssm-*.tar.gz and causal_conv1d-*.tar.gz)" >&2
  exit 2
fi
sdists="$(cd "$1" && pwd)"
target="$2"
arch="${3:-90}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
nvcc_real="${CUDA_HOME:-/usr/local/cuda}/bin/nvcc"
command -v nvcc > /dev/null && nvcc_real="$(command -v nvcc)"
cat > "$work/nvcc" << EOF
#!/usr/bin/env bash
# Keeps -gencode pairs for sm_$arch only (both spellings: "-gencode X" and "-gencode=X").
args=()
while [ \$# -gt 0 ]; do
  case "\$1" in
    -gencode) if [[ "\$2" == *"_$arch"* ]]; then args+=("\$1" "\$2"); fi; shift 2 ;;
    -gencode=*) if [[ "\$1" == *"_$arch"* ]]; then args+=("\$1"); fi; shift ;;
    *) args+=("\$1"); shift ;;
  esac
done
exec "$nvcc_real" "\${args[@]}"
EOF
chmod +x "$work/nvcc"
# PyTorch from 2.10 needs C++20 in every unit that includes it; mamba_ssm 2.3.2 compiles its host
# file with -std=c++17 (its build against torch 2.15 failed so, 2026-11-30): the host compiler
# gets c++20 instead.
cxx_real="$(command -v "${CXX:-c++}")"
cat > "$work/c++" << EOF
#!/usr/bin/env bash
args=()
for a in "\$@"; do [[ "\$a" == -std=c++17 ]] && a=-std=c++20; args+=("\$a"); done
exec "$cxx_real" "\${args[@]}"
EOF
chmod +x "$work/c++"
export PYTORCH_NVCC="$work/nvcc" CXX="$work/c++" TORCH_CUDA_ARCH_LIST="${arch:0:-1}.${arch: -1}"
export MAMBA_FORCE_BUILD=TRUE CAUSAL_CONV1D_FORCE_BUILD=TRUE MAX_JOBS="${MAX_JOBS:-$(nproc)}"
mkdir -p "$target"
for name in causal_conv1d mamba_ssm; do
  sdist="$(ls "$sdists"/"$name"-*.tar.gz | head -1)"
  start=$(date +%s)
  python3 -m pip wheel --no-build-isolation --no-deps --no-index --quiet -w "$work/wheels" "$sdist"
  echo "$name: built in $(( $(date +%s) - start )) s for sm_$arch"
done
python3 -m pip install --no-deps --no-index --quiet --target "$target" "$work"/wheels/*.whl
PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}" python3 -c "
from mamba_ssm.ops import selective_scan_interface as s
conv = getattr(s, 'causal_conv1d_fwd_function', None) or getattr(s, 'causal_conv1d_cuda', None)
assert conv is not None, 'causal_conv1d did not import'
import selective_scan_cuda
print('mamba_ssm', s.__file__)"
