"""Render one run of MemoryPlanner's per-rank logs (loaded by memplan.commands.run_logs): a plot of
memory over steps, a summary of what happened and why, and a live per-rank table (`memplan report`,
`memplan watch`). Figures stay in bytes as logged; they are formatted only when shown.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memplan.commands import args as arg
from memplan.units import GiB, format_bytes

if TYPE_CHECKING:  # (run_logs loads when a command reads logs, not for `memplan --help`)
    from memplan.commands.run_logs import RankHistory, RunLogs


def shared_changes(histories: list[RankHistory]) -> list[dict[str, Any]]:
    """Each shared decision once (every rank logs the same change), in step order."""
    seen, out = set(), []
    for history in histories:
        for change in history.changes:
            key = (change["step"], change.get("cause"), change.get("reason"))
            if key not in seen:
                seen.add(key)
                out.append(change)
    return sorted(out, key=lambda c: c["step"])


def change_label(change: dict[str, Any]) -> str:
    """'micro 8->4', '+ckpt' where checkpointing came on."""
    before, after = change.get("before", {}), change.get("after", {})
    parts = []
    if before.get("micro_batch_size") != after.get("micro_batch_size"):
        parts.append(f"micro {before.get('micro_batch_size')}->{after.get('micro_batch_size')}")
    if after.get("gradient_checkpointing") and not before.get("gradient_checkpointing"):
        parts.append("+ckpt")
    return " ".join(parts) or str(change.get("cause", "change"))


# --- what was read ------------------------------------------------------------------------------

def context_lines(logs: RunLogs) -> list[str]:
    """Which run and folder are shown, what else is there, and what could not be read (plain text)."""
    from memplan.commands.run_logs import OTHER_RUNS_SHOWN, describe_skipped

    run = logs.run
    ranks = len(logs.histories)
    lines = [f"run {run.run} in {logs.folder}: {ranks} rank{'s' if ranks != 1 else ''}, up to step {run.last_step}, "
             f"{logs.ended or 'still running (or stopped without closing its logs)'}"]
    if len(logs.versions) > 1:
        names = [_short(v) for v in logs.versions]
        lines.append(f"versions: {', '.join(names)}; shown: {_short(logs.folder)} (pick one with --version N)")
    if logs.other_runs:
        others = ", ".join(f"{r.run} (up to step {r.last_step})" for r in logs.other_runs[:OTHER_RUNS_SHOWN])
        if len(logs.other_runs) > OTHER_RUNS_SHOWN:
            others += f" and {len(logs.other_runs) - OTHER_RUNS_SHOWN:,} older"
        lines.append(f"other runs in this folder: {others}; shown: the newest (pick one with --run ID)")
    if logs.missing_ranks:
        lines.append(f"missing ranks: {', '.join(map(str, logs.missing_ranks))} of {logs.world_size or '?'} "
                     "(no log lines of this run)")
    skipped = describe_skipped(logs)
    if skipped:
        lines.append(skipped)
    lines += [f"could not read {name}: {why}" for name, why in sorted(logs.unreadable.items())]
    lines += [f"not read: {name}: {why}" for name, why in sorted(logs.ignored.items())]
    return lines


def _short(folder: Path) -> str:
    """A version folder by its version_N name where it has one."""
    named = next((p.name for p in (folder, *folder.parents) if p.name.startswith("version_")), None)
    return named or str(folder)


# --- summary -----------------------------------------------------------------------------------

def summary_renderables(logs: RunLogs) -> list[Any]:
    """What was read, a per-rank table, then the changes, OOM retries and fatal errors in words (rich
    renderables; text from the logs is escaped, never read as markup)."""
    from rich.markup import escape
    from rich.table import Table

    histories = logs.histories

    table = Table(title="memplan: per-rank memory", title_justify="left")
    for column in ("rank", "peak (process)", "least headroom", "device total", "samples", "OOM retries", "fatal"):
        table.add_column(column, justify="right")
    for h in histories:
        table.add_row(str(h.rank), _fmt(h.peak_process_bytes), _fmt(h.min_headroom_bytes), _fmt(h.device_total_bytes),
                      str(h.sample_count), str(h.oom_retry_count), str(len(h.fatals)) if h.fatals else "-")
    out: list[Any] = [escape(line) for line in context_lines(logs)] + [table]
    out += [escape(line) for line in fallback_notes(histories)]
    changes = shared_changes(histories)
    out.append(f"changes: {len(changes)}" if changes else "changes: none")
    out += [escape(f"  step {c['step']}: {change_label(c)} ({c.get('cause')}): {c.get('reason', '')}") for c in changes]
    retries = [(h.rank, e) for h in histories for e in h.oom_retries]
    count = sum(h.oom_retry_count for h in histories)
    out.append(f"OOM retries: {count}" + (f" ({len(retries)} listed: each rank's first ones and its latest)" if count > len(retries)
                                          else "") if count else "OOM retries: none")
    out += [escape(f"  rank {r} step {e['step']} ({e.get('phase')}): micro-batch {e.get('failed_micro_batch_size')} "
                   f"ran out of memory, retried with {e.get('micro_batch_size')}"
                   f"{' and checkpointing' if e.get('gradient_checkpointing') else ''}") for r, e in retries]
    fatals = [(h.rank, e) for h in histories for e in h.fatals]
    out += ["[bold red]fatal[/]: " + escape(f"rank {r} step {e['step']}: {e.get('error', '')}"
                                            f"{' (' + str(e['where']) + ')' if e.get('where') else ''}")
            for r, e in fatals]
    return out


def fallback_notes(histories: list[RankHistory]) -> list[str]:
    """The ranks whose readings fell back mid-run (NVML lost ...), from their end-of-fit summary records."""
    from memplan.hardware.fallbacks import fallback_lines, fallback_mask

    masks: dict[int, int] = {}
    for h in histories:
        codes = h.summaries[-1].get("reading_fallbacks") if h.summaries else None
        if isinstance(codes, list) and codes:
            masks[h.rank] = fallback_mask(tuple(c for c in codes if isinstance(c, str)))
    return fallback_lines([masks.get(r, 0) for r in range(max(masks, default=-1) + 1)])


def _fmt(num_bytes: int | None) -> str:
    return "n/a" if num_bytes is None else format_bytes(num_bytes)


# --- plot --------------------------------------------------------------------------------------

def prepare_plot() -> None:
    """Import matplotlib (Agg) ahead of `plot`: half a second, spent while the logs are read."""
    try:
        import matplotlib
    except ImportError as err:  # a declared dependency; only a broken install lands here
        raise ImportError("memplan report draws with matplotlib: pip install 'matplotlib>=3.7'") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401


def plot(histories: list[RankHistory], output: str | Path) -> Path:
    """A PNG of each rank's process and device memory (GiB) over steps, with the device limit, the
    plan's budget, the shared changes (vertical lines) and OOM retries / fatal errors (markers)."""
    prepare_plot()
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 6), dpi=110)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, h in enumerate(histories):
        color = colors[i % len(colors)]
        steps = [s["step"] for s in h.samples]
        ax.plot(steps, _gib(h.samples, "process_bytes"), "-o", ms=3, color=color, label=f"rank {h.rank} process")
        ax.plot(steps, _gib(h.samples, "device_used_bytes"), "--", color=color, alpha=0.7,
                label=f"rank {h.rank} device used")
        for e in h.oom_retries:
            y = (e.get("process_bytes") or 0) / GiB
            ax.plot(e["step"], y, "X", ms=11, color=color, mec="black", label=f"rank {h.rank} OOM retry")
            ax.annotate(f"OOM {e.get('phase', '')} {e.get('failed_micro_batch_size')}->{e.get('micro_batch_size')}",
                        (e["step"], y), xytext=(8, 10 + 12 * h.oom_retries.index(e)), textcoords="offset points",
                        fontsize=8, color=color)
        for e in h.fatals:
            ax.plot(e["step"], (e.get("process_bytes") or 0) / GiB, "*", ms=16, color="red", mec="black",
                    label=f"rank {h.rank} fatal OOM")
    top = max(_limits(ax, histories, colors), *(_highest(h) for h in histories), 1e-3)
    changes = shared_changes(histories)
    ax.set_ylim(0, top * (1.25 if changes else 1.08))  # room above the lines for the change labels
    _mark_changes(ax, changes)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("memory (GiB)")
    ax.set_title(f"memplan: memory per rank ({len(histories)} rank{'s' if len(histories) != 1 else ''})")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))  # one legend entry per label
    ax.legend(unique.values(), unique.keys(), loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    fig.tight_layout()
    path = Path(output)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".png")
        try:
            with os.fdopen(fd, "wb") as f:
                fig.savefig(f, format="png")
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)  # never a half-written PNG under the name asked for
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    finally:
        plt.close(fig)
    return path


