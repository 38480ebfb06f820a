"""MemoryPlanner: apply a memory plan to a Lightning Trainer, watch every rank, keep the run fitting."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from typing_extensions import override

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities.parsing import lightning_hasattr
from pytorch_lightning.utilities.rank_zero import rank_zero_info, rank_zero_warn

from memplan import batching, compat
from memplan.callback import fsdp_plan, sharded
from memplan.callback.apply import (
    apply_layout, can_checkpoint, current_loader_batch_size, device_budget, enable_checkpointing, first_train_batch,
    layout_from_plan, load_plan, plan_device_mismatch, plan_mismatches, plan_model_mismatch, planning_request,
    samples_per_rank, train_loader,
)
from memplan.callback.checks import (
    ADJUST_FIX, CHUNKS_FIX, check_can_adjust, check_gradient_hooks, check_guard, restored_layout, split_caveats,
)
from memplan.callback.chunking import MicroBatchRunner, NothingFitsError, OomRetry
from memplan.callback.exactness import Exactness, decide, drop_last_blocks
from memplan.callback.loss_reduction import LossReduction, LossWatcher, first_call_watched
from memplan.shapes import SCAN_BATCHES, SCAN_SECONDS, scan
from memplan.callback.adjust import Adjuster, Change, RankStatus, gather_statuses
from memplan.callback.collectives import decide_on_rank_zero, gather_objects, gather_rows
from memplan.callback.framework import ACCUMULATION_SCHEDULERS, CALLBACKS, MisconfigurationException
from memplan.callback.layout import Layout
from memplan.callback.rewrites import (
    Rewrite, announce, checkpointing_is_on, checkpointing_rewrite, layout_rewrites, summary_lines,
)
from memplan.callback.oom_site import oom_site
from memplan.callback.session import FitSession
from memplan.callback.sigterm import end_rank_on_sigterm
from memplan.callback.settings import PlannerSettings
from memplan.callback.runlog import (
    RankLog, lightning_writes_row, logger_metrics, new_run_id, summary_line,
)
from memplan.estimator.errors import EstimateError
from memplan.hardware import host_info, readings
from memplan.plan import Plan
from memplan.planner import Estimator, NoFit, PlanRequest, estimator_for, largest_block_bytes, make_plan
from memplan.planner.tracing import block_classes

log = logging.getLogger(__name__)

RESTORED = "restored from the checkpoint"
MANUAL_OPTIMIZATION = (
    "MemoryPlanner does not adjust micro-batches under manual optimization (automatic_optimization=False): "
    "training_step runs its own backwards and optimizer steps, so a batch cannot be split into micro-batch chunks "
    "nor an OOM retried on part of it. It applies the plan (the batch size, checkpointing; no accumulation, which "
    "Lightning does not do under manual optimization) and watches memory. Pass adjust=False to say so")
DEFAULT_EVERY_N_STEPS = 50
"""Steps between checks when the Trainer's log_every_n_steps is 0 (Lightning's own default interval)."""

class MemoryPlanner(*CALLBACKS):
    r"""Apply a memory plan, watch every rank's memory, and lower the micro-batch before it runs out.

    Apply (at fit start): with ``plan`` (a :class:`memplan.plan.Plan` or the path of the JSON file
    ``memplan suggest`` writes) the plan is checked against the Trainer and applied; without one the
    model is estimated on one batch of its train loader under the Trainer's precision and world size,
    and a planner picks the micro-batch, accumulation and checkpointing that keep the global batch.
    The batch size goes where Lightning users keep it (the ``batch_size`` attribute of the model, its
    hparams or the datamodule), the accumulation to ``trainer.accumulate_grad_batches``.

    Watch: every ``every_n_steps`` optimizer steps, and always at the first step, the step after a
    change and the last step, each rank reads its own device (NVML and torch on a GPU, psutil on CPU)
    and writes ``<log_dir>/rank<R>.jsonl`` (:mod:`memplan.callback.runlog`; a write that fails is
    counted, never raised); the readings of all ranks, gathered, go into the Trainer logger's own rows
    as ``memplan/rank<R>/<name>_gib``. torch's peak statistics are never reset.

    Adjust: when any rank's headroom falls under ``margin``, or a rank ran out of memory, all ranks
    agree (one all-gather) to halve the micro-batch (at 1: turn checkpointing on) while the loaded
    batch and the global batch stay as they are: each loaded batch runs as micro-batch chunks inside
    ``training_step``. An OOM is retried on the same samples at a smaller micro-batch on the rank
    where it happened, with no collective in flight (see :mod:`memplan.callback.chunking`): in the
    forward always; in the backward while the rank is guarded, which it is until a reading at the
    current layout shows ``margin`` free, and again after any OOM or change.

    Args:
        plan: a Plan, or a plan JSON file; None plans now from an estimate.
        global_batch_size: samples per optimizer step to keep when planning now. Default: the
            loader's batch x ranks x ``accumulate_grad_batches``.
        every_n_steps: optimizer steps between readings and shared decisions. Default: the
            Trainer's ``log_every_n_steps`` (50 where that is 0).
        margin: fraction of each device's memory to keep free; a rank under it lowers all ranks.
        adjust: adjust during training and retry OOMs; False only applies and watches.
        grow: grow back toward the planned micro-batch when headroom has lasted.
        grow_margin: fraction of memory every rank must have free for growth.
        grow_patience: checks in a row with ``grow_margin`` free before growing.
        guard: ``"auto"``: once a reading at the current layout shows ``margin`` free (and no OOM
            since the last one), a rank leaves a batch that runs whole to Lightning's own backward
            (an OOM there is not retried; a guarded step costs a second autograd pass and, under
            DDP, its all-reduce cannot overlap the backward); any change of layout or OOM guards it
            again. ``"always"``: every backward runs where its OOM can be retried, for inputs
            whose size varies a lot from batch to batch.
        allow_checkpointing: whether checkpointing may be turned on (by a plan, or at micro-batch 1).
        strict: refuse, with a MisconfigurationException naming the setting, to change the user's
            settings (the batch size, ``accumulate_grad_batches``, activation checkpointing, also
            mid-run) or to run a plan that does not match the Trainer; without it each change is
            one warning, before -> after, and a line of the end-of-fit summary.
        batch_arg_name: the attribute holding the train loader's batch size.
        log_dir: folder of the per-rank logs. Default: ``<trainer.log_dir>/memplan``.
        planner: ``callable(PlanRequest, estimator) -> Plan`` for planning now. Default:
            :func:`memplan.planner.make_plan` (plans keep twice ``margin`` free, so a plan that
            fits is not lowered at once).
        loss_reduction: how training_step's loss reduces over the batch, so a batch split into
            chunks trains as the whole batch would. ``"auto"``: recognised from the first planning
            trace (:mod:`memplan.callback.loss_reduction`: transformers models called with ``labels``,
            ``cross_entropy``/``nll_loss`` with ``ignore_index``, ``mse_loss`` and the like on targets
            from the batch); where it is not recognised the batch is neither split nor rewritten.
            ``"mean"`` declares a mean over samples, ``"sum"`` a sum.
        mean_over: ``callable(batch) -> number``: declares a mean over something other than samples,
            e.g. a causal LM's labels that count: ``lambda b: (b["labels"][:, 1:] != -100).sum()``.
        scan_batches: when planning now, read up to this many batches of the train loader at fit start
            (collate only, at most 10 s) and plan for the heaviest per sample
            (:mod:`memplan.shapes`); a heavier batch in training runs as smaller chunks before
            it runs. 0: plan from the first batch.
        exact: only make changes that train exactly as the user's settings would (the default). With
            ``False`` MemoryPlanner may also split or rewrite batches where that changes the training
            (BatchNorm statistics, an unknown loss weighted by samples, manual optimization's batch,
            ``drop_last``), each named in a warning and in the end-of-fit summary.

    Batches: any Lightning accepts (tensors in tuples, lists, dicts, namedtuples, dataclasses); a
    tensor whose first dimension is the batch size is split along it, any other value travels whole
    to every chunk. Override :meth:`batch_size_of` and :meth:`split_batch` for batches that need
    their own split.

    Example::

        trainer = Trainer(accelerator="gpu", devices=4, callbacks=[MemoryPlanner(plan="plan.json")])
    """

    def __init__(
        self,
        plan: Plan | str | os.PathLike | None = None,
        *,
        global_batch_size: int | None = None,
        every_n_steps: int | None = None,
        margin: float = 0.05,
        adjust: bool = True,
        grow: bool = True,
        grow_margin: float = 0.25,
        grow_patience: int = 5,
        guard: Literal["auto", "always"] = "auto",
        allow_checkpointing: bool = True,
        strict: bool = False,
        batch_arg_name: str = "batch_size",
        log_dir: str | os.PathLike | None = None,
        planner: Callable[[PlanRequest, Estimator], Plan] | None = None,
        loss_reduction: Literal["auto", "mean", "sum"] = "auto",
        mean_over: Callable[[Any], Any] | None = None,
        exact: bool = True,
        scan_batches: int = SCAN_BATCHES,
    ) -> None:
        self.settings = PlannerSettings(
            plan=plan, global_batch_size=global_batch_size, every_n_steps=every_n_steps, margin=margin, adjust=adjust,
            grow=grow, grow_margin=grow_margin, grow_patience=grow_patience, guard=guard,
            allow_checkpointing=allow_checkpointing, strict=strict, batch_arg_name=batch_arg_name, log_dir=log_dir,
            planner=planner, loss_reduction=loss_reduction, mean_over=mean_over, exact=exact,
            scan_batches=scan_batches)
        """The arguments, checked (memplan.callback.settings); never changed by a fit."""
        self._fit: FitSession | None = None  # one fit's state, from setup to teardown
        self._restored: dict[str, Any] | None = None  # a checkpoint's state_dict, until fit start takes it
        self.plan: Plan | None = None
        """The plan applied: the one given, or the one made at fit start (None when resumed without one)."""
        self.layout: Layout | None = None
        """The layout every rank shares now."""
        self.log_path: Path | None = None
        """This rank's JSON-lines log."""
        self.changes: list[dict[str, Any]] = []
        """The shared changes made during fit, as logged."""
        self.rewrites: list[Rewrite] = []
        """The user's settings MemoryPlanner changed (batch size, accumulation, checkpointing)."""
        self.exactness: Exactness | None = None
        """What this fit may change without changing what training computes (memplan.callback.exactness)."""

    # --- batch hooks: override for batches that need their own split -------------------------
    def batch_size_of(self, batch: Any) -> int:
        """Samples in a loaded batch: by default the leading dimension most of its tensors share
        (:func:`memplan.batching.batch_size_of`). ValueError, naming the fields, when it cannot tell."""
        return batching.batch_size_of(batch)

    def split_batch(self, batch: Any, start: int, stop: int, batch_size: int) -> Any:
        """Samples [start, stop) of a loaded batch of `batch_size`, as training_step receives a batch:
        by default every tensor whose first dimension is `batch_size` sliced (a view), the rest whole."""
        return batching.split_batch(batch, start, stop, batch_size)

    def _planning_batch(self, batch: Any, size: int) -> Any:
        """The loaded batch at `size` samples for a planning trace: cut by `split_batch` (a subclass's
        own split included) and copied, so the trace holds only those samples; grown by repeating its
        samples (memplan.batching.resize_batch) where the plan looks beyond it."""
        loaded = self.batch_size_of(batch)
        if size > loaded:
            resized = batching.resize_batch(batch, size)
        else:
            part = batch if size == loaded else self.split_batch(batch, 0, size, loaded)
            resized = batching.map_tensors(part, lambda t: t.clone())
        if self._fit.watcher is not None:  # the first planning trace: the loss is recognised on this batch
            self._fit.watcher.watch(resized, size)
        return resized

    # --- hooks: one line each ----------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._setup(trainer, pl_module)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = dict(state_dict)  # (Lightning restores callbacks after setup; kept for fit start)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self._state_dict()

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._apply(trainer, pl_module)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._record_apply(trainer)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._check_first_batch(trainer, batch)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._maybe_check(trainer, batch)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._record_exception(trainer, exception)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close("finished")  # (the session stays for state_dict after fit: trainer.save_checkpoint)

    @property
    def _plan_with(self) -> Callable[[PlanRequest, Estimator], Plan]:
        return self.settings.planner or make_plan

    # --- setup: environment checks -----------------------------------------------------------
    def _setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit = FitSession(adjusting=self.settings.adjust)
        self.plan = self.layout = self.log_path = self.exactness = None
        self.changes, self.rewrites = [], []
        for outside in compat.check_installed():
            rank_zero_warn(f"MemoryPlanner: {outside}")
        if trainer.world_size > 1:  # SIGTERM to one rank ends the job instead of hanging it (callback.sigterm)
            end_rank_on_sigterm(trainer)
        if any(isinstance(c, ACCUMULATION_SCHEDULERS) for c in trainer.callbacks):
            raise MisconfigurationException("MemoryPlanner sets `accumulate_grad_batches` itself; remove the "
                                            "GradientAccumulationScheduler callback, or MemoryPlanner")
        if self._fit.adjusting and not pl_module.automatic_optimization:
            rank_zero_warn(MANUAL_OPTIMIZATION)
            self._fit.adjusting = False  # this fit only applies and watches
        if self._fit.adjusting:
            check_can_adjust(trainer, pl_module)
            if sharded.is_sharded(trainer.strategy):
                sharded.check_guard(trainer.strategy, self.settings.guard)
                sharded.check_data_parallel(trainer.strategy)
                rank_zero_warn(sharded.NO_RETRY.format(strategy=sharded.strategy_name(trainer.strategy)))
        if self.settings.plan is not None:
            self._fit.given_plan = load_plan(self.settings.plan)
            wrong_model = plan_model_mismatch(self._fit.given_plan, pl_module)
            if wrong_model is not None:
                raise MisconfigurationException(f"MemoryPlanner(plan={str(self.settings.plan)!r}): {wrong_model}")
            self._check_plan(trainer, self._fit.given_plan)
        directory = Path(self.settings.log_dir) if self.settings.log_dir is not None else Path(trainer.log_dir or ".") / "memplan"
        self._open_log(trainer, directory)  # trainer.log_dir above is a collective: every rank gets here
        if self._fit.given_plan is None and sharded.is_sharded(trainer.strategy):
            # FSDP: traced now, on rank 0, before configure_model shards the model (its all-gathers
            # would wait for the other ranks)
            settable = self._settable(trainer, pl_module)
            self._fit.setup_plan = self._plan_now(trainer, pl_module, current_loader_batch_size(
                trainer, pl_module, self.settings.batch_arg_name if settable else None))
        self._fit.every = self.settings.every_n_steps or trainer.log_every_n_steps or DEFAULT_EVERY_N_STEPS
        if not (self.settings.every_n_steps or trainer.log_every_n_steps):
            rank_zero_info(f"MemoryPlanner: Trainer(log_every_n_steps=0): memory is checked every "
                           f"{DEFAULT_EVERY_N_STEPS} steps (and at the first and last); pass every_n_steps= to choose")

    def _open_log(self, trainer: pl.Trainer, directory: Path) -> None:
        """This rank's log, under one run id from rank 0. A folder some rank cannot write stops every
        rank at setup (a shared decision: no rank waits for one that raised)."""
        run_id = trainer.strategy.broadcast(new_run_id(), src=0)
        error = None
        try:
            self._fit.log = RankLog(directory, trainer.global_rank, run_id)
        except OSError as err:
            error = err
        if trainer.strategy.reduce_boolean_decision(error is None, all=True):
            self.log_path = self._fit.log.path
            self._fit.rows.install(trainer.loggers)
            self._fit.has_loggers = bool(trainer.loggers)
            self._fit.row_step = compat.logger_row_getter(trainer)
            return
        self._close("failed: log folder not writable")
        where = f"{directory} ({error.strerror or error})" if error is not None else f"{directory} on another rank"
        raise MisconfigurationException(f"MemoryPlanner cannot write its per-rank log in {where}: pass log_dir= a "
                                        "folder every rank can write, e.g. MemoryPlanner(log_dir='/tmp/memplan')")

    def _check_plan(self, trainer: pl.Trainer, plan: Plan) -> None:
        mismatches = plan_mismatches(plan, precision=str(trainer.precision), world_size=trainer.world_size,
                                     nodes=trainer.num_nodes, fsdp=sharded.is_sharded(trainer.strategy))
        self._fit.mismatches = mismatches
        other_device = plan_device_mismatch(plan, trainer.strategy.root_device)
        if other_device is not None:
            rank_zero_warn(f"MemoryPlanner: {other_device}")
        for message in mismatches:
            if self.settings.strict:
                raise MisconfigurationException(f"MemoryPlanner(strict=True): {message}")
            rank_zero_warn(f"MemoryPlanner: {message}")

    # --- apply -------------------------------------------------------------------------------
    def _apply(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit.restored, self._restored = self._restored, None
        # the batch size can be set where the model (hparams, datamodule) has it and builds the loader
        settable = self._settable(trainer, pl_module)
        layout, source = self._resolve_layout(trainer, pl_module, settable)
        checkpointable = self.settings.allow_checkpointing and not self.settings.strict and can_checkpoint(pl_module)
        if layout.gradient_checkpointing and not self.settings.allow_checkpointing:
            raise MisconfigurationException("MemoryPlanner: the plan turns checkpointing on, which "
                                            "allow_checkpointing=False forbids; allow it, or plan without it")
        self.rewrites = layout_rewrites(
            trainer, pl_module, layout, source=source, batch_arg_name=self.settings.batch_arg_name if settable else None,
            loader_batch_size=current_loader_batch_size(trainer, pl_module, self.settings.batch_arg_name) if settable else 0,
            checkpointing_on=checkpointing_is_on(pl_module))
        announce(self.rewrites, strict=self.settings.strict)
        apply_layout(trainer, pl_module, layout, self.settings.batch_arg_name if settable else None)
        self.layout = layout
        self._fit.adjuster = Adjuster(margin=self.settings.margin, grow=self.settings.grow, grow_margin=self.settings.grow_margin,
                                  grow_patience=self.settings.grow_patience, can_checkpoint=checkpointable,
                                  can_split=lambda: self._exactness(pl_module, self._fit.batch_now).can_split,
                                  loader_batch_size=layout.loader_batch_size,
                                  planned_micro_batch_size=self._fit.planned_micro_batch_size or layout.micro_batch_size)
        if source == RESTORED:
            self._fit.adjuster.load_state_dict(self._fit.restored)
        if self._fit.adjusting or layout.chunks > 1:
            self._install_runner(trainer, pl_module, layout, checkpointable)
        self._fit.apply_record = dict(source=source, layout=layout.to_dict(),
                                      plan=None if self.plan is None else self.plan.to_dict(),
                                      rewrites=[r.to_dict() for r in self.rewrites],
                                      planned_for=self._fit.scan.describe() if self._fit.scan is not None else None)
        rank_zero_info(f"MemoryPlanner ({source}): {layout.describe()}")

    def _record_apply(self, trainer: pl.Trainer) -> None:
        """The apply record, at the step training starts from: Lightning restores a resumed fit's step
        after on_fit_start (where the layout is applied, before the train loader is built)."""
        self._fit.last_step = trainer.global_step  # a resumed fit counts from its checkpoint's step
        if self._fit.apply_record is not None:
            self._fit.log.write("apply", trainer.global_step, **self._fit.apply_record)
            self._fit.apply_record = None

    def _settable(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
        return lightning_hasattr(pl_module, self.settings.batch_arg_name) and compat.train_data_source(trainer).is_module()

    def _resolve_layout(self, trainer: pl.Trainer, pl_module: pl.LightningModule, settable: bool
                        ) -> tuple[Layout, str]:
        restored = restored_layout(self._fit.restored, trainer.world_size)
        if restored is not None:
            self.plan = self._fit.given_plan
            self._fit.planned_micro_batch_size = int(self._fit.restored.get("planned_micro_batch_size", 0))
            if restored.chunks > 1 and not self._exactness(pl_module, first_train_batch(trainer)).can_split:
                raise MisconfigurationException(
                    f"MemoryPlanner: the checkpoint's layout runs each loaded batch of {restored.loader_batch_size} as "
                    f"chunks of {restored.micro_batch_size}, which changes what training computes: "
                    f"{self.exactness.no_split}")
            return restored, RESTORED
        loader_batch = current_loader_batch_size(trainer, pl_module, self.settings.batch_arg_name if settable else None)
        if self._fit.given_plan is not None:
            self.plan, source = self._fit.given_plan, "plan"
        elif self._fit.setup_plan is not None:
            self.plan, source = self._fit.setup_plan, "planned from an estimate"
        else:
            self.plan, source = self._plan_now(trainer, pl_module, loader_batch), "planned from an estimate"
        self._fit.planned_micro_batch_size = self.plan.micro_batch_size
        layout = self._layout(trainer, pl_module, loader_batch, settable)
        if not pl_module.automatic_optimization and layout.accumulate_grad_batches > 1:
            rank_zero_warn(f"MemoryPlanner: the plan's global batch of {layout.global_batch_size} needs "
                           f"{layout.accumulate_grad_batches} batches per optimizer step, which Lightning does not "
                           "accumulate under manual optimization: each optimizer step sees one loaded batch per rank, "
                           f"{layout.loader_batch_size} x {layout.world_size} rank(s) = "
                           f"{layout.loader_batch_size * layout.world_size} samples")
            layout = dataclasses.replace(layout, accumulate_grad_batches=1)
        if layout.micro_batch_size < self.plan.micro_batch_size:
            rank_zero_warn(f"MemoryPlanner: the plan's micro-batch of {self.plan.micro_batch_size} is above the "
                           f"{loader_batch} samples the train loader yields per batch; clamped to {loader_batch}")
        return layout, source

    def _exactness(self, pl_module: pl.LightningModule, batch: Any) -> Exactness:
        """What this fit may change (memplan.callback.exactness), decided once, when first needed: from the
        reduction planning recognised, else from a trace of its own on `batch` (this rank's; no collective,
        so an OOM retry on one rank may ask). A fit that never splits nor rewrites never traces for it."""
        if self.exactness is None:
            if self._fit.reduction is None:
                self._fit.reduction = self._recognise(pl_module, batch)
            self.exactness = decide(self._fit.reduction, pl_module, exact=self.settings.exact,
                                    manual=not pl_module.automatic_optimization)
        return self.exactness

    def _layout(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loader_batch: int, settable: bool) -> Layout:
        """The plan on this Trainer, making only the changes `self.exactness` allows: the loader's batch and
        accumulation kept where a rewrite is not exact (drop_last included), and a plan that would then
        split the batch refused where a split is not exact. A plan that changes nothing asks nothing."""
        layout = layout_from_plan(self.plan, world_size=trainer.world_size, loader_batch_size=loader_batch,
                                  settable=settable)
        if (layout.loader_batch_size, layout.accumulate_grad_batches, layout.chunks) == (
                loader_batch, trainer.accumulate_grad_batches, 1):
            return layout
        exactness = self._exactness(pl_module, first_train_batch(trainer))
        if not exactness.can_rewrite:
            layout = layout_from_plan(self.plan, world_size=trainer.world_size, loader_batch_size=loader_batch,
                                      settable=settable, keep_accumulation=trainer.accumulate_grad_batches)
        if self.settings.exact and layout.loader_batch_size != loader_batch:
            loader = train_loader(trainer)
            why = drop_last_blocks(loader, samples_per_rank(loader, trainer.world_size), loader_batch,
                                   layout.loader_batch_size)
            if why is not None:
                self.exactness = exactness = dataclasses.replace(
                    exactness, can_rewrite=False, no_rewrite=f"{why}. Pass MemoryPlanner(exact=False) to allow it")
                layout = layout_from_plan(self.plan, world_size=trainer.world_size, loader_batch_size=loader_batch,
                                          settable=settable, keep_accumulation=trainer.accumulate_grad_batches)
        if not pl_module.automatic_optimization and not exactness.can_rewrite and layout.loader_batch_size < loader_batch:
            raise MisconfigurationException(
                f"MemoryPlanner: the plan's global batch of {self.plan.global_batch_size} would set the loader's batch "
                f"from {loader_batch} to {layout.loader_batch_size}: {exactness.no_rewrite}")
        if layout.chunks > 1 and not exactness.can_split:
            why = "; ".join(dict.fromkeys(w for w in (exactness.no_split, exactness.no_rewrite) if w))
            raise MisconfigurationException(
                f"MemoryPlanner: the plan's micro-batch of {layout.micro_batch_size} would run each loaded batch of "
                f"{layout.loader_batch_size} as {layout.chunks} chunks, which changes what training computes: {why}. "
                "Or plan at the loader's batch (e.g. with activation checkpointing)")
        return layout

    def _plan_now(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loader_batch: int) -> Plan:
        """Estimate and plan on rank 0 with every rank's budget; every rank gets the same plan. Under
        an FSDP strategy: at setup, before configure_model shards the model (callback.fsdp_plan)."""
        device = trainer.strategy.root_device
        fsdp, request_fields = None, None
        if sharded.is_sharded(trainer.strategy):
            fsdp, assumed = fsdp_plan.planning_settings(trainer.strategy, pl_module)
            for line in assumed:
                rank_zero_warn(f"MemoryPlanner: {line}")
            request_fields = dict(strategies=("fsdp",), parameter_count=fsdp_plan.parameter_count(pl_module),
                                  block_classes=block_classes(pl_module), allow_cpu_offload=fsdp.cpu_offload)
        budgets = gather_objects(device_budget(device, trainer.num_devices))
        global_batch = self.settings.global_batch_size or loader_batch * trainer.world_size * trainer.accumulate_grad_batches

        def plan() -> Plan:
            request = planning_request(
                budgets, world_size=trainer.world_size, nodes=trainer.num_nodes, global_batch_size=global_batch,
                precision=str(trainer.precision), margin=min(0.5, 2 * self.settings.margin),
                allow_checkpointing=self.settings.allow_checkpointing and can_checkpoint(pl_module),
                host_available_bytes=host_info().budget_bytes if device.type == "cuda" else None,
                largest_block=largest_block_bytes(pl_module), fsdp=request_fields,
            )
            batch, on = self._batch_to_plan_for(trainer), "cpu" if device.type == "cpu" else None
            try:
                if fsdp is not None:  # traced in a process of its own, FSDP under the strategy's settings
                    made = fsdp_plan.plan_in_subprocess(pl_module, batch, request, fsdp, self._plan_with, on)
                    reduction = self._recognise(pl_module, batch)
                else:
                    estimator = estimator_for(pl_module, batch, device=on, resize=self._planning_batch)
                    made, reduction = self._plan_exactly(pl_module, request, estimator, loader_batch,
                                                         self._settable(trainer, pl_module))
            except EstimateError as err:  # the model or its batch cannot be traced: the message names why
                raise MisconfigurationException(f"MemoryPlanner: {err}") from err
            if made.world_size != trainer.world_size:
                rank_zero_warn(f"MemoryPlanner: the planner chose {made.world_size} rank(s); this Trainer runs "
                               f"{trainer.world_size}, so its micro-batch runs on {trainer.world_size} with the "
                               "accumulation recomputed")
            return made, reduction, None if self._fit.scan is None else dataclasses.replace(self._fit.scan, batch=None)

        made, self._fit.reduction, self._fit.scan = decide_on_rank_zero(trainer, plan)
        if self._fit.scan is not None:
            rank_zero_info(f"MemoryPlanner: {self._fit.scan.describe()}")
        return made

    def _batch_to_plan_for(self, trainer: pl.Trainer) -> Any:
        """The heaviest batch of a bounded scan of the train loader (memplan.shapes), or the first."""
        if not self.settings.scan_batches:
            return first_train_batch(trainer)
        try:
            self._fit.scan = scan(train_loader(trainer), self.batch_size_of, max_batches=self.settings.scan_batches,
                              seconds=SCAN_SECONDS)
        except ValueError:  # a batch MemoryPlanner cannot size: the first one, as it comes
            return first_train_batch(trainer)
        return self._fit.scan.batch

    def _plan_exactly(self, pl_module: pl.LightningModule, request: PlanRequest, estimator: Estimator,
                      loader_batch: int, settable: bool) -> tuple[Plan, LossReduction]:
        """The planner's plan, the loss's reduction recognised from its first trace (no extra trace); and
        where that plan would split the loader's batch and a split is not exact, the plan at the loader's
        batch (checkpointing the only lever left), or an error naming why and the argument that allows it."""
        if self.settings.declared is None and pl_module.automatic_optimization:
            self._fit.watcher = LossWatcher()
            estimator = first_call_watched(estimator, self._fit.watcher)
        try:
            made = self._plan_with(request, estimator)
            reduction = self.settings.declared or (self._fit.watcher.reduction() if self._fit.watcher is not None
                                           else LossReduction(kind="unknown", describe="manual optimization"))
        finally:
            self._fit.watcher = None
        exactness = decide(reduction, pl_module, exact=self.settings.exact, manual=not pl_module.automatic_optimization)
        keeps_loader = not exactness.can_rewrite or not settable
        if made.micro_batch_size >= loader_batch or exactness.can_split or not keeps_loader \
                or request.global_batch_size % loader_batch:
            return made, reduction
        try:
            return self._plan_with(dataclasses.replace(request, min_micro_batch_size=loader_batch), estimator), reduction
        except NoFit as err:
            raise MisconfigurationException(
                f"MemoryPlanner: nothing fits a loaded batch of {loader_batch} per rank whole (activation "
                f"checkpointing included where allowed), and running it as smaller chunks would change what training "
                f"computes: {exactness.no_split}. ({err})") from None

    def _recognise(self, pl_module: pl.LightningModule, batch: Any) -> LossReduction:
        """The loss's reduction from a trace of its own (a plan given, a resumed fit, FSDP's planning in a
        process of its own): one estimate at up to 2 samples, under a LossWatcher."""
        if self.settings.declared is not None:
            return self.settings.declared
        if not pl_module.automatic_optimization:
            return LossReduction(kind="unknown", describe="manual optimization")
        from memplan.estimator import estimate

        try:
            size = min(2, self.batch_size_of(batch))
            small = self._planning_batch(batch, size)
        except ValueError as err:  # (a batch MemoryPlanner cannot cut; the layout check names the fix)
            return LossReduction(kind="unknown", describe=f"the batch cannot be cut to trace its step: {err}")
        watcher = LossWatcher()
        watcher.watch(small, size)
        try:
            with self._fit.runner.unwrapped() if self._fit.runner is not None else contextlib.nullcontext(), watcher:
                estimate(pl_module, small, device="cpu")
        except EstimateError as err:
            return LossReduction(kind="unknown", describe=f"its training step could not be traced: {err}")
        return watcher.reduction()

    def _install_runner(self, trainer, pl_module, layout: Layout, checkpointable: bool) -> None:
        fix = None if self._fit.adjusting else CHUNKS_FIX  # (with adjust, setup checked the Trainer already)
        if fix is not None:
            check_can_adjust(trainer, pl_module, fix)
        check_gradient_hooks(pl_module, fix or ADJUST_FIX)
        fsdp = sharded.is_sharded(trainer.strategy)
        blocker = check_guard(trainer, self.settings.guard) if not fsdp else None
        if blocker is not None and self._fit.adjusting:
            rank_zero_warn(f"MemoryPlanner: backwards are not guarded under {blocker}; an OOM in a backward is not "
                           "retried (forwards still are), and a batch split into micro-batches holds that copy too")
        self._fit.runner = MicroBatchRunner(
            trainer, pl_module, layout=layout, can_checkpoint=checkpointable and self._fit.adjusting,
            retry=self._fit.adjusting and not fsdp, can_guard=blocker is None and not fsdp,
            enable_checkpointing=lambda: enable_checkpointing(pl_module),
            on_retry=lambda retry: self._record_retry(trainer, retry),
            out_of_memory=lambda message, size: self._out_of_memory(trainer, message, size),
            exactness=lambda batch: self._exactness(pl_module, batch), size_of=self.batch_size_of,
            split=self.split_batch, on_first_split=lambda size, chunk: self._warn_split(pl_module, size, chunk),
            sharded_sync_off=sharded.gradient_sync_off(trainer.strategy, pl_module) if fsdp else None,
            planned_load_per_sample=self._fit.scan.load_per_sample if self._fit.scan is not None else None,
        )
        self._fit.runner.install()

    def _check_first_batch(self, trainer: pl.Trainer, batch: Any) -> None:
        """The first batch tells whether the loader yields the batch size the layout has: a loader
        that does not read the batch-size attribute keeps its own, and the chunks follow it."""
        if self._fit.first_batch_seen or self.layout is None:
            return
        self._fit.first_batch_seen = True
        try:
            size = self.batch_size_of(batch)
        except ValueError as err:
            self._unsplittable(err)
            return
        if size == self.layout.loader_batch_size:
            return
        before = self.layout
        self.layout = before.with_loader_batch(size)
        clamped = (f"; the planned micro-batch of {before.micro_batch_size} is clamped to it"
                   if before.micro_batch_size > size else "")
        why = (f"a dataset of fewer samples than the batch, or a loader that does not read `{self.settings.batch_arg_name}`"
               if size < before.loader_batch_size else f"it does not read `{self.settings.batch_arg_name}`")
        rank_zero_warn(f"MemoryPlanner: the train loader yields {size} samples per batch, not the "
                       f"{before.loader_batch_size} of the layout ({why}){clamped}; micro-batches are cut from its "
                       f"{size}, and the global batch is {self.layout.global_batch_size}")
        if self._fit.runner is not None:
            self._fit.runner.loader_batch_size = size
            self._fit.runner.micro_batch_size = min(self._fit.runner.micro_batch_size, size)
        if self._fit.adjuster is not None:  # growth stops at the batch the loader yields
            self._fit.adjuster.planned_micro_batch_size = min(self._fit.adjuster.planned_micro_batch_size, size)
            self._fit.adjuster.loader_batch_size = size
        self._fit.log.write("loader", trainer.global_step, layout=self.layout.to_dict())

    def _unsplittable(self, err: ValueError) -> None:
        """A batch MemoryPlanner cannot split: refused where the layout splits it, else a warning
        that an OOM cannot be retried smaller."""
        fix = "or override MemoryPlanner.batch_size_of and split_batch (subclass MemoryPlanner)"
        if self.layout.chunks > 1:
            raise MisconfigurationException(
                f"MemoryPlanner runs each loaded batch of {self.layout.loader_batch_size} as chunks of "
                f"{self.layout.micro_batch_size}, and cannot split this one: {err}. Give the loader the batch-size "
                f"attribute MemoryPlanner sets (batch_arg_name={self.settings.batch_arg_name!r}), {fix}") from None
        if self._fit.runner is not None:
            rank_zero_warn(f"MemoryPlanner cannot split this train batch, so an OOM in it is not retried smaller: "
                           f"{err}")

    def _warn_split(self, pl_module: pl.LightningModule, size: int, chunk: int) -> None:
        """Once, on the rank that first splits a batch: what splitting does not keep exact."""
        warnings.warn(f"MemoryPlanner: a batch of {size} samples runs as chunks of {chunk} from now on (rank "
                      f"{pl_module.global_rank}). {split_caveats(pl_module, self._exactness(pl_module, None))}",
                      stacklevel=2)

    # --- watch and adjust --------------------------------------------------------------------
    def _maybe_check(self, trainer: pl.Trainer, batch: Any = None) -> None:
        """A reading every `every` steps, then a shared decision; recorded only: the first step, the
        step after a change, and each step Lightning writes a logger row (so every row has fresh
        figures). Every rank takes the same branch: the gather is a collective."""
        step = trainer.global_step
        if step == self._fit.last_step or self.layout is None:
            return
        due = step % self._fit.every == 0
        row = self._fit.has_loggers and lightning_writes_row(trainer, self._fit.row_step())
        if not (due or row or self._fit.record_next):
            return
        self._fit.last_step, self._fit.record_next = step, False
        statuses = gather_statuses(trainer.strategy, self._status(trainer), trainer.world_size)
        self._record_sample(trainer, statuses[trainer.global_rank])
        if row:  # into Lightning's own row for this step (its loggers write from rank 0, which has all ranks)
            predicted = None if self.plan is None else self.plan.predicted_peak_bytes
            on_gpu = trainer.strategy.root_device.type == "cuda"
            self._fit.rows.add(logger_metrics(statuses, self.layout, predicted, on_gpu), self._fit.row_step(), trainer.loggers)
        if not self._fit.adjusting:
            return
        if not due:  # a reading between decisions still tells whether this layout fits
            self._update_guard(statuses[trainer.global_rank])
            return
        self._fit.batch_now = batch  # (for a first decision whether a split is exact; not kept past the check)
        try:
            change = self._fit.adjuster.decide(statuses, self.layout.micro_batch_size, self.layout.gradient_checkpointing)
        finally:
            self._fit.batch_now = None
        if change is not None:
            self._apply_change(trainer, change)  # guards every rank: the new layout is untried
        else:
            self._update_guard(statuses[trainer.global_rank])

    def _update_guard(self, status: RankStatus) -> None:
        """Unguard this rank's backwards once a reading at the current layout shows the margin free
        and no OOM since the last check: those steps fit, and steps of the same shapes will. A change
        of layout guards it again (set_layout), as does an OOM (memplan.callback.chunking)."""
        retried = status.oom_retries > self._fit.oom_retries_seen
        self._fit.oom_retries_seen = status.oom_retries
        self._fit.runner.guarded = self.settings.guard == "always" or retried or not self._fit.adjuster.has_margin(status.reading)

    def _status(self, trainer: pl.Trainer) -> RankStatus:
        return dataclasses.replace(self._status_without_reading(trainer),
                                   reading=readings.read_memory(trainer.strategy.root_device))

    def _status_without_reading(self, trainer: pl.Trainer) -> RankStatus:
        runner, layout = self._fit.runner, self.layout
        return RankStatus(
            rank=trainer.global_rank, reading=readings.MemoryReading(),
            micro_batch_size=runner.micro_batch_size if runner else layout.micro_batch_size,
            gradient_checkpointing=runner.gradient_checkpointing if runner else layout.gradient_checkpointing,
            oom_retries=runner.oom_retries if runner else 0,
            oom_micro_batch_size=runner.oom_micro_batch_size if runner else None,
        )

    def _record_sample(self, trainer: pl.Trainer, status: RankStatus) -> None:
        reading = status.reading
        self._fit.sampled = True
        peak = reading.process_bytes if reading.process_peak_bytes is None else reading.process_peak_bytes
        if peak is not None:
            self._fit.peak_process_bytes = max(peak, self._fit.peak_process_bytes or 0)
        if reading.headroom_bytes is not None:
            low = self._fit.min_headroom_bytes
            self._fit.min_headroom_bytes = reading.headroom_bytes if low is None else min(low, reading.headroom_bytes)
        self._fit.log.write("sample", trainer.global_step, **reading.to_dict(), **self._runs_as(status))

    def _runs_as(self, status: RankStatus) -> dict[str, Any]:
        layout = self.layout.with_micro_batch(status.micro_batch_size, status.gradient_checkpointing)
        return {"micro_batch_size": layout.micro_batch_size, "loader_batch_size": layout.loader_batch_size,
                "accumulate_grad_batches": layout.micro_batches_per_step,
                "trainer_accumulate_grad_batches": layout.accumulate_grad_batches,
                "gradient_checkpointing": layout.gradient_checkpointing,
                "global_batch_size": layout.global_batch_size, "oom_retries": status.oom_retries,
                "guarded": self._fit.runner.guarded if self._fit.runner is not None else None}

    def _apply_change(self, trainer: pl.Trainer, change: Change) -> None:
        before = self.layout
        self.layout = before.with_micro_batch(change.micro_batch_size, change.gradient_checkpointing)
        self._fit.runner.set_layout(change.micro_batch_size, change.gradient_checkpointing)
        record = self._fit.log.write("change", trainer.global_step, cause=change.cause, ranks=list(change.ranks),
                                 reason=change.reason, before=before.to_dict(), after=self.layout.to_dict())
        self.changes.append(record)
        if self.layout.gradient_checkpointing and not before.gradient_checkpointing:
            self.rewrites.append(checkpointing_rewrite(trainer.global_step, change.reason))
            rank_zero_warn(f"MemoryPlanner changes {self.rewrites[-1].describe()}")
        self._fit.record_next = True  # the new layout's first step is recorded
        rank_zero_info(f"MemoryPlanner at step {trainer.global_step}: {change.reason}; now {self.layout.describe()}")

    def _record_retry(self, trainer: pl.Trainer, retry: OomRetry) -> None:
        reading = readings.read_memory(trainer.strategy.root_device, new_interval=False)
        self._fit.log.write("oom_retry", trainer.global_step, batch=trainer.fit_loop.epoch_loop.batch_idx,
                        phase=retry.phase, failed_micro_batch_size=retry.failed_micro_batch_size,
                        micro_batch_size=retry.micro_batch_size, gradient_checkpointing=retry.gradient_checkpointing,
                        error=retry.message, **reading.to_dict())
        log.warning("MemoryPlanner: rank %d ran out of memory at step %d in a %s of %d samples; retrying the same "
                    "samples with micro-batch %d%s", trainer.global_rank, trainer.global_step, retry.phase,
                    retry.failed_micro_batch_size, retry.micro_batch_size,
                    " and checkpointing" if retry.gradient_checkpointing else "")

    def _out_of_memory(self, trainer: pl.Trainer, message: str, size: int) -> NothingFitsError:
        reading = readings.read_memory(trainer.strategy.root_device, new_interval=False)
        checkpointing = self._fit.runner is not None and self._fit.runner.gradient_checkpointing
        self._fit.log.write("fatal", trainer.global_step, batch=trainer.fit_loop.epoch_loop.batch_idx,
                        micro_batch_size=size, gradient_checkpointing=checkpointing, error=message,
                        **reading.to_dict())
        return NothingFitsError(
            f"MemoryPlanner: rank {trainer.global_rank} ran out of memory at step {trainer.global_step} (batch "
            f"{trainer.fit_loop.epoch_loop.batch_idx}) with micro-batch {size}"
            f"{' and activation checkpointing on' if checkpointing else ''}, and "
            f"{'nothing smaller fits' if self.exactness is None or self.exactness.can_split else 'MemoryPlanner does not run it smaller: ' + self.exactness.no_split}. "
            f"{reading.describe()}. Use GPUs with more memory, more of them, a lower precision or shorter "
            f"samples. torch: {message}"
        )

    def _record_exception(self, trainer: pl.Trainer, exception: BaseException) -> None:
        """An OOM MemoryPlanner did not raise itself happened outside the chunks it retries: log it,
        with the rank, the step and the memory figures. Then take the training_step wrapper off, as
        teardown would (Lightning skips it after an error)."""
        if self._fit is None:  # (before setup: nothing of this fit to record)
            return
        if self._fit.log is not None and isinstance(exception, torch.OutOfMemoryError) \
                and not isinstance(exception, NothingFitsError):
            reading = readings.read_memory(trainer.strategy.root_device, new_interval=False)
            site = oom_site(trainer, exception, lightning_backward=self._fit.runner is not None
                            and self._fit.runner.lightning_backward)
            self._fit.log.write("fatal", trainer.global_step, error=str(exception), where=site.where, fix=site.fix,
                                **reading.to_dict())
            log.error("MemoryPlanner: rank %d ran out of memory at step %d, %s, where MemoryPlanner does not retry. "
                      "%s. What can help: %s.", trainer.global_rank, trainer.global_step, site.where,
                      reading.describe(), site.fix)
        self._close(f"failed: {type(exception).__name__}: {str(exception)[:200]}")

    # --- end of fit --------------------------------------------------------------------------
    def _finish(self, trainer: pl.Trainer) -> None:
        """The last step's reading, when no check took it (every rank: a collective), then the summary."""
        if self.layout is None:
            return
        if trainer.global_step != self._fit.last_step or not self._fit.sampled:
            self._fit.last_step = trainer.global_step
            statuses = gather_statuses(trainer.strategy, self._status(trainer), trainer.world_size)
            self._record_sample(trainer, statuses[trainer.global_rank])
        self._summarize(trainer)

    def _summarize(self, trainer: pl.Trainer) -> None:
        """Every rank's peak, least headroom and how it ran at the end, gathered, printed on rank 0."""
        if self.layout is None:
            return
        status = self._status_without_reading(trainer)
        fallbacks = readings.reading_fallbacks(trainer.strategy.root_device)  # NVML lost mid-run, ...
        mine = [-1 if self._fit.peak_process_bytes is None else self._fit.peak_process_bytes,
                -1 if self._fit.min_headroom_bytes is None else self._fit.min_headroom_bytes,
                status.micro_batch_size, status.gradient_checkpointing, status.oom_retries, self._fit.log.dropped,
                readings.fallback_mask(fallbacks)]
        rows = gather_rows(trainer.strategy, [float(v) for v in mine], trainer.world_size)
        self._fit.log.write("summary", trainer.global_step, peak_process_bytes=self._fit.peak_process_bytes,
                        min_headroom_bytes=self._fit.min_headroom_bytes, oom_retries=status.oom_retries,
                        heavier_batches=self._fit.runner.heavier_batches if self._fit.runner is not None else 0,
                        dropped_lines=self._fit.log.dropped, layout=self.layout.to_dict(),
                        reading_fallbacks=list(fallbacks))
        lines = []
        for rank, (peak, low, micro, checkpointing, ooms, dropped, _) in enumerate(rows):
            runs = self.layout.with_micro_batch(int(micro), bool(checkpointing))
            lines.append(summary_line(rank, None if peak < 0 else int(peak), None if low < 0 else int(low),
                                      runs.micro_batch_size, runs.micro_batches_per_step, runs.gradient_checkpointing,
                                      int(ooms), int(dropped)))
        lines += readings.fallback_lines([int(row[-1]) for row in rows])
        rank_zero_info("MemoryPlanner summary:\n  " + "\n  ".join(lines + summary_lines(self.rewrites, self._fit.mismatches)))

    def _close(self, status: str) -> None:
        if self._fit is None:
            return
        if self._fit.apply_record is not None and self._fit.log is not None:  # ended before training started
            self._fit.log.write("apply", self._fit.last_step, **self._fit.apply_record)
            self._fit.apply_record = None
        self._fit.rows.remove()
        if self._fit.runner is not None:
            self._fit.runner.remove()
            self._fit.runner = None
        if self._fit.log is not None:
            rank_log, self._fit.log = self._fit.log, None
            rank_log.write("end", self._fit.last_step, status=status, dropped_lines=rank_log.dropped)
            rank_log.close()
            if rank_log.dropped:
                warnings.warn(f"MemoryPlanner: rank {rank_log.rank} could not write {rank_log.dropped} of "
                              f"{rank_log.dropped + rank_log.written} lines of its log {rank_log.path}", stacklevel=2)

    def _state_dict(self) -> dict[str, Any]:
        if self.layout is None or self._fit is None:
            return {}
        state = {**self.layout.to_dict(), "planned_micro_batch_size": self._fit.planned_micro_batch_size}
        if self._fit.adjuster is not None:
            state.update(self._fit.adjuster.state_dict())
        return state
