"""The planner's two cost models: relative training throughput, and host RAM per rank.

Throughput
----------
Candidates that fit are ranked by a relative throughput (samples per second, in arbitrary units):

    speed = world_size x DDP_EFFICIENCY ** log2(world_size)       data parallelism
          x m / (m + MICRO_BATCH_K)                                 micro-batch m keeps the GPU busy
          x CHECKPOINT_FACTOR           if checkpointing            recompute of each block's forward
          x AMP_SPEEDUP                 if AMP on tensor cores      bf16-mixed / 16-mixed vs 32-true
          x GRAD_SCALER_FACTOR          if 16-mixed                 the GradScaler's unscale + inf check
          x (1 - ACCUMULATION_OVERHEAD x (1 - 1/accumulation))      extra micro-steps' loop overhead

- Data parallelism: each rank adds its samples; DDP overlaps the gradient all-reduce with backward
  but not completely. 5% lost per doubling of ranks (a ring all-reduce's time grows slowly with the
  ring) keeps adding a GPU always worthwhile (2 x 0.95 > 1): 8 GPUs -> 6.9x, 64 -> 47x. Multi-node
  rings pay more per hop; the planner searches GPUs per node with the node count fixed, so a
  per-node factor would not change the ranking and is left out.
- Micro-batch: per-sample throughput rises with the micro-batch and saturates; m / (m + 1) gives half
  speed at 1 and 89% at 8. K = 1 suits transformer steps with long sequences; small images would
  want a larger K. It is the knob that trades checkpointing against micro-batch: with K = 1, no
  checkpointing at micro-batch 4 (0.80) beats checkpointing at any micro-batch (< 0.75).
- Checkpointing recomputes one forward in backward: a step is ~1 forward + ~2 backward, so +1/3
  compute -> x 0.75.
- AMP: half-precision matmuls on tensor cores (sm70+) run at >= 2x the fp32 rate (Lightning does not
  turn on TF32), so x 2 for bf16-mixed / 16-mixed on sm70+, x 1 on older GPUs.
- 16-mixed runs a GradScaler (unscale and an inf check over all gradients, skipped steps on
  overflow): x 0.99, which makes bf16-mixed win ties where the GPU has it.
- Gradient accumulation: Lightning skips DDP's all-reduce on non-final micro-steps (no_sync), so the
  cost is only per-micro-step loop overhead: at most 2%. The small-micro-batch cost is in m/(m+K).

Data-parallel communication: FSDP against DDP
----------------------------------------------
The factors above rank DDP candidates. An FSDP candidate is the DDP candidate of the same setting
with its communication swapped: its speed is the DDP speed x (T + E_ddp) / (T + E_fsdp), where T is
the compute time of one optimizer step and E the communication time that compute cannot hide:

    T = 6 x params x tokens_per_sample x micro x accumulation / (flops x MFU)   (x 4/3 if checkpointing;
        flops halved for 32-true)
    E = max(0, C - OVERLAP x T)
    ring all-reduce of B bytes over n ranks: 2 (n - 1) / n x B / bw;  all-gather / reduce-scatter: (n - 1) / n x B / bw
    C_ddp          = all-reduce(grads) once per optimizer step (Lightning's no_sync skips it while accumulating)
    C_full_shard   = per micro-step: all-gather(params) in forward and again in backward + reduce-scatter(grads)
    C_shard_grad_op= per micro-step: all-gather(params) once (kept to backward) + reduce-scatter(grads)
    C_hybrid       = C_full_shard within a node (n = GPUs per node, NVLink) + per micro-step all-reduce of
                     the 1/n gradient shard across nodes (network)
    C_offload      = C_full_shard + per micro-step PCIe copies of the shard (params in, gradients out)
                     + the optimizer step on the host over the shard, which nothing hides
    params and grads in fp32 (4 bytes each: the planner does not set FSDP's param_dtype).
On top, FSDP_ENGINE_FACTOR (x 0.95) for what FSDP costs beyond the bytes it moves: copying each block's
parameters into and out of the all-gather buffers, its per-block hooks and stream waits. It is a
chosen figure (a GPU measure is owed), and it also makes DDP, the simpler engine, win unless FSDP
is predicted clearly faster; the search then does not trace FSDP for a model that DDP fits well.

bw is the catalog's per-GPU link (memplan.hardware.catalog.gpu_links: NVLink or PCIe inside a node,
INTER_NODE_BYTES_PER_S between nodes, a ring over several nodes runs at the slower of the two)
x COMM_EFFICIENCY. Lightning's ModelParallelStrategy / FSDPStrategy keep gradient sync on while
accumulating, hence FSDP's per-micro-step reduce-scatter.

Host RAM per rank
-----------------
    RANK_RUNTIME_BYTES + model_init_bytes + num_workers x WORKER_BYTES
    + batch_bytes x (num_workers x prefetch_factor + 1) + (2 x batch_bytes if pin_memory)

The runtime (Python, torch and CUDA libraries, the CUDA driver's host allocations) is ~2 GiB RSS per
CUDA process; each DataLoader worker is a forked copy whose touched pages (refcounts) grow to
~0.5 GiB; each worker keeps prefetch_factor batches and the training step holds one more; pinned
batches are a second copy, rounded up to a power of two by torch's CachingHostAllocator (so 2x).
These are approximations on the high side; a plan is only as good as host_available_bytes.
With FSDP CPU offload a rank also holds its shard of the training state in host RAM:
OFFLOAD_BYTES_PER_PARAM x params / shard degree.
"""
from __future__ import annotations

