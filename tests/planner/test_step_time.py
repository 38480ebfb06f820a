"""planner/costs.py's step-time model and planner/profile.py's derivations, and the ranking they give."""
from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

import pytest

from memplan.estimator.flops import OpCost, StepCosts
from memplan.hardware import lookup_gpu
from memplan.hardware.catalog import gpu_links
from memplan.plan import Plan
from memplan.planner import DeviceBudget, PlanRequest, StepSetting, make_plan, predict_step
from memplan.planner import costs
from memplan.planner.profile import CostProfile
from memplan.units import GiB

A100 = gpu_links("A100-80GB")


def one_gpu(profile: CostProfile, **kwargs):
    setting = dict(precision="bf16-mixed", checkpointing=False, micro_batch_size=1, accumulate_grad_batches=1,
                   world_size=1, gpus_per_node=1, nodes=1, sharding=None, offload=False, gpu_name="A100-80GB")
    return predict_step(profile, StepSetting(**{**setting, **kwargs}))


def costs_of(*ops: OpCost) -> StepCosts:
    return StepCosts(ops=ops)


def op(phase: str, op_class: str = "matmul", *, flops: int = 0, nbytes: int = 0, dtype: str = "bf16", **kw) -> OpCost:
    return OpCost(op_class=op_class, dtype=dtype, phase=phase, flops=flops, bytes=nbytes, **kw)


# --- the roofline -----------------------------------------------------------------------------------
def test_each_op_takes_the_longer_of_its_compute_and_its_memory_time():
    big = op("forward", flops=10**12, nbytes=10**6)                                   # compute-bound
    streaming = op("backward", "elementwise", flops=10**6, nbytes=10**10, dtype="fp32")  # memory-bound
    tiny = op("backward", "elementwise", flops=1, nbytes=1)                          # the kernel floor
    adam = op("optimizer", "elementwise", flops=10**6, nbytes=10**9, dtype="fp32")
    profile = CostProfile(costs_of(big, streaming, tiny, adam), traced_amp=True, parameter_count=10**6)
    t = one_gpu(profile)
    compute = 10**12 / (A100.dense_half_flops * costs.FLOP_EFFICIENCY["matmul"])
    memory = 10**10 / (A100.hbm_bytes_per_s * costs.BANDWIDTH_EFFICIENCY["elementwise"])
    assert t.micro_step_seconds == pytest.approx(compute + memory + costs.MIN_KERNEL_SECONDS)
    assert t.optimizer_seconds == pytest.approx(10**9 / (A100.hbm_bytes_per_s * costs.BANDWIDTH_EFFICIENCY["elementwise"]))
    assert t.step_seconds == pytest.approx(t.micro_step_seconds + t.optimizer_seconds)
    assert t.samples_per_s == pytest.approx(1 / t.step_seconds)
    assert t.tokens_per_s is None  # no sequence dimension
    # MFU: the forward and backward matmul FLOPs over the step at the bf16 peak
    assert t.mfu == pytest.approx(10**12 / (t.step_seconds * A100.dense_half_flops))


def test_many_small_ops_are_bound_by_the_host():
    ops = [op("forward", "elementwise", flops=10, nbytes=100) for _ in range(1000)]
    t = one_gpu(CostProfile(costs_of(*ops), traced_amp=True, parameter_count=10))
    assert t.micro_step_seconds == pytest.approx(1000 * costs.HOST_SECONDS_PER_OP)


def test_the_host_floor_is_what_the_host_bound_steps_on_a_gpu_took_per_op():
    # benchmarks/results/step_time_gpu.json: steps timed on an H200. Those bound by the host vary from step to step
    # (the host's Python), those bound by the GPU hardly do; the host-bound ones' time per traced op is the floor.
    rows = json.loads((Path(__file__).resolve().parents[2] / "benchmarks/results/step_time_gpu.json").read_text())["rows"]

    def deviation(r: dict) -> float:
        median = statistics.median(r["step_seconds"])
        return statistics.median(abs(x - median) for x in r["step_seconds"]) / median

    gpu_bound = [r for r in rows if r["precision"] == "32-true"]
    assert max(map(deviation, gpu_bound)) < 0.005
    host_bound = [r for r in rows if deviation(r) > 0.02 and not r["checkpointing"]]
    assert {(r["model"], r["micro_batch"]) for r in host_bound} == {("gpt2-small", 4), ("vit-l16", 32)}
    for r in host_bound:
        per_op = (r["step_seconds_median"] - r["predicted"]["optimizer_seconds"]) / r["predicted"]["host_ops"]
        assert 0.75 * costs.HOST_SECONDS_PER_OP < per_op < 1.25 * costs.HOST_SECONDS_PER_OP, r["model"]
        assert r["predicted"]["step_seconds"] == pytest.approx(r["step_seconds_median"], rel=0.2)

