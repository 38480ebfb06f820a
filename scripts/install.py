#!/usr/bin/env python3
"""Set up memplan in a virtual environment, on a machine with only Python.

    python3 scripts/install.py          # .venv with memplan and its runtime dependencies
    python3 scripts/install.py --dev    # ... plus pytest and transformers, for tests and benchmarks

torch is the one dependency handled apart. An unpinned `torch` requirement on a machine without it
pulls the newest CUDA build (several GB). So: where the environment has no torch, install the pinned
wheel (TORCH_SPEC, default torch==2.13.0, which this project's machines serve as a local CPU wheel);
where it has one, keep it. Every later pip call gets the installed version as a constraint, so no
dependency can upgrade or replace it.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCH_SPEC = os.environ.get("MEMPLAN_TORCH_SPEC", "torch==2.13.0")


def _venv_python(env_dir: Path) -> Path:
    return env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _run(*cmd: str) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def _installed_torch(python: Path) -> str | None:
    probe = "import importlib.metadata as m; print(m.version('torch'))"
    result = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    return result.stdout.strip() if result.returncode == 0 else None


def _torch_bounds() -> tuple[tuple[int, int], tuple[int, int]] | None:
    """pyproject.toml's torch range ("torch>=2.7,<2.14" -> ((2, 7), (2, 14))), or None where it has none."""
    found = re.search(r'"torch>=(\d+)\.(\d+),<(\d+)\.(\d+)"', (ROOT / "pyproject.toml").read_text())
    if found is None:
        return None
    a, b, c, d = (int(g) for g in found.groups())
    return (a, b), (c, d)


def _outside(version: str, bounds: tuple[tuple[int, int], tuple[int, int]] | None) -> bool:
    numbers = tuple(int(n) for n in re.findall(r"\d+", version)[:2])
    return bounds is not None and not bounds[0] <= numbers < bounds[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dev", action="store_true", help="also install test and benchmark dependencies")
    parser.add_argument("--venv", default=str(ROOT / ".venv"), help="virtual environment folder (default: .venv)")
    args = parser.parse_args()

    env_dir = Path(args.venv)
    python = _venv_python(env_dir)
    if not python.exists():
        print(f"creating virtual environment in {env_dir}", flush=True)
        venv.EnvBuilder(with_pip=True).create(env_dir)
    pip = [str(python), "-m", "pip", "--disable-pip-version-check"]

    torch_version = _installed_torch(python)
    if torch_version is None:
        _run(*pip, "install", "-q", TORCH_SPEC)
        torch_version = _installed_torch(python)
        if torch_version is None:
            print(f"error: installing {TORCH_SPEC} did not give an importable torch", file=sys.stderr)
            return 1
    else:
        print(f"keeping the installed torch {torch_version}", flush=True)
    bounds = _torch_bounds()
    if _outside(torch_version, bounds):  # pip would only say the requirements conflict
        (a, b), (c, d) = bounds
        print(f"error: {env_dir} has torch {torch_version}, outside the versions memplan supports (torch>={a}.{b},"
              f"<{c}.{d}, pyproject.toml); this script never replaces a torch: use another --venv, or install a "
              "torch in that range there first", file=sys.stderr)
        return 1

    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as constraints:
        constraints.write(f"torch=={torch_version}\n")
    target = f"{ROOT}[dev]" if args.dev else str(ROOT)
    try:
        _run(*pip, "install", "-q", "-c", constraints.name, "-e", target)
    finally:
        os.unlink(constraints.name)
    print(f"memplan installed in {env_dir} (torch {torch_version})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
