"""`Module.to()` / `.float()` called inside the traced step, on a model of fake parameters.

Some models convert a submodule inside their forward (SwitchTransformers' router runs
`self.classifier = self.classifier.to(self.dtype)` on every call). On real tensors a conversion to the
dtype and device the parameters already have is a no-op (`param.to(dtype)` returns `param`, and
`Module._apply` sets `.data` to itself). On fake parameters `Module._apply` always swaps each parameter
for a new one (`torch.utils.swap_tensors`), which fails ("Couldn't swap Linear.weight"), so the trace
would stop where the real step runs on. During the step, `conversions_in_step` skips such no-op
conversions as the real run does, and turns a real one (a dtype or device change of fake parameters,
which memplan cannot follow) into an EstimateError naming the module.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from memplan.compat.torch import replaced_module_apply
from memplan.estimator.errors import EstimateError


@contextlib.contextmanager
def conversions_in_step() -> Iterator[None]:
    """Within the block, `Module._apply` (`.to()`, `.float()`, `.half()`...) on a module whose tensors
    it would leave unchanged returns the module as is; any other conversion raises EstimateError."""
    def _apply(module: nn.Module, fn, recurse: bool = True):
        tensors = [t for t in (*module.parameters(recurse=recurse), *module.buffers(recurse=recurse))]
        with torch.no_grad():
            if all(fn(t) is t for t in tensors):
                return module
        raise EstimateError(
            argument="model", stage="step", detail=f"the training step converts the parameters of a "
            f"{type(module).__name__} (Module.to(), .float(), .half() or similar inside forward) to another dtype or "
            "device; memplan traces fake parameters and cannot swap them mid-step", fix="Convert the model once "
            "before training instead (e.g. model.to(dtype) before fit), or pass precision= to memplan"
        )

    with replaced_module_apply(_apply):
        yield
