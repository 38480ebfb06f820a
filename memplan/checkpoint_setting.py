"""Activation checkpointing as a setting: which repeated blocks recompute, and how much of each.

A shared leaf (no torch import): the planner searches it, a plan file stores it, the estimator and
MemoryPlanner apply it (memplan/estimator/checkpointing.py). The repeated blocks are those
`find_repeated_blocks` finds (transformer layers, ResNet blocks), in the model's order.

- none: nothing is recomputed.
- full: every repeated block keeps only its inputs and runs its forward again in backward.
- blocks: the first `blocks` of the N repeated blocks are checkpointed as in full, the rest keep
  everything (partial checkpointing: memory falls about linearly in `blocks`).
- every: every `every`-th repeated block is checkpointed (torchtitan's selective *layer* AC,
  `selective_ac_option = '2'`: blocks every-1, 2*every-1, ...).
- op: every repeated block is checkpointed with torchtitan's per-op policy (selective *op* AC): the
  outputs of matmuls and attention kernels are kept (except every second `aten.mm`), the cheap ops
  between them are recomputed.

Its text form, for plan files, YAML and the command line: 'none', 'full', 'blocks:K', 'every:K', 'op'.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

CheckpointMode = Literal["none", "full", "blocks", "every", "op"]
CHECKPOINT_MODES: tuple[str, ...] = ("none", "full", "blocks", "every", "op")


@dataclass(frozen=True, kw_only=True)
class Checkpointing:
    """Which activations a training step recomputes in backward instead of keeping (module docstring)."""

    mode: CheckpointMode = "none"
    """'none', 'full' (each repeated block), 'blocks' (the first `blocks`), 'every' (every `every`-th
    block) or 'op' (each block, torchtitan's per-op policy)."""
    blocks: int = 0
    """Repeated blocks checkpointed from the first, for mode 'blocks' (>= 1); 0 otherwise."""
    every: int = 0
    """Period of mode 'every' (>= 1: every `every`-th block); 0 otherwise."""

    def __post_init__(self) -> None:
        if self.mode not in CHECKPOINT_MODES:
            raise ValueError(f"checkpointing mode must be one of {', '.join(CHECKPOINT_MODES)}; got {self.mode!r}")
        for name in ("blocks", "every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Checkpointing.{name} must be a whole number >= 0; got {value!r}")
        if (self.mode == "blocks") != (self.blocks > 0):
            raise ValueError(f"Checkpointing.blocks must be >= 1 for mode 'blocks' (write 'blocks:K') and 0 for "
                             f"any other mode; got mode {self.mode!r}, blocks {self.blocks}")
        if (self.mode == "every") != (self.every > 0):
            raise ValueError(f"Checkpointing.every must be >= 1 for mode 'every' (write 'every:K') and 0 for "
                             f"any other mode; got mode {self.mode!r}, every {self.every}")

    def __bool__(self) -> bool:
        """Whether anything is recomputed."""
        return self.mode != "none"

    def __str__(self) -> str:
        if self.mode == "blocks":
            return f"blocks:{self.blocks}"
        if self.mode == "every":
            return f"every:{self.every}"
        return self.mode

    @classmethod
    def parse(cls, value: Any, *, name: str = "checkpointing") -> Checkpointing:
        """A Checkpointing from itself, a bool (True: full) or its text form; ValueError naming `name`."""
        if isinstance(value, Checkpointing):
            return value
        if isinstance(value, bool):
            return FULL if value else NONE
        if isinstance(value, str):
            text = value.strip().lower()
            mode, _, count = text.partition(":")
            if mode in ("none", "full", "op") and not count:
                return cls(mode=mode)
            if mode in ("blocks", "every") and count.isdigit() and int(count) >= 1:
                return cls(mode=mode, **{mode: int(count)})
        raise ValueError(f"{name} must be one of 'none', 'full', 'op', 'blocks:K' (the first K repeated blocks) "
                         f"or 'every:K' (every K-th block), or true/false; got {value!r}")

    @property
    def per_op(self) -> bool:
        """Whether checkpointed blocks keep the matmul and attention outputs (mode 'op')."""
        return self.mode == "op"

    def selected(self, n_blocks: int) -> list[int]:
        """Indices of the checkpointed blocks among `n_blocks` repeated blocks."""
        if self.mode == "none":
            return []
        if self.mode == "blocks":
            return list(range(min(self.blocks, n_blocks)))
        if self.mode == "every":
            return [i for i in range(n_blocks) if (i + 1) % self.every == 0]
        return list(range(n_blocks))

    def saves_no_less_than(self, other: Checkpointing) -> bool:
        """Whether this setting keeps at least what `other` keeps, on any model: none keeps everything,
        full the least; fewer checkpointed blocks keep more; the per-op policy keeps more than full.
        Settings not ordered so (op against blocks:K) answer False both ways."""
        if self == other or self.mode == "none" or other.mode == "full":
            return True
        if other.mode == "none" or self.mode == "full":
            return False
        if self.mode == other.mode == "blocks":
            return self.blocks <= other.blocks
        return False

    def describe(self, n_blocks: int | None = None) -> str:
        """In words: 'no checkpointing', 'selective (per-op) checkpointing', 'checkpointing 4 of 12 blocks'."""
        if self.mode == "none":
            return "no checkpointing"
        if self.mode == "full":
            return "full checkpointing"
        if self.mode == "op":
            return "selective (per-op) checkpointing"
        if self.mode == "blocks":
            of = f" of {n_blocks}" if n_blocks else ""
            return f"partial checkpointing ({self.blocks}{of} blocks)"
        return "checkpointing every block" if self.every == 1 else f"checkpointing every {_ordinal(self.every)} block"


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


NONE = Checkpointing()
FULL = Checkpointing(mode="full")
OP = Checkpointing(mode="op")
