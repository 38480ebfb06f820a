"""memplan.config.write_planned_config: the planned config sets the plan and keeps the user's keys; it never
replaces files unless forced, writes the plan first and atomically (two writers leave one writer's pair, SIGTERM
mid-write leaves both or neither, a failed second rename takes the first back); the planned config finds its
plan from any directory; the choices it writes (devices, strategy, batch size, the MemoryPlanner entry)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml
from config_files import (
    MLP_CONFIG,
    PLANNED_SOURCE,
    load_text,
    make_plan,
    raises_config_error,
    user_module,  # noqa: F401  (a fixture)
)

from memplan.config import load_config, plan_path_for, planner_callback, write_planned_config
from memplan.config.write import OutputExists
from memplan.plan import Plan


def test_write_planned_config_sets_the_plan_and_keeps_the_users_keys(tmp_path):
    loaded = load_text(tmp_path, PLANNED_SOURCE)
    plan = make_plan(nodes=2, world_size=8, micro_batch_size=4, accumulate_grad_batches=16, global_batch_size=512,
                     gradient_checkpointing=True)
    out = tmp_path / "out" / "planned.yaml"
    write_planned_config(loaded, plan, out, callback=planner_callback(plan_path_for(out)))

    text = out.read_text()
    assert text.startswith("# Planned by memplan from ") and "Micro-batch 4 x 8 rank(s) x 16 accumulation" in text
    written = yaml.safe_load(text)
    assert list(written) == ["seed_everything", "trainer", "model", "data", "optimizer"]  # memplan: dropped
    trainer = written["trainer"]
    assert list(trainer)[:5] == ["max_steps", "devices", "gradient_clip_val", "callbacks", "strategy"]
    assert (trainer["devices"], trainer["num_nodes"], trainer["precision"], trainer["accumulate_grad_batches"]) == (
        4, 2, "bf16-mixed", 16)
    assert trainer["strategy"] == "ddp_find_unused_parameters_true"  # the user's DDP variant is kept
    assert trainer["max_steps"] == 100 and trainer["gradient_clip_val"] == 1.0
    assert trainer["callbacks"] == [
        {"class_path": "pytorch_lightning.callbacks.LearningRateMonitor", "init_args": {"logging_interval": "step"}},
        {"class_path": "memplan.MemoryPlanner", "init_args": {  # the memplan: section moved in, beside the plan
            "global_batch_size": 512, "suggest": {"precisions": ["bf16-mixed"]},
            "plan": str(tmp_path / "out" / "planned.plan.json")}},
    ]
    assert "its memplan: section is, into the MemoryPlanner callback's init_args" in text
    assert written["data"]["init_args"] == {"batch_size": 4, "in_features": 20, "num_classes": 3, "num_samples": 512}
    assert written["model"] == loaded.raw["model"] and written["optimizer"] == loaded.raw["optimizer"]
    assert json.loads((tmp_path / "out" / "planned.plan.json").read_text()) == plan.to_dict()
    assert Plan.from_dict(json.loads(plan_path_for(out).read_text())) == plan

    again = load_config(out)  # the planned config reads back with the same global batch, from the callback
    assert again.global_batch_size == 512 and again.data_batch_size == 4 and again.accumulate_grad_batches == 16
    assert again.settings.precisions == ("bf16-mixed",) and again.deprecations == ()
    assert again.settings.key("global_batch_size") == "trainer.callbacks[1].init_args.global_batch_size"


def test_write_planned_config_never_replaces_files_unless_forced(tmp_path):
    loaded = load_text(tmp_path, MLP_CONFIG)
    out = tmp_path / "planned.yaml"
    plan_path_for(out).write_text("the user's plan\n")
    with pytest.raises(OutputExists, match=f"--output would replace {plan_path_for(out)}; pass --force") as info:
        write_planned_config(loaded, make_plan(), out)
    assert info.value.paths == [plan_path_for(out)] and not out.exists()
    assert plan_path_for(out).read_text() == "the user's plan\n"

    write_planned_config(loaded, make_plan(micro_batch_size=16, accumulate_grad_batches=2), out, force=True)
    assert Plan.from_dict(json.loads(plan_path_for(out).read_text())).micro_batch_size == 16
    with pytest.raises(OutputExists, match=f"{out} and {plan_path_for(out)}"):
        write_planned_config(loaded, make_plan(), out)


def test_write_planned_config_writes_the_plan_first_and_atomically(tmp_path, monkeypatch):
    loaded = load_text(tmp_path, MLP_CONFIG)
    out = tmp_path / "planned.yaml"
    out.write_text("old config\n")
    renamed = []
    real_replace = os.replace

    def replace(src, dst):
        renamed.append(Path(dst).name)
        if Path(dst) == out:
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="No space left"):
        write_planned_config(loaded, make_plan(), out, force=True)
    assert renamed == ["planned.plan.json", "planned.yaml"]  # the plan first: a config never names a partial plan
    assert out.read_text() == "old config\n"  # the failed write left the old file whole
    # and took its new plan back: no plan without the config that names it, no temporary file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "planned.yaml"]


def test_two_writers_leave_one_writers_pair(tmp_path, monkeypatch):
    """A writer that stalls between its plan and its config (a slow disk) must not let a second writer
    slip in between: the folder lock makes the second wait, so the config always matches the plan."""
    import threading
    import time

    import memplan.config.write as write_module

    loaded = load_text(tmp_path, MLP_CONFIG)
    out = tmp_path / "planned.yaml"
    real_write = write_module._temp_with

    def slow_for_the_first(path, text):
        temp = real_write(path, text)
        if path.name.endswith(".plan.json") and threading.current_thread().name == "first":
            time.sleep(0.3)
        return temp

    monkeypatch.setattr(write_module, "_temp_with", slow_for_the_first)
    plans = {"first": make_plan(world_size=2, micro_batch_size=4, accumulate_grad_batches=8),
             "second": make_plan(world_size=4, micro_batch_size=4, accumulate_grad_batches=4)}
    threads = [threading.Thread(target=write_planned_config, args=(loaded, plans[name], out), kwargs={"force": True},
                                name=name) for name in plans]
    threads[0].start()
    time.sleep(0.05)
    threads[1].start()
    for t in threads:
        t.join()
    written = Plan.from_dict(json.loads(plan_path_for(out).read_text()))
    assert yaml.safe_load(out.read_text())["trainer"]["devices"] == written.gpus_per_node


def test_the_planned_config_finds_its_plan_from_any_directory_and_after_the_pair_moved(tmp_path, monkeypatch):
    from memplan.callback.apply import load_plan

    loaded = load_text(tmp_path, MLP_CONFIG)
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)
    out = "runs/planned.yaml"
    write_planned_config(loaded, make_plan(), out, callback=planner_callback(plan_path_for(out), config_path=out))
    entry = yaml.safe_load((tmp_path / "runs" / "planned.yaml").read_text())["trainer"]["callbacks"][-1]
    assert entry["init_args"]["plan"] == "planned.plan.json"  # relative to the config's folder
    moved = tmp_path / "moved" / "here"
    moved.parent.mkdir()
    (tmp_path / "runs").rename(moved)  # the pair moved together
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # training started from another directory, as LightningCLI is started
    monkeypatch.setattr(sys, "argv", ["train.py", "fit", "--config", str(moved / "planned.yaml")])
    assert load_plan(entry["init_args"]["plan"]) == make_plan()
    monkeypatch.setattr(sys, "argv", ["train.py", "fit", f"--config={moved / 'planned.yaml'}", "--trainer.max_steps=3"])
    assert load_plan(entry["init_args"]["plan"]) == make_plan()


def test_a_plan_named_by_absolute_path_is_still_read(tmp_path, monkeypatch):
    from memplan.callback.apply import load_plan

    loaded = load_text(tmp_path, MLP_CONFIG)
    out = tmp_path / "runs" / "planned.yaml"
    write_planned_config(loaded, make_plan(), out, callback=planner_callback(plan_path_for(out)))
    entry = yaml.safe_load(out.read_text())["trainer"]["callbacks"][-1]
    assert Path(entry["init_args"]["plan"]).is_absolute()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train.py", "fit", "--config", str(tmp_path / "config.yaml")])
    assert load_plan(entry["init_args"]["plan"]) == make_plan()


def test_a_plan_not_beside_its_config_names_where_it_was_looked_for(tmp_path, monkeypatch):
    from memplan.callback.apply import load_plan
    from memplan.callback.framework import MisconfigurationException

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "planned.yaml").write_text("trainer: {}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train.py", "fit", "-c", "a/planned.yaml"])
    with pytest.raises(MisconfigurationException, match=r"MemoryPlanner\(plan='planned.plan.json'\): no such file "
                       rf"\(looked for {tmp_path}/a/planned.plan.json and {tmp_path}/planned.plan.json\); a planned "
                       "config names its plan relative to its own folder: keep the two together"):
        load_plan("planned.plan.json")


def test_write_planned_config_choices(tmp_path, user_module):  # noqa: F811
    loaded = load_text(tmp_path, MLP_CONFIG.replace("batch_size: 4, ", ""))
    local = make_plan(gpus=(0, 2), world_size=2, strategy="ddp")
    out = tmp_path / "local.yaml"
    write_planned_config(loaded, local, out, callback=planner_callback("p.json"))
    written = yaml.safe_load(out.read_text())
    assert written["trainer"]["devices"] == [0, 2] and written["trainer"]["strategy"] == "ddp"
    assert written["data"]["init_args"]["batch_size"] == 8  # added: the class's batch_size argument

    write_planned_config(load_config(out), make_plan(world_size=1, micro_batch_size=32, accumulate_grad_batches=2,
                                                     strategy="auto"), out.with_name("one.yaml"),
                         callback=planner_callback("q.json"))
    one = yaml.safe_load(out.with_name("one.yaml").read_text())["trainer"]
    assert one["devices"] == 1 and one["strategy"] == "auto"
    assert one["callbacks"] == [planner_callback("q.json")]  # a re-plan replaces memplan's entry

    with pytest.warns(UserWarning, match="the plan checkpoints activations, which the MemoryPlanner callback applies"):
        write_planned_config(loaded, make_plan(gradient_checkpointing=True), tmp_path / "ckpt.yaml")
    assert "callbacks" not in yaml.safe_load((tmp_path / "ckpt.yaml").read_text())["trainer"]

    with raises_config_error("", r"refusing to overwrite the source config"):
        write_planned_config(loaded, local, loaded.path)
    no_batch_arg = load_text(tmp_path, "model: {class_path: memplan_test_user.NoBatchSize}\n"
                                       "memplan: {batch_spec: {shape: [4]}}\n")
    with raises_config_error("data", r"cannot apply the plan's micro-batch size: model.init_args \(there is no data: "
                                     r"section\) has no batch_size or train_batch_size"):
        write_planned_config(no_batch_arg, local, tmp_path / "x.yaml")


def test_sigterm_while_the_pair_is_written_leaves_both_or_neither_and_no_temporary_file(tmp_path):
    """`suggest --output` killed with SIGTERM in the middle of writing (a slow disk: the plan's temporary file
    is not flushed until the signal has been sent, however long that takes): the signal waits until the pair
    is whole, then ends the process as SIGTERM does."""
    import signal
    import subprocess
    import sys

    from subprocess_run import Watched

    loaded = load_text(tmp_path, MLP_CONFIG)
    script = f"""
