"""Bad inputs found by trying memplan as a new user, beyond the tables of test_bad_flags.py, test_bad_yaml.py and
test_bad_plan_files.py: each refused before anything is traced, exit 2, one line naming the flag, the YAML key
path or the file."""
from __future__ import annotations

import json

import pytest
from refusals import assert_refused, config_with, no_gpu_and_no_trace, run, write_config  # noqa: F401

# (id, argv with CONFIG standing for the config path, YAML changes, fragment naming the input)
CASES = [
    ("validate-batch-0", ["validate", "CONFIG", "--batch-size", "0"], {},
     "argument --batch-size: must be a positive whole number"),
    ("validate-batch-negative", ["validate", "CONFIG", "--batch-size", "-3"], {},
     "argument --batch-size: must be a positive whole number"),
    ("yaml-data-batch-size-negative", ["suggest", "--gpu", "A100-80GB", "CONFIG"], {"data.init_args.batch_size": -4},
     "data.init_args.batch_size must be a positive int"),
    ("yaml-data-batch-size-0", ["suggest", "--gpu", "A100-80GB", "CONFIG"], {"data.init_args.batch_size": 0},
     "data.init_args.batch_size must be a positive int"),
    ("yaml-optimizer-lr-negative", ["suggest", "--gpu", "A100-80GB", "CONFIG"],
     {"optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": -1.0}}},
     "optimizer: AdamW(params, **optimizer.init_args) raised ValueError: Invalid learning rate"),
    ("yaml-top-level-typo", ["suggest", "--gpu", "A100-80GB", "CONFIG"], {"modle": {"init_args": {"hidden": 64}}},
     "modle: is not a LightningCLI section (did you mean 'model'?)"),
    ("yaml-top-level-typo-trainer", ["estimate", "CONFIG", "--batch-size", "4"], {"trainr": {"max_steps": 5}},
     "trainr: is not a LightningCLI section (did you mean 'trainer'?)"),
    ("estimate-device-ambiguous", ["estimate", "CONFIG", "--batch-size", "4", "--device", "A100"], {},
     "argument --device: 'A100' is ambiguous: say A100-40GB or A100-80GB"),
    ("estimate-optimizer-eps-negative", ["estimate", "CONFIG", "--batch-size", "4"],
     {"optimizer": {"class_path": "torch.optim.Adam", "init_args": {"eps": -1.0}}}, "fix optimizer.init_args"),
]


@pytest.mark.parametrize(("argv", "changes", "fragment"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_inputs_a_new_user_tried_are_refused_by_name(capsys, tmp_path, argv, changes, fragment):
    config = write_config(tmp_path, config_with(changes))
    got, _, err = run(capsys, [config if a == "CONFIG" else a for a in argv])
    assert_refused(got, err, 2, fragment)


@pytest.mark.parametrize(("make", "fragment"), [
    (lambda d: d / "missing.plan.json", "no such file"),
    (lambda d: d, "is a folder, not a regular file"),
    (lambda d: (d / "p.plan.json").write_text("trainer: {}\n") and d / "p.plan.json", "is not JSON"),
    (lambda d: (d / "p.plan.json").write_text(json.dumps({"micro_batch_size": 4})) and d / "p.plan.json",
     "plan file lacks"),
], ids=["missing", "a-folder", "yaml-not-json", "not-a-plan"])
def test_validate_names_its_plan_file(capsys, tmp_path, make, fragment):
    config = write_config(tmp_path, config_with({}))
    plan = make(tmp_path)
    got, _, err = run(capsys, ["validate", config, "--plan", str(plan)])
    assert_refused(got, err, 2, fragment)
    assert f"--plan {plan}" in err


def test_an_output_folder_that_fails_at_write_time_is_named_not_a_temp_file(capsys, tmp_path, monkeypatch):
    # root passes os.access() everywhere (/proc, a folder made read-only by its mode): the write itself fails
    import errno

    import memplan.config.write

    def refuse(path, text):
        raise OSError(errno.EROFS, "Read-only file system", str(path.parent / f".{path.name}.x1y2.tmp"))

    monkeypatch.undo()  # this test traces: the plan comes before the write
    monkeypatch.setattr(memplan.config.write, "_temp_with", refuse)
    config = write_config(tmp_path, config_with({}))
    output = tmp_path / "out" / "planned.yaml"
    got, _, err = run(capsys, ["suggest", "--gpu", "A100-80GB", "--gpus", "2", config, "--output", str(output)])
    assert_refused(got, err, 1, f"--output {output}: cannot write in {output.parent} (Read-only file system)")
    assert ".tmp" not in err


def test_a_top_level_key_that_is_no_near_miss_is_refused_as_lightningcli_refuses_it(capsys, tmp_path):
    """(It was left to a LightningCLI subclass; memplan's launch, LightningCLI itself, refused the planned config.)"""
    config = write_config(tmp_path, config_with({"optimizer_config": {"warmup": 10}}))
    got, _, err = run(capsys, ["suggest", "--gpu", "A100-80GB", config])
    assert_refused(got, err, 2, "optimizer_config: in")
    assert "is not a key LightningCLI's fit accepts at the top level" in err
