"""`batch_spec` (the MemoryPlanner callback's init_args.suggest.batch_spec): a batch described by per-sample
shapes, dtypes and value ranges, for models whose datamodule memplan should not (or cannot) run.

    batch_spec:                                   # a dict batch: training_step gets batch["input"] ...
      input:  {shape: [1024], dtype: int64, high: 50257}
      target: {shape: [1024], dtype: int64, high: 50257}

    batch_spec:                                   # a tuple batch: x, y = batch
      - {shape: [3, 224, 224]}                    # dtype defaults to float32, values ~ N(0, 1)
      - {shape: [], dtype: int64, high: 1000}     # shape [] is one number per sample

A mapping whose keys are all tensor-spec keys (shape, dtype, low, high) and that has `shape` is one
tensor; other mappings and lists nest. Values are deterministic (seed 0).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from memplan.config.errors import ConfigError, did_you_mean

if TYPE_CHECKING:
    import torch

DTYPES: dict[str, str] = {
    "float32": "float32", "float": "float32", "float16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "float64": "float64", "double": "float64",
    "int64": "int64", "long": "int64", "int32": "int32", "int": "int32",
    "int16": "int16", "int8": "int8", "uint8": "uint8", "bool": "bool",
}
"""The dtype names a batch_spec takes, each with the torch dtype it names (torch.<name>): checked without torch."""
FLOATING = ("float32", "float16", "bfloat16", "float64")
_TENSOR_KEYS = frozenset({"shape", "dtype", "low", "high"})


class TensorSpecError(ValueError):
    """A tensor spec's bad field: `field` is its key ("shape", "dtype", "low", "high"); the message starts with it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    """One tensor of the batch, per sample (the batch dimension is added in front)."""

    shape: tuple[int, ...]
    """Per-sample shape, without the batch dimension; () for one number per sample."""
    dtype: str = "float32"
    """A torch dtype name: float32, float16, bfloat16, float64, int64, int32, int16, int8, uint8, bool."""
    low: float | None = None
    """Inclusive lower bound of the values (integers: default 0; floats: with high, uniform)."""
    high: float | None = None
    """Exclusive upper bound: required for integer dtypes (e.g. the vocabulary size); floats without
    bounds are N(0, 1)."""

    def __post_init__(self) -> None:
        if not isinstance(self.shape, tuple) or not all(_is_int(d) and d > 0 for d in self.shape):
            raise TensorSpecError("shape", "shape must be a list of positive ints (per sample, no batch "
                                  f"dimension); got {list(self.shape)!r}")
        name = self.dtype.removeprefix("torch.") if isinstance(self.dtype, str) else self.dtype
        if name not in DTYPES:
            raise TensorSpecError("dtype", f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        for bound in ("low", "high"):
            value = getattr(self, bound)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise TensorSpecError(bound, f"{bound} must be a number; got {value!r}")
        canonical = DTYPES[name]
        integer = canonical not in FLOATING and canonical != "bool"
        if integer and self.high is None:
            raise TensorSpecError("high", f"high is required for {name} tensors: the exclusive upper bound of the "
                                  "values (e.g. the vocabulary size or the number of classes)")
        if integer and not all(v is None or _is_int(v) for v in (self.low, self.high)):
            raise TensorSpecError("low", f"low and high must be ints for {name} tensors; got low={self.low!r}, "
                                  f"high={self.high!r}")
        if self.low is not None and self.high is not None and not self.low < self.high:
            raise TensorSpecError("low", f"low must be below high; got low={self.low!r}, high={self.high!r}")
        if canonical in FLOATING and (self.low is None) != (self.high is None):
            raise TensorSpecError("low", "low and high go together for floating-point tensors (uniform in "
                                  "[low, high)); give both, or neither for N(0, 1)")

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, DTYPES[self.dtype.removeprefix("torch.")])

    def make(self, batch_size: int, generator: torch.Generator) -> torch.Tensor:
        """A real tensor of shape (batch_size, *shape)."""
        import torch

        size = (batch_size, *self.shape)
        dtype = self.torch_dtype
        if dtype == torch.bool:
            return torch.randint(0, 2, size, generator=generator).bool()
        if not dtype.is_floating_point:
            return torch.randint(int(self.low or 0), int(self.high), size, generator=generator, dtype=dtype)
        if self.low is None:
            return torch.randn(size, generator=generator).to(dtype)
        return (torch.rand(size, generator=generator) * (self.high - self.low) + self.low).to(dtype)


@dataclass(frozen=True)
class BatchSpec:
    """A batch layout: a TensorSpec, or dicts / tuples of them, nested as the batch is."""

    layout: Any
    """TensorSpec, dict[str, layout] or tuple[layout, ...]."""

    def make(self, batch_size: int) -> Any:
        """A deterministic batch of real tensors with `batch_size` samples."""
        if not _is_int(batch_size) or batch_size < 1:
            raise ValueError(f"batch size must be a positive int; got {batch_size!r}")
        import torch

        generator = torch.Generator().manual_seed(0)

        def build(node: Any) -> Any:
            if isinstance(node, TensorSpec):
                return node.make(batch_size, generator)
            if isinstance(node, dict):
                return {k: build(v) for k, v in node.items()}
            return tuple(build(v) for v in node)

        return build(self.layout)


def parse_batch_spec(value: Any, key: str = "memplan.batch_spec") -> BatchSpec:
    """A BatchSpec from its YAML form; every error names the key at fault (`memplan.batch_spec.input.high`)."""
    layout = _parse(value, key)
    if isinstance(layout, (dict, tuple)) and not layout:
        raise ConfigError(key, f"{key} is empty; describe at least one tensor, e.g. "
                          "{shape: [1024], dtype: int64, high: 50257}")
    return BatchSpec(layout)


def _parse(value: Any, key: str) -> Any:
    if isinstance(value, Mapping) and _looks_like_tensor(value):
        unknown = sorted(set(value) - _TENSOR_KEYS)
        if unknown:
            raise ConfigError(f"{key}.{unknown[0]}", f"{key}: unknown keys {unknown} in a tensor spec; its keys are "
                              f"shape, dtype, low, high{did_you_mean(str(unknown[0]), _TENSOR_KEYS)}")
        shape = value["shape"]
        if not isinstance(shape, list):
            raise ConfigError(f"{key}.shape", f"{key}.shape must be a list of positive ints, e.g. [1024] or "
                              f"[3, 224, 224] ([] for one number per sample); got {shape!r}")
        try:
            return TensorSpec(shape=tuple(shape), **{k: v for k, v in value.items() if k != "shape"})
        except TensorSpecError as err:
            raise ConfigError(f"{key}.{err.field}", f"{key}.{err}") from None
    if isinstance(value, Mapping):
        return {str(k): _parse(v, f"{key}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return tuple(_parse(v, f"{key}[{i}]") for i, v in enumerate(value))
    raise ConfigError(key, f"{key} must be a tensor spec such as {{shape: [1024], dtype: int64, high: 50257}}, "
                      f"or a dict or list of them; got {value!r}")


def _looks_like_tensor(value: Mapping) -> bool:
    """A mapping with a `shape` that is not itself a batch layout (a dict batch may not use the key
    'shape' for a nested layout)."""
    shape = value.get("shape")
    return "shape" in value and not isinstance(shape, Mapping) and not (
        isinstance(shape, list) and any(isinstance(d, (Mapping, list)) for d in shape))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
