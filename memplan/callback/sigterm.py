"""SIGTERM to one rank of a multi-rank run ends the whole job, instead of hanging it.

Lightning answers SIGTERM with a `dist.broadcast` from inside the signal handler (pytorch_lightning
2.6, `_SignalConnector._sigterm_notifier_fn`). Only the signalled rank enters that broadcast; the
others are in the step's own collectives, so the ranks wait on different collectives and the job
hangs until the process group times out (30 min by default). torchrun, for its part, stops every
other worker (SIGTERM, then SIGKILL 30 s later) as soon as one exits with an error. So, after
`end_rank_on_sigterm(trainer)`, a signalled rank of a multi-rank run ends at once, with an error:

- it raises `RankTerminated` (exit status 128 + signal number: 143) at its next Python bytecode,
  entering no collective. Lightning's exception path runs: callbacks' `on_exception` (MemoryPlanner
  closes its per-rank log, whose lines are written whole), loggers finalize "failed". torchrun sees
  the failure and terminates the other ranks, which end the same way, or sooner when their next
  collective fails on the closed peer (gloo: "Connection closed by peer").
- a deadline: `grace_s` seconds after the signal, SIGALRM (whose default action ends the process)
  ends the rank if its exception path blocks, e.g. in a checkpoint callback's barrier.
- one rank: Lightning's own handler, which stops cleanly at the next step (no collective there).
- a forked child (a DataLoader worker inherits the handler): the signal's default action.

MemoryPlanner installs it at setup in every multi-rank fit, so a training script of your own gets it
with the callback alone, whatever launched it; memplan.train installs it too (once is enough: a
second call is a no-op). Without MemoryPlanner, call it after building the Trainer.
"""
from __future__ import annotations

import os
import signal
from types import FrameType
from typing import Any

from pytorch_lightning.utilities.rank_zero import rank_zero_warn

from memplan.compat.lightning import replace_sigterm_notifier, sigterm_notifier

GRACE_S = 20
"""Seconds a terminated rank has for its exception path before SIGALRM ends it (torchrun waits 30)."""


class RankTerminated(SystemExit):
    """A signal ended this rank of a multi-rank run; `code` is the shell's 128 + signal number, `signal_name` the
    signal's name ('SIGTERM'), which MemoryPlanner's log records (numbers differ between platforms)."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signal_name = signal.Signals(signum).name


def end_rank_on_sigterm(trainer: Any, *, grace_s: int = GRACE_S) -> bool:
    """Make SIGTERM end this rank at once when `trainer` runs more than one rank (see the module's
    docstring). Call before `trainer.fit`. Returns False, with a warning, on a Lightning without the
    signal connector this replaces a method of (known: pytorch_lightning and lightning.pytorch 2.0-2.6)."""
    if grace_s < 1:
        raise ValueError(f"end_rank_on_sigterm: grace_s must be at least 1 second; got {grace_s}")
    connector, lightning_handler = sigterm_notifier(trainer)
    if isinstance(lightning_handler, _SigtermHandler):  # installed already (memplan.train, then MemoryPlanner)
        return True
    if lightning_handler is None:
        rank_zero_warn("memplan: this Lightning has no `Trainer._signal_connector._sigterm_notifier_fn` "
                       "(known in 2.0-2.6); SIGTERM to one rank is left to Lightning, which may hang the job")
        return False
    # register_signal_handlers (at fit start) looks the method up on the instance: this one is registered
    replace_sigterm_notifier(connector, _SigtermHandler(trainer, lightning_handler, grace_s))
    return True


class _SigtermHandler:
    def __init__(self, trainer: Any, lightning_handler: Any, grace_s: int) -> None:
        self._trainer = trainer
        self._lightning_handler = lightning_handler
        self._grace_s = grace_s
        self._pid = os.getpid()
        self._fired = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._pid:  # a forked child: die as the signal's default action would
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        trainer = self._trainer
        if trainer.world_size <= 1:
            self._lightning_handler(signum, frame)
            return
        if self._fired:  # a second signal while the first one's exit runs: the alarm is the deadline
            return
        self._fired = True
        name = signal.Signals(signum).name
        # os.write, not print or logging: the interrupted code may be inside a write to stderr
        os.write(2, f"[rank: {trainer.global_rank}] memplan: {name} received; ending this rank now (exit "
                    f"{128 + signum}, at the latest in {self._grace_s} s) so that the launcher stops the "
                    "others\n".encode())
        launcher = trainer.strategy.launcher
        if launcher is not None:  # Lightning started the other ranks itself: pass the signal on, as it does
            launcher.kill(signum)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(self._grace_s)
        raise RankTerminated(signum)
