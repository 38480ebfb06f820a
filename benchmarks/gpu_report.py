"""What every rendering of the GPU campaign's raw results shares: reading the parts, the header naming the
device, a section's status in words, and cells that say "not measured" instead of a blank that reads like zero.

Used by benchmarks.gpu_results (parts 1 and 2), benchmarks.gpu_extra_results (parts 3 and 4) and
benchmarks.gpu_profile_results (part 4's kernel profile, part 5).

A part may come in several files: DIR/partN.json, then follow-up calls' DIR/partNb.json, partNc.json ... (the
campaign's `--only` / `--cases` re-running what an earlier call left). load_parts merges them into one part
(merge_section): a section a follow-up was not asked to run keeps the earlier result; a section both measured
keeps both calls' rows, by case, the later call's where both have one.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from memplan.units import format_bytes

PARTS = (1, 2, 3, 4, 5)
NOT_MEASURED = "not measured"
"""What a table cell says where a section did not run or was cut short before the figure."""


def part_files(folder: Path, n: int) -> list[Path]:
    """Part n's files in the order the calls ran: partN.json, then partNb.json, partNc.json ..."""
    first = folder / f"part{n}.json"
    follow = sorted(p for p in folder.glob(f"part{n}[b-z].json") if p.is_file())
    return ([first] if first.is_file() else []) + follow


def load_parts(folder: Path) -> dict[int, dict]:
    """Each part's files merged (merge_part), with `calls` (each file's start and environment) and `sources`
    (section -> the files its figures come from, and each row's file: sources_of)."""
    parts = {}
    for n in PARTS:
        calls = []
        for path in part_files(folder, n):
            try:
                data = json.loads(path.read_text())
            except json.JSONDecodeError as err:
                raise ValueError(f"{path} is not valid JSON ({err}); was the run cut off while writing it?") from err
            calls.append((path.name, data))
            parts[n] = (merge_part(parts[n], data, path.name) if n in parts
                        else dict(data, files=[path.name], folder=str(folder)))
        if calls:
            parts[n]["calls"] = {name: {"started": d.get("started"),
                                        "environment": d.get("sections", {}).get("environment") or {}}
                                 for name, d in calls}
            parts[n]["sources"] = sources_of(calls, parts[n])
    if not parts:
        raise ValueError(f"{folder} holds none of part1.json .. part{PARTS[-1]}.json; pass the folder the campaign "
                         "wrote (the run tool's files_at)")
    return parts


def _rows(entry: dict) -> list:
    rows = entry.get("rows") if isinstance(entry, dict) else None
    return list(rows.values()) if isinstance(rows, dict) else rows if isinstance(rows, list) else []


def sources_of(calls: list[tuple[str, dict]], merged: dict) -> dict[str, dict]:
    """For each section of a merged part: {"files": the calls whose figures it holds, in call order, "rows": case ->
    the call that measured it}. merge_section keeps the calls' own entry and row objects, so each is found by
    identity; a section merged from calls' rows comes from the calls of its rows."""
    owner = {}
    for name, data in calls:
        for entry in data.get("sections", {}).values():
            owner[id(entry)] = name
            owner.update((id(r), name) for r in _rows(entry))
    order = [name for name, _ in calls]
    out = {}
    for key, entry in merged.get("sections", {}).items():
        rows = entry.get("rows")
        by_case = ({case: owner[id(r)] for case, r in rows.items() if id(r) in owner} if isinstance(rows, dict)
                   else {r["case"]: owner[id(r)] for r in _rows(entry) if "case" in r and id(r) in owner})
        files = {owner[id(entry)]} if id(entry) in owner else set(by_case.values())
        if not files:  # merged from calls that measured no rows: the last call that ran it
            files = {next(n for n, d in reversed(calls) if key in d.get("sections", {}))}
        out[key] = {"files": [n for n in order if n in files], "rows": by_case}
    return out


def merge_part(base: dict, follow: dict, name: str) -> dict:
    """A part's follow-up call (`follow`, file `name`) merged into what the earlier calls gave (`base`)."""
    sections = dict(base.get("sections", {}))
    for key, entry in follow.get("sections", {}).items():
        sections[key] = merge_section(sections[key], entry) if key in sections else entry
    return dict(base, sections=sections, files=[*base.get("files", []), name],
                dry_run=bool(base.get("dry_run") or follow.get("dry_run")))


