"""Fit memplan's cuDNN convolution workspace rule (memplan.estimator.cuda.conv_workspace) to the GPU campaign's
convolution grid, and say how well it generalises: leave-one-shape-out.

    python -m benchmarks.conv_workspace_fit [GRID_JSON] [--json]

GRID_JSON defaults to benchmarks/results/gpu_campaign_raw_h100/conv_grid.json (benchmarks.gpu_ops --conv-grid on
an H100). The rule: workspace = coefficient(class, pass, precision) * (input + output + weight bytes), the class
from the convolution's geometry (conv_workspace.classify), each coefficient the median of the measured ratio over
its class's rows (forward rows for FORWARD, 'backward weight only' rows for BACKWARD_WEIGHT; backward data takes
the forward's coefficient, and a 'backward input+weight' row is predicted as the larger of the two). Leave-one-
shape-out: each of the grid's shapes is predicted by coefficients fitted on the other shapes (a class left with
no rows takes the general class's coefficient); its error is sum |predicted - measured| / sum measured over the
shape's rows, and the error against the op's own peak (memory before it + its outputs + its workspace).
A backward-filter cell may also take a split-K term, min(copies * w, cap) on top (see _split_k), where it lowers
the cell's error by a tenth or more (float32's general class: 14 copies, 7.5 MiB).
In situ: the convolutions of the zoo steps read op by op on the same H100 (ops/<case>.json, step 2), each
predicted by memplan's rule from its recorded shapes against its measured transient (peak - max(before, after)),
and lined up with the grid's row of the same convolution (the grid measured each alone: within 1 MiB of the step's
reading, so the rule's misses in a step are the rule's, not the grid's).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from memplan.estimator.cuda.conv_workspace import (
    BACKWARD_INPUT, BACKWARD_WEIGHT, COEFFICIENTS, FORWARD, SPLIT_K, ConvGeometry, classify, split_k_bytes,
    workspace_bytes,
)

DEFAULT_GRID = Path(__file__).parent / "results" / "gpu_campaign_raw_h100" / "conv_grid.json"
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
_FIT_ROWS = {"forward": FORWARD, "backward weight only": BACKWARD_WEIGHT}


def shape_key(row: dict) -> tuple:
    return (row["source"], row["dims"], row["c_in"], row["c_out"], tuple(row["kernel"]), tuple(row["stride"]),
            tuple(row["padding"]), row["groups"], row["bias"], tuple(row["sample"]), row.get("transposed", False))


def row_geometry(row: dict, y_bytes: int) -> ConvGeometry:
    """The rule's geometry of one grid row (`y_bytes`: the convolution's output bytes, from its forward row)."""
    transposed, groups = row.get("transposed", False), row["groups"]
    w_shape = ([row["c_in"], row["c_out"] // groups] if transposed else [row["c_out"], row["c_in"] // groups])
    w_shape += row["kernel"]
    itemsize = _ITEMSIZE[row["dtype"]]
    klass = classify([row["batch"], *row["sample"]], w_shape, stride=row["stride"], padding=row["padding"],
                     dilation=[1] * row["dims"], transposed=transposed, groups=groups)
    return ConvGeometry(x_bytes=row["input_bytes"], y_bytes=y_bytes, w_bytes=math.prod(w_shape) * itemsize,
                        klass=klass, precision="float32" if row["dtype"] == "float32" else "half")


def load(path: Path) -> list[dict]:
    """The grid's rows, each with its geometry (`geom`) and the shape it belongs to (`shape`)."""
    rows = json.loads(path.read_text())["rows"]
    outputs = {(shape_key(r), r["batch"], r["dtype"]): r["output_bytes"] for r in rows if r["what"] == "forward"}
    for r in rows:
        r["shape"] = shape_key(r)
        r["geom"] = row_geometry(r, outputs[(r["shape"], r["batch"], r["dtype"])])
    return rows


_SPLIT_COPIES = range(0, 33)
_SPLIT_CAPS = [512 * 1024 * i for i in range(0, 65)]
"""The split-K grid searched: copies of the weight 0-32, caps 0-32 MiB by 0.5 MiB."""


def _split_k(cell_rows: list[dict]) -> tuple[int, int]:
    """A backward-filter cell's split-K term (copies, cap bytes): the one whose min(copies * w, cap) on top of the
    transposes (x + dy + w) leaves the least |error|; kept only where, with the coefficient then refitted, it
    lowers the cell's |error| by a tenth or more against the coefficient alone. (0, 0): none."""
    geoms = [(r["geom"], r["transient"]) for r in cell_rows]

    def error(term: tuple[int, int], coefficient: float) -> float:
        return sum(abs(int(coefficient * (g.x_bytes + g.y_bytes + g.w_bytes)) + split_k_bytes(g, term) - t)
                   for g, t in geoms)

    term = min(((c, k) for c in _SPLIT_COPIES for k in _SPLIT_CAPS), key=lambda ck: error(ck, 1.0))
    coefficient = statistics.median((t - split_k_bytes(g, term)) / (g.x_bytes + g.y_bytes + g.w_bytes)
                                    for g, t in geoms)
    alone = statistics.median(t / (g.x_bytes + g.y_bytes + g.w_bytes) for g, t in geoms)
    return term if term[0] and term[1] and error(term, coefficient) < 0.9 * error((0, 0), alone) else (0, 0)


