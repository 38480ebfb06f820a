"""From plan to running job on CPU: memplan suggest --output, then the torchrun command it prints, run
as printed from another directory, with 2 CPU processes (gloo) on launch/train.py, the MemoryPlanner
callback applying the plan."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None,
                    reason="torchrun is not installed beside this Python")
def test_planned_config_trains_under_torchrun_with_two_cpu_processes(tmp_path):
    memplan = [sys.executable, "-m", "memplan"]
    plans, elsewhere = tmp_path / "plans", tmp_path / "elsewhere"
    plans.mkdir()
    elsewhere.mkdir()
    # a global batch with enough work per step that the step-time model uses both GPUs (the MLP demo's own
    # 1024 is host-bound: one GPU is as fast)
    suggest = subprocess.run([*memplan, "suggest", "--gpus", "2", "--gpu", "A100-80GB", "--global-batch-size", "8192",
                              str(ROOT / "configs" / "mlp.yaml"), "--output", str(plans / "planned.yaml")],
                             cwd=plans, check=True, capture_output=True, text=True, timeout=120)
    plan = json.loads((plans / "planned.plan.json").read_text())
    assert plan["world_size"] == 2
    printed = next(line for line in suggest.stdout.splitlines() if line.startswith("launch with: "))
    command = printed.removeprefix("launch with: ").split()
    assert command[0] == "torchrun"
    command[0] = str(Path(sys.executable).parent / "torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    run = subprocess.run(
        [*command, "--trainer.max_steps=3", "--trainer.accelerator=cpu", "--trainer.log_every_n_steps=1"],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=240,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    logs = sorted(elsewhere.glob("lightning_logs/*/memplan/rank*.jsonl"))
    assert [p.name for p in logs] == ["rank0.jsonl", "rank1.jsonl"]
    for log in logs:
        events = [json.loads(line) for line in log.read_text().splitlines()]
        applied = [e for e in events if e.get("event") == "apply"]
        layout = applied[0]["layout"]
        assert layout["micro_batch_size"] == plan["micro_batch_size"] and layout["world_size"] == 2
        assert layout["global_batch_size"] == plan["global_batch_size"]
    assert "MemoryPlanner summary" in run.stdout + run.stderr
