"""Sparse COO gradients (`nn.Embedding(sparse=True)`) as the real CPU kernels make them.

torch 2.13's fake kernels give `clone`, `_coalesce` and `sparse_mask` of a sparse tensor no entries (nnz 0): the
gradient the autograd engine clones into `param.grad`, and every sparse tensor an optimizer (Adagrad, SGD)
derives from it, then holds nothing, and an optimizer step over a sparse gradient was under-counted (-3.7 % on
an embedding trained with Adagrad). These rules make their outputs with the real entry counts:
- `clone`: the same entries, indices and values copied. The autograd engine's AccumulateGrad clones a new sparse
  gradient unless nothing else references its parts, which it cannot tell under the trace: nn.Embedding's gradient
  is taken without a copy in the real run (the estimate is over by its size, +0.4 % measured), nn.EmbeddingBag's is
  cloned;
- `_coalesce`: one entry per distinct index, counted from the indices' values where the trace has them (the
  batch's token ids, kept on the sparse tensor itself by `construct`: a sparse tensor has no storage for
  memplan.estimator.known_values to carry them on), else every entry kept (an upper bound: no id
  repeated in the batch);
- `sparse_mask(dense, mask)`: the mask's entries, indices shared with the mask, values new.
What they do not model (the transients of the real coalesce, which sorts and merges every entry) the estimate's
notes name (`notes`): measured against real CPU steps, an embedding trained with sparse gradients is estimated
within 0.4 % where ids rarely repeat and -15 % to +5 % where they repeat many times
(tests/estimator/test_sparse_gradients.py). nn.EmbeddingBag(sparse=True) is refused by name (embedding_bag_backward).
"""
from __future__ import annotations

import torch

from memplan.compat.torch import FakeTensor, disable_current_modes, sparse_parts
from memplan.estimator.errors import EstimateError

_INDICES = "_memplan_indices"
"""Attribute of a fake sparse tensor: the real values of its indices, where the trace has them."""


def embedding_bag_backward(func, args, kwargs):
    """`_embedding_bag_backward` with sparse=True: refused by name. Its fake kernel gives the gradient no entries
    and none of the real kernel's per-id buffers (-3 % to -74 % measured on CPU), and a rule would need that kernel's
    own buffers, which nothing here measures yet."""
    sparse = args[9] if len(args) > 9 else kwargs.get("sparse", False)
    if sparse:
        raise EstimateError(
            argument="model", stage="step", detail="an nn.EmbeddingBag(sparse=True) (or F.embedding_bag with "
            "sparse=True) trains a sparse gradient whose memory memplan does not model",
            fix="Estimate the model with sparse=False: its dense gradient (the whole table) is an upper bound")
    return func(*args, **kwargs)


def notes(model: torch.nn.Module) -> list[str]:
    """The estimate's note where the model trains sparse gradients (`nn.Embedding(sparse=True)`; nn.EmbeddingBag's
    are refused, `embedding_bag_backward`)."""
    sparse = [type(m).__name__ for m in model.modules() if isinstance(m, torch.nn.Embedding) and m.sparse]
    if not sparse:
        return []
    return [f"{sparse[0]}(sparse=True): a sparse gradient's step is approximate (the real coalesce's buffers, which "
            "grow with how often ids repeat in the batch, are not modelled: -15 % to +5 % measured where they repeat "
            "many times, within 0.4 % where they do not)"]


def _sparse_like(template: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, *, coalesced: bool):
    return torch.ops.aten._sparse_coo_tensor_with_dims_and_tensors(
        template.sparse_dim(), template.dense_dim(), list(template.shape), indices, values, dtype=values.dtype,
        layout=torch.sparse_coo, device=values.device, is_coalesced=coalesced)


def construct(func, args, kwargs):
    """`_sparse_coo_tensor_with_dims_and_tensors`: its indices keep the real values they came with (the batch's
    ids, which the backward of a sparse embedding takes as they are)."""
    out = func(*args, **kwargs)
    indices = args[3] if len(args) > 3 else kwargs.get("indices")
    if isinstance(indices, torch.Tensor) and not isinstance(indices, FakeTensor):
        setattr(out, _INDICES, indices)
    return out


def clone(func, args, kwargs):
    source = args[0]
    if not source.is_sparse:
        return func(*args, **kwargs)
    indices, values = sparse_parts(source)
    out = _sparse_like(source, indices.clone(), values.clone(), coalesced=source.is_coalesced())
    if hasattr(source, _INDICES):
        setattr(out, _INDICES, getattr(source, _INDICES))
    return out


def coalesce(func, args, kwargs):
    source = args[0]
    indices, values = sparse_parts(source)
    known = getattr(source, _INDICES, None)
    if known is not None:
        with disable_current_modes():
            ones = torch.ones(known.shape[1], dtype=torch.int8)
            size = tuple(source.shape[:source.sparse_dim()])
            unique = sparse_parts(torch.sparse_coo_tensor(known, ones, size).coalesce())[0]
        count = unique.shape[1]
    else:
        unique, count = None, indices.shape[1]
    out = _sparse_like(source, indices.new_empty((indices.shape[0], count)),
                       values.new_empty((count, *values.shape[1:])), coalesced=True)
    if unique is not None:
        setattr(out, _INDICES, unique)
    return out


def sparse_mask(func, args, kwargs):
    dense, mask = args[0], args[1]
    if not mask.is_sparse or mask.layout != torch.sparse_coo:
        return func(*args, **kwargs)
    mask_indices = sparse_parts(mask)[0]
    values = dense.new_empty((mask_indices.shape[1], *dense.shape[mask.sparse_dim():]))
    return _sparse_like(mask, mask_indices, values, coalesced=mask.is_coalesced())
