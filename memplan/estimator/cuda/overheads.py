"""CUDA memory a training process uses besides its tensors.

Two kinds, which land in different places:
- inside the caching allocator: cuBLAS / cuBLASLt workspaces. torch allocates them with
  CUDACachingAllocator::allocate, so they count in max_memory_allocated and reserved. The trace
  takes them as never-freed mallocs at each thread's first cuBLAS (cuBLASLt) call
  (`CudaOverheads.library_workspaces`, memplan.estimator.cuda.workspaces).
- outside it: the CUDA context (driver state and lazily loaded kernel images, cuDNN's once a step
  runs it) and NCCL's communicator buffers. NVML / nvidia-smi see them; torch.cuda.memory_* do not.

sm90's context figures were measured on an H200 (cited below); the other GPUs' context and the NCCL
figures are approximations taken from measurements reported in issues, rounded up; calibrate them
on a real GPU before trusting them to 100 MiB.
"""
from __future__ import annotations

import logging
import os
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from memplan.units import KiB, MiB

log = logging.getLogger(__name__)

# CUDA context + kernel images, CUDA_MODULE_LOADING=LAZY (torch sets LAZY when the variable is
# unset, pytorch/pytorch#86509). Measured bare contexts, after the first CUDA tensor:
#   287,047,680 B used with one 6.4 MB tensor (a 20 MiB segment): ~266 MB context, CUDA 11.7
#   (pytorch/pytorch#86509)
#   "~300MB" (ptrblck, pytorch/pytorch#107667), "around 400MB" (ptrblck, pytorch/pytorch#109888)
#   426 MiB on an RTX 6000 Ada (sm89), torch 2.10 + CUDA 13.0 (unslothai/unsloth-zoo#1053)
# A training step then lazily loads cuBLAS(Lt)/cuDNN/NCCL/Triton kernels: no measurement found for sm70/sm80,
# estimated +100..300 MiB; assumed (unmeasured) to grow with the GPU generation. Range 270..730
# MiB; the values below sit at the top of it (a planner should over- rather than under-estimate).
_CONTEXT_LAZY_BYTES = {7: 512 * MiB, 8: 640 * MiB, 9: 768 * MiB}  # by compute-capability major
# sm90, measured on an NVIDIA H200, driver 580.159.04, torch 2.11.0+cu130 (CUDA 13.0), cuDNN 9.19
# (benchmarks/results/gpu_campaign_raw/part1.json): NVML's per-process bytes less torch's reserved bytes,
#   639,631,360 B after the first tensor (bare context), +69,206,016 B at the first matmul (cuBLAS, the
#   Python thread), +67,108,864 B at the first backward (the autograd thread's cuBLAS handle): 740 MiB;
#   over the zoo's training steps without cuDNN (MLPs, GPT-2, BERT, Llama, Mixtral): 740-742 MiB.
# A step that runs cuDNN (convolutions) loads its handle and kernels besides: +18,874,368 B at the first
# convolution in the probe, 758 MiB in every zoo step with one (CNNs, ResNet-18, MLP-Mixer's patch conv).
_CONTEXT_LAZY_MEASURED_BYTES = {9: 742 * MiB}  # sm90 only; sm100+ keeps the assumed figure above
_CUDNN_CONTEXT_BYTES = {9: 18 * MiB}  # by compute-capability major; 0 (unmeasured) elsewhere
# A step whose attention runs SDPA's flash or memory-efficient kernels in 16 bits loads their kernel images: on the
# same H200 (benchmarks/gpu_context_ops.py; benchmarks/results/gpu_context_ops*_h200.json), NVML's process bytes
# less torch's reserved grew by 16 MiB at a bf16 or fp16 flash forward + backward, 18 MiB at a 16-bit
# memory-efficient one (a masked SDPA), 2 MiB at fp32's memory-efficient or a 16-bit math SDPA (within the 742 MiB
# above); every 16-bit transformer step of the zoo (GPT-2, BERT, Llama, BART, T5; 16-mixed, bf16-mixed, bf16-true)
# read 758 MiB. The growths do not add up: a 16-bit ViT (cuDNN for its patch convolution and 16-bit flash
# attention) read 758 MiB too, as a CNN does. So a step's context is the base plus the larger of the two.
_ATTENTION_16BIT_CONTEXT_BYTES = {9: 16 * MiB}
# CUDA_MODULE_LOADING=EAGER loads every kernel of every library at init: 666,632,192 B
# (pytorch/pytorch#86509, CUDA 11.7), ">1000MB" (pytorch/pytorch#107667). Range 0.65..1.5 GB.
_CONTEXT_EAGER_BYTES = 1536 * MiB
# sm90 (same H200, driver, torch and CUDA as above): 1,310,720,000 B (1250 MiB) after the first tensor
# with CUDA_MODULE_LOADING=EAGER; plus the cuBLAS handles of a step's two threads, measured under LAZY
# (130 MiB, as above, 2 MiB of step kernels), assumed the same under EAGER: 1382 MiB.
_CONTEXT_EAGER_BYTES_BY_MAJOR = {9: 1382 * MiB}

