"""Real training runs, written here and shared with nothing the estimator runs.

Two loops, each the one a user writes:

    lightning_fit  a real `Trainer.fit` (pytorch_lightning, or lightning.pytorch for a module of that
                   package): Lightning's own closure orders the step, its precision plugin casts and
                   autocasts, its GradScaler scales; the model is wrapped in a LightningModule whose
                   `training_step` returns the loss and `configure_optimizers` the optimizer.
    plain_loop     a plain PyTorch loop: forward + loss under `torch.autocast` (the weight cache on, as
                   torch defaults it), backward, step, zero_grad(set_to_none=True); a GradScaler for
                   '16-mixed'.

What this module takes from memplan is only the meaning of its arguments: which blocks
`checkpointing=True` names (memplan.estimator.checkpointing.blocks_to_checkpoint) and what an
optimizer's name builds (memplan.estimator.inputs.OPTIMIZERS). The wrapping, the step and the
precision handling are written here. The estimator never imports this package
(tests/truth/test_independent.py).

The loader hands every step the same batch tensors (a list of one batch per step, `batch_size=None`):
the batch is allocated once, inside the measurement, as an estimate counts it.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from memplan.compat.torch import op_packet

Hook = Callable[[int], None]
"""Called with the 1-based step number."""


@dataclass(frozen=True, kw_only=True)
class Training:
    """What to train, as memplan.estimate takes it."""

    build: Callable[[], nn.Module]
    """Zero-argument callable returning the model (fp32, on CPU)."""
    make_batch: Callable[[], Any]
    """Zero-argument callable returning one batch of real tensors."""
    loss: Callable[[nn.Module, Any], torch.Tensor] | None = None
    """(model, batch) -> scalar loss; None: a LightningModule's training_step, or the output's `.loss`."""
    optimizer: str | Callable[..., torch.optim.Optimizer] | None = None
    """A name of memplan.estimator.inputs.OPTIMIZERS, a callable(params), or None (configure_optimizers, else AdamW)."""
    precision: str = "32-true"
    """Lightning's precision string."""
    checkpointing: bool | Collection[type[nn.Module]] | str = False
    """As memplan.estimate's `checkpointing=`."""
    steps: int = 2
    """Training steps to run: batches, each trained by the step as the module writes it (under manual
    optimization, every optimizer step it takes)."""
    on_step_start: Hook = field(default=lambda step: None)
    """Called before each step's forward."""
    on_step_end: Hook = field(default=lambda step: None)
    """Called after each step's optimizer update (and, in the plain loop, its zero_grad)."""


def preload(loop: str) -> None:
    """Import what the loop imports before a measurement starts: a module's import-time tensors (one
    4-byte tensor of Lightning's) belong to the program, not to its training."""
    if loop == "lightning":
        import pytorch_lightning  # noqa: F401

        try:
            import lightning.pytorch  # noqa: F401
        except ImportError:
            pass


PLAIN_LOOPS = ("torch", "torch-zero-after-forward", "torch-keep-grads")
"""The plain loops' orders, written here for the truth (memplan.estimator.step has the estimator's own)."""


def train(run: Training, *, loop: str = "lightning", accelerator: str = "cpu") -> nn.Module:
    """Build and train `run` in `loop` ("lightning": a real Trainer.fit; a PLAIN_LOOPS order: plain_loop);
    returns the trained model."""
    if loop == "lightning":
        return lightning_fit(run, accelerator=accelerator)
    if loop in PLAIN_LOOPS:
        device = torch.device(accelerator, 0) if accelerator == "cuda" else torch.device(accelerator)
        return plain_loop(run, device=device, order=loop)
    raise ValueError(f"loop must be 'lightning' or one of {', '.join(PLAIN_LOOPS)}; got {loop!r}")


def checkpoint_blocks(model: nn.Module, which: Any) -> None:
    """Apply checkpointing as a user would, with torch.utils.checkpoint (non-reentrant): True or block classes
    (each such block), or a setting's text ('full', 'blocks:K' the first K repeated blocks, 'every:K' every K-th,
    'op' each block under torchtitan's selective per-op policy, written here from torchtitan's code)."""
    from memplan.estimator.checkpointing import blocks_to_checkpoint, find_repeated_blocks

    text = str(which) if which is not None and not isinstance(which, (bool, list, tuple, set, frozenset)) else None
    if text is None:
        chosen = [block for _, block in blocks_to_checkpoint(model, which)]
    else:
        blocks = [block for _, block in find_repeated_blocks(model)]
        mode, _, k = text.partition(":")
        chosen = {"none": [], "full": blocks, "op": blocks, "blocks": blocks[:int(k or 0)],
                  "every": blocks[int(k or 1) - 1::int(k or 1)]}[mode]
    for block in chosen:
        extra = {"context_fn": _torchtitan_op_contexts} if text == "op" else {}
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False, **extra)


_SAVED = ("mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution", "_scaled_dot_product_flash_attention",
          "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
          "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_fused_attention_overrideable",
          "_flash_attention_forward", "_efficient_attention_forward", "abs", "max")
"""torchtitan's `_save_list` (mm, the attention kernels, abs and max) with its later default save ops (addmm, bmm,
baddbmm, convolutions) and other backends' attention kernels: the outputs the per-op policy keeps."""