def output_path(output: str | None, log_dir: str | Path) -> tuple[Path, str | None]:
    """Where the PNG goes, checked before anything is drawn: `--output` (its folder made), else
    LOG_DIR/memplan_report.png, else ./memplan_report.png when LOG_DIR cannot be written. Returns the
    path and a note when it is not where asked; raises OSError naming `--output` when nowhere works."""
    if output is not None:
        path = Path(output)
        if path.is_dir():
            raise IsADirectoryError(f"--output {output} is a folder; name the PNG file, e.g. {path / 'report.png'}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _check_writable(path.parent)
        except OSError as err:
            raise OSError(f"cannot write --output {output} ({err.strerror or err}); pass --output a path in a "
                          "folder you can write") from None
        return path, None
    default = Path(log_dir) / "memplan_report.png"
    try:
        _check_writable(default.parent)
        return default, None
    except OSError as err:
        fallback = Path.cwd() / "memplan_report.png"
        try:
            _check_writable(fallback.parent)
        except OSError:
            raise OSError(f"cannot write the report to {default.parent} ({err.strerror or err}) nor to the current "
                          "folder; pass --output PATH in a folder you can write") from None
        return fallback, f"{default.parent} is not writable ({err.strerror or err}): the PNG goes to {fallback}"


def _check_writable(folder: Path) -> None:
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".memplan_report_check."):
        pass


