"""Plan for the heaviest batch, not the first: variable-size inputs (dynamic padding, image sizes, audio
lengths) make the first batch a poor guide, and an OOM thousands of steps later the usual result.
MemoryPlanner (at fit start) and `memplan suggest` (from the config's datamodule) both plan this way.

A batch's *load* is the elements of its per-sample tensors (those whose first dimension is the batch
size): what grows with sequence length or image size. Where the loader's dataset gives each
sample's length (a `lengths` sequence), the loader's batch size of its longest samples is collated and
planned for (by_lengths): no batch is heavier per sample. Otherwise, at fit start MemoryPlanner reads batches from a
fresh train loader (collate only: the model does not run) until it has seen `max_batches` of them or
`seconds` have passed, and plans with the one of the largest load per sample. Where the first
SAME_SHAPE_STOP batches all have the same per-sample shapes (fixed-size data: most image and
packed-token pipelines) it stops there: such a loader has nothing heavier to find, and reading on would
only cost time. The scan restores the random number generators it advanced (torch's, Python's,
NumPy's), so the training sees the data it would have seen without MemoryPlanner.

In training, a batch heavier per sample than the one planned for runs as smaller chunks before it runs
(`chunk_for`): memory is taken as linear in the load, which holds for everything but attention
computed without a fused kernel (quadratic in the length); an OOM there is still retried.
"""
from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from memplan.batching import iter_tensors


def load_of(batch: Any, size: int) -> int:
    """Elements of the batch's per-sample tensors (first dimension `size`)."""
    return sum(t.numel() for t in iter_tensors(batch) if t.dim() > 0 and t.shape[0] == size)


def shapes_of(batch: Any, size: int) -> str:
    """The per-sample tensors' shapes, for people."""
    return ", ".join(str(tuple(t.shape)) for t in iter_tensors(batch) if t.dim() > 0 and t.shape[0] == size)


SCAN_BATCHES = 256
"""Batches a scan reads at the most (MemoryPlanner's scan_batches default; suggest's)."""
SCAN_SECONDS = 10.0
"""Longest a scan may read (collate only)."""
SAME_SHAPE_STOP = 32
"""Batches of one per-sample shape after which a scan stops (fixed-size data)."""


def _sample_shapes(batch: Any, size: int) -> tuple:
    return tuple(tuple(t.shape[1:]) for t in iter_tensors(batch) if t.dim() > 0 and t.shape[0] == size)


@dataclass(frozen=True, kw_only=True)
class Scan:
    """What the fit-start scan found."""

    batch: Any
    """The heaviest batch per sample seen (the first one when nothing heavier came); None once shared
    with the other ranks (they need its figures only)."""
    size: int
    """Its samples."""
    shapes: str
    """Its per-sample tensors' shapes, for people."""
    load_per_sample: float
    """Its load per sample."""
    first_load_per_sample: float
    """The first batch's, to say how much heavier the heaviest was."""
    scanned: int
    """Batches read."""
    seconds: float
    """How long the scan took."""
    complete: bool
    """Whether the loader ran out before the limits (every batch of an epoch seen)."""
    fixed: bool = False
    """Whether it stopped at SAME_SHAPE_STOP batches of one per-sample shape."""
    from_lengths: int = 0
    """Samples whose lengths the dataset gave (by_lengths); 0 when batches were read instead."""
    declared: bool = False
    """Whether the shapes are the user's max_shape (declared)."""

    def describe(self) -> str:
        ratio = self.load_per_sample / self.first_load_per_sample if self.first_load_per_sample else 1.0
        if self.declared:
            return (f"planned for the declared max_shape: per-sample tensors {self.shapes}, {ratio:.2f}x the first "
                    "batch's elements per sample")
        if self.from_lengths:
            return (f"planned for the {self.size} longest of {self.from_lengths} samples by the dataset's `lengths`, "
                    f"collated as the loader does ({self.seconds:.1f} s): per-sample tensors {self.shapes}, "
                    f"{ratio:.2f}x the first batch's elements per sample")
        if self.fixed:
            return (f"planned for batches of one shape: the first {self.scanned} read from the train loader all have "
                    f"per-sample tensors {self.shapes} ({self.seconds:.1f} s, collate only)")
        how = "every batch of an epoch" if self.complete else f"{self.scanned} batches"
        return (f"planned for the heaviest of {how} read from the train loader ({self.seconds:.1f} s, collate only): "
                f"per-sample tensors {self.shapes}, {ratio:.2f}x the first batch's elements per sample")


