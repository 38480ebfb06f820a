"""benchmarks.gpu_results on a campaign folder a second card's calls left: a part in several files (part1.json,
then a follow-up call's part1b.json), the kernel profile and part 5's readings, rendered under names ending with
the card so the first card's files stay as they are. Parts written here in the campaign's layout, figures chosen
here; the committed H100 files are checked against their raw folder at the end."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import gpu_profile_results, gpu_results
from benchmarks.accuracy_gpu import make_row
from benchmarks.gpu_report import load_parts, section
from memplan.units import MiB

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
ENV = {"status": "done", "python": "3.12.3", "torch": "2.11.0+cu130", "torch_cuda": "13.0", "cudnn": 91900,
       "driver": "580.159.04", "cuda_driver": "13.0", "packages": {"pytorch-lightning": "2.6.6", "transformers": "5.17.0"},
       "gpu": {"name": "NVIDIA H100 80GB HBM3", "total_bytes": 85520809984, "compute_capability": [9, 0]},
       "memplan_commit": "0123456789abcdef"}
NOT_ASKED = {"status": "skipped: not asked (--only)"}


def _row(case: str, allocated_mib: int, estimate_mib: int) -> dict:
    truth = {"device": "cuda", "max_allocated": allocated_mib * MiB, "max_reserved": (allocated_mib + 20) * MiB,
             "nvml_process_peak": (allocated_mib + 780) * MiB}
    est = {"peak_allocated": estimate_mib * MiB, "peak_reserved": (allocated_mib + 20) * MiB,
           "device_total": (allocated_mib + 780) * MiB}
    return make_row(case, truth, est, est)


def _write(folder: Path, name: str, part: int, sections: dict, started: str = "2026-12-01T00:00:00+00:00") -> None:
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(json.dumps({"format": 1, "part": part, "dry_run": False, "started": started,
                                           "sections": {"environment": ENV, **sections}}))


def _campaign(tmp_path: Path) -> Path:
    """Part 1 whose extra variants were cut off, and a follow-up call (part1b) that measured them; part 2 whose
    cnn bisection was skipped, and a follow-up (part2b) that ran it."""
    folder = tmp_path / "raw"
    _write(folder, "part1.json", 1, {
        "accuracy_zoo": {"status": "done", "cases": ["mlp-b64"], "rows": [_row("mlp-b64", 100, 101)],
                         "out_of_time": [], "missing": []},
        "accuracy_extra": {"status": "done", "cases": ["gpt2-b4-16mixed-gpu", "bert-b8-16mixed-gpu"],
                           "rows": [_row("gpt2-b4-16mixed-gpu", 1000, 970)], "summary": {"stale": True},
                           "out_of_time": ["bert-b8-16mixed-gpu"], "missing": ["bert-b8-16mixed-gpu"]}})
    _write(folder, "part1b.json", 1, {
        "accuracy_zoo": NOT_ASKED,
        "accuracy_extra": {"status": "done", "cases": ["bert-b8-16mixed-gpu"],
                           "rows": [_row("bert-b8-16mixed-gpu", 300, 303)], "out_of_time": [], "missing": []}},
           started="2026-12-01T01:00:00+00:00")
    bisect = {"status": "done", "config": "cnn", "precision": "32-true", "checkpointing": False,
              "planned_micro_batch": 900, "planned_runs": True, "memplan_max_micro_batch": 1000,
              "memplan_max_runs": True, "truth_max_micro_batch": 1010, "truth_first_oom": 1011, "ratio": 1000 / 1010,
              "suggest_seconds": 5.0, "batch_size_finder_seconds": 100.0, "batch_size_finder_batch": 1024,
              "suggest_over_batch_size_finder": 0.05}
    _write(folder, "part2.json", 2, {"plan_vs_bisect_cnn": {"status": "skipped: out of time"}})
    _write(folder, "part2b.json", 2, {"plan_vs_bisect_cnn": bisect})
    return folder


def test_a_follow_up_call_adds_the_cases_an_earlier_call_left_and_keeps_what_it_was_not_asked(tmp_path):
    parts = load_parts(_campaign(tmp_path))
    extra = section(parts, "accuracy_extra")
    assert [r["case"] for r in extra["rows"]] == ["gpt2-b4-16mixed-gpu", "bert-b8-16mixed-gpu"]
    assert extra["out_of_time"] == [] and extra["missing"] == [] and "summary" not in extra
    assert [r["case"] for r in section(parts, "accuracy_zoo")["rows"]] == ["mlp-b64"]  # not wiped by "not asked"
    assert section(parts, "plan_vs_bisect_cnn")["status"] == "done"  # the follow-up's run replaces the skip
    assert parts[1]["files"] == ["part1.json", "part1b.json"]


def test_the_second_cards_files_name_it_and_leave_the_first_cards_alone(tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    (out / "accuracy_gpu.md").write_text("the first card's\n")
    written = gpu_results.convert(_campaign(tmp_path), out, card="h100")
    assert written == ["accuracy_gpu_h100.json", "accuracy_gpu_h100.md", "plan_vs_bisect_gpu_h100.json",
                       "plan_vs_bisect_gpu_h100.md"]
    assert (out / "accuracy_gpu.md").read_text() == "the first card's\n"
    text = (out / "accuracy_gpu_h100.md").read_text()
    assert "Raw figures: `accuracy_gpu_h100.json`" in text
    assert "measured in 2 calls of campaign part 1: part1.json (" in text and "part1b.json (" in text
    assert "3 cases, 3 with a measured truth" in text
    assert "cut off" not in text  # part1's cut-off cases were measured by part1b
    # mlp +1 %, gpt2 -3 %, bert +1 %: the rows of both calls summarised together
    assert "| native_err_allocated | 1.00% | 3.00% | -3.00% | 3 | NOT met |" in text
    assert "| cnn | 32-true | False | 900 (runs) | 1000 (runs) | 1010 (1011) | 99% |" in (
        out / "plan_vs_bisect_gpu_h100.md").read_text()


def test_a_card_name_that_is_no_file_name_is_refused(tmp_path, capsys):
    assert gpu_results.main([str(_campaign(tmp_path)), "--results", str(tmp_path / "r"), "--card", "../h100"]) == 2
    assert "--card '../h100'" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def _profile_setting(precision: str, wall: float, busy: float, annotation_us: float) -> dict:
    return {"precision": precision, "micro_batch": 8, "wall_seconds_per_step": wall, "gpu_busy_seconds_per_step": busy,
            "kernels_per_step": 1000.0, "aten_ops_per_step": 4000.0,
            "top_kernels": [["void gemm_kernel<bf16>(Params)", 36.0, 30000.0],
                            ["Optimizer.step#AdamW.step", 1.0, annotation_us],
                            ["void elementwise_kernel<float>(int)", 300.0, 10000.0]],
            "top_aten_ops_device_us": [["aten::mm", 99.0, 30000.0, 3000.0]]}


def test_the_kernel_profile_counts_the_gpus_busy_time_without_the_optimizers_annotation_span(tmp_path):
    folder = tmp_path / "raw"
    _write(folder, "part4.json", 4, {"kernel_profile": {"status": "done", "steps_profiled": 3, "settings": [
        _profile_setting("bf16-mixed", 0.1, 0.044, 4000.0)]}})
    out = tmp_path / "results"
    assert gpu_results.convert(folder, out, card="h100") == ["kernel_profile_gpu_h100.json",
                                                             "kernel_profile_gpu_h100.md"]
    (row,) = json.loads((out / "kernel_profile_gpu_h100.json").read_text())["rows"]
    assert row["gpu_busy_seconds_per_step"] == pytest.approx(0.040)  # 44 ms less the 4 ms annotation span
    assert row["gpu_idle_fraction"] == pytest.approx(0.6)
    text = (out / "kernel_profile_gpu_h100.md").read_text()
    assert "| bf16-mixed | 8 | 100.0 | not measured | 40.0 | 60% | not measured | 1000 | 4000 |" in text
    assert "| `void gemm_kernel<bf16>(Params)` | 36 | 30000 | 75.0% |" in text
    assert "Optimizer.step#AdamW.step" not in text


def _conv(what: str, dtype: str, transient: int) -> dict:
    return {"source": "cnn", "dims": 2, "c_in": 1, "c_out": 32, "kernel": [3, 3], "stride": [1, 1], "padding": [1, 1],
            "groups": 1, "bias": False, "sample": [1, 50, 180], "transposed": False, "batch": 32, "dtype": dtype,
            "what": what, "input_bytes": MiB, "output_bytes": 2 * MiB, "before": 0, "peak": 0, "after": 0,
            "transient": transient, "reserved_growth": 0}


def test_part_five_lists_the_largest_transients_of_the_grid_and_of_each_case(tmp_path):
    folder = tmp_path / "raw"
    grid = {"cudnn": 91900, "cudnn_benchmark": False, "allow_tf32": True, "errors": [],
            "rows": [_conv("forward", "float32", 0), _conv("backward input+weight", "bfloat16", 48 * MiB),
                     _conv("forward", "bfloat16", 3 * MiB)]}
    folder.mkdir()
    (folder / "conv_grid.json").write_text(json.dumps(grid))
    _write(folder, "part5.json", 5, {
        "conv_grid": {"status": "done", "measurements": 3, "errors": []},
        "op_profiles": {"status": "done", "cases": ["cnn-b32", "gru-b32"], "summaries": {
            "cnn-b32": {"case": "cnn-b32", "precision": "32-true", "checkpointing": False, "batch": 32, "ops": 500,
                        "peak_allocated_step2": 300 * MiB, "peak_allocated": 300 * MiB, "max_reserved_seen": 400 * MiB,
                        "largest_transient_by_op": {"aten.convolution.default": 17 * MiB,
                                                    "aten.convolution_backward.default": 35 * MiB}},
            "gru-b32": {"error": "Traceback ...\nRuntimeError: CUDA error"}}}})
    out = tmp_path / "results"
    gpu_results.convert(folder, out, card="h100")
    text = (out / "op_readings_gpu_h100.md").read_text()
    summary = gpu_profile_results.conv_summary(grid)
    assert summary["with_transient"] == 2 and [r["transient"] for r in summary["largest"]] == [48 * MiB, 3 * MiB]
    assert "| backward input+weight, bfloat16 | 1 | 1 | 48.00 MiB |" in text
    assert ("| cnn-b32 | 32-true | False | 32 | 500 | 300.00 MiB | 400.00 MiB | convolution_backward.default: "
            "35.00 MiB; convolution.default: 17.00 MiB |") in text
    assert "| gru-b32 | not measured: RuntimeError: CUDA error |" in text


H100_RAW = RESULTS / "gpu_campaign_raw_h100"


@pytest.mark.skipif(not (RESULTS / "accuracy_gpu_h100.json").is_file(), reason="the H100's results not rendered")
def test_the_committed_h100_accuracy_is_its_raw_folder_rendered():
    """Every case either call measured is in the committed file, once, with the raw folder's truth."""
    committed = json.loads((RESULTS / "accuracy_gpu_h100.json").read_text())
    parts = load_parts(H100_RAW)
    raw = {r["case"]: r for name in ("accuracy_zoo", "accuracy_extra") for r in section(parts, name)["rows"]}
    assert sorted(r["case"] for r in committed["rows"]) == sorted(raw)
    assert all(r["truth"] == raw[r["case"]]["truth"] for r in committed["rows"])
    assert committed["environment"]["gpu"]["name"] == "NVIDIA H100 80GB HBM3"


