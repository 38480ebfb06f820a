"""Every bad input the command line has been seen to get wrong, and more of the same kinds: each is refused
before anything is traced, with exit code 2 (1 where noted), at most two lines on stderr, no traceback,
and a message that names the input as the user wrote it (the flag, the YAML key path, the plan field).

A row fails if its message stops naming the field: the fragment is the field's name plus what was wrong.
"""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import yaml

import memplan.config.load
import memplan.estimator
from memplan.commands.cli import main

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "hardware"))
from fake_nvml import SimGpu, SimulatedNvml  # noqa: E402  (the simulated NVML of tests/hardware)

from memplan.hardware import nvml  # noqa: E402

BASE = {
    "trainer": {"devices": 1, "precision": "32-true", "max_steps": 2},
    "model": {"class_path": "memplan.demos.MLP",
              "init_args": {"in_features": 20, "hidden": 8, "depth": 2, "num_classes": 3}},
    "data": {"class_path": "memplan.demos.RandomVectors",
             "init_args": {"batch_size": 4, "in_features": 20, "num_classes": 3, "num_samples": 64}},
    "memplan": {"global_batch_size": 64, "precisions": ["32-true", "16-mixed", "bf16-mixed"], "margin": 0.1},
}
DELETE = object()
GPU = ["--gpu", "A100-80GB"]


def config_with(changes: dict) -> dict:
    """BASE with dotted keys set (or deleted with DELETE)."""
    config = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = config
        for part in parents:
            node = node.setdefault(part, {})
        if value is DELETE:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return config


