"""When nothing fits: the error, and the FSDP full-shard figure it offers as the way out."""
from __future__ import annotations

from memplan.estimator.cuda import nccl_buffer_bytes
from memplan.estimator.result import MemoryEstimate

FSDP_PREFETCH_BLOCKS = 2
"""Unsharded blocks FSDP holds at once: the one computing and the next one being all-gathered."""


class NoFit(Exception):
    """No candidate fits the GPUs (or the host). Carries what DDP would need per GPU and an FSDP
    full-shard estimate, both in bytes, and says both in its message with what to do."""

    def __init__(self, message: str, *, ddp_needed_bytes_per_gpu: int, fsdp_needed_bytes_per_gpu: int,
                 budget_bytes_per_gpu: int) -> None:
        super().__init__(message)
        self.ddp_needed_bytes_per_gpu = ddp_needed_bytes_per_gpu
        """Per-GPU device total DDP needs with its most frugal allowed setting (AMP and activation
        checkpointing when allowed) at micro-batch 1, on as many GPUs as the job may use."""
        self.fsdp_needed_bytes_per_gpu = fsdp_needed_bytes_per_gpu
        """Approximate per-GPU device total of FSDP full shard (ZeRO-3) at the same setting."""
        self.budget_bytes_per_gpu = budget_bytes_per_gpu
        """The largest usable per-GPU budget in the request (free memory less the margin)."""


def fsdp_full_shard_bytes(est: MemoryEstimate, *, world_size: int, largest_block_bytes: int | None,
                          compute_capability: tuple[int, int]) -> int:
    """Approximate per-GPU device total of FSDP full shard across `world_size` ranks, from a DDP or
    single-GPU estimate of the same step (taken at micro-batch 1):

        (parameters + gradients + optimizer_state) / world_size    sharded state
      + max(activations, forward_activations) + batch + workspaces  per-rank, unsharded
      + temporaries (/ world_size when the peak is in the optimizer step, whose scratch is sharded)
      + peak_reserved - peak_allocated                              the allocator's rounding
      + 2 x largest block's parameters                              all-gathered block + prefetched next
      + cuda_context + NCCL buffers at world_size

    Approximate: `gradients` of a DDP estimate include its buckets (over by that / world_size);
    FSDP's own flat-parameter padding, reduce-scatter buffers and mixed-precision parameter copies are
    not modelled. Without `largest_block_bytes`, the whole model is assumed gathered at once (FSDP
    without an auto-wrap policy), counted once.
    """
    state = est.parameters + est.gradients + est.optimizer_state
    temporaries = est.temporaries // world_size if est.peak_phase == "optimizer" else est.temporaries
    unsharded = max(est.activations, est.forward_activations) + est.batch + est.workspaces + temporaries
    gathered = est.parameters if largest_block_bytes is None else FSDP_PREFETCH_BLOCKS * largest_block_bytes
    rounding = max(0, est.peak_reserved - est.peak_allocated)
    communication = 0
    if world_size > 1 and est.device != "cpu":  # NCCL only on a CUDA target
        communication = nccl_buffer_bytes(world_size, compute_capability=compute_capability)
    return -(-state // world_size) + unsharded + rounding + gathered + est.cuda_context + communication