def fit(rows: list[dict]) -> dict:
    """Each (class, pass, precision) cell's median measured workspace / (x + y + w) (net of a backward-filter cell's
    split-K term, under the key (class, precision), where one is fitted); cells without rows take the general
    class's."""
    cells: dict[tuple[str, str, str], list[dict]] = {}
    for r in rows:
        if r["what"] in _FIT_ROWS:
            g = r["geom"]
            cells.setdefault((g.klass, _FIT_ROWS[r["what"]], g.precision), []).append(r)
    table: dict = {}
    for (klass, what, precision), cell in cells.items():
        term = _split_k(cell) if what == BACKWARD_WEIGHT else (0, 0)
        if term[0]:
            table[(klass, precision)] = term
        table[(klass, what, precision)] = statistics.median(
            (r["transient"] - split_k_bytes(r["geom"], term))
            / (r["geom"].x_bytes + r["geom"].y_bytes + r["geom"].w_bytes) for r in cell)
    for klass, what, precision in COEFFICIENTS:
        table.setdefault((klass, what, precision), table.get(("general", what, precision), 1.0))
    return table


def coefficients(table: dict) -> dict[tuple[str, str, str], float]:
    """The coefficient cells of a fitted table."""
    return {k: v for k, v in table.items() if len(k) == 3}


def split_k(table: dict) -> dict[tuple[str, str], tuple[int, int]]:
    """The split-K cells of a fitted table."""
    return {k: v for k, v in table.items() if len(k) == 2}


def predict(row: dict, table: dict) -> int:
    g = row["geom"]
    saved, saved_split = dict(COEFFICIENTS), dict(SPLIT_K)
    COEFFICIENTS.update(coefficients(table))
    SPLIT_K.clear()
    SPLIT_K.update(split_k(table))
    try:
        if row["what"] == "forward":
            return workspace_bytes(g, FORWARD)
        if row["what"] == "backward weight only":
            return workspace_bytes(g, BACKWARD_WEIGHT)
        return max(workspace_bytes(g, BACKWARD_INPUT), workspace_bytes(g, BACKWARD_WEIGHT))
    finally:
        COEFFICIENTS.clear()
        COEFFICIENTS.update(saved)
        SPLIT_K.clear()
        SPLIT_K.update(saved_split)


def errors(rows: list[dict], table: dict) -> dict:
    measured = sum(r["transient"] for r in rows)
    predicted = [predict(r, table) for r in rows]
    of_peak = [abs(p - r["transient"]) / (r["after"] + max(p, r["transient"])) for p, r in zip(predicted, rows)]
    return {"rows": len(rows), "measured_MiB": round(measured / 2**20, 1),
            "predicted_MiB": round(sum(predicted) / 2**20, 1),
            "abs_error_of_workspace": round(sum(abs(p - r["transient"]) for p, r in zip(predicted, rows))
                                            / max(measured, 1), 3),
            "signed_error_of_workspace": round((sum(predicted) - measured) / max(measured, 1), 3),
            "median_abs_error_of_op_peak": round(statistics.median(of_peak), 4),
            "max_abs_error_of_op_peak": round(max(of_peak), 4)}


def leave_one_shape_out(rows: list[dict]) -> list[dict]:
    out = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        held = [r for r in rows if r["shape"] == shape]
        table = fit([r for r in rows if r["shape"] != shape])
        out.append({"shape": f"{shape[0]} {shape[2]}->{shape[3]} k{shape[4][0]} s{shape[5][0]} g{shape[7]}",
                    "class": held[0]["geom"].klass, **errors(held, table)})
    return out


def _grid_row(rows: list[dict], op: str, shapes: list) -> dict | None:
    """The grid's row of an op-by-op reading's convolution (same input, weight, stride, padding, dtype, pass)."""
    forward = op == "aten.convolution.default"
    x, w = (shapes[0], shapes[1]) if forward else (shapes[1], shapes[2])
    stride, padding = (shapes[3], shapes[4]) if forward else (shapes[4], shapes[5])
    what = "forward" if forward else ("backward input+weight" if shapes[10][0] else "backward weight only")
    return next((r for r in rows if (r["c_in"], r["c_out"], r["kernel"], r["stride"], r["padding"], r["batch"],
                                     r["sample"][1:], r["dtype"], r["what"])
                 == (x[0][1], w[0][0], w[0][2:], stride, padding, x[0][0], x[0][2:], x[1], what)), None)


