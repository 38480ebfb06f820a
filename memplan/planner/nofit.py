"""When nothing fits: the error, what DDP and FSDP would need at the most frugal setting, and the FSDP
full-shard figure it offers as the way out."""
from __future__ import annotations

from typing import TYPE_CHECKING

from memplan.checkpoint_setting import FULL, NONE

from memplan.estimator.cuda.overheads import nccl_buffer_bytes
from memplan.estimator.result import MemoryEstimate
from memplan.planner.reasons import what_would_help
from memplan.units import format_bytes

if TYPE_CHECKING:
    from memplan.planner.search import _Search

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


def no_fit_error(search: _Search) -> NoFit:
    """The error for an empty search, with DDP's and FSDP's per-GPU needs at the most frugal
    allowed setting (AMP and checkpointing when allowed), micro-batch 1, on every GPU allowed."""
    request = search.request
    amp = any(g.amp for g in search.groups)
    frugal = [g for g in search.groups if g.amp == amp and g.checkpointing == (FULL if request.allow_checkpointing
                                                                              else NONE)
              and g.sharding is None] or list(search.groups)
    group = max(frugal, key=lambda g: g.multi)
    widest = max(search.groups[group], key=lambda c: c.world_size)
    precision = search.trace_precision(group)
    ddp_est = search.trace(1, precision, group.checkpointing, group.probe_world_size)
    ddp_needed = ddp_est.device_total - ddp_est.communication
    if widest.world_size > 1 and ddp_est.communication:
        ddp_needed += nccl_buffer_bytes(widest.world_size, compute_capability=widest.compute_capability)
    # FSDP from the one-GPU trace where there is one: it has no DDP buckets in its gradients.
    base = search.traces.get((1, precision, group.checkpointing, 1, None, False), ddp_est)
    fsdp_traced = [search.predicted_bytes(c) for c in search.candidates if c.group.sharding is not None
                   and c.group in search.explored and c.micro_batch_size == 1]
    if fsdp_traced:  # FSDP was searched: its own traces say what it needs
        fsdp_needed = min(fsdp_traced)
    else:
        fsdp_needed = fsdp_full_shard_bytes(base, world_size=widest.world_size,
                                            largest_block_bytes=request.largest_block_bytes,
                                            compute_capability=widest.compute_capability)
    budget = max(c.budget_bytes for c in search.candidates)
    where = f"across {widest.world_size} GPUs" if widest.world_size > 1 else "on one GPU"
    setting = ", ".join([precision, *(["activation checkpointing"] if group.checkpointing else []),
                         "micro-batch 1"])
    lines = []
    on_device = [c for c in search.candidates if not c.offload]
    if not all(c.host_fits for c in on_device):
        least = min(on_device, key=lambda c: c.gpus_per_node * c.host_bytes_per_rank)
        lines.append(
            f"host RAM limits the ranks: {least.gpus_per_node} rank(s) per node need "
            f"{format_bytes(least.gpus_per_node * least.host_bytes_per_rank)} at the least, and "
            f"{'no' if not any(c.host_fits for c in on_device) else 'no other'} setting fits the "
            f"{format_bytes(request.host_budget_bytes or 0)} host budget ({request.margin:.0%} margin kept); "
            "free host memory, build the model on meta, or use fewer DataLoader workers.")
    offloaded = [c for c in search.candidates if c.offload]
    if offloaded and not any(c.host_fits for c in offloaded):
        least = min(offloaded, key=lambda c: c.gpus_per_node * c.host_bytes_per_rank)
        lines.append(
            f"FSDP with CPU offload (allow_cpu_offload) keeps each rank's shard of the training state in host "
            f"RAM: {least.gpus_per_node} ranks per node need {format_bytes(least.gpus_per_node * least.host_bytes_per_rank)}, "
            f"over the {format_bytes(request.host_budget_bytes or 0)} host budget; add nodes (smaller shards), "
            "free host memory, or use GPUs with more memory.")
    if ddp_needed > widest.budget_bytes:
        verdict = ("which would fit: use strategy='fsdp'" if fsdp_needed <= widest.budget_bytes else
                   "which does not fit either: add GPUs or nodes, "
                   f"{'' if offloaded else 'offload to CPU, '}or use GPUs with more memory")
        lines.append(
            f"DDP needs {format_bytes(ddp_needed)} per GPU {where} even with {setting}, over the per-GPU "
            f"budget of {format_bytes(widest.budget_bytes)} ({request.margin:.0%} margin kept). FSDP full "
            f"shard {where} would need {'' if fsdp_traced else 'about '}{format_bytes(fsdp_needed)} per GPU "
            f"({'traced, its most frugal layout' if fsdp_traced else 'approximate'}), {verdict}.")
        helps = what_would_help(request, amp_allowed=amp)
        if helps:
            lines.append(helps)
    else:
        lines.append(f"GPU memory is not the limit: DDP needs {format_bytes(ddp_needed)} per GPU {where} "
                     f"with {setting} (FSDP full shard about {format_bytes(fsdp_needed)}).")
    return NoFit("Nothing fits: " + " ".join(lines), ddp_needed_bytes_per_gpu=ddp_needed,
                 fsdp_needed_bytes_per_gpu=fsdp_needed, budget_bytes_per_gpu=budget)
