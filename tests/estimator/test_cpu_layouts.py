"""Output layouts the real CPU kernel chooses and the meta kernel does not: each rule against the real kernel.

CPU batch norm makes its output (and the backward its grad_input) in the input's suggested memory format:
a transposed (N, L, C) activation comes out contiguous, where the meta kernel keeps the input's strides.
A later transpose + Linear then reshapes by a copy in the real run (saved for backward), by a view on fakes.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import memplan.estimator.tracker as tracker
from memplan.estimator.kernels import input_copies
from memplan.estimator.api import estimate
from memplan.estimator.kernels.rules import CPU_LAYOUT_OPS, cpu_output_layout
from memplan.truth import measure_cpu_peak

aten = torch.ops.aten
C = 32

LAYOUTS = {
    "2d transposed": lambda: torch.randn(C, 8).t(),
    "3d transposed (N, L, C) -> (N, C, L)": lambda: torch.randn(8, 16, C).transpose(1, 2),
    "4d contiguous": lambda: torch.randn(4, C, 6, 5),
    "4d channels_last": lambda: torch.randn(4, C, 6, 5).contiguous(memory_format=torch.channels_last),
    "4d H and W swapped": lambda: torch.randn(4, C, 5, 6).transpose(2, 3),
    "5d channels_last_3d": lambda: torch.randn(2, C, 3, 4, 5).contiguous(memory_format=torch.channels_last_3d),
}


def _stats():
    return [torch.ones(C), torch.zeros(C), torch.zeros(C), torch.ones(C)]


OPS = {
    aten.native_batch_norm.default: lambda x, w, b, rm, rv: (x, w, b, rm, rv, True, 0.1, 1e-5),
    aten._native_batch_norm_legit.default: lambda x, w, b, rm, rv: (x, w, b, rm, rv, True, 0.1, 1e-5),
    aten._native_batch_norm_legit.no_stats: lambda x, w, b, rm, rv: (x, w, b, True, 0.1, 1e-5),
    aten._native_batch_norm_legit_no_training.default: lambda x, w, b, rm, rv: (x, w, b, rm, rv, 0.1, 1e-5),
    aten._native_batch_norm_legit_functional.default: lambda x, w, b, rm, rv: (x, w, b, rm, rv, True, 0.1, 1e-5),
    # grad_output contiguous, input in the layout under test: the CPU grad_input follows the input
    aten.native_batch_norm_backward.default: lambda x, w, b, rm, rv: (
        x.contiguous(), x, w, rm, rv, rm.clone(), rv.clone(), True, 1e-5, [True, True, True]),
}


def test_every_layout_rule_has_its_cases():
    assert CPU_LAYOUT_OPS == set(OPS) | {aten.log_sigmoid_forward.default, aten.log_sigmoid_backward.default,
                                         aten.native_layer_norm.default, aten.native_group_norm.default,
                                         aten.native_group_norm_backward.default}  # (group norm: test_group_norm.py)


@pytest.mark.parametrize("input_dtype, param_dtype, params", [
    (torch.bfloat16, torch.float32, "weight and bias"),  # CPU autocast: a bf16 activation, float32 weights
    (torch.float16, torch.float32, "weight"),
    (torch.bfloat16, torch.bfloat16, "weight and bias"),
    (torch.bfloat16, None, "none"),
    (torch.float32, torch.float32, "weight and bias"),
])
def test_layer_norm_statistics_dtype_is_the_real_cpu_kernels(input_dtype, param_dtype, params):
    """CPU layer_norm keeps mean and rstd in float32 for a half input with float32 weights (mixed type); the meta
    kernel gives them the input's dtype."""
    def args(make):
        weight = make(torch.ones(64, dtype=param_dtype)) if params != "none" else None
        bias = make(torch.zeros(64, dtype=param_dtype)) if params == "weight and bias" else None
        return make(torch.randn(8, 64).to(input_dtype)), [64], weight, bias, 1e-5

    real = aten.native_layer_norm(*args(lambda t: t))
    mode = FakeTensorMode()
    with mode:
        fake_args = args(mode.from_tensor)
        ruled = cpu_output_layout(aten.native_layer_norm.default, fake_args, aten.native_layer_norm(*fake_args))
    assert [t.dtype for t in ruled] == [t.dtype for t in real]
    assert [t.shape for t in ruled] == [t.shape for t in real]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("op", list(OPS), ids=str)
