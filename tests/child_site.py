"""The child processes tests start see memplan's user install, not the test venv's dev extras.

`python3 scripts/install.py --dev` adds transformers and scipy (pyproject's [dev] extra) beside memplan's own
dependencies, and torchmetrics, which Lightning imports, imports both whenever they are installed
(torchmetrics/__init__.py imports scipy.signal; torchmetrics.functional.text.bert imports transformers'
AutoModel): ~1.8 CPU-s more for every process that imports Lightning (5.8 against 4.0 CPU-s on a 2-core AMD
EPYC), and the suite starts dozens (torchrun's ranks, `memplan suggest`, the callback's DDP and FSDP drivers).
A user who installs memplan alone (`python3 scripts/install.py`, the README's first command) has neither.

`install(folder)` writes, under `folder`, a copy of this venv's site-packages made of links, without the
packages of HIDDEN, and a sitecustomize.py that puts that copy in the real folder's place on sys.path; it
returns the folder to put on PYTHONPATH. A child of this venv's Python then runs as in the user install;
another Python (a test's stub, a venv of its own) finds its own site-packages and is left as it is.
A child that needs a hidden package (a transformers model) is given `dev_env(env)`: with
MEMPLAN_TESTS_CHILD_SITE=dev its sitecustomize changes nothing, for it and the processes it starts."""
from __future__ import annotations

import os
import sysconfig
from pathlib import Path

#: the dev extras a child does not see (their distributions and modules both: torchmetrics asks for either)
HIDDEN = ("transformers", "scipy")
#: set to "dev" in a child's environment: it sees every package of this venv
SWITCH = "MEMPLAN_TESTS_CHILD_SITE"

SITECUSTOMIZE = '''"""Written by memplan's tests/child_site.py: this venv's site-packages without {hidden}."""
import os
import sys

if os.environ.get({switch!r}) != "dev":
    sys.path[:] = [{mirror!r} if entry == {site!r} else entry for entry in sys.path]
'''


def _hidden(name: str) -> bool:
    """Whether a site-packages entry belongs to a HIDDEN package (its module, its dist-info, its .libs)."""
    return any(name == package or name.startswith((f"{package}-", f"{package}.")) for package in HIDDEN)


def install(folder: Path) -> Path:
    """The folder (under `folder`) holding sitecustomize.py, for children's PYTHONPATH."""
    site = sysconfig.get_paths()["purelib"]
    mirror = folder / "user-site-packages"
    mirror.mkdir(parents=True)
    for entry in os.scandir(site):
        if not _hidden(entry.name):
            (mirror / entry.name).symlink_to(entry.path)
    hook = folder / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        SITECUSTOMIZE.format(hidden=", ".join(HIDDEN), switch=SWITCH, mirror=str(mirror), site=site))
    return hook


def dev_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for a child that needs a package of HIDDEN: it sees the whole test venv."""
    return {**env, SWITCH: "dev"}
