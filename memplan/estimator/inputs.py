"""Resolve estimate()'s loss= and optimizer= arguments into callables the step can run."""
from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from memplan.estimator.errors import EstimateError
from memplan.optimizers import OPTIMIZER_NAMES
from memplan.estimator.step import LossFn, loss_from_output

_BUILDERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=1e-3),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=1e-3),
}
OPTIMIZERS = {name: _BUILDERS[name] for name in OPTIMIZER_NAMES}
"""Each of memplan.optimizers.OPTIMIZER_NAMES with its builder (a name without one fails here, at import)."""


def is_lightning_module(model: nn.Module) -> bool:
    return any(cls.__name__ == "LightningModule" for cls in type(model).__mro__)


def resolve_loss(model: nn.Module, loss: LossFn | None) -> LossFn:
    if loss is not None:
        if not callable(loss):
            raise EstimateError(f"loss must be a callable(model, batch) -> scalar tensor; got {type(loss).__name__}")
        return loss
    if is_lightning_module(model):
        return _lightning_loss
    return _output_loss


def _lightning_loss(model: nn.Module, batch: Any) -> Any:
    """training_step's output: the loss, or a dict (a ModelOutput) holding it, whose other values Lightning keeps
    until the batch ends (memplan.estimator.step.run_training_step)."""
    output = model.training_step(batch, 0)
    loss = loss_from_output(output)
    if loss is None:
        raise EstimateError(
            f"loss: training_step returned {type(output).__name__}; Lightning needs a tensor or a dict with "
            "'loss'. Return the loss from training_step, or pass loss=callable(model, batch)"
        )
    return output if isinstance(output, Mapping) else loss


def _output_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    output = call_model(model, batch)
    loss = loss_from_output(output)
    if isinstance(output, torch.Tensor) and output.numel() != 1:
        raise EstimateError(
            f"loss: the model returned a tensor of shape {tuple(output.shape)}, not a scalar loss, and no "
            "loss= was given. Pass loss=callable(model, batch) -> scalar tensor, e.g. "
            "loss=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])"
        )
    if loss is None:
        raise EstimateError(
            f"loss: the model returned {type(output).__name__} with no `.loss`, so memplan cannot tell the "
            "training loss. Pass loss=callable(model, batch) -> scalar tensor, e.g. "
            "loss=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])"
        )
    return loss


def call_model(model: nn.Module, batch: Any) -> Any:
    """Call a plain module the way its batch suggests: dict -> **kwargs, tuple/list -> *args."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def resolve_optimizer(
    model: nn.Module, optimizer: str | Callable[..., torch.optim.Optimizer] | None
) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer is None:
        if is_lightning_module(model):
            return _from_configure_optimizers(model)
        optimizer = "adamw"
    if isinstance(optimizer, str):
        if optimizer not in OPTIMIZERS:
            raise EstimateError(
                f"optimizer must be one of {', '.join(OPTIMIZERS)} or a callable(params) -> "
                f"torch.optim.Optimizer; got {optimizer!r}"
            )
        return OPTIMIZERS[optimizer](params)
    if callable(optimizer):
        built = optimizer(params)
        if not isinstance(built, torch.optim.Optimizer):
            raise EstimateError(
                f"optimizer: the callable returned {type(built).__name__}, not a torch.optim.Optimizer"
            )
        return _without_closure(built)
    raise EstimateError(f"optimizer must be a name or a callable(params) -> Optimizer; got {type(optimizer).__name__}")


def _from_configure_optimizers(model: nn.Module) -> torch.optim.Optimizer:
    """The (first) optimizer of LightningModule.configure_optimizers(), in any of its return forms."""
    config = model.configure_optimizers()
    found = _first_optimizer(config)
    if found is None:
        raise EstimateError(
            "optimizer: configure_optimizers() returned no torch.optim.Optimizer; pass optimizer='adamw' "
            "(or another name, or a callable(params)) to estimate()"
        )
    return _without_closure(found)


def _without_closure(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """`optimizer`, or an EstimateError naming it where its step() needs a closure (LBFGS): such a step re-runs the
    forward and backward inside itself, as many times as its values decide, which one traced step cannot model."""
    closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    if closure is None or closure.default is not inspect.Parameter.empty:
        return optimizer
    name = type(optimizer).__name__
    raise EstimateError(
        argument="optimizer",
        detail=f"{name}.step() needs a closure: it runs the forward and backward again inside the step, as many "
               "times as the loss's values decide, which memplan does not model",
        fix=f"Estimate with a closure-free optimizer (optimizer='sgd' for the forward and backward), then add "
            f"{name}'s own state by hand (LBFGS keeps up to 2 x history_size flat copies of the parameters, and a few "
            "more)")


def _first_optimizer(config: Any) -> torch.optim.Optimizer | None:
    if isinstance(config, torch.optim.Optimizer):
        return config
    if isinstance(config, Mapping):
        return _first_optimizer(config.get("optimizer"))
    if isinstance(config, Sequence) and not isinstance(config, (str, bytes)):
        for item in config:
            found = _first_optimizer(item)
            if found is not None:
                return found
    return None
