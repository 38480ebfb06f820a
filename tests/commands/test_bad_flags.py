"""Bad command-line flags, each refused before anything is traced, with exit code 2 (1 where noted), at most two
lines on stderr, no traceback, and a message that names the flag as the user wrote it; --gpus beyond what NVML
sees, --output paths, and an absurd batch given to the planner. The YAML keys and files are test_bad_yaml.py's,
the plan files test_bad_plan_files.py's; together they are the table the issue asks for.

A row fails if its message stops naming the flag: the fragment is the flag's name plus what was wrong.
"""
from __future__ import annotations

import pytest
from refusals import (
    BASE,
    GPU,
    SimGpu,
    SimulatedNvml,
    assert_refused,
    config_with,
    no_gpu_and_no_trace,  # noqa: F401  (autouse)
    run,
    write_config,
)
from test_bad_plan_files import PLAN_CASES
from test_bad_yaml import YAML_CASES

from memplan.hardware import nvml

# (id, argv with CONFIG standing for the config path, YAML changes, exit code, fragment naming the input)
FLAG_CASES = [
    # suggest: GPUs
    ("gpus-0", ["suggest", *GPU, "--gpus", "0", "CONFIG"], {}, 2, "argument --gpus: must be a positive"),
    ("gpus-negative", ["suggest", *GPU, "--gpus", "-3", "CONFIG"], {}, 2, "argument --gpus: must be a positive"),
    ("gpus-word", ["suggest", *GPU, "--gpus", "two", "CONFIG"], {}, 2, "argument --gpus: must be a whole number"),
    ("gpus-fraction", ["suggest", *GPU, "--gpus", "2.5", "CONFIG"], {}, 2, "argument --gpus: must be a whole number"),
    ("gpus-over-global-batch", ["suggest", *GPU, "--gpus", "64", "--global-batch-size", "32", "CONFIG"], {}, 2,
     "--gpus 64 x --nodes 1 = 64 ranks, more than the global batch of 32"),
    ("gpus-over-global-batch-nodes", ["suggest", *GPU, "--gpus", "8", "--nodes", "16", "CONFIG"], {}, 2,
     "--gpus 8 x --nodes 16 = 128 ranks, more than the global batch of 64"),
    ("gpu-unknown", ["suggest", "--gpu", "GTX-9999", "CONFIG"], {}, 2, "argument --gpu: 'GTX-9999' is not a GPU"),
    ("gpu-ambiguous", ["suggest", "--gpu", "A100", "CONFIG"], {}, 2, "argument --gpu: 'A100' is ambiguous"),
    ("gpu-and-gpu-memory", ["suggest", *GPU, "--gpu-memory", "24GiB", "CONFIG"], {}, 2, "--gpu and --gpu-memory"),
    ("gpu-memory-no-unit", ["suggest", "--gpu-memory", "24", "CONFIG"], {}, 2, "argument --gpu-memory: 24 what?"),
    ("gpu-memory-zero", ["suggest", "--gpu-memory", "0GiB", "CONFIG"], {}, 2,
     "argument --gpu-memory: must be a positive size"),
    ("gpu-memory-negative", ["suggest", "--gpu-memory=-5GiB", "CONFIG"], {}, 2,
     "argument --gpu-memory: must be a positive size"),
    ("gpu-memory-bad-unit", ["suggest", "--gpu-memory", "24XB", "CONFIG"], {}, 2,
     "argument --gpu-memory: must be a size with a unit"),
    ("gpu-memory-word", ["suggest", "--gpu-memory", "lots", "CONFIG"], {}, 2,
     "argument --gpu-memory: must be a size with a unit"),
    ("gpu-memory-too-small", ["suggest", "--gpu-memory", "24MB", "CONFIG"], {}, 2,
     "--gpu-memory 22.89 MiB is outside what a GPU has"),
    ("gpu-memory-too-large", ["suggest", "--gpu-memory", "24TiB", "CONFIG"], {}, 2,
     "--gpu-memory 24.00 TiB is outside what a GPU has"),
    ("no-gpu-here", ["suggest", "CONFIG"], {}, 2, "pass --gpu H100-80GB"),
    # absurd sizes: refused by range at parse time, never looped over or overflowed
    ("gpus-20-digits", ["suggest", *GPU, "--gpus", "99999999999999999999", "CONFIG"], {}, 2,
     "argument --gpus: must be from 1 to 64 (GPUs per node); for more GPUs, add nodes with --nodes"),
    ("gpus-more-than-a-node", ["suggest", *GPU, "--gpus", "1000", "CONFIG"], {}, 2, "argument --gpus: must be from 1 to 64"),
    ("gpus-5000-digits", ["suggest", *GPU, "--gpus", "9" * 5000, "CONFIG"], {}, 2,
     "argument --gpus: must be a whole number (GPUs per node); got 5000 characters"),
    ("global-batch-10e30", ["suggest", *GPU, "--global-batch-size", "1" + "0" * 30, "CONFIG"], {}, 2,
     "argument --global-batch-size: must be from 1 to 16,777,216"),
    ("nodes-huge", ["suggest", *GPU, "--nodes", "10000000", "CONFIG"], {}, 2, "argument --nodes: must be from 1 to 32,768"),
    ("gpu-memory-negative-spaced", ["suggest", "--gpu-memory", "-5GiB", "CONFIG"], {}, 2,
     "argument --gpu-memory: must be a positive size"),
    ("gpus-negative-spaced", ["suggest", *GPU, "--gpus", "-1", "CONFIG"], {}, 2, "argument --gpus: must be a positive"),
    ("estimate-batch-10e30", ["estimate", "CONFIG", "--batch-size", "1" + "0" * 30], {}, 2,
     "argument --batch-size: must be from 1 to 16,777,216"),
    ("estimate-ddp-huge", ["estimate", "CONFIG", "--batch-size", "4", "--ddp", "10000000"], {}, 2,
     "argument --ddp: must be from 1 to 262,144"),
    ("validate-steps-huge", ["validate", "CONFIG", "--steps", "1000000000"], {}, 2,
     "argument --steps: must be from 1 to 1,000 (real training steps)"),
    ("validate-steps-0", ["validate", "CONFIG", "--steps", "0"], {}, 2, "argument --steps: must be a positive"),
    ("watch-interval-inf", ["watch", "CONFIG", "--interval", "inf"], {}, 2,
     "argument --interval: must be a number of seconds from 0.01 to 3600"),
    ("watch-interval-nan", ["watch", "CONFIG", "--interval", "nan"], {}, 2, "argument --interval: must be a number"),
    ("watch-interval-negative", ["watch", "CONFIG", "--interval", "-1"], {}, 2, "argument --interval: must be a number"),
    ("watch-interval-word", ["watch", "CONFIG", "--interval", "soon"], {}, 2, "argument --interval: must be a number"),
    ("report-version-negative", ["report", "CONFIG", "--version", "-1"], {}, 2, "argument --version: must be from 0"),
    ("report-version-huge", ["report", "CONFIG", "--version", "1" + "0" * 30], {}, 2, "argument --version: must be from 0"),
    # suggest: batch, nodes, margin, precision
    ("nodes-0", ["suggest", *GPU, "--nodes", "0", "CONFIG"], {}, 2, "argument --nodes: must be a positive"),
    ("nodes-word", ["suggest", *GPU, "--nodes", "x", "CONFIG"], {}, 2, "argument --nodes: must be a whole number"),
    ("global-batch-0", ["suggest", *GPU, "--global-batch-size", "0", "CONFIG"], {}, 2,
     "argument --global-batch-size: must be a positive"),
    ("global-batch-negative", ["suggest", *GPU, "--global-batch-size", "-5", "CONFIG"], {}, 2,
     "argument --global-batch-size: must be a positive"),
    ("global-batch-float", ["suggest", *GPU, "--global-batch-size", "1e3", "CONFIG"], {}, 2,
     "argument --global-batch-size: must be a whole number"),
    ("global-batch-over-nodes", ["suggest", *GPU, "--global-batch-size", "7", "--nodes", "2", "CONFIG"], {}, 2,
     "--global-batch-size (7) must be divisible by --nodes 2"),
    ("margin-over-1", ["suggest", *GPU, "--margin", "1.5", "CONFIG"], {}, 2, "argument --margin: must be a fraction"),
    ("margin-1", ["suggest", *GPU, "--margin", "1", "CONFIG"], {}, 2, "argument --margin: must be a fraction"),
    ("margin-percent", ["suggest", *GPU, "--margin", "10", "CONFIG"], {}, 2, "write 0.1"),
    ("margin-negative", ["suggest", *GPU, "--margin", "-0.1", "CONFIG"], {}, 2, "argument --margin: must be a fraction"),
    ("margin-nan", ["suggest", *GPU, "--margin", "nan", "CONFIG"], {}, 2, "argument --margin: must be a fraction"),
    ("margin-word", ["suggest", *GPU, "--margin", "some", "CONFIG"], {}, 2, "argument --margin: must be a fraction"),
    ("precision-64", ["suggest", *GPU, "--precision", "64", "CONFIG"], {}, 2,
     "argument --precision: '64': Lightning runs it, but memplan does not estimate it"),
    ("precision-typo", ["suggest", *GPU, "--precision", "bf16-mixd", "CONFIG"], {}, 2,
     "argument --precision: must be a Lightning precision"),
    ("precision-fp16", ["suggest", *GPU, "--precision", "fp16", "CONFIG"], {}, 2,
     "argument --precision: must be a Lightning precision"),
    ("precision-not-searched", ["suggest", *GPU, "--precision", "16-true", "CONFIG"], {}, 2,
     "--precision: the planner searches"),
    ("precision-bf16-on-v100", ["suggest", "--gpu", "V100-32GB", "--precision", "bf16", "CONFIG"], {}, 2,
     "--precision: bf16-mixed needs compute capability 8.0+"),
    ("unknown-flag", ["suggest", *GPU, "--gpus-per-node", "2", "CONFIG"], {}, 2, "unrecognized arguments: --gpus-per-node"),
    # estimate
    ("estimate-batch-0", ["estimate", "CONFIG", "--batch-size", "0"], {}, 2, "argument --batch-size: must be a positive"),
    ("estimate-batch-word", ["estimate", "CONFIG", "--batch-size", "x"], {}, 2,
     "argument --batch-size: must be a whole number"),
    ("estimate-batch-missing", ["estimate", "CONFIG"], {}, 2, "the following arguments are required: --batch-size"),
    ("estimate-ddp-0", ["estimate", "CONFIG", "--batch-size", "4", "--ddp", "0"], {}, 2,
     "argument --ddp: must be a positive"),
    ("estimate-ddp-negative", ["estimate", "CONFIG", "--batch-size", "4", "--ddp", "-2"], {}, 2,
     "argument --ddp: must be a positive"),
    ("estimate-precision-64", ["estimate", "CONFIG", "--batch-size", "4", "--precision", "64-true"], {}, 2,
     "argument --precision: '64-true': Lightning runs it"),
    ("estimate-device-unknown", ["estimate", "CONFIG", "--batch-size", "4", "--device", "cuda2"], {}, 2,
     "argument --device: must be 'cpu', 'cuda'"),
    ("estimate-device-no-unit", ["estimate", "CONFIG", "--batch-size", "4", "--device", "24"], {}, 2,
     "argument --device: must be 'cpu', 'cuda'"),
    ("estimate-optimizer", ["estimate", "CONFIG", "--batch-size", "4", "--optimizer", "adamm"], {}, 2,
     "argument --optimizer: must be one of"),
    ("estimate-demo", ["estimate", "--demo", "gpt3", "--batch-size", "4"], {}, 2, "argument --demo: must be one of"),
    ("estimate-batch-huge", ["estimate", "CONFIG", "--batch-size", "100000000000"], {}, 2,
     "argument --batch-size: must be from 1 to 16,777,216 (samples per device); got '100000000000'"),
    ("estimate-demo-batch-huge", ["estimate", "--demo", "gpt2-small", "--batch-size", "16777216"], {}, 2,
     "--batch-size 16777216: the batch alone is"),
    ("estimate-neither", ["estimate", "--batch-size", "4"], {}, 2, "pass a config file or --demo NAME"),
    ("estimate-both", ["estimate", "CONFIG", "--demo", "mlp", "--batch-size", "4"], {}, 2,
     "pass a config file or --demo NAME"),
    ("no-command", [], {}, 2, "the following arguments are required: command"),
    ("unknown-command", ["plan", "CONFIG"], {}, 2, "argument command: invalid choice: 'plan'"),
]


