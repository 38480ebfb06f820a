"""The result of an estimate: a frozen breakdown in bytes, and its printed table."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from memplan.precision import PRECISIONS, Precision  # noqa: F401  (re-exported: one list, in a torch-free leaf)

if TYPE_CHECKING:
    from memplan.estimator.flops import StepCosts


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Peak memory of one steady-state training step. Every figure is an int in bytes.

    The components (parameters .. workspaces) are what is live at the moment of the peak and add up
    to `peak_allocated`.
    """

    parameters: int
    """Model parameters and buffers."""
    gradients: int
    """`.grad` tensors live at the peak (and DDP's gradient buckets)."""
    optimizer_state: int
    """Optimizer state tensors (Adam's exp_avg / exp_avg_sq, momentum buffers, step counters)."""
    activations: int
    """Tensors saved for backward, live at the peak."""
    temporaries: int
    """Everything else live at the peak: op outputs in flight, gradient buffers, optimizer scratch."""
    batch: int
    """The input batch."""
    workspaces: int = 0
    """cuBLAS workspaces, and a cuDNN convolution's while the peak falls inside one, which torch allocates through
    the caching allocator (0 on CPU)."""
    peak_allocated: int
    """Peak of live tensor bytes over a steady-state step (`torch.cuda.max_memory_allocated` on a GPU,
    where tensor sizes are rounded to the caching allocator's blocks)."""
    peak_reserved: int
    """The caching allocator's reserved bytes at its peak (equals peak_allocated on CPU)."""
    side_stream_reserved: int = 0
    """Of peak_reserved, the bytes cached by streams other than the default one, which the default
    stream's requests cannot reuse (FSDP2's all-gather copy-in and reduce-scatter streams); 0 on CPU."""
    device_total: int
    """peak_reserved + CUDA context + library workspaces outside the allocator: what NVML shows for
    the process. On CPU, equals peak_reserved."""
    cuda_context: int = 0
    """CUDA context and kernel images (0 on CPU)."""
    communication: int = 0
    """Communication buffers outside the allocator (NCCL), 0 without DDP."""
    device: str = "cpu"
    """The target: 'cpu' or a GPU model name."""
    precision: Precision = "32-true"
    """Lightning precision string the step was traced under."""
    checkpointing: bool = False
    """Whether activation checkpointing was applied."""
    checkpoint_mode: str = "none"
    """The checkpointing applied, in memplan.checkpoint_setting's text form ('full', 'blocks:4', 'op')."""
    strategy: str | None = None
    """None, 'ddp' or 'fsdp' (figures are rank 0's: FSDP gives it the largest shard)."""
    world_size: int = 1
    """Number of data-parallel ranks the estimate is for (memory is per rank)."""
    batch_size: int | None = None
    """Samples in the batch, when it could be told from the batch's leading dimension."""
    forward_activations: int = 0
    """Bytes saved for backward at the end of the forward: the classic 'activation memory'. When the
    peak falls in the optimizer step, `activations` is near 0 while this is not."""
    peak_phase: str = "optimizer"
    """Where in the step the peak falls: 'forward', 'backward' or 'optimizer'."""
    peak_allocated_by_phase: tuple[tuple[str, int], ...] = ()
    """The steady-state step's peak allocated bytes in each phase reached, e.g. (('forward', ...),
    ('backward', ...), ('optimizer', ...)): the planner extrapolates each phase's own line, as the
    phase holding the peak can change with the micro-batch."""
    own_checkpoint_calls: int = 0
    """`torch.utils.checkpoint` calls the model made itself in the traced step (memplan's own wrapping of
    blocks not counted): > 0 means the model checkpoints inside its forward, which leaves no mark on its
    modules; the planner then keeps it and adds none of its own."""
    num_parameters: int = 0
    """Number of parameter elements (for the rule-of-thumb comparison)."""
    trace_seconds: float = 0.0
    """Wall time of the trace."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    """Approximations that apply to this estimate, in words."""
    step_costs: StepCosts | None = field(default=None, repr=False, compare=False)
    """Each op's FLOPs and bytes in the traced step (estimator/flops.py), for the planner's step-time
    model; None from an estimator that does not count them."""

    def to_dict(self) -> dict:
        """Plain dict (JSON-ready); bytes stay ints. The step's costs appear summed per phase."""
        costs = self.step_costs
        out = dataclasses.asdict(dataclasses.replace(self, step_costs=None))
        out["step_costs"] = costs.summary() if costs is not None else None
        out["notes"] = list(self.notes)
        return out

    def rule_of_thumb(self) -> dict[str, int]:
        """The seeds' rules of thumb for this model, in bytes, for comparison in the table."""
        weights = 4 * self.num_parameters
        return {
            "4 x model size": 4 * weights,
            "4B x (3 x params + 2 x activations)": 4 * (3 * self.num_parameters) + 2 * self.forward_activations,
        }

    def __str__(self) -> str:
        from memplan.estimator.table import render_text

        return render_text(self)

    def __rich__(self):
        from memplan.estimator.table import render_table

        return render_table(self)
