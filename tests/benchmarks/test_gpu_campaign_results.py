"""The GPU campaign's results converter (benchmarks/gpu_results.py) on parts written here in the campaign's
layout, as a GPU run would write them (figures chosen here), since no GPU is available: the committed files, the
constants they replace, what was not measured. The converter on a real dry run: test_gpu_campaign.py."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import gpu_extra_results, gpu_results
from benchmarks.accuracy_gpu import make_row
from memplan.estimator.cuda import overheads as cuda
from memplan.estimator.calibration import CalibrationKey, load_calibrations
from memplan.units import MiB


# --- the converter on GPU-shaped parts -----------------------------------------------------------
ENV = {"status": "done", "python": "3.12.3", "torch": "2.11.0+cu130", "torch_cuda": "13.0", "cudnn": 91300,
       "driver": "580.159.04", "cuda_driver": "13.0", "packages": {"pytorch-lightning": "2.6.6", "transformers": "5.17.0"},
       "gpu": {"name": "NVIDIA H100 80GB HBM3", "total_bytes": 85520809984, "compute_capability": [9, 0]},
       "memplan_commit": "0123456789abcdef"}


def _truth(allocated, reserved, nvml):
    return {"device": "cuda", "max_allocated": allocated, "max_reserved": reserved, "nvml_process_peak": nvml}


def _estimate(allocated, reserved, total):
    return {"peak_allocated": allocated, "peak_reserved": reserved, "device_total": total}


def _parts(tmp_path: Path) -> Path:
    """A part 1 and a part 2 in the campaign's layout, as a GPU run would write them (figures chosen here)."""
    rows = [make_row("mlp-b64", _truth(100 * MiB, 120 * MiB, 620 * MiB), _estimate(101 * MiB, 122 * MiB, 900 * MiB),
                     _estimate(101 * MiB, 122 * MiB, 900 * MiB)),
            make_row("gpt2-b4", _truth(1000 * MiB, 1100 * MiB, 1650 * MiB), _estimate(950 * MiB, 1100 * MiB, 1900 * MiB),
                     {"error": "EstimateError: boom"})]
    lazy = {"context": {"outside_allocator": 500 * MiB},
            "snapshots": [{"label": "nccl: before init", "outside_allocator": 530 * MiB}],
            "cublas": {"main_thread_workspace": 32 * MiB, "autograd_thread_workspace": 32 * MiB,
                       "cublaslt_extra_workspace": 0},
            "allocator": {"rows": [{"op": "malloc 512", "allocated": 512, "model_allocated": 512,
                                    "reserved": 2 * MiB, "model_reserved": 2 * MiB}], "mismatches": 0},
            "errors": {"nccl_one_rank": "RuntimeError: no NCCL"}}
    part1 = {"format": 1, "part": 1, "dry_run": False, "started": "2026-12-01T00:00:00+00:00", "sections": {
        "environment": ENV,
        "cuda_overheads": {"status": "done", "lazy": lazy, "eager": {"context": {"outside_allocator": 1200 * MiB}}},
        "accuracy_zoo": {"status": "out of time", "seconds": 400.0, "error": "TimeoutExpired: measure", "rows": rows},
    }}
    part2 = {"format": 1, "part": 2, "dry_run": False, "started": "2026-12-01T00:20:00+00:00", "sections": {
        "environment": ENV,
        "plan_vs_bisect_gpt2-small": {"status": "done", "config": "gpt2-small", "precision": "bf16-mixed",
                                      "checkpointing": False, "planned_micro_batch": 40, "planned_runs": True,
                                      "memplan_max_micro_batch": 46, "memplan_max_runs": True,
                                      "truth_max_micro_batch": 48, "truth_first_oom": 49, "ratio": 46 / 48,
                                      "suggest_seconds": 6.0, "batch_size_finder_seconds": 90.0,
                                      "batch_size_finder_batch": 32, "suggest_over_batch_size_finder": 6 / 90},
    }}
    folder = tmp_path / "raw"
    folder.mkdir()
    (folder / "part1.json").write_text(json.dumps(part1))
    (folder / "part2.json").write_text(json.dumps(part2))
    return folder