def scan(loader: Any, size_of: Any, *, max_batches: int, seconds: float) -> Scan:
    """The heaviest batch per sample among the first `max_batches` of `loader` (at most `seconds`)."""
    started = time.perf_counter()
    best = first = None
    count, complete, shapes = 0, False, set()
    with rng_preserved(loader):
        iterator = iter(loader)
        while count < max_batches and (count == 0 or time.perf_counter() - started < seconds):
            try:
                batch = next(iterator)
            except StopIteration:
                complete = True
                break
            count += 1
            size = size_of(batch)
            per_sample = load_of(batch, size) / size
            if first is None:
                first = per_sample
            if best is None or per_sample > best[2]:
                best = (batch, size, per_sample)
            if len(shapes) <= 1:
                shapes.add(_sample_shapes(batch, size))
                if count >= SAME_SHAPE_STOP and len(shapes) == 1:
                    break
    if best is None:
        raise ValueError("the train loader yielded no batch")
    return Scan(batch=best[0], size=best[1], shapes=shapes_of(best[0], best[1]), load_per_sample=best[2],
                first_load_per_sample=first or 0.0, scanned=count, seconds=time.perf_counter() - started,
                complete=complete, fixed=not complete and count == SAME_SHAPE_STOP and len(shapes) == 1)


def by_lengths(loader: Any, size_of: Any) -> Scan | None:
    """The heaviest batch the loader can produce, built without reading the loader where its dataset says how long
    each sample is: a map-style dataset with a `lengths` sequence (one number a sample, as bucketing samplers and
    `group_by_length` use) gives the loader's batch size of its longest samples, collated with the loader's own
    collate_fn. Under dynamic padding no batch is heavier per sample. None where the dataset has no usable
    `lengths` or building that batch fails (the caller then scans the loader)."""
    started = time.perf_counter()
    dataset = getattr(loader, "dataset", None)
    lengths = getattr(dataset, "lengths", None)
    if lengths is None or isinstance(dataset, torch.utils.data.IterableDataset) or callable(lengths):
        return None
    try:
        values = [float(v) for v in lengths]
        if len(values) != len(dataset) or not values:
            return None
        with rng_preserved(loader):
            first = next(iter(loader))
            size = loader.batch_size or size_of(first)
            longest = sorted(range(len(values)), key=lambda i: -values[i])[:size]
            batch = loader.collate_fn([dataset[i] for i in longest])
            size = size_of(batch)
            first_size = size_of(first)
    except Exception:  # a dataset or collate that cannot be read this way: the scan reads it as training would
        return None
    return Scan(batch=batch, size=size, shapes=shapes_of(batch, size), load_per_sample=load_of(batch, size) / size,
                first_load_per_sample=load_of(first, first_size) / first_size, scanned=1,
                seconds=time.perf_counter() - started, complete=True, from_lengths=len(values))


def heaviest(loader: Any, size_of: Any, *, max_batches: int, seconds: float) -> Scan:
    """The batch to plan for: from the dataset's lengths (by_lengths) where it has them, else the heaviest of a
    bounded scan of the loader (scan)."""
    return by_lengths(loader, size_of) or scan(loader, size_of, max_batches=max_batches, seconds=seconds)


