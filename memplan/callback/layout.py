"""The per-rank layout of the global batch: what MemoryPlanner applies, adjusts and checkpoints.

Each rank's DataLoader yields `loader_batch_size` samples; each loaded batch runs as chunks of at
most `micro_batch_size` samples (one forward/backward each); `accumulate_grad_batches` loaded
batches make one optimizer step. The global batch, loader x world x accumulate, never depends on the
micro-batch, which is why the micro-batch can change mid-run without touching the data order.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from memplan.batching import batch_size_of


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How each rank runs its share of the global batch."""

    loader_batch_size: int
    """Samples per rank in each batch the DataLoader yields."""
    micro_batch_size: int
    """Samples per forward/backward: each loaded batch runs as chunks of at most this many."""
    accumulate_grad_batches: int
    """Loaded batches per optimizer step (`Trainer.accumulate_grad_batches`)."""
    world_size: int
    """Data-parallel ranks."""
    gradient_checkpointing: bool = False
    """Whether activation checkpointing is on."""
    checkpointing: str | None = None
    """The plan's partial or per-op setting ('blocks:4', 'every:2', 'op'), applied at fit start; None: full
    or none, as gradient_checkpointing says (an OOM retry turns on full checkpointing of what is left)."""

    def __post_init__(self) -> None:
        for name in ("loader_batch_size", "micro_batch_size", "accumulate_grad_batches", "world_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Layout.{name} must be a positive int; got {value!r}")
        if self.micro_batch_size > self.loader_batch_size:
            raise ValueError(
                f"Layout.micro_batch_size ({self.micro_batch_size}) must not exceed loader_batch_size "
                f"({self.loader_batch_size}): a micro-batch is a chunk of a loaded batch"
            )

    @property
    def chunks(self) -> int:
        """Micro-batches per loaded batch."""
        return -(-self.loader_batch_size // self.micro_batch_size)

    @property
    def micro_batches_per_step(self) -> int:
        """Forward/backward passes per optimizer step on each rank: the effective accumulation."""
        return self.accumulate_grad_batches * self.chunks

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step over all ranks: loader x world x accumulate."""
        return self.loader_batch_size * self.world_size * self.accumulate_grad_batches

    def with_micro_batch(self, micro_batch_size: int, gradient_checkpointing: bool | None = None) -> Layout:
        """The same layout with another micro-batch (and checkpointing); the global batch is kept."""
        checkpointing = self.gradient_checkpointing if gradient_checkpointing is None else gradient_checkpointing
        return dataclasses.replace(self, micro_batch_size=micro_batch_size, gradient_checkpointing=checkpointing)

    def with_loader_batch(self, loader_batch_size: int) -> Layout:
        """The layout for a loader that yields `loader_batch_size` (the micro-batch kept, at most that)."""
        return dataclasses.replace(self, loader_batch_size=loader_batch_size,
                                   micro_batch_size=min(self.micro_batch_size, loader_batch_size))

    def describe(self) -> str:
        """One line for people: micro-batch x passes per step x ranks = global batch."""
        how = (f"each loaded batch of {self.loader_batch_size} in {self.chunks} chunks, accumulate "
               f"{self.accumulate_grad_batches}" if self.chunks > 1 else f"accumulate {self.accumulate_grad_batches}")
        return (f"micro-batch {self.micro_batch_size} x {self.micro_batches_per_step} per step ({how}) x "
                f"{self.world_size} rank(s) = global batch {self.global_batch_size}"
                f"{', activation checkpointing on' if self.gradient_checkpointing and not self.checkpointing else ''}"
                f"{f', activation checkpointing {self.checkpointing}' if self.checkpointing else ''}")

    def to_dict(self) -> dict[str, Any]:
        """Plain scalars (for state_dict and the JSON-lines log), derived figures included."""
        out = dataclasses.asdict(self)
        if out["checkpointing"] is None:  # (full or none: gradient_checkpointing says which)
            del out["checkpointing"]
        out["micro_batches_per_step"] = self.micro_batches_per_step
        out["global_batch_size"] = self.global_batch_size
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Layout:
        """Inverse of to_dict; derived figures are recomputed, not read."""
        return cls(**{f.name: data[f.name] if f.default is dataclasses.MISSING else data.get(f.name, f.default)
                      for f in dataclasses.fields(cls)})


def loaded_batch_size(batch: Any) -> int | None:
    """Samples in a loaded batch (the leading dimension its tensors share); None when they share none."""
    try:
        return batch_size_of(batch)
    except ValueError:
        return None


def chunk_bounds(start: int, stop: int, size: int) -> list[tuple[int, int]]:
    """[start, stop) cut into consecutive chunks of `size` samples; the last one may be smaller."""
    return [(lo, min(lo + size, stop)) for lo in range(start, stop, size)]
