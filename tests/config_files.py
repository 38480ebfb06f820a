"""Configs for the tests of memplan.config (test_config_load.py, test_config_batches.py, test_config_write.py,
test_config_launch.py): a small MLP config and a user's config to plan, writing and loading YAML text, the check
that a ConfigError names its key, a plan to write, and two fixtures a test module imports to use: sys.argv kept,
and an importable module of classes a user might write."""
from __future__ import annotations

import sys
import textwrap
import types
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from memplan.config import ConfigError, load_config
from memplan.demos import GPTLM
from memplan.plan import Plan

MLP_CONFIG = """
seed_everything: 7
trainer:
  devices: 2
  max_steps: 10
model:
  class_path: memplan.demos.MLP
  init_args: {in_features: 20, hidden: 8, depth: 2, num_classes: 3}
data:
  class_path: memplan.demos.RandomVectors
  init_args: {batch_size: 4, in_features: 20, num_classes: 3, num_samples: 64}
"""


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def load_text(tmp_path: Path, text: str, **kwargs):
    return load_config(write(tmp_path, text), **kwargs)


def raises_config_error(key: str, match: str):
    """pytest.raises for a ConfigError at `key`, exit code 2, whose message matches `match`."""
    class _Check:
        def __enter__(self):
            self._ctx = pytest.raises(ConfigError, match=match)
            self.info = self._ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            handled = self._ctx.__exit__(*exc)
            assert self.info.value.key == key
            assert self.info.value.exit_code == 2 and isinstance(self.info.value, ValueError)
            return handled

    return _Check()


def make_plan(**overrides) -> Plan:
    fields = dict(gpu_name="A100-80GB", gpus=(), nodes=1, world_size=2, micro_batch_size=8,
                  accumulate_grad_batches=4, global_batch_size=64, precision="bf16-mixed",
                  gradient_checkpointing=False, strategy="ddp", predicted_peak_bytes=10 << 30,
                  device_budget_bytes=70 << 30, host_bytes_per_rank=4 << 30, reasons=("fits",))
    fields.update(overrides)
    return Plan(**fields)


@pytest.fixture
def keep_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))


@pytest.fixture
def user_module(monkeypatch):
    """An importable module `memplan_test_user` with classes a user might write."""
    module = types.ModuleType("memplan_test_user")

    class NeedsWidth(pl.LightningModule):
        def __init__(self, width: int, depth: int = 2):
            super().__init__()
            self.layer = torch.nn.Linear(width, width)

    class NoBatchSize(pl.LightningModule):
        def __init__(self, width: int = 4):
            super().__init__()
            self.layer = torch.nn.Linear(width, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch).sum()

    class Counting(type(GPTLM)):
        def __call__(cls, *args, **kwargs):  # counts builds without touching the frames __init__ inspects, nor
            cls.built.append(cls)            # the signature LightningCLI's parser reads (a __new__ would hide it)
            return super().__call__(*args, **kwargs)

    class CountedGPT(GPTLM, metaclass=Counting):
        built: list[type] = []

    class OwnLoader(NoBatchSize):
        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2)

    module.NeedsWidth, module.NoBatchSize, module.CountedGPT = NeedsWidth, NoBatchSize, CountedGPT
    module.OwnLoader = OwnLoader
    monkeypatch.setitem(sys.modules, "memplan_test_user", module)
    return module


PLANNED_SOURCE = """
# my experiment
seed_everything: 7
trainer:
  max_steps: 100
  devices: 1
  gradient_clip_val: 1.0
  callbacks:
    - class_path: pytorch_lightning.callbacks.LearningRateMonitor
      init_args: {logging_interval: step}
  strategy: ddp_find_unused_parameters_true
model:
  class_path: memplan.demos.MLP
  init_args: {in_features: 20, hidden: 8, depth: 2, num_classes: 3}
data:
  class_path: memplan.demos.RandomVectors
  init_args: {batch_size: 32, in_features: 20, num_classes: 3, num_samples: 512}
optimizer:
  class_path: torch.optim.SGD
  init_args: {lr: 0.1, momentum: 0.9}
memplan:
  global_batch_size: 512
  precisions: [bf16-mixed]
"""
