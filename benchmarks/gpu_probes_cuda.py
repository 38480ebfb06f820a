"""benchmarks.gpu_probes' CUDA probes: the memory CUDA and its libraries take outside the caching allocator (the
context, cuBLAS/cuBLASLt workspaces, cuDNN and SDPA kernels, a 1-rank NCCL group) and the allocator's segments,
each read from this process's device memory at named points."""
from __future__ import annotations

import os
import time

from memplan.units import MiB


# --- readings ----------------------------------------------------------------------------------
class Snapshots:
    """Readings of this process's device memory, taken at named points."""

    def __init__(self) -> None:
        import torch

        from memplan.hardware import gpu_for_cuda_index

        self.torch = torch
        before = gpu_for_cuda_index(0)  # NVML only: no CUDA context yet
        self.device_used_before = None if before is None else before.used_bytes
        self.rows: list[dict] = []

    def take(self, label: str) -> dict:
        from memplan.hardware import gpu_for_cuda_index, process_gpu_bytes

        torch = self.torch
        torch.cuda.synchronize()
        gpu = gpu_for_cuda_index(0)
        free, total = torch.cuda.mem_get_info()
        row = {"label": label, "allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
               "nvml_process": None if gpu is None else process_gpu_bytes(os.getpid(), gpu),
               "nvml_device_used": None if gpu is None else gpu.used_bytes, "driver_used": total - free}
        row["outside_allocator"] = self.outside(row)
        self.rows.append(row)
        return row

    def outside(self, row: dict) -> int | None:
        """Bytes this process holds outside the caching allocator (context, kernels, library handles)."""
        if row["nvml_process"] is not None:
            return row["nvml_process"] - row["reserved"]
        if row["nvml_device_used"] is not None and self.device_used_before is not None:
            return row["nvml_device_used"] - self.device_used_before - row["reserved"]
        return None


def _delta(after: dict, before: dict, key: str) -> int | None:
    if after.get(key) is None or before.get(key) is None:
        return None
    return after[key] - before[key]


def _attempt(out: dict, name: str, fn) -> None:
    """Run one sub-measurement; a failure is recorded under errors and the others go on."""
    try:
        out[name] = fn()
    except Exception as err:  # noqa: BLE001 -- one failed sub-measurement must not lose the others
        out.setdefault("errors", {})[name] = f"{type(err).__name__}: {err}"[:2000]


# --- overheads ---------------------------------------------------------------------------------
def overheads() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    snaps = Snapshots()
    out: dict = {"device_used_before_cuda": snaps.device_used_before,
                 "module_loading": os.environ.get("CUDA_MODULE_LOADING", "LAZY (unset)")}
    torch.cuda.init()
    _attempt(out, "allocator", _allocator_segments)  # first: on an empty cache, as the model starts
    _keep = torch.zeros(1, device="cuda")
    out["context"] = snaps.take("context: first tensor")
    _attempt(out, "cublas", lambda: _cublas(snaps))
    _attempt(out, "cudnn", lambda: _cudnn(snaps))
    _attempt(out, "sdpa", lambda: _sdpa(snaps))
    _attempt(out, "nccl_one_rank", lambda: _nccl_one_rank(snaps))
    out["final"] = snaps.take("after every probe")
    out["snapshots"] = snaps.rows
    del _keep
    return out


def _cublas(snaps: Snapshots) -> dict:
    """cuBLAS workspaces: allocator bytes a matmul leaves behind beyond its output, per thread's handle."""
    import torch

    n = 1024
    a, b = torch.randn(n, n, device="cuda"), torch.randn(n, n, device="cuda")
    before = snaps.take("cublas: before the first matmul")
    c = a @ b
    after = snaps.take("cublas: after the first fp32 matmul (main thread)")
    out = {"main_thread_workspace": _delta(after, before, "allocated") - c.numel() * c.element_size(),
           "main_thread_outside_allocator": _delta(after, before, "outside_allocator")}
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
        cleared = snaps.take("cublas: after _cuda_clearCublasWorkspaces")
        out["cleared_workspaces"] = -_delta(cleared, after, "allocated")
        c = a @ b  # the workspace back, as in training
    w = torch.randn(n, n, device="cuda", requires_grad=True)
    x = torch.randn(n, n, device="cuda")
    before = snaps.take("cublas: before the first backward")
    loss = (x @ w).sum()
    loss.backward()
    del loss
    after = snaps.take("cublas: after a backward (autograd's device thread)")
    out["autograd_thread_workspace"] = _delta(after, before, "allocated") - w.grad.numel() * w.grad.element_size()
    xb, wb, bias = (t.to(torch.bfloat16) for t in (x, w.detach(), torch.randn(n, device="cuda")))
    before = snaps.take("cublaslt: before a bf16 addmm")
    y = torch.nn.functional.linear(xb, wb, bias)  # cublasLt with a bias epilogue
    after = snaps.take("cublaslt: after a bf16 addmm")
    out["cublaslt_extra_workspace"] = _delta(after, before, "allocated") - y.numel() * y.element_size()
    out["cublaslt_outside_allocator"] = _delta(after, before, "outside_allocator")
    out["env"] = {k: os.environ.get(k) for k in ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE",
                                                  "TORCH_CUBLASLT_UNIFIED_WORKSPACE")}
    return out


