"""CPU kernels' scratch, measured by running the one op for real on this host.

A fake tensor never runs a kernel, so it sees none of the buffers a CPU kernel takes through c10's
allocator while it runs:
- a convolution (forward or backward): oneDNN's scratchpad, weights and activations reordered into
  its blocked layouts, im2col columns of the slow path, depthwise kernels' padded copies (64 % of a
  tiny ConvNeXt's peak, 12 % of a ResNet's);
- an LSTM layer (`mkldnn_rnn_layer` and its backward): oneDNN's RNN scratchpad (gates of one step,
  per-thread GEMM buffers) besides the workspace it returns (11 % of a 2-layer LSTM's), other buffers under
  grad mode than without: each op is probed in the grad mode the trace ran it in;
- flash attention (forward and backward): per-thread blocks of scores and accumulators; torch.nn's native
  attention fast paths (a frozen MHA or encoder layer in eval mode): their q, k, v, scores and feed-forward;
- batch norm's backward: a buffer the size of its input (its forward: a few per-channel buffers);
- a float16 or bfloat16 matmul (mm, addmm, bmm, baddbmm): its operands converted or packed for the
  GEMM (0.87 MiB for a 256 x 512 x 512 float16 addmm on a 2-core AMX Xeon, 32 % of a small MLP's
  16-true peak; float32 matmuls take none), and the mean of a half-precision tensor, a float32 copy;
- linear algebra (qr, svd, eigh, solve, matrix_exp): LAPACK's work arrays, matrix_exp's Pade terms;
- softmax, log_softmax, their backwards, layer_norm, log_sigmoid and an erf gelu_backward given a non-contiguous
  input: a contiguous copy of it (MLP-Mixer's token mixing read 27 % under without it); pooling, padding and
  group norm given inputs in different layouts (channels_last and not): a copy of one in the other's layout;
- composites the trace sees as one op: masked_scatter's backward (a selection and zeros, concatenated) and
  binary_cross_entropy_with_logits (log_sigmoid with its buffer, the elementwise loss before the reduction);
- learnable fake quantization's backward (per-element scale and zero-point gradients, summed).
Their size depends on the algorithm the library picks for the shape, the ISA and the thread count,
so no rule predicts it.

So for a CPU target each distinct such op of the trace (op, shapes, strides, dtypes, arguments,
thread count) is run once on real zero tensors under the profiler, whose memory events give the most
the op had allocated at once; less its outputs (which the trace already counts) that is the op's
scratch, added to the trace as a transient. Results are cached per process. An op whose real
tensors would exceed PROBE_MAX_BYTES, or a matmul of more than PROBE_MAX_FLOPS, is not run, nor is
any while a profiler is already recording (profilers do not nest); the estimate's notes say how many
shapes went uncounted.

One trace probes at most PROBE_BUDGET_FLOPS and PROBE_BUDGET_BYTES of work, summed over its distinct
probed shapes in the order the trace meets them: a shape whose work would take either sum past its
budget is skipped, and so is any later sighting of it. The budget counts work, never time, and counts
a shape this process measured before as if it were new, so which shapes are counted is a function of
the trace alone: a busy or slow host, or an earlier estimate in the same process, gives the same
estimate (on a CPU without fast half-precision kernels a 4 GFLOP matmul takes over a second, so the
budget bounds that host's probing time too).
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile

from memplan.compat.torch import profiler_enabled
from memplan.estimator import known_values
from memplan.estimator.kernels.input_copies import copies_an_input
from memplan.estimator.kernels.losses import REDUCED_LOSSES

PROBE_MAX_BYTES = 512 << 20
"""Largest sum of a probed op's real inputs and outputs: above it the op is not run."""
PROBE_MAX_FLOPS = 4 * 10**9
"""Largest matmul probed, in floating-point operations (2 per multiply-add: 2 x batch x M x N x K).
How long one takes depends on the CPU: 0.003-0.02 s with AMX or native fp16, over 1 s on AVX2."""
PROBE_BUDGET_FLOPS = 256 * 10**9
"""Floating-point operations one trace's probes may run, summed over its distinct probed shapes (see
_flops: matmuls, attention, convolutions and LSTM layers; the other probed ops count as 0). The
benchmarks' largest is 83 GFLOP (the zoo's ResNet-18 at batch 16, its convolutions)."""
PROBE_BUDGET_BYTES = 8 << 30
"""Bytes of real tensors (inputs and outputs) one trace's probes may make, summed likewise."""

