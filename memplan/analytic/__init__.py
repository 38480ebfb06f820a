"""memplan.analytic: a closed-form peak-memory estimate from a layer list.

The seeds' rule of thumb, 4 bytes x (3 x params + 2 x activations x batch), done right: count what
autograd really saves per layer type, the gradients in flight during backward, the optimizer state
and its step temporaries, and find the moment of the peak. It explains; `memplan.estimate`'s trace
of the real step decides.

    layers = [Dense(100), Activation("relu"), Dense(10)]
    analytic_estimate(layers, (1000,), batch_size=256, optimizer="adamw")
    model = build_model(layers, (1000,))                # the same model, for the trace
    memplan.estimate(model, make_batch(layers, (1000,), 256), loss=loss)
"""
from memplan.analytic.build import build_model, loss, make_batch
from memplan.analytic.estimate import analytic_estimate
from memplan.analytic.layers import (
    Activation, AttentionBlock, Conv2d, Dense, Dropout, Embedding, Flatten, Layer, Norm, Pool, Recurrent,
)
from memplan.analytic.result import AnalyticEstimate, LayerRow
from memplan.analytic.sequence import lstm_workspace_bytes

__all__ = [
    "Activation", "AnalyticEstimate", "AttentionBlock", "Conv2d", "Dense", "Dropout", "Embedding", "Flatten",
    "Layer", "LayerRow", "Norm", "Pool", "Recurrent", "analytic_estimate", "build_model", "loss",
    "lstm_workspace_bytes", "make_batch",
]
