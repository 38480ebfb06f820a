"""memplan.config: loading LightningCLI configs, their errors, example batches, and the planned config."""
from __future__ import annotations

import json
import os
import re
import sys
import textwrap
import types
from pathlib import Path

import psutil
import pytest
import pytorch_lightning as pl
import torch
import yaml
from torch._subclasses.fake_tensor import FakeTensor

import memplan
from memplan.config import (
    ConfigError,
    MemplanSettings,
    load_config,
    plan_path_for,
    planner_callback,
    torchrun_command,
    write_planned_config,
)
from memplan.demos import GPTLM, RandomVectors
from memplan.estimator.fake import fake_model, new_fake_mode
from memplan.config.write import OutputExists
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


# --- MemplanSettings ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "value", "match"), [
    ("global_batch_size", 0, r"memplan.global_batch_size must be a positive int .*; got 0"),
    ("global_batch_size", 2.5, r"memplan.global_batch_size must be a positive int .*; got 2.5"),
    ("precisions", ("64-true",), r"memplan.precisions must hold Lightning precision strings .*; got '64-true'"),
    ("precisions", (), r"memplan.precisions must be a non-empty list"),
    ("allow_checkpointing", "yes", r"memplan.allow_checkpointing must be true or false; got 'yes'"),
    ("margin", 1.0, r"memplan.margin must be a fraction in \[0, 1\).*; got 1.0"),
    ("optimizer", "adamm", r"memplan.optimizer must be one of sgd, .* \(did you mean 'adam'\?\); got 'adamm'"),
    ("num_workers", -1, r"memplan.num_workers must be an int >= 0 .*; got -1"),
    ("prefetch_factor", 0, r"memplan.prefetch_factor must be a positive int .*; got 0"),
    ("pin_memory", "no", r"memplan.pin_memory must be true or false; got 'no'"),
])
def test_settings_refuse_bad_values_naming_the_key(name, value, match):
    with raises_config_error(f"memplan.{name}", match):
        MemplanSettings(**{name: value})


def test_settings_defaults_aliases_and_unknown_keys():
    defaults = MemplanSettings.from_dict(None)
    assert defaults.global_batch_size is None and defaults.margin == 0.10 and defaults.allow_checkpointing
    assert defaults.precisions == ("32-true", "16-mixed", "bf16-mixed")
    assert MemplanSettings.from_dict({"precisions": [16, "bf16", "32", "16-mixed"]}).precisions == (
        "16-mixed", "bf16-mixed", "32-true")
    assert MemplanSettings.from_dict({"precisions": "bf16-true"}).precisions == ("bf16-true",)
    with raises_config_error("memplan.global_batchsize", r"memplan.global_batchsize is not a memplan setting "
                                                         r"\(did you mean 'global_batch_size'\?\)"):
        MemplanSettings.from_dict({"global_batchsize": 8})


def test_memplan_section_errors_surface_from_load_config(tmp_path):
    with raises_config_error("memplan.global_batch_size", r"memplan.global_batch_size must be a positive int.*got -8"):
        load_text(tmp_path, MLP_CONFIG + "memplan: {global_batch_size: -8}\n")


# --- load_config errors ------------------------------------------------------------------------------
def test_missing_file(tmp_path):
    with raises_config_error("", r"config file .*nope.yaml does not exist; "
                                 r"pass the YAML you give LightningCLI's --config"):
        load_config(tmp_path / "nope.yaml")


def test_yaml_syntax_error_names_the_line(tmp_path):
    text = "model:\n  class_path: memplan.demos.MLP\n  init_args: [1, 2\ntrainer: {}\n"
    with raises_config_error("", r"config.yaml:4:\d+: YAML syntax error at line 4: did not find expected ',' or "
                                 r"'\]' \(while parsing a flow sequence started at line 3\)"):
        load_text(tmp_path, text)


