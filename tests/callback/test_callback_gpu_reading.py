"""The GPU reading on a SIMULATED GPU: tests/hardware's simulated NVML, and torch's caching-allocator
counters replaced by given figures (this torch has no CUDA). Checks which GPU is read (CUDA_VISIBLE_DEVICES
honoured), this process's share, and the headroom at the interval's peak."""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

from memplan.hardware import readings
from memplan.hardware import nvml
from memplan.units import GiB, MiB

def _fake_nvml():
    """tests/hardware/fake_nvml.py, the one module tests/hardware's own tests import by that name."""
    if "fake_nvml" in sys.modules:
        return sys.modules["fake_nvml"]
    spec = importlib.util.spec_from_file_location("fake_nvml", Path(__file__).parents[1] / "hardware" / "fake_nvml.py")
    module = sys.modules["fake_nvml"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fake_nvml = _fake_nvml()


@pytest.fixture
def simulated_gpus(monkeypatch):
    """Two simulated 80 GiB GPUs; this process holds 30 GiB on the second, another one 10 GiB there.
    torch's allocator (SIMULATED): 20 GiB allocated, 28 GiB reserved now, 34 GiB reserved at the peak."""
    mine = fake_nvml.SimProcess(pid=os.getpid(), used_bytes=30 * GiB)
    other = fake_nvml.SimProcess(pid=os.getpid() + 1, used_bytes=10 * GiB)
    gpus = [fake_nvml.SimGpu(), fake_nvml.SimGpu(driver_bytes=512 * MiB, processes=[mine, other])]
    nvml.set_backend(fake_nvml.SimulatedNvml(gpus))
    resets = []
    for name, value in (("memory_reserved", 28 * GiB), ("max_memory_reserved", 34 * GiB),
                        ("memory_allocated", 20 * GiB)):
        monkeypatch.setattr(torch.cuda, name, lambda device=None, value=value: value)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: resets.append(device))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # cuda:0 is the second GPU
    monkeypatch.setattr(readings, "_READERS", {})
    yield resets
    nvml.set_backend(None)


def test_a_gpu_reading_is_this_process_on_its_own_gpu_with_the_peak_headroom(simulated_gpus):
    reading = readings.read_memory(torch.device("cuda", 0))
    used = 30 * GiB + 10 * GiB + 512 * MiB
    assert reading.process_bytes == 30 * GiB and reading.device_used_bytes == used
    assert reading.device_total_bytes == 80 * GiB
    assert (reading.allocated_bytes, reading.reserved_bytes, reading.peak_bytes) == (20 * GiB, 28 * GiB, 34 * GiB)
    # at this interval's peak the process held 6 GiB more than now
    assert reading.headroom_bytes == 80 * GiB - used - 6 * GiB
    assert simulated_gpus == [torch.device("cuda", 0)]  # the next interval's peak starts now
    readings.read_memory(torch.device("cuda", 0), reset_peak=False)
    assert len(simulated_gpus) == 1
    assert "device: 40.50 GiB of 80.00 GiB in use; this process: 30.00 GiB" in reading.describe()
