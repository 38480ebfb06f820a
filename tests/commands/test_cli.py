"""The memplan command line, end to end in-process (CPU; GPUs named from the catalog)."""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import yaml

from memplan.commands.cli import main
from memplan.plan import Plan

ROOT = Path(__file__).resolve().parents[2]
MLP = str(ROOT / "configs" / "mlp.yaml")


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_suggest_off_box_keeps_the_global_batch_and_fits(capsys):
    code, out, _ = run(capsys, "suggest", "--gpus", "4", "--gpu", "A100-80GB", MLP, "--json")
    assert code == 0
    plan = Plan.from_dict(json.loads(out))
    config = yaml.safe_load(Path(MLP).read_text())
    assert plan.global_batch_size == config["trainer"]["callbacks"][0]["init_args"]["global_batch_size"]
    assert plan.micro_batch_size * plan.world_size * plan.accumulate_grad_batches == plan.global_batch_size
    assert plan.predicted_peak_bytes <= plan.device_budget_bytes
    # The demo MLP's step is bound by the host's per-op launch cost (planner/costs.py): more GPUs do not
    # finish the global batch sooner, and AMP's casts are extra ops; the predicted figures say so.
    assert (plan.world_size, plan.precision) == (1, "32-true") and plan.predicted_step_seconds > 0
    assert all(a.samples_per_s <= plan.samples_per_s * 1.01 for a in plan.alternatives if a.fits)
    assert plan.model_class == "memplan.demos.MLP" and len(plan.model_fingerprint) == 16  # checked when applied
    assert plan.gpu_name == "A100-80GB" and plan.gpu_total_bytes > 0


