"""How training_step's loss reduces over the batch, read off a planning trace: what makes a split exact.

A batch split into chunks trains as the whole batch only when each chunk's loss is weighted by its share
of what the loss averages over: samples for a per-sample mean, the labels that count for a token mean
(a language model's loss averages over the labels that are not -100, a number that differs from chunk to
chunk), nothing for a sum. memplan does not guess it. It watches the first planning trace at the level of
torch functions (a TorchFunctionMode around the estimator's fake step; no extra step is run) and follows
each tensor of the batch through the ops that only select or reshape it (indexing along other dimensions,
`F.pad`, `view`, `contiguous`, `to`, ...). The loss recognised is the tensor the step backwards, when it
is (up to a constant factor) one call of:
  - `cross_entropy` / `nll_loss` with `reduction="mean"` on integer targets taken from the batch: a mean
    over the targets that are not `ignore_index` (weighted by `weight=` when that comes from the batch).
    This is what transformers models compute when called with `labels` (the causal shift included:
    `pad(labels, (0, 1), value=-100)[..., 1:]`), and what `cross_entropy(..., ignore_index=...)` does.
    Each chunk is weighted by the same count, taken on its own samples (`TargetCount`);
  - `mse_loss`, `l1_loss`, `smooth_l1_loss`, `huber_loss`, `binary_cross_entropy(_with_logits)` or a
    float-target `cross_entropy` with `reduction="mean"`, whose target is a per-sample tensor of the
    batch: a mean over samples (each sample holds as many elements);
  - any of these with `reduction="sum"`: a sum.
Anything else (a loss built from several terms, a `.mean()` written out, targets not from the batch as
in a contrastive loss over `arange`, class weights held by the model) is `unknown`: MemoryPlanner then
neither splits nor rewrites the batch unless told how (MemoryPlanner(loss_reduction=, mean_over=)).
"""
from __future__ import annotations

import dataclasses
import inspect
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from memplan.compat.torch import tree_flatten

Kind = Literal["mean_samples", "mean_count", "sum", "unknown"]
Path = tuple[tuple[str, Any], ...]
"""Where a value sits in the batch: ("key", k) for a mapping, ("index", i) for a list or tuple,
("attr", name) for a namedtuple or dataclass field."""


@dataclass(frozen=True, kw_only=True)
class TargetCount:
    """What a token-mean loss averages over, for any part of the batch: the targets (the batch's tensor at
    `path`, put through `ops`) that are not `ignore_index`, each counted by its class weight where the
    weights come from the batch (`weight_path`). Picklable (ddp_spawn)."""

    path: Path
    ops: tuple[tuple, ...]
    """("getitem", index) and ("pad", pad, mode, value) steps, replayed on the chunk's tensor."""
    ignore_index: int
    weight_path: Path | None = None

    def __call__(self, batch: Any) -> torch.Tensor:
        target = _get(batch, self.path)
        for op in self.ops:
            target = target[op[1]] if op[0] == "getitem" else F.pad(target, op[1], mode=op[2], value=op[3])
        kept = target[target != self.ignore_index]
        if self.weight_path is None:
            return torch.tensor(kept.numel(), dtype=torch.float64)
        return _get(batch, self.weight_path)[kept].sum()

    def describe(self) -> str:
        where = _path_text(self.path) + "".join(_op_text(op) for op in self.ops)
        weighted = f", weighted by {_path_text(self.weight_path)}" if self.weight_path is not None else ""
        return f"a mean over the targets {where} that are not {self.ignore_index}{weighted}"


@dataclass(frozen=True, kw_only=True)
class LossReduction:
    """How the loss reduces over the batch, as recognised (or declared by the user)."""

    kind: Kind
    """'mean_samples', 'mean_count' (`count` says over what), 'sum', or 'unknown'."""
    describe: str
    """In words, for messages: the call recognised, or why none was."""
    count: TargetCount | None = None
    """For 'mean_count': what the mean is over, for any part of the batch."""

    @property
    def known(self) -> bool:
        return self.kind != "unknown"


UNWATCHED = LossReduction(kind="unknown", describe="no training step was traced to tell how its loss reduces")

_COUNTED = {F.cross_entropy, F.nll_loss}
_ELEMENTWISE = {F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.binary_cross_entropy,
                F.binary_cross_entropy_with_logits}
_KEEP = {torch.Tensor.to, torch.Tensor.contiguous, torch.Tensor.long, torch.Tensor.int, torch.Tensor.clone,
         torch.Tensor.detach, torch.Tensor.float, torch.Tensor.double, torch.Tensor.half, torch.Tensor.bfloat16}
"""Ops that keep every element where it is (a copy, another dtype or device)."""
_RESHAPE = {torch.Tensor.view, torch.Tensor.reshape, torch.Tensor.flatten, torch.reshape, torch.flatten,
            torch.Tensor.view_as, torch.Tensor.reshape_as}
