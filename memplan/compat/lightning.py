"""Every private attribute of pytorch-lightning / lightning.pytorch that memplan reads or sets, in one place.

Each accessor names the attribute, what it is for and the versions it is known for (both packages, the
unified `lightning.pytorch` and `pytorch_lightning`, share them). Those the callback needs are read where
MemoryPlanner is set up (a missing one raises `IncompatibleVersionError`, naming it, the version
installed and the versions known); what runs on every step is a getter bound then, so a step costs no
more than the plain attribute read. An upgrade of Lightning that moves one fails here, loudly, at fit
start, not deep in a run. Nothing here imports Lightning: the estimator uses some of these on a
LightningModule without needing the package.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from memplan.compat.versions import require

DEVICE_MESH_ATTRIBUTE = "_device_mesh"
"""`LightningModule._device_mesh` (pytorch-lightning 2.4-2.6), which the public `device_mesh` property
reads; the FSDP estimate sets it to its fake mesh around `configure_model()` (memplan.estimator.fsdp)."""

DEVICE_ATTRIBUTE = "_device"
"""`_DeviceDtypeModuleMixin._device` (lightning-fabric 2.0-2.6), which a LightningModule's public `device`
property reads; the estimator's fake copy sets it to the trace's device, where the copy's weights are, so a
step making tensors on `self.device` makes them there (memplan.estimator.fake_copy)."""


def train_data_source(trainer: Any) -> Any:
    """`trainer.fit_loop._data_source` (pytorch-lightning 2.2-2.6): where the train loader comes from:
    `.is_module()` (the LightningModule or datamodule builds it) and `.dataloader()`."""
    require(trainer.fit_loop, "_data_source", "pytorch-lightning")
    return trainer.fit_loop._data_source


def skip_backward_getter(trainer: Any) -> Callable[[], bool]:
    """`fit_loop.epoch_loop.automatic_optimization._skip_backward` (pytorch-lightning 2.2-2.6): True
    while Lightning runs training_step without a backward (e.g. StochasticWeightAveraging's
    batch-norm epoch). Returns a getter."""
    loop = trainer.fit_loop.epoch_loop.automatic_optimization
    require(loop, "_skip_backward", "pytorch-lightning")
    return lambda: loop._skip_backward


def ddp_kwargs(strategy: Any) -> dict[str, Any]:
    """`DDPStrategy._ddp_kwargs` (pytorch-lightning 2.2-2.6): the DistributedDataParallel arguments
    the user gave the strategy (static_graph, gradient_as_bucket_view, ...)."""
    require(strategy, "_ddp_kwargs", "pytorch-lightning")
    return strategy._ddp_kwargs


def logger_row_getter(trainer: Any) -> Callable[[], int]:
    """The step index Lightning gives the logger row of the training batch now ending (its loggers' x
    axis): `trainer.fit_loop.epoch_loop._batches_that_stepped` (Lightning 2.0-2.6), raised after the
    batch-end hooks. Where it is missing, the optimizer step count less one (the run log's rows may
    then sit one step off Lightning's). Returns a getter, bound once: it is read every step."""
    loop = trainer.fit_loop.epoch_loop
    if hasattr(loop, "_batches_that_stepped"):
        return lambda: loop._batches_that_stepped
    return lambda: trainer.global_step - 1


def writes_logger_row(trainer: Any, row_step: int) -> bool:
    """Whether Lightning writes its own logger row at the end of this training batch, whose row index
    is `row_step` (`logger_row_getter`): the private `_LoggerConnector.should_update_logs` for the fit
    loop (Lightning 2.0-2.6, both packages), re-implemented here without the property's loop lookup,
    paid every step. Reads only public Trainer attributes; what it copies is Lightning's private rule."""
    every = trainer.log_every_n_steps
    if not every:
        return False
    return (row_step + 1) % every == 0 or bool(trainer.should_stop)


def layer_sync(strategy: Any) -> Any:
    """`Strategy._layer_sync` (pytorch-lightning 2.2-2.6): set when `Trainer(sync_batchnorm=True)`
    converts BatchNorm to SyncBatchNorm (None otherwise, and on strategies without it)."""
    return getattr(strategy, "_layer_sync", None)


def attach_stand_in_trainer(module: Any, trainer: Any) -> None:
    """`LightningModule._trainer` (pytorch-lightning 2.2-2.6), set around the estimate's trace of a
    manual-optimization step (memplan.estimator.manual); None detaches it. Lightning's own
    `optimizers()` then reads the stand-in's `strategy._lightning_optimizers` (2.2-2.6)."""
    require(module, "_trainer", "pytorch-lightning")
    module._trainer = trainer


def sigterm_notifier(trainer: Any) -> tuple[Any, Any]:
    """(`trainer._signal_connector`, its `_sigterm_notifier_fn`) (pytorch_lightning and lightning.pytorch
    2.0-2.6): the handler Lightning registers for SIGTERM at fit start, looked up on the connector
    instance; None for either where this Lightning lacks it (memplan.callback.sigterm)."""
    connector = getattr(trainer, "_signal_connector", None)
    return connector, getattr(connector, "_sigterm_notifier_fn", None)


def replace_sigterm_notifier(connector: Any, handler: Callable[..., Any]) -> None:
    """Set `connector._sigterm_notifier_fn` (2.0-2.6) on the instance: `register_signal_handlers` (at
    fit start) registers what it finds there."""
    connector._sigterm_notifier_fn = handler
