"""On a GPU with PyTorch: membound.torch.use_allocator under a real training loop. Not run by ctest
(CI has no GPU or PyTorch); run on the GPU machine with the package importable:

    PYTHONPATH=<build>/python python3 tests/python/gpu_torch_allocator.py [OUT_DIR]

Checks, and writes torch_allocator.json to OUT_DIR: a small model trains 50 steps with every
tensor from the budget (the allocator's peak reserve under it); another process taking memory on
the device raises the pressure level through the callback at the next growth; a request past
the budget raises a RuntimeError carrying membound's report; empty_cache gives the
cache back. It has not run yet (2026-11-29: no GPU lent).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import membound.torch as mt

GiB = 1 << 30


def main() -> int:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    events = []
    budget = 4 * GiB
    mt.use_allocator(budget, thresholds=(0.5, 0.7, 0.9), on_pressure=events.append)
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4096, 8192), torch.nn.GELU(), torch.nn.Linear(8192, 4096)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(50):
        x = torch.randn(256, 4096, device="cuda")
        loss = model(x).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    trained = mt.stats()
    result = {"trained": trained, "events_training": [e.__dict__ for e in events]}
    assert trained["peak_reserved"] <= budget, trained

    # Another process holds 2 GiB on the device; our next growth measures it.
    holder = subprocess.Popen([sys.executable, "-c", "import torch, time; x = torch.empty(2 << 30, dtype=torch.uint8, "
                               "device='cuda'); print('held', flush=True); time.sleep(30)"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    before = len(events)
    big = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    result["events_other_process"] = [e.__dict__ for e in events[before:]]
    result["after_other_process"] = mt.stats()
    holder.kill()

    try:
        torch.empty(budget, dtype=torch.uint8, device="cuda")
        result["refused"] = False
    except RuntimeError as e:  # the hook's exception: membound's report as the message
        result["refused"] = "out of memory" in str(e)
        result["refusal_type"] = type(e).__name__
    result["last_refusal"] = mt.last_refusal()
    del big
    mt.empty_cache()
    result["after_empty_cache"] = mt.stats()
    ok = (result["refused"] and "out of memory" in result["last_refusal"]
          and len(result["events_other_process"]) > 0)
    result["ok"] = ok
    with open(os.path.join(out_dir, "torch_allocator.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(json.dumps(result, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    start = time.time()
    code = main()
    print(f"{time.time() - start:.1f} s")
    sys.exit(code)
