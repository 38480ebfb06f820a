"""What MemoryPlanner may change without changing what training computes, and the one argument that
allows the rest.

Two changes keep the global batch and yet can change the training:
- a *split*: each loaded batch run as micro-batch chunks inside training_step (a plan below the loader's
  batch, an OOM retried smaller). Exact when each chunk's loss is weighted by its share of what the
  loss reduces over (memplan.callback.loss_reduction) and nothing in the model looks across samples of
  the batch (BatchNorm does: it normalises over each chunk instead);
- a *rewrite*: the loader's batch size set to the micro-batch, with the accumulation raised to match.
  Lightning weighs every loaded batch 1/accumulate_grad_batches, which only a mean over samples makes
  exact; BatchNorm again sees other batches; under manual optimization nothing accumulates, so each
  optimizer step sees fewer samples; with `drop_last=True` the samples an epoch sees can change.
By default (exact=True) MemoryPlanner makes only the exact ones. Where the loss's reduction is unknown
it says so and names `loss_reduction=` / `mean_over=`, which declare it; for the rest `exact=False`
allows the change, each one then named in a warning and in the end-of-fit summary.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from memplan.callback.loss_reduction import LossReduction
from memplan.compat.torch import BatchNormBase

DECLARE = ("if training_step's loss is a mean over samples pass MemoryPlanner(loss_reduction='mean'), a sum over "
           "samples loss_reduction='sum', a mean over something else mean_over=callable(batch) -> what it "
           "averages over (e.g. lambda b: (b['labels'] != -100).sum())")


@dataclass(frozen=True, kw_only=True)
class Exactness:
    """What this fit may change (see the module docstring), and why not where it may not."""

    reduction: LossReduction
    """The loss's reduction: declared by the user, or recognised."""
    can_split: bool
    """Whether a loaded batch may run as chunks (a plan below the loader batch, OOM retries smaller)."""
    can_rewrite: bool
    """Whether the loader's batch size and the accumulation may be changed (the global batch kept)."""
    no_split: str | None = None
    """Why not, and the argument that allows it (None where a split is allowed)."""
    no_rewrite: str | None = None
    """Why not (None where a rewrite is allowed)."""

    @property
    def mean_over(self) -> Callable[[Any], Any] | None:
        """What each chunk's loss is weighted by, where not its share of the samples."""
        return self.reduction.count

    @property
    def loss_sum(self) -> bool:
        return self.reduction.kind == "sum"


def declared_reduction(loss_reduction: str, mean_over: Callable[[Any], Any] | None) -> LossReduction | None:
    """The reduction the user declared with MemoryPlanner(loss_reduction=, mean_over=); None for 'auto'."""
    if mean_over is not None:
        return LossReduction(kind="mean_count", describe="a mean over what MemoryPlanner(mean_over=) counts (declared)",
                             count=mean_over)
    if loss_reduction == "sum":
        return LossReduction(kind="sum", describe="a sum over samples (declared: loss_reduction='sum')")
    if loss_reduction == "mean":
        return LossReduction(kind="mean_samples", describe="a mean over samples (declared: loss_reduction='mean')")
    return None


def decide(reduction: LossReduction, module: torch.nn.Module, *, exact: bool, manual: bool) -> Exactness:
    """What may change for a model and its loss (the drop_last check comes with the layout: drop_last_blocks)."""
    norms = batch_norms(module)
    no_split = no_rewrite = None
    if manual:
        no_split = ("under manual optimization training_step runs its own backwards and optimizer steps, so a batch "
                    "cannot be split")
        if exact:
            no_rewrite = ("under manual optimization Lightning accumulates nothing: a smaller loader batch would give "
                          "each optimizer step fewer samples. Pass MemoryPlanner(exact=False) to allow it")
    elif not exact:
        pass  # the user allows every change; each is named in a warning (checks.split_caveats, rewrites)
    elif norms:
        no_split = no_rewrite = (f"the model's {', '.join(norms)} layers normalise over the batch they see, so a "
                                 "smaller batch or chunk trains differently. Pass MemoryPlanner(exact=False) to allow "
                                 "it")
    elif not reduction.known:
        no_split = no_rewrite = (f"memplan cannot tell how the loss reduces over the batch ({reduction.describe}): "
                                 f"{DECLARE}; or MemoryPlanner(exact=False) to weigh chunks by their samples anyway")
    elif reduction.kind != "mean_samples":
        no_rewrite = (f"the loss is {reduction.describe}, and Lightning's accumulation weighs every loaded batch "
                      "alike, which only a mean over samples makes exact")
    return Exactness(reduction=reduction, can_split=no_split is None, can_rewrite=no_rewrite is None,
                     no_split=no_split, no_rewrite=no_rewrite)


def batch_norms(module: torch.nn.Module) -> list[str]:
    """The class names of the model's BatchNorm layers (they normalise over the batch they see)."""
    return sorted({type(m).__name__ for m in module.modules() if isinstance(m, BatchNormBase)})


def drop_last_blocks(loader: Any, samples: int | None, before: int, after: int) -> str | None:
    """Why setting a `drop_last=True` loader's batch from `before` to `after` changes the samples an epoch
    sees (`samples` per rank per epoch, None when unknown), or None when it does not."""
    if not getattr(loader, "drop_last", False) or before == after:
        return None
    if samples is None:
        return (f"the train loader drops its last incomplete batch (drop_last=True) over a dataset of unknown "
                f"length, so a batch of {after} instead of {before} may change the samples each epoch sees")
    seen_before, seen_after = samples // before * before, samples // after * after
    if seen_before == seen_after:
        return None
    return (f"the train loader drops its last incomplete batch (drop_last=True): with a batch of {after} instead of "
            f"{before} each epoch would see {seen_after} of its {samples} samples instead of {seen_before}")


def epoch_blocks(trainer: Any, samples: int | None, before: int, after: int, drop_last: bool) -> str | None:
    """Why setting the loader's batch from `before` to `after` (its accumulation raised to match) changes what an epoch
    trains, besides drop_last (drop_last_blocks), or None when it does not: a last batch of fewer samples, which
    Lightning trains as one step's mean and would train as a few micro-batches weighed as a whole batch's part each
    (its gradient scaled down); and the Trainer's settings that count loaded batches (`samples` per rank per epoch,
    None when unknown)."""
    if before == after:
        return None
    if not drop_last and (samples is None or samples % before):
        tail = "an unknown number of samples" if samples is None else f"{samples % before} of its {samples} samples"
        return (f"the epoch's last batch may hold fewer than {before} samples ({tail}), which Lightning trains as one "
                f"step's mean; as batches of {after} accumulated it would weigh as a part of a step of {before}")
    limit = getattr(trainer, "limit_train_batches", 1.0)
    if isinstance(limit, int) or limit != 1.0:
        return (f"Trainer(limit_train_batches={limit}) counts loaded batches: with batches of {after} instead of "
                f"{before} each epoch would train other samples")
    interval = getattr(trainer, "val_check_interval", 1.0)
    if isinstance(interval, int):
        return (f"Trainer(val_check_interval={interval}) counts loaded batches: with batches of {after} instead of "
                f"{before} validation would run {before / after:g} times as often")
    return None
