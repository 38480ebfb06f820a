"""DistributedDataParallel's gradient buckets, which live beside the `.grad` tensors.

With the default `gradient_as_bucket_view=False`, the Reducer keeps one flat buffer per bucket that
holds a copy of the gradients for all-reduce (torch/nn/parallel/distributed.py, `_ddp_init_helper`;
torch/csrc/distributed/c10d/reducer.cpp `initialize_buckets`): one extra gradient's worth of memory,
allocated at wrap time, in buckets of `bucket_cap_mb` (25 MiB) after a first 1 MiB bucket
(`dist._DEFAULT_FIRST_BUCKET_BYTES`), filled in reverse parameter order, one dtype per bucket.
"""
from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from memplan.units import MiB

FIRST_BUCKET_BYTES = 1 * MiB
BUCKET_CAP_BYTES = 25 * MiB


def ddp_bucket_bytes(
    params: Sequence[nn.Parameter], *, bucket_cap_bytes: int = BUCKET_CAP_BYTES
) -> list[int]:
    """Sizes of the Reducer's bucket buffers for these parameters (those requiring grad)."""
    buckets: list[int] = []
    open_by_dtype: dict = {}
    limit_index: dict = {}
    for p in reversed([p for p in params if p.requires_grad]):
        nbytes = p.numel() * p.element_size()
        current = open_by_dtype.get(p.dtype, 0) + nbytes
        index = limit_index.get(p.dtype, 0)
        limit = FIRST_BUCKET_BYTES if index == 0 else bucket_cap_bytes
        if current >= limit:
            buckets.append(current)
            open_by_dtype[p.dtype] = 0
            limit_index[p.dtype] = index + 1
        else:
            open_by_dtype[p.dtype] = current
    buckets.extend(size for size in open_by_dtype.values() if size)
    return buckets