# (id, argv with CONFIG standing for the config path, YAML changes, exit code, fragment naming the input)
FLAG_CASES = [
    # suggest: GPUs
    ("gpus-0", ["suggest", *GPU, "--gpus", "0", "CONFIG"], {}, 2, "argument --gpus: must be a positive"),
    ("gpus-negative", ["suggest", *GPU, "--gpus", "-3", "CONFIG"], {}, 2, "argument --gpus: must be a positive"),
    ("gpus-word", ["suggest", *GPU, "--gpus", "two", "CONFIG"], {}, 2, "argument --gpus: must be a whole number"),
    ("gpus-fraction", ["suggest", *GPU, "--gpus", "2.5", "CONFIG"], {}, 2, "argument --gpus: must be a whole number"),
    ("gpus-over-global-batch", ["suggest", *GPU, "--gpus", "64", "--global-batch-size", "32", "CONFIG"], {}, 2,
     "--gpus 64 x --nodes 1 = 64 ranks, more than the global batch of 32"),
    ("gpus-over-global-batch-nodes", ["suggest", *GPU, "--gpus", "8", "--nodes", "16", "CONFIG"], {}, 2,
     "--gpus 8 x --nodes 16 = 128 ranks, more than the global batch of 64"),
    ("gpu-unknown", ["suggest", "--gpu", "GTX-9999", "CONFIG"], {}, 2, "argument --gpu: 'GTX-9999' is not a GPU"),
    ("gpu-ambiguous", ["suggest", "--gpu", "A100", "CONFIG"], {}, 2, "argument --gpu: 'A100' is ambiguous"),
    ("gpu-and-gpu-memory", ["suggest", *GPU, "--gpu-memory", "24GiB", "CONFIG"], {}, 2, "--gpu and --gpu-memory"),
    ("gpu-memory-no-unit", ["suggest", "--gpu-memory", "24", "CONFIG"], {}, 2, "argument --gpu-memory: 24 what?"),
    ("gpu-memory-zero", ["suggest", "--gpu-memory", "0GiB", "CONFIG"], {}, 2,
     "argument --gpu-memory: must be a positive size"),
    ("gpu-memory-negative", ["suggest", "--gpu-memory=-5GiB", "CONFIG"], {}, 2,
     "argument --gpu-memory: must be a positive size"),
    ("gpu-memory-bad-unit", ["suggest", "--gpu-memory", "24XB", "CONFIG"], {}, 2,
     "argument --gpu-memory: must be a size with a unit"),
    ("gpu-memory-word", ["suggest", "--gpu-memory", "lots", "CONFIG"], {}, 2,
     "argument --gpu-memory: must be a size with a unit"),
    ("gpu-memory-too-small", ["suggest", "--gpu-memory", "24MB", "CONFIG"], {}, 2,
     "--gpu-memory 22.89 MiB is outside what a GPU has"),
    ("gpu-memory-too-large", ["suggest", "--gpu-memory", "24TiB", "CONFIG"], {}, 2,
     "--gpu-memory 24.00 TiB is outside what a GPU has"),
    ("no-gpu-here", ["suggest", "CONFIG"], {}, 2, "pass --gpu H100-80GB"),
    # absurd sizes: refused by range at parse time, never looped over or overflowed
    ("gpus-20-digits", ["suggest", *GPU, "--gpus", "99999999999999999999", "CONFIG"], {}, 2,
     "argument --gpus: must be from 1 to 64 (GPUs per node); for more GPUs, add nodes with --nodes"),
    ("gpus-more-than-a-node", ["suggest", *GPU, "--gpus", "1000", "CONFIG"], {}, 2, "argument --gpus: must be from 1 to 64"),
    ("gpus-5000-digits", ["suggest", *GPU, "--gpus", "9" * 5000, "CONFIG"], {}, 2,
     "argument --gpus: must be a whole number (GPUs per node); got 5000 characters"),
    ("global-batch-10e30", ["suggest", *GPU, "--global-batch-size", "1" + "0" * 30, "CONFIG"], {}, 2,
     "argument --global-batch-size: must be from 1 to 16,777,216"),
    ("nodes-huge", ["suggest", *GPU, "--nodes", "10000000", "CONFIG"], {}, 2, "argument --nodes: must be from 1 to 32,768"),
    ("gpu-memory-negative-spaced", ["suggest", "--gpu-memory", "-5GiB", "CONFIG"], {}, 2,
     "argument --gpu-memory: must be a positive size"),
    ("gpus-negative-spaced", ["suggest", *GPU, "--gpus", "-1", "CONFIG"], {}, 2, "argument --gpus: must be a positive"),
    ("estimate-batch-10e30", ["estimate", "CONFIG", "--batch-size", "1" + "0" * 30], {}, 2,
     "argument --batch-size: must be from 1 to 16,777,216"),
    ("estimate-ddp-huge", ["estimate", "CONFIG", "--batch-size", "4", "--ddp", "10000000"], {}, 2,
     "argument --ddp: must be from 1 to 262,144"),
    ("validate-steps-huge", ["validate", "CONFIG", "--steps", "1000000000"], {}, 2,
     "argument --steps: must be from 1 to 1,000 (real training steps)"),
    ("validate-steps-0", ["validate", "CONFIG", "--steps", "0"], {}, 2, "argument --steps: must be a positive"),
    ("watch-interval-inf", ["watch", "CONFIG", "--interval", "inf"], {}, 2,
     "argument --interval: must be a number of seconds from 0.01 to 3600"),
    ("watch-interval-nan", ["watch", "CONFIG", "--interval", "nan"], {}, 2, "argument --interval: must be a number"),
    ("watch-interval-negative", ["watch", "CONFIG", "--interval", "-1"], {}, 2, "argument --interval: must be a number"),
    ("watch-interval-word", ["watch", "CONFIG", "--interval", "soon"], {}, 2, "argument --interval: must be a number"),
    ("report-version-negative", ["report", "CONFIG", "--version", "-1"], {}, 2, "argument --version: must be from 0"),
    ("report-version-huge", ["report", "CONFIG", "--version", "1" + "0" * 30], {}, 2, "argument --version: must be from 0"),
    # suggest: batch, nodes, margin, precision
    ("nodes-0", ["suggest", *GPU, "--nodes", "0", "CONFIG"], {}, 2, "argument --nodes: must be a positive"),
    ("nodes-word", ["suggest", *GPU, "--nodes", "x", "CONFIG"], {}, 2, "argument --nodes: must be a whole number"),
    ("global-batch-0", ["suggest", *GPU, "--global-batch-size", "0", "CONFIG"], {}, 2,
     "argument --global-batch-size: must be a positive"),
    ("global-batch-negative", ["suggest", *GPU, "--global-batch-size", "-5", "CONFIG"], {}, 2,
     "argument --global-batch-size: must be a positive"),
    ("global-batch-float", ["suggest", *GPU, "--global-batch-size", "1e3", "CONFIG"], {}, 2,
     "argument --global-batch-size: must be a whole number"),
    ("global-batch-over-nodes", ["suggest", *GPU, "--global-batch-size", "7", "--nodes", "2", "CONFIG"], {}, 2,
     "--global-batch-size (7) must be divisible by --nodes 2"),
    ("margin-over-1", ["suggest", *GPU, "--margin", "1.5", "CONFIG"], {}, 2, "argument --margin: must be a fraction"),
    ("margin-1", ["suggest", *GPU, "--margin", "1", "CONFIG"], {}, 2, "argument --margin: must be a fraction"),
    ("margin-percent", ["suggest", *GPU, "--margin", "10", "CONFIG"], {}, 2, "write 0.1"),
    ("margin-negative", ["suggest", *GPU, "--margin", "-0.1", "CONFIG"], {}, 2, "argument --margin: must be a fraction"),
    ("margin-nan", ["suggest", *GPU, "--margin", "nan", "CONFIG"], {}, 2, "argument --margin: must be a fraction"),
    ("margin-word", ["suggest", *GPU, "--margin", "some", "CONFIG"], {}, 2, "argument --margin: must be a fraction"),
    ("precision-64", ["suggest", *GPU, "--precision", "64", "CONFIG"], {}, 2,
     "argument --precision: '64': Lightning runs it, but memplan does not estimate it"),
    ("precision-typo", ["suggest", *GPU, "--precision", "bf16-mixd", "CONFIG"], {}, 2,
     "argument --precision: must be a Lightning precision"),
    ("precision-fp16", ["suggest", *GPU, "--precision", "fp16", "CONFIG"], {}, 2,
     "argument --precision: must be a Lightning precision"),
    ("precision-not-searched", ["suggest", *GPU, "--precision", "16-true", "CONFIG"], {}, 2,
     "--precision: the planner searches"),
    ("precision-bf16-on-v100", ["suggest", "--gpu", "V100-32GB", "--precision", "bf16", "CONFIG"], {}, 2,
     "--precision: bf16-mixed needs compute capability 8.0+"),
    ("unknown-flag", ["suggest", *GPU, "--gpus-per-node", "2", "CONFIG"], {}, 2, "unrecognized arguments: --gpus-per-node"),
    # estimate
    ("estimate-batch-0", ["estimate", "CONFIG", "--batch-size", "0"], {}, 2, "argument --batch-size: must be a positive"),
    ("estimate-batch-word", ["estimate", "CONFIG", "--batch-size", "x"], {}, 2,
     "argument --batch-size: must be a whole number"),
    ("estimate-batch-missing", ["estimate", "CONFIG"], {}, 2, "the following arguments are required: --batch-size"),
    ("estimate-ddp-0", ["estimate", "CONFIG", "--batch-size", "4", "--ddp", "0"], {}, 2,
     "argument --ddp: must be a positive"),
    ("estimate-ddp-negative", ["estimate", "CONFIG", "--batch-size", "4", "--ddp", "-2"], {}, 2,
     "argument --ddp: must be a positive"),
    ("estimate-precision-64", ["estimate", "CONFIG", "--batch-size", "4", "--precision", "64-true"], {}, 2,
     "argument --precision: '64-true': Lightning runs it"),
    ("estimate-device-unknown", ["estimate", "CONFIG", "--batch-size", "4", "--device", "cuda2"], {}, 2,
     "argument --device: must be 'cpu', 'cuda'"),
    ("estimate-device-no-unit", ["estimate", "CONFIG", "--batch-size", "4", "--device", "24"], {}, 2,
     "argument --device: must be 'cpu', 'cuda'"),
    ("estimate-optimizer", ["estimate", "CONFIG", "--batch-size", "4", "--optimizer", "adamm"], {}, 2,
     "argument --optimizer: must be one of"),
    ("estimate-demo", ["estimate", "--demo", "gpt3", "--batch-size", "4"], {}, 2, "argument --demo: must be one of"),
    ("estimate-batch-huge", ["estimate", "CONFIG", "--batch-size", "100000000000"], {}, 2,
     "argument --batch-size: must be from 1 to 16,777,216 (samples per device); got '100000000000'"),
    ("estimate-demo-batch-huge", ["estimate", "--demo", "gpt2-small", "--batch-size", "16777216"], {}, 2,
     "--batch-size 16777216: the batch alone is"),
    ("estimate-neither", ["estimate", "--batch-size", "4"], {}, 2, "pass a config file or --demo NAME"),
    ("estimate-both", ["estimate", "CONFIG", "--demo", "mlp", "--batch-size", "4"], {}, 2,
     "pass a config file or --demo NAME"),
    ("no-command", [], {}, 2, "the following arguments are required: command"),
    ("unknown-command", ["plan", "CONFIG"], {}, 2, "argument command: invalid choice: 'plan'"),
]

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