def _not_run(entry: dict) -> bool:
    """Skipped, or run on no case (a call whose `--cases` named none of the section's): it measured nothing."""
    no_case = entry.get("cases") == [] and not entry.get("rows")
    return no_case or (str(entry.get("status")).startswith("skipped") and not measured_anything(entry))


def merge_section(base: dict, follow: dict) -> dict:
    """One section as two calls left it: the one that ran where the other was skipped (`--only`, out of time);
    where both ran and hold rows (a list of dicts by "case", or a dict by case), both calls' rows, the later
    call's where both have a case, and out_of_time / missing only what neither measured; otherwise the later."""
    if _not_run(follow):
        return base
    if _not_run(base):
        return follow
    rows_a, rows_b = base.get("rows"), follow.get("rows")
    if isinstance(rows_a, dict) and isinstance(rows_b, dict):
        rows = {**rows_a, **rows_b}
        done = set(rows)
    elif isinstance(rows_a, list) and isinstance(rows_b, list) and all("case" in r for r in rows_a + rows_b):
        later = {r["case"] for r in rows_b}
        rows = [r for r in rows_a if r["case"] not in later] + rows_b
        done = {r["case"] for r in rows}
    else:
        return follow
    merged = dict(follow, rows=rows, merged_calls=base.get("merged_calls", 1) + 1,
                  seconds=(base.get("seconds") or 0) + (follow.get("seconds") or 0))
    merged.pop("summary", None)  # the calls' own summaries cover one call each: the renderers summarize the rows
    if "cases" in base or "cases" in follow:
        merged["cases"] = list(dict.fromkeys([*base.get("cases", []), *follow.get("cases", [])]))
    for key in ("out_of_time", "missing"):
        if key in base or key in follow:
            merged[key] = [c for c in dict.fromkeys([*base.get(key, []), *follow.get(key, [])]) if c not in done]
    return merged


NOT_ASKED = "skipped: not asked"
"""How a section's status begins where the call's `--only` left it out: it was never meant to run there."""


def asked(entry: dict) -> bool:
    """Whether some call was asked to run this section (a section no call asked for renders as absent)."""
    return not str(entry.get("status")).startswith(NOT_ASKED)


def section(parts: dict[int, dict], name: str) -> dict | None:
    """The section `name` as the parts hold it; None where it is absent or no call was asked to run it."""
    for data in parts.values():
        if name in data.get("sections", {}):
            entry = data["sections"][name]
            return entry if asked(entry) else None
    return None


def sections_starting(parts: dict[int, dict], prefix: str) -> dict[str, dict]:
    """Every section whose name starts with `prefix` (one per model or config) that some call was asked to run."""
    return {name: e for data in parts.values() for name, e in data.get("sections", {}).items()
            if name.startswith(prefix) and asked(e)}


def environment(parts: dict[int, dict], part: int | None = None, sections: tuple[str, ...] = ()) -> dict:
    """The environment section of `part` (the part a file renders, which may have run in another call),
    else the first part's that has one. With `sections`: the environment of the calls those sections' figures
    come from (the last of them; `runs` lists each where they are several), not of every call of the part."""
    order = ([part] if part in parts else []) + [n for n in parts if n != part]
    for n in order:
        data = parts[n]
        env = data.get("sections", {}).get("environment")
        if env and env.get("status") == "done":
            files = _files_of(data, sections)
            if files is None:
                return dict(env, date=data.get("started"), dry_run=data.get("dry_run", False), part=n,
                            files=data.get("files", [f"part{n}.json"]))
            calls = data["calls"]
            last = calls[files[-1]]
            out = dict(last["environment"], date=last["started"], dry_run=data.get("dry_run", False), part=n,
                       files=files)
            if len(files) > 1:
                counts = {f: 0 for f in files}
                for key in sections:
                    for f in data["sources"].get(key, {}).get("rows", {}).values():
                        counts[f] = counts.get(f, 0) + 1
                out["runs"] = [{"file": f, "date": calls[f]["started"], "rows": counts[f],
                                "memplan_commit": calls[f]["environment"].get("memplan_commit"),
                                "differs": _differs(calls[f]["environment"], out)} for f in files]
            return out
    return {"date": None, "dry_run": any(d.get("dry_run") for d in parts.values())}


