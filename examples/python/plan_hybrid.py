"""Plan a 1.3B-parameter hybrid (TTT-Linear, attention, Mamba, attention, six times; width 2048,
vocabulary 32,000) for 8 sequences of 4,096 tokens in bf16, at several budgets: what each budget
buys (micro-batch, gradient accumulation, recompute schedule) and what it leaves, before anything
is allocated. Then the same step over 8 MPI ranks (one sequence each) at the smallest budget,
under ZeRO-1, 2 and 3: what sharding the optimizer state, the gradients and the weights leaves
each rank. The sizes are membound's CPU backend's (device plans come with the package's CUDA
build, not there yet).

    pip install .   # from the repository root
    python3 examples/python/plan_hybrid.py [BUDGET ...]     # default: 16GiB 24GiB 40GiB 80GiB
"""

from __future__ import annotations

import sys

import membound


def main(budgets: list[str]) -> int:
    model = membound.Model(layers=["ttt", "attn", "mamba", "attn"] * 6, width=2048, heads=16, vocab=32000)
    print(f"{len(model.layers)} blocks, width {model.width}, bf16, 8 x 4096 tokens per step")
    print(f"{'budget':>8} {'micro':>6} {'accum':>6} {'schedule':>22} {'peak':>10} {'recompute':>10}")
    for budget in budgets:
        try:
            p = membound.fit(model, batch=8, seq=4096, budget=budget, precision="bf16", threads=16)
        except membound.BudgetTooSmall as e:
            print(f"{budget:>8}  does not fit: at least {e.minimum / 2**30:.2f} GiB")
            continue
        peak = max(p.peak_bytes, p.reserved_peak) / 2**30
        recompute = p.recompute_flops / p.forward_flops if p.forward_flops else 0.0
        print(f"{budget:>8} {p.micro_batch:>6} {p.accumulation:>6} {p.schedule:>22} {peak:>7.2f} GiB {recompute:>9.0%}")
    print(f"{model_parameters(model):,} parameters")
    budget = budgets[0]
    print(f"\nover 8 ranks, one sequence each, {budget} per rank (rank 0's plan):")
    print(f"{'ZeRO':>8} {'weights':>10} {'gathered':>10} {'grads':>10} {'optimizer':>10} {'peak':>10} {'recompute':>10}")
    for zero in (1, 2, 3):
        try:
            p = membound.fit(model, batch=8, seq=4096, budget=budget, precision="bf16", threads=16, ranks=8,
                             zero=zero)
        except membound.BudgetTooSmall as e:
            print(f"{zero:>8}  does not fit: at least {e.minimum / 2**30:.2f} GiB")
            continue
        gib = [x / 2**30 for x in (p.weights, p.weight_gather, p.gradients, p.optimizer,
                                   max(p.peak_bytes, p.reserved_peak))]
        recompute = p.recompute_flops / p.forward_flops if p.forward_flops else 0.0
        print(f"{zero:>8} " + " ".join(f"{g:>6.2f} GiB" for g in gib) + f" {recompute:>9.0%}")
    return 0


def model_parameters(model: membound.Model) -> int:
    return membound.plan(model, batch=1, seq=1, precision="bf16").parameters


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:] or ["16GiB", "24GiB", "40GiB", "80GiB"]))
    except membound.InvalidArgument as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
