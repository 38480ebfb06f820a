"""The plan: how to run a training job so that it fits. Produced by the planner, written to configs,
applied by the MemoryPlanner callback. Frozen; bytes as ints."""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Any, Literal

from memplan.checkpoint_setting import FULL, NONE, Checkpointing
from memplan.precision import PRECISIONS, Precision, canonical_precision

PLAN_FORMAT = 1
"""Version of the plan file layout (`Plan.to_dict()`)."""
STRATEGIES: tuple[str, ...] = ("ddp", "fsdp", "auto")
SHARDING_STRATEGIES: tuple[str, ...] = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD")
"""Lightning strategies a plan may name."""

# --- plausible ranges: every count a user or a file gives is checked against these before any work ---
MAX_BATCH_SIZE = 1 << 24
"""Samples per optimizer step (and per micro-batch) at most: 16,777,216, far above any real job."""
MAX_NODES = 1 << 15
"""Nodes at most (32,768)."""
MAX_GPUS_PER_NODE = 64
"""GPUs per node at most (a node holds 16 at the most today)."""
MAX_WORLD_SIZE = 1 << 18
"""Ranks at most (262,144)."""
MAX_PLAN_BYTES = 1 << 50
"""A byte figure in a plan at most (1 PiB)."""


def check_count(value: object, *, name: str, low: int, high: int, what: str = "") -> int:
    """`value` as an int in [low, high], else a ValueError naming `name` (the flag, YAML key or plan field)
    and the range."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        shown = repr(value) if not isinstance(value, int) or isinstance(value, bool) or len(str(value)) <= 30 \
            else f"a {len(str(abs(value)))}-digit number"
        raise ValueError(f"{name} must be a whole number from {low:,} to {high:,}{f' ({what})' if what else ''}; "
                         f"got {shown}")
    return value


@dataclass(frozen=True, kw_only=True)
class Alternative:
    """One candidate the planner weighed."""

    world_size: int
    """Data-parallel ranks (nodes x GPUs per node)."""
    micro_batch_size: int
    """Samples per GPU per forward/backward."""
    accumulate_grad_batches: int
    """Micro-batches per optimizer step."""
    precision: Precision
    """Lightning precision string."""
    gradient_checkpointing: bool
    """Whether repeated blocks are checkpointed."""
    predicted_peak_bytes: int
    """Predicted per-GPU device total (what NVML would show)."""
    relative_speed: float
    """Predicted throughput relative to the winner (1.0 = the winner)."""
    fits: bool
    """Whether it fits the device budget and host RAM."""
    why_not: str | None = None
    """Why it lost or does not fit, in words."""
    strategy: str = "ddp"
    """The data-parallel layout in words: 'ddp', 'single', or 'fsdp FULL_SHARD' (+ ' offload')."""
    predicted_step_seconds: float | None = None
    """Predicted time of one optimizer step (planner/costs.py; None: not predicted)."""
    samples_per_s: float | None = None
    """Predicted samples per second over all ranks."""
    tokens_per_s: float | None = None
    """Predicted tokens per second over all ranks (None: the batch has no sequence dimension)."""
    mfu: float | None = None
    """Predicted model FLOPs utilisation (0..1) against the precision's dense peak."""
    checkpointing: str | None = None
    """The checkpointing setting in its text form ('none', 'full', 'blocks:4', 'op'); None: as
    gradient_checkpointing says (a plan file from before settings)."""

    def __post_init__(self) -> None:
        if self.checkpointing is not None:
            setting = Checkpointing.parse(self.checkpointing, name="Alternative.checkpointing")
            if bool(setting) != self.gradient_checkpointing:
                raise ValueError(f"Alternative.checkpointing {str(setting)!r} disagrees with gradient_checkpointing="
                                 f"{self.gradient_checkpointing}")
        for name in ("world_size", "micro_batch_size", "accumulate_grad_batches"):
            check_count(getattr(self, name), name=f"Alternative.{name}", low=1,
                        high=MAX_WORLD_SIZE if name == "world_size" else MAX_BATCH_SIZE)
        check_count(self.predicted_peak_bytes, name="Alternative.predicted_peak_bytes", low=0, high=MAX_PLAN_BYTES,
                    what="bytes")
        if self.precision not in PRECISIONS:
            raise ValueError(f"Alternative.precision must be one of {', '.join(PRECISIONS)}; got {self.precision!r}")
        for name in ("gradient_checkpointing", "fits"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Alternative.{name} must be true or false; got {getattr(self, name)!r}")
        speed = self.relative_speed
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not 0 <= speed < float("inf"):
            raise ValueError(f"Alternative.relative_speed must be a number >= 0; got {speed!r}")
        if self.why_not is not None and not isinstance(self.why_not, str):
            raise ValueError(f"Alternative.why_not must be a string or null; got {self.why_not!r}")
        if not isinstance(self.strategy, str):
            raise ValueError(f"Alternative.strategy must be a string; got {self.strategy!r}")


@dataclass(frozen=True, kw_only=True)
class Plan:
    """How to run: per-GPU micro-batch, world size, precision, checkpointing, accumulation."""

    gpu_name: str
    """GPU model planned for (the smallest free budget among the chosen GPUs)."""
    gpus: tuple[int, ...]
    """CUDA indices of the chosen local GPUs (empty when planning off-box)."""
    nodes: int
    """Number of nodes."""
    world_size: int
    """Total data-parallel ranks: nodes x GPUs per node."""
    micro_batch_size: int
    """Samples per GPU per forward/backward."""
    accumulate_grad_batches: int
    """Micro-batches per optimizer step."""
    global_batch_size: int
    """micro_batch_size x world_size x accumulate_grad_batches: the user's batch, kept."""
    precision: Precision
    """Lightning precision string, ready for Trainer(precision=...)."""
    gradient_checkpointing: bool
    """Checkpoint each repeated block."""
    strategy: Literal["ddp", "fsdp", "auto"]
    """Lightning strategy: 'ddp' or 'fsdp' for more than one rank, else 'auto'."""
    predicted_peak_bytes: int
    """Predicted per-GPU device total (peak reserved + CUDA context + NCCL)."""
    device_budget_bytes: int
    """Usable per-GPU bytes: free memory less the safety margin."""
    host_bytes_per_rank: int
    """Predicted host RAM per rank (process runtime, model copy at init, loader workers, pinned buffers)."""
    relative_speed: float = 1.0
    """Predicted throughput relative to the best alternative (the winner is 1.0)."""
    reasons: tuple[str, ...] = ()
    """Why this plan won, in words."""
    alternatives: tuple[Alternative, ...] = field(default_factory=tuple)
    """The next-best candidates, best first."""
    gpu_total_bytes: int | None = None
    """Board memory of the GPU planned for (None: not recorded); a run on another board is warned about."""
    model_class: str | None = None
    """`module.ClassName` of the model planned for (None: not recorded)."""
    model_fingerprint: str | None = None
    """model_fingerprint() of the model planned for: its parameters' names and shapes. A plan is refused
    for a model with another fingerprint (None: not recorded, not checked)."""
    sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"] | None = None
    """FSDP's sharding strategy when strategy is 'fsdp' (HYBRID_SHARD: sharded within a node)."""
    cpu_offload: bool = False
    """FSDP keeps parameters, gradients and optimizer state in host memory."""
    block_classes: tuple[str, ...] = ()
    """Import paths of the repeated block classes FSDP wraps (its auto_wrap_policy)."""
    predicted_step_seconds: float | None = None
    """Predicted time of one optimizer step on the planned GPUs (planner/costs.py; None: not predicted)."""
    samples_per_s: float | None = None
    """Predicted samples per second over all ranks."""
    tokens_per_s: float | None = None
    """Predicted tokens per second over all ranks (None: the batch has no sequence dimension)."""
    mfu: float | None = None
    """Predicted model FLOPs utilisation (0..1) against the precision's dense peak."""
    speed_reason: str | None = None
    """Why the plan beats the runner-up, in one line (None: no runner-up fits)."""
    checkpointing: Checkpointing | None = None
    """Which blocks recompute, and how (memplan.checkpoint_setting: none, full, blocks:K, every:K, op).
    None on input: full or none as gradient_checkpointing says (plan files before settings); always set
    after construction. gradient_checkpointing is whether it recomputes anything."""
    user_checkpointing: str | None = None
    """What the model checkpoints itself (HF gradient_checkpointing_enable, torch's checkpoint_wrapper), in
    words: kept as it is, and memplan adds none. None: the model checkpoints nothing of its own."""

    def __post_init__(self) -> None:
        if not isinstance(self.gradient_checkpointing, bool):
            raise ValueError(f"Plan.gradient_checkpointing must be true or false; got {self.gradient_checkpointing!r}")
        if self.checkpointing is None:
            object.__setattr__(self, "checkpointing", FULL if self.gradient_checkpointing else NONE)
        object.__setattr__(self, "checkpointing", Checkpointing.parse(self.checkpointing, name="Plan.checkpointing"))
        if bool(self.checkpointing) != self.gradient_checkpointing:
            raise ValueError(f"Plan.checkpointing {str(self.checkpointing)!r} disagrees with gradient_checkpointing="
                             f"{self.gradient_checkpointing}: write both from one plan (memplan suggest --output)")
        if self.user_checkpointing is not None and not isinstance(self.user_checkpointing, str):
            raise ValueError(f"Plan.user_checkpointing must be a string or null; got {self.user_checkpointing!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"Plan.precision must be one of {', '.join(PRECISIONS)}; got {self.precision!r}")
        for name in ("nodes", "world_size", "micro_batch_size", "accumulate_grad_batches", "global_batch_size"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"Plan.{name} must be a positive int; got {value!r}")
            check_count(value, name=f"Plan.{name}", low=1, high=_PLAN_RANGES[name])
        for name in ("predicted_peak_bytes", "device_budget_bytes", "host_bytes_per_rank"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"Plan.{name} must be an int >= 0 (bytes); got {getattr(self, name)!r}")
            check_count(getattr(self, name), name=f"Plan.{name}", low=0, high=MAX_PLAN_BYTES, what="bytes")
        if self.gpu_total_bytes is not None and (not _is_int(self.gpu_total_bytes) or self.gpu_total_bytes < 1):
            raise ValueError(f"Plan.gpu_total_bytes must be a positive int (bytes) or None; got {self.gpu_total_bytes!r}")
        if self.gpu_total_bytes is not None:
            check_count(self.gpu_total_bytes, name="Plan.gpu_total_bytes", low=1, high=MAX_PLAN_BYTES, what="bytes")
        if not isinstance(self.relative_speed, (int, float)) or isinstance(self.relative_speed, bool) \
                or not 0 < self.relative_speed < float("inf"):
            raise ValueError(f"Plan.relative_speed must be a positive number; got {self.relative_speed!r}")
        if not isinstance(self.gpu_name, str) or not self.gpu_name:
            raise ValueError(f"Plan.gpu_name must be a non-empty string; got {self.gpu_name!r}")
        if not isinstance(self.gradient_checkpointing, bool):
            raise ValueError(f"Plan.gradient_checkpointing must be true or false; got {self.gradient_checkpointing!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"Plan.strategy must be one of {', '.join(STRATEGIES)}; got {self.strategy!r}")
        if not isinstance(self.gpus, tuple) or not all(_is_int(g) and 0 <= g < MAX_GPUS_PER_NODE for g in self.gpus):
            raise ValueError(f"Plan.gpus must be a list of CUDA indices (ints from 0 to {MAX_GPUS_PER_NODE - 1}); "
                             f"got {list(self.gpus) if isinstance(self.gpus, tuple) else self.gpus!r}")
        if len(set(self.gpus)) != len(self.gpus):
            raise ValueError(f"Plan.gpus names a GPU twice; got {list(self.gpus)}")
        for name in ("model_class", "model_fingerprint"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"Plan.{name} must be a string or None; got {getattr(self, name)!r}")
        product = self.micro_batch_size * self.world_size * self.accumulate_grad_batches
        if product != self.global_batch_size:
            raise ValueError(
                f"Plan.global_batch_size must equal micro_batch_size x world_size x accumulate_grad_batches "
                f"({self.micro_batch_size} x {self.world_size} x {self.accumulate_grad_batches} = {product}); "
                f"got {self.global_batch_size}"
            )
        if self.strategy == "fsdp" and self.sharding_strategy not in SHARDING_STRATEGIES:
            raise ValueError(f"Plan.sharding_strategy must be one of {', '.join(SHARDING_STRATEGIES)} when strategy "
                             f"is 'fsdp'; got {self.sharding_strategy!r}")
        if not isinstance(self.cpu_offload, bool):
            raise ValueError(f"Plan.cpu_offload must be true or false; got {self.cpu_offload!r}")
        if not all(isinstance(c, str) and c for c in self.block_classes):
            raise ValueError(f"Plan.block_classes must be a list of class import paths; got {list(self.block_classes)!r}")
        if self.world_size % self.nodes:
            raise ValueError(f"Plan.world_size ({self.world_size}) must be a multiple of nodes ({self.nodes})")
        check_count(self.world_size // self.nodes, name="Plan.world_size / Plan.nodes", low=1, high=MAX_GPUS_PER_NODE,
                    what="GPUs per node")

    @property
    def gpus_per_node(self) -> int:
        return self.world_size // self.nodes

    @property
    def headroom_bytes(self) -> int:
        """Budget left above the predicted peak (negative: does not fit)."""
        return self.device_budget_bytes - self.predicted_peak_bytes

    def to_dict(self) -> dict[str, Any]:
        """JSON/YAML-ready; bytes stay ints."""
        out = dataclasses.asdict(self)
        out["format"] = PLAN_FORMAT
        out["gpus"] = list(self.gpus)
        out["reasons"] = [str(r) for r in self.reasons]  # (the text: a Reason's code stays in memory)
        out["block_classes"] = list(self.block_classes)
        out["headroom_bytes"] = self.headroom_bytes
        out["alternatives"] = [dataclasses.asdict(a) for a in self.alternatives]
        out["checkpointing"] = str(self.checkpointing)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """Inverse of to_dict (for plan files); unknown keys are refused by name."""
        if not isinstance(data, dict):
            raise ValueError(f"a plan file holds one JSON object (Plan.to_dict()); got {type(data).__name__}")
        data = dict(data)
        fmt = data.pop("format", PLAN_FORMAT)
        if not _is_int(fmt):
            raise ValueError(f"plan file format must be the number {PLAN_FORMAT} (written unquoted: \"format\": "
                             f"{PLAN_FORMAT}); got {fmt!r}")
        if fmt != PLAN_FORMAT:
            raise ValueError(f"plan file format {fmt} is not supported (this memplan reads {PLAN_FORMAT}); re-run memplan suggest")
        data.pop("headroom_bytes", None)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"plan file has unknown keys {unknown}; re-run memplan suggest with this memplan version")
        data.setdefault("gpus", [])  # a plan for other machines names no local GPU
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.name not in data and f.default is dataclasses.MISSING
                         and f.default_factory is dataclasses.MISSING)
        if missing:
            raise ValueError(f"plan file lacks {', '.join(missing)}; write it with memplan suggest --output")
        for name in ("gpus", "reasons", "alternatives"):
            if not isinstance(data.get(name, []), list):
                raise ValueError(f"Plan.{name} must be a list; got {data[name]!r}")
        data["precision"] = canonical_precision(data["precision"], name="Plan.precision")
        data["gpus"] = tuple(data.get("gpus", ()))
        data["reasons"] = tuple(str(r) for r in data.get("reasons", ()))
        if not isinstance(data.get("block_classes", []), list):
            raise ValueError(f"Plan.block_classes must be a list; got {data['block_classes']!r}")
        data["block_classes"] = tuple(data.get("block_classes", ()))
        data["alternatives"] = tuple(_alternative(a, i) for i, a in enumerate(data.get("alternatives", ())))
        return cls(**data)


def _alternative(data: Any, index: int) -> Alternative:
    """One entry of a plan file's `alternatives`, every fault named by its path (Plan.alternatives[2].fits)."""
    where = f"Plan.alternatives[{index}]"
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be an object (Alternative fields); got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(Alternative)}
    unknown = sorted(str(k) for k in data if k not in fields)
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown}; its keys are {', '.join(fields)}")
    missing = [name for name, f in fields.items() if name not in data and f.default is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{where} lacks {', '.join(missing)}; re-run memplan suggest --output")
    data = dict(data)
    if "precision" in data:
        data["precision"] = canonical_precision(data["precision"], name=f"{where}.precision")
    try:
        return Alternative(**data)
    except ValueError as err:
        raise ValueError(f"{where}{str(err).removeprefix('Alternative')}") from None


_PLAN_RANGES = {"nodes": MAX_NODES, "world_size": MAX_WORLD_SIZE, "micro_batch_size": MAX_BATCH_SIZE,
                "accumulate_grad_batches": MAX_BATCH_SIZE, "global_batch_size": MAX_BATCH_SIZE}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def model_fingerprint(module: Any) -> str:
    """A short hash of a model's parameter names and shapes (not dtypes or values): the same for the
    fake model memplan plans on and the real one the Trainer runs, different for another architecture
    or size. Works on any nn.Module without importing torch here."""
    digest = hashlib.sha256()
    for name, parameter in module.named_parameters():
        digest.update(f"{name}:{tuple(parameter.shape)};".encode())
    return digest.hexdigest()[:16]


def model_class_name(module: Any) -> str:
    """`module.ClassName` of a model, as recorded in Plan.model_class."""
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"
