"""The planner's partial checkpointing: the smallest k of N blocks that fits, from the none and full
curves, verified (and stepped up) by a trace; and the per-op policy where it is the fastest fit."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from planner_sim import SimulatedStep, gpus  # noqa: E402

from memplan.checkpoint_setting import Checkpointing  # noqa: E402
from memplan.estimator.flops import OpCost, StepCosts  # noqa: E402
from memplan.planner import PlanRequest, make_plan  # noqa: E402
from memplan.planner.partial import smallest_k  # noqa: E402
from memplan.units import GiB  # noqa: E402

BLOCKS = 8


@dataclass
class BlockStep(SimulatedStep):
    """SimulatedStep with BLOCKS repeated blocks: full checkpointing keeps a quarter of the activations,
    the first k blocks' checkpointing a share k/BLOCKS of the saving plus a bump above that line (zero at
    k = 0 and k = BLOCKS, so a line through the two ends underestimates), the per-op policy keeps
    `op_keeps` of them; each block's forward is one matmul (kept by the op policy) and one elementwise op."""

    bump: float = 0.02
    op_keeps: float = 0.5

    def activations(self, micro: int, precision: str, checkpointing) -> int:
        act = self.activation_bytes_per_sample * micro
        setting = Checkpointing.parse(checkpointing)
        if setting.mode == "none":
            return act
        if setting.mode == "op":
            return int(act * self.op_keeps)
        k = len(setting.selected(BLOCKS))
        return int(act * (1 - 0.75 * k / BLOCKS + self.bump * k * (BLOCKS - k) / BLOCKS ** 2 * 4))

    def costs(self, micro: int, precision: str) -> StepCosts:
        n, a = self.params_bytes // 4, self.activation_bytes_per_sample * micro
        flops = 2 * n * 2048 * micro // BLOCKS
        ops = []
        for b in range(BLOCKS):
            ops += [OpCost(op_class="matmul", dtype="fp32", phase="forward", flops=flops, bytes=4 * n // BLOCKS,
                           in_block=True, block=b, op_kept=True),
                    OpCost(op_class="elementwise", dtype="fp32", phase="forward", flops=a // 4, bytes=2 * a // BLOCKS,
                           in_block=True, block=b)]
        ops += [OpCost(op_class="matmul", dtype="fp32", phase="backward", flops=2 * flops * BLOCKS, bytes=8 * n),
                OpCost(op_class="elementwise", dtype="fp32", phase="optimizer", flops=12 * n, bytes=28 * n)]
        return StepCosts(ops=tuple(ops))


def _request(**overrides) -> PlanRequest:
    fields = dict(global_batch_size=8, devices=gpus("A100-80GB", 1), precisions=("32-true",), min_micro_batch_size=8,
                  repeated_blocks=BLOCKS)
    fields.update(overrides)
    return PlanRequest(**fields)


def _step_for(keeps: float, **kwargs) -> BlockStep:
    """A step whose micro-batch 8 fits the budget when it keeps at most `keeps` of its activations."""
    request = _request()
    budget = request.budget_bytes(request.devices[0].free_bytes)
    fixed = 4 * GiB + 640 * (1 << 20) + (4 << 20)  # weights, grads, Adam state; CUDA context; rounding
    return BlockStep(params_bytes=GiB, activation_bytes_per_sample=int((budget - fixed) / (8 * keeps)), **kwargs)


def _fits(sim: BlockStep, setting: str, request: PlanRequest) -> bool:
    est = sim(micro_batch_size=8, precision="32-true", checkpointing=Checkpointing.parse(setting), world_size=1)
    return est.device_total <= request.budget_bytes(request.devices[0].free_bytes)


@pytest.mark.parametrize("keeps", [0.47, 0.445, 0.40])
def test_the_planner_picks_the_smallest_k_that_fits(keeps):
    sim = _step_for(keeps, op_keeps=0.6)  # the per-op policy keeps too much to fit
    request = _request()
    plan = make_plan(request, sim)
    assert plan.checkpointing.mode == "blocks"
    k = plan.checkpointing.blocks
    assert _fits(sim, f"blocks:{k}", request) and not _fits(sim, f"blocks:{k - 1}", request)
    assert plan.predicted_peak_bytes <= plan.device_budget_bytes
    assert "partial checkpointing" in plan.speed_reason and "over full checkpointing" in plan.speed_reason


def test_a_line_that_underestimates_is_stepped_up_by_the_trace():
    sim = _step_for(0.445, op_keeps=0.6)  # the line from none to full says 6 blocks; the bump makes it 7
    plan = make_plan(_request(), sim)
    assert plan.checkpointing == Checkpointing(mode="blocks", blocks=7)
    traced = [c[2] for c in sim.calls if isinstance(c[2], Checkpointing) and c[2].mode == "blocks"]
    assert traced == [Checkpointing(mode="blocks", blocks=6), Checkpointing(mode="blocks", blocks=7)]


def test_the_per_op_policy_wins_where_it_fits_and_recomputes_less():
    sim = _step_for(0.47, op_keeps=0.45)
    plan = make_plan(_request(), sim)
    assert str(plan.checkpointing) == "op"
    assert plan.speed_reason.startswith("selective (per-op) checkpointing: +")


def test_without_repeated_blocks_only_none_and_full_are_searched():
    sim = _step_for(0.47, op_keeps=0.45)
    plan = make_plan(_request(repeated_blocks=0), sim)
    assert str(plan.checkpointing) == "full"
    assert all(isinstance(c[2], bool) for c in sim.calls)


def test_smallest_k_on_the_line():
    assert smallest_k(8, 100, 20, 60) == 4
    assert smallest_k(8, 100, 20, 100) is None  # none fits
    assert smallest_k(8, 100, 20, 19) is None  # not even full
    assert smallest_k(8, 100, 20, 21) is None  # only full (k would be 8)
