#!/usr/bin/env python3
"""Structural checks on include/membound, run by ctest.

  --no-cuda-in-host  no header outside backend/cuda/*.cuh includes a CUDA header, so the host
                     API always builds with a plain C++ compiler
  --umbrella         every host header is reachable from membound/membound.hpp, every .cuh
                     from membound/backend/cuda.cuh and every MPI header (dist/mpi_*.hpp) from
                     membound/mpi.hpp, so new headers cannot be forgotten there; the host
                     umbrella reaches neither CUDA nor MPI
  --layering         each folder includes only the folders below it (LAYERS), so the memory core
                     never depends on the monitor, backends never on the layers, the planner
                     never on the trainer
  --backend-branches no header above backend/ branches on the backend (`if constexpr` on
                     on_cpu, on_host or is_cpu_backend_v): a front makes one call into
                     backend_kernels<Backend, Shape> and each backend answers it

Exits 1 listing every offending file.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INCLUDE_DIR = ROOT / "include"
HOST_UMBRELLA = "membound/membound.hpp"
CUDA_UMBRELLA = "membound/backend/cuda.cuh"
MPI_UMBRELLA = "membound/mpi.hpp"
NCCL_UMBRELLA = "membound/nccl.cuh"

INCLUDE_RE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)
# <cuda.h>, <cuda_runtime.h>, <cudaTypedefs.h>, <cuda/std/...>, "x/cuda_fp16.h", and any .cuh
CUDA_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*[<"]((?:[^>"]*/)?cuda[^>"]*|[^>"]*\.cuh)[>"]',
                             re.M)


def headers() -> list[str]:
    return sorted(p.relative_to(INCLUDE_DIR).as_posix()
                  for p in (INCLUDE_DIR / "membound").rglob("*")
                  if p.suffix in (".hpp", ".cuh") and p.is_file())


def is_cuda_backend(name: str) -> bool:
    return name.endswith(".cuh")


def check_no_cuda_in_host() -> list[str]:
    problems = []
    for name in headers():
        if is_cuda_backend(name):
            continue
        text = (INCLUDE_DIR / name).read_text(encoding="utf-8")
        for m in CUDA_INCLUDE_RE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            problems.append(f"include/{name}:{line}: host header includes <{m.group(1)}>; "
                            "CUDA headers belong in backend/cuda/*.cuh only")
    return problems


def reachable(start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        name = todo.pop()
        if name in seen or not (INCLUDE_DIR / name).is_file():
            continue
        seen.add(name)
        text = (INCLUDE_DIR / name).read_text(encoding="utf-8")
        todo.extend(t for t in INCLUDE_RE.findall(text) if t.startswith("membound/"))
    return seen


def is_mpi(name: str) -> bool:
    return name.startswith("membound/dist/mpi")


def is_nccl(name: str) -> bool:
    return name.startswith("membound/dist/nccl")


def check_umbrella() -> list[str]:
    problems = []
    host = reachable(HOST_UMBRELLA)
    cuda = reachable(CUDA_UMBRELLA)
    mpi = reachable(MPI_UMBRELLA)
    nccl = reachable(NCCL_UMBRELLA)
    for name in headers():
        if name in (HOST_UMBRELLA, CUDA_UMBRELLA, MPI_UMBRELLA, NCCL_UMBRELLA):
            continue
        if is_nccl(name):
            if name not in nccl:
                problems.append(f"include/{name} is not reachable from include/{NCCL_UMBRELLA}: "
                                "add an #include there")
        elif is_mpi(name):
            if name not in mpi:
                problems.append(f"include/{name} is not reachable from include/{MPI_UMBRELLA}: "
                                "add an #include there")
        elif is_cuda_backend(name):
            if name not in cuda:
                problems.append(f"include/{name} is not reachable from include/{CUDA_UMBRELLA}: "
                                "add an #include there")
        elif name not in host:
            problems.append(f"include/{name} is not reachable from include/{HOST_UMBRELLA}: "
                            "add an #include there, then run tools/amalgamate.py")
    for name in sorted(cuda):
        if is_nccl(name) or is_mpi(name):
            problems.append(f"include/{CUDA_UMBRELLA} reaches NCCL/MPI header include/{name}")
    for name in sorted(host):
        if is_cuda_backend(name):
            problems.append(f"include/{HOST_UMBRELLA} reaches CUDA header include/{name}")
        if is_mpi(name):
            problems.append(f"include/{HOST_UMBRELLA} reaches MPI header include/{name}")
    return problems


# What each folder of include/membound may include besides itself, lowest first. A backend's
# kernels see shapes and vocabulary, never the layer front ends (which call them through
# backend_kernels); the model and its planner see layers and the optimizer, never train/.
LAYERS = {
    "core": set(),
    "memory": {"core"},
    "monitor": {"core", "memory"},
    "policy": {"core", "memory"},
    "shape": {"core"},
    "optimizer": {"core"},
    "backend/cpu": {"core", "memory", "policy", "shape"},
    "backend/cuda": {"core", "memory", "policy", "shape", "optimizer"},
    "layers": {"core", "memory", "policy", "shape", "backend/cpu"},
    "model": {"core", "memory", "monitor", "policy", "shape", "optimizer", "backend/cpu",
              "layers"},
    "train": {"core", "memory", "monitor", "policy", "shape", "optimizer", "backend/cpu",
              "layers", "model", "dist"},
    # nccl_communicator's rank-order sum kernel reads and writes 16-bit storage with the CUDA
    # backend's device loads and stores (backend/cuda/storage.cuh; mpi_communicator and the
    # concept stay host-only).
    "dist": {"core", "memory", "backend/cuda"},
}


def folder_of(name: str) -> str | None:
    """The LAYERS key of include/<name>, None for the umbrellas (which include everything)."""
    parts = name.split("/")[1:]  # drop "membound"
    if len(parts) < 2:
        return None
    if parts[0] == "backend":
        return "backend/" + parts[1] if len(parts) > 2 else None
    return parts[0]


def check_layering() -> list[str]:
    problems = []
    for name in headers():
        folder = folder_of(name)
        if folder is None:
            continue
        if folder not in LAYERS:
            problems.append(f"include/{name}: folder {folder}/ has no place in LAYERS "
                            "(tests/structure/check_headers.py): add it with the folders it may include")
            continue
        text = (INCLUDE_DIR / name).read_text(encoding="utf-8")
        for m in INCLUDE_RE.finditer(text):
            target = m.group(1)
            if not target.startswith("membound/"):
                continue
            to = folder_of(target)
            if to is None or to == folder or to in LAYERS[folder]:
                continue
            line = text.count("\n", 0, m.start()) + 1
            problems.append(f"include/{name}:{line}: {folder}/ includes {target}, but {folder}/ "
                            f"may include only {sorted(LAYERS[folder])}: move the shared part "
                            "down a layer")
    return problems


# `if constexpr` on the backend above backend/: a front calls backend_kernels<Backend, Shape> and
# each backend answers it (45 such branches at 98b529b, in the layer fronts, the model and the
# trainer; none since).
BACKEND_BRANCH_RE = re.compile(r"if\s+constexpr\s*\([^)]*\b(on_cpu|on_host|is_cpu_backend_v)\b")


def check_backend_branches() -> list[str]:
    problems = []
    for name in headers():
        if name.startswith("membound/backend/"):
            continue
        text = (INCLUDE_DIR / name).read_text(encoding="utf-8")
        for m in BACKEND_BRANCH_RE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            problems.append(f"include/{name}:{line}: `if constexpr` on the backend above backend/: "
                            "put each backend's part behind backend_kernels<Backend, Shape> in "
                            "backend/cpu/ and backend/cuda/ (docs/architecture.md)")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-cuda-in-host", action="store_true")
    parser.add_argument("--umbrella", action="store_true")
    parser.add_argument("--layering", action="store_true")
    parser.add_argument("--backend-branches", action="store_true")
    args = parser.parse_args()
    if not (args.no_cuda_in_host or args.umbrella or args.layering or args.backend_branches):
        parser.error("pass --no-cuda-in-host, --umbrella, --layering and/or --backend-branches")
    problems = []
    if args.no_cuda_in_host:
        problems += check_no_cuda_in_host()
    if args.umbrella:
        problems += check_umbrella()
    if args.layering:
        problems += check_layering()
    if args.backend_branches:
        problems += check_backend_branches()
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        return 1
    print(f"check_headers.py: {len(headers())} headers OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
