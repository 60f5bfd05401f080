#!/usr/bin/env bash
# Installs the build and test dependencies that are missing, with apt-get only. Idempotent:
# nothing is updated or installed when everything is already there.
set -euo pipefail

packages=(cmake ninja-build g++ python3 git libeigen3-dev doctest-dev libbenchmark-dev
          nlohmann-json3-dev libcli11-dev libfmt-dev libopenmpi-dev openmpi-bin pkg-config)

missing=()
for p in "${packages[@]}"; do
  # dpkg -s also lists removed-but-configured packages; require "install ok installed".
  if [[ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" != "install ok installed" ]]; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "deps.sh: all ${#packages[@]} packages already installed"
  exit 0
fi

sudo=()
if ((EUID != 0)); then
  sudo=(sudo)
fi
echo "deps.sh: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "deps.sh: done"
