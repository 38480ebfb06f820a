"""Where each caching-allocator segment is reserved: memplan's allocator model against the H100's op-by-op readings.

The GPU campaign's part 5 (benchmarks.gpu_ops; benchmarks/results/gpu_campaign_raw_h100/ops/) read
`torch.cuda.memory_reserved()` after every aten op of 14 zoo cases' first two steps on an H100. This tool traces
the same case with memplan (CUDA emulated on CPU, as benchmarks.op_transients does: the same recording and the
same estimate), lines its ops up with the GPU's step by step (difflib over op names) and prints every op after
which either side reserved more, with both sides' reserved and allocated bytes, so a segment memplan takes and
the GPU does not (or the reverse) shows at the op that took it.

    .venv/bin/python -m benchmarks.op_reserved CASE [CASE ...] [--all]

prints; writes nothing. `--all`: every op, not only those where reserved grew. memplan's step 1 includes its
setup (parameters, batch), which it counts without aten ops; the GPU's step 0 is Lightning's setup.
"""
from __future__ import annotations

import argparse
import difflib
import json
import sys

from benchmarks.op_transients import DEVICE, RAW, MiB, _recording, estimate_emulated


def trace_rows(name: str) -> list[list]:
    """memplan's rows [step, op, before, peak, after, shapes, reserved after] for both traced steps."""
    state, undo = _recording()
    try:
        estimate_emulated(name, DEVICE)
    finally:
        undo()
    return state["rows"]


def line_up(gpu_rows: list[list], mp_rows: list[list]) -> list[tuple[list | None, list | None]]:
    """Pairs (GPU row, memplan row), either None where the other side has an op with no counterpart."""
    matcher = difflib.SequenceMatcher(None, [r[1] for r in gpu_rows], [r[1] for r in mp_rows], autojunk=False)
    pairs: list[tuple[list | None, list | None]] = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            pairs += [(gpu_rows[i], mp_rows[j]) for i, j in zip(range(i1, i2), range(j1, j2))]
        else:
            pairs += [(gpu_rows[i], None) for i in range(i1, i2)] + [(None, mp_rows[j]) for j in range(j1, j2)]
    return pairs


def growth(pairs, gpu_start: int, mp_start: int) -> list[dict]:
    """Per pair: both sides' reserved after the op and what it grew by (carried over ops a side lacks)."""
    out, g_prev, m_prev = [], gpu_start, mp_start
    for g, m in pairs:
        g_res = g[6] if g is not None else g_prev
        m_res = m[6] if m is not None else m_prev
        out.append({"op": (g or m)[1], "gpu": g, "memplan": m, "gpu_reserved": g_res, "memplan_reserved": m_res,
                    "gpu_grew": g_res - g_prev, "memplan_grew": m_res - m_prev})
        g_prev, m_prev = g_res, m_res
    return out


def _mib(n) -> str:
    return "-" if n is None else f"{n / MiB:8.2f}"


def report(name: str, *, every_op: bool) -> None:
    gpu = json.loads((RAW / f"{name}.json").read_text())["rows"]
    mp = trace_rows(name)
    g_start = max((r[6] for r in gpu if r[0] == 0), default=0)
    m_start = 0
    print(f"== {name}: GPU (H100, torch 2.11) reserved after its setup (step 0) {g_start / MiB:.1f} MiB, at the "
          f"end {gpu[-1][6] / MiB:.1f} MiB; memplan ({DEVICE}) at the end {mp[-1][6] / MiB:.1f} MiB")
    print(f"{'step':>4} {'op':42s} {'GPU alloc before/after':>19s} {'reserved (+grew)':>17s} | "
          f"{'memplan alloc before/after':>19s} {'reserved (+grew)':>17s}  args")
    for step in (1, 2):
        entries = growth(line_up([r for r in gpu if r[0] == step], [r for r in mp if r[0] == step]), g_start, m_start)
        for e in entries:
            if not every_op and not e["gpu_grew"] and not e["memplan_grew"]:
                continue
            g, m = e["gpu"], e["memplan"]
            shapes = (g[7] if g is not None else None) or (m[5] if m is not None else None)
            print(f"{step:>4} {e['op'][:42]:42s} {_mib(g and g[3])}/{_mib(g and g[5])} "
                  f"{e['gpu_reserved'] / MiB:7.1f} ({e['gpu_grew'] / MiB:+5.1f}) | "
                  f"{_mib(m and m[2])}/{_mib(m and m[4])} {e['memplan_reserved'] / MiB:7.1f} "
                  f"({e['memplan_grew'] / MiB:+5.1f})  {json.dumps(shapes)[:110] if shapes else ''}")
        if entries:
            g_start, m_start = entries[-1]["gpu_reserved"], entries[-1]["memplan_reserved"]
        print(f"-- end of step {step}: GPU reserved {g_start / MiB:.1f} MiB, memplan {m_start / MiB:.1f} MiB")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="+", metavar="CASE", help="cases with op readings (gpu_campaign_raw_h100/ops/)")
    parser.add_argument("--all", action="store_true", help="every op, not only those where reserved grew")
    args = parser.parse_args(argv)
    for name in args.cases:
        if not (RAW / f"{name}.json").exists():
            parser.error(f"CASE {name!r} has no op readings in {RAW}; pick one of "
                         + ", ".join(sorted(p.stem for p in RAW.glob("*.json"))))
        report(name, every_op=args.all)
    return 0


if __name__ == "__main__":
    sys.exit(main())
