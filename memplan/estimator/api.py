"""memplan.estimate(): trace one real training step on fake tensors and report its peak memory."""
from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from memplan.compat.torch import DataDependentOutputException, DynamicOutputShapeException, disable_current_modes
from memplan.compat.versions import VersionWarning, check_installed_once
from memplan.estimator.checkpointing import (
    _WRAPPED, CheckpointArg, OwnCheckpointCalls, apply_checkpointing, as_setting, find_repeated_blocks, saved_rng_states,
)
from memplan.estimator.cuda.composite import RealCompositePaths
from memplan.estimator.cuda.host_state import host_state_tensors
from memplan.estimator.determinism import Deterministic, deterministic_notes, resolve_deterministic
from memplan.estimator.ddp import ddp_bucket_bytes
from memplan.estimator.diagnose import explain_failure
from memplan.estimator.errors import EstimateError
from memplan.estimator.fake import batch_on_device, fake_model, new_fake_mode, quiet_fake_tensor_log
from memplan.estimator.fake_copy import metric_states
from memplan.estimator.flops import CostCounter
from memplan.estimator.fsdp import FsdpSettings, fake_process_group, follow_storage, shard_model
from memplan.estimator.hooks import hook_notes
from memplan.estimator.inputs import resolve_loss, resolve_optimizer
from memplan.estimator.module_conversion import conversions_in_step
from memplan.estimator.notes import generic_gpu_note
from memplan.estimator.result import MemoryEstimate
from memplan.estimator import manual
from memplan.estimator.kernels import sparse
from memplan.estimator.step import (LOOP_NOTES, LossFn, Loop, PrecisionPolicy, SavedTensorsHooks, StepOptions,
                                    check_loop, grad_scaler_tensors, iter_tensors, run_training_step)
from memplan.estimator.streams import StreamNumbers, side_stream_bytes
from memplan.estimator.target import (GENERIC_CUDA, check_precision_on_target, memory_model,
                                      precision_lightning_runs, resolve_target, set_up_cuda_tracker,
                                      target_overheads)
from memplan.estimator.trace_route import fallback_after, trace_target
from memplan.estimator.trace_setting import TraceSetting, check_strategy
from memplan.estimator.tracker import Category, Phase, StorageTracker
from memplan.estimator.values import DataDependent, ValueResolver
from memplan.units import MiB

TRACED_STEPS = 2
"""Step 1 creates the optimizer state lazily; step 2 is the steady state the peak is taken from."""


