"""Where a CUDA target's step is traced (memplan.estimator.trace_route): FSDP2 and a native trace stopped by an op
without a fake kernel go to the emulated trace, with a note.

This torch has no CUDA, so the native trace (fake CUDA tensors) cannot run here. "A machine with a GPU" is
simulated by making memplan.estimator.target choose the native trace; where a test needs that trace to run, a
stand-in raises the failure it met on an H200 (an op without a fake kernel, got here for real from a CPU trace
of a model calling such an op). What the stand-ins cannot show: that the native trace of nn.LSTM / nn.GRU fails
in exactly this way on every cuDNN, and that the emulated FSDP2 trace matches a multi-GPU run."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from memplan.demos import GPTLM
from memplan.estimator import api, target as target_module
from memplan.estimator.errors import EstimateError
from memplan.estimator.notes import FSDP_EMULATED, NATIVE_FALLBACK
from memplan.estimator.target import Target
from memplan.estimator.trace_route import fallback_after, trace_target

NATIVE = Target(name="NVIDIA H200", is_cuda=True, compute_capability=(9, 0), total_bytes=150_000_000_000,
                trace_device="cuda")
"""The H200 of the GPU campaign, traced on fake CUDA tensors (a machine with that GPU)."""
OP = "memplan_route_test.cuda_only.default"


@pytest.fixture
def cuda_only_op():
    """An op with a CPU kernel and autograd but no fake kernel, as `_cudnn_init_dropout_state` has none on CUDA."""
    lib = torch.library.Library("memplan_route_test", "FRAGMENT")
    lib.define("cuda_only(Tensor x) -> Tensor")
    lib.impl("cuda_only", lambda x: x * 2, "CPU")
    torch.library.register_autograd("memplan_route_test::cuda_only", lambda ctx, grad: grad * 2, lib=lib)
    yield torch.ops.memplan_route_test.cuda_only.default
    lib._destroy()


class _Calls(nn.Module):
    def __init__(self, op) -> None:
        super().__init__()
        self.op, self.linear = op, nn.Linear(32, 32)

    def forward(self, x):
        return self.op(self.linear(x)).sum()


def _failure_of(model: nn.Module, batch: torch.Tensor) -> EstimateError:
    with pytest.raises(EstimateError) as failed:
        api.estimate(model, batch, loss=lambda m, b: m(b), device="cpu")
    return failed.value


def test_a_native_trace_stopped_by_an_op_without_fake_kernel_goes_emulated_naming_the_op(cuda_only_op):
    failure = _failure_of(_Calls(cuda_only_op), torch.randn(4, 32))
    target, note = fallback_after(failure, NATIVE)
    assert target == replace(NATIVE, trace_device="cpu") and target.emulates_cuda
    assert note.code == NATIVE_FALLBACK and note.fields == {"op": OP} and note.startswith(f"{OP} has no fake kernel")


def test_other_failures_and_emulated_traces_stand(cuda_only_op):
    shape_mismatch = _failure_of(nn.Sequential(nn.Linear(8, 8)), torch.randn(4, 32))
    assert fallback_after(shape_mismatch, NATIVE) is None
    no_fake_kernel = _failure_of(_Calls(cuda_only_op), torch.randn(4, 32))
    assert fallback_after(no_fake_kernel, replace(NATIVE, trace_device="cpu")) is None  # already emulated: raise


def _on_a_gpu_machine(monkeypatch) -> None:
    """memplan.estimate chooses the native trace, as where torch has CUDA and a GPU and MEMPLAN_TRACE_ON_CPU=0."""
    monkeypatch.setattr(target_module, "_trace_device", lambda: "cuda")


def test_estimate_traces_again_emulated_when_the_native_trace_meets_an_op_without_fake_kernel(monkeypatch, cuda_only_op):
    failure = _failure_of(_Calls(cuda_only_op), torch.randn(4, 32))

    class NativeStandIn(api._Trace):
        """The native trace stops where the H200's stopped on nn.LSTM; the emulated one runs for real."""

        def __init__(self, model, batch, loss, optimizer, setting) -> None:
            self.native = setting.target.trace_device == "cuda"
            if self.native:
                self.notes = []
            else:
                super().__init__(model, batch, loss, optimizer, setting)

        def run(self) -> None:
            if self.native:
                raise failure
            super().run()

    def lstm_estimate():
        return api.estimate(nn.LSTM(32, 64, batch_first=True), torch.randn(4, 16, 32),
                            loss=lambda m, b: m(b)[0].float().sum(), precision="bf16-mixed", device="H100-80GB")

    emulated = lstm_estimate()  # what a machine without a GPU estimates
    _on_a_gpu_machine(monkeypatch)
    monkeypatch.setattr(api, "_Trace", NativeStandIn)
    fallen_back = lstm_estimate()  # raised the failure before
    assert fallen_back.peak_allocated == emulated.peak_allocated
    assert fallen_back.peak_reserved == emulated.peak_reserved
    fallback = [n for n in fallen_back.notes if getattr(n, "code", "") == NATIVE_FALLBACK]
    assert [n.fields["op"] for n in fallback] == [OP]
    assert [n for n in fallen_back.notes if n not in fallback] == list(emulated.notes)


