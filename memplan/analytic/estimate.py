"""The closed-form estimate: walk the layer list through one Lightning training step.

Order (memplan/estimator/step.py): forward + loss, zero_grad(set_to_none=True), backward, optimizer
step. In a steady-state step the previous step's gradients and the optimizer state exist from the
start, so they are live through the forward; zero_grad frees the gradients just before backward.
The peak is the highest moment of that walk. CPU semantics throughout: the optimizers are torch's
for-loop (single-tensor) implementations, which CPU tensors default to. bf16-mixed is autocast as Lightning 2.5.5
and later run it, with the weight cache off (each use casts its own copy); an earlier Lightning caches casts, which
memplan.estimate follows and this closed form does not.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from math import prod

from memplan.analytic import rules, sequence
from memplan.analytic.layers import (
    Activation, AttentionBlock, Conv2d, Dense, Dropout, Embedding, Flatten, Layer, Norm, Pool, Recurrent,
    infer_shapes,
)
from memplan.analytic.result import OPTIMIZERS, ANALYTIC_PRECISIONS, AnalyticEstimate, LayerRow
from memplan.analytic.rules import F32, I64, Act, Backward
from memplan.analytic.tape import Buf, Tape


def parameter_sizes(layer: Layer, shape: tuple[int, ...]) -> tuple[list[int], int]:
    """Element counts of the layer's parameters in `module.parameters()` order, and its buffer bytes."""
    if isinstance(layer, Dense):
        return [layer.out_features * shape[-1]] + ([layer.out_features] if layer.bias else []), 0
    if isinstance(layer, Conv2d):
        weight = layer.out_channels * shape[0] * layer.kernel_size ** 2
        return [weight] + ([layer.out_channels] if layer.bias else []), 0
    if isinstance(layer, Norm):
        width = shape[0] if layer.kind == "batch" else shape[-1]
        buffers = 2 * width * F32 + I64 if layer.kind == "batch" else 0  # running stats, num_batches_tracked
        return [width, width], buffers
    if isinstance(layer, Embedding):
        return [layer.num_embeddings * layer.embedding_dim], 0
    if isinstance(layer, AttentionBlock):
        width, hidden = shape[-1], layer.mlp_ratio * shape[-1]
        return [width, width, 3 * width * width, 3 * width, width * width, width,
                width, width, hidden * width, hidden, width * hidden, width], 0
    if isinstance(layer, Recurrent):
        gates = (4 if layer.kind == "lstm" else 3) * layer.hidden_size
        sizes, in_f = [], shape[-1]
        for _ in range(layer.num_layers):
            sizes += [gates * in_f, gates * layer.hidden_size, gates, gates]
            in_f = layer.hidden_size
        return sizes, 0
    return [], 0


def _forward(tape: Tape, layer: Layer, x: Act, out_shape: tuple[int, ...], amp: bool) -> tuple[Act, Backward | None]:
    full_out = (x.shape[0], *out_shape)
    if isinstance(layer, Dense):
        return rules.linear(tape, x, x.shape[-1], layer.out_features, layer.bias, amp)
    if isinstance(layer, Conv2d):
        return rules.conv2d(tape, x, full_out, layer.kernel_size, layer.bias, amp)
    if isinstance(layer, Pool):
        return rules.pool(tape, x, layer.kind, full_out)
    if isinstance(layer, Norm):
        return rules.batch_norm(tape, x) if layer.kind == "batch" else rules.layer_norm(tape, x)
    if isinstance(layer, Dropout):
        return rules.dropout(tape, x, layer.p)
    if isinstance(layer, Activation):
        return rules.activation(tape, x, layer.kind)
    if isinstance(layer, Embedding):
        return rules.embedding(tape, x, layer.num_embeddings, layer.embedding_dim)
    if isinstance(layer, AttentionBlock):
        return sequence.attention_block(tape, x, layer.num_heads, layer.mlp_ratio, layer.dropout, amp)
    if isinstance(layer, Recurrent):
        rnn = sequence.lstm if layer.kind == "lstm" else sequence.gru
        return rnn(tape, x, layer.hidden_size, layer.num_layers, amp)
    if isinstance(layer, Flatten):
        return rules.flatten(tape, x)
    raise ValueError(f"not a memplan.analytic layer: {layer!r}")


def _optimizer_state_bytes(optimizer: str, sizes: list[int]) -> int:
    if optimizer in ("adam", "adamw"):  # exp_avg, exp_avg_sq, and a float32 step tensor per parameter
        return sum(2 * n * F32 + F32 for n in sizes)
    if optimizer == "sgd-momentum":
        return sum(n * F32 for n in sizes)
    return 0


def _optimizer_step(tape: Tape, optimizer: str, sizes: list[int]) -> None:
    """The for-loop step. SGD (with or without momentum) updates in place. Adam/AdamW compute
    `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)`: two parameter-sized temporaries
    at once, and `denom` lives on until the next parameter's replaces it."""
    if optimizer not in ("adam", "adamw"):
        return
    previous = None
    for n in sizes:
        root = tape.new(n * F32)
        denom = tape.new(n * F32)
        tape.drop(root, previous)
        previous = denom
    tape.drop(previous)


def _describe(layer: Layer) -> str:
    values = ", ".join(repr(getattr(layer, f.name)) for f in fields(layer))
    return f"{type(layer).__name__}({values})"


