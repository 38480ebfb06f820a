"""MemoryPlanner at fit start: the layout to run (a checkpoint's, a given plan's, or one planned now from an
estimate of the user's own training step), applied to the Trainer, and the micro-batch runner installed.

A mixin of MemoryPlanner (memplan.callback.memory_planner): it works on the callback's settings, its FitSession
and the plan and layout the callback exposes; the hooks there call it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any


import pytorch_lightning as pl
from pytorch_lightning.utilities.parsing import lightning_getattr, lightning_hasattr
from pytorch_lightning.utilities.rank_zero import rank_zero_info, rank_zero_warn

from memplan import compat
from memplan.callback import fsdp_plan, mesh, sharded
from memplan.callback.apply import (
    apply_layout, can_checkpoint, check_planned_precision, current_loader_batch_size, device_budget, enable_checkpointing,
    first_train_batch, host_side, layout_from_plan, loader_ignores, planning_request,
    read_ahead_safe, samples_per_rank, train_loader,
)
from memplan.callback.checks import (
    ADJUST_FIX, CHUNKS_FIX, check_can_adjust, check_gradient_hooks, guard_blocker, restored_layout, split_caveats,
)
from memplan.callback.chunk_job import RunnerOptions
from memplan.callback.chunking import MicroBatchRunner
from memplan.callback.exactness import Exactness, decide, drop_last_blocks, epoch_blocks
from memplan.callback.loss_reduction import LossReduction, LossWatcher, first_call_watched
from memplan.shapes import SCAN_SECONDS, declared, heaviest
from memplan.callback.adjust import Adjuster
from memplan.callback.collectives import decide_on_rank_zero, gather_objects
from memplan.callback.framework import MisconfigurationException
from memplan.callback.layout import Layout
from memplan.callback.rewrites import (
    announce, checkpointing_is_on, layout_rewrites,
)
from memplan.callback.session import CallbackState
from memplan.estimator.errors import EstimateError
from memplan.batching import tensor_bytes
from memplan.plan import Plan
from memplan.estimator.determinism import process_deterministic
from memplan.planner import Estimator, NoFit, PlanRequest, estimator_for
from memplan.planner.assemble import Asked
from memplan.planner.reasons import Words

RESTORED = "restored from the checkpoint"
CALLBACK_WORDS = Words(allow_amp="running the Trainer at precision='bf16-mixed' or '16-mixed'",
                       allow_checkpointing="allowing MemoryPlanner(allow_checkpointing=True)",
                       checkpointing_refused="MemoryPlanner(allow_checkpointing=False)")
"""MemoryPlanner's settings, as the plan's account and NoFit name them (the Trainer's precision, its arguments)."""


class FitStart(CallbackState):
    """Fit-start planning and applying (module docstring)."""

    def _apply(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit.restored, self._restored = self._restored, None
        if self._fit.adjusting or self._fit.given_plan is None:  # (configure_model has run: the parameters exist)
            mesh.check_tensor_parallel(trainer, pl_module)
        if self._fit.setup_failure is not None:
            raise self._fit.setup_failure
        # the batch size can be set where the model (hparams, datamodule) has it and builds the loader
        settable = self._settable(trainer, pl_module)
        layout, source = self._resolve_layout(trainer, pl_module, settable)
        checkpointable = (self.settings.allow_checkpointing and not self.settings.strict and can_checkpoint(pl_module)
                          and not (self.plan is not None and self.plan.user_checkpointing))  # the model's own: kept
        if layout.gradient_checkpointing and not self.settings.allow_checkpointing:
            raise MisconfigurationException("MemoryPlanner: the plan turns checkpointing on, which "
                                            "allow_checkpointing=False forbids; allow it, or plan without it")
        self.rewrites = layout_rewrites(
            trainer, pl_module, layout, source=source, batch_arg_name=self.settings.batch_arg_name if settable else None,
            loader_batch_size=current_loader_batch_size(trainer, pl_module, self.settings.batch_arg_name) if settable else 0,
            checkpointing_on=checkpointing_is_on(pl_module))
        announce(self.rewrites, strict=self.settings.strict)
        if settable:
            name = self.settings.batch_arg_name
            self._fit.user_batch_size = (name, lightning_getattr(pl_module, name))
        apply_layout(trainer, pl_module, layout, self.settings.batch_arg_name if settable else None)
        self.layout = layout
        self._fit.adjuster = Adjuster(margin=self.settings.margin, grow=self.settings.grow, grow_margin=self.settings.grow_margin,
                                  grow_patience=self.settings.grow_patience, can_checkpoint=checkpointable,
                                  can_split=lambda: self._exactness(pl_module, self._fit.batch_now).can_split,
                                  planned_micro_batch_size=self._fit.planned_micro_batch_size or layout.micro_batch_size)
        if source == RESTORED:
            self._fit.adjuster.load_state_dict(self._fit.restored)
        if self._fit.adjusting or layout.chunks > 1:
            self._install_runner(trainer, pl_module, checkpointable)
        self._fit.apply_record = dict(source=source, layout=layout.to_dict(), ranks=trainer.world_size,
                                      plan=None if self.plan is None else self.plan.to_dict(),
                                      rewrites=[r.to_dict() for r in self.rewrites],
                                      planned_for=self._fit.scan.describe() if self._fit.scan is not None else None)
        ranks = ("" if trainer.world_size == layout.world_size else f" ({trainer.world_size} ranks, {layout.world_size} "
                 "of them data-parallel: the others train the same batches)")
        rank_zero_info(f"MemoryPlanner ({source}): {layout.describe()}{ranks}")

    def _record_apply(self, trainer: pl.Trainer) -> None:
        """The apply record, at the step training starts from: Lightning restores a resumed fit's step
        after on_fit_start (where the layout is applied, before the train loader is built)."""
        self._fit.last_step = trainer.global_step  # a resumed fit counts from its checkpoint's step
        if self._fit.apply_record is not None:
            self._fit.log.write("apply", trainer.global_step, **self._fit.apply_record)
            self._fit.apply_record = None

    def _settable(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
        """Whether setting the batch-size attribute sets the train loader's batch (decided once a fit): the model or
        datamodule has it, builds the loader, and the loader it builds yields it (a `batch_sampler` of its own does
        not read it: raising the accumulation for it would grow the global batch)."""
        if self._fit.settable is None:
            name = self.settings.batch_arg_name
            self._fit.settable = lightning_hasattr(pl_module, name) and compat.train_data_source(trainer).is_module()
            if self._fit.settable:
                ignored = loader_ignores(trainer, pl_module, name)
                if ignored is not None:
                    rank_zero_info(f"MemoryPlanner: the train loader does not take its batch size from `{name}` "
                                   f"({ignored}): the loader keeps its batches, and a smaller micro-batch runs them "
                                   "as chunks")
                    self._fit.settable = False
        return self._fit.settable

    def _resolve_layout(self, trainer: pl.Trainer, pl_module: pl.LightningModule, settable: bool
                        ) -> tuple[Layout, str]:
        restored = restored_layout(self._fit.restored, self._fit.data_parallel)
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
                           f"{loader_batch} samples the train loader yields per batch; clamped to {loader_batch} "
                           f"(each loaded batch runs whole, {layout.accumulate_grad_batches} per optimizer step for "
                           f"a global batch of {layout.global_batch_size}): the loader's batch is kept where memplan "
                           "cannot set it or setting it would not train the same")
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
        data_parallel = self._fit.data_parallel  # the ranks that train different samples (callback.mesh)
        layout = layout_from_plan(self.plan, world_size=data_parallel, loader_batch_size=loader_batch,
                                  settable=settable)
        if (layout.loader_batch_size, layout.accumulate_grad_batches, layout.chunks) == (
                loader_batch, trainer.accumulate_grad_batches, 1):
            return layout
        exactness = self._exactness(pl_module, first_train_batch(trainer))
        if not exactness.can_rewrite:
            layout = layout_from_plan(self.plan, world_size=data_parallel, loader_batch_size=loader_batch,
                                      settable=settable, keep_accumulation=trainer.accumulate_grad_batches)
        if self.settings.exact and layout.loader_batch_size != loader_batch:
            loader = train_loader(trainer)
            samples = samples_per_rank(loader, data_parallel)
            why = drop_last_blocks(loader, samples, loader_batch, layout.loader_batch_size) or epoch_blocks(
                trainer, samples, loader_batch, layout.loader_batch_size, bool(getattr(loader, "drop_last", False)))
            if why is not None:
                self.exactness = exactness = dataclasses.replace(
                    exactness, can_rewrite=False, no_rewrite=f"{why}. Pass MemoryPlanner(exact=False) to allow it")
                layout = layout_from_plan(self.plan, world_size=data_parallel, loader_batch_size=loader_batch,
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
        fsdp = None
        if sharded.is_sharded(trainer.strategy):
            fsdp, assumed = fsdp_plan.planning_settings(trainer.strategy, pl_module)
            for line in assumed:
                rank_zero_warn(f"MemoryPlanner: {line}")
        budgets = gather_objects(device_budget(device, trainer.num_devices))
        data_parallel = self._fit.data_parallel  # the ranks that train different samples (callback.mesh)
        global_batch = self.settings.global_batch_size or loader_batch * data_parallel * trainer.accumulate_grad_batches
        asked = Asked(global_batch_size=global_batch, precisions=(str(trainer.precision),), all_devices=True,
                      allow_checkpointing=self.settings.allow_checkpointing, checkpointable=can_checkpoint(pl_module),
                      margin=self.settings.planning_margin, strategies=("ddp",) if fsdp is None else ("fsdp",),
                      allow_cpu_offload=fsdp is None or fsdp.cpu_offload, words=CALLBACK_WORDS)

        # Trainer(deterministic=...) is applied to this process's torch flags (Lightning's _set_torch_flags; the
        # Trainer keeps no copy), where the step runs: read here, and handed to the planning as an input
        deterministic = process_deterministic()

        def plan() -> Plan:
            check_planned_precision(str(trainer.precision))
            batch, on = self._batch_to_plan_for(trainer), "cpu" if device.type == "cpu" else None
            host = None if device.type != "cuda" else host_side(train_loader(trainer), tensor_bytes(batch) // max(1, loader_batch))
            request = planning_request(pl_module, batch, budgets, nodes=trainer.num_nodes, asked=asked, host=host,
                                       data_parallel=data_parallel)
            try:
                if fsdp is not None:  # traced in a process of its own, FSDP under the strategy's settings
                    made = fsdp_plan.plan_in_subprocess(pl_module, batch, request, fsdp, self._plan_with, on,
                                                        deterministic)
                    reduction = self._recognise(pl_module, batch)
                else:
                    estimator = estimator_for(pl_module, batch, device=on, resize=self._planning_batch,
                                              deterministic=deterministic)
                    made, reduction = self._plan_exactly(pl_module, request, estimator, loader_batch,
                                                         self._settable(trainer, pl_module))
            except EstimateError as err:  # the model or its batch cannot be traced: the message names why
                if err.argument == "batch" and self.settings.max_shape is not None:
                    raise MisconfigurationException(
                        f"MemoryPlanner(max_shape={self.settings.max_shape!r}) grew the batch to shapes the model "
                        f"cannot take: {err.detail or err}. Give each field of this batch its per-sample shape (a "
                        "tensor of shape (batch, 16) takes (16,))") from err
                raise MisconfigurationException(f"MemoryPlanner: {err}") from err
            if made.world_size != data_parallel:
                rank_zero_warn(f"MemoryPlanner: the planner chose {made.world_size} rank(s); this Trainer runs "
                               f"{data_parallel} data-parallel rank(s), so its micro-batch runs on {data_parallel} with the "
                               "accumulation recomputed")
            return made, reduction, None if self._fit.scan is None else dataclasses.replace(self._fit.scan, batch=None)

        made, self._fit.reduction, self._fit.scan = decide_on_rank_zero(trainer, plan)
        if self._fit.scan is not None:
            rank_zero_info(f"MemoryPlanner: {self._fit.scan.describe()}")
        return made

    def _batch_to_plan_for(self, trainer: pl.Trainer) -> Any:
        """The first batch grown to the declared max_shape, the heaviest batch by the dataset's lengths or of a
        bounded scan of the train loader (memplan.shapes), or the first."""
        if self.settings.max_shape is not None:
            batch = first_train_batch(trainer)
            try:
                self._fit.scan = declared(batch, self.batch_size_of(batch), self.settings.max_shape)
            except ValueError as err:
                raise MisconfigurationException(str(err)) from None
            return self._fit.scan.batch
        if not self.settings.scan_batches:
            return first_train_batch(trainer)
        try:
            self._fit.scan = heaviest(read_ahead_safe(train_loader(trainer)), self.batch_size_of, max_batches=self.settings.scan_batches,
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

    def _install_runner(self, trainer, pl_module, checkpointable: bool) -> None:
        fix = None if self._fit.adjusting else CHUNKS_FIX  # (with adjust, setup checked the Trainer already)
        if fix is not None:
            check_can_adjust(trainer, pl_module, fix)
        check_gradient_hooks(pl_module, fix or ADJUST_FIX)
        fsdp = sharded.is_sharded(trainer.strategy)
        blocker = guard_blocker(trainer, self.settings.guard) if not fsdp else None
        if blocker is not None and self._fit.adjusting:
            rank_zero_warn(f"MemoryPlanner: backwards are not guarded under {blocker}; an OOM in a backward is not "
                           "retried (forwards still are), and a batch split into micro-batches holds that copy too")
        self._fit.runner = MicroBatchRunner(trainer, pl_module, RunnerOptions(
            shared_layout=lambda: self.layout, can_checkpoint=checkpointable and self._fit.adjusting,
            retry=self._fit.adjusting and not fsdp, can_guard=blocker is None and not fsdp,
            enable_checkpointing=lambda: enable_checkpointing(pl_module),
            on_retry=lambda retry: self._record_retry(trainer, retry),
            out_of_memory=lambda message, size: self._out_of_memory(trainer, message, size),
            exactness=lambda batch: self._exactness(pl_module, batch), size_of=self.batch_size_of,
            split=self.split_batch, on_first_split=lambda size, chunk: self._warn_split(pl_module, size, chunk),
            sharded_sync_off=sharded.gradient_sync_off(trainer.strategy, pl_module) if fsdp else None,
            planned_load_per_sample=self._fit.scan.load_per_sample if self._fit.scan is not None else None,
        ))
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
        if self._fit.adjuster is not None:  # growth stops at the batch the loader yields
            self._fit.adjuster.planned_micro_batch_size = min(self._fit.adjuster.planned_micro_batch_size, size)
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
