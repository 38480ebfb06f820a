"""Which GPUs this process sees: CUDA_VISIBLE_DEVICES read as CUDA reads it (ordinals, or GPU-/MIG- UUID
prefixes; the first bad entry ends the list, a repeat empties it), mapped onto NVML's GPUs, and why it hides
some when it does. LOCAL_RANK -> CUDA index -> physical GPU (nvitop's `CudaDevice`)."""
from __future__ import annotations

import os
from collections.abc import Mapping

from memplan.hardware.nvml import GpuInfo, list_gpus, mig_slices, warn_once


def visibility_problem(env: Mapping[str, str] = os.environ) -> str | None:
    """Why CUDA_VISIBLE_DEVICES hides some or all of this machine's GPUs, naming the variable and its
    value and the entry CUDA stops at; None when it is unset or every entry is a GPU here."""
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    shown = value if len(value) <= 60 else value[:57] + "..."
    if not value.strip():
        return f"CUDA_VISIBLE_DEVICES={shown!r} is empty, which hides every GPU; unset it or list GPU indices"
    gpus = list_gpus()
    prefix = "GPU-" if value.startswith("GPU-") else "MIG-" if value.startswith("MIG-") else None
    candidates = gpus if prefix != "MIG-" else mig_slices(gpus)
    seen: list[GpuInfo] = []
    for entry in (e.strip() for e in value.split(",")):
        if prefix is None:
            ordinal = _leading_int(entry)
            if ordinal is None:
                return (f"CUDA_VISIBLE_DEVICES={shown!r}: {entry!r} is not a GPU index or UUID; CUDA stops reading "
                        f"there{_kept(seen)}. This node has {len(gpus)} GPU(s) (0-{len(gpus) - 1})"
                        if gpus else f"CUDA_VISIBLE_DEVICES={shown!r}: {entry!r} is not a GPU index or UUID")
            if ordinal >= len(gpus):
                return (f"CUDA_VISIBLE_DEVICES={shown!r}: GPU {ordinal} does not exist here (NVML lists {len(gpus)} "
                        f"GPU(s){f', 0-{len(gpus) - 1}' if gpus else ''}); CUDA stops reading there{_kept(seen)}")
            match = gpus[ordinal]
        else:
            found = [g for g in candidates if entry.startswith(prefix) and g.uuid.startswith(entry)]
            if len(found) != 1:
                what = "matches no GPU here" if not found else "matches several GPUs"
                return f"CUDA_VISIBLE_DEVICES={shown!r}: {entry!r} {what}; CUDA stops reading there{_kept(seen)}"
            match = found[0]
        if match in seen:
            return (f"CUDA_VISIBLE_DEVICES={shown!r} names {entry!r} twice; CUDA then sees no GPU at all: list each "
                    "GPU once")
        seen.append(match)
    return None



def _kept(seen: list[GpuInfo]) -> str:
    return f" (only the {len(seen)} GPU(s) before it are visible)" if seen else " (no GPU is visible)"



def _leading_int(entry: str) -> int | None:
    """What CUDA's strtoul-style parse reads: '1gpu' -> 1, '+2' -> 2, '', 'x' or '-1' -> None."""
    digits = ""
    entry = entry.strip()
    for ch in entry[1:] if entry.startswith("+") else entry:
        if not ch.isdigit():
            break
        digits += ch
    return int(digits) if digits else None



def _parse_visible(value: str, gpus: tuple[GpuInfo, ...]) -> tuple[GpuInfo, ...]:
    """CUDA_VISIBLE_DEVICES as CUDA (and torch.cuda._parse_visible_devices) reads it: ordinals or
    unique "GPU-"/"MIG-" UUID prefixes; the first invalid entry ends the list; a repeat empties it."""
    prefix = "GPU-" if value.startswith("GPU-") else "MIG-" if value.startswith("MIG-") else None
    candidates = gpus if prefix != "MIG-" else mig_slices(gpus)
    chosen: list[GpuInfo] = []
    for entry in value.split(","):
        entry = entry.strip()
        if prefix is None:
            ordinal = _leading_int(entry)
            match = gpus[ordinal] if ordinal is not None and ordinal < len(gpus) else None
        else:
            found = [g for g in candidates if entry.startswith(prefix) and g.uuid.startswith(entry)]
            match = found[0] if len(found) == 1 else None  # none, or an ambiguous prefix
        if match is None:
            break
        if match in chosen:
            return ()
        chosen.append(match)
    return tuple(chosen)



def visible_gpus(env: Mapping[str, str] = os.environ) -> tuple[GpuInfo, ...]:
    """The GPUs this process's CUDA sees, in CUDA order (position i is cuda:i). Honours
    CUDA_VISIBLE_DEVICES; "" hides every GPU. Ordinals are mapped in NVML (PCI bus) order, which is
    CUDA's order only with CUDA_DEVICE_ORDER=PCI_BUS_ID or identical GPUs."""
    gpus = list_gpus()
    value = env.get("CUDA_VISIBLE_DEVICES")
    if (env.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID" and len({g.name for g in gpus}) > 1
            and not (value or "").startswith(("GPU-", "MIG-"))):
        warn_once("order", "GPUs of different models and CUDA_DEVICE_ORDER is not PCI_BUS_ID: CUDA "
                   "numbers the fastest GPU first, memplan maps cuda:i in nvidia-smi order. Set "
                   "CUDA_DEVICE_ORDER=PCI_BUS_ID so both agree.")
    return gpus if value is None else _parse_visible(value, gpus)



def gpu_for_cuda_index(cuda_index: int, env: Mapping[str, str] = os.environ) -> GpuInfo | None:
    """The GPU behind cuda:<cuda_index> (e.g. trainer.strategy.root_device.index), or None."""
    if cuda_index < 0:
        raise ValueError(f"cuda_index must be >= 0; got {cuda_index}")
    gpus = visible_gpus(env)
    return gpus[cuda_index] if cuda_index < len(gpus) else None



def gpu_for_local_rank(local_rank: int, env: Mapping[str, str] = os.environ) -> GpuInfo | None:
    """LOCAL_RANK -> CUDA index -> physical GPU, for launchers that give rank i the device cuda:i
    (Lightning with devices=N or "auto", torchrun). With Trainer(devices=[1, 3]) rank 0 runs on
    cuda:1: use gpu_for_cuda_index(trainer.strategy.root_device.index) there."""
    if local_rank < 0:
        raise ValueError(f"local_rank must be >= 0 (it is LOCAL_RANK); got {local_rank}")
    return gpu_for_cuda_index(local_rank, env)


__all__ = ["gpu_for_cuda_index", "gpu_for_local_rank", "visibility_problem", "visible_gpus"]
