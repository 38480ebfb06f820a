"""The planner's search (memplan.planner.make_plan): the largest micro-batch that fits at the global batch, the
GPUs it leaves out, precision by compute capability, checkpointing only when needed, the host RAM's limit,
NoFit, how few traces a search takes and the verification trace that catches an optimistic line, alternatives,
caps and nodes. Against the simulated estimator of planner_sim.py; the request checks and the real estimator are
test_planner_requests.py's, a Trainer's request test_planner_trainer.py's.
"""
from __future__ import annotations

import dataclasses

import pytest
from planner_sim import CONTEXT_BYTES, SimulatedStep, brute_force_speed, exact_peak, gpus, speed_of

from memplan.estimator.cuda.overheads import nccl_buffer_bytes
from memplan.plan import Plan
from memplan.planner import HostLoad, NoFit, PlanRequest, host_bytes_per_rank, make_plan
from memplan.units import GiB, MiB


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