import math

from memplan.hardware.catalog import INTER_NODE_BYTES_PER_S, gpu_links
from memplan.planner.request import HostLoad
from memplan.units import GiB, MiB

DDP_EFFICIENCY = 0.95
"""Throughput kept per doubling of data-parallel ranks."""
MICRO_BATCH_K = 1
"""Micro-batch at which per-sample throughput is half of its saturated value (m / (m + K))."""
CHECKPOINT_FACTOR = 0.75
"""Throughput with activation checkpointing: one extra forward, ~1/3 of a step."""
AMP_SPEEDUP = 2.0
"""bf16-mixed / 16-mixed vs 32-true on tensor-core GPUs (sm70+)."""
TENSOR_CORE_MIN_CAPABILITY = (7, 0)
"""First compute capability with tensor cores (Volta)."""
GRAD_SCALER_FACTOR = 0.99
"""16-mixed's GradScaler cost relative to bf16-mixed."""
ACCUMULATION_OVERHEAD = 0.02
"""Largest throughput loss from many accumulation micro-steps (loop and hook overhead)."""

RANK_RUNTIME_BYTES = 2 * GiB
"""Host RSS of one CUDA training process before the model and data: Python, torch, CUDA libraries."""
WORKER_BYTES = 512 * MiB
"""Host RSS of one forked DataLoader worker (copy-on-write pages it touches)."""


COMM_EFFICIENCY = 0.7
"""Fraction of a link's bandwidth a NCCL ring reaches (nccl-tests bus bandwidth on NVLink and IB)."""
MFU = 0.4
"""Model FLOPs utilisation of a well-tuned transformer step (the compute-time estimate's efficiency)."""
OVERLAP = 0.8
FSDP_ENGINE_FACTOR = 0.95
"""FSDP's throughput beyond its communication: all-gather copy-in/copy-out, per-block hooks (module docstring)."""
"""Fraction of the compute time that collectives can hide behind (prefetch and bucketing are not perfect)."""
PCIE_BYTES_PER_S = 25e9
"""Host<->GPU copies of CPU offload (PCIe 4.0/5.0 x16 in practice, pinned memory)."""
HOST_OPTIMIZER_BYTES_PER_S = 10e9
"""Memory bandwidth one rank's host-side optimizer step gets (a socket's bandwidth shared by its ranks)."""
OFFLOAD_BYTES_PER_PARAM = 16
"""Host bytes per parameter under CPU offload: fp32 parameter, gradient and Adam's two states."""


def _compute_seconds(*, parameter_count: int, tokens_per_sample: int, samples: int, precision: str,
                     checkpointing: bool, flops: float) -> float:
    seconds = 6.0 * parameter_count * tokens_per_sample * samples / (flops * MFU)
    if precision not in ("bf16-mixed", "16-mixed"):
        seconds *= AMP_SPEEDUP
    return seconds / CHECKPOINT_FACTOR if checkpointing else seconds