def test_a_recomputed_op_costs_the_host_twice_an_ordinary_one():
    forward = [op("forward", "elementwise", flops=10, nbytes=100, in_block=True) for _ in range(300)]
    backward = [op("backward", "elementwise", flops=10, nbytes=100) for _ in range(500)]
    profile = CostProfile(costs_of(*forward, *backward), traced_amp=True, parameter_count=10)
    plain, full = one_gpu(profile), one_gpu(profile, checkpointing=True)
    assert plain.micro_step_seconds == pytest.approx(800 * costs.HOST_SECONDS_PER_OP)
    assert full.micro_step_seconds == pytest.approx((800 + costs.RECOMPUTE_HOST_FACTOR * 300) * costs.HOST_SECONDS_PER_OP)


def test_the_recompute_host_cost_is_what_checkpointing_added_to_the_host_bound_steps_on_two_gpus():
    # benchmarks/results/step_time_cards.json: the steps bound by the host without checkpointing (GPT-2 small at
    # micro-batch 4, ViT-L/16 at 32; bf16-mixed) on an H200 and an H100 host: full checkpointing added what its
    # recomputed ops cost the host, the difference in the ops the model counts for the host.
    cards = json.loads((Path(__file__).resolve().parents[2] / "benchmarks/results/step_time_cards.json").read_text())
    seen = 0
    for card in cards["cards"]:
        rows = {(r["model"], r["precision"], r["micro_batch"], r["checkpointing"]): r for r in card["rows"]}
        for model, micro in (("gpt2-small", 4), ("vit-l16", 32)):
            none, full = rows[(model, "bf16-mixed", micro, False)], rows[(model, "bf16-mixed", micro, True)]
            assert none["predicted"]["gpu_seconds"] < none["measured_s"]  # not the GPU alone: the host sets the pace
            recomputed = full["predicted"]["host_ops"] - none["predicted"]["host_ops"]
            per_op = (full["measured_s"] - none["measured_s"]) / recomputed
            assert per_op == pytest.approx(costs.RECOMPUTE_HOST_FACTOR * costs.HOST_SECONDS_PER_OP, rel=0.15), (
                card["card"], model)
            seen += 1
    assert seen == 4


def test_32_true_runs_matmuls_on_the_fp32_peak_and_convolutions_on_tf32():
    matmul = op("forward", flops=10**12)
    conv = op("backward", flops=10**12, convolution=True)
    profile = CostProfile(costs_of(matmul, conv), traced_amp=True, parameter_count=1)
    fp32 = one_gpu(profile, precision="32-true")
    eff = costs.FLOP_EFFICIENCY["matmul"]
    assert fp32.micro_step_seconds == pytest.approx(10**12 / (A100.fp32_flops * eff) + 10**12 / (A100.dense_tf32_flops * eff))
    assert fp32.mfu == pytest.approx(2 * 10**12 / (fp32.step_seconds * A100.fp32_flops))


def test_ddp_hides_its_all_reduce_behind_the_backward():
    n = 10**9  # 4 GB of fp32 gradients, all-reduced over 8 NVLink 3 ranks: 2 x 7/8 x 4e9 / (300e9 x 0.7)
    ring = 2 * 7 / 8 * 4 * n / (300e9 * costs.COMM_EFFICIENCY)
    for backward_flops, exposed in ((10**13, None), (10**15, 'floor')):
        profile = CostProfile(costs_of(op("forward", flops=10**12), op("backward", flops=backward_flops)),
                              traced_amp=True, parameter_count=n)
        t = one_gpu(profile, world_size=8, gpus_per_node=8, micro_batch_size=1)
        backward = backward_flops / (A100.dense_half_flops * costs.FLOP_EFFICIENCY["matmul"])
        floor = (1 - costs.OVERLAP) * ring  # what contends with compute shows whatever the overlap
        want = max(floor, ring - costs.OVERLAP * backward) if exposed is None else floor
        assert t.communication_seconds == pytest.approx(want)
        assert want == floor or want > 2 * floor


