"""One training step, defined once.

The tracer runs it on fake tensors, the benchmarks run it on real ones: both must execute the same
sequence of ops, or the estimate would be exact for a step nobody runs. The orders (`loop=`):

    "lightning"            forward + loss (autocast) -> zero_grad(set_to_none=True) -> backward -> update
    "torch"                forward + loss (autocast) -> backward -> update -> zero_grad(set_to_none=True)
                           (the same memory as zero_grad at the top of the loop, its usual place)
    "torch-zero-after-forward"
                           forward + loss (autocast) -> zero_grad(set_to_none=True) -> backward -> update
                           (a plain loop, or Fabric's, that zeroes between forward and backward)
    "torch-keep-grads"     forward + loss (autocast) -> backward -> update -> zero_grad(set_to_none=False)
                           (gradients stay allocated across steps: torch 1.x's default, `model.zero_grad()`
                           before torch 2.0, a hand-written `p.grad.zero_()`)

Lightning's autocast runs with the weight cache off (since Lightning 2.5.5; earlier releases keep it on, as the
installed one says: compat.versions.lightning_autocast_caches); a plain loop's `torch.autocast` keeps it on (every
loop but "lightning").

"lightning" is Lightning's automatic optimization (pytorch_lightning/loops/optimization/automatic.py,
`Closure.closure`): it zeroes gradients *after* the forward, so the previous step's gradients are
still alive while the next forward builds its activations. "torch" is the plain PyTorch loop, whose
forward runs with no gradients alive, so it peaks lower when the forward's activations dominate.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from memplan.batching import iter_tensors, map_tensors  # noqa: F401  (re-exported: the estimator's callers import them here)
from memplan.compat.torch import amp_unscale_
from memplan.compat.versions import lightning_autocast_caches
from memplan.estimator.errors import EstimateError

LossFn = Callable[[nn.Module, Any], Any]
"""(model, batch) -> the scalar loss, or training_step's output holding it (a dict's "loss", a ModelOutput's)."""

Loop = Literal["lightning", "torch", "torch-zero-after-forward", "torch-keep-grads"]
LOOPS: tuple[str, ...] = ("lightning", "torch", "torch-zero-after-forward", "torch-keep-grads")
PLAIN_LOOPS: tuple[str, ...] = LOOPS[1:]
"""The orders of a plain PyTorch (or Fabric) loop: `torch.autocast` with its weight cache on."""
LOOP_NOTES: dict[str, str] = {
    "torch": "plain PyTorch loop order: zero_grad(set_to_none=True) after the optimizer step",
    "torch-zero-after-forward": "plain PyTorch loop order: zero_grad(set_to_none=True) between forward and "
                                "backward, so the last step's gradients are alive through the forward",
    "torch-keep-grads": "plain PyTorch loop order: zero_grad(set_to_none=False) after the optimizer step, so "
                        "gradients stay allocated through every step",
}
"""The note an estimate carries for each plain loop's order."""

_MIXED = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}
_TRUE = {"16-true": torch.float16, "bf16-true": torch.bfloat16}


