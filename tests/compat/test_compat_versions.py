"""memplan.compat: the private Lightning and torch attributes memplan reads, the versions known, and the check
of the installed ones (MemoryPlanner, memplan.estimate, memplan suggest)."""
from __future__ import annotations

import re
import tomllib
import warnings
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import DDPStrategy

from memplan import compat
from memplan.compat import versions

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = ROOT / "pyproject.toml"


def declared(requirement_prefix: str) -> str:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    found = [r for r in project["dependencies"] + project["optional-dependencies"]["dev"]
             if re.match(rf"{re.escape(requirement_prefix)}\b", r)]
    assert found, requirement_prefix
    return found[0]


@pytest.mark.parametrize(("package", "bounds"), [("pytorch-lightning", compat.LIGHTNING_RANGE),
                                                 ("lightning", compat.LIGHTNING_RANGE)])
def test_pyproject_bounds_lightning_to_the_range_compat_knows_and_the_installed_one_is_inside(package, bounds):
    (low_major, low_minor), (high_major, high_minor) = bounds
    assert declared(package) == f"{package}>={low_major}.{low_minor},<{high_major}.{high_minor}"
    assert compat.within(compat.installed_version(package), bounds)


def test_pyproject_bounds_torch_to_the_range_compat_knows():
    (low_major, low_minor), (high_major, high_minor) = compat.TORCH_RANGE
    assert declared("torch") == f"torch>={low_major}.{low_minor},<{high_major}.{high_minor}"


def test_the_installed_torch_is_inside_the_range_compat_knows():
    assert compat.within(torch.__version__, compat.TORCH_RANGE)
    assert compat.check_installed() == []
    assert not compat.within("2.7.0", compat.LIGHTNING_RANGE) and not compat.within("2.3.3", compat.LIGHTNING_RANGE)
    assert compat.within("2.6.6", compat.LIGHTNING_RANGE) and compat.within("2.13.0+cpu", compat.TORCH_RANGE)


def test_each_accessor_reads_the_installed_versions():
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    assert compat.skip_backward_getter(trainer)() is False
    assert hasattr(compat.train_data_source(trainer), "is_module")
    assert compat.ddp_kwargs(DDPStrategy(static_graph=True)) == {"static_graph": True}
    param = torch.nn.Parameter(torch.zeros(2))
    assert not compat.has_gradient_hooks(param)
    param.register_hook(lambda g: g)
    assert compat.has_gradient_hooks(param)
    assert compat.tensor_version(param.data.add_(1)) >= 1


def test_a_moved_attribute_is_one_error_naming_it_and_the_versions_known():
    class Strategy:  # stands in for a Lightning release whose DDPStrategy no longer has _ddp_kwargs
        pass

    installed = re.escape(compat.installed_version("pytorch-lightning"))
    with pytest.raises(compat.IncompatibleVersionError,
                       match=rf"Strategy\._ddp_kwargs, which this pytorch-lightning \({installed}\) does not have; it "
                             r"is known in pytorch-lightning>=2\.4,<2\.7"):
        compat.ddp_kwargs(Strategy())


@pytest.fixture
def torch_from_the_future(monkeypatch):
    """The installed torch reads as 2.99.0, and no check has run in this process yet."""
    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda p: "2.99.0" if p == "torch" else real(p))
    monkeypatch.setattr(versions, "_checked", False)


def test_estimate_warns_once_naming_the_installed_torch_and_the_known_range(torch_from_the_future):
    import memplan

    model, batch = torch.nn.Linear(4, 2), torch.zeros(3, 4)
    with pytest.warns(compat.VersionWarning) as caught:
        first = memplan.estimate(model, batch, loss=lambda m, b: m(b).sum(), device="cpu")
    messages = [str(w.message) for w in caught if issubclass(w.category, compat.VersionWarning)]
    assert messages == ["memplan.estimate: torch 2.99.0 is outside the versions memplan is known to work with "
                        "(torch>=2.7,<2.14)"]
    assert first.peak_allocated > 0  # a warning, not a refusal
    with warnings.catch_warnings():
        warnings.simplefilter("error", compat.VersionWarning)  # said once a process
        memplan.estimate(model, batch, loss=lambda m, b: m(b).sum(), device="cpu")


def test_suggest_says_it_on_stderr_once_and_still_plans(torch_from_the_future, capsys):
    from memplan.commands.cli import main

    code = main(["suggest", "--gpu-memory", "24GiB", str(ROOT / "configs" / "mlp.yaml"), "--json"])
    err = capsys.readouterr().err
    assert code == 0
    assert err.count("torch 2.99.0 is outside") == 1
    assert "memplan: warning: torch 2.99.0 is outside the versions memplan is known to work with " \
           "(torch>=2.7,<2.14)" in err


def test_the_callback_check_names_memory_planner_and_says_it_at_every_setup(monkeypatch):
    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda p: "2.1.0" if p == "pytorch-lightning" else real(p))
    assert compat.check_installed() == ["pytorch-lightning 2.1.0 is outside the versions MemoryPlanner is known to "
                                        "work with (pytorch-lightning>=2.4,<2.7)"]
    assert compat.check_installed() == compat.check_installed()  # not once: each fit's setup says it


@pytest.mark.parametrize("installed, distribution, caches", [
    ({"pytorch-lightning": "2.4.0"}, "pytorch-lightning", True),
    ({"pytorch-lightning": "2.5.4"}, "pytorch-lightning", True),
    ({"pytorch-lightning": "2.5.5"}, "pytorch-lightning", False),
    ({"pytorch-lightning": "2.6.6"}, "pytorch-lightning", False),
    # both installed at different releases (memplan requires pytorch-lightning; `lightning` is the user's own)
    ({"pytorch-lightning": "2.6.6", "lightning": "2.4.0"}, "lightning", True),
    ({"pytorch-lightning": "2.6.6", "lightning": "2.4.0"}, "pytorch-lightning", False),
    ({"lightning": "2.5.0.post0"}, "pytorch-lightning", True),  # the other one where the asked one is missing
    ({}, "pytorch-lightning", False),
])
def test_lightnings_autocast_caches_weight_casts_before_2_5_5(monkeypatch, installed, distribution, caches):
    """Lightning 2.5.5 made its MixedPrecision autocast `cache_enabled=False`; before, torch's cache was on, and the
    estimate of a -mixed precision under loop="lightning" keeps casts as the release the Trainer comes from does."""
    monkeypatch.setattr(versions, "installed_version", installed.get)
    assert versions.lightning_autocast_caches(distribution) is caches
