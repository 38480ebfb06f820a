"""A SIMULATED NVML: a stand-in for the `pynvml` module, for tests on machines without a GPU.

Nothing here reads hardware. `SimulatedNvml` answers the pynvml functions memplan calls from a
description of GPUs, MIG slices and processes given by the test, and raises pynvml's own
`NVMLError` classes (NVMLError(code) becomes e.g. NVMLError_LibraryNotFound), so the door's
`except` clauses run exactly as they would against a real driver. It behaves like NVML where that
matters to memplan: calls before nvmlInit fail with Uninitialized, a device's `used` memory is its
processes plus what the driver reserves, MIG slices have their own memory and UUIDs.

Install one with `memplan.hardware.nvml.set_backend(SimulatedNvml(...))` (the `nvml_sim` fixture).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml
from pynvml import NVMLError

from memplan.units import MiB


@dataclass
class SimProcess:
    """A simulated process holding a CUDA context."""

    pid: int
    used_bytes: int | None  # None: NVML cannot attribute it (as under Windows WDDM)
    name: str = "python"


@dataclass
class SimGpu:
    """A simulated GPU, or a MIG slice when listed in another SimGpu's `mig_slices`."""

    name: str = "NVIDIA A100-SXM4-80GB"
    total_bytes: int = 81920 * MiB
    driver_bytes: int = 0  # counted in `used` with no process behind it
    compute_capability: tuple[int, int] = (8, 0)
    uuid: str = ""  # filled in by SimulatedNvml when empty
    mig_mode: bool | None = None  # None: the board does not support MIG (NotSupported)
    mig_slices: list[SimGpu] = field(default_factory=list)
    processes: list[SimProcess] = field(default_factory=list)
    failing: dict[str, int] = field(default_factory=dict)  # function name -> NVML error code
    raising: dict[str, BaseException] = field(default_factory=dict)  # function name -> any exception (a binding bug)


class SimulatedNvml:
    """Quacks like the pynvml module for the functions memplan uses.

    init_error: NVML error code nvmlInit raises (e.g. pynvml.NVML_ERROR_LIBRARY_NOT_FOUND).
    failing: function name -> error code, raised on every device.
    driver_lacks: functions the "driver" lacks (raise NVMLError_FunctionNotFound, as pynvml does).
    bindings_lack: functions absent from the "nvidia-ml-py" module itself (AttributeError).
    raising: function name -> an exception that is not NVMLError (a binding's RuntimeError, ctypes' OSError),
    raised on every device (SimGpu.raising: on one).
    """

    NVMLError = NVMLError
    NVMLLibraryMismatchError = pynvml.NVMLLibraryMismatchError

    def __init__(self, gpus: list[SimGpu], *, init_error: int | None = None,
                 failing: dict[str, int] | None = None, driver_lacks: set[str] = frozenset(),
                 bindings_lack: set[str] = frozenset(), raising: dict[str, BaseException] | None = None) -> None:
        self.gpus = gpus
        self.raising = raising or {}
        for i, gpu in enumerate(gpus):
            gpu.uuid = gpu.uuid or f"GPU-{i:08x}-sim0-4000-8000-{i:012x}"
            for j, mig in enumerate(gpu.mig_slices):
                mig.uuid = mig.uuid or f"MIG-{i:04x}{j:04x}-sim0-4000-8000-{j:012x}"
        self.init_error = init_error
        self.failing = failing or {}
        self.driver_lacks = set(driver_lacks)
        self._absent = set(bindings_lack)
        self.initialized = 0
        self.init_calls = 0
        self.shutdown_calls = 0
        self.calls: list[str] = []

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("nvml") and name in object.__getattribute__(self, "_absent"):
            raise AttributeError(name)
        return object.__getattribute__(self, name)

    # -- session ------------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        self.init_calls += 1
        if "nvmlInit" in self.raising:
            raise self.raising["nvmlInit"]
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.initialized += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self.shutdown_calls += 1
        self.initialized -= 1

    def _enter(self, func: str, gpu: SimGpu | None = None) -> None:
        self.calls.append(func)
        if not self.initialized:
            raise NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        if func in self.driver_lacks:
            raise NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        error = self.raising.get(func, gpu.raising.get(func) if gpu is not None else None)
        if error is not None:
            raise error
        code = self.failing.get(func, gpu.failing.get(func) if gpu is not None else None)
        if code is not None:
            raise NVMLError(code)

    # -- devices ------------------------------------------------------------------------------
    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> SimGpu:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self.gpus[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> SimGpu:
        self._enter("nvmlDeviceGetHandleByUUID")
        for gpu in self.gpus:
            for candidate in (gpu, *gpu.mig_slices):
                if candidate.uuid == uuid:
                    return candidate
        raise NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetName(self, handle: SimGpu) -> str:
        self._enter("nvmlDeviceGetName", handle)
        return handle.name

    def nvmlDeviceGetUUID(self, handle: SimGpu) -> str:
        self._enter("nvmlDeviceGetUUID", handle)
        return handle.uuid

    def nvmlDeviceGetMemoryInfo(self, handle: SimGpu) -> SimpleNamespace:
        self._enter("nvmlDeviceGetMemoryInfo", handle)
        slices = handle.mig_slices if handle.mig_mode else []
        used = handle.driver_bytes + sum(p.used_bytes or 0 for g in (handle, *slices)
                                         for p in g.processes)
        return SimpleNamespace(total=handle.total_bytes, used=used, free=handle.total_bytes - used)

    def nvmlDeviceGetCudaComputeCapability(self, handle: SimGpu) -> tuple[int, int]:
        self._enter("nvmlDeviceGetCudaComputeCapability", handle)
        return handle.compute_capability

    def nvmlDeviceGetMigMode(self, handle: SimGpu) -> list[int]:
        self._enter("nvmlDeviceGetMigMode", handle)
        if handle.mig_mode is None:
            raise NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return [int(handle.mig_mode), int(handle.mig_mode)]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: SimGpu) -> int:
        self._enter("nvmlDeviceGetMaxMigDeviceCount", handle)
        if handle.mig_mode is None:
            raise NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: SimGpu, index: int) -> SimGpu:
        self._enter("nvmlDeviceGetMigDeviceHandleByIndex", handle)
        if not handle.mig_mode or index >= len(handle.mig_slices):
            raise NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return handle.mig_slices[index]

    def _running(self, func: str, handle: SimGpu) -> list[SimpleNamespace]:
        self._enter(func, handle)
        return [SimpleNamespace(pid=p.pid, usedGpuMemory=p.used_bytes, gpuInstanceId=0xFFFFFFFF,
                                computeInstanceId=0xFFFFFFFF) for p in handle.processes]

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: SimGpu) -> list[SimpleNamespace]:
        return self._running("nvmlDeviceGetComputeRunningProcesses_v3", handle)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: SimGpu) -> list[SimpleNamespace]:
        return self._running("nvmlDeviceGetComputeRunningProcesses_v2", handle)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: SimGpu) -> list[SimpleNamespace]:
        try:
            return self._running("nvmlDeviceGetComputeRunningProcesses", handle)
        except pynvml.NVMLError_FunctionNotFound:  # what pynvml's @throwOnVersionMismatch does
            raise pynvml.NVMLLibraryMismatchError("unversioned function missing") from None

    def nvmlSystemGetProcessName(self, pid: int) -> str:
        self._enter("nvmlSystemGetProcessName")
        for gpu in self.gpus:
            for p in (p for g in (gpu, *gpu.mig_slices) for p in g.processes):
                if p.pid == pid:
                    return p.name
        raise NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
