"""From plan to running job on CPU: memplan suggest --output (in this process: the command's own code, as
tests/commands run it), then the torchrun command it prints, run as printed from another directory, with 2 CPU
processes (gloo) on memplan.train, the MemoryPlanner callback applying the plan."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from subprocess_run import run_watched

ROOT = Path(__file__).resolve().parent.parent


def test_planned_config_trains_under_torchrun_with_two_cpu_processes(tmp_path, monkeypatch, capsys):
    from memplan.commands.cli import main

    plans, elsewhere = tmp_path / "plans", tmp_path / "elsewhere"
    plans.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(plans)
    # a global batch with enough work per step that the step-time model uses both GPUs (the MLP demo's own
    # 1024 is host-bound: one GPU is as fast)
    code = main(["suggest", "--gpus", "2", "--gpu", "A100-80GB", "--global-batch-size", "32768",
                 str(ROOT / "configs" / "mlp.yaml"), "--output", str(plans / "planned.yaml")])
    printed = capsys.readouterr()
    assert code == 0, printed.err[-3000:]
    plan = json.loads((plans / "planned.plan.json").read_text())
    assert plan["world_size"] == 2
    printed = next(line for line in printed.out.splitlines() if line.startswith("launch with: "))
    command = printed.removeprefix("launch with: ").split()
    # as printed: this Python (no activated venv needed) and the entry point shipped in the package
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"] and "memplan.train" in command
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    # the planned loader batch is 16,384 samples a rank (~0.8 CPU-s each to make here): 2 steps, and no DataLoader
    # workers prefetching batches the run never reads (torchrun's ranks with workers: test_launch_scripts, sigterm)
    run = run_watched(
        [*command, "--trainer.max_steps=2", "--trainer.accelerator=cpu", "--trainer.log_every_n_steps=1",
         "--data.init_args.num_workers=0"],
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
        assert events[-1]["event"] == "end" and events[-1]["status"] == "finished"
        assert [e["step"] for e in events if e["event"] == "sample"][-1] == 2
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

    def on_train_end(self):  # what the test reads (Lightning's own log lines go wherever an earlier test set them)
        with open(f"{type(self).__name__}.steps", "w") as f:
            f.write(str(self.trainer.global_step))


class UnifiedModel(Steps, L.LightningModule):
    pass


class ClassicModel(Steps, pl.LightningModule):
    pass
'''


def test_the_entry_point_runs_modules_of_either_lightning_package(tmp_path, monkeypatch):
    # launch/train.py ran pytorch_lightning's LightningCLI only, which refuses a lightning.pytorch LightningModule
    # ("does not correspond to a subclass of LightningModule"); memplan.train picks the model's own package.
    # memplan.train's main in this process (one CPU device: no process group, no SIGTERM handler left behind);
    # `python -m memplan.train` itself runs in test_planned_config_trains_under_torchrun_with_two_cpu_processes.
    from memplan.train import main

    (tmp_path / "tiny_modules.py").write_text(TINY_MODULES)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    try:
        for name in ("UnifiedModel", "ClassicModel"):
            config = tmp_path / f"{name}.yaml"
            config.write_text(f"model:\n  class_path: tiny_modules.{name}\ntrainer:\n  max_steps: 2\n"
                              "  accelerator: cpu\n  logger: false\n  enable_checkpointing: false\n"
                              "  enable_progress_bar: false\nmemplan:\n  global_batch_size: 4\n")
            main(["fit", "--config", str(config)])  # LightningCLI exits (SystemExit) on a model it refuses
            assert (tmp_path / f"{name}.steps").read_text() == "2", name  # fit ran to max_steps=2
    finally:
        sys.modules.pop("tiny_modules", None)  # this test's module, not another test's


def test_the_entry_point_reads_the_model_class_from_the_config_or_the_command_line(tmp_path):
    from memplan.train import lightning_package

    config = tmp_path / "c.yaml"
    config.write_text("model:\n  class_path: memplan.demos.MLP\n")
    assert lightning_package(["fit", "--config", str(config)]) == "pytorch_lightning"
    assert lightning_package(["fit", f"--config={config}", "--model", "lightning.pytorch.demos.BoringModel"]) \
        == "lightning.pytorch"
    assert lightning_package(["fit", "--model.class_path=no.such.Module"]) == "pytorch_lightning"  # CLI names it
