"""FSDP2 (`torch.distributed.fsdp.fully_shard`) traced for real, on fake tensors, in one process.

The estimate runs the step on rank 0 of a fake process group of `world_size` ranks (torch's own
`FakeStore` + the "fake" backend, which torchtitan's memory estimation uses): fully_shard shards the
fake parameters as it would on rank 0 (rank 0 holds the largest shard when a dimension does not
divide), and every collective returns at once with its output buffer untouched. So the trace sees
what rank 0 allocates: the sharded parameters, gradients and optimizer state (DTensors, counted by
their local shard), each wrapped block's all-gather buffers and unsharded parameters, the prefetch of
the next block, and the reduce-scatter buffers, freed when FSDP frees them.

What is wrapped follows Lightning's ModelParallelStrategy examples: `fully_shard` on each repeated
block (the blocks memplan checkpoints, memplan.estimator.checkpointing), then on the root.

torch privates used here, known for torch 2.7-2.13 (an upgrade fails in `follow_storage`):
`torch.distributed.fsdp._fully_shard._fsdp_param.alloc_storage / free_storage` (FSDP2 frees the
unsharded parameters with `storage.resize_(0)`, which no dispatch mode sees),
`torch.distributed.fsdp._fully_shard._fsdp_param._chunk_with_empty` (see `lazy_chunks`), and
`torch.testing._internal.distributed.fake_pg.FakeStore`.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from memplan.compat.lightning import DEVICE_MESH_ATTRIBUTE
from memplan.compat.torch import (
    ensure_c10d_fake_kernels, fake_store, fsdp2_chunk_with_empty, fsdp2_default_reshard, fsdp2_internals,
    set_fsdp2_chunk_with_empty,
)
from memplan.estimator.checkpointing import find_repeated_blocks
from memplan.estimator.errors import EstimateError

ShardingStrategy = Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"]
SHARDING_STRATEGIES: tuple[str, ...] = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class FsdpSettings:
    """How the model is sharded: the settings an FSDP user chooses."""

    sharding_strategy: ShardingStrategy = "FULL_SHARD"
    """FULL_SHARD: parameters, gradients and optimizer state sharded over all ranks, blocks resharded
    after forward. SHARD_GRAD_OP: same, but blocks stay unsharded from forward to backward.
    HYBRID_SHARD: FULL_SHARD within groups of `shard_size` ranks (a node), replicated across groups.
    NO_SHARD: every rank holds everything (DDP's memory, FSDP's engine)."""
    shard_size: int | None = None
    """Ranks per shard group for HYBRID_SHARD (the GPUs of one node); ignored otherwise."""
    reshard_after_forward: bool | None = None
    """Free each block's unsharded parameters after its forward; None: as the strategy implies."""
    wrap: tuple[type[nn.Module], ...] | None = None
    """Module classes given their own fully_shard; None: the model's repeated blocks."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in host memory (CPUOffloadPolicy)."""
    param_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """dtype of the all-gathered parameters (MixedPrecisionPolicy.param_dtype); None: as stored."""
    reduce_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """dtype gradients are reduce-scattered in (MixedPrecisionPolicy.reduce_dtype); None: param_dtype."""
    configure_model: bool = False
    """Shard as the model does itself: call its `configure_model()` (Lightning's ModelParallelStrategy,
    where the user applies fully_shard) with `device_mesh` a fake mesh of ("data_parallel",
    "tensor_parallel") = (world size, 1), instead of wrapping the repeated blocks and the root. Only the
    sharding is read from this field: wrap, reshard and the dtypes are whatever the user's calls say.
    Where configure_model shards nothing here (it looks for a Trainer first, say), the repeated blocks
    and the root are wrapped, as without this field."""

    def __post_init__(self) -> None:
        if self.sharding_strategy not in SHARDING_STRATEGIES:
            raise EstimateError(
                f"fsdp.sharding_strategy must be one of {', '.join(SHARDING_STRATEGIES)}; "
                f"got {self.sharding_strategy!r}"
            )
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and value not in DTYPES:
                raise EstimateError(f"fsdp.{name} must be one of {', '.join(DTYPES)} or None; got {value!r}")
        if self.shard_size is not None and (not isinstance(self.shard_size, int) or self.shard_size < 1):
            raise EstimateError(f"fsdp.shard_size must be a positive int (ranks per node); got {self.shard_size!r}")
        if self.wrap is not None and not all(isinstance(c, type) and issubclass(c, nn.Module) for c in self.wrap):
            raise EstimateError(f"fsdp.wrap must be a tuple of nn.Module classes; got {self.wrap!r}")

    @property
    def resharded(self) -> bool:
        """Whether blocks free their unsharded parameters after forward."""
        if self.reshard_after_forward is not None:
            return self.reshard_after_forward
        return self.sharding_strategy in ("FULL_SHARD", "HYBRID_SHARD")

    def shard_degree(self, world_size: int) -> int:
        """Ranks one parameter is sharded over."""
        if self.sharding_strategy == "NO_SHARD":
            return 1
        if self.sharding_strategy == "HYBRID_SHARD":
            return self.shard_size or world_size
        return world_size

    def check(self, world_size: int) -> None:
        """Errors that need the world size."""
        if self.sharding_strategy != "HYBRID_SHARD":
            return
        if self.shard_size is None:
            raise EstimateError(
                "fsdp.sharding_strategy='HYBRID_SHARD' needs fsdp.shard_size, the ranks of one shard group "
                "(usually the GPUs per node, e.g. shard_size=8)"
            )
        if world_size % self.shard_size:
            raise EstimateError(
                f"fsdp.sharding_strategy='HYBRID_SHARD': world_size={world_size} is not a multiple of "
                f"fsdp.shard_size={self.shard_size}; use a shard_size that divides the world size "
                "(the GPUs per node), or FULL_SHARD"
            )

    def describe(self, world_size: int) -> str:
        parts = [f"FSDP2 {self.sharding_strategy} over {self.shard_degree(world_size)} of {world_size} ranks"]
        if self.cpu_offload:
            parts.append("CPU offload (sharded parameters, gradients and optimizer state in host memory)")
        if self.param_dtype or self.reduce_dtype:
            parts.append(f"param_dtype={self.param_dtype}, reduce_dtype={self.reduce_dtype}")
        if not self.resharded:
            parts.append("blocks kept unsharded from forward to backward")
        return "; ".join(parts)


