"""The tensors an op takes or makes, as the tracker counts them."""
from __future__ import annotations

import torch

from memplan.compat.torch import disable_current_modes, sparse_parts


def tensors_in(value, found: list | None = None) -> list[torch.Tensor]:
    """The tensors in an op's arguments or outputs (nested tuples, lists and dict values), in order: what
    tree_flatten finds there, at a fraction of its cost on every op of a trace. A sparse COO tensor (the gradient
    of `nn.Embedding(sparse=True)`) has no storage of its own: it is its indices and values, two dense tensors."""
    found = [] if found is None else found
    if isinstance(value, torch.Tensor):
        if value.is_sparse:
            with disable_current_modes():
                found += list(sparse_parts(value))
        else:
            found.append(value)
    elif isinstance(value, (tuple, list)):
        for item in value:
            tensors_in(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            tensors_in(item, found)
    return found