@pytest.mark.parametrize(("text", "key", "match"), [
    ("trainer: {devices: 1}\n", "model",
     r"no model: section; memplan reads the YAML you pass to LightningCLI's `fit --config`"),
    ("model: {init_args: {hidden: 3}}\n", "model.class_path",
     r"model.class_path is missing; memplan reads LightningCLI's form"),
    ("model: {class_path: memplan.nowhere.MLP}\n", "model.class_path",
     r"model.class_path 'memplan.nowhere.MLP': cannot import module 'memplan.nowhere' \(ModuleNotFoundError: "
     r"No module named 'memplan.nowhere'\)\. Check the spelling, and run memplan from the directory"),
    ("model: {class_path: memplan.demos.MLPP}\n", "model.class_path",
     r"model.class_path 'memplan.demos.MLPP': module 'memplan.demos' has no attribute 'MLPP' \(did you mean 'MLP'\?\)"),
    ("model: {class_path: MLP}\n", "model.class_path", r"model.class_path 'MLP' must be a full import path"),
    ("model: {class_path: torch.nn.Linear}\n", "model.class_path",
     r"model.class_path 'torch.nn.Linear' is not a LightningModule subclass"),
    ("model: {class_path: memplan.demos.MLP, hidden: 5}\n", "model.hidden",
     r"model.hidden: init arguments go under model.init_args"),
    ("model: {class_path: memplan.demos.MLP, init_args: {hiddden: 5}}\n", "model.init_args.hiddden",
     r"model.init_args.hiddden: MLP has no argument 'hiddden' \(did you mean 'hidden'\?\); its arguments are "
     r"in_features, hidden, depth, num_classes"),
    ("model: {class_path: memplan_test_user.NeedsWidth}\n", "model.init_args.width",
     r"model.init_args.width is missing: NeedsWidth requires it \(no default\); add it under model.init_args"),
    ("model: {class_path: memplan.demos.MLP}\n"
     "data: {class_path: memplan.demos.RandomVectors, init_args: {batchsize: 4}}\n",
     "data.init_args.batchsize", r"data.init_args.batchsize: RandomVectors has no argument 'batchsize' "
                                 r"\(did you mean 'batch_size'\?\)"),
    ("model: {class_path: memplan.demos.MLP}\ndata: {class_path: memplan.demos.MLP}\n", "data.class_path",
     r"data.class_path 'memplan.demos.MLP' is not a LightningDataModule subclass"),
    ("model: {class_path: memplan.demos.MLP}\n", "trainer.callbacks[MemoryPlanner].init_args.suggest.batch_spec",
     r"no batch to plan with: the config has no data: section .*; describe one batch in "
     r"trainer.callbacks\[MemoryPlanner\].init_args.suggest.batch_spec .*class_path: memplan.MemoryPlanner, "
     r"init_args: {suggest: {batch_spec: "
     r".*README: 'Describing the batch'"),
    ("model: {class_path: memplan_test_user.OwnLoader}\n", "trainer.callbacks[MemoryPlanner].init_args.suggest.batch_spec",
     r"no batch to plan with: OwnLoader loads its own data \(train_dataloader\), which memplan does not run"),
    (MLP_CONFIG + "optimizer: {class_path: AdamW, init_args: {lrr: 0.1}}\n", "optimizer.init_args.lrr",
     r"optimizer.init_args.lrr: AdamW has no argument 'lrr' \(did you mean 'lr'\?\)"),
    (MLP_CONFIG.replace("devices: 2", "devices: 0"), "trainer.devices",
     r"trainer.devices must be a positive number of devices, a list of device indices, 'auto' or -1; got 0"),
    (MLP_CONFIG.replace("devices: 2", "num_nodes: 0"), "trainer.num_nodes",
     r"trainer.num_nodes must be a positive int; got 0"),
])
def test_load_errors_name_the_key_and_the_fix(tmp_path, user_module, text, key, match):
    with raises_config_error(key, match):
        load_text(tmp_path, text)


@pytest.mark.parametrize(("spec", "key", "match"), [
    ("{input: {shape: [8], dtype: int64}}", "memplan.batch_spec.input.high",
     r"memplan.batch_spec.input.high is required for int64 tensors: the exclusive upper bound"),
    ("{input: {shape: [8], dtype: complex64}}", "memplan.batch_spec.input.dtype",
     r"memplan.batch_spec.input.dtype must be one of float32, .*; got 'complex64'"),
    ("[{shape: 8}]", "memplan.batch_spec[0].shape", r"memplan.batch_spec\[0\].shape must be a list of positive ints"),
    ("[{shape: [0]}]", "memplan.batch_spec[0].shape", r"memplan.batch_spec\[0\].shape must be a list of positive ints"),
    ("{x: {shape: [4], hihg: 3}}", "memplan.batch_spec.x.hihg",
     r"memplan.batch_spec.x: unknown keys \['hihg'\] in a tensor spec; its keys are shape, dtype, low, high "
     r"\(did you mean 'high'\?\)"),
    ("{x: {shape: [4], low: 0}}", "memplan.batch_spec.x.low", r"memplan.batch_spec.x.low and high go together"),
    ("{x: 3}", "memplan.batch_spec.x", r"memplan.batch_spec.x must be a tensor spec such as"),
])
def test_batch_spec_errors_name_the_key(tmp_path, spec, key, match):
    text = f"model: {{class_path: memplan.demos.MLP}}\nmemplan:\n  batch_spec: {spec}\n"
    with raises_config_error(key, match):
        load_text(tmp_path, text)


def test_a_batch_spec_that_does_not_fit_the_model_is_reported_against_the_batch_spec(tmp_path):
    loaded = load_text(tmp_path, """
        model: {class_path: memplan.demos.MLP, init_args: {in_features: 20, hidden: 8, depth: 1, num_classes: 3}}
        memplan:
          batch_spec: [{shape: [19]}, {shape: [], dtype: int64, high: 3}]
    """)
    with raises_config_error("memplan.batch_spec", r"memplan.batch_spec and model.init_args do not work together: "
                                                   r"memplan.demos.MLP's training step failed on a batch from "
                                                   r"memplan.batch_spec: the model could not run .*describes the "
                                                   r"batch exactly as training_step receives it"):
        loaded.estimate(2, device="cpu")