def _forward_pass(
    tape: Tape, layers: tuple[Layer, ...], shapes: list[tuple[int, ...]], x: Act, amp: bool, param_bytes: list[int]
) -> tuple[Act, list[Backward | None], list[LayerRow]]:
    """The layers one after the other, as nn.Sequential runs them; a row per layer for the explanation."""
    rows, backwards = [], []
    for index, (layer, out_shape) in enumerate(zip(layers, shapes[1:])):
        saved_before = tape.saved_bytes()
        out, backward = _forward(tape, layer, x, out_shape, amp)
        tape.drop(x.buf)  # nn.Sequential lets go of each input once the layer returns
        rows.append(LayerRow(
            name=f"{index}: {_describe(layer)}",
            parameter_bytes=param_bytes[index],
            output_bytes=out.nbytes,
            saved_bytes=tape.saved_bytes() - saved_before,
        ))
        backwards.append(backward)
        x = out
    return x, backwards, rows


def _backward_pass(tape: Tape, g: Buf | None, backwards: list[Backward | None]) -> None:
    """Layer backwards in reverse; the gradient stops at the first layer whose input needs none."""
    for backward in reversed(backwards):
        if g is None or backward is None:
            break
        g = backward(g)
    tape.drop(g)


def analytic_estimate(
    layers: Sequence[Layer],
    input_shape: tuple[int, ...],
    *,
    batch_size: int,
    optimizer: str = "adamw",
    precision: str = "32-true",
) -> AnalyticEstimate:
    """Peak memory of one steady-state Lightning training step of `build_model(layers, input_shape)`
    on CPU, with cross-entropy on the last layer's logits, from shape formulas alone."""
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int; got {batch_size!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}; got {optimizer!r}")
    if precision not in ANALYTIC_PRECISIONS:
        raise ValueError(
            f"precision must be one of {', '.join(ANALYTIC_PRECISIONS)} (the analytic model covers these); "
            f"got {precision!r}. Use memplan.estimate for the others"
        )
    layers = tuple(layers)
    shapes = infer_shapes(layers, input_shape)
    amp = precision == "bf16-mixed"
    sizes, param_bytes, buffer_bytes = [], [], 0
    for layer, shape in zip(layers, shapes):
        layer_sizes, layer_buffers = parameter_sizes(layer, shape)
        sizes += layer_sizes
        buffer_bytes += layer_buffers
        param_bytes.append(sum(layer_sizes) * F32 + layer_buffers)
    if not sizes:
        raise ValueError("layers have no parameters, so there is nothing to train: add a Dense, Conv2d, Norm, "
                         "Embedding, AttentionBlock or Recurrent layer")

    # a steady-state step starts with the weights, last step's gradients, the optimizer state, the batch
    tape = Tape()
    tape.new(sum(sizes) * F32 + buffer_bytes, "parameters")
    previous_grads = tape.new(sum(sizes) * F32, "gradients")
    tape.new(_optimizer_state_bytes(optimizer, sizes), "optimizer_state")
    ids = isinstance(layers[0], Embedding)
    inputs = tape.new(batch_size * prod(shapes[0]) * (I64 if ids else F32), "batch")
    tape.new(batch_size * prod(shapes[-1][:-1]) * I64, "batch")  # targets

    # forward + loss, on cross-entropy over logits.flatten(0, -2)
    x = Act(tape.ref(inputs), (batch_size, *shapes[0]), I64 if ids else F32, requires_grad=False)
    x, backwards, rows = _forward_pass(tape, layers, shapes, x, amp, param_bytes)
    logits = Act(x.buf, (x.numel // x.shape[-1], x.shape[-1]), x.itemsize, x.requires_grad)
    if not x.contiguous:  # the reshape copies
        logits.buf = tape.new(x.nbytes)
        tape.drop(x.buf)
    saved_before = tape.saved_bytes()
    (loss, total_weight), loss_backward = rules.cross_entropy(tape, logits, amp)
    rows.append(LayerRow(name="loss: cross_entropy", parameter_bytes=0, output_bytes=F32,
                         saved_bytes=tape.saved_bytes() - saved_before))
    saved_at_loss = tape.saved_bytes()
    tape.drop(logits.buf)  # the loss function returns

    # zero_grad(set_to_none=True), then backward
    tape.drop(previous_grads)
    tape.enter("backward")
    _backward_pass(tape, loss_backward(None), backwards)
    tape.drop(total_weight)

    tape.enter("optimizer")
    _optimizer_step(tape, optimizer, sizes)
    tape.drop(loss)

    peak = tape.peak
    return AnalyticEstimate(
        parameters=peak.parameters,
        gradients=peak.gradients,
        optimizer_state=peak.optimizer_state,
        activations=peak.activations,
        temporaries=peak.temporaries,
        batch=peak.batch,
        peak_bytes=peak.total,
        peak_phase=peak.phase,
        forward_peak_bytes=tape.phase_peaks["forward"],
        backward_peak_bytes=tape.phase_peaks["backward"],
        optimizer_peak_bytes=tape.phase_peaks["optimizer"],
        per_layer=tuple(rows),
        saved_at_loss_bytes=saved_at_loss,
        num_parameters=sum(sizes),
        rule_of_thumb_bytes=4 * (3 * sum(sizes) + 2 * batch_size * sum(prod(s) for s in shapes[1:])),
        batch_size=batch_size,
        optimizer=optimizer,
        precision=precision,
    )
