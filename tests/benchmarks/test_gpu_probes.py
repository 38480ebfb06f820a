"""The GPU campaign's oom-retry probe, as its CPU dry run runs it."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from subprocess_run import run_watched

from benchmarks.gpu_probes import DRY_OOM_ABOVE, RESULT_MARKER

ROOT = Path(__file__).resolve().parents[2]


def test_the_oom_retry_dry_run_meets_a_simulated_oom_and_finishes_on_smaller_micro_batches():
    """On the GPU the probe's first step runs out of memory for real; the CPU dry run simulates it, so
    MemoryPlanner's retry (the loss reduction it traces, the split) runs before the GPU is lent."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    done = run_watched([sys.executable, "-m", "benchmarks.gpu_probes", "oom-retry", "--cpu"], cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1].removeprefix(RESULT_MARKER))
    assert result["finished"] is True and result["loaded_batch"] == 16
    retries = [e for e in result["rank_log"]["notable"] if e["event"] == "oom_retry"]
    assert [(e["failed_micro_batch_size"], e["micro_batch_size"]) for e in retries] == [(16, 8), (8, 4)]
    assert result["final_layout"]["micro_batch_size"] == DRY_OOM_ABOVE
    assert result["loss_reduction"].startswith("cross_entropy: a mean over the targets batch[1]")
