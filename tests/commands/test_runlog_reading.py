"""How `memplan report` and `memplan watch` read rank logs: the fast line check gives runlog's reasons, odd files
(misnamed, FIFOs, impossible values) are named not read, and large folders and long logs are read in bounded
time and memory (short lines for many runs, folding, appended lines only, over-long lines, parallel first read,
thinned samples)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from rank_logs import LAYOUT_8, reading, run, runs_as, write_run

from memplan.callback.rank_log import RankLog
from memplan.units import GiB, MiB


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
