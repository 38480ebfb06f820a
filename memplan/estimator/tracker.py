"""Follow every tensor storage through one traced training step.

A TorchDispatchMode sits above FakeTensorMode and sees each op's outputs. A storage seen for the
first time is an allocation; a weakref finalizer on the storage object (UntypedStorage keeps one
Python object per StorageImpl, so the finalizer runs when the storage itself dies, however many
views or autograd references held it) is its free. Each allocation goes through a memory model
(exact bytes for CPU, the CUDA caching allocator's blocks for a GPU), and live bytes are kept per
category so the breakdown at the peak is a copy of six counters, not a walk over live tensors.

Ops whose tensor inputs are all real (index arithmetic on the user's batch: masks, positions) run
for real, so data-dependent Python in models (`if mask.all():`) keeps working; small factory
outputs (`torch.arange(seq)`) are made real for the same reason; a random one among them (LayerDrop's
`torch.rand([])`) is decided rather than drawn (memplan.estimator.values). Everything touching a
parameter stays fake: no weight is ever allocated.
"""
from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Iterable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from memplan.compat.torch import (
    FakeTensor,
    TorchDispatchMode,
    disable_current_modes,
    local_tensor,
    tree_flatten,
)
from memplan.estimator.accumulation import RunningNode, accumulation_inputs
from memplan.estimator.allocator import ZERO_HANDLE
from memplan.estimator.conversions import share_conversions
from memplan.estimator.cuda.op_scratch import BY_DETERMINISM, GENERIC_GPU, cuda_op_scratch
from memplan.estimator.determinism import Deterministic
from memplan.estimator.kernels.losses import kept_buffer_bytes
from memplan.estimator.kernels.probe import KernelScratchProbe
from memplan.estimator.kernels.rules import CPU_LAYOUT_OPS, cpu_output_layout
from memplan.estimator.kernels.scratch import (
    ctc_backward_scratch_bytes, cuda_contiguous_copies, gloo_flat_buffer_bytes, promotion_scratch_bytes,
    with_rnn_workspace,
)
from memplan.estimator.op_tensors import tensors_in
from memplan.estimator.records import Category, Phase, Record, Snapshot  # noqa: F401  (Category, Phase re-exported)
from memplan.estimator.values import is_random

# Factory ops with no tensor inputs whose output is at most this many elements are made real, so
# that values like `torch.arange(seq_len)` can be inspected by model code. 64 Ki elements.
REAL_FACTORY_MAX_NUMEL = 1 << 16
_DEVICE_OF = torch.ops.prim.device.default