_ATTENTION = frozenset({
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
})
"""CPU flash attention keeps per-thread blocks of scores, sums and outputs (and in backward, gradient
accumulators) while it runs: 8.7 % of a small MultiheadAttention model's fp32 peak."""
_BATCH_NORMS = frozenset({torch.ops.aten.native_batch_norm.default, torch.ops.aten.native_batch_norm_backward.default})
"""CPU batch norm's backward takes a buffer the size of its input while it runs (its forward a few
per-channel buffers): a BatchNorm3d after a depthwise Conv3d peaks there (-14.9 % unprobed)."""
_MATRIX_EXP = torch.ops.aten.linalg_matrix_exp.default
_LINALG = frozenset({
    _MATRIX_EXP, torch.ops.aten.linalg_qr.default, torch.ops.aten._linalg_svd.default,
    torch.ops.aten._linalg_eigh.default, torch.ops.aten._linalg_solve_ex.default,
})
"""CPU linear algebra keeps buffers while it runs: LAPACK's work arrays and the copies it factors in place (a
shape's alone: zeros and random inputs take the same), and matrix_exp's Pade terms, whose number grows with the
input's 1-norm (4 x n^2 floats at norm 0 to 12 x at and above theta_18, where it scales and squares). The
trace does not know the values, so matrix_exp is probed at the worst case (_worst_case_input); the estimate's
notes say so. orthogonal parametrizations call it in every forward, and twice the size in the backward."""
_TRILINEAR = torch.ops.aten._trilinear.default
"""nn.Bilinear's op: its CPU kernel expands and multiplies its operands in steps, holding products up to 4 x the
weight (a backward call of nn.Bilinear(128, 128, 64) on 256 rows: 16.9 MB of scratch beside a 131 kB output)."""
_SELECTION_COPIES = frozenset({torch.ops.aten.kthvalue.default})
"""CPU kthvalue selects in a copy of its input (and an int64 index of its shape); median, topk and sort need none."""
_MASKED_SCATTER_BACKWARD = torch.ops.aten.masked_scatter_backward.default
"""masked_scatter's backward (one op to the trace) selects the gradient under the mask, makes zeros for the rest and
concatenates both: the selection and the zeros sit beside the output (-20.8 % on a model whose peak it is,
tests/estimator/test_probed_kernel_scratch.py). How much depends on the mask: with two or more threads and 32 Ki
elements or more, a selection of at least one element first writes two int64 prefix sums of the mask's shape, and
the selection holds one element per True: a zero mask takes 0.3 to 0.7 times what a mask half True takes, by dtype.
So the mask is probed with its values: the real ones where the trace has them (a mask computed from the batch: the
image-token mask of a multimodal model; a buffer's carried value), else a seeded stand-in, half True and laid out as
the mask is, as the value resolver answers a selection under a mask of an activation (memplan.estimator.values); the
notes say so."""
_MASK_STAND_IN = "masked_scatter's backward under a mask the trace has no values of"
_BCE_WITH_LOGITS = torch.ops.aten.binary_cross_entropy_with_logits.default
"""One op to the trace, a composite to the kernel (Loss.cpp): log_sigmoid(input) (on CPU with a buffer of the same
size while it runs), with pos_weight a weight of the input's size, then the elementwise loss beside it, before the
reduction: two to three times the logits (-1.6 % on a multi-label head whose peak it is)."""
_FAKE_QUANT_LEARNABLE = frozenset({
    torch.ops.aten._fake_quantize_learnable_per_tensor_affine_backward.default,
    torch.ops.aten._fake_quantize_learnable_per_channel_affine_backward.default,
})
"""Quantization-aware training's learnable fake quantization (LSQ): the CPU backward computes per-element gradients of
the scale and zero point at the input's size, then sums them (-14.3 % on a model whose peak it is)."""
_PROBED_OPS = frozenset({
    *_FAKE_QUANT_LEARNABLE, torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default,
    torch.ops.aten.mkldnn_rnn_layer.default, torch.ops.aten.mkldnn_rnn_layer_backward.default,
    *_ATTENTION, *_BATCH_NORMS, *_LINALG, _TRILINEAR, *_SELECTION_COPIES, _MASKED_SCATTER_BACKWARD, _BCE_WITH_LOGITS,
    torch.ops.aten._native_multi_head_attention.default, torch.ops.aten._transformer_encoder_layer_fwd.default,
    *REDUCED_LOSSES, torch.ops.aten.native_group_norm_backward.default})  # (group norm: its N x C sums)
