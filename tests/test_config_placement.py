"""Where memplan's settings live in a config (memplan.config.placement): the MemoryPlanner callback's
init_args under trainer.callbacks, read by load_config and named by their key path in every message; the
deprecated top-level memplan: section, still read with a message that says what to write instead."""
from __future__ import annotations

import re
import textwrap
import warnings

import pytest
import yaml

from memplan import MemoryPlanner
from memplan.commands.cli import main
from memplan.config import ConfigError, load_config
from memplan.config.placement import SettingsDeprecation
from memplan.plan import MAX_BATCH_SIZE

BASE = """
trainer:
  devices: 2
  max_steps: 10
model:
  class_path: memplan.demos.MLP
  init_args: {in_features: 20, hidden: 8, depth: 2, num_classes: 3}
data:
  class_path: memplan.demos.RandomVectors
  init_args: {batch_size: 4, in_features: 20, num_classes: 3, num_samples: 64}
"""


def with_planner(init_args: dict, others: tuple = ()) -> str:
    raw = yaml.safe_load(BASE)
    raw["trainer"]["callbacks"] = [*others, {"class_path": "memplan.MemoryPlanner", "init_args": init_args}]
    return yaml.safe_dump(raw, sort_keys=False)


def load(tmp_path, text: str):
    path = tmp_path / "config.yaml"
    path.write_text(textwrap.dedent(text))
    return load_config(path)


LR_MONITOR = {"class_path": "pytorch_lightning.callbacks.LearningRateMonitor"}


def test_settings_are_read_from_the_memory_planners_init_args(tmp_path):
    loaded = load(tmp_path, with_planner({
        "global_batch_size": 64, "allow_checkpointing": False, "plan_margin": 0.2, "adjust": False,
        "suggest": {"precisions": ["bf16", "32"], "num_workers": 3, "pin_memory": True, "optimizer": "sgd"}},
        others=(LR_MONITOR,)))
    s = loaded.settings
    assert (s.global_batch_size, s.allow_checkpointing, s.margin, s.precisions, s.optimizer) == (
        64, False, 0.2, ("bf16-mixed", "32-true"), "sgd")
    assert (loaded.loader.num_workers, loaded.loader.pin_memory, loaded.global_batch_size) == (3, True, 64)
    assert s.key("global_batch_size") == "trainer.callbacks[1].init_args.global_batch_size"
    assert s.key("margin") == "trainer.callbacks[1].init_args.plan_margin"
    assert s.key("precisions") == "trainer.callbacks[1].init_args.suggest.precisions"
    assert loaded.deprecations == ()


@pytest.mark.parametrize("init_args, plan_margin", [
    ({}, 0.10),                                 # MemoryPlanner's default margin 0.05, planned at twice it
    ({"margin": 0.08}, 0.16),                   # as MemoryPlanner plans at fit start
    ({"margin": 0.3, "grow_margin": 0.9}, 0.5),  # at most half the memory
    ({"margin": 0.08, "plan_margin": 0.12}, 0.12),
])
def test_the_plan_margin_is_the_one_memory_planner_plans_with(tmp_path, init_args, plan_margin):
    assert load(tmp_path, with_planner(init_args)).settings.margin == pytest.approx(plan_margin)
    assert MemoryPlanner(**init_args).settings.planning_margin == pytest.approx(plan_margin)


P = re.escape("trainer.callbacks[0].init_args")


@pytest.mark.parametrize("init_args, key, match", [
    ({"global_batch_size": 0}, "trainer.callbacks[0].init_args.global_batch_size",
     rf"{P}.global_batch_size must be a positive int .*; got 0"),
    ({"allow_checkpointing": "yes"}, "trainer.callbacks[0].init_args.allow_checkpointing",
     rf"{P}.allow_checkpointing must be true or false; got 'yes'"),
    ({"plan_margin": 1.5}, "trainer.callbacks[0].init_args.plan_margin",
     rf"{P}.plan_margin must be a fraction in \[0, 1\)"),
    ({"margin": -0.1}, "trainer.callbacks[0].init_args.margin", rf"{P}.margin must be a fraction in \[0, 1\)"),
    ({"suggest": {"precisions": ["fp8"]}}, "trainer.callbacks[0].init_args.suggest.precisions[0]",
     rf"{P}.suggest.precisions\[0\]"),
    ({"suggest": {"precison": ["bf16"]}}, "trainer.callbacks[0].init_args.suggest.precison",
     rf"{P}.suggest.precison is not a memplan suggest setting \(did you mean 'precisions'\?\)"),
    ({"suggest": {"margin": 0.1}}, "trainer.callbacks[0].init_args.suggest.margin",
     rf"{P}.suggest.margin is not a memplan suggest setting; margin goes directly under {P} \(as plan_margin\)"),
    ({"suggest": {"num_workers": -1}}, "trainer.callbacks[0].init_args.suggest.num_workers",
     rf"{P}.suggest.num_workers must be an int >= 0"),
    ({"suggest": {"batch_spec": {"x": {"shape": [0]}}}}, "trainer.callbacks[0].init_args.suggest.batch_spec.x.shape",
     rf"{P}.suggest.batch_spec.x.shape must be a list of positive ints"),
    ({"suggest": [1]}, "trainer.callbacks[0].init_args.suggest", rf"{P}.suggest must be a mapping"),
])
def test_a_bad_setting_is_named_by_its_key_in_the_callback(tmp_path, init_args, key, match):
    with pytest.raises(ConfigError, match=match) as info:
        load(tmp_path, with_planner(init_args))
    assert info.value.key == key and "\n" not in str(info.value)


