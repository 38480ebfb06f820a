"""The log reader's fast path (memplan.commands.log_scan): the same folded result as the slow way, on
logs with every kind of line it must hand back, and no JSON decoded for the samples it folds."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from memplan.callback.rank_log import RankLog
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


def variants(rng: random.Random) -> list[str]:
    """Sample lines as MemoryPlanner writes them and as it never does: each must be folded as json.loads
    and the slow way's checks fold it (most take the slow way; those of the shape, the fast one)."""
    base = sample(0, 7, RUN_A, rng)
    plain = json.dumps(base)
    reordered = dict(reversed(list(base.items())))
    missing = {k: v for k, v in base.items() if k != "reserved_bytes"}
    lines = [
        plain,
        json.dumps(base, separators=(",", ":")),  # compact: another text, the same record
        json.dumps(reordered),
        json.dumps(missing),
        json.dumps({**base, "note": 'say "hi"\\ \t caf\u00e9'}),  # escapes in a string
        json.dumps({**base, "note": "caf\u00e9"}, ensure_ascii=False),  # raw UTF-8
        plain.replace('"run": "', '"run": "\\u0032'),  # an escaped run id: another run
        plain.replace('"note": null', '"note": "\\ud800"'),  # a lone surrogate escape
        json.dumps({**base, "process_bytes": None, "peak_bytes": None}),
        json.dumps({**base, "reserved_bytes": None}),
        json.dumps({**base, "headroom_bytes": -(3 * GiB)}),
        json.dumps({**base, "headroom_bytes": -0}),
        plain.replace('"headroom_bytes": ', '"headroom_bytes": -0'),  # -0123...: not JSON
        json.dumps({**base, "time": 1.7e9}),  # 1700000000.0
        json.dumps({**base, "time": 1_700_000_000}),  # an int time
        json.dumps({**base, "time": 12.5}),  # another count of whole seconds
        json.dumps({**base, "time": 0.0005}),  # 0.0005
        json.dumps({**base, "time": 1e-7}),  # 1e-07
        json.dumps({**base, "time": 99999999999.5}),  # 10^11 - 0.5
        json.dumps({**base, "time": 1e11}),  # impossible
        json.dumps({**base, "time": 1700000000.1234567891}),  # repr: 1700000000.1234568
        json.dumps({**base, "step": 0}),
        json.dumps({**base, "step": 10**12}),
        json.dumps({**base, "step": 10**12 + 1}),  # impossible
        json.dumps({**base, "step": -1}),
        json.dumps({**base, "step": 7.0}),  # not an integer step
        json.dumps({**base, "process_bytes": 2**50}),
        json.dumps({**base, "process_bytes": 2**50 + 1}),  # impossible
        json.dumps({**base, "process_bytes": 10**15 - 1}),
        json.dumps({**base, "process_bytes": 1.5}),
        json.dumps({**base, "process_bytes": True}),
        json.dumps({**base, "device_total_bytes": 0}),
        json.dumps({**base, "allocated_bytes": -5}),  # impossible
        json.dumps({**base, "micro_batch_size": 10**200}),  # a long integer json.loads reads
        json.dumps({**base, "micro_batch_size": 1.5e300}),
        plain.replace('"micro_batch_size": 8', '"micro_batch_size": ' + "9" * 5000),  # past json.loads' limit
        plain.replace('"micro_batch_size": 8', '"micro_batch_size": NaN'),  # json.loads reads it
        plain.replace('"micro_batch_size": 8', '"micro_batch_size": Infinity'),
        plain.replace('"micro_batch_size": 8', '"micro_batch_size": 08'),
        plain.replace('"micro_batch_size": 8', '"micro_batch_size": 8, "micro_batch_size": 4'),  # the last counts
        plain.replace('"process_bytes": ', '"process_bytes": 1, "process_bytes": '),
        plain.replace('"guarded": ', '"guarded":  '),  # another space
        plain + " ",
        plain + "\r",  # (a CRLF line)
        " " + plain,
        plain[:-1] + ', "layout": {"micro_batch_size": 8}}',  # a nested value
        plain[:-1] + ', "layout": [1]}',
        plain[:-1] + ', "extra_bytes": 12}',
        plain[:-1] + ',}',
        plain.replace('"event": "sample"', '"event": "Sample"'),
        plain.replace('"event": "sample"', '"event": "sample\\u0000"'),
        plain.replace("{", "[", 1),
        plain[:len(plain) // 2],
        "",
        "null",
        "[]",
        '"sample"',
        "\x00" + plain,
        plain.encode("utf-8").decode("latin-1") + "\u00ff",  # (written back as UTF-8: not the same bytes)
    ]
    return lines


@pytest.mark.parametrize("chunk", [1 << 12, 4 << 20])
def test_the_fast_path_reads_every_kind_of_line_as_json_loads_does(tmp_path, monkeypatch, chunk):
    """Each variant between lines of the shape (so the fast path is taken around it, and learns a new
    shape where the variant is a valid sample of another): the same fold, both ways. In 4 KiB chunks
    (a variant or two each) the lines around each variant take the fast path; in one chunk, past
    MAX_NEW_SHAPES shapes the rest is read the slow way."""
    monkeypatch.setattr(log_reader, "CHUNK_BYTES", chunk)
    rng = random.Random(5)
    folder = tmp_path / "memplan"
    folder.mkdir()
    lines = []
    for i, variant in enumerate(variants(rng)):
        lines += [json.dumps(sample(0, 100 * i + k, RUN_A, rng)) for k in range(3)]
        lines.append(variant)
        lines += [json.dumps(sample(0, 100 * i + 50 + k, RUN_A, rng)) for k in range(3)]
    (folder / "rank0.jsonl").write_bytes(("\n".join(lines) + "\n").encode("utf-8", "surrogatepass"))
    monkeypatch.setattr(run_history, "PLOT_POINTS", 4)
    fast_lines = []
    real_add = log_reader.FolderReader._add_fast

    def add_fast(self, state, shape, groups):
        fast_lines.extend(groups[0])
        real_add(self, state, shape, groups)

    monkeypatch.setattr(log_reader.FolderReader, "_add_fast", add_fast)
    results = []
    for fast in (False, True):
        monkeypatch.setattr(log_reader, "FAST_PATH", fast)
        reader = log_reader.FolderReader(folder)
        reader.update()
        results.append(folded(reader))
    slow, fast = results
    assert fast == slow
    if chunk > len(lines) * 1024:
        return
    assert len(fast_lines) > 4 * len(variants(random.Random(5))), "the lines around each variant go fast"
    for variant in ('"headroom_bytes": -3221225472', '"step": 0,', '"process_bytes": 999999999999999,', '"device_total_bytes": 0,',
                    '"time": 1700000000.0,'):  # valid samples of the shape: fast too
        assert any(variant.encode() in line for line in fast_lines), variant
    assert len(slow["runs"]) == 2  # the escaped run id is another run
    assert {"not JSON", "impossible step", "impossible process_bytes", "impossible time",
            "no integer step"} <= set(slow["skipped"]["rank0.jsonl"])


@pytest.mark.parametrize("numpy_parse", [True, False])
def test_a_shape_folds_its_lines_as_each_record_folds(monkeypatch, numpy_parse):
    """SampleShape.fold against the records json.loads gives, on batches with nulls (none to all), negative headroom,
    peaks under what is reserved, times that share their whole seconds (decimals 5 and 25 and 05) and
    steps out of order: numpy's parse and the one-by-one fold both."""
    from memplan.commands import log_scan

    if not numpy_parse:
        monkeypatch.setattr(log_scan, "_integers", lambda *a: None)
    rng = random.Random(3)
    for trial in range(200):
        n = rng.randrange(1, 40)
        nulls = rng.choice([0.0, 0.2, 0.6, 1.0])  # (a CPU run logs no device figures)
        records = []
        for _ in range(n):
            over = {name: None for name in ("process_bytes", "reserved_bytes", "peak_bytes", "headroom_bytes",
                                            "device_total_bytes") if rng.random() < nulls}
            if rng.random() < 0.3 and "headroom_bytes" not in over:
                over["headroom_bytes"] = -rng.randrange(10**15)
            if rng.random() < 0.5:  # a peak under what is reserved now (the interval's peak was earlier)
                over.update({name: rng.randrange(10**15) for name in ("reserved_bytes", "peak_bytes") if name not in over})
            record = sample(0, rng.randrange(10**rng.randrange(1, 13)), RUN_A, rng, **over)
            record["time"] = rng.choice([1.7e9 + rng.choice([0.5, 0.25, 0.05, 0.125, 0.0]), 1.7e9 + rng.random(),
                                         1.7e9 + rng.randrange(3)])
            records.append(record)
        log_scan._SHAPES.clear()
        first = {**records[0], "process_bytes": 1, "reserved_bytes": 1, "peak_bytes": 1, "headroom_bytes": 1,
                 "device_total_bytes": 1}
        shape = log_scan.sample_shape(first)
        assert shape is not None
        text = b"\n".join(json.dumps(r).encode() for r in records)
        rows = shape.pattern.findall(text)
        assert len(rows) == n and all(row[0] for row in rows), "every line of the shape"
        got = shape.fold(list(zip(*rows)))
        peaks = [p for p in map(run_history.sample_peak_bytes, records) if p is not None]
        heads = [r["headroom_bytes"] for r in records if r["headroom_bytes"] is not None]
        totals = [r["device_total_bytes"] for r in records if r["device_total_bytes"] is not None]
        assert got == log_scan.SampleFigures(
            last_step=max(r["step"] for r in records), started=min(r["time"] for r in records),
            peak_bytes=max(peaks, default=None), min_headroom_bytes=min(heads, default=None),
            device_total_bytes=max(totals, default=None)), trial
        assert type(got.peak_bytes) in (int, type(None)) and type(got.started) is float