def test_a_truth_at_the_searchs_cap_is_no_ratio_of_one(tmp_path):
    """No step failed up to the bisection's cap: the truth is at least the cap, memplan's ratio at most 100 %."""
    folder = _campaign(tmp_path)
    data = json.loads((folder / "part2b.json").read_text())
    data["sections"]["plan_vs_bisect_cnn"].update(truth_max_micro_batch=16384, truth_first_oom=None,
                                                  memplan_max_micro_batch=16384, ratio=1.0)
    (folder / "part2b.json").write_text(json.dumps(data))
    gpu_results.convert(folder, tmp_path / "results")
    assert "| 16384 (runs) | 16384 (none failed up to the search's cap) | <= 100% |" in (
        tmp_path / "results" / "plan_vs_bisect_gpu.md").read_text()


def test_the_kernel_profile_sets_the_busy_time_beside_the_same_step_unprofiled(tmp_path):
    from benchmarks.gpu_report import Results, environment

    step_rows = [{"model": "gpt2-small", "precision": "bf16-mixed", "micro_batch": 8, "checkpointing": False,
                  "step_seconds_median": 0.05},
                 {"model": "gpt2-small", "precision": "bf16-mixed", "micro_batch": 8, "checkpointing": True,
                  "step_seconds_median": 0.09}]
    parts = {4: {"part": 4, "sections": {"environment": ENV, "step_time_gpt2-small": {"status": "done", "rows": step_rows},
                                         "kernel_profile": {"status": "done", "steps_profiled": 3, "settings": [
                                             _profile_setting("bf16-mixed", 0.1, 0.044, 4000.0)]}}}}
    out = Results(tmp_path, "h100")
    gpu_profile_results.kernel_profile(parts, environment(parts, 4), out)
    (row,) = json.loads((tmp_path / "kernel_profile_gpu_h100.json").read_text())["rows"]
    assert row["unprofiled_step_seconds"] == 0.05 and row["busy_over_unprofiled"] == pytest.approx(0.8)
    assert "| bf16-mixed | 8 | 100.0 | 50.0 | 40.0 | 60% | 80% | 1000 | 4000 |" in (
        tmp_path / "kernel_profile_gpu_h100.md").read_text()
