"""Fixtures for tests/hardware: install a simulated NVML, and never leak it into other tests.

`fake_nvml` (the simulation) is imported by module name: pytest's default "prepend" import mode puts
this folder on sys.path for its conftest and test files, so no __init__.py is needed here.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from fake_nvml import SimulatedNvml

from memplan.hardware import nvml


@pytest.fixture(autouse=True)
def _restore_real_nvml() -> Iterator[None]:
    yield
    nvml.set_backend(None)


@pytest.fixture
def nvml_sim() -> Callable[..., SimulatedNvml]:
    """nvml_sim(gpus, **options) installs SimulatedNvml(gpus, **options) as memplan's NVML."""

    def install(gpus, **options) -> SimulatedNvml:
        sim = SimulatedNvml(gpus, **options)
        nvml.set_backend(sim)
        return sim

    return install