def test_a_datamodule_batch_that_does_not_fit_the_model_is_reported_against_data_around_any_trace(tmp_path):
    loaded = load_text(tmp_path, MLP_CONFIG.replace("in_features: 20, hidden", "in_features: 19, hidden"))
    with raises_config_error("data", r"data and model.init_args do not work together: .*check model.init_args "
                                     r"\(the model's own sizes\) and that data.init_args agree with it"):
        with loaded.config_errors():  # as the CLI wraps the planner's search
            memplan.estimate(loaded.build_model, loaded.example_batch(2), device="cpu")


def test_init_args_of_the_wrong_type_are_refused_at_load_by_their_key(tmp_path):
    with raises_config_error("model.init_args.depth", r"model.init_args.depth must be an int .*got 'two'"):
        load_text(tmp_path, MLP_CONFIG.replace("depth: 2", "depth: two"))
    with raises_config_error("data.init_args.batch_size", r"data.init_args.batch_size must be an int .*got 4.5"):
        load_text(tmp_path, MLP_CONFIG.replace("batch_size: 4,", "batch_size: 4.5,"))


def test_init_args_that_cannot_build_the_model_are_reported_against_model_init_args(tmp_path):
    loaded = load_text(tmp_path, MLP_CONFIG.replace("hidden: 8", "hidden: -8"))
    with raises_config_error("model.init_args", r"model.init_args: memplan.demos.MLP\(\*\*init_args\) failed: "
                                                r"RuntimeError: .*; fix model.init_args"):
        loaded.estimate(2, device="cpu")


def test_a_datamodule_that_fails_is_reported_as_the_users_with_its_message(tmp_path):
    loaded = load_text(tmp_path, MLP_CONFIG.replace("RandomVectors", "RandomImages").replace(
        "batch_size: 4, in_features: 20", "batch_size: 4, shape: [1, 50]"))
    with raises_config_error("data", r"data: RandomImages\(\*\*data.init_args\) raised ValueError: RandomImages: "
                                     r"shape must be \[channels, height, width\]"
                                     r".*or describe the batch in the MemoryPlanner callback's "
                                     r"init_args.suggest.batch_spec"):
        loaded.example_batch(2)


def test_a_global_batch_that_cannot_be_derived_asks_for_the_planners_global_batch_size(tmp_path):
    loaded = load_text(tmp_path, MLP_CONFIG.replace("devices: 2", "devices: auto"))
    key = "trainer.callbacks[MemoryPlanner].init_args.global_batch_size"
    with raises_config_error(key, rf"{re.escape(key)} is not set, and trainer.devices is 'auto', .*set {re.escape(key)}"):
        _ = loaded.global_batch_size


# --- loading -----------------------------------------------------------------------------------------
def test_example_batch_is_one_datamodule_batch_resized(tmp_path):
    loaded = load_text(tmp_path, MLP_CONFIG)
    dm = RandomVectors(batch_size=4, in_features=20, num_classes=3, num_samples=64)
    dm.setup("fit")
    x_true, y_true = next(iter(dm.train_dataloader()))

    x, y = loaded.example_batch(4)
    assert torch.equal(x, x_true) and torch.equal(y, y_true)
    x3, y3 = loaded.example_batch(3)
    assert torch.equal(x3, x_true[:3]) and torch.equal(y3, y_true[:3])
    x6, _ = loaded.example_batch(6)
    assert torch.equal(x6[4:], x_true[:2])
    assert loaded.data_batch_size == 4 and loaded.batch_size_arg == ("data", "batch_size")
    assert loaded.model.cls.__name__ == "MLP" and loaded.trainer == {"devices": 2, "max_steps": 10}
    assert loaded.raw["seed_everything"] == 7 and loaded.path.name == "config.yaml"


def test_example_batch_from_batch_spec_dict_tuple_and_single_tensor(tmp_path):
    loaded = load_text(tmp_path, """
        model: {class_path: memplan.demos.GPTLM}
        memplan:
          batch_spec:
            input: {shape: [16], dtype: int64, high: 100}
            mask: {shape: [16], dtype: bool}
            pixels: {shape: [3, 4], dtype: bfloat16, low: -1, high: 1}
    """)
    batch = loaded.example_batch(5)
    assert batch["input"].shape == (5, 16) and batch["input"].dtype == torch.int64
    assert 0 <= batch["input"].min() and batch["input"].max() < 100
    assert batch["mask"].dtype == torch.bool and batch["pixels"].dtype == torch.bfloat16
    assert -1 <= batch["pixels"].min() and batch["pixels"].max() < 1
    assert torch.equal(loaded.example_batch(5)["input"], batch["input"])  # deterministic

    pair = load_text(tmp_path, """
        model: {class_path: memplan.demos.MLP}
        memplan: {batch_spec: [{shape: [1000]}, {shape: [], dtype: int64, high: 10}]}
    """).example_batch(3)
    assert isinstance(pair, tuple) and pair[0].shape == (3, 1000) and pair[1].shape == (3,)
    single = load_text(tmp_path, "model: {class_path: memplan.demos.MLP}\nmemplan: {batch_spec: {shape: [7]}}\n")
    assert single.example_batch(2).shape == (2, 7)


