"""Lower bounds on a candidate's per-rank memory: what lets the search skip a group without a trace.

At the end of the forward of the traced (steady-state) step a rank holds at least

    its resident training state        parameters (and buffers) and optimizer state, alive all step
  + what the forward saved for backward (the estimate's forward_activations)
  + under SHARD_GRAD_OP, every parameter unsharded (FSDP keeps each block gathered until its backward)

and the step's peak is no lower than that moment, so neither is the estimate's device total. Each
term is taken only from what is certain:

- Resident state. Before any trace: PlanRequest.parameter_bytes + optimizer_state_bytes (the state
  the optimizer keeps per element of a parameter, elementwise like the sharding), all of it on a DDP
  or one-GPU rank, at least 1/d of it on an FSDP rank sharding over d ranks (FSDP2 chunks dim 0 and
  rank 0 holds the first, largest chunk, and its state), none with CPU offload. The optimizer figure
  is a claim (estimator/optimizer_state.py cannot see which parameters get no gradient): the first
  trace that is not offloaded checks it at its own layout, and a trace holding less optimizer state
  than it implies withdraws it for the rest of the search. Unchecked, it only orders the search: it is
  withdrawn before the search settles on a plan or on none (_Search.run). Once a group of the same layout (DDP and one GPU are
  one layout; an FSDP sharding, offload and world size another) is traced, its traced parameters +
  optimizer state, which do not depend on precision (the searched ones keep the model's parameter
  dtype), checkpointing or micro-batch.
- Activations. The forward_activations of a traced group with the same precision kind (AMP or
  32-true) and checkpointing, at its largest traced micro-batch not above the candidate's (a larger
  micro-batch saves no less). The saved tensors are the same under every layout, but an FSDP forward
  also keeps unsharded parameters alive to its end (the root's, and under SHARD_GRAD_OP every
  block's), which its trace counts as activations. So a DDP or one-GPU trace bounds every layout; an
  FSDP trace that reshards after forward (not SHARD_GRAD_OP) bounds the FSDP layouts that reshard
  too, at its own world size; several sources give the smallest of their figures.
- Unsharded parameters under SHARD_GRAD_OP: PlanRequest.parameter_bytes (the root's parameters
  included: it is not resharded after forward either).

CPU offload has a second bound. It runs the same ops as the same sharding without offload (same
world size, so the same padded all-gather and reduce-scatter buffers), with the sharded parameters,
gradients and optimizer state in host memory instead. So at the moment the non-offloaded trace peaked
in forward or backward, an offloaded rank holds all that trace held but those three: its
peak_allocated less twice its parameters (the sharded gradients have the sharded parameters' shapes,
wherever the trace counted them) and its optimizer_state, plus the CUDA context and communication
buffers, bounds the offloaded layout at that micro-batch and above. (A peak in the
optimizer step is left out: its temporaries are the size of the state, which offload steps on the
host.)

tests/test_planner_floors.py holds these bounds against full traces on small models.
"""
from __future__ import annotations

from dataclasses import dataclass

from memplan.checkpoint_setting import Checkpointing
from memplan.estimator.result import MemoryEstimate
from memplan.planner.candidates import Candidate, Group
from memplan.planner.request import AMP_PRECISIONS


@dataclass(frozen=True, kw_only=True)
class _Traced:
    """What a floor needs from one trace."""

    amp: bool
    """Traced in an AMP precision (bf16-mixed / 16-mixed); False: 32-true."""
    checkpointing: Checkpointing
    """Activation checkpointing of the repeated blocks."""
    sharding: str | None
    """FSDP sharding strategy; None: DDP or one GPU."""
    offload: bool
    """FSDP with CPU offload."""
    world_size: int
    """Ranks of the traced step."""
    micro_batch_size: int
    """Samples per rank of the traced step."""
    resident: int
    """parameters + optimizer_state at the peak (all of both are alive through the traced step)."""
    forward_activations: int
    beside_state: int | None
    """Device bytes at the peak besides the sharded parameters, gradients and optimizer state, context
    and communication included; None when the peak is in the optimizer step."""


def _layout(sharding: str | None, offload: bool, world_size: int) -> tuple:
    """Groups with the same resident training state: DDP and one GPU alike; FSDP by its layout."""
    return ("replicated",) if sharding is None else (sharding, offload, world_size)


