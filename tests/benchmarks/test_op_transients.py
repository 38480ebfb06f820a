"""benchmarks.op_transients on CPU: memplan's per-op readings, lined up with a GPU profile's rows."""
from __future__ import annotations

import torch

from benchmarks.op_transients import _recording, by_class, compare, verdict
from tests.estimator.test_cuda_reductions import Head
from memplan.estimator import estimate

SUM = "aten.sum.dim_IntList"


def gpu_row(op: str, before: int, peak: int, after: int) -> list:
    return [2, op, True, before, peak, after, 0, None]


def mp_row(op: str, before: int, peak: int, after: int) -> list:
    return [2, op, before, peak, after, None]


def test_ops_are_lined_up_by_name_and_judged_by_their_transients():
    gpu = [gpu_row("aten.mm.default", 0, 10, 10), gpu_row(SUM, 10, 5010, 20), gpu_row("aten.sort.default", 20, 90, 40),
           gpu_row(SUM, 40, 8040, 50)]
    # memplan runs an extra op first, counts the first sum exactly, misses the sort, over-counts the last sum
    mine = [mp_row("aten.view.default", 0, 0, 0), mp_row("aten.mm.default", 0, 10, 10), mp_row(SUM, 10, 5010, 20),
            mp_row("aten.sort.default", 20, 40, 40), mp_row(SUM, 40, 9040, 50)]
    entries = compare(gpu, mine)
    assert [(e["op"], e["gpu"], e["memplan"], verdict(e)) for e in entries] == [
        (SUM, 4990, 4990, "match"), ("aten.sort.default", 50, 0, "missed"), (SUM, 7990, 8990, "over-counted")]
    classes = by_class(entries)
    assert classes[SUM]["counts"] == {"match": 1, "over-counted": 1}
    assert classes[SUM]["largest"]["over-counted"]["memplan"] == 8990


def test_an_op_one_side_runs_alone_is_reported_as_such():
    gpu = [gpu_row("aten._cudnn_rnn.default", 0, 100, 50)]
    mine = [mp_row("aten.mkldnn_rnn_layer.default", 0, 50, 50), mp_row(SUM, 50, 80, 60)]
    assert sorted(verdict(e) for e in compare(gpu, mine)) == ["gpu only", "memplan only"]




def test_memplan_is_read_around_each_op_as_the_gpu_was(monkeypatch):
    """The head's bias gradient (sum over [32, 64] tokens of 5000 logits) holds the H100's 81,920,512 bytes of
    staging inside the op in memplan's trace, as lstm-b32's did on the GPU; rows are the steady-state step's."""
    monkeypatch.setenv("MEMPLAN_TRACE_ON_CPU", "1")
    state, undo = _recording()
    try:
        estimate(Head, torch.randint(0, 5000, (32, 64)), loss=lambda m, b: m(b)[..., 0].mean(), optimizer="sgd",
                 device="H100-80GB")
    finally:
        undo()
    sums = [r for r in state["rows"] if r[0] == 2 and r[1] == SUM and r[5] is not None]
    assert [r[3] - max(r[2], r[4]) for r in sums] == [81_920_512]
    assert sums[0][5][0] == [[2048, 5000], "float32", True]  # F.linear's addmm on the flattened tokens


def _transients(build, batch, op: str, **kwargs) -> list[int]:
    """memplan's transient inside each `op` of the steady-state step, on an emulated H100."""
    state, undo = _recording()
    try:
        estimate(build, batch, device="H100-80GB", **kwargs)
    finally:
        undo()
    return [r[3] - max(r[2], r[4]) for r in state["rows"] if r[0] == 2 and r[1] == op]


class Gather(torch.nn.Module):
    """Two gathers per token from 1024 rows (mixtral-moe-b4's routing): the backward of `hidden[index]` is an
    index_put with accumulate over 2048 int64 indices."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(256, 256)

    def forward(self, x):
        index = torch.arange(2048, device=x.device) % 1024
        return self.proj(x)[index].square().mean()


def test_an_index_puts_sort_buffers_are_held_inside_it_as_on_the_h100(monkeypatch):
    monkeypatch.setenv("MEMPLAN_TRACE_ON_CPU", "1")
    held = _transients(Gather, torch.randn(1024, 256), "aten.index_put.default", loss=lambda m, b: m(b),
                       optimizer="sgd")
    assert held == [66_048]  # mixtral-moe-b4's reading for 2048 indices


class TokensLstm(torch.nn.Module):
    """lstm-b32's embedding and LSTM: [64, 32] token ids transposed to batch-first, so the embedding's backward copies
    its [32, 64, 128] gradient and the ids before launching."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(5000, 128)
        self.lstm = torch.nn.LSTM(128, 256, num_layers=2, batch_first=True, dropout=0.1)

    def forward(self, ids):
        out, _ = self.lstm(self.embed(ids.t()))
        return out.square().mean()


def test_an_embedding_backwards_two_copies_are_two_requests(monkeypatch):
    """lstm-b32 / gru-b32 on the H100: 1,048,576 + 16,384 = 1,064,960 B inside embedding_dense_backward. As one
    request of their sum (over 1 MiB: the large pool) memplan's allocator took a cached 2 MiB block whole."""
    monkeypatch.setenv("MEMPLAN_TRACE_ON_CPU", "1")
    held = _transients(TokensLstm, torch.randint(0, 5000, (64, 32)), "aten.embedding_dense_backward.default",
                       loss=lambda m, b: m(b), optimizer="adam")
    assert held == [1_064_960]


def test_the_gpus_cudnn_attention_stands_where_memplan_runs_flash():
    flash = "aten._scaled_dot_product_flash_attention_backward.default"
    gpu = [gpu_row("aten._scaled_dot_product_cudnn_attention_backward.default", 0, 1_065_472, 0)]
    entries = compare(gpu, [mp_row(flash, 0, 1_064_960, 0)])
    assert [(e["op"], verdict(e)) for e in entries] == [(flash + " (GPU: cuDNN)", "match")]