def test_batch_spec_is_preferred_over_the_datamodule_and_estimates(tmp_path):
    spec = "memplan:\n  batch_spec: [{shape: [20]}, {shape: [], dtype: int64, high: 3}]\n"
    loaded = load_text(tmp_path, MLP_CONFIG + spec)
    assert "_datamodule_scan" not in vars(loaded)
    est = loaded.estimate(4, device="cpu")
    assert est.batch_size == 4 and est.num_parameters == 20 * 8 + 8 + 8 * 8 + 8 + 8 * 3 + 3
    assert "_datamodule_scan" not in vars(loaded)  # the datamodule never ran


def test_global_batch_size_is_the_setting_else_the_configs_own(tmp_path):
    own = load_text(tmp_path, MLP_CONFIG.replace(
        "devices: 2", "devices: [0, 3]\n  num_nodes: 2\n  accumulate_grad_batches: 4"))
    assert own.trainer_world_size == 4 and own.global_batch_size == 4 * 4 * 4
    assert load_text(tmp_path, MLP_CONFIG.replace("devices: 2", "devices: '0,1,2'")).global_batch_size == 12
    assert load_text(tmp_path, MLP_CONFIG + "memplan: {global_batch_size: 96}\n").global_batch_size == 96
    default_batch = load_text(tmp_path, MLP_CONFIG.replace("batch_size: 4, ", ""))
    assert default_batch.data_batch_size == 256  # the datamodule's signature default


def test_loader_hints_from_init_args_else_the_memplan_section_else_defaults(tmp_path):
    default = load_text(tmp_path, MLP_CONFIG).loader
    assert (default.num_workers, default.pin_memory, default.prefetch_factor) == (0, False, 2)
    hints = "memplan: {num_workers: 6, pin_memory: true, prefetch_factor: 4}\n"
    hinted = load_text(tmp_path, MLP_CONFIG + hints).loader
    assert (hinted.num_workers, hinted.pin_memory, hinted.prefetch_factor) == (6, True, 4)
    given = load_text(tmp_path, MLP_CONFIG.replace("batch_size: 4,", "batch_size: 4, num_workers: 3,")
                      + "memplan: {num_workers: 6}\n").loader
    assert (given.num_workers, given.pin_memory, given.prefetch_factor) == (3, False, 2)


