"""Every setting the planner could choose, before any memory is known.

A candidate is one (precision, checkpointing, GPUs per node, micro-batch, strategy) with its
accumulation set so that micro x world x accumulation is the global batch exactly. Candidates fall
into groups that share one per-rank memory curve: (AMP or 32-true) x (checkpointing: none, full, or
torchtitan's per-op policy where the model has repeated blocks) x (one rank, DDP, or an FSDP sharding
at one world size). Partial checkpointing (the first k blocks) is not enumerated: the search derives
it from the none and full curves (search.py, partial.py).

FSDP candidates use every usable GPU of each node: sharding over fewer ranks only holds more per GPU
and trains fewer samples at once, so it never wins. They are searched with FULL_SHARD, SHARD_GRAD_OP,
HYBRID_SHARD (several nodes, sharded within a node) and FULL_SHARD with CPU offload (when allowed).
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from memplan.checkpoint_setting import FULL, NONE, OP, Checkpointing
from memplan.plan import MAX_BATCH_SIZE, MAX_GPUS_PER_NODE, MAX_NODES, check_count
from memplan.planner.costs import OFFLOAD_BYTES_PER_PARAM, StepTime, host_bytes_per_rank
from memplan.planner.request import AMP_PRECISIONS, SEARCHED_PRECISIONS, DeviceBudget, HostLoad, PlanRequest

PRECISION_PREFERENCE = {p: i for i, p in enumerate(SEARCHED_PRECISIONS)}
"""At equal predicted speed: bf16-mixed, then 16-mixed, then 32-true."""
SPEED_TIE = 0.01
"""Fits whose predicted speeds are within this fraction of the fastest tie: the simpler setting wins
(preference_key: bf16, no checkpointing, DDP, no offload, the larger micro-batch). The step-time model
cannot tell them apart (benchmarks/results/published_throughput.md)."""


CHECKPOINT_PREFERENCE = {"full": 2, "op": 1}
"""At equal predicted speed among checkpointed settings: full (one switch, the least memory), then the
per-op policy, then partial."""


def checkpoint_settings(request: PlanRequest) -> tuple[Checkpointing, ...]:
    """The checkpointing groups searched: none; full when allowed; torchtitan's per-op policy too when the
    model's repeated blocks are known (request.repeated_blocks)."""
    if not request.allow_checkpointing:
        return (NONE,)
    return (NONE, FULL, OP) if request.repeated_blocks >= 1 else (NONE, FULL)


def fastest(candidates: list[Candidate]) -> Candidate | None:
    """The candidate to pick among `candidates`: the most preferred of those within SPEED_TIE of the fastest."""
    if not candidates:
        return None
    top = max(c.speed for c in candidates)
    return max((c for c in candidates if c.speed >= top / (1 + SPEED_TIE)), key=Candidate.preference_key)


