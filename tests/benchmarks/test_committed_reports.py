"""The committed CPU benchmark reports are what their renderers make of the committed JSON beside them, byte for
byte: a renderer that drifts (or a module split that loses a piece of one) shows here, without re-running a
benchmark."""
from __future__ import annotations

import json

import pytest

from benchmarks.results_io import RESULTS


def _realmodels(report: dict) -> str:
    from benchmarks.realmodels import render_markdown

    return render_markdown(report)


def _heldout_sweep(report: dict) -> str:
    from benchmarks.heldout_sweep import render_markdown

    return render_markdown(report)


def _published_gpu(report: dict) -> str:
    from benchmarks.published_gpu import _markdown

    return _markdown(report["figures"], report["summary"])


def _callback_overhead(report: dict) -> str:
    from benchmarks.callback_overhead import render

    return render(report)


RENDERERS = {"realmodels": _realmodels, "heldout_sweep": _heldout_sweep, "published_gpu": _published_gpu,
             "callback_overhead": _callback_overhead}


@pytest.mark.parametrize("name", sorted(RENDERERS))
def test_the_committed_markdown_is_its_json_rendered(name):
    report = json.loads((RESULTS / f"{name}.json").read_text())
    committed = (RESULTS / f"{name}.md").read_text()
    rendered = RENDERERS[name](report)
    assert rendered == committed, f"benchmarks/results/{name}.md is not what its renderer makes of {name}.json"


def test_a_changed_figure_changes_the_rendering():
    report = json.loads((RESULTS / "realmodels.json").read_text())
    row = next(r for r in report["rows"] if "error" in r)
    before = _realmodels(report)
    row["error"] += 0.01
    assert _realmodels(report) != before