PLAN = {
    "format": 1, "gpu_name": "A100-80GB", "gpus": [], "nodes": 1, "world_size": 2, "micro_batch_size": 8,
    "accumulate_grad_batches": 4, "global_batch_size": 64, "precision": "bf16-mixed", "gradient_checkpointing": False,
    "strategy": "ddp", "predicted_peak_bytes": 1 << 30, "device_budget_bytes": 70 << 30,
    "host_bytes_per_rank": 3 << 30,
}

ALTERNATIVE = {"world_size": 1, "micro_batch_size": 8, "accumulate_grad_batches": 8, "precision": "bf16-mixed",
               "gradient_checkpointing": False, "predicted_peak_bytes": 1 << 30, "relative_speed": 0.5, "fits": True}

PLAN_CASES = [
    ("plan-micro-batch-bool", {"micro_batch_size": True}, "Plan.micro_batch_size must be a positive int; got True"),
    ("plan-micro-batch-0", {"micro_batch_size": 0}, "Plan.micro_batch_size must be a positive int"),
    ("plan-micro-batch-str", {"micro_batch_size": "8"}, "Plan.micro_batch_size must be a positive int"),
    ("plan-micro-batch-float", {"micro_batch_size": 8.0}, "Plan.micro_batch_size must be a positive int"),
    ("plan-nodes-0", {"nodes": 0}, "Plan.nodes must be a positive int"),
    ("plan-accumulate-bool", {"accumulate_grad_batches": False}, "Plan.accumulate_grad_batches must be a positive"),
    ("plan-global-batch-product", {"global_batch_size": 63}, "Plan.global_batch_size must equal"),
    ("plan-world-nodes", {"nodes": 3, "world_size": 2, "accumulate_grad_batches": 4}, "Plan.world_size (2) must be a "
                                                                                       "multiple of nodes (3)"),
    ("plan-precision", {"precision": "fp16"}, "Plan.precision must be a Lightning precision"),
    ("plan-precision-64", {"precision": "64-true"}, "Plan.precision '64-true': Lightning runs it"),
    ("plan-checkpointing", {"gradient_checkpointing": "yes"}, "Plan.gradient_checkpointing must be true or false"),
    ("plan-strategy", {"strategy": "horovod"}, "Plan.strategy must be one of"),
    ("plan-gpus-str", {"gpus": "0,1"}, "Plan.gpus must be a list"),
    ("plan-gpus-negative", {"gpus": [0, -1]}, "Plan.gpus must be a list of CUDA indices"),
    ("plan-peak-negative", {"predicted_peak_bytes": -1}, "Plan.predicted_peak_bytes must be an int >= 0"),
    ("plan-gpu-name", {"gpu_name": ""}, "Plan.gpu_name must be a non-empty string"),
    ("plan-gpu-total", {"gpu_total_bytes": "80GB"}, "Plan.gpu_total_bytes must be a positive int"),
    ("plan-fingerprint", {"model_fingerprint": 12}, "Plan.model_fingerprint must be a string"),
    ("plan-missing", {"micro_batch_size": DELETE}, "plan file lacks micro_batch_size"),
    ("plan-unknown", {"micro_batch": 8}, "plan file has unknown keys ['micro_batch']"),
    ("plan-format", {"format": 2}, "plan file format 2 is not supported"),
    ("plan-alternatives", {"alternatives": [{"world_size": 1}]}, "Plan.alternatives[0] lacks micro_batch_size"),
    ("plan-alternatives-unknown", {"alternatives": [{**ALTERNATIVE, "speed": 1}]},
     "Plan.alternatives[0] has unknown keys ['speed']"),
    ("plan-alternatives-not-object", {"alternatives": [ALTERNATIVE, 3]}, "Plan.alternatives[1] must be an object"),
    ("plan-alternatives-bad-field", {"alternatives": [{**ALTERNATIVE, "fits": "yes"}]},
     "Plan.alternatives[0].fits must be true or false"),
    ("plan-alternatives-precision", {"alternatives": [{**ALTERNATIVE, "precision": "fp8"}]},
     "Plan.alternatives[0].precision must be a Lightning precision"),
    ("plan-micro-batch-10e30", {"micro_batch_size": 10**30, "global_batch_size": 8 * 10**30},
     "Plan.micro_batch_size must be a whole number from 1 to 16,777,216; got a 31-digit number"),
    ("plan-world-huge", {"world_size": 10**7, "accumulate_grad_batches": 1, "micro_batch_size": 1,
                         "global_batch_size": 10**7}, "Plan.world_size must be a whole number from 1 to 262,144"),
    ("plan-gpus-per-node-huge", {"world_size": 128, "accumulate_grad_batches": 1, "micro_batch_size": 1,
                                 "global_batch_size": 128}, "Plan.world_size / Plan.nodes must be a whole number from 1 to 64"),
    ("plan-gpus-twice", {"gpus": [0, 0]}, "Plan.gpus names a GPU twice"),
    ("plan-peak-huge", {"predicted_peak_bytes": 10**30}, "Plan.predicted_peak_bytes must be a whole number from 0"),
    ("plan-speed", {"relative_speed": "fast"}, "Plan.relative_speed must be a positive number"),
    ("plan-format-string", {"format": "1"}, "plan file format must be the number 1 (written unquoted"),
]


