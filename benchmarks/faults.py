"""Bad inputs and faults, replayed through memplan's command line and launch script, counted by outcome.

Each case runs in a fresh process (its own temporary folder, a time limit), from issue 23's list and
more of the same kinds: absurd sizes, files that are not files, bad plan files, implausible plans, run
logs at their edges, NVML going wrong (a SIMULATED NVML, tests/hardware/fake_nvml.py, with the GPUs
the case describes), SIGTERM during `suggest --output`. Each outcome is one of

    clear        refused (or answered) as expected, the message naming the input (the fragment), one
                 or two lines, no traceback
    unclear      refused, but the message does not name the input as expected
    traceback    a Python traceback reached the user
    hang         still running at the time limit
    silent wrong exit 0 where a refusal or an explanation was due, or an answer that misses what it must say
    data loss    a user's file changed, or a planned config / plan left without its partner, or a
                 temporary file left behind

Run from the repository root: `.venv/bin/python -m benchmarks.faults [--only ID ...] [--write]`
(--write stores results/faults.{json,md}). About 10 minutes on 2 CPU cores shared with other work.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CHECKOUT = {"code": ROOT}
"""The memplan checkout under test (--code), for setups that run memplan themselves."""
TIME_LIMIT_S = 120
OUTCOMES = ("clear", "unclear", "traceback", "hang", "silent wrong", "data loss")

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

# The process a case runs: installs the simulated NVML the case describes (if any), then memplan's main.
RUNNER = """
import json, sys
spec = json.loads(sys.argv[1])
if spec.get("gpus") is not None:
    sys.path.insert(0, spec["fake_nvml_dir"])
    import pynvml
    from fake_nvml import SimGpu, SimulatedNvml
    from memplan.hardware import nvml
    def error(text):
        kind, _, message = text.partition(": ")
        return {"RuntimeError": RuntimeError, "OSError": OSError}[kind](message)
    gpus = []
    for g in spec["gpus"]:
        g = dict(g)
        g["failing"] = {f: getattr(pynvml, code) for f, code in g.get("failing", {}).items()}
        g["raising"] = {f: error(text) for f, text in g.get("raising", {}).items()}
        gpus.append(SimGpu(**g))
    nvml.set_backend(SimulatedNvml(gpus, raising={f: error(t) for f, t in spec.get("raising", {}).items()},
                                   failing={f: getattr(pynvml, c) for f, c in spec.get("failing", {}).items()}))
