"""The suite's own setting (tests/conftest.py, tests/child_site.py): a child process a test starts imports Lightning
as memplan's user install does, without torchmetrics importing the dev extras transformers and scipy (~1.8 CPU-s
in every child), and can still build a transformers model of its own."""
import json
import sys

from subprocess_run import run_watched

CHILD = """import json, sys
import pytorch_lightning
imported = sorted(m for m in ("transformers", "scipy") if m in sys.modules)
import transformers
print(json.dumps({"with_lightning": imported, "transformers": transformers.LlamaConfig.__name__}))
"""


def test_a_child_imports_lightning_without_the_dev_extras_and_can_still_import_transformers():
    done = run_watched([sys.executable, "-c", CHILD])
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == {"with_lightning": [], "transformers": "LlamaConfig"}