# aten/src/ATen/cuda/CublasHandlePool.cpp (pytorch/pytorch), parseChosenWorkspaceSize():
# ":4096:2:16:8 default, 32MiB for Hopper and Blackwell" -> 4096 KiB x 2 + 16 KiB x 8, or
# 4096 x 8 x 1024 when properties->major is 9, 10, 11 or 12 (older versions: sm90 only).
_CUBLAS_DEFAULT_BYTES = 4096 * KiB * 2 + 16 * KiB * 8  # 8.125 MiB
_CUBLAS_BIG_BYTES = 32 * MiB  # measured on the H200 above: 33,554,432 B on the Python and the autograd thread
_CUBLAS_BIG_MAJORS = (9, 10, 11, 12)
# parseCUDABlasLtWorkspaceSize(): CUBLASLT_WORKSPACE_SIZE in KiB, "default size in KiB
# according to #73328" = 1024. getCUDABlasLtWorkspace() (torch 2.11): a cuBLASLt workspace of its own
# per (handle, stream) unless TORCH_CUBLASLT_UNIFIED_WORKSPACE=1 (`check_env(...) == true`: unset is
# separate). Measured on the H200 above (torch 2.11.0+cu130): a bf16 addmm with a bias left 1,048,576 B
# beyond its output after the thread's cuBLAS workspace was taken. (pytorch main has since unified
# them by default: there this overestimates by 1 MiB per thread.)
_CUBLASLT_DEFAULT_KIB = 1024


