"""Helpers for the bad-input tables (test_bad_flags.py, test_bad_yaml.py, test_bad_plan_files.py) and
test_review_inputs.py: a small valid config (BASE) and its changed copies, a fixture that lets no GPU be seen and
fails any trace, and the check that a command refused an input as the house asks (the exit code, at most two
lines on stderr naming the input, no traceback). A test module imports `no_gpu_and_no_trace` (autouse) to use it."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import yaml

import memplan.config.load
import memplan.estimator
from memplan.commands.cli import main

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "hardware"))
from fake_nvml import SimGpu, SimulatedNvml  # noqa: E402, F401  (the simulated NVML of tests/hardware)

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