def test_batch_norm_output_layout_is_the_real_cpu_kernels(op, layout):
    real = op(*OPS[op](LAYOUTS[layout](), *_stats()))[0]
    mode = FakeTensorMode()
    with mode:
        args = OPS[op](mode.from_tensor(LAYOUTS[layout]()), *(mode.from_tensor(t) for t in _stats()))
        meta = op(*args)
        ruled = cpu_output_layout(op, args, meta)[0]
    assert (ruled.shape, ruled.stride(), ruled.dtype) == (real.shape, real.stride(), real.dtype)


class TransposedBatchNorm(nn.Module):
    """Sequence blocks normalising over channels with BatchNorm1d on (N, C, L), then a Linear on (N, L, C)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict(dict(bn=nn.BatchNorm1d(128), fc=nn.Linear(128, 128))) for _ in range(3))
        self.head = nn.Linear(128, 10)

    def forward(self, x):
        for b in self.blocks:
            x = b["fc"](F.gelu(b["bn"](x.transpose(1, 2))).transpose(1, 2))
        return self.head(x.mean(1))


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(16, 64, 128, generator=g), torch.randint(0, 10, (16,), generator=g)


def _ce(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


def test_a_transposed_batch_norm_before_a_linear_matches_a_real_run(monkeypatch):
    truth = measure_cpu_peak(TransposedBatchNorm, _batch, loss=_ce)
    est = estimate(TransposedBatchNorm, _batch(), loss=_ce, device="cpu")
    assert abs(est.peak_allocated - truth) / truth < 0.001, (est.peak_allocated, truth)
    monkeypatch.setattr(tracker, "CPU_LAYOUT_OPS", frozenset())  # the meta kernel's strides: the copy is missed
    meta = estimate(TransposedBatchNorm, _batch(), loss=_ce, device="cpu")
    assert (meta.peak_allocated - truth) / truth < -0.05


def _log_sigmoid_cases():
    """(op, args builder) for log_sigmoid's forward and backward, grad_output contiguous or like the input."""
    def backward(grad_like_input):
        def build(x):
            out, buffer = aten.log_sigmoid_forward(x)
            grad = torch.ones_like(x) if grad_like_input else torch.ones(x.shape)
            return grad, x, buffer
        return build
    return {
        "forward": (aten.log_sigmoid_forward.default, lambda x: (x,)),
        "backward, grad_output contiguous": (aten.log_sigmoid_backward.default, backward(False)),
        "backward, grad_output like the input": (aten.log_sigmoid_backward.default, backward(True)),
    }


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", list(_log_sigmoid_cases()))
def test_log_sigmoid_output_layout_is_the_real_cpu_kernels(case, layout):
    op, build = _log_sigmoid_cases()[case]
    torch.manual_seed(0)
    real = op(*build(LAYOUTS[layout]()))
    mode = FakeTensorMode()
    torch.manual_seed(0)
    x = LAYOUTS[layout]()
    real_args = build(x)  # built for real (the backward's buffer from a real forward), then faked
    with mode:
        args = tuple(mode.from_tensor(a) for a in real_args)
        ruled = cpu_output_layout(op, args, op(*args))
    for r, f in zip(real if isinstance(real, tuple) else (real,), ruled if isinstance(ruled, tuple) else (ruled,)):
        assert (f.shape, f.stride(), f.dtype) == (r.shape, r.stride(), r.dtype)


