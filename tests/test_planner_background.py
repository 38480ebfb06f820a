"""Background traces (memplan.planner.background): a prefetched setting is traced in a forked child
and its estimate used; a child that fails leaves the parent to trace (and raise) itself."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from memplan.estimator.errors import EstimateError
from memplan.planner import PlanRequest, make_plan
from memplan.planner import background as background_module
from memplan.planner.background import BackgroundEstimator, can_fork
from tests.planner_sim import SimulatedStep, gpus

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


class CopiesRealTensors(SimulatedStep):
    """A simulated estimator that, like a real fake-tensor trace, copies a real CPU tensor (the batch)
    large enough for ATen to copy it with OpenMP threads."""

    def __call__(self, **setting):
        torch.ones(1 << 22).clone()
        return super().__call__(**setting)


def test_a_child_copies_tensors_after_the_parent_used_openmp_threads():
    # Seen: `memplan suggest` on the resnet config hung for ever; its child's parallel copy waited on
    # the parent's OpenMP team, which a fork does not copy.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.ones(1 << 22).clone()  # the parent's OpenMP team now exists
        sim = CopiesRealTensors()
        background = BackgroundEstimator(sim)
        setting = dict(micro_batch_size=4, precision="16-mixed", checkpointing=False, world_size=2)
        background.prefetch(**setting)
        assert background(**setting) == SimulatedStep()(**setting)
        assert sim.calls == []  # the child's estimate: the parent traced nothing
    finally:
        torch.set_num_threads(threads)


class HangsInTheChild(SimulatedStep):
    """A simulated estimator that never returns in a forked child, using no CPU (a deadlock)."""

    def __init__(self):
        super().__init__()
        self.parent = os.getpid()

    def __call__(self, **setting):
        if os.getpid() != self.parent:
            time.sleep(3600)
        return super().__call__(**setting)


def test_a_child_that_stalls_is_killed_and_the_parent_traces(monkeypatch):
    monkeypatch.setattr(background_module, "STALL_SECONDS", 2.0)
    sim = HangsInTheChild()
    background = BackgroundEstimator(sim)
    setting = dict(micro_batch_size=4, precision="16-mixed", checkpointing=False, world_size=2)
    background.prefetch(**setting)
    pid = next(iter(background._pending.values()))._pid
    started = time.monotonic()
    assert background(**setting) == SimulatedStep()(**setting)
    assert time.monotonic() - started < 10
    assert sim.calls == [(4, "16-mixed", False, 2)]  # traced by the parent
    with pytest.raises(ChildProcessError):  # the child was killed and reaped
        os.waitpid(pid, os.WNOHANG)


def test_cancel_of_one_setting_keeps_the_others():
    sim = Recording()
    background = BackgroundEstimator(sim)
    probe = dict(micro_batch_size=8, precision="32-true", checkpointing=False, world_size=2)
    verification = dict(micro_batch_size=4, precision="16-mixed", checkpointing=False, world_size=2)
    background.prefetch(**probe)
    background.prefetch(**verification)
    background.cancel(**probe)
    assert background(**verification) == SimulatedStep()(**verification)
    assert sim.calls == []  # the verification's child was left running, and used


SETTING = dict(micro_batch_size=4, precision="16-mixed", checkpointing=False, world_size=2)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_no_fork_leaves_the_parent_to_trace(monkeypatch):
    # Found in review: a fork refused (EAGAIN under a process limit) escaped prefetch and leaked the pipe.
    def refused():
        raise BlockingIOError(11, "Resource temporarily unavailable")

    before = open_fds()
    monkeypatch.setattr(os, "fork", refused)
    sim = Recording()
    background = BackgroundEstimator(sim)
    background.prefetch(**SETTING)
    assert background(**SETTING) == SimulatedStep()(**SETTING) and sim.pids == [os.getpid()]
    assert open_fds() == before


def test_a_parent_with_many_open_files_reads_its_child():
    # Found in review: select.select refuses descriptors >= 1024, and the child was left unreaped.
    files = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]
    try:
        sim = Recording()
        background = BackgroundEstimator(sim)
        background.prefetch(**SETTING)
        assert background(**SETTING) == SimulatedStep()(**SETTING)
        assert sim.calls == []  # the child's estimate
    finally:
        for fd in files:
            os.close(fd)


def test_an_interrupt_while_waiting_ends_the_child(monkeypatch):
    monkeypatch.setattr(background_module, "STALL_SECONDS", 60.0)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    background = BackgroundEstimator(HangsInTheChild())
    background.prefetch(**SETTING)
    pid = next(iter(background._pending.values()))._pid
    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(1)
    try:
        with pytest.raises(KeyboardInterrupt):
            background(**SETTING)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    with pytest.raises(ChildProcessError):  # killed and reaped: no child left running, no zombie
        os.waitpid(pid, os.WNOHANG)


def test_children_are_used_when_sigchld_is_ignored():
    # Found in review: an inherited SIGCHLD=SIG_IGN makes waitpid raise ChildProcessError.
    previous = signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    try:
        sim = Recording()
        background = BackgroundEstimator(sim)
        background.prefetch(**SETTING)
        assert background(**SETTING) == SimulatedStep()(**SETTING)
        assert sim.calls == []
        background.prefetch(**dict(SETTING, micro_batch_size=8))
        background.cancel()  # reaped by the kernel: nothing to wait for, no error
    finally:
        signal.signal(signal.SIGCHLD, previous)
