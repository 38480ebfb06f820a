"""benchmarks/gpu_rules.py's pooling cases (session 15, no reading yet): a channels_last input whose gradient comes
back NCHW-contiguous, as a CNN flattened into a linear head gives it. max_pool2d's and avg_pool2d's backwards copy it
into the input's layout (memplan/estimator/cuda/op_scratch.py, from source); adaptive pooling and reflection padding
have no CUDA rule yet: their readings say whether they copy too."""
from __future__ import annotations

POOLS = (  # (shape, dtype, op)
    ((32, 256, 56, 56), "float16", "max_pool2d"),
    ((32, 256, 56, 56), "float32", "avg_pool2d"),
    ((32, 256, 56, 56), "bfloat16", "adaptive_avg_pool2d"),
    ((32, 256, 56, 56), "float32", "adaptive_max_pool2d"),
    ((16, 128, 56, 56), "float32", "reflection_pad2d"),
)
RULED = ("pool2d", "reflection_pad2d")
"""Ops whose readings the cases keep (forwards too: a channels_last forward copies nothing)."""


def pool_case(spec, gpu) -> list[dict]:
    """One case run on `gpu` under gpu_rules' reading mode; its rows."""
    import torch
    import torch.nn.functional as F

    from benchmarks.gpu_rules import _reading_mode

    shape, dtype, op = spec
    pool = {"max_pool2d": lambda t: F.max_pool2d(t, 2), "avg_pool2d": lambda t: F.avg_pool2d(t, 2),
            "adaptive_avg_pool2d": lambda t: F.adaptive_avg_pool2d(t, 7),
            "adaptive_max_pool2d": lambda t: F.adaptive_max_pool2d(t, 7),
            "reflection_pad2d": lambda t: F.pad(t, (1, 1, 1, 1), mode="reflect")}[op]
    x = torch.randn(shape, device="cuda", dtype=getattr(torch, dtype)).contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    reading_mode = _reading_mode(True, gpu)
    with reading_mode:
        y = pool(x)
        y.backward(torch.ones(y.shape, device="cuda", dtype=y.dtype))  # NCHW-contiguous, as a flatten's gradient
    return [dict(row, case=f"{op} channels_last {list(shape)} {dtype}, NCHW gradient",
                 path="the gradient copied into the input's layout") for row in reading_mode.rows]
