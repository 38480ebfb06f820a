"""Each kernel rule checked against the installed torch: the real op, the fake op, the fake op with the rule."""
from __future__ import annotations

import logging

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan.estimator.kernels.rules import RULES


def _grouped_mm_cases():
    """(name, builder) pairs; builder(dtype) -> (args, kwargs) of real tensors."""
    offs = lambda g, n: torch.arange(1, g + 1, dtype=torch.int32) * (n // g)  # noqa: E731
    return {
        "2d x 3d, offs": lambda dt: ((torch.randn(16, 8, dtype=dt), torch.randn(4, 8, 16, dtype=dt)), {"offs": offs(4, 16)}),
        "2d x 3d transposed weight": lambda dt: (
            (torch.randn(16, 8, dtype=dt), torch.randn(4, 16, 8, dtype=dt).transpose(-2, -1)), {"offs": offs(4, 16)}),
        "3d x 3d": lambda dt: ((torch.randn(4, 16, 8, dtype=dt), torch.randn(4, 8, 16, dtype=dt)), {}),
        "2d x 2d, offs": lambda dt: ((torch.randn(16, 32, dtype=dt), torch.randn(32, 8, dtype=dt)), {"offs": offs(4, 32)}),
        "3d x 2d, offs": lambda dt: ((torch.randn(4, 16, 32, dtype=dt), torch.randn(32, 8, dtype=dt)), {"offs": offs(4, 32)}),
        "stride of 4 elements": lambda dt: ((torch.randn(16, 4, dtype=dt), torch.randn(4, 4, 4, dtype=dt)), {"offs": offs(4, 16)}),
        "misaligned stride": lambda dt: ((torch.randn(16, 8, dtype=dt), torch.randn(4, 8, 6, dtype=dt)), {"offs": offs(4, 16)}),
        "contraction mismatch": lambda dt: ((torch.randn(16, 8, dtype=dt), torch.randn(4, 16, 16, dtype=dt)), {"offs": offs(4, 16)}),
    }


DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GROUPED_MM = torch.ops.aten._grouped_mm.default


def _run(fn):
    """(accepted, shape, dtype) of fn()."""
    try:
        out = fn()
    except (RuntimeError, ValueError, TypeError, NotImplementedError):
        return (False, None, None)
    return (True, tuple(out.shape), out.dtype)


@pytest.fixture(autouse=True)
def _quiet_fake_log():
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    yield
    logger.setLevel(level)


def _fake(mode, args, kwargs):
    convert = lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t  # noqa: E731
    return tuple(convert(a) for a in args), {k: convert(v) for k, v in kwargs.items()}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(_grouped_mm_cases()))
def test_grouped_mm_rule_agrees_with_the_real_kernel(case, dtype):
    args, kwargs = _grouped_mm_cases()[case](dtype)
    real = _run(lambda: GROUPED_MM(*args, **kwargs))
    mode = FakeTensorMode()
    fargs, fkwargs = _fake(mode, args, kwargs)
    with mode:
        ruled = _run(lambda: RULES[GROUPED_MM].run(GROUPED_MM, fargs, fkwargs))
    assert ruled == real


def test_every_rule_is_still_needed():
    """An op whose fake kernel now agrees with the real one in every case needs no rule: remove it."""
    disagreements = []
    for dtype in DTYPES:
        for build in _grouped_mm_cases().values():
            args, kwargs = build(dtype)
            mode = FakeTensorMode()
            fargs, fkwargs = _fake(mode, args, kwargs)
            with mode:
                fake = _run(lambda: GROUPED_MM(*fargs, **fkwargs))
            if fake != _run(lambda: GROUPED_MM(*args, **kwargs)):
                disagreements.append(dtype)
    assert torch.float32 in disagreements, (
        f"torch {torch.__version__}: the fake _grouped_mm now agrees with the real kernel in float32; "
        "drop or narrow its rule in memplan/estimator/kernels/rules.py"
    )
    matmuls = {getattr(torch.ops.aten, case.split(",")[0]).default for case in MATMUL_CASES}
    sparse = {torch.ops.aten.clone.default, torch.ops.aten._coalesce.default, torch.ops.aten.sparse_mask.default,
              torch.ops.aten._sparse_coo_tensor_with_dims_and_tensors.default,
              torch.ops.aten._embedding_bag_backward.default}  # tests/estimator/test_sparse_rules.py, _gradients.py
    assert set(RULES) <= {GROUPED_MM} | matmuls | sparse, "a new rule needs its cases in this file"


