"""Resize an example batch to another micro-batch size, so one batch can be estimated at any size."""
from __future__ import annotations

from typing import Any

import torch

from memplan.estimator.step import iter_tensors, map_tensors


def batch_size_of(batch: Any) -> int:
    """The batch dimension: the leading size shared by the batch's tensors with at least one dimension."""
    sizes = {t.shape[0] for t in iter_tensors(batch) if t.dim() > 0}
    if len(sizes) != 1:
        found = sorted(sizes) if sizes else "no tensor with a dimension"
        raise ValueError(
            f"batch: cannot tell its batch size: the leading dimensions of its tensors are {found}; "
            "every tensor in the batch must have the batch size as its first dimension"
        )
    return sizes.pop()


def resize_batch(batch: Any, size: int) -> Any:
    """The batch with `size` samples: the first `size` rows, or the rows repeated cyclically when it
    has fewer. Tensors without the batch dimension (scalars, shared masks) are kept as they are."""
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
        reps = -(-size // current)
        return t.repeat(reps, *([1] * (t.dim() - 1)))[:size].clone()

    return map_tensors(batch, resize)
