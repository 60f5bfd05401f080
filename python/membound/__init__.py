"""membound: the exact peak memory of a training step, before step 1, and the plan that fits a budget.

    import membound
    model = membound.Model(layers=["ttt", "attn", "mamba", "attn"], width=768, heads=12)
    plan = membound.fit(model, batch=8, seq=2048, budget="24GiB", precision="bf16")
    print(plan)                     # the table the C++ planner prints, byte for byte
    plan.micro_batch, plan.accumulation, plan.schedule, plan.reserved_peak

The planner is membound's C++ planner (membound._core); this module checks arguments and names
what is wrong in a typed error (InvalidArgument, BudgetTooSmall) before anything is computed.
membound.torch has the budgeted allocator for PyTorch (use_allocator).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Optional, Sequence, Union

from . import _core
from ._errors import BudgetTooSmall, InvalidArgument, OutOfMemory, invalid

__all__ = ["Model", "Plan", "plan", "fit", "fit_tokens", "parse_size", "InvalidArgument", "BudgetTooSmall",
           "OutOfMemory", "__version__"]

__version__: str = _core.version()

# The library's block names, and the example trainer's short --layers spellings of some of them.
LAYER_NAMES = ("ttt_linear", "ttt_mlp", "attention", "mamba", "local_attention", "attention_moe")
LAYER_SHORT = {"ttt": "ttt_linear", "attn": "attention", "swa": "local_attention", "attn_moe": "attention_moe"}
PRECISIONS = ("fp32", "bf16", "fp16")
ALLOCATORS = ("arena", "caching", "none")
DEVICES = ("cpu", "cuda")
OPTIMIZERS = ("adamw", "adamw8bit", "none")
OFFLOADS = ("none", "auto", "optimizer", "activations", "all")

Size = Union[int, str]

_UNITS = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40,
          "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE = re.compile(r"(\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)?", re.ASCII)


def parse_size(value: Size, argument: str = "size") -> int:
    """Bytes from an int or a string such as "24GiB", "512MiB", "1.5GB" (the C++ flags' grammar).

    Exact: the result must be a whole number of bytes from 1 to 2**64 - 1 ("0.5KiB" is 512,
    "1.3KiB" is refused); no sign, space or hex.
    """
    expected = ("a size: a positive int, or a number and at once an optional unit among "
                "B, KiB, MiB, GiB, TiB, KB, MB, GB, TB")
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise invalid(argument, expected, value, 'e.g. budget="24GiB"')
    if isinstance(value, int):
        exact = Fraction(value)
    else:
        m = _SIZE.fullmatch(value)
        if m is None:
            raise invalid(argument, expected, value, 'e.g. budget="24GiB"')
        try:
            number = Decimal(m.group(1))
        except InvalidOperation:  # pragma: no cover - the pattern admits only decimals
            raise invalid(argument, expected, value, 'e.g. budget="24GiB"') from None
        # Far outside 1 .. 2^64 whatever the digits: refused before 10**exponent is ever built.
        if number and number.adjusted() > 40:
            raise invalid(argument, "at most 2^64 - 1 bytes (16 EiB)", value, 'e.g. budget="24GiB"')
        if number and number.adjusted() < -40:
            raise invalid(argument, "a whole number of bytes", value, 'e.g. budget="24GiB"')
        exact = Fraction(number) * _UNITS[m.group(2) or ""]
    if exact.denominator != 1:
        raise invalid(argument, "a whole number of bytes", value, 'e.g. budget="24GiB"')
    if exact < 1:
        raise invalid(argument, "a positive size, at least 1 byte", value, 'e.g. budget="24GiB"')
    if exact >= 1 << 64:
        raise invalid(argument, "at most 2^64 - 1 bytes (16 EiB)", value, 'e.g. budget="24GiB"')
    return int(exact)


def _whole(argument: str, value: object, low: int, high: int, example: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise invalid(argument, f"a whole number from {low} to {high}", value, f"e.g. {example}")
    return value


def _one_of(argument: str, value: object, words: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in words:
        raise invalid(argument, "one of " + ", ".join(words), value, f'e.g. {argument}="{words[0]}"')
    return value


@dataclass(frozen=True)
class Model:
    """A hybrid language model as the example trainer builds it: an embedding, blocks of TTT-Linear
    ("ttt_linear" or "ttt"), TTT-MLP ("ttt_mlp"), attention ("attention" or "attn"), sliding-window
    attention ("local_attention" or "swa": each token sees itself and the window - 1 before it)
    and Mamba ("mamba"), each followed by a SwiGLU MLP, or attention followed by a mixture of
    SwiGLU experts ("attention_moe" or "attn_moe"), and a tied LM head. width divides by heads;
    kv_heads 0 means heads (no GQA); mlp_hidden 0 means 8/3 of width rounded up to a multiple of
    8; window is the local layers' (required with them, refused without). The mixture's experts
    (2 to 256, each a SwiGLU of mlp_hidden), top_k (1 or 2), capacity (slots per expert
    floor(capacity * tokens * top_k / experts); 0: no limit) and aux (the balancing loss's weight)
    are the example trainer's --experts, --top-k, --capacity and --aux."""

    layers: Sequence[str]
    width: int
    heads: int
    vocab: int = 256
    kv_heads: int = 0
    mlp_hidden: int = 0
    window: int = 0
    experts: int = 8
    top_k: int = 2
    capacity: float = 1.25
    aux: float = 0.01

    def __post_init__(self) -> None:
        if isinstance(self.layers, str) or not isinstance(self.layers, Sequence) or len(self.layers) == 0:
            raise invalid("layers", "a non-empty list of block names among " + ", ".join(LAYER_NAMES),
                          self.layers, 'e.g. layers=["ttt", "attn", "mamba", "attn"]')
        for name in self.layers:
            _one_of("layers", name, LAYER_NAMES + tuple(LAYER_SHORT))
        if len(self.layers) > 1024:
            raise invalid("layers", "at most 1024 blocks", len(self.layers), "Plan a deeper model in parts")
        object.__setattr__(self, "layers", tuple(self.layers))
        _whole("width", self.width, 1, 1 << 16, "width=768")
        _whole("heads", self.heads, 1, min(self.width, 1024), "heads=12")
        if self.width % self.heads != 0:
            raise invalid("heads", f"a divisor of width {self.width}", self.heads, "e.g. heads=12 with width=768")
        _whole("vocab", self.vocab, 1, 1 << 22, "vocab=256")
        _whole("kv_heads", self.kv_heads, 0, self.heads, "kv_heads=0 (as many as heads)")
        if self.kv_heads != 0 and self.heads % self.kv_heads != 0:
            raise invalid("kv_heads", f"a divisor of heads {self.heads}", self.kv_heads, "e.g. kv_heads=4 with heads=12")
        _whole("mlp_hidden", self.mlp_hidden, 0, 1 << 18, "mlp_hidden=0 (8/3 of width)")
        local = any(LAYER_SHORT.get(n, n) == "local_attention" for n in self.layers)
        if local:
            _whole("window", self.window, 1, 1 << 20, "window=4096")
        elif self.window != 0:
            raise invalid("window", "0 without local_attention (swa) layers", self.window,
                          'Add "swa" layers, or leave window out')
        _whole("experts", self.experts, 2, 256, "experts=8")
        _whole("top_k", self.top_k, 1, 2, "top_k=2")
        for name, value, high in (("capacity", self.capacity, 1e6), ("aux", self.aux, 1e3)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= high:
                raise invalid(name, f"a number from 0 to {high:g}", value, f"e.g. {name}={getattr(Model, name)}")
        head_dim = self.width // self.heads
        if any(LAYER_SHORT.get(n, n) in ("attention", "local_attention", "attention_moe") for n in self.layers) and (
                head_dim % 8 or head_dim > 256):
            raise invalid("heads", f"a head dimension (width / heads) that is a multiple of 8 up to 256 for "
                          f"attention; width {self.width} / heads {self.heads} is {head_dim}", self.heads,
                          "e.g. heads=16 with width=2048 (head dimension 128)")


@dataclass(frozen=True)
class Plan:
    """A training step's plan: its micro-batch, schedule, and every byte of its peak.

    Sizes are in bytes. reserved_peak is what the allocator stack holds at the peak (0 when the
    plan was made without one, allocator="none"); str(plan) is the C++ planner's table.
    """

    micro_batch: int
    seq: int
    sequences: int
    accumulation: int
    schedule: str
    head_chunk: int
    threads: int
    weights: int
    gradients: int
    weight_gather: int
    optimizer: int
    optimizer_policy: str
    offload_optimizer: bool
    host_optimizer: int
    host_staging: int
    offload_bucket: int
    host_activations: int
    offloaded_bytes: int
    host_peak: int
    host_budget: int
    activations: int
    workspace: int
    peak_bytes: int
    reserved_peak: int
    peak_phase: str
    budget: int
    fits: bool
    forward_flops: float
    recompute_flops: float
    parameters: int
    table: str = field(repr=False)
    model_line: str = field(repr=False)

    def __str__(self) -> str:
        return self.table

    @property
    def parts(self) -> dict[str, int]:
        """The peak's persistent and transient parts, in bytes, as the table lists them."""
        return {"weights": self.weights, "gradients": self.gradients, "optimizer": self.optimizer,
                "activations": self.activations, "workspace": self.workspace}


def _request(model: Model, batch: int, seq: int, budget: Optional[Size], precision: str,
             allocator: Optional[str], optimizer: str, threads: int, sequences: int = 0,
             offload: str = "none", host_budget: Optional[Size] = None, ranks: int = 1, rank: int = 0,
             zero: int = 0, overlap: bool = False, device: str = "cpu") -> _core.Request:
    if not isinstance(model, Model):
        raise invalid("model", "a membound.Model", model, 'e.g. membound.Model(layers=["ttt", "attn"], width=256, heads=4)')
    r = _core.Request()
    r.layers = [LAYER_SHORT.get(name, name) for name in model.layers]
    r.width, r.heads, r.vocab = model.width, model.heads, model.vocab
    r.kv_heads, r.mlp_hidden, r.window = model.kv_heads, model.mlp_hidden, model.window
    r.experts, r.top_k, r.capacity, r.aux = model.experts, model.top_k, float(model.capacity), float(model.aux)
    r.batch = _whole("batch", batch, 1, 1 << 16, "batch=8")
    r.seq = _whole("seq", seq, 1, 1 << 20, "seq=2048")
    r.sequences = _whole("sequences", sequences, 0, 1 << 20, "sequences=16")
    r.budget = 0 if budget is None else parse_size(budget, "budget")
    r.precision = _one_of("precision", precision, PRECISIONS)
    if allocator is None:  # the trainer's stack under a budget; requested bytes without one
        allocator = "arena" if r.budget != 0 else "none"
    r.allocator = _one_of("allocator", allocator, ALLOCATORS)
    r.optimizer = _one_of("optimizer", optimizer, OPTIMIZERS)
    r.threads = _whole("threads", threads, 1, 1024, "threads=8")
    r.offload = _one_of("offload", offload, OFFLOADS)
    if r.offload in ("auto", "optimizer", "all") and r.optimizer == "none":
        raise invalid("offload", 'none with optimizer="none" (there is no state to offload)', offload,
                      'e.g. optimizer="adamw", offload="auto"')
    if host_budget is not None:
        if r.offload == "none":
            raise invalid("host_budget", 'only with offload="auto", "optimizer", "activations" or "all"', host_budget,
                          'e.g. offload="auto", host_budget="64GiB"')
        r.host_budget = parse_size(host_budget, "host_budget")
    if r.allocator != "none" and r.budget == 0:
        raise invalid("budget", f"a size with allocator={allocator!r} (its reserve is planned under a budget)",
                      budget, 'e.g. budget="24GiB", or allocator="none"')
    r.ranks = _whole("ranks", ranks, 1, 1 << 20, "ranks=4 (MPI ranks, each taking batch / ranks sequences)")
    r.rank = _whole("rank", rank, 0, r.ranks - 1, f"rank=0 (below ranks={r.ranks})")
    r.zero = _whole("zero", zero, 0, 3, "zero=1 (the optimizer state sharded), 2 (gradients too), 3 (weights too)")
    if not isinstance(overlap, bool):
        raise invalid("overlap", "True or False", overlap, "e.g. overlap=True")
    if overlap and r.ranks == 1:
        raise invalid("overlap", "False in one process (it exchanges nothing)", overlap, "e.g. ranks=2, overlap=True")
    r.overlap = overlap
    if r.batch % r.ranks != 0:
        raise invalid("batch", f"a multiple of ranks={r.ranks} (every rank takes an equal share)", batch,
                      f"e.g. batch={r.ranks * max(1, r.batch // r.ranks)}")
    r.device = _one_of("device", device, DEVICES)
    if r.device == "cuda":
        _check_device_request(r, model)
    return r


def _check_device_request(r: _core.Request, model: Model) -> None:
    """What the GPU trainer (train --device cuda) runs, and so what a device plan may ask for."""
    if "cuda" not in _core.plans_devices():
        raise invalid("device", "cpu: this install was built without nvcc (no CUDA layers to plan)", "cuda",
                      'Plan with device="cpu", or reinstall where nvcc 12 or newer is found')
    if r.precision not in ("fp32", "bf16"):
        raise invalid("precision", 'fp32 or bf16 with device="cuda" (the GPU trainer\'s)', r.precision,
                      'e.g. precision="bf16"')
    if r.offload in ("activations", "all"):
        raise invalid("offload", 'none, auto or optimizer with device="cuda" (activation offload runs on the CPU '
                      'backend so far)', r.offload, 'e.g. offload="optimizer", or plan with device="cpu"')
    if r.ranks > 1 and r.zero >= 2:
        raise invalid("zero", '0 or 1 with device="cuda" over ranks (ZeRO-2 and 3 run on CPU ranks)', r.zero,
                      "e.g. zero=1")
    if r.overlap:
        raise invalid("overlap", 'False with device="cuda" (the overlapped exchange runs on CPU ranks)', True,
                      "e.g. overlap=False")


def _plan(r: _core.Request) -> Plan:
    p = _core.make_plan(r)
    return Plan(micro_batch=p.micro_batch, seq=p.seq, sequences=p.sequences, accumulation=p.accumulation,
                schedule=p.schedule,
                head_chunk=p.head_chunk, threads=p.threads, weights=p.weights, gradients=p.gradients,
                weight_gather=p.weight_gather,
                optimizer=p.optimizer, optimizer_policy=p.optimizer_policy,
                offload_optimizer=p.offload_optimizer, host_optimizer=p.host_optimizer,
                host_staging=p.host_staging, offload_bucket=p.offload_bucket,
                host_activations=p.host_activations, offloaded_bytes=p.offloaded_bytes, host_peak=p.host_peak,
                host_budget=p.host_budget, activations=p.activations,
                workspace=p.workspace, peak_bytes=p.peak_bytes, reserved_peak=p.reserved_peak,
                peak_phase=p.peak_phase, budget=p.budget, fits=p.fits, forward_flops=p.forward_flops,
                recompute_flops=p.recompute_flops, parameters=p.parameters, table=p.table,
                model_line=p.model_line)


def fit(model: Model, *, batch: int, seq: int, budget: Size, precision: str = "fp32",
        allocator: Optional[str] = None, optimizer: str = "adamw", threads: int = 1,
        head_chunks: Sequence[int] = (256, 64), prefer_below: Union[Size, float, None] = None,
        sequences: int = 0, offload: str = "none", host_budget: Optional[Size] = None, ranks: int = 1,
        rank: int = 0, zero: int = 0, overlap: bool = False, device: str = "cpu") -> Plan:
    """The plan with the least recompute whose peak fits `budget`: the micro-batch (dividing
    `batch`; gradient accumulation keeps the effective batch), the recompute schedule and the
    logit chunk. sequences > 0: `batch` packed rows of `seq` tokens, each holding at most that many
    variable-length sequences end to end (one row per micro-batch; the plan holds for any packing
    of them, as the example trainer's --pack). allocator: the stack whose reserve the plan counts ("arena", the default: one
    expandable range at page granularity, the example trainer's; "caching": a PyTorch-style
    caching allocator; "none": requested bytes only). device: "cpu" plans the CPU layers and host
    stacks; "cuda" the CUDA layers (cuBLASLt's workspace included) and the device stacks
    (expandable_arena over cuda_virtual_memory at 2 MiB granules, or caching_allocator over
    cudaMalloc), as `train --device cuda --plan-only 1` does, with `budget` the stack's (that run
    first counts what the CUDA context and executor hold outside the stack: about 0.5 GiB on an
    H200). No GPU is needed; threads is ignored there. prefer_below: a line under
    the budget to stay under when some plan can, a size or a fraction of the budget (0.97 is the
    example trainer's emergency line: with it, the plan is the one `train --plan-only 1` prints).
    offload: "auto" puts the optimizer's state in a host space (host_budget: its budget) when no
    plan fits the budget with it, "optimizer" always, "none" never; "activations" lets a budget
    schedule keep block inputs there instead of recomputing them, "all" both (the example
    trainer's --offload); the plan then states the host space's bytes too (host_peak,
    host_activations, offloaded_bytes per micro-batch).
    ranks > 1: the plan of rank `rank` of a data-parallel run over that many MPI ranks (the example
    trainer under mpirun), each taking batch / ranks sequences of the step, at ZeRO stage `zero`
    (1: the optimizer state sharded, 2: the gradients too, 3: the weights too, each block, the
    embedding and the head gathered around their use: weight_gather) with overlapped exchanges when `overlap` (train's --zero, --overlap);
    budget is that rank's. No MPI is needed: the exchanges' sizes are mpi_communicator's.
    Raises BudgetTooSmall (with .minimum) when no plan fits, InvalidArgument naming host_budget
    when only offloaded plans fit and none fits the host budget."""
    if budget is None:
        raise invalid("budget", "a size: fit chooses the plan that fits it", budget,
                      'e.g. budget="24GiB"; membound.plan states the peak of one schedule without a budget')
    r = _request(model, batch, seq, budget, precision, allocator, optimizer, threads, sequences, offload, host_budget,
                 ranks, rank, zero, overlap, device)
    _fit_fields(r, head_chunks, prefer_below)
    return _plan(r)


def fit_tokens(model: Model, *, max_tokens: int, sequences: int, budget: Size, batch: int = 1,
               multiple: int = 64, precision: str = "fp32", allocator: Optional[str] = None,
               optimizer: str = "adamw", threads: int = 1, head_chunks: Sequence[int] = (256, 64),
               prefer_below: Union[Size, float, None] = None, offload: str = "none",
               host_budget: Optional[Size] = None, ranks: int = 1, rank: int = 0, zero: int = 0,
               overlap: bool = False, device: str = "cpu") -> Plan:
    """The plan for the most tokens per packed row that fit `budget`: rows of N tokens (a multiple
    of `multiple`, at most max_tokens) holding at most `sequences` sequences each, N chosen under
    prefer_below when some row fits there, else under the budget; then fit's plan for `batch` such
    rows (plan.seq is N). With prefer_below=0.97 it is `train --pack S --seq max --plan-only 1`'s.
    offload, ranks, rank, zero, overlap, device: as fit's (batch is then every rank's rows together).
    Raises BudgetTooSmall when not even a row of `multiple` tokens fits."""
    if budget is None:
        raise invalid("budget", "a size: fit_tokens chooses the row that fits it", budget, 'e.g. budget="24GiB"')
    r = _request(model, batch, 1, budget, precision, allocator, optimizer, threads,
                 _whole("sequences", sequences, 1, 1 << 20, "sequences=16"), offload, host_budget, ranks, rank, zero,
                 overlap, device)
    r.max_tokens = _whole("max_tokens", max_tokens, 1, 1 << 20, "max_tokens=65536")
    r.multiple = _whole("multiple", multiple, 1, r.max_tokens, "multiple=64 (at most max_tokens)")
    _fit_fields(r, head_chunks, prefer_below)
    return _plan(r)


def _fit_fields(r: _core.Request, head_chunks: Sequence[int], prefer_below: Union[Size, float, None]) -> None:
    if isinstance(head_chunks, (str, bytes)) or not isinstance(head_chunks, Sequence) or len(head_chunks) == 0:
        raise invalid("head_chunks", "a non-empty list of logit rows per chunk", head_chunks, "e.g. head_chunks=(256, 64)")
    r.head_chunks = [_whole("head_chunks", c, 1, 1 << 24, "head_chunks=(256, 64)") for c in head_chunks]
    if isinstance(prefer_below, float):
        # A fraction of the budget, as the trainer's pressure monitor draws its emergency line:
        # the byte under ceil(fraction x budget).
        if not 0 < prefer_below < 1:
            raise invalid("prefer_below", "a fraction of the budget in (0, 1), or a size", prefer_below,
                          "e.g. prefer_below=0.97 (the trainer's emergency line)")
        at = math.ceil(prefer_below * r.budget)
        r.prefer_below = at - 1 if 1 <= at < r.budget else 0
    elif prefer_below is not None:
        r.prefer_below = parse_size(prefer_below, "prefer_below")
    r.schedule = "auto"


_SCHEDULE = re.compile(r"(none|full)|(every|binomial):(\d+)")


def plan(model: Model, *, batch: int, seq: int, schedule: str = "none", budget: Optional[Size] = None,
         precision: str = "fp32", allocator: Optional[str] = None, optimizer: str = "adamw",
         threads: int = 1, head_chunk: int = 256, sequences: int = 0, offload: str = "none",
         host_budget: Optional[Size] = None, ranks: int = 1, rank: int = 0, zero: int = 0,
         overlap: bool = False, device: str = "cpu") -> Plan:
    """The plan of one fixed schedule for the whole batch in one micro-batch: "none" (keep every
    block's activations), "full" (recompute every block), "every:K" (keep every K-th block's
    input), "binomial:S" (Griewank's S slots). With a budget, raises BudgetTooSmall when the
    plan does not fit it; without one, only states the peak (allocator "none"). sequences > 0:
    one packed row (batch 1) of `seq` tokens holding at most that many sequences. offload: as fit's
    ("auto": offloaded when the plan does not fit the budget with the optimizer's state); ranks,
    rank, zero, overlap, device: as fit's."""
    r = _request(model, batch, seq, budget, precision, allocator, optimizer, threads, sequences, offload, host_budget,
                 ranks, rank, zero, overlap, device)
    if r.sequences != 0 and r.batch != r.ranks:
        raise invalid("batch", f"{r.ranks} with sequences (one packed row per rank; fit plans several)", batch,
                      f"e.g. batch={r.ranks}")
    m = _SCHEDULE.fullmatch(schedule) if isinstance(schedule, str) else None
    depth = len(model.layers)
    if m is None:
        raise invalid("schedule", "none, full, every:K or binomial:S", schedule, 'e.g. schedule="every:2"')
    if m.group(1):
        r.schedule = m.group(1)
    else:
        r.schedule = m.group(2)
        r.schedule_param = int(m.group(3))
        if not 1 <= r.schedule_param <= depth:
            raise invalid("schedule", f"{m.group(2)}:K with K from 1 to the {depth} blocks", schedule,
                          f'e.g. schedule="{m.group(2)}:1"')
    r.head_chunks = [_whole("head_chunk", head_chunk, 1, 1 << 24, "head_chunk=256")]
    return _plan(r)
