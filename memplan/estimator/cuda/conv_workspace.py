"""cuDNN convolution workspaces: allocated through the caching allocator by each convolution call, freed at its end.

torch's cuDNN convolutions (aten/src/ATen/native/cudnn/Conv_v8.cpp, torch 2.11) ask the chosen engine for its
workspace size and allocate it with `c10::cuda::CUDACachingAllocator` for the call only: forward, backward data
(the input's gradient) and backward filter (the weight's gradient) each take their own, one after the other, so a
`convolution_backward` holds the larger of its two. The size depends on the engine cuDNN's heuristics pick
(torch.backends.cudnn.benchmark off, Lightning's default), which memplan cannot run; this is a rule fitted to
measurements instead (benchmarks/conv_workspace_fit.py; H100 sm90, cuDNN 9.19, torch 2.11+cu130, TF32 for convs
on; benchmarks/results/gpu_campaign_raw_h100/conv_grid.json: 747 convolutions of 25 shapes, 1-3 spatial dims).

On Hopper, for NCHW tensors, most engines transpose the input, the weight and the output to NHWC in the workspace:
the measured forward workspace is x + y + w (the three tensors' bytes) within 1 % on 115 of the general class's 207
forward measurements (some fp32 engines take x + w only, some fp16 ones up to 2.9 x), backward filter about
1.1 (x + dy + w) (split-K partial sums besides). Four geometry classes differ:

- depthwise (groups == input channels): torch's own depthwise kernels, or cuDNN engines with no workspace: 0;
- pointwise (1x1, stride 1, no padding, groups 1): the forward and backward data are a GEMM on NCHW as it is: 0;
- thin (at most 4 input channels per group, a kernel of at most 27 taps, stride 1: an image or audio stem):
  direct NCHW kernels, no forward workspace; backward filter as the general rule in half precision, none in fp32;
- general: the transposes.

Backward data takes the forward's transposes (dy, w, dx), by the same rule as the forward. Each coefficient is
the median over its class's measurements of workspace / (x + y + w), one for float32 and one for bfloat16/float16.
Backward filter in float32 (TF32) also sums split-K partial weight gradients: min(14 w, 7.5 MiB) more on the
general class (a ResNet's 128-channel 3x3 at 32 x 32, batch 8: 20.25 MiB measured, 8.56 MiB of transposes; with
the term the class's in-sample |error| is 0.10 of the measured workspace, 0.14 without). Held out, the term does
not help: the leave-one-shape-out median is 0.135 with it, 0.130 without, and ResNet-18's convolutions read op by op
in whole steps sum to 8-19 % more workspace than measured with it (1-2 % less without; conv_workspace_fit.txt, "in
situ"). It is kept because the steps' peaks, where one backward filter's workspace lands on the saved activations,
come closer with it on both GPUs (benchmarks/results/gpu_fidelity*.md: H200 resnet18-b16-sgd-momentum reserved
-5.98 -> -2.99 %, H100 resnet18-b8-ckpt-gpu -6.53 -> -0.50 %); it errs high. Where the rule is known to miss:
float32 forwards of some shapes take x + w only (the output written NCHW directly: ResNet-18's 64-channel 3x3
convolutions at batch 8 and 16, not at 32 and 64), a choice of cuDNN's heuristics that no geometry feature of the
grid separates; the rule takes x + y + w there.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

aten = torch.ops.aten

FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT = "forward", "backward_input", "backward_weight"
CLASSES = ("depthwise", "pointwise", "thin", "general")
HALF = (torch.bfloat16, torch.float16)

COEFFICIENTS: dict[tuple[str, str, str], float] = {
    # (class, FORWARD or BACKWARD_WEIGHT, "float32" or "half"): workspace / (x + y + w), the median over the
    # class's rows of conv_grid.json (benchmarks/conv_workspace_fit.py prints this table)
    ("depthwise", FORWARD, "float32"): 0.0, ("depthwise", FORWARD, "half"): 0.0,
    ("depthwise", BACKWARD_WEIGHT, "float32"): 0.0, ("depthwise", BACKWARD_WEIGHT, "half"): 0.0,
    ("pointwise", FORWARD, "float32"): 0.0, ("pointwise", FORWARD, "half"): 0.0,
    ("pointwise", BACKWARD_WEIGHT, "float32"): 1.034, ("pointwise", BACKWARD_WEIGHT, "half"): 1.002,
    ("thin", FORWARD, "float32"): 0.0, ("thin", FORWARD, "half"): 0.0,
    ("thin", BACKWARD_WEIGHT, "float32"): 0.0, ("thin", BACKWARD_WEIGHT, "half"): 1.088,
    ("general", FORWARD, "float32"): 1.0, ("general", FORWARD, "half"): 1.0,
    ("general", BACKWARD_WEIGHT, "float32"): 1.003, ("general", BACKWARD_WEIGHT, "half"): 1.080,
}
"""Workspace bytes per byte of (input + output + weight), by geometry class, pass and precision."""

SPLIT_K: dict[tuple[str, str], tuple[int, int]] = {
    # (class, "float32" or "half"): backward filter's split-K partial sums, (copies of the weight, cap in bytes),
    # fitted on conv_grid.json where they lower the cell's |error| by a tenth or more (conv_workspace_fit.py)
    ("general", "float32"): (14, 7680 * 1024),
}
"""Backward filter's extra workspace: min(copies * weight bytes, cap) (none where absent)."""