def estimate(
    model: nn.Module | Callable[[], nn.Module],
    batch: Any,
    *,
    loss: LossFn | None = None,
    optimizer: str | Callable[..., torch.optim.Optimizer] | None = None,
    precision: str = "32-true",
    checkpointing: CheckpointArg = False,
    device: str | None = None,
    strategy: str | None = None,
    world_size: int = 1,
    loop: Loop = "lightning",
    data_dependent: DataDependent = "balanced",
    fsdp: FsdpSettings | None = None,
    deterministic: Deterministic | None = None,
) -> MemoryEstimate:
    """Peak memory of one steady-state training step, traced on fake tensors (no weight allocated).

    model: nn.Module / LightningModule (real or meta), or a zero-argument callable that builds one.
    batch: one batch exactly as the training step receives it.
    loss: callable(model, batch) -> scalar. Default: LightningModule.training_step, else `output.loss`.
    optimizer: "sgd", "sgd-momentum", "adam", "adamw", "rmsprop", "adagrad" or callable(params).
        Default: the LightningModule's configure_optimizers(), else "adamw".
    precision: Lightning's precision string.
    checkpointing: False, True (each repeated block), a memplan Checkpointing or its text form ('full',
        'blocks:4' the first 4 repeated blocks, 'every:2' every 2nd, 'op' torchtitan's per-op policy on each
        block), or a set of module classes to checkpoint.
    device: "cpu", a GPU model name ("A100-80GB"), a memplan.hardware GpuModel (custom_gpu("24GiB")),
        or None for the local GPU. A GPU target is traced on fake CPU tensors with CUDA emulated, also where
        there is a GPU (MEMPLAN_TRACE_ON_CPU=0 traces on fake CUDA tensors there: memplan.estimator.target).
    strategy, world_size: None, or "ddp" / "fsdp" with the number of ranks (memory is per rank).
    loop: "lightning" (zero_grad after the forward, as Lightning runs it), "torch" (a plain loop:
        forward + loss, backward, step, zero_grad(set_to_none=True)), "torch-zero-after-forward" (a plain
        loop zeroing between forward and backward) or "torch-keep-grads" (zero_grad(set_to_none=False):
        gradients stay allocated). See memplan/estimator/step.py.
    data_dependent: how shapes decided by activation values (MoE routing, matching, `.item()` checks)
        are resolved: "balanced" (even routing), "sample" (random values) or "error" (refuse). Shapes
        decided by the batch (masks, lengths) are always exact. See memplan/estimator/values.py.
    fsdp: FsdpSettings (sharding strategy, wrapped classes, offload, dtypes) for strategy="fsdp".
    deterministic: whether the step runs with deterministic algorithms, as Lightning's Trainer(deterministic=...):
        True, "warn" (warn-only) or False; None (default): as this process has set torch.use_deterministic_algorithms.
        Some CUDA ops hold other temporaries then (memplan.estimator.determinism); a note names those counted.

    Warns (VersionWarning, once a process) where torch or Lightning is installed outside the versions
    memplan knows (memplan.compat.versions).
    """
    for outside in check_installed_once("memplan"):
        warnings.warn(f"memplan.estimate: {outside}", VersionWarning, stacklevel=2)
    policy = PrecisionPolicy.from_string(precision)
    check_strategy(strategy, world_size)
    check_loop(loop)
    deterministic = resolve_deterministic(deterministic)
    if strategy == "fsdp":
        fsdp = fsdp or FsdpSettings()
        fsdp.check(world_size)
    target = resolve_target(device)
    check_precision_on_target(policy, target)
    policy, precision_note = precision_lightning_runs(policy, target, loop)
    target, route_note = trace_target(target, strategy)

    started = time.perf_counter()
    group = fake_process_group(world_size) if strategy == "fsdp" else contextlib.nullcontext()
    with warnings.catch_warnings(), quiet_fake_tensor_log(), group:
        warnings.filterwarnings("ignore", message=".*self.log.*")
        warnings.filterwarnings("ignore", message=".*`training_step` returned `None`.*")
        setting = TraceSetting(policy=policy, checkpointing=checkpointing, target=target, strategy=strategy, loop=loop,
                               data_dependent=data_dependent, fsdp=fsdp, world_size=world_size,
                               deterministic=deterministic)
        trace = _traced(model, batch, loss, optimizer, setting, [n for n in (precision_note, route_note) if n])
    return trace.result(time.perf_counter() - started, world_size)


def _traced(model, batch, loss, optimizer, setting: TraceSetting, notes: list[str]) -> _Trace:
    """The trace of `setting`, run, with `notes`; where a trace on fake CUDA tensors stops at an op without a fake
    kernel, the trace with CUDA emulated on CPU instead (memplan.estimator.trace_route)."""
    trace = _Trace(model, batch, loss, optimizer, setting)
    trace.notes.extend(notes)
    try:
        trace.run()
        return trace
    except EstimateError as err:
        fallback = fallback_after(err, setting.target)
        if fallback is None:
            raise
    target, note = fallback
    return _traced(model, batch, loss, optimizer, replace(setting, target=target), [*notes, note])


