"""How the plan's account words a candidate: what it is called, whether two are the same setting, why one does
not fit, how long its step takes. Shared by explain.py, alternatives.py and layout_reasons.py."""
from __future__ import annotations

from typing import TYPE_CHECKING

from memplan.planner.candidates import Candidate
from memplan.planner.costs import StepTime
from memplan.planner.request import PlanRequest
from memplan.units import format_bytes

if TYPE_CHECKING:
    from memplan.planner.search import _Search


def timing_fields(timing: StepTime | None) -> dict:
    """The plan's or an alternative's predicted step time, throughput and MFU fields."""
    if timing is None:
        return {}
    return dict(predicted_step_seconds=timing.step_seconds, samples_per_s=timing.samples_per_s,
                tokens_per_s=timing.tokens_per_s, mfu=timing.mfu)


def format_seconds(seconds: float) -> str:
    """'412 ms', '3.2 s', '85 us': a predicted duration at three significant figures or so."""
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"


def plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def same_setting(c: Candidate, w: Candidate, **changes) -> bool:
    fields = {"precision": w.precision, "checkpointing": w.checkpointing, "world_size": w.world_size,
              "micro_batch_size": w.micro_batch_size, "sharding": w.sharding, "offload": w.offload}
    fields.update(changes)
    return all(getattr(c, k) == v for k, v in fields.items())


def precision_twin(c: Candidate, w: Candidate) -> bool:
    """c is w's bf16-mixed/16-mixed twin: the same setting in the other AMP flavour (same memory). A 32-true
    winner has no twin: its mixed-precision settings differ in memory and speed."""
    return c is not w and c.group.amp and w.group.amp and same_setting(c, w, precision=c.precision)


def find_setting(search: _Search, w: Candidate, **changes) -> Candidate | None:
    return next((c for c in search.candidates if same_setting(c, w, **changes)), None)


def why_unfit(search: _Search, c: Candidate, request: PlanRequest) -> str:
    """Why a candidate does not fit, in words."""
    if not search.possible(c):
        need = search.floors.floor(c)
        return (f"needs at least {format_bytes(need)} per {request.device_word} (a lower bound from its resident "
                f"training state and activations, floors.py: not traced), over the {format_bytes(c.budget_bytes)} "
                "budget")
    if not search.fits_device(c):
        need = search.predicted_bytes(c)
        how = "traced" if c.trace_key in search.traces else "predicted"
        return (f"needs {format_bytes(need)} per {request.device_word} ({how}), over the "
                f"{format_bytes(c.budget_bytes)} budget "
                f"by {format_bytes(need - c.budget_bytes)}")
    return (f"host RAM: {plural(c.gpus_per_node, 'rank')} x {format_bytes(c.host_bytes_per_rank)} = "
            f"{format_bytes(c.gpus_per_node * c.host_bytes_per_rank)} per node, over the "
            f"{format_bytes(request.host_budget_bytes or 0)} host budget")


def layout_name(c: Candidate) -> str:
    if c.sharding is None:
        return "ddp" if c.world_size > 1 else "single"
    return f"fsdp {c.sharding}{' offload' if c.offload else ''}"