@dataclass(frozen=True, kw_only=True)
class PrecisionPolicy:
    """How a Lightning precision string changes the step."""

    precision: str
    """Lightning's precision string."""
    autocast_dtype: torch.dtype | None
    """dtype of torch.autocast around forward + loss; None without AMP."""
    param_dtype: torch.dtype
    """dtype of parameters and floating-point inputs ('16-true' / 'bf16-true' convert the model)."""
    grad_scaling: bool
    """Whether Lightning's MixedPrecision plugin uses a GradScaler ('16-mixed')."""

    @classmethod
    def from_string(cls, precision: str) -> PrecisionPolicy:
        from memplan.estimator.result import PRECISIONS

        if precision not in PRECISIONS:
            raise EstimateError(
                f"precision must be one of Lightning's strings {', '.join(PRECISIONS)}; got {precision!r}"
            )
        return cls(
            precision=precision,
            autocast_dtype=_MIXED.get(precision),
            param_dtype=_TRUE.get(precision, torch.float32),
            grad_scaling=precision == "16-mixed",
        )

    def forward_context(self, device_type: str, *, loop: Loop = "lightning",
                        lightning: str = "pytorch-lightning") -> contextlib.AbstractContextManager:
        """Lightning's `precision_plugin.forward_context()`: autocast with the weight cache off
        (plugins/precision/amp.py: `torch.autocast(device, dtype=dtype, cache_enabled=False)`, Lightning 2.5.5 and
        later; before, the cache on, as the installed Lightning says: compat.versions.lightning_autocast_caches), or
        the default dtype set to the half type for the '-true' precisions (plugins/precision/half.py).
        A plain loop (every `loop` but "lightning") writes `torch.autocast(device, dtype=dtype)`, whose weight cache is
        on: each parameter's cast is made once and held until the autocast block exits. `lightning`: the distribution
        whose Trainer runs the step (`lightning_distribution`)."""
        if self.autocast_dtype is not None:
            caches = loop in PLAIN_LOOPS or lightning_autocast_caches(lightning)
            return torch.autocast(device_type, dtype=self.autocast_dtype, cache_enabled=caches)
        if self.param_dtype != torch.float32:
            return _default_dtype(self.param_dtype)
        return contextlib.nullcontext()

    def convert_batch(self, batch: Any) -> Any:
        """'-true' precisions cast floating-point inputs to the half type, as Lightning's HalfPrecision does."""
        if self.param_dtype == torch.float32:
            return batch
        return map_tensors(batch, lambda t: t.to(self.param_dtype) if t.is_floating_point() else t)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def loss_from_output(output: Any) -> torch.Tensor | None:
    """What Lightning takes as the loss from training_step: a tensor, or a dict's "loss"."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    loss = getattr(output, "loss", None)  # transformers' ModelOutput
    return loss if isinstance(loss, torch.Tensor) else None


@dataclass(frozen=True, kw_only=True)
class StepOptions:
    """How run_training_step runs a step: its precision, device, loss scale and loop order."""

    policy: PrecisionPolicy
    """The precision's autocast and parameter dtypes."""
    device_type: str
    """The device type autocast runs on ("cpu", "cuda")."""
    grad_scale: torch.Tensor | None = None
    """The loss scale for '16-mixed' (a float32 scalar tensor); None without a GradScaler."""
    loop: Loop = "lightning"
    """The step order (see the module's docstring)."""
    scaler_copies: bool = False
    """Unscale as torch's GradScaler does on a CUDA target: per-device copies of inv_scale and found_inf, the found_inf
    copy kept through optimizer.step() (see `unscale_grads`)."""


def lightning_distribution(model: nn.Module) -> str:
    """The distribution whose Trainer runs `model`: "lightning" for a lightning.pytorch LightningModule, else
    "pytorch-lightning" (a plain module under loop="lightning" is taken as pytorch_lightning's)."""
    bases = (c for c in type(model).__mro__ if c.__name__ == "LightningModule")
    return "lightning" if any(c.__module__.split(".")[0] == "lightning" for c in bases) else "pytorch-lightning"


def run_training_step(
    model: nn.Module,
    batch: Any,
    *,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer,
    options: StepOptions,
    on_phase: Callable[[str], None] | None = None,
) -> torch.Tensor:
    """One training step in `options.loop`'s order (see the module's docstring); returns the detached loss.

    `options.grad_scale` is the loss scale for '16-mixed' (a float32 scalar tensor). Lightning's GradScaler
    reads `found_inf.item()`, which a fake tensor cannot answer, so the scaler's tensor work is done
    here op for op: scale the loss, unscale the gradients in place (what `scaler.unscale_` runs), step.
    `on_phase` is told "forward", "forward_end", "backward", "optimizer" and "end" as the step moves on.
    """
    policy, device_type, grad_scale, loop = options.policy, options.device_type, options.grad_scale, options.loop
    phase = on_phase or (lambda _: None)
    phase("forward")
    with policy.forward_context(device_type, loop=loop, lightning=lightning_distribution(model)):
        output = loss_fn(model, batch)
    loss = loss_from_output(output) if isinstance(output, Mapping) else output
    # Lightning keeps the other values of a training_step's dict (ClosureResult.extra: logits returned beside the
    # loss, a transformers ModelOutput's) until the batch ends, through the backward and the optimizer step
    kept = {k: v for k, v in output.items() if k != "loss"} if loop == "lightning" and output is not loss else None
    del output
    check_loss(loss)
    phase("forward_end")
    if loop == "lightning":
        # Lightning's ClosureResult: `closure_loss / accumulate_grad_batches` (out of place, even by 1: a tensor of
        # its own, made here by a clone, which a loss watcher does not take for the step's own scaling by a number)
        # and a detached clone of it for logging, both alive until the step ends.
        loss = loss.clone()
        logged = loss.detach().clone()  # noqa: F841
        optimizer.zero_grad(set_to_none=True)
    elif loop == "torch-zero-after-forward":
        optimizer.zero_grad(set_to_none=True)
    phase("backward")
    (loss * grad_scale if grad_scale is not None else loss).backward()
    phase("optimizer")
    found_inf = unscale_grads(optimizer, grad_scale, copies=options.scaler_copies) if grad_scale is not None else None
    optimizer.step()
    del found_inf  # GradScaler.update() drops found_inf_per_device
    if loop == "torch":
        optimizer.zero_grad(set_to_none=True)
    elif loop == "torch-keep-grads":
        optimizer.zero_grad(set_to_none=False)
    phase("end")
    del kept  # (the batch's end)
    return loss.detach()


