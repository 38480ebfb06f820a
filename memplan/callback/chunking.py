"""Run each loaded batch as micro-batch chunks inside `training_step`, and retry an OOM smaller.

Why inside training_step: changing the DataLoader's batch size mid-epoch would re-order or repeat
samples (the sampler and the iterator's position count in batches). Splitting the batch the loader
gave keeps the data order, the global batch and Lightning's progress counters as they are.

One loaded batch of B samples at micro-batch m runs as chunks c_1..c_k of at most m samples (k = 1
when m >= B). Every chunk's forward *and* backward run here, under DDP's `no_sync`, each loss scaled
by its weight (`MemoryPlanner(loss_reduction=, mean_over=)`: its share |c_i|/B of the samples, its
share of `mean_over(batch)` (tokens, say), or 1 for a sum), by 1/accumulate_grad_batches and by the
GradScaler's scale (16-mixed), exactly as Lightning scales the loss it backwards. The chunks' losses,
so weighted, add up to the whole batch's loss, and their gradients to its gradient. What
training_step returns is a *carrier*: a loss whose value is the whole batch's and whose backward
hands every parameter the gradient already computed (memplan.callback.carrier: the gradients are
moved out of `.grad` before returning and given back, not copied, by Lightning's one backward). So:
  - Lightning's backward is the rank's one synchronised backward: DDP's hooks fire once per
    parameter and all-reduce the whole gradient, however many chunks each rank ran. Ranks may run
    different micro-batches (after an OOM on one) without a hang.
  - That backward allocates nothing (the gradients exist already), so every backward that can run
    out of memory runs here, where no collective is in flight, and can be retried.
  - Lightning zeroes gradients after training_step on the first batch of an accumulation window;
    the gradients are out of `.grad` by then, so the zeroing cannot wipe them. (The previous step's
    gradients are dropped before the first chunk's forward, where Lightning keeps them alive through
    it: a guarded step peaks lower, by up to the gradients' size, than the step memplan estimates.)
  - Users' `on_before_backward` / `on_after_backward` run once per batch, as without chunking, and
    `on_after_backward` sees the whole batch's gradient. The in-step backwards call the module's own
    `backward` (so an override is honoured) but not Lightning's backward hooks.

What it costs, and what it cannot do:
  - A second, empty autograd pass and a few Python calls per batch (0.2-0.44 ms a step on a 2-core
    CPU: benchmarks/results/callback_overhead.md).
  - Under DDP, every gradient is ready only when the whole backward is done, so the step's all-reduce
    cannot overlap it.
  - DDP rebuilds its buckets once, from the order its hooks fire in the first synchronised backward: that one
    backward hands the gradients over in the order the step's own backward made them (memplan.callback.carrier).
  - Parameter gradient hooks would run per chunk and again on the whole gradient: refused (checks).
  - Under DDP's gradient_as_bucket_view the handoff would copy the gradients out of DDP's buckets:
    not guarded (checks.guard_blocker).
  - DDP's static_graph (it would skip later all-reduces after counting the chunks' hooks): refused.

Guarded and unguarded: so the runner is `guarded` (the above) only while a rank may run out of
memory: until a reading at its current layout shows the margin free (those steps fit, and steps of
the same shapes will), and again after any OOM or change of layout (the callback decides:
MemoryPlanner(guard=...)). Unguarded, a batch that runs whole is left to Lightning as if MemoryPlanner
were not there, except that its forward runs here, where an OOM still drops the batch back to the
guarded path; a batch split into chunks always runs guarded. Ranks may differ: each does one
synchronised backward either way.

OOM: a `torch.OutOfMemoryError` in any chunk's forward or backward is caught here and the chunk is
retried smaller, the same samples, none skipped, each parameter's gradient added exactly once
(memplan.callback.retry: which size next, which parameters a failed backward touched).

Under FSDP (memplan.callback.sharded) the chunks but the last run with FSDP's gradient sync off and
the last chunk's backward reduce-scatters; the carrier hands the sharded gradients over. No OOM is
retried there (a rank cannot re-run part of a step alone while the others all-gather).

Values `self.log`-ged in training_step describe the whole batch: every chunk's calls are held, and
once the last chunk's backward has succeeded they are merged (memplan.callback.logged: weighted as
the losses are) and made, so every rank logs, and syncs, once per batch however many chunks it ran
or retried; a dict training_step returns reaches on_train_batch_end joined over the chunks
(memplan.callback.outputs). A chunk that weighs nothing (no token to average over) runs its forward, not its
backward. BatchNorm running statistics see the samples of a failed forward twice (buffers, not gradients).
"""
from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from memplan import compat
from memplan.callback.adjust import smaller_or_even
from memplan.callback.carrier import Recording, carry
from memplan.callback.chunk_job import ChunkJob, ChunkResult, RunnerOptions
from memplan.callback.held_logging import HeldLogging, replay_logged
from memplan.callback.layout import chunk_bounds
from memplan.callback.logged import merge_logged
from memplan.callback.outputs import OutputJoiner
from memplan.callback.step_wrapper import StepWrapper
from memplan.callback.retry import (
    NONE, Failure, Frozen, NothingFitsError, OomRetry, RetryState, gradient_versions, release_memory, touched,
)
from memplan.estimator.step import loss_from_output
from memplan.shapes import chunk_for, load_of