def blocks_to_wrap(model: nn.Module, wrap: Collection[type[nn.Module]] | None) -> list[nn.Module]:
    """The modules that get their own fully_shard, before the root."""
    if wrap is None:
        blocks = [m for _, m in find_repeated_blocks(model)]
        if not blocks:
            raise EstimateError(
                "fsdp.wrap: the model has no repeated block (an nn.ModuleList or nn.Sequential of >= 2 modules "
                "of one class) to give its own fully_shard; pass fsdp=FsdpSettings(wrap=(BlockClass,)) naming "
                "the module classes to wrap"
            )
        return blocks
    classes = tuple(wrap)
    blocks = [m for m in model.modules() if isinstance(m, classes) and m is not model]
    if not blocks:
        names = ", ".join(c.__name__ for c in classes)
        raise EstimateError(f"fsdp.wrap=({names}) matched no module of the model; check the class names")
    return blocks


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """A process group of `world_size` fake ranks in this process, this process being rank 0."""
    import torch.distributed as dist

    if not dist.is_available():
        raise EstimateError("strategy='fsdp' needs torch.distributed, which this torch build lacks")
    if dist.is_initialized():
        raise EstimateError(
            "strategy='fsdp' traces with a fake process group, but a process group is already initialized in "
            "this process; run the estimate before init_process_group, or in a separate process "
            "(python -m memplan estimate ...)"
        )
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=world_size)
    ensure_c10d_fake_kernels()  # every collective the trace runs, memplan's wrapping or the model's configure_model
    try:
        yield
    finally:
        dist.destroy_process_group()


def shard_model(model: nn.Module, settings: FsdpSettings, world_size: int, fake_mode) -> list[nn.Module]:
    """Apply fully_shard to the blocks and the root, on fake tensors; returns the wrapped blocks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if settings.configure_model and callable(getattr(model, "configure_model", None)):
        sharded = _shard_as_configured(model, world_size, fake_mode)
        if sharded is not None:
            return sharded
    blocks = blocks_to_wrap(model, settings.wrap)
    shard = settings.shard_degree(world_size)
    # The mesh is built outside the fake mode: DeviceMesh reads its rank map back with .tolist().
    if shard == world_size:
        mesh = init_device_mesh("cpu", (world_size,))
    else:
        mesh = init_device_mesh("cpu", (world_size // shard, shard), mesh_dim_names=("replicate", "shard"))
    kwargs = dict(
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(
            param_dtype=DTYPES.get(settings.param_dtype), reduce_dtype=DTYPES.get(settings.reduce_dtype)
        ),
        offload_policy=CPUOffloadPolicy(pin_memory=False) if settings.cpu_offload else OffloadPolicy(),
    )
    with fake_mode, lazy_chunks():
        for block in blocks:
            fully_shard(block, reshard_after_forward=settings.resharded, **kwargs)
        # The root as fully_shard leaves it by default: kept unsharded from forward to backward
        # (its parameters are the first backward needs), unless the user said otherwise.
        root_reshard = settings.reshard_after_forward if settings.reshard_after_forward is not None else (
            fsdp2_default_reshard() if settings.resharded else False)
        fully_shard(model, reshard_after_forward=root_reshard, **kwargs)
    return blocks


def _shard_as_configured(model: nn.Module, world_size: int, fake_mode) -> list[nn.Module] | None:
    """The model's own configure_model() on a fake ("data_parallel", "tensor_parallel") mesh of
    (world_size, 1), as Lightning's ModelParallelStrategy calls it: whatever fully_shard calls it makes
    (on `self.model`'s blocks and `self.model`, say) are the sharding traced. Returns the sharded modules,
    None where it sharded nothing."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    had = model.__dict__.get(DEVICE_MESH_ATTRIBUTE, _MISSING)
    model.__dict__[DEVICE_MESH_ATTRIBUTE] = mesh  # LightningModule.device_mesh reads it
    try:
        with fake_mode, lazy_chunks():
            model.configure_model()
    except Exception as err:  # user code: one error naming it
        raise EstimateError(argument="model", stage="step", cause=f"{type(err).__name__}: {err}",
                            detail=f"its configure_model() failed on memplan's fake mesh of {world_size} "
                            f"data-parallel rank(s) ({type(err).__name__}: {err})") from err
    finally:
        if had is _MISSING:
            model.__dict__.pop(DEVICE_MESH_ATTRIBUTE, None)
        else:
            model.__dict__[DEVICE_MESH_ATTRIBUTE] = had
    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    return sharded or None  # None: it shards nothing here (it may ask the Trainer first): memplan's own wrapping


_MISSING = object()


LAZY_CHUNKS = True
"""Whether shard_model makes only the chunks fully_shard reads (tests compare with False)."""


class _Chunks(Sequence):
    """torch.chunk(tensor, num_chunks, dim) padded with empty tensors to num_chunks, as FSDP2's
    `_chunk_with_empty` returns it, each chunk made when it is read. fully_shard reads rank 0's and the
    first of every parameter's `world_size` chunks; making all of them on fake tensors was a fifth of
    a 64-rank trace of a 70B model."""

    def __init__(self, tensor: torch.Tensor, num_chunks: int, dim: int) -> None:
        self.tensor, self.num_chunks, self.dim = tensor, num_chunks, dim
        self.size = -(-tensor.shape[dim] // num_chunks)

    def __len__(self) -> int:
        return self.num_chunks

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.num_chunks))]
        if index < 0:
            index += self.num_chunks
        if not 0 <= index < self.num_chunks:
            raise IndexError(index)
        start = index * self.size
        if start >= self.tensor.shape[self.dim]:
            return self[0].new_empty(0)
        return self.tensor.narrow(self.dim, start, min(self.size, self.tensor.shape[self.dim] - start))


