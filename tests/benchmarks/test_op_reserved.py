"""benchmarks.op_reserved: memplan's reserved bytes against a GPU's op-by-op readings, op by op."""
from __future__ import annotations

from benchmarks.op_reserved import growth, line_up

MM, SUM, VIEW = "aten.mm.default", "aten.sum.dim_IntList", "aten.view.default"


def gpu_row(op: str, reserved: int) -> list:
    return [1, op, True, 0, 0, 0, reserved, None]


def mp_row(op: str, reserved: int) -> list:
    return [1, op, 0, 0, 0, None, reserved]


def test_each_ops_reserved_growth_is_shown_on_both_sides_at_the_op_that_took_it():
    """The GPU takes a 20 MiB segment at the mm and 16 MiB at the sum; memplan takes 20 at the mm and 18 at the sum,
    after a view the GPU's readings lack: the sum's row shows both growths, the view's memplan's alone."""
    gpu = [gpu_row(MM, 20), gpu_row(SUM, 36)]
    mine = [mp_row(VIEW, 0), mp_row(MM, 20), mp_row(SUM, 38)]
    entries = growth(line_up(gpu, mine), 0, 0)
    assert [(e["op"], e["gpu_grew"], e["memplan_grew"]) for e in entries] == [(VIEW, 0, 0), (MM, 20, 20), (SUM, 16, 18)]
    assert entries[0]["gpu"] is None and entries[-1]["gpu_reserved"] == 36 and entries[-1]["memplan_reserved"] == 38


def test_an_op_one_side_lacks_carries_that_sides_reserved_over():
    gpu = [gpu_row(MM, 20), gpu_row("aten.cudnn_batch_norm.default", 40), gpu_row(SUM, 40)]
    mine = [mp_row(MM, 20), mp_row("aten.native_batch_norm.default", 22), mp_row(SUM, 42)]
    entries = growth(line_up(gpu, mine), 0, 0)
    grew = {e["op"]: (e["gpu_grew"], e["memplan_grew"]) for e in entries}
    assert grew["aten.cudnn_batch_norm.default"] == (20, 0) and grew["aten.native_batch_norm.default"] == (0, 2)
    assert grew[SUM] == (0, 20)
