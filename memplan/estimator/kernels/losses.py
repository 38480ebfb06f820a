"""Elementwise losses whose CPU kernels hold buffers the trace does not see.

ATen's mse_loss, smooth_l1_loss, huber_loss, binary_cross_entropy and soft_margin_loss (Loss.cpp) compute the
unreduced loss into a buffer of the input's size and then reduce it: one op and a scalar to the trace, a full-size
buffer to the kernel. All but huber_loss return the reduced loss as a 0-dim tensor over that whole buffer, alive as
long as the loss is (`kept_buffer_bytes`: the tracker counts it); with a target broadcast to the input
(`F.mse_loss(out, x.expand_as(out))`, or a target of another shape, which F.mse_loss broadcasts) mse_loss holds a
second one while it runs, which the kernel probe measures (REDUCED_LOSSES, their backwards too: kernels/probe.py). A
reconstruction loss over 4 samples of each input read -31.8 % against a real fit whose peak it was (-18 % the kept
buffer, -14 % the transient one)."""
from __future__ import annotations

import math

import torch

REDUCED_LOSSES = frozenset(getattr(torch.ops.aten, name).default for name in (
    "mse_loss", "mse_loss_backward", "smooth_l1_loss", "smooth_l1_loss_backward", "huber_loss", "huber_loss_backward",
    "binary_cross_entropy", "binary_cross_entropy_backward", "soft_margin_loss", "soft_margin_loss_backward"))

_REDUCTION_AT = {getattr(torch.ops.aten, name).default: at for name, at in (
    ("mse_loss", 2), ("smooth_l1_loss", 2), ("binary_cross_entropy", 3), ("soft_margin_loss", 2))}
"""Losses whose CPU kernel returns the reduced loss as a 0-dim tensor over the whole unreduced buffer (the buffer
resized to one element, or the reduction written into it): the loss holds input-sized bytes for as long as it lives,
where the meta kernel's holds one element (torch 2.13 on CPU; huber_loss and l1_loss do not). By the position of their
`reduction` argument."""


def kept_buffer_bytes(func, args: tuple, kwargs: dict, out) -> int:
    """What the real CPU kernel's output of `func` holds where it is more than the fake output's one element (the
    unreduced loss at the broadcast shape of input and target, in the loss's dtype); 0 otherwise."""
    at = _REDUCTION_AT.get(func)
    if at is None or not isinstance(out, torch.Tensor) or out.dim() != 0:
        return 0
    if kwargs.get("reduction", args[at] if len(args) > at else 1) == 0:
        return 0
    return math.prod(torch.broadcast_shapes(args[0].shape, args[1].shape)) * out.element_size()