def declared(batch: Any, size: int, max_shape: Any) -> Scan:
    """`batch` with the per-sample tensors `max_shape` names grown (values repeated along each dimension) or cut
    to the per-sample shapes declared: `{"input_ids": (2048,), "pixel_values": (3, 512, 512)}`, keyed as the
    batch holds them (a dict key, an attribute, a position) or by the path memplan prints (batch['input_ids'])."""
    from memplan.batching import map_named_tensors, named_tensors

    wanted = {str(k): tuple(v) for k, v in max_shape.items()}
    found: set[str] = set()

    def grow(path: str, t: torch.Tensor) -> torch.Tensor:
        key = next((k for k in wanted if path in (k, f"batch[{k!r}]", f"batch[{k}]", f"batch.{k}")), None)
        if key is None or t.dim() == 0 or t.shape[0] != size:
            return t
        found.add(key)
        shape = wanted[key]
        if len(shape) != t.dim() - 1:
            raise ValueError(f"MemoryPlanner(max_shape=...): {key!r} declares a per-sample shape {shape}, but "
                             f"{path} has {t.dim() - 1} dimension(s) a sample ({tuple(t.shape)})")
        for dim, n in enumerate(shape, start=1):
            t = t.index_select(dim, torch.arange(n, device=t.device) % t.shape[dim]) if t.shape[dim] else t.new_zeros(
                (*t.shape[:dim], n, *t.shape[dim + 1:]))
        return t.contiguous()

    grown = map_named_tensors(batch, grow)
    missing = [k for k in wanted if k not in found]
    if missing:
        have = ", ".join(p for p, t in named_tensors(batch) if t.dim() > 0 and t.shape[0] == size) or "none"
        raise ValueError(f"MemoryPlanner(max_shape=...): no per-sample tensor {missing[0]!r} in the batch (its "
                         f"per-sample tensors: {have}); key max_shape by those names")
    first = load_of(batch, size) / size
    return Scan(batch=grown, size=size, shapes=shapes_of(grown, size), load_per_sample=load_of(grown, size) / size,
                first_load_per_sample=first, scanned=1, seconds=0.0, complete=True, declared=True)


def chunk_for(batch_load_per_sample: float, planned_load_per_sample: float, micro_batch_size: int) -> int:
    """The micro-batch for a batch of `batch_load_per_sample`, where `micro_batch_size` was planned for
    `planned_load_per_sample`: as many samples as hold the planned load, at least 1."""
    if batch_load_per_sample <= planned_load_per_sample or planned_load_per_sample <= 0:
        return micro_batch_size
    return max(1, int(micro_batch_size * planned_load_per_sample / batch_load_per_sample))


@contextlib.contextmanager
def rng_preserved(loader: Any = None) -> Iterator[None]:
    """Restore torch's CPU generator, Python's and NumPy's on the way out: a DataLoader iterator draws its
    base seed from torch's, and datasets draw augmentations from any of them, so reading batches ahead of
    training would otherwise change what the training sees. With `loader`, the torch.Generators it draws from
    too (its own `generator=`, its sampler's, its batch sampler's sampler's): the user's objects, which the loader
    training iterates shares (a shuffled loader with a seeded generator of its own shuffled otherwise)."""
    generators: list[torch.Generator] = []
    for owner in (loader, getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler",
                                                                   None)):
        generator = getattr(owner, "generator", None) if owner is not None else None
        if isinstance(generator, torch.Generator) and all(generator is not g for g in generators):
            generators.append(generator)
    states = (torch.random.get_rng_state(), random.getstate(), _numpy_state(), [g.get_state() for g in generators])
    try:
        yield
    finally:
        torch.random.set_rng_state(states[0])
        random.setstate(states[1])
        _set_numpy_state(states[2])
        for generator, state in zip(generators, states[3]):
            generator.set_state(state)


def _numpy_state() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy.random.get_state()


def _set_numpy_state(state: Any) -> None:
    if state is not None:
        import numpy

        numpy.random.set_state(state)
