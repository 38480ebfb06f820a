"""benchmarks/realmodels.py: the architectures it promises, and how its summary judges the goal."""
from __future__ import annotations

from benchmarks.realmodels import CASES, summarize


def test_at_least_50_architectures_across_the_promised_families():
    assert len(CASES) >= 50
    families = {case.family for case in CASES.values()}
    assert {"decoder", "moe", "encoder", "encoder-decoder", "speech", "vision", "cnn", "state-space",
            "detection", "plain torch"} <= families
    moe = [name for name, case in CASES.items() if case.family == "moe"]
    for path in ("eager", "grouped_mm"):  # both of transformers' experts implementations
        assert sum(name.endswith(path) for name in moe) >= 3, (path, moe)


def _row(name, error, family="decoder"):
    return {"case": name, "family": family, "estimate": {}, "error": error}


def test_summary_meets_the_goal_only_when_median_worst_and_moe_do():
    rows = [_row(f"c{i}", 0.0) for i in range(9)] + [_row("moe", 0.001, "moe")]
    assert summarize(rows)["goal_met"]
    assert not summarize(rows + [_row("far", 0.05)])["goal_met"]  # worst > 3 %
    assert not summarize(rows + [_row("moe-far", -0.04, "moe")])["goal_met"]
    failed = {"case": "broken", "family": "moe", "estimate": None, "failed": "estimate"}
    summary = summarize(rows + [failed])
    assert not summary["goal_met"] and summary["failed"] == ["broken"]
    assert summary["moe"]["worst_abs_error"] == 0.001
