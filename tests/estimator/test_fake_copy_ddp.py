"""MemoryPlanner() planning at fit start under 2-process CPU DDP (gloo), on a module deepcopy cannot
copy, and on one that cannot be traced. Each run is a watched subprocess: a hang (no CPU progress) fails the test."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from subprocess_run import run_watched

DRIVER = Path(__file__).with_name("ddp_planning_driver.py")

pytestmark = pytest.mark.slow


def run_scenario(scenario: str, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return run_watched([sys.executable, str(DRIVER), scenario, str(out)], cwd=out.parent, env=env)


def test_planning_at_fit_start_copes_with_a_module_holding_a_file_a_lock_a_generator_a_lambda_a_metric(tmp_path):
    out = tmp_path / "holder"
    result = run_scenario("holder", out)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "planned from an estimate" in result.stderr
    results = [json.loads((out / f"result_rank{r}.json").read_text()) for r in (0, 1)]
    assert results[0]["layout"] == results[1]["layout"]
    for r in results:
        # the training itself went on with the module's own objects: 2 steps, 2 metric updates
        assert all(r["same_objects"].values()) and r["file_open"]
        assert r["next_number"] == 0 and r["mse_updates"] == 2
    # the file is shared, not copied: the traced steps on rank 0 wrote through it too, rank 1 only trained
    assert (out / "notes_rank1.txt").read_text() == "step\n" * 2
    assert (out / "notes_rank0.txt").read_text().count("step\n") > 2


def test_a_model_that_cannot_be_traced_ends_every_rank_with_the_op_and_the_module(tmp_path):
    out = tmp_path / "untraceable"
    result = run_scenario("untraceable", out)
    assert result.returncode != 0
    message = (r"MemoryPlanner: model: the op memplan_test\.opaque\.default\(float32\[\d+, 32\]\) failed in "
               r"`model\.blocks\.1` in the forward \(UnsupportedOperatorException: memplan_test\.opaque\.default\)\. "
               r".*register_fake")
    assert re.search(r"\[rank0\]: \S*MisconfigurationException: " + message, result.stderr)
    assert re.search(r"\[rank1\]: RuntimeError: MemoryPlanner: planning on rank 0 failed: MisconfigurationException: "
                     + message, result.stderr)
    assert "batch:" not in result.stderr