def test_optimizer_is_memplans_override_else_the_optimizer_section_else_the_models(tmp_path):
    assert load_text(tmp_path, MLP_CONFIG).optimizer is None
    section = "optimizer:\n  class_path: torch.optim.AdamW\n  init_args: {lr: 6e-4, betas: [0.9, 0.95]}\n"
    built = load_text(tmp_path, MLP_CONFIG + section).optimizer([torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(built, torch.optim.AdamW) and built.defaults["lr"] == 6e-4  # 6e-4 is a float, as in LightningCLI
    assert load_text(tmp_path, MLP_CONFIG + "optimizer: SGD\n").optimizer_section.cls is torch.optim.SGD
    assert load_text(tmp_path, MLP_CONFIG + section + "memplan: {optimizer: sgd}\n").optimizer == "sgd"


def test_the_yaml_is_read_as_lightning_clis_parser_reads_it(tmp_path):
    from jsonargparse import get_loader

    text = MLP_CONFIG + "optimizer: {class_path: torch.optim.SGD, init_args: {lr: 1e-3, weight_decay: .5e-4}}\n"
    loaded = load_text(tmp_path, text)
    assert loaded.raw == get_loader("yaml")(textwrap.dedent(text))  # jsonargparse's loader: 1e-3 a float ...
    assert loaded.optimizer_section.init_args == {"lr": 1e-3, "weight_decay": 0.5e-4}
    with raises_config_error("", r"config.yaml holds only a key without a value \(model:\), which LightningCLI reads "
                                 r"as a string, not a config; give it its value"):
        load_text(tmp_path, "model:\n")  # ... and a lone key as a string, which YAML itself would not


def test_overrides_merge_dotted_and_nested_keys(tmp_path):
    loaded = load_text(tmp_path, MLP_CONFIG, overrides={
        "memplan.global_batch_size": 48, "trainer": {"precision": 16}, "data.init_args.batch_size": 2})
    assert loaded.settings.global_batch_size == 48 and loaded.trainer_precision == "16-mixed"
    assert loaded.data_batch_size == 2 and loaded.trainer["devices"] == 2 and loaded.data.init_args["in_features"] == 20


def test_a_7b_config_allocates_no_weights_until_memplan_builds_it_fake(tmp_path, user_module):
    built = user_module.CountedGPT.built
    rss_before = psutil.Process().memory_info().rss
    loaded = load_text(tmp_path, """
        model:
          class_path: memplan_test_user.CountedGPT
          init_args: {vocab_size: 32000, context: 4096, d_model: 4096, n_layers: 32, n_heads: 32}
        data:
          class_path: memplan.demos.RandomTokens
          init_args: {batch_size: 1, vocab_size: 32000, context: 4096}
        memplan: {global_batch_size: 64}
    """)
    assert loaded.example_batch(2)[0].shape == (2, 4096) and loaded.global_batch_size == 64
    assert built == []  # loading, batches and settings never build the model

    model = fake_model(loaded.build_model, new_fake_mode(), device=torch.device("cpu"), param_dtype=torch.float32)
    params = list(model.parameters())
    assert len(built) == 1 and all(isinstance(p, FakeTensor) for p in params)
    assert sum(p.numel() for p in params) > 6.5e9  # 26 GB of fp32 weights, had they been allocated
    assert psutil.Process().memory_info().rss - rss_before < 1 << 30


# --- write_planned_config ----------------------------------------------------------------------------
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


def test_write_planned_config_sets_the_plan_and_keeps_the_users_keys(tmp_path):
    loaded = load_text(tmp_path, PLANNED_SOURCE)
    plan = make_plan(nodes=2, world_size=8, micro_batch_size=4, accumulate_grad_batches=16, global_batch_size=512,
                     gradient_checkpointing=True)
    out = tmp_path / "out" / "planned.yaml"
    write_planned_config(loaded, plan, out, callback=planner_callback(plan_path_for(out)))

    text = out.read_text()
    assert text.startswith("# Planned by memplan from ") and "Micro-batch 4 x 8 rank(s) x 16 accumulation" in text
    written = yaml.safe_load(text)
    assert list(written) == ["seed_everything", "trainer", "model", "data", "optimizer"]  # memplan: dropped
    trainer = written["trainer"]
    assert list(trainer)[:5] == ["max_steps", "devices", "gradient_clip_val", "callbacks", "strategy"]
    assert (trainer["devices"], trainer["num_nodes"], trainer["precision"], trainer["accumulate_grad_batches"]) == (
        4, 2, "bf16-mixed", 16)
    assert trainer["strategy"] == "ddp_find_unused_parameters_true"  # the user's DDP variant is kept
    assert trainer["max_steps"] == 100 and trainer["gradient_clip_val"] == 1.0
    assert trainer["callbacks"] == [
        {"class_path": "pytorch_lightning.callbacks.LearningRateMonitor", "init_args": {"logging_interval": "step"}},
        {"class_path": "memplan.MemoryPlanner", "init_args": {  # the memplan: section moved in, beside the plan
            "global_batch_size": 512, "suggest": {"precisions": ["bf16-mixed"]},
            "plan": str(tmp_path / "out" / "planned.plan.json")}},
    ]
    assert "its memplan: section is, into the MemoryPlanner callback's init_args" in text
    assert written["data"]["init_args"] == {"batch_size": 4, "in_features": 20, "num_classes": 3, "num_samples": 512}
    assert written["model"] == loaded.raw["model"] and written["optimizer"] == loaded.raw["optimizer"]
    assert json.loads((tmp_path / "out" / "planned.plan.json").read_text()) == plan.to_dict()
    assert Plan.from_dict(json.loads(plan_path_for(out).read_text())) == plan

    again = load_config(out)  # the planned config reads back with the same global batch, from the callback
    assert again.global_batch_size == 512 and again.data_batch_size == 4 and again.accumulate_grad_batches == 16
    assert again.settings.precisions == ("bf16-mixed",) and again.deprecations == ()
    assert again.settings.key("global_batch_size") == "trainer.callbacks[1].init_args.global_batch_size"


def test_write_planned_config_never_replaces_files_unless_forced(tmp_path):
    loaded = load_text(tmp_path, MLP_CONFIG)
    out = tmp_path / "planned.yaml"
    plan_path_for(out).write_text("the user's plan\n")
    with pytest.raises(OutputExists, match=f"--output would replace {plan_path_for(out)}; pass --force") as info:
        write_planned_config(loaded, make_plan(), out)
    assert info.value.paths == [plan_path_for(out)] and not out.exists()
    assert plan_path_for(out).read_text() == "the user's plan\n"

    write_planned_config(loaded, make_plan(micro_batch_size=16, accumulate_grad_batches=2), out, force=True)
    assert Plan.from_dict(json.loads(plan_path_for(out).read_text())).micro_batch_size == 16
    with pytest.raises(OutputExists, match=f"{out} and {plan_path_for(out)}"):
        write_planned_config(loaded, make_plan(), out)


def test_write_planned_config_writes_the_plan_first_and_atomically(tmp_path, monkeypatch):
    loaded = load_text(tmp_path, MLP_CONFIG)
    out = tmp_path / "planned.yaml"
    out.write_text("old config\n")
    renamed = []
    real_replace = os.replace

    def replace(src, dst):
        renamed.append(Path(dst).name)
        if Path(dst) == out:
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="No space left"):
        write_planned_config(loaded, make_plan(), out, force=True)
    assert renamed == ["planned.plan.json", "planned.yaml"]  # the plan first: a config never names a partial plan
    assert out.read_text() == "old config\n"  # the failed write left the old file whole
    # and took its new plan back: no plan without the config that names it, no temporary file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "planned.yaml"]


def test_two_writers_leave_one_writers_pair(tmp_path, monkeypatch):
    """A writer that stalls between its plan and its config (a slow disk) must not let a second writer
    slip in between: the folder lock makes the second wait, so the config always matches the plan."""
    import threading
    import time

    import memplan.config.write as write_module

    loaded = load_text(tmp_path, MLP_CONFIG)
    out = tmp_path / "planned.yaml"
    real_write = write_module._temp_with

    def slow_for_the_first(path, text):
        temp = real_write(path, text)
        if path.name.endswith(".plan.json") and threading.current_thread().name == "first":
            time.sleep(0.3)
        return temp

    monkeypatch.setattr(write_module, "_temp_with", slow_for_the_first)
    plans = {"first": make_plan(world_size=2, micro_batch_size=4, accumulate_grad_batches=8),
             "second": make_plan(world_size=4, micro_batch_size=4, accumulate_grad_batches=4)}
    threads = [threading.Thread(target=write_planned_config, args=(loaded, plans[name], out), kwargs={"force": True},
                                name=name) for name in plans]
    threads[0].start()
    time.sleep(0.05)
    threads[1].start()
    for t in threads:
        t.join()
    written = Plan.from_dict(json.loads(plan_path_for(out).read_text()))
    assert yaml.safe_load(out.read_text())["trainer"]["devices"] == written.gpus_per_node


def test_the_planned_config_finds_its_plan_from_any_directory_and_after_the_pair_moved(tmp_path, monkeypatch):
    from memplan.callback.apply import load_plan

    loaded = load_text(tmp_path, MLP_CONFIG)
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)
    out = "runs/planned.yaml"
    write_planned_config(loaded, make_plan(), out, callback=planner_callback(plan_path_for(out), config_path=out))
    entry = yaml.safe_load((tmp_path / "runs" / "planned.yaml").read_text())["trainer"]["callbacks"][-1]
    assert entry["init_args"]["plan"] == "planned.plan.json"  # relative to the config's folder
    moved = tmp_path / "moved" / "here"
    moved.parent.mkdir()
    (tmp_path / "runs").rename(moved)  # the pair moved together
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # training started from another directory, as LightningCLI is started
    monkeypatch.setattr(sys, "argv", ["train.py", "fit", "--config", str(moved / "planned.yaml")])
    assert load_plan(entry["init_args"]["plan"]) == make_plan()
    monkeypatch.setattr(sys, "argv", ["train.py", "fit", f"--config={moved / 'planned.yaml'}", "--trainer.max_steps=3"])
    assert load_plan(entry["init_args"]["plan"]) == make_plan()