def test_results_name_the_device_and_give_constants_that_replace_the_sourced_ones(tmp_path):
    out = tmp_path / "results"
    written = gpu_results.convert(_parts(tmp_path), out)
    assert {"accuracy_gpu.md", "cuda_overheads_gpu.md", "plan_vs_bisect_gpu.md", "calibration_gpu.json"} <= set(written)
    for md in out.glob("*.md"):
        text = md.read_text()
        assert "NVIDIA H100 80GB HBM3" in text and "driver 580.159.04" in text and "torch 2.11.0+cu130 (CUDA 13.0" in text
        assert "DRY RUN" not in text
    constants = json.loads((out / "cuda_overheads_gpu.json").read_text())
    lazy = constants["replaces"]["_CONTEXT_LAZY_BYTES[9]"]
    # the largest NVML peak - reserved over the cases: gpt2 550 MiB, mlp 500 MiB
    assert lazy["measured"] == 550 * MiB and lazy["now"] == cuda.cuda_overheads((9, 0), env={}).context_bytes
    assert constants["replaces"]["_CUBLAS_BIG_BYTES"]["measured"] == 32 * MiB
    assert constants["replaces"]["CudaOverheads.cublas_workspaces"]["measured"] == 2
    assert constants["replaces"]["_CONTEXT_EAGER_BYTES"]["measured"] == 1200 * MiB
    # the calibration file is one memplan reads, keyed by this GPU, driver, torch and CUDA
    (cal,) = load_calibrations(out / "calibration_gpu.json").values()
    assert cal.key == CalibrationKey(gpu_name="NVIDIA H100 80GB HBM3", driver_version="580.159.04",
                                     torch_version="2.11.0+cu130", cuda_version="13.0")
    assert cal.context_bytes == 550 * MiB and cal.compute_capability == (9, 0)
    accuracy = (out / "accuracy_gpu.md").read_text()
    assert "`accuracy_zoo`: **out of time**" in accuracy  # a cut-off section says so
    assert "| native_err_allocated | 3.00% | 5.00% | -5.00% | 2 | NOT met |" in accuracy  # mlp +1 %, gpt2 -5 %
    assert "gpt2-b4 (emulated): EstimateError: boom" in accuracy
    overheads = (out / "cuda_overheads_gpu.md").read_text()
    assert "nccl_one_rank: RuntimeError: no NCCL" in overheads
    assert "| gpt2-small | bf16-mixed | False | 40 (runs) | 46 (runs) | 48 (49) | 96% |" in (out / "plan_vs_bisect_gpu.md").read_text()


def test_results_refuse_a_dry_run_for_the_committed_folder(tmp_path):
    folder = _parts(tmp_path)
    data = json.loads((folder / "part1.json").read_text())
    (folder / "part1.json").write_text(json.dumps(dict(data, dry_run=True)))
    assert gpu_results.main([str(folder)]) == 2
    assert gpu_results.main([str(folder), "--results", str(tmp_path / "elsewhere")]) == 0
    assert "DRY RUN on CPU" in (tmp_path / "elsewhere" / "accuracy_gpu.md").read_text()


def test_results_name_the_folder_when_it_holds_no_part(tmp_path, capsys):
    assert gpu_results.main([str(tmp_path)]) == 2
    assert str(tmp_path) in capsys.readouterr().err



def test_without_nvml_per_process_the_context_comes_from_the_probe(tmp_path):
    folder = _parts(tmp_path)
    data = json.loads((folder / "part1.json").read_text())
    for row in data["sections"]["accuracy_zoo"]["rows"]:  # a PID namespace hides this process from NVML
        row["truth"]["nvml_process_peak"] = None
    (folder / "part1.json").write_text(json.dumps(data))
    gpu_results.convert(folder, tmp_path / "results")
    lazy = json.loads((tmp_path / "results" / "cuda_overheads_gpu.json").read_text())["replaces"]["_CONTEXT_LAZY_BYTES[9]"]
    assert lazy["measured"] == 530 * MiB and "NVML saw no zoo process" in lazy["how"]


def test_cases_cut_off_by_the_budget_are_named(tmp_path):
    folder = _parts(tmp_path)
    data = json.loads((folder / "part1.json").read_text())
    data["sections"]["accuracy_zoo"].update(status="done", out_of_time=["gpt2-b4"])
    (folder / "part1.json").write_text(json.dumps(data))
    gpu_results.convert(folder, tmp_path / "results")
    assert ("`accuracy_zoo`: 1 cases not measured, cut off by the time budget: gpt2-b4."
            in (tmp_path / "results" / "accuracy_gpu.md").read_text())



