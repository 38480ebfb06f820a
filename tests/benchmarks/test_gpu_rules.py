"""benchmarks/gpu_rules.py: the H200's op readings of cub sorts and flash backward (committed raw file) against the
rules on this tree, and the script's CPU dry run."""
from __future__ import annotations

import json

from benchmarks.gpu_rules import decode, encode, report, run
from benchmarks.results_io import RESULTS

RAW = RESULTS / "gpu_rules_raw" / "gpu_rules_h200.json"


def test_every_rule_requests_what_the_h200_requested_for_the_same_arguments():
    result = report(RAW)
    assert result["n"] >= 20 and not result["errors"]
    differs = [(r["case"], r["gpu_requested_peak"], r["rule_requested_peak"]) for r in result["rows"]
               if r["gpu_requested_peak"] != r["rule_requested_peak"]]
    assert not differs
    committed = json.loads((RESULTS / "gpu_rules.json").read_text())
    assert committed["exact"] == result["exact"] and committed["n"] == result["n"]


def test_the_dry_run_reads_a_sort_and_its_rule():
    data = run(cpu=True)
    assert not data["errors"]
    (row,) = data["rows"]
    assert row["op"].startswith("aten.sort") and row["rule_requested_peak"] > 0 and row["gpu_transient"] == 0
    args = decode(encode(([1, 2.5, None], {"dim": 0})))
    assert args == [[1, 2.5, None], {"dim": 0}]
