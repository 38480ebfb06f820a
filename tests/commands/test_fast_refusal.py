"""A config refused by memplan's own checks (its YAML, memplan's settings, device and node counts) is refused by
`memplan suggest` and `memplan estimate` before torch or Lightning is imported (checked in a fresh interpreter's
sys.modules, not timed); one that passes them is read by Lightning's own parser, which imports both."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from import_probe import ROOT, modules_imported

HEAVY = ("torch", "pytorch_lightning", "lightning")

PLANNER = "trainer.callbacks[0].init_args"


def edited(path: str, value) -> dict:
    """configs/mlp.yaml with the dotted key `path` (list entries as [i]) set to `value`."""
    config = yaml.safe_load((ROOT / "configs" / "mlp.yaml").read_text())
    *parents, leaf = path.replace("[", ".[").split(".")
    node = config
    for part in parents:
        node = node[int(part[1:-1])] if part.startswith("[") else node[part]
    node[leaf] = value
    return config


def refused(tmp_path: Path, argv: list[str], text: str) -> tuple[list[str], int, str]:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    modules, code, _, stderr = modules_imported([str(path) if a == "CONFIG" else a for a in argv], HEAVY)
    return modules, code, stderr


COMMANDS = {"suggest": ["suggest", "--gpu", "A100-80GB", "CONFIG"], "estimate": ["estimate", "CONFIG", "--batch-size", "4"]}
CASES = {
    "yaml-syntax": ("model: [1, 2\n", "YAML syntax error at line 2"),
    "global-batch-0": (yaml.safe_dump(edited(f"{PLANNER}.global_batch_size", 0)),
                       f"{PLANNER}.global_batch_size must be a positive int"),
    "suggest-precision-typo": (yaml.safe_dump(edited(f"{PLANNER}.suggest", {"precisions": ["bf16-mixd"]})),
                               f"{PLANNER}.suggest.precisions[0] must be a Lightning precision"),
    "suggest-batch-spec-dtype": (yaml.safe_dump(edited(f"{PLANNER}.suggest", {"batch_spec": {"x": {
        "shape": [4], "dtype": "complex"}}})), f"{PLANNER}.suggest.batch_spec.x.dtype must be one of"),
    "suggest-optimizer": (yaml.safe_dump(edited(f"{PLANNER}.suggest", {"optimizer": "adamm"})),
                          f"{PLANNER}.suggest.optimizer must be one of sgd"),
    "devices-0": (yaml.safe_dump(edited("trainer.devices", 0)), "trainer.devices must be a positive number"),
    "model-class-path-missing": (yaml.safe_dump(edited("model", {"init_args": {}})), "model.class_path is missing"),
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_config_memplans_own_checks_refuse_imports_neither_torch_nor_lightning(tmp_path, command, case):
    text, fragment = CASES[case]
    modules, code, output = refused(tmp_path, COMMANDS[command], text)
    assert code == 2 and fragment in output, output
    assert modules == [], output


def test_a_config_past_memplans_own_checks_is_read_by_lightnings_parser(tmp_path):
    """The probe sees torch and Lightning where they are imported: a class_path only the parser can refuse."""
    text = yaml.safe_dump(edited("model.class_path", "memplan.demos.MLPP"))
    modules, code, output = refused(tmp_path, COMMANDS["suggest"], text)
    assert code == 2 and "model.class_path 'memplan.demos.MLPP': module 'memplan.demos' has no attribute 'MLPP' " \
                          "(did you mean 'MLP'?)" in output, output
    assert "torch" in modules and "pytorch_lightning" in modules
