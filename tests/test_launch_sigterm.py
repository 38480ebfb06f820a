"""SIGTERM to one rank of a 2-process CPU (gloo) run started by launch/torchrun.sh: the whole job ends
within 30 s, and every rank's memplan log is whole. Lightning's own handler would hang both ranks in a
broadcast (for the process group's 30-minute timeout); memplan.train installs
memplan.callback.sigterm, which ends the signalled rank at once and lets torchrun stop the other."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN_SH = ROOT / "launch" / "torchrun.sh"
MLP = ROOT / "configs" / "mlp.yaml"
JOB_ENDS_WITHIN_S = 30  # the requirement (torchrun alone waits 30 s before SIGKILL)
START_WITHIN_S = 240    # 2 ranks starting on a busy 2-core machine


def _training_started(log: Path) -> bool:
    return log.exists() and any('"event": "sample"' in line for line in log.read_text().splitlines())


def _rank_processes(root: psutil.Process) -> dict[int, psutil.Process]:
    ranks = {}
    for child in root.children(recursive=True):
        try:
            rank = child.environ().get("RANK")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if rank is not None and child.ppid() == root.pid:  # torchrun's workers, not their DataLoader workers
            ranks[int(rank)] = child
    return ranks


def _kill_leftovers(processes: list[psutil.Process]) -> None:
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


@pytest.mark.slow
def test_sigterm_to_one_rank_ends_the_job_with_every_ranks_log_whole(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", MEMPLAN_PYTHON=sys.executable, MEMPLAN_CPU="1")
    output = (tmp_path / "job.out").open("w")
    # long enough never to finish by itself; a sample in the log every step
    job = subprocess.Popen([str(TORCHRUN_SH), str(MLP), "--", "--trainer.max_epochs=1000",
                            "--trainer.max_steps=1000000", "--trainer.log_every_n_steps=1"],
                           cwd=tmp_path, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    root = psutil.Process(job.pid)
    everything: list[psutil.Process] = [root]
    try:
        rank1_log = tmp_path / "lightning_logs" / "version_0" / "memplan" / "rank1.jsonl"
        deadline = time.monotonic() + START_WITHIN_S
        while not _training_started(rank1_log):
            assert job.poll() is None, f"the job ended before training:\n{(tmp_path / 'job.out').read_text()[-3000:]}"
            assert time.monotonic() < deadline, "rank 1 logged no training step"
            time.sleep(0.2)
        ranks = _rank_processes(root)
        assert sorted(ranks) == [0, 1]
        everything += root.children(recursive=True)  # the ranks and their DataLoader workers

        ranks[1].send_signal(signal.SIGTERM)
        deadline = time.monotonic() + JOB_ENDS_WITHIN_S
        try:
            status = job.wait(timeout=JOB_ENDS_WITHIN_S)  # torchrun (the script execs it)
        except subprocess.TimeoutExpired:
            status = None
        _, alive = psutil.wait_procs(everything[1:], timeout=max(0.0, deadline - time.monotonic()))
        assert status is not None and not alive, \
            f"still running {JOB_ENDS_WITHIN_S} s after SIGTERM to rank 1: torchrun " \
            f"{'ended' if status is not None else 'too'}, {[p.pid for p in alive]}\n" \
            f"{(tmp_path / 'job.out').read_text()[-3000:]}"
    finally:
        _kill_leftovers(everything)
        output.close()

    text = (tmp_path / "job.out").read_text()
    assert status != 0, "a terminated rank fails the job"
    assert "[rank: 1] memplan: SIGTERM received; ending this rank now (exit 143" in text
    logs = sorted(tmp_path.glob("lightning_logs/version_0/memplan/rank*.jsonl"))
    assert [log.name for log in logs] == ["rank0.jsonl", "rank1.jsonl"]
    for log in logs:
        lines = log.read_text().splitlines()
        records = [json.loads(line) for line in lines]  # every line a whole JSON object
        assert all(isinstance(r, dict) and "event" in r for r in records)
        assert any(r["event"] == "sample" for r in records), f"{log.name}: no training step logged"