def test_the_callback_refuses_at_construction_what_suggest_would_refuse():
    with pytest.raises(ValueError, match=r"MemoryPlanner\(suggest=...\): suggest.precison is not a memplan suggest "
                                         r"setting \(did you mean 'precisions'\?\)"):
        MemoryPlanner(suggest={"precison": ["bf16"]})
    with pytest.raises(ValueError, match=r"MemoryPlanner\(plan_margin=...\) is a fraction"):
        MemoryPlanner(plan_margin=1.0)
    assert MemoryPlanner(suggest={"precisions": ["bf16-mixed"], "batch_spec": {"shape": [4]}}).settings.suggest


def test_two_memory_planners_or_both_places_are_refused(tmp_path):
    planner = {"class_path": "memplan.MemoryPlanner"}
    with pytest.raises(ConfigError, match=r"trainer.callbacks\[1\]: a second MemoryPlanner callback "
                                          r"\(trainer.callbacks\[0\] is one\)"):
        load(tmp_path, with_planner({}, others=(planner,)))
    with pytest.raises(ConfigError, match=r"memplan: and the MemoryPlanner callback at trainer.callbacks\[0\] both "
                                          r"hold memplan's settings; move what memplan: holds into "
                                          r"trainer.callbacks\[0\].init_args .* and delete memplan:") as info:
        load(tmp_path, with_planner({}) + "memplan: {global_batch_size: 8}\n")
    assert info.value.key == "memplan"


LEGACY = BASE + """memplan:
  global_batch_size: 32
  precisions: [bf16-mixed, 16-mixed]
  allow_checkpointing: false
  margin: 0.2
  num_workers: 2
"""


def test_the_old_memplan_section_is_still_read_and_says_how_to_move_it(tmp_path):
    with pytest.warns(SettingsDeprecation) as caught:
        old = load(tmp_path, LEGACY)
    (message,) = [str(w.message) for w in caught]
    assert message == old.deprecations[0] and "\n" not in message
    assert re.search(r"config.yaml: the top-level memplan: section is deprecated \(a plain LightningCLI refuses a "
                     r"config with it\) and is read only until memplan 0.3; move it into the MemoryPlanner callback",
                     message)
    assert old.settings.global_batch_size == 32 and old.settings.key("margin") == "memplan.margin"

    # the YAML the message gives, put where it says, reads as the same settings, with no message
    snippet = re.search(r"add it as trainer.callbacks: (\[\{.*\}\])\) and delete memplan:", message).group(1)
    raw = yaml.safe_load(BASE)
    raw["trainer"]["callbacks"] = yaml.safe_load(snippet)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SettingsDeprecation)
        moved = load(tmp_path, yaml.safe_dump(raw))
    keys = ("global_batch_size", "precisions", "allow_checkpointing", "margin", "num_workers")
    assert [getattr(moved.settings, k) for k in keys] == [getattr(old.settings, k) for k in keys]
    assert moved.settings.key("margin") == "trainer.callbacks[0].init_args.plan_margin"


def test_a_bad_value_in_the_old_section_is_named_there(tmp_path):
    with pytest.raises(ConfigError, match=r"memplan.margin must be a fraction in \[0, 1\)"):
        load(tmp_path, BASE + "memplan: {margin: 2}\n")


def test_suggest_prints_the_deprecation_as_one_warning_line_and_refuses_as_before(tmp_path, capsys):
    config = tmp_path / "old.yaml"
    config.write_text(LEGACY.replace("global_batch_size: 32", "global_batch_size: 0"))
    assert main(["suggest", "--gpu", "A100-80GB", str(config)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"memplan: error: memplan.global_batch_size must be a positive int up to {MAX_BATCH_SIZE:,} (samples per "
                   "optimizer step, over all GPUs), or null to keep the config's own; got 0"]

    config.write_text(LEGACY)  # refused after loading (32 samples over 3 nodes): the warning is said first
    assert main(["suggest", "--gpu", "A100-80GB", "--nodes", "3", str(config)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith("memplan: warning: ") and "memplan: section is deprecated" in err[0]
    assert err[1].startswith("memplan: error: ")
