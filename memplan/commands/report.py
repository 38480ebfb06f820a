"""Read MemoryPlanner's per-rank JSON-lines logs back: a plot of memory over steps, a summary of what
happened and why, and a live per-rank table (`memplan report`, `memplan watch`).

Everything stays in bytes as logged (memplan.callback.runlog.RankLog); figures are formatted only when shown.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memplan.units import GiB, format_bytes

LOG_GLOB = "rank*.jsonl"


class NoRankLogs(ValueError):
    """The directory holds no MemoryPlanner rank logs."""


@dataclass(kw_only=True)
class RankHistory:
    """One rank's log, split by event."""

    rank: int
    """Global rank."""
    path: Path
    """Its rank<R>.jsonl."""
    samples: list[dict[str, Any]] = field(default_factory=list)
    """`sample` events: readings in bytes and how the rank ran at that step."""
    changes: list[dict[str, Any]] = field(default_factory=list)
    """`change` events: shared micro-batch / checkpointing decisions with cause and reason."""
    oom_retries: list[dict[str, Any]] = field(default_factory=list)
    """`oom_retry` events."""
    fatals: list[dict[str, Any]] = field(default_factory=list)
    """`fatal` events."""
    applies: list[dict[str, Any]] = field(default_factory=list)
    """`apply` events (layout and plan), one per fit or resume."""
    summaries: list[dict[str, Any]] = field(default_factory=list)
    """`summary` events at the end of each fit."""

    @property
    def device_total_bytes(self) -> int | None:
        totals = [s["device_total_bytes"] for s in self.samples if s.get("device_total_bytes")]
        return max(totals) if totals else None

    @property
    def budget_bytes(self) -> int | None:
        """The plan's per-device budget (free memory less the planning margin), where a plan was applied."""
        budgets = [a["plan"]["device_budget_bytes"] for a in self.applies
                   if a.get("plan") and a["plan"].get("device_budget_bytes")]
        return budgets[-1] if budgets else None

    @property
    def peak_process_bytes(self) -> int | None:
        values = [s["process_bytes"] for s in self.samples if s.get("process_bytes") is not None]
        values += [e["peak_process_bytes"] for e in self.summaries if e.get("peak_process_bytes") is not None]
        return max(values) if values else None

    @property
    def min_headroom_bytes(self) -> int | None:
        values = [s["headroom_bytes"] for s in self.samples if s.get("headroom_bytes") is not None]
        values += [e["min_headroom_bytes"] for e in self.summaries if e.get("min_headroom_bytes") is not None]
        return min(values) if values else None


_KINDS = {"sample": "samples", "change": "changes", "oom_retry": "oom_retries", "fatal": "fatals",
          "apply": "applies", "summary": "summaries"}


def find_rank_logs(directory: str | Path) -> list[Path]:
    """The rank<R>.jsonl files for `directory`: the memplan/ folder itself, or the newest such folder
    below it (e.g. lightning_logs/version_0). Raises NoRankLogs when there are none."""
    root = Path(directory)
    if not root.is_dir():
        raise NoRankLogs(f"{root} is not a directory")
    here = sorted(root.glob(LOG_GLOB))
    if here:
        return _by_rank(here)
    folders = {p.parent for p in root.rglob(LOG_GLOB)}
    if not folders:
        raise NoRankLogs(f"no MemoryPlanner rank logs ({LOG_GLOB}) in {root} or below it; point at the run's "
                         "log directory (the one holding memplan/)")
    newest = max(folders, key=lambda d: max(p.stat().st_mtime for p in d.glob(LOG_GLOB)))
    return _by_rank(list(newest.glob(LOG_GLOB)))


def _by_rank(paths: list[Path]) -> list[Path]:
    ranked = [p for p in paths if p.stem[4:].isdigit()]
    if not ranked:
        raise NoRankLogs(f"no rank<R>.jsonl files among {', '.join(p.name for p in paths)}")
    return sorted(ranked, key=lambda p: int(p.stem[4:]))


