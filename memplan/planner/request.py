"""What the planner is asked: the GPUs a job may use, the host it runs on, and what may change.

Every figure is an int in bytes. Each dataclass checks itself in `__post_init__` and raises
ValueError naming the field and the fix, so a bad request fails before any trace is run.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from memplan.hardware.catalog import GpuModel, match_nvml_name, supports_bf16
from memplan.planner.reasons import Words

SEARCHED_PRECISIONS: tuple[str, ...] = ("bf16-mixed", "16-mixed", "32-true")
"""Lightning precision strings the planner searches, in order of preference at equal speed."""
AMP_PRECISIONS: tuple[str, ...] = ("bf16-mixed", "16-mixed")
STRATEGIES: tuple[str, ...] = ("ddp", "fsdp")
"""Data-parallel strategies the planner searches."""
"""Mixed precisions: fp32 master weights, half-precision autocast (same memory to within the GradScaler)."""


def _check_int(owner: str, name: str, value: object, *, minimum: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}.{name} must be an int >= {minimum} ({fix}); got {value!r}")


def _check_capability(owner: str, cc: object) -> None:
    if (not isinstance(cc, tuple) or len(cc) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in cc)):
        raise ValueError(f"{owner}.compute_capability must be a (major, minor) tuple of ints such as "
                         f"(8, 0) for an A100; got {cc!r}")


@dataclass(frozen=True, kw_only=True)
class DeviceBudget:
    """One GPU the job may use, and how much of its memory is free for it."""

    name: str
    """GPU model name (catalog name or NVML's board name), for messages and the plan."""
    cuda_index: int | None
    """cuda:<index> of this GPU on the local machine; None when planning off-box."""
    total_bytes: int
    """Board memory as NVML reports it."""
    free_bytes: int
    """Memory free for this job: total less what other processes (and the driver) hold."""
    compute_capability: tuple[int, int]
    """CUDA compute capability (major, minor); bf16-mixed needs (8, 0) or newer."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"DeviceBudget.name must be a non-empty GPU name such as 'A100-80GB'; got {self.name!r}")
        if self.cuda_index is not None:
            _check_int("DeviceBudget", "cuda_index", self.cuda_index, minimum=0,
                       fix="the cuda:<index> of the GPU, or None off-box")
        _check_int("DeviceBudget", "total_bytes", self.total_bytes, minimum=1, fix="board memory in bytes")
        _check_int("DeviceBudget", "free_bytes", self.free_bytes, minimum=0, fix="free memory in bytes")
        if self.free_bytes > self.total_bytes:
            raise ValueError(f"DeviceBudget.free_bytes ({self.free_bytes}) must not exceed total_bytes "
                             f"({self.total_bytes}); read both from the same NVML reading")
        _check_capability("DeviceBudget", self.compute_capability)

    @property
    def bf16_supported(self) -> bool:
        """Native bf16 (sm80+), the condition for bf16-mixed."""
        return supports_bf16(self.compute_capability)

    @property
    def label(self) -> str:
        """'cuda:1 (A100-80GB)' or the bare name off-box; for messages."""
        return self.name if self.cuda_index is None else f"cuda:{self.cuda_index} ({self.name})"

    @classmethod
    def from_gpu_info(cls, info, *, cuda_index: int | None = None) -> DeviceBudget:
        """From an NVML reading (memplan.hardware.GpuInfo). NVML numbers GPUs physically; pass
        `cuda_index`, the GPU's position in `visible_gpus()`, to name it as the job's cuda:<i>."""
        if info.total_bytes is None or info.free_bytes is None:
            raise ValueError(f"GpuInfo for {info.name!r} (NVML index {info.index}) has no memory reading; "
                             "NVML could not read it: plan off-box with DeviceBudget.from_catalog instead")
        cc = info.compute_capability
        if cc is None:
            model = match_nvml_name(info.name)
            if model is None:
                raise ValueError(f"GpuInfo for {info.name!r} has no compute capability and the board is not "
                                 "in memplan's catalog; build DeviceBudget(...) with compute_capability=")
            cc = model.compute_capability
        return cls(name=info.name, cuda_index=cuda_index, total_bytes=int(info.total_bytes),
                   free_bytes=int(info.free_bytes), compute_capability=tuple(cc))

    @classmethod
    def from_catalog(cls, model: GpuModel, cuda_index: int | None = None) -> DeviceBudget:
        """A whole, idle board of a catalogued model (off-box planning): free = total. The CUDA
        context is not subtracted here; the estimate's device_total already contains it."""
        return cls(name=model.name, cuda_index=cuda_index, total_bytes=model.total_bytes,
                   free_bytes=model.total_bytes, compute_capability=model.compute_capability)


@dataclass(frozen=True, kw_only=True)
class HostLoad:
    """What each rank costs in host RAM, besides the process itself."""

    model_init_bytes: int
    """The model's CPU copy at init (0 when built on meta, or by a callable under fake tensors)."""
    sample_bytes: int
    """Bytes of one sample of the batch, as the DataLoader yields it."""
    num_workers: int = 0
    """DataLoader worker processes per rank."""
    prefetch_factor: int = 2
    """Batches each worker loads ahead (DataLoader's prefetch_factor; unused without workers)."""
    pin_memory: bool = False
    """Whether the DataLoader copies batches into pinned (page-locked) memory."""

    def __post_init__(self) -> None:
        for name, fix in (("model_init_bytes", "0 when the model is built on meta"),
                          ("sample_bytes", "bytes of one sample"),
                          ("num_workers", "DataLoader(num_workers=...)")):
            _check_int("HostLoad", name, getattr(self, name), minimum=0, fix=fix)
        _check_int("HostLoad", "prefetch_factor", self.prefetch_factor, minimum=1,
                   fix="DataLoader(prefetch_factor=...), 2 by default")
        if not isinstance(self.pin_memory, bool):
            raise ValueError(f"HostLoad.pin_memory must be True or False; got {self.pin_memory!r}")


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """What to plan: the user's global batch, the GPUs and host, and the settings the planner may choose."""

    global_batch_size: int
    """Samples per optimizer step across all ranks; kept exactly (micro x world x accumulation)."""
    devices: tuple[DeviceBudget, ...]
    """The GPUs of ONE node the job may use (all identical when planning off-box)."""
    nodes: int = 1
    """Nodes, each with the same `devices`; world size = nodes x GPUs used per node."""
    host_available_bytes: int | None = None
    """Host RAM available per node (HostInfo.budget_bytes); None skips the host-RAM limit."""
    host_load: HostLoad | None = None
    """Host RAM each rank costs; None with host_available_bytes counts only the process runtime."""
    precisions: tuple[str, ...] = SEARCHED_PRECISIONS
    """Precisions the planner may choose among (Lightning strings: bf16-mixed, 16-mixed, 32-true)."""
    allow_checkpointing: bool = True
    """Whether the planner may turn on activation checkpointing of repeated blocks."""
    margin: float = 0.10
    """Fraction of each GPU's free memory (and of the host's available RAM) left unused."""
    max_micro_batch_size: int | None = None
    """Upper bound on the per-GPU micro-batch (e.g. the dataset's sequence packing); None: no bound."""
    all_devices: bool = False
    """Use every GPU of `devices` (MemoryPlanner: the Trainer's world size is already fixed); False: the
    planner may choose fewer where that is faster."""
    min_micro_batch_size: int | None = None
    """Lower bound on the per-GPU micro-batch: MemoryPlanner's loader batch where splitting it would change
    what training computes (the plan may then only choose checkpointing, precision being fixed); None: 1."""
    largest_block_bytes: int | None = None
    """Parameter bytes of the model's largest repeated block, for NoFit's FSDP estimate (all-gather
    prefetch holds about two); None assumes the whole model is gathered at once (no wrap policy)."""
    strategies: tuple[str, ...] = STRATEGIES
    """Data-parallel strategies the planner may choose among: 'ddp' and/or 'fsdp'."""
    parameter_count: int | None = None
    """Parameters of the model (elements). FSDP's communication is weighed with it (costs.py); None
    leaves FSDP out of the search."""
    parameter_bytes: int | None = None
    """Bytes of the model's parameters as the searched precisions keep them (as built: fp32 master
    weights under AMP). Every DDP rank holds all of them, an FSDP rank its shard: a lower bound that
    rules out layouts without a trace (floors.py); None: no such bound before a trace."""
    optimizer_state_bytes: int | None = None
    """Optimizer state the step keeps at the least, over all parameters, unsharded (elementwise state:
    estimator/optimizer_state.py); sharded like the parameters. With parameter_bytes, a lower bound
    on the resident training state (floors.py); None: 0."""
    tokens_per_sample: int = 1
    """Tokens (sequence positions) per sample, for the compute time FSDP's collectives hide behind;
    1 for models that are not sequence models."""
    allow_cpu_offload: bool = True
    """Whether the planner may choose FSDP with CPU offload (slow: only when nothing else fits)."""
    block_classes: tuple[str, ...] = ()
    """Import paths of the model's repeated block classes: FSDP's wrap policy in the planned config."""
    repeated_blocks: int = 0
    """How many repeated blocks the model has (estimator/checkpointing.find_repeated_blocks). With >= 1 the
    planner also searches torchtitan's per-op policy and partial checkpointing (the first k blocks);
    0 (unknown) searches none and full only."""
    user_checkpointing: str | None = None
    """What the model checkpoints itself, in words (HF gradient_checkpointing_enable, torch's
    checkpoint_wrapper); the plan keeps it and adds none. None: nothing found."""
    checkpointable: bool = True
    """Whether the model has anything to checkpoint (repeated blocks, or a switch of its own). False: allowing
    checkpointing cannot help, and the plan's account says so instead of suggesting it."""
    words: Words = field(default_factory=Words)
    """How the caller's user names the settings the plan's account and NoFit tell them to change."""

    def __post_init__(self) -> None:
        for name in ("devices", "precisions"):  # a list is as good as a tuple; store the tuple
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        _check_int("PlanRequest", "global_batch_size", self.global_batch_size, minimum=1,
                   fix="the samples per optimizer step across all GPUs")
        _check_int("PlanRequest", "nodes", self.nodes, minimum=1, fix="the number of nodes, 1 for one machine")
        self._check_devices()
        if self.host_available_bytes is not None:
            _check_int("PlanRequest", "host_available_bytes", self.host_available_bytes, minimum=0,
                       fix="HostInfo.budget_bytes, or None to skip the host-RAM limit")
        if self.host_load is not None and not isinstance(self.host_load, HostLoad):
            raise ValueError(f"PlanRequest.host_load must be a HostLoad or None; got {type(self.host_load).__name__}")
        self._check_precisions()
        if not isinstance(self.allow_checkpointing, bool):
            raise ValueError(f"PlanRequest.allow_checkpointing must be True or False; got {self.allow_checkpointing!r}")
        if (isinstance(self.margin, bool) or not isinstance(self.margin, (int, float))
                or not 0.0 <= self.margin < 1.0):
            raise ValueError(f"PlanRequest.margin must be a fraction in [0, 1), e.g. 0.10 to keep 10% of "
                             f"free memory unused; got {self.margin!r}")
        if self.max_micro_batch_size is not None:
            _check_int("PlanRequest", "max_micro_batch_size", self.max_micro_batch_size, minimum=1,
                       fix="a positive bound, or None for no bound")
        if not isinstance(self.all_devices, bool):
            raise ValueError(f"PlanRequest.all_devices must be True or False; got {self.all_devices!r}")
        if self.min_micro_batch_size is not None:
            _check_int("PlanRequest", "min_micro_batch_size", self.min_micro_batch_size, minimum=1,
                       fix="a positive bound, or None for no bound")
        if self.largest_block_bytes is not None:
            _check_int("PlanRequest", "largest_block_bytes", self.largest_block_bytes, minimum=0,
                       fix="parameter bytes of the largest repeated block, or None")
        self._check_fsdp_fields()
        _check_int("PlanRequest", "repeated_blocks", self.repeated_blocks, minimum=0,
                   fix="the number of repeated blocks (find_repeated_blocks), 0 when unknown")
        if self.user_checkpointing is not None and not isinstance(self.user_checkpointing, str):
            raise ValueError(f"PlanRequest.user_checkpointing must be a description or None; got "
                             f"{self.user_checkpointing!r}")
        if not isinstance(self.checkpointable, bool):
            raise ValueError(f"PlanRequest.checkpointable must be True or False; got {self.checkpointable!r}")
        if not isinstance(self.words, Words):
            raise ValueError(f"PlanRequest.words must be a memplan.planner.reasons.Words; got {self.words!r}")
        if not any(self.global_batch_size % (self.nodes * g) == 0 for g in range(1, len(self.devices) + 1)):
            raise ValueError(
                f"PlanRequest.global_batch_size ({self.global_batch_size}) must be divisible by the world size, "
                f"nodes x GPUs per node = {self.nodes} x 1..{len(self.devices)}; none divides it: use a multiple "
                f"of {self.nodes}, or fewer nodes")

    def _check_fsdp_fields(self) -> None:
        for name in ("strategies", "block_classes"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if not self.strategies or any(s not in STRATEGIES for s in self.strategies):
            raise ValueError(f"PlanRequest.strategies must be a non-empty tuple drawn from {STRATEGIES}; "
                             f"got {self.strategies!r}")
        if self.parameter_bytes is not None:
            _check_int("PlanRequest", "parameter_bytes", self.parameter_bytes, minimum=0,
                       fix="the bytes of the model's parameters, or None")
        if self.optimizer_state_bytes is not None:
            _check_int("PlanRequest", "optimizer_state_bytes", self.optimizer_state_bytes, minimum=0,
                       fix="a lower bound on the bytes of the optimizer's state, or None")
        if self.parameter_count is not None:
            _check_int("PlanRequest", "parameter_count", self.parameter_count, minimum=1,
                       fix="the model's number of parameters, or None to leave FSDP out")
        _check_int("PlanRequest", "tokens_per_sample", self.tokens_per_sample, minimum=1,
                   fix="the sequence length of one sample, 1 for non-sequence models")
        if not isinstance(self.allow_cpu_offload, bool):
            raise ValueError(f"PlanRequest.allow_cpu_offload must be True or False; got {self.allow_cpu_offload!r}")

    @property
    def searches_fsdp(self) -> bool:
        """Whether FSDP candidates are searched: allowed, and the parameter count known."""
        return "fsdp" in self.strategies and self.parameter_count is not None

    @property
    def device_word(self) -> str:
        """What the plan's account calls one of `devices`: 'GPU', or 'device' for CPU ranks (MemoryPlanner on a
        machine without a GPU)."""
        return "device" if self.devices[0].name == "cpu" else "GPU"

    def _check_devices(self) -> None:
        if not isinstance(self.devices, tuple) or not self.devices:
            raise ValueError("PlanRequest.devices must be a non-empty tuple of DeviceBudget (the GPUs of one node); "
                             f"got {self.devices!r}")
        for d in self.devices:
            if not isinstance(d, DeviceBudget):
                raise ValueError(f"PlanRequest.devices must hold DeviceBudget objects; got {type(d).__name__}: "
                                 "build them with DeviceBudget.from_gpu_info or DeviceBudget.from_catalog")
        indices = [d.cuda_index for d in self.devices if d.cuda_index is not None]
        if len(indices) != len(set(indices)):
            raise ValueError(f"PlanRequest.devices lists a cuda_index twice ({sorted(indices)}); list each GPU once")

    def _check_precisions(self) -> None:
        if not isinstance(self.precisions, tuple) or not self.precisions:
            raise ValueError(f"PlanRequest.precisions must be a non-empty tuple drawn from "
                             f"{', '.join(SEARCHED_PRECISIONS)}; got {self.precisions!r}")
        for p in self.precisions:
            if p not in SEARCHED_PRECISIONS:
                raise ValueError(f"PlanRequest.precisions: {p!r} is not a precision the planner searches; "
                                 f"use {', '.join(SEARCHED_PRECISIONS)}")
        if set(self.precisions) == {"bf16-mixed"} and not any(d.bf16_supported for d in self.devices):
            names = ", ".join(sorted({f"{d.name} (sm{d.compute_capability[0]}{d.compute_capability[1]})"
                                      for d in self.devices}))
            raise ValueError(f"PlanRequest.precisions allows only 'bf16-mixed', which needs compute capability "
                             f"8.0+, and no device has it ({names}): add '16-mixed'")

    def usable_device_indices(self, precision: str) -> tuple[int, ...]:
        """Positions in `devices` of the GPUs that can run `precision`, most free memory first (the
        order the planner picks them in); ties keep the request's order."""
        pool = [i for i, d in enumerate(self.devices) if precision != "bf16-mixed" or d.bf16_supported]
        return tuple(sorted(pool, key=lambda i: -self.devices[i].free_bytes))

    def budget_bytes(self, free_bytes: int) -> int:
        """Usable bytes of a GPU with `free_bytes` free: the margin left unused."""
        return int(free_bytes * (1.0 - self.margin))

    @property
    def host_budget_bytes(self) -> int | None:
        """Host RAM per node the ranks may use (margin left unused); None: no limit."""
        if self.host_available_bytes is None:
            return None
        return int(self.host_available_bytes * (1.0 - self.margin))
