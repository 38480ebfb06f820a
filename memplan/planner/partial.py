"""Partial checkpointing: the first k of the model's N repeated blocks, k the smallest that fits.

At one micro-batch, memory falls about linearly in k from no checkpointing (k = 0) to full
checkpointing (k = N): each checkpointed block keeps its input instead of its saved activations, and
the blocks are alike. The search has both curves of a layout once it has explored both groups
(search.py), so for each micro-batch where full checkpointing fits and none does not, the line
through the two predictions gives the smallest k within the budget, with no trace. Its step recomputes
the forward of k blocks (profile.py), so it is faster than full checkpointing at that micro-batch and
may beat a smaller micro-batch without checkpointing.

The fastest such candidate, when it beats the search's winner by more than SPEED_TIE, is traced at
exactly its setting. A trace over the budget gives a new line, through it and full checkpointing, and
the next k from it (at least one more block); at most MAX_PARTIAL_TRACES traces. A full-checkpointing
group not yet explored is explored first (1-2 traces) only where a setting without checkpointing that
does not fit would beat the winner.
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from memplan.checkpoint_setting import FULL, NONE, Checkpointing
from memplan.planner.candidates import SPEED_TIE, Candidate

if TYPE_CHECKING:
    from memplan.planner.search import _Search

MAX_PARTIAL_TRACES = 3
"""Exact traces of a partial setting before the search keeps its winner."""


def smallest_k(blocks: int, none_bytes: int, full_bytes: int, budget_bytes: int) -> int | None:
    """The least k in 1..blocks-1 whose bytes, on the line from none_bytes (k = 0) to full_bytes (k =
    blocks), are within the budget; None when only full checkpointing (or nothing) fits."""
    if none_bytes <= full_bytes or full_bytes > budget_bytes:
        return None
    if none_bytes <= budget_bytes:
        return None  # no checkpointing fits: nothing to gain
    k = math.ceil(blocks * (none_bytes - budget_bytes) / (none_bytes - full_bytes))
    return k if 1 <= k < blocks else None


def partial_checkpointing(search: _Search, best: Candidate) -> Candidate | None:
    """A partial-checkpointing candidate that beats `best` and whose trace fits, or None."""
    request = search.request
    blocks = request.repeated_blocks
    if blocks < 2 or not request.allow_checkpointing:
        return None
    beat = best.speed * (1 + SPEED_TIE)
    options = []
    for full in [g for g in list(search.groups) if g.checkpointing == FULL]:
        plain = dataclasses.replace(full, checkpointing=NONE)
        if plain not in search.explored:  # its bound did not beat the winner: nor can partial settings
            continue
        unfit_faster = [c for c in search.groups[plain] if c.speed > beat and c.host_fits and not search.fits(c)]
        if not unfit_faster:
            continue
        if full not in search.explored:
            if search.ruled_out(full):
                continue
            search.explore(full)
        for c in search.groups[full]:
            option = _option(search, c, plain, blocks)
            if option is not None and option.speed > beat:
                options.append(option)
    if not options:
        return None
    return _verified(search, max(options, key=Candidate.rank_key), blocks, beat)


def _option(search: _Search, full: Candidate, plain_group, blocks: int) -> Candidate | None:
    """The partial candidate at `full`'s micro-batch and layout: the smallest k the line admits."""
    if not search.fits(full):
        return None
    plain = next((c for c in search.groups[plain_group] if c.precision == full.precision
                  and c.world_size == full.world_size and c.micro_batch_size == full.micro_batch_size), None)
    if plain is None:
        return None
    _use_known_traces(search, plain_group)
    k = smallest_k(blocks, search.predicted_bytes(plain), search.predicted_bytes(full), full.budget_bytes)
    return None if k is None else _with_blocks(search, full, k)


def _use_known_traces(search: _Search, group) -> None:
    """Give the group's curve every trace the search holds for it (the step-time model's probe may not
    have joined it: a group with no micro-batch-1 candidate stops after its first trace)."""
    curve = search.curves[group]
    key = (search.trace_precision(group), group.checkpointing, group.probe_world_size, group.sharding, group.offload)
    for (micro, *rest), est in search.traces.items():
        if tuple(rest) == key and micro not in curve.points:
            curve.add(micro, est)


def _with_blocks(search: _Search, c: Candidate, k: int) -> Candidate:
    group = dataclasses.replace(c.group, checkpointing=Checkpointing(mode="blocks", blocks=k))
    return search.timed(dataclasses.replace(c, group=group))


def _verified(search: _Search, option: Candidate, blocks: int, beat: float) -> Candidate | None:
    """Trace the option; while over the budget, step k along the line through the trace and full."""
    full_bytes = search.predicted_bytes(dataclasses.replace(option, group=dataclasses.replace(
        option.group, checkpointing=FULL)))
    for _ in range(MAX_PARTIAL_TRACES):
        est = search.trace(*option.trace_key)
        if est.device_total <= option.budget_bytes:
            return option
        k = option.checkpointing.blocks
        over, span = est.device_total - option.budget_bytes, est.device_total - full_bytes
        step = max(1, math.ceil((blocks - k) * over / span)) if span > 0 else blocks
        if k + step >= blocks:
            return None
        option = _with_blocks(search, option, k + step)
        if option.speed <= beat:
            return None
    return None
