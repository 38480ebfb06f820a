"""MemoryPlanner() planning at fit start under 2-process CPU DDP (gloo), on a module deepcopy cannot
copy, and on one that cannot be traced: both scenarios in one watched launch (the planning_runs fixture; the
failing one last), each test reading its own scenario's files. A hang (no CPU progress) fails the tests."""
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


@pytest.fixture(scope="module")
def planning_runs(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """Both scenarios of ddp_planning_driver.py in one launch, `holder` then `untraceable` (which ends every
    rank): (the folder holding one folder per scenario, the launch's result). tests/conftest.py keeps this
    module on one xdist worker."""
    root = tmp_path_factory.mktemp("ddp-planning")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return root, run_watched([sys.executable, str(DRIVER), str(root), "holder", "untraceable"], cwd=root, env=env)


def test_planning_at_fit_start_copes_with_a_module_holding_a_file_a_lock_a_generator_a_lambda_a_metric(planning_runs):
    root, result = planning_runs
    out = root / "holder"
    assert all((out / f"result_rank{r}.json").exists() for r in (0, 1)), result.stderr[-3000:]
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


def test_a_model_that_cannot_be_traced_ends_every_rank_with_the_op_and_the_module(planning_runs):
    root, result = planning_runs
    assert not list((root / "untraceable").glob("result_rank*.json")), "a rank trained past the failed planning"
    assert result.returncode != 0
    message = (r"MemoryPlanner: model: the op memplan_test\.opaque\.default\(float32\[\d+, 32\]\) failed in "
               r"`model\.blocks\.1` in the forward \(UnsupportedOperatorException: memplan_test\.opaque\.default\)\. "
               r".*register_fake")
    assert re.search(r"\[rank0\]: \S*MisconfigurationException: " + message, result.stderr)
    assert re.search(r"\[rank1\]: RuntimeError: MemoryPlanner: planning on rank 0 failed: MisconfigurationException: "
                     + message, result.stderr)
    assert "batch:" not in result.stderr
