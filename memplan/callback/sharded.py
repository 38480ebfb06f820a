"""MemoryPlanner under FSDP: Lightning's ModelParallelStrategy (FSDP2, `fully_shard` applied in the
user's `configure_model`) and FSDPStrategy (FSDP1, `FullyShardedDataParallel`).

A batch split into chunks runs as under DDP (memplan.callback.chunking), with one difference: DDP
all-reduces once, in Lightning's backward of the carrier, while FSDP reduce-scatters in the backward
of the module's own forward. So the chunks but the last run with FSDP's gradient sync off (FSDP2:
`set_requires_gradient_sync(False)` on every fully_shard'ed module, the part DDP's `no_sync` plays;
FSDP1: `FullyShardedDataParallel.no_sync()`), each rank keeping its unsharded gradients; the last
chunk's backward runs with the sync on and reduce-scatters the sum of them all into the sharded
gradients. The carrier then hands those sharded gradients to Lightning's backward, past Lightning's
`zero_grad`, as under DDP.

Lightning itself does not block FSDP's sync while it accumulates batches (its `block_backward_sync`
acts on DDP only): every loaded batch reduce-scatters, and MemoryPlanner leaves that as it is; the
sync is off only inside one batch, between its chunks, and on again (True, Lightning's state) after.

What FSDP does not allow (each said once, by name, at setup):
  - An OOM cannot be retried on one rank: every forward and backward all-gathers and reduce-scatters
    block by block, so a rank that stops mid-step leaves the others inside a collective, and one that
    re-runs a chunk would pair its all-gathers with the others' next ones. Under FSDP MemoryPlanner
    lowers the micro-batch from readings (all ranks at once, every rank running the same chunks) and
    an OOM ends the run with its figures logged.
  - Every rank must run the same chunks, so a batch runs whole or split alike on all ranks (the
    micro-batch is a shared decision; no rank lowers its own).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from torch import nn

from memplan.callback.framework import FSDP_STRATEGIES, MODEL_PARALLEL_STRATEGIES, MisconfigurationException

NO_RETRY = ("MemoryPlanner does not retry an OOM under {strategy}: every forward and backward all-gathers and "
            "reduce-scatters block by block, so a rank that re-ran part of a batch would leave the others waiting in "
            "a collective, or pair its all-gathers with their next ones. It lowers the micro-batch of all ranks at "
            "once when a reading shows less than `margin` free (raise margin= for inputs whose size varies), and "
            "an OOM ends the run with its figures in the per-rank log")


def is_sharded(strategy: Any) -> bool:
    """Whether the Trainer's strategy is one of Lightning's FSDP strategies."""
    return isinstance(strategy, FSDP_STRATEGIES + MODEL_PARALLEL_STRATEGIES)


def strategy_name(strategy: Any) -> str:
    """The strategy as a user names it: 'ModelParallelStrategy (FSDP2)' or 'FSDPStrategy (FSDP1)'."""
    if isinstance(strategy, MODEL_PARALLEL_STRATEGIES):
        return "ModelParallelStrategy (FSDP2)"
    return "FSDPStrategy (FSDP1)"


def refuse_guard_always(strategy: Any, guard: str) -> None:
    """MemoryPlanner(guard='always') asks for what FSDP cannot do: MisconfigurationException."""
    if guard == "always":
        raise MisconfigurationException(f"MemoryPlanner(guard='always') retries the OOM of every backward, which "
                                        f"{strategy_name(strategy)} cannot (its collectives run block by block on "
                                        "every rank): use guard='auto'")


def fully_sharded_modules(module: nn.Module) -> list[nn.Module]:
    """The modules `fully_shard` was applied to (FSDP2), outermost first."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def gradient_sync_off(strategy: Any, module: nn.Module) -> Callable[[], contextlib.AbstractContextManager]:
    """A context-manager factory under which FSDP does not reduce gradients (the non-last chunks of a
    batch); MisconfigurationException when the strategy's model has no FSDP to switch."""
    if isinstance(strategy, MODEL_PARALLEL_STRATEGIES):
        sharded = fully_sharded_modules(module)
        if not sharded:
            raise MisconfigurationException(
                "MemoryPlanner runs a split batch's chunks with FSDP2's gradient sync off, and this "
                "ModelParallelStrategy model has no module fully_shard was applied to: apply "
                "torch.distributed.fsdp.fully_shard in configure_model (each repeated block, then the root, as in "
                "Lightning's ModelParallelStrategy examples), or pass MemoryPlanner(adjust=False) with a plan whose "
                "micro-batch is the loader's batch")
        return lambda: _RequiresGradientSyncOff(sharded)
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = strategy.model
    if not isinstance(model, FullyShardedDataParallel):
        raise MisconfigurationException(
            f"MemoryPlanner runs a split batch's chunks under FullyShardedDataParallel.no_sync(), and this "
            f"FSDPStrategy's model is a {type(model).__name__}, not FullyShardedDataParallel: pass "
            "MemoryPlanner(adjust=False) with a plan whose micro-batch is the loader's batch")
    return model.no_sync


class _RequiresGradientSyncOff:
    """FSDP2's gradient sync off on each fully_shard'ed module for the block, on again (Lightning's
    state: it reduces every batch) after. A class, not a generator: it runs for every chunk."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self._modules = modules

    def __enter__(self) -> None:
        for module in self._modules:
            module.set_requires_gradient_sync(False, recurse=False)

    def __exit__(self, *exc: Any) -> None:
        for module in self._modules:
            module.set_requires_gradient_sync(True, recurse=False)