class _Trace:
    """One estimate's trace: the fake model, the tracker, and the two steps."""

    def __init__(self, model, batch, loss, optimizer, setting: TraceSetting):
        policy, checkpointing, target, strategy = setting.policy, setting.checkpointing, setting.target, setting.strategy
        loop, data_dependent, fsdp, world_size = setting.loop, setting.data_dependent, setting.fsdp, setting.world_size
        self.target, self.deterministic = target, setting.deterministic
        self.loop, self.policy, self.strategy = loop, policy, strategy
        self.composites = RealCompositePaths(native_fast_paths=not target.is_cuda)
        self.notes: list[str] = []
        self.fake_mode = new_fake_mode()
        self.values = ValueResolver(data_dependent, self.fake_mode)
        self.device = torch.device(target.trace_device)
        self.model = fake_model(model, self.fake_mode, device=self.device, param_dtype=policy.param_dtype)
        self.checkpointed = apply_checkpointing(self.model, checkpointing) if checkpointing else []
        self.own_checkpoints = OwnCheckpointCalls()
        setting = as_setting(checkpointing) if checkpointing else None
        self.checkpoint_mode = str(setting) if setting is not None else ("full" if self.checkpointed else "none")
        self.fsdp = fsdp if strategy == "fsdp" else None
        if self.fsdp is not None:
            shard_model(self.model, self.fsdp, world_size, self.fake_mode)
            self.notes.append(self.fsdp.describe(world_size))
        self.batch = batch
        self.loss_arg, self.optimizer_arg = loss, optimizer
        self.memory = memory_model(target)
        self.tracker = StorageTracker(self.memory, self.fake_mode, cpu_kernels=not target.is_cuda, values=self.values)
        self.tracker.costs = CostCounter()
        if target.is_cuda:
            self.tracker.streams = StreamNumbers(self.device.type)
        self.tracker.costs.watch_blocks(_blocks_of(self.model), [m for _, m in find_repeated_blocks(self.model)])
        self.overheads = target_overheads(target, deterministic=self.deterministic, loop=loop)

    # --- the trace ---------------------------------------------------------------------------
    def run(self) -> None:
        tracker = self.tracker
        try:
            follow = follow_storage(tracker) if self.fsdp else contextlib.nullcontext()
            with self._emulation(), self.values.watching(self.model), self.fake_mode, tracker, self._rng_states(), \
                    self.composites, follow, self.own_checkpoints:
                self._setup()
                for step in range(TRACED_STEPS):
                    if step == TRACED_STEPS - 1:
                        tracker.reset_peak()
                        self.own_checkpoints.calls = 0
                    self._step()
        except (DataDependentOutputException, DynamicOutputShapeException) as err:
            raise EstimateError(
                argument="model", stage="step", detail="the training step has an op whose output depends on tensor "
                f"values ({err.func if hasattr(err, 'func') else err}), e.g. boolean masking, nonzero or .item() on "
                "an activation", fix="memplan traces without data, so it cannot follow it; estimate a variant "
                "without that op, or pass a loss= that avoids it"
            ) from err
        finally:
            tracker.stop()

    def _emulation(self) -> contextlib.AbstractContextManager:
        if not self.target.emulates_cuda:
            return contextlib.nullcontext()
        from memplan.estimator.cuda.semantics import emulate_cuda

        return emulate_cuda(compute_capability=self.target.compute_capability, autocast_dtype=self.policy.autocast_dtype)

    def _rng_states(self) -> contextlib.AbstractContextManager:
        """Checkpointing's saved CPU RNG states (memplan's or the model's own checkpointing): in the
        device's memory only when the device is the CPU."""
        if self.target.is_cuda:
            return contextlib.nullcontext()
        return saved_rng_states(lambda state: self.tracker.track(state, Category.ACTIVATIONS))

    def _setup(self) -> None:
        tracker = self.tracker
        for p in self.model.parameters():
            tracker.track(p, Category.PARAMETERS)
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda q: tracker.classify(q.grad, Category.GRADIENTS))
        for b in (*self.model.buffers(), *metric_states(self.model)):
            tracker.track(b, Category.PARAMETERS)
        if self.fsdp is not None and self.fsdp.cpu_offload:
            for p in self.model.parameters():
                tracker.forget(p)
                p.register_post_accumulate_grad_hook(lambda q: tracker.forget(q.grad))
        loaded, self.batch = self._prepare_batch(self.batch)
        self._loader_batch = None  # (kept alive only where counted)
        if self.loop == "lightning" and not self.target.is_cuda and self.policy.param_dtype != torch.float32:
            # Lightning's '-true' precision converts each step's batch (training_epoch_loop: precision_plugin.
            # convert_input) before moving it: the loader's float32 batch stays beside the copy in host memory,
            # so it is counted only where the target's memory is the host's.
            self._loader_batch = loaded
            for t in iter_tensors(loaded):
                tracker.track(t, Category.BATCH)
            self.notes.append("'-true' precision in Lightning's loop: the loader's float32 batch stays alive "
                              "beside the converted copy Lightning makes each step")
        for t in iter_tensors(self.batch):
            tracker.track(t, Category.BATCH)
        self.manual = None
        if self.loss_arg is None and self.optimizer_arg is None and manual.is_manual(self.model):
            optimizers, schedulers = manual.configured(self.model.configure_optimizers())
            self.manual = manual.StandInTrainer(optimizers, schedulers, device_type=self.device.type,
                                                grad_scale=None, phase=lambda name: None)
            self.optimizer = optimizers[0]
        else:
            self.optimizer = resolve_optimizer(self.model, self.optimizer_arg)
        if self.target.is_cuda:  # torch's optimizers default to foreach on CUDA, whose device check fake tensors fail
            from memplan.estimator.cuda.semantics import apply_cuda_optimizer_defaults
            apply_cuda_optimizer_defaults(self.optimizer)  # what CUDA would choose
        self.loss_fn = resolve_loss(self.model, self.loss_arg)
        if self.strategy == "ddp":
            for nbytes in ddp_bucket_bytes(list(self.model.parameters())):
                tracker.reserve(nbytes, Category.GRADIENTS)
        if self.overheads is not None:
            set_up_cuda_tracker(tracker, self.overheads, self.target, self.deterministic)
        self.grad_scale, self.growth_tracker = grad_scaler_tensors(self.device, cuda=self.target.is_cuda) \
            if self.policy.grad_scaling else (None, None)
        if self.manual is not None:
            self.manual.grad_scale, self.manual.scaler_copies = self.grad_scale, self.target.is_cuda

    def _prepare_batch(self, batch: Any) -> tuple[Any, Any]:
        """The batch as the loader gives it on the trace's device, and as the step takes it (precision's)."""
        if not any(True for _ in iter_tensors(batch)):
            raise EstimateError(
                f"batch has no tensors (got {type(batch).__name__}); pass one batch exactly as the training "
                "step receives it, e.g. (inputs, targets) or a dict of tensors",
                argument="batch", detail=f"the batch has no tensors (got {type(batch).__name__})"
            )
        with disable_current_modes():  # the user's real batch stays real, on the trace's device
            loaded = batch_on_device(batch, self.device, self.fake_mode)
            return loaded, self.policy.convert_batch(loaded)

    def _step(self) -> None:
        saved_hooks = SavedTensorsHooks(self._pack)
        try:
            with conversions_in_step():  # a no-op Module.to() in forward, as the real run
                if self.manual is not None:  # the user's own manual_backward and optimizer steps
                    manual.run_manual_step(self.model, self.batch, self.manual, policy=self.policy,
                                           phase=lambda name: self._on_phase(name, saved_hooks))
                else:  # a plain loop's `loss` variable holds the last step's loss until the next forward returns
                    last = run_training_step(
                        self.model, self.batch, loss_fn=self.loss_fn, optimizer=self.optimizer,
                        options=StepOptions(policy=self.policy, device_type=self.device.type,
                                            grad_scale=self.grad_scale, loop=self.loop,
                                            scaler_copies=self.target.is_cuda),
                        on_phase=lambda name: self._on_phase(name, saved_hooks),
                    )
                    self._last_loss = None if self.loop == "lightning" else last
        except (EstimateError, DataDependentOutputException, DynamicOutputShapeException):
            saved_hooks.close()
            raise
        except Exception as err:  # the step is user code: any failure becomes one EstimateError naming its cause
            saved_hooks.close()
            raise explain_failure(err, model=self.model, batch_tensors=iter_tensors(self.batch),
                                  phase=self.tracker.phase.value) from err
        optimizers = self.manual.optimizers if self.manual is not None else [self.optimizer]
        state_tensors = [t for o in optimizers for s in o.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        self.tracker.classify_all(state_tensors, Category.OPTIMIZER_STATE)
        off_device = state_tensors if self.fsdp is not None and self.fsdp.cpu_offload else (
            [t for o in optimizers for t in host_state_tensors(o)] if self.target.is_cuda else [])
        for t in off_device:  # CPU-offloaded state; on CUDA, the step counters torch keeps on the host
            self.tracker.forget(t)

    def _on_phase(self, name: str, saved_hooks) -> None:
        tracker = self.tracker
        if name == "forward":
            tracker.phase = Phase.FORWARD
            saved_hooks.open()
        elif name == "forward_end":
            saved_hooks.close()
            self._last_loss = None  # (the user's `loss = ...` replaces it: a CPU mse_loss's keeps its whole buffer)
            tracker.promote_forward_survivors()
        elif name == "backward":
            tracker.phase = Phase.BACKWARD
        elif name == "optimizer":
            tracker.phase = Phase.OPTIMIZER

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """Count a tensor saved for backward as an activation; keep its data only. Autograd saves an
        op's own output (`exp`, `sigmoid`, `tanh`) without its grad_fn, to avoid a cycle; a pack hook
        returning the tensor itself would have the node hold the tensor that holds the node, and an
        unused branch would then outlive the forward until a backward through it (+25 % on a toy).
        The node gives the grad_fn back at unpacking, so the data is all it needs."""
        self.tracker.classify(tensor, Category.ACTIVATIONS, only_from=Category.TEMPORARIES)
        return tensor.detach()

    # --- the result --------------------------------------------------------------------------
    def result(self, seconds: float, world_size: int) -> MemoryEstimate:
        peak = self.tracker.peak
        by = peak.by_category
        peak_reserved = self.memory.peak_reserved_bytes
        used = self.tracker.workspaces
        context = (self.overheads.step_context_bytes(cudnn=used.cudnn_used, attention_16bit=used.attention_16bit)
                   if self.overheads else 0)
        communication = 0
        if self.strategy in ("ddp", "fsdp") and self.target.is_cuda:
            from memplan.estimator.cuda.overheads import nccl_buffer_bytes

            communication = nccl_buffer_bytes(world_size, compute_capability=self.target.compute_capability)
        notes = list(self.notes) + self.values.notes + sparse.notes(self.model)
        if self.loop != "lightning":
            notes.append(LOOP_NOTES[self.loop])
        if self.target.emulates_cuda:
            notes.append("CUDA target traced on CPU fake tensors with CUDA's op semantics emulated")
        if self.target.name == GENERIC_CUDA:
            notes.append(generic_gpu_note(self.target.compute_capability))
        if self.overheads is not None:
            workspaces = self.tracker.workspaces
            notes.extend(self.overheads.notes + tuple(workspaces.conv.notes()) + tuple(workspaces.rnn.notes()))
        if self.checkpointed:
            notes.append(f"checkpointed {len(self.checkpointed)} blocks"
                         f"{' (per-op policy: matmul and attention outputs kept)' if self.checkpoint_mode == 'op' else ''}")
        notes.extend(self.tracker.kernel_probe.notes() + self.composites.notes() + hook_notes(self.model, self.loop))
        notes.extend(deterministic_notes(self.deterministic, self.tracker.deterministic_paths, lightning=self.loop
                                         == "lightning") if self.target.is_cuda else ())
        side = side_stream_bytes(self.memory)
        if side:
            whose = " (FSDP2's all-gather copy-in and reduce-scatter streams)" if self.fsdp is not None else ""
            notes.append(f"{side / MiB:.0f} MiB of the reserved memory is cached by side streams{whose}: the "
                         "caching allocator keeps a stream's freed blocks for that stream, so the default stream "
                         "cannot reuse them")
        return MemoryEstimate(
            parameters=by[Category.PARAMETERS],
            gradients=by[Category.GRADIENTS],
            optimizer_state=by[Category.OPTIMIZER_STATE],
            activations=by[Category.ACTIVATIONS],
            temporaries=by[Category.TEMPORARIES],
            batch=by[Category.BATCH],
            workspaces=by[Category.WORKSPACES],
            peak_allocated=peak.total,
            peak_reserved=max(peak_reserved, peak.total),
            side_stream_reserved=side,
            device_total=max(peak_reserved, peak.total) + context + communication,
            cuda_context=context, communication=communication,
            device=self.target.name,
            precision=self.policy.precision,
            checkpointing=bool(self.checkpointed),
            checkpoint_mode=self.checkpoint_mode if self.checkpointed else "none",
            strategy=self.strategy,
            world_size=world_size,
            batch_size=_batch_size(self.batch),
            num_parameters=sum(p.numel() for p in self.model.parameters()),
            own_checkpoint_calls=self.own_checkpoints.calls,
            forward_activations=self.tracker.forward_activations,
            peak_phase=peak.phase.value,
            peak_allocated_by_phase=tuple((phase.value, value) for phase, value in self.tracker.phase_peaks.items()
                                          if phase is not Phase.SETUP),
            trace_seconds=seconds,
            notes=tuple(notes),
            step_costs=self.tracker.costs.result(),
        )


def _blocks_of(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks and the checkpointed modules: where the step-time model looks for recompute."""
    blocks = {id(m): m for _, m in find_repeated_blocks(model)}
    blocks.update((id(m), m) for m in model.modules() if getattr(m, _WRAPPED, False))
    return list(blocks.values())


def _batch_size(batch: Any) -> int | None:
    for t in iter_tensors(batch):
        return int(t.shape[0]) if t.dim() > 0 else None
    return None
