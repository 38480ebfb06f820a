"""The GPU campaign's oom-retry probe, as its CPU dry run runs it: in the campaign's own process (the dry run calls
run_probe there), here through the probe's command line (main), in this process."""
from __future__ import annotations

import json
import logging

import pytest

from benchmarks import gpu_probes
from benchmarks.gpu_probes import DRY_OOM_ABOVE, RESULT_MARKER


@pytest.fixture
def loggers_kept():
    """The probe quiets Lightning's and memplan's loggers for its own process: put their levels back after it."""
    names = ("pytorch_lightning", "lightning", "lightning.pytorch", "memplan")
    levels = {name: logging.getLogger(name).level for name in names}
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def test_the_oom_retry_dry_run_meets_a_simulated_oom_and_finishes_on_smaller_micro_batches(capsys, loggers_kept):
    """On the GPU the probe's first step runs out of memory for real; the CPU dry run simulates it, so
    MemoryPlanner's retry (the loss reduction it traces, the split) runs before the GPU is lent."""
    assert gpu_probes.main(["oom-retry", "--cpu"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1].removeprefix(RESULT_MARKER))
    assert result["finished"] is True and result["loaded_batch"] == 16
    retries = [e for e in result["rank_log"]["notable"] if e["event"] == "oom_retry"]
    assert [(e["failed_micro_batch_size"], e["micro_batch_size"]) for e in retries] == [(16, 8), (8, 4)]
    assert result["final_layout"]["micro_batch_size"] == DRY_OOM_ABOVE
    assert result["loss_reduction"].startswith("cross_entropy: a mean over the targets batch[1]")
