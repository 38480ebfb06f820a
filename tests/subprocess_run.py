"""Child processes for tests: a hang is named by the lack of CPU progress, never by a wall-clock timeout.

A two-process test on a busy machine can take many times its quiet duration, so a fixed timeout fails
healthy runs; and a timed-out child left to itself keeps its ranks alive (torchrun starts each worker in
a session of its own, so even killing the child's process group misses them). Here each child starts in
its own session, and the helper watches the CPU time of every process under it (children, torchrun's
workers, DataLoader workers): the child is taken for hung only when that whole tree used almost no CPU
(under IDLE_FRACTION of one core) for STALL_S seconds while hardly ever waiting for a CPU (runnable), the
signature of a deadlock (a collective the other rank never joins, a wait on a dead pipe). Load does not
produce it: a child starved of CPU by other processes is runnable, and not taken for hung. A generous CEILING_S catches
a child that spins for ever. On a hang, on the ceiling, on the test's own failure or interrupt, and after
a normal exit too, every process the tree ever held (and its process group) is killed, so nothing
outlives its test.

    result = run_watched([sys.executable, "driver.py", ...], cwd=...)      # a CompletedProcess (text)
    with Watched([...], stdout=file) as job:                              # a child the test talks to
        job.wait_until(lambda: log.exists(), "rank 1 logged a step")
        job.send_signal(signal.SIGTERM)
        code = job.wait()

Like memplan/planner/background.py, which kills a forked trace that makes no CPU progress."""
from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import psutil

#: How long the tree may use almost no CPU before it is taken for hung.
STALL_S = 60.0
#: "Almost no CPU": under this fraction of one core over STALL_S. torchrun's agent and an idle gloo
#: rank use ~0.01 (its 0.1 s monitor loop); a child that works gets far more, even on a loaded machine.
IDLE_FRACTION = 0.03
#: A tree seen runnable (running, or waiting for a core) in this fraction of the window's readings or more
#: is starved, not hung (an idle torchrun agent wakes for a moment every 0.1 s: a few readings at most).
RUNNABLE_FRACTION = 0.25
#: The most a child may run in all (it spins, or the machine is starved beyond use).
CEILING_S = 1800.0
#: How often the tree's CPU time is read.
POLL_S = 0.5


class Hung(AssertionError):
    """The child made no CPU progress for stall_s seconds, or ran past ceiling_s; it has been killed."""

    def __init__(self, message: str, stdout: str | None = None, stderr: str | None = None) -> None:
        super().__init__(message)
        self.stdout, self.stderr = stdout, stderr


