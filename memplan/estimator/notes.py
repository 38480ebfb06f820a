"""The estimate's notes that an edge words its own way: each a `Note`, the text a Python caller reads, with a code
and the fields it is rendered from, so that `memplan estimate` renders it again in its own words (its --device
flag) from the fields, never by rewriting the text; and the notes a caller tells apart by code (where the step was
traced, when not where this machine would trace it: memplan.estimator.trace_route)."""
from __future__ import annotations

from typing import Any

GENERIC_GPU = "generic_gpu"
"""Note code: no local GPU, so the estimate is for a generic GPU of compute capability `compute_capability`; the
note says how to choose another."""
CHOOSE_DEVICE = "pass device='H100-80GB' (or another)"
"""How a caller of memplan.estimate chooses the GPU, as the generic-GPU note words it."""


class Note(str):
    """One of an estimate's notes as the user reads it (a str: the table, the JSON and MemoryEstimate.notes hold
    the text), with `code`, what it is about ('' for a note nothing tells apart by code), and `fields`, what it is
    rendered from."""

    code: str
    fields: dict[str, Any]

    def __new__(cls, text: str, code: str = "", fields: dict[str, Any] | None = None) -> Note:
        made = super().__new__(cls, text)
        made.code = code
        made.fields = dict(fields or {})
        return made

    def __reduce__(self):  # (pickled out of the planning process and copied by dataclasses.asdict: the code goes along)
        return (Note, (str(self), self.code, self.fields))


def generic_gpu_note(compute_capability: tuple[int, int], *, choose: str = CHOOSE_DEVICE) -> Note:
    """'no local GPU: estimated for a generic sm80 GPU; pass device='H100-80GB' (or another) to choose', with
    `choose` in the words of whoever shows it."""
    major, minor = compute_capability
    return Note(f"no local GPU: estimated for a generic sm{major}{minor} GPU; {choose} to choose", GENERIC_GPU,
                {"compute_capability": (major, minor)})


FSDP_EMULATED = "fsdp_emulated"
"""Note code: strategy='fsdp' on a machine with a GPU, traced on CPU fake tensors with CUDA emulated."""
NATIVE_FALLBACK = "native_fallback"
"""Note code: the trace on fake CUDA tensors met `op`, which has no fake kernel there, and was traced again on CPU
fake tensors with CUDA emulated."""


def fsdp_emulated_note() -> Note:
    return Note("strategy='fsdp': traced on CPU fake tensors with CUDA's semantics emulated, also on a machine with "
                "a GPU (memplan shards the fake model over a fake CPU device mesh)", FSDP_EMULATED)


def native_fallback_note(op: str) -> Note:
    return Note(f"{op} has no fake kernel on CUDA: the step was traced again on CPU fake tensors with CUDA's "
                "semantics emulated, so the op's CUDA-only work (cuDNN's RNN reserve, say) is modelled by its "
                "CPU path", NATIVE_FALLBACK, {"op": op})