@contextlib.contextmanager
def lazy_chunks() -> Iterator[None]:
    """fully_shard with `_Chunks` for its `_chunk_with_empty` (a tensor with an empty dim keeps torch's)."""
    original = fsdp2_chunk_with_empty()

    def chunk_with_empty(tensor: torch.Tensor, num_chunks: int, dim: int):
        if not LAZY_CHUNKS or tensor.dim() == 0 or tensor.shape[dim] == 0:
            return original(tensor, num_chunks, dim)
        return _Chunks(tensor, num_chunks, dim)

    set_fsdp2_chunk_with_empty(chunk_with_empty)
    try:
        yield
    finally:
        set_fsdp2_chunk_with_empty(original)


@contextlib.contextmanager
def follow_storage(tracker) -> Iterator[None]:
    """Tell the tracker when FSDP2 frees or re-allocates an unsharded parameter in place."""
    try:
        _fsdp_param, _fsdp_param_group = fsdp2_internals()
    except ImportError as err:  # pragma: no cover - a torch upgrade moved FSDP2's internals
        raise EstimateError(f"strategy='fsdp' needs FSDP2's internals of torch 2.7-2.13 ({err})") from err
    original_alloc, original_free = _fsdp_param.alloc_storage, _fsdp_param.free_storage

    def alloc_storage(tensor: torch.Tensor) -> None:
        original_alloc(tensor)
        tracker.resize(tensor)

    def free_storage(tensor: torch.Tensor) -> None:
        original_free(tensor)
        tracker.resize(tensor)

    _fsdp_param.alloc_storage = _fsdp_param_group.alloc_storage = alloc_storage
    _fsdp_param.free_storage = free_storage
    try:
        with _collective_buffers_stay_fake(tracker, _fsdp_param_group.FSDPParamGroup):
            yield
    finally:
        _fsdp_param.alloc_storage = _fsdp_param_group.alloc_storage = original_alloc
        _fsdp_param.free_storage = original_free


_COLLECTIVES = ("unshard", "wait_for_unshard", "post_backward")
"""The FSDPParamGroup methods that allocate FSDP2's all-gather and reduce-scatter buffers (torch 2.7-2.13)."""


@contextlib.contextmanager
def _collective_buffers_stay_fake(tracker, group_class) -> Iterator[None]:
    """While FSDP2 gathers and reduces, its buffers stay fake even where a small model makes them small enough for the
    tracker to run their factory for real: nothing reads their values, and a real buffer among fake shards would be
    converted back to a fake by every op that meets it (a quarter of a small model's FSDP trace). The bytes counted
    are the same."""
    originals = {name: group_class.__dict__[name] for name in _COLLECTIVES if name in group_class.__dict__}

    def fake_factories(method):
        @functools.wraps(method)
        def run(*args, **kwargs):
            before, tracker.realize_factories = tracker.realize_factories, False
            try:
                return method(*args, **kwargs)
            finally:
                tracker.realize_factories = before
        return run

    for name, method in originals.items():
        setattr(group_class, name, fake_factories(method))
    try:
        yield
    finally:
        for name, method in originals.items():
            setattr(group_class, name, method)