def test_a_plan_named_by_absolute_path_is_still_read(tmp_path, monkeypatch):
    from memplan.callback.apply import load_plan

    loaded = load_text(tmp_path, MLP_CONFIG)
    out = tmp_path / "runs" / "planned.yaml"
    write_planned_config(loaded, make_plan(), out, callback=planner_callback(plan_path_for(out)))
    entry = yaml.safe_load(out.read_text())["trainer"]["callbacks"][-1]
    assert Path(entry["init_args"]["plan"]).is_absolute()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train.py", "fit", "--config", str(tmp_path / "config.yaml")])
    assert load_plan(entry["init_args"]["plan"]) == make_plan()


def test_a_plan_not_beside_its_config_names_where_it_was_looked_for(tmp_path, monkeypatch):
    from memplan.callback.apply import load_plan
    from memplan.callback.framework import MisconfigurationException

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "planned.yaml").write_text("trainer: {}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train.py", "fit", "-c", "a/planned.yaml"])
    with pytest.raises(MisconfigurationException, match=r"MemoryPlanner\(plan='planned.plan.json'\): no such file "
                       rf"\(looked for {tmp_path}/a/planned.plan.json and {tmp_path}/planned.plan.json\); a planned "
                       "config names its plan relative to its own folder: keep the two together"):
        load_plan("planned.plan.json")


