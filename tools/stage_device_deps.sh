#!/usr/bin/env bash
# Copies the Debian packages membound builds against (headers, CMake package files, the shared
# libraries they name) into a prefix that travels to a GPU machine that lacks them:
#
#   bash tools/stage_device_deps.sh            # -> .device_deps/usr (ignored by git)
#   then carry .device_deps and run tools/gpu_session.sh --build ARCH there
#
# The packages' CMake files locate themselves relative to their own path, so
# CMAKE_PREFIX_PATH=<prefix>/usr finds them wherever the folder lands.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="${1:-$root/.device_deps}"
packages=(libeigen3-dev doctest-dev libbenchmark-dev libbenchmark1debian nlohmann-json3-dev
          libcli11-dev libfmt-dev libfmt9)
rm -rf "$dest"
mkdir -p "$dest"
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    echo "stage_device_deps.sh: $p is not installed; run tools/deps.sh first" >&2
    exit 1
  fi
  # Regular files and symlinks only; documentation stays behind. tar keeps the /usr layout.
  dpkg -L "$p" | grep -v -e '/share/doc/' -e '/share/man/' | while read -r f; do
    if [[ -f "$f" || -L "$f" ]]; then echo "${f#/}"; fi
  done | tar -C / -cf - -T - | tar -C "$dest" -xf -
done
# So that ignored status survives a fresh checkout's `git status`.
exclude="$root/.git/info/exclude"
if [[ -d "$root/.git" ]] && ! grep -qx '/.device_deps/' "$exclude" 2>/dev/null; then
  mkdir -p "$(dirname "$exclude")"
  echo '/.device_deps/' >> "$exclude"
fi
echo "stage_device_deps.sh: $(du -sh "$dest" | cut -f1) in $dest"
