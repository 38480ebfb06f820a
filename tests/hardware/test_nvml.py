"""The NVML door and the GPU readings, on a simulated NVML (fake_nvml.py) unless marked `gpu`."""
from __future__ import annotations

import logging
import re
import sys
import threading
from pathlib import Path

import pynvml
import pytest
from fake_nvml import SimGpu, SimProcess, SimulatedNvml

from memplan.hardware import nvml
from memplan.hardware.catalog import match_nvml_name
from memplan.hardware.nvml import NA, list_gpus, nvml_available, nvml_query, nvml_unavailable_reason, process_gpu_bytes
from memplan.hardware.visible import gpu_for_cuda_index, gpu_for_local_rank, visible_gpus
from memplan.units import GiB, MiB

A100_80 = 81920 * MiB
DRIVER = 512 * MiB
TRAINER_PID, OTHER_PID = 4242, 777


def four_gpus_one_busy() -> list[SimGpu]:
    """Four A100-80GB; GPU 1 runs two processes (30 GiB and 10 GiB)."""
    gpus = [SimGpu(driver_bytes=DRIVER) for _ in range(4)]
    gpus[1].processes = [SimProcess(pid=TRAINER_PID, used_bytes=30 * GiB, name="python train.py"),
                         SimProcess(pid=OTHER_PID, used_bytes=10 * GiB, name="jupyter")]
    return gpus


def test_four_gpus_one_busy_reports_free_bytes_and_processes(nvml_sim):
    nvml_sim(four_gpus_one_busy())
    gpus = list_gpus()
    assert [g.index for g in gpus] == [0, 1, 2, 3]
    busy, idle = gpus[1], gpus[0]
    assert busy.total_bytes == A100_80
    assert busy.used_bytes == DRIVER + 40 * GiB
    assert busy.free_bytes == A100_80 - DRIVER - 40 * GiB
    assert idle.free_bytes == A100_80 - DRIVER and idle.processes == ()
    assert {(p.pid, p.used_bytes, p.name) for p in busy.processes} == {
        (TRAINER_PID, 30 * GiB, "python train.py"), (OTHER_PID, 10 * GiB, "jupyter")}
    assert busy.process_bytes(TRAINER_PID) == 30 * GiB  # own share, apart from the device's used
    assert busy.process_bytes(12345) is None
    assert busy.compute_capability == (8, 0) and busy.bf16_supported is True
    assert busy.mig_mode is None  # board without MIG support: NotSupported -> None
    assert match_nvml_name(busy.name).name == "A100-80GB"


def test_bf16_follows_compute_capability(nvml_sim):
    nvml_sim([SimGpu(name="Tesla V100-SXM2-16GB", total_bytes=16160 * MiB, compute_capability=(7, 0)),
              SimGpu(name="Tesla T4", total_bytes=15360 * MiB, compute_capability=(7, 5)),
              SimGpu(name="NVIDIA H100 80GB HBM3", total_bytes=81559 * MiB, compute_capability=(9, 0))])
    assert [g.bf16_supported for g in list_gpus()] == [False, False, True]


def test_cuda_visible_devices_maps_local_rank_to_physical_gpu(nvml_sim):
    nvml_sim(four_gpus_one_busy())
    env = {"CUDA_VISIBLE_DEVICES": "2,0"}
    assert [g.index for g in visible_gpus(env)] == [2, 0]
    assert gpu_for_local_rank(0, env).index == 2
    assert gpu_for_local_rank(1, env).index == 0
    assert gpu_for_local_rank(2, env) is None  # only two GPUs visible
    assert gpu_for_local_rank(1, {}).index == 1  # unset: CUDA index == NVML index
    assert gpu_for_cuda_index(1, {"CUDA_VISIBLE_DEVICES": "3,1"}).index == 1
    with pytest.raises(ValueError, match="local_rank must be >= 0"):
        gpu_for_local_rank(-1, env)


def test_cuda_visible_devices_by_uuid_and_unique_prefix(nvml_sim):
    sim = nvml_sim(four_gpus_one_busy())
    uuids = [g.uuid for g in sim.gpus]
    full_3, prefix_1 = uuids[3], uuids[1][:12]  # "GPU-00000001" is unique to GPU 1
    assert [g.index for g in visible_gpus({"CUDA_VISIBLE_DEVICES": f"{full_3},{prefix_1}"})] == [3, 1]
    assert gpu_for_local_rank(0, {"CUDA_VISIBLE_DEVICES": prefix_1}).uuid == uuids[1]
    # "GPU-0000000" matches all four: ambiguous, so the list ends there (as in CUDA).
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": f"{full_3},GPU-0000000"})[0].index == 3
    assert len(visible_gpus({"CUDA_VISIBLE_DEVICES": f"{full_3},GPU-0000000"})) == 1