# --- the profile's derivations -------------------------------------------------------------------
def test_two_traced_micro_batches_make_a_line_per_op():
    # A weight read (fixed) plus activations (4 KiB per sample): 1 -> 4 samples.
    low = costs_of(op("forward", flops=100, nbytes=1000 + 4096), op("optimizer", "elementwise", flops=5, nbytes=50))
    high = costs_of(op("forward", flops=400, nbytes=1000 + 4 * 4096), op("optimizer", "elementwise", flops=5, nbytes=50))
    profile = CostProfile(low, high=high, high_micro=4, traced_amp=True, parameter_count=1)
    assert profile.two_points
    at8 = {o.phase: (o.flops, o.bytes) for o in profile.ops(8, amp=True, checkpointing=False)}
    assert at8 == {"forward": (800, 1000 + 8 * 4096), "optimizer": (5, 50)}
    # ops that do not line up fall back to proportional scaling of the first trace
    unlike = CostProfile(low, high=costs_of(high.ops[0]), high_micro=4, traced_amp=True, parameter_count=1)
    assert not unlike.two_points
    assert {o.phase: o.bytes for o in unlike.ops(8, amp=True, checkpointing=False)} == {"forward": 8 * 5096, "optimizer": 50}


def test_traces_that_differ_in_a_few_ops_still_make_a_line_per_op():
    # transformers' causal-LM loss copies its shifted labels only when the batch has more than one sample: the
    # trace at micro-batch 4 has one op more than the one at 1. The other ops still make lines (their weight
    # reads stay flat), and the extra op scales from its own trace at micro-batches above the first.
    def trace(micro: int) -> StepCosts:
        ops = [op("forward", flops=100 * micro, nbytes=1000 + 4096 * micro, in_block=True) for _ in range(9)]
        if micro > 1:
            ops.insert(5, op("forward", "elementwise", flops=micro, nbytes=64 * micro, dtype="fp32"))
        return costs_of(*ops, op("optimizer", "elementwise", flops=5, nbytes=50, dtype="fp32"))

    profile = CostProfile(trace(1), high=trace(4), high_micro=4, traced_amp=True, parameter_count=1)
    assert profile.two_points

    def by_class(micro: int) -> dict:
        return {(o.op_class, o.phase): (o.count, o.bytes) for o in profile.ops(micro, amp=True, checkpointing=False)}

    assert by_class(8) == {("matmul", "forward"): (9, 1000 + 8 * 4096), ("elementwise", "forward"): (1, 8 * 64),
                           ("elementwise", "optimizer"): (1, 50)}
    assert by_class(1) == {("matmul", "forward"): (9, 1000 + 4096), ("elementwise", "optimizer"): (1, 50)}
    # checkpointing recomputes the in-block ops of the lined-up trace
    full = profile.ops(8, amp=True, checkpointing=True)
    assert sum(o.count for o in full if o.phase == "recompute") == 9


def test_derived_settings_recompute_in_block_ops_and_upcast_without_autocast():
    ops = costs_of(op("forward", flops=100, nbytes=10, in_block=True),
                   op("forward", flops=7, nbytes=3),                                   # outside the blocks
                   op("forward", "elementwise", flops=1, nbytes=6, dtype="fp32", cast=True),
                   op("backward", flops=200, nbytes=20))
    profile = CostProfile(ops, traced_amp=True, parameter_count=1)
    ckpt = profile.ops(1, amp=True, checkpointing=True)
    assert [(o.phase, o.flops) for o in ckpt if o.phase == "recompute"] == [("recompute", 100)]
    fp32 = profile.ops(1, amp=False, checkpointing=False)
    assert all(o.dtype == "fp32" for o in fp32) and len(fp32) == 3  # the cast is gone
    assert sorted(o.bytes for o in fp32) == [6, 20, 40]


# --- misaligned half-precision matmuls ------------------------------------------------------------------
def test_a_half_precision_matmul_with_unaligned_dimensions_runs_at_the_fallback_kernels_share_of_the_peak():
    aligned = op("forward", flops=10**12, align=8)       # 8 bf16 elements: 16 bytes
    unaligned = op("backward", flops=10**12, align=1)    # a dimension of 50257 elements
    t = one_gpu(CostProfile(costs_of(aligned, unaligned), traced_amp=True, parameter_count=1))
    assert t.micro_step_seconds == pytest.approx(
        10**12 / (A100.dense_half_flops * costs.FLOP_EFFICIENCY["matmul"])
        + 10**12 / (A100.dense_half_flops * costs.MISALIGNED_MATMUL_EFFICIENCY))
    # in 32-true the same GEMMs run on the CUDA cores (TF32 off for matmuls), where the alignment costs nothing
    fp32 = one_gpu(CostProfile(costs_of(aligned, unaligned), traced_amp=True, parameter_count=1), precision="32-true")
    assert fp32.micro_step_seconds == pytest.approx(2 * 10**12 / (A100.fp32_flops * costs.FLOP_EFFICIENCY["matmul"]))
    # 4 elements are 8 bytes in bf16 (too few) but 16 in tf32 (enough): a convolution's tf32 is never flagged
    half = CostProfile(costs_of(op("forward", flops=10**12, align=4)), traced_amp=True, parameter_count=1)
    assert [costs.misaligned(o) for o in half.ops(1, amp=True, checkpointing=False)] == [True]
    tf32 = dataclasses.replace(half.ops(1, amp=True, checkpointing=False)[0], dtype="tf32", align_bytes=16)
    assert not costs.misaligned(tf32)


