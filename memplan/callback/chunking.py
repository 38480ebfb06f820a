"""Run each loaded batch as micro-batch chunks inside `training_step`, and retry an OOM smaller.

Why inside training_step: changing the DataLoader's batch size mid-epoch would re-order or repeat
samples (the sampler and the iterator's position count in batches). Splitting the batch the loader
gave keeps the data order, the global batch and Lightning's progress counters as they are.

One loaded batch of B samples at micro-batch m runs as chunks c_1..c_k of at most m samples:
  - c_1..c_{k-1}: forward and backward here, under DDP's `no_sync` (no all-reduce), each loss scaled
    by its share |c_i|/B and by 1/accumulate_grad_batches, as Lightning scales the loss it backwards;
  - c_k: forward here; its loss times its share is returned, and Lightning backwards it. That is the
    rank's one synchronised backward, so it pairs with every other rank's one backward however many
    chunks each ran: ranks may run different micro-batches (after an OOM on one) without a hang.
  The returned loss's value is the whole batch's (the inner chunks' parts enter detached), so the
  progress bar and loggers show what they would without chunking.

Gradients: Lightning zeroes them *after* training_step on the first batch of each accumulation
window, which would wipe the inner chunks' gradients. On such a batch the stale gradients are dropped
first (Lightning would drop them anyway), the inner chunks' gradients are set aside before returning,
and put back in `on_before_backward`: after the zeroing, before the final backward, so DDP all-reduces
them with the last chunk's.

OOM: a `torch.OutOfMemoryError` in any chunk's forward or in an inner chunk's backward is caught here,
where no collective is in flight, and the chunk is retried in halves: the same samples, none skipped.
A forward touches no gradient. A backward that fails part-way has added the chunk's gradient to some
parameters already (post-accumulate-grad hooks record which), so the retry runs with those frozen:
every parameter gets each sample's gradient exactly once. At micro-batch 1 the rank turns checkpointing
on (same math, less memory) and retries; with checkpointing on and still no room, it raises one error
naming the rank, the step and the memory figures. An OOM inside Lightning's final backward is not
retried: DDP's all-reduce may have started there.

Values `self.log`-ged in training_step come from each batch's last chunk (inner chunks' logging is
muted, so every rank logs, and syncs, once per batch). BatchNorm running statistics see the samples
of a failed forward twice (they are buffers, not gradients).
"""
from __future__ import annotations

import contextlib
import functools
import gc
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from memplan.callback.layout import Layout, chunk_bounds, loaded_batch_size
from memplan.estimator.step import loss_from_output, map_tensors
from memplan.monitor import smaller_micro_batch


class NothingFitsError(torch.OutOfMemoryError):
    """Out of memory at micro-batch 1 with checkpointing on (or not allowed): nothing smaller fits.
    A torch.OutOfMemoryError, so code that catches those catches it."""


@dataclass(frozen=True, kw_only=True)
class OomRetry:
    """An OOM this rank caught and is retrying: what failed and what it does now."""

    phase: str
    """'forward' or 'backward'."""
    failed_micro_batch_size: int
    """Samples in the chunk that ran out of memory."""
    micro_batch_size: int
    """The micro-batch this rank retries and goes on with."""
    gradient_checkpointing: bool
    """Whether checkpointing is on for the retry."""
    message: str
    """torch's error message."""


@dataclass(frozen=True)
class _Failure:
    start: int
    stop: int
    phase: str
    frozen: frozenset[int]  # indices of parameters that already hold this chunk's gradient
    message: str


