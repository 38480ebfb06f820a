"""The estimator the planner calls in practice: memplan.estimate with the model and batch bound.

Kept apart from the search so that the planner itself stays pure (tests pass simulated estimators).
Nothing here runs until the planner calls it.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from memplan.planner.search import Estimator


def estimator_for(model: Any, batch: Any, *, loss: Callable | None = None, optimizer: Any = None,
                  device: Any = None) -> Estimator:
    """An Estimator tracing `model` on `batch` resized to each micro-batch (memplan.batching), with
    strategy='ddp' for world_size > 1. `model`, `loss`, `optimizer` and `device` are as in
    memplan.estimate; build the model on meta or pass a callable so that no weights are allocated.
    The resized batch is made of real tensors in host memory (the trace itself allocates nothing)."""

    def estimate_at(*, micro_batch_size: int, precision: str, checkpointing: bool, world_size: int):
        from memplan.batching import resize_batch
        from memplan.estimator import estimate

        return estimate(model, resize_batch(batch, micro_batch_size), loss=loss, optimizer=optimizer,
                        precision=precision, checkpointing=checkpointing, device=device,
                        strategy="ddp" if world_size > 1 else None, world_size=world_size)

    return estimate_at


def largest_block_bytes(model: Any) -> int | None:
    """Parameter bytes of the model's largest repeated block (what checkpointing=True wraps), for
    PlanRequest.largest_block_bytes; None when the model has no repeated blocks. Works on a meta model."""
    from memplan.estimator.checkpointing import find_repeated_blocks

    blocks = find_repeated_blocks(model)
    if not blocks:
        return None
    return max(sum(p.numel() * p.element_size() for p in block.parameters()) for _, block in blocks)