def test_mixed_models_without_pci_bus_order_warn_once(nvml_sim, caplog):
    mixed = [SimGpu(name="NVIDIA GeForce RTX 3090"), SimGpu(name="NVIDIA GeForce RTX 4090")]
    with caplog.at_level(logging.WARNING, logger=nvml.__name__):
        nvml_sim(mixed)
        visible_gpus({"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "1"})
        assert caplog.records == []  # bus order asked for: cuda:i is nvidia-smi's i
        visible_gpus({"CUDA_VISIBLE_DEVICES": "1"})
        visible_gpus({})
    assert [r.getMessage().count("CUDA_DEVICE_ORDER=PCI_BUS_ID") for r in caplog.records] == [1]


@pytest.mark.parametrize("value, expected", [
    ("", []),              # empty string hides every GPU
    ("1,x,2", [1]),        # first invalid entry ends the list
    ("0,7,1", [0]),        # so does an ordinal past the last GPU
    ("-1", []),
    ("1gpu,+2", [1, 2]),   # strtoul-style: leading digits count
    (" 3 , 2", [3, 2]),
    ("1,2,1", []),         # a repeated device empties the list
    ("0,GPU-00000002", [0]),  # ordinals and UUIDs do not mix
])
def test_cuda_visible_devices_parsed_as_cuda_does(nvml_sim, value, expected):
    nvml_sim(four_gpus_one_busy())
    assert [g.index for g in visible_gpus({"CUDA_VISIBLE_DEVICES": value})] == expected


def test_mig_slice_named_by_uuid_reports_the_slice(nvml_sim):
    # Board-level queries are not asked of the slice (drivers may refuse them on MIG handles).
    board_only = {"nvmlDeviceGetCudaComputeCapability": pynvml.NVML_ERROR_NOT_SUPPORTED,
                  "nvmlDeviceGetMigMode": pynvml.NVML_ERROR_NOT_SUPPORTED}
    slices = [SimGpu(name="NVIDIA A100-SXM4-80GB MIG 3g.40gb", total_bytes=40 * GiB,
                     failing=board_only),
              SimGpu(name="NVIDIA A100-SXM4-80GB MIG 1g.10gb", total_bytes=10 * GiB,
                     failing=board_only, processes=[SimProcess(pid=TRAINER_PID, used_bytes=2 * GiB)])]
    sim = nvml_sim([SimGpu(), SimGpu(mig_mode=True, mig_slices=slices)])
    assert [g.mig_mode for g in list_gpus()] == [None, True]
    (gpu,) = visible_gpus({"CUDA_VISIBLE_DEVICES": slices[1].uuid})
    assert (gpu.index, gpu.mig_index, gpu.total_bytes) == (1, 1, 10 * GiB)
    assert gpu.free_bytes == 8 * GiB and gpu.process_bytes(TRAINER_PID) == 2 * GiB
    assert gpu.compute_capability == (8, 0) and gpu.mig_mode is True  # from the parent board
    assert match_nvml_name(gpu.name) is None  # a slice is not an A100-80GB
    assert process_gpu_bytes(TRAINER_PID, gpu) == 2 * GiB
    assert sim.gpus[1].mig_slices[1].uuid.startswith("MIG-")


def test_nvml_error_in_one_call_gives_default_not_crash(nvml_sim):
    gpus = four_gpus_one_busy()
    gpus[2].failing = {"nvmlDeviceGetMemoryInfo": pynvml.NVML_ERROR_GPU_IS_LOST}
    nvml_sim(gpus, failing={"nvmlSystemGetProcessName": pynvml.NVML_ERROR_NO_PERMISSION})
    readings = list_gpus()
    assert len(readings) == 4
    assert (readings[2].total_bytes, readings[2].free_bytes) == (None, None)
    assert readings[3].free_bytes == A100_80 - DRIVER  # the others are unaffected
    assert {p.name for p in readings[1].processes} == {None}  # names unavailable, usage still there
    assert readings[1].process_bytes(TRAINER_PID) == 30 * GiB
    assert nvml_query("nvmlDeviceGetHandleByIndex", 99, default="fallback") == "fallback"


def test_process_list_falls_back_to_older_versions_and_logs_once(nvml_sim, caplog):
    sim = nvml_sim(four_gpus_one_busy(),
                   driver_lacks={"nvmlDeviceGetComputeRunningProcesses_v3"},
                   bindings_lack={"nvmlDeviceGetComputeRunningProcesses_v2"})
    with caplog.at_level(logging.WARNING, logger=nvml.__name__):
        list_gpus()
        readings = list_gpus()
    assert readings[1].process_bytes(TRAINER_PID) == 30 * GiB
    assert "nvmlDeviceGetComputeRunningProcesses" in sim.calls  # the unversioned one answered
    missing = [r.getMessage() for r in caplog.records]
    assert len(missing) == 2  # v3 (driver) and v2 (bindings): once each, not once per GPU or call
    assert any("_v3 is missing from this NVIDIA driver" in m for m in missing)


def test_driver_without_any_process_list_gives_no_processes_not_a_crash(nvml_sim):
    nvml_sim(four_gpus_one_busy(), driver_lacks={
        "nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2",
        "nvmlDeviceGetComputeRunningProcesses"})
    busy = list_gpus()[1]
    assert busy.processes == () and busy.free_bytes == A100_80 - DRIVER - 40 * GiB


NVML_CALL = re.compile(r'nvml_query\(\s*"(\w+)"')


def test_every_function_the_door_calls_exists_in_nvidia_ml_py_and_the_simulation():
    source = Path(nvml.__file__).read_text()
    called = set(NVML_CALL.findall(source)) | set(nvml._PROCESS_FUNCS)
    assert "nvmlDeviceGetMemoryInfo" in called and len(called) >= 10
    assert {f for f in called if not hasattr(pynvml, f)} <= {"nvmlDeviceGetComputeRunningProcesses_v2"}
    assert {f for f in called if not hasattr(SimulatedNvml, f)} == set()


def test_process_gpu_bytes_reads_now_apart_from_device_used(nvml_sim):
    sim = nvml_sim(four_gpus_one_busy())
    snapshot = list_gpus()[1]
    sim.gpus[1].processes[0].used_bytes = 31 * GiB  # the trainer grew after the snapshot
    assert process_gpu_bytes(TRAINER_PID, snapshot) == 31 * GiB
    assert process_gpu_bytes(TRAINER_PID, 1) == 31 * GiB  # by NVML index
    assert process_gpu_bytes(TRAINER_PID, 0) is None  # not on GPU 0
    assert process_gpu_bytes(TRAINER_PID, 9) is None  # no such GPU
    sim.gpus[1].processes[0].used_bytes = None  # WDDM: NVML cannot attribute memory
    assert process_gpu_bytes(TRAINER_PID, 1) is None


def test_library_missing_makes_nvml_unavailable_with_a_reason(nvml_sim):
    sim = nvml_sim(four_gpus_one_busy(), init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    assert nvml_available() is False
    assert "libnvidia-ml.so.1 was not found" in nvml_unavailable_reason()
    assert list_gpus() == () and visible_gpus({}) == ()
    assert gpu_for_local_rank(0, {}) is None and process_gpu_bytes(1, 0) is None
    assert nvml_query("nvmlDeviceGetCount") is NA
    assert sim.init_calls == 1  # the failure is remembered, not retried on every call


def test_driver_not_loaded_reason(nvml_sim):
    nvml_sim([], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    assert "driver is not loaded" in nvml_unavailable_reason()


def test_bindings_missing_reason_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    nvml.set_backend(None)
    assert nvml_available() is False
    assert "pip install nvidia-ml-py" in nvml_unavailable_reason()


def test_init_is_lazy_once_across_threads_and_shut_down(nvml_sim):
    sim = nvml_sim(four_gpus_one_busy())
    assert sim.init_calls == 0  # installing does not touch NVML
    threads = [threading.Thread(target=list_gpus) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sim.init_calls == 1 and sim.initialized == 1
    nvml._shutdown_at_exit()  # what atexit runs
    assert sim.shutdown_calls == 1 and sim.initialized == 0
    assert list_gpus() == () and sim.init_calls == 1  # no re-init after shutdown at exit


def test_bytes_from_old_bindings_become_str(nvml_sim):
    class OldBindings(SimulatedNvml):
        def nvmlDeviceGetName(self, handle):
            return super().nvmlDeviceGetName(handle).encode()

    nvml.set_backend(OldBindings([SimGpu()]))
    assert list_gpus()[0].name == "NVIDIA A100-SXM4-80GB"


@pytest.mark.gpu
def test_real_gpus_read_through_nvml():
    nvml.set_backend(None)
    if not nvml_available():
        pytest.skip(f"no NVML: {nvml_unavailable_reason()}")
    for gpu in list_gpus():
        assert gpu.total_bytes > 0 and 0 <= gpu.free_bytes <= gpu.total_bytes
        model = match_nvml_name(gpu.name)
        if model is not None:  # the catalog figure is NVML's, within driver-to-driver drift
            assert abs(gpu.total_bytes - model.total_bytes) <= 512 * MiB
