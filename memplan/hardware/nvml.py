"""The one door to NVML, and the GPUs seen through it (which of them this process sees: memplan.hardware.visible).

Every NVML call in memplan goes through `nvml_query` (the design of nvitop's `libnvml.nvmlQuery`):
NVML is initialised lazily under a lock and shut down at exit; a function missing from the installed
nvidia-ml-py or from the driver is logged once; an `NVMLError` becomes the caller's `default`, never
a crash. Without a driver every reading is simply not available, and `nvml_unavailable_reason` says
why. `set_backend` swaps the pynvml module, which is how the tests run on a simulated NVML.
"""
from __future__ import annotations

import atexit
import logging
import threading
from dataclasses import dataclass
from typing import Any

from memplan.hardware.catalog import supports_bf16

log = logging.getLogger(__name__)


class _NotAvailable:
    """The type of NA: a reading NVML could not give. Falsy; test it with `is NA`."""

    __slots__ = ()

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "NA"

    def __reduce__(self) -> str:  # copies and pickles stay the one NA
        return "NA"


NA = _NotAvailable()
_SAME_AS_DEFAULT = object()

# NVML return codes (nvml.h): ABI constants, the same in every pynvml.
_FUNCTION_NOT_FOUND = 13
_INIT_REASONS = {  # LIBRARY_NOT_FOUND, DRIVER_NOT_LOADED, NO_PERMISSION, LIB_RM_VERSION_MISMATCH
    12: "libnvidia-ml.so.1 was not found: no NVIDIA driver on this machine, or a container "
        "started without GPU access (docker run --gpus all)",
    9: "the NVIDIA kernel driver is not loaded (nvidia-smi fails the same way)",
    4: "no permission to open the NVIDIA devices (/dev/nvidia*)",
    18: "the NVIDIA driver and libnvidia-ml versions differ, usually after a driver upgrade "
        "without a reboot",
}

_BINDING_ERRORS = (RuntimeError, OSError, ValueError, TypeError, AttributeError, LookupError)
"""What a binding or driver in trouble raises besides NVMLError (a plain RuntimeError from a wrapper,
an OSError from ctypes, a malformed struct): a reading that fails this way is a missing reading,
logged once per function, never an exception out of a reading."""

_lock = threading.Lock()
_backend: Any = None            # the pynvml module (or a simulated one); imported on first use
_initialized = False
_closed = False                 # set at interpreter exit: no new NVML calls after shutdown
_init_error: str | None = None  # why NVML is unavailable, once nvmlInit has failed
_warned: set[str] = set()  # keys of warnings already logged
_atexit_registered = False


def set_backend(module: Any | None) -> None:
    """Use `module` as pynvml from now on (tests pass a simulated NVML); None restores the real one.
    Shuts down the NVML session of the previous backend and forgets any earlier init failure."""
    global _backend, _init_error, _closed
    with _lock:
        _shutdown_locked()
        _backend, _init_error, _closed = module, None, False
        _warned.clear()


def _shutdown_locked() -> None:
    global _initialized
    if _initialized:
        _initialized = False
        try:
            _backend.nvmlShutdown()
        except _backend.NVMLError as err:  # already torn down: the OS reclaims it at exit anyway
            log.debug("nvmlShutdown: %s", err)


def _shutdown_at_exit() -> None:
    global _closed
    with _lock:
        _closed = True
        _shutdown_locked()


def _session() -> Any | None:
    """The initialised backend, or None when NVML is unavailable (the reason is kept)."""
    global _backend, _initialized, _init_error, _atexit_registered
    if _initialized:
        return _backend
    with _lock:
        if _initialized or _closed or _init_error is not None:
            return _backend if _initialized else None
        if _backend is None:
            try:
                import pynvml
            except ImportError:
                _init_error = "the NVML bindings are not installed: pip install nvidia-ml-py"
                return None
            _backend = pynvml
        try:
            _backend.nvmlInit()
        except _backend.NVMLError as err:
            _init_error = _INIT_REASONS.get(getattr(err, "value", None), f"nvmlInit failed: {err}")
            log.info("NVML unavailable: %s", _init_error)
            return None
        except _BINDING_ERRORS as err:
            _init_error = f"nvmlInit raised {type(err).__name__}: {err}"
            log.info("NVML unavailable: %s", _init_error)
            return None
        _initialized = True
        if not _atexit_registered:
            atexit.register(_shutdown_at_exit)
            _atexit_registered = True
        return _backend


def warn_once(key: str, message: str, *args: Any) -> None:
    """Log a warning the first time `key` comes, never again in this process (until set_backend)."""
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    log.warning(message, *args)


def _log_missing_once(func_name: str, where: str) -> None:
    warn_once(func_name, "NVML function %s is missing from %s; readings that need it are not "
               "available.", func_name, where)


