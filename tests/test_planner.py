"""The planner (memplan.planner): search, throughput and host models, NoFit, request checks.

Most tests run the planner against a *simulated* estimator: a function building the MemoryEstimate of
a simulated training step on a simulated GPU, with memory linear in the micro-batch (weights,
gradients, optimizer state, DDP buckets and NCCL buffers fixed; activations per sample). The
simulation records its calls, so the tests can count traces. One test runs the real memplan.estimate.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

from memplan.estimator.cuda.overheads import nccl_buffer_bytes
from memplan.estimator.errors import EstimateError
from memplan.estimator.flops import OpCost, StepCosts
from memplan.estimator.result import MemoryEstimate
from memplan.hardware import GpuInfo, lookup_gpu
from memplan.plan import Plan
from memplan.planner import (
    DeviceBudget,
    HostLoad,
    NoFit,
    PlanRequest,
    StepSetting,
    estimator_for,
    host_bytes_per_rank,
    make_plan,
    predict_step,
)
from memplan.planner.profile import CostProfile
from memplan.planner.costs import RANK_RUNTIME_BYTES, WORKER_BYTES
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


# --- the search ----------------------------------------------------------------------------------
def test_picks_the_largest_micro_batch_that_fits_and_keeps_the_global_batch():
    # 8 x A100-80GB, budget 72 GiB. Per rank under AMP: 5 GiB fixed + 1.5 GiB/sample (+ context, NCCL):
    # micro 32 needs ~54.5 GiB, micro 64 ~102.5 GiB: micro 32, accumulation 2 for global 512.
    sim = SimulatedStep(activation_bytes_per_sample=3 * GiB)
    request = PlanRequest(global_batch_size=512, devices=gpus("A100-80GB", 8))
    plan = make_plan(request, sim)
    assert (plan.world_size, plan.micro_batch_size, plan.accumulate_grad_batches) == (8, 32, 2)
    assert plan.micro_batch_size * plan.world_size * plan.accumulate_grad_batches == 512
    assert (plan.precision, plan.gradient_checkpointing, plan.strategy) == ("bf16-mixed", False, "ddp")
    assert plan.gpus == tuple(range(8))
    assert plan.predicted_peak_bytes == exact_peak(sim, plan) <= plan.device_budget_bytes == int(80 * GiB * 0.9)
    assert speed_of(plan, request, sim) == pytest.approx(brute_force_speed(request, sim))
    assert any("64 needs" in r and "over the 72.00 GiB budget" in r for r in plan.reasons)
    assert Plan.from_dict(plan.to_dict()) == plan


@pytest.mark.parametrize("global_batch, act_gib, params_gib, count", [
    (256, 3, 1, 8), (96, 7, 2, 4), (60, 20, 1, 8), (1024, 0.25, 4, 2), (24, 48, 1, 3), (12, 1, 8, 8),
    (64, 1, 15, 8),  # DDP's buckets do not fit: one GPU wins
])
def test_plan_is_as_fast_as_tracing_every_candidate(global_batch, act_gib, params_gib, count):
    sim = SimulatedStep(params_bytes=int(params_gib * GiB), activation_bytes_per_sample=int(act_gib * GiB))
    request = PlanRequest(global_batch_size=global_batch, devices=gpus("A100-80GB", count))
    plan = make_plan(request, sim)
    assert plan.micro_batch_size * plan.world_size * plan.accumulate_grad_batches == global_batch
    assert plan.predicted_peak_bytes == exact_peak(sim, plan) <= plan.device_budget_bytes
    # As fast as the best setting with 64 MiB to spare (the planner keeps a 32 MiB safety on predictions).
    assert speed_of(plan, request, sim) >= brute_force_speed(request, sim, slack=64 * MiB) * (1 - 1e-9)
    assert len(sim.calls) <= 10


def test_world_size_divides_the_global_batch_and_says_which_gpus_it_left_out():
    sim = SimulatedStep(activation_bytes_per_sample=GiB)
    plan = make_plan(PlanRequest(global_batch_size=36, devices=gpus("A100-80GB", 8)), sim)
    assert plan.world_size == 6 and plan.micro_batch_size * 6 * plan.accumulate_grad_batches == 36
    assert any(r.startswith("Uses 6 of 8 GPUs per node") and "does not split evenly over 7, 8 ranks" in r
               for r in plan.reasons)


def test_leaves_out_a_gpu_that_another_job_uses():
    # cuda:2 has 10 GiB free; the step needs ~7.6 GiB at micro-batch 1 with DDP, more than 9 GiB
    # budget allows once micro-batch or NCCL grow, so using it would cap all four GPUs.
    sim = SimulatedStep(params_bytes=2 * GiB, activation_bytes_per_sample=2 * GiB)
    devices = gpus("A100-80GB", 4, cuda2=10 * GiB)
    plan = make_plan(PlanRequest(global_batch_size=48, devices=devices), sim)
    assert plan.world_size == 3 and plan.gpus == (0, 1, 3)
    assert plan.device_budget_bytes == int(80 * GiB * 0.9)
    left = [r for r in plan.reasons if r.startswith("Left out cuda:2")]
    assert len(left) == 1 and "10.00 GiB free of 80.00 GiB (other processes hold 70.00 GiB)" in left[0]
    assert "cap every GPU's budget at 9.00 GiB" in left[0]
    assert any(r.startswith("Uses 3 of 4 GPUs per node: with 4 nothing fits the 9.00 GiB per-GPU budget")
               for r in plan.reasons)


def test_prefers_bf16_on_sm80_and_falls_back_to_16_mixed_on_v100():
    a100 = make_plan(PlanRequest(global_batch_size=64, devices=gpus("A100-80GB", 2)), SimulatedStep())
    assert a100.precision == "bf16-mixed"
    assert any(a.precision == "16-mixed" and a.fits and "GradScaler" in a.why_not for a in a100.alternatives)
    v100_sim = SimulatedStep(params_bytes=GiB // 4, activation_bytes_per_sample=GiB // 4, cc=(7, 0))
    v100 = make_plan(PlanRequest(global_batch_size=64, devices=gpus("V100-32GB", 2)), v100_sim)
    assert v100.precision == "16-mixed"  # and the simulation, like memplan.estimate, refuses bf16 on sm70
    assert all(p != "bf16-mixed" for _, p, _, _ in v100_sim.calls)
    assert any("compute capability 8.0+" in r for r in v100.reasons)


def test_bf16_only_uses_the_sm80_gpus_of_a_mixed_box():
    devices = (gpus("A100-80GB", 1)[0], dataclasses.replace(gpus("V100-32GB", 2)[1]))
    sim = SimulatedStep(params_bytes=GiB // 4, activation_bytes_per_sample=GiB // 8)
    plan = make_plan(PlanRequest(global_batch_size=64, devices=devices, precisions=("bf16-mixed",)), sim)
    assert (plan.precision, plan.gpus, plan.gpu_name) == ("bf16-mixed", (0,), "A100-80GB")
    assert "Left out cuda:1 (V100-32GB): bf16-mixed needs compute capability 8.0+, it has 7.0." in plan.reasons
    # The V100 sets the pace of a step it joins (125 dense half-precision TFLOP/s against 312): two ranks at
    # its speed are slower than the A100 alone, four are faster.
    both = make_plan(PlanRequest(global_batch_size=64, devices=devices), sim)
    assert (both.precision, both.gpus, both.gpu_name) == ("bf16-mixed", (0,), "A100-80GB")
    four = (devices[0], *(dataclasses.replace(d, cuda_index=i) for i, d in enumerate(gpus("V100-32GB", 4)[1:], 1)))
    wide = make_plan(PlanRequest(global_batch_size=64, devices=four), sim)
    assert (wide.precision, wide.gpus, wide.gpu_name) == ("16-mixed", (0, 1, 2, 3), "V100-32GB")


def test_turns_on_checkpointing_only_when_needed():
    roomy = SimulatedStep(activation_bytes_per_sample=GiB)
    plan = make_plan(PlanRequest(global_batch_size=64, devices=gpus("A100-80GB", 8)), roomy)
    assert not plan.gradient_checkpointing
    assert not any(ckpt for _, _, ckpt, _ in roomy.calls), "checkpointing traced although it could not win"
    # 160 GiB of fp32 activations per sample: 80 GiB under AMP does not fit at micro-batch 1;
    # checkpointed (20 GiB per sample), micro-batch 2 fits (~46 GiB) and 4 does not (~86 GiB).
    tight = SimulatedStep(activation_bytes_per_sample=160 * GiB)
    plan = make_plan(PlanRequest(global_batch_size=64, devices=gpus("A100-80GB", 8)), tight)
    assert plan.gradient_checkpointing and (plan.world_size, plan.micro_batch_size) == (8, 2)
    assert any(r.startswith("Activation checkpointing on") and "nothing without checkpointing fits" in r
               for r in plan.reasons)
    assert len(tight.calls) <= 5


def test_host_ram_limits_the_world_size():
    load = HostLoad(model_init_bytes=3 * GiB, sample_bytes=MiB, num_workers=2)
    per_rank_at_1 = host_bytes_per_rank(load, 1)  # ~6 GiB: runtime + model copy + 2 workers
    request = PlanRequest(global_batch_size=48, devices=gpus("A100-80GB", 8),
                          host_available_bytes=22 * GiB, host_load=load)
    plan = make_plan(request, SimulatedStep())
    assert plan.world_size == 3  # 3 x ~6 GiB fits 19.8 GiB; 4 do not
    assert plan.host_bytes_per_rank == host_bytes_per_rank(load, plan.micro_batch_size)
    assert 3 * plan.host_bytes_per_rank <= int(22 * GiB * 0.9) < 4 * per_rank_at_1
    assert any(r.startswith("Uses 3 of 8 GPUs per node: host RAM stops 4") for r in plan.reasons)


def test_no_fit_carries_what_ddp_and_fsdp_need():
    # 20 GiB of fp32 parameters: DDP keeps params + grads + 2 x Adam state + buckets = 100 GiB per GPU,
    # + context and NCCL: 101.57 GiB. FSDP: 80 GiB / 8 + 2 x 1 GiB block + context, NCCL, activations.
    sim = SimulatedStep(params_bytes=20 * GiB, activation_bytes_per_sample=GiB)
    request = PlanRequest(global_batch_size=64, devices=gpus("A100-80GB", 8), largest_block_bytes=GiB)
    with pytest.raises(NoFit) as info:
        make_plan(request, sim)
    err = info.value
    direct = dataclasses.replace(sim, calls=[])
    assert err.ddp_needed_bytes_per_gpu == direct(micro_batch_size=1, precision="16-mixed", checkpointing=True,
                                                  world_size=8).device_total
    single = direct(micro_batch_size=1, precision="16-mixed", checkpointing=True, world_size=1)
    sharded = -(-(single.parameters + single.gradients + single.optimizer_state) // 8)
    assert err.fsdp_needed_bytes_per_gpu == (sharded + single.activations + (single.peak_reserved - single.peak_allocated)
                                             + 2 * GiB + CONTEXT_BYTES + nccl_buffer_bytes(8))
    assert err.budget_bytes_per_gpu == int(80 * GiB * 0.9)
    message = str(err)
    assert "DDP needs 101.57 GiB per GPU across 8 GPUs" in message
    assert "FSDP full shard across 8 GPUs would need about 13.57 GiB per GPU" in message
    assert "strategy='fsdp'" in message
    assert len(sim.calls) <= 5


def test_no_fit_on_the_host_says_so():
    request = PlanRequest(global_batch_size=8, devices=gpus("A100-80GB", 2), host_available_bytes=GiB,
                          host_load=HostLoad(model_init_bytes=0, sample_bytes=0))
    with pytest.raises(NoFit, match=r"host RAM limits the ranks: 1 rank\(s\) per node need 2.00 GiB"):
        make_plan(request, SimulatedStep())


def test_a_typical_search_takes_few_traces():
    sim = SimulatedStep(activation_bytes_per_sample=GiB)
    make_plan(PlanRequest(global_batch_size=64, devices=gpus("A100-80GB", 8)), sim)
    # micro 1 and 4 of the AMP DDP group (16-mixed, world 2), then the winner at its own setting.
    assert sim.calls[:2] == [(1, "16-mixed", False, 2), (4, "16-mixed", False, 2)]
    assert sim.calls[2] == (8, "bf16-mixed", False, 8) and len(sim.calls) == 3


def test_an_optimistic_line_is_caught_by_the_verification_trace():
    # The optimizer step's scratch (12 GiB) holds the peak up to micro-batch 8, so micro 1 and 4 trace
    # the same: the line is flat. This estimator reports neither forward activations nor phase peaks.
    sim = SimulatedStep(activation_bytes_per_sample=3 * GiB, optimizer_scratch_bytes=12 * GiB,
                        report_activations=False)
    request = PlanRequest(global_batch_size=512, devices=gpus("A100-80GB", 8))
    plan = make_plan(request, sim)
    assert plan.micro_batch_size == 32 and plan.accumulate_grad_batches == 2
    assert plan.predicted_peak_bytes == exact_peak(sim, plan) <= plan.device_budget_bytes
    assert (64, "bf16-mixed", False, 8) in sim.calls  # tried, did not fit, shrunk
    assert len(sim.calls) <= 6


def test_saved_activations_keep_a_flat_start_from_misleading_the_line():
    # As above, but the estimator reports forward activations: their growth sets the slope.
    sim = SimulatedStep(activation_bytes_per_sample=3 * GiB, optimizer_scratch_bytes=12 * GiB)
    plan = make_plan(PlanRequest(global_batch_size=512, devices=gpus("A100-80GB", 8)), sim)
    assert plan.micro_batch_size == 32
    assert not any(micro == 64 for micro, *_ in sim.calls) and len(sim.calls) <= 4


def test_the_steepest_phase_sets_the_line_when_another_holds_the_peak_at_small_batches():
    # bf16-mixed on 8 GPUs: 5 GiB fixed, 0.5 GiB activations and 1 GiB more in the backward per sample.
    # A forward scratch of 20 GiB holds the peak at micro-batch 1 and 4 (25.5, 27 GiB); the backward
    # holds it from micro-batch 16 on (micro 32: 53 GiB, 64: 101 GiB). The line through the
    # forward-held traces alone (0.5 GiB a sample) would admit 64: a wasted verification trace.
    sim = SimulatedStep(activation_bytes_per_sample=1 * GiB, forward_scratch_bytes=20 * GiB,
                        backward_bytes_per_sample=2 * GiB)
    plan = make_plan(PlanRequest(global_batch_size=512, devices=gpus("A100-80GB", 8)), sim)
    assert plan.micro_batch_size == 32
    assert not any(micro == 64 for micro, *_ in sim.calls) and len(sim.calls) <= 4
    assert plan.predicted_peak_bytes == exact_peak(sim, plan) <= plan.device_budget_bytes
    for a in plan.alternatives:  # no prediction falls under the truth
        truth = exact_peak(sim, dataclasses.replace(plan, world_size=a.world_size, micro_batch_size=a.micro_batch_size,
                                                    accumulate_grad_batches=a.accumulate_grad_batches,
                                                    precision=a.precision, gradient_checkpointing=a.gradient_checkpointing))
        assert a.predicted_peak_bytes >= truth, a


@pytest.mark.parametrize("act_mib", [100, 333, 1000])
def test_predictions_do_not_undercut_the_allocator_rounding(act_mib):
    # Reserved memory grows in 64 MiB steps: a line through two traces can fall below a step.
    sim = SimulatedStep(activation_bytes_per_sample=act_mib * MiB, segment_bytes=64 * MiB)
    plan = make_plan(PlanRequest(global_batch_size=1024, devices=gpus("A100-80GB", 8)), sim)
    assert plan.alternatives
    for a in plan.alternatives:
        truth = exact_peak(sim, dataclasses.replace(plan, world_size=a.world_size, micro_batch_size=a.micro_batch_size,
                                                    accumulate_grad_batches=a.accumulate_grad_batches,
                                                    precision=a.precision, gradient_checkpointing=a.gradient_checkpointing))
        assert a.predicted_peak_bytes >= truth, a


def test_alternatives_show_fits_that_lost_and_near_misses():
    # cuda7 has 6 GiB free: eight ranks would be faster but their budget (5.4 GiB) holds no setting.
    sim = SimulatedStep(activation_bytes_per_sample=3 * GiB)
    plan = make_plan(PlanRequest(global_batch_size=512, devices=gpus("A100-80GB", 8, cuda7=6 * GiB)), sim)
    assert plan.world_size == 4
    assert 1 <= len(plan.alternatives) <= 5
    misses = [a for a in plan.alternatives if not a.fits]
    lost = [a for a in plan.alternatives if a.fits]
    assert misses and all(a.relative_speed > 1 and a.predicted_peak_bytes > int(6 * GiB * 0.9) for a in misses)
    assert misses[0].world_size == 8 and "over the 5.40 GiB budget" in misses[0].why_not
    assert lost and all(a.relative_speed <= 1 and a.why_not and a.predicted_peak_bytes <= plan.device_budget_bytes
                        for a in lost)
    assert [a.relative_speed for a in plan.alternatives] == sorted((a.relative_speed for a in plan.alternatives),
                                                                    reverse=True)


def test_max_micro_batch_size_caps_the_micro_batch():
    plan = make_plan(PlanRequest(global_batch_size=64, devices=gpus("A100-80GB", 1), max_micro_batch_size=5),
                     SimulatedStep(activation_bytes_per_sample=MiB))
    assert (plan.micro_batch_size, plan.accumulate_grad_batches) == (4, 16)
    assert any("max_micro_batch_size=5" in r for r in plan.reasons)


def test_nodes_multiply_the_world_size():
    sim = SimulatedStep(activation_bytes_per_sample=GiB, cc=(9, 0))
    plan = make_plan(PlanRequest(global_batch_size=128, devices=gpus("H100-80GB", 8), nodes=2), sim)
    assert (plan.nodes, plan.world_size, plan.gpus_per_node) == (2, 16, 8)
    assert plan.predicted_peak_bytes == exact_peak(sim, plan)
    # Traced at world size 2 (and 16 to verify); the 8-rank alternative's NCCL bytes come from the formula.
    assert {w for *_, w in sim.calls} == {2, 16}
    eight = next(a for a in plan.alternatives if a.world_size == 8)
    exact = exact_peak(sim, dataclasses.replace(plan, world_size=8, micro_batch_size=eight.micro_batch_size,
                                                accumulate_grad_batches=eight.accumulate_grad_batches))
    assert 0 <= eight.predicted_peak_bytes - exact <= 64 * MiB + 0.02 * eight.micro_batch_size * GiB


# --- the models ----------------------------------------------------------------------------------
def test_host_bytes_per_rank_formula():
    load = HostLoad(model_init_bytes=GiB, sample_bytes=MiB, num_workers=4, prefetch_factor=2, pin_memory=True)
    assert host_bytes_per_rank(load, 8) == (RANK_RUNTIME_BYTES + GiB + 4 * WORKER_BYTES
                                            + 8 * MiB * (4 * 2 + 1) + 2 * 8 * MiB)
    assert host_bytes_per_rank(HostLoad(model_init_bytes=0, sample_bytes=MiB), 2) == RANK_RUNTIME_BYTES + 2 * MiB


def test_device_budget_from_nvml_reading_and_catalog():
    info = GpuInfo(index=3, uuid="GPU-x", name="NVIDIA A100-SXM4-80GB", total_bytes=80 * GiB,
                   used_bytes=30 * GiB, free_bytes=50 * GiB, compute_capability=None, mig_mode=False)
    budget = DeviceBudget.from_gpu_info(info, cuda_index=1)
    assert (budget.cuda_index, budget.free_bytes, budget.compute_capability) == (1, 50 * GiB, (8, 0))
    catalog = DeviceBudget.from_catalog(lookup_gpu("V100-16GB"))
    assert catalog.free_bytes == catalog.total_bytes == 16160 * MiB and catalog.cuda_index is None
    with pytest.raises(ValueError, match="no memory reading"):
        DeviceBudget.from_gpu_info(dataclasses.replace(info, free_bytes=None))


# --- bad requests ----------------------------------------------------------------------------------
A100 = gpus("A100-80GB", 2)


@pytest.mark.parametrize("kwargs, match", [
    (dict(devices=()), r"PlanRequest.devices must be a non-empty tuple"),
    (dict(margin=1.0), r"PlanRequest.margin must be a fraction in \[0, 1\)"),
    (dict(margin=-0.1), r"PlanRequest.margin must be a fraction in \[0, 1\)"),
    (dict(precisions=("fp8",)), r"PlanRequest.precisions: 'fp8' is not a precision the planner searches"),
    (dict(precisions=("bf16-true",)), r"'bf16-true' is not a precision the planner searches"),
    (dict(precisions=("bf16-mixed",), devices=gpus("V100-32GB", 2)), r"allows only 'bf16-mixed'.*add '16-mixed'"),
    (dict(global_batch_size=0), r"PlanRequest.global_batch_size must be an int >= 1"),
    (dict(global_batch_size=10, nodes=4), r"global_batch_size \(10\) must be divisible by the world size.*multiple of 4"),
    (dict(max_micro_batch_size=0), r"PlanRequest.max_micro_batch_size must be an int >= 1"),
    (dict(devices=gpus("A100-80GB", 1) * 2), r"lists a cuda_index twice"),
])
def test_bad_requests_name_the_field_and_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PlanRequest(**{"global_batch_size": 64, "devices": A100, **kwargs})


def test_bad_device_budget_and_host_load():
    with pytest.raises(ValueError, match=r"DeviceBudget.free_bytes .* must not exceed total_bytes"):
        DeviceBudget(name="A100-80GB", cuda_index=0, total_bytes=GiB, free_bytes=2 * GiB, compute_capability=(8, 0))
    with pytest.raises(ValueError, match=r"DeviceBudget.compute_capability must be a \(major, minor\)"):
        DeviceBudget(name="A100-80GB", cuda_index=0, total_bytes=GiB, free_bytes=GiB, compute_capability=(8,))
    with pytest.raises(ValueError, match=r"HostLoad.prefetch_factor must be an int >= 1"):
        HostLoad(model_init_bytes=0, sample_bytes=0, prefetch_factor=0)


# --- the real estimator ----------------------------------------------------------------------------
def test_plan_with_the_real_estimator_matches_a_direct_estimate():
    import memplan
    from memplan.batching import resize_batch
    from memplan.demos import ImageCNN

    batch = ImageCNN().example_batch(4)
    calls = []
    traced = estimator_for(ImageCNN, batch, device="A100-80GB")  # the model is built under fake tensors

    def estimator(**kwargs):
        calls.append(kwargs)
        return traced(**kwargs)

    # ~3.9 MiB of activations per sample: 2 GiB free per GPU holds micro-batch 128, not 256 (with NCCL).
    a100 = lookup_gpu("A100-80GB")
    device = DeviceBudget(name=a100.name, cuda_index=None, total_bytes=a100.total_bytes, free_bytes=2 * GiB,
                          compute_capability=(8, 0))
    request = PlanRequest(global_batch_size=512, devices=(device, device), allow_checkpointing=False)
    plan = make_plan(request, estimator)
    direct = memplan.estimate(ImageCNN, resize_batch(batch, plan.micro_batch_size), precision=plan.precision,
                              device="A100-80GB", strategy="ddp" if plan.world_size > 1 else None,
                              world_size=plan.world_size)
    assert plan.predicted_peak_bytes == direct.device_total <= plan.device_budget_bytes
    # The small CNN's micro-steps are bound by the host (costs.HOST_SECONDS_PER_OP per op): 32-true, which runs no
    # autocast casts, is the faster; the two GPUs' DDP buckets leave room for micro-batch 64.
    assert (plan.world_size, plan.precision) == (2, "32-true")
    assert plan.micro_batch_size < 256 and plan.accumulate_grad_batches > 1
    assert len(calls) <= 6


def test_all_devices_keeps_every_candidate_on_every_gpu():
    """MemoryPlanner's request: the Trainer's world size is fixed, so no candidate uses fewer GPUs."""
    from memplan.planner.candidates import enumerate_candidates
    from memplan.planner.request import DeviceBudget, PlanRequest

    gpu = DeviceBudget(name="cpu", cuda_index=None, total_bytes=1 << 34, free_bytes=1 << 34, compute_capability=(8, 0))
    free = PlanRequest(global_batch_size=16, devices=(gpu, gpu), precisions=("32-true",))
    fixed = PlanRequest(global_batch_size=16, devices=(gpu, gpu), precisions=("32-true",), all_devices=True)
    assert {c.gpus_per_node for c in enumerate_candidates(free)} == {1, 2}
    assert {c.gpus_per_node for c in enumerate_candidates(fixed)} == {2}


# --- a Trainer's request: world size and precision fixed --------------------------------------------
def test_a_trainers_request_that_fits_whole_is_planned_with_one_trace():
    # MemoryPlanner's request (all_devices, the Trainer's precision): every trace runs the user's training_step,
    # so where the largest micro-batch without checkpointing fits, that one trace is the plan.
    sim = SimulatedStep(activation_bytes_per_sample=256 * MiB)
    request = PlanRequest(global_batch_size=64, devices=gpus("A100-80GB", 2), all_devices=True,
                          precisions=("bf16-mixed",), allow_checkpointing=True)
    plan = make_plan(request, sim)
    assert sim.calls == [(32, "bf16-mixed", False, 2)]
    assert (plan.world_size, plan.micro_batch_size, plan.gradient_checkpointing) == (2, 32, False)
    assert plan.predicted_peak_bytes == exact_peak(sim, plan)
    assert speed_of(plan, request, sim) == pytest.approx(brute_force_speed(request, sim), rel=1e-9)


def test_a_trainers_request_whose_largest_micro_batch_does_not_fit_is_searched_as_before():
    # 6 GiB a sample (3 under AMP): micro 32 needs ~101 GiB, over the 72 GiB budget; that first trace joins the
    # curve and the search goes on from its usual traces to the fastest setting that fits.
    sim = SimulatedStep(activation_bytes_per_sample=6 * GiB)
    request = PlanRequest(global_batch_size=64, devices=gpus("A100-80GB", 2), all_devices=True,
                          precisions=("bf16-mixed",), allow_checkpointing=True)
    plan = make_plan(request, sim)
    assert sim.calls[0] == (32, "bf16-mixed", False, 2) and len(sim.calls) > 1
    assert exact_peak(sim, plan) <= int(gpus("A100-80GB", 1)[0].free_bytes * (1 - request.margin))
    assert speed_of(plan, request, sim) == pytest.approx(brute_force_speed(request, sim), rel=1e-9)


@dataclass
class SelfCheckpointingStep(SimulatedStep):
    """A SimulatedStep whose model calls torch.utils.checkpoint inside its own forward, as a trace reports
    it (MemoryEstimate.own_checkpoint_calls): its activations are already those of a checkpointed model."""

    def __call__(self, **kwargs) -> MemoryEstimate:
        return dataclasses.replace(super().__call__(**kwargs), own_checkpoint_calls=4)


def test_a_model_checkpointing_inside_its_forward_is_kept_and_memplan_adds_none():
    # 40 GiB per sample under AMP: memplan's checkpointing would be needed for micro-batch 1 to fit,
    # but the model checkpoints itself: the plan adds none, says so, and reuses the traces it made
    sim = SelfCheckpointingStep(activation_bytes_per_sample=80 * GiB)
    plan = make_plan(PlanRequest(global_batch_size=64, devices=gpus("A100-80GB", 8)), sim)
    assert plan.checkpointing.mode == "none" and not plan.gradient_checkpointing
    assert plan.user_checkpointing == "torch.utils.checkpoint called 4 times a step inside the model's forward"
    assert any(r.startswith("Keeps the model's own activation checkpointing (torch.utils.checkpoint") for r in plan.reasons)
    assert not any(ckpt for _, _, ckpt, _ in sim.calls)
    assert len(sim.calls) == len(set(sim.calls)), "a trace made before the model's checkpointing was found is made again"


@dataclass
class CastBoundStep(SimulatedStep):
    """A simulated step whose autocast casts (many small ops, host-bound) cost more than AMP's tensor-core
    speed-up: a small MLP on a fast GPU, where 32-true wins."""

    casts: int = 20_000

    def costs(self, micro: int, precision: str) -> StepCosts:
        base = super().costs(micro, precision)
        if precision == "32-true":
            return base
        cast = OpCost(op_class="elementwise", dtype="bf16", phase="forward", flops=0, bytes=1024, cast=True,
                      count=self.casts)
        return StepCosts(ops=base.ops + (cast,))


def test_a_32_true_winner_lists_each_alternative_once_and_races_its_mixed_precision_settings():
    # A 32-true winner has no bf16/16-mixed twin: its mixed settings are ordinary rivals (the runner-up when
    # fastest), and an alternative found both as "the winner's twin" and as "the best of its kind" is printed once.
    sim = CastBoundStep(params_bytes=64 * MiB, activation_bytes_per_sample=MiB)
    plan = make_plan(PlanRequest(global_batch_size=64, devices=gpus("H100-80GB", 1)), sim)
    assert plan.precision == "32-true"
    lines = [(a.world_size, a.micro_batch_size, a.precision, a.checkpointing) for a in plan.alternatives]
    assert len(lines) == len(set(lines)), lines
    mixed = [a for a in plan.alternatives if a.precision != "32-true" and a.fits]
    assert mixed and "bf16-mixed instead of 32-true (AMP's casts cost more than it saves here)" in mixed[0].why_not
    fastest_rival = max((a for a in plan.alternatives if a.fits), key=lambda a: a.relative_speed)
    assert f"micro-batch {fastest_rival.micro_batch_size}, {fastest_rival.precision}" in plan.speed_reason
