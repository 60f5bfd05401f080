#!/usr/bin/env bash
# Installs the build and test dependencies that are missing: Debian packages with apt-get, and the
# Python package's build and test tools, which Debian 12 lacks (nanobind, scikit-build-core; pytest
# and PyTorch, whose ops membound.ops registers and tests against, with them), from PyPI for the
# python3 on PATH. PyPI's torch wheel brings its CUDA libraries (~5 GB installed, about a minute);
# the tests run it on the CPU; nvidia-cudnn-frontend's headers (~50 MB wheel) for attention's cuDNN
# path. Idempotent: nothing is updated or installed when
# everything is already there.
set -euo pipefail

packages=(cmake ninja-build g++ python3 python3-dev python3-pip python3-venv git libeigen3-dev doctest-dev
          libbenchmark-dev nlohmann-json3-dev libcli11-dev libfmt-dev libopenmpi-dev openmpi-bin
          pkg-config doxygen)

missing=()
for p in "${packages[@]}"; do
  # dpkg -s also lists removed-but-configured packages; require "install ok installed".
  if [[ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" != "install ok installed" ]]; then
    missing+=("$p")
  fi
done

sudo=()
if ((EUID != 0)); then
  sudo=(sudo)
fi
if ((${#missing[@]} == 0)); then
  echo "deps.sh: all ${#packages[@]} packages already installed"
else
  echo "deps.sh: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  "${sudo[@]}" apt-get update -qq
  "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# PyPI modules, by import name=distribution name.
modules=(nanobind=nanobind scikit_build_core=scikit-build-core pytest=pytest numpy=numpy torch=torch)
wanted=()
for m in "${modules[@]}"; do
  python3 -c "import ${m%%=*}" 2>/dev/null || wanted+=("${m#*=}")
done
# Header-only: cudnn_frontend's C++ headers for attention's cuDNN path (CMake finds them through
# the distribution; importing its Python module would load cuDNN).
python3 -c "import importlib.metadata as m; m.distribution('nvidia-cudnn-frontend')" 2>/dev/null ||
  wanted+=(nvidia-cudnn-frontend)
if ((${#wanted[@]} == 0)); then
  echo "deps.sh: python3 has nanobind, scikit-build-core, pytest, numpy, torch and nvidia-cudnn-frontend"
else
  echo "deps.sh: pip installing ${wanted[*]} for $(command -v python3)"
  pip_args=(--quiet --disable-pip-version-check)
  export PIP_ROOT_USER_ACTION=ignore  # as root (CI): no warning; older pips ignore the variable
  # Debian's own python3 refuses pip outside a virtual environment (PEP 668): into the user's
  # site-packages then, which that python3 reads and no Debian package owns.
  if python3 -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")))'; then
    pip_args+=(--user --break-system-packages)
  fi
  python3 -m pip install "${pip_args[@]}" "${wanted[@]}"
fi
echo "deps.sh: done"
