"""memplan.config.lightning_parser: what LightningCLI's own parser refuses (and memplan's checks do not name
first) is refused when the config loads, in one line naming the key, before anything is built or traced."""
from __future__ import annotations

import copy
import sys
import types

import pytest
import pytorch_lightning as pl
import yaml
from torch import nn

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


@pytest.mark.parametrize("change, key, message", [
    (lambda c: c["trainer"]["callbacks"][1]["init_args"].update(adjsut=False),
     "trainer.callbacks[1].init_args.adjsut", "trainer.callbacks[1].init_args.adjsut: MemoryPlanner has no argument "
     "'adjsut' (did you mean 'adjust'?); its arguments are plan, global_batch_size, "),
    (lambda c: c["trainer"]["callbacks"][1]["init_args"].update(grow_patience="five"),
     "trainer.callbacks[1].init_args.grow_patience", "trainer.callbacks[1].init_args.grow_patience must be an int "
     "(MemoryPlanner's argument 'grow_patience'); got 'five'"),
    (lambda c: c["trainer"]["callbacks"][0].update(init_args={"logging_intervall": "step"}),
     "trainer.callbacks[0].init_args.logging_intervall", "trainer.callbacks[0].init_args.logging_intervall: "
     "LearningRateMonitor has no argument 'logging_intervall' (did you mean 'logging_interval'?); its arguments are "
     "logging_interval, log_momentum, log_weight_decay"),
    (lambda c: c.update(lr_scheduler={"class_path": "torch.optim.lr_scheduler.StepLR", "init_args": {"step": 3}}),
     "lr_scheduler.init_args.step", "lr_scheduler.init_args.step: StepLR has no argument 'step' (did you mean "
     "'step_size'?); its arguments are step_size, gamma, last_epoch"),
    (lambda c: c["trainer"].update(logger={"class_path": "CSVLogger", "init_args": {"save_dirr": "."}}),
     "trainer.logger.init_args.save_dirr", "trainer.logger.init_args.save_dirr: CSVLogger has no argument 'save_dirr' "
     "(did you mean 'save_dir'?); its arguments are save_dir, "),
    (lambda c: c["trainer"].update(max_stepz=3),
     "trainer.max_stepz", "trainer.max_stepz: Trainer has no argument 'max_stepz' (did you mean 'max_steps'?)"),
    (lambda c: c.update(optimizer="Adamm"), "optimizer", "optimizer 'Adamm': LightningCLI finds no class by that name "
     "(did you mean 'Adam'?); write its full import path (as optimizer: {class_path: package.module.ClassName})"),
    (lambda c: c.update(optimizer={"class_path": "Adamm"}), "optimizer.class_path", "optimizer.class_path 'Adamm': "
     "LightningCLI finds no class by that name (did you mean 'Adam'?)"),
    (lambda c: c.update(optimizer={"class_path": "torch.nn.Linear"}), "optimizer.class_path",
     "optimizer.class_path 'torch.nn.Linear' is not an Optimizer subclass; LightningCLI's optimizer must be one"),
    (lambda c: c.update(lr_scheduler={"class_path": "torch.optim.lr_scheduler.StepLR"}), "lr_scheduler.init_args.step_size",
     "lr_scheduler.init_args.step_size is missing: StepLR requires it (no default); add it under lr_scheduler.init_args"),
    (lambda c: c["trainer"].update(logger=5), "trainer.logger",
     "trainer.logger must be Logger or Iterable or true or false or null (Trainer's argument 'logger'); got 5"),
])
def test_what_lightning_cli_would_refuse_is_refused_in_one_line_naming_the_key(tmp_path, change, key, message):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(edited(change)))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == key
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_the_config_read_is_not_changed_by_the_parser(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(BASE))
    assert load_config(path).raw == BASE  # (jsonargparse's parse_object turns what it is given into Namespaces)


class Backbone(nn.Module):
    def __init__(self, width: int = 4, depth: int = 1):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


class Head(nn.Module):
    def __init__(self, width: int = 4, classes: int = 2):
        super().__init__()
        self.out = nn.Linear(width, classes)


class Composed(pl.LightningModule):
    def __init__(self, backbone: nn.Module, heads: list[nn.Module] | None = None):
        super().__init__()
        self.backbone, self.heads = backbone, nn.ModuleList(heads or [])


