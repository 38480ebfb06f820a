"""The plan's alternatives: the best fits that lost and the closest faster settings that do not fit, each
with why it lost."""
from __future__ import annotations

from typing import TYPE_CHECKING

from memplan.plan import Alternative
from memplan.planner.candidates import Candidate
from memplan.planner.wording import layout_name, plural, precision_twin, same_setting, timing_fields, why_unfit

if TYPE_CHECKING:
    from memplan.planner.search import _Search

MAX_ALTERNATIVES = 5
"""Runners-up kept in the plan."""
MAX_NEAR_MISSES = 2
"""Of which, at most this many faster settings that do not fit."""


def alternatives(w: Candidate, search: _Search) -> list[Alternative]:
    """The best fits that lost (one per world size x precision x checkpointing) and the closest
    faster settings that do not fit, best first."""
    seen = [c for c in search.candidates if c.group in search.explored and c is not w
            and (c.group not in search.unfit or c.micro_batch_size == 1)]  # unfit groups: only micro 1 traced

    def kind(c: Candidate) -> tuple:  # bf16-mixed and 16-mixed twins count as one kind
        return (c.world_size, c.group.amp, c.checkpointing, c.sharding, c.offload)

    best_fit: dict[tuple, Candidate] = {}
    for c in (c for c in seen if search.fits(c) and kind(c) != kind(w)):
        if kind(c) not in best_fit or c.rank_key() > best_fit[kind(c)].rank_key():
            best_fit[kind(c)] = c
    fits = sorted(best_fit.values(), key=Candidate.rank_key, reverse=True)
    # The winner's own kind: its precision twin, and its best smaller micro-batch.
    twin = [c for c in seen if precision_twin(c, w) and search.fits(c)]
    smaller = [c for c in seen if kind(c) == kind(w) and c.precision == w.precision and search.fits(c)]
    own = twin[:1] + ([max(smaller, key=Candidate.rank_key)] if smaller else [])

    closest_miss: dict[tuple, Candidate] = {}
    for c in (c for c in seen if not search.fits(c) and c.speed > w.speed):
        over = _overshoot(search, c)
        if kind(c) not in closest_miss or over < _overshoot(search, closest_miss[kind(c)]):
            closest_miss[kind(c)] = c
    misses = sorted(closest_miss.values(), key=lambda c: _overshoot(search, c))[:MAX_NEAR_MISSES]
    kept = list({id(c): c for c in own + fits}.values())  # one line per candidate
    chosen = sorted(kept[:MAX_ALTERNATIVES - len(misses)] + misses, key=lambda c: c.speed, reverse=True)
    return [_alternative(c, w, search) for c in chosen]


def _overshoot(search: _Search, c: Candidate) -> float:
    if not search.fits_device(c):
        return search.predicted_bytes(c) / c.budget_bytes
    budget = search.request.host_budget_bytes or 1
    return c.gpus_per_node * c.host_bytes_per_rank / budget


def _alternative(c: Candidate, w: Candidate, search: _Search) -> Alternative:
    fits = search.fits(c)
    if fits:
        why = f"{c.speed / w.speed:.0%} of the winner's predicted speed: {_differences(c, w)}"
    else:
        why = f"does not fit: {why_unfit(search, c, search.request)}"
    return Alternative(
        world_size=c.world_size, micro_batch_size=c.micro_batch_size,
        accumulate_grad_batches=c.accumulate_grad_batches, precision=c.precision,
        gradient_checkpointing=bool(c.checkpointing), checkpointing=str(c.checkpointing),
        predicted_peak_bytes=search.predicted_bytes(c),
        relative_speed=c.speed / w.speed, fits=fits, why_not=why, strategy=layout_name(c), **timing_fields(c.timing))


def _differences(c: Candidate, w: Candidate) -> str:
    out = []
    if layout_name(c) != layout_name(w):
        out.append(f"{c.group.strategy_label} instead of {w.group.strategy_label} (communication, costs.py)")
    if c.world_size < w.world_size:
        out.append(f"{plural(c.world_size, 'rank')} instead of {w.world_size}")
    if c.micro_batch_size < w.micro_batch_size:
        out.append(f"micro-batch {c.micro_batch_size} instead of {w.micro_batch_size}")
    if c.checkpointing and not w.checkpointing:
        out.append("activation checkpointing recomputes each block's forward")
    elif c.checkpointing != w.checkpointing and c.checkpointing:
        out.append(f"{c.checkpointing.describe()} instead of {w.checkpointing.describe()}")
    if c.precision == "32-true" and w.precision != "32-true":
        out.append("32-true forgoes AMP's tensor-core speed-up")
    if c.precision != "32-true" and w.precision == "32-true":
        alone = same_setting(c, w, precision=c.precision)  # the precision is the only difference
        why = " (AMP's casts cost more than it saves here)" if alone else ""
        out.append(f"{c.precision} instead of 32-true{why}")
    if c.precision == "16-mixed" and w.precision == "bf16-mixed":
        out.append("16-mixed pays for a GradScaler; same memory as bf16-mixed")
    return "; ".join(out) or "ranked lower by the step-time model"
