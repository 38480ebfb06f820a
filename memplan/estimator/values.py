"""Ops whose output shapes depend on tensor values, resolved instead of refused.

A fake tensor has a shape and no values, so its kernels cannot answer `nonzero`, boolean-mask
indexing, `unique`, `masked_select`, CTC loss (whose saved alpha table is sized by the real target
lengths), `.item()` / `.tolist()`, or a Hungarian matcher that reads a cost matrix into numpy. The
values that decide such shapes come from one of two places, and each is resolved its own way:

1. **The batch** (masks, lengths, labels). The tracker already runs every op whose inputs are all
   real on the real batch, so tensors derived only from the batch keep their real values. When such
   a real tensor meets a fake activation in a value-dependent op, the shape follows from the real
   values alone, and it is computed exactly: a real boolean index becomes its real integer indices
   (`x[mask]` then stays fake and costs nothing), and any other op whose fake inputs are all
   floating point (data, not decisions: `ctc_loss(log_probs, targets, input_lengths, target_lengths)`)
   runs once on the real deciding values with its fake inputs stood in by zeros. No assumption, so no
   note, in every mode.
2. **The activations** (MoE routing, matching, finiteness checks). No values exist before training,
   so the estimate names an assumption, chosen by `estimate(data_dependent=...)` and stated in its
   notes:
   - "balanced" (default): the index outputs of selection ops (topk, argmax/argmin, max/min over a
     dim, sort) on an activation are made real and spread evenly: row r of a top-k over E choices
     takes choices (r*k + j) mod E, so each expert gets exactly tokens*k/E tokens (a capacity factor
     of 1.0, no imbalance). Routing code downstream (one_hot, nonzero, where, histc, bincount) then
     runs on real values, and the experts' shapes are exact for that routing. Which experts a token
     picks does not change the bytes saved for backward (their sum is tokens*k per layer); only the
     largest expert's transient does.
   - "sample": those selections run on random real values of the deciding tensor (normal, seeded by
     op and shape, so a checkpointed block recomputes the same routing; layers of one shape therefore
     draw the same routing), which gives the imbalance a randomly initialised model shows.
   - "error": refuse, with one EstimateError naming the op, the module and the fix.
   In both resolving modes, what remains value-dependent on an activation is answered as a random
   real sample (nonzero of a thresholded activation, `unique`), a boolean or number read back with
   `.item()` is taken as True / 1 (finiteness and range checks pass), and a fake tensor read into
   numpy (scipy's `linear_sum_assignment` in a Hungarian matcher) gets random values: the matching's
   shape depends on the matrix's shape, not its values.

Random draws that decide structure. A random op whose output the trace makes real (a small factory
such as LayerDrop's `torch.rand([])`, or a random op on real tensors) would draw from whatever RNG
state the caller has, so `if self.training and torch.rand([]) < self.layerdrop: continue` would drop a
different set of layers on every call. So every such draw is decided, never sampled: a draw of one
value takes its distribution's median (0.5 for `rand`/`uniform_`, the mean for `randn`/`normal_`,
the likelier outcome for `bernoulli`, the middle integer for `randint`), so a comparison with a
probability p < 0.5 takes its likelier outcome, `u < p` False and `u > 1 - p` False: no layer is
dropped (LayerDrop, stochastic depth that gates a block with one draw), the worst case for memory,
whatever the seed, and the notes say so. Larger draws (random masks and permutations) run from a
fixed seed per op and shape, and the caller's RNG state is left as it was in both cases.

Why not symbolic shapes: FakeTensorMode with a ShapeEnv (`allow_dynamic_output_shape_ops`) gives
`nonzero` an unbacked SymInt size, which carries no value. Byte counting needs a number, and the
number is exactly the routing or batch value in question, so the choice would only be deferred;
any branch on it (`if n > 0:`) would still fail. Real values where they exist, and one stated
assumption where they do not, is exact where it can be and explicit where it cannot.
"""
from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator
from typing import Any, Literal

