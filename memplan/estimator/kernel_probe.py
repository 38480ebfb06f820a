"""oneDNN's CPU convolution, LSTM and half-precision matmul scratch, measured by running the one op
for real on this host.

A CPU convolution (forward or backward) takes buffers through c10's allocator while it runs: oneDNN's
scratchpad, weights and activations reordered into its blocked layouts, im2col columns of the slow
path, depthwise kernels' padded copies; an LSTM layer (`mkldnn_rnn_layer` and its backward) takes
oneDNN's RNN scratchpad (gates of one step, per-thread GEMM buffers) besides the workspace it returns;
a float16 or bfloat16 matmul (mm, addmm, bmm, baddbmm) takes its operands converted or packed for the
GEMM (0.87 MiB for a 256 x 512 x 512 float16 addmm on a 2-core AMX Xeon, 32 % of a small MLP's
16-true peak; float32 matmuls take none). Their size depends on the algorithm the library picks for
the shape, the ISA and the thread count, so no rule predicts it; a fake tensor, which never runs a kernel, sees none of it (it was 64 % of a tiny
ConvNeXt's peak, 12 % of a ResNet's, 11 % of a 2-layer LSTM's).

So for a CPU target each distinct such op of the trace (op, shapes, strides, dtypes, arguments,
thread count) is run once on real zero tensors under the profiler, whose memory events give the most
the op had allocated at once; less its outputs (which the trace already counts) that is the op's
scratch, added to the trace as a transient. Results are cached per process. An op whose real
tensors would exceed PROBE_MAX_BYTES, or a matmul of more than PROBE_MAX_FLOPS, is not run, nor is
any new shape once the trace has spent PROBE_BUDGET_S probing (on a CPU without fast half-precision
kernels a 4 GFLOP matmul takes over a second), nor any while a profiler is already recording
(profilers do not nest); the estimate's notes say how many shapes went uncounted.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile

PROBE_MAX_BYTES = 512 << 20
"""Largest sum of a probed op's real inputs and outputs: above it the op is not run."""
PROBE_MAX_FLOPS = 4 * 10**9
"""Largest matmul probed, in floating-point operations (2 per multiply-add: 2 x batch x M x N x K).
How long one takes depends on the CPU: 0.003-0.02 s with AMX or native fp16, over 1 s on AVX2."""
PROBE_BUDGET_S = 2.0
"""Seconds of probing one trace may spend on shapes not measured before; later ones are skipped."""

_PROBED_OPS = frozenset({
    torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default,
    torch.ops.aten.mkldnn_rnn_layer.default, torch.ops.aten.mkldnn_rnn_layer_backward.default,
})
_MATMULS = frozenset({
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default,
})
_HALF = frozenset({torch.float16, torch.bfloat16})
_CACHE: dict[tuple, int] = {}
"""Scratch bytes by convolution signature, for the life of the process."""


@dataclass(kw_only=True)
class KernelScratchProbe:
    """Measures and counts the scratch of the convolutions, LSTM layers and half-precision matmuls one
    trace meets."""

    probed: set = field(default_factory=set)
    """Signatures whose scratch was measured (or found in the cache) in this trace."""
    skipped: set = field(default_factory=set)
    """Signatures not run: over PROBE_MAX_BYTES or PROBE_MAX_FLOPS, past PROBE_BUDGET_S, or a profiler
    was already recording."""
    seconds: float = 0.0
    """Time this trace spent running probes."""
    largest: int = 0
    """The largest scratch measured in this trace, bytes."""

    def scratch_bytes(self, func, args: tuple, kwargs: dict, out) -> int:
        """The real kernel's scratch for `func(*args, **kwargs)`; 0 for an op that is not probed (all but
        convolutions, LSTM layers and float16/bfloat16 matmuls)."""
        half_matmul = _is_half_matmul(func, out)
        if not (func in _PROBED_OPS or half_matmul) or (kwargs and not half_matmul):
            return 0
        if any(isinstance(v, torch.Tensor) for v in kwargs.values()):
            return 0  # a matmul's keywords are scalars (beta, alpha); an out= tensor is not probed
        key = (func, torch.get_num_threads(), torch.backends.mkldnn.enabled, *(_signature(a) for a in args),
               *sorted(kwargs.items()))
        if key in _CACHE:
            self.probed.add(key)
            self.largest = max(self.largest, _CACHE[key])
            return _CACHE[key]
        tensors = [a for a in args if isinstance(a, torch.Tensor)] + _outputs(out)
        if (sum(_nbytes(t) for t in tensors) > PROBE_MAX_BYTES or _matmul_flops(func, args) > PROBE_MAX_FLOPS
                or self.seconds > PROBE_BUDGET_S or torch.autograd.profiler._is_profiler_enabled):
            self.skipped.add(key)
            return 0
        started = time.perf_counter()
        nbytes = _measure(func, args, kwargs)
        self.seconds += time.perf_counter() - started
        _CACHE[key] = nbytes
        self.probed.add(key)
        self.largest = max(self.largest, nbytes)
        return nbytes

    def notes(self) -> list[str]:
        """What the estimate's notes say about kernel scratch (nothing when no probed op ran)."""
        out = []
        if self.probed:
            out.append(f"CPU convolutions/LSTMs/half matmuls: in-kernel scratch measured by running each of "
                       f"{len(self.probed)} op shapes once on this host, {torch.get_num_threads()} threads "
                       f"(largest {self.largest / 2**20:.2f} MiB)")
        if self.skipped:
            out.append(f"CPU convolutions/LSTMs/half matmuls: the scratch of {len(self.skipped)} op shapes is "
                       f"not counted (over {PROBE_MAX_BYTES >> 20} MiB or {PROBE_MAX_FLOPS / 1e9:.0f} GFLOP to "
                       f"probe, past the trace's {PROBE_BUDGET_S:.0f} s of probing, or a profiler was recording)")
        return out


def _is_half_matmul(func, out) -> bool:
    return func in _MATMULS and isinstance(out, torch.Tensor) and out.dtype in _HALF


def _matmul_flops(func, args: tuple) -> int:
    """2 x the multiply-adds of a matmul (batch x M x N x K); 0 for any other op."""
    if func not in _MATMULS:
        return 0
    a, b = (args[1], args[2]) if func in (torch.ops.aten.addmm.default, torch.ops.aten.baddbmm.default) else args[:2]
    return 2 * a.numel() * b.shape[-1]


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


def _measure(func, args: tuple, kwargs: dict) -> int:
    """Run `func` on real zeros shaped like `args`; the most it had allocated at once, less its outputs."""
    real_args = tuple(_real(a) for a in args)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = func(*real_args, **kwargs)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return max(0, peak - sum(t.untyped_storage().nbytes() for t in _outputs(out)))
