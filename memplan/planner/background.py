"""A trace the search will need next, run at the same time in a forked copy of this process.

The search knows some traces in advance (a group's micro-batch 1 and PROBE_MICRO traces); each
takes a second or more, almost all of it Python in FakeTensorMode, so a second CPU core halves the
wait. `BackgroundEstimator.prefetch(**setting)` forks a child that runs the estimator on that
setting and pipes the MemoryEstimate back; the call for the same setting then takes the child's
result instead of tracing again. Whatever goes wrong in the child (an error, a crash, a result that
does not unpickle), the parent traces the setting itself, so errors surface exactly as without it.

Used only where forking is safe and useful: Linux, more than one usable CPU, and an estimate that
touches no GPU and runs none of the model's kernels for real (a named GPU model traced on fake
tensors: `memplan suggest --gpu`; a local GPU's CUDA context cannot be used in a forked child, and a
CPU target probes real oneDNN kernels). Such a trace still copies a few real CPU tensors (the batch,
a module's buffers), and OpenMP's thread team does not survive a fork (a parallel copy in the child
waits forever for threads it does not have): the child runs with one intra-op thread. Whatever else
could hang a forked child, the parent does not wait on one that makes no progress: a child that uses
no CPU for STALL_SECONDS while the parent waits for it is killed, and the setting traced in-process.
"""
from __future__ import annotations

import os
import pickle
import select
import signal
import sys
from typing import Any

from memplan.estimator.result import MemoryEstimate
from memplan.planner.search import Estimator

#: How long a child may use no CPU while the parent waits for it before it is taken for hung (a trace
#: is busy Python throughout; a child blocked writing its result is not idle: the parent reads).
STALL_SECONDS = 10.0


def can_fork() -> bool:
    """Whether a background trace can run beside this process: Linux with two usable CPUs or more."""
    if sys.platform != "linux" or not hasattr(os, "fork"):
        return False
    return len(os.sched_getaffinity(0)) > 1


class BackgroundEstimator:
    """`estimator`, with `prefetch(**setting)`: start that setting's trace in a forked child now."""

    def __init__(self, estimator: Estimator) -> None:
        self._estimator = estimator
        self._pending: dict[tuple, _Child] = {}

    def prefetch(self, **setting: Any) -> None:
        key = _key(setting)
        if key not in self._pending:
            try:
                self._pending[key] = _Child(self._estimator, setting)
            except OSError:  # no fork now (a process or memory limit): the trace is made when asked
                pass

    def cancel(self, **setting: Any) -> None:
        """Stop the background trace of `setting`, or with no setting every one still running (the
        search no longer needs them)."""
        if setting:
            child = self._pending.pop(_key(setting), None)
            if child is not None:
                child.cancel()
            return
        for child in self._pending.values():
            child.cancel()
        self._pending.clear()

    def __call__(self, **setting: Any) -> MemoryEstimate:
        child = self._pending.pop(_key(setting), None)
        result = child.result() if child is not None else None
        return result if result is not None else self._estimator(**setting)


def _key(setting: dict[str, Any]) -> tuple:
    """A setting's identity: its arguments, an argument given as None the same as one left out."""
    return tuple(sorted((name, repr(value)) for name, value in setting.items() if value is not None))


class _Child:
    """One forked trace; its result read once."""

    def __init__(self, estimator: Estimator, setting: dict[str, Any]) -> None:
        sys.stdout.flush()
        sys.stderr.flush()  # nothing buffered is written twice
        read_fd, write_fd = os.pipe()
        try:
            pid = os.fork()
        except OSError:
            os.close(read_fd)
            os.close(write_fd)
            raise
        if pid == 0:  # the child: trace, send, leave without running the parent's exit handlers
            code = 1
            try:
                os.close(read_fd)
                import torch

                torch.set_num_threads(1)  # the parent's OpenMP threads are not in this process
                payload = pickle.dumps(estimator(**setting))
                with os.fdopen(write_fd, "wb") as pipe:
                    pipe.write(payload)
                code = 0
            except BaseException:  # the parent traces it again and meets the error itself
                pass
            finally:
                os._exit(code)
        os.close(write_fd)
        self._pid: int | None = pid
        self._fd: int | None = read_fd

    def result(self) -> MemoryEstimate | None:
        """The child's estimate, or None when it failed or stalled (the caller then traces in-process)."""
        if self._pid is None:
            return None
        try:
            data = self._read(STALL_SECONDS)
        except BaseException:  # Ctrl-C, or anything else, while waiting: leave no child behind
            self.cancel()
            raise
        if data is None:
            self.cancel()
            return None
        try:
            _, status = os.waitpid(self._pid, 0)
        except ChildProcessError:  # SIGCHLD ignored (inherited): reaped already; judge by what it sent
            status = 0
        self._pid = None
        if status != 0 or not data:
            return None
        try:
            result = pickle.loads(data)
        except Exception:  # a truncated or foreign payload: trace it here instead
            return None
        return result if isinstance(result, MemoryEstimate) else None

    def _read(self, stall_seconds: float) -> bytes | None:
        """All the child writes until it closes the pipe; None if it used no CPU for stall_seconds."""
        fd, self._fd = self._fd, None
        chunks: list[bytes] = []
        last, idle = _cpu_ticks(self._pid), 0.0
        try:
            poller = select.poll()  # not select.select: it refuses descriptors >= 1024
            poller.register(fd, select.POLLIN | select.POLLHUP)
            while True:
                if poller.poll(1000):
                    chunk = os.read(fd, 1 << 20)
                    if not chunk:
                        return b"".join(chunks)
                    chunks.append(chunk)
                    idle = 0.0
                    continue
                now = _cpu_ticks(self._pid)
                idle = idle + 1.0 if now is not None and now == last else 0.0
                last = now
                if idle >= stall_seconds:
                    return None
        finally:
            os.close(fd)

    def cancel(self) -> None:
        if self._pid is None:
            return
        try:
            os.kill(self._pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(self._pid, 0)
        except ChildProcessError:  # SIGCHLD ignored: the kernel reaped it
            pass
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._pid = None


def _cpu_ticks(pid: int) -> int | None:
    """The user + system CPU clock ticks a process has used (/proc/<pid>/stat), None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])  # utime and stime, the line's 14th and 15th fields
