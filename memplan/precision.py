"""Lightning's precision strings, and the short spellings Trainer(precision=...) accepts for them.

A leaf (no torch): the command line checks `--precision` with it while parsing, and the config,
the plan file and the estimator share its one list.
"""
from __future__ import annotations

import difflib
from typing import Any, Literal

Precision = Literal["32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"]
PRECISIONS: tuple[str, ...] = ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")
"""The precisions memplan estimates, as Lightning names them."""

ALIASES: dict[Any, str] = {
    32: "32-true", "32": "32-true", 16: "16-mixed", "16": "16-mixed", "bf16": "bf16-mixed",
    64: "64-true", "64": "64-true",
}
"""Lightning's short spellings (lightning.fabric.connector), mapped as Trainer(precision=...) maps them."""

_LIGHTNING_ONLY = ("64-true", "transformer-engine", "transformer-engine-float16")
"""Precisions Lightning runs that memplan does not estimate."""


def canonical_precision(value: Any, *, name: str) -> str:
    """Lightning's canonical string for `value` (16, "16", "bf16", "16-mixed" ...), the same wherever it
    is written (a flag, a YAML key, a plan file). `name` is the input's name as the user wrote it
    ('--precision', 'trainer.precision'): a ValueError names it and the accepted values."""
    hashable = isinstance(value, (str, int)) and not isinstance(value, bool)
    canonical = ALIASES.get(value, value) if hashable else value
    if canonical in PRECISIONS:
        return canonical
    accepted = f"{', '.join(PRECISIONS)} (or Lightning's aliases 32, 16, bf16)"
    if canonical in _LIGHTNING_ONLY:
        raise ValueError(f"{name} {value!r}: Lightning runs it, but memplan does not estimate it; use one of "
                         f"{accepted}")
    close = difflib.get_close_matches(str(value), PRECISIONS, n=1) if isinstance(value, str) else []
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"{name} must be a Lightning precision: {accepted}; got {value!r}{hint}")
