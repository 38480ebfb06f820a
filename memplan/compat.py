"""Every private attribute of Lightning and torch that memplan reads (MemoryPlanner, and the estimate's
stand-in Trainer), in one place.

Each accessor names the attribute, what it is for and the versions it is known for. They are read
where MemoryPlanner is set up (a missing one raises `IncompatibleVersionError`, naming it, the version
installed and the versions known); what runs on every step is a getter bound then, so a step costs
no more than the plain attribute read. An upgrade of Lightning or torch that moves one fails here,
loudly, at fit start, not deep in a run.

Known versions: the ranges below are pyproject.toml's; the test suite runs on the installed ones
(tests/callback/test_callback_compat.py checks they lie inside them).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
import re
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch

LIGHTNING_RANGE = ((2, 2), (2, 7))
"""pytorch-lightning / lightning versions MemoryPlanner is known to work with: >= 2.2, < 2.7."""
TORCH_RANGE = ((2, 4), (2, 14))
"""torch versions whose private attributes below are known: >= 2.4, < 2.14."""


class IncompatibleVersionError(RuntimeError):
    """A private attribute of Lightning or torch that MemoryPlanner needs is not where it was."""


def _version_tuple(text: str) -> tuple[int, int]:
    """(major, minor) of a version string: '2.13.0+cpu' -> (2, 13), '2.7.0rc1' -> (2, 7)."""
    numbers = [int(m.group()) if (m := re.match(r"\d+", part)) else 0 for part in text.split(".")[:2]]
    return (numbers + [0, 0])[0], (numbers + [0, 0])[1]


def installed_version(package: str) -> str | None:
    """The installed version of `package`, or None."""
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def within(text: str, bounds: tuple[tuple[int, int], tuple[int, int]]) -> bool:
    """Whether version `text` lies in [low, high) by major.minor."""
    low, high = bounds
    return low <= _version_tuple(text) < high


def _known(bounds: tuple[tuple[int, int], tuple[int, int]]) -> str:
    (a, b), (c, d) = bounds
    return f">={a}.{b},<{c}.{d}"


def _require(owner: Any, name: str, package: str) -> None:
    if not hasattr(owner, name):
        bounds = TORCH_RANGE if package == "torch" else LIGHTNING_RANGE
        raise IncompatibleVersionError(
            f"MemoryPlanner reads {type(owner).__name__}.{name}, which this {package} "
            f"({installed_version(package) or 'unknown version'}) does not have; it is known in {package}"
            f"{_known(bounds)}. Install a {package} in that range, or a memplan that supports this one")


# --- Lightning -------------------------------------------------------------------------------
def train_data_source(trainer: Any) -> Any:
    """`trainer.fit_loop._data_source` (pytorch-lightning 2.2-2.6): where the train loader comes from:
    `.is_module()` (the LightningModule or datamodule builds it) and `.dataloader()`."""
    _require(trainer.fit_loop, "_data_source", "pytorch-lightning")
    return trainer.fit_loop._data_source


def skip_backward_getter(trainer: Any) -> Callable[[], bool]:
    """`fit_loop.epoch_loop.automatic_optimization._skip_backward` (pytorch-lightning 2.2-2.6): True
    while Lightning runs training_step without a backward (e.g. StochasticWeightAveraging's
    batch-norm epoch). Returns a getter."""
    loop = trainer.fit_loop.epoch_loop.automatic_optimization
    _require(loop, "_skip_backward", "pytorch-lightning")
    return lambda: loop._skip_backward


def ddp_kwargs(strategy: Any) -> dict[str, Any]:
    """`DDPStrategy._ddp_kwargs` (pytorch-lightning 2.2-2.6): the DistributedDataParallel arguments
    the user gave the strategy (static_graph, gradient_as_bucket_view, ...)."""
    _require(strategy, "_ddp_kwargs", "pytorch-lightning")
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


def layer_sync(strategy: Any) -> Any:
    """`Strategy._layer_sync` (pytorch-lightning 2.2-2.6): set when `Trainer(sync_batchnorm=True)`
    converts BatchNorm to SyncBatchNorm (None otherwise, and on strategies without it)."""
    return getattr(strategy, "_layer_sync", None)


# --- torch -----------------------------------------------------------------------------------
def rebuilt_buckets_getter(ddp: torch.nn.parallel.DistributedDataParallel) -> Callable[[], bool]:
    """`DistributedDataParallel._has_rebuilt_buckets` (torch 2.4-2.13): whether DDP rebuilt its
    gradient buckets from the first synchronised backward yet. Returns a getter."""
    _require(ddp, "_has_rebuilt_buckets", "torch")
    return lambda: ddp._has_rebuilt_buckets


def has_gradient_hooks(param: torch.nn.Parameter) -> bool:
    """Whether a parameter has gradient hooks: `Tensor._backward_hooks` (register_hook) and
    `Tensor._post_accumulate_grad_hooks` (register_post_accumulate_grad_hook, torch 2.1+) (torch 2.4-2.13)."""
    return bool(getattr(param, "_backward_hooks", None) or getattr(param, "_post_accumulate_grad_hooks", None))


def tensor_version(tensor: torch.Tensor) -> int:
    """`Tensor._version` (torch 2.4-2.13): the in-place write counter, to tell whether a failed
    backward wrote to a gradient."""
    return tensor._version


def attach_stand_in_trainer(module: Any, trainer: Any) -> None:
    """`LightningModule._trainer` (pytorch-lightning 2.2-2.6), set around the estimate's trace of a
    manual-optimization step (memplan.estimator.manual); None detaches it. Lightning's own
    `optimizers()` then reads the stand-in's `strategy._lightning_optimizers` (2.2-2.6)."""
    _require(module, "_trainer", "pytorch-lightning")
    module._trainer = trainer


@contextlib.contextmanager
def counting_checkpoint_calls(count: Callable[[], None]) -> Iterator[None]:
    """While open, every `torch.utils.checkpoint.checkpoint` call runs `count()` first, however the caller
    imported `checkpoint`: the non-reentrant path enters the module-level generator
    `torch.utils.checkpoint._checkpoint_without_reentrant_generator`, the reentrant path
    `CheckpointFunction.forward` (both looked up at call time; torch 2.4-2.13)."""
    import torch.utils.checkpoint as module

    _require(module, "_checkpoint_without_reentrant_generator", "torch")
    generator = module._checkpoint_without_reentrant_generator
    forward = module.CheckpointFunction.__dict__["forward"]

    def counted_generator(*args, **kwargs):
        count()
        return generator(*args, **kwargs)

    def counted_forward(*args):
        count()
        return forward.__func__(*args)

    module._checkpoint_without_reentrant_generator = counted_generator
    module.CheckpointFunction.forward = staticmethod(counted_forward)
    try:
        yield
    finally:
        module._checkpoint_without_reentrant_generator = generator
        module.CheckpointFunction.forward = forward


def check_installed() -> list[str]:
    """What is installed outside the known ranges, in words (empty: all inside)."""
    found = []
    for package, bounds in (("pytorch-lightning", LIGHTNING_RANGE), ("lightning", LIGHTNING_RANGE),
                            ("torch", TORCH_RANGE)):
        text = installed_version(package)
        if text is not None and not within(text, bounds):
            found.append(f"{package} {text} is outside the versions MemoryPlanner is known to work with "
                         f"({package}{_known(bounds)})")
    return found
