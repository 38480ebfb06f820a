"""One fit's state: made in MemoryPlanner.setup (replacing the last fit's), closed in teardown (kept for
a state_dict after the fit: `trainer.save_checkpoint`), so a callback reused for another fit (or another
model) starts afresh and its settings (memplan.callback.settings) never change."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from memplan.callback.adjust import Adjuster
from memplan.callback.chunking import MicroBatchRunner
from memplan.callback.loss_reduction import LossReduction, LossWatcher
from memplan.callback.logger_rows import LoggerRows
from memplan.callback.rank_log import RankLog
from memplan.shapes import Scan
from memplan.plan import Plan


def _no_logger_row() -> int:
    return 0


@dataclass(kw_only=True)
class FitSession:
    """What one fit holds besides the callback's public results (plan, layout, log_path, changes,
    rewrites, exactness)."""

    adjusting: bool
    """Whether this fit adjusts (the setting, less what the fit rules out: manual optimization)."""
    data_parallel: int = 1
    """Ranks that train different samples (memplan.callback.mesh.data_parallel_size): the world size, or
    a ModelParallelStrategy's data-parallel mesh size. The global batch, the layout and the plan count by it."""
    restored: dict[str, Any] | None = None
    """MemoryPlanner.state_dict from the checkpoint this fit resumes, if any."""
    given_plan: Plan | None = None
    """The plan given as an argument, loaded."""
    setup_plan: Plan | None = None
    """FSDP: the plan made at setup, before configure_model."""
    setup_failure: Exception | None = None
    """ModelParallelStrategy with tensor-parallel ranks: why planning at setup failed, raised at fit start unless
    the configured model is refused first for its tensor parallelism (memplan.callback.mesh)."""
    scan: Scan | None = None
    """The batch planned for, when planning at fit start."""
    watcher: LossWatcher | None = None
    """While the first planning trace runs."""
    reduction: LossReduction | None = None
    """The loss's reduction, recognised or declared, once known."""
    batch_now: Any = None
    """The batch of the check in progress (for a first decision whether a split is exact)."""
    runner: MicroBatchRunner | None = None
    adjuster: Adjuster | None = None
    log: RankLog | None = None
    rows: LoggerRows = field(default_factory=LoggerRows)
    has_loggers: bool = False
    row_step: Callable[[], int] = _no_logger_row
    """The step index of Lightning's logger row (compat.logger_row_getter); module-level default (ddp_spawn)."""
    every: int = 1
    """Steps between checks."""
    last_step: int = 0
    record_next: bool = True
    """The first step, and the step after a change, are always recorded."""
    sampled: bool = False
    planned_micro_batch_size: int = 0
    settable: bool | None = None
    """Whether the batch-size attribute sets the train loader's batch (decided at the first need)."""
    user_batch_size: tuple[str, Any] | None = None
    """(attribute, value) of the loader's batch size as the user set it, where fit start sets it: what the
    hyper-parameters of each checkpoint saved say (a model loaded without memplan trains at the user's global batch;
    memplan's own state in the checkpoint restores its layout on a resume with it)."""
    first_batch_seen: bool = False
    oom_retries_seen: int = 0
    peak_process_bytes: int | None = None
    min_headroom_bytes: int | None = None
    apply_record: dict[str, Any] | None = None
    """The apply record, made at fit start, written when training starts (at its real step)."""
    mismatches: list[str] = field(default_factory=list)
    """How the Trainer differs from the given plan, in words."""


class CallbackState:
    """What MemoryPlanner's parts (callback.fit_start, callback.watching) read and set on the callback: its
    settings, this fit's session, and the public results."""

    settings: Any  # memplan.callback.settings.PlannerSettings
    _fit: FitSession
    plan: Plan | None
    layout: Any  # memplan.callback.layout.Layout | None
    exactness: Any  # memplan.callback.exactness.Exactness | None
    rewrites: list[Any]  # memplan.callback.rewrites.Rewrite
