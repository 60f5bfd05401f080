"""membound's C++ planner (nanobind). Use the membound package's functions; they check arguments first."""

class Request:
    """A checked planning request (membound.plan and membound.fit fill it)."""

    layers: list[str]
    vocab: int
    width: int
    heads: int
    kv_heads: int
    mlp_hidden: int
    window: int
    experts: int
    top_k: int
    capacity: float
    aux: float
    batch: int
    seq: int
    sequences: int
    max_tokens: int
    multiple: int
    budget: int
    threads: int
    prefer_below: int
    precision: str
    allocator: str
    optimizer: str
    offload: str
    host_budget: int
    ranks: int
    rank: int
    zero: int
    overlap: bool
    schedule: str
    schedule_param: int
    head_chunks: list[int]
    device: str
    def __init__(self) -> None: ...

class PlanResult:
    """The C++ training_plan's fields and table."""

    @property
    def table(self) -> str: ...
    @property
    def model_line(self) -> str: ...
    @property
    def parameters(self) -> int: ...
    @property
    def micro_batch(self) -> int: ...
    @property
    def seq(self) -> int: ...
    @property
    def sequences(self) -> int: ...
    @property
    def accumulation(self) -> int: ...
    @property
    def schedule(self) -> str: ...
    @property
    def head_chunk(self) -> int: ...
    @property
    def threads(self) -> int: ...
    @property
    def weights(self) -> int: ...
    @property
    def gradients(self) -> int: ...
    @property
    def weight_gather(self) -> int: ...
    @property
    def optimizer(self) -> int: ...
    @property
    def optimizer_policy(self) -> str: ...
    @property
    def offload_optimizer(self) -> bool: ...
    @property
    def host_optimizer(self) -> int: ...
    @property
    def host_staging(self) -> int: ...
    @property
    def offload_bucket(self) -> int: ...
    @property
    def host_activations(self) -> int: ...
    @property
    def offloaded_bytes(self) -> int: ...
    @property
    def host_peak(self) -> int: ...
    @property
    def host_budget(self) -> int: ...
    @property
    def activations(self) -> int: ...
    @property
    def workspace(self) -> int: ...
    @property
    def peak_bytes(self) -> int: ...
    @property
    def reserved_peak(self) -> int: ...
    @property
    def peak_phase(self) -> str: ...
    @property
    def budget(self) -> int: ...
    @property
    def fits(self) -> bool: ...
    @property
    def forward_flops(self) -> float: ...
    @property
    def recompute_flops(self) -> float: ...

def make_plan(request: Request) -> PlanResult:
    """The plan for a checked request."""

def plans_devices() -> list[str]:
    """The backends this install plans for: cpu, and cuda where it was built with nvcc."""

def version() -> str:
    """membound's version, MAJOR.MINOR.PATCH, as the C++ headers state it."""