class MicroBatchRunner:
    """Wraps the LightningModule's `training_step` (an instance attribute, removed by `remove`)."""

    def __init__(self, trainer: Any, module: Any, *, layout: Layout, can_checkpoint: bool, retry: bool,
                 enable_checkpointing: Callable[[], None], on_retry: Callable[[OomRetry], None],
                 out_of_memory: Callable[[str, int], NothingFitsError]) -> None:
        self.micro_batch_size = layout.micro_batch_size
        """This rank's micro-batch now (a shared decision, or lower after a local OOM)."""
        self.loader_batch_size = layout.loader_batch_size
        """Samples per loaded batch; at or above it a micro-batch runs the batch whole."""
        self.gradient_checkpointing = layout.gradient_checkpointing
        """Whether checkpointing is on for this rank."""
        self.oom_retries = 0
        """OOMs recovered from."""
        self.oom_micro_batch_size: int | None = None
        """The smallest chunk that ran out of memory."""
        self._trainer = trainer
        self._module = module
        self._can_checkpoint = can_checkpoint
        self._retry = retry
        self._enable_checkpointing = enable_checkpointing
        self._on_retry = on_retry
        self._out_of_memory = out_of_memory
        self._params = list(module.parameters())
        self._stash: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self._inner_value: torch.Tensor | None = None
        self._zeroes_after_step = False
        self._original: Callable[..., Any] | None = None
        self._previous: Any = None

    # --- installation and shared decisions ---------------------------------------------------
    def install(self) -> None:
        self._previous = self._module.__dict__.get("training_step")
        original = self._module.training_step

        @functools.wraps(original)  # Lightning reads the signature (batch_idx or not) through __wrapped__
        def training_step(*args: Any, **kwargs: Any) -> Any:
            return self._training_step(args, kwargs)

        self._original = original
        self._module.training_step = training_step

    def remove(self) -> None:
        if self._original is None:
            return
        if self._previous is None:
            self._module.__dict__.pop("training_step", None)
        else:
            self._module.training_step = self._previous
        self._original = None

    def set_layout(self, micro_batch_size: int, gradient_checkpointing: bool) -> None:
        """Apply a shared decision from the next batch on."""
        if gradient_checkpointing and not self.gradient_checkpointing:
            self._enable_checkpointing()
        self.micro_batch_size = micro_batch_size
        self.gradient_checkpointing = self.gradient_checkpointing or gradient_checkpointing

    def restore_grads(self) -> None:
        """Put the inner chunks' gradients back (from `on_before_backward`, after Lightning's zero_grad)."""
        stash, self._stash = self._stash, []
        for param, grad in stash:
            if param.grad is None:
                param.grad = grad
            else:  # zero_grad(set_to_none=False) left zeros
                param.grad.add_(grad)

    # --- the wrapped training_step -----------------------------------------------------------
    def _training_step(self, args: tuple, kwargs: dict) -> Any:
        if self.micro_batch_size >= self.loader_batch_size:
            try:
                return self._original(*args, **kwargs)
            except torch.OutOfMemoryError as err:
                if not self._retry:
                    raise
                failure = _Failure(0, 0, "forward", frozenset(), str(err))  # bounds filled in below
            return self._run_chunks(args, kwargs, failure)
        return self._run_chunks(args, kwargs, None)

    def _run_chunks(self, args: tuple, kwargs: dict, failure: _Failure | None) -> Any:
        batch = args[0] if args else kwargs["batch"]
        size = loaded_batch_size(batch)
        if size is None:  # the batch cannot be split: run it whole, as Lightning would
            if failure is not None:
                raise torch.OutOfMemoryError(f"{failure.message} (MemoryPlanner cannot retry it smaller: the batch "
                                             "has no common leading dimension to split it by)")
            return self._original(*args, **kwargs)
        self._drop_stale_grads()
        self._inner_value = None
        if failure is None:
            pending = deque((lo, hi, frozenset()) for lo, hi in chunk_bounds(0, size, self.micro_batch_size))
        else:  # the whole batch failed on the fast path
            pending = self._after_failure(_Failure(0, size, failure.phase, frozenset(), failure.message), deque())
        while True:
            start, stop, frozen = pending.popleft()
            if pending:
                failure = self._inner_chunk(args, kwargs, batch, size, start, stop, frozen)
                output = None
            else:
                output, failure = self._last_chunk(args, kwargs, batch, size, start, stop)
            if failure is None and output is not None:
                self._stash_grads()
                return self._with_batch_loss(output, (stop - start) / size)
            if failure is not None:
                pending = self._after_failure(failure, pending)
            elif not pending:  # the last chunk returned None (a skipped step)
                return None

    def _inner_chunk(self, args, kwargs, batch, size, start, stop, frozen) -> _Failure | None:
        share = (stop - start) / size
        touched: set[int] = set()
        phase = "forward"
        try:
            with self._no_sync(), self._frozen(frozen), _muted_logging(self._module):
                chunk_args, chunk_kwargs = _with_chunk(args, kwargs, batch, size, start, stop)
                output = self._original(*chunk_args, **chunk_kwargs)
                loss = loss_from_output(output)
                if loss is None:
                    return None
                phase = "backward"
                with self._tracking(touched, frozen), torch.autocast(self._device_type(), enabled=False):
                    scale = share / self._trainer.accumulate_grad_batches
                    self._trainer.strategy.backward(loss * scale, self._trainer.optimizers[0])
                self._add_value(loss.detach() * share)
        except torch.OutOfMemoryError as err:
            return _Failure(start, stop, phase, frozen | frozenset(touched), str(err))
        return None

    def _last_chunk(self, args, kwargs, batch, size, start, stop) -> tuple[Any, _Failure | None]:
        try:
            chunk_args, chunk_kwargs = _with_chunk(args, kwargs, batch, size, start, stop)
            return self._original(*chunk_args, **chunk_kwargs), None
        except torch.OutOfMemoryError as err:
            return None, _Failure(start, stop, "forward", frozenset(), str(err))

    def _after_failure(self, failure: _Failure, pending: deque) -> deque:
        """Lower this rank's micro-batch (or turn checkpointing on) and re-cut what is left."""
        if not self._retry:
            raise torch.OutOfMemoryError(failure.message)
        _release_memory()
        failed = failure.stop - failure.start
        self.oom_retries += 1
        self.oom_micro_batch_size = failed if self.oom_micro_batch_size is None else min(failed, self.oom_micro_batch_size)
        smaller = smaller_micro_batch(min(self.micro_batch_size, failed))
        if smaller is not None:
            self.micro_batch_size = smaller
        elif self._can_checkpoint and not self.gradient_checkpointing:
            self._enable_checkpointing()
            self.gradient_checkpointing = True
        else:
            raise self._out_of_memory(failure.message, failed)
        self._on_retry(OomRetry(phase=failure.phase, failed_micro_batch_size=failed,
                                micro_batch_size=self.micro_batch_size,
                                gradient_checkpointing=self.gradient_checkpointing, message=failure.message))
        ranges = [(failure.start, failure.stop, failure.frozen), *pending]
        return deque((lo, hi, frozen) for start, stop, frozen in ranges
                     for lo, hi in chunk_bounds(start, stop, self.micro_batch_size))

    # --- gradients ---------------------------------------------------------------------------
    def _drop_stale_grads(self) -> None:
        """On the first batch of an accumulation window Lightning zeroes gradients after
        training_step; drop them now, so the inner chunks accumulate from nothing."""
        loop = self._trainer.fit_loop.epoch_loop
        self._zeroes_after_step = (not loop.automatic_optimization._skip_backward
                                   and loop.batch_idx % self._trainer.accumulate_grad_batches == 0)
        if self._zeroes_after_step:
            for param in self._params:
                param.grad = None

    def _stash_grads(self) -> None:
        if not self._zeroes_after_step:
            return
        self._stash = [(p, p.grad) for p in self._params if p.grad is not None]
        for param, _ in self._stash:
            param.grad = None

    def _add_value(self, value: torch.Tensor) -> None:
        self._inner_value = value if self._inner_value is None else self._inner_value + value

    def _with_batch_loss(self, output: Any, share: float) -> Any:
        loss = loss_from_output(output)
        if loss is None:
            return output
        whole = loss * share if self._inner_value is None else loss * share + self._inner_value
        self._inner_value = None
        if isinstance(output, torch.Tensor):
            return whole
        if isinstance(output, Mapping):
            return {**output, "loss": whole}
        raise TypeError(f"training_step returned {type(output).__name__}; MemoryPlanner chunks batches whose "
                        "training_step returns a loss tensor or a dict with 'loss'")

    @contextlib.contextmanager
    def _frozen(self, frozen: frozenset[int]) -> Iterator[None]:
        params = [self._params[i] for i in frozen if self._params[i].requires_grad]
        for param in params:
            param.requires_grad_(False)
        try:
            yield
        finally:
            for param in params:
                param.requires_grad_(True)

    @contextlib.contextmanager
    def _tracking(self, touched: set[int], frozen: frozenset[int]) -> Iterator[None]:
        handles = [p.register_post_accumulate_grad_hook(lambda _, i=i: touched.add(i))
                   for i, p in enumerate(self._params) if p.requires_grad and i not in frozen]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _no_sync(self) -> contextlib.AbstractContextManager:
        block = getattr(self._trainer.strategy, "block_backward_sync", None)  # DDP: model.no_sync()
        return block() if block is not None else contextlib.nullcontext()

    def _device_type(self) -> str:
        return self._trainer.strategy.root_device.type


def _with_chunk(args: tuple, kwargs: dict, batch: Any, size: int, start: int, stop: int) -> tuple[tuple, dict]:
    """training_step's arguments with samples [start, stop) of the batch in its place (views, no copy);
    tensors without the batch dimension are passed as they are."""
    chunk = map_tensors(batch, lambda t: t[start:stop] if t.dim() > 0 and t.shape[0] == size else t)
    if args:
        return (chunk, *args[1:]), kwargs
    return args, {**kwargs, "batch": chunk}


@contextlib.contextmanager
def _muted_logging(module: Any) -> Iterator[None]:
    module.__dict__["log"] = _discard
    try:
        yield
    finally:
        module.__dict__.pop("log", None)


def _discard(*args: Any, **kwargs: Any) -> None:
    return None


def _release_memory() -> None:
    """Free what the failed chunk held (its graph is gone with the exception) back to the device."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
