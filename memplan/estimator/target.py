"""What the estimate is for: CPU execution, or a CUDA GPU (local, or a named model from the catalog)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

TRACE_ON_CPU_ENV = "MEMPLAN_TRACE_ON_CPU"
"""Set to 1 to trace a CUDA target on fake CPU tensors with CUDA semantics emulated even where torch
has CUDA: a diagnostic, to measure how far the emulation is from tracing on fake CUDA tensors."""


@dataclass(frozen=True, kw_only=True)
class Target:
    """The device an estimate is for, and how the trace runs on this machine to represent it."""

    name: str
    """'cpu' or the GPU model's name."""
    is_cuda: bool
    """Whether the target is a CUDA GPU (caching allocator, CUDA context, cuBLAS workspaces)."""
    compute_capability: tuple[int, int] | None = None
    """(major, minor) of the GPU; None for CPU."""
    total_bytes: int | None = None
    """The GPU's memory, when known."""
    trace_device: str = "cpu"
    """Device of the fake tensors: 'cuda' where this torch has CUDA and a GPU, else 'cpu'."""

    @property
    def emulates_cuda(self) -> bool:
        """A CUDA target traced on fake CPU tensors, with CUDA's op semantics emulated."""
        return self.is_cuda and self.trace_device == "cpu"


GENERIC_CUDA = "generic CUDA GPU (sm80)"


def resolve_target(device) -> Target:
    """'cpu', a GPU model name from the catalog, a `memplan.hardware.GpuModel` (e.g. from
    `custom_gpu("24GiB")`), or None for the local GPU (a generic sm80 GPU when there is none, with a note)."""
    from memplan.hardware.catalog import GpuModel, lookup_gpu

    if isinstance(device, GpuModel):
        return _gpu_target(device)
    if device is not None and not isinstance(device, str):
        raise ValueError(
            f"device must be 'cpu', a GPU name such as 'A100-80GB', a GpuModel, or None; got {device!r}"
        )
    if device is not None and device.strip().lower() == "cpu":
        return Target(name="cpu", is_cuda=False)
    trace_device = _trace_device()
    if device is None:
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            return Target(
                name=props.name, is_cuda=True, compute_capability=(props.major, props.minor),
                total_bytes=int(props.total_memory), trace_device=trace_device,
            )
        return Target(name=GENERIC_CUDA, is_cuda=True, compute_capability=(8, 0), trace_device="cpu")
    try:
        model = lookup_gpu(device)
    except ValueError as err:
        raise ValueError(f"device: {err}") from None
    return _gpu_target(model)


def _gpu_target(model) -> Target:
    return Target(
        name=model.name, is_cuda=True, compute_capability=tuple(model.compute_capability),
        total_bytes=model.total_bytes, trace_device=_trace_device(),
    )


def _trace_device() -> str:
    native = torch.cuda.is_available() and os.environ.get(TRACE_ON_CPU_ENV, "0") != "1"
    return "cuda" if native else "cpu"
