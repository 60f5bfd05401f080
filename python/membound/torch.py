"""membound's budgeted allocator for PyTorch.

    import membound.torch
    membound.torch.use_allocator(budget="20GiB", thresholds=(0.92, 0.95, 0.97),
                                 on_pressure=lambda e: print(e.level, e.usage, e.limit))
    # ... then the training program, unchanged

Every CUDA tensor PyTorch allocates then comes from membound's stream-ordered caching allocator
under a hard budget per device (the bytes other processes hold on the device counted too), and
each change of pressure level reaches `on_pressure`: what training programs write by hand as
"spike mode" and "emergency cleanup". A request past the budget raises a RuntimeError carrying
membound's out-of-memory report (PyTorch takes the hook's exception as the error; it would not
check a null pointer); membound.torch.last_refusal() holds the report too. record_history() and
dump_snapshot(path) write the allocator's segments and events in PyTorch's memory-snapshot layout
(torch.cuda.memory._dump_snapshot's pickle), for https://pytorch.org/memory_viz.

Limits, as PyTorch's CUDAPluggableAllocator defines them (read in its source, not yet run here):
it must be installed before the first CUDA allocation of the process; its Python constructor takes
malloc and free only, so Tensor.record_stream does not reach the allocator (a tensor used on a
second stream must be synchronized by the program before it is freed) and
torch.cuda.empty_cache() does not either (call membound.torch.empty_cache()).
This module has not run on a GPU yet.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from . import parse_size
from ._errors import invalid
from ._service import LEVELS, PressureEvent, Service, library_path

__all__ = ["use_allocator", "stats", "empty_cache", "last_refusal", "record_history", "snapshot", "dump_snapshot",
           "PressureEvent", "LEVELS"]

_service: Optional[Service] = None


def use_allocator(budget: object, *, thresholds: Sequence[float] = (0.92, 0.95, 0.97),
                  on_pressure: Optional[Callable[[PressureEvent], None]] = None) -> None:
    """Makes membound's budgeted allocator PyTorch's CUDA allocator for this process."""
    global _service
    import torch  # only here: the package needs no PyTorch for its planner

    if _service is not None:
        raise invalid("use_allocator", "one call per process", "a second call",
                      "PyTorch cannot swap an allocator it has used; configure once")
    if not torch.cuda.is_available():
        raise invalid("device", "a CUDA device (the allocator serves cudaMalloc)", "none",
                      "Run on a machine with a GPU, or plan without one: membound.fit")
    service = Service("cuda")
    service.configure(parse_size(budget, "budget"), tuple(thresholds))  # type: ignore[arg-type]
    service.on_pressure(on_pressure)
    allocator = torch.cuda.memory.CUDAPluggableAllocator(library_path("cuda"), "membound_alloc_malloc",
                                                         "membound_alloc_free")
    torch.cuda.memory.change_current_allocator(allocator)
    _service = service


def _active() -> Service:
    if _service is None:
        raise invalid("use_allocator", "a call to membound.torch.use_allocator first", "none", "Call it at start-up")
    return _service


def stats(device: int = 0) -> dict[str, object]:
    """The device's figures: requested and reserved bytes and their peaks, the limit, others' bytes,
    allocations, refusals, cached bytes and the pressure level."""
    return _active().stats(device)


def empty_cache() -> None:
    """Gives the cached free segments of every device back to cudaFree."""
    _active().empty_cache()


def last_refusal() -> str:
    """membound's out-of-memory report for the last request the budget refused."""
    return _active().last_refusal()


def record_history(max_entries: int = 100_000) -> None:
    """Keeps the last max_entries allocations, frees, segment changes and refusals of every device,
    as torch.cuda.memory._record_memory_history(max_entries=...) does (0 stops)."""
    _active().record_history(max_entries)


def snapshot() -> dict[str, object]:
    """The allocator's state in torch.cuda.memory._snapshot()'s layout: segments with their live
    and free blocks, and the recorded history per device (no stack frames)."""
    return _active().snapshot()


def dump_snapshot(path: str) -> None:
    """snapshot() pickled, as torch.cuda.memory._dump_snapshot writes it: drop the file on
    https://pytorch.org/memory_viz, or render it with torch.cuda._memory_viz.trace_plot."""
    import pickle

    with open(path, "wb") as f:
        pickle.dump(snapshot(), f)
