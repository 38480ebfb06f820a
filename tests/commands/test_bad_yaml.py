"""Bad configs, each refused before anything is traced, with exit code 2, at most two lines on stderr, no
traceback, and a message that names the YAML key path as the user wrote it or the file: bad keys, files that are
not YAML mappings, missing files, files that are not small regular files; --debug shows the traceback.

A row fails if its message stops naming the key: the fragment is the key's path plus what was wrong.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from refusals import (
    DELETE,
    assert_refused,
    config_with,
    no_gpu_and_no_trace,  # noqa: F401  (autouse)
    run,
    write_config,
)

from memplan.commands.cli import main

YAML_CASES = [
    ("yaml-no-model", {"model": DELETE}, "no model: section"),
    ("yaml-model-class-path-missing", {"model.class_path": DELETE}, "model.class_path is missing"),
    ("yaml-model-class-path-module", {"model.class_path": "nowhere.Model"}, "model.class_path 'nowhere.Model'"),
    ("yaml-model-class-path-name", {"model.class_path": "memplan.demos.MLPP"}, "model.class_path 'memplan.demos.MLPP'"),
    ("yaml-model-not-a-module", {"model.class_path": "memplan.demos.RandomVectors"},
     "model.class_path 'memplan.demos.RandomVectors' is not a LightningModule"),
    ("yaml-model-extra-key", {"model.hidden": 8}, "model.hidden: init arguments go under model.init_args"),
    ("yaml-init-args-unknown", {"model.init_args.hiden": 8}, "model.init_args.hiden: MLP has no argument 'hiden'"),
    ("yaml-optimizer-class-path", {"optimizer": {"class_path": "torch.optim.Adamm"}},
     "optimizer.class_path 'torch.optim.Adamm': module 'torch.optim' has no attribute 'Adamm' (did you mean 'Adam'?)"),
    ("yaml-optimizer-betas", {"optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"betas": "0.9"}}},
     "optimizer.init_args.betas must be a list"),
    ("yaml-optimizer-weight-decay", {"optimizer": {"class_path": "AdamW", "init_args": {"weight_decay": "heavy"}}},
     "optimizer.init_args.weight_decay must be a number"),
    ("yaml-optimizer-unknown-arg", {"optimizer": {"class_path": "AdamW", "init_args": {"learning_rate": 0.1}}},
     "optimizer.init_args.learning_rate: AdamW has no argument 'learning_rate'"),
    ("yaml-init-args-str-for-int", {"model.init_args.depth": "two"}, "model.init_args.depth must be an int"),
    ("yaml-init-args-float-for-int", {"model.init_args.hidden": 8.5}, "model.init_args.hidden must be an int"),
    ("yaml-init-args-list-for-int", {"model.init_args.in_features": [20]}, "model.init_args.in_features must be an int"),
    ("yaml-init-args-bool-for-int", {"data.init_args.batch_size": True}, "data.init_args.batch_size must be an int"),
    ("yaml-init-args-str-for-bool", {"data.init_args.pin_memory": "yes please"},
     "data.init_args.pin_memory must be true or false"),
    ("yaml-nested-class-path", {"model.init_args.hidden": {"class_path": "nowhere.Width"}},  # MLP's hidden is an int
     "model.init_args.hidden must be an int (MLP's argument 'hidden'); got {'class_path': 'nowhere.Width'}"),
    ("yaml-init-args-not-mapping", {"model.init_args": [1, 2]}, "model.init_args must be a mapping"),
    ("yaml-trainer-not-mapping", {"trainer": "fast"}, "trainer must be a mapping"),
    ("yaml-trainer-precision-64", {"trainer.precision": 64}, "trainer.precision 64: Lightning runs it"),
    ("yaml-trainer-precision-typo", {"trainer.precision": "fp16"}, "trainer.precision must be a Lightning precision"),
    ("yaml-trainer-devices", {"trainer.devices": -3}, "trainer.devices must be a positive number"),
    ("yaml-trainer-devices-word", {"trainer.devices": "many"}, "trainer.devices must be a positive number"),
    ("yaml-trainer-num-nodes", {"trainer.num_nodes": 0}, "trainer.num_nodes must be a positive int"),
    ("yaml-trainer-strategy-gone", {"trainer.strategy": "horovod"}, "trainer.strategy 'horovod' is not a Lightning strategy"),
    ("yaml-trainer-strategy-typo", {"trainer.strategy": "dpp"},
     "trainer.strategy 'dpp' is not a Lightning strategy (did you mean 'ddp'?)"),
    ("yaml-trainer-strategy-unplanned", {"trainer.strategy": "deepspeed_stage_2"},
     "trainer.strategy 'deepspeed_stage_2': memplan plans DDP and FSDP"),
    ("yaml-trainer-strategy-class", {"trainer.strategy": {"class_path": "pytorch_lightning.strategies.DeepSpeedStrategy"}},
     "trainer.strategy.class_path 'DeepSpeedStrategy': memplan plans"),
    ("yaml-trainer-strategy-number", {"trainer.strategy": 2}, "trainer.strategy must be a strategy name"),
    ("yaml-trainer-accelerator-tpu", {"trainer.accelerator": "tpu"}, "trainer.accelerator 'tpu': memplan plans CUDA GPUs"),
    ("yaml-trainer-accelerator-typo", {"trainer.accelerator": "gpus"}, "trainer.accelerator must be one of auto, gpu"),
    ("yaml-seed-word", {"seed_everything": "abc"}, "seed_everything must be true, false or an int seed"),
    ("yaml-seed-negative", {"seed_everything": -1}, "seed_everything must be true, false or an int seed"),
    ("yaml-trainer-accumulate-bool", {"trainer.accumulate_grad_batches": True},
     "trainer.accumulate_grad_batches must be a positive int"),
    ("yaml-trainer-unknown", {"trainer.max_stepz": 10},
     "trainer.max_stepz: Trainer has no argument 'max_stepz' (did you mean 'max_steps'?)"),
    ("yaml-trainer-max-steps-str", {"trainer.max_steps": "ten"}, "trainer.max_steps must be an int"),
    ("yaml-trainer-clip-str", {"trainer.gradient_clip_val": "big"}, "trainer.gradient_clip_val must be"),
    ("yaml-memplan-not-mapping", {"memplan": [1]}, "memplan must be a mapping"),
    ("yaml-memplan-unknown", {"memplan.global_batch": 64}, "memplan.global_batch is not a memplan setting"),
    ("yaml-memplan-gbs-0", {"memplan.global_batch_size": 0}, "memplan.global_batch_size must be a positive int"),
    ("yaml-memplan-gbs-bool", {"memplan.global_batch_size": True}, "memplan.global_batch_size must be a positive int"),
    ("yaml-memplan-gbs-str", {"memplan.global_batch_size": "64"}, "memplan.global_batch_size must be a positive int"),
    ("yaml-memplan-gbs-over-ranks", {"memplan.global_batch_size": 2}, "--gpus 4 x --nodes 1 = 4 ranks, more than the "
                                                                       "global batch of 2 (memplan.global_batch_size)"),
    ("yaml-memplan-margin", {"memplan.margin": 1.5}, "memplan.margin must be a fraction"),
    ("yaml-memplan-margin-str", {"memplan.margin": "10%"}, "memplan.margin must be a fraction"),
    ("yaml-memplan-precisions-typo", {"memplan.precisions": ["bf16-mixed", "fp16"]},
     "memplan.precisions[1] must be a Lightning precision"),
    ("yaml-memplan-precisions-empty", {"memplan.precisions": []}, "memplan.precisions must be a non-empty list"),
    ("yaml-memplan-precisions-not-searched", {"memplan.precisions": ["16-true"]}, "memplan.precisions: the planner"),
    ("yaml-memplan-checkpointing", {"memplan.allow_checkpointing": "yes please"},
     "memplan.allow_checkpointing must be true or false"),
    ("yaml-memplan-optimizer", {"memplan.optimizer": "adamm"}, "memplan.optimizer must be one of"),
    ("yaml-memplan-num-workers", {"memplan.num_workers": -1}, "memplan.num_workers must be an int >= 0"),
    ("yaml-memplan-prefetch", {"memplan.prefetch_factor": 0}, "memplan.prefetch_factor must be a positive int"),
    ("yaml-memplan-pin-memory", {"memplan.pin_memory": "no"}, "memplan.pin_memory must be true or false"),
    ("yaml-batch-spec-dtype", {"data": DELETE, "memplan.batch_spec": {"x": {"shape": [20], "dtype": "complex"}}},
     "memplan.batch_spec.x.dtype must be one of"),
    ("yaml-batch-spec-shape", {"data": DELETE, "memplan.batch_spec": {"x": {"shape": "20"}}},
     "memplan.batch_spec.x.shape must be a list"),
    ("yaml-batch-spec-int-high", {"data": DELETE, "memplan.batch_spec": {"x": {"shape": [20], "dtype": "int64"}}},
     "memplan.batch_spec.x.high is required"),
    ("yaml-no-batch", {"data": DELETE}, "no batch to plan with: the config has no data: section"),
    # absurd sizes in the YAML: refused by key path and range before any work
    ("yaml-memplan-gbs-10e30", {"memplan.global_batch_size": 10**30},
     "memplan.global_batch_size must be a positive int up to 16,777,216"),
    ("yaml-memplan-prefetch-10e9", {"memplan.prefetch_factor": 10**9}, "memplan.prefetch_factor must be a positive int "
                                                                       "up to 64"),
    ("yaml-data-workers-10e9", {"data.init_args.num_workers": 10**9},
     "data.init_args.num_workers must be a whole number from 0 to 256"),
    ("yaml-memplan-workers-huge", {"memplan.num_workers": 10**6}, "memplan.num_workers must be an int >= 0 and at most 256"),
    ("yaml-data-batch-10e30", {"data.init_args.batch_size": 10**30, "memplan.global_batch_size": DELETE},
     "data.init_args.batch_size must be a whole number from 1 to 16,777,216 (samples per batch); got a 31-digit number"),
    ("yaml-trainer-devices-huge", {"trainer.devices": 10**30}, "trainer.devices is per node and must be at most 64"),
    ("yaml-trainer-devices-huge-str", {"trainer.devices": "9" * 40}, "trainer.devices must be a positive number"),
    ("yaml-trainer-num-nodes-huge", {"trainer.num_nodes": 10**30}, "trainer.num_nodes must be a whole number from 1 "
                                                                   "to 32,768"),
    ("yaml-trainer-accumulate-huge", {"trainer.accumulate_grad_batches": 10**30},
     "trainer.accumulate_grad_batches must be a whole number from 1 to 16,777,216"),
    ("yaml-config-global-batch-huge", {"memplan.global_batch_size": DELETE, "data.init_args.batch_size": 1 << 20,
                                       "trainer.devices": 8, "trainer.accumulate_grad_batches": 1 << 10},
     "a global batch of 8,589,934,592 samples is more than the 16,777,216 memplan plans for"),
]


@pytest.mark.parametrize(("changes", "fragment"), [c[1:] for c in YAML_CASES], ids=[c[0] for c in YAML_CASES])
def test_bad_yaml_keys_are_refused_by_their_path(capsys, tmp_path, changes, fragment):
    config = write_config(tmp_path, config_with(changes))
    got, _, err = run(capsys, ["suggest", "--gpu", "A100-80GB", "--gpus", "4", config])
    assert_refused(got, err, 2, fragment)


@pytest.mark.parametrize(("text", "fragment"), [
    ("model: [1, 2\n", "YAML syntax error at line"),
    ("- a\n- b\n", "must hold a YAML mapping"),
    ("", "got an empty file"),
    ("model: \udcff\n", "is not UTF-8 text"),
], ids=["syntax", "a-list", "empty", "not-utf8"])
def test_bad_yaml_files_are_refused_with_the_file(capsys, tmp_path, text, fragment):
    path = tmp_path / "config.yaml"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    got, _, err = run(capsys, ["suggest", "--gpu", "A100-80GB", str(path)])
    assert_refused(got, err, 2, fragment)
    assert str(path) in err


def test_a_missing_config_is_named(capsys, tmp_path):
    got, _, err = run(capsys, ["suggest", "--gpu", "A100-80GB", str(tmp_path / "nope.yaml")])
    assert_refused(got, err, 2, f"config file {tmp_path / 'nope.yaml'} does not exist")


def test_debug_shows_the_traceback(tmp_path):
    config = write_config(tmp_path, config_with({"memplan.margin": 1.5}))
    with pytest.raises(ValueError, match="memplan.margin"):
        main(["suggest", "--gpu", "A100-80GB", config, "--debug"])
    with pytest.raises(ValueError, match="memplan.margin"):
        main(["--debug", "suggest", "--gpu", "A100-80GB", config])


@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "folder", "too-large"])
def test_configs_that_are_not_small_regular_files_are_refused_by_name(capsys, tmp_path, kind):
    """/dev/zero would be read until memory ran out, a FIFO would block for ever: each is refused, named."""
    import os

    from memplan.files import CONFIG_MAX_BYTES

    if kind == "dev-zero":
        path, fragment = Path("/dev/zero"), "config file /dev/zero is a character device, not a regular file"
    elif kind == "fifo":
        path, fragment = tmp_path / "pipe.yaml", "is a FIFO (named pipe), not a regular file"
        os.mkfifo(path)
    elif kind == "folder":
        path, fragment = tmp_path, "is a folder, not a regular file"
    else:
        path, fragment = tmp_path / "big.yaml", "is larger than 16.00 MiB"
        path.write_bytes(b"# " + b"x" * CONFIG_MAX_BYTES + b"\n")
    got, _, err = run(capsys, ["suggest", "--gpu", "A100-80GB", str(path)])
    assert_refused(got, err, 2, fragment)
    assert str(path) in err
