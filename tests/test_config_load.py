"""memplan.config: the memplan settings (bad values refused by key, defaults, aliases, unknown keys), and
load_config's errors, each naming the key as the user wrote it and the fix: bad sections and class paths, batch
specs, init_args, a datamodule that fails, a global batch that cannot be derived."""
from __future__ import annotations

import re

import pytest
from config_files import (
    MLP_CONFIG,
    load_text,
    raises_config_error,
    user_module,  # noqa: F401  (a fixture)
)

import memplan
from memplan.config import MemplanSettings, load_config


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
def test_load_errors_name_the_key_and_the_fix(tmp_path, user_module, text, key, match):  # noqa: F811
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