@dataclass(frozen=True, kw_only=True)
class CudaOverheads:
    """CUDA memory of one training process besides its tensors, in bytes."""

    context_bytes: int
    """CUDA context and loaded kernel images; outside the caching allocator (NVML sees it)."""
    cublas_workspace_bytes: int
    """One cuBLAS workspace, allocated through the caching allocator per (handle, stream)."""
    cublaslt_workspace_bytes: int = 0
    """A separate cuBLASLt workspace per (handle, stream) (torch 2.11's default); 0 when
    TORCH_CUBLASLT_UNIFIED_WORKSPACE=1 unifies it with cuBLAS's."""
    cudnn_context_bytes: int = 0
    """cuDNN's handle and kernels, loaded into the context by a step's first cuDNN op (convolution)."""
    attention_context_bytes: int = 0
    """Fused attention's 16-bit kernels (flash, memory-efficient), loaded by the first call (not on top of cuDNN's:
    step_context_bytes)."""
    cublas_workspaces: int = 2
    """(handle, stream) pairs a step uses: the Python thread (forward, optimizer) and the
    autograd engine's device thread (backward); cuBLAS handles are per thread."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    """Approximations behind these figures, in words."""

    def __post_init__(self) -> None:
        for name in ("context_bytes", "cublas_workspace_bytes", "cublaslt_workspace_bytes",
                     "cudnn_context_bytes", "attention_context_bytes", "cublas_workspaces"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"CudaOverheads.{name} must be a non-negative int; got {value!r}")

    @property
    def allocator_workspaces(self) -> tuple[int, ...]:
        """Request sizes (bytes) to replay into CachingAllocatorModel.malloc and never free."""
        per_pair = [self.cublas_workspace_bytes]
        if self.cublaslt_workspace_bytes:
            per_pair.append(self.cublaslt_workspace_bytes)
        return tuple(n for n in per_pair * self.cublas_workspaces if n)

    def library_workspaces(self, conv=None, rnn=None):
        """A fresh cuda.workspaces.LibraryWorkspaces for one trace: the workspaces taken at first use, with `conv`
        (a cuda.conv_workspace.ConvWorkspaces) each convolution's for its run, with `rnn` (a fresh
        cuda.rnn.CudnnRnnBuffers) cuDNN RNNs' buffers."""
        from memplan.estimator.cuda.workspaces import LibraryWorkspaces

        return LibraryWorkspaces(self.cublas_workspace_bytes, self.cublaslt_workspace_bytes, conv, rnn)

    def step_context_bytes(self, *, cudnn: bool, attention_16bit: Collection[str] = ()) -> int:
        """The context outside the allocator for a step that did (or did not) run cuDNN, and ran these fused
        attention kernel families in 16 bits: the base and the larger of what each loads (measured on the H200:
        cuDNN and 16-bit flash in one step grew the context as much as cuDNN alone)."""
        return self.context_bytes + max(self.cudnn_context_bytes if cudnn else 0,
                                        self.attention_context_bytes if attention_16bit else 0)


def _check_cc(compute_capability: tuple[int, int]) -> tuple[int, int]:
    cc = tuple(compute_capability)
    if len(cc) != 2 or not all(isinstance(v, int) and v >= 0 for v in cc) or cc[0] < 3:
        raise ValueError("compute_capability must be (major, minor) ints such as (8, 0) for A100 "
                         f"or (9, 0) for H100; got {compute_capability!r}")
    return cc  # type: ignore[return-value]


def cublas_workspace_bytes(compute_capability: tuple[int, int], env: Mapping[str, str] = os.environ) -> int:
    """parseChosenWorkspaceSize(): CUBLAS_WORKSPACE_CONFIG (':SIZE_KiB:COUNT' pairs) or the default."""
    major, _ = _check_cc(compute_capability)
    default = _CUBLAS_BIG_BYTES if major in _CUBLAS_BIG_MAJORS else _CUBLAS_DEFAULT_BYTES
    config = env.get("CUBLAS_WORKSPACE_CONFIG")
    if config is None:
        return default
    pairs = re.findall(r":([0-9]+):([0-9]+)", config)
    if not pairs:  # torch warns "Could not parse CUBLAS_WORKSPACE_CONFIG" and uses the default
        return default
    return sum(int(size) * KiB * int(count) for size, count in pairs)


