"""Estimate vs real CPU run for the cases issue 10 item 6 fixed, and both loop orders.

    PYTHONPATH=<tree> python -m benchmarks.fixed_overcounts     # one line per case: estimate, truth, error %

Truth is memplan.truth.measure_cpu_peak (torch.profiler "Total Allocated" peak over
building the model and batch and 2 real steps), oneDNN off so that no in-kernel scratch is in it.
Bytes, not timings: the figures do not depend on the machine's load. Run it against an older tree to
get the "before" figures (its estimate() may lack loop=; the torch-order rows then estimate in
Lightning's order against a torch-order truth, which is what a plain-loop user got).
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn

from memplan.estimator.api import estimate
from memplan.truth import measure_cpu_peak


def transformer_encoder() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)


def transformer() -> nn.Module:
    torch.manual_seed(0)
    return nn.Transformer(64, 4, 2, 2, 128, dropout=0.0, batch_first=True)


class RecurrentLM(nn.Module):
    def __init__(self, cell: str):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(1000, 64)
        self.rnn = getattr(nn, cell)(64, 128, num_layers=2, batch_first=True)
        self.head = nn.Linear(128, 1000)

    def forward(self, tokens):
        return self.head(self.rnn(self.emb(tokens))[0])


class DeepBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(24))
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def seq_batch():
    return (torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(0)),)


def tokens():
    return torch.randint(0, 1000, (8, 32), generator=torch.Generator().manual_seed(0))


def regression_batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(16, 32, generator=g), torch.randn(16, 1, generator=g)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1000, 100), nn.ReLU(), nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 10))


def mlp_batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(256, 1000, generator=g), torch.randint(0, 10, (256,), generator=g)


def lm_loss(m, t):
    return F.cross_entropy(m(t).flatten(0, 1), t.flatten())


CASES = [  # name, build, make_batch, loss, options
    ("TransformerEncoder by callable", transformer_encoder, seq_batch, lambda m, b: m(b[0]).square().mean(), {}),
    ("Transformer by callable", transformer, seq_batch, lambda m, b: m(b[0], b[0]).square().mean(), {}),
    ("LSTM LM (head on the RNN output)", lambda: RecurrentLM("LSTM"), tokens, lm_loss, {}),
    ("GRU LM (head on the RNN output)", lambda: RecurrentLM("GRU"), tokens, lm_loss, {}),
    ("RNN LM (head on the RNN output)", lambda: RecurrentLM("RNN"), tokens, lm_loss, {}),
    ("24 checkpointed blocks, sgd", DeepBlocks, regression_batch, lambda m, b: F.mse_loss(m(b[0]), b[1]),
     dict(checkpointing=True, optimizer="sgd")),
    ("MLP, sgd, torch loop", mlp, mlp_batch, lambda m, b: F.cross_entropy(m(b[0]), b[1]),
     dict(optimizer="sgd", loop="torch")),
    ("MLP, adamw, torch loop", mlp, mlp_batch, lambda m, b: F.cross_entropy(m(b[0]), b[1]),
     dict(optimizer="adamw", loop="torch")),
]


def main() -> None:
    torch.backends.mkldnn.enabled = False
    has_loop = "loop" in inspect.signature(estimate).parameters
    for name, build, make_batch, loss, options in CASES:
        loop = options.pop("loop", "lightning") if not has_loop else options.get("loop", "lightning")
        est = estimate(build, make_batch(), loss=loss, device="cpu", **options)
        measure_options = {k: v for k, v in options.items() if k != "loop"}
        truth = measure_cpu_peak(build, make_batch, loss=loss, loop=loop, **measure_options)
        print(f"{name:40s} estimate {est.peak_allocated:>10d}  truth {truth:>10d}  "
              f"error {100 * (est.peak_allocated - truth) / truth:+.3f} %")


if __name__ == "__main__":
    main()
