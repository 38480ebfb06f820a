"""benchmarks.op_reserved: memplan's reserved bytes against a GPU's op-by-op readings, op by op."""
from __future__ import annotations

from benchmarks.op_reserved import (
    CONV,
    CONV_BACKWARD,
    conv_key,
    growth,
    line_up,
    measured_workspaces,
)

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
    gpu = [gpu_row(MM, 20), gpu_row("aten.cudnn_convolution.default", 40), gpu_row(SUM, 40)]
    mine = [mp_row(MM, 20), mp_row("aten.native_layer_norm.default", 22), mp_row(SUM, 42)]
    entries = growth(line_up(gpu, mine), 0, 0)
    grew = {e["op"]: (e["gpu_grew"], e["memplan_grew"]) for e in entries}
    assert grew["aten.cudnn_convolution.default"] == (20, 0) and grew["aten.native_layer_norm.default"] == (0, 2)
    assert grew[SUM] == (0, 20)


def test_cudnn_batch_norm_on_the_gpu_lines_up_with_the_traces_native_batch_norm():
    """A trace on CPU runs native_batch_norm where the GPU ran cuDNN's: one row, both growths side by side."""
    gpu = [gpu_row(MM, 20), gpu_row("aten.cudnn_batch_norm.default", 40),
           gpu_row("aten.cudnn_batch_norm_backward.default", 60)]
    mine = [mp_row(MM, 20), mp_row("aten.native_batch_norm.default", 38),
            mp_row("aten.native_batch_norm_backward.default", 58)]
    pairs = line_up(gpu, mine)
    assert all(g is not None and m is not None for g, m in pairs)
    assert [(e["gpu_grew"], e["memplan_grew"]) for e in growth(pairs, 0, 0)] == [(20, 20), (20, 18), (20, 20)]


def conv_row(step: int, op: str, before: int, peak: int, after: int, shapes: list) -> list:
    return [step, op, True, before, peak, after, 0, shapes]


FORWARD_64 = [[[8, 64, 64, 64], "float32", True], [[64, 64, 3, 3], "float32", True], None, [1, 1], [1, 1], [1, 1],
              False, [0, 0], 1]
"""A ResNet-18 64-channel 3x3 forward at batch 8 as benchmarks.gpu_ops records its args."""


def test_each_convolutions_gpu_workspace_is_its_step_2_transient():
    backward = [[[8, 64, 64, 64], "float32", True], *FORWARD_64[:2], [0], [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                [True, True, False]]
    rows = [conv_row(1, CONV, 0, 99, 10, FORWARD_64),  # step 1: not read
            conv_row(2, CONV, 100, 180, 120, FORWARD_64), conv_row(2, "aten.mm.default", 0, 50, 0, None),
            conv_row(2, CONV_BACKWARD, 300, 350, 320, backward)]
    measured = measured_workspaces(rows)
    assert measured == {conv_key(CONV, FORWARD_64): 60, conv_key(CONV_BACKWARD, backward): 30}
    assert conv_key(CONV, FORWARD_64) == ("forward", ((8, 64, 64, 64), "float32"), ((64, 64, 3, 3), "float32"),
                                          (1, 1), (1, 1))


def test_a_traced_convolution_takes_the_h200s_reading_of_it_and_the_rule_elsewhere():
    """The H200 read 8,536,576 B of workspace (x + w) around ResNet-18's 64-channel forward at batch 8, where the
    rule takes x + y + w; substituted, the trace takes the GPU's, for that convolution only, and only inside."""
    import json

    import torch

    from benchmarks.op_reserved import gpu_workspaces
    from benchmarks.results_io import RESULTS
    from memplan.estimator.cuda.conv_workspace import ConvWorkspaces
    from memplan.estimator.fake import new_fake_mode

    readings = json.loads((RESULTS / "gpu_campaign_raw" / "ops" / "resnet18-b8.json").read_text())["rows"]
    conv, aten = ConvWorkspaces((9, 0)), torch.ops.aten
    with new_fake_mode():
        def forward_workspace(batch: int) -> int:
            x, w = torch.empty(batch, 64, 64, 64), torch.empty(64, 64, 3, 3)
            args = (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
            return conv.transient_bytes(aten.convolution.default, args, aten.convolution.default(*args))

        rule_b8, rule_b16 = forward_workspace(8), forward_workspace(16)
        with gpu_workspaces(measured_workspaces(readings)):
            read_b8, read_b16 = forward_workspace(8), forward_workspace(16)
        after = forward_workspace(8)
    assert rule_b8 == 2 * 8 * 64 * 64 * 64 * 4 + 64 * 64 * 9 * 4 and read_b8 == 8_536_576
    assert read_b16 == rule_b16 and after == rule_b8