_MATMULS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                      torch.ops.aten.baddbmm.default})
_HALF = frozenset({torch.float16, torch.bfloat16})
_CACHE: dict[tuple, int] = {}
"""Scratch bytes by op signature, for the life of the process."""


@dataclass(kw_only=True)
class KernelScratchProbe:
    """Measures and counts the scratch of the probed CPU kernels one trace meets (see the module doc)."""

    probed: set = field(default_factory=set)
    """Signatures whose scratch was measured (or found in the cache) in this trace."""
    skipped: set = field(default_factory=set)
    """Signatures not run: over PROBE_MAX_BYTES or PROBE_MAX_FLOPS, past the trace's work budget
    (PROBE_BUDGET_FLOPS, PROBE_BUDGET_BYTES), or a profiler was already recording."""
    failed: set = field(default_factory=set)
    """Signatures whose real run raised: their scratch is not counted."""
    flops: int = 0
    """Floating-point operations charged to this trace's budget (each distinct shape once, cached or not)."""
    nbytes: int = 0
    """Bytes of real tensors charged to this trace's budget, likewise."""
    largest: int = 0
    """The largest scratch measured in this trace, bytes."""
    stood_in: bool = False
    """Whether a masked_scatter backward was probed under a stand-in mask (_MASK_STAND_IN)."""

    def scratch_bytes(self, func, args: tuple, kwargs: dict, out) -> int:
        """The real kernel's scratch for `func(*args, **kwargs)`; 0 for an op that is not probed (all but
        convolutions, LSTM layers, CPU flash attention, _LINALG, _TRILINEAR, kthvalue, half matmuls, and the ops
        input_copies.copies_an_input names: half means, casting reductions, LAYOUT_OPS on a non-contiguous input)."""
        if not (func in _PROBED_OPS or _is_half_matmul(func, out) or copies_an_input(func, args)):
            return 0
        if "out" in kwargs:
            return 0  # an out= variant writes into a tensor the trace already counts
        mask = None
        if func is _MASKED_SCATTER_BACKWARD:
            mask = known_values.values_of(args[1])
            if mask is None:
                mask, self.stood_in = _stand_in_mask(args[1]), True
            args = (args[0], mask, *args[2:])
        grad = torch.is_grad_enabled()
        key = (func, torch.get_num_threads(), torch.backends.mkldnn.enabled, grad, *(_signature(a) for a in args),
               *sorted((k, _signature(v)) for k, v in kwargs.items()), None if mask is None else int(mask.sum()))
        if key in self.probed:
            return _CACHE[key]
        if key in self.skipped or key in self.failed:
            return 0
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)] + _outputs(out)
        nbytes, flops = sum(_nbytes(t) for t in tensors), _flops(func, args, out)
        if (nbytes > PROBE_MAX_BYTES or _forward_flops(func, flops) > PROBE_MAX_FLOPS
                or self.flops + flops > PROBE_BUDGET_FLOPS or self.nbytes + nbytes > PROBE_BUDGET_BYTES):
            self.skipped.add(key)
            return 0
        self.flops += flops  # charged whether or not the cache holds it: the budget depends on the trace alone
        self.nbytes += nbytes
        if key not in _CACHE:
            if profiler_enabled():
                self.skipped.add(key)
                return 0
            try:
                _CACHE[key] = _measure(func, args, kwargs, grad)
            except Exception:  # noqa: BLE001 - a probe that cannot run leaves the estimate as it is
                # The fake op's outputs may not be what the real kernel takes back (CPU's mixed-dtype
                # layer_norm keeps float32 mean/rstd where the meta kernel says bfloat16).
                self.failed.add(key)
                return 0
        self.probed.add(key)
        self.largest = max(self.largest, _CACHE[key])
        return _CACHE[key]

    def notes(self) -> list[str]:
        """What the estimate's notes say about kernel scratch (nothing when no probed op ran)."""
        out = []
        if self.probed:
            out.append(f"CPU kernel scratch (convolutions, LSTMs, attention, half matmuls, losses, ops copying a "
                       f"non-contiguous input): measured by running each of "
                       f"{len(self.probed)} op shapes once on this host, {torch.get_num_threads()} threads "
                       f"(largest {self.largest / 2**20:.2f} MiB)")
        if self.stood_in:
            out.append(f"{_MASK_STAND_IN} (computed from an activation, or a buffer over 64 Ki elements): its scratch "
                       "was measured under a random mask, half True; more True takes more (all True: +14 % for a "
                       "float32 gradient, +7 % bfloat16, +33 % float64), fewer less")
        if any(key[0] is _MATRIX_EXP for key in self.probed):
            out.append("matrix_exp's scratch is counted at its worst case (the input's 1-norm past theta_18); "
                       "a smaller norm takes as little as a third of it")
        if self.skipped:
            out.append(f"CPU kernel scratch: the scratch of {len(self.skipped)} op shapes is "
                       f"not counted (over {PROBE_MAX_BYTES >> 20} MiB or {PROBE_MAX_FLOPS / 1e9:.0f} GFLOP to "
                       f"probe, past the trace's probing budget of {PROBE_BUDGET_FLOPS / 1e9:.0f} GFLOP and "
                       f"{PROBE_BUDGET_BYTES >> 30} GiB, or a profiler was recording)")
        if self.failed:
            out.append(f"CPU kernel scratch: the scratch of {len(self.failed)} op shapes is not counted (the "
                       f"real kernel refused the traced arguments)")
        return out


