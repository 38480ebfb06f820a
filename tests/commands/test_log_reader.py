"""The log reader's fast path (memplan.commands.log_scan): the same folded result as the slow way, on
logs with every kind of line it must hand back, and no JSON decoded for the samples it folds."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from memplan.callback.runlog import RankLog
from memplan.commands import log_reader, run_history
from memplan.units import GiB, MiB

RUN_A, RUN_B = "20261124-050000-aaaaaa", "20261125-060000-bbbbbb"


def sample(rank: int, step: int, run: str, rng: random.Random, **over) -> dict:
    process = rng.randrange(GiB, 8 * GiB)
    fields = {"process_bytes": process, "device_used_bytes": process + GiB, "device_total_bytes": 16 * GiB,
              "allocated_bytes": process - MiB, "reserved_bytes": process, "peak_bytes": process + rng.randrange(GiB),
              "headroom_bytes": rng.randrange(-GiB, 8 * GiB), "micro_batch_size": 8, "gradient_checkpointing": False,
              "guarded": rng.random() < 0.5, "note": None, **over}
    return {"event": "sample", "step": step, "rank": rank, "run": run, "time": 1.7e9 + step + rng.random(), **fields}


def messy_log(folder: Path, rng: random.Random) -> None:
    """Two ranks: a run, then a resumed one (a new run id), samples with nulls, impossible values, bad
    JSON, blank and over-long lines, other events between the samples, a key set that changes."""
    folder.mkdir(parents=True)
    for rank in (0, 1):
        lines = [json.dumps({"event": "apply", "step": 0, "rank": rank, "run": RUN_A, "time": 1.7e9,
                             "layout": {"world_size": 2}})]
        for step in range(1, 1500):
            run = RUN_A if step < 900 else RUN_B
            roll = rng.random()
            if roll < 0.02:
                lines.append(json.dumps(sample(rank, step, run, rng, reserved_bytes=None, allocated_bytes=None)))
            elif roll < 0.03:
                lines.append(json.dumps(sample(rank, step, run, rng, peak_bytes=10**30)))
            elif roll < 0.035:
                lines.append(json.dumps(sample(rank, step, run, rng))[:-7])  # cut short
            elif roll < 0.04:
                lines.append("")
            elif roll < 0.045:
                lines.append(json.dumps(sample(rank, step, run, rng, note="x" * 5000)))
            elif roll < 0.05:
                lines.append(json.dumps({"event": "change", "step": step, "rank": rank, "run": run, "time": 1.7e9 + step,
                                         "cause": "grow", "before": {"micro_batch_size": 8}, "after": {}}))
            elif roll < 0.055:
                lines.append(json.dumps(sample(rank, step, run, rng, step_ms=12.5)))  # another key set
            elif roll < 0.06:
                lines.append(json.dumps(sample(rank, step, run, rng, headroom_bytes=-(2**51))))
            elif roll < 0.065:
                lines.append(json.dumps(sample(rank, step, run, rng, process_bytes=True)))
            elif roll < 0.07:
                lines.append(json.dumps(sample(rank, 10**13, run, rng)))
            elif roll < 0.075:
                lines.append(json.dumps(sample(rank, step, run, rng)).replace('"micro_batch_size": 8',
                                                                              '"micro_batch_size": 08'))
            elif roll < 0.08:
                lines.append(json.dumps(sample(rank, step, run, rng, note="caf\u00e9 \"quoted\"")))
            else:
                lines.append(json.dumps(sample(rank, step, run, rng)))
        lines.append(json.dumps({"event": "end", "step": 1500, "rank": rank, "run": RUN_B, "time": 1.8e9,
                                 "status": "finished"}))
        (folder / f"rank{rank}.jsonl").write_text("\n".join(lines) + "\n")


def folded(reader: log_reader.FolderReader) -> dict:
    out = {"skipped": reader.skipped, "runs": reader.run_infos()}
    for run, state in reader.runs.items():
        for rank, h in state.ranks.items():
            out[(run, rank)] = (h.sample_count, h.sample_stride, h.samples, h.last, h.last_sample,
                                h.peak_process_bytes, h.min_headroom_bytes, h.device_total_bytes, h.changes,
                                h.applies, h.ends)
    return out


@pytest.mark.parametrize("chunk", [1 << 12, 1 << 16, 4 << 20])
def test_the_fast_path_folds_exactly_what_the_slow_way_does(tmp_path, monkeypatch, chunk):
    messy_log(tmp_path / "memplan", random.Random(chunk))
    monkeypatch.setattr(log_reader, "CHUNK_BYTES", chunk)
    monkeypatch.setattr(log_reader, "MAX_LINE_BYTES", 1 << 12)
    monkeypatch.setattr(run_history, "PLOT_POINTS", 16)
    results = []
    for fast in (False, True):
        monkeypatch.setattr(log_reader, "FAST_PATH", fast)
        reader = log_reader.FolderReader(tmp_path / "memplan")
        reader.update()
        raw = sum(type(s) is bytes for state in reader.runs.values() for h in state.ranks.values() for s in h._samples)
        assert (raw > 0) == fast  # (the fast path keeps its samples undecoded until shown)
        results.append(folded(reader))
    slow, fast = results
    assert fast == slow
    assert {"not JSON", "impossible peak_bytes", "impossible headroom_bytes", "process_bytes is not a byte count",
            "impossible step", "line longer than 4.00 KiB"} <= set(slow["skipped"]["rank0.jsonl"])
    assert [r.run for r in slow["runs"]] == [RUN_B, RUN_A]


def test_a_long_log_decodes_only_the_samples_it_shows(tmp_path, monkeypatch):
    """Figures from every sample, JSON decoded for the few kept for the plot and the latest: the
    slow way decodes every line."""
    monkeypatch.setattr(run_history, "PLOT_POINTS", 16)
    log = RankLog(tmp_path / "memplan", 0, RUN_A)
    rng = random.Random(0)
    peaks = []
    for step in range(1, 20_001):
        record = sample(0, step, RUN_A, rng)
        peaks.append(record["process_bytes"] + max(0, record["peak_bytes"] - record["reserved_bytes"]))
        log.write("sample", step, **{k: v for k, v in record.items() if k not in ("event", "step", "rank", "run", "time")})
    log.close()
    decoded = []
    real_loads = json.loads
    def counting_loads(text, *args, **kwargs):
        decoded.append(text.count(b'"event"' if isinstance(text, bytes) else '"event"'))
        return real_loads(text, *args, **kwargs)

    monkeypatch.setattr(json, "loads", counting_loads)
    reader = log_reader.FolderReader(tmp_path / "memplan")
    reader.update()
    history = reader.runs[RUN_A].ranks[0]
    assert history.sample_count == 20_000 and history.peak_process_bytes == max(peaks)
    assert [s["step"] for s in history.samples][-1] == 20_000 and history.last_sample["step"] == 20_000
    assert sum(decoded) < 100, f"{sum(decoded)} records decoded of 20,000"


def test_a_run_id_on_every_line_builds_a_few_patterns_not_one_a_line(tmp_path, monkeypatch):
    """20,000 runs of one line each (each a new shape): the lines are read the slow way, and a pattern is
    built for a few of them per chunk, not for each."""
    from memplan.commands import log_scan

    folder = tmp_path / "memplan"
    folder.mkdir()
    rng = random.Random(1)
    (folder / "rank0.jsonl").write_text("".join(json.dumps(sample(0, 1, f"2026-{i:06d}", rng)) + "\n"
                                                for i in range(20_000)))
    built = []
    real = log_scan._build
    monkeypatch.setattr(log_scan, "_build", lambda *a: built.append(1) or real(*a))
    log_scan._SHAPES.clear()
    reader = log_reader.FolderReader(folder)
    reader.update()
    assert len(reader.runs) == 20_000
    chunks = (folder / "rank0.jsonl").stat().st_size // log_reader.CHUNK_BYTES + 1
    assert len(built) <= chunks * (log_reader.MAX_NEW_SHAPES + 1), f"{len(built)} patterns built"
