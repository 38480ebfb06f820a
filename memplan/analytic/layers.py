"""The layer list: what the analytic estimate reads and `build_model` turns into a real module.

Specs are frozen dataclasses that take positional arguments (`Dense(100)`, `Pool("max", 2)`), as torch's
modules do. Shapes are per sample (no batch dimension): (features,) for dense stacks, (channels, height, width)
for convolutions, (sequence, features) for sequence models, and (sequence,) token ids in front of an
Embedding. Every spec is frozen and checked when built, so a bad list fails at its definition.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Literal, Union


def _positive(owner: str, name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{owner}.{name} must be a positive int; got {value!r}")


def _choice(owner: str, name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{owner}.{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


def _probability(owner: str, name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value < 1.0:
        raise ValueError(f"{owner}.{name} must be a float in [0, 1); got {value!r}")


@dataclass(frozen=True)
class Dense:
    """nn.Linear on the last dimension."""

    out_features: int
    """Output features."""
    bias: bool = True
    """Whether the layer has a bias."""

    def __post_init__(self) -> None:
        _positive("Dense", "out_features", self.out_features)


@dataclass(frozen=True)
class Conv2d:
    """nn.Conv2d on a (channels, height, width) input."""

    out_channels: int
    """Output channels."""
    kernel_size: int
    """Square kernel side."""
    stride: int = 1
    """Stride in both spatial dimensions."""
    padding: int = 0
    """Zero padding on each side."""
    bias: bool = True
    """Whether the layer has a bias."""

    def __post_init__(self) -> None:
        for name in ("out_channels", "kernel_size", "stride"):
            _positive("Conv2d", name, getattr(self, name))
        if not isinstance(self.padding, int) or self.padding < 0:
            raise ValueError(f"Conv2d.padding must be a non-negative int; got {self.padding!r}")


@dataclass(frozen=True)
class Pool:
    """nn.MaxPool2d / nn.AvgPool2d on a (channels, height, width) input."""

    kind: Literal["max", "avg"]
    """'max' or 'avg'."""
    kernel_size: int
    """Square window side."""
    stride: int | None = None
    """Stride; None means kernel_size, as in torch."""

    def __post_init__(self) -> None:
        _choice("Pool", "kind", self.kind, ("max", "avg"))
        _positive("Pool", "kernel_size", self.kernel_size)
        if self.stride is not None:
            _positive("Pool", "stride", self.stride)


@dataclass(frozen=True)
class Norm:
    """BatchNorm over the first per-sample dimension (channels), or LayerNorm over the last."""

    kind: Literal["batch", "layer"]
    """'batch' (nn.BatchNorm1d / 2d) or 'layer' (nn.LayerNorm on the last dimension)."""

    def __post_init__(self) -> None:
        _choice("Norm", "kind", self.kind, ("batch", "layer"))


@dataclass(frozen=True)
class Dropout:
    """nn.Dropout."""

    p: float
    """Probability of zeroing an element, in [0, 1)."""

    def __post_init__(self) -> None:
        _probability("Dropout", "p", self.p)


@dataclass(frozen=True)
class Activation:
    """An elementwise activation module."""

    kind: Literal["relu", "gelu", "tanh", "sigmoid"]
    """'relu', 'gelu', 'tanh' or 'sigmoid'."""

    def __post_init__(self) -> None:
        _choice("Activation", "kind", self.kind, ("relu", "gelu", "tanh", "sigmoid"))


@dataclass(frozen=True)
class Embedding:
    """nn.Embedding; only as the first layer, on integer token ids."""

    num_embeddings: int
    """Vocabulary size."""
    embedding_dim: int
    """Width of each embedding vector."""

    def __post_init__(self) -> None:
        _positive("Embedding", "num_embeddings", self.num_embeddings)
        _positive("Embedding", "embedding_dim", self.embedding_dim)


@dataclass(frozen=True)
class AttentionBlock:
    """A pre-LN transformer block on (sequence, width): x + MHA(LN(x)), then x + MLP(LN(x)) with GELU.

    Attention runs through F.scaled_dot_product_attention; `dropout` is applied to each branch's
    output before its residual add (GPT-2's resid_pdrop), not inside attention.
    """

    num_heads: int
    """Attention heads; must divide the width."""
    mlp_ratio: int = 4
    """MLP hidden width as a multiple of the block width."""
    causal: bool = True
    """Causal (decoder) attention mask."""
    dropout: float = 0.0
    """Residual-branch dropout probability, in [0, 1)."""

    def __post_init__(self) -> None:
        _positive("AttentionBlock", "num_heads", self.num_heads)
        _positive("AttentionBlock", "mlp_ratio", self.mlp_ratio)
        _probability("AttentionBlock", "dropout", self.dropout)


@dataclass(frozen=True)
class Recurrent:
    """nn.LSTM / nn.GRU (batch_first) on (sequence, features); the output is the last layer's sequence."""

    kind: Literal["lstm", "gru"]
    """'lstm' or 'gru'."""
    hidden_size: int
    """Hidden (and output) width."""
    num_layers: int = 1
    """Stacked recurrent layers."""

    def __post_init__(self) -> None:
        _choice("Recurrent", "kind", self.kind, ("lstm", "gru"))
        _positive("Recurrent", "hidden_size", self.hidden_size)
        _positive("Recurrent", "num_layers", self.num_layers)


@dataclass(frozen=True)
class Flatten:
    """Flatten every per-sample dimension into one (a view, no memory)."""


Layer = Union[Dense, Conv2d, Pool, Norm, Dropout, Activation, Embedding, AttentionBlock, Recurrent, Flatten]
LAYER_TYPES: tuple[type, ...] = (
    Dense, Conv2d, Pool, Norm, Dropout, Activation, Embedding, AttentionBlock, Recurrent, Flatten,
)


def output_shape(layer: Layer, shape: tuple[int, ...], index: int) -> tuple[int, ...]:
    """Per-sample output shape of `layer` on a per-sample `shape`; ValueError when they do not fit.

    `index` is the layer's position in the list, used only in error messages.
    """
    where = f"layers[{index}] ({type(layer).__name__})"
    if isinstance(layer, Embedding):
        if index != 0:
            raise ValueError(f"{where}: Embedding must be the first layer (it reads integer token ids)")
        return (*shape, layer.embedding_dim)
    if not shape:
        raise ValueError(f"{where}: input has no feature dimension; give input_shape such as (features,)")
    if isinstance(layer, Dense):
        return (*shape[:-1], layer.out_features)
    if isinstance(layer, (Conv2d, Pool)):
        if len(shape) != 3:
            raise ValueError(f"{where} needs a (channels, height, width) input; got shape {shape}")
        channels, height, width = shape
        if isinstance(layer, Conv2d):
            kernel, stride, pad, channels = layer.kernel_size, layer.stride, layer.padding, layer.out_channels
        else:
            kernel, stride, pad = layer.kernel_size, layer.stride or layer.kernel_size, 0
        out_h = (height + 2 * pad - kernel) // stride + 1
        out_w = (width + 2 * pad - kernel) // stride + 1
        if out_h < 1 or out_w < 1:
            raise ValueError(f"{where}: kernel {kernel} does not fit the {height}x{width} input; pad it or shrink it")
        return (channels, out_h, out_w)
    if isinstance(layer, Norm):
        if layer.kind == "batch" and len(shape) > 3:
            raise ValueError(f"{where}: batch norm takes 1 to 3 per-sample dimensions; got shape {shape}")
        return shape
    if isinstance(layer, (AttentionBlock, Recurrent)):
        if len(shape) != 2:
            raise ValueError(f"{where} needs a (sequence, features) input; got shape {shape}")
        if isinstance(layer, Recurrent):
            return (shape[0], layer.hidden_size)
        if shape[1] % layer.num_heads:
            raise ValueError(
                f"{where}: num_heads={layer.num_heads} must divide the width {shape[1]}; pick a divisor"
            )
        return shape
    if isinstance(layer, Flatten):
        return (prod(shape),)
    if isinstance(layer, (Dropout, Activation)):
        return shape
    raise ValueError(f"{where}: not a memplan.analytic layer; use one of {', '.join(t.__name__ for t in LAYER_TYPES)}")


def infer_shapes(layers: tuple[Layer, ...] | list[Layer], input_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Per-sample shapes: [input_shape, after layer 0, after layer 1, ...]."""
    if not layers:
        raise ValueError("layers must name at least one layer, e.g. [Dense(out_features=10)]")
    shape = tuple(input_shape)
    if not all(isinstance(d, int) and d >= 1 for d in shape):
        raise ValueError(f"input_shape must be a tuple of positive ints (per sample); got {input_shape!r}")
    shapes = [shape]
    for index, layer in enumerate(layers):
        shape = output_shape(layer, shape, index)
        shapes.append(shape)
    if len(shapes[-1]) not in (1, 2):
        raise ValueError(
            f"the last layer must give logits of shape (classes,) or (sequence, classes) for cross-entropy; "
            f"got {shapes[-1]}: end the list with Flatten() and Dense(out_features=classes)"
        )
    return shapes