@pytest.fixture(autouse=True)
def no_gpu_and_no_trace(monkeypatch):
    """No GPU visible (a simulated NVML with none), and a trace fails the test: every case here must be
    refused before anything is traced."""
    nvml.set_backend(SimulatedNvml([]))

    def traced(*args, **kwargs):
        raise AssertionError("traced before refusing a bad input")

    monkeypatch.setattr(memplan.estimator, "estimate", traced)
    monkeypatch.setattr(memplan.config.load, "estimate", traced)
    yield
    nvml.set_backend(None)


def run(capsys, argv):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_refused(code, err, expected_code, fragment):
    assert code == expected_code, err
    assert fragment in err, err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) <= 2, err


def write_config(tmp_path: Path, config: dict) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return str(path)


@pytest.mark.parametrize(("argv", "changes", "code", "fragment"), [c[1:] for c in FLAG_CASES],
                         ids=[c[0] for c in FLAG_CASES])
def test_bad_flags_are_refused_by_name(capsys, tmp_path, argv, changes, code, fragment):
    config = write_config(tmp_path, config_with(changes))
    got, _, err = run(capsys, [config if a == "CONFIG" else a for a in argv])
    assert_refused(got, err, code, fragment)


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


def test_more_gpus_than_nvml_sees_names_both_numbers(capsys, tmp_path):
    nvml.set_backend(SimulatedNvml([SimGpu(), SimGpu()]))
    got, _, err = run(capsys, ["suggest", "--gpus", "8", write_config(tmp_path, BASE)])
    assert_refused(got, err, 2, "--gpus 8: this node has 2 GPU(s) visible to NVML")


