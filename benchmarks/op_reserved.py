"""Where each caching-allocator segment is reserved: memplan's allocator model against the H100's op-by-op readings.

The GPU campaign's part 5 (benchmarks.gpu_ops; benchmarks/results/gpu_campaign_raw_h100/ops/) read
`torch.cuda.memory_reserved()` after every aten op of 14 zoo cases' first two steps on an H100. This tool traces
the same case with memplan (CUDA emulated on CPU, as benchmarks.op_transients does: the same recording and the
same estimate), lines its ops up with the GPU's step by step (difflib over op names) and prints every op after
which either side reserved more, with both sides' reserved and allocated bytes, so a segment memplan takes and
the GPU does not (or the reverse) shows at the op that took it.

    .venv/bin/python -m benchmarks.op_reserved CASE [CASE ...] [--all] [--raw DIR --device NAME]

prints; writes nothing. `--all`: every op, not only those where reserved grew. memplan's step 1 includes its
setup (parameters, batch), which it counts without aten ops; the GPU's step 0 is Lightning's setup.
`--raw DIR --device NAME`: another card's readings (DIR/CASE.json), traced for the catalog's NAME (the H200's:
--raw benchmarks/results/gpu_campaign_raw/ops --device H200). `--gpu-workspaces`: each convolution's cuDNN
workspace taken as the GPU read it (its step 2's transient of the same convolution) instead of memplan's rule
(memplan.estimator.cuda.conv_workspace), so what is left is the allocator model's and the ops' timing, not the
rule's sizes.
"""
from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import sys
from pathlib import Path

from benchmarks.op_transients import (
    _SAME_OP,
    DEVICE,
    RAW,
    MiB,
    _recording,
    estimate_emulated,
)

CONV, CONV_BACKWARD = "aten.convolution.default", "aten.convolution_backward.default"


def conv_key(op: str, args: list) -> tuple:
    """A convolution's identity, the same for a GPU reading's recorded args (benchmarks.gpu_ops._shapes: a tensor
    as [shape, dtype, contiguous]) and for the op's own args in a trace: the pass (a backward with the gradients
    it computes), the input's and weight's shapes, dtype, stride and padding."""
    def shape(a) -> tuple:
        return (tuple(a[0]), a[1]) if isinstance(a, list) else (tuple(a.shape), str(a.dtype).removeprefix("torch."))

    if op == CONV:
        return ("forward", shape(args[0]), shape(args[1]), tuple(args[3]), tuple(args[4]))
    return ("backward", shape(args[1]), shape(args[2]), tuple(args[4]), tuple(args[5]), tuple(args[10][:2]))


def measured_workspaces(gpu_rows: list[list]) -> dict[tuple, int]:
    """conv_key -> the transient (peak - max(before, after)) the GPU read around that convolution in step 2:
    a forward's cuDNN workspace; a backward's larger call's, past what its outputs hold."""
    return {conv_key(r[1], r[7]): max(0, r[4] - max(r[3], r[5])) for r in gpu_rows
            if r[0] == 2 and r[1] in (CONV, CONV_BACKWARD) and r[7]}


@contextlib.contextmanager
def gpu_workspaces(measured: dict[tuple, int]):
    """memplan's convolutions take the GPU's workspaces (`measured`, by conv_key): every cuDNN call of an op takes
    its reading (a backward's peak is then its weight call's, as read); one the readings lack keeps the rule's."""
    import torch

    from memplan.estimator.cuda.conv_workspace import ConvWorkspaces

    rule = ConvWorkspaces.calls

    def calls(self, func, args, out):
        held = rule(self, func, args, out)
        op = CONV if func is torch.ops.aten.convolution.default else CONV_BACKWARD
        nbytes = measured.get(conv_key(op, list(args))) if held else None
        return held if nbytes is None else [(tensor, nbytes) for tensor, _ in held]

    ConvWorkspaces.calls = calls
    try:
        yield
    finally:
        ConvWorkspaces.calls = rule


def trace_rows(name: str, device: str = DEVICE) -> list[list]:
    """memplan's rows [step, op, before, peak, after, shapes, reserved after] for both traced steps."""
    state, undo = _recording()
    try:
        estimate_emulated(name, device)
    finally:
        undo()
    return state["rows"]


SAME_OP = {**_SAME_OP, "aten.cudnn_batch_norm.default": "aten.native_batch_norm.default",
           "aten.cudnn_batch_norm_backward.default": "aten.native_batch_norm_backward.default"}
"""GPU ops lined up with the op memplan's trace runs in their place: cuDNN attention (op_transients._SAME_OP) and
cuDNN batch norm, which a trace on CPU runs as native_batch_norm."""


def line_up(gpu_rows: list[list], mp_rows: list[list]) -> list[tuple[list | None, list | None]]:
    """Pairs (GPU row, memplan row), either None where the other side has an op with no counterpart."""
    matcher = difflib.SequenceMatcher(None, [SAME_OP.get(r[1], r[1]) for r in gpu_rows], [r[1] for r in mp_rows],
                                      autojunk=False)
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


def report(name: str, *, every_op: bool, raw: Path = RAW, device: str = DEVICE, workspaces: bool = False) -> None:
    gpu = json.loads((raw / f"{name}.json").read_text())["rows"]
    with gpu_workspaces(measured_workspaces(gpu)) if workspaces else contextlib.nullcontext():
        mp = trace_rows(name, device)
    g_start = max((r[6] for r in gpu if r[0] == 0), default=0)
    m_start = 0
    print(f"== {name}: GPU ({raw}, torch 2.11) reserved after its setup (step 0) {g_start / MiB:.1f} MiB, at the "
          f"end {gpu[-1][6] / MiB:.1f} MiB; memplan ({device}) at the end {mp[-1][6] / MiB:.1f} MiB"
          + (" (convolution workspaces: the GPU's readings)" if workspaces else ""))
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
    parser.add_argument("--raw", type=Path, default=RAW, help=f"the readings' folder (default {RAW})")
    parser.add_argument("--device", default=DEVICE, help=f"the catalog GPU to trace for (default {DEVICE})")
    parser.add_argument("--gpu-workspaces", action="store_true",
                        help="each convolution's cuDNN workspace as the GPU read it, not memplan's rule")
    args = parser.parse_args(argv)
    for name in args.cases:
        if not (args.raw / f"{name}.json").exists():
            parser.error(f"CASE {name!r} has no op readings in {args.raw}; pick one of "
                         + ", ".join(sorted(p.stem for p in args.raw.glob("*.json"))))
        report(name, every_op=args.all, raw=args.raw, device=args.device, workspaces=args.gpu_workspaces)
    return 0


if __name__ == "__main__":
    sys.exit(main())
