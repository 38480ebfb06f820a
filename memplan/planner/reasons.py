"""The plan's account and NoFit, rendered once, in the words of whoever asked.

The planner's sentences about what the user may change name the user's own inputs: `memplan suggest` its
flags and YAML keys, MemoryPlanner its arguments, a direct caller PlanRequest's fields. Each caller
passes its `Words` with the request (PlanRequest.words), and the planner renders with them: nobody
rewrites a sentence afterwards. A sentence another layer acts on is a `Reason`, carrying its code.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memplan.planner.request import PlanRequest

GPUS_USED = "gpus_used"
"""Reason code: 'Uses N of M GPUs per node: ...', why the plan leaves some of the node's GPUs unused."""
NO_BLOCKS = "the model has no repeated blocks memplan can checkpoint"


@dataclass(frozen=True, kw_only=True)
class Words:
    """How the user names the settings the planner's sentences tell them to change (by default, PlanRequest's
    own fields, for a direct caller)."""

    allow_amp: str = "allowing precisions=('bf16-mixed', '16-mixed', ...)"
    """How to allow mixed precision, as a phrase ('allowing bf16-mixed or 16-mixed (--precision)')."""
    allow_checkpointing: str = "allowing allow_checkpointing=True"
    """How to allow activation checkpointing, as a phrase."""
    checkpointing_refused: str = "not allowed by the request"
    """Why the plan has no activation checkpointing where the user's settings refuse it ('--no-checkpointing
    was given')."""

    def __post_init__(self) -> None:
        for name in ("allow_amp", "allow_checkpointing", "checkpointing_refused"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"Words.{name} must be a non-empty phrase; got {getattr(self, name)!r}")


class Reason(str):
    """One sentence of the plan's account as the user reads it (a str: plan files and JSON hold the text), with
    `code`, what it is about, for a caller that acts on one (suggest --json notes the GPUs left unused)."""

    code: str

    def __new__(cls, text: str, code: str = "") -> Reason:
        made = super().__new__(cls, text)
        made.code = code
        return made

    def __reduce__(self):  # (pickled to other ranks and out of the FSDP planning process: the code goes along)
        return (Reason, (str(self), self.code))


def no_checkpointing(request: PlanRequest) -> str:
    """Why a request that does not allow checkpointing has none: the model has nothing to checkpoint, or the
    user's settings refuse it."""
    why = request.words.checkpointing_refused if request.checkpointable else NO_BLOCKS
    return f"No activation checkpointing ({why})."


def what_would_help(request: PlanRequest, *, amp_allowed: bool) -> str:
    """NoFit's last sentence when DDP does not fit: the settings that, allowed, would lower what it needs
    (mixed precision, checkpointing), in the user's words; '' when every one is allowed."""
    words = request.words
    levers = [] if amp_allowed else [words.allow_amp]
    helps = request.checkpointable and request.user_checkpointing is None
    if not request.allow_checkpointing and helps:
        levers.append(words.allow_checkpointing)
    text = f"{_upper_first(' and '.join(levers))} would lower what DDP needs." if levers else ""
    if not request.allow_checkpointing and not request.checkpointable:
        text += " Activation checkpointing cannot help: the model has no repeated blocks to checkpoint."
    return text.strip()


def _upper_first(text: str) -> str:
    return text[:1].upper() + text[1:]
