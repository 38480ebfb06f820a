"""`memplan report` and `memplan watch` on small rank logs written by the callback's own RankLog."""
from __future__ import annotations

from pathlib import Path

from memplan.commands.cli import main
from memplan.callback.runlog import RankLog
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


def write_run(log_dir: Path) -> None:
    """Two ranks, 4 checks; rank 1 retries an OOM at step 1 and runs tight at step 2, where both
    ranks lower micro-batch 8 -> 4. Process peaks: rank 0 3 GiB, rank 1 15 GiB."""
    plan = {"device_budget_bytes": 14 * GiB, "micro_batch_size": 8}
    process = {0: [1, 2, 3, 2], 1: [10, 14, 15, 9]}
    for rank in (0, 1):
        log = RankLog(log_dir, rank)
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
