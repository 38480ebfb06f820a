"""The carrier: how a batch run as chunks inside training_step gives Lightning one loss to backward.

Every chunk's forward and backward run in training_step (memplan.callback.chunking), so the batch's
gradient exists before Lightning's backward. What training_step returns is a *carrier*: a loss whose
value is the whole batch's and whose backward hands every parameter the gradient already computed
(`CarryGradients`: the gradients are moved out of `.grad` before returning and given back, not copied,
by Lightning's one backward). That backward allocates nothing, and under DDP it is the rank's one
synchronised backward: DDP's hooks fire once per parameter and all-reduce the whole gradient.

DDP rebuilds its buckets once, from the order its hooks fire in the first synchronised backward. A single
carrier fires them in the autograd engine's heap order, which can put the first layer in bucket 0 and hold
back every all-reduce of the run (buckets go out in order). So on that one backward the gradients go
through a chain of carriers, one per parameter, in the order the step's own backward made them
(`Recording` records it).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


class Handoff:
    """The gradients a carrier gives back, dropped as they are given (so autograd can take them
    over without a copy), and dropped too if the carrier is never backwarded."""

    def __init__(self, grads: list[torch.Tensor]) -> None:
        self.grads: list[torch.Tensor] | None = grads

    def take(self) -> list[torch.Tensor]:
        grads, self.grads = self.grads, None
        if grads is None:
            raise RuntimeError("MemoryPlanner: a batch's loss was backwarded twice; its gradients were already "
                               "given to the parameters by the first backward")
        return grads


class CarryGradients(torch.autograd.Function):
    """value -> value; its backward gives the parameters it was applied to the gradients in the
    handoff, and passes the incoming gradient on to `value`.

    The gradients were computed in training_step with the scale Lightning applies to the loss it
    backwards (the batch share, 1/accumulate_grad_batches, the GradScaler's scale), so the incoming
    gradient, which is that same scale, is not applied again. One carrier hands over every gradient at
    once. A chain of carriers, one parameter each, hands them over one at a time in the chain's order:
    when a link has run, the engine runs its parameter's AccumulateGrad (the highest priority it
    knows) before the next link (`carry`, for DDP's bucket rebuild)."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, handoff: Handoff, *params: torch.Tensor) -> torch.Tensor:
        ctx.handoff = handoff
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grads = ctx.handoff.take()
        ctx.handoff = None
        return (grad_output, None, *grads)


def carry(output: Any, value: torch.Tensor, params: list[torch.nn.Parameter], order: list[int] | None) -> Any:
    """training_step's output with its loss replaced by a carrier of the gradients `params` hold now (taken out of
    `.grad`): one carrier, or with `order` (indices into `params`) a chain of carriers handing them over in
    that order, any parameter not in it after, latest registered first."""
    held, grads = [], []
    for param in params:
        grad = param.grad
        if grad is not None and param.requires_grad:
            held.append(param)
            grads.append(grad)
            param.grad = None
    if order is None:
        carrier = CarryGradients.apply(value, Handoff(grads), *held)
    else:
        rank = {index: position for position, index in enumerate(dict.fromkeys(order))}
        index = {id(param): i for i, param in enumerate(params)}
        first = sorted(zip(held, grads), key=lambda pg: (rank.get(index[id(pg[0])], len(rank)), -index[id(pg[0])]))
        carrier = value
        for param, grad in reversed(first):  # the last link made runs first in the backward
            carrier = CarryGradients.apply(carrier, Handoff([grad]), param)
    if isinstance(output, torch.Tensor):
        return carrier
    if isinstance(output, Mapping):
        return {**output, "loss": carrier}
    raise TypeError(f"training_step returned {type(output).__name__}; MemoryPlanner chunks batches whose "
                    "training_step returns a loss tensor or a dict with 'loss'")


class Recording:
    """Record the order in which a backward makes the parameters' gradients (post-accumulate hooks,
    on for this one backward only)."""

    def __init__(self, params: list[torch.nn.Parameter], order: list[int]) -> None:
        self._params, self._order, self._handles = params, order, []

    def __enter__(self) -> None:
        order = self._order
        self._handles = [p.register_post_accumulate_grad_hook(lambda _, i=i: order.append(i))
                         for i, p in enumerate(self._params) if p.requires_grad]

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