MEASURED_SM = (9, 0)
MEASURED_MAX_BYTES = 496 * 1024 * 1024
"""The largest workspace measured (a ResNet-50 stem's backward filter at batch 128, float32)."""


@dataclass(frozen=True, kw_only=True)
class ConvGeometry:
    """One convolution as cuDNN sees it: the three tensors' bytes and what picks the rule."""

    x_bytes: int
    """The input (forward) or its gradient (backward data)."""
    y_bytes: int
    """The output (forward) or its gradient (backward)."""
    w_bytes: int
    """The weight."""
    klass: str
    """One of CLASSES."""
    precision: str
    """'float32' or 'half' (bfloat16, float16); float64 uses float32's coefficients."""
    unmeasured: tuple[str, ...] = ()
    """Why this convolution is outside what the rule was fitted on (empty: inside)."""


def classify(x_shape, w_shape, *, stride, padding, dilation, transposed: bool, groups: int) -> str:
    """The geometry class (see the module docstring) of a convolution of input `x_shape`, weight `w_shape`."""
    c_in, kernel = x_shape[1], tuple(w_shape[2:])
    if groups > 1 and groups == c_in:
        return "depthwise"
    if (groups == 1 and not transposed and all(k == 1 for k in kernel) and all(s == 1 for s in stride)
            and all(p == 0 for p in padding)):
        return "pointwise"
    if c_in // groups <= 4 and math.prod(kernel) <= 27 and all(s == 1 for s in stride):
        return "thin"
    return "general"


def geometry(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, *, stride, padding, dilation, transposed: bool,
             groups: int) -> ConvGeometry:
    unmeasured = []
    if x.dtype not in (torch.float32, *HALF):
        unmeasured.append(f"dtype {str(x.dtype).removeprefix('torch.')}")
    if 1 < groups < x.shape[1]:
        unmeasured.append("grouped (not depthwise) convolution")
    if any(d != 1 for d in dilation):
        unmeasured.append("dilation")
    if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        unmeasured.append("channels_last input (no NCHW transposes: likely less)")
    klass = classify(x.shape, w.shape, stride=stride, padding=padding, dilation=dilation, transposed=transposed,
                     groups=groups)
    return ConvGeometry(x_bytes=x.numel() * x.element_size(), y_bytes=y.numel() * y.element_size(),
                        w_bytes=w.numel() * w.element_size(), klass=klass,
                        precision="half" if x.dtype in HALF else "float32", unmeasured=tuple(unmeasured))


def workspace_bytes(geom: ConvGeometry, what: str) -> int:
    """The workspace one cuDNN call (FORWARD, BACKWARD_INPUT or BACKWARD_WEIGHT) of this convolution takes."""
    rule = FORWARD if what == BACKWARD_INPUT else what  # backward data: the forward's transposes
    coefficient = COEFFICIENTS[(geom.klass, rule, geom.precision)]
    nbytes = int(coefficient * (geom.x_bytes + geom.y_bytes + geom.w_bytes))
    if what == BACKWARD_WEIGHT:
        nbytes += split_k_bytes(geom, SPLIT_K.get((geom.klass, geom.precision), (0, 0)))
    return nbytes