def nvml_query(func_name: str, *args: Any, default: Any = NA,
               if_missing: Any = _SAME_AS_DEFAULT) -> Any:
    """Call pynvml.<func_name>(*args). Returns `default` when NVML is unavailable or the call raises
    NVMLError, and `if_missing` (default: `default`) when the function is absent from nvidia-ml-py
    or from the driver, so callers can fall back to an older versioned name. Bytes become str."""
    backend = _session()
    if backend is None:
        return default
    missing = default if if_missing is _SAME_AS_DEFAULT else if_missing
    func = getattr(backend, func_name, None)
    if func is None:
        _log_missing_once(func_name, "the installed nvidia-ml-py (pip install -U nvidia-ml-py)")
        return missing
    try:
        value = func(*args)
    except backend.NVMLError as err:
        if getattr(err, "value", None) == _FUNCTION_NOT_FOUND:
            _log_missing_once(func_name, "this NVIDIA driver")
            return missing
        log.debug("%s%r failed: %s", func_name, args, err)
        return default
    # pynvml's unversioned wrappers turn FunctionNotFound into this (an Exception, not NVMLError).
    except getattr(backend, "NVMLLibraryMismatchError", ()):
        _log_missing_once(func_name, "this NVIDIA driver")
        return missing
    except UnicodeDecodeError:  # pynvml decodes C strings; a garbled one is just not available
        return default
    except _BINDING_ERRORS as err:
        warn_once(f"raised {func_name}", "NVML %s raised %s: %s; the readings that need it are not available "
                   "(said once)", func_name, type(err).__name__, err)
        return default
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def nvml_available() -> bool:
    """True when NVML initialised (a driver is present); see nvml_unavailable_reason otherwise."""
    return _session() is not None


def nvml_unavailable_reason() -> str | None:
    """Why NVML is unavailable (driver missing, library not found, ...), or None when it works."""
    return None if _session() is not None else _init_error or "NVML was shut down at exit"


@dataclass(frozen=True, kw_only=True)
class GpuProcess:
    """A process holding a CUDA context on a GPU."""

    pid: int
    """Process id as NVML sees it (the host's PID namespace: differs from os.getpid() in a container)."""
    used_bytes: int | None
    """GPU memory this process holds; None where NVML cannot attribute it (Windows WDDM)."""
    name: str | None = None
    """Process name, when NVML can read it."""


@dataclass(frozen=True, kw_only=True)
class GpuInfo:
    """One GPU (or one MIG slice of it) as NVML saw it at one moment. Memory in bytes."""

    index: int
    """NVML (physical) index: nvidia-smi's numbering. For a MIG slice, its parent's index."""
    uuid: str
    """UUID: "GPU-..." for a GPU, "MIG-..." for a MIG slice (what CUDA_VISIBLE_DEVICES accepts)."""
    name: str
    """Board name as NVML reports it, e.g. "NVIDIA A100-SXM4-80GB"."""
    total_bytes: int | None
    """Memory of the device (of the slice, for MIG); None when NVML could not read it."""
    used_bytes: int | None
    """Memory in use by every process on the device, plus what the driver reserves."""
    free_bytes: int | None
    """Memory free for new allocations."""
    compute_capability: tuple[int, int] | None
    """CUDA compute capability (major, minor); None when NVML could not read it."""
    mig_mode: bool | None
    """Whether MIG is enabled on the (parent) GPU; None where the GPU does not support MIG."""
    mig_index: int | None = None
    """Index of the MIG slice within its parent GPU; None for a whole GPU."""
    processes: tuple[GpuProcess, ...] = ()
    """Compute processes on the device, as listed at the moment of the reading."""
    opened: bool = True
    """False where NVML could not open the GPU (nvmlDeviceGetHandleByIndex failed): a place-holder keeping CUDA
    ordinals in order, with no figures."""

    @property
    def bf16_supported(self) -> bool | None:
        """Native bf16 (sm_80+); None when the compute capability is unknown."""
        return None if self.compute_capability is None else supports_bf16(self.compute_capability)

    def process_bytes(self, pid: int) -> int | None:
        """Memory `pid` held on this device in this reading; None when it is not listed (see
        process_gpu_bytes for why a process can be missing) or NVML cannot attribute it."""
        return _sum_for_pid(self.processes, pid)


_PROCESS_FUNCS = ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2",
                  "nvmlDeviceGetComputeRunningProcesses")


def _processes(handle: Any, *, names: bool = True) -> tuple[GpuProcess, ...]:
    """Compute processes via the newest process-list function both nvidia-ml-py and driver have."""
    for func_name in _PROCESS_FUNCS:
        raw = nvml_query(func_name, handle, default=NA, if_missing=None)
        if raw is not None:
            break
    if not raw:  # NA (query failed) or an empty list
        return ()
    return tuple(
        GpuProcess(pid=int(p.pid), used_bytes=None if p.usedGpuMemory is None else int(p.usedGpuMemory),
                   name=nvml_query("nvmlSystemGetProcessName", p.pid, default=None) if names else None)
        for p in raw
    )


def _sum_for_pid(processes: tuple[GpuProcess, ...], pid: int) -> int | None:
    mine = [p.used_bytes for p in processes if p.pid == pid]
    return None if not mine or None in mine else sum(mine)


