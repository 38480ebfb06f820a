"""What the estimate is for: CPU execution, or a CUDA GPU (local, or a named model from the catalog); and what
the target implies: the precision it runs, its allocator model and its CUDA overheads."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from memplan.estimator.errors import EstimateError
from memplan.estimator.step import Loop, PrecisionPolicy

TRACE_ON_CPU_ENV = "MEMPLAN_TRACE_ON_CPU"
"""Where a CUDA target is traced. Unset or 1 (the default): on fake CPU tensors with CUDA's semantics emulated
(memplan.estimator.cuda), on every machine. 0: on fake CUDA tensors where this torch has CUDA and a GPU (the native
trace), a diagnostic. The emulated trace is the default on GPU machines too because it is the one that matches the
GPUs' max_memory_allocated: on an H200 (torch 2.11, session 9) its error was never larger than the native trace's,
at default settings (33 zoo cases, benchmarks/results/gpu_campaign_raw/part1b.json, part1c.json: native
llama-gqa-b4-bf16mixed +0.67 %, llama-gqa-b2-bf16true +0.64 %, gpt2-b4 +0.17 % where emulated read 0.00 %;
gpt2-b8-bf16mixed +0.17 % against +0.07 %) and under expandable segments (12 cases, gpu_campaign_raw_expandable:
mixtral-moe-b4 -3.23 %, llama-gqa-b2 -2.58 % against 0.00 %). On reserved bytes the two differ both ways by up to
0.3 % (llama-gqa-b2 under expandable segments: native -2.88 %, emulated -3.19 %)."""


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
    """Device of the fake tensors: 'cpu' (CUDA targets emulated), or 'cuda' where MEMPLAN_TRACE_ON_CPU=0 asks for it
    and this torch has CUDA and a GPU."""

    @property
    def emulates_cuda(self) -> bool:
        """A CUDA target traced on fake CPU tensors, with CUDA's op semantics emulated."""
        return self.is_cuda and self.trace_device == "cpu"


GENERIC_CUDA = "generic CUDA GPU (sm80)"


def resolve_target(device) -> Target:
    """'cpu', a GPU model name from the catalog, a `memplan.hardware.GpuModel` (e.g. from
    `custom_gpu("24GiB")`), or None for the local GPU (a generic sm80 GPU when there is none, with a note)."""
    from memplan.hardware.catalog import GpuModel, UnknownGpu, lookup_gpu

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
        from memplan.hardware.readings import cuda_device_facts

        facts = cuda_device_facts()
        if facts is not None:
            return Target(name=facts.name, is_cuda=True, compute_capability=facts.compute_capability,
                          total_bytes=facts.total_bytes, trace_device=trace_device)
        return Target(name=GENERIC_CUDA, is_cuda=True, compute_capability=(8, 0), trace_device="cpu")
    try:
        model = lookup_gpu(device)
    except UnknownGpu as err:  # (named as this argument, not as the command line's --gpu)
        raise ValueError(f"device: {err.what}") from None
    return _gpu_target(model)


def _gpu_target(model) -> Target:
    return Target(
        name=model.name, is_cuda=True, compute_capability=tuple(model.compute_capability),
        total_bytes=model.total_bytes, trace_device=_trace_device(),
    )


def _trace_device() -> str:
    value = os.environ.get(TRACE_ON_CPU_ENV, "").strip() or "1"  # (set but empty: as unset)
    if value not in ("0", "1"):
        raise ValueError(f"{TRACE_ON_CPU_ENV}={value!r}: set it to 1 (trace CUDA targets on CPU with CUDA emulated, "
                         "the default) or 0 (on fake CUDA tensors where this machine has a GPU), or unset it")
    return "cuda" if value == "0" and torch.cuda.is_available() else "cpu"


