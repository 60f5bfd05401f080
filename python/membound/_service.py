"""The framework allocator's C hooks (python/src/framework_allocator.hpp) through ctypes.

Two builds of one service: `host` (system memory; what the tests drive on any machine) and `cuda`
(cudaMalloc; what membound.torch.use_allocator hands to PyTorch). Each is a shared library beside
this file, loaded once per process.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import re
from dataclasses import dataclass
from typing import Callable, Optional

from ._errors import InvalidArgument

LEVELS = ("normal", "warning", "critical", "emergency")

_STATS = ("requested", "peak_requested", "reserved", "peak_reserved", "limit", "external", "allocations",
          "deallocations", "refusals", "upstream_allocations", "level", "cached", "bad_frees")

CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64)


@dataclass(frozen=True)
class PressureEvent:
    """A change of pressure level on one device: usage / limit crossed a threshold, up or down."""

    device: int
    previous: str  # "normal", "warning", "critical" or "emergency"
    level: str
    usage: int  # bytes: the allocator's reserve plus what others hold on the device
    limit: int  # the budget


def library_path(kind: str) -> str:
    """Where the `kind` ("host" or "cuda") build of the service lies, beside this package."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), f"libmembound_alloc_{kind}.so")


def _typed_error(message: str) -> InvalidArgument:
    m = re.match(r"membound: invalid argument '([^']*)': expected (.*?)(?:, got (.*?))?(?:\. (.*))?$", message)
    if m is None:
        return InvalidArgument(message, "", "", "", "")
    return InvalidArgument(message, m.group(1), m.group(2) or "", m.group(3) or "", m.group(4) or "")


