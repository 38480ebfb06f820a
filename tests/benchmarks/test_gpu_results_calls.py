"""benchmarks.gpu_results when a part came in several calls on different memplan commits: each row names the call
that measured it and that call's commit, a file renders the environment of the calls its own section came from
(a follow-up that did not re-measure a section leaves its file as it was), a call run on none of a section's cases
does not hide that the section was never measured, and a run under a non-default allocator setting says so in its
heading. Parts written here in the campaign's layout; the committed H200 files are checked against their raw
folders at the end."""
from __future__ import annotations

import json
import os
from pathlib import Path

from benchmarks import gpu_results
from benchmarks.accuracy_gpu import make_row
from benchmarks.gpu_accuracy_results import row_runs
from benchmarks.gpu_fidelity import allocator_settings
from benchmarks.gpu_report import load_parts, section
from memplan.estimator.allocator_config import AllocatorConfig
from memplan.units import MiB

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
OLD, NEW = "0123456789abcdef", "fedcba9876543210"


def _env(commit: str, alloc_conf: str | None = None) -> dict:
    return {"status": "done", "torch": "2.11.0+cu130", "driver": "580.159.04", "memplan_commit": commit,
            "packages": {"transformers": "5.17.0"},
            "gpu": {"name": "NVIDIA H200", "total_bytes": 150754820096, "compute_capability": [9, 0]},
            "env": {"PYTORCH_CUDA_ALLOC_CONF": alloc_conf, "PYTORCH_ALLOC_CONF": None}}


def _row(case: str, estimate_mib: int) -> dict:
    truth = {"device": "cuda", "max_allocated": 100 * MiB, "max_reserved": 120 * MiB, "nvml_process_peak": 900 * MiB}
    est = {"peak_allocated": estimate_mib * MiB, "peak_reserved": 120 * MiB, "device_total": 900 * MiB}
    return make_row(case, truth, est, est)


def _write(folder: Path, name: str, env: dict, sections: dict, started: str) -> None:
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(json.dumps({"format": 1, "part": 1, "dry_run": False, "started": started,
                                           "sections": {"environment": env, **sections}}))


def _campaign(tmp_path: Path) -> Path:
    """part1 (old commit): validate, and mlp-b64 and gpt2-b4 at +5 %, the extra variants cut off; part1b (new
    commit): gpt2-b4 again at +1 %, validate not asked, the extra variants run on none of their cases."""
    folder = tmp_path / "raw"
    _write(folder, "part1.json", _env(OLD), {
        "validate": {"status": "done", "calibration_file": None},
        "accuracy_zoo": {"status": "done", "cases": ["mlp-b64", "gpt2-b4"],
                         "rows": [_row("mlp-b64", 105), _row("gpt2-b4", 105)]},
        "accuracy_extra": {"status": "skipped: out of time"}}, "2026-11-26T09:00:00+00:00")
    _write(folder, "part1b.json", _env(NEW), {
        "validate": {"status": "skipped: not asked (--only)"},
        "accuracy_zoo": {"status": "done", "cases": ["gpt2-b4"], "rows": [_row("gpt2-b4", 101)]},
        "accuracy_extra": {"status": "done", "cases": [], "rows": [], "out_of_time": []}}, "2026-11-26T23:00:00+00:00")
    return folder


def test_each_row_names_the_call_and_commit_that_measured_it(tmp_path):
    parts = load_parts(_campaign(tmp_path))
    assert {c: r["file"] for c, r in row_runs(parts).items()} == {"mlp-b64": "part1.json", "gpt2-b4": "part1b.json"}
    out = tmp_path / "results"
    gpu_results.convert(tmp_path / "raw", out)
    text = (out / "accuracy_gpu.md").read_text()
    assert ("measured in 2 calls of campaign part 1: part1.json (2026-11-26T09:00:00+00:00, memplan 0123456789, "
            "1 rows), part1b.json (2026-11-26T23:00:00+00:00, memplan fedcba9876, 1 rows)") in text
    assert "| gpt2-b4 | 100.00 MiB | +1.00% |" in text and text.rstrip().endswith("| part1b.json (fedcba9) |")
    assert "| mlp-b64 | 100.00 MiB | +5.00% |" in text and "| part1.json (0123456) |" in text
    assert "| part1.json | 0123456789 | 1 | 5.00% / 5.00% |" in text  # the summary per call
    rows = json.loads((out / "accuracy_gpu.json").read_text())["rows"]
    assert [(r["case"], r["run"]["memplan_commit"]) for r in rows] == [("mlp-b64", OLD), ("gpt2-b4", NEW)]


