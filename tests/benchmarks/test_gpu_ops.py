"""The GPU campaign's part 5 (benchmarks.gpu_ops), its kernel profile and its --only / --cases selection, on CPU.

On CPU no device memory is read (every allocator figure is 0): these tests check what is measured and recorded
(which ops, which convolutions, which sections), not any GPU figure.
"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("pytorch_lightning")

from benchmarks import gpu_campaign, gpu_ops  # noqa: E402


def _settings(tmp_path, part: int, **kw) -> gpu_campaign.Settings:
    return gpu_campaign.Settings(part=part, out=tmp_path, budget_s=600.0, dry_run=True, jobs=1, measure_jobs=1, **kw)


def test_only_runs_the_named_sections_and_a_skipped_section_is_no_failure(tmp_path):
    data = gpu_campaign.run_part(_settings(tmp_path, 5, only=("conv_grid",)))
    status = {name: s["status"] for name, s in data["sections"].items()}
    assert status == {"environment": "done", "conv_grid": "done", "op_profiles": "skipped: not asked (--only)"}
    assert not (tmp_path / "ops").exists()
    assert gpu_campaign.main(["--part", "5", "--out", str(tmp_path / "again"), "--dry-run",
                              "--only", "conv_grid"]) == 0


def test_the_conv_grid_records_each_convolution_forward_and_both_backwards(tmp_path):
    gpu_campaign.run_part(_settings(tmp_path, 5, only=("conv_grid",)))
    rows = json.loads((tmp_path / "conv_grid.json").read_text())["rows"]
    by_what: dict[str, list] = {}
    for row in rows:
        by_what.setdefault(row["what"], []).append(row)
    assert set(by_what) == {"forward", "backward input+weight", "backward weight only"}
    assert len(by_what["forward"]) == len(by_what["backward input+weight"]) == len(by_what["backward weight only"])
    first = by_what["forward"][0]  # the zoo CNN's first layer: Conv2d(1, 32, 3, padding=1) on 1x50x180
    assert (first["c_in"], first["c_out"], first["kernel"], first["sample"]) == (1, 32, [3, 3], [1, 50, 180])
    assert first["output_bytes"] == first["batch"] * 32 * 50 * 180 * 4  # same size out (padding 1), float32
    weight_only = by_what["backward weight only"][0]
    assert weight_only["output_bytes"] == 32 * 1 * 3 * 3 * 4  # only the weight's gradient (no bias)


def test_cases_keeps_only_the_named_cases_in_their_own_order():
    s = gpu_campaign.Settings(part=1, out=None, budget_s=1, dry_run=True, jobs=1, measure_jobs=1,
                              cases=("gpt2-b4", "cnn-b32"))
    assert s.chosen(["cnn-b32", "mlp-b64", "gpt2-b4"]) == ["cnn-b32", "gpt2-b4"]
    assert gpu_campaign.Settings(part=1, out=None, budget_s=1, dry_run=True, jobs=1,
                                 measure_jobs=1).chosen(["a", "b"]) == ["a", "b"]


def test_an_op_profile_reads_every_step_forward_backward_and_optimizer(tmp_path):
    result = gpu_ops.profile_case("linear-b64-sgd", cpu=True)
    columns = result["columns"]
    assert columns[:2] == ["step", "op"]
    ops_by_step: dict[int, set] = {}
    for row in result["rows"]:
        ops_by_step.setdefault(row[0], set()).add(row[1])
    assert {1, 2} <= set(ops_by_step)  # both training steps, numbered as memplan.truth numbers them
    step2 = ops_by_step[2]
    assert any(op.startswith("aten.addmm") for op in step2)  # the Linear's forward
    assert any(op.startswith("aten.mm") for op in step2)  # its weight gradient in the backward
    assert result["ops"] == len(result["rows"])


def test_the_kernel_profile_counts_a_steps_aten_ops():
    from benchmarks.gpu_extra import profile_steps

    out = profile_steps(cpu=True)
    (setting,) = out["settings"]
    assert (setting["precision"], setting["micro_batch"]) == ("bf16-mixed", 8)
    assert setting["aten_ops_per_step"] > 100  # a GPT-2 forward + backward + AdamW step
    assert setting["kernels_per_step"] == 0 and setting["top_kernels"] == []  # no CUDA kernels on CPU
    assert any(name == "aten::mm" for name, *_ in setting["top_aten_ops_device_us"])
