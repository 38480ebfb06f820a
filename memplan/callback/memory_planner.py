"""MemoryPlanner: apply a memory plan to a Lightning Trainer, watch every rank, keep the run fitting."""
from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from typing_extensions import override

import pytorch_lightning as pl
from pytorch_lightning.utilities.rank_zero import rank_zero_info, rank_zero_warn

from memplan import batching, compat
from memplan.callback import mesh, runlog, sharded
from memplan.callback.apply import (
    current_loader_batch_size, load_plan, plan_device_mismatch, plan_mismatches, plan_model_mismatch,
)
from memplan.callback.checks import (
    check_can_adjust,
)
from memplan.callback.exactness import Exactness
from memplan.shapes import SCAN_BATCHES
from memplan.callback.fit_start import FitStart
from memplan.callback.watching import Watching
from memplan.callback.framework import ACCUMULATION_SCHEDULERS, CALLBACKS, MisconfigurationException
from memplan.callback.layout import Layout
from memplan.callback.rewrites import Rewrite, users_hyper_parameters
from memplan.callback.session import FitSession
from memplan.callback.sigterm import end_rank_on_sigterm
from memplan.callback.settings import PlannerSettings
from memplan.callback.rank_log import RankLog, new_run_id
from memplan.plan import Plan
from memplan.planner import Estimator, PlanRequest, make_plan

log = logging.getLogger(__name__)

MANUAL_OPTIMIZATION = (
    "MemoryPlanner does not adjust micro-batches under manual optimization (automatic_optimization=False): "
    "training_step runs its own backwards and optimizer steps, so a batch cannot be split into micro-batch chunks "
    "nor an OOM retried on part of it. It applies the plan (the batch size, checkpointing; no accumulation, which "
    "Lightning does not do under manual optimization) and watches memory. Pass adjust=False to say so")
DEFAULT_EVERY_N_STEPS = 50
"""Steps between checks when the Trainer's log_every_n_steps is 0 (Lightning's own default interval)."""

class MemoryPlanner(FitStart, Watching, *CALLBACKS):
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
        log_dir: folder of the per-rank logs. Default: ``<trainer.log_dir>/memplan`` (``memplan_logs`` where
            trainer.log_dir is a folder Python imports from: ``logger=False`` in the script's folder).
        planner: ``callable(PlanRequest, estimator) -> Plan`` for planning now. Default:
            :func:`memplan.planner.make_plan` (plans keep ``plan_margin`` free, so a plan that
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
            it runs. 0: plan from the first batch. A dataset with a ``lengths`` sequence (one number a
            sample) is planned for its longest samples instead, without reading the loader.
        max_shape: the per-sample shapes to plan for, by the batch's field, where you know the
            largest input: ``{"input_ids": (2048,), "labels": (2048,)}``. The first batch's tensors
            are grown to them (values repeated) for planning; no loader scan.
        plan_margin: fraction of each device's memory a plan keeps free (planning now, and
            ``memplan suggest`` reading this callback's entry in a config). Default: twice ``margin``, at
            most 0.5.
        suggest: what only ``memplan suggest`` reads from this callback's entry in a LightningCLI config,
            planning before any Trainer exists: ``precisions`` it may choose, ``batch_spec``, ``optimizer``,
            ``num_workers``, ``prefetch_factor``, ``pin_memory`` (:mod:`memplan.config.placement`).
            Checked here; training ignores it.
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
        max_shape: Mapping[str | int, Sequence[int]] | None = None,
        plan_margin: float | None = None,
        suggest: Mapping[str, Any] | None = None,
    ) -> None:
        self.settings = PlannerSettings(
            plan=plan, global_batch_size=global_batch_size, every_n_steps=every_n_steps, margin=margin, adjust=adjust,
            grow=grow, grow_margin=grow_margin, grow_patience=grow_patience, guard=guard,
            allow_checkpointing=allow_checkpointing, strict=strict, batch_arg_name=batch_arg_name, log_dir=log_dir,
            planner=planner, loss_reduction=loss_reduction, mean_over=mean_over, exact=exact,
            scan_batches=scan_batches, max_shape=max_shape, plan_margin=plan_margin, suggest=suggest)
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
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        users_hyper_parameters(checkpoint, self._fit.user_batch_size if self._fit is not None else None)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close("finished")  # (the session stays for state_dict after fit: trainer.save_checkpoint)

    @property
    def _plan_with(self) -> Callable[[PlanRequest, Estimator], Plan]:
        return self.settings.planner or make_plan

    # --- setup: environment checks -----------------------------------------------------------
    def _setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit = FitSession(adjusting=self.settings.adjust, data_parallel=mesh.data_parallel_size(trainer))
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
                sharded.refuse_guard_always(trainer.strategy, self.settings.guard)
                rank_zero_warn(sharded.NO_RETRY.format(strategy=sharded.strategy_name(trainer.strategy)))
        repeated = mesh.repeated_work(trainer)
        if repeated is not None:  # (said again in the end-of-fit summary)
            rank_zero_warn(f"MemoryPlanner: {repeated}")
        if self.settings.plan is not None:
            self._fit.given_plan = load_plan(self.settings.plan)
            wrong_model = plan_model_mismatch(self._fit.given_plan, pl_module)
            if wrong_model is not None:
                raise MisconfigurationException(f"MemoryPlanner(plan={str(self.settings.plan)!r}): {wrong_model}")
            self._check_plan(trainer, self._fit.given_plan)
        directory = Path(self.settings.log_dir) if self.settings.log_dir is not None else \
            runlog.default_log_dir(trainer.log_dir, sys.path)
        self._open_log(trainer, directory)  # trainer.log_dir above is a collective: every rank gets here
        if self._fit.given_plan is None and sharded.is_sharded(trainer.strategy):
            # FSDP: traced now, on rank 0, before configure_model shards the model (its all-gathers
            # would wait for the other ranks)
            settable = self._settable(trainer, pl_module)
            try:
                self._fit.setup_plan = self._plan_now(trainer, pl_module, current_loader_batch_size(
                    trainer, pl_module, self.settings.batch_arg_name if settable else None))
            except (MisconfigurationException, RuntimeError) as err:  # (RuntimeError: rank 0's, on the others)
                if not mesh.has_tensor_parallel_ranks(trainer):
                    raise
                # a configure_model applying tensor parallelism fails on memplan's fake mesh: fit start, where
                # the configured parameters show it, refuses that by name, else raises this (callback.mesh)
                self._fit.setup_failure = err
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
        data_parallel = self._fit.data_parallel  # (the ranks a plan counts: memplan.callback.mesh)
        mismatches = plan_mismatches(plan, precision=str(trainer.precision), world_size=data_parallel,
                                     nodes=mesh.data_parallel_nodes(data_parallel, trainer.num_nodes),
                                     fsdp=sharded.is_sharded(trainer.strategy))
        self._fit.mismatches = mismatches
        other_device = plan_device_mismatch(plan, trainer.strategy.root_device)
        if other_device is not None:
            rank_zero_warn(f"MemoryPlanner: {other_device}")
        for message in mismatches:
            if self.settings.strict:
                raise MisconfigurationException(f"MemoryPlanner(strict=True): {message}")
            rank_zero_warn(f"MemoryPlanner: {message}")
