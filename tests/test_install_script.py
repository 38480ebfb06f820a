"""scripts/install.py keeps a venv's torch, and says so plainly where that torch is outside memplan's range."""
from __future__ import annotations

import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _venv_with_torch_metadata(path: Path, version: str) -> None:
    """A venv (no pip) whose only package is a torch distribution's metadata at `version`."""
    venv.EnvBuilder(with_pip=False).create(path)
    purelib = Path(sysconfig.get_path("purelib", vars={"base": str(path), "platbase": str(path)}))
    info = purelib / f"torch-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")


@pytest.mark.parametrize("version", ["2.14.0", "2.6.0"])
def test_a_torch_outside_the_range_is_one_error_before_pip_runs(tmp_path, version):
    env = tmp_path / "env"
    _venv_with_torch_metadata(env, version)
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "install.py"), "--venv", str(env)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert f"has torch {version}, outside the versions memplan supports (torch>=2.7,<2.14" in run.stderr
    assert "+ " not in run.stdout  # no pip command ran: nothing was replaced
    assert (Path(sysconfig.get_path("purelib", vars={"base": str(env), "platbase": str(env)}))
            / f"torch-{version}.dist-info").is_dir()