import os, sys, time
sys.path.insert(0, {str(Path(__file__).parent)!r})
import memplan.config.write as write
from memplan.config import load_config
from config_files import make_plan
real = write._temp_with
def slow(path, text):
    temp = real(path, text)
    with open({str(tmp_path / 'temps')!r}, "a") as temps:
        temps.write(path.name + "\\n")
    while path.name.endswith(".plan.json") and not os.path.exists({str(tmp_path / 'signal-sent')!r}):
        time.sleep(0.01)
    return temp
write._temp_with = slow
write.write_planned_config(load_config({str(loaded.path)!r}), make_plan(), {str(tmp_path / 'planned.yaml')!r})
print("written", flush=True)
"""
    with Watched([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        temps = tmp_path / "temps"
        proc.wait_until(lambda: temps.exists() and "planned.plan.json" in temps.read_text(),
                        "the plan's temporary file was written")
        proc.send_signal(signal.SIGTERM)
        (tmp_path / "signal-sent").touch()
        out, err = proc.communicate()
    assert proc.returncode == -signal.SIGTERM, err
    assert "written" not in out  # the signal ended it, after the pair
    assert temps.read_text().splitlines()[0] == "planned.plan.json"  # the plan first
    (tmp_path / "signal-sent").unlink()
    temps.unlink()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["config.yaml", "planned.plan.json", "planned.yaml"], names  # both, and no hidden .tmp
    written = Plan.from_dict(json.loads((tmp_path / "planned.plan.json").read_text()))
    assert yaml.safe_load((tmp_path / "planned.yaml").read_text())["trainer"]["accumulate_grad_batches"] == \
        written.accumulate_grad_batches


def test_a_failed_second_rename_takes_the_first_back(tmp_path, monkeypatch):
    import memplan.config.write as write_module

    real = write_module.os.replace
    calls = []

    def second_fails(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(write_module.os, "replace", second_fails)
    with pytest.raises(OSError, match="No space left"):
        write_module.write_pair(((tmp_path / "a.plan.json", "{}\n"), (tmp_path / "a.yaml", "x: 1\n")))
    assert list(tmp_path.iterdir()) == []  # neither file, no temporary file
