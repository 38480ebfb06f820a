"""Real modules from a layer list, so the closed form can be checked against the trace and real runs.

`build_model(layers, input_shape)` gives an nn.Sequential; `make_batch` gives a matching (inputs,
integer targets) pair; `loss(model, batch)` is cross-entropy on the last layer's logits. Together they
plug into `memplan.estimate(model, batch, loss=loss)`.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from memplan.analytic.layers import (
    Activation, AttentionBlock, Conv2d, Dense, Dropout, Embedding, Flatten, Layer, Norm, Pool, Recurrent,
    infer_shapes,
)

_ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid}


class TransformerBlock(nn.Module):
    """Pre-LN block: x + drop(proj(SDPA(qkv(LN(x))))), then x + drop(fc2(GELU(fc1(LN(x)))))."""

    def __init__(self, dim: int, spec: AttentionBlock) -> None:
        super().__init__()
        self.num_heads = spec.num_heads
        self.causal = spec.causal
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, spec.mlp_ratio * dim)
        self.fc2 = nn.Linear(spec.mlp_ratio * dim, dim)
        self.drop = nn.Dropout(spec.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        qkv = self.qkv(self.ln1(x)).view(batch, seq, 3, self.num_heads, dim // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.drop(self.proj(attn.transpose(1, 2).reshape(batch, seq, dim)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class RecurrentStack(nn.Module):
    """nn.LSTM / nn.GRU (batch_first), returning only the last layer's output sequence."""

    def __init__(self, in_features: int, spec: Recurrent) -> None:
        super().__init__()
        rnn = nn.LSTM if spec.kind == "lstm" else nn.GRU
        self.rnn = rnn(in_features, spec.hidden_size, num_layers=spec.num_layers, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


def _module(layer: Layer, shape: tuple[int, ...]) -> nn.Module:
    if isinstance(layer, Dense):
        return nn.Linear(shape[-1], layer.out_features, bias=layer.bias)
    if isinstance(layer, Conv2d):
        return nn.Conv2d(shape[0], layer.out_channels, layer.kernel_size, layer.stride, layer.padding, bias=layer.bias)
    if isinstance(layer, Pool):
        pool = nn.MaxPool2d if layer.kind == "max" else nn.AvgPool2d
        return pool(layer.kernel_size, layer.stride)
    if isinstance(layer, Norm):
        if layer.kind == "layer":
            return nn.LayerNorm(shape[-1])
        return nn.BatchNorm2d(shape[0]) if len(shape) == 3 else nn.BatchNorm1d(shape[0])
    if isinstance(layer, Dropout):
        return nn.Dropout(layer.p)
    if isinstance(layer, Activation):
        return _ACTIVATIONS[layer.kind]()
    if isinstance(layer, Embedding):
        return nn.Embedding(layer.num_embeddings, layer.embedding_dim)
    if isinstance(layer, AttentionBlock):
        return TransformerBlock(shape[-1], layer)
    if isinstance(layer, Recurrent):
        return RecurrentStack(shape[-1], layer)
    if isinstance(layer, Flatten):
        return nn.Flatten()
    raise ValueError(f"not a memplan.analytic layer: {layer!r}")


def build_model(layers: Sequence[Layer], input_shape: tuple[int, ...]) -> nn.Sequential:
    """An nn.Sequential of real modules for `layers`, in-features inferred from the per-sample `input_shape`.

    The model is in training mode with float32 parameters; Lightning's precision plugins (or
    `memplan.estimate(precision=...)`) apply mixed precision around it.
    """
    shapes = infer_shapes(layers, input_shape)
    return nn.Sequential(*(_module(layer, shape) for layer, shape in zip(layers, shapes)))


def make_batch(
    layers: Sequence[Layer],
    input_shape: tuple[int, ...],
    batch_size: int,
    num_classes: int | None = None,
    *,
    input_dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets): random inputs of (batch_size, *input_shape) and int64 class targets.

    Inputs are int64 token ids below the vocabulary when the first layer is an Embedding, else
    `input_dtype` values. Targets have the logits' shape without the class dimension.
    `num_classes` defaults to the last layer's width; when given it must match it.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int; got {batch_size!r}")
    shapes = infer_shapes(layers, input_shape)
    classes = shapes[-1][-1]
    if num_classes is not None and num_classes != classes:
        raise ValueError(
            f"num_classes={num_classes} does not match the last layer's width {classes}; "
            f"drop num_classes or end the list with Dense(out_features={num_classes})"
        )
    gen = torch.Generator().manual_seed(seed)
    if isinstance(layers[0], Embedding):
        inputs = torch.randint(0, layers[0].num_embeddings, (batch_size, *shapes[0]), generator=gen)
    else:
        inputs = torch.randn((batch_size, *shapes[0]), generator=gen).to(input_dtype)
    targets = torch.randint(0, classes, (batch_size, *shapes[-1][:-1]), generator=gen)
    return inputs, targets


def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy of the model's logits against the integer targets (tokens flattened)."""
    inputs, targets = batch
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())