def _reshards(sharding: str | None) -> bool:
    """FSDP layouts that free each block's gathered parameters after its forward."""
    return sharding in ("FULL_SHARD", "HYBRID_SHARD")


class Floors:
    """Lower bounds on the device bytes of candidates, refined by every trace the search makes."""

    def __init__(self, parameter_bytes: int | None, optimizer_state_bytes: int | None = None) -> None:
        self.parameter_bytes = parameter_bytes or 0
        self.optimizer_claim = optimizer_state_bytes or 0
        """PlanRequest.optimizer_state_bytes until a trace withdraws it (then 0)."""
        self.claim_checked = self.optimizer_claim == 0
        self.traced: list[_Traced] = []

    @property
    def state_bytes(self) -> int:
        """Parameters and (claimed) optimizer state of the whole model, unsharded."""
        return self.parameter_bytes + self.optimizer_claim

    def withdraw_claim(self) -> None:
        """Stop counting the optimizer state that no trace has confirmed."""
        self.optimizer_claim, self.claim_checked = 0, True

    def add(self, *, micro_batch_size: int, precision: str, checkpointing: bool | Checkpointing, world_size: int,
            sharding: str | None, offload: bool, est: MemoryEstimate, shard_degree: int = 1) -> None:
        """Learn from one trace; `shard_degree`: the ranks its parameters are sharded over (1: DDP)."""
        if not self.claim_checked and not offload:
            degree = 1 if sharding in (None, "NO_SHARD") else shard_degree
            if est.optimizer_state < self.optimizer_claim // degree:
                self.withdraw_claim()
            self.claim_checked = True
        self.traced.append(_Traced(
            amp=precision in AMP_PRECISIONS, checkpointing=Checkpointing.parse(checkpointing), sharding=sharding, offload=offload,
            world_size=world_size, micro_batch_size=micro_batch_size,
            resident=est.parameters + est.optimizer_state, forward_activations=est.forward_activations,
            beside_state=(est.peak_allocated - 2 * est.parameters - est.optimizer_state
                          + est.cuda_context + est.communication) if est.peak_phase in ("forward", "backward") else None))

    def resident(self, c: Candidate) -> int:
        """Resident training state per rank: the static bound or a traced figure, the larger."""
        group = c.group
        if group.sharding in (None, "NO_SHARD"):
            static = self.state_bytes
        elif group.offload:
            static = 0
        else:
            static = self.state_bytes // (c.gpus_per_node if group.sharding == "HYBRID_SHARD" else c.world_size)
        layout = _layout(group.sharding, group.offload, c.world_size)
        traced = [t.resident for t in self.traced if _layout(t.sharding, t.offload, t.world_size) == layout]
        return max([static, *traced])

    def activations(self, group: Group, micro_batch_size: int, world_size: int) -> int:
        """Forward activations the candidate's forward saves at the least (0 when nothing bounds them)."""
        best_by_source: dict[tuple, tuple[int, int]] = {}
        for t in self.traced:
            if (t.amp, t.checkpointing) != (group.amp, group.checkpointing) or t.micro_batch_size > micro_batch_size:
                continue
            if t.sharding is not None and not (_reshards(t.sharding) and _reshards(group.sharding)
                                               and t.world_size == world_size):
                continue
            source = _layout(t.sharding, t.offload, t.world_size)
            seen = best_by_source.get(source)
            if seen is None or t.micro_batch_size > seen[0]:
                best_by_source[source] = (t.micro_batch_size, t.forward_activations)
        return min((value for _, value in best_by_source.values()), default=0)

    def beside_offloaded_state(self, c: Candidate) -> int:
        """For CPU offload: the largest beside_state of the same sharding without offload, same
        precision kind, checkpointing and world size, traced at a micro-batch not above the candidate's."""
        g = c.group
        return max((t.beside_state for t in self.traced
                    if g.offload and not t.offload and t.sharding == g.sharding and t.world_size == c.world_size
                    and (t.amp, t.checkpointing) == (g.amp, g.checkpointing)
                    and t.micro_batch_size <= c.micro_batch_size and t.beside_state is not None), default=0)

    def floor(self, c: Candidate) -> int:
        """Device bytes the candidate needs at the least."""
        unsharded = self.parameter_bytes if c.group.sharding == "SHARD_GRAD_OP" else 0
        resident = self.resident(c)
        return resident + max(unsharded + self.activations(c.group, c.micro_batch_size, c.world_size),
                              self.beside_offloaded_state(c))
