"""The command line starts without torch: `--help`, `--version` and a flag refused while parsing import
none of torch or Lightning (checked in a fresh interpreter's sys.modules, not timed). Progress goes
to a terminal's stderr only."""
from __future__ import annotations

import io
import json
import sys

import pytest
from import_probe import ROOT, modules_imported

from memplan.commands.cli import main
from memplan.commands.progress import Progress

HEAVY = ("torch", "pytorch_lightning", "lightning", "torchmetrics", "transformers", "matplotlib")


def modules_after(*argv: str) -> tuple[list[str], int, str]:
    modules, code, stdout, stderr = modules_imported(list(argv), HEAVY)
    return modules, code, stdout + stderr


@pytest.mark.parametrize("argv", [
    ["--help"], ["--version"], ["suggest", "--help"], ["estimate", "--help"], ["devices", "--help"],
    ["suggest", "--gpus", "0", "configs/mlp.yaml"], ["suggest", "--gpu-memory", "24", "configs/mlp.yaml"],
    ["suggest", "--gpu", "GTX-9999", "configs/mlp.yaml"], ["estimate", "configs/mlp.yaml", "--batch-size", "0"],
], ids=lambda argv: " ".join(argv))
def test_help_version_and_refused_flags_do_not_import_torch(argv):
    modules, code, output = modules_after(*argv)
    assert modules == [], output
    assert code == (0 if argv[-1] in ("--help", "--version") else 2)


def test_version_prints_the_package_version(capsys):
    from memplan import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"memplan {__version__}"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_writes_one_rewritten_line_on_a_terminal_only():
    terminal, pipe = Terminal(), io.StringIO()
    for stream in (terminal, pipe):
        progress = Progress(stream)
        progress.say("tracing GPTLM: trace 1")
        progress.say("tracing GPTLM: trace 2")
        progress.clear()
    assert "trace 1" in terminal.getvalue() and "trace 2" in terminal.getvalue()
    assert terminal.getvalue().count("\n") == 0 and terminal.getvalue().endswith("\r\x1b[2K")
    assert pipe.getvalue() == ""
    muted = Terminal()
    Progress(muted, enabled=False).say("x")
    assert muted.getvalue() == ""


def test_suggest_says_what_it_traces_on_a_terminal_and_nothing_with_json(capsys, monkeypatch):
    mlp = str(ROOT / "configs" / "mlp.yaml")
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert main(["suggest", "--gpu", "A100-80GB", mlp]) == 0
    said = sys.stderr.getvalue()
    assert f"loading {mlp}" in said and "building MLP on fake tensors" in said
    assert "tracing MLP: trace 1 (usually 3-8), micro-batch" in said
    capsys.readouterr()
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert main(["suggest", "--gpu", "A100-80GB", mlp, "--json"]) == 0
    assert sys.stderr.getvalue() == ""
    assert json.loads(capsys.readouterr().out)["micro_batch_size"] >= 1