def load_rank_log(path: Path) -> RankHistory:
    """A rank's events. A line cut short (the rank is still writing it) is skipped."""
    history = RankHistory(rank=int(path.stem[4:]), path=path)
    with path.open(encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            kind = _KINDS.get(record.get("event"))
            if kind is not None:
                getattr(history, kind).append(record)
    return history


def load_logs(directory: str | Path) -> list[RankHistory]:
    return [load_rank_log(p) for p in find_rank_logs(directory)]


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


# --- summary -----------------------------------------------------------------------------------

def summary_renderables(histories: list[RankHistory]) -> list[Any]:
    """A per-rank table, then the changes, OOM retries and fatal errors in words (rich renderables)."""
    from rich.table import Table

    table = Table(title="memplan: per-rank memory", title_justify="left")
    for column in ("rank", "peak (process)", "least headroom", "device total", "samples", "OOM retries", "fatal"):
        table.add_column(column, justify="right")
    for h in histories:
        table.add_row(str(h.rank), _fmt(h.peak_process_bytes), _fmt(h.min_headroom_bytes), _fmt(h.device_total_bytes),
                      str(len(h.samples)), str(len(h.oom_retries)), str(len(h.fatals)) if h.fatals else "-")
    out: list[Any] = [table]
    changes = shared_changes(histories)
    out.append(f"changes: {len(changes)}" if changes else "changes: none")
    out += [f"  step {c['step']}: {change_label(c)} ({c.get('cause')}): {c.get('reason', '')}" for c in changes]
    retries = [(h.rank, e) for h in histories for e in h.oom_retries]
    out.append(f"OOM retries: {len(retries)}" if retries else "OOM retries: none")
    out += [f"  rank {r} step {e['step']} ({e.get('phase')}): micro-batch {e.get('failed_micro_batch_size')} ran out "
            f"of memory, retried with {e.get('micro_batch_size')}"
            f"{' and checkpointing' if e.get('gradient_checkpointing') else ''}" for r, e in retries]
    fatals = [(h.rank, e) for h in histories for e in h.fatals]
    out += [f"[bold red]fatal[/]: rank {r} step {e['step']}: {e.get('error', '')}"
            f"{' (' + e['where'] + ')' if e.get('where') else ''}" for r, e in fatals]
    return out


def _fmt(num_bytes: int | None) -> str:
    return "n/a" if num_bytes is None else format_bytes(num_bytes)


# --- plot --------------------------------------------------------------------------------------

def plot(histories: list[RankHistory], output: str | Path) -> Path:
    """A PNG of each rank's process and device memory (GiB) over steps, with the device limit, the
    plan's budget, the shared changes (vertical lines) and OOM retries / fatal errors (markers)."""
    try:
        import matplotlib
    except ImportError as err:  # a declared dependency; only a broken install lands here
        raise ImportError("memplan report draws with matplotlib: pip install 'matplotlib>=3.7'") from err
    matplotlib.use("Agg")
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
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


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

def watch_table(histories: list[RankHistory]):
    """The latest reading of each rank, like `gpustat -i`."""
    from rich.table import Table

    table = Table(title="memplan watch", title_justify="left")
    for column in ("rank", "step", "process", "device used / total", "headroom", "micro-batch", "last change"):
        table.add_column(column, justify="right" if column != "last change" else "left")
    changes = shared_changes(histories)
    for h in histories:
        last = h.samples[-1] if h.samples else {}
        used, total = last.get("device_used_bytes"), last.get("device_total_bytes")
        device = "n/a" if used is None else f"{format_bytes(used)} / {_fmt(total)}"
        micro = last.get("micro_batch_size")
        micro_text = "n/a" if micro is None else f"{micro} x {last.get('accumulate_grad_batches', '?')}" \
                                                  f"{' ckpt' if last.get('gradient_checkpointing') else ''}"
        mine = [c for c in h.changes] or changes
        last_change = f"step {mine[-1]['step']}: {change_label(mine[-1])} ({mine[-1].get('cause')})" if mine else "-"
        if h.fatals:
            last_change = f"[red]FATAL at step {h.fatals[-1]['step']}[/]"
        table.add_row(str(h.rank), str(last.get("step", "-")), _fmt(last.get("process_bytes")), device,
                      _fmt(last.get("headroom_bytes")), micro_text, last_change)
    return table
