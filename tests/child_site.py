"""The child processes tests start import Lightning as memplan's user install does, without the dev extras.

`python3 scripts/install.py --dev` adds transformers and scipy (pyproject's [dev] extra) beside memplan's own
dependencies, and torchmetrics, which Lightning imports, imports both whenever it finds them installed
(torchmetrics/__init__.py imports scipy.signal where find_spec finds scipy; torchmetrics.functional.text.bert imports
transformers' AutoModel where transformers' distribution metadata says >= 4.4): ~1.8 CPU-s more for every process
that imports Lightning (5.8 against 4.0 CPU-s on a 2-core AMD EPYC), and the suite starts dozens (torchrun's ranks,
`memplan suggest`, the callback's DDP and FSDP drivers). A user who installs memplan alone
(`python3 scripts/install.py`, the README's first command) has neither.

`install(folder)` writes, under `folder`, a copy of this venv's site-packages made of links, without scipy and
without transformers' distribution metadata (its modules stay: a test's child may build a transformers model,
which torchmetrics then does not import for itself), and a sitecustomize.py that puts that copy in the real
folder's place on sys.path; it returns the folder to put on PYTHONPATH. Another Python (a test's stub, a venv of
its own) finds its own site-packages and is left as it is. (No child of the suite needs scipy.)"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sysconfig
from pathlib import Path

#: what a child does not see: scipy whole (torchmetrics asks find_spec), transformers' distribution metadata
#: (torchmetrics asks importlib.metadata)
HIDDEN = ("scipy",)
HIDDEN_DISTRIBUTIONS = ("transformers",)

SITECUSTOMIZE = '''"""Written by memplan's tests/child_site.py: this venv's site-packages without scipy and transformers'
distribution metadata."""
import importlib
import os
import sys

sys.path[:] = [{mirror!r} if os.path.realpath(entry) == {site!r} else entry for entry in sys.path]
# the interpreter's own sitecustomize (a distribution's, coverage's), which this one shadows, still runs
sys.path[:] = [entry for entry in sys.path if entry != {hook!r}]
this = sys.modules.pop("sitecustomize")
try:
    importlib.import_module("sitecustomize")
except ImportError:  # none: this module stays what `import sitecustomize` found (site.py looks it up)
    sys.modules["sitecustomize"] = this
# back on the path, last: a process this one starts with its sys.path as PYTHONPATH (memplan's FSDP planning
# process, memplan.callback.fsdp_plan) runs this file too
sys.path.append({hook!r})
'''


def _hidden(name: str) -> bool:
    """Whether a site-packages entry is a HIDDEN package's (its module, its dist-info, its .libs) or the
    distribution metadata of one of HIDDEN_DISTRIBUTIONS."""
    return (any(name == package or name.startswith((f"{package}-", f"{package}.")) for package in HIDDEN)
            or any(name.startswith(f"{package}-") for package in HIDDEN_DISTRIBUTIONS))


def install(folder: Path) -> Path | None:
    """The folder (under `folder`) holding sitecustomize.py, for children's PYTHONPATH; None where this venv's
    site-packages does not hold what HIDDEN names (another layout: a separate platlib, the user site, system site
    packages), so that children would still see it: they then import as the test process does."""
    site = os.path.realpath(sysconfig.get_paths()["purelib"])
    if not os.path.isdir(site) or not all(_inside(site, where) for where in _found()):
        return None
    mirror = folder / "user-site-packages"
    mirror.mkdir(parents=True)
    for entry in os.scandir(site):
        if not _hidden(entry.name):
            (mirror / entry.name).symlink_to(entry.path)
    hook = folder / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE.format(mirror=str(mirror), site=site, hook=str(hook)))
    return hook


def _found() -> list[str]:
    """Where the HIDDEN packages and the HIDDEN_DISTRIBUTIONS' metadata that this interpreter finds live."""
    out = []
    for package in HIDDEN:
        spec = importlib.util.find_spec(package)
        if spec is not None:
            out.extend(spec.submodule_search_locations or [spec.origin or ""])
    for name in HIDDEN_DISTRIBUTIONS:
        try:
            out.append(str(importlib.metadata.distribution(name).locate_file("")))
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def _inside(site: str, where: str) -> bool:
    return os.path.realpath(where).startswith(site + os.sep) or os.path.realpath(where) == site