def test_sections_that_did_not_run_or_were_cut_short_read_not_measured(tmp_path):
    """A skipped section, a failed probe and a search cut short say so; no cell reads None or a bare dash."""
    folder = _parts(tmp_path)
    part2 = json.loads((folder / "part2.json").read_text())
    part2["sections"].update({
        "oom_retry": {"status": "error", "seconds": 24.0, "error": "RuntimeError: gpu_probes oom-retry exited 1: boom",
                      "stderr_tail": "boom"},
        "plan_vs_bisect_gpt2-small": {"status": "out of time", "seconds": 91.0, "config": "gpt2-small",
                                      "precision": "bf16-mixed", "checkpointing": False, "planned_micro_batch": 64,
                                      "planned_runs": True, "memplan_max_micro_batch": 124, "suggest_seconds": 18.6,
                                      "probes": [{"micro_batch": 64, "fits": True, "max_reserved": 70 * MiB,
                                                  "nvml_process_peak": 80 * MiB, "seconds": 15.0},
                                                 {"micro_batch": 130, "fits": True, "max_reserved": 140 * MiB,
                                                  "nvml_process_peak": 150 * MiB, "seconds": 14.8}],
                                      "error": "TimeoutExpired: probe gpt2-small 142"},
        "callback_overhead": {"status": "skipped: out of time"},
        "plan_vs_bisect_cnn": {"status": "skipped: out of time"}})
    (folder / "part2.json").write_text(json.dumps(part2))
    out = tmp_path / "results"
    gpu_results.convert(folder, out)
    pvb, cb = (out / "plan_vs_bisect_gpu.md").read_text(), (out / "callback_gpu.md").read_text()
    assert ("| gpt2-small | bf16-mixed | False | 64 (runs) | 124 (not measured) | not measured (search cut short; "
            "130 ran) | not measured | 18.6 | not measured (not measured) | not measured | not measured |") in pvb
    assert "| gpt2-small | 130 | runs | 140.00 MiB | 150.00 MiB | 14.8 |" in pvb
    assert "`plan_vs_bisect_cnn`: not measured (skipped: out of time" in pvb and "| None |" not in pvb
    assert "`callback_overhead`: not measured (skipped: out of time" in cb
    assert "`oom_retry`: **error** after 24 s: RuntimeError: gpu_probes oom-retry exited 1: boom" in cb
    for md in out.glob("*.md"):
        text = md.read_text()
        assert not re.search(r"\bNone\b|\| - \|", text), (md.name, text)


TRACEBACK = """Traceback (most recent call last):
[rank0]:   File "/work/main/benchmarks/gpu_extra.py", line 272, in estimate_gap
[rank0]:     est = estimate(case.build, ...)
[rank0]:     raise AssertionError(
[rank0]: AssertionError: Expects the parameter to already be moved to device cpu
[rank0]: but got cuda:0
"""


def _gap_truth(allocated, reserved):
    return {"device": "cuda", "max_allocated": allocated, "max_reserved": reserved,
            "steady_max_allocated": allocated, "steady_max_reserved": reserved}


def test_memory_gaps_give_signed_errors_and_each_failure_in_one_line(tmp_path):
    """Part 3 in the campaign's layout (figures chosen here): truth vs native and emulated, allocated and
    reserved; a failed estimate's traceback tail becomes its exception's line; a case the part never reached
    reads "not measured"."""
    rows = {"vit-l16-fp32-b16": {"truth": _gap_truth(1000 * MiB, 1100 * MiB),
                                 "native": _estimate(990 * MiB, 1100 * MiB, 1900 * MiB),
                                 "emulated": _estimate(1010 * MiB, 1067 * MiB, 1900 * MiB)},
            "fsdp2-1gpu-fp32": {"truth": _gap_truth(2000 * MiB, 2200 * MiB), "native": {"error": TRACEBACK},
                                "emulated": _estimate(2040 * MiB, 2200 * MiB, 3000 * MiB)}}
    part3 = {"format": 1, "part": 3, "dry_run": False, "started": "2026-12-01T00:05:00+00:00", "sections": {
        "environment": ENV, "memory_gaps": {"status": "done", "cases": [*rows, "autocast-cache-bert-b8"], "rows": rows}}}
    folder = tmp_path / "raw"
    folder.mkdir()
    (folder / "part3.json").write_text(json.dumps(part3))
    out = tmp_path / "results"
    assert gpu_results.convert(folder, out) == ["memory_gaps_gpu.json", "memory_gaps_gpu.md"]
    text = (out / "memory_gaps_gpu.md").read_text()
    assert "NVIDIA H100 80GB HBM3" in text and "driver 580.159.04" in text and "(campaign part 3)" in text
    assert ("| vit-l16-fp32-b16 | 1000.00 MiB | 990.00 MiB | -1.00% | 1010.00 MiB | +1.00% | 1.07 GiB | 1.07 GiB | "
            "+0.00% | 1.04 GiB | -3.00% |") in text
    assert "| fsdp2-1gpu-fp32 | 1.95 GiB | estimate failed | failed | 1.99 GiB | +2.00% |" in text
    assert ("- fsdp2-1gpu-fp32 (native): AssertionError: Expects the parameter to already be moved to device cpu "
            "but got cuda:0\n") in text and "Traceback" not in text and "[rank0]" not in text
    assert "| autocast-cache-bert-b8 | not measured (no result" in text
    summary = json.loads((out / "memory_gaps_gpu.json").read_text())["summary"]
    assert summary["native_err_allocated"] == {"n": 1, "median_abs": pytest.approx(0.01), "worst": pytest.approx(-0.01)}
    assert summary["emulated_err_reserved"]["worst"] == pytest.approx(-0.03)