def _cudnn(snaps: Snapshots) -> dict:
    """cuDNN: the handle and kernels outside the allocator, the workspace as a transient inside it."""
    import torch

    conv = torch.nn.Conv2d(64, 64, 3, padding=1).cuda()
    x = torch.randn(32, 64, 56, 56, device="cuda", requires_grad=True)
    before = snaps.take("cudnn: before the first convolution")
    torch.cuda.reset_peak_memory_stats()
    conv(x).sum().backward()
    after = snaps.take("cudnn: after a convolution forward + backward")
    return {"outside_allocator": _delta(after, before, "outside_allocator"),
            "peak_allocated_above_start": torch.cuda.max_memory_allocated() - before["allocated"],
            "benchmark": torch.backends.cudnn.benchmark, "version": torch.backends.cudnn.version()}


def _sdpa(snaps: Snapshots) -> dict:
    """Scaled dot-product attention in bf16 (flash on sm80+): kernels loaded outside the allocator."""
    import torch
    import torch.nn.functional as F

    q, k, v = (torch.randn(4, 8, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    before = snaps.take("sdpa: before the first attention")
    F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    after = snaps.take("sdpa: after attention forward + backward")
    return {"outside_allocator": _delta(after, before, "outside_allocator")}


def _nccl_one_rank(snaps: Snapshots) -> dict:
    """A 1-rank NCCL group and one all-reduce: NCCL's fixed part (no peers, so no channel buffers)."""
    import torch
    import torch.distributed as dist

    if not dist.is_nccl_available():
        return {"skipped": "torch has no NCCL"}
    before = snaps.take("nccl: before init")
    store = dist.HashStore()
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        t = torch.ones(1 << 20, device="cuda")
        dist.all_reduce(t)
        after = snaps.take("nccl: after a 1-rank all-reduce")
    finally:
        dist.destroy_process_group()
    return {"outside_allocator": _delta(after, before, "outside_allocator"),
            "nccl_version": ".".join(map(str, torch.cuda.nccl.version()))}


ALLOCATOR_SEQUENCE = (512, 1, 1 * MiB, 1 * MiB + 1, 5 * MiB, 10 * MiB - 1, 10 * MiB, 10 * MiB + 1, 37 * MiB + 3,
                      100 * MiB + 1, 2 * MiB, 512 * 1024)
"""Request sizes (bytes) held at once, then freed in order and requested again: segment rounding, splits, reuse."""


def _allocator_segments() -> dict:
    """torch's reserved/allocated after each step of a fixed sequence vs memplan's CachingAllocatorModel."""
    import torch

    from memplan.estimator.allocator import AllocatorConfig, CachingAllocatorModel

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base_alloc, base_res = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    model = CachingAllocatorModel(AllocatorConfig.from_env())
    real, handles, rows = [], [], []

    def row(op: str) -> None:
        rows.append({"op": op, "allocated": torch.cuda.memory_allocated() - base_alloc,
                     "reserved": torch.cuda.memory_reserved() - base_res,
                     "model_allocated": model.allocated_bytes, "model_reserved": model.reserved_bytes})

    for n in ALLOCATOR_SEQUENCE:
        real.append(torch.empty(n, dtype=torch.uint8, device="cuda"))
        handles.append(model.malloc(n))
        row(f"malloc {n}")
    for i in range(0, len(real), 2):
        real[i] = None
        model.free(handles[i])
        row(f"free #{i}")
    for n in reversed(ALLOCATOR_SEQUENCE):
        real.append(torch.empty(n, dtype=torch.uint8, device="cuda"))
        handles.append(model.malloc(n))
        row(f"malloc {n} again")
    mismatches = sum(r["reserved"] != r["model_reserved"] or r["allocated"] != r["model_allocated"] for r in rows)
    real.clear()
    torch.cuda.empty_cache()
    return {"rows": rows, "mismatches": mismatches,
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")}


def context() -> dict:
    """The context alone: init, one tensor, one reading (for CUDA_MODULE_LOADING=EAGER)."""
    import torch

    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    snaps = Snapshots()
    torch.cuda.init()
    _keep = torch.zeros(1, device="cuda")
    started = time.perf_counter()
    row = snaps.take("context: first tensor")
    return {"module_loading": os.environ.get("CUDA_MODULE_LOADING", "LAZY (unset)"), "context": row,
            "seconds": time.perf_counter() - started, "kept": _keep.numel()}