def split_k_bytes(geom: ConvGeometry, term: tuple[int, int]) -> int:
    """Backward filter's split-K partial weight gradients (summed at the end): min(copies * w, cap) bytes."""
    copies, cap = term
    return min(copies * geom.w_bytes, cap)


def op_geometry(func, args, out) -> tuple[ConvGeometry, tuple[str, ...]] | None:
    """The geometry of an aten.convolution / convolution_backward call (`out`: what it returned) and the cuDNN
    calls it makes; None for any other op."""
    if func is aten.convolution.default and len(args) >= 9:
        x, w, _bias, stride, padding, dilation, transposed, _out_pad, groups = args[:9]
        y, calls = out, (FORWARD,)
    elif func is aten.convolution_backward.default and len(args) >= 11:
        y, x, w, _bias, stride, padding, dilation, transposed, _out_pad, groups, mask = args[:11]
        calls = tuple(c for c, wanted in ((BACKWARD_INPUT, mask[0]), (BACKWARD_WEIGHT, mask[1])) if wanted)
    else:
        return None
    if not all(isinstance(t, torch.Tensor) for t in (x, w, y)) or x.dim() < 3:
        return None
    return geometry(x, w, y, stride=stride, padding=padding, dilation=dilation, transposed=transposed,
                    groups=groups), calls


class ConvWorkspaces:
    """The cuDNN workspace each convolution holds while it runs, on a CUDA target; and what the rule did not cover."""

    def __init__(self, compute_capability: tuple[int, int], *, benchmark: bool = False) -> None:
        self.compute_capability, self.benchmark = tuple(compute_capability), benchmark
        self.largest = 0
        """The largest workspace of the trace (bytes)."""
        self.unmeasured: set[str] = set()

    def calls(self, func, args, out) -> list[tuple[torch.Tensor, int]]:
        """Each cuDNN call `func` makes, in torch's order, as (the tensor it allocates, its workspace bytes): the
        call allocates its output first, then its workspace, and frees the workspace before the next call starts
        (cudnn_convolution_forward: the output, then the workspace; cudnn_convolution_backward: grad_input and its
        workspace, then grad_weight and its; ConvShared.cpp / Conv_v8.cpp, torch 2.11). [] for any other op."""
        found = op_geometry(func, args, out)
        if found is None:
            return []
        geom, calls = found
        self.unmeasured.update(geom.unmeasured)
        outputs = (out,) if func is aten.convolution.default else tuple(out[:2])
        held = []
        for call in calls:
            nbytes = workspace_bytes(geom, call)
            self.largest = max(self.largest, nbytes)
            tensor = outputs[0] if call in (FORWARD, BACKWARD_INPUT) else outputs[1]
            if isinstance(tensor, torch.Tensor):
                held.append((tensor, nbytes))
        return held

    def transient_bytes(self, func, args, out) -> int:
        """The largest workspace `func` holds while it runs (backward: the larger of its two calls')."""
        return max((nbytes for _, nbytes in self.calls(func, args, out)), default=0)

    def notes(self) -> list[str]:
        if not self.largest and not self.unmeasured:
            return []
        major, minor = self.compute_capability
        outside = sorted(self.unmeasured)
        if self.compute_capability != MEASURED_SM:
            outside.append(f"this GPU (sm{major}{minor})")
        if self.benchmark:
            outside.append("torch.backends.cudnn.benchmark=True (benchmarked algorithms may take more)")
        if self.largest > MEASURED_MAX_BYTES:
            outside.append(f"a workspace of {self.largest / (1 << 20):.0f} MiB (the largest measured: 496 MiB)")
        text = (f"cuDNN convolution workspaces modelled from sm90 / cuDNN 9 measurements (input + output + weight "
                f"bytes by geometry class; largest here {self.largest / (1 << 20):.1f} MiB)")
        if outside:
            text += "; outside the measured range: " + ", ".join(outside)
        return [text]