class Watched:
    """A child in its own session whose whole process tree is watched for CPU progress and killed on exit
    from the `with` block (or by `kill()`). Popen's keyword arguments pass through."""

    def __init__(self, argv: Sequence[str], *, stall_s: float = STALL_S, ceiling_s: float = CEILING_S,
                 idle_fraction: float = IDLE_FRACTION, **popen) -> None:
        self.argv = [str(a) for a in argv]
        self.stall_s, self.ceiling_s, self.idle_fraction = stall_s, ceiling_s, idle_fraction
        self.popen = subprocess.Popen(self.argv, start_new_session=True, **popen)
        self.pid = self.popen.pid
        self._started = time.monotonic()
        self._seen: dict[tuple[int, float], psutil.Process] = {}  # every process of the tree, by (pid, start)
        self._cpu: dict[tuple[int, float], float] = {}  # the most CPU seconds each was seen to have used
        self._samples: deque[tuple[float, float, bool]] = deque()  # (time, the tree's CPU seconds, runnable)
        try:
            self._root: psutil.Process | None = psutil.Process(self.pid)
        except psutil.NoSuchProcess:  # it ended already
            self._root = None
        self._sample()

    def __enter__(self) -> Watched:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def poll(self) -> int | None:
        return self.popen.poll()

    def send_signal(self, sig: int) -> None:
        self.popen.send_signal(sig)

    def processes(self) -> list[psutil.Process]:
        """The child and every process under it now."""
        self._sample()
        return [p for p in self._seen.values() if _running(p)]

    def check(self) -> None:
        """Read the tree's CPU time; raise Hung (after killing the tree) if it stalled or ran too long."""
        now = self._sample()
        elapsed = now - self._started
        if elapsed > self.ceiling_s:
            self._hung(f"ran past its ceiling of {self.ceiling_s:.0f} s")
        stalled = _stalled(self._samples, now, self.stall_s, self.idle_fraction)
        if stalled:
            self._hung(f"{stalled} (after {elapsed:.0f} s)")

    def wait(self) -> int:
        """The child's exit status, once it ends (it still must show CPU progress while it runs). Its
        pipes, if any, are not read: use communicate() for a child whose output is piped."""
        while True:
            try:
                return self.popen.wait(timeout=POLL_S)
            except subprocess.TimeoutExpired:
                self.check()

    def communicate(self, input: str | bytes | None = None) -> tuple:
        """Popen.communicate, watched: (stdout, stderr) once the child ends; Hung if it stalls."""
        while True:
            try:
                return self.popen.communicate(input, timeout=POLL_S)
            except subprocess.TimeoutExpired:  # nothing is lost: communicate goes on where it was
                input = None
                if self.popen.poll() is not None:  # the child ended; what it left behind holds its pipes
                    self._kill_all()
                self.check()

    def wait_until(self, condition: Callable[[], bool], what: str) -> None:
        """Poll `condition` until it holds; fail if the child ends first or stalls on the way."""
        while not condition():
            if self.popen.poll() is not None:
                raise AssertionError(f"{what}: not before the child ended (exit {self.popen.returncode})")
            self.check()
            time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL every process the tree holds or held and the child's session, reap the child, close its
        pipes."""
        self._kill_all()
        for stream in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            if stream is not None:
                stream.close()

    def _kill_all(self) -> None:
        self._sample()
        for _ in range(3):  # a process forked while we kill is caught by the next look
            alive = [p for p in self._seen.values() if _running(p)] + _session(self.pid)
            for process in alive:
                try:
                    process.kill()
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
            self._sample()
            if not alive:
                break
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:  # uninterruptible sleep: left to init
            pass

    def _sample(self) -> float:
        """Record the tree's processes and their CPU time; the time now."""
        members = []
        if self._root is not None and _running(self._root):
            try:
                members = [self._root, *self._root.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        return _record(members, self._seen, self._cpu, self._samples)

    def _hung(self, why: str) -> None:
        left = {p.pid: p for p in self._seen.values() if _running(p)} | {p.pid: p for p in _session(self.pid)}
        tree = ", ".join(f"{pid} {_describe(p)}" for pid, p in left.items())
        self._kill_all()
        out = err = None
        if self.popen.stdout is not None or self.popen.stderr is not None:
            try:
                out, err = self.popen.communicate(timeout=5)
            except (subprocess.TimeoutExpired, ValueError):
                pass
        self.kill()
        tail = (err or "")[-3000:] if isinstance(err, str) else (err or b"")[-3000:]
        raise Hung(f"{' '.join(self.argv[:4])}... {why}; killed its processes ({tree})\n{tail}", out, err)


def run_watched(argv: Sequence[str], *, check: bool = False, input: str | None = None, stall_s: float = STALL_S,
                ceiling_s: float = CEILING_S, idle_fraction: float = IDLE_FRACTION,
                **popen) -> subprocess.CompletedProcess:
    """subprocess.run(argv, capture_output=True, text=True), watched: Hung (an AssertionError) when the child's
    tree makes no CPU progress for stall_s seconds or runs past ceiling_s; every process it started is killed
    before this returns, whatever happened."""
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.PIPE)
    popen.setdefault("text", True)
    if input is not None:
        popen["stdin"] = subprocess.PIPE
    with Watched(argv, stall_s=stall_s, ceiling_s=ceiling_s, idle_fraction=idle_fraction, **popen) as job:
        out, err = job.communicate(input)
    result = subprocess.CompletedProcess(job.argv, job.returncode, out, err)
    if check:
        result.check_returncode()
    return result