def cuda_overheads(compute_capability: tuple[int, int], env: Mapping[str, str] = os.environ) -> CudaOverheads:
    """Context and cuBLAS workspaces for a GPU of this compute capability under `env`."""
    major, minor = _check_cc(compute_capability)
    notes = []
    loading = env.get("CUDA_MODULE_LOADING", "LAZY").upper()
    cudnn = _CUDNN_CONTEXT_BYTES.get(major, 0)
    attention = _ATTENTION_16BIT_CONTEXT_BYTES.get(major, 0)
    if loading == "EAGER":  # fused attention's kernels are libtorch_cuda's, loaded at init (cuDNN opens at first use)
        context, attention = _CONTEXT_EAGER_BYTES_BY_MAJOR.get(major, _CONTEXT_EAGER_BYTES), 0
        notes.append("CUDA_MODULE_LOADING=EAGER: every kernel image is loaded at init "
                     + (f"({context // MiB} MiB measured on an H200, torch 2.11 + CUDA 13.0)" if major in
                        _CONTEXT_EAGER_BYTES_BY_MAJOR else "(0.65-1.5 GB reported); 1.5 GiB assumed"))
    elif major in _CONTEXT_LAZY_MEASURED_BYTES:
        context = _CONTEXT_LAZY_MEASURED_BYTES[major]
        notes.append(f"CUDA context for sm{major}{minor} with lazy module loading: {context // MiB} MiB, "
                     f"+{cudnn // MiB} MiB when the step runs cuDNN, else +{attention // MiB} MiB when it runs fused "
                     "attention (flash, memory-efficient) in 16 bits, as measured on an H200 (driver 580, torch 2.11 "
                     "+ CUDA 13.0); `memplan validate` on this GPU measures it for this machine")
    else:
        context = _CONTEXT_LAZY_BYTES[min(max(major, 7), 9)]
        notes.append(f"CUDA context for sm{major}{minor} with lazy module loading: {context // MiB} MiB assumed, "
                     "unmeasured (bare contexts are reported at 266-426 MiB, plus an estimated 100-300 MiB of "
                     "kernels loaded during a step, set high on purpose); `memplan validate` on this GPU measures it")
    calibrated = _calibrated_context((major, minor), env)
    if calibrated is not None:  # measured on this machine by a step (with or without cuDNN): used as it is
        context, cudnn, attention = calibrated[0], 0, 0
        notes[-1] = calibrated[1]
    cublas = cublas_workspace_bytes((major, minor), env)
    if "CUBLAS_WORKSPACE_CONFIG" in env:
        notes.append(f"cuBLAS workspace from CUBLAS_WORKSPACE_CONFIG: {cublas} bytes per handle")
    unified = env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE") == "1"  # c10::utils::check_env: "1" true, "0" false
    lt = 0
    if not unified:
        raw = env.get("CUBLASLT_WORKSPACE_SIZE", "")
        lt_kib = int(raw) if raw.strip().isdigit() else _CUBLASLT_DEFAULT_KIB  # torch warns, keeps 1024
        lt = lt_kib * KiB
    notes.append("cuBLAS workspaces come from the caching allocator: one per (thread handle, "
                 "stream), taken at the thread's first matmul (forward thread, autograd backward thread)"
                 + (f", and {lt // KiB} KiB more at its first cuBLASLt call (addmm with a bias)" if lt else ""))
    return CudaOverheads(context_bytes=context, cublas_workspace_bytes=cublas, cublaslt_workspace_bytes=lt,
                         cudnn_context_bytes=cudnn, attention_context_bytes=attention, notes=tuple(notes))


def _calibrated_context(compute_capability: tuple[int, int], env: Mapping[str, str]) -> tuple[int, str] | None:
    """(context bytes, note) from `memplan validate`'s saved calibration of this machine's GPU, driver,
    torch and CUDA when one matches (see memplan.estimator.calibration); None otherwise."""
    from memplan.estimator.calibration import local_calibration

    try:
        found = local_calibration(compute_capability, env)
    except ValueError as err:  # an unreadable calibration file: warn, keep the sourced figure
        log.warning("ignoring the CUDA calibration: %s", err)
        return None
    if found is None:
        return None
    calibration, path = found
    return calibration.context_bytes, (
        f"CUDA context {calibration.context_bytes / MiB:.0f} MiB measured by memplan validate on "
        f"{calibration.key.as_str()} ({path}), used as it is: the kernels its own steps loaded are in it, "
        "others this step loads (cuDNN, 16-bit fused attention: up to 18 MiB on an H200) are not")