def _highest(h: RankHistory) -> float:
    events = [*h.samples, *h.oom_retries, *h.fatals]
    values = [e.get(n) or 0 for e in events for n in ("process_bytes", "device_used_bytes")]
    return max(values, default=0) / GiB


def _gib(samples: list[dict[str, Any]], name: str) -> list[float]:
    return [float("nan") if s.get(name) is None else s[name] / GiB for s in samples]


def _limits(ax, histories: list[RankHistory], colors: list[str]) -> float:
    """Device limit(s) and plan budget(s) as horizontal lines: once in black/grey when every rank shares
    them, else one per rank in its colour. Returns the highest line drawn (GiB), 0 if none."""
    top = 0.0
    for name, style, label in (("device_total_bytes", dict(lw=1.5), "device limit"),
                               ("budget_bytes", dict(ls=":", lw=1.5), "plan budget (after margin)")):
        values = [getattr(h, name) for h in histories]
        if len(set(values) - {None}) == 1:
            value = next(v for v in values if v is not None)
            ax.axhline(value / GiB, color="black" if name == "device_total_bytes" else "dimgray", **style,
                       label=f"{label} {format_bytes(value)}")
            top = max(top, value / GiB)
            continue
        for i, (h, value) in enumerate(zip(histories, values)):
            if value is not None:
                ax.axhline(value / GiB, color=colors[i % len(colors)], alpha=0.9, **style,
                           label=f"rank {h.rank} {label} {format_bytes(value)}")
                top = max(top, value / GiB)
    return top


def _mark_changes(ax, changes: list[dict[str, Any]]) -> None:
    from matplotlib.transforms import blended_transform_factory

    transform = blended_transform_factory(ax.transData, ax.transAxes)
    colors = {"oom": "crimson", "headroom": "darkorange", "grow": "seagreen"}
    for i, change in enumerate(changes):
        color = colors.get(change.get("cause"), "purple")
        ax.axvline(change["step"], color=color, ls="-.", lw=1, label=f"change ({change.get('cause')})")
        ax.text(change["step"], 0.98 - 0.045 * (i % 4), f" {change_label(change)}", transform=transform,
                color=color, fontsize=8, va="top", ha="left",
                bbox=dict(facecolor="white", edgecolor="none", alpha=0.8, pad=1))


# --- watch -------------------------------------------------------------------------------------

