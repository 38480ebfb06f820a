"""A fake copy of a module tree: its modules copied, its weights fake, everything else shared.

`copy.deepcopy` of a user's model copies what it holds besides weights (open files, locks, clients,
tokenizers, a dataset held in memory), and fails on what cannot be pickled. The copy made here is
structural instead:

- every module of the tree (`_modules`, recursively) gets a new object of its class, once, however
  many places reuse it; its parameters and buffers become fake tensors (tied ones stay tied);
- each module's attributes are the original's, with references to the tree's modules, parameters
  and buffers pointed at their copies (also inside lists, tuples, dicts, sets, bound methods and
  `functools.partial`), and with the builtin containers (list, dict, set) copied, so that a training
  step appending to `self.outputs` leaves the original's list as it was;
- every other object (files, locks, generators, lambdas, clients, the Trainer, plain tensors) is
  shared with the original, never copied, except a plain tensor on a device that is neither the CPU
  nor the trace's (class weights a hook moved to the GPU, while the trace runs on the CPU): the copy
  holds it on the trace's device (`move`), as a run there would;
- a torchmetrics Metric is a module of the tree: its state tensors become fakes on the trace device
  (they live there in training, so they are counted), and its update/compute wrappers are rebuilt
  around the copy. Its update runs on the fakes (a confusion matrix of num_classes**2 counts is real
  memory); where it needs values a fake tensor does not have (a `bincount`, a boolean mask) and
  nothing resolves them, that update is skipped and `forward` returns a zero: the metric takes no
  gradient memory and its value never feeds the loss;
- a LightningModule copy keeps the Trainer (configure_optimizers may read it) but its `log` and
  `log_dict` do nothing, so tracing never writes into the Trainer's results; its `device` is the
  trace's, where its weights are (the original's is cuda:0 on a GPU while the trace runs on the CPU).

The original is never changed: nothing is set on it, its containers are not touched, and hooks
added to the copy (checkpointing, gradient hooks) land in the copy's own hook dicts.
"""
from __future__ import annotations

import functools
import sys
import types
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn.utils.parametrize import is_parametrized

from memplan.compat.torch import (
    COMPILED_CALL_ATTRIBUTE,
    DataDependentOutputException,
    DynamicOutputShapeException,
    buffer_slots,
    child_slots,
    parameter_slots,
)
from memplan.compat.lightning import DEVICE_ATTRIBUTE
from memplan.compat.torchmetrics import metric_defaults
from memplan.estimator import known_values
from memplan.estimator.inputs import is_lightning_module

_DROPPED = frozenset({COMPILED_CALL_ATTRIBUTE})
"""Module attributes not carried over: `module.compile()`'s compiled call is bound to the original."""


def copy_module_tree(model: nn.Module, make_fake, *, device: torch.device, move) -> nn.Module:
    """The structural copy of `model` described above. `make_fake(tensor)` returns the fake that
    replaces a parameter's or buffer's data (call under the fake mode); metric states become fakes
    on `device` in their own dtype; `move(tensor)` puts a plain tensor held on another device on `device`."""
    return _TreeCopy(make_fake, device, move).copy(model)


def metric_states(model: nn.Module) -> Iterator[torch.Tensor]:
    """The state tensors of every torchmetrics Metric in `model`, and their defaults (plain attributes,
    not buffers)."""
    for module in model.modules():
        if _is_metric(module):
            for name, default in metric_defaults(module).items():
                for value in (getattr(module, name, None), default):
                    yield from (t for t in (value if isinstance(value, list) else [value]) if isinstance(t, torch.Tensor))