#: multiprocessing's helpers, which serve this process for the rest of its life: not a test's children
_SERVICES = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


@contextlib.contextmanager
def children_watched(*, stall_s: float = STALL_S, ceiling_s: float = CEILING_S,
                     idle_fraction: float = IDLE_FRACTION) -> Iterator[None]:
    """For children this process starts itself inside the block (torch.multiprocessing.spawn's ranks, a
    Manager): a thread watches their CPU progress as Watched does and, on a hang, kills them, so that
    whatever waits on them fails; Hung is raised at the end of the block. Children started in the block
    and still running at its end are killed."""
    me, started_at = psutil.Process(), time.time() - 1  # create_time has a coarse clock
    seen: dict[tuple[int, float], psutil.Process] = {}
    cpu: dict[tuple[int, float], float] = {}
    samples: deque[tuple[float, float, bool]] = deque()
    verdict: list[str] = []
    done = threading.Event()

    def ours() -> list[psutil.Process]:
        members = []
        for process in me.children(recursive=True):
            try:
                helper = any(name in " ".join(process.cmdline()) for name in _SERVICES)
                if process.create_time() >= started_at and not helper:
                    members.append(process)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return members

    def kill() -> None:
        for process in {*ours(), *(p for p in seen.values() if _running(p))}:
            try:
                process.kill()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass

    def watch() -> None:
        begun = time.monotonic()
        while not done.wait(POLL_S):
            now = _record(ours(), seen, cpu, samples)
            stalled = ("ran past its ceiling" if now - begun > ceiling_s
                       else _stalled(samples, now, stall_s, idle_fraction))
            if stalled:
                verdict.append(f"children {sorted(p.pid for p in seen.values())}: {stalled}; killed")
                kill()
                return

    watcher = threading.Thread(target=watch, name="children_watched", daemon=True)
    watcher.start()
    try:
        yield
    except BaseException as err:  # what waited on a killed child fails: say why it was killed
        if verdict:
            raise Hung(verdict[0]) from err
        raise
    finally:
        done.set()
        watcher.join()
        kill()
    if verdict:
        raise Hung(verdict[0])


def _record(members: list[psutil.Process], seen: dict, cpu: dict, samples: deque) -> float:
    """Add a reading of `members` (their CPU seconds, whether one is runnable) to `samples`; the time now."""
    runnable = False
    for process in members:
        try:
            key = (process.pid, process.create_time())
            times = process.cpu_times()
            runnable = runnable or process.status() == psutil.STATUS_RUNNING
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        seen.setdefault(key, process)
        cpu[key] = max(cpu.get(key, 0.0), times.user + times.system)
    now = time.monotonic()
    samples.append((now, sum(cpu.values()), runnable))
    return now


def _stalled(samples: deque, now: float, stall_s: float, idle_fraction: float) -> str | None:
    """Why the readings of the last stall_s seconds show a hung tree, or None."""
    while len(samples) > 1 and samples[1][0] <= now - stall_s:
        samples.popleft()  # keep one reading at or before the window's start
    then, used_then, _ = samples[0]
    if now - then < stall_s:
        return None
    used = samples[-1][1] - used_then
    runnable = sum(r for _, _, r in samples) / len(samples)
    if used < idle_fraction * (now - then) and runnable < RUNNABLE_FRACTION:
        return f"made no CPU progress: {used:.2f} CPU s in the last {now - then:.0f} s"
    return None


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _session(sid: int) -> list[psutil.Process]:
    """The processes of session `sid` now (those the child started, orphaned or not, unless they left it)."""
    members = []
    for process in psutil.process_iter():
        try:
            if process.pid != os.getpid() and os.getsid(process.pid) == sid and _running(process):
                members.append(process)
        except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
            continue
    return members


def _describe(process: psutil.Process) -> str:
    try:
        return f"{process.name()} ({process.status()})"
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "(gone)"
