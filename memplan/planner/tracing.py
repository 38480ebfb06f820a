"""The estimator the planner calls in practice: memplan.estimate with the model and batch bound.

Kept apart from the search so that the planner itself stays pure (tests pass simulated estimators).
Nothing here runs until the planner calls it.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from memplan.planner.search import Estimator


def estimator_for(model: Any, batch: Any, *, loss: Callable | None = None, optimizer: Any = None,
                  device: Any = None, resize: Callable[[Any, int], Any] | None = None,
                  deterministic: Any = None) -> Estimator:
    """An Estimator tracing `model` on `batch` resized to each micro-batch (`resize(batch, size)`, by
    default memplan.batching.resize_batch; MemoryPlanner passes one built on its `split_batch` hook), with
    strategy='ddp' for world_size > 1
    (strategy='fsdp' when the planner passes FSDP settings). `model`, `loss`, `optimizer`, `device` and
    `deterministic` are as in memplan.estimate (`deterministic`, the run's, is resolved and checked here, once:
    None, this process's setting); build the model on meta or pass a callable so that no weights are allocated.
    The resized batch is made of real tensors in host memory (the trace itself allocates nothing)."""
    from memplan.estimator.determinism import resolve_deterministic

    deterministic = resolve_deterministic(deterministic)

    def estimate_at(*, micro_batch_size: int, precision: str, checkpointing: bool, world_size: int, fsdp=None):
        from memplan.batching import resize_batch
        from memplan.estimator import estimate

        strategy = "fsdp" if fsdp is not None else ("ddp" if world_size > 1 else None)
        return estimate(model, (resize or resize_batch)(batch, micro_batch_size), loss=loss, optimizer=optimizer,
                        precision=precision, checkpointing=checkpointing, device=device,
                        strategy=strategy, world_size=world_size, fsdp=fsdp, deterministic=deterministic)

    return estimate_at


def largest_block_bytes(model: Any) -> int | None:
    """Parameter bytes of the model's largest repeated block (what checkpointing=True wraps), for
    PlanRequest.largest_block_bytes; None when the model has no repeated blocks. Works on a meta model."""
    from memplan.estimator.checkpointing import find_repeated_blocks

    return _largest(find_repeated_blocks(model))


def _largest(blocks: list) -> int | None:
    if not blocks:
        return None
    return max(sum(p.numel() * p.element_size() for p in block.parameters()) for _, block in blocks)


def block_classes(model: Any) -> tuple[str, ...]:
    """Import paths of the model's repeated block classes (FSDP's wrap policy), for
    PlanRequest.block_classes; empty when the model has none. Works on a meta model."""
    from memplan.estimator.checkpointing import find_repeated_blocks

    return _classes(find_repeated_blocks(model))


def _classes(blocks: list) -> tuple[str, ...]:
    return tuple(dict.fromkeys(f"{type(block).__module__}.{type(block).__qualname__}" for _, block in blocks))


def tokens_per_sample(batch: Any) -> int:
    """Sequence positions per sample: the second dimension of the batch's first integer tensor of
    two or more dimensions (token ids), else 1. For the compute time in costs.py."""
    import torch

    from memplan.batching import iter_tensors

    for t in iter_tensors(batch):
        if t.dim() >= 2 and not t.is_floating_point() and t.dtype != torch.bool:
            return int(t.shape[1])
    return 1


def model_facts(model: Any, *, allow_checkpointing: bool) -> dict[str, Any]:
    """The PlanRequest fields that come from the model itself, for `suggest` (a fake skeleton) and MemoryPlanner
    (the user's module) alike: its repeated blocks (how many, their classes, the largest one's parameter bytes),
    what it checkpoints itself (then kept, and no checkpointing of memplan's allowed), its parameter count and
    bytes. `allow_checkpointing`: whether the caller allows checkpointing at all."""
    from memplan.estimator.checkpointing import find_repeated_blocks, own_checkpointing

    blocks = find_repeated_blocks(model)
    own = own_checkpointing(model)
    parameters = list(model.parameters())
    return dict(repeated_blocks=len(blocks), user_checkpointing=own,
                allow_checkpointing=allow_checkpointing and own is None,
                largest_block_bytes=_largest(blocks), block_classes=_classes(blocks),
                parameter_count=sum(p.numel() for p in parameters) if blocks else None,
                parameter_bytes=sum(p.numel() * p.element_size() for p in parameters))