def test_write_planned_config_choices(tmp_path, user_module):
    loaded = load_text(tmp_path, MLP_CONFIG.replace("batch_size: 4, ", ""))
    local = make_plan(gpus=(0, 2), world_size=2, strategy="ddp")
    out = tmp_path / "local.yaml"
    write_planned_config(loaded, local, out, callback=planner_callback("p.json"))
    written = yaml.safe_load(out.read_text())
    assert written["trainer"]["devices"] == [0, 2] and written["trainer"]["strategy"] == "ddp"
    assert written["data"]["init_args"]["batch_size"] == 8  # added: the class's batch_size argument

    write_planned_config(load_config(out), make_plan(world_size=1, micro_batch_size=32, accumulate_grad_batches=2,
                                                     strategy="auto"), out.with_name("one.yaml"),
                         callback=planner_callback("q.json"))
    one = yaml.safe_load(out.with_name("one.yaml").read_text())["trainer"]
    assert one["devices"] == 1 and one["strategy"] == "auto"
    assert one["callbacks"] == [planner_callback("q.json")]  # a re-plan replaces memplan's entry

    with pytest.warns(UserWarning, match="the plan checkpoints activations, which the MemoryPlanner callback applies"):
        write_planned_config(loaded, make_plan(gradient_checkpointing=True), tmp_path / "ckpt.yaml")
    assert "callbacks" not in yaml.safe_load((tmp_path / "ckpt.yaml").read_text())["trainer"]

    with raises_config_error("", r"refusing to overwrite the source config"):
        write_planned_config(loaded, local, loaded.path)
    no_batch_arg = load_text(tmp_path, "model: {class_path: memplan_test_user.NoBatchSize}\n"
                                       "memplan: {batch_spec: {shape: [4]}}\n")
    with raises_config_error("data", r"cannot apply the plan's micro-batch size: model.init_args \(there is no data: "
                                     r"section\) has no batch_size or train_batch_size"):
        write_planned_config(no_batch_arg, local, tmp_path / "x.yaml")


def lightning_cli_test(test):
    """Mark a test that runs LightningCLI: sys.argv restored, and Lightning's own noise silenced."""
    for mark in (
        pytest.mark.usefixtures("keep_argv"),
        pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # Lightning's use of jsonargparse's old API
        pytest.mark.filterwarnings("ignore:.*tensorboardX.*"),
        pytest.mark.filterwarnings("ignore:.*configure_optimizers` will be overridden.*"),
    ):
        test = mark(test)
    return test


def _lightning_cli(config: Path, *args: str, run: bool = True):
    from pytorch_lightning.cli import LightningCLI

    sys.argv[1:] = []  # LightningCLI warns when args= and a command line (pytest's) are both given
    return LightningCLI(pl.LightningModule, pl.LightningDataModule, subclass_mode_model=True,
                        subclass_mode_data=True, args=[*args, "--config", str(config)], run=run,
                        save_config_callback=None)


@lightning_cli_test
def test_lightning_cli_accepts_the_planned_config_as_is(tmp_path, capsys):
    loaded = load_text(tmp_path, PLANNED_SOURCE)
    plan = make_plan(world_size=2, micro_batch_size=8, accumulate_grad_batches=32, global_batch_size=512)
    out = tmp_path / "planned.yaml"
    write_planned_config(loaded, plan, out)

    cli = _lightning_cli(out, run=False)
    assert cli.trainer.num_devices == 2 and cli.trainer.accumulate_grad_batches == 32
    assert type(cli.trainer.strategy).__name__ == "DDPStrategy" and cli.trainer.precision == "bf16-mixed"
    assert cli.datamodule.batch_size == 8 and type(cli.model).__name__ == "MLP"

    with pytest.raises(SystemExit) as exited:
        _lightning_cli(out, "fit", "--print_config")
    assert exited.value.code == 0 and "accumulate_grad_batches: 32" in capsys.readouterr().out


@lightning_cli_test
def test_lightning_cli_accepts_the_planned_config_with_the_memory_planner_callback(tmp_path, capsys):
    try:
        from memplan import MemoryPlanner  # noqa: F401
    except ImportError:
        pytest.skip("memplan.MemoryPlanner (memplan/callback) does not import yet; its trainer.callbacks "
                    "entry cannot be checked by LightningCLI")
    out = tmp_path / "planned.yaml"
    write_planned_config(load_text(tmp_path, PLANNED_SOURCE), make_plan(global_batch_size=64), out,
                         callback=planner_callback(plan_path_for(out)))
    with pytest.raises(SystemExit) as exited:
        _lightning_cli(out, "fit", "--print_config")
    assert exited.value.code == 0 and "memplan.MemoryPlanner" in capsys.readouterr().out