def _read(handle: Any, *, index: int, mig_index: int | None = None,
          parent: Any = None) -> GpuInfo:
    board = handle if parent is None else parent
    total, used, free = memory_bytes(nvml_query("nvmlDeviceGetMemoryInfo", handle))
    cc = nvml_query("nvmlDeviceGetCudaComputeCapability", board)
    mig = nvml_query("nvmlDeviceGetMigMode", board)
    try:
        capability = None if cc is NA else (int(cc[0]), int(cc[1]))
        mig_mode = None if mig is NA else bool(mig[0])  # [current, pending]: 1 is enabled
    except (*_BINDING_ERRORS, IndexError):
        capability, mig_mode = None, None
    uuid, name = nvml_query("nvmlDeviceGetUUID", handle, default=""), nvml_query("nvmlDeviceGetName", handle,
                                                                                  default="unknown")
    return GpuInfo(
        index=index, mig_index=mig_index, uuid=uuid if isinstance(uuid, str) else "",
        name=name if isinstance(name, str) else "unknown",
        total_bytes=total, used_bytes=used, free_bytes=free, compute_capability=capability, mig_mode=mig_mode,
        processes=_processes(handle),
    )


def memory_bytes(memory: Any) -> tuple[int | None, int | None, int | None]:
    """(total, used, free) of an nvmlMemory_t, or Nones when the reading failed or is malformed."""
    if memory is NA:
        return None, None, None
    try:
        return int(memory.total), int(memory.used), int(memory.free)
    except _BINDING_ERRORS:
        return None, None, None


def list_gpus() -> tuple[GpuInfo, ...]:
    """Every GPU on this machine in NVML order (whole GPUs; MIG slices come via visible_gpus)."""
    count = nvml_query("nvmlDeviceGetCount", default=0)
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= 1024:
        warn_once("count", "NVML nvmlDeviceGetCount gave %r; no GPU is listed", count)
        count = 0
    gpus = []
    for index in range(count):
        handle = nvml_query("nvmlDeviceGetHandleByIndex", index)
        if handle is not NA:
            gpus.append(_read(handle, index=index))
        else:  # it stays in its place, so that CUDA ordinals still map to the right GPUs
            gpus.append(GpuInfo(index=index, uuid="", name="unknown (NVML cannot open it)", total_bytes=None,
                                used_bytes=None, free_bytes=None, compute_capability=None, mig_mode=None,
                                opened=False))
    return tuple(gpus)


def answers(gpu: GpuInfo) -> bool:
    """Whether NVML gave this GPU's memory: a total above 0 and a free figure."""
    return bool(gpu.total_bytes) and gpu.total_bytes > 0 and gpu.free_bytes is not None


def why_silent(gpu: GpuInfo) -> str:
    """Why a GPU that does not `answer` is left out, in words."""
    if not gpu.opened:
        return "NVML cannot open it (nvmlDeviceGetHandleByIndex failed)"
    if gpu.total_bytes == 0:
        return "NVML reports 0 bytes of memory on it"
    return "NVML cannot read its memory (nvmlDeviceGetMemoryInfo failed)"


def mig_slices(gpus: tuple[GpuInfo, ...]) -> tuple[GpuInfo, ...]:
    """The MIG slices configured on `gpus` (those in MIG mode), each read as a GPU of its own."""
    slices = []
    for gpu in gpus:
        if not gpu.mig_mode:
            continue
        parent = nvml_query("nvmlDeviceGetHandleByIndex", gpu.index)
        if parent is NA:
            continue
        for mig_index in range(nvml_query("nvmlDeviceGetMaxMigDeviceCount", parent, default=0)):
            handle = nvml_query("nvmlDeviceGetMigDeviceHandleByIndex", parent, mig_index)
            if handle is not NA:  # NotFound: no slice configured at this position
                slices.append(_read(handle, index=gpu.index, mig_index=mig_index, parent=parent))
    return tuple(slices)


def process_gpu_bytes(pid: int, gpu: GpuInfo | int) -> int | None:
    """GPU memory held by process `pid` on `gpu` (a GpuInfo, or an NVML index), read now: this
    process's own share, apart from the device's `used`. None when NVML cannot tell: unavailable,
    the query failed, or `pid` is not listed (no CUDA context yet, or a container whose PID
    namespace hides the host PIDs that NVML reports)."""
    if isinstance(gpu, GpuInfo):
        handle = nvml_query("nvmlDeviceGetHandleByUUID", gpu.uuid)
    else:
        handle = nvml_query("nvmlDeviceGetHandleByIndex", gpu)
    if handle is NA:
        return None
    return _sum_for_pid(_processes(handle, names=False), pid)


__all__ = ["NA", "GpuInfo", "GpuProcess", "answers", "list_gpus", "mig_slices", "nvml_available", "nvml_query",
           "nvml_unavailable_reason", "process_gpu_bytes", "set_backend", "warn_once", "why_silent"]
