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

Host RAM per rank
-----------------
    RANK_RUNTIME_BYTES + model_init_bytes + num_workers x WORKER_BYTES
    + batch_bytes x (num_workers x prefetch_factor + 1) + (2 x batch_bytes if pin_memory)

The runtime (Python, torch and CUDA libraries, the CUDA driver's host allocations) is ~2 GiB RSS per
CUDA process; each DataLoader worker is a forked copy whose touched pages (refcounts) grow to
~0.5 GiB; each worker keeps prefetch_factor batches and the training step holds one more; pinned
batches are a second copy, rounded up to a power of two by torch's CachingHostAllocator (so 2x).
These are approximations on the high side; a plan is only as good as host_available_bytes.
"""
from __future__ import annotations

import math

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
