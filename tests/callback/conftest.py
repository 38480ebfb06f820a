"""Fixtures for tests/callback: a quiet CPU Trainer factory. `callback_sim` (models, data and the
SIMULATED device memory) is imported by module name, as tests/hardware imports fake_nvml."""
from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import pytorch_lightning as pl


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