import torch
from torch import nn
from memplan.compat.torch import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    disable_current_modes,
    is_traceable_wrapper_subclass,
    tree_flatten,
    tree_unflatten,
)

from memplan.estimator import known_values
from memplan.estimator.errors import EstimateError
from memplan.estimator.kernels.rules import rule_for

DataDependent = Literal["balanced", "sample", "error"]
DATA_DEPENDENT: tuple[str, ...] = ("balanced", "sample", "error")

MATERIALIZE_MAX_BYTES = 256 << 20
"""Largest total of fake inputs stood in by real values to run one value-dependent op (256 MiB)."""
SELECTION_MAX_NUMEL = 1 << 22
"""Selections with larger index outputs stay fake (no routing is that large; sorting a tensor can be)."""

aten = torch.ops.aten
_BOOL_INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
_SELECTIONS = {  # op -> position of the index output (None: the output is the index)
    aten.topk.default: 1, aten.argmax.default: None, aten.argmin.default: None,
    aten.max.dim: 1, aten.min.dim: 1, aten.sort.default: 1, aten.sort.stable: 1,
}


class ValueResolver:
    """Answers value-dependent ops for the tracker, under one `data_dependent` mode."""

    def __init__(self, mode: str, fake_mode) -> None:
        if mode not in DATA_DEPENDENT:
            raise EstimateError(f"data_dependent must be one of {', '.join(map(repr, DATA_DEPENDENT))}; got {mode!r}")
        self.mode = mode
        self.fake_mode = fake_mode
        self._assumed: dict[str, dict[str, None]] = {}
        """assumption text -> module paths it was used in (ordered sets)."""
        self._names: dict[int, str] = {}
        self._stack: list[str] = []
        self._carry = False

    # --- the trace's context -------------------------------------------------------------------
    @contextlib.contextmanager
    def watching(self, model: nn.Module) -> Iterator[None]:
        """Know the module path of each op, and answer numpy reads of fake tensors, while the trace runs."""
        self._names = {id(m): name or type(m).__name__ for name, m in model.named_modules()}
        self._carry = known_values.models_carry_values(model)  # buffers' values (known_values) to carry op by op
        hooks = nn.modules.module
        pre = hooks.register_module_forward_pre_hook(lambda m, _: self._stack.append(self._name(m)))
        post = hooks.register_module_forward_hook(lambda m, _i, _o: self._pop(), always_call=True)
        numpy = FakeTensor.__dict__.get("numpy")
        FakeTensor.numpy = lambda t, *, force=False: self._numpy(t)  # private: torch 2.13 refuses subclasses
        try:
            yield
        finally:
            pre.remove()
            post.remove()
            if numpy is None:
                del FakeTensor.numpy
            else:
                FakeTensor.numpy = numpy

    def _name(self, module: nn.Module) -> str:
        return self._names.get(id(module), type(module).__name__)

    def _pop(self) -> None:
        if self._stack:
            self._stack.pop()

    @property
    def module_path(self) -> str:
        return self._stack[-1] if self._stack else "the loss (outside any module)"

    @property
    def notes(self) -> list[str]:
        out = []
        for text, paths in self._assumed.items():
            where = list(paths)
            shown = ", ".join(where[:3]) + (f" and {len(where) - 3} more" if len(where) > 3 else "")
            out.append(f"{text} (in {shown}; data_dependent={self.mode!r})")
        return out

    def _assume(self, text: str) -> None:
        self._assumed.setdefault(text, {})[self.module_path] = None

    def _numpy(self, t: torch.Tensor):
        if self.mode == "error":
            raise EstimateError(
                argument="model", stage="step", detail=f"{self.module_path} reads an activation into numpy (e.g. "
                "scipy's linear_sum_assignment in a Hungarian matcher), which a trace without data cannot give",
                fix="Pass data_dependent='balanced' or 'sample' to estimate() to answer it with random values of the "
                "same shape"
            )
        self._assume("an activation read into numpy (e.g. a Hungarian matcher) got random values of its shape")
        with disable_current_modes():
            return self._stand_in(t, "sample", self._seed("numpy", [t])).numpy()

    # --- random draws --------------------------------------------------------------------------
    def draw(self, func, args, kwargs):
        """Run a random op (torch.Tag.nondeterministic_seeded) whose inputs are all real, decided instead
        of drawn (see the module doc): one value takes its distribution's median, more run from a seed
        fixed by op and shapes. Call with the fake and dispatch modes disabled."""
        kwargs = dict(kwargs)
        shapes = [tuple(t.shape) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        seed = zlib.crc32(f"{func}|{shapes}|{args if not shapes else ''}".encode())
        if kwargs.get("generator") is not None:  # the user's own generator is left as it was too
            kwargs["generator"] = torch.Generator(device=kwargs["generator"].device).manual_seed(seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            out = func(*args, **kwargs)
        median = _median(func, args, kwargs)
        if median is None or not isinstance(out, torch.Tensor) or out.numel() != 1:
            return out
        with torch.no_grad():
            out.fill_(median)
        self._assume("a random draw of one value (LayerDrop's `torch.rand([]) < p`, stochastic depth) took its "
                     "distribution's median, whatever the seed: a probability under 0.5 never fires, so no "
                     "layer is dropped (the worst case)")
        return out

    # --- dispatch ------------------------------------------------------------------------------
    def call(self, func, args, kwargs):
        """Run `func` on fake inputs as the tracker would, resolving what the fake kernel cannot answer."""
        rule = rule_for(func)
        try:
            out = rule.run(func, args, kwargs) if rule is not None else func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            if rule is not None:
                raise
            return self._resolve(func, *known_values.substitute(args, kwargs))
        if self._carry:
            known_values.propagate(func, args, kwargs, out, random=is_random(func))
        if rule is None and self.mode != "error" and func in _SELECTIONS:
            out = self._realize_selection(func, args, kwargs, out)
        return out

    def _resolve(self, func, args, kwargs):
        flat, spec = tree_flatten((args, kwargs))
        fakes = [t for t in flat if _holds_fakes(t)]
        reals = [t for t in flat if isinstance(t, torch.Tensor) and not _holds_fakes(t)]
        if func in _BOOL_INDEX_OPS and _has_real_bool_index(args):
            return func(args[0], _integer_indices(args[1]), *args[2:], **kwargs)
        if reals and all(t.is_floating_point() for t in fakes):
            return self._run_real(func, flat, spec, fill="zeros")  # the batch decides: exact
        if self.mode == "error":
            raise EstimateError(
                argument="model", stage="step", detail=f"{func} in {self.module_path} has an output whose shape "
                "depends on the values of an activation, which a trace without data does not have",
                fix="Pass data_dependent='balanced' (routing spread evenly, checks assumed to pass) or "
                "data_dependent='sample' (values sampled at random) to estimate(), or estimate a variant without "
                "that op"
            )
        if func is aten._local_scalar_dense.default:
            value = _assumed_scalar(args[0])
            self._assume(f"a value read with .item() from a tensor the trace has no values of (an activation, or "
                         f"a norm in the optimizer step) was taken as {value!r}")
            return value
        self._assume(f"{func} on an activation ran on random values of the same shape")
        return self._run_real(func, flat, spec, fill="sample")

    def _run_real(self, func, flat, spec, *, fill: str):
        fakes = [t for t in flat if isinstance(t, FakeTensor)]
        nbytes = sum(t.numel() * t.element_size() for t in fakes)
        if nbytes > MATERIALIZE_MAX_BYTES:
            raise EstimateError(
                argument="model", stage="step", detail=f"{func} in {self.module_path} needs real values to know its "
                f"output's shape, and its fake inputs ({nbytes >> 20} MiB) are too large to stand in by real ones",
                fix="Estimate with a smaller batch or sequence and scale, or estimate a variant without that op"
            )
        with disable_current_modes():
            seed = self._seed(func, fakes)
            real = [self._stand_in(t, fill, seed + i) if isinstance(t, FakeTensor) else t for i, t in enumerate(flat)]
            r_args, r_kwargs = tree_unflatten(real, spec)
            out = func(*r_args, **r_kwargs)
        # decisions (indices, masks, counts) stay real for the code that branches on them; data goes fake
        return _map_out(out, lambda t: t if not t.is_floating_point() else self.fake_mode.from_tensor(t))

    @staticmethod
    def _seed(func, tensors) -> int:
        """The same op on the same shapes draws the same sample, so a checkpointed block recomputes the
        routing its forward took (recomputation may run outside the module hooks that name the path)."""
        return zlib.crc32(f"{func}|{[tuple(t.shape) for t in tensors]}".encode())

    @staticmethod
    def _stand_in(t: torch.Tensor, fill: str, seed: int) -> torch.Tensor:
        if fill == "zeros":
            return torch.zeros(tuple(t.shape), dtype=t.dtype, device=t.device)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        if t.is_floating_point():
            return torch.randn(tuple(t.shape), generator=gen).to(t.dtype)
        if t.dtype == torch.bool:
            return torch.randint(0, 2, tuple(t.shape), generator=gen).bool()
        return torch.randint(0, 2, tuple(t.shape), generator=gen).to(t.dtype)

    # --- routing -------------------------------------------------------------------------------
    def _realize_selection(self, func, args, kwargs, out):
        source = args[0]
        position = _SELECTIONS[func]
        fake_index = out if position is None else out[position]
        if not isinstance(source, FakeTensor) or fake_index.numel() > SELECTION_MAX_NUMEL:
            return out
        if self.mode == "sample" and source.numel() * 4 <= MATERIALIZE_MAX_BYTES:
            with disable_current_modes():
                gen = torch.Generator(device="cpu").manual_seed(self._seed(func, [source]))
                sample = torch.randn(tuple(source.shape), generator=gen).to(source.dtype)
                real_out = func(sample, *args[1:], **kwargs)
            index = real_out if position is None else real_out[position]
            self._assume(f"{func} on an activation chose from random values (seeded)")
        else:
            index = _balanced_index(func, args, kwargs, source, fake_index)
            if index is None:
                return out
            self._assume(f"{func} on an activation chose evenly: every choice equally often (capacity factor 1.0)")
        return index if position is None else (*out[:position], index, *out[position + 1:])


def _balanced_index(func, args, kwargs, source: torch.Tensor, fake_index: torch.Tensor) -> torch.Tensor | None:
    """Indices of `fake_index`'s shape where each row's choices rotate through the dimension evenly."""
    shape = tuple(fake_index.shape)
    if func in (aten.argmax.default, aten.argmin.default) and _arg(args, kwargs, 1, "dim") is None:
        with disable_current_modes():
            return torch.zeros(shape, dtype=torch.long)
    dim = _arg(args, kwargs, 2 if func is aten.topk.default else 1, "dim", -1)
    if func is aten.sort.stable:
        dim = kwargs.get("dim", -1)
    if source.dim() == 0:
        with disable_current_modes():
            return torch.zeros(shape, dtype=torch.long)
    dim = dim % source.dim()
    choices = source.shape[dim]
    keepdim = len(shape) == source.dim()
    with disable_current_modes():
        if not keepdim:  # argmax / max.dim without keepdim: put the reduced dim back as size 1
            shape = shape[:dim] + (1,) + shape[dim:]
        picks = shape[dim]
        moved = shape[:dim] + shape[dim + 1:] + (picks,)
        rows = math.prod(moved[:-1])
        if picks > choices:
            return None
        if func in (aten.sort.default, aten.sort.stable):
            index = torch.arange(picks).expand(rows, picks)
        else:
            index = (torch.arange(rows)[:, None] * picks + torch.arange(picks)[None, :]) % choices
        index = index.reshape(moved).movedim(-1, dim).contiguous()
        if not keepdim:
            index = index.squeeze(dim)
        return index.to(device=fake_index.device)


def is_random(func) -> bool:
    """Whether an aten op draws from an RNG (rand, randn, uniform_, bernoulli, randint, randperm ...)."""
    return torch.Tag.nondeterministic_seeded in func.tags and func not in _NOT_RANDOM


_NOT_RANDOM = {aten.native_dropout.default}
"""Seeded ops whose draw only masks values (dropout: its mask has the input's shape, decided or not)."""


def _median(func, args, kwargs) -> float | None:
    """The median of the distribution a random op draws one value from; None for one with no median
    that decides anything (randperm, multinomial, random_): those keep their fixed-seed draw."""
    name = func.overloadpacket.__name__
    if name in ("rand", "rand_like"):
        return 0.5
    if name in ("randn", "randn_like"):
        return 0.0
    if name == "uniform_":
        return (_arg(args, kwargs, 1, "from", 0.0) + _arg(args, kwargs, 2, "to", 1.0)) / 2
    if name in ("normal_", "cauchy_"):
        return _arg(args, kwargs, 1, "mean" if name == "normal_" else "median", 0.0)
    if name == "log_normal_":
        return math.exp(_arg(args, kwargs, 1, "mean", 1.0))
    if name == "exponential_":
        return math.log(2) / _arg(args, kwargs, 1, "lambd", 1.0)
    if name in ("bernoulli", "bernoulli_"):
        if func is aten.bernoulli.default:  # bernoulli(p): the input holds the probability
            p = args[0]
        else:  # bernoulli(self, p), bernoulli_(self, p=0.5): p a float or a tensor
            p = _arg(args, kwargs, 1, "p", 0.5)
        if isinstance(p, torch.Tensor):
            if p.numel() != 1:
                return None
            p = float(p)
        return 1.0 if p >= 0.5 else 0.0
    if name in ("randint", "randint_like"):
        bounds = [a for a in args[1 if name == "randint_like" else 0:] if not isinstance(a, (list, tuple))][:2]
        low, high = (0, bounds[0]) if len(bounds) == 1 else bounds
        return float((int(low) + int(high) - 1) // 2)
    return None


def _arg(args, kwargs, position: int, name: str, default=None):
    if name in kwargs:
        return kwargs[name]
    return args[position] if len(args) > position else default


def _has_real_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    masks = [i for i in indices if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)]
    return bool(masks) and not any(isinstance(m, FakeTensor) for m in masks)


def _integer_indices(indices):
    """Boolean masks replaced by the integer indices they select (aten's own expansion), from real values."""
    out = []
    with disable_current_modes():
        for index in indices:
            if isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8):
                out.extend(index.nonzero().unbind(1))
            else:
                out.append(index)
    return out


def _holds_fakes(t: Any) -> bool:
    """A fake tensor, or a tensor subclass wrapping fakes (FSDP2's DTensor parameters: an optimizer's
    `param.norm().item()` reaches here as a DTensor), whose values the trace does not have."""
    if isinstance(t, FakeTensor):
        return True
    if not is_traceable_wrapper_subclass(t):
        return False
    inner, _ = t.__tensor_flatten__()
    return any(_holds_fakes(getattr(t, name)) for name in inner)


def _assumed_scalar(t: torch.Tensor):
    if t.dtype == torch.bool:
        return True
    return 1.0 if t.is_floating_point() else 1


def _map_out(out, fn):
    flat, spec = tree_flatten(out)
    return tree_unflatten([fn(t) if isinstance(t, torch.Tensor) else t for t in flat], spec)