def in_situ(ops_dir: Path, grid: list[dict]) -> list[dict]:
    """Per zoo case read op by op: its step-2 convolutions' measured and predicted workspaces (bytes), and the
    grid's measurement of the same convolution where the grid has it (in a step, as alone)."""
    import torch

    from memplan.estimator.cuda.conv_workspace import ConvWorkspaces
    from memplan.estimator.fake import new_fake_mode

    aten, out = torch.ops.aten, []
    for path in sorted(ops_dir.glob("*.json")):
        case = json.loads(path.read_text())
        ops = [r for r in case["rows"] if r[0] == 2 and r[1] in ("aten.convolution.default",
                                                                   "aten.convolution_backward.default")]
        if not ops:
            continue
        conv, measured, predicted, worst = ConvWorkspaces((9, 0)), 0, 0, 0.0
        in_grid = [(max(0, peak - max(before, after)), _grid_row(grid, op, shapes))
                   for _, op, _, before, peak, after, _, shapes in ops]
        in_grid = [(took, row["transient"]) for took, row in in_grid if row is not None]
        with new_fake_mode():
            for _, op, _, before, peak, after, _, shapes in ops:
                fake = [torch.empty(a[0], dtype=getattr(torch, a[1])) if isinstance(a, list) and len(a) == 3
                        and isinstance(a[1], str) else a for a in shapes]
                func = aten.convolution.default if op == "aten.convolution.default" else aten.convolution_backward.default
                result = func(*fake) if func is aten.convolution.default else None
                nbytes = conv.transient_bytes(func, fake, result)
                took = max(0, peak - max(before, after))
                measured, predicted = measured + took, predicted + nbytes
                worst = max(worst, abs(nbytes - took) / peak)
        out.append({"case": case["case"], "conv_ops": len(ops), "measured_MiB": round(measured / 2**20, 1),
                    "predicted_MiB": round(predicted / 2**20, 1), "worst_abs_error_of_op_peak": round(worst, 3),
                    "with_a_grid_row": len(in_grid), "grid_MiB": round(sum(g for _, g in in_grid) / 2**20, 1),
                    "worst_abs_diff_from_grid_MiB": round(max((abs(t - g) for t, g in in_grid), default=0) / 2**20, 2)})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("grid", nargs="?", type=Path, default=DEFAULT_GRID)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = parser.parse_args(argv)
    rows = load(args.grid)
    table = fit(rows)
    loso = leave_one_shape_out(rows)
    memplan = {**COEFFICIENTS, **SPLIT_K}
    result = {"coefficients": {" ".join(k): round(v, 3) for k, v in sorted(coefficients(table).items())},
              "split_k": {" ".join(k): {"copies": c, "cap_MiB": cap / 2**20} for k, (c, cap) in split_k(table).items()},
              "in_sample": errors(rows, table), "in_sample_with_memplan_coefficients": errors(rows, memplan),
              "leave_one_shape_out": loso,
              "loso_median_abs_error_of_workspace": statistics.median(s["abs_error_of_workspace"] for s in loso),
              "loso_median_op_peak_error": statistics.median(s["median_abs_error_of_op_peak"] for s in loso),
              "in_situ": in_situ(args.grid.parent / "ops", rows) if (args.grid.parent / "ops").is_dir() else []}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print("coefficients (class pass precision: workspace / (x + y + w)):")
    for k, v in result["coefficients"].items():
        print(f"  {k:40s} {v:6.3f}   memplan: {COEFFICIENTS[tuple(k.split())]:.3f}")
    print("backward filter's split-K term (class precision: min(copies * w, cap)):")
    for k, v in result["split_k"].items():
        copies, cap = SPLIT_K.get(tuple(k.split()), (0, 0))
        print(f"  {k:40s} {v['copies']} copies, cap {v['cap_MiB']:.1f} MiB   memplan: {copies} copies, cap "
              f"{cap / 2**20:.1f} MiB")
    print("in sample:", result["in_sample"])
    print("leave one shape out:")
    for s in loso:
        print(f"  {s['shape']:32s} {s['class']:9s} rows {s['rows']:3d}  measured {s['measured_MiB']:8.1f} MiB  "
              f"predicted {s['predicted_MiB']:8.1f}  |err|/ws {s['abs_error_of_workspace']:6.3f}  "
              f"signed {s['signed_error_of_workspace']:+6.3f}  op peak median {s['median_abs_error_of_op_peak']:.3f} "
              f"max {s['max_abs_error_of_op_peak']:.3f}")
    print(f"median over shapes: |err|/workspace {result['loso_median_abs_error_of_workspace']:.3f}, "
          f"op-peak error {result['loso_median_op_peak_error']:.4f}")
    print("in situ (zoo steps read op by op, step 2's convolutions):")
    for c in result["in_situ"]:
        print(f"  {c['case']:28s} {c['conv_ops']:3d} conv ops  measured {c['measured_MiB']:7.1f} MiB  predicted "
              f"{c['predicted_MiB']:7.1f}  worst |error| / op peak {c['worst_abs_error_of_op_peak']:.3f}  grid "
              f"{c['grid_MiB']:7.1f} MiB for {c['with_a_grid_row']} of them (worst |diff| "
              f"{c['worst_abs_diff_from_grid_MiB']:.2f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