@pytest.mark.parametrize(("argv", "changes", "code", "fragment"), [c[1:] for c in FLAG_CASES],
                         ids=[c[0] for c in FLAG_CASES])
def test_bad_flags_are_refused_by_name(capsys, tmp_path, argv, changes, code, fragment):
    config = write_config(tmp_path, config_with(changes))
    got, _, err = run(capsys, [config if a == "CONFIG" else a for a in argv])
    assert_refused(got, err, code, fragment)


def test_more_gpus_than_nvml_sees_names_both_numbers(capsys, tmp_path):
    nvml.set_backend(SimulatedNvml([SimGpu(), SimGpu()]))
    got, _, err = run(capsys, ["suggest", "--gpus", "8", write_config(tmp_path, BASE)])
    assert_refused(got, err, 2, "--gpus 8: this node has 2 GPU(s) visible to NVML")


@pytest.mark.parametrize("existing", [["planned.yaml"], ["planned.plan.json"], ["planned.yaml", "planned.plan.json"]])
def test_output_never_replaces_files_without_force(capsys, tmp_path, existing):
    for name in existing:
        (tmp_path / name).write_text("the user's\n")
    got, _, err = run(capsys, ["suggest", "--gpu", "A100-80GB", write_config(tmp_path, BASE),
                               "--output", str(tmp_path / "planned.yaml")])
    assert_refused(got, err, 2, "pass --force")
    for name in existing:
        assert str(tmp_path / name) in err
        assert (tmp_path / name).read_text() == "the user's\n"