def test_a_section_no_later_call_measured_keeps_its_own_calls_environment(tmp_path):
    gpu_results.convert(_campaign(tmp_path), tmp_path / "results")
    validate = json.loads((tmp_path / "results" / "validate_gpu.json").read_text())["environment"]
    assert validate["memplan_commit"] == OLD and validate["files"] == ["part1.json"]
    assert "measured 2026-11-26T09:00:00+00:00 (campaign part 1) on memplan 0123456789" in (
        tmp_path / "results" / "validate_gpu.md").read_text()


def test_a_call_run_on_none_of_a_sections_cases_leaves_it_not_measured(tmp_path):
    parts = load_parts(_campaign(tmp_path))
    assert section(parts, "accuracy_extra")["status"] == "skipped: out of time"
    gpu_results.convert(tmp_path / "raw", tmp_path / "results")
    assert "`accuracy_extra`: not measured (skipped: out of time" in (
        tmp_path / "results" / "accuracy_gpu.md").read_text()


def test_a_run_under_expandable_segments_says_so_in_its_heading(tmp_path):
    folder = tmp_path / "raw"
    _write(folder, "part1.json", _env(NEW, "expandable_segments:True"), {
        "accuracy_zoo": {"status": "done", "cases": ["mlp-b64"], "rows": [_row("mlp-b64", 100)]}},
        "2026-11-26T23:00:00+00:00")
    assert gpu_results.convert(folder, tmp_path / "r", card="expandable") == [
        "accuracy_gpu_expandable.json", "accuracy_gpu_expandable.md"]
    assert (tmp_path / "r" / "accuracy_gpu_expandable.md").read_text().startswith(
        "# memplan's estimates vs a real GPU, on the zoo, under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True\n")


def test_fidelity_estimates_under_the_campaigns_allocator_setting_and_restores_this_ones(monkeypatch):
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:64")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    with allocator_settings(_env(NEW, "expandable_segments:True")):
        assert "PYTORCH_ALLOC_CONF" not in os.environ  # torch would read it first: the campaign had none
        assert AllocatorConfig.from_env().expandable_segments
    with allocator_settings(_env(NEW)):
        assert AllocatorConfig.from_env() == AllocatorConfig()
    assert os.environ["PYTORCH_ALLOC_CONF"] == "max_split_size_mb:64" and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ


H200_RAW, EXPANDABLE_RAW = RESULTS / "gpu_campaign_raw", RESULTS / "gpu_campaign_raw_expandable"


def test_the_committed_h200_accuracy_is_each_cases_newest_reading():
    """part1c over part1b over part1: each committed row is the newest call's, with that call's commit."""
    committed = json.loads((RESULTS / "accuracy_gpu.json").read_text())
    calls = [json.loads((H200_RAW / f).read_text()) for f in ("part1.json", "part1b.json", "part1c.json")]
    newest = {}
    for name, data in zip(("part1.json", "part1b.json", "part1c.json"), calls):
        for r in data["sections"]["accuracy_zoo"]["rows"]:
            newest[r["case"]] = (name, data["sections"]["environment"]["memplan_commit"], r["truth"])
    assert sorted(r["case"] for r in committed["rows"]) == sorted(newest)
    for r in committed["rows"]:
        assert (r["run"]["file"], r["run"]["memplan_commit"], r["truth"]) == newest[r["case"]], r["case"]
    validate = json.loads((RESULTS / "validate_gpu.json").read_text())["environment"]
    assert validate["memplan_commit"] == calls[0]["sections"]["environment"]["memplan_commit"]


def test_the_committed_expandable_accuracy_is_its_raw_run_under_its_setting():
    committed = json.loads((RESULTS / "accuracy_gpu_expandable.json").read_text())
    raw = json.loads((EXPANDABLE_RAW / "part1.json").read_text())["sections"]
    assert committed["environment"]["env"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert [r["truth"] for r in committed["rows"]] == [r["truth"] for r in raw["accuracy_zoo"]["rows"]]
    assert "expandable_segments:True" in (RESULTS / "accuracy_gpu_expandable.md").read_text().splitlines()[0]
