"""From plan to running job on CPU: memplan suggest --output, then the torchrun command it prints, run
as printed from another directory, with 2 CPU processes (gloo) on memplan.train, the MemoryPlanner
callback applying the plan."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from subprocess_run import run_watched

ROOT = Path(__file__).resolve().parent.parent


def test_planned_config_trains_under_torchrun_with_two_cpu_processes(tmp_path):
    memplan = [sys.executable, "-m", "memplan"]
    plans, elsewhere = tmp_path / "plans", tmp_path / "elsewhere"
    plans.mkdir()
    elsewhere.mkdir()
    # a global batch with enough work per step that the step-time model uses both GPUs (the MLP demo's own
    # 1024 is host-bound: one GPU is as fast)
    suggest = run_watched([*memplan, "suggest", "--gpus", "2", "--gpu", "A100-80GB", "--global-batch-size", "32768",
                           str(ROOT / "configs" / "mlp.yaml"), "--output", str(plans / "planned.yaml")],
                          cwd=plans, check=True)
    plan = json.loads((plans / "planned.plan.json").read_text())
    assert plan["world_size"] == 2
    printed = next(line for line in suggest.stdout.splitlines() if line.startswith("launch with: "))
    command = printed.removeprefix("launch with: ").split()
    # as printed: this Python (no activated venv needed) and the entry point shipped in the package
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"] and "memplan.train" in command
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    run = run_watched(
        [*command, "--trainer.max_steps=3", "--trainer.accelerator=cpu", "--trainer.log_every_n_steps=1"],
        cwd=elsewhere, env=env,
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


TINY_MODULES = '''
import torch
from torch.utils.data import DataLoader, TensorDataset
import lightning.pytorch as L
import pytorch_lightning as pl


class Steps:
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4)


class UnifiedModel(Steps, L.LightningModule):
    pass


class ClassicModel(Steps, pl.LightningModule):
    pass
'''


def test_the_entry_point_runs_modules_of_either_lightning_package(tmp_path):
    # launch/train.py ran pytorch_lightning's LightningCLI only, which refuses a lightning.pytorch LightningModule
    # ("does not correspond to a subclass of LightningModule"); memplan.train picks the model's own package
    (tmp_path / "tiny_modules.py").write_text(TINY_MODULES)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]), CUDA_VISIBLE_DEVICES="")
    for name in ("UnifiedModel", "ClassicModel"):
        config = tmp_path / f"{name}.yaml"
        config.write_text(f"model:\n  class_path: tiny_modules.{name}\ntrainer:\n  max_steps: 2\n  accelerator: cpu\n"
                          "  logger: false\n  enable_checkpointing: false\n  enable_progress_bar: false\n"
                          "memplan:\n  global_batch_size: 4\n")
        run = run_watched([sys.executable, "-m", "memplan.train", "fit", "--config", str(config)], cwd=tmp_path,
                          env=env)
        assert run.returncode == 0, name + run.stderr[-3000:]
        assert "`Trainer.fit` stopped: `max_steps=2` reached" in run.stdout + run.stderr


def test_the_entry_point_reads_the_model_class_from_the_config_or_the_command_line(tmp_path):
    from memplan.train import lightning_package

    config = tmp_path / "c.yaml"
    config.write_text("model:\n  class_path: memplan.demos.MLP\n")
    assert lightning_package(["fit", "--config", str(config)]) == "pytorch_lightning"
    assert lightning_package(["fit", f"--config={config}", "--model", "lightning.pytorch.demos.BoringModel"]) \
        == "lightning.pytorch"
    assert lightning_package(["fit", "--model.class_path=no.such.Module"]) == "pytorch_lightning"  # CLI names it
