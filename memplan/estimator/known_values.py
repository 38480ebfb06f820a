"""The values of a model's small buffers, carried beside their fakes so the trace reads them as the real step does.

A model keeps numbers in buffers that decide shapes: a padding width (`register_buffer("pad", torch.tensor(3))`,
read with `int(self.pad)` by a convolution's padding), a slice length, a mask, position ids. The buffer is
re-made a fresh fake for the trace (memplan.estimator.fake), which has no values, so `.item()` on it was answered
with 1 (values.ValueResolver): a padding of 1 instead of 3 fails the next convolution, a slice of 1 instead of
4000 elements is a silent -99.9 %. Yet the value is known: the buffer was real when the model was built.

So a buffer that is real when the fake copy is made and has at most MAX_NUMEL elements keeps its real value as
an attribute of its fake (`keep`); an op whose fake inputs all have values computes its outputs' values too, on
the CPU (`propagate`: `.to(device)`, views, `add_` of BatchNorm's step counter, arithmetic); an op that writes
into a valued fake from an input without values drops that fake's value. What asks for values
(`.item()`, `.tolist()`, `nonzero`, a boolean mask) gets the real ones (`substitute`), exactly, with no note.
The fakes themselves, and so every byte the trace counts, are unchanged.
"""
from __future__ import annotations

from typing import Any

import torch

from memplan.compat.torch import FakeTensor, disable_current_modes, tree_flatten, tree_unflatten

MAX_NUMEL = 1 << 16
"""Largest buffer (and op output) whose values are carried: structure is decided by small tensors."""
_ATTR = "_memplan_value"


def keep(original: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    """`fake` (the trace's copy of the buffer `original`), carrying `original`'s value where it has one."""
    if (not isinstance(original, FakeTensor) and original.device.type == "cpu" and original.numel() <= MAX_NUMEL
            and not original.is_sparse and tuple(original.shape) == tuple(fake.shape)):
        with disable_current_modes(), torch.no_grad():
            setattr(fake, _ATTR, original.detach().to(fake.dtype, copy=True))
    return fake


def value_of(t: object) -> torch.Tensor | None:
    """The real value a fake carries, or None."""
    return getattr(t, _ATTR, None) if isinstance(t, FakeTensor) else None


def models_carry_values(model: torch.nn.Module) -> bool:
    """Whether any buffer of `model` carries a value (the trace then propagates values op by op)."""
    return any(value_of(b) is not None for b in model.buffers())


def substitute(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """`args`, `kwargs` with every fake that carries a value replaced by that value."""
    flat, spec = tree_flatten((args, kwargs))
    if not any(value_of(t) is not None for t in flat):
        return args, kwargs
    return tree_unflatten([v if (v := value_of(t)) is not None else t for t in flat], spec)


def propagate(func, args: tuple, kwargs: dict, out: Any, *, random: bool) -> None:
    """After the fake op ran: give its outputs values when all its fake inputs carry values (computed on the
    CPU, outside every mode); drop the value of an input the op writes into otherwise."""
    flat = tree_flatten((args, kwargs))[0]
    fakes = [t for t in flat if isinstance(t, FakeTensor)]
    if not fakes:
        return
    if not random and all(value_of(t) is not None for t in fakes):
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if all(t.numel() <= MAX_NUMEL for t in outs) and _compute(func, args, kwargs, out):
            return
    for t in _written(func, args, kwargs):
        if value_of(t) is not None:
            delattr(t, _ATTR)


def _compute(func, args: tuple, kwargs: dict, out: Any) -> bool:
    """Run `func` on the values of its inputs and attach the results to `out`'s fakes; False where it cannot."""
    real_args, real_kwargs = substitute(args, {k: v for k, v in kwargs.items() if k not in ("device", "pin_memory")})
    try:
        with disable_current_modes(), torch.no_grad():
            real_out = func(*real_args, **real_kwargs)
    except Exception:  # an op the CPU cannot run as the trace asked (a device-only kernel): no value
        return False
    fake_flat, real_flat = tree_flatten(out)[0], tree_flatten(real_out)[0]
    if len(fake_flat) != len(real_flat):
        return False
    for fake, real in zip(fake_flat, real_flat):
        if isinstance(fake, FakeTensor) and isinstance(real, torch.Tensor) and real.shape == fake.shape:
            setattr(fake, _ATTR, real)
    return True


def _written(func, args: tuple, kwargs: dict) -> list:
    """The tensors `func` writes into (its schema's mutable arguments)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    written = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            written += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return written
