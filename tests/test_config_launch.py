"""What launches a planned config: LightningCLI accepts it as it is written (and with the MemoryPlanner callback
in trainer.callbacks), and torchrun_command starts it on one node or several."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
from config_files import (
    PLANNED_SOURCE,
    keep_argv,  # noqa: F401  (a fixture)
    load_text,
    make_plan,
)

from memplan.config import plan_path_for, planner_callback, torchrun_command, write_planned_config


def lightning_cli_test(test):
    """Mark a test that runs LightningCLI: sys.argv restored, and Lightning's own noise silenced."""
    for mark in (
        pytest.mark.usefixtures("keep_argv"),
        pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # Lightning's use of jsonargparse's old API
        pytest.mark.filterwarnings("ignore:.*tensorboardX.*"),
        pytest.mark.filterwarnings("ignore:.*configure_optimizers` will be overridden.*"),
    ):
        test = mark(test)
    return test


def _lightning_cli(config: Path, *args: str, run: bool = True):
    from pytorch_lightning.cli import LightningCLI

    sys.argv[1:] = []  # LightningCLI warns when args= and a command line (pytest's) are both given
    return LightningCLI(pl.LightningModule, pl.LightningDataModule, subclass_mode_model=True,
                        subclass_mode_data=True, args=[*args, "--config", str(config)], run=run,
                        save_config_callback=None)


@lightning_cli_test
def test_lightning_cli_accepts_the_planned_config_as_is(tmp_path, capsys):
    loaded = load_text(tmp_path, PLANNED_SOURCE)
    plan = make_plan(world_size=2, micro_batch_size=8, accumulate_grad_batches=32, global_batch_size=512)
    out = tmp_path / "planned.yaml"
    write_planned_config(loaded, plan, out)

    cli = _lightning_cli(out, run=False)
    assert cli.trainer.num_devices == 2 and cli.trainer.accumulate_grad_batches == 32
    assert type(cli.trainer.strategy).__name__ == "DDPStrategy" and cli.trainer.precision == "bf16-mixed"
    assert cli.datamodule.batch_size == 8 and type(cli.model).__name__ == "MLP"

    with pytest.raises(SystemExit) as exited:
        _lightning_cli(out, "fit", "--print_config")
    assert exited.value.code == 0 and "accumulate_grad_batches: 32" in capsys.readouterr().out


@lightning_cli_test
def test_lightning_cli_accepts_the_planned_config_with_the_memory_planner_callback(tmp_path, capsys):
    try:
        from memplan import MemoryPlanner  # noqa: F401
    except ImportError:
        pytest.skip("memplan.MemoryPlanner (memplan/callback) does not import yet; its trainer.callbacks "
                    "entry cannot be checked by LightningCLI")
    out = tmp_path / "planned.yaml"
    write_planned_config(load_text(tmp_path, PLANNED_SOURCE), make_plan(global_batch_size=64), out,
                         callback=planner_callback(plan_path_for(out)))
    with pytest.raises(SystemExit) as exited:
        _lightning_cli(out, "fit", "--print_config")
    assert exited.value.code == 0 and "memplan.MemoryPlanner" in capsys.readouterr().out


# --- torchrun ----------------------------------------------------------------------------------------
def test_torchrun_command_for_one_node_and_for_several(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # paths come out absolute: the command runs from any directory
    one = torchrun_command(make_plan(world_size=4, micro_batch_size=2, accumulate_grad_batches=8), "planned.yaml")
    # this interpreter, not a bare `torchrun` (not on PATH without an activated venv); the entry point in the package
    assert one == [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", "--nnodes=1", "--standalone",
                   "-m", "memplan.train", "fit", "--config", str(tmp_path / "planned.yaml")]
    many = torchrun_command(make_plan(nodes=2, world_size=16, micro_batch_size=1, accumulate_grad_batches=4),
                            Path("out/p.yaml"), entry_point="train.py", rdzv_endpoint="node0:29400", python="py")
    assert many == ["py", "-m", "torch.distributed.run", "--nproc-per-node=8", "--nnodes=2", "--rdzv-backend=c10d",
                    "--rdzv-endpoint=node0:29400", str(tmp_path / "train.py"), "fit", "--config",
                    str(tmp_path / "out" / "p.yaml")]