@pytest.mark.parametrize("existing", [["planned.yaml"], ["planned.plan.json"], ["planned.yaml", "planned.plan.json"]])
def test_output_never_replaces_files_without_force(capsys, tmp_path, existing):
    for name in existing:
        (tmp_path / name).write_text("the user's\n")
    got, _, err = run(capsys, ["suggest", "--gpu", "A100-80GB", write_config(tmp_path, BASE),
                               "--output", str(tmp_path / "planned.yaml")])
    assert_refused(got, err, 2, "pass --force")
    for name in existing:
        assert str(tmp_path / name) in err
        assert (tmp_path / name).read_text() == "the user's\n"


@pytest.mark.parametrize(("output", "fragment"), [
    ("config.yaml", "is the source config"),
    (".", "is a folder"),
    ("afile/planned.yaml", "is a file, not a folder"),
    ("x.plan.json", "names a plan file; --output names the planned config (YAML), and the plan goes beside it: "
                    "pass --output x.yaml"),
], ids=["source", "folder", "under-a-file", "a-plan-file-name"])
def test_bad_output_paths_are_refused_before_planning(capsys, tmp_path, monkeypatch, output, fragment):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    config = write_config(tmp_path, BASE)
    got, _, err = run(capsys, ["suggest", "--gpu", "A100-80GB", config, "--output", output])
    assert_refused(got, err, 2, f"--output {output}")
    assert fragment in err


