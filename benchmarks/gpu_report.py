"""What every rendering of the GPU campaign's raw results shares: reading the parts, the header naming the
device, a section's status in words, and cells that say "not measured" instead of a blank that reads like zero.

Used by benchmarks.gpu_results (parts 1 and 2) and benchmarks.gpu_extra_results (parts 3 and 4).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from memplan.units import format_bytes

PARTS = (1, 2, 3, 4)
NOT_MEASURED = "not measured"
"""What a table cell says where a section did not run or was cut short before the figure."""


def load_parts(folder: Path) -> dict[int, dict]:
    parts = {}
    for n in PARTS:
        path = folder / f"part{n}.json"
        if path.is_file():
            try:
                parts[n] = json.loads(path.read_text())
            except json.JSONDecodeError as err:
                raise ValueError(f"{path} is not valid JSON ({err}); was the run cut off while writing it?") from err
    if not parts:
        raise ValueError(f"{folder} holds none of part1.json .. part4.json; pass the folder the campaign wrote "
                         "(the run tool's files_at)")
    return parts


def section(parts: dict[int, dict], name: str) -> dict | None:
    for data in parts.values():
        if name in data.get("sections", {}):
            return data["sections"][name]
    return None


def environment(parts: dict[int, dict], part: int | None = None) -> dict:
    """The environment section of `part` (the part a file renders, which may have run in another call),
    else the first part's that has one."""
    order = ([part] if part in parts else []) + [n for n in parts if n != part]
    for n in order:
        data = parts[n]
        env = data.get("sections", {}).get("environment")
        if env and env.get("status") == "done":
            return dict(env, date=data.get("started"), dry_run=data.get("dry_run", False), part=n)
    return {"date": None, "dry_run": any(d.get("dry_run") for d in parts.values())}


def header(title: str, env: dict, raw: str) -> list[str]:
    """The title and the line naming the device, driver, torch and CUDA."""
    gpu = env.get("gpu") or {}
    packages = env.get("packages") or {}
    cc = gpu.get("compute_capability")
    lines = [f"# {title}", ""]
    if env.get("dry_run"):
        lines += ["**DRY RUN on CPU: these are not GPU figures.**", ""]
    device = (f"{gpu.get('name')} ({format_bytes(gpu['total_bytes']) if gpu.get('total_bytes') else '?'}, "
              f"sm{cc[0]}{cc[1]})" if gpu else "no GPU")
    part = f" (campaign part {env['part']})" if env.get("part") else ""
    lines += [f"Device: {device}; driver {env.get('driver')} (CUDA {env.get('cuda_driver')}); torch {env.get('torch')} "
              f"(CUDA {env.get('torch_cuda')}, cuDNN {env.get('cudnn')}); Lightning {packages.get('pytorch-lightning')}, "
              f"transformers {packages.get('transformers')}; Python {env.get('python')}; measured {env.get('date')}"
              f"{part} on memplan {str(env.get('memplan_commit'))[:10]}. Raw figures: `{raw}`.", ""]
    return lines


def measured_anything(entry: dict) -> bool:
    return any(k not in ("status", "seconds", "error", "traceback", "stderr_tail") for k in entry)


def status_line(entry: dict | None, name: str) -> list[str]:
    """One line saying how a section ended, where it did not simply finish."""
    if entry is None:
        return [f"`{name}`: {NOT_MEASURED} (its part's JSON is missing).", ""]
    status = str(entry.get("status"))
    if status.startswith("skipped"):
        return [f"`{name}`: {NOT_MEASURED} ({status}: the part's time budget was spent before it started).", ""]
    if status == "done" and entry.get("out_of_time"):
        return [f"`{name}`: {len(entry['out_of_time'])} cases {NOT_MEASURED}, cut off by the time budget: "
                f"{', '.join(entry['out_of_time'])}.", ""]
    if status != "done":
        what = "what it measured before is below" if measured_anything(entry) else "nothing measured"
        why = exception_line(entry.get("stderr_tail") or "") or one_line(entry.get("error") or "")
        return [f"`{name}`: **{status}** after {entry.get('seconds', 0):.0f} s"
                + (f": {why[:700]}" if why else "") + f"; {what}.", ""]
    return []


_EXCEPTION = re.compile(r"^(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Expired|Interrupt|Exit)\b.*?:")


def exception_line(text: str) -> str | None:
    """The last exception line of a traceback tail, its message joined onto one line ("[rank0]: " prefixes and
    the traceback above it dropped); None where there is none."""
    lines = [re.sub(r"^\[rank\d+\]:\s?", "", ln).rstrip() for ln in str(text).splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        if _EXCEPTION.match(lines[i]):
            return " ".join(ln.strip() for ln in lines[i:] if ln.strip())
    return None


def one_line(error: str) -> str:
    """An error on one line: its exception line (exception_line), else the text itself joined."""
    return exception_line(error) or " ".join(ln.strip() for ln in str(error).splitlines() if ln.strip())


def pct(e: float | None) -> str:
    return NOT_MEASURED if e is None else f"{100 * e:+.2f}%"


def nbytes(n) -> str:
    return NOT_MEASURED if n is None else format_bytes(int(n))


def seconds(x) -> str:
    return NOT_MEASURED if x is None else f"{x:.1f}"


def value(x) -> str:
    return NOT_MEASURED if x is None else str(x)


def write(out: Path, name: str, data: dict, lines: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=1, default=repr) + "\n")
    (out / f"{name}.md").write_text("\n".join(lines).rstrip() + "\n")
