"""What the runner and each of its chunks take and give: the options the callback runs it with, one chunk's job
(which samples, under which gradient state) and its result (output, loss, held logs, weight, or the OOM)."""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from memplan.batching import batch_size_of, split_batch
from memplan.callback.layout import Layout
from memplan.callback.retry import NONE, Failure, NothingFitsError, OomRetry


@dataclass(frozen=True, kw_only=True)
class RunnerOptions:
    """How the callback runs a MicroBatchRunner for one fit: its layout, what it may do, and whom it tells."""

    shared_layout: Callable[[], Layout]
    """The layout every rank shares now (MemoryPlanner.layout), read at each batch: its micro-batch and loader
    batch, and the checkpointing the runner starts with. The runner keeps no copy of them."""
    can_checkpoint: bool
    """Whether an OOM at micro-batch 1 may turn gradient checkpointing on."""
    retry: bool
    """Whether an OOM is retried smaller (else it is raised)."""
    can_guard: bool
    """Whether backwards may run inside training_step, where an OOM in them can be retried."""
    enable_checkpointing: Callable[[], None]
    """Turns gradient checkpointing on for the module."""
    on_retry: Callable[[OomRetry], None]
    """Told of each OOM recovered from."""
    out_of_memory: Callable[[str, int], NothingFitsError]
    """The error to raise when nothing smaller is left to try: (the OOM's message, the failed chunk size)."""
    exactness: Callable[[Any], Any] | None = None
    """batch -> Exactness (memplan.callback.exactness), asked once, before the first split; None: always exact."""
    size_of: Callable[[Any], int] = batch_size_of
    """A batch's size (MemoryPlanner.batch_size_of)."""
    split: Callable[[Any, int, int, int], Any] = split_batch
    """(batch, start, stop, size) -> the chunk (MemoryPlanner.split_batch)."""
    on_first_split: Callable[[int, int], None] | None = None
    """Told (batch size, chunk size) the first time a batch runs as chunks."""
    sharded_sync_off: Callable[[], contextlib.AbstractContextManager] | None = None
    """FSDP: gradient sync off for every chunk but a batch's last (memplan.callback.sharded)."""
    planned_load_per_sample: float | None = None
    """The load per sample the plan was made for (memplan.shapes): a heavier batch runs as smaller chunks."""


@dataclass(frozen=True, kw_only=True)
class ChunkJob:
    """One chunk to run: samples [start, stop) of a loaded batch of `size`."""

    args: tuple
    """training_step's positional arguments (the batch first, where given so)."""
    kwargs: dict
    """Its keyword arguments."""
    batch: Any
    """The loaded batch."""
    size: int
    """Its samples."""
    start: int
    stop: int
    frozen: frozenset[int] = NONE
    """Parameters that hold this chunk's gradient already (a retry after a failed backward): frozen."""
    clear: bool = False
    """No parameter holds a gradient yet (so a failed backward touched exactly those that hold one after it)."""
    order: list[int] | None = None
    """A list to record the parameters' indices in, as the backward makes their gradients (DDP's bucket rebuild)."""
    total: float | None = None
    """mean_over(batch), where a mean over something other than samples weighs the chunks."""
    synced: bool = False
    """Run with the strategy's gradient sync on (FSDP's last chunk; backwarded even at weight 0, since its
    backward is the one that reduce-scatters)."""


@dataclass(frozen=True, kw_only=True)
class ChunkResult:
    """What a chunk gave: training_step's output, its loss, its held `self.log` calls and weight; or what failed."""

    output: Any = None
    loss: torch.Tensor | None = None
    logged: list = ()
    weight: float = 0.0
    """What its loss is multiplied by so the chunks add up to the whole batch's loss (MicroBatchRunner._weight)."""
    failure: Failure | None = None
    """The OOM, where it ran out of memory (every other field then empty)."""
