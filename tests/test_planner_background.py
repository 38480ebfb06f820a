"""Background traces (memplan.planner.background): a prefetched setting is traced in a forked child
and its estimate used; a child that fails leaves the parent to trace (and raise) itself."""
from __future__ import annotations

import os

import pytest

from memplan.planner import PlanRequest, make_plan
from memplan.planner.background import BackgroundEstimator, can_fork
from memplan.estimator.errors import EstimateError
from tests.test_planner import SimulatedStep, gpus

pytestmark = pytest.mark.skipif(not can_fork(), reason="background traces need Linux and two CPUs")


class Recording(SimulatedStep):
    """A simulated estimator that also says which process traced each setting."""

    def __call__(self, **setting):
        self.pids = getattr(self, "pids", []) + [os.getpid()]
        return super().__call__(**setting)


def test_a_prefetched_setting_is_traced_in_the_child_and_used():
    sim = Recording()
    background = BackgroundEstimator(sim)
    setting = dict(micro_batch_size=4, precision="16-mixed", checkpointing=False, world_size=2)
    background.prefetch(**setting)
    est = background(**setting, fsdp=None)  # None given or left out: the same setting
    assert est == SimulatedStep()(**setting)
    assert sim.calls == []  # the parent never traced it


def test_a_failing_child_leaves_the_parent_to_trace_and_raise():
    sim = Recording(cc=(7, 0))  # bf16-mixed raises on sm70
    background = BackgroundEstimator(sim)
    setting = dict(micro_batch_size=1, precision="bf16-mixed", checkpointing=False, world_size=1)
    background.prefetch(**setting)
    with pytest.raises(EstimateError, match="bf16"):
        background(**setting)
    assert sim.pids == [os.getpid()]  # the error is the parent's own attempt's


def test_cancel_ends_the_children():
    background = BackgroundEstimator(SimulatedStep())
    background.prefetch(micro_batch_size=8, precision="32-true", checkpointing=False, world_size=2)
    child = next(iter(background._pending.values()))
    pid = child._pid
    background.cancel()
    with pytest.raises(ChildProcessError):  # reaped: no zombie left behind
        os.waitpid(pid, os.WNOHANG)
    assert background._pending == {}


def test_the_search_plans_the_same_with_background_traces():
    request = PlanRequest(global_batch_size=512, devices=gpus("A100-80GB", 8))
    alone, beside = SimulatedStep(), SimulatedStep()
    plan = make_plan(request, alone)
    assert make_plan(request, BackgroundEstimator(beside)) == plan
    # the probe trace of the first group ran in the child: the parent traced one fewer
    assert len(beside.calls) == len(alone.calls) - 1 and (4, "16-mixed", False, 2) not in beside.calls
