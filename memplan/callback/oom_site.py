"""Where an OOM that MemoryPlanner did not retry happened, and what can help there.

Read off the exception's traceback (the innermost frame in torch's optimizers, in autograd's backward)
and the Trainer's state (validating, sanity checking), not guessed: each place has its own remedy, and
`guard='always'` helps only with a backward Lightning ran for a batch left unguarded.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

_SEP = os.sep
_BACKWARD = (f"{_SEP}torch{_SEP}autograd{_SEP}", f"{_SEP}torch{_SEP}_tensor.py")
_CLOSURE = (f"{_SEP}loops{_SEP}optimization{_SEP}",)
"""Lightning's automatic optimization runs training_step and its backward in a closure that the
optimizer's step calls: so the innermost of these places in the traceback decides, not any of them."""
_OPTIMIZER = (f"{_SEP}torch{_SEP}optim{_SEP}", f"{_SEP}core{_SEP}optimizer.py", f"{_SEP}precision{_SEP}")


@dataclass(frozen=True, kw_only=True)
class OomSite:
    where: str
    """Where it happened, in words."""
    fix: str
    """What can help there."""


def oom_site(trainer: Any, exception: BaseException, *, lightning_backward: bool) -> OomSite:
    """Where `exception` (an OOM MemoryPlanner did not retry) happened. `lightning_backward`: the batch in
    progress was left to Lightning's own backward (unguarded, or a batch MemoryPlanner cannot split)."""
    if getattr(trainer, "sanity_checking", False) or getattr(trainer, "validating", False):
        return OomSite(where="in validation (its batches run whole, outside MemoryPlanner's micro-batches)",
                       fix="lower the validation loader's batch size (val_dataloader's batch_size)")
    place = _innermost_place([frame.f_code.co_filename for frame, _ in _frames(exception)])
    if place == "backward" and lightning_backward:
        return OomSite(where="in Lightning's own backward of a batch this rank ran unguarded",
                       fix="MemoryPlanner(guard='always') runs every backward where an OOM can be retried (for "
                           "inputs whose size varies)")
    if place == "optimizer":
        return OomSite(where="in the optimizer step (its memory is per parameter; a smaller micro-batch does "
                             "not shrink it)",
                       fix="shard the optimizer state (FSDP), use an optimizer with less state, or a GPU with "
                           "more memory")
    return OomSite(where="outside the forwards and backwards MemoryPlanner retries (a hook or callback of the step)",
                   fix="the traceback names the hook; MemoryPlanner retries OOMs in training_step's chunks only")


def _innermost_place(files: list[str]) -> str | None:
    for name in reversed(files):
        if any(part in name for part in _BACKWARD):
            return "backward"
        if any(part in name for part in _CLOSURE):
            return "step"
        if any(part in name for part in _OPTIMIZER):
            return "optimizer"
    return None


def _frames(exception: BaseException):
    tb = exception.__traceback__
    while tb is not None:
        yield tb.tb_frame, tb.tb_lineno
        tb = tb.tb_next
