"""Whether the step runs with deterministic algorithms: an input of the estimate, as Lightning takes it.

Lightning's `Trainer(deterministic=...)` (`_set_torch_flags`, lightning/pytorch/trainer/connectors/
accelerator_connector.py): True calls `torch.use_deterministic_algorithms(True)`, "warn" calls it with
`warn_only=True`, False turns it off, None leaves the process as it is. ATen reads the two flags apart, so the
estimate keeps all three values:

- flash attention's backward (attention_backward.cu `_flash_attention_backward`) runs mha_bwd's deterministic
  kernel only when the flag is on and not warn-only: ceil(SMs / (B x H)) dQ accumulators (cuda/op_scratch.py);
- `index_put` with more than one value (TensorAdvancedIndexing.cpp `index_put_`: `accumulate ||
  (globalContext().deterministicAlgorithms() && value_.numel() > 1)`) takes the sort path under either
  (cuda/index_scratch.py);
- embedding's backward over more than 3072 indices (EmbeddingBackwardKernel.cu, torch >= 2.11) never takes its
  fused atomic path under either (cuda/embedding_scratch.py);
- Lightning itself, for True and "warn", sets CUBLAS_WORKSPACE_CONFIG=:4096:8 (32 MiB per cuBLAS handle, where an
  sm80 GPU's default is 8.125 MiB; sm90 and newer default to 32 MiB already): a Lightning step's cuBLAS workspaces
  (estimator/target.py `target_overheads`).

Not modelled: other ops' deterministic paths (index_add_ / scatter_add_ on CUDA through index_put with accumulate,
and the like; no zoo case runs them), the memory-efficient attention backward (one key split under determinism:
its dQ workspace does not depend on the splits), cuDNN's deterministic convolution algorithms (the conv workspace
rule is fitted to Lightning's default, benchmark off), torch's NaN fill of empty tensors (no memory).

Each rule takes the value from the trace (TraceSetting.deterministic), never from torch's global flags: the
process that traces (`memplan suggest`, the FSDP planning subprocess) is not the process that trains.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch

from memplan.estimator.errors import EstimateError

Deterministic = bool | Literal["warn"]
"""False, True or "warn": Lightning's Trainer(deterministic=...) values (None, "as the process is", resolved)."""


def process_deterministic() -> Deterministic:
    """This process's setting: True, "warn" (torch.use_deterministic_algorithms(True, warn_only=True)) or False."""
    if not torch.are_deterministic_algorithms_enabled():
        return False
    return "warn" if torch.is_deterministic_algorithms_warn_only_enabled() else True


def check_deterministic(value: object, *, name: str = "deterministic") -> Deterministic | None:
    """`value` as given (None stays None), or ValueError naming `name` (an argument, a flag, a YAML key)."""
    if value is None or value is True or value is False or value == "warn":
        return value  # type: ignore[return-value]
    raise EstimateError(f"{name} must be True, False or 'warn' (Lightning's Trainer(deterministic=...)), or None for "
                        f"this process's torch.use_deterministic_algorithms setting; got {value!r}", argument=name,
                        detail=f"must be True, False or 'warn'; got {value!r}")


def resolve_deterministic(value: object) -> Deterministic:
    """estimate(deterministic=...): the value given, or this process's setting for None."""
    checked = check_deterministic(value)
    return process_deterministic() if checked is None else checked


def splits_flash_backward(deterministic: Deterministic) -> bool:
    """Flash attention's backward runs its deterministic kernel: the flag on and not warn-only."""
    return deterministic is True


def sorts_index_put(deterministic: Deterministic) -> bool:
    """index_put takes its sort path for more than one value: the flag on, warn-only or not."""
    return deterministic is True or deterministic == "warn"


def deterministic_notes(deterministic: Deterministic, counted: Mapping[str, int], *,
                        lightning: bool) -> tuple[str, ...]:
    """The estimate's note for a CUDA target traced with deterministic algorithms (none without them): which ops'
    deterministic paths were counted, `counted` by op name, or that none of this step's ops has one; for a
    `lightning` step, that cuBLAS's workspace is the one Lightning sets (estimator/target.py)."""
    if not deterministic:
        return ()
    how = "deterministic=True" if deterministic is True else "deterministic='warn', warn-only"
    if counted:
        ops = ", ".join(f"{op} ({n} a step)" for op, n in sorted(counted.items()))
        said = f"deterministic algorithms ({how}): the deterministic path counted for {ops}"
    else:
        said = (f"deterministic algorithms ({how}): no op of this step takes a deterministic path memplan models "
                "with other memory (flash attention's backward, index_put, embedding's backward)")
    return (said + ("; cuBLAS's workspace as Lightning sets it for them (CUBLAS_WORKSPACE_CONFIG=:4096:8)"
                    if lightning else ""),)
