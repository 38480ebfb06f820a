"""memplan.config.lightning_parser: what LightningCLI's own parser refuses (and memplan's checks do not name
first) is refused when the config loads, in one line naming the key, before anything is built or traced."""
from __future__ import annotations

import copy

import pytest
import yaml

from memplan.config import ConfigError, load_config

BASE = yaml.safe_load("""
trainer:
  devices: 2
  callbacks:
    - class_path: pytorch_lightning.callbacks.LearningRateMonitor
    - class_path: memplan.MemoryPlanner
      init_args: {global_batch_size: 16}
model:
  class_path: memplan.demos.MLP
  init_args: {in_features: 20, hidden: 8, depth: 2, num_classes: 3}
data:
  class_path: memplan.demos.RandomVectors
  init_args: {batch_size: 4, in_features: 20, num_classes: 3, num_samples: 64}
optimizer: {class_path: torch.optim.SGD, init_args: {lr: 0.1}}
""")


def edited(change) -> dict:
    raw = copy.deepcopy(BASE)
    change(raw)
    return raw


@pytest.mark.parametrize("change, key, reason", [
    (lambda c: c["trainer"]["callbacks"][1]["init_args"].update(adjsut=False),
     "trainer.callbacks[1].init_args.adjsut", "memplan.MemoryPlanner: Option 'adjsut' is not accepted"),
    (lambda c: c["trainer"]["callbacks"][1]["init_args"].update(grow_patience="five"),
     "trainer.callbacks[1].init_args.grow_patience", "memplan.MemoryPlanner: Expected a <class 'int'>. Got value: five"),
    (lambda c: c["trainer"]["callbacks"][0].update(init_args={"logging_intervall": "step"}),
     "trainer.callbacks[0].init_args.logging_intervall",
     "pytorch_lightning.callbacks.LearningRateMonitor: Option 'logging_intervall' is not accepted"),
    (lambda c: c.update(lr_scheduler={"class_path": "torch.optim.lr_scheduler.StepLR", "init_args": {"step": 3}}),
     "lr_scheduler.init_args.step", "torch.optim.lr_scheduler.StepLR: Option 'step' is not accepted"),
    (lambda c: c["trainer"].update(logger={"class_path": "CSVLogger", "init_args": {"save_dirr": "."}}),
     "trainer.logger.init_args.save_dirr", "pytorch_lightning.loggers.CSVLogger: Option 'save_dirr' is not accepted"),
])
def test_what_lightning_cli_would_refuse_is_refused_in_one_line_naming_the_key(tmp_path, change, key, reason):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(edited(change)))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == key
    assert str(info.value) == f"{key}: LightningCLI would refuse this config at launch ({reason}); fix {key}"


def test_the_config_read_is_not_changed_by_the_parser(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(BASE))
    assert load_config(path).raw == BASE  # (jsonargparse's parse_object turns what it is given into Namespaces)
