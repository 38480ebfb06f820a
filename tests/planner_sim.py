"""A *simulated* estimator for the planner's tests (test_planner*.py, tests/planner/): SimulatedStep builds the
MemoryEstimate of a simulated training step on a simulated GPU, with memory linear in the micro-batch (weights,
gradients, optimizer state, DDP buckets and NCCL buffers fixed; activations per sample). The simulation records
its calls, so the tests can count traces. Also: catalogued GPUs as DeviceBudgets, a setting's predicted speed
under the planner's step-time model, the best speed found by tracing every candidate, and a plan's exact peak."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from memplan.estimator.cuda.overheads import nccl_buffer_bytes
from memplan.estimator.errors import EstimateError
from memplan.estimator.flops import OpCost, StepCosts
from memplan.estimator.result import MemoryEstimate
from memplan.hardware import lookup_gpu
from memplan.plan import Plan
from memplan.planner import DeviceBudget, PlanRequest, StepSetting, predict_step
from memplan.planner.profile import CostProfile
from memplan.units import GiB, MiB

CONTEXT_BYTES = 640 * MiB
SIM_TOKENS = 2048
"""Tokens per sample of the simulated language model (its FLOPs)."""


@dataclass
class SimulatedStep:
    """A simulated training step on a simulated GPU of compute capability `cc`.

    Per rank: parameters (fp32) + gradients + 2 x optimizer state + DDP buckets (one gradient's worth
    when world_size > 1) + activations (per sample; halved by AMP, quartered by checkpointing) + an
    optimizer-step scratch that, when larger than the activations, holds the peak (a flat curve at
    small micro-batches), reserved in `segment_bytes` segments, + CUDA context + NCCL buffers.
    """

    params_bytes: int = 1 * GiB
    activation_bytes_per_sample: int = 1 * GiB
    cc: tuple[int, int] = (8, 0)
    optimizer_scratch_bytes: int = 0
    report_activations: bool = True
    """Whether the estimate reports forward activations and each phase's peak (what the line's slope reads)."""
    forward_scratch_bytes: int = 0
    """A forward temporary that holds the forward's peak whatever the micro-batch."""
    backward_bytes_per_sample: int = 0
    """What the backward holds beyond the saved activations, per sample (a language model's logits'
    gradient): the backward's peak grows faster than the forward's."""
    segment_bytes: int = 2 * MiB
    calls: list[tuple[int, str, bool, int]] = field(default_factory=list)

    def activations(self, micro: int, precision: str, checkpointing: bool) -> int:
        act = self.activation_bytes_per_sample * micro
        act = act // 2 if precision in ("bf16-mixed", "16-mixed") else act
        return act // 4 if checkpointing else act

    def __call__(self, *, micro_batch_size: int, precision: str, checkpointing: bool,
                 world_size: int) -> MemoryEstimate:
        if precision == "bf16-mixed" and self.cc < (8, 0):  # what memplan.estimate does too
            raise EstimateError(f"precision 'bf16-mixed' needs bf16, which sm{self.cc[0]}{self.cc[1]} lacks")
        self.calls.append((micro_batch_size, precision, checkpointing, world_size))
        act = self.activations(micro_batch_size, precision, checkpointing)
        buckets = self.params_bytes if world_size > 1 else 0
        fixed = 4 * self.params_bytes + buckets
        phases = {"forward": fixed + act + self.forward_scratch_bytes,
                  "backward": fixed + act + self.activations(micro_batch_size, precision, False)
                  * self.backward_bytes_per_sample // self.activation_bytes_per_sample,
                  "optimizer": fixed + self.optimizer_scratch_bytes}
        allocated = max(phases.values())
        reserved = -(-allocated // self.segment_bytes) * self.segment_bytes
        comm = nccl_buffer_bytes(world_size, compute_capability=self.cc) if world_size > 1 else 0
        return MemoryEstimate(
            parameters=self.params_bytes, gradients=self.params_bytes + buckets,
            optimizer_state=2 * self.params_bytes, activations=act, temporaries=0, batch=0,
            peak_allocated=allocated, peak_reserved=reserved, device_total=reserved + CONTEXT_BYTES + comm,
            cuda_context=CONTEXT_BYTES, communication=comm, device="A100-80GB", precision=precision,
            checkpointing=checkpointing, strategy="ddp" if world_size > 1 else None, world_size=world_size,
            forward_activations=act if self.report_activations else 0, batch_size=micro_batch_size,
            peak_allocated_by_phase=tuple(phases.items()) if self.report_activations else (),
            num_parameters=self.params_bytes // 4, step_costs=self.costs(micro_batch_size, precision))

    def costs(self, micro: int, precision: str) -> StepCosts:
        """The simulated step's ops: a language model of SIM_TOKENS tokens per sample whose matmuls read
        the weights once per pass, elementwise ops over the activations, and an Adam step."""
        n, a = self.params_bytes // 4, self.activations(micro, precision, False)
        dtype, size = ("fp32", 4) if precision == "32-true" else ("bf16", 2)
        flops = 2 * n * SIM_TOKENS * micro
        return StepCosts(ops=(
            OpCost(op_class="matmul", dtype=dtype, phase="forward", flops=flops, bytes=size * n + a, in_block=True),
            OpCost(op_class="elementwise", dtype=dtype, phase="forward", flops=a // size, bytes=2 * a, in_block=True),
            OpCost(op_class="matmul", dtype=dtype, phase="backward", flops=2 * flops, bytes=2 * size * n + 2 * a),
            OpCost(op_class="elementwise", dtype=dtype, phase="backward", flops=a // size, bytes=3 * a),
            OpCost(op_class="elementwise", dtype="fp32", phase="optimizer", flops=12 * n, bytes=28 * n),
        ))

    def profile(self, request: PlanRequest) -> CostProfile:
        """The step-time model's costs as the planner derives them: from its first trace's precision."""
        amp = any(p in request.precisions for p in ("bf16-mixed", "16-mixed"))
        precision = "16-mixed" if amp else "32-true"
        return CostProfile(self.costs(1, precision), high=self.costs(4, precision), high_micro=4, traced_amp=amp,
                           parameter_count=self.params_bytes // 4, tokens_per_sample=request.tokens_per_sample)


def gpus(name: str, count: int, **free_by_index: int) -> tuple[DeviceBudget, ...]:
    """`count` GPUs of a catalogued model with cuda indices 0..count-1; free_by_index={'cuda2': bytes}."""
    model = lookup_gpu(name)
    out = []
    for i in range(count):
        free = free_by_index.get(f"cuda{i}", model.total_bytes)
        out.append(DeviceBudget(name=model.name, cuda_index=i, total_bytes=model.total_bytes, free_bytes=free,
                                compute_capability=model.compute_capability))
    return tuple(out)


def speed(request: PlanRequest, sim: SimulatedStep, *, world: int, micro: int, precision: str,
          checkpointing: bool, gpu: str = "A100-80GB") -> float:
    """Predicted samples/s of one setting under the planner's step-time model (DDP or one GPU)."""
    per_rank = request.global_batch_size // world
    return predict_step(sim.profile(request), StepSetting(
        precision=precision, checkpointing=checkpointing, micro_batch_size=micro,
        accumulate_grad_batches=per_rank // micro, world_size=world, gpus_per_node=world // request.nodes,
        nodes=request.nodes, sharding=None, offload=False, gpu_name=gpu)).samples_per_s


def brute_force_speed(request: PlanRequest, sim: SimulatedStep, *, slack: int = 0) -> float:
    """Speed of the best setting found by tracing every candidate with the simulation (no planner
    code), counting only those that fit with `slack` bytes to spare."""
    best = 0.0
    probe = dataclasses.replace(sim, calls=[])
    for precision in request.precisions:
        pool = sorted((d for d in request.devices if precision != "bf16-mixed" or d.compute_capability >= (8, 0)),
                      key=lambda d: -d.free_bytes)
        for ckpt in (False, True) if request.allow_checkpointing else (False,):
            for g in range(1, len(pool) + 1):
                world = g * request.nodes
                if request.global_batch_size % world:
                    continue
                budget = int(pool[g - 1].free_bytes * (1 - request.margin))
                per_rank = request.global_batch_size // world
                for micro in (m for m in range(1, per_rank + 1) if per_rank % m == 0):
                    est = probe(micro_batch_size=micro, precision=precision, checkpointing=ckpt, world_size=world)
                    if est.device_total + slack <= budget:
                        best = max(best, speed(request, sim, world=world, micro=micro, precision=precision,
                                               checkpointing=ckpt, gpu=pool[g - 1].name))
    return best


def speed_of(plan: Plan, request: PlanRequest, sim: SimulatedStep) -> float:
    return speed(request, sim, world=plan.world_size, micro=plan.micro_batch_size, precision=plan.precision,
                 checkpointing=plan.gradient_checkpointing, gpu=plan.gpu_name)


def exact_peak(sim: SimulatedStep, plan: Plan) -> int:
    return dataclasses.replace(sim, calls=[])(
        micro_batch_size=plan.micro_batch_size, precision=plan.precision,
        checkpointing=plan.gradient_checkpointing, world_size=plan.world_size).device_total
