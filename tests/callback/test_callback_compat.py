"""memplan.compat: the private Lightning and torch attributes memplan reads, and the versions known."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import DDPStrategy

from memplan import compat

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


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


def test_the_installed_torch_is_inside_the_range_compat_knows():
    assert compat.within(torch.__version__, compat.TORCH_RANGE)
    assert compat.check_installed() == []
    assert not compat.within("2.7.0", compat.LIGHTNING_RANGE) and not compat.within("2.1.4", compat.LIGHTNING_RANGE)
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
                             r"is known in pytorch-lightning>=2\.2,<2\.7"):
        compat.ddp_kwargs(Strategy())
