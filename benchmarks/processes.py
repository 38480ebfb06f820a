"""Child processes the GPU campaign can stop: each in its own process group, killed whole at its timeout, so a
measurement's own children (`memplan validate`'s measuring process, loader workers) never outlive it and hold
the GPU while the next measurement runs."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator


def run_group(argv: list[str], *, timeout: float, cwd=None, env: dict | None = None) -> subprocess.CompletedProcess:
    """subprocess.run(argv, capture_output=True, text=True, timeout=timeout), killing the child's whole process
    group on timeout (then TimeoutExpired is raised, as subprocess.run does)."""
    with subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as child:
        try:
            out, err = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended on its own meanwhile
                pass
            child.communicate()
            raise
    return subprocess.CompletedProcess(argv, child.returncode, out, err)


@contextlib.contextmanager
def environment_variable(name: str, value: str) -> Iterator[None]:
    """os.environ[name] = value inside the block (what a child started with it would see, for work run in this
    process instead); the previous value, or its absence, restored after."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous
