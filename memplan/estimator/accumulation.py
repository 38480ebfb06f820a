"""Which `add` in a traced backward is the autograd engine's gradient accumulation (StorageTracker's rule).

The engine adds in place where the real run allows it; under the tracker's dispatch mode it never does, so the
tracker counts such an add as the real run holds it (memplan.estimator.tracker, `_settle_accumulation`).
"""
from __future__ import annotations

import torch

from memplan.compat.torch import current_autograd_node, is_view, local_tensor
from memplan.estimator.cuda.composite import linear_bias_add_in_place


_aten = torch.ops.aten
FILLED_IN_PLACE = frozenset({_aten.scatter.src, _aten.scatter.value, _aten.scatter_add.default, _aten.put.default})
"""Ops a backward formula runs in place on a buffer of zeros it has just made (`zeros(...).scatter_(dim, indices,
grad)` for max/min/median/mode/kthvalue over a dim, `scatter_add_` for gather, `put_` for take), and out of place
when any dispatch mode is active (FunctionsManual's `areAnyTensorSubclassLike`, true under the tracker): the trace
holds the buffer and its copy together, which the real backward never does (+3 % on a model whose peak is a max's
backward, +15 % on take's)."""


class RunningNode:
    """The autograd node running now, as a number that stays that node's while it runs (None outside a node).

    `torch._C._current_autograd_node()` wraps the C++ node in a Python object that the node caches only while the
    object lives. Compared by id(), a wrapper dropped between two calls is no identity: the node's next wrapper
    may sit at a new address (torch 2.11 on a ResNet's residual gradients: no accumulation was recognised, the
    caching allocator model reserved 38 MiB less on an H200 than torch 2.13's trace and the GPU) or a dead node's
    address may be taken by another. Holding the wrapper of the node running now makes the node return that same
    object on every call, and no other node can. The wrapper is dropped as soon as no node runs (the engine's
    gradient sums run under their node, so nothing that needs it is lost), at the first op outside a backward
    and when the trace stops: the trace keeps no node, nor what a custom Function's ctx holds, alive past it.

    The number belongs to a run of a node: a node that runs again after another (a reentrant checkpoint's nested
    backward returning to it) gets a new one, and its earlier gradients no longer count as made by the running
    node (the add is then counted out of place, as it runs under a dispatch mode: an overestimate)."""

    def __init__(self) -> None:
        self._node: object | None = None
        self._number = 0

    def current(self) -> int | None:
        node = current_autograd_node()
        if node is None:
            self._node = None
            return None
        if node is not self._node:
            self._node, self._number = node, self._number + 1
        return self._number

    def release(self) -> None:
        """Drop the node held."""
        self._node = None


def _filled_buffer(records, node: int | None, phase_is_backward: bool, args, out) -> list:
    """The record of the buffer an op of FILLED_IN_PLACE fills out of place in a traced backward, where the real
    formula fills it in place: one the running node made, of the output's shape and dtype, not a view; else []. The
    tracker then counts the op as in place if the buffer dies with it (it had no other use), as for an `add`."""
    if not phase_is_backward or torch.is_grad_enabled() or not isinstance(out, torch.Tensor):
        return []
    first = args[0]
    if node is None or first.shape != out.shape or first.dtype != out.dtype or is_view(first):
        return []
    record = records.get(local_tensor(first).untyped_storage())
    return [record] if record is not None and record.live and record.node == node else []


def accumulation_inputs(records, node: int | None, phase_is_backward: bool, func, args, kwargs, out) -> list:
    """The autograd engine sums two gradients flowing into one tensor (a tensor read several times: `x[:, i]` in a
    loop, tokens gathered per expert, a weight tied between an embedding and an LM head) with `old + new`
    (InputBuffer::accumulate), and in place, `old.add_(new)`, only into the gradient already in the buffer (`old`,
    the first to arrive, made by another node) when the engine holds the last reference to it and to its storage:
    never into a view, whose base holds the storage too (a Linear weight's gradient, `.t()` of a transposed
    product), nor into the new one. Under a dispatch mode, or for a tensor subclass, it always adds out of place, so
    the trace allocates a sum the real run may never hold. An `add` of two same-shape gradients in backward, with
    grad mode off, the first made by another node and not a view, the second by the node now running, is such an
    accumulation: returns the first input's record in `records` (storage -> the tracker's record), else [] (counted
    as it is). So is an autocast `F.linear`'s bias add, which the real kernel does in place on the matmul's output
    (memplan.estimator.cuda.composite): returns that output's record. `node`: the running node's number
    (RunningNode.current), as the records hold the number of the node that made them."""
    if func in FILLED_IN_PLACE:
        return _filled_buffer(records, node, phase_is_backward, args, out)
    if func is not torch.ops.aten.add.Tensor or kwargs or len(args) != 2 or not isinstance(out, torch.Tensor):
        return []
    if linear_bias_add_in_place():
        # an autocast F.linear's bias add, `output.add_(bias)` on real tensors (estimator.cuda.composite)
        first = args[0]
        if not isinstance(first, torch.Tensor) or first.shape != out.shape or first.dtype != out.dtype:
            return []
        record = records.get(local_tensor(first).untyped_storage())
        return [record] if record is not None and record.live else []
    if not phase_is_backward or torch.is_grad_enabled():
        return []
    if node is None or not all(isinstance(a, torch.Tensor) and a.shape == out.shape and a.dtype == out.dtype
                               and a.is_contiguous() for a in args):
        return []
    old, new = args
    if is_view(old):
        return []  # the real engine adds out of place: the sum is held beside both gradients
    found = [records.get(a.untyped_storage()) for a in (old, new)]
    if any(r is None or not r.live for r in found) or found[0].node == node or found[1].node != node:
        return []
    return found[:1]
