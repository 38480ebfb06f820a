"""SIGTERM to one rank of a 2-process CPU (gloo) run started by launch/torchrun.sh: the whole job ends
without torchrun having to SIGKILL any rank, and every rank's memplan log is whole. Lightning's own
handler would hang both ranks in a broadcast (for the process group's 30-minute timeout: the watched
job then makes no CPU progress, which fails the test); memplan.train installs memplan.callback.sigterm,
which ends the signalled rank at once and lets torchrun stop the other with SIGTERM alone."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from subprocess_run import Watched

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN_SH = ROOT / "launch" / "torchrun.sh"
MLP = ROOT / "configs" / "mlp.yaml"
#: torchrun's words when a rank outlives its SIGTERM by 30 s and is killed (torch/distributed/elastic/
#: multiprocessing/api.py): the job did not end at once
TORCHRUN_KILLED = "forcefully exiting via"


def _training_started(log: Path) -> bool:
    return log.exists() and any('"event": "sample"' in line for line in log.read_text().splitlines())


def _rank_processes(job: Watched) -> dict[int, psutil.Process]:
    ranks = {}
    for child in job.processes():
        try:
            rank = child.environ().get("RANK")
            parent = child.ppid()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if rank is not None and parent == job.pid:  # torchrun's workers, not their DataLoader workers
            ranks[int(rank)] = child
    return ranks


@pytest.mark.slow
def test_sigterm_to_one_rank_ends_the_job_with_every_ranks_log_whole(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", MEMPLAN_PYTHON=sys.executable, MEMPLAN_CPU="1")
    # long enough never to finish by itself; a sample in the log every step
    with (tmp_path / "job.out").open("w") as output, \
            Watched([str(TORCHRUN_SH), str(MLP), "--", "--trainer.max_epochs=1000", "--trainer.max_steps=1000000",
                     "--trainer.log_every_n_steps=1"], cwd=tmp_path, env=env, stdout=output,
                    stderr=subprocess.STDOUT) as job:
        rank1_log = tmp_path / "lightning_logs" / "version_0" / "memplan" / "rank1.jsonl"
        job.wait_until(lambda: _training_started(rank1_log), "rank 1 logged a training step")
        ranks = _rank_processes(job)
        assert sorted(ranks) == [0, 1]
        ranks[1].send_signal(signal.SIGTERM)
        status = job.wait()  # torchrun (the script execs it); a hang fails here
        alive = [rank for rank, process in ranks.items() if process.is_running()]
        assert not alive, f"ranks {alive} still running after torchrun ended"

    text = (tmp_path / "job.out").read_text()
    assert status != 0, "a terminated rank fails the job"
    assert TORCHRUN_KILLED not in text, text[-3000:]
    assert "[rank: 1] memplan: SIGTERM received; ending this rank now (exit 143" in text
    logs = sorted(tmp_path.glob("lightning_logs/version_0/memplan/rank*.jsonl"))
    assert [log.name for log in logs] == ["rank0.jsonl", "rank1.jsonl"]
    for log in logs:
        lines = log.read_text().splitlines()
        records = [json.loads(line) for line in lines]  # every line a whole JSON object
        assert all(isinstance(r, dict) and "event" in r for r in records)
        assert any(r["event"] == "sample" for r in records), f"{log.name}: no training step logged"
