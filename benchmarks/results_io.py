"""Where benchmark results go and how they are written: one JSON (the figures, bytes as ints) and
one Markdown table per benchmark, in benchmarks/results/, committed."""
from __future__ import annotations

import json
import os
import platform
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def write_results(name: str, report: dict, markdown: str, *, indent: int = 2) -> None:
    """Write results/<name>.json and results/<name>.md."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=indent) + "\n")
    (RESULTS / f"{name}.md").write_text(markdown)


def machine() -> dict:
    """The CPU, Python, torch and transformers a result was measured with."""
    import torch
    import transformers

    model = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")),
        platform.processor(),
    ) if Path("/proc/cpuinfo").exists() else platform.processor()
    return {
        "cpu": model, "cpu_count": os.cpu_count(), "platform": platform.platform(),
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
    }
