"""The batch pytree: walk, map, size and split any batch Lightning accepts.

A batch is a tensor, or tensors nested in tuples, lists, dicts (any Mapping), namedtuples and
dataclasses; anything else (strings, numbers, None) is a leaf that travels as it is. The batch size is
the leading dimension most of its tensors share; a tensor whose first dimension is the batch size is
per-sample (split along dim 0, resized), any other tensor is per-batch (class weights, a shared mask, a
scalar) and travels whole. A list or tuple holding no tensor (ids, file names, raw texts: what a
collate function puts beside the tensors) whose length is the batch size is per-sample too, split and
resized with the tensors; one of another length travels whole. Where these rules guess wrong (a
per-batch tuple that happens to be as long as the batch), MemoryPlanner's `batch_size_of` and
`split_batch` are the hooks to override.
"""
from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch


def _is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`obj` with fn applied to every tensor in it; containers are rebuilt as their own type (dict,
    OrderedDict, transformers' BatchEncoding, namedtuples; dataclasses copied with the fields replaced,
    which keeps fields outside __init__ and frozen ones, as Lightning's apply_to_collection)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (Mapping, list, tuple)) or _is_dataclass_instance(obj):
        return _map_children(obj, lambda child: map_tensors(child, fn))
    return obj


def named_tensors(obj: Any, path: str = "batch") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in `obj` with where it sits, as the user would write it: batch['ids'], batch[0], batch.x."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from named_tensors(v, f"{path}[{k!r}]")
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):
        for name, v in zip(obj._fields, obj):
            yield from named_tensors(v, f"{path}.{name}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from named_tensors(v, f"{path}[{i}]")
    elif _is_dataclass_instance(obj):
        for field in dataclasses.fields(obj):
            yield from named_tensors(getattr(obj, field.name), f"{path}.{field.name}")


def map_named_tensors(obj: Any, fn: Callable[[str, torch.Tensor], Any], path: str = "batch") -> Any:
    """`obj` with fn(path, tensor) applied to every tensor, paths as named_tensors names them; containers
    rebuilt as in map_tensors."""
    if isinstance(obj, torch.Tensor):
        return fn(path, obj)
    if isinstance(obj, Mapping):
        return _rebuilt(obj, {k: map_named_tensors(v, fn, f"{path}[{k!r}]") for k, v in obj.items()})
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_named_tensors(v, fn, f"{path}.{n}") for n, v in zip(obj._fields, obj)))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_named_tensors(v, fn, f"{path}[{i}]") for i, v in enumerate(obj))
    if _is_dataclass_instance(obj):
        out = copy.copy(obj)
        for field in dataclasses.fields(obj):
            object.__setattr__(out, field.name, map_named_tensors(getattr(obj, field.name), fn, f"{path}.{field.name}"))
        return out
    return obj


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in `obj`, in order."""
    return (t for _, t in named_tensors(obj))


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in `obj` (numel x element size)."""
    return sum(t.numel() * t.element_size() for t in iter_tensors(obj))


def _fields(batch: Any) -> str:
    shown = [f"{path} {tuple(t.shape)}" for path, t in named_tensors(batch)]
    return ", ".join(shown[:8]) + (f" and {len(shown) - 8} more" if len(shown) > 8 else "") if shown else "none"


def batch_size_of(batch: Any) -> int:
    """The batch size: the leading dimension shared by most of the batch's tensors with a dimension.
    ValueError naming the fields when no tensor has one, or when two sizes tie."""
    counts = Counter(t.shape[0] for t in iter_tensors(batch) if t.dim() > 0)
    if not counts:
        raise ValueError(
            f"batch: cannot tell its batch size: no tensor in it has a batch dimension (tensors: {_fields(batch)}; "
            f"a {type(batch).__name__} batch). Put the per-sample data in tensors whose first dimension is the "
            "batch size, or override MemoryPlanner.batch_size_of and split_batch"
        )
    (size, most), *rest = counts.most_common()
    if rest and rest[0][1] == most:
        tied = sorted(s for s, n in counts.items() if n == most)
        raise ValueError(
            f"batch: cannot tell its batch size: the leading dimensions of its tensors are {tied}, each shared by "
            f"{most} tensor(s) ({_fields(batch)}). Override MemoryPlanner.batch_size_of (and split_batch) to say "
            "which is the batch dimension"
        )
    return size


def _is_per_sample_list(obj: Any, size: int) -> bool:
    """A list or tuple (not a namedtuple) of `size` values with no tensor in them: one value a sample."""
    return (isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields") and len(obj) == size
            and next(iter_tensors(obj), None) is None)


def map_samples(obj: Any, size: int, on_tensor: Callable[[torch.Tensor], Any],
                on_list: Callable[[list | tuple], Any]) -> Any:
    """`obj` with `on_tensor` applied to every tensor and `on_list` to every per-sample list or tuple
    (one holding no tensor, of length `size`); containers rebuilt as in map_tensors."""
    if _is_per_sample_list(obj, size):
        return on_list(obj)
    if isinstance(obj, torch.Tensor):
        return on_tensor(obj)
    if isinstance(obj, (Mapping, list, tuple)) or _is_dataclass_instance(obj):
        return _map_children(obj, lambda child: map_samples(child, size, on_tensor, on_list))
    return obj


def _map_children(obj: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(obj, Mapping):
        return _rebuilt(obj, {k: fn(v) for k, v in obj.items()})
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(fn(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(fn(v) for v in obj)
    out = copy.copy(obj)
    for field in dataclasses.fields(obj):
        object.__setattr__(out, field.name, fn(getattr(obj, field.name)))
    return out


def _rebuilt(obj: Mapping, mapped: dict) -> Mapping:
    """A mapping of obj's own type holding `mapped` (a plain dict where the type cannot be built from one)."""
    try:
        return type(obj)(mapped)
    except TypeError:
        return mapped


def split_batch(batch: Any, start: int, stop: int, size: int) -> Any:
    """Samples [start, stop) of a batch of `size`: every tensor whose first dimension is `size` sliced
    along it (a view, no copy), every per-sample list or tuple sliced, every other value as it is."""
    return map_samples(batch, size, lambda t: t[start:stop] if t.dim() > 0 and t.shape[0] == size else t,
                       lambda values: values[start:stop])


def resize_batch(batch: Any, size: int) -> Any:
    """The batch with `size` samples: the first `size` rows, or the rows repeated cyclically when it
    has fewer (per-sample lists alike). Tensors without the batch dimension (scalars, shared masks) are
    kept as they are."""
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"batch size must be a positive int; got {size!r}")
    current = batch_size_of(batch)
    if size == current:
        return batch

    def resize(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or t.shape[0] != current:
            return t
        if size < current:
            return t[:size].clone()
        # written once into a tensor of exactly `size` rows (contiguous, as repeat-then-clone gave it): a planner
        # resizing a few samples to a micro-batch of 2**19 made that copy twice, most of `memplan suggest`'s time
        whole, part = divmod(size, current)
        out = t.new_empty((size, *t.shape[1:]))
        out[: whole * current].view(whole, *t.shape).copy_(t.unsqueeze(0).expand(whole, *t.shape))
        out[whole * current:].copy_(t[:part])
        return out

    return map_samples(batch, current, resize, lambda values: type(values)(values[i % current] for i in range(size)))