def _is_half_matmul(func, out) -> bool:
    return func in _MATMULS and isinstance(out, torch.Tensor) and out.dtype in _HALF


def _forward_flops(func, flops: int) -> int:
    """The floating-point operations PROBE_MAX_FLOPS limits: a matmul's, or its forward's for attention;
    0 for the other ops (their bytes limit them)."""
    if func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
        return flops // 2
    return flops if func in _MATMULS or func in _ATTENTION or func in _LINALG or func is _TRILINEAR else 0


def _flops(func, args: tuple, out) -> int:
    """Floating-point operations of a probed op, 2 per multiply-add: a matmul (2 x batch x M x N x K),
    attention (4 x batch x heads x Lq x Lk x head dim forward), a convolution (2 x output elements x
    the weight's elements per output channel; the input's elements for a transposed one) and an LSTM
    layer (2 x steps x batch x both weight matrices), linear algebra (_LINALG: 40 x the matrices' n^3); a backward
    counts twice its forward (the gradients of the input and of the weights). 0 for the other probed ops, whose
    work is their bytes."""
    if func in _ATTENTION:
        forward = func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
        q, k = (args[0], args[1]) if forward else (args[1], args[2])
        return (1 if forward else 2) * 4 * q.numel() * k.shape[-2]
    if func in _MATMULS:
        a, b = (args[1], args[2]) if func in (torch.ops.aten.addmm.default, torch.ops.aten.baddbmm.default) \
            else args[:2]
        return 2 * a.numel() * b.shape[-1]
    if func is torch.ops.aten.convolution.default:
        input, weight, transposed = args[0], args[1], args[6]
        return 2 * (input.numel() if transposed else _outputs(out)[0].numel()) * weight[0].numel()
    if func is torch.ops.aten.convolution_backward.default:
        grad_output, input, weight, transposed = args[0], args[1], args[2], args[7]
        return 4 * (input.numel() if transposed else grad_output.numel()) * weight[0].numel()
    if func in (torch.ops.aten.mkldnn_rnn_layer.default, torch.ops.aten.mkldnn_rnn_layer_backward.default):
        input = args[0]
        weights = sum(w.numel() for w in args[1:3])
        forward = func is torch.ops.aten.mkldnn_rnn_layer.default
        return (1 if forward else 2) * 2 * (input.numel() // max(1, input.shape[-1])) * weights
    if func is _TRILINEAR:  # every index of the three operands, each expanded to the common rank, met once
        sizes = [_expanded(t, dims) for t, dims in zip(args[:3], args[3:6])]
        return 2 * math.prod(max(d) for d in zip(*sizes))
    if func in _LINALG:  # n^3 per matrix: about 20 matmuls' worth at matrix_exp's worst case (13th-order Pade,
        a = args[0]  # scaling and squaring), a bound for the factorizations (qr, svd, eigh, solve: 1-10 n^3)
        return 20 * 2 * a.numel() * a.shape[-1]
    return 0


def _expanded(t: torch.Tensor, dims: list[int]) -> list[int]:
    """`t`'s shape with a 1 inserted at each of `dims` (how _trilinear expands an operand)."""
    shape = list(t.shape)
    for d in sorted(dims):
        shape.insert(d, 1)
    return shape


def _stand_in_mask(mask: torch.Tensor) -> torch.Tensor:
    """Random values half True, seeded by the mask's shape (the same on every host and call), laid out as the mask is:
    its strides and broadcast dims (the CPU kernel's path depends on the mask's layout)."""
    generator = torch.Generator().manual_seed(zlib.crc32(repr(tuple(mask.shape)).encode()))
    base_shape = [1 if stride == 0 else size for size, stride in zip(mask.shape, mask.stride())]
    base = torch.empty_strided(base_shape, [stride or 1 for stride in mask.stride()], dtype=torch.bool)
    base.copy_(torch.rand(base_shape, generator=generator) < 0.5)
    return base.expand(tuple(mask.shape))


def _signature(value) -> object:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.stride(), value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    return value


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes() if t.device.type != "meta" else t.numel() * t.element_size()


def _outputs(out) -> list[torch.Tensor]:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [o for o in outs if isinstance(o, torch.Tensor)]


def _real(value):
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype).zero_()
    if isinstance(value, list):
        return [_real(v) for v in value]
    return value


