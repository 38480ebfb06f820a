"""Hardware memplan plans for: local GPUs through one NVML door, the host through psutil, and a
catalog of GPU models for planning off-box. Every memory figure is an int in bytes."""
from memplan.hardware.catalog import (
    KNOWN_GPUS,
    GpuModel,
    custom_gpu,
    known_gpu_names,
    lookup_gpu,
    match_nvml_name,
    supports_bf16,
)
from memplan.hardware.host import HostInfo, host_info, process_rss_bytes
from memplan.hardware.nvml import (
    NA,
    GpuInfo,
    GpuProcess,
    list_gpus,
    nvml_available,
    nvml_query,
    nvml_unavailable_reason,
    process_gpu_bytes,
    set_backend,
)
from memplan.hardware.visible import gpu_for_cuda_index, gpu_for_local_rank, visible_gpus

__all__ = [
    "KNOWN_GPUS", "NA", "GpuInfo", "GpuModel", "GpuProcess", "HostInfo", "custom_gpu",
    "gpu_for_cuda_index", "gpu_for_local_rank", "host_info",
    "known_gpu_names", "list_gpus", "lookup_gpu", "match_nvml_name", "nvml_available", "nvml_query",
    "nvml_unavailable_reason", "process_gpu_bytes", "process_rss_bytes", "set_backend",
    "supports_bf16", "visible_gpus",
]
