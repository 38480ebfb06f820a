"""Why the plan checkpoints what it does, in one line: a partial or per-op setting against the two
settings a user would otherwise pick, full checkpointing at the same micro-batch and no checkpointing
at the largest micro-batch that fits without it (the step-time model, costs.py)."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from memplan.checkpoint_setting import FULL, NONE
from memplan.planner.candidates import Candidate

if TYPE_CHECKING:
    from memplan.planner.search import _Search


def _rate(c: Candidate) -> str:
    return "tokens/s" if c.timing is not None and c.timing.tokens_per_s is not None else "samples/s"


def _with(c: Candidate, setting) -> Candidate:
    return dataclasses.replace(c, group=dataclasses.replace(c.group, checkpointing=setting))


def best_without(w: Candidate, search: _Search) -> Candidate | None:
    """The fastest fit without checkpointing at the winner's precision, world size and layout."""
    plain = dataclasses.replace(w.group, checkpointing=NONE)
    fits = [c for c in search.groups.get(plain, ()) if c.precision == w.precision and search.fits(c)]
    return max(fits, key=Candidate.rank_key) if fits else None


def checkpoint_speed_reason(w: Candidate, search: _Search, blocks: int) -> str | None:
    """'selective (per-op) checkpointing: +18 % tokens/s over full checkpointing at the same micro-batch,
    +6 % over no checkpointing at micro-batch 2 (the largest that fits without)'; None unless the
    winner checkpoints partially or per op."""
    if w.checkpointing.mode in ("none", "full"):
        return None
    full = search.timed(_with(w, FULL))
    parts = [f"{w.speed / full.speed - 1:+.0%} {_rate(w)} over full checkpointing at the same micro-batch"]
    plain = best_without(w, search)
    if plain is not None:
        parts.append(f"{w.speed / plain.speed - 1:+.0%} over no checkpointing at micro-batch {plain.micro_batch_size} "
                     "(the largest that fits without)")
    else:
        parts.append("and nothing fits without checkpointing")
    return f"{w.checkpointing.describe(blocks)}: {', '.join(parts)}."
