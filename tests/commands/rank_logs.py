"""Small rank logs for the tests of `memplan report` and `memplan watch` (test_report_cli.py, test_watch_cli.py,
test_runlog_reading.py, test_piped_output.py): written by the callback's own RankLog, or line by line."""
from __future__ import annotations

from pathlib import Path

from memplan.callback.rank_log import RankLog
from memplan.commands.cli import main
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


def open_rank_log(log_dir: Path, rank: int):
    """Rank `rank`'s log file in `log_dir` (made if missing), open to append lines to."""
    log_dir.mkdir(parents=True, exist_ok=True)
    return (log_dir / f"rank{rank}.jsonl").open("a")