def _measure(func, args: tuple, kwargs: dict, grad: bool = False) -> int:
    """Run `func` on real zeros shaped like `args` in grad mode `grad`; the most it held at once, less its outputs."""
    real_args = tuple(_real(a) for a in args)
    kwargs = {k: _real(v) for k, v in kwargs.items()}
    if func is _MATRIX_EXP:
        real_args = (_worst_case_input(real_args[0]), *real_args[1:])
    if func is _MASKED_SCATTER_BACKWARD:  # the mask's values (scratch_bytes chose them) decide the scratch
        real_args = (real_args[0], args[1], *real_args[2:])  # (read, never written)
    if func is torch.ops.aten.native_layer_norm_backward.default:
        # mean and rstd as the real forward makes them: CPU's mixed-dtype layer_norm keeps them in
        # float32 where the meta kernel says the input's dtype, and the real backward checks.
        _, input, shape, _, _, weight, bias, _ = real_args
        real_args = (*real_args[:3], *torch.ops.aten.native_layer_norm.default(input, shape, weight, bias, 1e-5)[1:],
                     *real_args[5:])
    with torch.set_grad_enabled(grad), memory_profile() as prof:
        out = func(*real_args, **kwargs)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return max(0, peak - sum(t.untyped_storage().nbytes() for t in _outputs(out)))


def _worst_case_input(a: torch.Tensor) -> torch.Tensor:
    """A matrix_exp input whose 1-norm (8 in every matrix) is past theta_18 for every dtype, so the kernel takes
    its largest path (degree 18 and squaring); more squarings take no more buffers."""
    return a.fill_(8.0 / max(1, a.shape[-1]))


@contextlib.contextmanager
def memory_profile() -> Iterator[profile]:
    """torch's profiler recording CPU memory events, with kineto's start and stop lines kept off the
    console: kineto writes them ("USDT: ... profiler_start") to the process's stderr from C++, a dozen
    lines in one planning. Only the start and the stop are silenced, not what runs in between."""
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _stderr_silenced():
        prof.start()
    try:
        yield prof
    finally:
        with _stderr_silenced():
            prof.stop()


@contextlib.contextmanager
def _stderr_silenced() -> Iterator[None]:
    """File descriptor 2 pointed at the null device for the block (C++ writes bypass sys.stderr)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no descriptor 2 (an embedded interpreter): nothing to do
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
