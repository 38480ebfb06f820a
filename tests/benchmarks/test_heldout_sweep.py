"""benchmarks/heldout_sweep.py: its cases are held out from realmodels.py, and its summary counts what it says."""
from __future__ import annotations

import functools
import json

import pytest

from benchmarks import heldout_sweep, realmodels
from benchmarks.heldout_sweep import CASES, summarize


def _architecture(build) -> object:
    """The transformers model class name a realmodels-style builder makes, or the plain-torch class/function."""
    if isinstance(build, functools.partial):
        return build.args[0] if build.func is realmodels._hf else _architecture(build.func)
    return build


def test_no_architecture_is_one_realmodels_already_checks():
    seen = {_architecture(case.build) for case in realmodels.CASES.values()}
    ours = {name: _architecture(case.build) for name, case in CASES.items()}
    assert len(set(ours.values())) >= 25
    assert not {name for name, arch in ours.items() if arch in seen}


def _row(name, error=None, failed=None):
    row = {"case": name, "family": "x", "precision": "32-true"}
    if failed:
        return {**row, "failed": failed, "error_message": "boom"}
    return {**row, "error": error}


def test_summary_counts_within_median_worst_and_keeps_failed_truths_out():
    rows = [_row("a", 0.0), _row("b", 0.0005), _row("c", -0.02), _row("d", 0.0011),
            _row("e", failed="truth"), _row("f", failed="estimate")]
    s = summarize(rows)
    assert (s["cases"], s["compared"], s["within_0.1%"]) == (6, 4, 2)
    assert s["median_abs_error"] == pytest.approx(0.0008)
    assert (s["worst_error"], s["worst_case"]) == (-0.02, "c")
    assert (s["truth_failed"], s["estimate_failed"]) == (["e"], ["f"])


def test_committed_results_summary_is_the_summary_of_its_rows():
    path = heldout_sweep.RESULTS / "heldout_sweep.json"
    report = json.loads(path.read_text())
    assert report["summary"] == summarize(report["rows"])
    assert {r["case"] for r in report["rows"]} <= set(CASES)
