"""Which stream an allocation is made on, as the caching allocator sees it.

The CUDA caching allocator caches a freed block for the stream it was allocated on (see
memplan.estimator.allocator), so the memory model needs the current stream of every allocation.
Code that runs work on side streams selects them with `torch.cuda.stream(s)`, or device-agnostically
with the device module's `stream(s)`: FSDP2 allocates its all-gather buffers under its all-gather
copy-in stream and the reduce-scatter outputs under its reduce-scatter stream
(torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py). A CUDA target traced on fake CPU tensors
runs that code with `torch.cpu`'s streams, whose current stream `torch.cpu.current_stream()` follows
`torch.cpu.stream(s)` just as the CUDA one does; a trace on fake CUDA tensors reads
`torch.cuda.current_stream()`.
"""
from __future__ import annotations

import torch

DEFAULT_STREAM = 0
"""The number of the default (compute) stream."""


class StreamNumbers:
    """Numbers the streams a trace allocates on: the default stream is 0, the others 1, 2, ... in
    the order they first allocate. The streams are held, so a number is never reused."""

    def __init__(self, device_type: str) -> None:
        if device_type == "cuda":
            self._current, default = torch.cuda.current_stream, torch.cuda.default_stream()
        else:
            self._current, default = torch.cpu.current_stream, torch.cpu.current_stream()
        self._numbers: dict[object, int] = {default: DEFAULT_STREAM}

    def current(self) -> int:
        """The number of the stream current now."""
        stream = self._current()
        number = self._numbers.get(stream)
        if number is None:
            number = self._numbers[stream] = len(self._numbers)
        return number


def side_stream_bytes(memory) -> int:
    """Reserved bytes an allocator model holds for streams other than the default one (reserved only
    grows: this is at the peak); 0 for a model without streams."""
    by_stream = getattr(memory, "reserved_by_stream", {})
    return sum(n for stream, n in by_stream.items() if stream != DEFAULT_STREAM)
