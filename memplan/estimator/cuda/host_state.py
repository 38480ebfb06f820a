"""Optimizer state that torch keeps in host memory on a CUDA run.

torch's optimizers create each parameter's step counter in `_init_group` as `torch.tensor(0.0)` (no device:
the CPU) unless the group is `capturable` (or `fused`, where a fused kernel exists), "because kernel launches
are costly on CUDA" (torch/optim/nadam.py's note [special device hosting for step]; torch 2.11 - 2.13). On a
CUDA run those 0-dim tensors take no GPU memory; a trace on fake CPU tensors creates them like any other
state, and counting them would add one 512-byte block per parameter. The H100's op readings show it
(benchmarks/results/gpu_campaign_raw_h100/ops/, step 1: one `lift_fresh` of 0 device bytes per parameter).

Per optimizer (installed torch's `_init_group`): Adam and AdamW keep `step` on the host unless capturable
or fused; Adagrad unless fused; Adadelta, Adamax, RAdam, RMSprop and Rprop unless capturable; NAdam its
`step` and `mu_product` unless capturable; Adafactor always. ASGD keeps `step`, `eta` and `mu` on the
device; SGD keeps no counter; SparseAdam's and LBFGS's counters are Python ints.
"""
from __future__ import annotations

import torch

_CAPTURABLE = ("capturable",)
_HOST_STATE = (
    # (optimizer classes, state keys kept on the host, group options that put them on the device instead)
    ((torch.optim.Adam,), ("step",), ("capturable", "fused")),  # AdamW subclasses Adam
    ((torch.optim.Adagrad,), ("step",), ("fused",)),
    ((torch.optim.NAdam,), ("step", "mu_product"), _CAPTURABLE),
    ((torch.optim.Adadelta, torch.optim.Adamax, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Rprop),
     ("step",), _CAPTURABLE),
    ((torch.optim.Adafactor,), ("step",), ()),
)


def host_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The state tensors of `optimizer` that torch would keep in host memory on CUDA ([] for other optimizers)."""
    rule = next(((keys, unless) for classes, keys, unless in _HOST_STATE if isinstance(optimizer, classes)), None)
    if rule is None:
        return []
    keys, unless = rule
    found = []
    for group in optimizer.param_groups:
        if any(group.get(option) for option in unless):
            continue
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            found.extend(t for t in (state.get(k) for k in keys) if isinstance(t, torch.Tensor) and t.dim() == 0)
    return found
