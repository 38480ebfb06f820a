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

The optimizer is built as the trace builds it (memplan.estimate's optimizer=, or a LightningModule's
own configure_optimizers) on the model's fake parameters, which allocates nothing, and a copy of that
very instance is stepped, each param group with its own options (a group without momentum keeps no
momentum). Counted on the parameters in its groups that require grad. An optimizer that cannot be
built or stepped here counts 0: no bound, never an error (the trace meets the same optimizer and
reports what is wrong with it).

What no probe can know is which parameters will get a gradient (an unused head, a teacher run under
no_grad keep no state) or an optimizer that factors only large matrices: the figure is a claim the
planner checks against its first trace (planner/floors.py), and withdraws if that trace holds less.
"""
from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any, Callable

import torch
from torch import nn

from memplan.estimator.inputs import resolve_optimizer

#: Shapes of the probe's parameters: a matrix, a vector and a 3-D weight (conv-like).
PROBE_SHAPES = ((8, 4), (16,), (2, 3, 4))


def elementwise_state_bytes(model: nn.Module, optimizer: str | Callable[..., Any] | None) -> int:
    """Bytes of optimizer state, over all the parameters `optimizer` trains in `model` (unsharded),
    that a step keeps if every trained parameter gets a gradient; 0 where that cannot be told."""
    try:
        built = resolve_optimizer(model, optimizer)  # on the model's (fake) parameters: no state yet
        total = 0.0
        for group, ratio in zip(built.param_groups, _elementwise_ratios(built)):
            trained = {id(p): p for p in group["params"] if p.requires_grad}.values()  # tied weights once
            total += ratio * sum(p.numel() * p.element_size() for p in trained)
    except Exception:  # any optimizer the probe cannot build or step: no bound
        return 0
    return int(total)


def _elementwise_ratios(built: torch.optim.Optimizer) -> list[float]:
    """Per param group of `built`: the least, over the probe's parameters, of (state bytes of the
    parameter's shape) / (its bytes), from one step of a copy of `built` (its class, and each group's
    own options) on small real parameters."""
    probe = copy.copy(built)
    probe.state = defaultdict(dict)
    groups = [[nn.Parameter(torch.full(shape, 0.5)) for shape in PROBE_SHAPES] for _ in built.param_groups]
    probe.param_groups = [{**group, "params": params} for group, params in zip(built.param_groups, groups)]
    for params in groups:
        for p in params:
            p.grad = torch.full_like(p, 0.1)
    probe.step()
    ratios = []
    for params in groups:
        ratios.append(min(
            sum(t.numel() * t.element_size() for t in probe.state.get(p, {}).values()
                if isinstance(t, torch.Tensor) and t.shape == p.shape) / (p.numel() * p.element_size())
            for p in params))
    return ratios