def test_the_misaligned_share_is_what_the_lm_heads_gemms_reached_on_an_h100():
    # benchmarks/results/gpu_campaign_raw_h100/part4.json: torch.profiler's kernels of GPT-2 small, bf16-mixed,
    # micro-batch 8 x 1024 tokens. The LM head (768 -> 50257) ran its forward GEMM and both backward ones as cuBLAS's
    # alignment-1 fallback kernels, 2 x 8192 x 768 x 50257 FLOPs each.
    raw = Path(__file__).resolve().parents[2] / "benchmarks/results/gpu_campaign_raw_h100/part4.json"
    (setting,) = [s for s in json.loads(raw.read_text())["sections"]["kernel_profile"]["settings"]
                  if s["precision"] == "bf16-mixed"]
    align1 = [k for k in setting["top_kernels"] if "gemm" in k[0] and k[0].rstrip(")").endswith("align1::Params")]
    assert [k[1] for k in align1] == [1, 1, 1]  # one call each per step
    seconds = sum(k[2] for k in align1) * 1e-6
    reached = 3 * 2 * 8 * 1024 * 768 * 50257 / seconds / gpu_links("H100-80GB").dense_half_flops
    assert reached == pytest.approx(costs.MISALIGNED_MATMUL_EFFICIENCY, rel=0.1)
    assert reached < costs.FLOP_EFFICIENCY["matmul"] / 4