# NVIDIA/nccl src/init.cc: DEFAULT_BUFFSIZE (1 << 22) /* 4MiB */ for the Simple protocol;
# DEFAULT_LL_BUFFSIZE = NCCL_LL_LINES_PER_THREAD*NCCL_LL_MAX_NTHREADS*NCCL_STEPS*16 = 8*512*8*16;
# DEFAULT_LL128_BUFFSIZE = NCCL_LL128_ELEMS_PER_THREAD*NCCL_LL128_MAX_NTHREADS*NCCL_STEPS*8
# = 120*640*8*8. Overridden by NCCL_BUFFSIZE, NCCL_LL_BUFFSIZE, NCCL_LL128_BUFFSIZE (bytes).
_NCCL_SIMPLE_BYTES = 4 * MiB
_NCCL_LL_BYTES = 8 * 512 * 8 * 16
_NCCL_LL128_BYTES = 120 * 640 * 8 * 8
# Fixed part per communicator (NCCL kernels loaded into the context, work FIFOs, proxy state):
# no source gives it; chosen so the formula lands at or above the measurements below.
_NCCL_FIXED_BYTES = 256 * MiB


def _default_channels(compute_capability: tuple[int, int]) -> int:
    # Channels follow the interconnect: NCCL uses up to 32 per peer pair on 8x H100 NVLink
    # (NVIDIA/nccl#1685), fewer on A100, a handful over PCIe. Defaults assume NVLink servers.
    major = compute_capability[0]
    return 32 if major >= 9 else 16 if major == 8 else 8


def nccl_buffer_bytes(world_size: int, *, compute_capability: tuple[int, int] = (8, 0),
                      channels: int | None = None, env: Mapping[str, str] = os.environ) -> int:
    """NCCL device memory per rank for one DDP process group, outside the caching allocator.

    Model: channels x connections x (Simple + LL + LL128 buffers) + a fixed 256 MiB, with
    2 connections per channel for 2 ranks (a ring's send and receive side) and 4 for more
    (ring plus tree). "The memory usage is linearly tied to the number of channels" and "Ring
    uses a limited amount of memory as it only has 2 connections regardless of the scale"
    (sjeaugey, NVIDIA/nccl#864 / #986). Measured with PyTorch on 4x A100 NVLink: 544 MB for a
    2-rank group, 688 MB for larger ones (NVIDIA/nccl#964); 1.06 GB per GPU on 8x H100 NVLink
    after init (NVIDIA/nccl#1685). This gives 577 MB, 885 MB and 1.50 GB for those three: an
    approximation on the high side, to be calibrated on a GPU. NVLS/CollNet (NCCL_NVLS_ENABLE,
    NVSwitch systems) and all-to-all traffic can add gigabytes and are not modelled.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int (number of DDP ranks); got {world_size!r}")
    if world_size == 1:
        return 0  # a single rank has no peer connections (runtime connect, NCCL >= 2.22)
    cc = _check_cc(compute_capability)
    if channels is None:
        channels = _default_channels(cc)
        if env.get("NCCL_MIN_NCHANNELS", "").isdigit():
            channels = max(channels, int(env["NCCL_MIN_NCHANNELS"]))
        if env.get("NCCL_MAX_NCHANNELS", "").isdigit():
            channels = min(channels, int(env["NCCL_MAX_NCHANNELS"]))
    if not isinstance(channels, int) or channels < 1:
        raise ValueError(f"channels must be a positive int (NCCL channels per rank); got {channels!r}")

    def size(name: str, default: int) -> int:
        raw = env.get(name, "")
        return int(raw) if raw.isdigit() else default

    per_connection = (size("NCCL_BUFFSIZE", _NCCL_SIMPLE_BYTES) + size("NCCL_LL_BUFFSIZE", _NCCL_LL_BYTES)
                      + size("NCCL_LL128_BUFFSIZE", _NCCL_LL128_BYTES))
    connections = 2 if world_size == 2 else 4
    return channels * connections * per_connection + _NCCL_FIXED_BYTES
