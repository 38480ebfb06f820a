"""cuDNN RNNs on an emulated CUDA target (memplan.estimator.cuda.rnn): nn.LSTM / nn.GRU take `_cudnn_rnn`, which
saves cuDNN's reserve and the flat weight buffer, and the rule's sizes give the bytes an H100 read per op."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan.estimator.allocator import CachingAllocatorModel
from memplan.estimator.cuda.rnn import (
    GRU,
    LSTM,
    CudnnRnnBuffers,
    RnnShape,
    allocation_steps,
    dropout_state_bytes,
    reserve_bytes,
    workspace_bytes,
)
from memplan.estimator.cuda.semantics import emulate_cuda
from memplan.estimator.cuda.workspaces import LibraryWorkspaces
from memplan.estimator.fake import new_fake_mode
from memplan.estimator.tracker import StorageTracker
from memplan.hardware.catalog import streaming_multiprocessors

aten = torch.ops.aten
H100 = (9, 0)


def _block(nbytes: int) -> int:
    """The caching allocator's request size: rounded up to 512 bytes."""
    return -(-nbytes // 512) * 512


def _new_bytes(outputs, known=()) -> int:
    """Block bytes of the distinct storages among `outputs` not already in `known` (as the tracker counts them)."""
    seen, total = {id(s) for s in known}, 0
    for t in outputs:
        storage = t.untyped_storage()
        if id(storage) not in seen and storage.nbytes():
            seen.add(id(storage))
            total += _block(storage.nbytes())
    return total


def _new_and_held(steps, known=()) -> tuple[int, int]:
    """Walk an op's `allocation_steps` as the caching allocator counts them: (block bytes it leaves allocated, the
    most it held above that while it ran)."""
    seen, live, peak, held = {id(s) for s in known}, 0, 0, []
    for kind, value in steps:
        if kind == "track" and id(value.untyped_storage()) not in seen and value.untyped_storage().nbytes():
            seen.add(id(value.untyped_storage()))
            live += _block(value.untyped_storage().nbytes())
        elif kind == "hold":
            held.append(_block(value))
            live += held[-1]
        elif kind == "drop":
            live -= sum(held.pop() for _ in range(value))
        peak = max(peak, live)
    return live, peak - live


# Measured on an H100 (benchmarks/results/gpu_campaign_raw_h100/ops/lstm-b32.json, gru-b32.json, step 2): the
# zoo's rnn_lm, input [32, 64, 128] float32 batch-first, 2 layers, hidden 256, dropout 0.1. "new": after - before;
# "held": peak - after (what the op held only while it ran).
READINGS = {
    "lstm": dict(module=nn.LSTM, mode=LSTM, forward_new=25_362_944, forward_held=35_783_168,
                 backward_new=4_866_048, backward_held=35_914_240),
    "gru": dict(module=nn.GRU, mode=GRU, forward_new=29_491_712, forward_held=32_440_832,
                backward_new=3_878_912, backward_held=32_506_368),
}


@pytest.mark.parametrize("cell", sorted(READINGS))
def test_the_rule_gives_the_h100_readings_of_each_op_to_the_byte(cell):
    reading = READINGS[cell]
    with emulate_cuda(compute_capability=H100, autocast_dtype=None), FakeTensorMode(allow_non_fake_inputs=True):
        rnn = reading["module"](128, 256, num_layers=2, batch_first=True, dropout=0.1)
        weights = rnn._flat_weights
        x = torch.empty(32, 64, 128)
        hx = torch.zeros(2, 32, 256)
        cx = torch.zeros(2, 32, 256) if cell == "lstm" else None
        args = (x, weights, 4, weights[0].detach(), hx, cx, reading["mode"], 256, 0, 2, True, 0.1, True, False, [], None)
        out = aten._cudnn_rnn.default(*args)
        known = [w.untyped_storage() for w in weights]
        assert _new_bytes(out, known=known) == reading["forward_new"]
        assert _new_and_held(allocation_steps(aten._cudnn_rnn.default, args, out), known) == \
            (reading["forward_new"], reading["forward_held"])

        grad_output = torch.empty(32, 64, 256)  # the head's gradient, batch-first contiguous
        backward_args = (x, weights, 4, weights[0].detach(), hx, cx, out[0], grad_output, None, None,
                         reading["mode"], 256, 0, 2, True, 0.1, True, False, [], None, out[3], [True, True, True, True])
        dx, dhx, dcx, dw = aten._cudnn_rnn_backward.default(*backward_args)
        produced = [dx, dhx, *([dcx] if dcx is not None else []), *dw]
        assert _new_bytes(produced) == reading["backward_new"]
        steps = allocation_steps(aten._cudnn_rnn_backward.default, backward_args, (dx, dhx, dcx, dw))
        assert _new_and_held(steps) == (reading["backward_new"], reading["backward_held"])
    # _cudnn_init_dropout_state's step-1 reading, with the catalog's SM count of the board that read it
    assert dropout_state_bytes(streaming_multiprocessors("NVIDIA H100 80GB HBM3", H100)) == 19_071_488 - 12_583_424


def test_each_cudnn_rnn_call_takes_its_blocks_in_rnn_cpps_order(monkeypatch):
    """RNN.cpp (torch 2.11): `_cudnn_impl` makes the dropout state first; `_cudnn_rnn` allocates the input's seq-major
    copy, output, hy, cy, then the workspace and then the reserve, and frees the workspace and the copy at return (so
    with expandable segments the workspace's hole lies below the reserve). The backward: zeros for hy's and cy's
    undefined gradients; `_cudnn_rnn_backward_input`: the copies of input and gradient, dx, dhx, dcx, its workspace,
    freed; `_cudnn_rnn_backward_weight`: the input's copy, dw, its workspace, freed; the zeros freed last."""
    events, sizes = [], {}
    malloc, free = CachingAllocatorModel.malloc, CachingAllocatorModel.free

    def recording_malloc(self, nbytes, stream=0):
        sizes[handle := malloc(self, nbytes, stream)] = nbytes
        events.append(("malloc", nbytes))
        return handle

    def recording_free(self, handle):
        events.append(("free", sizes[handle]))
        return free(self, handle)

    monkeypatch.setattr(CachingAllocatorModel, "malloc", recording_malloc)
    monkeypatch.setattr(CachingAllocatorModel, "free", recording_free)
    fake_mode = new_fake_mode()
    tracker = StorageTracker(CachingAllocatorModel(), fake_mode, cpu_kernels=False)
    tracker.workspaces = LibraryWorkspaces(0, 0, rnn=CudnnRnnBuffers(sm_count=132))
    with emulate_cuda(compute_capability=H100, autocast_dtype=None), fake_mode:
        rnn = nn.LSTM(16, 32, num_layers=2, batch_first=True, dropout=0.1)
        weights = rnn._flat_weights
        x, hx, cx, grad_output = torch.empty(4, 5, 16), torch.zeros(2, 4, 32), torch.zeros(2, 4, 32), \
            torch.empty(4, 5, 32)  # the head's gradient, batch-first contiguous
        args = (x, weights, 4, weights[0].detach(), hx, cx, LSTM, 32, 0, 2, True, 0.1, True, False, [], None)
        with tracker:
            for t in (*weights, x, hx, cx, grad_output):  # on the device before the call
                tracker.track(t)
            events.clear()
            out = aten._cudnn_rnn.default(*args)  # all five kept: a dropped fake is freed
            forward = list(events)
            output, reserve, weight_buf = out[0], out[3], out[4]
            events.clear()
            grads = aten._cudnn_rnn_backward.default(
                x, weights, 4, weights[0].detach(), hx, cx, output, grad_output, None, None, LSTM, 32, 0, 2, True,
                0.1, True, False, [], None, reserve, [True, True, True, True])
            backward = list(events)
    dx, dw = grads[0], grads[3]
    tracker.stop()
    workspace = workspace_bytes(RnnShape(mode=LSTM, tokens=20, hidden=32, layers=2, directions=1, itemsize=4,
                                         dropout=True))
    state, copy, h = dropout_state_bytes(132), x.nbytes, hx.nbytes
    assert forward == [("malloc", state), ("malloc", copy), ("malloc", output.nbytes), ("malloc", h), ("malloc", h),
                       ("malloc", workspace), ("malloc", reserve.nbytes), ("free", workspace), ("free", copy)]
    assert weight_buf.untyped_storage()._cdata == weights[0].untyped_storage()._cdata  # no new weight buffer
    flat = dw[0].untyped_storage().nbytes()
    assert backward == [("malloc", h), ("malloc", h),  # zeros for hy's and cy's gradients
                        ("malloc", copy), ("malloc", grad_output.nbytes), ("malloc", dx.nbytes), ("malloc", h),
                        ("malloc", h), ("malloc", workspace), ("free", workspace), ("free", grad_output.nbytes),
                        ("free", copy),
                        ("malloc", copy), ("malloc", flat), ("malloc", workspace), ("free", workspace), ("free", copy),
                        ("free", h), ("free", h)]


def _small(module, **kwargs):
    return module(16, 32, num_layers=2, batch_first=True, dropout=0.1, **kwargs)


@pytest.mark.parametrize("module,mode,units", [(nn.LSTM, LSTM, 6), (nn.GRU, GRU, 7)])
def test_an_emulated_rnn_saves_cudnns_reserve_and_the_parameters_own_storage(module, mode, units):
    """batch 4, seq 5: 20 tokens; the reserve keeps `units` hidden-sized tensors per layer less the output, a
    dropout bit per inner-layer element and 512 bytes."""
    with emulate_cuda(compute_capability=H100, autocast_dtype=None), FakeTensorMode(allow_non_fake_inputs=True):
        rnn = _small(module)
        out, _ = rnn(torch.empty(4, 5, 16))
        node = out.grad_fn
        assert type(node).__name__ == "CudnnRnnBackward0"
        reserve = node._saved_result3
        assert reserve.dtype == torch.uint8
        expected = (units * 2 - 1) * 20 * 32 * 4 + 20 * 32 // 8 + 512
        assert reserve.numel() == expected == reserve_bytes(
            RnnShape(mode=mode, tokens=20, hidden=32, layers=2, directions=1, itemsize=4, dropout=True))
        # the flat weight buffer is the parameters' own storage (flattened when the module moved to the GPU)
        assert node._saved_result4.untyped_storage()._cdata == rnn.weight_ih_l0.untyped_storage()._cdata
        assert out.shape == (4, 5, 32) and out.transpose(0, 1).is_contiguous()  # cuDNN writes seq-major
        out.sum().backward()
        grads = [p.grad for p in rnn.parameters()]
        assert [g.shape for g in grads] == [p.shape for p in rnn.parameters()]
        assert len({g.untyped_storage()._cdata for g in grads}) == 1  # views of one flat weight gradient
        assert grads[0].untyped_storage().nbytes() == 4 * sum(p.numel() for p in rnn.parameters())
    # real CPU tensors keep the CPU path (no cuDNN to run them): the same values as outside the emulation
    torch.manual_seed(0)
    rnn, x = _small(module).eval(), torch.randn(4, 5, 16)
    expected, _ = rnn(x)
    with emulate_cuda(compute_capability=H100, autocast_dtype=None):
        real, _ = rnn(x)
    assert type(real.grad_fn).__name__ != "CudnnRnnBackward0"
    torch.testing.assert_close(real, expected)


def test_under_autocast_the_weights_are_cast_to_float16_and_flattened_per_call():
    """AutocastRNN.cpp casts to float16 even under bfloat16 autocast: the output is float16 and the saved flat
    buffer is a new float16 copy of every weight."""
    with emulate_cuda(compute_capability=H100, autocast_dtype=torch.bfloat16), \
            FakeTensorMode(allow_non_fake_inputs=True), torch.autocast("cpu", dtype=torch.bfloat16):
        rnn = _small(nn.LSTM)
        out, (hy, cy) = rnn(torch.empty(4, 5, 16))
        node = out.grad_fn
        flat = node._saved_result4
        assert out.dtype == hy.dtype == cy.dtype == torch.float16
        assert flat.dtype == torch.float16 and flat.numel() == sum(p.numel() for p in rnn.parameters())
        assert flat.untyped_storage()._cdata != rnn.weight_ih_l0.untyped_storage()._cdata
        assert node._saved_input.dtype == torch.float16
        out.float().sum().backward()
        assert rnn.weight_ih_l0.grad.dtype == torch.float32


@pytest.mark.parametrize("case,truth", [("lstm-b32", 260_877_312), ("gru-b32", 262_494_720)])
def test_the_zoo_rnn_language_models_estimate_within_1_percent_of_the_h200(case, truth):
    """torch.cuda.max_memory_allocated of the H200 campaign (benchmarks/results/gpu_campaign_raw/part1.json): the
    emulated estimate was 16 % over for the LSTM while its trace ran CPU's per-step cells."""
    from benchmarks.accuracy_gpu import all_cases
    from memplan.estimator.api import estimate

    c = all_cases()[case]
    est = estimate(c.build, c.make_batch(c.batch_size), loss=c.loss, optimizer=c.optimizer, precision=c.precision,
                   checkpointing=c.checkpointing, loop=c.loop, device="H200")
    assert abs(est.peak_allocated - truth) / truth < 0.01


def test_with_expandable_segments_the_lstm_steps_reserved_is_within_2_percent_of_the_h200(monkeypatch):
    """torch.cuda.max_memory_reserved of the H200's expandable-segments run (benchmarks/results/
    gpu_campaign_raw_expandable/part1.json, lstm-b32-adagrad): 352 MiB, one growing segment in which the forward's
    workspace, freed under the reserve the backward keeps, leaves a hole. Allocated the other way round (the reserve
    with the outputs, the workspace after it) the estimate read 296 MiB (-15.9 %)."""
    from benchmarks.accuracy_gpu import all_cases
    from memplan.estimator.api import estimate

    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    c, truth = all_cases()["lstm-b32-adagrad"], 369_098_752
    est = estimate(c.build, c.make_batch(c.batch_size), loss=c.loss, optimizer=c.optimizer, precision=c.precision,
                   checkpointing=c.checkpointing, loop=c.loop, device="H200")
    assert abs(est.peak_reserved - truth) / truth < 0.02


class _RawFeatureLstm(nn.Module):
    """A time-series LSTM on raw features: its input is the loader's batch itself, or (shift) a tensor the model
    computed from it."""

    def __init__(self, shift: bool) -> None:
        super().__init__()
        self.rnn = nn.LSTM(64, 128, num_layers=2, dropout=0.1, batch_first=True)
        self.zero = nn.Parameter(torch.zeros(()))
        self.head = nn.Linear(128, 1)
        self.shift = shift

    def forward(self, x):
        out, _ = self.rnn(x + self.zero if self.shift else x)
        return self.head(out[:, -1])


def test_an_rnn_fed_the_loaders_batch_takes_cudnns_path_like_one_fed_a_computed_tensor():
    """The loader's batch is a real tensor in the trace: an RNN reading it directly took CPU's per-step cells on a
    CUDA target (no reserve, no workspace, no dropout state), silently."""
    from memplan.estimator.api import estimate

    batch = (torch.randn(32, 64, 64), torch.randn(32, 1))

    def loss(model, b):
        return nn.functional.mse_loss(model(b[0]), b[1])

    raw, computed = (estimate(lambda shift=shift: _RawFeatureLstm(shift), batch, loss=loss, optimizer="adam",
                              device="H100-80GB") for shift in (False, True))
    assert raw.workspaces == computed.workspaces > dropout_state_bytes(132)
    assert raw.activations == computed.activations
    assert any(n.startswith("cuDNN RNN reserve, workspace and dropout state modelled") for n in raw.notes)


def test_the_notes_name_what_the_rnn_rules_were_not_measured_on():
    from memplan.estimator.api import estimate

    batch = (torch.randn(8, 16, 64), torch.randn(8, 1))

    class Bidirectional(_RawFeatureLstm):
        def __init__(self) -> None:
            super().__init__(shift=False)
            self.rnn = nn.GRU(64, 64, num_layers=2, batch_first=True, bidirectional=True)

    def loss(model, b):
        return nn.functional.mse_loss(model(b[0]), b[1])

    (note,) = (n for n in estimate(Bidirectional, batch, loss=loss, device="T4").notes if n.startswith("cuDNN RNN"))
    assert note.endswith("outside the measured range: this GPU (40 SMs; measured: 132), bidirectional")