class GroupedExperts(torch.nn.Module):
    """Experts applied with torch._grouped_mm in float32, as transformers' default MoE path runs on CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.w_in = torch.nn.Parameter(torch.randn(4, 32, 64) * 0.02)
        self.w_out = torch.nn.Parameter(torch.randn(4, 64, 32) * 0.02)

    def forward(self, x):
        offs = torch.tensor([64, 128, 192, 256], dtype=torch.int32)
        h = torch.nn.functional.gelu(torch._grouped_mm(x, self.w_in, offs=offs))
        return torch._grouped_mm(h, self.w_out, offs=offs)


def test_float32_grouped_mm_model_estimates_exactly():
    from memplan.estimator.api import estimate
    from memplan.truth import measure_cpu_peak

    def build():
        torch.manual_seed(0)
        return GroupedExperts()

    def batch():
        return (torch.randn(256, 32, generator=torch.Generator().manual_seed(0)),)

    loss = lambda m, b: m(b[0]).square().mean()  # noqa: E731
    est = estimate(build, batch(), loss=loss, device="cpu")
    assert est.peak_allocated == measure_cpu_peak(build, batch, loss=loss)


MATMUL_CASES = {  # op -> builder(dtype_a, dtype_b) -> args: the second operand's dtype varies
    "mm": lambda a, b: (torch.randn(4, 8, dtype=a), torch.randn(8, 3, dtype=b)),
    "bmm": lambda a, b: (torch.randn(2, 4, 8, dtype=a), torch.randn(2, 8, 3, dtype=b)),
    "addmm": lambda a, b: (torch.randn(3, dtype=a), torch.randn(4, 8, dtype=a), torch.randn(8, 3, dtype=b)),
    "addmm, bias differs": lambda a, b: (torch.randn(3, dtype=b), torch.randn(4, 8, dtype=a), torch.randn(8, 3, dtype=a)),
    "baddbmm": lambda a, b: (torch.randn(2, 4, 3, dtype=a), torch.randn(2, 4, 8, dtype=a), torch.randn(2, 8, 3, dtype=b)),
    "mv": lambda a, b: (torch.randn(4, 8, dtype=a), torch.randn(8, dtype=b)),
    "addmv": lambda a, b: (torch.randn(4, dtype=a), torch.randn(4, 8, dtype=a), torch.randn(8, dtype=b)),
    "dot": lambda a, b: (torch.randn(8, dtype=a), torch.randn(8, dtype=b)),
}


@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                    (torch.float16, torch.bfloat16)], ids=str)
@pytest.mark.parametrize("case", list(MATMUL_CASES))
def test_matmul_rules_refuse_mixed_dtypes_as_the_real_kernel_does(case, dtypes):
    op = getattr(torch.ops.aten, case.split(",")[0]).default
    args = MATMUL_CASES[case](*dtypes)
    real = _run(lambda: op(*args))
    mode = FakeTensorMode()
    fake_args, _ = _fake(mode, args, {})
    rule = RULES.get(op)
    with mode:
        plain_fake = _run(lambda: op(*fake_args))
        ruled = _run(lambda: rule.run(op, fake_args, {})) if rule is not None else plain_fake
    assert ruled == real  # with the rule where there is one, the fake kernel's own verdict elsewhere
    if dtypes[0] != dtypes[1]:
        assert not real[0]
        assert plain_fake[0] == (rule is not None), "the fake kernel changed its verdict on mixed dtypes: update RULES"


def test_a_step_that_cannot_run_is_reported_not_estimated():
    from memplan.estimator.api import estimate
    from memplan.estimator.errors import EstimateError

    class HalfInput(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 2)

        def forward(self, x):
            return self.fc(x.bfloat16())  # a float32 weight: the real addmm raises

    with pytest.raises(RuntimeError, match="same dtype"):
        HalfInput()(torch.randn(4, 8))
    with pytest.raises(EstimateError, match=r"addmm.*different dtypes \(float32, bfloat16, float32\).*cannot run"):
        estimate(HalfInput, (torch.randn(4, 8),), loss=lambda m, b: m(b[0]).float().sum(), device="cpu")
