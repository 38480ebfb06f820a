"""What training_step returns beside the loss, for a batch run as chunks (memplan.callback.chunking).

A training_step may return a dict: the loss and other entries (predictions, counts) that Lightning hands to
`on_train_batch_end(outputs, ...)` of the module and of every callback. Run as chunks, each chunk returns its
own; the batch's outputs are joined from them by the rule memplan.batching splits batches by: an entry that is
a tensor whose first dimension is its chunk's sample count in every chunk is per-sample, joined along dim 0
into the whole batch's, detached (Lightning hands an unchunked batch's on with their graph; a chunk's graph kept
through the next chunk would hold the memory chunking is there to free, and the info line says "detached"). A
tensor whose first dimension only happens to equal the chunk's samples (a per-class vector of 4 with chunks of
4) is joined too: the runner names the entries it joined once, at info level. Any other entry (a sum, a count, a
chunk's mean, a constant) cannot be told from the chunks alone: it carries the last chunk's value, and the
runner says so once, naming it, in a warning.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from pytorch_lightning.utilities.rank_zero import rank_zero_info, rank_zero_warn


class OutputJoiner:
    """A runner's joiner: each chunk's extras added (detached) as it succeeds, the batch's outputs joined after its
    last chunk, and once per fit on rank 0 the entries joined (info) and those left at the last chunk's value
    (a warning)."""

    def __init__(self) -> None:
        self._batch: Any = None
        self._parts: list[tuple[int, int, dict[str, Any]]] = []
        self._said = False

    def add(self, batch: Any, start: int, stop: int, output: Any) -> None:
        """A chunk [start, stop) of `batch` ran and returned `output` (a new batch starts afresh)."""
        if batch is not self._batch:
            self._batch, self._parts = batch, []
        extras = extras_of(output)
        if extras is not None:
            self._parts.append((start, stop, {k: _detached(v) for k, v in extras.items()}))

    def joined(self, output: Any) -> Any:
        """The batch's outputs: the last chunk's `output` with its extras joined over the chunks."""
        output, unjoined = join_outputs(output, self._parts)
        joined = [k for k in (self._parts[-1][2] if len(self._parts) > 1 else ()) if k not in unjoined]
        self._batch, self._parts = None, []
        if (joined or unjoined) and not self._said:
            self._said = True
            if joined:
                rank_zero_info(JOINED.format(keys=", ".join(repr(k) for k in joined)))
            if unjoined:
                keys = ", ".join(repr(k) for k in unjoined)
                rank_zero_warn(UNJOINED.format(keys=keys, them="it" if len(unjoined) == 1 else "them"))
        return output


def _detached(value: Any) -> Any:
    """`value` with every tensor in it (in dicts, lists and tuples) detached."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, Mapping):
        return {k: _detached(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_detached(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def extras_of(output: Any) -> dict[str, Any] | None:
    """The entries beside the loss of a dict output (None where it has none)."""
    if not isinstance(output, Mapping):
        return None
    extras = {k: v for k, v in output.items() if k != "loss"}
    return extras or None


def join_outputs(output: Any, parts: list[tuple[int, int, dict[str, Any]]]) -> tuple[Any, list[str]]:
    """The last chunk's `output` with each extra entry joined over `parts` (each chunk's start, stop and extras,
    in any order), and the names of the entries left at the last chunk's value."""
    if len(parts) < 2 or not isinstance(output, Mapping):
        return output, []
    parts = sorted(parts, key=lambda part: part[0])
    joined, unjoined = dict(output), []
    for key in parts[-1][2]:
        values = [extras.get(key) for _, _, extras in parts]
        if all(isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == stop - start
               for (start, stop, _), v in zip(parts, values)):
            joined[key] = torch.cat(values)
        else:  # (equal in every chunk says nothing of the batch's: a count of 4 in each of 2 chunks is 8)
            unjoined.append(key)
    return joined, unjoined


JOINED = ("MemoryPlanner: with a batch run as chunks, training_step's {keys} (first dimension the chunk's samples) "
          "reach on_train_batch_end joined along dim 0 into the batch's, detached")
UNJOINED = ("MemoryPlanner: training_step returns {keys} beside the loss; with a batch run as chunks, the "
            "`outputs` that on_train_batch_end receives hold the last chunk's value of {them} (per-sample "
            "tensors, whose first dimension is the chunk's samples, are joined into the batch's). Compute such a "
            "figure in on_train_batch_end from the batch, log it with self.log (merged over chunks by its "
            "reduce_fx), or return it per sample")
