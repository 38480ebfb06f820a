"""Fixtures for tests/callback: a quiet CPU Trainer factory. `callback_sim` (models, data and the
SIMULATED device memory) is imported by module name, as tests/hardware imports fake_nvml."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import pytorch_lightning as pl
from subprocess_run import run_watched

DDP_DRIVER = Path(__file__).with_name("ddp_driver.py")
#: ddp_driver.py's scenarios that one 2-rank launch runs (the ddp_runs fixture), read by test_callback_ddp.py,
#: test_callback_final_backward.py (`final`) and test_callback_lightning_pytorch.py (`lightning`, where the lightning
#: package is installed): those that end by themselves with success, then `fatal`, which ends the job (last, so no
#: scenario is left unrun). `sigterm` is stopped by its test and `spawn` starts workers of its own: a launch each.
DDP_SHARED = ("adjust", "oom", "converge", "accumulate", "buckets", "buckets_plain", "mixed", "tokens", "tokens_plain",
              "final", *(("lightning",) if importlib.util.find_spec("lightning") else ()), "fatal")


@pytest.fixture(scope="session")
def ddp_runs(request, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The scenarios of DDP_SHARED that this session's tests read (each names its own with the ddp_scenarios mark:
    a test run alone launches only its scenario; xdist's workers collect every test, so there all of them), run
    once in one watched 2-rank launch (a hang fails every test reading it): (the folder holding one folder per
    scenario, the launch's result). tests/conftest.py keeps the three modules reading it on one xdist worker."""
    readers = [item for item in request.session.items if "ddp_runs" in getattr(item, "fixturenames", ())]
    unnamed = [item.nodeid for item in readers if item.get_closest_marker("ddp_scenarios") is None]
    assert not unnamed, f"tests reading ddp_runs without a ddp_scenarios mark: {unnamed}"
    wanted = {name for item in readers for mark in item.iter_markers("ddp_scenarios") for name in mark.args}
    assert wanted <= set(DDP_SHARED), f"ddp_scenarios names no shared scenario: {sorted(wanted - set(DDP_SHARED))}"
    root = tmp_path_factory.mktemp("ddp")
    scenarios = [s for s in DDP_SHARED if s in wanted]  # DDP_SHARED's order: `fatal` last
    return root, run_watched([sys.executable, str(DDP_DRIVER), str(root), *scenarios], cwd=root)


@pytest.fixture
def make_trainer(tmp_path) -> Callable[..., pl.Trainer]:
    """make_trainer(callbacks, **overrides): a single-process CPU Trainer writing under tmp_path."""

    def make(callbacks=(), **overrides) -> pl.Trainer:
        options = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                       enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                       max_steps=4, log_every_n_steps=1)
        options.update(overrides)
        return pl.Trainer(callbacks=list(callbacks), **options)

    return make


@pytest.fixture(autouse=True)
def _quiet_lightning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*smaller than the logging interval.*")
        warnings.filterwarnings("ignore", message=".*LeafSpec.*")
        warnings.filterwarnings("ignore", message=".*GPU available but not used.*")
        yield
