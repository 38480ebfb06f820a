"""`memplan report` and `memplan watch` on small rank logs written by the callback's own RankLog."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from memplan.commands.cli import main
from memplan.callback.rank_log import RankLog
from memplan.hardware.readings import MemoryReading
from memplan.units import GiB, MiB

TOTAL = 16 * GiB
LAYOUT_8 = {"loader_batch_size": 8, "micro_batch_size": 8, "accumulate_grad_batches": 1, "world_size": 2,
            "gradient_checkpointing": False, "micro_batches_per_step": 1, "global_batch_size": 16}
LAYOUT_4 = {**LAYOUT_8, "micro_batch_size": 4, "micro_batches_per_step": 2}
REASON = "rank 1 has 512.00 MiB free at its peak, under the margin of 5% of 16.00 GiB: micro-batch 8 -> 4"


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def reading(process: int, used: int) -> dict:
    return MemoryReading(process_bytes=process, device_used_bytes=used, device_total_bytes=TOTAL,
                         peak_bytes=process, headroom_bytes=TOTAL - used).to_dict()


def runs_as(layout: dict, oom_retries: int) -> dict:
    return {"micro_batch_size": layout["micro_batch_size"], "loader_batch_size": 8,
            "accumulate_grad_batches": layout["micro_batches_per_step"], "trainer_accumulate_grad_batches": 1,
            "gradient_checkpointing": False, "global_batch_size": 16, "oom_retries": oom_retries}


def write_run(log_dir: Path, run_id: str = "20261124-050000-aaaaaa", ranks: tuple[int, ...] = (0, 1)) -> None:
    """Two ranks, 4 checks; rank 1 retries an OOM at step 1 and runs tight at step 2, where both
    ranks lower micro-batch 8 -> 4. Process peaks: rank 0 3 GiB, rank 1 15 GiB."""
    plan = {"device_budget_bytes": 14 * GiB, "micro_batch_size": 8}
    process = {0: [1, 2, 3, 2], 1: [10, 14, 15, 9]}
    for rank in ranks:
        log = RankLog(log_dir, rank, run_id)
        log.write("apply", 0, source="plan", layout=LAYOUT_8, plan=plan)
        ooms = 0
        for step in range(1, 5):
            if rank == 1 and step == 1:
                ooms = 1
                log.write("oom_retry", step, batch=step, phase="forward", failed_micro_batch_size=8, micro_batch_size=4,
                          gradient_checkpointing=False, error="CUDA out of memory", **reading(14 * GiB, 15 * GiB))
            layout = LAYOUT_8 if step <= 2 else LAYOUT_4
            gib = process[rank][step - 1] * GiB
            log.write("sample", step, **reading(gib, gib + 512 * MiB), **runs_as(layout, ooms))
            if step == 2:
                log.write("change", step, cause="headroom", ranks=[1], reason=REASON, before=LAYOUT_8, after=LAYOUT_4)
        log.write("summary", 4, peak_process_bytes=max(process[rank]) * GiB, min_headroom_bytes=None,
                  oom_retries=ooms, layout=LAYOUT_4)
        log.close()


def test_report_writes_a_png_and_names_each_ranks_peak_and_the_change_reason(tmp_path, capsys):
    run_dir = tmp_path / "lightning_logs" / "version_0"
    write_run(run_dir / "memplan")
    code, out, err = run(capsys, "report", run_dir)  # a parent of memplan/: found below it
    assert code == 0, err
    png = run_dir / "memplan_report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert f"wrote {png}" in out
    flat = " ".join(out.split())  # rich wraps long lines
    assert "3.00 GiB" in flat and "15.00 GiB" in flat  # each rank's peak
    assert REASON in flat and "micro 8->4" in flat
    assert "rank 1 step 1 (forward): micro-batch 8 ran out of memory, retried with 4" in flat


def test_report_output_path(tmp_path, capsys):
    write_run(tmp_path / "memplan")
    target = tmp_path / "plots" / "run.png"
    code, out, _ = run(capsys, "report", tmp_path / "memplan", "--output", target)
    assert code == 0 and target.stat().st_size > 0 and f"wrote {target}" in out


def test_watch_once_prints_each_ranks_latest_reading(tmp_path, capsys):
    write_run(tmp_path / "memplan")
    code, out, err = run(capsys, "watch", tmp_path, "--once")
    assert code == 0, err
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") > 3}
    assert "2.00 GiB" in rows["0"] and "9.00 GiB" in rows["1"]  # the last sample's process bytes
    assert "4 x 2" in rows["0"]  # micro-batch 4, 2 per step, after the change


def test_an_empty_dir_exits_2_with_one_message(tmp_path, capsys):
    code, out, err = run(capsys, "report", tmp_path)
    assert code == 2
    assert "no MemoryPlanner rank logs" in err and str(tmp_path) in err
    assert not (tmp_path / "memplan_report.png").exists()
    assert run(capsys, "watch", tmp_path, "--once")[0] == 2


# --- data that is not what it should be ----------------------------------------------------------

def test_bad_lines_are_skipped_and_counted_by_reason(tmp_path, capsys):
    log_dir = tmp_path / "memplan"
    write_run(log_dir)
    with (log_dir / "rank0.jsonl").open("ab") as f:
        f.write(b"\xff\xfe not utf-8\n")  # non-UTF-8
        f.write(b"[1, 2, 3]\n")  # a JSON array
        f.write(b'{"event": "sample", "process_bytes": 1}\n')  # a record without step
        f.write(b'{"event": "sample", "step": 9, "process_bytes": "lots"}\n')  # a size that is not bytes
    code, out, err = run(capsys, "report", log_dir)
    assert code == 0, err
    flat = " ".join(out.split())
    assert ("skipped 4 bad lines: rank0.jsonl: 1 not UTF-8, 1 not a JSON object, 1 no integer step, "
            "1 process_bytes is not a byte count") in flat
    assert "15.00 GiB" in flat  # the good lines still count
    code, out, _ = run(capsys, "watch", log_dir, "--once")
    assert code == 0 and "skipped 4 bad lines" in " ".join(out.split())


def test_a_folder_of_nothing_readable_exits_2_saying_what_was_skipped(tmp_path, capsys):
    (tmp_path / "rank0.jsonl").write_bytes(b"\xff\xfe\n[1]\n")
    code, out, err = run(capsys, "report", tmp_path)
    assert code == 2 and out == ""
    assert "no readable MemoryPlanner record" in err and "rank0.jsonl: 1 not UTF-8, 1 not a JSON object" in err


def test_a_missing_rank_is_named(tmp_path, capsys):
    write_run(tmp_path / "memplan", ranks=(0,))  # its layout says 2 ranks; rank 1 wrote nothing
    code, out, _ = run(capsys, "report", tmp_path)
    assert code == 0 and "missing ranks: 1 of 2" in " ".join(out.split())
    code, out, _ = run(capsys, "watch", tmp_path, "--once")
    assert "no log" in out


def test_two_runs_in_one_folder_are_never_merged(tmp_path, capsys):
    old, new = "20261124-040000-111111", "20261124-050000-222222"
    write_run(tmp_path / "memplan", run_id=old)
    write_run(tmp_path / "memplan", run_id=new, ranks=(0,))
    code, out, _ = run(capsys, "report", tmp_path)
    flat = " ".join(out.split())
    assert code == 0 and f"run {new}" in flat and f"other runs in this folder: {old}" in flat
    table = [line for line in out.splitlines() if line.count("│") > 3]
    assert [line.split("│")[1].strip() for line in table] == ["0"]  # rank 0 of the new run only
    assert table[0].split("│")[5].strip() == "4"  # its 4 samples, not 8
    code, out, _ = run(capsys, "report", tmp_path, "--run", "20261124-04")
    assert code == 0 and f"run {old}" in " ".join(out.split()) and "missing ranks" not in out
    code, _, err = run(capsys, "report", tmp_path, "--run", "nope")
    assert code == 2 and "--run nope" in err and old in err and new in err


def test_versions_are_listed_and_picked(tmp_path, capsys):
    logs = tmp_path / "lightning_logs"
    write_run(logs / "version_0" / "memplan", run_id="20261124-040000-000000")
    write_run(logs / "version_1" / "memplan", run_id="20261124-050000-111111")
    code, out, _ = run(capsys, "report", logs)
    flat = " ".join(out.split())
    assert code == 0 and "versions: version_0, version_1; shown: version_1 (pick one with --version N)" in flat
    assert "run 20261124-050000-111111" in flat
    code, out, _ = run(capsys, "report", logs, "--version", "0")
    assert code == 0 and "shown: version_0" in " ".join(out.split())
    code, _, err = run(capsys, "report", logs, "--version", "7")
    assert code == 2 and "--version 7" in err and "versions there: 0, 1" in err


def test_an_unwritable_output_is_one_error_before_the_summary(tmp_path, capsys):
    write_run(tmp_path / "memplan")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    code, out, err = run(capsys, "report", tmp_path, "--output", blocker / "report.png")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "--output" in err and str(blocker / "report.png") in err


def test_a_read_only_log_dir_puts_the_png_in_the_current_folder(tmp_path, capsys, monkeypatch):
    from memplan.commands import report

    write_run(tmp_path / "logs" / "memplan")
    real = report._check_writable

    def read_only(folder):
        if Path(folder) == tmp_path / "logs":
            raise PermissionError(13, "Permission denied")
        real(folder)

    monkeypatch.setattr(report, "_check_writable", read_only)
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    code, out, err = run(capsys, "report", tmp_path / "logs")
    assert code == 0 and (here / "memplan_report.png").stat().st_size > 0
    assert "is not writable (Permission denied): the PNG goes to" in err
    assert not (tmp_path / "logs" / "memplan_report.png").exists()


# --- watch ---------------------------------------------------------------------------------------

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


def test_the_readers_fast_check_gives_runlogs_reasons():
    """log_scan.problem is runlog.record_problem in one pass (plus impossible values): same reasons."""
    from memplan.callback.runlog import record_problem
    from memplan.commands.log_scan import problem as _problem

    good = {"event": "sample", "step": 3, "time": 1.5, "process_bytes": 5, "headroom_bytes": -4, "layout": {}}
    cases = [good, [1], {"event": "x"}, {"event": "x", "step": -1}, {"event": "x", "step": True}, {"step": 1},
             {**good, "time": "noon"}, {**good, "time": True}, {**good, "peak_bytes": 1.5}, {**good, "peak_bytes": True},
             {**good, "plan": [1]}, {**good, "before": "x"}, {**good, "peak_bytes": None}]
    for record in cases:
        assert _problem(record) == record_problem(record), record
    for record, why in [({**good, "step": 10**20}, "impossible step"), ({**good, "peak_bytes": 10**30}, "impossible peak_bytes"),
                        ({**good, "process_bytes": -1}, "impossible process_bytes"), ({**good, "time": 1e300}, "impossible time"),
                        ({**good, "headroom_bytes": -10**30}, "impossible headroom_bytes")]:
        assert _problem(record) == why


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


def test_rank_logs_named_otherwise_fifos_and_impossible_values_are_named_not_read(tmp_path, capsys):
    log_dir = tmp_path / "memplan"
    write_run(log_dir)
    (log_dir / "rank01.jsonl").write_text((log_dir / "rank1.jsonl").read_text())
    os.mkfifo(log_dir / "rank7.jsonl")  # would block a plain read for ever
    with (log_dir / "rank0.jsonl").open("a") as f:
        for field, value in (("peak_bytes", 10**30), ("process_bytes", -5), ("step", 10**20)):
            record = {"event": "sample", "step": 9, "rank": 0, "run": "20261124-050000-aaaaaa", "time": 2.0,
                      **reading(GiB, GiB)}
            record[field] = value
            f.write(json.dumps(record) + "\n")
    code, out, err = run(capsys, "report", log_dir, "--output", tmp_path / "r.png")
    text = " ".join(out.split())
    assert code == 0, err
    assert "not read: rank01.jsonl: not a name MemoryPlanner writes (rank 1's log is rank1.jsonl)" in text
    assert "could not read rank7.jsonl: not a regular file (a FIFO or a device): skipped" in text
    assert "1 impossible peak_bytes, 1 impossible process_bytes, 1 impossible step" in text
    assert "15.00 GiB" in text and "PiB" not in text  # rank 1's peak as logged; no 10^30 bytes shown
    code, out, _ = run(capsys, "watch", log_dir, "--once")
    assert code == 0 and "rank7.jsonl" in " ".join(out.split())


def test_report_blames_the_rank_that_was_signalled_not_a_peers_secondary_error(tmp_path, capsys):
    log_dir = tmp_path / "memplan"
    run_id = "20261124-050000-aaaaaa"
    for rank, (when, status) in {0: (1005.0, "failed: RuntimeError: Connection closed by peer"),
                                 1: (1000.0, "failed: RankTerminated: 143")}.items():
        with (log_dir / f"rank{rank}.jsonl").open("a") if log_dir.exists() else _fresh(log_dir, rank) as f:
            for record in ({"event": "apply", "step": 0, "layout": {**LAYOUT_8, "world_size": 2}, "time": 900.0},
                           {"event": "sample", "step": 3, **reading(GiB, GiB), "time": 990.0},
                           {"event": "end", "step": 3, "status": status, "dropped_lines": 0, "time": when}):
                f.write(json.dumps({**record, "rank": rank, "run": run_id}) + "\n")
    code, out, _ = run(capsys, "report", log_dir, "--output", tmp_path / "r.png")
    text = " ".join(out.split())
    assert code == 0
    assert "rank 1 failed: RankTerminated: 143 (SIGTERM received) (first to fail; then rank 0)" in text


def test_report_names_the_signal_the_log_records_not_one_read_back_from_the_status(tmp_path, capsys):
    # a log written on macOS, where SIGUSR1 is 30 (exit 158); read here, 158 - 128 would be Linux's SIGPWR
    log_dir = tmp_path / "memplan"
    run_id = "20261124-050000-aaaaaa"
    ends = {0: (1005.0, "failed: RuntimeError: Connection closed by peer", None),
            1: (1000.0, "failed: RankTerminated: 158", "SIGUSR1")}
    for rank, (when, status, signal_name) in ends.items():
        with _fresh(log_dir, rank) as f:
            for record in ({"event": "apply", "step": 0, "layout": {**LAYOUT_8, "world_size": 2}, "time": 900.0},
                           {"event": "sample", "step": 3, **reading(GiB, GiB), "time": 990.0},
                           {"event": "end", "step": 3, "status": status, "signal": signal_name, "dropped_lines": 0,
                            "time": when}):
                f.write(json.dumps({**record, "rank": rank, "run": run_id}) + "\n")
    code, out, _ = run(capsys, "report", log_dir, "--output", tmp_path / "r.png")
    text = " ".join(out.split())
    assert code == 0
    assert "rank 1 failed: RankTerminated: 158 (SIGUSR1 received) (first to fail; then rank 0)" in text


def _fresh(log_dir: Path, rank: int):
    log_dir.mkdir(parents=True, exist_ok=True)
    return (log_dir / f"rank{rank}.jsonl").open("a")


def test_twenty_thousand_runs_in_one_folder_print_a_short_line(tmp_path, capsys):
    log_dir = tmp_path / "memplan"
    log_dir.mkdir()
    lines = [json.dumps({"event": "sample", "step": 1, "rank": 0, "run": f"2026-{i:06d}", "time": float(i),
                         **reading(GiB, GiB)}) for i in range(20_000)]
    (log_dir / "rank0.jsonl").write_text("\n".join(lines) + "\n")
    code, out, _ = run(capsys, "watch", log_dir, "--once")
    assert code == 0
    assert "and 19,994 older; shown: the newest" in " ".join(out.split())
    assert max(len(line) for line in out.splitlines()) < 400


def test_a_long_log_is_folded_in_bounded_memory_and_watch_reads_only_what_was_appended(tmp_path, monkeypatch):
    """Every sample counts in the figures; the plot keeps at most 2 x PLOT_POINTS of them; a refresh
    reads the appended bytes only."""
    from memplan.commands import log_reader, run_history, run_logs

    monkeypatch.setattr(run_history, "PLOT_POINTS", 16)
    monkeypatch.setattr(log_reader, "CHUNK_BYTES", 4096)  # many chunks: lines cut across chunk edges
    log_dir = tmp_path / "memplan"
    log = RankLog(log_dir, 0, "20261124-050000-aaaaaa")
    for step in range(1, 1001):
        log.write("sample", step, **reading((step % 97) * MiB + (GiB if step == 777 else 0), GiB), **runs_as(LAYOUT_8, 0))
    watcher = run_logs.RunWatcher(log_dir)
    history = watcher.logs().histories[0]
    assert history.sample_count == 1000 and len(history.samples) < 32
    assert history.peak_process_bytes == 1 * GiB + (777 % 97) * MiB  # the one high sample, wherever it fell
    assert history.last_sample["step"] == 1000 and history.samples[-1]["step"] == 1000
    steps = [s["step"] for s in history.samples]
    assert steps == sorted(steps) and steps[0] == 1
    stride = history.sample_stride
    assert all((step - 1) % stride == 0 for step in steps[:-1])  # every stride-th, evenly
    for last in range(1001, 1001 + 2 * stride + 1):  # the latest is always last, across a thinning too
        log.write("sample", last, **reading(MiB, GiB), **runs_as(LAYOUT_8, 0))
        assert watcher.logs().histories[0].samples[-1]["step"] == last
    read = []
    real = os.pread
    monkeypatch.setattr(log_reader.os, "pread", lambda fd, n, off: read.append(n) or real(fd, n, off))
    log.write("sample", 2001, **reading(MiB, GiB), **runs_as(LAYOUT_8, 0))
    history = watcher.logs().histories[0]
    assert history.last_sample["step"] == 2001
    assert sum(read) < 1000  # one line, not the whole file


@pytest.mark.parametrize("chunk", [1 << 10, 1 << 20], ids=["across-chunks", "within-a-chunk"])
def test_an_over_long_line_is_skipped_and_the_next_ones_read(tmp_path, capsys, monkeypatch, chunk):
    from memplan.commands import log_reader, run_logs

    monkeypatch.setattr(log_reader, "MAX_LINE_BYTES", 1 << 12)
    monkeypatch.setattr(log_reader, "CHUNK_BYTES", chunk)
    write_run(tmp_path / "memplan")
    with (tmp_path / "memplan" / "rank0.jsonl").open("ab") as f:
        f.write(b'{"event": "sample", "x": "' + b"y" * 20_000 + b'"}\n')
        f.write((json.dumps({"event": "sample", "step": 5, "rank": 0, "run": "20261124-050000-aaaaaa", "time": 3.0,
                             **reading(GiB, GiB)}) + "\n").encode())
    logs = run_logs.load_run(tmp_path / "memplan")
    assert logs.skipped == {"rank0.jsonl": {"line longer than 4.00 KiB": 1}}
    assert logs.histories[0].last_sample["step"] == 5


def test_a_parallel_first_read_folds_the_same_as_one_process(tmp_path, monkeypatch):
    from memplan.commands import log_reader, run_logs

    write_run(tmp_path / "memplan")
    (tmp_path / "memplan" / "rank01.jsonl").write_text("")
    one = run_logs.load_run(tmp_path / "memplan")
    monkeypatch.setattr(log_reader, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(log_reader.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    spread = []
    real = log_reader.FolderReader._read_in_parallel
    monkeypatch.setattr(log_reader.FolderReader, "_read_in_parallel",
                        lambda self, paths, meanwhile=None: spread.append(real(self, paths, meanwhile)) or spread[-1])
    many = run_logs.load_run(tmp_path / "memplan")
    assert spread == [True]
    assert [(h.rank, h.sample_count, h.peak_process_bytes, h.min_headroom_bytes, h.ended, len(h.samples))
            for h in many.histories] == [(h.rank, h.sample_count, h.peak_process_bytes, h.min_headroom_bytes,
                                          h.ended, len(h.samples)) for h in one.histories]
    assert many.run == one.run and many.ignored == one.ignored and many.ignored


def test_thinned_samples_keep_every_kth_and_the_latest_last(monkeypatch):
    from memplan.commands import run_history

    monkeypatch.setattr(run_history, "PLOT_POINTS", 4)
    history = run_history.RankHistory(rank=0, path=Path("rank0.jsonl"))
    for step in range(1, 300):
        history.add({"event": "sample", "step": step, "process_bytes": step})
        steps = [s["step"] for s in history.samples]
        assert steps[-1] == step and len(steps) <= 2 * 4 + 1
        assert all((s - 1) % history.sample_stride == 0 for s in steps[:-1]), (step, steps)
    assert history.peak_process_bytes == 299 and history.sample_count == 299


def test_report_names_the_ranks_whose_readings_fell_back_mid_run(tmp_path, capsys):
    """(The summary record's reading_fallbacks, as MemoryPlanner writes it when NVML was lost mid-run.)"""
    log_dir = tmp_path / "memplan"
    for rank, codes in ((0, []), (1, ["nvml"])):
        log = RankLog(log_dir, rank, "20261124-050000-aaaaaa")
        log.write("sample", 1, **reading(GiB, 2 * GiB), **runs_as(LAYOUT_8, 0))
        log.write("summary", 1, peak_process_bytes=GiB, min_headroom_bytes=None, oom_retries=0, layout=LAYOUT_8,
                  reading_fallbacks=codes)
        log.close()
    code, out, _ = run(capsys, "report", log_dir, "--output", tmp_path / "r.png")
    assert code == 0
    assert ("rank 1: NVML gave no memory reading, so the device's figures came from CUDA's mem_get_info and this "
            "process's own share was not available during this fit") in " ".join(out.split())
    assert "rank 0: NVML" not in out