class Service:
    """One build of the service: configure it, then allocate and free through it (or let a
    framework do so through its hooks)."""

    _loaded: dict[str, "Service"] = {}

    def __new__(cls, kind: str = "host") -> "Service":
        if kind not in ("host", "cuda"):
            raise InvalidArgument(f"membound: invalid argument 'kind': expected host or cuda, got {kind!r}",
                                  "kind", "host or cuda", repr(kind), 'e.g. Service("host")')
        if kind not in cls._loaded:
            path = library_path(kind)
            if not os.path.exists(path):
                raise FileNotFoundError(f"membound: {path} was not built (the cuda service needs the CUDA toolkit "
                                        "where the package is built)")
            self = super().__new__(cls)
            self.kind, self.path = kind, path
            self._lib = lib = ctypes.CDLL(path)
            lib.membound_alloc_configure.argtypes = [ctypes.c_uint64, ctypes.c_double, ctypes.c_double, ctypes.c_double]
            lib.membound_alloc_configure.restype = ctypes.c_int
            lib.membound_alloc_set_callback.argtypes = [CALLBACK]
            # membound_alloc_malloc throws on a refusal (for PyTorch): never through ctypes.
            lib.membound_alloc_try_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            lib.membound_alloc_try_malloc.restype = ctypes.c_void_p
            lib.membound_alloc_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            lib.membound_alloc_record_stream.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
            lib.membound_alloc_record_stream.restype = ctypes.c_int
            lib.membound_alloc_stats.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_uint64)]
            lib.membound_alloc_stats.restype = ctypes.c_int
            lib.membound_alloc_stat_count.restype = ctypes.c_int
            lib.membound_alloc_set_others.argtypes = [ctypes.c_int, ctypes.c_uint64]
            lib.membound_alloc_last_refusal.restype = ctypes.c_char_p
            lib.membound_alloc_last_error.restype = ctypes.c_char_p
            lib.membound_alloc_record_history.argtypes = [ctypes.c_uint64]
            lib.membound_alloc_snapshot.restype = ctypes.c_char_p
            assert lib.membound_alloc_stat_count() == len(_STATS), "the library and _service.py disagree"
            # Every thunk handed to the library, kept for the process's life: a thread may be
            # calling the previous one while it is replaced.
            self._callbacks = [CALLBACK()]
            lib.membound_alloc_set_callback(self._callbacks[0])
            cls._loaded[kind] = self
        return cls._loaded[kind]

    def configure(self, budget: int, thresholds: tuple[float, float, float] = (0.90, 0.95, 0.97)) -> None:
        """The budget per device, in bytes, and the warning, critical and emergency fractions of it.
        Before the first allocation (InvalidArgument with blocks live: the previous one stays)."""
        if isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget < 1 << 64:
            raise InvalidArgument(f"membound: invalid argument 'budget': expected bytes from 1 to 2^64 - 1, got {budget!r}",
                                  "budget", "bytes from 1 to 2^64 - 1", repr(budget), "e.g. 20 << 30")
        if (not isinstance(thresholds, (tuple, list)) or len(thresholds) != 3
                or not all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in thresholds)):
            raise InvalidArgument(f"membound: invalid argument 'thresholds': expected (warning, critical, emergency) "
                                  f"fractions, got {thresholds!r}", "thresholds", "(warning, critical, emergency)",
                                  repr(thresholds), "e.g. thresholds=(0.92, 0.95, 0.97)")
        if self._lib.membound_alloc_configure(budget, *map(float, thresholds)) != 0:
            raise _typed_error(self.last_error())

    def on_pressure(self, callback: Optional[Callable[[PressureEvent], None]]) -> None:
        """Calls callback(PressureEvent) on every change of level, from the allocating thread,
        outside the service's lock (with several threads, in the order they deliver). An exception
        in it is printed and dropped (ctypes)."""
        if callback is None:
            thunk = CALLBACK()
        else:
            def call(device: int, previous: int, level: int, usage: int, limit: int) -> None:
                callback(PressureEvent(device, LEVELS[previous], LEVELS[level], usage, limit))
            thunk = CALLBACK(call)
        self._callbacks.append(thunk)  # kept before the library sees it, never dropped
        self._lib.membound_alloc_set_callback(thunk)

    def malloc(self, size: int, device: int = 0, stream: int = 0) -> int:
        """An address, or 0 when the budget refuses (last_refusal() then says why)."""
        return self._lib.membound_alloc_try_malloc(size, device, stream) or 0

    def free(self, address: int, size: int, device: int = 0, stream: int = 0) -> None:
        self._lib.membound_alloc_free(address, size, device, stream)

    def record_stream(self, address: int, stream: int, device: int = 0) -> None:
        if self._lib.membound_alloc_record_stream(address, device, stream) != 0:
            raise _typed_error(self.last_error())

    def empty_cache(self) -> None:
        """Gives every device's free cached segments back (to cudaFree, or the heap)."""
        self._lib.membound_alloc_empty_cache()

    def set_others(self, device: int, size: int) -> None:
        """Bytes others hold on the device (on a GPU the service measures them itself)."""
        self._lib.membound_alloc_set_others(device, size)

    def stats(self, device: int = 0) -> dict[str, object]:
        """The device's figures in bytes (and counts): requested, reserved and their peaks, limit,
        external (others' bytes on the device), allocations, refusals, cached, level, bad_frees
        (frees that matched no live block, on any device)."""
        out = (ctypes.c_uint64 * len(_STATS))()
        if self._lib.membound_alloc_stats(device, out) != 0:
            return {}
        s: dict[str, object] = dict(zip(_STATS, out))
        s["level"] = LEVELS[out[_STATS.index("level")]]
        return s

    def record_history(self, max_entries: int) -> None:
        """Keeps the last max_entries allocator events of every device (0: stops, forgets them)."""
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or not 0 <= max_entries < 1 << 63:
            raise InvalidArgument(f"membound: invalid argument 'max_entries': expected a count from 0, got {max_entries!r}",
                                  "max_entries", "a count from 0", repr(max_entries), "e.g. max_entries=100000")
        self._lib.membound_alloc_record_history(max_entries)

    def snapshot(self) -> dict[str, object]:
        """The segments, their blocks and the recorded events, in torch.cuda.memory._snapshot()'s
        layout (PyTorch's memory viewer reads it pickled)."""
        text = self._lib.membound_alloc_snapshot().decode()
        if not text:
            raise RuntimeError(f"membound: no snapshot: {self.last_error()}")
        snap: dict[str, object] = json.loads(text)
        for seg in snap["segments"]:  # type: ignore[union-attr]
            seg["segment_pool_id"] = tuple(seg["segment_pool_id"])
        return snap

    def last_refusal(self) -> str:
        """membound's out-of-memory report for the last refused request: every field."""
        return self._lib.membound_alloc_last_refusal().decode()

    def last_error(self) -> str:
        return self._lib.membound_alloc_last_error().decode()


@atexit.register
def _quiet_at_exit() -> None:
    # The libraries outlive the interpreter (a framework may free during its own teardown): no
    # Python callback may run after this point.
    for service in Service._loaded.values():
        service._lib.membound_alloc_set_callback(service._callbacks[0])
