"""The planner's two cost models: the time of one training step, and host RAM per rank.

Step time
---------
Each candidate's step time is predicted from the ops of a traced step (estimator/flops.py: every op's
FLOPs, bytes moved, class, dtype and phase, counted on the same fake trace that gives memory):

    step = accumulation x micro-step + optimizer step + exposed communication
    micro-step = max(sum over ops of op time, host time)                     the GPU, or eager PyTorch's
                                                                              per-op host cost, whichever is slower
                                                                              (forward and backward each)
    host time = (ops + (RECOMPUTE_HOST_FACTOR - 1) x recomputed ops) x HOST_SECONDS_PER_OP
    op time = max(flops / (peak[dtype] x FLOP_EFFICIENCY[class]),          a per-op roofline
                  bytes / (HBM bandwidth x BANDWIDTH_EFFICIENCY[class]),
                  MIN_KERNEL_SECONDS)

- Misaligned matmuls: a tensor-core matmul (bf16, fp16; tf32) whose operands' contiguous extents or leading
  dimensions are not multiples of 16 bytes (OpCost.align: GPT-2's LM head with vocabulary 50257) runs at
  MISALIGNED_MATMUL_EFFICIENCY of the dense peak instead of FLOP_EFFICIENCY['matmul']: cuBLAS cannot use its
  16-byte-load kernels and falls back to alignment-1 ones. fp32 matmuls (CUDA cores) and convolutions (cuDNN)
  are left as they are.

- peak[dtype]: the catalog's dense figures (memplan.hardware.catalog.gpu_links): bf16 / fp16 tensor
  cores for AMP matmuls, TF32 for fp32 convolutions (cuDNN's default), fp32 CUDA cores for fp32
  matmuls (torch keeps TF32 off for cuBLAS by default, and Lightning does not turn it on).
- Micro-batches: the planner traces one setting (the fastest-looking group: AMP, no checkpointing) at
  micro-batch 1 and PROBE_MICRO; each op's FLOPs and bytes are a line through the two (a weight is
  read once per op whatever the micro-batch, activations grow with it), so small micro-batches pay
  for their weight reads and per-op costs, large ones for their FLOPs.
- Checkpointing: the forward ops inside repeated blocks run again in backward (phase 'recompute').
- 32-true from an AMP trace: autocast's casts go, half-precision ops run in fp32 with twice the bytes.
- Optimizer step: the traced optimizer ops (bandwidth-bound foreach kernels), over 1/shard of the
  parameters under FSDP; on the host under CPU offload.
- FSDP's own copies: each all-gather's output is copied out of the flat buffer into the parameters, and
  each gradient into the reduce-scatter's input: read + write of the fp32 parameters per collective.
- Communication (ring collectives on the catalog's links x COMM_EFFICIENCY; see communication_seconds):
  DDP's gradient all-reduce once per optimizer step, hidden behind OVERLAP of the last micro-step's
  backward; FSDP's all-gathers and reduce-scatter per micro-step, hidden behind OVERLAP of that
  micro-step, except the first block's all-gather which nothing precedes. At least 1 - OVERLAP of
  every collective shows even when compute could hide it all: NCCL's kernels share the SMs and HBM
  with the compute they overlap (so DDP's one all-reduce per step beats FSDP's per-micro-step
  collectives where both hide).
- Throughput: samples/s = global batch / step; tokens/s = samples/s x the batch's sequence length
  (when it has one); MFU = the forward and backward matmul and attention FLOPs (recompute excluded) /
  (step x the precision's dense peak).

The efficiency factors are checked against 18 published throughput figures (benchmarks/published_throughput.py,
table in benchmarks/results/published_throughput.md: median |error| 6.2 %, worst 37.2 %); attention's come
from the FlashAttention-2 and -3 papers, the rest are figures for well-tuned large kernels, not measured on
each GPU. HOST_SECONDS_PER_OP and MIN_KERNEL_SECONDS matter only for small models and micro-batches, which
no published figure covers: the first is measured on one GPU host (its docstring), the second is an
order-of-magnitude assumption. MISALIGNED_MATMUL_EFFICIENCY and RECOMPUTE_HOST_FACTOR come from GPU measurements
(their docstrings); the whole model against the step times of 16 settings timed on an H200 and an H100 is
benchmarks/results/step_time_cards.md. Fits whose predicted speeds are within
candidates.SPEED_TIE tie, and the simpler setting wins.

Data-parallel communication
---------------------------
    ring all-reduce of B bytes over n ranks: 2 (n - 1) / n x B / bw;  all-gather / reduce-scatter: (n - 1) / n x B / bw
    C_ddp          = all-reduce(grads) once per optimizer step (Lightning's no_sync skips it while accumulating)
    C_full_shard   = per micro-step: all-gather(params) in forward and again in backward + reduce-scatter(grads)
    C_shard_grad_op= per micro-step: all-gather(params) once (kept to backward) + reduce-scatter(grads)
    C_hybrid       = C_full_shard within a node (n = GPUs per node, NVLink) + per micro-step all-reduce of
                     the 1/n gradient shard across nodes (each GPU's own NIC)
    C_offload      = C_full_shard + per micro-step PCIe copies of the shard (params in, gradients out)
                     + the optimizer step on the host over the shard, which nothing hides
    params and grads in fp32 (4 bytes each: the planner does not set FSDP's param_dtype).

bw is the catalog's per-GPU link (memplan.hardware.catalog.gpu_links: NVLink or PCIe inside a node)
x COMM_EFFICIENCY. A ring over several nodes crosses between nodes on each of NCCL's channels through
its own NIC (INTER_NODE_BYTES_PER_S, one per GPU), so its hop between nodes carries the node's NICs
together: bw = min(NVLink, GPUs per node x INTER_NODE_BYTES_PER_S) x COMM_EFFICIENCY. Lightning's
ModelParallelStrategy / FSDPStrategy keep gradient sync on while accumulating, hence FSDP's
per-micro-step reduce-scatter.

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

from dataclasses import dataclass
from typing import TYPE_CHECKING

from memplan.checkpoint_setting import Checkpointing
from memplan.hardware.catalog import INTER_NODE_BYTES_PER_S, GpuLinks, gpu_links
from memplan.planner.request import HostLoad
from memplan.units import GiB, MiB

if TYPE_CHECKING:
    from memplan.planner.profile import CostProfile, ScaledOp

FLOP_EFFICIENCY = {"matmul": 0.70, "attention": 0.60, "elementwise": 0.5, "reduction": 0.5}
"""Fraction of the dense peak an op class reaches when compute-bound: large cuBLAS GEMMs ~70 %; the fused
attention kernels (FlashAttention-2, torch's SDPA flash backend) "50-73 % of the theoretical maximum
FLOPs/s on A100" (FlashAttention-2 paper, arXiv 2307.08691), on Hopper and later HOPPER_ATTENTION_EFFICIENCY."""
HOPPER_ATTENTION_EFFICIENCY = 0.35
"""FlashAttention-2 on sm90+: "achieving only 35% utilization on the H100 GPU" (FlashAttention-3 paper,
arXiv 2407.08608); torch's SDPA runs FlashAttention-2 there too."""
BANDWIDTH_EFFICIENCY = {"matmul": 0.8, "attention": 0.8, "elementwise": 0.75, "reduction": 0.6}
"""Fraction of HBM bandwidth an op class reaches when memory-bound: streaming elementwise kernels ~75 %,
reductions (softmax, norms: two passes, a tail of partial sums) less."""
MISALIGNED_MATMUL_EFFICIENCY = 0.12
"""Fraction of the dense peak a half-precision matmul reaches when its dimensions are not 16-byte aligned
(ALIGN_BYTES). Measured on an H100 80GB HBM3 (torch 2.11+cu130, benchmarks/results/gpu_campaign_raw_h100/part4.json,
kernel_profile, GPT-2 small bf16-mixed micro-batch 8): the LM head's three GEMMs (8192 x 768 x 50257, 632 GFLOP
each) ran as cuBLAS's `cutlass_75_tensorop_bf16_s1688gemm_..._align1` kernels in 6.69 + 4.54 + 4.31 ms, 122 TFLOP/s
together: 12.3 % of the H100's 989 dense TFLOP/s, where the aligned GEMMs of the same step run at ~60-70 %. Not
measured on other GPUs: the fallback kernels are pre-Hopper designs, so a Hopper's share is probably the lowest."""
ALIGN_BYTES = 16
"""The alignment cuBLAS's fast tensor-core kernels need of a matmul's contiguous extents and leading dimensions
(NVIDIA's Matrix Multiplication Background User's Guide: dimensions multiples of 8 for FP16, 4 for TF32)."""
TENSOR_CORE_DTYPES = ("bf16", "fp16", "tf32")
"""The dtypes whose matmuls run on tensor cores (where alignment matters)."""
MIN_KERNEL_SECONDS = 3e-6
"""The shortest a GPU kernel takes (launch latency and a tail wave), however little it does."""
HOST_SECONDS_PER_OP = 40e-6
"""Eager PyTorch's CPU cost per counted op (Python and the modules' code, the dispatcher with autocast, autograd
bookkeeping, the views and reshapes between the ops that move data, the launch): a step of many small ops is bound
by the host, not the GPU. Measured on the H200 host of the GPU campaign (benchmarks/results/step_time_gpu.md): the
two steps without checkpointing that were bound by the host (their 10 timed steps deviate from their median by
2.7 % and 6.8 % (median absolute deviation), the GPU-bound ones by under 0.5 %) took, less their optimizer step,
34 us (GPT-2 small, transformers, bf16-mixed, micro-batch 4: 988 ops) and 43 us (ViT-L/16, bf16-mixed,
micro-batch 32: 1488 ops) per op the trace counts, autocast's casts included; 10 us, the earlier guess, was
3-4x short. A host's CPU sets it: a faster one is quicker."""
RECOMPUTE_HOST_FACTOR = 2.0
"""A checkpointed block's forward, run again in backward, costs the host this many times HOST_SECONDS_PER_OP per op
(torch.utils.checkpoint's recompute runs from inside the autograd engine: its own hooks, the RNG state, the graph
it builds again). Measured on both GPU campaigns' host-bound steps (part 4: GPT-2 small bf16-mixed micro-batch 4,
ViT-L/16 bf16-mixed micro-batch 32; benchmarks/results/step_time_cards.md): full checkpointing added 75 and 85 us
(H200 host) and 83 and 87 us (H100 host) per recomputed op to steps whose other ops took 34-43 us each."""

RANK_RUNTIME_BYTES = 2 * GiB
"""Host RSS of one CUDA training process before the model and data: Python, torch, CUDA libraries."""
WORKER_BYTES = 512 * MiB
"""Host RSS of one forked DataLoader worker (copy-on-write pages it touches)."""


COMM_EFFICIENCY = 0.7
"""Fraction of a link's bandwidth a NCCL ring reaches (nccl-tests bus bandwidth on NVLink and IB)."""
OVERLAP = 0.8
"""Fraction of the compute time that collectives can hide behind (prefetch and bucketing are not perfect)."""
PCIE_BYTES_PER_S = 25e9
"""Host<->GPU copies of CPU offload (PCIe 4.0/5.0 x16 in practice, pinned memory)."""
HOST_OPTIMIZER_BYTES_PER_S = 10e9
"""Memory bandwidth one rank's host-side optimizer step gets (a socket's bandwidth shared by its ranks)."""
OFFLOAD_BYTES_PER_PARAM = 16
"""Host bytes per parameter under CPU offload: fp32 parameter, gradient and Adam's two states."""


@dataclass(frozen=True, kw_only=True)
class Collectives:
    """The ranks one optimizer step's collectives run over, and the bytes per parameter they move."""

    sharding: str | None
    """FSDP's sharding strategy; None is DDP."""
    world_size: int
    """Ranks in all."""
    gpus_per_node: int
    """Ranks per node."""
    nodes: int
    """Nodes."""
    gpu_name: str
    """The GPU (its links: memplan.hardware.catalog.gpu_links)."""
    offload: bool = False
    """FSDP's CPU offload: the shard's training state crosses PCIe."""
    gather_bytes: int = 4
    """Bytes per parameter of the all-gathers (4: fp32, as the planner runs FSDP; param_dtype=bf16 gathers 2)."""
    reduce_bytes: int = 4
    """Bytes per parameter of the gradient reduction."""


def communication_seconds(collectives: Collectives, *, parameter_count: int, accumulate_grad_batches: int) -> float:
    """Communication time of one optimizer step (see the module docstring) of `parameter_count` parameters."""
    c = collectives
    sharding, offload, world_size, gpus_per_node, nodes, gpu_name = (
        c.sharding, c.offload, c.world_size, c.gpus_per_node, c.nodes, c.gpu_name)
    gather_bytes, reduce_bytes = c.gather_bytes, c.reduce_bytes
    if world_size == 1:
        return 0.0
    links = gpu_links(gpu_name)
    intra = links.intra_node_bytes_per_s * COMM_EFFICIENCY
    # A ring over several nodes crosses between them once per node on each of NCCL's channels, one NIC per
    # channel: its hop between nodes runs at the node's NICs together (one per GPU), capped by NVLink.
    across = min(links.intra_node_bytes_per_s, INTER_NODE_BYTES_PER_S * gpus_per_node) * COMM_EFFICIENCY
    bw = intra if nodes == 1 else across

    def ring(n: int, nbytes: float, speed: float) -> float:  # all-gather or reduce-scatter of nbytes over n ranks
        return (n - 1) / n * nbytes / speed

    gathered, reduced = gather_bytes * parameter_count, reduce_bytes * parameter_count
    if sharding is None:
        return 2 * ring(world_size, reduced, bw)
    if sharding == "NO_SHARD":
        return 2 * ring(world_size, reduced, bw) * accumulate_grad_batches
    if sharding == "HYBRID_SHARD":  # sharded within the node; each GPU all-reduces its shard with its peers
        network = INTER_NODE_BYTES_PER_S * COMM_EFFICIENCY
        per_micro = (2 * ring(gpus_per_node, gathered, intra) + ring(gpus_per_node, reduced, intra)
                     + 2 * (nodes - 1) / nodes * reduced / gpus_per_node / network)
        return per_micro * accumulate_grad_batches
    gathers = 1 if sharding == "SHARD_GRAD_OP" else 2
    seconds = (gathers * ring(world_size, gathered, bw) + ring(world_size, reduced, bw)) * accumulate_grad_batches
    if offload:
        shard = 4.0 * parameter_count / world_size
        seconds += 3 * shard / PCIE_BYTES_PER_S * accumulate_grad_batches
    return seconds


def host_bytes_per_rank(load: HostLoad, micro_batch_size: int) -> int:
    """Host RAM one rank needs at micro-batch `micro_batch_size` (see the module docstring)."""
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise ValueError(f"host_bytes_per_rank: micro_batch_size must be a positive int; got {micro_batch_size!r}")
    batch = load.sample_bytes * micro_batch_size
    in_flight = load.num_workers * load.prefetch_factor + 1
    pinned = 2 * batch if load.pin_memory else 0
    return (RANK_RUNTIME_BYTES + load.model_init_bytes + load.num_workers * WORKER_BYTES
            + batch * in_flight + pinned)


# --- the step-time model -------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class StepTime:
    """Predicted time and throughput of one optimizer step of a candidate (all ranks together)."""

    step_seconds: float
    """One optimizer step: every micro-step, the optimizer step and the communication compute does not hide."""
    micro_step_seconds: float
    """One forward + backward (+ recompute) of a micro-batch."""
    optimizer_seconds: float
    """The optimizer step (on the host under CPU offload)."""
    communication_seconds: float
    """Collective time not hidden behind compute."""
    samples_per_s: float
    """Global batch / step_seconds."""
    tokens_per_s: float | None
    """samples_per_s x the batch's sequence length; None when the batch has none."""
    mfu: float
    """Model FLOPs utilisation: forward + backward matmul and attention FLOPs (no recompute) per second
    per GPU over the precision's dense peak."""


def peak_flops(links: GpuLinks, dtype: str, op_class: str) -> float:
    """Dense peak FLOP/s an op of `op_class` in `dtype` runs at on a GPU (module docstring)."""
    if op_class not in ("matmul", "attention"):
        return links.fp32_flops
    if dtype in ("bf16", "fp16"):
        return links.dense_half_flops
    return links.dense_tf32_flops if dtype == "tf32" else links.fp32_flops


def flop_efficiency(op_class: str, compute_capability: tuple[int, int] = (8, 0)) -> float:
    """FLOP_EFFICIENCY of an op class on a GPU of that compute capability (attention is lower on sm90+)."""
    if op_class == "attention" and tuple(compute_capability) >= (9, 0):
        return HOPPER_ATTENTION_EFFICIENCY
    return FLOP_EFFICIENCY[op_class]


def _compute_capability(gpu_name: str) -> tuple[int, int]:
    from memplan.hardware.catalog import lookup_gpu, match_nvml_name

    try:
        return lookup_gpu(gpu_name).compute_capability
    except ValueError:
        model = match_nvml_name(gpu_name)
        return model.compute_capability if model is not None else (8, 0)


def misaligned(op: ScaledOp) -> bool:
    """Whether `op` is a tensor-core matmul whose dimensions are not ALIGN_BYTES aligned (module docstring)."""
    return op.op_class == "matmul" and op.dtype in TENSOR_CORE_DTYPES and op.align_bytes < ALIGN_BYTES


def ops_seconds(ops: list[ScaledOp], links: GpuLinks, compute_capability: tuple[int, int] = (8, 0)) -> float:
    """GPU time of `ops` under the per-op roofline (module docstring)."""
    total = 0.0
    efficiency = {c: flop_efficiency(c, compute_capability) for c in FLOP_EFFICIENCY}
    for op in ops:
        share = MISALIGNED_MATMUL_EFFICIENCY if misaligned(op) else efficiency[op.op_class]
        compute = op.flops / (peak_flops(links, op.dtype, op.op_class) * share)
        memory = op.bytes / (links.hbm_bytes_per_s * BANDWIDTH_EFFICIENCY[op.op_class])
        total += op.count * max(compute, memory, MIN_KERNEL_SECONDS)
    return total


def _busy_seconds(ops: list[ScaledOp], links: GpuLinks, compute_capability: tuple[int, int]) -> float:
    """The GPU's time or the host's time, whichever is longer (kernels launch asynchronously)."""
    return max(ops_seconds(ops, links, compute_capability), host_seconds(ops))


def host_seconds(ops: list[ScaledOp]) -> float:
    """The host's time for `ops`: HOST_SECONDS_PER_OP each, RECOMPUTE_HOST_FACTOR times that for a recomputed one."""
    recomputed = sum(op.count for op in ops if op.phase == "recompute")
    return (host_ops(ops) + (RECOMPUTE_HOST_FACTOR - 1) * recomputed) * HOST_SECONDS_PER_OP


def host_ops(ops: list[ScaledOp]) -> int:
    """The ops of `ops` that each cost the host HOST_SECONDS_PER_OP (all of them, autocast's casts too)."""
    return sum(op.count for op in ops)


@dataclass(frozen=True, kw_only=True)
class StepSetting:
    """One candidate's setting, as the step-time model needs it."""

    precision: str
    """Lightning precision string."""
    checkpointing: bool | Checkpointing
    """Activation checkpointing: False / True (none / full) or a memplan Checkpointing."""
    micro_batch_size: int
    """Samples per rank per micro-step."""
    accumulate_grad_batches: int
    """Micro-steps per optimizer step."""
    world_size: int
    """Ranks in all."""
    gpus_per_node: int
    """Ranks per node."""
    nodes: int
    """Nodes."""
    sharding: str | None
    """FSDP's sharding strategy; None is DDP or one GPU."""
    offload: bool
    """FSDP's CPU offload."""
    gpu_name: str
    """The GPU that sets the pace."""
    largest_block_bytes: int | None = None
    """The largest repeated block's parameter bytes (FSDP's first all-gather, never hidden)."""
    gather_bytes: int = 4
    """The all-gathers' bytes per parameter (Collectives)."""
    reduce_bytes: int = 4
    """The gradient reduction's bytes per parameter (Collectives)."""

    def collectives(self, **changes) -> Collectives:
        """Its collectives (with `changes`: another sharding, no reduction)."""
        fields = dict(sharding=self.sharding, world_size=self.world_size, gpus_per_node=self.gpus_per_node,
                      nodes=self.nodes, gpu_name=self.gpu_name, offload=self.offload, gather_bytes=self.gather_bytes,
                      reduce_bytes=self.reduce_bytes)
        return Collectives(**{**fields, **changes})


def predict_step(profile: CostProfile, setting: StepSetting) -> StepTime:
    """The step time of one candidate from the model's traced costs (see the module docstring)."""
    precision, checkpointing, micro_batch_size = setting.precision, setting.checkpointing, setting.micro_batch_size
    accumulate_grad_batches, world_size, sharding = setting.accumulate_grad_batches, setting.world_size, setting.sharding
    offload, gpu_name, largest_block_bytes = setting.offload, setting.gpu_name, setting.largest_block_bytes
    gpus_per_node = setting.gpus_per_node
    links, cc = gpu_links(gpu_name), _compute_capability(gpu_name)
    amp = precision in ("bf16-mixed", "16-mixed")
    ops = profile.ops(micro_batch_size, amp=amp, checkpointing=checkpointing)
    forward = [o for o in ops if o.phase == "forward"]
    backward = [o for o in ops if o.phase in ("backward", "recompute")]
    optimizer = [o for o in ops if o.phase == "optimizer"]
    micro = _busy_seconds(forward, links, cc) + _busy_seconds(backward, links, cc)
    shard = 1 if sharding is None else (gpus_per_node if sharding == "HYBRID_SHARD" else world_size)
    params = profile.parameter_count
    if sharding is not None and world_size > 1:  # FSDP copies each gathered block out of (and each gradient
        copies = 1 if sharding == "SHARD_GRAD_OP" else 2  # into) the collective's flat buffer: read + write
        micro += (copies + 1) * 2 * 4 * params / (links.hbm_bytes_per_s * BANDWIDTH_EFFICIENCY["elementwise"])
    if offload:  # the host updates its shard: Adam reads and writes ~3 x 16 bytes per parameter
        opt = 3 * OFFLOAD_BYTES_PER_PARAM * params / shard / HOST_OPTIMIZER_BYTES_PER_S
    else:
        opt = _busy_seconds([o.sharded(shard) for o in optimizer], links, cc)
    comm = communication_seconds(setting.collectives(), parameter_count=params, accumulate_grad_batches=1)
    if world_size == 1:
        exposed = 0.0
    elif sharding is None:  # DDP: one all-reduce per optimizer step, behind the last backward
        exposed = max((1 - OVERLAP) * comm, comm - OVERLAP * _busy_seconds(backward, links, cc))
    else:  # FSDP: per micro-step, behind that micro-step; the first block's gather is never hidden
        first = communication_seconds(setting.collectives(sharding="SHARD_GRAD_OP", offload=False, reduce_bytes=0),
                                      parameter_count=(largest_block_bytes or 0) // 4, accumulate_grad_batches=1)
        exposed = accumulate_grad_batches * max(first, (1 - OVERLAP) * comm, comm - OVERLAP * micro)
    step = accumulate_grad_batches * micro + opt + exposed
    samples = micro_batch_size * accumulate_grad_batches * world_size / step
    model_flops = sum(o.flops * o.count for o in forward + backward
                      if o.phase != "recompute" and o.op_class in ("matmul", "attention"))
    peak = links.dense_half_flops if amp else links.fp32_flops
    mfu = model_flops * accumulate_grad_batches / (step * peak)
    tokens = samples * profile.tokens_per_sample if profile.tokens_per_sample > 1 else None
    return StepTime(step_seconds=step, micro_step_seconds=micro, optimizer_seconds=opt, communication_seconds=exposed,
                    samples_per_s=samples, tokens_per_s=tokens, mfu=mfu)
