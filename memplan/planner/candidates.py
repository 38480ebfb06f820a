"""Every setting the planner could choose, before any memory is known.

A candidate is one (precision, checkpointing, GPUs per node, micro-batch) with its accumulation set so
that micro x world x accumulation is the global batch exactly. Candidates fall into groups that share
one per-rank memory curve: (AMP or 32-true) x (checkpointing or not) x (one rank, or DDP).
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from memplan.planner.costs import host_bytes_per_rank, relative_throughput
from memplan.planner.request import AMP_PRECISIONS, SEARCHED_PRECISIONS, DeviceBudget, HostLoad, PlanRequest

PRECISION_PREFERENCE = {p: i for i, p in enumerate(SEARCHED_PRECISIONS)}
"""At equal predicted speed: bf16-mixed, then 16-mixed, then 32-true."""


@dataclass(frozen=True, kw_only=True)
class Group:
    """Candidates that share one per-rank memory curve (micro-batch -> device bytes)."""

    amp: bool
    """bf16-mixed / 16-mixed (same memory to within the GradScaler's scalars); False: 32-true."""
    checkpointing: bool
    """Activation checkpointing of repeated blocks."""
    multi: bool
    """DDP with more than one rank (gradient buckets and NCCL buffers); False: a single GPU."""

    @property
    def probe_world_size(self) -> int:
        """World size the group is traced at: per-rank DDP memory is the same for any world > 1
        except NCCL's buffers, which are recomputed per world size."""
        return 2 if self.multi else 1

    def needs_no_less_than(self, other: Group) -> bool:
        """Whether this group needs at least `other`'s memory at equal micro-batch: 32-true >= AMP
        (same fp32 master weights and optimizer state, activations saved in fp32 rather than half),
        no checkpointing >= checkpointing, DDP >= one rank (buckets and NCCL only add). A pruning
        assumption: for all but toy models the activations and the DDP buckets dominate the
        difference."""
        return ((other.amp or not self.amp) and (other.checkpointing or not self.checkpointing)
                and (self.multi or not other.multi))

    def describe(self) -> str:
        return (f"{'AMP' if self.amp else '32-true'}, {'checkpointing' if self.checkpointing else 'no checkpointing'}, "
                f"{'DDP' if self.multi else 'one GPU'}")


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
    speed: float
    """relative_throughput of this setting."""

    @property
    def checkpointing(self) -> bool:
        return self.group.checkpointing

    @property
    def compute_capability(self) -> tuple[int, int]:
        """The oldest compute capability among the chosen GPUs."""
        return min(d.compute_capability for d in self.devices)

    @property
    def trace_key(self) -> tuple[int, str, bool, int]:
        """(micro_batch_size, precision, checkpointing, world_size): the estimator call for it exactly."""
        return (self.micro_batch_size, self.precision, self.checkpointing, self.world_size)

    def rank_key(self) -> tuple:
        """Sort key, best last: speed, then bf16 > 16 > 32, no checkpointing, larger micro-batch."""
        return (round(self.speed, 12), -PRECISION_PREFERENCE[self.precision], not self.checkpointing,
                self.micro_batch_size)


def divisors(n: int) -> list[int]:
    """Divisors of n, ascending."""
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def enumerate_candidates(request: PlanRequest) -> Iterator[Candidate]:
    """Every candidate of the request: precisions allowed (bf16-mixed only on sm80+ GPUs),
    checkpointing off/on, 1..len(devices) GPUs per node (those with the most free memory), each
    micro-batch dividing the per-rank batch (up to max_micro_batch_size)."""
    load = request.host_load or HostLoad(model_init_bytes=0, sample_bytes=0)
    host_budget = request.host_budget_bytes
    for precision in (p for p in SEARCHED_PRECISIONS if p in request.precisions):
        usable = request.usable_device_indices(precision)
        for checkpointing in ((False, True) if request.allow_checkpointing else (False,)):
            for gpus in range(1, len(usable) + 1):
                world = gpus * request.nodes
                if request.global_batch_size % world:
                    continue
                group = Group(amp=precision in AMP_PRECISIONS, checkpointing=checkpointing, multi=world > 1)
                chosen = tuple(request.devices[i] for i in usable[:gpus])
                per_rank = request.global_batch_size // world
                for micro in divisors(per_rank):
                    if request.max_micro_batch_size is not None and micro > request.max_micro_batch_size:
                        break
                    host = host_bytes_per_rank(load, micro)
                    yield Candidate(
                        group=group, precision=precision, gpus_per_node=gpus, world_size=world,
                        micro_batch_size=micro, accumulate_grad_batches=per_rank // micro, devices=chosen,
                        device_indices=usable[:gpus],
                        budget_bytes=request.budget_bytes(chosen[-1].free_bytes), host_bytes_per_rank=host,
                        host_fits=host_budget is None or gpus * host <= host_budget,
                        speed=relative_throughput(
                            world_size=world, micro_batch_size=micro, accumulate_grad_batches=per_rank // micro,
                            precision=precision, checkpointing=checkpointing,
                            compute_capability=min(d.compute_capability for d in chosen)),
                    )
