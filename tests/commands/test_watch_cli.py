"""`memplan watch` on small rank logs written by the callback's own RankLog: once and live, each reading's age and
the run's end, and into a pipe (one plain line a reading, ending with the run or on SIGTERM)."""
from __future__ import annotations

import json
import sys

from rank_logs import LAYOUT_4, LAYOUT_8, reading, run, runs_as, write_run

from memplan.callback.rank_log import RankLog
from memplan.units import GiB


def test_watch_once_prints_each_ranks_latest_reading(tmp_path, capsys):
    write_run(tmp_path / "memplan")
    code, out, err = run(capsys, "watch", tmp_path, "--once")
    assert code == 0, err
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") > 3}
    assert "2.00 GiB" in rows["0"] and "9.00 GiB" in rows["1"]  # the last sample's process bytes
    assert "4 x 2" in rows["0"]  # micro-batch 4, 2 per step, after the change


def test_watch_shows_each_readings_age_and_that_the_run_ended(tmp_path, capsys):
    write_run(tmp_path / "memplan")
    code, out, _ = run(capsys, "watch", tmp_path, "--once")
    assert code == 0 and "age" in out and "s ago" in out
    assert "run ended: finished" in out


def test_a_live_watch_waits_for_logs_and_survives_a_bad_line(tmp_path, capsys, monkeypatch):
    import time

    from memplan.commands import report

    seen = []
    real_view = report.watch_view
    monkeypatch.setattr(report, "watch_view", lambda logs, now=None: seen.append(logs) or real_view(logs, now))
    ticks = []

    def tick(seconds):
        ticks.append(seconds)
        if len(ticks) == 1:  # the run starts writing after the watch started
            write_run(tmp_path / "lightning_logs" / "version_0" / "memplan")
        elif len(ticks) == 2:
            with (tmp_path / "lightning_logs" / "version_0" / "memplan" / "rank1.jsonl").open("ab") as f:
                f.write(b"\x00\xff garbage\n")
        else:
            raise KeyboardInterrupt

    monkeypatch.setattr(time, "sleep", tick)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)  # a terminal: the live table
    code, out, err = run(capsys, "watch", tmp_path, "--interval", "0.01")
    assert code == 0, err
    assert len(seen) == 2 and seen[1].skipped == {"rank1.jsonl": {"not UTF-8": 1}}
    assert "run ended: finished" in out  # the last frame, after the bad line


def test_watch_into_a_pipe_prints_one_plain_line_per_reading_and_ends_with_the_run(tmp_path, capsys, monkeypatch):
    """Not a terminal: each rank's latest reading, then one line per new reading, and the end of the run."""
    import time

    log_dir = tmp_path / "memplan"
    log = RankLog(log_dir, 0, "20261124-050000-aaaaaa")
    log.write("apply", 0, source="plan", layout={**LAYOUT_8, "world_size": 1}, plan={})
    log.write("sample", 1, **reading(1 * GiB, 2 * GiB), **runs_as(LAYOUT_8, 0))
    log.write("sample", 2, **reading(2 * GiB, 3 * GiB), **runs_as(LAYOUT_8, 0))
    ticks = []

    def tick(seconds):
        ticks.append(seconds)
        if len(ticks) == 1:
            log.write("sample", 3, **reading(3 * GiB, 4 * GiB), **runs_as(LAYOUT_4, 0))
            log.write("sample", 4, **reading(4 * GiB, 5 * GiB), **runs_as(LAYOUT_4, 0))
        elif len(ticks) == 2:
            log.write("summary", 4, peak_process_bytes=4 * GiB, min_headroom_bytes=None, oom_retries=0, layout=LAYOUT_4)
            log.write("end", 4, status="finished", dropped_lines=0)
        else:
            raise AssertionError("watch kept going after the run ended")

    monkeypatch.setattr(time, "sleep", tick)
    code, out, err = run(capsys, "watch", log_dir, "--interval", "0.5")
    assert code == 0, err
    lines = out.strip().splitlines()
    assert [line.split(": ", 1)[0].split(" ", 1)[1] for line in lines[:3]] == ["rank 0 step 2", "rank 0 step 3",
                                                                               "rank 0 step 4"]
    assert "process 4.00 GiB, device 5.00 GiB / 16.00 GiB" in lines[2] and "micro-batch 4 x 2" in lines[2]
    assert lines[3] == "memplan watch: run 20261124-050000-aaaaaa ended: finished" and len(lines) == 4


def test_watch_into_a_pipe_ends_on_sigterm(tmp_path):
    """A `memplan watch DIR > file` killed with SIGTERM ends at once, exit 0, its lines flushed."""
    import signal

    from subprocess_run import Watched

    write_run(tmp_path / "memplan", ranks=(0,))
    (tmp_path / "memplan" / "rank1.jsonl").write_text("")  # rank 1 never ends: the run goes on
    with (tmp_path / "memplan" / "rank0.jsonl").open("a") as f:
        f.write(json.dumps({"event": "apply", "step": 0, "rank": 0, "run": "20261124-050000-aaaaaa", "time": 1.0,
                            "layout": {**LAYOUT_8, "world_size": 2}}) + "\n")
    out = tmp_path / "watch.txt"
    with out.open("w") as stdout, (tmp_path / "watch.err").open("w") as stderr, \
            Watched([sys.executable, "-m", "memplan.commands.cli", "watch", str(tmp_path / "memplan"),
                     "--interval", "0.1"], stdout=stdout, stderr=stderr) as proc:
        proc.wait_until(lambda: "rank 0 step 4" in out.read_text(), "watch printed rank 0's step 4")
        proc.send_signal(signal.SIGTERM)
        code = proc.wait()
    assert code == 0, (tmp_path / "watch.err").read_text()
    assert "rank 0 step 4" in out.read_text()