# --- torchrun ----------------------------------------------------------------------------------------
def test_torchrun_command_for_one_node_and_for_several(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # paths come out absolute: the command runs from any directory
    one = torchrun_command(make_plan(world_size=4, micro_batch_size=2, accumulate_grad_batches=8), "planned.yaml")
    # this interpreter, not a bare `torchrun` (not on PATH without an activated venv); the entry point in the package
    assert one == [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", "--nnodes=1", "--standalone",
                   "-m", "memplan.train", "fit", "--config", str(tmp_path / "planned.yaml")]
    many = torchrun_command(make_plan(nodes=2, world_size=16, micro_batch_size=1, accumulate_grad_batches=4),
                            Path("out/p.yaml"), entry_point="train.py", rdzv_endpoint="node0:29400", python="py")
    assert many == ["py", "-m", "torch.distributed.run", "--nproc-per-node=8", "--nnodes=2", "--rdzv-backend=c10d",
                    "--rdzv-endpoint=node0:29400", str(tmp_path / "train.py"), "fit", "--config",
                    str(tmp_path / "out" / "p.yaml")]


def test_sigterm_while_the_pair_is_written_leaves_both_or_neither_and_no_temporary_file(tmp_path):
    """`suggest --output` killed with SIGTERM in the middle of writing (a slow disk: the plan's temporary file
    is not flushed until the signal has been sent, however long that takes): the signal waits until the pair
    is whole, then ends the process as SIGTERM does."""
    import signal
    import subprocess
    import sys

    from subprocess_run import Watched

    loaded = load_text(tmp_path, MLP_CONFIG)
    script = f"""
import os, sys, time
sys.path.insert(0, {str(Path(__file__).parent)!r})
import memplan.config.write as write
from memplan.config import load_config
from test_config import make_plan
real = write._temp_with
def slow(path, text):
    temp = real(path, text)
    with open({str(tmp_path / 'temps')!r}, "a") as temps:
        temps.write(path.name + "\\n")
    while path.name.endswith(".plan.json") and not os.path.exists({str(tmp_path / 'signal-sent')!r}):
        time.sleep(0.01)
    return temp
write._temp_with = slow
write.write_planned_config(load_config({str(loaded.path)!r}), make_plan(), {str(tmp_path / 'planned.yaml')!r})
print("written", flush=True)
"""
    with Watched([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        temps = tmp_path / "temps"
        proc.wait_until(lambda: temps.exists() and "planned.plan.json" in temps.read_text(),
                        "the plan's temporary file was written")
        proc.send_signal(signal.SIGTERM)
        (tmp_path / "signal-sent").touch()
        out, err = proc.communicate()
    assert proc.returncode == -signal.SIGTERM, err
    assert "written" not in out  # the signal ended it, after the pair
    assert temps.read_text().splitlines()[0] == "planned.plan.json"  # the plan first
    (tmp_path / "signal-sent").unlink()
    temps.unlink()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["config.yaml", "planned.plan.json", "planned.yaml"], names  # both, and no hidden .tmp
    written = Plan.from_dict(json.loads((tmp_path / "planned.plan.json").read_text()))
    assert yaml.safe_load((tmp_path / "planned.yaml").read_text())["trainer"]["accumulate_grad_batches"] == \
        written.accumulate_grad_batches


def test_a_failed_second_rename_takes_the_first_back(tmp_path, monkeypatch):
    import memplan.config.write as write_module

    real = write_module.os.replace
    calls = []

    def second_fails(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(write_module.os, "replace", second_fails)
    with pytest.raises(OSError, match="No space left"):
        write_module.write_pair(((tmp_path / "a.plan.json", "{}\n"), (tmp_path / "a.yaml", "x: 1\n")))
    assert list(tmp_path.iterdir()) == []  # neither file, no temporary file


class LongTailTokens(pl.LightningDataModule):
    """Token batches whose length grows in steps: the first 8 tokens a sample, the fifth batch 64 (8x)."""

    def __init__(self, batch_size: int = 4):
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        lengths = [8, 16, 8, 24, 64, 16, 8, 8]
        return torch.utils.data.DataLoader([torch.zeros(n, dtype=torch.long) for n in lengths for _ in range(4)],
                                           batch_size=4, collate_fn=lambda s: (torch.stack(s), torch.stack(s)))


def test_suggest_plans_from_the_heaviest_batch_of_the_datamodule(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "longtail_dm", types.SimpleNamespace(LongTailTokens=LongTailTokens))
    loaded = load_text(tmp_path, """
        model: {class_path: memplan.demos.GPTLM, init_args: {vocab_size: 64, context: 64, d_model: 8, n_layers: 1, n_heads: 1}}
        data: {class_path: longtail_dm.LongTailTokens}
        memplan: {global_batch_size: 4}
    """)
    assert loaded.example_batch(2)[0].shape == (2, 64)  # not the first batch's 8
    assert "every batch of an epoch" in loaded.planned_for and "8.00x the first batch's" in loaded.planned_for
    # suggest's plan is for that batch, and says so
    from memplan.commands.planning import plan_config, resolve_hardware

    plan = plan_config(loaded, resolve_hardware(gpus=1, gpu="A100-80GB", gpu_memory=None))
    assert any("Planned for the heaviest" in r and "(4, 64), (4, 64)" in r for r in plan.reasons), plan.reasons


def test_a_fixed_shape_loader_is_scanned_only_briefly():
    from memplan.batching import batch_size_of
    from memplan.shapes import SAME_SHAPE_STOP, scan

    loader = [(torch.zeros(4, 16), torch.zeros(4, dtype=torch.long))] * 1000
    found = scan(loader, batch_size_of, max_batches=256, seconds=60)
    assert found.scanned == SAME_SHAPE_STOP and found.fixed
    assert found.describe().startswith(f"planned for batches of one shape: the first {SAME_SHAPE_STOP} read")
