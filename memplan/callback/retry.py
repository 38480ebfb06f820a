"""An OOM in a chunk, and what the rank does next: the same samples again, smaller (none skipped).

A `torch.OutOfMemoryError` in any chunk's forward or backward is caught (memplan.callback.chunking) and the
chunk retried at a smaller micro-batch: back to the largest size that ran on this rank, where that is below
the one that failed; else about half, in even chunks of the loaded batch (memplan.callback.adjust). A
forward touches no gradient. A backward that fails part-way has added the chunk's gradient to some
parameters already (their `.grad` changed: another tensor or a newer version), so the retry runs with those
`Frozen`: every parameter gets each sample's gradient exactly once. At micro-batch 1 the rank turns
checkpointing on (same math, less memory) and retries; with checkpointing on and still no room, it raises
`NothingFitsError`, naming the rank, the step and the memory figures.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any

import torch

from memplan.callback.adjust import smaller_micro_batch
from memplan.compat import tensor_version

NONE: frozenset[int] = frozenset()


class NothingFitsError(torch.OutOfMemoryError):
    """Out of memory at micro-batch 1 with checkpointing on (or not allowed): nothing smaller fits.
    A torch.OutOfMemoryError, so code that catches those catches it."""


@dataclass(frozen=True, kw_only=True)
class OomRetry:
    """An OOM this rank caught and is retrying: what failed and what it does now."""

    phase: str
    """'forward' or 'backward'."""
    failed_micro_batch_size: int
    """Samples in the chunk that ran out of memory."""
    micro_batch_size: int
    """The micro-batch this rank retries and goes on with."""
    gradient_checkpointing: bool
    """Whether checkpointing is on for the retry."""
    message: str
    """torch's error message."""


@dataclass(frozen=True)
class Failure:
    """A chunk that ran out of memory: samples [start, stop), in which phase."""

    start: int
    stop: int
    phase: str
    frozen: frozenset[int]
    """Indices of parameters that already hold this chunk's gradient."""
    message: str


@dataclass
class RetryState:
    """What this rank knows of the sizes that run: the largest that ran since the last OOM, the smallest that failed."""

    retries: int = 0
    """OOMs recovered from."""
    smallest_failed: int | None = None
    """The smallest chunk that ran out of memory."""
    largest_ok: int | None = None
    """The largest chunk whose forward and backward ran here since the last OOM (None before any)."""

    def ran(self, size: int) -> None:
        if self.largest_ok is None or size > self.largest_ok:
            self.largest_ok = size

    def failed(self, size: int, micro_batch_size: int, loader_batch_size: int) -> int | None:
        """Record an OOM of a `size` chunk; the micro-batch to retry at (None: none smaller)."""
        self.retries += 1
        self.smallest_failed = size if self.smallest_failed is None else min(size, self.smallest_failed)
        if self.largest_ok is not None and self.largest_ok >= size:  # (that size ran before; it does not now)
            self.largest_ok = None
        if self.largest_ok is not None:
            return self.largest_ok
        return smaller_micro_batch(min(micro_batch_size, size), loader_batch_size)


def touched(params: list[torch.nn.Parameter], before: list[tuple[torch.Tensor | None, int]] | None) -> frozenset[int]:
    """Parameters whose gradient a failed backward changed (a new tensor, or one written to); `before` None:
    no parameter had a gradient before it."""
    if before is None:
        return frozenset(i for i, param in enumerate(params) if param.grad is not None)
    return frozenset(i for i, (param, (grad, version)) in enumerate(zip(params, before))
                     if param.grad is not grad or (grad is not None and tensor_version(grad) != version))


def gradient_versions(params: list[torch.nn.Parameter]) -> list[tuple[torch.Tensor | None, int]]:
    """Each parameter's gradient and its version now (what `touched` compares with)."""
    return [(g, tensor_version(g)) if (g := p.grad) is not None else (None, 0) for p in params]


class Frozen:
    """Parameters that already hold a chunk's gradient take no gradient in its retry."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self._params = params

    def __enter__(self) -> None:
        for param in self._params:
            param.requires_grad_(False)

    def __exit__(self, *exc: Any) -> None:
        for param in self._params:
            param.requires_grad_(True)


def release_memory() -> None:
    """Free what the failed chunk held (its graph is gone with the exception) back to the device."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
