"""The values of a model's small buffers, carried beside their fakes so the trace reads them as the real step does.

A model keeps numbers in buffers that decide shapes: a padding width (`register_buffer("pad", torch.tensor(3))`,
read with `int(self.pad)` by a convolution's padding), a slice length, a mask, position ids. The buffer is
re-made a fresh fake for the trace (memplan.estimator.fake), which has no values, so `.item()` on it was answered
with 1 (values.ValueResolver): a padding of 1 instead of 3 fails the next convolution, a slice of 1 instead of
4000 elements is a silent -99.9 %. Yet the value is known: the buffer was real when the model was built.

So a buffer that is real when the fake copy is made, has at most MAX_NUMEL elements and is no view of another
keeps its real value, carried by its fake's storage (`keep`), so every view, `.detach()` and `.data` of it reads
and writes the same value; an op whose fake inputs all have values computes its outputs' values too, on the CPU
(`propagate`: `.to(device)`, views, `add_` of BatchNorm's step counter, arithmetic); an op that writes into a
valued storage from an input without values drops the storage's value, for every alias at once. What asks for values
(`.item()`, `.tolist()`, `nonzero`, a boolean mask) gets the real ones (`substitute`), exactly, with no note.
The fakes themselves, and so every byte the trace counts, are unchanged.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from memplan.compat.torch import (FakeTensor, OpOverload, disable_current_modes, is_fake, op_schema, owns_its_storage,
                                  tree_flatten, tree_unflatten)

MAX_NUMEL = 1 << 16
"""Largest buffer (and op output) whose values are carried: structure is decided by small tensors."""
_VALUES = WeakIdKeyDictionary()
"""A fake storage -> a real tensor laid out over a real storage as its fakes are over it (a value is the
storage's, so a write through any view, `.detach()` or `.data` of it reaches or drops every alias at once)."""


def keep(original: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    """`fake` (the trace's copy of the buffer `original`), carrying `original`'s value where it has one. A buffer
    that is a view of another is not carried: its fake copy has a storage of its own, which writes into the other
    would not reach."""
    if (not isinstance(original, FakeTensor) and original.device.type == "cpu" and original.numel() <= MAX_NUMEL
            and not original.is_sparse and owns_its_storage(original) and tuple(original.shape) == tuple(fake.shape)
            and fake.storage_offset() == 0):
        with disable_current_modes(), torch.no_grad():
            real = torch.empty_strided(tuple(fake.shape), fake.stride(), dtype=fake.dtype).copy_(original)
        _remember(fake, real)
    return fake


def _remember(fake: torch.Tensor, real: torch.Tensor) -> None:
    """Let `fake`'s storage carry `real`, laid out as `fake` is (same shape, strides and offset)."""
    if real.shape == fake.shape and real.stride() == fake.stride() and real.storage_offset() == fake.storage_offset():
        _VALUES[fake.untyped_storage()] = real


def _carries(t: FakeTensor) -> bool:
    real = None if t.is_sparse else _VALUES.get(t.untyped_storage())
    return real is not None and real.dtype == t.dtype


def value_of(t: object) -> torch.Tensor | None:
    """The real value of the fake `t` (any view of a storage that carries one), or None."""
    if not isinstance(t, FakeTensor) or not _carries(t):
        return None
    real = _VALUES[t.untyped_storage()]
    try:
        with disable_current_modes():
            return real.as_strided(tuple(t.shape), t.stride(), t.storage_offset())
    except RuntimeError:  # a view reaching past what the value covers: no value
        return None


def values_of(t: torch.Tensor) -> torch.Tensor | None:
    """`t`'s values where the trace has them: `t` itself if it is real (the batch's), a fake's carried value (a
    buffer's), else None (a fake without one, or a meta tensor)."""
    if is_fake(t):  # (a DTensor of fakes too: no value)
        return value_of(t)
    return None if t.device.type == "meta" else t


def models_carry_values(model: torch.nn.Module) -> bool:
    """Whether any buffer of `model` carries a value (the trace then propagates values op by op)."""
    return any(isinstance(b, FakeTensor) and b.untyped_storage() in _VALUES for b in model.buffers())


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
    if not random and all(_carries(t) for t in fakes):
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if all(t.numel() <= MAX_NUMEL for t in outs) and _compute(func, args, kwargs, out):
            return
    for t in _written(func, args, kwargs):
        if isinstance(t, FakeTensor) and not t.is_sparse:
            _VALUES.pop(t.untyped_storage(), None)


def _compute(func, args: tuple, kwargs: dict, out: Any) -> bool:
    """Run `func` on the values of its inputs and attach the results to `out`'s fakes; False where it cannot."""
    real_args, real_kwargs = substitute(args, {k: v for k, v in kwargs.items() if k not in ("device", "pin_memory")})
    if any(isinstance(t, FakeTensor) for t in tree_flatten((real_args, real_kwargs))[0]):
        return False
    try:
        with disable_current_modes(), torch.no_grad():
            real_out = func(*real_args, **real_kwargs)
    except Exception:  # an op the CPU cannot run as the trace asked (a device-only kernel): no value
        return False
    fake_flat, real_flat = tree_flatten(out)[0], tree_flatten(real_out)[0]
    if len(fake_flat) != len(real_flat):
        return False
    for fake, real in zip(fake_flat, real_flat):
        if isinstance(fake, FakeTensor) and isinstance(real, torch.Tensor) and not fake.is_sparse \
                and fake.untyped_storage() not in _VALUES:  # a view or in-place result: its storage carries it
            _remember(fake, real)
    return True


def _written(func, args: tuple, kwargs: dict) -> list:
    """The tensors `func` writes into (its schema's mutable arguments)."""
    if not isinstance(func, OpOverload):
        return []
    written = []
    for i, arg in enumerate(op_schema(func).arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            written += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return written
