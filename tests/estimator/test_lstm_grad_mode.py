"""oneDNN's LSTM layer (`mkldnn_rnn_layer`, CPU) acts by grad mode, not by the module's train flag: under grad mode it
returns a workspace for its backward and takes its scratch in other buffers; under torch.no_grad it makes no workspace
at all. A frozen LSTM encoder run under no_grad (a feature extractor, a teacher) was counted with the workspace (+94 %
on the model below), and the scratch probe ran every LSTM layer under no_grad (a trained 2-layer LSTM read 0.16 %
under). Estimates are held against a real Trainer.fit (memplan.truth)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from memplan.estimator.api import estimate
from memplan.estimator.kernels import probe as kernel_probe
from memplan.truth import measure_cpu_peak


class Tagger(nn.Module):
    """Token tagger: embedding, a 2-layer LSTM run as `mode` says, a linear head."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mode = mode
        self.embed = nn.Embedding(500, 32)
        self.rnn = nn.LSTM(32, 64, num_layers=2, batch_first=True)
        self.head = nn.Linear(64, 5)
        if mode == "frozen":
            self.rnn.requires_grad_(False)

    def forward(self, ids):
        x = self.embed(ids)
        if self.mode == "frozen":
            with torch.no_grad():
                out, _ = self.rnn(x)
        elif self.mode == "reentrant":  # its first forward runs under no_grad, the recomputation under grad mode
            out, _ = checkpoint(self.rnn, x, use_reentrant=True)
        else:
            out, _ = self.rnn(x)
        return self.head(out)


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 500, (4, 48), generator=g), torch.randint(0, 5, (4, 48), generator=g)


def _loss(model, batch):
    return F.cross_entropy(model(batch[0]).flatten(0, 1), batch[1].flatten())


@pytest.mark.parametrize("mode", ["trained", "frozen", "reentrant"])
def test_an_lstm_estimate_matches_a_real_fit_under_each_grad_mode(mode):
    truth = measure_cpu_peak(lambda: Tagger(mode), _batch, loss=_loss)
    est = estimate(lambda: Tagger(mode), _batch(), loss=_loss, device="cpu")
    assert abs(est.peak_allocated - truth) / truth < 0.0005, (est.peak_allocated, truth)


def _layer_call():
    """The second layer's `mkldnn_rnn_layer` call of a trained Tagger's forward: (op, args)."""
    calls = []

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.mkldnn_rnn_layer.default:
                calls.append((func, args))
            return func(*args, **(kwargs or {}))

    model = Tagger("trained")
    with Spy():
        model(_batch()[0])
    return calls[-1]


def _scratch_of_the_real_call(func, args) -> int:
    """The most the op held at once while it ran on the model's own tensors, less its outputs (profiler events)."""
    with kernel_probe.memory_profile() as prof:
        out = func(*args)
    live = peak = 0
    for event in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                        key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak - sum(t.untyped_storage().nbytes() for t in out if isinstance(t, torch.Tensor))


def test_the_probe_measures_an_lstm_layer_in_the_trace_s_grad_mode():
    """The probe's figure (on zeros) is the scratch the op takes on the model's own tensors in the same grad mode (the
    old probe, always under no_grad, read 354,136 B where the op under grad mode takes 362,040 B on an AVX2 EPYC)."""
    func, args = _layer_call()
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            probed = kernel_probe.KernelScratchProbe().scratch_bytes(func, args, {}, func(*args))
            assert probed == _scratch_of_the_real_call(func, args), grad