@pytest.fixture
def nested_module(monkeypatch):
    """`memplan_test_nested`: a LightningModule taking its backbone and heads as modules (class_path values)."""
    module = types.ModuleType("memplan_test_nested")
    module.Backbone, module.Head, module.Composed = Backbone, Head, Composed
    monkeypatch.setitem(sys.modules, "memplan_test_nested", module)
    return module


NESTED = """
model:
  class_path: memplan_test_nested.Composed
  init_args:
    backbone: {class_path: memplan_test_nested.Backbone, init_args: {width: 8, depth: 3}}
    heads: [{class_path: memplan_test_nested.Head, init_args: {width: 8, classes: 5}}]
data:
  class_path: memplan.demos.RandomVectors
  init_args: {batch_size: 4, in_features: 8, num_classes: 5, num_samples: 64}
"""


def test_nested_class_path_values_are_built_by_the_parser_on_fake_tensors(tmp_path, nested_module):
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    from memplan.estimator.fake import fake_model, new_fake_mode

    path = tmp_path / "config.yaml"
    path.write_text(NESTED)
    loaded = load_config(path)
    model = fake_model(loaded.build_model, new_fake_mode(), device=torch.device("cpu"), param_dtype=torch.float32)
    assert isinstance(model.backbone, nested_module.Backbone) and len(model.backbone.layers) == 3
    assert [type(h) for h in model.heads] == [nested_module.Head] and model.heads[0].out.out_features == 5
    assert all(isinstance(p, FakeTensor) for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == 3 * (8 * 8 + 8) + 8 * 5 + 5


@pytest.mark.parametrize("text, key, message", [
    (NESTED.replace("width: 8, depth: 3", "widht: 8, depth: 3"), "model.init_args.backbone.init_args.widht",
     "model.init_args.backbone.init_args.widht: Backbone has no argument 'widht' (did you mean 'width'?); "
     "its arguments are width, depth"),
    (NESTED.replace("width: 8, depth: 3", "width: 8, depth: three"), "model.init_args.backbone.init_args.depth",
     "model.init_args.backbone.init_args.depth must be an int (Backbone's argument 'depth'); got 'three'"),
    (NESTED.replace("memplan_test_nested.Backbone", "memplan_test_nested.Backbon"),
     "model.init_args.backbone.class_path", "model.init_args.backbone.class_path 'memplan_test_nested.Backbon': module "
     "'memplan_test_nested' has no attribute 'Backbon' (did you mean 'Backbone'?)"),
    (NESTED.replace("memplan_test_nested.Backbone", "memplan.demos.RandomVectors"), "model.init_args.backbone.class_path",
     "model.init_args.backbone.class_path 'memplan.demos.RandomVectors' is not a Module subclass"),
    (NESTED.replace("memplan_test_nested.Backbone", "nowhere.Backbone"), "model.init_args.backbone.class_path",
     "model.init_args.backbone.class_path 'nowhere.Backbone': cannot import module 'nowhere'"),
    (NESTED.replace("width: 8, classes: 5", "width: 8, clases: 5"), "model.init_args.heads[0].init_args.clases",
     "model.init_args.heads[0].init_args.clases: Head has no argument 'clases' (did you mean 'classes'?)"),
    (NESTED.replace("    backbone: {class_path: memplan_test_nested.Backbone, init_args: {width: 8, depth: 3}}\n", ""),
     "model.init_args.backbone", "model.init_args.backbone is missing: Composed requires it (no default); add it "
     "under model.init_args"),
])
def test_a_nested_class_is_refused_by_its_full_key_path(tmp_path, nested_module, text, key, message):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == key
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_the_values_memplan_plans_with_are_the_ones_lightning_cli_passes(tmp_path):
    """A quoted number is an int to LightningCLI's parser ('4' -> 4): the batch size and loader settings are
    read from what it parsed, as the launch passes them, not from the YAML text."""
    quoted = edited(lambda c: c["data"]["init_args"].update(batch_size="4", num_workers="3"))
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(quoted))
    loaded = load_config(path)
    assert loaded.data_batch_size == 4 and loaded.loader.num_workers == 3
    assert loaded.data.init_args["batch_size"] == "4"  # as written, for the planned config