class _TreeCopy:
    def __init__(self, make_fake, device: torch.device, move) -> None:
        self.make_fake = make_fake
        self.device = device
        self.move = move
        self.memo: dict[int, object] = {}
        """id(original) -> its copy: modules, parameters, buffers and the containers copied."""
        self._alive: list[object] = []
        """Every object whose id is in memo, so no id is reused while the copy is made."""

    def copy(self, model: nn.Module) -> nn.Module:
        modules = self._skeleton(model)
        for original in modules:
            self._fill(original, self.memo[id(original)])
        return self.memo[id(model)]

    def _remember(self, original: object, copy: object) -> object:
        self.memo[id(original)] = copy
        self._alive.append(original)
        return copy

    def _skeleton(self, model: nn.Module) -> list[nn.Module]:
        """An empty object per module, a fake per parameter and buffer; the modules in tree order."""
        order: list[nn.Module] = []
        stack = [model]
        while stack:
            module = stack.pop()
            if id(module) in self.memo:
                continue
            order.append(module)
            self._remember(module, _new_empty(type(module)))
            for param in parameter_slots(module).values():
                if param is not None and id(param) not in self.memo:
                    fake = nn.Parameter(self.make_fake(param), requires_grad=param.requires_grad)
                    # attributes users set on parameters (read when forming param groups), not a
                    # fake tensor's own (a parameter built on fakes has them: they name its storage)
                    fake.__dict__.update((k, v) for k, v in param.__dict__.items() if k not in fake.__dict__)
                    self._remember(param, fake)
            for buffer in buffer_slots(module).values():
                if buffer is not None and id(buffer) not in self.memo:
                    self._remember(buffer, known_values.keep(buffer, self.make_fake(buffer)))
            stack.extend(m for m in reversed(child_slots(module).values()) if m is not None)
        return order

    def _fill(self, original: nn.Module, copy: nn.Module) -> None:
        # parametrize's classes (weight_norm in wav2vec2) refuse __getstate__; their __dict__ is the state
        custom_state = type(original).__setstate__ is not nn.Module.__setstate__ and not is_parametrized(original)
        state = original.__getstate__() if custom_state else original.__dict__
        copy.__setstate__({k: self._remap(v) for k, v in state.items() if k not in _DROPPED})
        if _is_metric(original):
            self._fake_metric_states(copy)
            copy.update, copy.forward = _tolerant(copy.update), _tolerant(copy.forward)
        if is_lightning_module(original):
            copy.log = copy.log_dict = _no_log  # never write into the (shared) Trainer's results
            if DEVICE_ATTRIBUTE in copy.__dict__:
                copy.__dict__[DEVICE_ATTRIBUTE] = self.device

    def _fake_metric_states(self, metric: nn.Module) -> None:
        """States and their defaults (torchmetrics keeps a copy of each state's initial value) as fakes."""
        fake = lambda t: torch.empty_like(t, device=self.device) if isinstance(t, torch.Tensor) else t  # noqa: E731
        defaults = metric_defaults(metric)  # the copy's own dict
        for name, default in defaults.items():
            defaults[name] = [fake(t) for t in default] if isinstance(default, list) else fake(default)
            value = getattr(metric, name, None)
            setattr(metric, name, [fake(t) for t in value] if isinstance(value, list) else fake(value))

    def _remap(self, value):
        """`value` with the tree's objects replaced by their copies and builtin containers copied."""
        found = self.memo.get(id(value))
        if found is not None:
            return found
        kind = type(value)
        if isinstance(value, torch.Tensor) and value.device.type not in ("cpu", self.device.type):
            return self._remember(value, self.move(value))
        if kind in (list, dict, set) or (isinstance(value, dict) and kind.__module__ == "collections"):
            return self._copy_container(value)
        if kind is tuple or (isinstance(value, tuple) and hasattr(value, "_fields")):
            items = [self._remap(v) for v in value]
            if all(a is b for a, b in zip(items, value)):
                return value
            return kind(items) if kind is tuple else kind(*items)
        if kind is types.MethodType and id(value.__self__) in self.memo:
            return types.MethodType(value.__func__, self.memo[id(value.__self__)])
        if kind is functools.partial:
            func, args, keywords = self._remap(value.func), self._remap(value.args), self._remap(value.keywords)
            if func is value.func and args is value.args and keywords is value.keywords:
                return value
            return functools.partial(func, *args, **keywords)
        return value

    def _copy_container(self, value):
        if isinstance(value, dict):
            new = value.copy()  # keeps the class (OrderedDict, defaultdict and its factory)
            self._remember(value, new)
            for key, item in value.items():
                new[key] = self._remap(item)
            return new
        new = type(value)()
        self._remember(value, new)
        if isinstance(new, list):
            new.extend(self._remap(item) for item in value)
        else:
            new.update(self._remap(item) for item in value)
        return new


def _new_empty(cls: type) -> nn.Module:
    """An uninitialised instance: a copy, not a build, so a class's own `__new__` (counting or
    registering instances) is not run, unless a C base type needs it."""
    try:
        return object.__new__(cls)
    except TypeError:
        return cls.__new__(cls)


def _no_log(*args, **kwargs) -> None:
    """LightningModule.log / log_dict on the traced copy."""


def _tolerant(method):
    """A metric's update/forward on the traced copy, skipped where it needs tensor values."""

    @functools.wraps(method)
    def call(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            return torch.zeros(())

    return call


def _is_metric(module: nn.Module) -> bool:
    torchmetrics = sys.modules.get("torchmetrics")  # a Metric exists only if torchmetrics was imported
    return torchmetrics is not None and isinstance(module, torchmetrics.Metric)
