"""benchmarks/gpu_context_ops.py: every op it reads on a GPU runs, forward and backward, on CPU (so the script works
when a GPU session runs it), and the committed H200 readings are the ones memplan's context model cites."""
from __future__ import annotations

import json

import pytest

from benchmarks.gpu_context_ops import OPS, _run
from benchmarks.results_io import RESULTS
from memplan.estimator.cuda.overheads import cuda_overheads
from memplan.units import MiB


@pytest.mark.parametrize("op", OPS)
def test_every_op_runs_forward_and_backward(op):
    _run(op, device="cpu")


def test_the_committed_readings_are_what_the_context_model_adds():
    rows = {r["op"]: r for name in ("gpu_context_ops_h200", "gpu_context_ops_sdpa_h200")
            for r in json.loads((RESULTS / f"{name}.json").read_text())}
    hopper = cuda_overheads((9, 0), env={})
    assert rows["sdpa_bf16"]["grew_mib"] == rows["sdpa_fp16"]["grew_mib"] == hopper.attention_context_bytes / MiB
    assert rows["sdpa_bf16_masked"]["grew_mib"] <= hopper.cudnn_context_bytes / MiB  # within the larger of the two
    assert all(rows[op]["grew_mib"] == 0 for op in ("linear_bf16", "softmax_bf16", "layer_norm_bf16", "gelu_bf16"))