@dataclass(frozen=True, kw_only=True)
class Group:
    """Candidates that share one per-rank memory curve (micro-batch -> device bytes)."""

    amp: bool
    """bf16-mixed / 16-mixed (same memory to within the GradScaler's scalars); False: 32-true."""
    checkpointing: Checkpointing
    """Activation checkpointing of the repeated blocks (false when none)."""
    multi: bool
    """More than one rank (DDP, or FSDP); False: a single GPU."""
    sharding: str | None = None
    """FSDP sharding strategy (FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD); None: DDP or one GPU."""
    offload: bool = False
    """FSDP with CPU offload of parameters, gradients and optimizer state."""
    world_size: int = 0
    """The world size of an FSDP group (its per-rank memory depends on it); 0 otherwise."""

    @property
    def probe_world_size(self) -> int:
        """World size the group is traced at: per-rank DDP memory is the same for any world > 1
        except NCCL's buffers, which are recomputed per world size; FSDP is traced at its own."""
        if self.sharding is not None:
            return self.world_size
        return 2 if self.multi else 1

    @property
    def _memory_level(self) -> tuple[int, str]:
        """Order of the data-parallel layouts by memory at equal setting: offload < FULL_SHARD <
        SHARD_GRAD_OP, HYBRID_SHARD (incomparable with each other) < one GPU < DDP."""
        if self.sharding is None:
            return (4 if self.multi else 3, "")
        if self.offload:
            return (0, "")
        return (1, "") if self.sharding == "FULL_SHARD" else (2, self.sharding)

    def needs_no_less_than(self, other: Group) -> bool:
        """Whether this group needs at least `other`'s memory at equal micro-batch: 32-true >= AMP
        (same fp32 master weights and optimizer state, activations saved in fp32 rather than half),
        no checkpointing >= checkpointing, DDP >= one rank >= FSDP (see _memory_level). A pruning
        assumption: for all but toy models the activations and the DDP buckets dominate the
        difference."""
        mine, theirs = self._memory_level, other._memory_level
        layout = mine[0] > theirs[0] or mine == theirs
        if self.sharding is not None and other.sharding is not None and self.world_size != other.world_size:
            layout = False
        return (other.amp or not self.amp) and self.checkpointing.saves_no_less_than(other.checkpointing) and layout

    @property
    def strategy_label(self) -> str:
        if self.sharding is None:
            return "DDP" if self.multi else "one GPU"
        return f"FSDP {self.sharding}{' + CPU offload' if self.offload else ''}"

    def describe(self) -> str:
        return f"{'AMP' if self.amp else '32-true'}, {self.checkpointing.describe()}, {self.strategy_label}"


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One setting the planner may choose."""

    group: Group
    """Its memory curve."""
    precision: str
    """Lightning precision string."""
    gpus_per_node: int
    """GPUs used on each node."""
    world_size: int
    """nodes x gpus_per_node."""
    micro_batch_size: int
    """Samples per GPU per forward/backward."""
    accumulate_grad_batches: int
    """Micro-batches per optimizer step."""
    devices: tuple[DeviceBudget, ...]
    """The chosen GPUs of one node, most free memory first (the last one sets the budget)."""
    device_indices: tuple[int, ...]
    """Their positions in PlanRequest.devices."""
    budget_bytes: int
    """Usable per-GPU bytes: the smallest free memory among `devices`, less the margin."""
    host_bytes_per_rank: int
    """Predicted host RAM per rank."""
    host_fits: bool
    """Whether gpus_per_node x host_bytes_per_rank fits the host budget (True without one)."""
    speed: float = 0.0
    """Predicted samples per second (timing.samples_per_s); 0 until the search has a step-time model."""
    timing: StepTime | None = None
    """Predicted step time, throughput and MFU (costs.predict_step); None until the search has the model."""

    @property
    def checkpointing(self) -> Checkpointing:
        return self.group.checkpointing

    @property
    def compute_capability(self) -> tuple[int, int]:
        """The oldest compute capability among the chosen GPUs."""
        return min(d.compute_capability for d in self.devices)

    @property
    def sharding(self) -> str | None:
        return self.group.sharding

    @property
    def offload(self) -> bool:
        return self.group.offload

    @property
    def trace_key(self) -> tuple:
        """(micro_batch_size, precision, checkpointing, world_size, sharding, offload): the estimator
        call for it exactly."""
        return (self.micro_batch_size, self.precision, self.checkpointing, self.world_size,
                self.group.sharding, self.group.offload)

    def preference_key(self) -> tuple:
        """rank_key without the speed: what decides between candidates whose predicted speeds tie."""
        return self.rank_key()[1:] + (self.speed,)

    def rank_key(self) -> tuple:
        """Sort key, best last: speed, then bf16 > 16 > 32, no checkpointing, DDP over FSDP (the
        simpler engine at equal speed), HYBRID_SHARD over other FSDP layouts (less traffic between
        nodes), no offload, larger micro-batch."""
        speed = round(math.log(self.speed), 9) if self.speed > 0 else -math.inf  # equal to float noise: a tie
        return (speed, -PRECISION_PREFERENCE[self.precision], not self.checkpointing,
                CHECKPOINT_PREFERENCE.get(self.checkpointing.mode, 0), self.group.sharding is None, self.group.sharding == "HYBRID_SHARD", not self.group.offload,
                self.micro_batch_size)


def divisors(n: int) -> list[int]:
    """Divisors of n, ascending. n is a per-rank batch: at most MAX_BATCH_SIZE, refused above it (trial
    division to sqrt(n) would run for minutes on 10^30)."""
    check_count(n, name="the per-rank batch", low=1, high=MAX_BATCH_SIZE, what="samples")
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def enumerate_candidates(request: PlanRequest) -> Iterator[Candidate]:
    """Every candidate of the request: precisions allowed (bf16-mixed only on sm80+ GPUs),
    checkpointing (checkpoint_settings), 1..len(devices) GPUs per node (those with the most free memory), each
    micro-batch dividing the per-rank batch (up to max_micro_batch_size), under DDP (or one GPU)
    and, when request.searches_fsdp, under each FSDP layout on every usable GPU of each node.
    Counts out of every plausible range are refused first (ValueError naming the request field)."""
    check_count(request.global_batch_size, name="PlanRequest.global_batch_size", low=1, high=MAX_BATCH_SIZE)
    check_count(request.nodes, name="PlanRequest.nodes", low=1, high=MAX_NODES)
    check_count(len(request.devices), name="len(PlanRequest.devices)", low=1, high=MAX_GPUS_PER_NODE,
                what="GPUs per node")
    for precision in (p for p in SEARCHED_PRECISIONS if p in request.precisions):
        usable = request.usable_device_indices(precision)
        for checkpointing in checkpoint_settings(request):
            amp = precision in AMP_PRECISIONS
            for gpus in range(len(usable) if request.all_devices else 1, len(usable) + 1):
                world = gpus * request.nodes
                if request.global_batch_size % world or (world > 1 and "ddp" not in request.strategies):
                    continue
                group = Group(amp=amp, checkpointing=checkpointing, multi=world > 1)
                yield from _micro_batches(request, group, precision, usable[:gpus])
            world = len(usable) * request.nodes
            if not request.searches_fsdp or world < 2 or request.global_batch_size % world:
                continue
            for sharding, offload in _fsdp_layouts(request, len(usable)):
                group = Group(amp=amp, checkpointing=checkpointing, multi=True, sharding=sharding, offload=offload,
                              world_size=world)
                yield from _micro_batches(request, group, precision, usable)


def _fsdp_layouts(request: PlanRequest, gpus_per_node: int) -> list[tuple[str, bool]]:
    layouts = [("FULL_SHARD", False), ("SHARD_GRAD_OP", False)]
    if request.nodes > 1 and gpus_per_node > 1:
        layouts.append(("HYBRID_SHARD", False))
    if request.allow_cpu_offload:
        layouts.append(("FULL_SHARD", True))
    return layouts


def _micro_batches(request: PlanRequest, group: Group, precision: str,
                   indices: tuple[int, ...]) -> Iterator[Candidate]:
    load = request.host_load or HostLoad(model_init_bytes=0, sample_bytes=0)
    host_budget = request.host_budget_bytes
    gpus = len(indices)
    world = gpus * request.nodes
    chosen = tuple(request.devices[i] for i in indices)
    per_rank = request.global_batch_size // world
    offloaded = 0
    if group.offload:
        shard = gpus if group.sharding == "HYBRID_SHARD" else world
        offloaded = -(-OFFLOAD_BYTES_PER_PARAM * (request.parameter_count or 0) // shard)
    for micro in divisors(per_rank):
        if request.max_micro_batch_size is not None and micro > request.max_micro_batch_size:
            break
        if request.min_micro_batch_size is not None and micro < request.min_micro_batch_size:
            continue
        host = host_bytes_per_rank(load, micro) + offloaded
        accumulation = per_rank // micro
        yield Candidate(
            group=group, precision=precision, gpus_per_node=gpus, world_size=world,
            micro_batch_size=micro, accumulate_grad_batches=accumulation, devices=chosen,
            device_indices=indices, budget_bytes=request.budget_bytes(chosen[-1].free_bytes),
            host_bytes_per_rank=host, host_fits=host_budget is None or gpus * host <= host_budget,
        )
