"""A lower bound on the optimizer state a model's training keeps, known before any trace.

The planner rules out settings by lower bounds (planner/floors.py); the larger the bound it has
before a trace, the fewer traces it makes. The parameter bytes are known from the model's skeleton;
most optimizers also keep state the size of each parameter (SGD's momentum, Adam's two moments),
which for a large model is most of its training state. Which state an optimizer keeps is found by
running it for one step on a few small real parameters of different shapes: the state tensors of a
parameter's own shape are elementwise state, whatever the optimizer (torch's or a user's). Only
that part is counted, and only the smallest ratio seen over the probe's shapes, so the figure is a
lower bound for every parameter: a factored optimizer (Adafactor keeps row and column statistics
for a matrix) counts 0 for its matrices, and per-parameter scalars (Adam's step) count nothing.

Counted on the parameters the optimizer trains: those that require grad, or for a LightningModule's
own configure_optimizers, those in its optimizer's param groups (built on the fake skeleton, which
allocates nothing). An optimizer that cannot be built or stepped here counts 0: no bound, never an
error (the trace meets the same optimizer and reports what is wrong with it).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from torch import nn

from memplan.estimator.inputs import resolve_optimizer

#: Shapes of the probe's parameters: a matrix, a vector and a 3-D weight (conv-like).
PROBE_SHAPES = ((8, 4), (16,), (2, 3, 4))


def elementwise_state_bytes(model: nn.Module, optimizer: str | Callable[..., Any] | None) -> int:
    """Bytes of optimizer state, over all the parameters `optimizer` trains in `model` (unsharded),
    that every step keeps at the least; 0 where that cannot be told."""
    try:
        trained, factory = _trained_and_factory(model, optimizer)
        ratio = _elementwise_ratio(factory)
    except Exception:  # any optimizer the probe cannot build or step: no bound
        return 0
    return int(ratio * sum(p.numel() * p.element_size() for p in trained))


def _trained_and_factory(model: nn.Module, optimizer: str | Callable[..., Any] | None
                         ) -> tuple[list[nn.Parameter], Callable[[list[nn.Parameter]], torch.optim.Optimizer]]:
    """The parameters the optimizer steps, and how to build the same optimizer on other parameters."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if optimizer is not None or not hasattr(model, "configure_optimizers"):
        return trainable, lambda params: resolve_optimizer(_Holder(params), optimizer)
    built = resolve_optimizer(model, None)  # the model's configure_optimizers, on its fake parameters
    stepped = {id(p) for group in built.param_groups for p in group["params"] if p.requires_grad}
    cls = type(built)  # rebuilt from its defaults, less those its constructor does not take (AdamW's
    accepted = inspect.signature(cls.__init__).parameters
    takes_any = any(a.kind is inspect.Parameter.VAR_KEYWORD for a in accepted.values())
    defaults = {k: v for k, v in built.defaults.items() if takes_any or k in accepted}  # name one of Adam's)
    return [p for p in trainable if id(p) in stepped], lambda params: cls(params, **defaults)


def _elementwise_ratio(factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> float:
    """The least, over the probe's parameters, of (state bytes of the parameter's shape) / (its bytes)."""
    params = [nn.Parameter(torch.full(shape, 0.5)) for shape in PROBE_SHAPES]
    opt = factory(params)
    for p in params:
        p.grad = torch.full_like(p, 0.1)
    opt.step()
    ratios = []
    for p in params:
        own = sum(t.numel() * t.element_size() for t in opt.state.get(p, {}).values()
                  if isinstance(t, torch.Tensor) and t.shape == p.shape)
        ratios.append(own / (p.numel() * p.element_size()))
    return min(ratios)


class _Holder(nn.Module):
    """A module owning the probe's parameters, for resolve_optimizer."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__()
        self.params = nn.ParameterList(params)
