"""`memplan estimate` and `memplan suggest` trace a deterministic run as one: --deterministic, else the config's
trainer.deterministic (Lightning's Trainer argument), reaches the CUDA rules (memplan.estimator.determinism)."""
from __future__ import annotations

import json
import textwrap

import pytest
import torch
from op_reading import op_transients

from memplan.commands import planning
from memplan.commands.cli import main

FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_backward.default
EXTRA = 65 * 131_072
"""The dQ accumulators a deterministic backward keeps beyond the one (one block, 2 heads of 64, 256 tokens, batch 1,
an H100's 132 SMs: 66 splits of [1, 256, 2, 64] fp32)."""


def config(tmp_path, deterministic: str | None = None) -> str:
    trainer = "{devices: 1" + (f", deterministic: {deterministic}" if deterministic is not None else "") + "}"
    path = tmp_path / f"config-{deterministic}.yaml"
    path.write_text(textwrap.dedent(f"""
        trainer: {trainer}
        model: {{class_path: memplan.demos.GPTLM, init_args: {{vocab_size: 64, context: 256, d_model: 128,
                 n_layers: 1, n_heads: 2, dropout: 0.0}}}}
        data: {{class_path: memplan.demos.RandomTokens, init_args: {{batch_size: 1, vocab_size: 64, context: 256}}}}
    """))
    return str(path)


def estimate_held(capsys, monkeypatch, path: str, *flags: str) -> tuple[int, list[str]]:
    """The flash backward's temporaries in `memplan estimate` (H100, bf16-mixed, batch 1) and the notes."""
    seen = op_transients(monkeypatch, FLASH_BACKWARD)
    code = main(["estimate", path, "--batch-size", "1", "--precision", "bf16-mixed", "--device", "H100-80GB",
                 "--json", *flags])
    monkeypatch.undo()
    assert code == 0
    (held,) = set(seen)
    return held, json.loads(capsys.readouterr().out)["notes"]


def test_estimate_s_flag_and_the_config_s_key_count_the_deterministic_accumulators(capsys, monkeypatch, tmp_path):
    plain, notes = estimate_held(capsys, monkeypatch, config(tmp_path))
    flag, flag_notes = estimate_held(capsys, monkeypatch, config(tmp_path), "--deterministic", "true")
    key, _ = estimate_held(capsys, monkeypatch, config(tmp_path, "true"))
    assert flag - plain == key - plain == EXTRA
    assert not any("deterministic" in n for n in notes)
    assert any(n.startswith("deterministic algorithms (deterministic=True)") for n in flag_notes)
    # the flag over the key; 'warn' is warn-only (flash's single accumulator)
    assert estimate_held(capsys, monkeypatch, config(tmp_path, "true"), "--deterministic", "false")[0] == plain
    assert estimate_held(capsys, monkeypatch, config(tmp_path, "warn"))[0] == plain


class Traced(Exception):
    """Raised by the stand-in make_plan after one trace of suggest's estimator."""


def suggest_held(capsys, monkeypatch, path: str, *flags: str) -> int:
    """The flash backward's temporaries in suggest's estimator (its first trace, in this process), for an H100."""
    seen = op_transients(monkeypatch, FLASH_BACKWARD)

    def one_trace(request, estimator):
        raise Traced(estimator(micro_batch_size=1, precision="bf16-mixed", checkpointing=False, world_size=1))

    monkeypatch.setattr(planning, "make_plan", one_trace)
    with pytest.raises(Traced):
        main(["suggest", "--gpu", "H100-80GB", "--gpus", "1", "--json", path, *flags])
    monkeypatch.undo()
    capsys.readouterr()
    (held,) = set(seen)
    return held


def test_suggest_s_flag_and_the_config_s_key_reach_its_estimator(capsys, monkeypatch, tmp_path):
    plain = suggest_held(capsys, monkeypatch, config(tmp_path))
    assert suggest_held(capsys, monkeypatch, config(tmp_path), "--deterministic", "true") - plain == EXTRA
    assert suggest_held(capsys, monkeypatch, config(tmp_path, "true")) - plain == EXTRA
    assert suggest_held(capsys, monkeypatch, config(tmp_path, "true"), "--deterministic", "warn") == plain


@pytest.mark.parametrize("command", ["estimate", "suggest"])
def test_bad_values_are_one_line_naming_the_flag_or_the_key(capsys, tmp_path, command):
    extra = ["--batch-size", "1", "--device", "H100-80GB"] if command == "estimate" else ["--gpu", "H100-80GB"]
    assert main([command, config(tmp_path), *extra, "--deterministic", "sometimes"]) == 2
    err = capsys.readouterr().err
    assert "argument --deterministic: must be true, false or warn" in err and "'sometimes'" in err
    assert main([command, config(tmp_path, "sometimes"), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trainer.deterministic must be true, false or warn" in err[0] and "'sometimes'" in err[0]


def test_suggest_output_writes_the_deterministic_flag_it_planned_for(capsys, tmp_path):
    """The planned config runs what was planned: --deterministic lands in its trainer.deterministic."""
    import yaml

    out = tmp_path / "planned.yaml"
    assert main(["suggest", "--gpu", "H100-80GB", "--gpus", "1", "--precision", "bf16-mixed", "--deterministic",
                 "true", "--output", str(out), config(tmp_path)]) == 0
    capsys.readouterr()
    assert yaml.safe_load(out.read_text())["trainer"]["deterministic"] is True
