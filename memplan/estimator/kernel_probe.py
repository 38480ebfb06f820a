"""oneDNN's CPU convolution and LSTM scratch, measured by running the one op for real on this host.

A CPU convolution (forward or backward) takes buffers through c10's allocator while it runs: oneDNN's
scratchpad, weights and activations reordered into its blocked layouts, im2col columns of the slow
path, depthwise kernels' padded copies; an LSTM layer (`mkldnn_rnn_layer` and its backward) takes
oneDNN's RNN scratchpad (gates of one step, per-thread GEMM buffers) besides the workspace it returns.
Their size depends on the algorithm oneDNN picks for the shape, the ISA and the thread count, so no
rule predicts it; a fake tensor, which never runs a kernel, sees none of it (it was 64 % of a tiny
ConvNeXt's peak, 12 % of a ResNet's, 11 % of a 2-layer LSTM's).

So for a CPU target each distinct such op of the trace (op, shapes, strides, dtypes, arguments,
thread count) is run once on real zero tensors under the profiler, whose memory events give the most
the op had allocated at once; less its outputs (which the trace already counts) that is the op's
scratch, added to the trace as a transient. Results are cached per process. An op whose real
tensors would exceed PROBE_MAX_BYTES is not run (the estimate's notes say so), nor is any while a
profiler is already recording (profilers do not nest).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile

PROBE_MAX_BYTES = 512 << 20
"""Largest sum of a probed convolution's real inputs and outputs: above it the op is not run."""

_PROBED_OPS = frozenset({
    torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default,
    torch.ops.aten.mkldnn_rnn_layer.default, torch.ops.aten.mkldnn_rnn_layer_backward.default,
})
_CACHE: dict[tuple, int] = {}
"""Scratch bytes by convolution signature, for the life of the process."""


@dataclass(kw_only=True)
class KernelScratchProbe:
    """Measures and counts the scratch of the convolutions and LSTM layers one trace meets."""

    probed: set = field(default_factory=set)
    """Signatures whose scratch was measured (or found in the cache) in this trace."""
    skipped: set = field(default_factory=set)
    """Signatures not run: over PROBE_MAX_BYTES, or a profiler was already recording."""
    largest: int = 0
    """The largest scratch measured in this trace, bytes."""

    def scratch_bytes(self, func, args: tuple, kwargs: dict, out) -> int:
        """The real kernel's scratch for `func(*args, **kwargs)`, 0 for any op but a convolution or an LSTM layer."""
        if func not in _PROBED_OPS or kwargs:
            return 0
        key = (func, torch.get_num_threads(), *(_signature(a) for a in args))
        if key in _CACHE:
            self.probed.add(key)
            self.largest = max(self.largest, _CACHE[key])
            return _CACHE[key]
        tensors = [a for a in args if isinstance(a, torch.Tensor)] + _outputs(out)
        if sum(_nbytes(t) for t in tensors) > PROBE_MAX_BYTES or torch.autograd.profiler._is_profiler_enabled:
            self.skipped.add(key)
            return 0
        nbytes = _measure(func, args)
        _CACHE[key] = nbytes
        self.probed.add(key)
        self.largest = max(self.largest, nbytes)
        return nbytes

    def notes(self) -> list[str]:
        """What the estimate's notes say about kernel scratch (nothing when no probed op ran)."""
        out = []
        if self.probed:
            out.append(f"CPU convolutions/LSTMs: oneDNN's in-kernel scratch measured by running each of "
                       f"{len(self.probed)} op shapes once on this host, {torch.get_num_threads()} threads "
                       f"(largest {self.largest / 2**20:.2f} MiB)")
        if self.skipped:
            out.append(f"CPU convolutions/LSTMs: the scratch of {len(self.skipped)} op shapes is not counted "
                       f"(over {PROBE_MAX_BYTES >> 20} MiB to probe, or a profiler was recording)")
        return out


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


def _measure(func, args: tuple) -> int:
    """Run `func` on real zeros shaped like `args`; the most it had allocated at once, less its outputs."""
    real_args = tuple(_real(a) for a in args)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = func(*real_args)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return max(0, peak - sum(t.untyped_storage().nbytes() for t in _outputs(out)))
