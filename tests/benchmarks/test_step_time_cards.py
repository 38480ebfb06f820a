"""benchmarks/step_time_cards.py's summary and table, on hand-made rows (the traces need full-size models)."""
from __future__ import annotations

from benchmarks.step_time_cards import markdown, summary


def row(micro: int, error: float, *, checkpointing: bool = False) -> dict:
    return {"model": "gpt2-small", "precision": "bf16-mixed", "micro_batch": micro, "checkpointing": checkpointing,
            "measured_s": 0.05, "predicted": {"step_seconds": 0.05 * (1 + error), "gpu_seconds": 0.04}, "error": error}


def card(rows: list[dict]) -> dict:
    return {"card": "H100", "device": "NVIDIA H100 80GB HBM3", "catalog": "H100-80GB", "torch": "2.11.0+cu130",
            "raw": "benchmarks/results/gpu_campaign_raw_h100/part4.json", "rows": rows,
            "summary": summary([r["error"] for r in rows]), "kernel_profile": []}


def test_the_worst_error_keeps_its_sign_and_the_median_is_of_the_magnitudes():
    s = summary([0.02, -0.30, 0.10])
    assert (s["n"], s["median_abs"], s["worst"], s["median"]) == (3, 0.10, -0.30, 0.02)
    assert summary([]) is None


def test_the_before_column_is_the_same_setting_of_the_baseline_run():
    now = [row(8, -0.04), row(8, -0.09, checkpointing=True)]
    before = {"memplan": "8b5073a", "cards": [card([row(8, -0.24, checkpointing=True), row(8, -0.23)])]}
    text = markdown([card(now)], before)
    assert "| gpt2-small | bf16-mixed | 8 | none | 0.0500 | 0.0480 | 0.0400 | -4.0% | -23.0% |" in text
    assert "| gpt2-small | bf16-mixed | 8 | full | 0.0500 | 0.0455 | 0.0400 | -9.0% | -24.0% |" in text
    assert "Before (8b5073a): median |error| 23.5 %, worst -24.0 %" in text
