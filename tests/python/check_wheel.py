"""What `pip install .` gives a user, end to end: the wheel built from this source tree, with its
CUDA half where nvcc is found (required where MEMBOUND_REQUIRE_CUDA is set, as in CI)
(`pip wheel --no-build-isolation`, the build `pip install .` runs, with the build tools already
installed) holds the package and its module and nothing else (no headers, no CMake files), and,
installed into an empty folder (WORK_DIR/site, kept: ctest's python_pytest runs against it),
imports, plans and allocates through the framework allocator's host build in a fresh interpreter.

    python3 tests/python/check_wheel.py SOURCE_DIR WORK_DIR
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import zipfile


def main() -> int:
    source, work = sys.argv[1], sys.argv[2]
    shutil.rmtree(work, ignore_errors=True)
    wheels, target = os.path.join(work, "wheels"), os.path.join(work, "site")
    env = dict(os.environ)
    # CI exports MEMBOUND_REQUIRE_CUDA: there the wheel must hold the CUDA half (the device planner
    # in _core, _layers_cuda, the CUDA allocator), built through pip's CMake path as a user's
    # `pip install .` builds it where nvcc is found; elsewhere the wheel is what that machine gives.
    require_cuda = env.pop("MEMBOUND_REQUIRE_CUDA", "").upper() in ("1", "ON", "TRUE", "YES")
    env.pop("MEMBOUND_REQUIRE_MPI", None)
    # One architecture (sm_90, CI's) instead of the package's default two: the check is that it
    # compiles, links and imports, with every warning an error (the nvcc units already are). Its
    # nvcc units as a check build compiles them (MEMBOUND_CHECK_BUILD: device code to PTX at cicc
    # -O1, host code at -O1; the layer tests put the kernels through ptxas); a user's
    # `pip install .` compiles them fully.
    defines = ["CMAKE_CUDA_ARCHITECTURES=90-real", "CMAKE_COMPILE_WARNING_AS_ERROR=ON", "MEMBOUND_CHECK_BUILD=ON",
               f"MEMBOUND_REQUIRE_CUDA={'ON' if require_cuda else 'OFF'}"]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--quiet",
                    "--disable-pip-version-check", "-w", wheels,
                    f"--config-settings=build-dir={os.path.join(work, 'build')}",
                    *[f"--config-settings=cmake.define.{d}" for d in defines], source], check=True, env=env)
    (wheel,) = glob.glob(os.path.join(wheels, "membound-*.whl"))
    names = sorted(zipfile.ZipFile(wheel).namelist())
    package = [n for n in names if not n.startswith("membound-")]
    print(os.path.basename(wheel), *package, sep="\n  ")
    for module in ("_core", "_layers"):
        assert any(n.startswith(f"membound/{module}.") and n.endswith((".so", ".pyd")) for n in package), names
    for needed in ("membound/__init__.py", "membound/_errors.py", "membound/py.typed", "membound/_core.pyi",
                   "membound/_service.py", "membound/torch.py", "membound/ops.py", "membound/nn.py", "membound/_layers.pyi", "membound/libmembound_alloc_host.so"):
        assert needed in package, f"{needed} missing from the wheel"
    assert all(n.startswith("membound/") for n in package), f"files outside the package: {package}"
    cuda = any(n.startswith("membound/_layers_cuda.") for n in package)
    if require_cuda:
        for needed in ("membound/_layers_cuda.pyi", "membound/libmembound_alloc_cuda.so"):
            assert needed in package, f"{needed} missing from the wheel (MEMBOUND_REQUIRE_CUDA)"
        assert cuda, "membound/_layers_cuda missing from the wheel (MEMBOUND_REQUIRE_CUDA)"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--disable-pip-version-check",
                    "--no-index", "--target", target, wheel], check=True, env={**env, "PIP_ROOT_USER_ACTION": "ignore"})
    probe = ("import membound; m = membound.Model(layers=['ttt', 'attn'], width=64, heads=2); "
             "p = membound.fit(m, batch=4, seq=64, budget='64MiB'); "
             "assert p.fits and p.reserved_peak >= p.peak_bytes > 0; "
             "from membound._service import Service; s = Service('host'); s.configure(1 << 20); "
             "a = s.malloc(4096); assert a and s.stats()['requested'] == 4096; s.free(a, 4096); "
             "from membound import _layers; sp = _layers.Spec(); sp.kind = 'mamba'; sp.width = 8; "
             "sp.d_inner = 16; sp.dt_rank = 1; assert _layers.sizes(sp)[0] > 0; "
             "print(membound.__version__, p.schedule, membound._core.plans_devices())")
    if cuda:  # imports without a GPU; the device planner is in _core
        probe += ("; from membound import _layers_cuda; assert 'cuda' in membound._core.plans_devices(); "
                  "d = membound.fit(m, batch=4, seq=64, budget='2GiB', device='cuda'); assert d.fits")
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    clean["PYTHONPATH"] = target
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True, cwd=work, env=clean)
    print("installed and planned:", out.stdout.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