@pytest.mark.parametrize(("changes", "fragment"), [c[1:] for c in PLAN_CASES], ids=[c[0] for c in PLAN_CASES])
def test_bad_plan_files_are_refused_by_field(tmp_path, changes, fragment):
    from pytorch_lightning.utilities.exceptions import MisconfigurationException

    from memplan.callback.apply import load_plan

    plan = {k: v for k, v in {**PLAN, **changes}.items() if v is not DELETE}
    path = tmp_path / "bad.plan.json"
    path.write_text(json.dumps(plan))
    with pytest.raises(MisconfigurationException) as info:
        load_plan(path)
    assert f"MemoryPlanner(plan={str(path)!r})" in str(info.value)
    assert fragment in str(info.value)


@pytest.mark.parametrize(("text", "fragment"), [
    ("[1, 2]", "a plan file holds one JSON object"),
    ("{not json", "is not JSON"),
], ids=["a-list", "not-json"])
def test_plan_files_that_are_not_a_plan_are_refused(tmp_path, text, fragment):
    from pytorch_lightning.utilities.exceptions import MisconfigurationException

    from memplan.callback.apply import load_plan

    path = tmp_path / "bad.plan.json"
    path.write_text(text)
    with pytest.raises(MisconfigurationException, match="MemoryPlanner") as info:
        load_plan(path)
    assert fragment in str(info.value)


def test_debug_shows_the_traceback(tmp_path):
    config = write_config(tmp_path, config_with({"memplan.margin": 1.5}))
    with pytest.raises(ValueError, match="memplan.margin"):
        main(["suggest", "--gpu", "A100-80GB", config, "--debug"])
    with pytest.raises(ValueError, match="memplan.margin"):
        main(["--debug", "suggest", "--gpu", "A100-80GB", config])


def test_the_table_is_broad():
    """The issue asks for every bad input it lists and more of the kinds: keep the table wide."""
    assert len(FLAG_CASES) + len(YAML_CASES) + len(PLAN_CASES) >= 100


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


@pytest.mark.parametrize("kind", ["dev-zero", "fifo"])
def test_validate_plan_that_is_not_a_regular_file_is_refused(capsys, tmp_path, kind):
    import os

    path = Path("/dev/zero") if kind == "dev-zero" else tmp_path / "x.plan.json"
    if kind == "fifo":
        os.mkfifo(path)
    got, _, err = run(capsys, ["validate", write_config(tmp_path, BASE), "--plan", str(path)])
    assert_refused(got, err, 2, f"--plan {path} is a")


def test_the_planner_refuses_an_absurd_batch_instead_of_dividing_it():
    """Trial division of 10^30 would run for minutes: the range check answers at once."""
    from memplan.planner.candidates import divisors

    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    assert divisors(1 << 24)[-1] == 1 << 24
    with pytest.raises(ValueError, match="the per-rank batch must be a whole number from 1 to 16,777,216"):
        divisors(10**30)
