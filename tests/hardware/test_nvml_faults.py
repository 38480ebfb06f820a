"""NVML going wrong, on a SIMULATED NVML (fake_nvml.py): a binding that raises something other than
NVMLError, GPUs that do not answer, NVML's 0-byte boards, CUDA_VISIBLE_DEVICES that hides GPUs, and
readings where NVML and CUDA both fail. Each is a missing reading or a message naming the input."""
from __future__ import annotations

import logging

import pynvml
import pytest
import torch
from fake_nvml import SimGpu, SimProcess

from memplan.commands.cli import main
from memplan.hardware import readings
from memplan.hardware.nvml import GpuInfo, answers, list_gpus, nvml_query, nvml_unavailable_reason, why_silent
from memplan.hardware.visible import visibility_problem, visible_gpus
from memplan.units import GiB

CONFIG = "configs/mlp.yaml"


def test_a_plain_runtimeerror_from_the_binding_is_a_missing_reading_logged_once(nvml_sim, caplog):
    gpus = [SimGpu(), SimGpu()]
    gpus[1].raising = {"nvmlDeviceGetMemoryInfo": RuntimeError("binding bug")}
    nvml_sim(gpus, raising={"nvmlSystemGetProcessName": OSError(5, "ctypes failure")})
    with caplog.at_level(logging.WARNING, logger="memplan.hardware.nvml"):
        first, second = list_gpus(), list_gpus()
    assert first[0].total_bytes == 80 * GiB and first[1].total_bytes is None and second[1].free_bytes is None
    said = [r.getMessage() for r in caplog.records]
    assert sum("nvmlDeviceGetMemoryInfo raised RuntimeError: binding bug" in m for m in said) == 1
    assert nvml_query("nvmlDeviceGetMemoryInfo", gpus[1], default="missing") == "missing"


def test_nvmlinit_raising_a_plain_error_makes_nvml_unavailable_with_the_reason(nvml_sim):
    nvml_sim([SimGpu()], raising={"nvmlInit": RuntimeError("driver timed out")})
    assert list_gpus() == ()
    assert nvml_unavailable_reason() == "nvmlInit raised RuntimeError: driver timed out"


def test_a_gpu_nvml_cannot_open_keeps_its_place_for_cuda_ordinals(nvml_sim):
    sim = nvml_sim([SimGpu(), SimGpu(), SimGpu()])
    real = sim.nvmlDeviceGetHandleByIndex

    def lost_middle(index):
        if index == 1:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return real(index)

    sim.nvmlDeviceGetHandleByIndex = lost_middle
    assert [g.index for g in visible_gpus({"CUDA_VISIBLE_DEVICES": "2"})] == [2]  # not shifted onto another GPU
    lost = visible_gpus({"CUDA_VISIBLE_DEVICES": "1"})[0]
    assert not answers(lost) and why_silent(lost) == "NVML cannot open it (nvmlDeviceGetHandleByIndex failed)"


def test_why_a_gpu_is_silent_does_not_depend_on_its_name():
    # a board whose real name happens to read like the place-holder's is still one NVML opened
    odd = GpuInfo(index=0, uuid="GPU-1", name="unknown (NVML cannot open it)", total_bytes=0, used_bytes=0,
                  free_bytes=0, compute_capability=(9, 0), mig_mode=False)
    assert why_silent(odd) == "NVML reports 0 bytes of memory on it"