# --- the ranking -------------------------------------------------------------------------------------
@dataclasses.dataclass
class RoomyStep:
    """A simulated 350M-parameter language model (1024 tokens per sample) whose memory fits anything:
    the plan is decided by the step-time model alone."""

    params: int = 350_000_000

    def costs(self, micro: int, precision: str) -> StepCosts:
        n, t = self.params, 1024
        dtype, size = ("fp32", 4) if precision == "32-true" else ("bf16", 2)
        per_layer = []
        for layer in range(24):  # matmuls read their weights, elementwise ops their activations
            per_layer += [op("forward", flops=2 * n * t * micro // 24, nbytes=size * n // 24 + size * t * 1024 * micro,
                             dtype=dtype, in_block=True),
                          op("forward", "elementwise", flops=t * 4096 * micro, nbytes=2 * size * t * 4096 * micro,
                             dtype=dtype, in_block=True),
                          op("backward", flops=4 * n * t * micro // 24, nbytes=2 * size * n // 24, dtype=dtype),
                          op("backward", "elementwise", flops=t * 4096 * micro, nbytes=3 * size * t * 4096 * micro,
                             dtype=dtype)]
        return costs_of(*per_layer, op("optimizer", "elementwise", flops=12 * n, nbytes=28 * n, dtype="fp32"))

    def __call__(self, *, micro_batch_size, precision, checkpointing, world_size):
        from memplan.estimator.result import MemoryEstimate

        total = GiB + micro_batch_size * (GiB // 64) // (4 if checkpointing else 1)
        return MemoryEstimate(parameters=GiB, gradients=0, optimizer_state=0, activations=0, temporaries=0, batch=0,
                              peak_allocated=total, peak_reserved=total, device_total=total, num_parameters=self.params,
                              precision=precision, checkpointing=checkpointing, world_size=world_size,
                              step_costs=self.costs(micro_batch_size, precision))


def roomy_request(**kwargs) -> PlanRequest:
    gpu = lookup_gpu("A100-80GB")
    return PlanRequest(global_batch_size=64, devices=(DeviceBudget.from_catalog(gpu),) * 4, tokens_per_sample=1024,
                       **kwargs)


def test_the_fastest_predicted_setting_is_the_plan():
    plan = make_plan(roomy_request(), RoomyStep())
    # more ranks, AMP, no recompute, and a large enough micro-batch to leave the host-bound regime
    assert (plan.world_size, plan.precision, plan.gradient_checkpointing) == (4, "bf16-mixed", False)
    assert plan.samples_per_s and all(a.samples_per_s <= plan.samples_per_s * (1 + 1e-9) for a in plan.alternatives if a.fits)
    assert plan.tokens_per_s == pytest.approx(1024 * plan.samples_per_s)
    assert 0 < plan.mfu < 1 and plan.predicted_step_seconds == pytest.approx(64 / plan.samples_per_s)
    # micro-batch 16 is each rank's share; a smaller one predicts the same speed: the larger wins the tie
    assert plan.micro_batch_size == 16
    assert plan.speed_reason.startswith("ties the runner-up (4 ranks, micro-batch 8")
    slower = [a for a in plan.alternatives if a.fits and a.samples_per_s < plan.samples_per_s]
    assert slower and all(a.relative_speed == pytest.approx(a.samples_per_s / plan.samples_per_s) for a in slower)
    again = Plan.from_dict(plan.to_dict())
    assert again == plan and again.to_dict()["mfu"] == plan.mfu


def test_a_plan_without_checkpointing_beats_one_with_it_when_both_fit():
    plan = make_plan(roomy_request(precisions=("bf16-mixed",)), RoomyStep())
    assert not plan.gradient_checkpointing
    # recompute: the in-block forward again, a third of the FLOPs of a step that is mostly matmuls
    sim = RoomyStep()
    profile = CostProfile(sim.costs(1, "16-mixed"), high=sim.costs(4, "16-mixed"), high_micro=4, traced_amp=True,
                          parameter_count=sim.params, tokens_per_sample=1024)
    setting = dict(precision="bf16-mixed", micro_batch_size=plan.micro_batch_size, world_size=4, gpus_per_node=4,
                   accumulate_grad_batches=plan.accumulate_grad_batches, nodes=1, sharding=None, offload=False,
                   gpu_name="A100-80GB")
    with_it = predict_step(profile, StepSetting(checkpointing=True, **setting)).samples_per_s
    assert predict_step(profile, StepSetting(checkpointing=False, **setting)).samples_per_s == pytest.approx(plan.samples_per_s)
    loss = 1 - with_it / plan.samples_per_s
    assert 0.2 < loss <= 0.25
    assert any(f"recomputing each block's forward would cost {loss:.0%} of the speed" in r for r in plan.reasons)
    without = make_plan(roomy_request(precisions=("bf16-mixed",), allow_checkpointing=False), RoomyStep())
    assert (without.micro_batch_size, without.world_size, without.samples_per_s) == \
        (plan.micro_batch_size, plan.world_size, plan.samples_per_s)


def test_the_ranking_does_not_change_when_every_op_runs_at_half_the_speed(monkeypatch):
    """Halving every efficiency and doubling the per-op floors doubles every one-GPU step time: the same
    plan and the same order of alternatives, at half the predicted throughput."""
    request = roomy_request(strategies=("ddp",))
    request = dataclasses.replace(request, devices=request.devices[:1])
    before = make_plan(request, RoomyStep())
    monkeypatch.setattr(costs, "FLOP_EFFICIENCY", {k: v / 2 for k, v in costs.FLOP_EFFICIENCY.items()})
    monkeypatch.setattr(costs, "BANDWIDTH_EFFICIENCY", {k: v / 2 for k, v in costs.BANDWIDTH_EFFICIENCY.items()})
    monkeypatch.setattr(costs, "MIN_KERNEL_SECONDS", 2 * costs.MIN_KERNEL_SECONDS)
    monkeypatch.setattr(costs, "HOST_SECONDS_PER_OP", 2 * costs.HOST_SECONDS_PER_OP)
    after = make_plan(request, RoomyStep())
    key = lambda p: (p.micro_batch_size, p.precision, p.gradient_checkpointing,  # noqa: E731
                     [(a.micro_batch_size, a.precision, a.gradient_checkpointing) for a in p.alternatives])
    assert key(after) == key(before)
    assert after.samples_per_s == pytest.approx(before.samples_per_s / 2)


def test_link_speed_does_not_reorder_one_gpu_settings_but_can_favour_fewer_ranks(monkeypatch):
    one = dataclasses.replace(roomy_request(), devices=roomy_request().devices[:1])
    before = make_plan(one, RoomyStep())
    monkeypatch.setattr(costs, "COMM_EFFICIENCY", costs.COMM_EFFICIENCY / 1000)
    assert make_plan(one, RoomyStep()) == before  # no collectives on one GPU
    # links 1000x slower: an all-reduce of 1.4 GB takes seconds, more than the compute it would save
    slow = make_plan(roomy_request(strategies=("ddp",)), RoomyStep())
    assert slow.world_size == 1
