"""The run log in a fit: readings at the first, changed and last steps whatever the interval; a log
that cannot be written never ends the run; Lightning's own logger rows carry the readings."""
from __future__ import annotations

import csv
import errno
import logging
import os
import signal
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from callback_sim import Regression, make_plan, read_jsonl
from pytorch_lightning.loggers import CSVLogger
from subprocess_run import run_watched

from memplan import compat
from memplan.compat import lightning as compat_lightning
from memplan.callback import MemoryPlanner, logger_rows, rank_log, runlog
from memplan.callback.framework import MisconfigurationException
from memplan.callback.sigterm import RankTerminated


def samples(planner: MemoryPlanner) -> list[int]:
    return [e["step"] for e in read_jsonl(planner.log_path) if e["event"] == "sample"]


def summary(caplog) -> str:
    return next(r.getMessage() for r in caplog.records if "MemoryPlanner summary" in r.getMessage())


# --- readings regardless of the interval -------------------------------------------------------

def test_a_run_shorter_than_the_interval_records_its_first_and_last_step_and_each_peak(make_trainer, caplog):
    planner = MemoryPlanner(make_plan(4, 1))
    with caplog.at_level(logging.INFO):
        make_trainer([planner], max_steps=7, log_every_n_steps=50).fit(Regression())
    assert samples(planner) == [1, 7]
    assert "peak n/a" not in summary(caplog) and "least headroom n/a" not in summary(caplog)


def test_log_every_n_steps_0_checks_at_lightnings_default_interval(make_trainer, caplog):
    planner = MemoryPlanner(make_plan(4, 1))
    with caplog.at_level(logging.INFO):
        make_trainer([planner], max_steps=5, log_every_n_steps=0).fit(Regression())
    assert samples(planner) == [1, 5]
    assert any("log_every_n_steps=0" in r.getMessage() and "every_n_steps=" in r.getMessage() for r in caplog.records)


def test_the_step_after_a_change_is_recorded(make_trainer):
    planner = MemoryPlanner(make_plan(8, 1), every_n_steps=3, margin=0.99, grow=False)  # every check lowers
    make_trainer([planner], max_steps=7).fit(Regression(batch_size=8))
    events = read_jsonl(planner.log_path)
    assert [e["step"] for e in events if e["event"] == "change"] == [3, 6]
    assert samples(planner) == [1, 3, 4, 6, 7]
    after = next(e for e in events if e["event"] == "sample" and e["step"] == 4)
    assert after["micro_batch_size"] == 4  # the reading at the new layout


def test_readings_that_fell_back_mid_run_are_named_in_the_summary_and_the_log(make_trainer, caplog, monkeypatch):
    """(On CPU no reading falls back: the codes a GPU's readings would report are given.)"""
    from memplan.hardware import readings

    planner = MemoryPlanner(make_plan(4, 1))
    with caplog.at_level(logging.INFO):
        make_trainer([planner], max_steps=3).fit(Regression())
    assert "NVML" not in summary(caplog)
    assert [e["reading_fallbacks"] for e in read_jsonl(planner.log_path) if e["event"] == "summary"] == [[]]
    caplog.clear()
    monkeypatch.setattr(readings, "reading_fallbacks", lambda device: ("nvml",))
    planner = MemoryPlanner(make_plan(4, 1))
    with caplog.at_level(logging.INFO):
        make_trainer([planner], max_steps=3).fit(Regression())
    assert ("rank 0: NVML gave no memory reading, so the device's figures came from CUDA's mem_get_info and this "
            "process's own share was not available during this fit") in summary(caplog)
    assert [e["reading_fallbacks"] for e in read_jsonl(planner.log_path) if e["event"] == "summary"][-1] == ["nvml"]


# --- a log that cannot be written --------------------------------------------------------------

