"""tests/subprocess_run.py: hangs named by lack of CPU progress (not wall time), and no process outliving
its test. Every child here is a tiny Python or shell script; the windows are short because a sleeping
child uses no CPU however loaded the machine is."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from subprocess_run import Hung, Watched, children_watched, run_watched

SLEEPS_FOREVER = "import time; time.sleep(3600)"


def python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def gone(pid: int) -> bool:
    """Whether `pid` has ended (a zombie counts as ended: init reaps an orphan a moment later)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_child_that_sleeps_for_ever_is_a_hang_and_is_killed():
    with pytest.raises(Hung, match="made no CPU progress") as hung:
        with Watched(python(SLEEPS_FOREVER), stall_s=2) as job:
            job.wait()
    assert job.returncode is not None and gone(job.pid)
    assert "python" in str(hung.value)  # the processes it killed are named


def test_a_child_computing_for_longer_than_the_window_is_not_a_hang():
    # two CPU seconds of work (however long that takes on this machine), against a 1 s window
    done = run_watched(python("""
        import time
        while time.process_time() < 2.0:
            sum(range(10_000))
        print("done")
        """), stall_s=1)
    assert done.returncode == 0 and done.stdout == "done\n", done.stderr


def test_the_work_of_a_grandchild_counts_as_progress():
    # the child only waits; its child computes
    done = run_watched(python("""
        import subprocess, sys
        work = "import time\\nwhile time.process_time() < 2.0: sum(range(10_000))"
        subprocess.run([sys.executable, "-c", work], check=True)
        print("waited")
        """), stall_s=1)
    assert done.returncode == 0 and done.stdout == "waited\n", done.stderr


def test_a_hung_childs_grandchildren_are_killed_even_in_a_session_of_their_own(tmp_path):
    # as torchrun starts its workers: each in a new session, out of reach of the child's process group
    pids = tmp_path / "pids"
    code = f"""
        import subprocess, sys, time
        kids = [subprocess.Popen([sys.executable, "-c", {SLEEPS_FOREVER!r}], start_new_session=new)
                for new in (True, False)]
        open({str(pids)!r}, "w").write(" ".join(str(k.pid) for k in kids))
        time.sleep(3600)
        """
    with pytest.raises(Hung):
        run_watched(python(code), stall_s=2)
    grandchildren = [int(p) for p in pids.read_text().split()]
    assert len(grandchildren) == 2
    for pid in grandchildren:
        for _ in range(50):  # SIGKILL is at once; init reaps the orphan a moment later
            if gone(pid):
                break
            time.sleep(0.1)
        assert gone(pid), f"grandchild {pid} outlived its killed parent"


def test_processes_left_behind_by_a_child_that_succeeded_are_killed(tmp_path):
    pid_file = tmp_path / "pid"
    done = run_watched(["bash", "-c", f"sleep 3600 & echo $! > {pid_file}"], stall_s=5)
    assert done.returncode == 0, done.stderr
    assert gone(int(pid_file.read_text()))


def test_a_failing_test_kills_the_child_it_was_talking_to():
    with pytest.raises(ZeroDivisionError):
        with Watched(python(SLEEPS_FOREVER)) as job:
            1 / 0
    assert gone(job.pid)


def test_waiting_for_something_a_child_never_does_is_a_hang_or_its_end(tmp_path):
    with pytest.raises(Hung):
        with Watched(python(SLEEPS_FOREVER), stall_s=2) as job:
            job.wait_until(lambda: (tmp_path / "never").exists(), "the file appeared")
    with pytest.raises(AssertionError, match="the file appeared: not before the child ended"):
        with Watched(python("pass")) as job:
            job.wait_until(lambda: (tmp_path / "never").exists(), "the file appeared")


def test_the_result_is_subprocess_runs():
    done = run_watched(python("import sys; print(sys.stdin.read().upper()); sys.exit(3)"), input="abc")
    assert (done.returncode, done.stdout) == (3, "ABC\n")
    with pytest.raises(subprocess.CalledProcessError):
        run_watched(python("import sys; sys.exit(3)"), check=True)


def test_a_child_writing_more_than_a_pipe_holds_is_read_while_it_runs():
    done = run_watched(python("import sys; sys.stdout.write('x' * (1 << 20)); sys.stderr.write('y' * (1 << 20))"),
                       stall_s=2)
    assert (len(done.stdout), len(done.stderr)) == (1 << 20, 1 << 20)


def test_a_spinning_child_ends_at_the_ceiling():
    with pytest.raises(Hung, match="ran past its ceiling"):
        run_watched(python("while True: pass"), ceiling_s=1)



def test_a_child_starved_of_cpu_by_other_processes_is_not_a_hang():
    # idle_fraction=2.0: whatever CPU the child gets counts as none, as on a machine so loaded that it gets
    # almost none; it is runnable throughout (computing, or waiting for a core), so it is starved, not hung
    done = run_watched(python("""
        import time
        while time.process_time() < 2.0:
            sum(range(10_000))
        """), stall_s=1, idle_fraction=2.0)
    assert done.returncode == 0, done.stderr


def _sleep_for_ever() -> None:
    time.sleep(3600)


def _compute() -> None:
    while time.process_time() < 2.0:
        sum(range(10_000))


def test_children_a_test_starts_itself_are_watched_too():
    import multiprocessing

    context = multiprocessing.get_context("spawn")  # as torch.multiprocessing.spawn starts ranks
    with pytest.raises(Hung, match="made no CPU progress"):
        with children_watched(stall_s=3):
            child = context.Process(target=_sleep_for_ever)
            child.start()
            child.join()  # returns once the watcher killed it
    assert child.exitcode == -9
    with children_watched(stall_s=1):
        child = context.Process(target=_compute)
        child.start()
        child.join()
    assert child.exitcode == 0