class TransposedLogSigmoid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(256, 256)

    def forward(self, x):
        return F.logsigmoid(self.fc(x).t()).mean()


def _features():
    return (torch.randn(512, 256, generator=torch.Generator().manual_seed(0)),)


def test_log_sigmoid_of_a_transposed_activation_matches_a_real_run(monkeypatch):
    from memplan.estimator.kernels import probe as kernel_probe

    loss = lambda m, b: m(b[0])  # noqa: E731
    truth = measure_cpu_peak(TransposedLogSigmoid, _features, loss=loss)
    est = estimate(TransposedLogSigmoid, _features(), loss=loss, device="cpu")
    assert abs(est.peak_allocated - truth) / truth < 0.001, (est.peak_allocated, truth)
    # without the rule and the probe: the kernel's contiguous copy of its input is missed
    monkeypatch.setattr(tracker, "CPU_LAYOUT_OPS", frozenset())
    monkeypatch.setattr(input_copies, "LAYOUT_OPS", input_copies.LAYOUT_OPS - set(_LOG_SIGMOID_OPS))
    kernel_probe._CACHE.clear()
    missed = estimate(TransposedLogSigmoid, _features(), loss=loss, device="cpu")
    assert (missed.peak_allocated - truth) / truth < -0.05


_LOG_SIGMOID_OPS = (aten.log_sigmoid_forward.default, aten.log_sigmoid_backward.default)


AGREEING = {  # ops with no layout rule: their meta kernels already lay non-contiguous inputs out as CPU does
    "gelu": lambda x: aten.gelu(x), "gelu_backward": lambda x: aten.gelu_backward(torch.ones(x.shape), x),
    "silu": lambda x: aten.silu(x), "silu_backward": lambda x: aten.silu_backward(torch.ones(x.shape), x),
    "sigmoid": lambda x: aten.sigmoid(x), "tanh": lambda x: aten.tanh(x), "relu": lambda x: aten.relu(x),
    "threshold_backward": lambda x: aten.threshold_backward(torch.ones(x.shape), x, 0.0),
    "softmax": lambda x: aten._softmax(x, -1, False), "log_softmax": lambda x: aten._log_softmax(x, -1, False),
    "softplus": lambda x: aten.softplus(x, 1, 20), "elu": lambda x: aten.elu(x), "mish": lambda x: aten.mish(x),
    "native_dropout": lambda x: aten.native_dropout(x, 0.1, True), "clone": lambda x: aten.clone(x),
    "add": lambda x: aten.add(x, torch.ones(x.shape)), "mul": lambda x: aten.mul(x, 2.0), "exp": lambda x: aten.exp(x),
    "where": lambda x: aten.where(x > 0, x, torch.zeros(x.shape)),
    "layer_norm": lambda x: aten.native_layer_norm(x, [x.shape[-1]], None, None, 1e-5),
    "glu": lambda x: aten.glu(x, 1), "cumsum": lambda x: aten.cumsum(x, -1),
    "logsumexp": lambda x: aten.logsumexp(x, [-1], True), "hardtanh": lambda x: aten.hardtanh(x),
}


@pytest.mark.parametrize("layout", ["2d transposed", "3d transposed (N, L, C) -> (N, C, L)", "4d channels_last",
                                    "4d H and W swapped"])
def test_ops_without_a_rule_lay_out_their_outputs_as_the_real_cpu_kernel(layout):
    differ = []
    for name, op in AGREEING.items():
        torch.manual_seed(0)
        real = op(LAYOUTS[layout]())
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        torch.manual_seed(0)
        x = LAYOUTS[layout]()
        with mode:
            fake = op(mode.from_tensor(x))
        strides = lambda out: [t.stride() for t in (out if isinstance(out, tuple) else (out,))]  # noqa: E731
        if strides(real) != strides(fake):
            differ.append(name)
    assert differ == [], "these ops need a rule in kernel_rules.cpu_output_layout"
