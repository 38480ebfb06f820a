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


class SimulatedAllocator:
    """SIMULATED torch.cuda caching-allocator counters (this torch has no CUDA): `reserved` now and
    torch's running `peak` of it, which only the user resets (`user_reset`)."""

    def __init__(self, reserved: int, peak: int, allocated: int) -> None:
        self.reserved, self.peak, self.allocated = reserved, peak, allocated

    def set(self, reserved: int, peak: int | None = None) -> None:
        self.reserved = reserved
        self.peak = max(self.peak, reserved) if peak is None else peak

    def user_reset(self) -> None:
        self.peak = self.reserved

    def memory_stats(self, device=None) -> dict[str, int]:
        return {"reserved_bytes.all.current": self.reserved, "reserved_bytes.all.peak": self.peak,
                "allocated_bytes.all.current": self.allocated}


@pytest.fixture
def simulated_gpus(monkeypatch):
    """Two simulated 80 GiB GPUs; this process holds 30 GiB on the second, another one 10 GiB there.
    torch's allocator (SIMULATED): 20 GiB allocated, 28 GiB reserved now, 34 GiB reserved at the peak."""
    mine = fake_nvml.SimProcess(pid=os.getpid(), used_bytes=30 * GiB)
    other = fake_nvml.SimProcess(pid=os.getpid() + 1, used_bytes=10 * GiB)
    gpus = [fake_nvml.SimGpu(), fake_nvml.SimGpu(driver_bytes=512 * MiB, processes=[mine, other])]
    nvml.set_backend(fake_nvml.SimulatedNvml(gpus))
    allocator = SimulatedAllocator(reserved=28 * GiB, peak=34 * GiB, allocated=20 * GiB)
    monkeypatch.setattr(torch.cuda, "memory_stats", allocator.memory_stats)

    def never(device=None):
        raise AssertionError("memplan reset the user's CUDA peak statistics")

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", never)
    monkeypatch.setattr(torch.cuda, "reset_max_memory_allocated", never)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # cuda:0 is the second GPU
    monkeypatch.setattr(readings, "_READERS", {})
    yield allocator
    nvml.set_backend(None)


def test_a_gpu_reading_is_this_process_on_its_own_gpu_with_the_peak_headroom(simulated_gpus):
    reading = readings.read_memory(torch.device("cuda", 0))
    used = 30 * GiB + 10 * GiB + 512 * MiB
    assert reading.process_bytes == 30 * GiB and reading.device_used_bytes == used
    assert reading.device_total_bytes == 80 * GiB
    assert (reading.allocated_bytes, reading.reserved_bytes, reading.peak_bytes) == (20 * GiB, 28 * GiB, 34 * GiB)
    # at this interval's peak the process held 6 GiB more than now
    assert reading.headroom_bytes == 80 * GiB - used - 6 * GiB
    assert reading.process_peak_bytes == 36 * GiB
    assert "device: 40.50 GiB of 80.00 GiB in use; this process: 30.00 GiB" in reading.describe()


def test_each_intervals_peak_without_resetting_the_users_statistics(simulated_gpus):
    gpu = torch.device("cuda", 0)
    assert readings.read_memory(gpu).peak_bytes == 34 * GiB  # the first interval: the run so far
    simulated_gpus.set(reserved=30 * GiB)  # steady: the allocator holds what it reached
    assert readings.read_memory(gpu).peak_bytes == 30 * GiB  # not the 34 GiB of the previous interval
    simulated_gpus.set(reserved=36 * GiB)
    simulated_gpus.set(reserved=31 * GiB)  # rose to 36 GiB, then released (empty_cache)
    assert readings.read_memory(gpu).peak_bytes == 36 * GiB
    assert simulated_gpus.peak == 36 * GiB  # torch's own running peak, as the user reads it, untouched
    simulated_gpus.user_reset()  # the user's own reset_peak_memory_stats(): their figure, their choice
    simulated_gpus.set(reserved=33 * GiB)
    assert readings.read_memory(gpu).peak_bytes == 33 * GiB
    between = readings.read_memory(gpu, new_interval=False)  # e.g. at an OOM: the interval goes on
    simulated_gpus.set(reserved=35 * GiB)
    assert between.peak_bytes == 33 * GiB and readings.read_memory(gpu).peak_bytes == 35 * GiB