@pytest.mark.parametrize(("value", "fragment"), [
    ("garbage", "CUDA_VISIBLE_DEVICES='garbage': 'garbage' is not a GPU index or UUID"),
    ("0,0", "CUDA_VISIBLE_DEVICES='0,0' names '0' twice; CUDA then sees no GPU at all"),
    ("7", "CUDA_VISIBLE_DEVICES='7': GPU 7 does not exist here (NVML lists 2 GPU(s), 0-1)"),
    ("", "CUDA_VISIBLE_DEVICES='' is empty, which hides every GPU"),
    ("GPU-ffff", "CUDA_VISIBLE_DEVICES='GPU-ffff': 'GPU-ffff' matches no GPU here"),
])
def test_suggest_names_cuda_visible_devices_and_its_value(nvml_sim, capsys, monkeypatch, value, fragment):
    nvml_sim([SimGpu(), SimGpu()])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    assert main(["suggest", CONFIG]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err
    assert "pass --gpu H100-80GB" in err


def test_a_partly_valid_cuda_visible_devices_is_explained(nvml_sim):
    nvml_sim([SimGpu(), SimGpu()])
    assert "only the 1 GPU(s) before it are visible" in visibility_problem({"CUDA_VISIBLE_DEVICES": "1,x"})
    assert visibility_problem({"CUDA_VISIBLE_DEVICES": "1,0"}) is None
    assert visibility_problem({}) is None


def test_nvml_timeout_on_every_gpu_is_named_not_no_gpu_visible(nvml_sim, capsys):
    nvml_sim([SimGpu(), SimGpu()], failing={"nvmlDeviceGetMemoryInfo": pynvml.NVML_ERROR_TIMEOUT})
    assert main(["suggest", CONFIG]) == 2
    err = capsys.readouterr().err
    assert "no visible GPU answers NVML: cuda:0 (NVML index 0, NVIDIA A100-SXM4-80GB): NVML cannot read its " \
           "memory (nvmlDeviceGetMemoryInfo failed)" in err
    assert "no GPU is visible here" not in err


def test_nvml_reporting_zero_bytes_names_the_gpu_not_an_internal_field(nvml_sim, capsys):
    nvml_sim([SimGpu(total_bytes=0)])
    assert main(["suggest", CONFIG]) == 2
    err = capsys.readouterr().err
    assert "cuda:0 (NVML index 0, NVIDIA A100-SXM4-80GB): NVML reports 0 bytes of memory on it" in err
    assert "DeviceBudget" not in err and "Traceback" not in err


def test_one_lost_gpu_does_not_block_planning_on_the_others(nvml_sim, capsys):
    gpus = [SimGpu(), SimGpu(), SimGpu()]
    gpus[1].failing = {"nvmlDeviceGetMemoryInfo": pynvml.NVML_ERROR_GPU_IS_LOST}
    nvml_sim(gpus)
    assert main(["suggest", CONFIG, "--gpus", "1", "--json"]) == 0
    captured = capsys.readouterr()
    assert "left out of the plan: cuda:1 (NVML index 1, NVIDIA A100-SXM4-80GB): NVML cannot read its memory" in \
        captured.err and "planning on the 2 GPU(s) that answer" in captured.err
    assert '"gpus": [\n    0\n  ]' in captured.out or '"gpus": [\n    2\n  ]' in captured.out
    assert main(["suggest", CONFIG, "--gpus", "3"]) == 2
    err = capsys.readouterr().err
    assert "--gpus 3: this node has 2 GPU(s) visible to NVML, and 1 more that do not answer (cuda:1" in err


def test_a_reading_where_nvml_and_cuda_both_fail_is_missing_not_an_exception(nvml_sim, monkeypatch, caplog):
    nvml_sim([SimGpu(processes=[SimProcess(pid=1, used_bytes=GiB)])],
             raising={"nvmlDeviceGetMemoryInfo": RuntimeError("NVML lost")})
    monkeypatch.setattr(readings, "_READERS", {})
    monkeypatch.setattr(readings, "_said", set())
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {"reserved_bytes.all.current": 2 * GiB,
                                                                         "reserved_bytes.all.peak": 3 * GiB})

    def lost(device=None):
        raise RuntimeError("CUDA error: unspecified launch failure")

    monkeypatch.setattr(torch.cuda, "mem_get_info", lost)
    with caplog.at_level(logging.WARNING):
        first = readings.read_memory(torch.device("cuda", 0))
        second = readings.read_memory(torch.device("cuda", 0))
    assert (first.device_total_bytes, first.device_used_bytes, first.headroom_bytes) == (None, None, None)
    assert first.peak_bytes == 3 * GiB and second.reserved_bytes == 2 * GiB  # torch's own counters still read
    said = [r.getMessage() for r in caplog.records if r.name == "memplan.hardware.readings"]
    assert len(said) == 2 and "mem_get_info from now on" in said[0] and "failed too" in said[1]