from memplan.commands.cli import main
sys.exit(main(spec["argv"]))
"""


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


def cases() -> list[Case]:
    big = "9" * 20
    c: list[Case] = []
    # 1. absurd sizes on the command line
    c += [
        Case(id="gpus-20-digits", kind="absurd size", argv=["suggest", *GPU, "--gpus", big, "CONFIG"],
             fragment="argument --gpus: must be from 1 to 64"),
        Case(id="gpus-1000-one-node", kind="absurd size", argv=["suggest", *GPU, "--gpus", "1000", "CONFIG"],
             fragment="argument --gpus: must be from 1 to 64 (GPUs per node); for more GPUs, add nodes with --nodes"),
        Case(id="gpus-5000-digits", kind="absurd size", argv=["suggest", *GPU, "--gpus", "9" * 5000, "CONFIG"],
             fragment="argument --gpus: must be a whole number"),
        Case(id="nodes-10e7", kind="absurd size", argv=["suggest", *GPU, "--nodes", "10000000", "CONFIG"],
             fragment="argument --nodes: must be from 1 to 32,768"),
        Case(id="global-batch-10e30-flag", kind="absurd size",
             argv=["suggest", *GPU, "--global-batch-size", "1" + "0" * 30, "CONFIG"],
             fragment="argument --global-batch-size: must be from 1 to 16,777,216"),
        Case(id="gpu-memory-negative", kind="absurd size", argv=["suggest", "--gpu-memory", "-5GiB", "CONFIG"],
             fragment="argument --gpu-memory: must be a positive size"),
        Case(id="gpu-memory-no-unit", kind="absurd size", argv=["suggest", "--gpu-memory", "24", "CONFIG"],
             fragment="argument --gpu-memory: 24 what?"),
        Case(id="gpu-memory-24TiB", kind="absurd size", argv=["suggest", "--gpu-memory", "24TiB", "CONFIG"],
             fragment="--gpu-memory 24.00 TiB is outside what a GPU has"),
        Case(id="margin-inf", kind="absurd size", argv=["suggest", *GPU, "--margin", "inf", "CONFIG"],
             fragment="argument --margin: must be a fraction"),
        Case(id="estimate-batch-10e30", kind="absurd size",
             argv=["estimate", "CONFIG", "--batch-size", "1" + "0" * 30], fragment="argument --batch-size: must be from 1"),
        Case(id="estimate-ddp-10e7", kind="absurd size", argv=["estimate", "CONFIG", "--batch-size", "4", "--ddp",
                                                               "10000000"], fragment="argument --ddp: must be from 1"),
        Case(id="validate-steps-10e9", kind="absurd size", argv=["validate", "CONFIG", "--steps", "1000000000"],
             fragment="argument --steps: must be from 1 to 1,000"),
        Case(id="watch-interval-inf", kind="absurd size", argv=["watch", "DIR", "--interval", "inf"],
             fragment="argument --interval: must be a number of seconds"),
        Case(id="watch-interval-nan", kind="absurd size", argv=["watch", "DIR", "--interval", "nan"],
             fragment="argument --interval: must be a number of seconds"),
        Case(id="report-version-negative", kind="absurd size", argv=["report", "DIR", "--version", "-1"],
             fragment="argument --version: must be from 0"),
    ]
    # 1b. absurd sizes in the YAML
    for cid, changes, fragment in [
        ("yaml-global-batch-10e30", {"memplan.global_batch_size": 10**30}, "memplan.global_batch_size must be a positive int up to 16,777,216"),
        ("yaml-prefetch-10e9", {"memplan.prefetch_factor": 10**9}, "memplan.prefetch_factor must be a positive int up to 64"),
        ("yaml-workers-10e6", {"data.init_args.num_workers": 10**6}, "data.init_args.num_workers must be a whole number from 0 to 256"),
        ("yaml-data-batch-10e30", {"data.init_args.batch_size": 10**30, "memplan.global_batch_size": None},
         "data.init_args.batch_size must be a whole number from 1 to 16,777,216"),
        ("yaml-devices-10e30", {"trainer.devices": 10**30}, "trainer.devices is per node and must be at most 64"),
        ("yaml-num-nodes-10e30", {"trainer.num_nodes": 10**30}, "trainer.num_nodes must be a whole number from 1 to 32,768"),
        ("yaml-accumulate-10e30", {"trainer.accumulate_grad_batches": 10**30}, "trainer.accumulate_grad_batches must be a whole number"),
        ("yaml-config-global-batch-2e33", {"memplan.global_batch_size": None, "data.init_args.batch_size": 1 << 20,
                                           "trainer.devices": 8, "trainer.accumulate_grad_batches": 1 << 10},
         "a global batch of 8,589,934,592 samples is more than the 16,777,216 memplan plans for"),
        ("yaml-global-batch-string", {"memplan.global_batch_size": "64"}, "memplan.global_batch_size must be a positive int"),
        ("yaml-margin-1.5", {"memplan.margin": 1.5}, "memplan.margin must be a fraction"),
        ("yaml-section-typo", {"modle": {"class_path": "x"}}, "modle: is not a LightningCLI section (did you mean 'model'?)"),
        ("yaml-extra-top-level-key", {"notes": "run 3"}, "notes: in"),
        ("yaml-fit-subcommand-section", {"fit": {"trainer": {"devices": 1}}}, "fit: in"),
    ]:
        c.append(Case(id=cid, kind="absurd size (YAML)", argv=["suggest", *GPU, "CONFIG"], config=with_changes(changes),
                      fragment=fragment))
    # 1b'. configs LightningCLI would refuse, and config values that do not fit together
    c += [
        Case(id="yaml-anchor-holder", kind="absurd size (YAML)", argv=["suggest", *GPU, "CONFIG"], config=anchored(),
             fragment="defaults: in", check=says("is not a key LightningCLI's fit accepts at the top level",
                                                 "define each anchor where its value is first used")),
        Case(id="heads-not-dividing-width", kind="config values", argv=["estimate", "CONFIG", "--batch-size", "2"],
             config=GPT_HEADS, fragment="model.init_args.n_heads (3) does not divide model.init_args.d_model (100)",
             check=says("set model.init_args.n_heads to a divisor of 100 (2, 4, 5)")),
        Case(id="heads-not-dividing-width-transformers", kind="config values", argv=["suggest", *GPU, "CONFIG"],
             config=LLAMA_HEADS,
             fragment="model.init_args.num_attention_heads (3) does not divide model.init_args.hidden_size (100)"),
    ]
    # 1c. files that are not (small) files
    c += [
        Case(id="config-dev-zero", kind="not a file", argv=["suggest", *GPU, "/dev/zero"], config=None,
             fragment="config file /dev/zero is a character device, not a regular file"),
        Case(id="config-fifo", kind="not a file", argv=["suggest", *GPU, "DIR/pipe.yaml"], config=None,
             setup=fifo("pipe.yaml"), fragment="is a FIFO (named pipe), not a regular file"),
        Case(id="config-folder", kind="not a file", argv=["suggest", *GPU, "DIR"], config=None,
             fragment="is a folder, not a regular file"),
        Case(id="config-17MiB", kind="not a file", argv=["suggest", *GPU, "DIR/big.yaml"], config=None,
             setup=raw_file("big.yaml", b"# " + b"x" * (17 << 20) + b"\n"), fragment="is larger than 16.00 MiB"),
        Case(id="config-binary", kind="not a file", argv=["suggest", *GPU, "DIR/bin.yaml"], config=None,
             setup=raw_file("bin.yaml", bytes(range(256)) * 4), fragment="is not UTF-8 text"),
        Case(id="config-empty", kind="not a file", argv=["suggest", *GPU, "DIR/empty.yaml"], config=None,
             setup=raw_file("empty.yaml", b""), fragment="got an empty file"),
        Case(id="config-missing", kind="not a file", argv=["suggest", *GPU, "DIR/none.yaml"], config=None,
             fragment="does not exist"),
        Case(id="plan-dev-zero", kind="not a file", argv=["validate", "CONFIG", "--plan", "/dev/zero"],
             fragment="--plan /dev/zero is a character device"),
        Case(id="plan-fifo", kind="not a file", argv=["validate", "CONFIG", "--plan", "DIR/x.plan.json"],
             setup=fifo("x.plan.json"), fragment="is a FIFO (named pipe)"),
    ]
    # 1d. plan files
    for cid, changes, fragment in [
        ("plan-micro-10e30", {"micro_batch_size": 10**30, "global_batch_size": 8 * 10**30},
         "Plan.micro_batch_size must be a whole number from 1 to 16,777,216"),
        ("plan-format-string", {"format": "1"}, "plan file format must be the number 1"),
        ("plan-alternatives-missing", {"alternatives": [{"world_size": 1}]}, "Plan.alternatives[0] lacks"),
        ("plan-alternatives-unknown", {"alternatives": [{"speed": 1}]}, "Plan.alternatives[0] has unknown keys ['speed']"),
        ("plan-alternatives-not-list", {"alternatives": {"a": 1}}, "Plan.alternatives must be a list"),
        ("plan-gpus-twice", {"gpus": [0, 0]}, "Plan.gpus names a GPU twice"),
        ("plan-world-10e7", {"world_size": 10**7, "accumulate_grad_batches": 1, "micro_batch_size": 1,
                             "global_batch_size": 10**7}, "Plan.world_size must be a whole number from 1 to 262,144"),
        ("plan-peak-negative", {"predicted_peak_bytes": -1}, "Plan.predicted_peak_bytes must be an int >= 0"),
    ]:
        c.append(Case(id=cid, kind="bad plan file", argv=["validate", "CONFIG", "--plan", "DIR/x.plan.json"],
                      setup=plan_file(changes), fragment=fragment))
    # 1e. implausible plans: explained, or refused
    c += [
        Case(id="global-batch-509-on-4", kind="implausible plan", expect="answer",
             argv=["suggest", *GPU, "--gpus", "4", "--json", "CONFIG"], config=with_changes({"memplan.global_batch_size": 509}),
             fragment="the plan uses 1 of the 4 GPUs per node --gpus gives",
             check=says("does not split evenly over 2, 3, 4 ranks")),
        Case(id="global-batch-509-on-3", kind="implausible plan", expect="answer",
             argv=["suggest", *GPU, "--gpus", "3", "--json", "CONFIG"], config=with_changes({"memplan.global_batch_size": 509}),
             fragment="the plan uses 1 of the 3 GPUs per node --gpus gives"),
        Case(id="gpus-48-global-1024", kind="implausible plan", expect="answer",
             argv=["suggest", *GPU, "--gpus", "48", "--json", "CONFIG"], config=with_changes({"memplan.global_batch_size": 1024}),
             fragment="of the 48 GPUs per node --gpus gives",  # (1 since the step-time model: more are no faster)
             check=says("no setting is predicted faster", "does not split evenly over")),
        Case(id="more-ranks-than-batch", kind="implausible plan", argv=["suggest", *GPU, "--gpus", "8", "--nodes", "16",
                                                                        "CONFIG"],
             fragment="--gpus 8 x --nodes 16 = 128 ranks, more than the global batch of 64"),
    ]
    # --output
    c += [
        Case(id="output-exists", kind="output", argv=["suggest", *GPU, "CONFIG", "--output", "DIR/planned.yaml"],
             setup=raw_file("planned.yaml", b"the user's\n"), fragment="pass --force",
             check=unchanged("planned.yaml", "the user's\n")),
        Case(id="output-is-source", kind="output", argv=["suggest", *GPU, "CONFIG", "--output", "CONFIG"],
             fragment="is the source config"),
        Case(id="output-plan-json", kind="output", argv=["suggest", *GPU, "CONFIG", "--output", "DIR/x.plan.json"],
             fragment="names a plan file; --output names the planned config"),
    ]
    c.append(Case(id="planned-pair-moved", kind="output", expect="answer", setup=planned_then_moved, argv=[],
                  command=["PYTHON", "ROOT/launch/train.py", "fit", "--config", "DIR/b/planned.yaml",
                           "--trainer.max_steps=2", "--trainer.accelerator=cpu", "--trainer.logger=false",
                           "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false"],
                  env={"CUDA_VISIBLE_DEVICES": ""}, fragment="MemoryPlanner summary"))
    for delay in (0.5, 2.0, 3.5, 5.0, 6.5):
        c.append(Case(id=f"sigterm-suggest-output-{delay:g}s", kind="preemption", expect="signal",
                      argv=["suggest", *GPU, "CONFIG", "--output", "DIR/planned.yaml"], sigterm_after_s=delay,
                      check=pair_whole))
    # 4. run logs
    c += [
        Case(id="log-impossible-values", kind="logs", expect="answer", argv=["report", "DIR/logs", "--output", "DIR/r.png"],
             setup=logs(two_ranks(sample(3, 0, peak_bytes=10**30) + sample(4, 0, process_bytes=-5),
                                  record("sample", 10**20, 1))),
             fragment="1 impossible peak_bytes, 1 impossible process_bytes", check=says("1 impossible step")),
        Case(id="log-rank01-beside-rank1", kind="logs", expect="answer", argv=["report", "DIR/logs", "--output", "DIR/r.png"],
             setup=logs({**two_ranks(), "rank01.jsonl": two_ranks()["rank1.jsonl"]}),
             fragment="not read: rank01.jsonl: not a name MemoryPlanner writes"),
        Case(id="log-fifo", kind="logs", expect="answer", argv=["report", "DIR/logs", "--output", "DIR/r.png"],
             setup=logs(two_ranks(), fifos=("rank2.jsonl",)), fragment="could not read rank2.jsonl: not a regular file"),
        Case(id="log-fifo-watch-once", kind="logs", expect="answer", argv=["watch", "DIR/logs", "--once"],
             setup=logs(two_ranks(), fifos=("rank2.jsonl",)), fragment="rank2.jsonl"),
        Case(id="log-20000-runs", kind="logs", expect="answer", argv=["watch", "DIR/logs", "--once"],
             setup=logs({"rank0.jsonl": "".join(sample(1, 0, run=f"2026-{i:06d}", time=float(i)) for i in range(20_000))}),
             fragment="19,994 older", check=short_lines(400)),
        Case(id="log-sigterm-blame", kind="logs", expect="answer", argv=["report", "DIR/logs", "--output", "DIR/r.png"],
             setup=logs({"rank0.jsonl": record("apply", 0, 0, layout={"world_size": 2}) + sample(1, 0)
                         + record("end", 1, 0, status="failed: RuntimeError: Connection closed by peer", time=1500.0),
                         "rank1.jsonl": record("apply", 0, 1, layout={"world_size": 2}) + sample(1, 1)
                         + record("end", 1, 1, status="failed: RankTerminated: 143", time=1400.0)}),
             fragment="rank 1 failed: RankTerminated: 143 (SIGTERM received)"),
        Case(id="log-over-long-line", kind="logs", expect="answer", argv=["report", "DIR/logs", "--output", "DIR/r.png"],
             setup=logs(two_ranks('{"event": "sample", "x": "' + "y" * (2 << 20) + '"}\n')),
             fragment="line longer than 1.00 MiB"),
        Case(id="log-empty-folder", kind="logs", argv=["report", "DIR/logs"], setup=logs({}),
             fragment="no MemoryPlanner rank logs"),
        Case(id="log-not-a-folder", kind="logs", argv=["report", "DIR/none"], fragment="does not exist"),
        Case(id="log-only-garbage", kind="logs", argv=["report", "DIR/logs"],
             setup=logs({"rank0.jsonl": "\x00\x01 garbage\n[1]\n"}), fragment="no readable MemoryPlanner record"),
        Case(id="watch-piped-ends-with-the-run", kind="logs", expect="answer", argv=["watch", "DIR/logs", "--interval", "0.1"],
             setup=logs(two_ranks()), fragment="ended: finished", check=says("rank 0 step 2", "rank 1 step 2")),
    ]
    # 3. NVML going wrong (simulated)
    two = [A100, A100]
    for cid, value, fragment in [
        ("cvd-garbage", "garbage", "CUDA_VISIBLE_DEVICES='garbage': 'garbage' is not a GPU index or UUID"),
        ("cvd-0-0", "0,0", "CUDA_VISIBLE_DEVICES='0,0' names '0' twice"),
        ("cvd-7", "7", "CUDA_VISIBLE_DEVICES='7': GPU 7 does not exist here"),
        ("cvd-empty", "", "CUDA_VISIBLE_DEVICES='' is empty"),
    ]:
        c.append(Case(id=cid, kind="NVML", argv=["suggest", "CONFIG"], gpus=two, env={"CUDA_VISIBLE_DEVICES": value},
                      fragment=fragment))
    c += [
        Case(id="nvml-timeout-all", kind="NVML", argv=["suggest", "CONFIG"], gpus=two,
             nvml={"failing": {"nvmlDeviceGetMemoryInfo": "NVML_ERROR_TIMEOUT"}},
             fragment="no visible GPU answers NVML: cuda:0 (NVML index 0, NVIDIA A100-SXM4-80GB): NVML cannot read"),
        Case(id="nvml-zero-total", kind="NVML", argv=["suggest", "CONFIG"], gpus=[{**A100, "total_bytes": 0}],
             fragment="NVML reports 0 bytes of memory on it", check=says_not("DeviceBudget")),
        Case(id="nvml-one-lost-gpus-1", kind="NVML", expect="answer", argv=["suggest", "CONFIG", "--gpus", "1", "--json"],
             gpus=[A100, {**A100, "failing": {"nvmlDeviceGetMemoryInfo": "NVML_ERROR_GPU_IS_LOST"}}],
             fragment="left out of the plan: cuda:1 (NVML index 1"),
        Case(id="nvml-runtimeerror-one-gpu", kind="NVML", expect="answer", argv=["suggest", "CONFIG", "--json"],
             gpus=[A100, {**A100, "raising": {"nvmlDeviceGetMemoryInfo": "RuntimeError: binding bug"}}],
             fragment="planning on the 1 GPU(s) that answer"),
        Case(id="nvml-init-runtimeerror", kind="NVML", argv=["suggest", "CONFIG"], gpus=two,
             nvml={"raising": {"nvmlInit": "RuntimeError: driver timed out"}},
             fragment="nvmlInit raised RuntimeError: driver timed out"),
        Case(id="nvml-more-gpus-than-answer", kind="NVML", argv=["suggest", "CONFIG", "--gpus", "2"],
             gpus=[A100, {**A100, "failing": {"nvmlDeviceGetMemoryInfo": "NVML_ERROR_GPU_IS_LOST"}}],
             fragment="--gpus 2: this node has 1 GPU(s) visible to NVML, and 1 more that do not answer"),
        Case(id="devices-cvd-garbage", kind="NVML", expect="answer", argv=["devices"], gpus=two,
             env={"CUDA_VISIBLE_DEVICES": "garbage"}, fragment="'garbage' is not a GPU index or UUID"),
    ]
    return c


def run_case(case: Case, folder: Path, code: Path = ROOT) -> dict:
    if case.config is not None:
        (folder / "config.yaml").write_text(yaml.safe_dump(case.config, sort_keys=False))
    if case.setup is not None:
        CHECKOUT["code"] = code
        case.setup(folder)
    argv = [a.replace("CONFIG", str(folder / "config.yaml")).replace("DIR", str(folder)) for a in case.argv]
    spec = {"argv": argv, "gpus": case.gpus, "fake_nvml_dir": str(ROOT / "tests" / "hardware"), **case.nvml}
    env = dict(os.environ, PYTHONPATH=str(code), **case.env)
    if "CUDA_VISIBLE_DEVICES" not in case.env:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    started = time.monotonic()
    argv_run = [sys.executable, "-c", RUNNER, json.dumps(spec)]
    if case.command is not None:
        argv_run = [a.replace("CONFIG", str(folder / "config.yaml")).replace("DIR", str(folder))
                    .replace("PYTHON", sys.executable).replace("ROOT", str(code)) for a in case.command]
    proc = subprocess.Popen(argv_run, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if case.sigterm_after_s is not None:
            try:
                proc.wait(timeout=case.sigterm_after_s)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=TIME_LIMIT_S)
        hung = False
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        hung = True
    return {"code": proc.returncode, "out": out, "err": err, "hung": hung, "seconds": time.monotonic() - started}


def classify(case: Case, result: dict, folder: Path) -> tuple[str, str]:
    """(outcome, what was seen)."""
    out, err, code = result["out"], result["err"], result["code"]
    text = _plain(out + " " + err)
    first = next((line for line in err.splitlines() if line.strip()), "") or next(
        (line for line in out.splitlines() if line.strip()), "")
    if result["hung"]:
        return "hang", f"still running after {TIME_LIMIT_S} s"
    if "Traceback (most recent call last)" in err:
        return "traceback", err.strip().splitlines()[-1][:200]
    if case.check is not None:
        problem = case.check(folder, out, err)
        if problem is not None:
            return problem, f"exit {code}: {first[:200]}"
    if case.expect == "signal":
        return "clear", f"exit {code} (SIGTERM at {case.sigterm_after_s} s): files whole"
    if case.expect == "answer":
        if code != 0:
            return ("unclear" if case.fragment not in text else "clear"), f"exit {code}: {first[:200]}"
        return ("clear" if case.fragment in text else "silent wrong"), f"exit 0: {case.fragment if case.fragment in text else first[:200]}"
    if code == 0:
        return "silent wrong", f"exit 0 where a refusal was due: {first[:200]}"
    if case.fragment in text and code == case.code and len(err.strip().splitlines()) <= 2:
        return "clear", f"exit {code}: {first[:200]}"
    return "unclear", f"exit {code}: {first[:200]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="run these case ids")
    parser.add_argument("--write", action="store_true", help="write benchmarks/results/faults.{json,md}")
    parser.add_argument("--code", metavar="CHECKOUT", type=Path, default=ROOT,
                        help="run another checkout's memplan (e.g. the main branch) on the same cases; the simulated "
                             "NVML stays this one's")
    args = parser.parse_args(argv)
    if args.write and args.code.resolve() != ROOT:
        parser.error("--write stores this checkout's figures; drop --code")
    chosen = [c for c in cases() if args.only is None or c.id in args.only]
    rows = []
    for case in chosen:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            result = run_case(case, folder, args.code.resolve())
            outcome, seen = classify(case, result, folder)
        rows.append({"id": case.id, "kind": case.kind, "outcome": outcome, "seen": seen,
                     "seconds": round(result["seconds"], 1)})
        print(f"{outcome:>12}  {case.id:<34} {seen[:150]}", flush=True)
    counts = Counter(r["outcome"] for r in rows)
    summary = {o: counts.get(o, 0) for o in OUTCOMES}
    print(f"\n{len(rows)} cases: " + ", ".join(f"{n} {o}" for o, n in summary.items()))
    if args.write:
        results = ROOT / "benchmarks" / "results"
        (results / "faults.json").write_text(json.dumps({"cases": len(rows), "counts": summary, "rows": rows},
                                                        indent=2) + "\n")
        lines = ["# Fault benchmark (`python -m benchmarks.faults`)", "",
                 f"{len(rows)} cases: " + ", ".join(f"{n} {o}" for o, n in summary.items()), "",
                 "| case | class | outcome | what was seen |", "|---|---|---|---|"]
        lines += [f"| {r['id']} | {r['kind']} | {r['outcome']} | {r['seen'].replace('|', '/')} |" for r in rows]
        (results / "faults.md").write_text("\n".join(lines) + "\n")
        print(f"wrote {results / 'faults.json'} and faults.md")
    return 0 if all(r["outcome"] == "clear" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