"""Ops that keep every sample's elements (samples stay sample-major); after one, indexing is not replayed."""
_SCALE = {torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.mul, torch.Tensor.div,
          torch.Tensor.__truediv__, torch.div, torch.Tensor.float, torch.Tensor.to, torch.Tensor.clone}
"""Ops that keep a recognised loss what it is when their other operand is a constant."""


@dataclass(frozen=True)
class _Origin:
    ref: weakref.ref
    path: Path
    ops: tuple[tuple, ...]
    reshaped: bool
    per_sample: bool


class LossWatcher(TorchFunctionMode):
    """Recognises the loss of the first training step traced under it (module docstring). Holds no
    strong reference to a traced tensor (the estimator's tracker follows their lifetimes)."""

    def __init__(self) -> None:
        super().__init__()
        self._origins: dict[int, _Origin] = {}
        self._tainted: dict[int, weakref.ref] = {}
        self._losses: dict[int, tuple[weakref.ref, LossReduction]] = {}
        self._seen: list[str] = []
        self._watching = False
        self._batch_size = 0
        self.result: LossReduction | None = None

    def watch(self, batch: Any, batch_size: int) -> None:
        """The batch of `batch_size` samples the step will receive (its tensors, as they are: the
        estimator traces a real batch), once; later calls are ignored."""
        if self._watching:
            return
        self._watching = True
        self._batch_size = batch_size
        for path, tensor in _tensor_paths(batch, ()):
            self._origins[id(tensor)] = _Origin(weakref.ref(tensor), path, (), False,
                                                tensor.dim() > 0 and tensor.shape[0] == batch_size)
            self._tainted[id(tensor)] = weakref.ref(tensor)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.result is None and self._watching:
            try:
                self._observe(func, args, kwargs, out)
            except Exception as err:  # noqa: BLE001 - watching never breaks the trace; it only says unknown
                self.result = LossReduction(kind="unknown", describe=f"memplan could not follow the step ({err})")
        return out

    def reduction(self) -> LossReduction:
        return self.result or UNWATCHED

    # --- following tensors -------------------------------------------------------------------
    def _lookup(self, table: dict, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return None
        entry = table.get(id(value))
        if entry is None:
            return None
        ref = entry.ref if isinstance(entry, _Origin) else entry[0] if isinstance(entry, tuple) else entry
        return entry if ref() is value else None

    def _observe(self, func, args, kwargs, out) -> None:
        if func is torch.Tensor.backward:
            found = self._lookup(self._losses, args[0])
            if found is not None:
                self.result = found[1]
            else:
                calls = f" (it saw {', '.join(self._seen)}, not as the loss itself)" if self._seen else ""
                self.result = LossReduction(
                    kind="unknown", describe="the loss is not one call of a loss function memplan recognises "
                                             f"(cross_entropy, nll_loss, mse_loss, ...) on targets from the batch{calls}")
            return
        flat, _ = tree_flatten((args, kwargs))
        if func in _COUNTED or func in _ELEMENTWISE:
            self._recognise(func, args, kwargs, out)
        elif func in _SCALE and self._scales_a_loss(flat, out):
            pass
        origin = self._lookup(self._origins, args[0]) if args else None
        if origin is not None and isinstance(out, torch.Tensor):
            self._follow(func, origin, args, kwargs, out)
        if any(self._lookup(self._tainted, v) is not None for v in flat):
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._tainted[id(t)] = weakref.ref(t)

    def _follow(self, func, origin: _Origin, args, kwargs, out: torch.Tensor) -> None:
        op = None
        if func in _KEEP:
            pass
        elif func in _RESHAPE:
            origin = dataclasses.replace(origin, reshaped=True)
        elif func is torch.Tensor.__getitem__ and not origin.reshaped and _keeps_batch_dim(args[0], args[1]):
            op = ("getitem", args[1])
        elif func is F.pad and not origin.reshaped:
            bound = _bind(func, args, kwargs)
            pad = tuple(bound["pad"])
            if len(pad) // 2 >= args[0].dim():
                return
            op = ("pad", pad, bound["mode"], bound["value"])
        else:
            return
        self._origins[id(out)] = _Origin(weakref.ref(out), origin.path, origin.ops + ((op,) if op else ()),
                                         origin.reshaped, origin.per_sample)

    def _scales_a_loss(self, flat: list, out: Any) -> bool:
        tensors = [v for v in flat if isinstance(v, torch.Tensor)]
        loss = next((found for v in tensors if (found := self._lookup(self._losses, v)) is not None), None)
        if loss is None or not isinstance(out, torch.Tensor):
            return False
        others = [v for v in tensors if self._lookup(self._losses, v) is None]
        if any(v.dim() > 0 or self._lookup(self._tainted, v) is not None for v in others):
            return False  # divided by something from the batch (a count of its own): not one we know
        counts = [v for v in flat if isinstance(v, (int, float)) and not isinstance(v, bool) and self._batch_size
                  and float(v).is_integer() and v and int(v) % self._batch_size == 0]
        if counts:  # `loss / x.shape[0]`: a number that changes with the chunk's size, which a constant cannot tell
            self.result = LossReduction(
                kind="unknown", describe=f"the loss is scaled by {counts[0]:g}, a multiple of the {self._batch_size} "
                "samples traced: a count of the batch (a mean written out as `/ x.shape[0]`) or a constant, which "
                "memplan cannot tell apart")
            return False
        self._losses[id(out)] = (weakref.ref(out), loss[1])
        return True

    # --- recognising the loss ----------------------------------------------------------------
    def _recognise(self, func, args, kwargs, out) -> None:
        bound = _bind(func, args, kwargs)
        name = func.__name__
        self._seen.append(name)
        if bound.get("size_average") is not None or bound.get("reduce") is not None or not isinstance(out, torch.Tensor):
            return
        reduction = bound.get("reduction", "mean")
        target = bound.get("target")
        origin = self._lookup(self._origins, target)
        if reduction == "sum":
            found = LossReduction(kind="sum", describe=f"{name}(reduction='sum'): a sum over the batch")
        elif reduction != "mean" or origin is None:
            return
        elif func in _COUNTED and not target.is_floating_point():
            weight = bound.get("weight")
            weight_origin = self._lookup(self._origins, weight) if weight is not None else None
            if weight is not None and (weight_origin is None or weight_origin.ops or weight_origin.reshaped
                                       or weight_origin.per_sample):
                return  # class weights the model holds: their values are not the batch's to replay
            count = TargetCount(path=origin.path, ops=origin.ops, ignore_index=int(bound.get("ignore_index", -100)),
                                weight_path=None if weight is None else weight_origin.path)
            found = LossReduction(kind="mean_count", describe=f"{name}: {count.describe()}", count=count)
        elif origin.per_sample:
            found = LossReduction(kind="mean_samples",
                                  describe=f"{name} on {_path_text(origin.path)}: a mean over samples")
        else:
            return
        self._losses[id(out)] = (weakref.ref(out), found)


def first_call_watched(estimator: Any, watcher: LossWatcher) -> Any:
    """`estimator` whose first call runs under `watcher` (the batch it traces registered with
    `watcher.watch`, by the resize hook that makes it)."""
    state = {"done": False}

    def estimate_at(**kwargs: Any) -> Any:
        if state["done"]:
            return estimator(**kwargs)
        state["done"] = True
        with watcher:
            return estimator(**kwargs)

    return estimate_at


# --- helpers ---------------------------------------------------------------------------------
_SIGNATURES: dict[Any, inspect.Signature] = {}


def _bind(func, args, kwargs) -> dict[str, Any]:
    signature = _SIGNATURES.get(func)
    if signature is None:
        signature = _SIGNATURES[func] = inspect.signature(func)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _keeps_batch_dim(tensor: torch.Tensor, index: Any) -> bool:
    """Whether `tensor[index]` leaves dimension 0 (the batch) whole: a full slice there, or a leading
    Ellipsis that stands for it."""
    index = index if isinstance(index, tuple) else (index,)
    if not index:
        return True
    if any(isinstance(i, (torch.Tensor, list, bool)) for i in index):
        return False  # advanced indexing: not replayed
    first = index[0]
    if first is Ellipsis:  # it stands for dimension 0 when the rest do not reach it
        return tensor.dim() > sum(1 for i in index[1:] if i is not None)
    return isinstance(first, slice) and first == slice(None)  # (a leading None would put a new dimension first)


def _tensor_paths(obj: Any, path: Path):
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _tensor_paths(v, (*path, ("key", k)))
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):
        for name, v in zip(obj._fields, obj):
            yield from _tensor_paths(v, (*path, ("attr", name)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensor_paths(v, (*path, ("index", i)))
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from _tensor_paths(getattr(obj, field.name), (*path, ("attr", field.name)))


def _get(batch: Any, path: Path) -> Any:
    for how, key in path:
        batch = batch[key] if how in ("key", "index") else getattr(batch, key)
    return batch


def _path_text(path: Path) -> str:
    return "batch" + "".join(f"[{key!r}]" if how == "key" else f"[{key}]" if how == "index" else f".{key}"
                             for how, key in path)


def _op_text(op: tuple) -> str:
    if op[0] == "pad":
        return f" padded by {op[1]} with {op[3]}"
    index = op[1] if isinstance(op[1], tuple) else (op[1],)
    shown = ", ".join("..." if i is Ellipsis else f"{'' if i.start is None else i.start}:"
                      f"{'' if i.stop is None else i.stop}" if isinstance(i, slice) else repr(i) for i in index)
    return f"[{shown}]"
