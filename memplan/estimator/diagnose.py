"""Turn a failure inside the traced step into one EstimateError that names its cause.

The failure's traceback tells where it happened, with no hook in the trace: the innermost frame of
the tracker's `__torch_dispatch__` holds the aten op that failed and its arguments, and the
innermost `nn.Module._call_impl` frame holds the module it ran in (named by its path in the model,
`model.layers.3.mlp.experts`). The batch is blamed only when it is the cause:

- an op failed on a tensor of the batch (a real tensor sharing the batch's storage: the first layer
  meeting an input of the wrong shape or dtype);
- or no op failed and the step's own code could not take the batch apart (KeyError, IndexError,
  ValueError, TypeError outside every submodule: `x, y = batch`, `batch["labels"]`, a forward called
  with keywords it does not have).

Anything else is the model's or an op's: the op, the module, and the fix.
"""
from __future__ import annotations

import inspect
import os
import sysconfig
import traceback
from collections.abc import Iterable
from types import TracebackType

import torch
from torch import nn

from memplan.compat.torch import FakeTensor, UnsupportedOperatorException, module_call_code, storage_key, tree_flatten
from memplan.estimator.errors import EstimateError
from memplan.estimator.tracker import StorageTracker

_BATCH_SHAPED = (KeyError, IndexError, ValueError, TypeError)
"""Errors of code taking a batch apart, when raised outside every submodule."""

_SAVED_TENSOR_HOOKS = "don't yet support saved tensor hooks"
"""torch.func's refusal (torch 2.4-2.13) of grad, vjp, jacrev and hessian under saved-tensor hooks."""

_BATCH_FIX = ("Pass the batch exactly as training_step receives it (same structure, keys, shapes and dtypes), "
              "and a loss= that matches it")


def explain_failure(err: BaseException, *, model: nn.Module, batch_tensors: Iterable[torch.Tensor],
                    phase: str) -> EstimateError:
    """The EstimateError for `err`, raised while tracing the `phase` ("forward", "backward",
    "optimizer") of a step of `model` on a batch made of `batch_tensors`."""
    frames = [frame for frame, _ in traceback.walk_tb(err.__traceback__)]
    failed = _failed_op(frames)
    where = _module_path(frames, model)
    what = f"{type(err).__name__}: {_first_line(err)}"
    in_module = f" in `{where}`" if where else _user_location(err)
    if failed is not None:
        func, args = failed
        call = _describe_call(func, args)
        batch_storages = {storage_key(t) for t in batch_tensors if t.layout == torch.strided}
        if any(_is_real(t) and t.layout == torch.strided and storage_key(t) in batch_storages for t in _tensors(args)):
            return EstimateError(argument="batch", detail=f"the model could not run {call}{in_module} on this batch "
                                 f"({what})", fix=_BATCH_FIX, cause=what)
        return EstimateError(argument="model", stage="step", detail=f"the op {call} failed{in_module} in the {phase} "
                             f"({what})", fix=_op_fix(err), cause=what)
    location = _user_location(err)
    if isinstance(err, RuntimeError) and _SAVED_TENSOR_HOOKS in str(err):
        return EstimateError(argument="model", stage="step", detail=f"the training step calls a torch.func transform "
                             f"(grad, vjp, jacrev, hessian){in_module}, which refuses to run under saved-tensor "
                             "hooks; memplan's trace follows every tensor saved for backward with them, so it cannot "
                             "trace this step", fix="Estimate a variant of the step that takes the same gradients "
                             "with torch.autograd.grad(..., create_graph=True) (it traces), or measure this one on a "
                             "GPU", cause=what)
    if isinstance(err, _BATCH_SHAPED) and phase == "forward" and where in (None, "model"):
        return EstimateError(argument="batch", detail=f"the training step could not take this batch ({what}{location})",
                             fix=_BATCH_FIX, cause=what)
    return EstimateError(argument="model", stage="step", detail=f"the training step raised {what}{in_module} in the "
                         f"{phase}{location}", fix="Check that it runs for real on this batch; if it does, this is "
                         "memplan's to fix: report it with this message", cause=what)


def op_without_fake_kernel(err: BaseException) -> str | None:
    """The op ('aten._cudnn_init_dropout_state.default') whose missing fake kernel stopped the trace, where that is
    what `err` (an EstimateError from `explain_failure`, or its cause) is; None for any other failure."""
    cause = err.__cause__ if isinstance(err, EstimateError) else err
    if not isinstance(cause, (UnsupportedOperatorException, NotImplementedError)):
        return None
    failed = _failed_op([frame for frame, _ in traceback.walk_tb(cause.__traceback__)])
    return str(failed[0]) if failed is not None and failed[0] is not None else None


def _failed_op(frames) -> tuple[object, tuple] | None:
    """(op, its (args, kwargs)) from the innermost tracker dispatch frame, or None if no op failed."""
    code = inspect.unwrap(StorageTracker.__torch_dispatch__).__code__  # under torch's dynamo-disable wrapper
    for frame in reversed(frames):
        if frame.f_code is code:
            return frame.f_locals.get("func"), (frame.f_locals.get("args", ()), frame.f_locals.get("kwargs") or {})
    return None


def _module_path(frames, model: nn.Module) -> str | None:
    names = {id(m): ("model." + name if name else "model") for name, m in model.named_modules()}
    code = module_call_code()
    for frame in reversed(frames):
        if frame.f_code is code:
            name = names.get(id(frame.f_locals.get("self")))
            if name is not None:
                return name
    return None


def _op_fix(err: BaseException) -> str:
    unsupported = isinstance(err, (UnsupportedOperatorException, NotImplementedError)) or any(
        word in str(err) for word in ("fake impl", "Meta", "meta kernel", "register_fake"))
    if unsupported:
        return ("memplan traces on fake tensors and this op has no fake (meta) kernel: register one with "
                "torch.library.register_fake, or estimate a variant of the model that avoids the op")
    return ("Check that the model runs this step for real on this batch and precision (a shape or dtype "
            "mismatch inside the model fails there too); if it does, the op's fake kernel is stricter than its "
            "real one: try another precision=, or a variant of the model that avoids the op")


def _describe_call(func, args) -> str:
    shapes = ", ".join(f"{_layout(t)}{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in _tensors(args))
    return f"{func}({shapes})"


def _layout(t: torch.Tensor) -> str:
    """'' for a dense tensor, else its layout ('sparse_coo ')."""
    return "" if t.layout == torch.strided else f"{str(t.layout).removeprefix('torch.')} "


def _tensors(args) -> list[torch.Tensor]:
    return [a for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor)]


def _is_real(t: torch.Tensor) -> bool:
    return not isinstance(t, FakeTensor) and t.device.type != "meta"


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else "(no message)"


def _user_location(err: BaseException) -> str:
    """' at file:line' of the innermost frame outside torch, memplan's estimator and Python's own library
    (contextlib's and functools' wrappers, which torch.func's transforms run through), or ''."""
    tb: TracebackType | None = err.__traceback__
    found = ""
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if "/torch/" not in filename and "/memplan/estimator/" not in filename and not _in_stdlib(filename):
            found = f" at {filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    return found


_STDLIB = tuple(os.path.join(os.path.realpath(sysconfig.get_paths()[key]), "")
                for key in ("stdlib", "platstdlib"))


def _in_stdlib(filename: str) -> bool:
    path = os.path.realpath(filename)
    return path.startswith(_STDLIB) and "site-packages" not in path
