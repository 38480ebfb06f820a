"""A config's top-level keys are checked as LightningCLI's `fit` checks them (memplan.config.sections):
a key it would refuse is refused at load, by name, with the fix; the keys memplan takes are the ones
memplan's own launch (memplan.train, a LightningCLI) takes."""
from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from memplan.config import ConfigError, load_config
from memplan.config.sections import ALSO_ACCEPTED, SECTIONS, fit_arguments

ROOT = Path(__file__).resolve().parent.parent
MLP = """
trainer:
  devices: 1
model:
  class_path: memplan.demos.MLP
  init_args: {in_features: 20, hidden: 8, depth: 2, num_classes: 3}
data:
  class_path: memplan.demos.RandomVectors
  init_args: {batch_size: 4, in_features: 20, num_classes: 3, num_samples: 64}
"""
ANCHORED = """
defaults: &d
  in_features: 20
  num_classes: 3
trainer:
  devices: 1
model:
  class_path: memplan.demos.MLP
  init_args:
    <<: *d
    hidden: 8
    depth: 2
data:
  class_path: memplan.demos.RandomVectors
  init_args:
    <<: *d
    batch_size: 4
    num_samples: 64
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_an_anchor_holder_at_the_top_level_is_refused_by_name_with_the_fix(tmp_path, monkeypatch):
    import memplan.config.load

    def built(*args, **kwargs):
        raise AssertionError("a section was read before the top-level keys were checked")

    monkeypatch.setattr(memplan.config.load, "parse_config", built)
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, ANCHORED))
    message = str(caught.value)
    assert caught.value.key == "defaults"
    assert message.startswith(f"defaults: in {tmp_path / 'config.yaml'} is not a key LightningCLI's fit accepts")
    assert "remove defaults:" in message and "define each anchor where its value is first used" in message


def test_anchors_where_first_used_are_accepted(tmp_path):
    text = MLP.replace("in_features: 20, hidden", "in_features: &width 20, hidden").replace(
        "num_classes: 3}\ndata", "num_classes: &classes 3}\ndata").replace(
        "in_features: 20, num_classes: 3, num_samples", "in_features: *width, num_classes: *classes, num_samples")
    assert text.count("*width") == 1 and text.count("*classes") == 1
    loaded = load_config(write(tmp_path, text))
    assert loaded.data.init_args["in_features"] == 20 and loaded.model.init_args["num_classes"] == 3


def test_a_subcommand_section_is_refused_naming_the_structure_memplan_reads(tmp_path):
    nested = "fit:\n" + textwrap.indent(textwrap.dedent(MLP), "  ")
    with pytest.raises(ConfigError, match=r"^fit: in .* holds a subcommand's settings .* move what is under fit: up"):
        load_config(write(tmp_path, nested))


def test_lightningclis_other_keys_pass(tmp_path):
    loaded = load_config(write(tmp_path, MLP + "ckpt_path: null\nconfig: null\nseed_everything: 3\n"
                               + "".join(f"{k}: null\n" for k in fit_arguments() if k != "ckpt_path")))
    assert loaded.raw["ckpt_path"] is None


def test_the_keys_memplan_accepts_are_those_memplans_launch_accepts(capsys, monkeypatch):
    """memplan.train (LightningCLI with `memplan:`) prints every top-level key its fit takes: its own main, in this
    process (`python -m memplan.train` itself runs under torchrun in tests/test_launch_train.py; a child here would
    only import torch and Lightning again)."""
    from memplan.train import main

    monkeypatch.setattr(sys, "argv", ["memplan.train"])  # pytest's own arguments are not the CLI's
    with pytest.raises(SystemExit) as done:  # LightningCLI exits after --print_config
        main(["fit", "--print_config"])
    printed = capsys.readouterr()
    assert done.value.code in (0, None), printed.err[-3000:]
    assert set(yaml.safe_load(printed.out)) | {"config"} == {*SECTIONS, *ALSO_ACCEPTED, *fit_arguments()}