@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_a_full_disk_warns_once_and_the_fit_goes_on(make_trainer, tmp_path, caplog):
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    (log_dir / "rank0.jsonl").symlink_to("/dev/full")  # every write: ENOSPC
    planner = MemoryPlanner(make_plan(4, 1), every_n_steps=1, log_dir=log_dir)
    module = Regression()
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        make_trainer([planner], max_steps=6).fit(module)
    assert len(module.step_samples) == 6  # trained to the end
    cannot = [w for w in caught if "cannot write its log" in str(w.message)]
    assert len(cannot) == 1 and "No space left on device" in str(cannot[0].message)
    assert "7 log line(s) not written" in summary(caplog)  # so far: apply and 6 samples
    end = [str(w.message) for w in caught if "could not write" in str(w.message)]  # + summary and end
    assert end == [f"MemoryPlanner: rank 0 could not write 9 of 9 lines of its log {log_dir / 'rank0.jsonl'}"]


def test_a_disk_filling_mid_run_keeps_every_line_written_whole(make_trainer, tmp_path, monkeypatch):
    calls = []

    def fills_after_three(fd, data, write=os.write):
        calls.append(data)
        if len(calls) > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_append(fd, data, write)

    real_append = rank_log.append_line
    monkeypatch.setattr(rank_log, "append_line", fills_after_three)
    planner = MemoryPlanner(make_plan(4, 1), every_n_steps=1)
    with pytest.warns(UserWarning) as caught:
        make_trainer([planner], max_steps=5).fit(Regression())
    messages = [str(w.message) for w in caught]
    assert len([m for m in messages if "cannot write its log" in m]) == 1
    assert [m for m in messages if "could not write" in m] == [
        f"MemoryPlanner: rank 0 could not write 5 of 8 lines of its log {planner.log_path}"]  # 5 samples, summary, end
    lines = planner.log_path.read_bytes().split(b"\n")
    assert lines[-1] == b"" and len(lines) == 4
    records, skipped = runlog.parse_lines(planner.log_path.read_bytes())
    assert [r["event"] for r in records] == ["apply", "sample", "sample"] and skipped == {}


def test_a_short_write_is_taken_back(tmp_path):
    path = tmp_path / "rank0.jsonl"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    rank_log.append_line(fd, b'{"event": "sample", "step": 1}\n')
    with pytest.raises(rank_log.PartialLine, match="taken back") as err:
        rank_log.append_line(fd, b'{"event": "sample", "step": 2}\n', write=lambda f, data: os.write(f, data[:9]))
    assert err.value.errno == errno.ENOSPC and not err.value.left_behind
    os.close(fd)
    assert path.read_bytes() == b'{"event": "sample", "step": 1}\n'


def test_a_part_line_that_cannot_be_taken_back_never_joins_the_next_record(tmp_path, monkeypatch):
    log = rank_log.RankLog(tmp_path, 0, "run-a")
    read_end, write_end = os.pipe()  # a pipe cannot be truncated
    os.close(log._fd)
    log._fd = write_end
    real = rank_log.append_line
    monkeypatch.setattr(rank_log, "append_line", lambda fd, data: real(fd, data, write=lambda f, d: os.write(f, d[:5])))
    with pytest.warns(UserWarning, match="cannot write its log"):
        log.write("sample", 1)
    monkeypatch.setattr(rank_log, "append_line", real)
    log.write("sample", 2)
    log.close()
    records, skipped = runlog.parse_lines(os.read(read_end, 4096))
    assert [r["step"] for r in records] == [2] and skipped == {"not JSON": 1}
    assert (log.written, log.dropped) == (1, 1)