def check_loop(loop: Any) -> None:
    if loop not in LOOPS:
        raise EstimateError(
            "loop must be 'lightning' (Lightning's order: zero_grad after the forward), 'torch' (a plain loop: "
            "forward, backward, step, zero_grad(set_to_none=True)), 'torch-zero-after-forward' (a plain loop "
            "that zeroes between forward and backward) or 'torch-keep-grads' (zero_grad(set_to_none=False): "
            f"gradients kept allocated); got {loop!r}")


def check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor):
        raise EstimateError(
            f"loss must return a scalar tensor; got {type(loss).__name__}. Pass loss=callable(model, batch) "
            "that returns one, e.g. loss=lambda m, b: F.cross_entropy(m(b[0]), b[1])"
        )
    if loss.numel() != 1:
        raise EstimateError(
            f"loss must return a scalar tensor; got shape {tuple(loss.shape)}. Reduce it (e.g. .mean()) "
            "inside the loss callable"
        )
    if not loss.requires_grad:
        raise EstimateError(
            "loss does not require grad, so there is nothing to train: check that the loss is computed "
            "from the model's output and that some parameters have requires_grad=True"
        )


def grad_scaler_tensors(device: torch.device, *, cuda: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """torch.amp.GradScaler's `_scale` (fp32, 65536) and, on a CUDA target, its `_growth_tracker` (int32): both made
    at the first `scale()` and kept (torch/amp/grad_scaler.py `_lazy_init_scale_growth_tracker`, torch 2.7-2.13).
    The H100 read 512 B more than memplan's peak without the tracker in every 16-mixed case (bf16-mixed twins: 0).
    A CPU target keeps memplan's earlier model (the scale only; torch's CPU tracker is 4 bytes), so CPU estimates
    stay as they were."""
    scale = torch.tensor(65536.0, device=device)
    return scale, (torch.zeros((), dtype=torch.int32, device=device) if cuda else None)


def unscale_grads(optimizer: torch.optim.Optimizer, grad_scale: torch.Tensor, *, copies: bool = False):
    """`GradScaler.unscale_`'s tensor work. With `copies` (CUDA targets), as torch orders it: inv_scale (fp64, then
    fp32), found_inf, then `_MultiDeviceReplicator.get`'s copy of each on the gradients' device; the found_inf copy
    is returned: the scaler keeps it in found_inf_per_device until update(), after optimizer.step() (the H100's
    16-mixed rows whose peak is in the step read 512 B more than memplan without it). Otherwise memplan's earlier
    model: found_inf and inv_scale, freed on return (None)."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return None
    if not copies:
        found_inf = torch.zeros((), dtype=torch.float32, device=grad_scale.device)
        inv_scale = grad_scale.double().reciprocal().float()
        amp_unscale_(grads, found_inf, inv_scale)
        return None
    inv_scale = grad_scale.double().reciprocal().float()
    found_inf = torch.zeros((), dtype=torch.float32, device=grad_scale.device)
    kept = found_inf.clone()
    amp_unscale_(grads, kept, inv_scale.clone())
    return kept


def params_with_grad(params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
    return [p for p in params if p.requires_grad]


class SavedTensorsHooks:
    """Autograd's saved-tensor hooks, opened and closed at step phases; closing twice is harmless, so
    an error mid-forward never leaves them on autograd's global hook stack."""

    def __init__(self, pack) -> None:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._open = False

    def open(self) -> None:
        self._hooks.__enter__()
        self._open = True

    def close(self) -> None:
        if self._open:
            self._open = False
            self._hooks.__exit__(None, None, None)
