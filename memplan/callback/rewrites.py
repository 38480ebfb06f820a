"""The user's settings MemoryPlanner changes, said out loud: one rank-zero warning per change, before
-> after, repeated in the end-of-fit summary; `MemoryPlanner(strict=True)` refuses them instead.

A setting is what the user wrote: the batch-size attribute the train loader reads, the Trainer's
`accumulate_grad_batches`, activation checkpointing. The micro-batch chunks a loaded batch runs as
are not a setting: they change neither the data order nor the global batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pytorch_lightning.utilities.rank_zero import rank_zero_warn

from memplan.callback.framework import MisconfigurationException
from memplan.callback.layout import Layout


@dataclass(frozen=True, kw_only=True)
class Rewrite:
    """One of the user's settings, changed by MemoryPlanner."""

    setting: str
    """The setting as the user wrote it, e.g. `Trainer(accumulate_grad_batches=...)`."""
    before: Any
    """Its value as the user set it."""
    after: Any
    """Its value from now on."""
    why: str
    """Why, in words."""

    def describe(self) -> str:
        """One line for people."""
        return f"{self.setting}: {self.before} -> {self.after} ({self.why})"

    def to_dict(self) -> dict[str, Any]:
        """Plain values, for the per-rank log."""
        return {"setting": self.setting, "before": self.before, "after": self.after, "why": self.why}


def layout_rewrites(trainer: Any, module: Any, layout: Layout, *, source: str, batch_arg_name: str | None,
                    loader_batch_size: int, checkpointing_on: bool) -> list[Rewrite]:
    """What applying `layout` changes: `batch_arg_name` is the attribute MemoryPlanner sets (None: the
    loader keeps its batch), `loader_batch_size` the batch it yields now."""
    why = f"the layout {source}: {layout.describe()}"
    found = []
    if batch_arg_name is not None and loader_batch_size != layout.loader_batch_size:
        found.append(Rewrite(setting=f"`{batch_arg_name}` (the train loader's batch size)", before=loader_batch_size,
                             after=layout.loader_batch_size, why=why))
    if trainer.accumulate_grad_batches != layout.accumulate_grad_batches:
        found.append(Rewrite(setting="Trainer(accumulate_grad_batches=...)", before=trainer.accumulate_grad_batches,
                             after=layout.accumulate_grad_batches, why=why))
    if layout.gradient_checkpointing and not checkpointing_on:
        found.append(Rewrite(setting="activation checkpointing", before="off", after=layout.checkpointing or "on", why=why))
    return found


def checkpointing_rewrite(step: int, reason: str) -> Rewrite:
    """Checkpointing turned on mid-run by a shared decision (at micro-batch 1, still short of memory)."""
    return Rewrite(setting="activation checkpointing", before="off", after="on", why=f"at step {step}: {reason}")


def announce(rewrites: list[Rewrite], *, strict: bool) -> None:
    """Warn once per rewrite (rank zero); with strict=True refuse the first one instead."""
    for rewrite in rewrites:
        if strict:
            raise MisconfigurationException(
                f"MemoryPlanner(strict=True) does not change your settings, and the plan changes "
                f"{rewrite.describe()}. Set {rewrite.setting} to {rewrite.after} yourself, give a plan that keeps "
                "it, or drop strict=True")
        rank_zero_warn(f"MemoryPlanner changes {rewrite.describe()}")


def summary_lines(rewrites: list[Rewrite], mismatches: list[str]) -> list[str]:
    """The end-of-fit summary's account of what was changed and what did not match the plan."""
    return ([f"changed {r.describe()}" for r in rewrites]
            + [f"plan mismatch: {m}" for m in mismatches])


def checkpointing_is_on(module: Any) -> bool:
    """Whether the model has activation checkpointing on already (its own switch, memplan's wrapper, or
    torch's checkpoint_wrapper)."""
    return any(getattr(m, "is_gradient_checkpointing", False) is True or getattr(m, "_memplan_checkpointed", False)
               or type(m).__name__ == "CheckpointWrapper"  # torch's, e.g. FSDPStrategy's activation_checkpointing_policy
               for m in module.modules())


def users_hyper_parameters(checkpoint: dict[str, Any], saved: tuple[str, Any] | None) -> None:
    """A checkpoint's saved hyper-parameters (the model's and the datamodule's) with the batch size the user set:
    memplan's own state in the checkpoint restores its layout on a resume with it, and a model loaded without memplan
    then trains at the global batch the user chose, not at memplan's loader batch without its accumulation."""
    if saved is None:
        return
    name, value = saved
    for key in ("hyper_parameters", "datamodule_hyper_parameters"):
        params = checkpoint.get(key)
        if isinstance(params, dict) and name in params:
            params[name] = value