def communication_seconds(*, sharding: str | None, offload: bool = False, world_size: int, gpus_per_node: int,
                          nodes: int, accumulate_grad_batches: int, parameter_count: int, gpu_name: str) -> float:
    """Communication time of one optimizer step (see the module docstring); sharding None is DDP."""
    links = gpu_links(gpu_name)
    intra = links.intra_node_bytes_per_s * COMM_EFFICIENCY
    inter = min(links.intra_node_bytes_per_s, INTER_NODE_BYTES_PER_S) * COMM_EFFICIENCY
    state = 4.0 * parameter_count
    if world_size == 1:
        return 0.0

    def ring(n: int, bw: float) -> float:  # all-gather or reduce-scatter of `state` over n ranks
        return (n - 1) / n * state / bw

    bw = intra if nodes == 1 else inter
    if sharding is None:
        return 2 * ring(world_size, bw)
    if sharding == "NO_SHARD":
        return 2 * ring(world_size, bw) * accumulate_grad_batches
    if sharding == "HYBRID_SHARD":
        per_micro = 3 * ring(gpus_per_node, intra) + 2 * (nodes - 1) / nodes * state / gpus_per_node / inter
        return per_micro * accumulate_grad_batches
    gathers = 1 if sharding == "SHARD_GRAD_OP" else 2
    seconds = (gathers + 1) * ring(world_size, bw) * accumulate_grad_batches
    if offload:
        shard = state / world_size
        seconds += 3 * shard / PCIE_BYTES_PER_S * accumulate_grad_batches
    return seconds


def strategy_factor(*, sharding: str | None, offload: bool = False, world_size: int, gpus_per_node: int,
                    nodes: int, micro_batch_size: int, accumulate_grad_batches: int, precision: str,
                    checkpointing: bool, parameter_count: int, tokens_per_sample: int, gpu_name: str) -> float:
    """Speed of a candidate under `sharding` relative to the same candidate under DDP (1.0 for DDP)."""
    if sharding is None:
        return 1.0
    compute = _compute_seconds(parameter_count=parameter_count, tokens_per_sample=tokens_per_sample,
                               samples=micro_batch_size * accumulate_grad_batches, precision=precision,
                               checkpointing=checkpointing, flops=gpu_links(gpu_name).dense_half_flops)
    common = dict(world_size=world_size, gpus_per_node=gpus_per_node, nodes=nodes,
                  accumulate_grad_batches=accumulate_grad_batches, parameter_count=parameter_count,
                  gpu_name=gpu_name)
    ddp = max(0.0, communication_seconds(sharding=None, **common) - OVERLAP * compute)
    fsdp = max(0.0, communication_seconds(sharding=sharding, offload=offload, **common) - OVERLAP * compute)
    if offload:  # the host optimizer step over this rank's shard: nothing hides it
        shard = world_size if sharding != "HYBRID_SHARD" else gpus_per_node
        fsdp += 3 * OFFLOAD_BYTES_PER_PARAM * parameter_count / shard / HOST_OPTIMIZER_BYTES_PER_S
    return FSDP_ENGINE_FACTOR * (compute + ddp) / (compute + fsdp)


def relative_throughput(*, world_size: int, micro_batch_size: int, accumulate_grad_batches: int = 1,
                        precision: str, checkpointing: bool,
                        compute_capability: tuple[int, int] = (8, 0)) -> float:
    """Relative samples/s of one candidate under the model in this module's docstring (arbitrary
    units: only ratios between candidates mean anything)."""
    for name, value in (("world_size", world_size), ("micro_batch_size", micro_batch_size),
                        ("accumulate_grad_batches", accumulate_grad_batches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"relative_throughput: {name} must be a positive int; got {value!r}")
    speed = world_size * DDP_EFFICIENCY ** math.log2(world_size)
    speed *= micro_batch_size / (micro_batch_size + MICRO_BATCH_K)
    if checkpointing:
        speed *= CHECKPOINT_FACTOR
    if precision in ("bf16-mixed", "16-mixed") and tuple(compute_capability) >= TENSOR_CORE_MIN_CAPABILITY:
        speed *= AMP_SPEEDUP
    if precision == "16-mixed":
        speed *= GRAD_SCALER_FACTOR
    speed *= 1.0 - ACCUMULATION_OVERHEAD * (1.0 - 1.0 / accumulate_grad_batches)
    return speed


def host_bytes_per_rank(load: HostLoad, micro_batch_size: int) -> int:
    """Host RAM one rank needs at micro-batch `micro_batch_size` (see the module docstring)."""
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise ValueError(f"host_bytes_per_rank: micro_batch_size must be a positive int; got {micro_batch_size!r}")
    batch = load.sample_bytes * micro_batch_size
    in_flight = load.num_workers * load.prefetch_factor + 1
    pinned = 2 * batch if load.pin_memory else 0
    return (RANK_RUNTIME_BYTES + load.model_init_bytes + load.num_workers * WORKER_BYTES
            + batch * in_flight + pinned)