class StorageTracker(TorchDispatchMode):
    """Counts live storage bytes through a memory model. Use as the outermost dispatch mode."""

    def __init__(self, memory_model, fake_mode, *, cpu_kernels: bool, values=None) -> None:
        super().__init__()
        self.values = values
        """A values.ValueResolver that runs ops on fake inputs (kernel rules, value-dependent shapes)."""
        self.memory = memory_model
        self.fake_mode = fake_mode
        self.cpu_kernels = cpu_kernels
        """Model CPU kernels' in-kernel temporaries (type-promotion copies); off for CUDA targets."""
        self.kernel_probe = KernelScratchProbe()
        """oneDNN convolution and LSTM scratch, measured per shape on this host (CPU targets only)."""
        self.phase = Phase.SETUP
        self._running_node = RunningNode()
        self._records: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._by_category = {c: 0 for c in Category}
        self._active = True
        self.peak = Snapshot(total=0, by_category=dict(self._by_category), phase=Phase.SETUP)
        self.phase_peaks: dict[Phase, int] = {}
        """The peak window's largest allocated bytes in each phase (the planner extrapolates each)."""
        self.ops_seen = 0
        self.costs = None
        """A flops.CostCounter told of every op of the step (None: none counted)."""
        self.streams = None
        """A streams.StreamNumbers naming the stream each allocation is made on (None: all on the default
        stream); the caching allocator model keeps each stream's freed blocks for that stream."""
        self.forward_activations = 0
        self.realize_factories = True
        """Whether small CPU factories run for real (_maybe_realize_factory); not in FSDP2's collectives (fsdp.py)."""
        self.workspaces = None
        """A cuda.workspaces.LibraryWorkspaces: cuBLAS(Lt) workspaces taken at first use, cuDNN convolutions'
        and RNNs' for their run (None: CPU target)."""
        self.reductions = None
        """A cuda.reductions.ReductionStaging: a CUDA sum's staging buffer and semaphores (None: CPU target)."""
        self.cuda_gpu = GENERIC_GPU
        """The CUDA target's architecture and SMs, for the ops' own temporaries (cuda/op_scratch.py)."""
        self.deterministic: Deterministic = False
        """Whether the step runs with deterministic algorithms, for the ops' own temporaries (cuda/op_scratch.py)."""
        self.deterministic_paths: Counter[str] = Counter()
        """Calls of ops whose temporaries took their deterministic path in the peak window, by op name (the note)."""
        self._accumulation: tuple | None = None
        """A backward `add` that may be the autograd engine's gradient accumulation, until the next op
        shows whether one input died with it (see _settle_accumulation)."""

    # --- allocation bookkeeping ------------------------------------------------------------
    def track(self, tensor: torch.Tensor, category: Category = Category.TEMPORARIES) -> None:
        """Count a tensor's storage if it is not counted yet; recount it if it was resized in place since it
        was last counted (`torch.cat(..., out=buffer)` grows a buffer, as `resize_` does; torch's
        MemTracker re-checks every sighting the same way); otherwise leave it as it is."""
        storage = local_tensor(tensor).untyped_storage()
        record = self._records.get(storage)
        if record is not None:
            if record.live and storage.nbytes() != record.storage_bytes:
                self._recount(record, storage.nbytes())
            return
        handle = self.memory.malloc(storage.nbytes(), self._stream())
        node = self._running_node.current() if self.phase is Phase.BACKWARD else None
        record = Record(handle, self.memory.block_bytes(handle), category, self.phase, node=node,
                         storage_bytes=storage.nbytes())
        self._records[storage] = record
        weakref.finalize(storage, self._storage_died, record)
        self._by_category[category] += record.nbytes
        self._update_peak()

    def classify(self, tensor: torch.Tensor, category: Category, *, only_from: Category | None = None) -> None:
        """Move a tensor's storage (a sparse tensor's two) into `category` (tracking it first if needed)."""
        if tensor.is_sparse:
            for part in tensors_in(tensor):
                self.classify(part, category, only_from=only_from)
            return
        storage = local_tensor(tensor).untyped_storage()
        record = self._records.get(storage)
        if record is None:
            self.track(tensor, category)
            return
        if only_from is not None and record.category is not only_from:
            return
        self._by_category[record.category] -= record.nbytes
        record.category = category
        self._by_category[category] += record.nbytes

    def classify_all(self, tensors: Iterable[torch.Tensor], category: Category) -> None:
        for t in tensors:
            self.classify(t, category)

    def promote_forward_survivors(self) -> None:
        """At the end of the forward, what the forward made and is still alive is kept for backward
        (saved tensors, checkpoint inputs): count it as activations."""
        for record in list(self._records.values()):
            if record.live and record.phase is Phase.FORWARD and record.category is Category.TEMPORARIES:
                self._by_category[Category.TEMPORARIES] -= record.nbytes
                record.category = Category.ACTIVATIONS
                self._by_category[Category.ACTIVATIONS] += record.nbytes
        self.forward_activations = self._by_category[Category.ACTIVATIONS]

    def reserve(self, nbytes: int, category: Category) -> int:
        """An allocation no traced tensor stands for (a cuBLAS workspace, a DDP bucket): its handle."""
        handle = self.memory.malloc(nbytes, self._stream())
        self._by_category[category] += self.memory.block_bytes(handle)
        self._update_peak()
        return handle

    def resize(self, tensor: torch.Tensor) -> None:
        """A storage was resized in place (FSDP frees and re-allocates its unsharded parameters with
        `storage.resize_`): count its new size, as a fresh allocation of the current phase."""
        storage = local_tensor(tensor).untyped_storage()
        record = self._records.get(storage)
        if record is None:
            if storage.nbytes():
                self.track(tensor)
            return
        if record.live:
            self._on_free(record)
        if storage.nbytes():
            record.handle = self.memory.malloc(storage.nbytes(), self._stream())
            record.nbytes, record.storage_bytes = self.memory.block_bytes(record.handle), storage.nbytes()
            record.category, record.phase, record.live = Category.TEMPORARIES, self.phase, True
            self._by_category[record.category] += record.nbytes
            self._update_peak()

    def _holds(self, tensor: torch.Tensor, nbytes: int) -> None:
        """The real kernel's output `tensor` holds `nbytes`, more than the fake's storage (kernels/losses.py): counted
        so from now on, for as long as it lives (later sightings compare the fake storage's own size, kept)."""
        record = self._records.get(local_tensor(tensor).untyped_storage()) if nbytes else None
        if record is None or not record.live or nbytes <= record.nbytes:
            return
        old_handle, old_bytes = record.handle, record.nbytes
        record.handle = self.memory.malloc(nbytes, self._stream())
        record.nbytes = self.memory.block_bytes(record.handle)
        self._by_category[record.category] += record.nbytes - old_bytes
        self.memory.free(old_handle)
        self._update_peak()

    def _recount(self, record: Record, nbytes: int) -> None:
        """A live storage now `nbytes` long: its old block freed, a new one taken, its category kept (the
        allocator frees the old block after copying into the new one; the new one is taken first)."""
        old_handle, old_bytes = record.handle, record.nbytes
        record.handle = self.memory.malloc(nbytes, self._stream())
        record.nbytes, record.storage_bytes = self.memory.block_bytes(record.handle), nbytes
        self._by_category[record.category] += record.nbytes
        self._update_peak()
        self._by_category[record.category] -= old_bytes
        self.memory.free(old_handle)

    def forget(self, tensor: torch.Tensor) -> None:
        """The storage lives off the device from now on (FSDP's CPU offload): stop counting it."""
        record = self._records.get(local_tensor(tensor).untyped_storage())
        if record is None:
            self.track(tensor)
            record = self._records[local_tensor(tensor).untyped_storage()]
        self._on_free(record)

    def _stream(self) -> int:
        return 0 if self.streams is None else self.streams.current()

    def _storage_died(self, record: Record) -> None:
        record.storages -= 1
        if record.storages == 0:
            self._on_free(record)

    def _on_free(self, record: Record) -> None:
        if not self._active or not record.live:
            return
        record.live = False
        self._by_category[record.category] -= record.nbytes
        self.memory.free(record.handle)

    _defer_peak = False

    def _settle_accumulation(self) -> None:
        """After an accumulation's `add`: if the gradient it could add into died with it (the engine held its last
        reference), the real engine added in place and never held the sum besides both inputs; count the moment of the
        add without the sum. Otherwise count it as it was. On a CUDA target the sum took that gradient's block (lent at
        the add), so the caching allocator model never caches a block the real run never took."""
        if self._accumulation is None:
            return
        total, by_category, phase, out_bytes, inputs = self._accumulation
        self._accumulation = None
        lent = [r for r in inputs if r.handle == ZERO_HANDLE and r.nbytes]
        if any(not r.live and r.nbytes == out_bytes for r in inputs):
            total -= 0 if lent else out_bytes
            by_category[Category.TEMPORARIES] -= out_bytes
        else:  # added out of place after all: the gradient kept its own block beside the sum
            total += sum(r.nbytes for r in lent)
            for r in lent:
                r.handle = self.memory.malloc(r.storage_bytes, self._stream()) if r.live else ZERO_HANDLE
        if total > self.peak.total:
            self.peak = Snapshot(total=total, by_category=by_category, phase=phase)
        if total > self.phase_peaks.get(phase, 0):
            self.phase_peaks[phase] = total

    def _update_peak(self) -> None:
        if self._defer_peak:
            return
        total = self.memory.allocated_bytes
        if total > self.peak.total:
            self.peak = Snapshot(total=total, by_category=dict(self._by_category), phase=self.phase)
        if total > self.phase_peaks.get(self.phase, 0):
            self.phase_peaks[self.phase] = total

    def reset_peak(self) -> None:
        """Start a new peak window (the steady-state step)."""
        self._settle_accumulation()
        self.memory.reset_peaks()
        self.peak = Snapshot(total=self.memory.allocated_bytes, by_category=dict(self._by_category), phase=self.phase)
        self.phase_peaks = {self.phase: self.memory.allocated_bytes}
        self.deterministic_paths.clear()
        if self.costs is not None:
            self.costs.reset()

    def stop(self) -> None:
        """Stop counting: finalizers that run later (garbage collected fakes) are ignored."""
        self._settle_accumulation()
        self._active = False
        self._running_node.release()

    # --- dispatch ----------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE_OF and isinstance(args[0], FakeTensor):
            # `tensor.device` of a fake (the autograd engine asks it of every input and output): more
            # than half the ops a trace dispatches. It allocates nothing; answer as FakeTensorMode does.
            return args[0].fake_device
        kwargs = kwargs or {}
        self.ops_seen += 1
        self._settle_accumulation()
        tensors = tensors_in((args, kwargs))
        if tensors and not any(isinstance(local_tensor(t), FakeTensor) for t in tensors):
            with disable_current_modes():
                out = self._real(func, args, kwargs)
        else:
            out = self.values.call(func, args, kwargs) if self.values is not None else func(*args, **kwargs)
            if not tensors:
                out = self._maybe_realize_factory(func, args, kwargs, out)
            out = with_rnn_workspace(func, args, out)
            if self.cpu_kernels and func in CPU_LAYOUT_OPS:
                out = cpu_output_layout(func, args, out)
        backward = self.phase is Phase.BACKWARD
        if not backward:
            self._running_node.release()
        node = self._running_node.current() if backward else None
        accumulation = accumulation_inputs(self._records, node, backward, func, args, kwargs, out)
        if accumulation:
            self._defer_peak = True
            for r in accumulation:  # the real add writes into that input's block: the sum takes it (settled below)
                if not self.cpu_kernels and r.storage_bytes == local_tensor(out).untyped_storage().nbytes():
                    self.memory.free(r.handle)
                    r.handle = ZERO_HANDLE
        outputs = tensors_in(out)
        share_conversions(self._records, self.fake_mode, tensors, outputs, self._storage_died)
        for t, nbytes in self.workspaces.conv_calls(func, args, out) if self.workspaces is not None else ():
            self.track(t)  # a cuDNN call's output, then its workspace, freed before the next call
            self._transient(nbytes, category=Category.WORKSPACES)
        self._in_order(self.workspaces.rnn_steps(func, args, out) if self.workspaces is not None else ())
        for t in outputs:
            self.track(t)
        if self.cpu_kernels:
            self._holds(out, kept_buffer_bytes(func, args, kwargs, out))
        if self.costs is not None:
            self.costs.record(func, args, kwargs, out, tensors, outputs, self.phase.value)
        if accumulation:
            self._defer_peak = False
            self._accumulation = (self.memory.allocated_bytes, dict(self._by_category), self.phase,
                                  self._records[local_tensor(out).untyped_storage()].nbytes, accumulation)
        if self.cpu_kernels:
            self._transient(promotion_scratch_bytes(func, tensors), gloo_flat_buffer_bytes(func, args))  # (one is 0)
            with disable_current_modes():  # the probe runs the real op on real tensors
                self._transient(self.kernel_probe.scratch_bytes(func, args, kwargs, out))
        else:
            self._transient(*cuda_contiguous_copies(func, args))  # one request per copy
            phases = cuda_op_scratch(func, args, kwargs, self.cuda_gpu, deterministic=self.deterministic)
            if self.deterministic and func in BY_DETERMINISM and phases != cuda_op_scratch(func, args, kwargs,
                                                                                           self.cuda_gpu):
                self.deterministic_paths[func.overloadpacket.__name__] += 1
            for held in phases:  # an op's own buffers, phase by phase
                self._transient(*held)
            if self.reductions is not None:  # its buffer and semaphores, each a request of its own
                self._transient(*self.reductions.staging_allocations(func, args, kwargs, out))
        if self.workspaces is not None:
            for nbytes in self.workspaces.due(func, args, kwargs, backward=self.phase is Phase.BACKWARD,
                                              stream=self._stream()):
                self.reserve(nbytes, Category.WORKSPACES)
        self._transient(ctc_backward_scratch_bytes(func, args))
        return out

    def _in_order(self, steps) -> None:
        """An op's allocations in its kernel's order (a cuDNN RNN call's: cuda/rnn.py `allocation_steps`): ("keep",
        bytes) stays, ("track", tensor) is an output, ("hold", bytes) a local until ("drop", n) frees the last n."""
        held: list[int] = []
        for kind, value in steps:
            if kind == "track":
                self.track(value)
            elif kind in ("keep", "hold"):
                handle = self.reserve(value, Category.WORKSPACES)
                held += [handle] * (kind == "hold")
            else:
                for handle in [held.pop() for _ in range(value)]:
                    self._by_category[Category.WORKSPACES] -= self.memory.block_bytes(handle)
                    self.memory.free(handle)

    def _transient(self, *sizes: int, category: Category = Category.TEMPORARIES) -> None:
        """Memory a kernel holds only while it runs, on top of what is live (its outputs included): one request per
        size, in order, all held at once, then freed in reverse, as C++ destroys locals (a reduction's staging
        buffer and semaphores, an op's own buffers)."""
        handles = [self.memory.malloc(n, self._stream()) for n in sizes if n > 0]
        if not handles:
            return
        held = sum(self.memory.block_bytes(h) for h in handles)
        self._by_category[category] += held
        self._update_peak()
        self._by_category[category] -= held
        for handle in reversed(handles):
            self.memory.free(handle)

    def _maybe_realize_factory(self, func, args, kwargs, out):
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not self.realize_factories or len(outs) != 1 or outs[0].numel() > REAL_FACTORY_MAX_NUMEL \
                or outs[0].device.type != "cpu":
            return out
        with disable_current_modes():
            return self._real(func, args, kwargs)

    def _real(self, func, args, kwargs):
        """Run `func` on real tensors; a random draw is decided, not drawn (ValueResolver.draw)."""
        if self.values is not None and is_random(func):
            return self.values.draw(func, args, kwargs)
        return func(*args, **kwargs)
