"""benchmarks.faults' pieces: what a fault case is (Case), the inputs it starts from, the files its setup writes
(plan files, run logs, FIFOs) and the checks that read what it left (benchmarks.faults_cases puts them together)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CHECKOUT = {"code": ROOT}
"""The memplan checkout under test (--code), for setups that run memplan themselves."""
TIME_LIMIT_S = 120

BASE = {
    "trainer": {"devices": 1, "precision": "32-true", "max_steps": 2},
    "model": {"class_path": "memplan.demos.MLP",
              "init_args": {"in_features": 20, "hidden": 8, "depth": 2, "num_classes": 3}},
    "data": {"class_path": "memplan.demos.RandomVectors",
             "init_args": {"batch_size": 4, "in_features": 20, "num_classes": 3, "num_samples": 64}},
    "memplan": {"global_batch_size": 64},
}
PLAN = {"format": 1, "gpu_name": "A100-80GB", "gpus": [], "nodes": 1, "world_size": 2, "micro_batch_size": 8,
        "accumulate_grad_batches": 4, "global_batch_size": 64, "precision": "bf16-mixed",
        "gradient_checkpointing": False, "strategy": "ddp", "predicted_peak_bytes": 1 << 30,
        "device_budget_bytes": 70 << 30, "host_bytes_per_rank": 3 << 30}
GPU = ["--gpu", "A100-80GB"]
A100 = {"name": "NVIDIA A100-SXM4-80GB"}
GiB = 1 << 30


@dataclass(kw_only=True)
class Case:
    """One bad input or fault."""

    id: str
    kind: str
    """The class of problem (issue 23's sections)."""
    argv: list[str]
    """memplan's arguments; CONFIG, PLAN, LOGS and DIR stand for the case's files and folder."""
    expect: str = "refuse"
    """'refuse' (a non-zero exit, the fragment on stderr), 'answer' (exit 0, the fragment in the output)."""
    fragment: str = ""
    """What the message must say (the input as the user wrote it, and what is wrong)."""
    code: int = 2
    config: dict | None = field(default_factory=lambda: BASE)
    setup: Callable[[Path], None] | None = None
    """Writes the case's other files into its folder."""
    check: Callable[[Path, str, str], str | None] | None = None
    """After the run: an outcome ('data loss', 'silent wrong') when the folder or output shows one."""
    gpus: list[dict] | None = None
    """A simulated NVML with these GPUs (SimGpu fields); None: this machine's NVML (none here)."""
    nvml: dict = field(default_factory=dict)
    """SimulatedNvml options: failing / raising for every GPU."""
    env: dict = field(default_factory=dict)
    sigterm_after_s: float | None = None
    """Send SIGTERM this long after the start (the run's own folder is checked after)."""
    command: list[str] | None = None
    """Run this instead of memplan (a launch script); PYTHON, ROOT (the checkout), CONFIG and DIR are replaced."""


def with_changes(changes: dict) -> dict:
    config = json.loads(json.dumps(BASE))
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = config
        for part in parents:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return config


def plan_file(changes: dict) -> Callable[[Path], None]:
    def setup(folder: Path) -> None:
        data = {**PLAN, **changes}
        (folder / "x.plan.json").write_text(json.dumps(data))
    return setup


def raw_file(name: str, data: bytes) -> Callable[[Path], None]:
    def setup(folder: Path) -> None:
        (folder / name).write_bytes(data)
    return setup


def fifo(name: str) -> Callable[[Path], None]:
    def setup(folder: Path) -> None:
        os.mkfifo(folder / name)
    return setup


def anchored() -> dict:
    """BASE with a top-level anchor holder: `defaults: &id001 {...}`, used by model.init_args as *id001."""
    config = json.loads(json.dumps(BASE))
    config["defaults"] = config["model"]["init_args"]  # one object twice: YAML writes an anchor and an alias
    return config


def planned_then_moved(folder: Path) -> None:
    """`memplan suggest --output DIR/a/planned.yaml`, then the pair moved to DIR/b (the planned config
    named its plan by absolute path: training from DIR/b then failed)."""
    (folder / "a").mkdir()
    subprocess.run([sys.executable, "-m", "memplan", "suggest", *GPU, "--gpus", "1", str(folder / "config.yaml"),
                    "--output", str(folder / "a" / "planned.yaml")], check=True, capture_output=True, cwd=folder,
                   env=dict(os.environ, PYTHONPATH=str(CHECKOUT["code"])), timeout=TIME_LIMIT_S)
    (folder / "a").rename(folder / "b")


GPT_HEADS = {"trainer": {"devices": 1, "precision": "32-true"},
             "model": {"class_path": "memplan.demos.GPTLM",
                       "init_args": {"vocab_size": 128, "context": 16, "d_model": 100, "n_layers": 1, "n_heads": 3}},
             "data": {"class_path": "memplan.demos.RandomTokens",
                      "init_args": {"batch_size": 2, "vocab_size": 128, "context": 16, "num_samples": 64}},
             "memplan": {"global_batch_size": 8}}
LLAMA_HEADS = {**GPT_HEADS, "model": {"class_path": "memplan.demos.LlamaLM", "init_args": {
    "vocab_size": 128, "hidden_size": 100, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 3,
    "num_key_value_heads": 3, "context": 16}}}


# --- run logs -------------------------------------------------------------------------------------
RUN = "20261124-050000-aaaaaa"


def record(event: str, step: int, rank: int, **fields) -> str:
    return json.dumps({"event": event, "step": step, "rank": rank, "run": fields.pop("run", RUN),
                       "time": fields.pop("time", 1000.0 + step), **fields}) + "\n"


def sample(step: int, rank: int, **over) -> str:
    fields = {"process_bytes": GiB, "device_used_bytes": 2 * GiB, "device_total_bytes": 16 * GiB,
              "allocated_bytes": None, "reserved_bytes": None, "peak_bytes": GiB, "headroom_bytes": 14 * GiB,
              "micro_batch_size": 8, "accumulate_grad_batches": 1, **over}
    return record("sample", step, rank, **fields)


def finished(rank: int, step: int = 3) -> str:
    return (record("summary", step, rank, peak_process_bytes=GiB, min_headroom_bytes=14 * GiB, oom_retries=0)
            + record("end", step, rank, status="finished", dropped_lines=0))


def logs(files: dict[str, str], fifos: tuple[str, ...] = ()) -> Callable[[Path], None]:
    def setup(folder: Path) -> None:
        (folder / "logs").mkdir()
        for name, text in files.items():
            (folder / "logs" / name).write_text(text)
        for name in fifos:
            os.mkfifo(folder / "logs" / name)
    return setup


def two_ranks(extra0: str = "", extra1: str = "") -> dict[str, str]:
    apply = lambda r: record("apply", 0, r, layout={"world_size": 2, "micro_batch_size": 8})  # noqa: E731
    return {"rank0.jsonl": apply(0) + sample(1, 0) + sample(2, 0) + extra0 + finished(0),
            "rank1.jsonl": apply(1) + sample(1, 1) + sample(2, 1, process_bytes=3 * GiB) + extra1 + finished(1)}


# --- checks after a run -----------------------------------------------------------------------------
def unchanged(name: str, text: str) -> Callable[[Path, str, str], str | None]:
    def check(folder: Path, out: str, err: str) -> str | None:
        return None if (folder / name).read_text() == text else "data loss"
    return check


def pair_whole(folder: Path, out: str, err: str) -> str | None:
    """After a SIGTERM during `suggest --output`: both files or neither, no temporary file."""
    names = {p.name for p in folder.iterdir()}
    hidden = [n for n in names if n.startswith(".")]
    pair = {"planned.yaml", "planned.plan.json"} & names
    if hidden or len(pair) == 1:
        return "data loss"
    if len(pair) == 2:
        plan = json.loads((folder / "planned.plan.json").read_text())
        config = yaml.safe_load((folder / "planned.yaml").read_text())
        if config["trainer"]["accumulate_grad_batches"] != plan["accumulate_grad_batches"]:
            return "data loss"
    return None


def says(*fragments: str) -> Callable[[Path, str, str], str | None]:
    def check(folder: Path, out: str, err: str) -> str | None:
        text = _plain(out + " " + err)
        return None if all(f in text for f in fragments) else "silent wrong"
    return check


def says_not(*fragments: str) -> Callable[[Path, str, str], str | None]:
    def check(folder: Path, out: str, err: str) -> str | None:
        text = _plain(out + " " + err)
        return "silent wrong" if any(f in text for f in fragments) else None
    return check


def short_lines(limit: int) -> Callable[[Path, str, str], str | None]:
    def check(folder: Path, out: str, err: str) -> str | None:
        return None if max((len(line) for line in out.splitlines()), default=0) <= limit else "unclear"
    return check


def _plain(text: str) -> str:
    """Output as one line of words: a table's borders dropped, wrapped lines joined."""
    return " ".join(text.translate({ord(ch): " " for ch in "│┃║"}).split())

