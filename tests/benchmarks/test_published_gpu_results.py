"""benchmarks/results/published_gpu.json (issue 22 §3) holds each published figure with its source, the
conditions it was measured under and the quantity memplan compares it with, and its summary is its rows.
README's quotes of it are test_readme_figures.py's; the stand-ins of benchmarks/published_gpu.py are
test_published_gpu.py's."""
from __future__ import annotations

import statistics

import pytest
from readme_figures import results

PUBLISHED_GPU_QUANTITIES = {"max_memory_reserved": "peak_reserved", "max_memory_allocated": "peak_allocated",
                            "nvml_used": "device_total"}
PUBLISHED_GPU_CONDITIONS = {"model", "batch", "input", "precision", "optimizer", "gpu", "torch", "checkpointing", "loop"}


def test_published_gpu_results_hold_each_figure_with_its_source_conditions_and_quantity():
    figures = results("published_gpu")["figures"]
    assert len(figures) >= 10
    assert len({f["name"] for f in figures}) == len(figures)
    for f in figures:
        assert f["source"].startswith("https://") and f["quote"], f["name"]
        assert PUBLISHED_GPU_CONDITIONS <= set(f["conditions"]) and all(f["conditions"].values()), f["name"]
        assert f["memplan_field"] == PUBLISHED_GPU_QUANTITIES[f["quantity"]], f["name"]
        assert f["memplan_bytes"] == f[f["memplan_field"]] and f["published_bytes"] > 0, f["name"]
        assert f["error"] == pytest.approx(f["memplan_bytes"] / f["published_bytes"] - 1, abs=1e-12), f["name"]
        assert f["error_published_torch"] == pytest.approx(
            f["memplan_published_torch_bytes"] / f["published_bytes"] - 1, abs=1e-12), f["name"]
        if f["quantity"] == "nvml_used":  # NVML's used includes the CUDA context memplan models
            assert f["device_total"] >= f["peak_reserved"] + f["cuda_context"], f["name"]


@pytest.mark.parametrize("key, column", [("error", "memplan"), ("error_published_torch", "memplan_published_torch")])
def test_published_gpu_summary_is_its_rows(key, column):
    report = results("published_gpu")
    for subset, rows in (("goal_set", [r for r in report["figures"] if r["torch_at_least_2_1"]]),
                         ("all", report["figures"])):
        s = report["summary"][column][subset]
        errors = [abs(r[key]) for r in rows]
        assert s["figures"] == len(rows)
        assert s["median_abs_error"] == pytest.approx(statistics.median(errors), abs=1e-12)
        assert s["worst_abs_error"] == pytest.approx(max(errors), abs=1e-12)
