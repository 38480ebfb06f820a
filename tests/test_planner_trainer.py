"""The planner on a Trainer's request (MemoryPlanner's: all_devices, the Trainer's precision): one trace where the
largest micro-batch fits whole, the usual search where it does not; a model that checkpoints inside its own
forward keeps it and memplan adds none; a 32-true winner lists each alternative once. Against the simulated
estimator of planner_sim.py."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
from planner_sim import SimulatedStep, brute_force_speed, exact_peak, gpus, speed_of

from memplan.estimator.flops import OpCost, StepCosts
from memplan.estimator.result import MemoryEstimate
from memplan.planner import PlanRequest, make_plan
from memplan.units import GiB, MiB


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