@pytest.mark.parametrize(("output", "fragment"), [
    ("config.yaml", "is the source config"),
    (".", "is a folder"),
    ("afile/planned.yaml", "is a file, not a folder"),
    ("x.plan.json", "names a plan file; --output names the planned config (YAML), and the plan goes beside it: "
                    "pass --output x.yaml"),
], ids=["source", "folder", "under-a-file", "a-plan-file-name"])
def test_bad_output_paths_are_refused_before_planning(capsys, tmp_path, monkeypatch, output, fragment):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    config = write_config(tmp_path, BASE)
    got, _, err = run(capsys, ["suggest", "--gpu", "A100-80GB", config, "--output", output])
    assert_refused(got, err, 2, f"--output {output}")
    assert fragment in err


def test_the_table_is_broad():
    """The issue asks for every bad input it lists and more of the kinds: keep the table wide."""
    assert len(FLAG_CASES) + len(YAML_CASES) + len(PLAN_CASES) >= 100


def test_the_planner_refuses_an_absurd_batch_instead_of_dividing_it():
    """Trial division of 10^30 would run for minutes: the range check answers at once."""
    from memplan.planner.candidates import divisors

    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    assert divisors(1 << 24)[-1] == 1 << 24
    with pytest.raises(ValueError, match="the per-rank batch must be a whole number from 1 to 16,777,216"):
        divisors(10**30)
