"""MemoryPlanner() planning at fit start under Lightning DDP on CPU (gloo, 2 processes), on a module
that `copy.deepcopy` cannot copy.

    python ddp_planning_driver.py <out_root> <scenario> [...]

Lightning's "ddp" launcher starts rank 1 by running this script again (LOCAL_RANK=1). Each rank runs the
scenarios one after another in one launch (two interpreters, not two per scenario), each writing under
<out_root>/<scenario>; an exception ends the rank, so `untraceable`, which ends every rank, goes last.
  holder       the module holds an open file, a threading.Lock, a generator, a lambda and a
               torchmetrics metric: rank 0 estimates and plans, every rank trains with the plan.
               Each rank writes result_rank<R>.json (the layout applied, and whether the module's
               attributes are still the objects it was built with).
  untraceable  the same module calls an op with no fake kernel inside `model.blocks.1`: planning
               fails on rank 0 with one MisconfigurationException, and every rank ends (none hangs).
"""
from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from memplan.callback import MemoryPlanner

RANK = int(os.environ.get("LOCAL_RANK", "0"))

_lib = torch.library.Library("memplan_test", "DEF")
_lib.define("opaque(Tensor x) -> Tensor")
_lib.impl("opaque", lambda x: x.clone(), "CPU")  # a real kernel, no fake one


class Opaque(nn.Module):
    def forward(self, x):
        return torch.ops.memplan_test.opaque(x)


class Holder(pl.LightningModule):
    def __init__(self, out: Path, untraceable: bool) -> None:
        super().__init__()
        self.batch_size = 8
        self.blocks = nn.Sequential(nn.Linear(16, 32), Opaque() if untraceable else nn.ReLU(), nn.Linear(32, 4))
        self.file = open(out / f"notes_rank{RANK}.txt", "w")  # noqa: SIM115
        self.lock = threading.Lock()
        self.numbers = (i for i in range(10**6))
        self.scale = lambda t: t * 0.5
        self.mse = torchmetrics.MeanSquaredError()
        self.originals = {name: id(getattr(self, name)) for name in ("file", "lock", "numbers", "scale", "mse")}

    def training_step(self, batch, batch_idx):
        x, y = batch
        with self.lock:
            out = self.scale(self.blocks(x))
        self.mse(out.detach(), y)
        self.file.write("step\n")
        return F.mse_loss(out, y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g))
        return DataLoader(data, batch_size=self.batch_size)


def main(scenario: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    module = Holder(out, untraceable=scenario == "untraceable")
    planner = MemoryPlanner(log_dir=out / "memplan")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=2, logger=False,
                         callbacks=[planner], enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=out)
    trainer.fit(module)
    same = {name: id(getattr(module, name)) == value for name, value in module.originals.items()}
    (out / f"result_rank{trainer.global_rank}.json").write_text(json.dumps({
        "layout": planner.layout.to_dict(), "same_objects": same, "file_open": not module.file.closed,
        "next_number": next(module.numbers), "mse_updates": module.mse._update_count,
    }))


if __name__ == "__main__":
    for name in sys.argv[2:]:
        main(name, Path(sys.argv[1]) / name)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