@pytest.fixture(scope="module")
def table_on_24gib() -> tuple[int, str]:
    """`memplan suggest --gpu-memory 24GiB configs/mlp.yaml` (a table on stdout, not a terminal, as with
    `> plan.txt`), run once for the tests that read it: its exit status and stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["suggest", "--gpu-memory", "24GiB", MLP])
    return code, out.getvalue()


def test_suggest_prints_a_table_with_reasons(table_on_24gib):
    code, out = table_on_24gib
    assert code == 0
    for word in ("micro-batch per GPU", "gradient accumulation", "predicted per-GPU peak", "Why:"):
        assert word in out


def test_suggest_output_writes_a_planned_config_and_the_plan(capsys, tmp_path):
    out_path = tmp_path / "planned.yaml"
    # enough work per step that two GPUs pay (planner/costs.py); AMP only allowed, so the planned config's
    # precision differs from the config's 32-true, and the V100 (no bf16) gets 16-mixed
    big = ("--global-batch-size", "1048576", "--precision", "16-mixed", "--precision", "bf16-mixed")
    code, out, _ = run(capsys, "suggest", "--gpus", "2", "--gpu", "V100-32GB", MLP, *big, "--output", str(out_path))
    assert code == 0
    planned = yaml.safe_load(out_path.read_text())
    plan = Plan.from_dict(json.loads(out_path.with_suffix(".plan.json").read_text()))
    assert planned["trainer"]["precision"] == plan.precision == "16-mixed"  # V100: no bf16
    assert planned["trainer"]["accumulate_grad_batches"] == plan.accumulate_grad_batches
    assert planned["data"]["init_args"]["batch_size"] == plan.micro_batch_size
    assert "-m torch.distributed.run --nproc-per-node=2" in out and " -m memplan.train fit --config " in out
    assert "Changes to" in out and "trainer.accumulate_grad_batches" in out  # the before -> after table

    code, _, err = run(capsys, "suggest", "--gpus", "2", "--gpu", "V100-32GB", MLP, *big, "--output", str(out_path))
    assert code == 2 and f"--output would replace {out_path} and {out_path.with_suffix('.plan.json')}" in err
    out_path.write_text("edited by the user\n")
    code, _, _ = run(capsys, "suggest", "--gpus", "1", "--gpu", "V100-32GB", MLP, "--output", str(out_path), "--force")
    assert code == 0
    assert yaml.safe_load(out_path.read_text())["trainer"]["devices"] == 1


def test_suggest_without_a_gpu_says_how_to_name_one(capsys):
    code, _, err = run(capsys, "suggest", MLP)
    assert code == 2
    assert "--gpu H100-80GB" in err and "--gpu-memory 24GiB" in err


@pytest.mark.parametrize(("argv", "message"), [
    (["suggest", "--gpu", "A100-80GB", "missing.yaml"], "missing.yaml does not exist"),
    (["suggest", "--gpu", "GTX-9999", MLP], "GTX-9999"),
    (["suggest", "--gpu", "A100-80GB", "--precision", "16-true", MLP], "--precision: the planner searches"),
    (["suggest", "--gpu", "A100-80GB", "--global-batch-size", "7", "--nodes", "2", MLP],
     "--global-batch-size (7) must be divisible by --nodes 2"),
])
def test_suggest_bad_input_exits_2_with_one_clear_line(capsys, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err


def test_estimate_a_config_at_one_batch_size(capsys):
    code, out, _ = run(capsys, "estimate", MLP, "--batch-size", "64", "--device", "cpu", "--json")
    assert code == 0
    est = json.loads(out)
    assert est["batch_size"] == 64 and est["peak_allocated"] > est["parameters"] > 0


def test_estimate_a_demo_prints_the_breakdown(capsys):
    code, out, _ = run(capsys, "estimate", "--demo", "mlp", "--batch-size", "32", "--device", "cpu")
    assert code == 0
    assert "peak allocated" in out and "rule of thumb" in out
    assert "rule of thumb: 4 bytes x (3 x parameters + 2 x activations)" in out  # the column says what it is


def test_estimate_needs_a_config_or_a_demo(capsys):
    code, _, err = run(capsys, "estimate", "--batch-size", "8")
    assert code == 2 and "config file or --demo" in err


def test_devices_json_reports_the_host(capsys):
    code, out, _ = run(capsys, "devices", "--json")
    assert code == 0
    assert json.loads(out)["host"]["total_bytes"] > 0


def test_suggest_json_with_output_keeps_stdout_pure_json(capsys, tmp_path):
    code, out, err = run(capsys, "suggest", "--gpu", "A100-80GB", MLP, "--json", "--output", str(tmp_path / "p.yaml"))
    assert code == 0
    assert json.loads(out)["world_size"] >= 1
    assert "launch with: " in err and "-m torch.distributed.run" in err


def test_fewer_gpus_than_given_is_never_silent(capsys):
    # a global batch of 2**20 does not split over 48 ranks (nor any count above 32 but 2**20's divisors):
    # the plan uses fewer GPUs and says so
    big = ("--global-batch-size", "1048576")
    code, out, err = run(capsys, "suggest", "--gpus", "48", "--gpu", "A100-80GB", MLP, *big, "--json")
    world = json.loads(out)["world_size"]
    assert code == 0 and 1 < world <= 32
    assert f"the plan uses {world} of the 48 GPUs per node --gpus gives" in err and "does not split evenly" in err
    code, out, _ = run(capsys, "suggest", "--gpus", "48", "--gpu", "A100-80GB", MLP, *big)
    assert f"Uses {world} of 48 GPUs per node" in " ".join(out.split())


@pytest.mark.parametrize("flags, expected", [((), ("lightning", "balanced")),
                                             (("--loop", "torch", "--data-dependent", "sample"), ("torch", "sample"))])
def test_estimate_passes_the_loop_and_the_data_dependent_policy_to_the_trace(capsys, monkeypatch, flags, expected):
    import memplan

    seen = {}
    real = memplan.estimate

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(memplan, "estimate", spy)
    code, out, _ = run(capsys, "estimate", "--demo", "mlp", "--batch-size", "2", "--device", "cpu", *flags)
    assert code == 0 and "peak" in out.lower()
    assert (seen["loop"], seen["data_dependent"]) == expected


def test_piped_output_keeps_each_sentence_on_one_line(table_on_24gib):
    # stdout here is not a terminal (as with `| tee plan.txt` or `> plan.txt`): rich wrapped it at 80 columns,
    # mid-sentence; now each reason is one line, whole
    code, out = table_on_24gib
    assert code == 0
    why = next(line for line in out.splitlines() if line.startswith("Why: "))
    assert len(why) > 200 and why.rstrip().endswith(".")
    assert all(len(line) <= 240 for line in out.splitlines() if line.startswith(("┃", "│", "┏", "└")))
