"""memplan.callback.sigterm: what a SIGTERM does to a rank, per case. The multi-rank end to end (two gloo
processes under torchrun) is tests/test_launch_sigterm.py; here the handler is called directly, on a
stand-in Trainer of 2 ranks, and on a real 1-rank Trainer."""
from __future__ import annotations

import multiprocessing
import os
import signal
from types import SimpleNamespace

import pytest
import pytorch_lightning as pl
import torch

from memplan.callback.sigterm import RankTerminated, end_rank_on_sigterm


class _Launcher:
    def __init__(self) -> None:
        self.killed: list[int] = []

    def kill(self, signum: int) -> None:
        self.killed.append(signum)


def _trainer(world_size: int, launcher: _Launcher | None = None) -> SimpleNamespace:
    """A stand-in Trainer with Lightning's signal connector attribute, recording Lightning's handler."""
    calls: list[int] = []
    connector = SimpleNamespace(_sigterm_notifier_fn=lambda signum, frame: calls.append(signum))
    return SimpleNamespace(world_size=world_size, global_rank=1, strategy=SimpleNamespace(launcher=launcher),
                           _signal_connector=connector, lightning_calls=calls)


@pytest.fixture
def no_alarm_left():
    before = signal.getsignal(signal.SIGALRM)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, before)


def test_a_rank_of_several_exits_143_at_once_and_arms_its_deadline(no_alarm_left, capfd):
    launcher = _Launcher()
    trainer = _trainer(2, launcher)
    assert end_rank_on_sigterm(trainer, grace_s=7)
    with pytest.raises(RankTerminated) as ended:
        trainer._signal_connector._sigterm_notifier_fn(signal.SIGTERM, None)
    assert ended.value.code == 143 and isinstance(ended.value, SystemExit)
    assert trainer.lightning_calls == [], "Lightning's handler (a broadcast) is not entered"
    assert launcher.killed == [signal.SIGTERM], "ranks Lightning started itself get the signal too"
    assert signal.getsignal(signal.SIGALRM) == signal.SIG_DFL and 0 < signal.alarm(0) <= 7
    assert "[rank: 1] memplan: SIGTERM received; ending this rank now (exit 143, at the latest in 7 s)" \
        in capfd.readouterr().err


def test_a_second_signal_leaves_the_first_ones_exit_alone(no_alarm_left):
    trainer = _trainer(4)
    end_rank_on_sigterm(trainer)
    handler = trainer._signal_connector._sigterm_notifier_fn
    with pytest.raises(RankTerminated):
        handler(signal.SIGTERM, None)
    handler(signal.SIGTERM, None)  # during the exception path: no second exception
    assert trainer.lightning_calls == []


def test_one_rank_keeps_lightnings_handler():
    trainer = _trainer(1)
    end_rank_on_sigterm(trainer)
    trainer._signal_connector._sigterm_notifier_fn(signal.SIGTERM, None)
    assert trainer.lightning_calls == [signal.SIGTERM]


def _call_in_child(handler) -> None:
    handler(signal.SIGTERM, None)
    os._exit(0)  # not reached when the handler ends the process


def test_a_forked_child_dies_of_the_signal(no_alarm_left):
    """A DataLoader worker forked from a rank inherits the handler: it dies as SIGTERM's default action."""
    trainer = _trainer(2)
    end_rank_on_sigterm(trainer)
    child = multiprocessing.get_context("fork").Process(target=_call_in_child,
                                                       args=(trainer._signal_connector._sigterm_notifier_fn,))
    child.start()
    child.join(timeout=30)
    assert child.exitcode == -signal.SIGTERM


def test_a_lightning_without_the_signal_connector_is_warned_about():
    with pytest.warns(UserWarning, match="_sigterm_notifier_fn"):
        assert end_rank_on_sigterm(SimpleNamespace(world_size=2)) is False


def test_grace_under_a_second_is_refused():
    with pytest.raises(ValueError, match="grace_s must be at least 1 second; got 0"):
        end_rank_on_sigterm(_trainer(2), grace_s=0)


class _Boring(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        self.registered = signal.getsignal(signal.SIGTERM)
        if batch_idx == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(64, 4))
        return torch.utils.data.DataLoader(data, batch_size=4)


def test_a_real_one_rank_fit_still_stops_as_lightning_does(tmp_path):
    """Installed on a real Trainer: the handler is the one Lightning registers at fit start, and one
    rank stops at the next step (Lightning's SIGTERMException), not at once."""
    before = signal.getsignal(signal.SIGTERM)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=100, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    assert end_rank_on_sigterm(trainer)
    model = _Boring()
    with pytest.raises(SystemExit):
        trainer.fit(model)
    assert trainer.received_sigterm and trainer.global_step == 3
    # the compat assumption, checked where it can break: Lightning registers the connector's method,
    # looked up on the instance, first in its handler list (pytorch_lightning 2.6: _HandlersCompose)
    assert model.registered.signal_handlers[0] is trainer._signal_connector._sigterm_notifier_fn
    assert signal.getsignal(signal.SIGTERM) == before, "Lightning restores the handlers after fit"
