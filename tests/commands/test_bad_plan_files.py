"""Bad plan files (MemoryPlanner(plan=...), `memplan validate --plan`), each refused with a message that names the
plan field and what was wrong, before anything is traced; files that are not a plan, or not a regular file.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from refusals import (
    BASE,
    DELETE,
    assert_refused,
    no_gpu_and_no_trace,  # noqa: F401  (autouse)
    run,
    write_config,
)

PLAN = {
    "format": 1, "gpu_name": "A100-80GB", "gpus": [], "nodes": 1, "world_size": 2, "micro_batch_size": 8,
    "accumulate_grad_batches": 4, "global_batch_size": 64, "precision": "bf16-mixed", "gradient_checkpointing": False,
    "strategy": "ddp", "predicted_peak_bytes": 1 << 30, "device_budget_bytes": 70 << 30,
    "host_bytes_per_rank": 3 << 30,
}

ALTERNATIVE = {"world_size": 1, "micro_batch_size": 8, "accumulate_grad_batches": 8, "precision": "bf16-mixed",
               "gradient_checkpointing": False, "predicted_peak_bytes": 1 << 30, "relative_speed": 0.5, "fits": True}

PLAN_CASES = [
    ("plan-micro-batch-bool", {"micro_batch_size": True}, "Plan.micro_batch_size must be a positive int; got True"),
    ("plan-micro-batch-0", {"micro_batch_size": 0}, "Plan.micro_batch_size must be a positive int"),
    ("plan-micro-batch-str", {"micro_batch_size": "8"}, "Plan.micro_batch_size must be a positive int"),
    ("plan-micro-batch-float", {"micro_batch_size": 8.0}, "Plan.micro_batch_size must be a positive int"),
    ("plan-nodes-0", {"nodes": 0}, "Plan.nodes must be a positive int"),
    ("plan-accumulate-bool", {"accumulate_grad_batches": False}, "Plan.accumulate_grad_batches must be a positive"),
    ("plan-global-batch-product", {"global_batch_size": 63}, "Plan.global_batch_size must equal"),
    ("plan-world-nodes", {"nodes": 3, "world_size": 2, "accumulate_grad_batches": 4}, "Plan.world_size (2) must be a "
                                                                                       "multiple of nodes (3)"),
    ("plan-precision", {"precision": "fp16"}, "Plan.precision must be a Lightning precision"),
    ("plan-precision-64", {"precision": "64-true"}, "Plan.precision '64-true': Lightning runs it"),
    ("plan-checkpointing", {"gradient_checkpointing": "yes"}, "Plan.gradient_checkpointing must be true or false"),
    ("plan-strategy", {"strategy": "horovod"}, "Plan.strategy must be one of"),
    ("plan-gpus-str", {"gpus": "0,1"}, "Plan.gpus must be a list"),
    ("plan-gpus-negative", {"gpus": [0, -1]}, "Plan.gpus must be a list of CUDA indices"),
    ("plan-peak-negative", {"predicted_peak_bytes": -1}, "Plan.predicted_peak_bytes must be an int >= 0"),
    ("plan-gpu-name", {"gpu_name": ""}, "Plan.gpu_name must be a non-empty string"),
    ("plan-gpu-total", {"gpu_total_bytes": "80GB"}, "Plan.gpu_total_bytes must be a positive int"),
    ("plan-fingerprint", {"model_fingerprint": 12}, "Plan.model_fingerprint must be a string"),
    ("plan-missing", {"micro_batch_size": DELETE}, "plan file lacks micro_batch_size"),
    ("plan-unknown", {"micro_batch": 8}, "plan file has unknown keys ['micro_batch']"),
    ("plan-format", {"format": 2}, "plan file format 2 is not supported"),
    ("plan-alternatives", {"alternatives": [{"world_size": 1}]}, "Plan.alternatives[0] lacks micro_batch_size"),
    ("plan-alternatives-unknown", {"alternatives": [{**ALTERNATIVE, "speed": 1}]},
     "Plan.alternatives[0] has unknown keys ['speed']"),
    ("plan-alternatives-not-object", {"alternatives": [ALTERNATIVE, 3]}, "Plan.alternatives[1] must be an object"),
    ("plan-alternatives-bad-field", {"alternatives": [{**ALTERNATIVE, "fits": "yes"}]},
     "Plan.alternatives[0].fits must be true or false"),
    ("plan-alternatives-precision", {"alternatives": [{**ALTERNATIVE, "precision": "fp8"}]},
     "Plan.alternatives[0].precision must be a Lightning precision"),
    ("plan-micro-batch-10e30", {"micro_batch_size": 10**30, "global_batch_size": 8 * 10**30},
     "Plan.micro_batch_size must be a whole number from 1 to 16,777,216; got a 31-digit number"),
    ("plan-world-huge", {"world_size": 10**7, "accumulate_grad_batches": 1, "micro_batch_size": 1,
                         "global_batch_size": 10**7}, "Plan.world_size must be a whole number from 1 to 262,144"),
    ("plan-gpus-per-node-huge", {"world_size": 128, "accumulate_grad_batches": 1, "micro_batch_size": 1,
                                 "global_batch_size": 128}, "Plan.world_size / Plan.nodes must be a whole number from 1 to 64"),
    ("plan-gpus-twice", {"gpus": [0, 0]}, "Plan.gpus names a GPU twice"),
    ("plan-peak-huge", {"predicted_peak_bytes": 10**30}, "Plan.predicted_peak_bytes must be a whole number from 0"),
    ("plan-speed", {"relative_speed": "fast"}, "Plan.relative_speed must be a positive number"),
    ("plan-format-string", {"format": "1"}, "plan file format must be the number 1 (written unquoted"),
]


@pytest.mark.parametrize(("changes", "fragment"), [c[1:] for c in PLAN_CASES], ids=[c[0] for c in PLAN_CASES])
def test_bad_plan_files_are_refused_by_field(tmp_path, changes, fragment):
    from pytorch_lightning.utilities.exceptions import MisconfigurationException

    from memplan.callback.apply import load_plan

    plan = {k: v for k, v in {**PLAN, **changes}.items() if v is not DELETE}
    path = tmp_path / "bad.plan.json"
    path.write_text(json.dumps(plan))
    with pytest.raises(MisconfigurationException) as info:
        load_plan(path)
    assert f"MemoryPlanner(plan={str(path)!r})" in str(info.value)
    assert fragment in str(info.value)


@pytest.mark.parametrize(("text", "fragment"), [
    ("[1, 2]", "a plan file holds one JSON object"),
    ("{not json", "is not JSON"),
], ids=["a-list", "not-json"])
def test_plan_files_that_are_not_a_plan_are_refused(tmp_path, text, fragment):
    from pytorch_lightning.utilities.exceptions import MisconfigurationException

    from memplan.callback.apply import load_plan

    path = tmp_path / "bad.plan.json"
    path.write_text(text)
    with pytest.raises(MisconfigurationException, match="MemoryPlanner") as info:
        load_plan(path)
    assert fragment in str(info.value)


@pytest.mark.parametrize("kind", ["dev-zero", "fifo"])
def test_validate_plan_that_is_not_a_regular_file_is_refused(capsys, tmp_path, kind):
    import os

    path = Path("/dev/zero") if kind == "dev-zero" else tmp_path / "x.plan.json"
    if kind == "fifo":
        os.mkfifo(path)
    got, _, err = run(capsys, ["validate", write_config(tmp_path, BASE), "--plan", str(path)])
    assert_refused(got, err, 2, f"--plan {path} is a")
