"""The suite's own setting (tests/conftest.py, tests/child_site.py): a child process a test starts imports Lightning
as memplan's user install does, without torchmetrics importing the dev extras transformers and scipy (~1.8 CPU-s
in every child), and can still build a transformers model of its own."""
import json
import os
import sys

import pytest

from subprocess_run import run_watched

CHILD = """import json, sys
import pytorch_lightning
imported = sorted(m for m in ("transformers", "scipy") if m in sys.modules)
import transformers
print(json.dumps({"with_lightning": imported, "transformers": transformers.LlamaConfig.__name__}))
"""


def test_a_child_imports_lightning_without_the_dev_extras_and_can_still_import_transformers():
    pytest.importorskip("transformers")
    if "child-site" not in os.environ.get("PYTHONPATH", ""):
        pytest.skip("this venv keeps scipy or transformers outside its site-packages: conftest left children as they are")
    done = run_watched([sys.executable, "-c", CHILD])
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == {"with_lightning": [], "transformers": "LlamaConfig"}


GRANDCHILD = """import os, subprocess, sys
env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # as memplan.callback.fsdp_plan does
check = "import importlib.util; print(importlib.util.find_spec('scipy'))"
sys.exit(subprocess.run([sys.executable, "-c", check], env=env).returncode)
"""


def test_a_process_started_with_its_parents_sys_path_as_pythonpath_does_not_find_the_extras_either():
    """memplan's FSDP planning process gets the training process's sys.path as PYTHONPATH: it imports Lightning
    without the extras too."""
    if "child-site" not in os.environ.get("PYTHONPATH", ""):
        pytest.skip("this venv keeps scipy or transformers outside its site-packages: conftest left children alone")
    done = run_watched([sys.executable, "-c", GRANDCHILD])
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "None"


def test_the_interpreter_s_own_sitecustomize_still_runs_in_a_child(tmp_path):
    # the hook's sitecustomize shadows any other on the path (a distribution's, coverage's process_startup):
    # it imports the next one itself
    if "child-site" not in os.environ.get("PYTHONPATH", ""):
        pytest.skip("conftest installed no child hook in this venv")
    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import os\nos.environ['OWN_SITECUSTOMIZE'] = 'ran'\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.environ["PYTHONPATH"], str(own)])}
    done = run_watched([sys.executable, "-c", "import os; print(os.environ.get('OWN_SITECUSTOMIZE'))"], env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ran"


def test_a_child_without_a_sitecustomize_of_its_own_starts_silently():
    # the hook's sitecustomize, finding no other to run, leaves nothing on stderr (a test reading a child's
    # stderr byte for byte would see it)
    if "child-site" not in os.environ.get("PYTHONPATH", ""):
        pytest.skip("conftest installed no child hook in this venv")
    done = run_watched([sys.executable, "-c", "import sys; print(sys.modules['sitecustomize'].__file__)"])
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert "child-site" in done.stdout
