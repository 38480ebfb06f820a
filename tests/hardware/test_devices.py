"""`memplan devices` views: what a user reads in the table and what a script reads in the JSON."""
from __future__ import annotations

import json

import pynvml
from fake_nvml import SimGpu, SimProcess
from rich.console import Console

from memplan.hardware.host import HostInfo
from memplan.hardware.visible import visible_gpus
from memplan.commands.device_table import devices_dict, devices_table
from memplan.units import GiB, MiB

HOST = HostInfo(total_bytes=512 * GiB, available_bytes=400 * GiB, cpu_count=64, usable_cpu_count=16,
                cgroup_limit_bytes=128 * GiB, cgroup_used_bytes=8 * GiB, shm_total_bytes=64 * MiB)


def two_gpus() -> list[SimGpu]:
    return [SimGpu(driver_bytes=512 * MiB),
            SimGpu(name="Tesla T4", total_bytes=15360 * MiB, compute_capability=(7, 5),
                   processes=[SimProcess(pid=101, used_bytes=6 * GiB, name="python [rank0]")])]


def render(table) -> str:
    console = Console(record=True, width=200)
    console.print(table)
    return console.export_text()


def test_dict_lists_gpus_in_cuda_order_with_plain_byte_ints(nvml_sim):
    nvml_sim(two_gpus())
    env = {"CUDA_VISIBLE_DEVICES": "1,0"}
    view = devices_dict(visible_gpus(env), HOST, env=env)
    assert view["nvml"] == {"available": True, "reason": None} and view["note"] is None
    assert view["cuda_visible_devices"] == "1,0"
    t4, a100 = view["gpus"]
    assert (t4["cuda_index"], t4["nvml_index"], t4["catalog_model"]) == (0, 1, "T4")
    assert (a100["cuda_index"], a100["nvml_index"], a100["catalog_model"]) == (1, 0, "A100-80GB")
    assert t4["free_bytes"] == 15360 * MiB - 6 * GiB and t4["bf16_supported"] is False
    assert t4["processes"] == [{"pid": 101, "used_bytes": 6 * GiB, "name": "python [rank0]"}]
    assert a100["compute_capability"] == [8, 0] and a100["bf16_supported"] is True
    assert view["host"]["budget_bytes"] == 120 * GiB  # cgroup limit minus its usage
    assert json.loads(json.dumps(view)) == view  # JSON-ready as is


def test_table_shows_each_gpu_its_memory_and_processes(nvml_sim):
    nvml_sim(two_gpus())
    text = render(devices_table(visible_gpus({}), HOST, env={}))
    assert "NVIDIA A100-SXM4-80GB" in text and "Tesla T4" in text
    assert "6.00 GiB / 15.00 GiB" in text and "79.50 GiB" in text  # used / total, free
    assert "101 python [rank0] 6.00 GiB" in text  # markup-like names printed literally
    assert "7.5" in text and "no" in text and "yes" in text
    assert "16/64 CPUs usable" in text and "cgroup limit 128.00 GiB" in text


def test_without_nvml_both_views_say_why_and_how_to_plan_off_box(nvml_sim):
    nvml_sim(two_gpus(), init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    view = devices_dict(visible_gpus({}), HOST, env={})
    assert view["nvml"]["available"] is False and "libnvidia-ml" in view["nvml"]["reason"]
    assert view["gpus"] == []
    assert "--gpu H100-80GB" in view["note"] and "--gpu-memory 24GiB" in view["note"]
    text = " ".join(render(devices_table((), HOST, env={})).split())
    assert "NVML is unavailable" in text and "--gpu H100-80GB" in text and "--gpu-memory 24GiB" in text


def test_empty_cuda_visible_devices_is_named_as_the_cause(nvml_sim):
    nvml_sim(two_gpus())
    env = {"CUDA_VISIBLE_DEVICES": ""}
    view = devices_dict(visible_gpus(env), HOST, env=env)
    assert view["nvml"]["available"] is True and view["gpus"] == []
    assert "CUDA_VISIBLE_DEVICES=''" in view["note"]


def test_piped_devices_output_keeps_each_sentence_on_one_line(nvml_sim, capsys):
    # stdout is pytest's capture, not a terminal (as with `memplan devices | tee`): no fold at 80 columns
    from memplan.commands.cli import main

    nvml_sim(two_gpus(), init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    note = next(line for line in out.splitlines() if "NVML is unavailable" in line)
    assert len(note) > 80 and "--gpu H100-80GB" in note and "--gpu-memory 24GiB" in note