def check_precision_on_target(policy: PrecisionPolicy, target: Target) -> None:
    """Refuse a bf16 precision on a GPU without bf16 (compute capability below 8.0)."""
    uses_bf16 = torch.bfloat16 in (policy.autocast_dtype, policy.param_dtype)
    if uses_bf16 and target.is_cuda and target.compute_capability < (8, 0):
        major, minor = target.compute_capability
        raise EstimateError(
            f"precision {policy.precision!r} needs bf16, which {target.name} (sm{major}{minor}) does not "
            "support (it needs compute capability 8.0+); use precision='16-mixed'"
        )


def precision_lightning_runs(policy: PrecisionPolicy, target: Target, loop: Loop) -> tuple[PrecisionPolicy, str]:
    """The precision the step runs in, and a note when it is not the one asked for: Lightning's
    Trainer(accelerator="cpu", precision="16-mixed") runs bf16-mixed (AMP with float16 is not supported
    on CPU: pytorch_lightning's _AcceleratorConnector._check_and_init_precision, Lightning 2.x). A plain
    loop (loop="torch") runs what its own autocast says, float16 on CPU too."""
    if policy.precision == "16-mixed" and not target.is_cuda and loop == "lightning":
        return PrecisionPolicy.from_string("bf16-mixed"), (
            "precision '16-mixed' on a CPU target: Lightning runs bf16-mixed there (AMP with float16 is not "
            "supported on CPU), so the step was traced in bf16-mixed, as Lightning trains it")
    return policy, ""


def memory_model(target: Target):
    """The allocator model: exact bytes on CPU, the CUDA caching allocator (PYTORCH_CUDA_ALLOC_CONF) on a GPU."""
    from memplan.estimator.allocator import AllocatorConfig, CachingAllocatorModel, ExactAllocatorModel

    if not target.is_cuda:
        return ExactAllocatorModel()
    return CachingAllocatorModel(config=AllocatorConfig.from_env())


LIGHTNING_DETERMINISTIC_CUBLAS = ":4096:8"
"""CUBLAS_WORKSPACE_CONFIG as Lightning's Trainer(deterministic=True or "warn") sets it in the training process
(accelerator_connector.py `_set_torch_flags`, over any value the user set), for cuBLAS's reproducibility."""


def target_overheads(target: Target, *, deterministic=False, loop: Loop = "lightning"):
    """CUDA memory besides tensors (context, cuBLAS workspaces) for a GPU target; None on CPU. A Lightning step
    with deterministic algorithms (True or "warn") has Lightning's CUBLAS_WORKSPACE_CONFIG."""
    if not target.is_cuda:
        return None
    from memplan.estimator.cuda.overheads import cuda_overheads

    env = os.environ
    if deterministic and loop == "lightning":
        env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": LIGHTNING_DETERMINISTIC_CUBLAS}
    return cuda_overheads(target.compute_capability, env)


def set_up_cuda_tracker(tracker, overheads, target: Target, deterministic) -> None:
    """A CUDA target's tracker: the library workspaces taken at first use (cuBLAS(Lt) at each thread's first call,
    cuDNN's per conv and RNN), reductions' staging, the GPU's architecture and SMs and the deterministic-algorithms
    setting for the ops' own temporaries (cuda/op_scratch.py)."""
    from memplan.estimator.cuda.conv_workspace import ConvWorkspaces
    from memplan.estimator.cuda.op_scratch import CudaGpu
    from memplan.estimator.cuda.reductions import ReductionStaging
    from memplan.estimator.cuda.rnn import CudnnRnnBuffers
    from memplan.hardware.catalog import streaming_multiprocessors

    cc = target.compute_capability
    tracker.workspaces = overheads.library_workspaces(
        ConvWorkspaces(cc, benchmark=torch.backends.cudnn.benchmark),
        CudnnRnnBuffers(sm_count=streaming_multiprocessors(target.name, cc)))
    tracker.reductions = ReductionStaging.for_gpu(target.name, cc)
    tracker.cuda_gpu = CudaGpu.for_gpu(target.name, cc)
    tracker.deterministic = deterministic