def watch_view(logs: RunLogs, now: float | None = None):
    """The latest reading of each rank, like `gpustat -i`, with its age; the title says which run and
    whether it has ended."""
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table

    from memplan.commands.run_logs import age

    now = time.time() if now is None else now
    histories = logs.histories
    table = Table(title=escape(f"memplan watch: run {logs.run.run}"), title_justify="left")
    for column in ("rank", "step", "age", "process", "device used / total", "headroom", "micro-batch", "last change"):
        table.add_column(column, justify="right" if column != "last change" else "left")
    changes = shared_changes(histories)
    for h in histories:
        last = h.last_sample or {}
        used, total = last.get("device_used_bytes"), last.get("device_total_bytes")
        device = "n/a" if used is None else f"{format_bytes(used)} / {_fmt(total)}"
        micro = last.get("micro_batch_size")
        micro_text = "n/a" if micro is None else f"{micro} x {last.get('accumulate_grad_batches', '?')}" \
                                                  f"{' ckpt' if last.get('gradient_checkpointing') else ''}"
        mine = [c for c in h.changes] or changes
        last_change = escape(f"step {mine[-1]['step']}: {change_label(mine[-1])} ({mine[-1].get('cause')})") \
            if mine else "-"
        if h.fatals:
            last_change = f"[red]FATAL at step {h.fatals[-1]['step']}[/]"
        table.add_row(str(h.rank), str(last.get("step", "-")), age(last or h.last, now),
                      _fmt(last.get("process_bytes")), device, _fmt(last.get("headroom_bytes")), escape(micro_text),
                      last_change)
    for rank in logs.missing_ranks:
        table.add_row(str(rank), "-", "-", "[yellow]no log[/]", "", "", "", "")
    notes = [escape(line) for line in context_lines(logs)[1:]]
    ended = logs.ended
    status = f"[bold]run ended: {escape(ended)}[/]" if ended else f"running; last record {age(_latest(histories), now)}"
    return Group(table, status, *notes)


def _latest(histories: list[RankHistory]) -> dict[str, Any] | None:
    records = [h.last for h in histories if h.last and isinstance(h.last.get("time"), (int, float))]
    return max(records, key=lambda r: r["time"], default=None)


def plain_line(rank: int, sample: dict[str, Any]) -> str:
    """One reading as one plain line, for `memplan watch` into a pipe or a file:
    '2026-11-25T12:00:03Z rank 1 step 12: process 3.00 GiB, device 3.50 GiB / 16.00 GiB, headroom 12.50 GiB,
    micro-batch 8 x 1'."""
    when = sample.get("time")
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(when)) if isinstance(when, (int, float)) else "-"
    used, total = sample.get("device_used_bytes"), sample.get("device_total_bytes")
    device = "n/a" if used is None else f"{format_bytes(used)} / {_fmt(total)}"
    micro = sample.get("micro_batch_size")
    layout = "n/a" if micro is None else (f"{micro} x {sample.get('accumulate_grad_batches', '?')}"
                                          f"{' ckpt' if sample.get('gradient_checkpointing') else ''}")
    return (f"{stamp} rank {rank} step {sample.get('step')}: process {_fmt(sample.get('process_bytes'))}, "
            f"device {device}, headroom {_fmt(sample.get('headroom_bytes'))}, micro-batch {layout}")


# --- the command: `memplan report` -------------------------------------------------------------
def add_parser(subparsers) -> None:
    p = subparsers.add_parser("report", help="plot and summarise a run's MemoryPlanner logs (memory per rank, changes, OOMs)")
    p.add_argument("log_dir", help="the run's log directory (lightning_logs/, a version_N folder, or its memplan/ "
                   "folder holding rank<R>.jsonl)")
    p.add_argument("--output", default=None, help="PNG to write (default: LOG_DIR/memplan_report.png, else "
                   "./memplan_report.png when LOG_DIR is read-only)")
    arg.add_run_choice(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from memplan.commands.output import console as output_console
    from memplan.commands.run_logs import NoRankLogs, load_run

    try:  # (matplotlib imported while worker processes read a large folder)
        logs = load_run(args.log_dir, version=args.version, run=args.run_id, meanwhile=prepare_plot)
    except NoRankLogs as err:
        return arg.usage_error(str(err))
    try:  # before anything prints: a read-only folder is one clear line, not a crash after the summary
        path, note = output_path(args.output, args.log_dir)
    except OSError as err:
        return arg.usage_error(str(err))
    console = output_console()
    for renderable in summary_renderables(logs):
        console.print(renderable)
    if note:
        print(f"memplan: {note}", file=sys.stderr)
    try:
        plot(logs.histories, path)
    except OSError as err:
        print(f"memplan: could not write {path}: {err.strerror or err}; pass --output PATH", file=sys.stderr)
        return arg.EXIT_ERROR
    print(f"wrote {path}")
    return arg.EXIT_OK
