"""Real tensors the trace made, and the fake tensors FakeTensorMode converts them to: one storage in a real run.

The trace runs an op whose inputs are all real for real (memplan.estimator.tracker: ops on the batch alone, such as
`x.repeat(1, 4)`), so its output is a real tensor with a storage of its own, counted. When a later op meets it beside a
fake tensor, FakeTensorMode converts it to a fake tensor with another storage (memoized while that fake lives): an
in-place op (`e.mul_(h)`, h an activation) returns that fake, whose storage the tracker would count a second time (+13
to +15 % on small models whose peak holds such a tensor). In a real run they are one tensor. `share_conversions` counts
such an output's storage under the real input's record, freed when both storages are gone."""
from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch

from memplan.compat.torch import FakeTensor, disable_current_modes, local_tensor


def share_conversions(records, fake_mode, inputs: Iterable[torch.Tensor], outputs: Iterable[torch.Tensor],
                      died: Callable) -> None:
    """Each fake tensor of an op's `outputs` that `records` does not count and that is `fake_mode`'s conversion of a
    real input whose storage it counts (live): counted under that input's record (`records`: storage -> record with a
    `storages` count; `died(record)` runs as each storage is gone)."""
    reals = []
    for tensor in inputs:
        real = local_tensor(tensor)
        if not isinstance(real, FakeTensor) and real.layout == torch.strided:
            record = records.get(real.untyped_storage())
            if record is not None and record.live:
                reals.append((real, record))
    if not reals:
        return
    for out in outputs:
        if not isinstance(out, FakeTensor) or out.untyped_storage() in records:
            continue
        for real, record in reals:
            if out.shape != real.shape or out.dtype != real.dtype:
                continue
            with disable_current_modes():
                converted = fake_mode.from_tensor(real)  # the memoized conversion while it lives, else a new one
            if converted is out:
                records[out.untyped_storage()] = record
                record.storages += 1
                weakref.finalize(out.untyped_storage(), died, record)
                break