def _files_of(data: dict, sections: tuple[str, ...]) -> list[str] | None:
    """The calls the named sections' figures come from, in call order; None where not known (no sections)."""
    sources = data.get("sources") or {}
    found = [f for key in sections if key in sources and asked(data["sections"][key]) for f in sources[key]["files"]]
    order = list(data.get("calls") or {})
    return [f for f in order if f in found] or None


def alloc_conf(env: dict) -> str | None:
    """The allocator setting a call ran under ("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"); None at
    the defaults. torch reads PYTORCH_ALLOC_CONF first, as memplan does (AllocatorConfig.from_env)."""
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        if ((env.get("env") or {}).get(name)) is not None:
            return f"{name}={env['env'][name]}"
    return None


def _differs(env: dict, shown: dict) -> list[str]:
    """What a call's environment has that the header (the last call's) does not: GPU, driver, torch, allocator."""
    def facts(e: dict) -> dict:
        return {"GPU": (e.get("gpu") or {}).get("name"), "driver": e.get("driver"), "torch": e.get("torch"),
                "transformers": (e.get("packages") or {}).get("transformers"), "allocator": alloc_conf(e) or "default"}
    mine, theirs = facts(env), facts(shown)
    return [f"{k} {v}" for k, v in mine.items() if v != theirs[k]]


def header(title: str, env: dict, raw: str) -> list[str]:
    """The title and the line naming the device, driver, torch and CUDA."""
    gpu = env.get("gpu") or {}
    packages = env.get("packages") or {}
    cc = gpu.get("compute_capability")
    setting = alloc_conf(env)
    lines = [f"# {title}" + (f", under {setting}" if setting else ""), ""]
    if env.get("dry_run"):
        lines += ["**DRY RUN on CPU: these are not GPU figures.**", ""]
    device = (f"{gpu.get('name')} ({format_bytes(gpu['total_bytes']) if gpu.get('total_bytes') else '?'}, "
              f"sm{cc[0]}{cc[1]})" if gpu else "no GPU")
    files = env.get("files") or []
    part = (f" (campaign part {env['part']}" + (f": {' + '.join(files)}, {len(files)} calls" if len(files) > 1 else "")
            + ")") if env.get("part") else ""
    when = (f"measured {env.get('date')}{part} on memplan {str(env.get('memplan_commit'))[:10]}" if not env.get("runs")
            else f"measured in {len(env['runs'])} calls of campaign part {env.get('part')}: " + ", ".join(
                f"{r['file']} ({r['date']}, memplan {str(r['memplan_commit'])[:10]}, {r['rows']} rows"
                + "".join(f", {d}" for d in r["differs"]) + ")" for r in env["runs"]))
    lines += [f"Device: {device}; driver {env.get('driver')} (CUDA {env.get('cuda_driver')}); torch {env.get('torch')} "
              f"(CUDA {env.get('torch_cuda')}, cuDNN {env.get('cudnn')}); Lightning {packages.get('pytorch-lightning')}, "
              f"transformers {packages.get('transformers')}; Python {env.get('python')}; {when}. Raw figures: `{raw}`.",
              ""]
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


@dataclass(frozen=True)
class Results:
    """Where rendered files go, and the card their names end with: `accuracy_gpu.md`, or with card "h100"
    `accuracy_gpu_h100.md` (a second campaign's files beside the first's)."""

    folder: Path
    card: str = ""

    def name(self, stem: str) -> str:
        return f"{stem}_{self.card}" if self.card else stem


def write(out: Results | Path, name: str, data: dict, lines: list[str]) -> None:
    out = out if isinstance(out, Results) else Results(Path(out))
    out.folder.mkdir(parents=True, exist_ok=True)
    (out.folder / f"{out.name(name)}.json").write_text(json.dumps(data, indent=1, default=repr) + "\n")
    (out.folder / f"{out.name(name)}.md").write_text("\n".join(lines).rstrip() + "\n")


def raw_name(out: Results | Path, name: str) -> str:
    """The JSON file a rendered Markdown file names as its raw figures."""
    return f"{out.name(name) if isinstance(out, Results) else name}.json"
