"""Messages that used to mislead (issue 12): each now says what is true, in the user's own words."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from memplan.commands.cli import main
from memplan.demos import MLP
from memplan.planner import DeviceBudget, PlanRequest, estimator_for, make_plan
from memplan.units import GiB

ROOT = Path(__file__).resolve().parents[2]
MLP_CONFIG = ROOT / "configs" / "mlp.yaml"


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def config(tmp_path: Path, **init_args) -> Path:
    raw = yaml.safe_load(MLP_CONFIG.read_text())
    raw["model"]["init_args"].update(init_args)
    raw["data"]["init_args"]["in_features"] = raw["model"]["init_args"]["in_features"]
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_model_without_blocks_is_not_said_to_be_refused_checkpointing(capsys):
    code, out, _ = run(capsys, "suggest", "--gpu", "A100-80GB", MLP_CONFIG, "--json")
    assert code == 0
    reasons = " ".join(json.loads(out)["reasons"])
    assert "No activation checkpointing (the model has no repeated blocks memplan can checkpoint)." in reasons
    assert "not allowed by the request" not in reasons


def test_nofit_names_what_the_user_can_change_and_not_what_is_already_allowed(capsys, tmp_path):
    huge = config(tmp_path, in_features=20000, hidden=8000, depth=1)  # 160M parameters, no repeated blocks
    code, _, err = run(capsys, "suggest", "--gpu-memory", "1GiB", "--precision", "32", huge)
    assert code == 1 and "Nothing fits" in err
    assert "Allowing bf16-mixed or 16-mixed (--precision) would lower what DDP needs." in err
    assert "Activation checkpointing cannot help: the model has no repeated blocks to checkpoint." in err
    assert "allow_checkpointing=True" not in err and "precisions=(" not in err


def test_no_checkpointing_flag_is_named_when_checkpointing_would_help(capsys):
    gpt = ROOT / "configs" / "gpt2-small.yaml"  # 124M parameters: 2 GB of fp32 state, over a 1 GiB GPU
    code, _, err = run(capsys, "suggest", "--gpu-memory", "1GiB", "--precision", "32-true", "--no-checkpointing", gpt)
    assert code == 1 and "Nothing fits" in err
    assert ("Allowing bf16-mixed or 16-mixed (--precision) and allowing activation checkpointing (drop "
            "--no-checkpointing) would lower what DDP needs.") in err
    assert "allow_checkpointing=True" not in err


def test_a_cpu_plan_speaks_of_devices_not_gpus():
    cpu = DeviceBudget(name="cpu", cuda_index=None, total_bytes=8 * GiB, free_bytes=4 * GiB, compute_capability=(8, 0))
    request = PlanRequest(global_batch_size=8, devices=(cpu, cpu), precisions=("32-true",), allow_checkpointing=False)
    batch = (torch.randn(8, 20), torch.randint(0, 3, (8,)))
    plan = make_plan(request, estimator_for(lambda: MLP(in_features=20, hidden=8, depth=2, num_classes=3), batch,
                                            device="cpu"))
    text = " ".join(plan.reasons)
    assert "per device" in text and "GPU" not in text


def test_the_assumed_cuda_context_is_not_said_to_lie_outside_its_own_range(capsys):
    code, out, _ = run(capsys, "estimate", "--demo", "mlp", "--batch-size", "8", "--device", "A100-80GB", "--json")
    assert code == 0
    note = next(n for n in json.loads(out)["notes"] if n.startswith("CUDA context"))
    assert "640 MiB assumed, unmeasured" in note and "270-730" not in note
    assert "memplan validate" in note


def test_the_hopper_cuda_context_is_said_to_be_measured_and_where(capsys):
    code, out, _ = run(capsys, "estimate", "--demo", "mlp", "--batch-size", "8", "--device", "H100-80GB", "--json")
    assert code == 0
    note = next(n for n in json.loads(out)["notes"] if n.startswith("CUDA context"))
    assert "742 MiB" in note and "measured on an H200" in note and "unmeasured" not in note
    assert "memplan validate" in note


def test_estimate_notes_name_estimates_own_flags(capsys):
    code, out, _ = run(capsys, "estimate", "--demo", "mlp", "--batch-size", "8", "--device", "cuda", "--json")
    assert code == 0
    notes = " ".join(json.loads(out)["notes"])
    if torch.cuda.is_available():
        pytest.skip("a local GPU: no generic-GPU note")
    assert "pass --device H100-80GB" in notes and "device='" not in notes


def test_estimate_checkpointing_without_blocks_names_the_flag(capsys):
    code, _, err = run(capsys, "estimate", MLP_CONFIG, "--batch-size", "4", "--device", "cpu", "--checkpointing")
    assert code == 2
    assert "--checkpointing: the model has no repeated blocks" in err and "checkpointing={" not in err


@pytest.mark.parametrize("command", [["suggest", "--gpu", "A100-80GB"], ["estimate", "--batch-size", "2", "--device", "cpu"]])
def test_a_model_that_cannot_be_built_names_the_init_arg(capsys, tmp_path, command):
    raw = yaml.safe_load(MLP_CONFIG.read_text())
    raw["model"] = {"class_path": "memplan.demos.GPTLM", "init_args": {"dropout": 2.0, "n_layers": 1, "d_model": 64,
                                                                        "n_heads": 2, "context": 16, "vocab_size": 50}}
    raw["data"] = {"class_path": "memplan.demos.RandomTokens", "init_args": {"batch_size": 2, "context": 16,
                                                                             "vocab_size": 50}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    code, _, err = run(capsys, *command, path)
    assert code == 2
    assert "model.init_args.dropout: memplan.demos.GPTLM(**init_args) failed: ValueError: dropout probability" in err
    assert "calling it with no arguments" not in err


def test_no_checkpointing_flag_on_a_model_without_blocks_is_not_offered_back(capsys, tmp_path):
    # the model has nothing to checkpoint: dropping --no-checkpointing would not help, and is not suggested
    huge = config(tmp_path, in_features=20000, hidden=8000, depth=1)
    code, _, err = run(capsys, "suggest", "--gpu-memory", "1GiB", "--precision", "32", "--no-checkpointing", huge)
    assert code == 1 and "Nothing fits" in err
    assert "Allowing bf16-mixed or 16-mixed (--precision) would lower what DDP needs." in err
    assert "Activation checkpointing cannot help: the model has no repeated blocks to checkpoint." in err
    assert "drop --no-checkpointing" not in err