def test_nvml_lost_mid_run_falls_back_to_cuda_and_says_so_once(nvml_sim, monkeypatch, caplog):
    sim = nvml_sim([SimGpu()])
    monkeypatch.setattr(readings, "_READERS", {})
    monkeypatch.setattr(readings, "_said", set())
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {})
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * GiB, 80 * GiB))
    assert readings.read_memory(torch.device("cuda", 0)).device_total_bytes == 80 * GiB
    sim.raising["nvmlDeviceGetMemoryInfo"] = RuntimeError("NVML lost")
    with caplog.at_level(logging.WARNING, logger="memplan.hardware.readings"):
        for _ in range(3):
            reading = readings.read_memory(torch.device("cuda", 0))
    assert (reading.device_total_bytes, reading.device_used_bytes, reading.process_bytes) == (80 * GiB, 20 * GiB, None)
    said = [r.getMessage() for r in caplog.records if r.name == "memplan.hardware.readings"]
    assert len(said) == 1 and "device figures come from CUDA's mem_get_info" in said[0]
    # ... and the end-of-fit summary says so again (memplan.callback gathers the codes from every rank)
    assert readings.reading_fallbacks(torch.device("cuda", 0)) == ("nvml",)
    assert readings.reading_fallbacks(torch.device("cpu")) == ()


def test_the_summary_names_the_ranks_whose_readings_fell_back():
    masks = [readings.fallback_mask(("nvml",)), 0, readings.fallback_mask(("nvml", "stats"))]
    assert readings.fallback_lines(masks) == [
        "ranks 0, 2: NVML gave no memory reading, so the device's figures came from CUDA's mem_get_info and this "
        "process's own share was not available during this fit",
        "rank 2: torch.cuda.memory_stats failed, so torch's counters were missing during this fit"]
    assert readings.fallback_lines([0, 0]) == []


def _simulated_cuda(monkeypatch, *, free: int, total: int) -> None:
    """A SIMULATED CUDA device 0 (an H100 as torch would describe it): no GPU is touched."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=None: SimpleNamespace(
        name="NVIDIA H100 80GB HBM3", total_memory=total, major=9, minor=0))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))


def test_a_rank_whose_gpu_nvml_does_not_answer_plans_from_cudas_own_figures(nvml_sim, monkeypatch):
    from memplan.callback.apply import device_budget

    nvml_sim([SimGpu()], raising={"nvmlDeviceGetMemoryInfo": RuntimeError("NVML lost")})
    _simulated_cuda(monkeypatch, free=70 * GiB, total=80 * GiB)
    budget = device_budget(torch.device("cuda", 0), local_world_size=1)
    assert (budget.name, budget.cuda_index, budget.total_bytes, budget.free_bytes, budget.compute_capability) == (
        "NVIDIA H100 80GB HBM3", 0, 80 * GiB, 70 * GiB, (9, 0))


def test_the_device_facts_torch_gives_are_read_in_one_place(monkeypatch):
    from memplan.estimator.target import resolve_target

    _simulated_cuda(monkeypatch, free=70 * GiB, total=80 * GiB)
    facts = readings.cuda_device_facts()
    assert (facts.index, facts.name, facts.total_bytes, facts.compute_capability) == (
        0, "NVIDIA H100 80GB HBM3", 80 * GiB, (9, 0))
    target = resolve_target(None)  # memplan.estimate(device=None): this process's GPU
    assert (target.name, target.total_bytes, target.compute_capability) == ("NVIDIA H100 80GB HBM3", 80 * GiB, (9, 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert readings.cuda_device_facts() is None
