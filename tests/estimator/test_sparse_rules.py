"""The sparse kernel rules (memplan/estimator/kernels/sparse.py) against the installed torch's real and fake kernels:
a sparse gradient as an embedding's backward makes it (real ids as indices), cloned, coalesced and used as a mask."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan.estimator.kernels.rules import RULES

aten = torch.ops.aten
CONSTRUCT = aten._sparse_coo_tensor_with_dims_and_tensors.default
SIZE = [50, 4]


def _structure(t: torch.Tensor) -> tuple:
    return (t._nnz(), tuple(t._indices().shape), tuple(t._values().shape), t.is_coalesced())


def _ids() -> torch.Tensor:
    return torch.tensor([[3, 7, 3, 9, 7, 3, 1, 0]])  # 8 entries, 5 distinct rows


def _make(construct, indices, values):
    return construct(CONSTRUCT, (1, 1, SIZE, indices, values),
                     {"dtype": values.dtype, "layout": torch.sparse_coo, "device": values.device})


def _real_and_fake(op: str):
    """The op's output structure on real tensors, on fakes as torch 2.13 makes them, and on fakes under the rule."""
    plain = lambda func, args, kwargs: func(*args, **kwargs)  # noqa: E731
    steps = {
        "clone": lambda s, dense, run: run(aten.clone.default, (s,), {}),
        "_coalesce": lambda s, dense, run: run(aten._coalesce.default, (s,), {}),
        "sparse_mask": lambda s, dense, run: run(aten.sparse_mask.default, (dense, run(aten._coalesce.default, (s,), {})), {}),
    }[op]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        real = steps(_make(plain, _ids(), torch.randn(8, 4)), torch.randn(*SIZE), plain)
        results = [_structure(real)]
        for ruled in (False, True):
            ids = _ids()  # real, as the batch is in a trace (a torch.tensor made under the fake mode is fake)
            run = (lambda func, args, kwargs: RULES[func].run(func, args, kwargs)) if ruled else plain
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                values, dense = mode.from_tensor(torch.randn(8, 4)), mode.from_tensor(torch.randn(*SIZE))
                sparse = _make(RULES[CONSTRUCT].run if ruled else plain, ids, values)
                results.append(_structure(steps(sparse, dense, run)))
    return results


@pytest.mark.parametrize("op", ["clone", "_coalesce", "sparse_mask"])
def test_each_sparse_rule_gives_the_real_kernels_entries(op):
    real, fake, ruled = _real_and_fake(op)
    assert ruled == real
    assert fake != real, f"torch {torch.__version__}'s fake {op} now counts a sparse tensor's entries: drop its rule"


def test_a_dense_clone_is_the_fake_kernels_own():
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(3, 5).t())
        ruled = RULES[aten.clone.default].run(aten.clone.default, (x,), {})
        plain = aten.clone.default(x)
    assert (ruled.shape, ruled.stride()) == (plain.shape, plain.stride())
