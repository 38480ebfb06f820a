"""memplan validate: a real run on this machine against the estimate; the GPU calibration it saves and
cuda_overheads' use of it (keys monkeypatched: these run on CPU)."""
import json
from pathlib import Path

import pytest
import torch

from memplan.estimator import calibration as calib
from memplan.commands import validate
from memplan.estimator.calibration import Calibration, CalibrationKey, find_calibration, load_calibrations, save_calibration
from memplan.commands.cli import main
from memplan.estimator.cuda.overheads import cuda_overheads
from memplan.units import GiB, MiB, format_bytes

MLP = str(Path(__file__).resolve().parents[2] / "configs" / "mlp.yaml")
H100 = CalibrationKey(gpu_name="NVIDIA H100 80GB HBM3", driver_version="550.54.15", torch_version="2.13.0",
                      cuda_version="12.8")


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_validate_on_cpu_prints_estimate_vs_measured_and_passes(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("MEMPLAN_CALIBRATION", str(tmp_path / "calibration.json"))
    code, out, _ = run(capsys, "validate", MLP, "--batch-size", "8", "--json")
    report = json.loads(out)
    assert code == 0 and report["device"] == "cpu" and report["within_goal"] is True
    [row] = report["rows"]  # on CPU only the peak allocation has a measured figure
    assert row["name"] == "peak allocated"
    assert row["estimate_bytes"] == report["estimate"]["peak_allocated"]
    assert row["measured_bytes"] > 1 * MiB  # 131k fp32 parameters + AdamW state alone exceed this
    assert abs(row["error_pct"]) <= validate.CPU_GOAL_PCT
    assert report["calibration"] is None and not (tmp_path / "calibration.json").exists()  # nothing on CPU


def test_validate_text_says_passed_and_that_cpu_has_no_context(capsys, monkeypatch):
    monkeypatch.setattr(validate, "measure_in_subprocess",
                        lambda s: validate.Measurement(device="cpu", max_allocated=_cpu_estimate(s)))
    code, out, _ = run(capsys, "validate", MLP, "--batch-size", "8")
    assert code == 0
    assert "peak allocated" in out and "+0.00%" in out
    assert "validation passed" in out and "no CUDA context to calibrate; nothing saved" in out


def test_a_forced_mismatch_fails_loudly_with_exit_1(capsys, monkeypatch):
    monkeypatch.setattr(validate, "measure_in_subprocess",
                        lambda s: validate.Measurement(device="cpu", max_allocated=2 * _cpu_estimate(s)))
    code, out, err = run(capsys, "validate", MLP, "--batch-size", "8")
    assert code == 1
    assert "OUTSIDE GOAL" in out and "-50.00%" in out
    assert "VALIDATION FAILED: 1 of 1 figures outside the goal on cpu" in err


def test_gpu_goal_is_asymmetric():
    assert validate.within_goal(5.9, "cuda") and not validate.within_goal(6.1, "cuda")
    assert validate.within_goal(-1.9, "cuda") and not validate.within_goal(-2.1, "cuda")
    assert validate.within_goal(-2.9, "cpu") and not validate.within_goal(3.1, "cpu")


def test_a_gpu_measurement_gives_rows_and_a_calibration():
    est = type("E", (), dict(peak_allocated=1000, peak_reserved=1200, device_total=1700))()
    got = validate.Measurement(device="cuda", max_allocated=1000, max_reserved=1190, nvml_process_peak=1800,
                               gpu={"key": H100.__dict__, "compute_capability": [9, 0]})
    rows = {r.name: r for r in validate.compare(est, got)}
    assert rows["peak allocated"].within_goal and rows["peak reserved"].within_goal
    assert not rows["device total (NVML)"].within_goal  # 1700 vs 1800: -5.6 %, an under-estimate
    cal = validate.calibration_from(got)
    assert (cal.key, cal.compute_capability, cal.context_bytes) == (H100, (9, 0), 610)
    assert cal.allocator_overhead == pytest.approx(1.19)


def test_validate_refuses_batch_size_with_plan(capsys, tmp_path):
    code, _, err = run(capsys, "validate", MLP, "--batch-size", "8", "--plan", str(tmp_path / "x.plan.json"))
    assert code == 2 and "not both" in err


def test_calibration_round_trip_is_keyed_and_keeps_other_entries(tmp_path):
    path = tmp_path / "sub" / "calibration.json"
    h100 = Calibration(key=H100, compute_capability=(9, 0), context_bytes=537_919_488, allocator_overhead=1.03)
    other = CalibrationKey(**{**H100.__dict__, "driver_version": "535.104.05"})
    a100 = Calibration(key=other, compute_capability=(8, 0), context_bytes=500 * MiB, allocator_overhead=1.0)
    save_calibration(h100, path)
    save_calibration(a100, path)
    assert find_calibration(H100, path) == h100
    assert isinstance(json.loads(path.read_text())["entries"][H100.as_str()]["context_bytes"], int)
    assert len(load_calibrations(path)) == 2
    for field, value in [("gpu_name", "NVIDIA A100-SXM4-80GB"), ("torch_version", "2.12.0"),
                         ("cuda_version", "13.0"), ("module_loading", "EAGER")]:
        assert find_calibration(CalibrationKey(**{**H100.__dict__, field: value}), path) is None
    assert find_calibration(None, path) is None


def test_a_corrupt_calibration_file_is_refused_by_name(tmp_path):
    path = tmp_path / "calibration.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="calibration.json is not valid JSON"):
        load_calibrations(path)


def test_calibration_path_follows_the_env_var(tmp_path):
    assert calib.calibration_path({"MEMPLAN_CALIBRATION": str(tmp_path / "c.json")}) == tmp_path / "c.json"
    assert calib.calibration_path({}).parts[-3:] == (".cache", "memplan", "calibration.json")


def test_cuda_overheads_use_a_matching_calibration_and_fall_back_otherwise(tmp_path, monkeypatch):
    path = tmp_path / "calibration.json"
    env = {"MEMPLAN_CALIBRATION": str(path)}
    sourced = cuda_overheads((9, 0), env=env).context_bytes
    save_calibration(Calibration(key=H100, compute_capability=(9, 0), context_bytes=537_919_488,
                                 allocator_overhead=1.03), path)
    monkeypatch.setattr(calib, "current_key", lambda env: H100)  # as if this machine were that H100
    used = cuda_overheads((9, 0), env=env)
    assert used.context_bytes == 537_919_488 != sourced
    assert any("measured by memplan validate" in n and "driver 550.54.15" in n for n in used.notes)
    # Another GPU model estimated on the same machine keeps the sourced figure.
    assert cuda_overheads((8, 0), env=env).context_bytes == cuda_overheads((8, 0), env={}).context_bytes
    # A different driver on this machine: the saved entry does not match.
    monkeypatch.setattr(calib, "current_key", lambda env: CalibrationKey(**{**H100.__dict__, "driver_version": "560"}))
    assert cuda_overheads((9, 0), env=env).context_bytes == sourced
    # No CUDA here at all (the real current_key on this CPU machine): the sourced figure.
    monkeypatch.undo()
    if not torch.cuda.is_available():
        assert cuda_overheads((9, 0), env=env).context_bytes == sourced


def test_an_unreadable_calibration_falls_back_to_the_sourced_context(tmp_path, monkeypatch, caplog):
    path = tmp_path / "calibration.json"
    path.write_text("[]")
    monkeypatch.setattr(calib, "current_key", lambda env: H100)
    env = {"MEMPLAN_CALIBRATION": str(path)}
    assert cuda_overheads((9, 0), env=env).context_bytes == cuda_overheads((9, 0), env={}).context_bytes
    assert "ignoring the CUDA calibration" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_validate_on_a_gpu_compares_three_figures_and_saves_a_calibration(capsys, tmp_path, monkeypatch):
    path = tmp_path / "calibration.json"
    monkeypatch.setenv("MEMPLAN_CALIBRATION", str(path))
    code, out, _ = run(capsys, "validate", MLP, "--batch-size", "64", "--json")
    report = json.loads(out)
    assert report["device"] == "cuda"
    assert {r["name"] for r in report["rows"]} >= {"peak allocated", "peak reserved"}
    assert code == (0 if report["within_goal"] else 1)
    if report["measurement"]["nvml_process_peak"] is not None:
        saved = load_calibrations(path)
        assert len(saved) == 1 and next(iter(saved.values())).context_bytes > 0


def _cpu_estimate(setting) -> int:
    from memplan.config import load_config

    return validate.estimate_for(load_config(setting.config), setting, "cpu").peak_allocated


# --- room first: the estimate against the memory free where the steps would run -----------------
def _simulated_host(monkeypatch, *, available: int, cgroup_limit: int | None = None, cgroup_used: int = 0):
    """A simulated small host: memplan.hardware's reading answers with these figures."""
    from memplan import hardware

    host = hardware.HostInfo(total_bytes=22 * GiB, available_bytes=available, cpu_count=2, usable_cpu_count=2,
                             cgroup_limit_bytes=cgroup_limit,
                             cgroup_used_bytes=cgroup_used if cgroup_limit is not None else None)
    monkeypatch.setattr(hardware, "host_info", lambda: host)


def _no_measurement(setting):
    raise AssertionError("validate ran the steps")


def test_validate_refuses_steps_the_estimate_says_cannot_fit_the_host(capsys, monkeypatch):
    _simulated_host(monkeypatch, available=1 * MiB)
    monkeypatch.setattr(validate, "measure_in_subprocess", _no_measurement)
    code, out, err = run(capsys, "validate", MLP, "--batch-size", "8")
    assert code == 1 and out == ""
    estimate = _cpu_estimate(validate.Setting(config=MLP, batch_size=8, precision="32-true"))
    short = format_bytes(estimate - 1 * MiB)
    assert (f"this host: estimated {format_bytes(estimate)} (peak allocated), 1.00 MiB available (RAM available): "
            f"{short} short") in err
    assert "--force" in err and "--batch-size" in err


def test_the_cgroup_limit_is_what_the_host_has(capsys, monkeypatch):
    _simulated_host(monkeypatch, available=20 * GiB, cgroup_limit=1 * GiB, cgroup_used=1 * GiB - 2 * MiB)
    monkeypatch.setattr(validate, "measure_in_subprocess", _no_measurement)
    code, _, err = run(capsys, "validate", MLP, "--batch-size", "8")
    assert code == 1 and "2.00 MiB available (RAM available within the cgroup's limit)" in err


def test_force_runs_anyway_and_says_so(capsys, monkeypatch):
    _simulated_host(monkeypatch, available=1 * MiB)
    monkeypatch.setattr(validate, "measure_in_subprocess",
                        lambda s: validate.Measurement(device="cpu", max_allocated=_cpu_estimate(s)))
    code, out, err = run(capsys, "validate", MLP, "--batch-size", "8", "--force", "--json")
    assert code == 0 and "short" in err and "running anyway (--force)" in err
    [room] = json.loads(out)["room"]
    assert room["where"] == "this host" and room["available_bytes"] == 1 * MiB and room["short_bytes"] > 0


def test_a_host_with_room_runs_without_a_word(capsys, monkeypatch):
    _simulated_host(monkeypatch, available=16 * GiB)
    monkeypatch.setattr(validate, "measure_in_subprocess",
                        lambda s: validate.Measurement(device="cpu", max_allocated=_cpu_estimate(s)))
    code, out, err = run(capsys, "validate", MLP, "--batch-size", "8", "--json")
    assert code == 0 and err == ""
    [room] = json.loads(out)["room"]
    assert room["short_bytes"] == 0 and room["available_bytes"] == 16 * GiB


def _simulated_gpu(free: int | None):
    """A simulated GPU as NVML would describe it (no CUDA here)."""
    from memplan import hardware

    return hardware.GpuInfo(index=3, uuid="GPU-sim", name="Simulated A100", total_bytes=80 * GiB,
                            used_bytes=None if free is None else 80 * GiB - free, free_bytes=free,
                            compute_capability=(8, 0), mig_mode=None)


def test_on_a_gpu_the_device_total_is_held_to_nvmls_free_memory(monkeypatch):
    from types import SimpleNamespace

    from memplan import hardware

    _simulated_host(monkeypatch, available=16 * GiB)
    monkeypatch.setattr(hardware, "gpu_for_cuda_index", lambda index: _simulated_gpu(10 * GiB))
    estimate = SimpleNamespace(peak_allocated=30 * GiB, device_total=31 * GiB, num_parameters=1_000_000_000)
    rooms, notes = validate.rooms_for(estimate, "cuda")
    host, gpu = rooms
    assert notes == ()
    assert host.needed_bytes == 4 * 1_000_000_000 and host.short_bytes == 0  # float32 weights built on the host
    assert gpu.where == "GPU 3 (Simulated A100)" and gpu.short_bytes == 21 * GiB
    assert "estimated 31.00 GiB (device total, CUDA context included), 10.00 GiB available (free, NVML): " \
           "21.00 GiB short" in gpu.describe()


def test_without_nvml_the_gpu_check_is_named_as_skipped(monkeypatch, capsys):
    from types import SimpleNamespace

    from memplan import hardware

    _simulated_host(monkeypatch, available=16 * GiB)
    monkeypatch.setattr(hardware, "gpu_for_cuda_index", lambda index: None)
    monkeypatch.setattr(hardware, "nvml_unavailable_reason", lambda: "libnvidia-ml.so.1 not found")
    estimate = SimpleNamespace(peak_allocated=30 * GiB, device_total=31 * GiB, num_parameters=1000)
    rooms = validate.check_room(estimate, "cuda", force=False)
    assert [room.where for room in rooms] == ["this host"]
    assert "GPU memory not checked before running: libnvidia-ml.so.1 not found" in capsys.readouterr().err


def test_validate_says_a_plan_for_a_gpu_is_checked_here_on_cpu(capsys, tmp_path, monkeypatch):
    from memplan.plan import Plan

    plan = Plan(gpu_name="A100-80GB", gpus=(0, 1), nodes=1, world_size=2, micro_batch_size=8,
                accumulate_grad_batches=1, global_batch_size=16, precision="32-true", gradient_checkpointing=False,
                strategy="ddp", predicted_peak_bytes=1 << 30, device_budget_bytes=72 << 30, host_bytes_per_rank=0)
    path = tmp_path / "planned.plan.json"
    path.write_text(json.dumps(plan.to_dict()))
    monkeypatch.setattr(validate, "measure_in_subprocess",
                        lambda s: validate.Measurement(device="cpu", max_allocated=_cpu_estimate(s)))
    code, out, err = run(capsys, "validate", MLP, "--plan", str(path))
    assert code == 0 and "validation passed" in out
    assert f"--plan {path} was made for 2 x A100-80GB" in err and "not that the plan fits A100-80GB" in err