__all__ = ["MicroBatchRunner", "NothingFitsError", "OomRetry", "smaller_or_even"]

_NO_OP = contextlib.nullcontext()


class MicroBatchRunner(StepWrapper):
    """Wraps the LightningModule's `training_step` (an instance attribute, removed by `remove`)."""

    def __init__(self, trainer: Any, module: Any, options: RunnerOptions) -> None:
        self._shared = options.shared_layout  # the layout every rank shares now: read, never copied
        self._retried_to: int | None = None  # this rank's size after an OOM retried here, until the next shared decision
        self.gradient_checkpointing = self._shared().gradient_checkpointing
        """Whether checkpointing is on for this rank."""
        self.retries = RetryState()
        """The sizes that ran and failed here, and the OOMs recovered from (memplan.callback.retry)."""
        self.lightning_backward = False
        """Whether the current batch's backward is Lightning's own (unguarded or unsplittable): an
        OOM in it is not retried."""
        self._can_guard = options.can_guard
        self._guarded = options.can_guard
        self._trainer = trainer
        self._module = module
        self._can_checkpoint = options.can_checkpoint
        self._retry = options.retry
        self._enable_checkpointing = options.enable_checkpointing
        self._on_retry = options.on_retry
        self._out_of_memory = options.out_of_memory
        self._params = list(module.parameters())
        self._device_type = "cpu"
        self._scaler: Any = None
        self._block_sync: Callable[[], contextlib.AbstractContextManager] | None = None
        self._ddp: Any = None
        self._exactness = options.exactness  # batch -> Exactness, asked once, before the first split
        self._sum = False
        self._can_split: bool | None = None if options.exactness is not None else True
        self._mean_over: Callable[[Any], Any] | None = None
        self._size_of = options.size_of
        self._split = options.split
        self._on_first_split = options.on_first_split
        self._sharded_sync_off = options.sharded_sync_off  # FSDP: sync off but for a batch's last chunk (callback.sharded)
        self._planned_load = options.planned_load_per_sample  # (memplan.shapes)
        self._outputs = OutputJoiner()  # training_step's other outputs, joined over a batch's chunks
        self.heavier_batches = 0
        """Batches heavier per sample than the one planned for, run as smaller chunks before they ran."""

    @property
    def micro_batch_size(self) -> int:
        """This rank's micro-batch now: the shared layout's, or lower after an OOM retried here since the
        last shared decision."""
        return self._micro_of(self._shared())

    @property
    def loader_batch_size(self) -> int:
        """Samples per loaded batch (the shared layout's); at or above it a micro-batch runs the batch whole."""
        return self._shared().loader_batch_size

    def _runs_whole(self) -> bool:
        """micro_batch_size >= loader_batch_size, the shared layout read once (asked every step)."""
        shared = self._shared()
        return self._micro_of(shared) >= shared.loader_batch_size

    def _micro_of(self, shared: Any) -> int:
        """`shared`'s micro-batch, or this rank's lower size after an OOM retried here."""
        return shared.micro_batch_size if self._retried_to is None else min(shared.micro_batch_size, self._retried_to)

    @property
    def oom_retries(self) -> int:
        """OOMs recovered from."""
        return self.retries.retries

    @property
    def oom_micro_batch_size(self) -> int | None:
        """The smallest chunk that ran out of memory."""
        return self.retries.smallest_failed

    @property
    def guarded(self) -> bool:
        """Whether every backward runs here, where an OOM in it can be retried (module docstring);
        else a batch that runs whole is backwarded by Lightning. Never, where guarding cannot work."""
        return self._guarded

    @guarded.setter
    def guarded(self, on: bool) -> None:
        self._guarded = on and self._can_guard

    # --- installation and shared decisions ---------------------------------------------------
    def install(self) -> None:
        self.wrap()
        # fixed for the fit: the device autocast would run on, the GradScaler (16-mixed), DDP's no_sync
        self._device_type = self._trainer.strategy.root_device.type
        self._scaler = getattr(self._trainer.precision_plugin, "scaler", None)
        self._block_sync = self._sharded_sync_off or getattr(self._trainer.strategy, "block_backward_sync", None)
        model = getattr(self._trainer.strategy, "model", None)
        self._ddp = model if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None
        self._skips_backward = compat.skip_backward_getter(self._trainer)
        self._has_rebuilt_buckets = compat.rebuilt_buckets_getter(self._ddp) if self._ddp is not None else None

    def layout_changed(self) -> None:
        """A shared decision changed the shared layout: from the next batch this rank runs its micro-batch
        (its own lower size after an OOM dropped) and its checkpointing; guarded, since the new layout is untried."""
        checkpointing = self._shared().gradient_checkpointing
        if checkpointing and not self.gradient_checkpointing:
            self._enable_checkpointing()
        self._retried_to = None
        self.gradient_checkpointing = self.gradient_checkpointing or checkpointing
        self.guarded = True

    # --- the wrapped training_step -----------------------------------------------------------
    def _training_step(self, args: tuple, kwargs: dict) -> Any:
        self.lightning_backward = True
        if self._skips_backward():
            return self._original(*args, **kwargs)  # e.g. SWA's batch-norm epoch: no backward to run
        error = None
        heavier = self._heavier(args[0] if args else kwargs["batch"]) if self._planned_load else None
        if heavier is not None:  # heavier per sample than planned for: smaller chunks before it runs
            self.lightning_backward = False
            batch, size, micro = heavier
            return self._run_guarded(args, kwargs, batch, size,
                                     deque((lo, hi, NONE) for lo, hi in chunk_bounds(0, size, micro)))
        if not self.guarded and self._runs_whole():
            # unguarded, a whole batch: its forward here, its backward Lightning's
            output, error = self._run_unguarded(args, kwargs)
            if error is None:
                return output
        batch = args[0] if args else kwargs["batch"]
        try:
            size = self._size_of(batch)
        except ValueError:
            size = None
        if size is None:  # the batch cannot be split: run it whole, as Lightning would
            if error is not None:
                raise torch.OutOfMemoryError(f"{error} (MemoryPlanner cannot retry it smaller: the batch has no "
                                             "common leading dimension to split it by)")
            return self._original(*args, **kwargs)
        self.lightning_backward = False
        if error is not None:  # the unguarded forward ran out of memory: retry it guarded, smaller
            pending = self._after_failure(Failure(0, size, "forward", NONE, error), deque(), batch)
        else:
            pending = deque((lo, hi, NONE) for lo, hi in chunk_bounds(0, size, self.micro_batch_size))
        return self._run_guarded(args, kwargs, batch, size, pending)

    def _heavier(self, batch: Any) -> tuple[Any, int, int] | None:
        """(batch, its size, the micro-batch it runs at) for a batch heavier per sample than the one
        planned for, where splitting it is exact; None for any other."""
        try:
            size = self._size_of(batch)
        except ValueError:
            return None
        micro = chunk_for(load_of(batch, size) / size, self._planned_load, min(self.micro_batch_size, size))
        micro = smaller_or_even(size, micro)
        if micro >= min(self.micro_batch_size, size) or not self._splits(batch):
            return None
        self.heavier_batches += 1
        return batch, size, micro

    def _run_unguarded(self, args: tuple, kwargs: dict) -> tuple[Any, str | None]:
        """(training_step's output, None), or (None, the OOM's message). Only the message leaves the
        except clause: the exception's traceback would keep the failed forward's tensors alive."""
        with HeldLogging(self._module) as logged:
            try:
                output = self._original(*args, **kwargs)
            except torch.OutOfMemoryError as err:
                message = str(err)
            else:
                message = None
        if message is not None:
            return None, message
        replay_logged(self._module, logged)
        return output, None

    def _run_guarded(self, args: tuple, kwargs: dict, batch: Any, size: int, pending: deque) -> Any:
        """Every chunk's forward and backward here, OOMs retried; returns the carrier."""
        clear = self._trainer.fit_loop.epoch_loop.batch_idx % self._trainer.accumulate_grad_batches == 0
        if clear:
            # Lightning zeroes gradients after this step on the first batch of a window: drop the
            # stale ones now, so the chunks accumulate from nothing
            for param in self._params:
                param.grad = None
        # DDP rebuilds its buckets from the first synchronised backward: hand the gradients over in
        # the order this step's own backward made them (a chain of carriers)
        order: list[int] | None = [] if self._rebuilds_buckets() else None
        value: torch.Tensor | None = None
        held: list[tuple[float, list[tuple[tuple, dict]]]] = []  # each chunk's weight and `self.log` calls
        if pending and pending[0][1] - pending[0][0] != size and not self._splits(batch):
            raise RuntimeError("MemoryPlanner: a loaded batch was to run as chunks where that is not exact; this is "
                               "memplan's to fix: report it")  # (the layout is refused at fit start first)
        total = None if self._mean_over is None or not pending or pending[0][1] - pending[0][0] == size \
            else float(self._mean_over(batch))
        while pending:
            start, stop, frozen = pending.popleft()
            if stop - start != size and self._on_first_split is not None:
                self._on_first_split(size, stop - start)
                self._on_first_split = None
            result = None  # a chunk's output (logits, say) is not kept through the next
            # FSDP reduce-scatters in the last chunk's own backward; DDP in Lightning's, of the carrier
            result = self._chunk(ChunkJob(args=args, kwargs=kwargs, batch=batch, size=size, start=start, stop=stop,
                                          frozen=frozen, clear=clear, order=order if not order else None, total=total,
                                          synced=self._sharded_sync_off is not None and not pending))
            if result.failure is not None:
                clear = clear and result.failure.phase == "forward"
                pending = self._after_failure(result.failure, pending, batch)
                if total is None and self._mean_over is not None:
                    total = float(self._mean_over(batch))
                continue
            clear = False
            self.retries.ran(stop - start)
            held.append((result.weight, result.logged))
            self._outputs.add(batch, start, stop, result.output)
            if result.loss is not None and result.weight:
                share = result.loss.detach() if result.weight == 1.0 else result.loss.detach() * result.weight
                value = share if value is None else value + share
            if not pending:  # the batch's last chunk succeeded: make the batch's `self.log` calls, once
                replay_logged(self._module, held[0][1] if len(held) == 1 else merge_logged(held, self._sum))
                if result.loss is None:  # no loss: Lightning skips this batch's backward
                    return self._outputs.joined(result.output)
        if value is None:  # every chunk weighed nothing (no token to average over): a zero loss
            value = result.loss.detach() * 0.0
        return carry(self._outputs.joined(result.output), value, self._params, order)

    def _weight(self, chunk: Any, size: int, start: int, stop: int, total: float | None) -> float:
        """What a chunk's loss is multiplied by so the chunks add up to the whole batch's loss: 1 for a
        sum; for a mean, the chunk's share of what the mean is over (samples, or `mean_over`)."""
        if self._sum or stop - start == size:
            return 1.0
        if self._mean_over is None or not total:  # (no token in the whole batch: its mean is 0/0 anyway)
            return (stop - start) / size
        return float(self._mean_over(chunk)) / total

    def _chunk(self, job: ChunkJob) -> ChunkResult:
        """Forward and backward of the job's samples; the OOM as a failure (its `frozen` those parameters whose
        gradient it had touched). A chunk of weight 0 (no token to average over) is not backwarded."""
        phase, before, args, kwargs = "forward", None, job.args, job.kwargs
        try:
            with _NO_OP if job.synced else self._no_sync(), self._frozen(job.frozen), \
                    HeldLogging(self._module) as logged:
                chunk = job.batch
                if job.stop - job.start != job.size:
                    chunk = self._split(job.batch, job.start, job.stop, job.size)
                    if args:
                        args = (chunk, *args[1:])
                    else:
                        kwargs = {**kwargs, "batch": chunk}
                weight = self._weight(chunk, job.size, job.start, job.stop, job.total)
                output = self._original(*args, **kwargs)
                loss = loss_from_output(output)
                if loss is None or not (weight or job.synced):  # (FSDP's last chunk reduce-scatters, weight or not)
                    return ChunkResult(output=output, loss=loss, logged=logged, weight=weight)
                phase = "backward"
                if not job.clear:
                    before = gradient_versions(self._params)
                scale = weight / self._trainer.accumulate_grad_batches
                with Recording(self._params, job.order) if job.order is not None else _NO_OP:
                    self._backward(loss if scale == 1.0 else loss * scale)
        except torch.OutOfMemoryError as err:
            # a failed forward touched no gradient; a failed backward may have added to some
            changed = touched(self._params, before) if phase == "backward" else NONE
            return ChunkResult(failure=Failure(job.start, job.stop, phase, job.frozen | changed, str(err)))
        return ChunkResult(output=output, loss=loss, logged=logged, weight=weight)

    def _rebuilds_buckets(self) -> bool:
        """Whether this batch's backward is the one DDP rebuilds its buckets from: the first
        synchronised one, where DDP is not finding unused parameters (it then never rebuilds)."""
        ddp = self._ddp
        return (ddp is not None and ddp.require_backward_grad_sync and not ddp.find_unused_parameters
                and not self._has_rebuilt_buckets())

    def _backward(self, loss: torch.Tensor) -> None:
        """What Lightning's backward does with a loss, less its hooks and DDP's synchronisation: the
        GradScaler's scale (16-mixed), then the module's `backward` (autocast off, as in Lightning)."""
        if self._scaler is not None:
            loss = self._scaler.scale(loss)
        if torch.is_autocast_enabled(self._device_type):  # training_step runs under the precision's autocast
            with torch.autocast(self._device_type, enabled=False):
                self._module.backward(loss)
        else:
            self._module.backward(loss)

    def _splits(self, batch: Any) -> bool:
        """Whether this batch may run as chunks, and with what weights: memplan.callback.exactness, asked
        the first time a batch would be split (a planned split, or an OOM retry)."""
        if self._can_split is None:
            exactness = self._exactness(batch)
            self._can_split, self._sum, self._mean_over = exactness.can_split, exactness.loss_sum, exactness.mean_over
        return self._can_split

    def _after_failure(self, failure: Failure, pending: deque, batch: Any) -> deque:
        """Lower this rank's micro-batch (or turn checkpointing on) and re-cut what is left (memplan.callback.retry)."""
        if not self._retry:
            raise torch.OutOfMemoryError(failure.message)
        self.guarded = True  # (where guarding can work)
        release_memory()
        failed = failure.stop - failure.start
        smaller = self.retries.failed(failed, self.micro_batch_size, self.loader_batch_size)
        smaller = smaller if smaller is not None and self._splits(batch) else None
        if smaller is not None:
            self._retried_to = smaller
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

    def _frozen(self, frozen: frozenset[int]) -> contextlib.AbstractContextManager:
        return Frozen([self._params[i] for i in frozen if self._params[i].requires_grad]) if frozen else _NO_OP

    def _no_sync(self) -> contextlib.AbstractContextManager:
        return self._block_sync() if self._block_sync is not None else _NO_OP  # DDP: model.no_sync()