def test_an_unwritable_log_dir_is_one_error_naming_the_path_and_log_dir(make_trainer, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    planner = MemoryPlanner(make_plan(4, 1), log_dir=blocker / "memplan")
    with pytest.raises(MisconfigurationException, match="log_dir=") as err:
        make_trainer([planner], max_steps=2).fit(Regression())
    assert str(blocker / "memplan") in str(err.value)


class _Strategy:
    """Just the two collectives MemoryPlanner's setup makes: rank 0's run id, and whether every rank's
    folder is writable (here: another rank's is not)."""

    def broadcast(self, obj, src=0):
        return obj

    def reduce_boolean_decision(self, decision, all=True):
        return False


def test_a_folder_another_rank_cannot_write_stops_this_rank_too(tmp_path):
    from memplan.callback.session import FitSession

    planner = MemoryPlanner(make_plan(4, 1))
    planner._fit = FitSession(adjusting=True)  # as setup makes it
    trainer = SimpleNamespace(strategy=_Strategy(), global_rank=1)
    with pytest.raises(MisconfigurationException, match="on another rank: pass log_dir="):
        planner._open_log(trainer, tmp_path / "memplan")
    records, _ = runlog.parse_lines((tmp_path / "memplan" / "rank1.jsonl").read_bytes())
    assert [(r["event"], r["status"]) for r in records] == [("end", "failed: log folder not writable")]


class _Signalled(Regression):
    """Ended at its third step as the SIGTERM handler of a multi-rank fit ends a rank (memplan.callback.sigterm)."""

    def training_step(self, batch, batch_idx):
        if batch_idx == 2:
            raise RankTerminated(signal.SIGTERM)
        return super().training_step(batch, batch_idx)


def test_a_rank_ended_by_a_signal_records_the_signal_in_its_log(make_trainer):
    planner = MemoryPlanner(make_plan(4, 1))
    with pytest.raises(RankTerminated):
        make_trainer([planner], max_steps=5).fit(_Signalled())
    end = read_jsonl(planner.log_path)[-1]
    assert (end["event"], end["status"], end["signal"]) == ("end", "failed: RankTerminated: 143", "SIGTERM")
    finished = MemoryPlanner(make_plan(4, 1))
    make_trainer([finished], max_steps=2).fit(Regression())
    end = read_jsonl(finished.log_path)[-1]
    assert (end["event"], end["status"], end["signal"]) == ("end", "finished", None)


# --- Lightning's logger --------------------------------------------------------------------------

def test_a_csv_logger_gets_one_full_row_per_step(make_trainer, tmp_path):
    logger = CSVLogger(tmp_path, name="csv")
    make_trainer([MemoryPlanner(make_plan(4, 1))], max_steps=6, log_every_n_steps=2, logger=logger).fit(Regression())
    with open(Path(logger.log_dir) / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [row["step"] for row in rows] == ["1", "3", "5"]  # Lightning's step index: one row each
    for row in rows:
        assert row["train_loss"] and row["memplan/rank0/process_gib"] and row["memplan/predicted_tensor_peak_gib"]
        assert all(value != "" for value in row.values())  # no half-empty row
        assert 0 < float(row["memplan/rank0/process_gib"]) < 1024


def test_the_row_decision_matches_lightnings_own(make_trainer, tmp_path):
    from pytorch_lightning.callbacks import Callback

    class Compare(Callback):
        def __init__(self) -> None:
            self.pairs, self.last = [], 0

        def on_train_batch_end(self, trainer, *args) -> None:
            if trainer.global_step != self.last:  # a batch that stepped: where MemoryPlanner asks
                self.last = trainer.global_step
                self.pairs.append((compat_lightning.writes_logger_row(trainer, compat.logger_row_getter(trainer)()), trainer._logger_connector.should_update_logs))

    compare = Compare()
    make_trainer([compare], max_steps=9, log_every_n_steps=3, accumulate_grad_batches=2,
                 logger=CSVLogger(tmp_path, name="csv")).fit(Regression())
    assert len(compare.pairs) == 9 and [ours for ours, _ in compare.pairs].count(True) == 3
    assert all(ours == theirs for ours, theirs in compare.pairs)


class _Slotted:
    """A logger whose methods cannot be wrapped (no instance __dict__)."""

    __slots__ = ("calls",)

    def __init__(self) -> None:
        self.calls = []

    def log_metrics(self, metrics, step=None):
        self.calls.append((step, dict(metrics)))


class _Plain:
    """A logger as most are: its method can be wrapped on the object."""

    def __init__(self) -> None:
        self.calls = []

    def log_metrics(self, metrics, step=None):
        self.calls.append((step, dict(metrics)))


def test_logger_rows_merge_once_into_the_rows_step_and_unwrap():
    plain, slotted, rows = _Plain(), _Slotted(), logger_rows.LoggerRows()
    rows.install([plain, slotted])
    rows.add({"memplan/x_gib": 1.0}, step=4, loggers=[plain, slotted])
    assert slotted.calls == [(4, {"memplan/x_gib": 1.0})]  # cannot be wrapped: a call of its own
    plain.log_metrics(metrics={"loss": 0.5}, step=4)  # Lightning's row for step 4
    plain.log_metrics({"val_loss": 0.4}, step=4)  # a second row at that index gets nothing more
    plain.log_metrics({"loss": 0.3}, step=5)
    assert plain.calls == [(4, {"loss": 0.5, "memplan/x_gib": 1.0}), (4, {"val_loss": 0.4}), (5, {"loss": 0.3})]
    rows.remove()
    assert "log_metrics" not in vars(plain)


def test_the_prediction_is_named_for_what_it_can_be_read_against():
    """On a GPU the prediction sits beside the process's peak (both device memory); on CPU the readings are
    resident memory (libraries included), so the prediction is named as tensor bytes."""
    from memplan.callback.adjust import RankStatus
    from memplan.callback.layout import Layout
    from memplan.hardware.readings import MemoryReading

    status = RankStatus(rank=0, reading=MemoryReading(process_bytes=3 << 30, peak_bytes=3 << 30),
                        micro_batch_size=4, gradient_checkpointing=False, oom_retries=0)
    layout = Layout(loader_batch_size=4, micro_batch_size=4, accumulate_grad_batches=1, world_size=1)
    gpu = logger_rows.logger_metrics([status], layout, 2 << 30, on_gpu=True)
    cpu = logger_rows.logger_metrics([status], layout, 2 << 30, on_gpu=False)
    assert gpu["memplan/predicted_peak_gib"] == 2.0 and gpu["memplan/rank0/peak_gib"] == 3.0
    assert cpu["memplan/predicted_tensor_peak_gib"] == 2.0 and "memplan/predicted_peak_gib" not in cpu


def test_the_log_readers_import_the_schema_and_neither_the_writer_nor_lightning():
    """`memplan report` and `memplan watch` read the schema (runlog.py) in a fresh interpreter, without the
    callback's writer, its logger rows, torch or Lightning."""
    code = ("import sys\n"
            "import memplan.commands.report, memplan.commands.watch, memplan.commands.run_logs\n"
            "import memplan.commands.log_reader, memplan.commands.log_scan\n"
            "print(sorted(m for m in sys.modules if m.startswith('memplan.callback') or m.split('.')[0] in "
            "('torch', 'pytorch_lightning', 'lightning')))\n")
    done = run_watched([sys.executable, "-c", code], check=True)
    assert done.stdout.strip().splitlines()[-1] == "['memplan.callback', 'memplan.callback.runlog']"



def test_a_log_folder_where_python_imports_from_is_not_named_like_the_package(make_trainer, tmp_path, monkeypatch):
    """logger=False makes trainer.log_dir the working directory, the script's folder: a `memplan/` folder there was
    imported as an empty namespace package on the next run ("module 'memplan' has no attribute 'MemoryPlanner'")."""
    monkeypatch.syspath_prepend(str(tmp_path))  # the script's folder is sys.path[0]
    planner = MemoryPlanner(make_plan(4, 1))
    make_trainer([planner], max_steps=2).fit(Regression())
    assert Path(planner.log_path).parent == tmp_path / "memplan_logs" and not (tmp_path / "memplan").exists()
    elsewhere = tmp_path / "run"
    planner = MemoryPlanner(make_plan(4, 1))
    make_trainer([planner], max_steps=2, default_root_dir=elsewhere).fit(Regression())
    assert Path(planner.log_path).parent == elsewhere / "memplan"  # any other folder keeps the documented name
