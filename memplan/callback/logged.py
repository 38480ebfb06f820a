"""A split batch's `self.log` calls, merged into the calls the whole batch would have made.

training_step runs once per chunk when a batch is split (memplan.callback.chunking); each chunk's
`self.log` / `self.log_dict` calls are held, and the batch logs once, with values that describe the
whole batch, merged by the `reduce_fx` the user gave Lightning for merging values across steps:

    "mean" (Lightning's default)  the chunks' values weighted as their losses are: by each chunk's
                                  share of the samples (or of `mean_over`, tokens say) under
                                  loss_reduction="mean", so a logged mean loss is the batch's; added
                                  up under loss_reduction="sum", so a logged sum loss is the batch's
    "sum"                         added up (counts, a logged batch size)
    "max" / "min"                 the largest / smallest

What cannot be merged (a torchmetrics Metric object, whose own state already holds every chunk's
update; a custom reduce_fx) is logged as the last chunk gave it, with a warning naming the key.
"""
from __future__ import annotations

import numbers
import warnings
from typing import Any

import torch

Call = tuple[tuple, dict]

_REDUCE_FX_POSITION = 6  # LightningModule.log(name, value, prog_bar, logger, on_step, on_epoch, reduce_fx, ...)


def merge_logged(chunks: list[tuple[float, list[Call]]], summed_loss: bool) -> list[Call]:
    """One call per logged name, in the order first logged: `chunks` is each successful chunk's loss
    weight and held calls; `summed_loss`: the loss is a sum (each weight 1), else a weighted mean."""
    by_name: dict[str, list[tuple[float, Call]]] = {}
    for weight, calls in chunks:
        for args, kwargs in calls:
            name = args[0] if args else kwargs.get("name")
            by_name.setdefault(name, []).append((weight, (args, kwargs)))
    return [_merge(name, entries, summed_loss) for name, entries in by_name.items()]


def _merge(name: str, entries: list[tuple[float, Call]], summed_loss: bool) -> Call:
    args, kwargs = entries[-1][1]
    if len(entries) == 1:
        return args, kwargs
    values = [_value(call) for _, call in entries]
    reduce_fx = args[_REDUCE_FX_POSITION] if len(args) > _REDUCE_FX_POSITION else kwargs.get("reduce_fx", "mean")
    reduce_name = reduce_fx if isinstance(reduce_fx, str) else getattr(reduce_fx, "__name__", repr(reduce_fx))
    if not all(isinstance(v, (torch.Tensor, numbers.Number)) for v in values) or \
            reduce_name not in ("mean", "sum", "max", "min"):
        warnings.warn(f"MemoryPlanner: self.log({name!r}, ...) in a batch split into chunks logs the last chunk's "
                      f"value: a {type(values[-1]).__name__} with reduce_fx={reduce_name!r} cannot be merged over "
                      "the chunks (a torchmetrics Metric's own state holds every chunk's update; its epoch value is "
                      "the batch's)", stacklevel=2)
        return args, kwargs
    values = [v.detach() if isinstance(v, torch.Tensor) else v for v in values]
    if reduce_name == "max":
        merged = _fold(values, torch.maximum, max)
    elif reduce_name == "min":
        merged = _fold(values, torch.minimum, min)
    elif reduce_name == "sum" or summed_loss:
        merged = _fold(values, torch.add, lambda a, b: a + b)
    else:
        weights = [w for w, _ in entries]
        kept = [(w, v) for w, v in zip(weights, values) if w]  # a chunk weighing nothing (no token) is left out
        if not kept:
            return args, kwargs
        total = sum(w for w, _ in kept)
        merged = _fold([v * (w / total) for w, v in kept], torch.add, lambda a, b: a + b)
    return _with_value(args, kwargs, merged, [call for _, call in entries])


def _fold(values: list[Any], tensor_op: Any, number_op: Any) -> Any:
    out = values[0]
    for v in values[1:]:
        if isinstance(out, torch.Tensor) or isinstance(v, torch.Tensor):
            out = tensor_op(torch.as_tensor(out), torch.as_tensor(v))
        else:
            out = number_op(out, v)
    return out


def _value(call: Call) -> Any:
    args, kwargs = call
    return args[1] if len(args) > 1 else kwargs.get("value")


def _with_value(args: tuple, kwargs: dict, value: Any, calls: list[Call]) -> Call:
    if len(args) > 1:
        args = (args[0], value, *args[2:])
    else:
        kwargs = {**kwargs, "value": value}
    sizes = [c[1].get("batch_size") for c in calls]
    if all(isinstance(s, int) for s in sizes):  # batch_size= given per chunk: the batch's is their sum
        kwargs = {**kwargs, "batch_size": sum(sizes)}
    return args, kwargs
