"""The two Lightning packages MemoryPlanner works with: `pytorch_lightning`, and `lightning.pytorch`
(in the unified `lightning` package), where it is installed.

They ship the same Trainer under two names, each with its own Callback, exception and strategy
classes. MemoryPlanner is written once: it subclasses both packages' Callback, raises a
MisconfigurationException that both packages' `except` clauses catch, and checks strategies against
both packages' classes. What else it uses is one object in both (rank_zero_only, from
lightning_utilities) or the same duck-typed code (lightning_setattr, is_param_in_hook_signature), so
it comes from pytorch_lightning.
"""
from __future__ import annotations

import importlib.util
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytorch_lightning


def _lightning_pytorch() -> ModuleType | None:
    if importlib.util.find_spec("lightning") is None:
        return None
    try:
        import lightning.pytorch
    except ImportError:  # a `lightning` package without its pytorch part
        return None
    return lightning.pytorch


PACKAGES: tuple[ModuleType, ...] = tuple(p for p in (pytorch_lightning, _lightning_pytorch()) if p is not None)
"""pytorch_lightning, and lightning.pytorch where installed."""


def _each(name: Callable[[Any], type]) -> tuple[type, ...]:
    return tuple(name(package) for package in PACKAGES)


CALLBACKS = _each(lambda p: p.callbacks.Callback)
SINGLE_DEVICE_STRATEGIES = _each(lambda p: p.strategies.SingleDeviceStrategy)
DDP_STRATEGIES = _each(lambda p: p.strategies.DDPStrategy)
FSDP_STRATEGIES = _each(lambda p: p.strategies.FSDPStrategy)
MODEL_PARALLEL_STRATEGIES = _each(lambda p: p.strategies.ModelParallelStrategy)
ACCUMULATION_SCHEDULERS = _each(lambda p: p.callbacks.GradientAccumulationScheduler)
COMBINED_LOADERS = _each(lambda p: p.utilities.CombinedLoader)


class MisconfigurationException(*_each(lambda p: p.utilities.exceptions.MisconfigurationException)):
    """Lightning's MisconfigurationException, of both packages: MemoryPlanner's refusals are caught
    by either package's `except MisconfigurationException`."""
