"""Why the plan's data-parallel layout (DDP, or which FSDP sharding): the best fit of each other layout,
or what it needs (moved out of explain.py, which renders the rest of the plan's account)."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from memplan.planner.candidates import Candidate
from memplan.planner.request import PlanRequest
from memplan.planner.wording import why_unfit

if TYPE_CHECKING:
    from memplan.planner.search import _Search


# --- the data-parallel layout ----------------------------------------------------------------------
def strategy_reasons(request: PlanRequest, w: Candidate, search: _Search) -> list[str]:
    """Why DDP or FSDP (and which sharding): the best fit of each other layout, or what it needs."""
    if w.world_size == 1 or not request.searches_fsdp:
        return []
    others: dict[str, list[Candidate]] = {}
    for c in search.candidates:
        if c.group.strategy_label != w.group.strategy_label and c.world_size > 1:
            others.setdefault(c.group.strategy_label, []).append(c)
    lines = []
    for label, cands in others.items():
        fitting = [c for c in cands if search.fits(c)]
        if fitting:
            best = max(fitting, key=Candidate.rank_key)
            lines.append(f"{label}: fits (micro-batch {best.micro_batch_size}"
                         f"{', checkpointing' if best.checkpointing else ''}) but runs at {best.speed / w.speed:.0%} "
                         f"of this speed.")
            continue
        explored = [c for c in cands if c.group in search.explored and c.micro_batch_size == 1]
        ruled_out = [c for c in cands if c.micro_batch_size == 1]
        if ruled_out and not any(search.possible(c) for c in ruled_out):  # floors grow with the micro-batch
            least = min(ruled_out, key=search.floors.floor)
            lines.append(f"{label} does not fit: {why_unfit(search, least, request)}, even at micro-batch 1"
                         f"{' with checkpointing' if least.checkpointing else ''}.")
        elif explored:
            least = min(explored, key=search.predicted_bytes)
            lines.append(f"{label} does not fit: {why_unfit(search, least, request)} even at micro-batch 1"
                         f"{' with checkpointing' if least.checkpointing else ''}.")
        elif cands:
            lines.append(f"{label}: not traced; it could not beat this setting's predicted speed.")
    if w.sharding is not None:
        loss = 1 - w.speed / _ddp_speed(w, search)
        cost = (f"cost {loss:.0%} of DDP's speed at this setting" if loss >= 0.005 else
                "hide behind compute at this setting (no loss against DDP)")
        lines.insert(0, f"FSDP {w.sharding}{' with CPU offload' if w.offload else ''}: parameters, gradients and "
                        f"optimizer state sharded over {w.gpus_per_node if w.sharding == 'HYBRID_SHARD' else w.world_size} "
                        f"ranks; its all-gathers and reduce-scatters {cost} (costs.py).")
    return lines


def _ddp_speed(w: Candidate, search: _Search) -> float:
    """The winner's speed at the same setting under DDP (the step-time model, no trace)."""
    ddp = dataclasses.replace(w, group=dataclasses.replace(w.group, sharding=None, offload=False, world_size=0))
    return search.timed(ddp).speed