def test_fsdp_is_traced_emulated_on_a_machine_with_a_gpu():
    routed, note = trace_target(NATIVE, "fsdp")
    assert routed == replace(NATIVE, trace_device="cpu") and note.code == FSDP_EMULATED
    for strategy in (None, "ddp"):
        assert trace_target(NATIVE, strategy) == (NATIVE, None)
    emulated = replace(NATIVE, trace_device="cpu")
    assert trace_target(emulated, "fsdp") == (emulated, None)  # a machine without a GPU: emulated anyway


def _fsdp_estimate():
    def tiny_gpt():
        torch.manual_seed(0)
        return GPTLM(vocab_size=515, context=64, d_model=64, n_layers=3, n_heads=4, dropout=0.0)

    return api.estimate(tiny_gpt, GPTLM.example_batch(tiny_gpt(), 4), optimizer="adamw", precision="bf16-mixed",
                        device="H100-80GB", strategy="fsdp", world_size=2)


def test_an_fsdp_estimate_on_a_machine_with_a_gpu_is_the_emulated_one_with_a_note(monkeypatch):
    emulated = _fsdp_estimate()
    _on_a_gpu_machine(monkeypatch)
    on_gpu_machine = _fsdp_estimate()  # failed: fake CUDA parameters on memplan's CPU mesh
    assert on_gpu_machine.peak_allocated == emulated.peak_allocated
    assert on_gpu_machine.peak_reserved == emulated.peak_reserved
    assert [getattr(n, "code", "") for n in on_gpu_machine.notes].count(FSDP_EMULATED) == 1
    assert [n for n in on_gpu_machine.notes if getattr(n, "code", "") != FSDP_EMULATED] == list(emulated.notes)


@pytest.mark.parametrize(("setting", "has_gpu", "traced_on"), [
    (None, True, "cpu"),  # a GPU machine traces emulated by default: the trace the H200's readings matched
    ("1", True, "cpu"),
    ("", True, "cpu"),  # set but empty: as unset
    ("0", True, "cuda"),  # the native trace, asked for
    ("0", False, "cpu"),  # no GPU here: emulated whatever the setting
    (None, False, "cpu"),
])
def test_cuda_targets_are_traced_emulated_unless_the_native_trace_is_asked_for(monkeypatch, setting, has_gpu,
                                                                                traced_on):
    if setting is None:
        monkeypatch.delenv(target_module.TRACE_ON_CPU_ENV, raising=False)
    else:
        monkeypatch.setenv(target_module.TRACE_ON_CPU_ENV, setting)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: has_gpu)
    assert target_module.resolve_target("H100-80GB").trace_device == traced_on


def test_a_trace_setting_other_than_0_or_1_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(target_module.TRACE_ON_CPU_ENV, "yes")
    with pytest.raises(ValueError, match=r"MEMPLAN_TRACE_ON_CPU='yes': set it to 1 .* or 0"):
        target_module.resolve_target("H100-80GB")
