"""Which autograd node runs, as the tracker tells gradient accumulations apart (accumulation.RunningNode).

torch 2.11 hands out a new Python wrapper for a C++ autograd node once the last one died, at a new address; torch
2.13's trace happened to see the same address. Identity by id() recognised no accumulation on torch 2.11: a ResNet's
residual gradients were counted out of place and the caching allocator model reserved 38 MiB less than the H200
(and torch 2.13's trace). The tests emulate torch 2.11's wrappers on the installed torch."""
from __future__ import annotations

import weakref

import torch
from torch import nn

import memplan.estimator.accumulation as accumulation
from memplan.estimator.accumulation import RunningNode
from memplan.estimator.api import estimate


class _Wrapper:
    __slots__ = ("node", "__weakref__")


def _torch_2_11_wrappers(monkeypatch) -> None:
    """current_autograd_node as torch 2.11 answers it: a node's wrapper is cached only while the wrapper lives, and
    the next one sits elsewhere (a filler takes the dead wrapper's address, as other objects do in a real trace)."""
    real = accumulation.current_autograd_node
    cache: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
    nodes, fillers = [], []

    def current():
        node = real()
        if node is None:
            return None
        nodes.append(node)  # keeps torch's own wrapper, so id(node) names one node for the whole test
        wrapper = cache.get(id(node))
        if wrapper is None:
            fillers.append(_Wrapper())
            wrapper = _Wrapper()
            wrapper.node = node
            cache[id(node)] = wrapper
        return wrapper

    monkeypatch.setattr(accumulation, "current_autograd_node", current)


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.blocks = nn.ModuleList(nn.Conv2d(16, 16, 3, padding=1) for _ in range(3))
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = x + torch.relu(block(x))  # x's gradient: the sum of two, accumulated by the engine
        return self.head(x.mean((2, 3)))


def _estimate():
    torch.manual_seed(0)
    return estimate(_Residual(), (torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))),
                    loss=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]), optimizer="sgd", device="H100-80GB")


def _accumulations_recognised(monkeypatch) -> int:
    """How many of the engine's gradient sums the tracker takes for accumulations in one estimate."""
    import memplan.estimator.tracker as tracker

    found = []
    real = tracker.accumulation_inputs
    monkeypatch.setattr(tracker, "accumulation_inputs", lambda *a: found.append(bool(real(*a))) or real(*a))
    _estimate()
    monkeypatch.setattr(tracker, "accumulation_inputs", real)
    return sum(found)


def test_the_engines_gradient_sums_are_recognised_however_torch_wraps_autograd_nodes(monkeypatch):
    stable = _accumulations_recognised(monkeypatch)
    assert stable == 6  # x's gradient in each of the 3 residual blocks, in each of the 2 steps traced
    _torch_2_11_wrappers(monkeypatch)
    assert _accumulations_recognised(monkeypatch) == stable  # id() of the wrappers found none


def test_one_node_keeps_its_number_while_it_runs_and_none_is_held_outside_a_node(monkeypatch):
    a, b = object(), object()
    answers = iter([None, a, a, b, None, b])
    monkeypatch.setattr(accumulation, "current_autograd_node", lambda: next(answers))
    running = RunningNode()
    numbers = [running.current() for _ in range(6)]
    assert numbers[0] is None and numbers[4] is None
    assert numbers[1] == numbers[2] != numbers[3]
    assert numbers[5] != numbers[3]  # released outside a node: the wrapper is not kept, a later run is new


def test_what_a_custom_functions_ctx_holds_is_not_kept_past_its_backward():
    """The tracker holds the running node's wrapper; a node whose ctx holds a tensor must not outlive the backward
    in the trace because of it (the wrapper is dropped once no node runs)."""
    freed = []

    class Holds(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.big = torch.empty(1 << 16)
            weakref.finalize(ctx.big, freed.append, "ctx.big")
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    running = RunningNode()
    x = torch.randn(4, requires_grad=True)
    y = Holds.apply(x)
    y.register_hook(lambda g: running.current() and None)  # inside y's node: hold its wrapper
    y.sum().backward()
    del y
    running.current()  # no node runs now
    assert freed == ["ctx.big"]
