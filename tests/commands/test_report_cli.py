"""`memplan report` on small rank logs written by the callback's own RankLog: the PNG and its path, each rank's
peak and the change reason, what it says of empty, bad, missing or mixed logs, which rank it blames for a failed
run, and the ranks whose readings fell back. `memplan watch` is test_watch_cli.py's; reading the logs (bounds,
odd files) test_runlog_reading.py's."""
from __future__ import annotations

import json
from pathlib import Path

from rank_logs import LAYOUT_8, REASON, open_rank_log, reading, run, runs_as, write_run

from memplan.callback.rank_log import RankLog
from memplan.units import GiB


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


def test_report_blames_the_rank_that_was_signalled_not_a_peers_secondary_error(tmp_path, capsys):
    log_dir = tmp_path / "memplan"
    run_id = "20261124-050000-aaaaaa"
    for rank, (when, status) in {0: (1005.0, "failed: RuntimeError: Connection closed by peer"),
                                 1: (1000.0, "failed: RankTerminated: 143")}.items():
        with (log_dir / f"rank{rank}.jsonl").open("a") if log_dir.exists() else open_rank_log(log_dir, rank) as f:
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
        with open_rank_log(log_dir, rank) as f:
            for record in ({"event": "apply", "step": 0, "layout": {**LAYOUT_8, "world_size": 2}, "time": 900.0},
                           {"event": "sample", "step": 3, **reading(GiB, GiB), "time": 990.0},
                           {"event": "end", "step": 3, "status": status, "signal": signal_name, "dropped_lines": 0,
                            "time": when}):
                f.write(json.dumps({**record, "rank": rank, "run": run_id}) + "\n")
    code, out, _ = run(capsys, "report", log_dir, "--output", tmp_path / "r.png")
    text = " ".join(out.split())
    assert code == 0
    assert "rank 1 failed: RankTerminated: 158 (SIGUSR1 received) (first to fail; then rank 0)" in text


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
