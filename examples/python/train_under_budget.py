"""Training in PyTorch under a hard byte budget on the GPU, the pressure levels acted on: the first
seed program's case (a TTT fine-tuning run dying at 99.9% of the card), written with membound.

    python3 examples/python/train_under_budget.py [--budget 2GiB] [--steps 60] [--spike 768MiB@20:40]

membound.torch.use_allocator makes membound's budgeted caching allocator PyTorch's CUDA allocator:
every tensor comes from the budget (what others hold on the device counted too), a request past it
raises a RuntimeError with membound's report instead of taking the card, and each change of
pressure level (warning 92%, critical 95%, emergency 97% of the budget) reaches on_pressure. The
loop answers the levels as the seed programs did by hand ("spike mode", "emergency cleanup"), from
the allocator's own figures instead of guessed thresholds:
- a rise to critical or above: the micro-batch halves once (gradient accumulation keeps the step's
  batch, so the run computes the same thing) and the allocator's cached free blocks go back, so
  the level is measured again on the smaller reserve;
- emergency: the cache goes back at every step it lasts;
- a refused request: the step is retried at half the micro-batch, never lost;
- five steps back at normal: the micro-batch doubles again.
The model is train_ttt.py's: TTT-Linear layers as membound's torch ops (membound.nn) on CUDA
tensors. --spike SIZE@A:B holds SIZE of device memory from step A to B through the same allocator
(as an evaluation's buffers or a cache would), so the levels move within one run.

Needs a GPU with PyTorch (the allocator serves cudaMalloc); without one it says so and exits 2.
Never run on a GPU yet: tools/gpu_session.sh --steps torch_ops runs it.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch
from torch import nn

import membound
import membound.torch as mt

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from train_ttt import DATA, CharModel  # noqa: E402

LEVELS = ("normal", "warning", "critical", "emergency")


def parse_spike(text: str) -> tuple[int, int, int]:
    try:
        size, steps = text.split("@")
        a, b = (int(s) for s in steps.split(":"))
        nbytes = membound.parse_size(size, "--spike")
    except (ValueError, membound.InvalidArgument):
        raise SystemExit(f"train_under_budget.py: --spike: expected SIZE@FIRST:LAST (e.g. 768MiB@20:40), got {text!r}")
    if not 0 < a <= b:
        raise SystemExit(f"train_under_budget.py: --spike: expected 0 < FIRST <= LAST, got {a}:{b}")
    return nbytes, a, b


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--budget", default="2GiB")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=32, help="sequences per step (the micro-batch divides it)")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--spike", default="768MiB@20:40", help="SIZE@FIRST:LAST held through the allocator ('' none)")
    args = ap.parse_args()
    for flag in ("steps", "batch", "seq", "width", "heads", "blocks"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"train_under_budget.py: --{flag}: expected a whole number of at least 1, "
                             f"got {getattr(args, flag)}")
    spike = parse_spike(args.spike) if args.spike else None
    budget = membound.parse_size(args.budget, "--budget")

    level, rose, log = ["normal"], [False], []

    def on_pressure(e: mt.PressureEvent) -> None:  # from the allocating thread: record, act between steps
        level[0] = e.level
        rose[0] = rose[0] or LEVELS.index(e.level) > LEVELS.index(e.previous)
        log.append((step_now[0], e.previous, e.level, e.usage, e.limit))
        print(f"  [step {step_now[0]}] pressure {e.previous} -> {e.level}: {e.usage / 2**20:,.0f} MiB of "
              f"{e.limit / 2**20:,.0f} MiB", flush=True)

    step_now = [0]
    try:
        mt.use_allocator(budget, thresholds=(0.92, 0.95, 0.97), on_pressure=on_pressure)
    except membound.InvalidArgument as e:
        print(f"train_under_budget.py: {e}", file=sys.stderr)
        return 2

    text = pathlib.Path(args.data).read_bytes()
    data = torch.tensor(list(text), dtype=torch.long)
    torch.manual_seed(0)
    model = CharModel(256, args.width, args.heads, args.blocks).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(1)

    def run_step(rows: torch.Tensor, micro: int) -> float:
        """One step in micro-batches of `micro` rows (gradient accumulation: the same step for any
        micro). Its tensors are this call's locals, so a refused request frees them all on the way out."""
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for k in range(0, args.batch, micro):
            part = rows[k:k + micro]
            logits = model(part[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, 256), part[:, 1:].reshape(-1))
            (loss * (part.shape[0] / args.batch)).backward()
            total += loss.item() * part.shape[0] / args.batch
        opt.step()
        return total

    micro, calm, retries, held = args.batch, 0, 0, None
    first = last = None
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        step_now[0] = step
        if spike and step == spike[1]:
            try:
                held = torch.empty(spike[0], dtype=torch.uint8, device="cuda")
            except RuntimeError as e:  # the budget cannot hold it beside the training: said, not fatal
                print(f"  [step {step}] the spike was refused: {str(e).splitlines()[0][:100]}", flush=True)
        if spike and step == spike[2] + 1:
            held = None
            mt.empty_cache()  # its blocks back to the device: the level can fall again
        at = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=gen)
        rows = torch.stack([data[i:i + args.seq + 1] for i in at.tolist()]).cuda()
        while True:  # the step, retried at half the micro-batch when the budget refuses a request
            try:
                total = run_step(rows, micro)
                break
            except RuntimeError as e:
                if "out of memory" not in str(e) or micro == 1:
                    raise
                retries += 1
                micro //= 2
                opt.zero_grad(set_to_none=True)
                mt.empty_cache()
                print(f"  [step {step}] refused by the budget ({str(e).splitlines()[0][:100]}...): "
                      f"retried at micro-batch {micro}", flush=True)
        first = total if first is None else first
        last = total
        # The levels, acted on between steps: a rise to critical or above halves the micro-batch
        # once (then the cache goes back, so the level is measured again on the smaller reserve);
        # an emergency gives the cache back whatever the micro-batch; five normal steps double it.
        high = LEVELS.index(level[0]) >= LEVELS.index("critical")
        if high and rose[0] and micro > 1:
            micro //= 2
            print(f"  [step {step}] {level[0]}: micro-batch {micro} from the next step", flush=True)
        if high and (rose[0] or level[0] == "emergency"):
            mt.empty_cache()
        rose[0] = False
        calm = calm + 1 if level[0] == "normal" else 0
        if calm >= 5 and micro < args.batch:
            micro, calm = micro * 2, 0
            print(f"  [step {step}] normal for 5 steps: micro-batch {micro}", flush=True)
        if step % 10 == 0 or step == args.steps:
            s = mt.stats()
            print(f"step {step:4d}  loss {total:.4f}  micro-batch {micro:3d}  {level[0]:9s}  reserved "
                  f"{s['reserved'] / 2**20:,.0f} MiB (peak {s['peak_reserved'] / 2**20:,.0f} MiB, others "
                  f"{s['external'] / 2**20:,.0f} MiB)  "
                  f"{step * args.batch * args.seq / (time.perf_counter() - start):,.0f} tokens/s", flush=True)
    del held
    s = mt.stats()
    seen = sorted({lv for _, p, lv, _, _ in log} | {p for _, p, _, _, _ in log}, key=LEVELS.index)
    # The budget held by construction (a request past it is refused); what is checked is that the
    # run got through every step and learned.
    print(f"loss {first:.4f} -> {last:.4f} over {args.steps} steps; peak reserve {s['peak_reserved'] / 2**20:,.0f} MiB "
          f"of the {budget / 2**20:,.0f} MiB budget (with others {s['external'] / 2**20:,.0f} MiB); "
          f"{len(log)} level changes ({', '.join(seen) or 'none'}); {retries} steps retried; "
          f"{s['refusals']} requests refused")
    return 0 if last < first else 1


if __name__ == "__main__":
    raise SystemExit(main())