def _torchtitan_op_contexts():
    """torchtitan's selective op checkpointing (parallelize_llama.py, `_get_custom_policy`): per checkpointed
    call, save the outputs of _SAVED except every second mm, counted apart in the forward and the recompute."""
    from collections import defaultdict

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    counts: dict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        name = op_packet(func).__name__.split(".")[-1]
        if name == "mm":
            counts["recompute" if ctx.is_recompute else "forward"] += 1
            keep = counts["recompute" if ctx.is_recompute else "forward"] % 2 == 1
        else:
            keep = name in _SAVED
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def make_optimizer(model: nn.Module, optimizer) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer is None and _lightning_package(model)[1]:
        return _first_optimizer(model.configure_optimizers())
    if optimizer is None:
        optimizer = "adamw"
    if isinstance(optimizer, str):
        from memplan.estimator.inputs import OPTIMIZERS

        return OPTIMIZERS[optimizer](params)
    return optimizer(params)


def _first_optimizer(config: Any) -> torch.optim.Optimizer:
    """The first optimizer in any of configure_optimizers' return forms."""
    if isinstance(config, torch.optim.Optimizer):
        return config
    if isinstance(config, Mapping):
        return _first_optimizer(config["optimizer"])
    return _first_optimizer(config[0])


def _loss_of(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    return output["loss"] if isinstance(output, Mapping) else output.loss


def step_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """What a plain loop takes as the loss when none is given: a LightningModule's training_step, else
    the model's output's loss."""
    if _lightning_package(model)[1]:
        return _loss_of(model.training_step(batch, 0))
    return output_loss(model, batch)


def output_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The model called as its batch suggests (dict -> kwargs, tuple -> args); its output's loss."""
    if isinstance(batch, Mapping):
        out = model(**batch)
    elif isinstance(batch, (tuple, list)):
        out = model(*batch)
    else:
        out = model(batch)
    return _loss_of(out)


# --------------------------------------------------------------------------------------------------
# Lightning


def _lightning_package(model: nn.Module):
    """The Lightning package whose LightningModule `model` is, else pytorch_lightning."""
    for cls in type(model).__mro__:
        if cls.__name__ == "LightningModule":
            if cls.__module__.startswith("lightning.pytorch"):
                import lightning.pytorch as pl

                return pl, True
            import pytorch_lightning as pl

            return pl, True
    import pytorch_lightning as pl

    return pl, False


def _as_lightning_module(pl, model: nn.Module, is_module: bool, run: Training):
    """The model itself where it is a LightningModule (its training_step / configure_optimizers
    replaced only where `run` names a loss / an optimizer), else a LightningModule around it."""
    if is_module:
        if run.loss is not None:
            model.training_step = lambda batch, batch_idx: run.loss(model, batch)
        if run.optimizer is not None:
            model.configure_optimizers = lambda: make_optimizer(model, run.optimizer)
        return model
    loss = run.loss or output_loss

    class Wrapped(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            return loss(self.model, batch)

        def configure_optimizers(self):
            return make_optimizer(self.model, run.optimizer)

    return Wrapped()


def lightning_fit(run: Training, *, accelerator: str = "cpu") -> nn.Module:
    """Build the model and the batch, then `Trainer.fit` over `run.steps` batches on one device: one epoch of a
    loader holding that many, not `max_steps`, which under manual optimization counts every `optimizer.step()`
    (two per batch for a GAN's two optimizers: `max_steps=2` ended such a fit after its first batch)."""
    from torch.utils.data import DataLoader

    model = run.build()
    if run.checkpointing:
        checkpoint_blocks(model, run.checkpointing)
    pl, is_module = _lightning_package(model)
    module = _as_lightning_module(pl, model, is_module, run)
    batch = run.make_batch()

    class Marks(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            run.on_step_start(batch_idx + 1)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            run.on_step_end(batch_idx + 1)

    trainer = pl.Trainer(
        accelerator=accelerator, devices=1, precision=run.precision, max_epochs=1, callbacks=[Marks()],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, DataLoader([batch] * run.steps, batch_size=None))
    return module


# --------------------------------------------------------------------------------------------------
# plain PyTorch

_HALF = {"16": torch.float16, "bf16": torch.bfloat16}


def _to(batch: Any, device: torch.device, dtype: torch.dtype | None) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, dtype if dtype is not None and batch.is_floating_point() else None)
    if isinstance(batch, Mapping):
        return type(batch)({k: _to(v, device, dtype) for k, v in batch.items()})
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to(v, device, dtype) for v in batch)
    return batch


def plain_loop(run: Training, *, device: torch.device, order: str = "torch") -> nn.Module:
    """Build the model and the batch on `device`, then `run.steps` steps of a plain PyTorch loop, written as
    users write it: "torch" zeroes the gradients (set to None) after the step, "torch-zero-after-forward"
    between the forward and the backward, "torch-keep-grads" after the step with set_to_none=False."""
    kind, _, mode = run.precision.partition("-")
    if mode not in ("true", "mixed") or (kind != "32" and kind not in _HALF):
        raise ValueError(f"precision must be a Lightning precision string; got {run.precision!r}")
    half = _HALF.get(kind)
    model = run.build()
    if mode == "true" and half is not None:
        model = model.to(half)
    model = model.to(device)
    if run.checkpointing:
        checkpoint_blocks(model, run.checkpointing)
    batch = _to(run.make_batch(), device, half if mode == "true" else None)
    optimizer = make_optimizer(model, run.optimizer)
    loss_fn = run.loss or step_loss
    autocast = mode == "mixed" and half is not None
    scaler = torch.amp.GradScaler(device.type) if autocast and half is torch.float16 else None
    for step in range(1, run.steps + 1):
        run.on_step_start(step)
        with torch.autocast(device.type, dtype=half, enabled=autocast):
            loss = loss_fn(model, batch)
        if order == "torch-zero-after-forward":
            optimizer.zero_grad()
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        if order == "torch":
            optimizer.zero_grad(set_to_none=True)
        elif order == "torch-keep-grads":
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.zero_()
        run.on_step_end(step)
    return model
