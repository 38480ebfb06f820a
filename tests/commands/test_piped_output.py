"""Piped or redirected (`| tee`, `> file`), every command's output keeps each sentence and table row on one
line (memplan.commands.output.console): rich would fold them at 80 columns, mid-sentence. Here stdout is
pytest's capture, not a terminal, as in a pipe. (`memplan suggest`: tests/commands/test_cli.py; `memplan
devices`: tests/hardware/test_devices.py; `validate` prints plain lines, `watch` without --once too.)"""
from __future__ import annotations

from rank_logs import REASON, run, write_run


def test_estimate_keeps_its_notes_whole(capsys):
    code, out, _ = run(capsys, "estimate", "--demo", "mlp", "--batch-size", "2", "--device", "cpu")
    assert code == 0
    rule = next(line for line in out.splitlines() if line.startswith("rule of thumb:"))
    assert len(rule) > 80 and rule.endswith("'rule misses' is memplan minus the rule")


def test_report_keeps_each_change_on_one_line(tmp_path, capsys):
    write_run(tmp_path / "memplan")
    code, out, _ = run(capsys, "report", tmp_path / "memplan", "--output", tmp_path / "run.png")
    assert code == 0
    assert f"  step 2: micro 8->4 (headroom): {REASON}" in out.splitlines()


def test_watch_once_keeps_each_rank_on_one_row(tmp_path, capsys):
    write_run(tmp_path / "memplan")
    code, out, _ = run(capsys, "watch", tmp_path / "memplan", "--once")
    assert code == 0
    rows = [line for line in out.splitlines() if "/ 16.00 GiB" in line]
    assert len(rows) == 2 and all(len(row) > 80 and "step 2: micro 8->4 (headroom)" in row for row in rows)
