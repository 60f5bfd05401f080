"""The budgeted allocator PyTorch is given (membound.torch.use_allocator), tested through the same C
hooks on its host build: the budget refuses what would pass it and reports why, blocks are pooled
per stream, pressure levels reach the callback up and down (others' bytes included), the cache is
given back, bad configurations are refused by name, and threads allocating at once leave the
books balanced. The CUDA build is the same template over cudaMalloc (compiled in CI; not run on a
GPU yet).
"""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys
import threading

import pytest

import membound
from membound._service import Service

MiB = 1 << 20


@pytest.fixture()
def service():
    s = Service("host")
    s.on_pressure(None)
    s.configure(100 * MiB, (0.90, 0.95, 0.97))  # a fresh stack per test: nothing is live between tests
    yield s
    s.on_pressure(None)
    assert s.stats(0).get("requested", 0) == 0, "a test left blocks live"


def test_unconfigured_service_refuses_and_says_why():
    code = ("from membound._service import Service; s = Service('host'); "
            "assert s.malloc(1024) == 0; print(s.last_error())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "invalid argument 'budget'" in out and "use_allocator" in out


def test_budget_refuses_and_reports(service):
    a = service.malloc(60 * MiB)
    assert a != 0
    assert service.malloc(50 * MiB) == 0  # 60 + 50 > 100 MiB
    report = service.last_refusal()
    assert "out of memory" in report and "budget" in report
    s = service.stats()
    assert s["refusals"] == 1 and s["requested"] == 60 * MiB and s["limit"] == 100 * MiB
    b = service.malloc(30 * MiB)  # what fits still does
    assert b != 0
    service.free(b, 30 * MiB)
    service.free(a, 60 * MiB)


def test_blocks_are_pooled_per_stream(service):
    a = service.malloc(4 * MiB, stream=1)
    service.free(a, 4 * MiB, stream=1)
    other = service.malloc(4 * MiB, stream=2)
    assert other not in (0, a)  # another stream: other memory, while stream 1's work may still use a
    again = service.malloc(4 * MiB, stream=1)
    assert again == a  # its own stream: the same block at once
    service.record_stream(again, stream=2)  # used on stream 2 too: accepted (host: nothing to wait for)
    service.free(again, 4 * MiB, stream=1)
    service.free(other, 4 * MiB, stream=2)
    assert service.stats()["requested"] == 0


def test_pressure_levels_reach_the_callback_up_and_down(service):
    events = []
    service.on_pressure(events.append)
    a = service.malloc(80 * MiB)  # 80%: normal
    assert events == []
    b = service.malloc(12 * MiB)  # 92% reserved: warning
    assert [(e.previous, e.level) for e in events] == [("normal", "warning")]
    service.set_others(0, 4 * MiB)  # another process takes 4 MiB: 96%, critical
    assert events[-1].level == "critical" and events[-1].usage == 96 * MiB and events[-1].limit == 100 * MiB
    service.set_others(0, 6 * MiB)  # 98%: emergency
    assert events[-1].level == "emergency"
    service.free(b, 12 * MiB)  # cached, still reserved: no change
    assert events[-1].level == "emergency"
    service.empty_cache()  # 80 + 6 = 86%: normal again
    assert [(e.previous, e.level) for e in events][-1] == ("emergency", "normal")
    assert service.stats()["level"] == "normal"
    service.free(a, 80 * MiB)
    service.set_others(0, 0)


def test_empty_cache_gives_segments_back(service):
    a = service.malloc(30 * MiB)
    service.free(a, 30 * MiB)
    assert service.stats()["reserved"] == 30 * MiB and service.stats()["cached"] == 30 * MiB
    service.empty_cache()
    assert service.stats()["reserved"] == 0


def test_bad_configuration_is_named_and_changes_nothing(service):
    with pytest.raises(membound.InvalidArgument) as e:
        service.configure(0)
    assert e.value.argument == "budget"
    with pytest.raises(membound.InvalidArgument) as e:
        service.configure(100 * MiB, (0.95, 0.90, 0.97))
    assert e.value.argument == "warning"
    with pytest.raises(membound.InvalidArgument) as e:
        service.configure(100 * MiB, (0.9, 0.95, 1.5))
    assert e.value.argument == "emergency"
    for bad in (-1, 1 << 64, 2.5, True):  # ctypes would wrap these silently
        with pytest.raises(membound.InvalidArgument) as e:
            service.configure(bad)
        assert e.value.argument == "budget"
    with pytest.raises(membound.InvalidArgument) as e:
        service.configure(100 * MiB, (0.9, "0.95", 0.97))
    assert e.value.argument == "thresholds"
    a = service.malloc(MiB)
    with pytest.raises(membound.InvalidArgument) as e:  # blocks live: the budget stays
        service.configure(200 * MiB)
    assert service.stats()["limit"] == 100 * MiB
    service.free(a, MiB)


def test_threads_allocating_at_once_balance(service):
    errors = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        live = []
        try:
            for _ in range(500):
                if live and rng.random() < 0.5:
                    addr, size, stream = live.pop(rng.randrange(len(live)))
                    service.free(addr, size, stream=stream)
                else:
                    size, stream = rng.choice([512, 4096, 100_000, MiB, 3 * MiB]), rng.randrange(3)
                    addr = service.malloc(size, stream=stream)
                    if addr:
                        live.append((addr, size, stream))
            for addr, size, stream in live:
                service.free(addr, size, stream=stream)
        except Exception as x:  # pragma: no cover - reported below
            errors.append(x)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    s = service.stats()
    assert s["requested"] == 0 and s["allocations"] == s["deallocations"]
    assert s["peak_reserved"] <= 100 * MiB


def test_torch_module_needs_use_allocator_first():
    import membound.torch as mt
    with pytest.raises(membound.InvalidArgument) as e:
        mt.stats()
    assert e.value.argument == "use_allocator"


def test_others_past_the_headroom_leave_none(service):
    # Others take more than is left: the budget counts as much as leaves no headroom, so nothing
    # more is granted while they hold it (ours 60 + theirs 50 > 100 MiB).
    a = service.malloc(60 * MiB)
    service.set_others(0, 50 * MiB)
    assert service.stats()["external"] == 50 * MiB and service.stats()["level"] == "emergency"
    assert service.malloc(30 * MiB) == 0
    assert service.malloc(MiB) == 0
    service.set_others(0, 10 * MiB)  # they give most of it back: room again
    b = service.malloc(20 * MiB)
    assert b != 0
    service.free(b, 20 * MiB)
    service.free(a, 60 * MiB)
    service.set_others(0, 0)


def test_a_wrong_free_changes_nothing_and_is_counted(service):
    a = service.malloc(MiB)
    before = service.stats()["bad_frees"]
    service.free(a, 2 * MiB)  # another size
    service.free(a, MiB, device=3)  # another device: no stack is made for it
    assert service.stats()["bad_frees"] == before + 2
    assert service.stats(3) == {}
    assert service.stats()["requested"] == MiB
    assert "invalid argument" in service.last_error()
    service.free(a, MiB)


def test_swapping_the_callback_while_threads_allocate():
    # A thread may be delivering through the previous callback while it is replaced.
    s = Service("host")
    s.configure(64 * MiB, (0.1, 0.2, 0.3))
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            a = s.malloc(8 * MiB)
            if a:
                s.free(a, 8 * MiB)
            s.empty_cache()

    threads = [threading.Thread(target=churn) for _ in range(3)]
    for t in threads:
        t.start()
    seen = []
    for k in range(300):
        s.on_pressure(seen.append if k % 2 else None)
    stop.set()
    for t in threads:
        t.join()
    s.on_pressure(None)
    assert s.stats()["requested"] == 0


def test_snapshot_is_pytorchs_layout_and_its_tools_read_it(service):
    service.record_history(1000)
    live_blocks = []
    try:
        a = service.malloc(3 * MiB, 0, 1)
        b = service.malloc(5000, 0, 1)
        c = service.malloc(7 * MiB, 0, 2)
        live_blocks += [(a, 3 * MiB, 1), (c, 7 * MiB, 2)]
        service.free(b, 5000, 0, 1)
        assert service.malloc(200 * MiB) == 0  # refused: an oom event
        snap = service.snapshot()
        events = snap["device_traces"][0]
        actions = [e["action"] for e in events]
        assert actions.count("alloc") == 3 and actions.count("oom") == 1 and actions.count("segment_alloc") >= 2
        assert actions[actions.index("free_requested") + 1] == "free_completed"
        oom = events[actions.index("oom")]
        assert oom["size"] == 200 * MiB and 0 < oom["device_free"] <= 100 * MiB
        live = {blk["address"]: blk["size"] for seg in snap["segments"] for blk in seg["blocks"]
                if blk["state"] == "active_allocated"}
        assert live == {a: 3 * MiB, c: 7 * MiB}
        for seg in snap["segments"]:  # the blocks tile each segment
            assert sum(blk["size"] for blk in seg["blocks"]) == seg["total_size"]
            assert seg["allocated_size"] == sum(live.get(blk["address"], 0) for blk in seg["blocks"])
        assert sum(seg["total_size"] for seg in snap["segments"]) == service.stats()["reserved"]
        # PyTorch's own readers of a snapshot (torch.cuda._memory_viz) take it as they take theirs.
        if os.environ.get("CI") or importlib.util.find_spec("torch"):
            import io

            from torch.cuda import _memory_viz

            text = _memory_viz.trace(snap)
            assert "cudaMalloc" in text and "raise OutOfMemoryError" in text and "del " in text
            for seg in snap["segments"]:
                _memory_viz._write_blocks(io.StringIO(), "p", seg["blocks"])
            assert "snapshot.pickle" in _memory_viz.trace_plot(snap)
        for address, size, stream in live_blocks:
            service.free(address, size, 0, stream)
        live_blocks.clear()
        service.empty_cache()
        after = service.snapshot()
        assert after["segments"] == [] and after["device_traces"][0][-1]["action"] == "segment_free"
        service.record_history(0)
        assert service.snapshot()["device_traces"] == [[]]
    finally:
        for address, size, stream in live_blocks:  # a failed assertion above leaves the fixture clean
            service.free(address, size, 0, stream)
        service.record_history(0)
