"""The two collectives of fit start: every rank's object to every rank, and one decision made on
rank 0 for all. (The per-check gather of readings is memplan.callback.adjust.gather_statuses, over gather_rows.)"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytorch_lightning as pl
import torch


def gather_objects(obj: Any) -> list[Any]:
    """`obj` from every rank, in rank order (just [obj] without torch.distributed)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [obj]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def decide_on_rank_zero(trainer: pl.Trainer, decide: Callable[[], Any]) -> Any:
    """Run `decide` on rank 0 and give every rank its result. An error there ends every rank (so none
    waits in the broadcast for a result that never comes): rank 0 raises it, the others raise its
    text (an exception may not survive pickling); hence the broad except, which swallows nothing."""
    result, error, failure = None, None, None
    if trainer.is_global_zero:
        try:
            result = decide()
        except Exception as err:  # re-raised below, on every rank
            error, failure = err, f"{type(err).__name__}: {err}"
    result, failure = trainer.strategy.broadcast((result, failure), src=0)
    if error is not None:
        raise error
    if failure is not None:
        raise RuntimeError(f"MemoryPlanner: planning on rank 0 failed: {failure}")
    return result


def gather_rows(strategy: Any, row: Sequence[float], world_size: int) -> list[list[float]]:
    """Each rank's row of numbers, in rank order, on every rank (one all-gather, one device sync). A single
    process gathers nothing: its row, as the gather would give it back (floats), without the device round
    trip, which on a GPU waits for every kernel queued before it (a whole step's, where the host runs ahead)."""
    if world_size == 1:
        return [[float(v) for v in row]]
    tensor = torch.tensor(list(row), dtype=torch.float64, device=strategy.root_device)
    return strategy.all_gather(tensor).reshape(world_size, -1).tolist()
