"""Checks MemoryPlanner makes before it runs: its arguments (at construction), the Trainer (at setup),
and a checkpoint's layout (at fit start). Each error names the fix."""
from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities.rank_zero import rank_zero_warn
from pytorch_lightning.utilities.signature_utils import is_param_in_hook_signature

from memplan import compat
from memplan.callback.framework import (
    DDP_STRATEGIES, FSDP_STRATEGIES, MODEL_PARALLEL_STRATEGIES, SINGLE_DEVICE_STRATEGIES, MisconfigurationException,
)
from memplan.callback.exactness import batch_norms
from memplan.callback.layout import Layout


ADJUST_FIX = "pass MemoryPlanner(adjust=False) to apply the plan and watch memory only"
CHUNKS_FIX = ("let the loader yield the plan's micro-batch (give the model or datamodule the batch-size attribute "
              "MemoryPlanner sets, batch_arg_name), so no batch has to be split")


def check_can_adjust(trainer: pl.Trainer, pl_module: pl.LightningModule, fix: str = ADJUST_FIX) -> None:
    """Chunking and per-rank OOM retries need one synchronised backward per batch and no collective
    in the forward: single-device or DDP (without static_graph), automatic optimization, a batch to
    split, no SyncBatchNorm."""
    if not isinstance(trainer.strategy, SINGLE_DEVICE_STRATEGIES + DDP_STRATEGIES + FSDP_STRATEGIES
                      + MODEL_PARALLEL_STRATEGIES):
        raise MisconfigurationException(f"MemoryPlanner adjusts micro-batches under single-device, DDP and FSDP "
                                        f"(FSDPStrategy, ModelParallelStrategy) strategies, not "
                                        f"{type(trainer.strategy).__name__}: {fix}")
    if not pl_module.automatic_optimization:
        raise MisconfigurationException(f"MemoryPlanner adjusts micro-batches under automatic optimization; "
                                        f"this module optimizes manually: {fix}")
    if is_param_in_hook_signature(pl_module.training_step, "dataloader_iter", explicit=True):
        raise MisconfigurationException(f"MemoryPlanner splits the batch training_step receives; this "
                                        f"training_step takes a dataloader_iter: {fix}")
    if _ddp_option(trainer, "static_graph"):
        raise MisconfigurationException(
            "DDP's static_graph=True counts each parameter's gradient hooks over the first iteration, the "
            "micro-batch backwards MemoryPlanner runs under no_sync included, and then skips the all-reduce "
            f"of later steps without an error: drop static_graph=True, or {fix}")
    if compat.layer_sync(trainer.strategy) is not None or any(
            isinstance(m, torch.nn.SyncBatchNorm) for m in pl_module.modules()):
        raise MisconfigurationException(f"SyncBatchNorm synchronises every forward, so every rank must run the "
                                        f"same number of micro-batches, which a rank retrying an OOM does not: {fix}")


def check_gradient_hooks(pl_module: pl.LightningModule, fix: str = ADJUST_FIX) -> None:
    """Micro-batches hand their gradients over in one backward (memplan.callback.chunking), so a
    parameter's gradient hook would run once per micro-batch and again on the whole gradient."""
    hooked = [name for name, p in pl_module.named_parameters()
              if p.requires_grad and compat.has_gradient_hooks(p)]
    if hooked:
        more = f" and {len(hooked) - 3} more" if len(hooked) > 3 else ""
        raise MisconfigurationException(
            f"MemoryPlanner runs micro-batches inside training_step and hands their gradients over in one backward, "
            f"so the gradient hooks (register_hook / register_post_accumulate_grad_hook) on parameter(s) "
            f"{', '.join(hooked[:3])}{more} would run once per micro-batch and again on the whole gradient: "
            f"remove them, or {fix}")


def guard_blocker(trainer: pl.Trainer, guard: str) -> str | None:
    """Why this Trainer's backwards cannot be guarded (memplan.callback.chunking), or None; with
    guard='always', which cannot then be honoured, MisconfigurationException."""
    blocker = None
    if _ddp_option(trainer, "gradient_as_bucket_view"):
        blocker = ("DDP's gradient_as_bucket_view=True: handing a guarded step's gradients over would copy them "
                   "out of DDP's buckets, one more gradient's worth of memory at the step's peak")
    if blocker is not None and guard == "always":
        raise MisconfigurationException(f"MemoryPlanner(guard='always') cannot guard backwards under {blocker}: "
                                        "use guard='auto', or drop gradient_as_bucket_view")
    return blocker


def _ddp_option(trainer: pl.Trainer, name: str) -> Any:
    """A DistributedDataParallel argument the Trainer's DDP strategy was given (None elsewhere)."""
    strategy = trainer.strategy
    return compat.ddp_kwargs(strategy).get(name) if isinstance(strategy, DDP_STRATEGIES) else None


def restored_layout(state: dict[str, Any] | None, world_size: int) -> Layout | None:
    """The layout a checkpoint kept (MemoryPlanner.state_dict), if it is for this world size."""
    if not state or "micro_batch_size" not in state:
        return None
    if state.get("world_size") != world_size:
        rank_zero_warn(f"MemoryPlanner: the checkpoint's layout is for {state.get('world_size')} ranks, this run "
                       f"has {world_size}; planning afresh instead of resuming it")
        return None
    return Layout.from_dict(state)


def split_caveats(pl_module: pl.LightningModule, exactness: Any) -> str:
    """What a batch split into chunks keeps exact, and what it cannot, in words."""
    reduction = exactness.reduction
    weighted = {"sum": "summed", "mean_count": "weighted by each chunk's share of what the mean is over",
                "mean_samples": "weighted by each chunk's share of the samples"}.get(reduction.kind,
                                                                                  "weighted by each chunk's share of the samples")
    norms = batch_norms(pl_module)
    if exactness.no_split is None and reduction.known and not norms:
        return (f"The loss is {reduction.describe}: chunk losses are {weighted}, so the chunks train as the whole "
                "batch does (a loss comparing samples within the batch, such as in-batch negatives, would not).")
    batch_norm = (f" The model's {', '.join(norms)} layers normalise over each chunk, not the batch (their "
                  "statistics differ)." if norms else "")
    return (f"MemoryPlanner(exact=False): chunk losses are {weighted} (the loss: {reduction.describe}), which trains as "
            f"the whole batch does only for such a loss.{batch_norm} A loss that compares samples within the batch "
            "(contrastive, in-batch negatives, ranking) sees only its chunk and is not the same.")
