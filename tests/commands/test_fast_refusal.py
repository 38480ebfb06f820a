"""A config refused by memplan's own checks (its YAML, memplan's settings, device and node counts) is refused by
`memplan suggest` and `memplan estimate` before torch or Lightning is imported (checked in a fresh interpreter's
sys.modules, not timed: one interpreter runs every refused case in turn, each read after its own command, so a case
that imported torch fails there and in every case after it); one that passes them is read by Lightning's own parser,
which imports both (in an interpreter of its own). tests/conftest.py keeps this module on one xdist worker."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml
from import_probe import ROOT, modules_imported
from subprocess_run import run_watched

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


#: one interpreter running `memplan ARGV` for each job of a JSON list in turn (as `python -m memplan` does), printing
#: one JSON line per job: its exit code, what it printed to stderr, the modules of HEAVY imported so far
PROBE_ALL = """
import contextlib, io, json, runpy, sys
for argv in json.loads(sys.argv[1]):
    sys.argv, err = ["memplan", *argv], io.StringIO()
    code = 0
    with contextlib.redirect_stderr(err):
        try:
            runpy.run_module("memplan", run_name="__main__")
        except SystemExit as done:
            code = done.code
    print(json.dumps({"code": code, "stderr": err.getvalue(), "modules": [m for m in HEAVY if m in sys.modules]}))
"""


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> dict[tuple[str, str], dict]:
    """Every (command, case) of the parametrized test below, run in one fresh interpreter: what each one gave."""
    folder = tmp_path_factory.mktemp("refused")
    jobs = {}
    for case, (text, _) in CASES.items():
        path = folder / f"{case}.yaml"
        path.write_text(text)
        for command, argv in COMMANDS.items():
            jobs[command, case] = [str(path) if a == "CONFIG" else a for a in argv]
    # as import_probe.modules_imported runs a command: the repository first, then what the suite gives every child
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = run_watched([sys.executable, "-c", f"HEAVY = {HEAVY!r}\n{PROBE_ALL}", json.dumps(list(jobs.values()))],
                       env=env, cwd=ROOT)
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and len(results) == len(jobs), done.stderr[-3000:]
    return dict(zip(jobs, results))


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_config_memplans_own_checks_refuse_imports_neither_torch_nor_lightning(refusals, command, case):
    _, fragment = CASES[case]
    result = refusals[command, case]
    output = result["stderr"]
    assert result["code"] == 2 and fragment in output, output
    assert result["modules"] == [], output


def test_a_config_past_memplans_own_checks_is_read_by_lightnings_parser(tmp_path):
    """The probe sees torch and Lightning where they are imported: a class_path only the parser can refuse."""
    text = yaml.safe_dump(edited("model.class_path", "memplan.demos.MLPP"))
    modules, code, output = refused(tmp_path, COMMANDS["suggest"], text)
    assert code == 2 and "model.class_path 'memplan.demos.MLPP': module 'memplan.demos' has no attribute 'MLPP' " \
                          "(did you mean 'MLP'?)" in output, output
    assert "torch" in modules and "pytorch_lightning" in modules
