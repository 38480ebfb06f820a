"""benchmarks/gpu_rules.py: the H200's op readings of cub sorts and flash backward (committed raw file) against the
rules on this tree, and the script's CPU dry run."""
from __future__ import annotations

import json

from benchmarks.gpu_rules import _temporaries, decode, encode, report, run
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


def test_a_block_at_an_address_freed_earlier_is_no_temporary():
    """The H200's first embedding reading counted the op's output as a temporary: the allocator gave it the address
    of a block the sort had freed. Only a free after the allocation makes a block temporary."""
    events = [{"action": "alloc", "addr": 1, "size": 100}, {"action": "free_requested", "addr": 1, "size": 100},
              {"action": "alloc", "addr": 1, "size": 400},  # the output, kept
              {"action": "alloc", "addr": 2, "size": 50}, {"action": "free_requested", "addr": 2, "size": 50}]
    assert _temporaries(events) == ([100, 50], 100)


def test_a_mask_is_recorded_with_its_count_so_the_report_recomputes_count_dependent_rules():
    """masked_scatter's backward selects the mask's set elements (cases MASKED_SCATTERS, not yet read on a GPU): the
    report re-computes the rule from the recorded arguments, so a mask keeps its count (an expanded one too)."""
    import torch

    from memplan.estimator.cuda.op_scratch import cuda_op_scratch

    ids_mask = torch.zeros(4, 64, 1, dtype=torch.bool)
    ids_mask[:, 1:17] = True
    mask = ids_mask.expand(4, 64, 32)
    decoded = decode(encode(mask))
    assert decoded.shape == mask.shape and int(torch.count_nonzero(decoded)) == 4 * 16 * 32
    assert decoded.stride() == mask.stride()
    transposed = decode(encode(torch.ones(32, 64, dtype=torch.bool).t()))
    assert transposed.stride() == (1, 64) and int(torch.count_nonzero(transposed)) == 32 * 64
    args = (torch.empty(4, 64, 32, device="meta"), mask, [4 * 16, 32])
    op = torch.ops.aten.masked_scatter_backward.default
    assert cuda_op_scratch(op, decode(encode(args)), {}) == cuda_op_scratch(op, args, {})
    assert cuda_op_scratch(op, args, {})[0][0] == 4 * 16 * 32 * 3 * 8  # the nonzero of the counted elements