def test_measured_step_times_meet_the_planners_prediction(tmp_path):
    """Part 4 in the campaign's layout, as a dry run writes it (gpu_extra's tiny models, so the predictions'
    traces take seconds): each row gets predict_step's figure for its setting and the signed error; a failed
    setting and a section that never started read "not measured"."""
    def row(precision, micro, ckpt, seconds):
        return {"model": "gpt2-small", "precision": precision, "micro_batch": micro, "checkpointing": ckpt,
                "step_seconds_median": seconds, "step_seconds": [seconds], "parameters": 1, "tf32_matmul": False}

    rows = [row("bf16-mixed", 1, False, 0.002), row("bf16-mixed", 2, False, 0.003), row("bf16-mixed", 2, True, 0.004),
            row("32-true", 2, False, 0.005),
            {**row("32-true", 2, True, 0.0), "error": "OutOfMemoryError: CUDA out of memory."}]
    for r in rows[-1:]:
        del r["step_seconds_median"]
    part4 = {"format": 1, "part": 4, "dry_run": True, "started": "2026-12-01T00:10:00+00:00", "sections": {
        "environment": {**ENV, "gpu": None},
        "step_time_gpt2-small": {"status": "done", "rows": rows, "exit": 0},
        "step_time_vit-l16": {"status": "skipped: out of time"}}}
    folder = tmp_path / "raw"
    folder.mkdir()
    (folder / "part4.json").write_text(json.dumps(part4))
    out = tmp_path / "results"
    gpu_results.convert(folder, out)
    got = json.loads((out / "step_time_gpu.json").read_text())
    assert got["gpu"] == gpu_extra_results.DRY_RUN_GPU
    timed = [r for r in got["rows"] if "predicted" in r]
    assert len(timed) == 4
    for r in timed:
        assert r["error"] == pytest.approx(r["predicted"]["step_seconds"] / r["step_seconds_median"] - 1)
        assert r["predicted"]["step_seconds"] == pytest.approx(
            r["predicted"]["micro_step_seconds"] + r["predicted"]["optimizer_seconds"])
    by = {(r["precision"], r["micro_batch"], r["checkpointing"]): r["predicted"]["step_seconds"] for r in timed}
    assert by["bf16-mixed", 2, True] > by["bf16-mixed", 2, False]  # the blocks' forward runs again
    errors = [r["error"] for r in timed]
    assert got["summary"]["worst"] == max(errors, key=abs) and got["summary"]["n"] == 4
    text = (out / "step_time_gpu.md").read_text()
    assert "DRY RUN on CPU" in text and "The traces ran on CPU" in text
    assert f"| gpt2-small | bf16-mixed | 2 | full | 0.0040 | {by['bf16-mixed', 2, True]:.4f} | " in text
    assert "| gpt2-small | 32-true | 2 | full | not measured | not measured | not measured |" in text
    assert "- gpt2-small 32-true micro-batch 2: OutOfMemoryError: CUDA out of memory." in text
    assert "`step_time_vit-l16`: not measured (skipped: out of time" in text


def test_step_times_are_predicted_for_the_measured_gpu_named_by_nvml():
    assert gpu_extra_results.catalog_gpu({"gpu": {"name": "NVIDIA H200"}}) == "H200"
    with pytest.raises(ValueError, match="'NVIDIA Imaginary 1'.*catalog"):
        gpu_extra_results.catalog_gpu({"gpu": {"name": "NVIDIA Imaginary 1"}})
