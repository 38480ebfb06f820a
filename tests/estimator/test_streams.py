"""The stream each allocation is made on reaches the caching allocator model, whose pools are per stream."""
from __future__ import annotations

import pytest
import torch

from memplan.estimator.allocator import CachingAllocatorModel
from memplan.estimator.api import estimate
from memplan.estimator.fake import new_fake_mode
from memplan.estimator.streams import StreamNumbers
from memplan.estimator.tracker import StorageTracker
from memplan.units import MiB


def test_streams_are_numbered_in_the_order_they_first_allocate():
    streams = StreamNumbers("cpu")
    first, second = torch.cpu.Stream(), torch.cpu.Stream()
    assert streams.current() == 0
    with torch.cpu.stream(second):
        assert streams.current() == 1
        with torch.cpu.stream(first):
            assert streams.current() == 2
        assert streams.current() == 1
    assert streams.current() == 0


def _side_then_default(streams: StreamNumbers | None) -> CachingAllocatorModel:
    """A 40 MiB tensor made and dropped on a side stream, then one of the same size on the default stream."""
    memory = CachingAllocatorModel()
    fake_mode = new_fake_mode()
    tracker = StorageTracker(memory, fake_mode, cpu_kernels=False)
    tracker.streams = streams
    side = torch.cpu.Stream()
    with fake_mode, tracker:
        with torch.cpu.stream(side):
            buffer = torch.empty(10 * MiB, dtype=torch.float32)
        del buffer
        kept = torch.empty(10 * MiB, dtype=torch.float32)
    tracker.stop()
    assert kept.numel() == 10 * MiB
    return memory


def test_the_tracker_allocates_on_the_current_stream_so_a_side_streams_block_is_not_reused():
    memory = _side_then_default(StreamNumbers("cpu"))
    assert memory.reserved_bytes == 80 * MiB  # the side stream's freed 40 MiB stays cached for it
    assert memory.reserved_by_stream == {1: 40 * MiB, 0: 40 * MiB}
    one_stream = _side_then_default(None)  # every allocation counted on the default stream
    assert one_stream.reserved_bytes == 40 * MiB
    assert one_stream.peak_allocated_bytes == memory.peak_allocated_bytes


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Stack(torch.nn.Module):
    def __init__(self, width: int = 256, depth: int = 4):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _fsdp_on_h100():
    batch = (torch.randn(8, 512, 256), torch.randn(8, 512, 256))
    return estimate(Stack, batch, loss=lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
                    optimizer="adamw", device="H100-80GB", strategy="fsdp", world_size=4)


@pytest.fixture(scope="module")
def fsdp_streams():
    return _fsdp_on_h100()


def test_fsdp2_side_streams_reserve_beside_the_default_stream_and_allocated_is_unchanged(fsdp_streams, monkeypatch):
    """FSDP2 all-gathers into buffers made on its copy-in stream and reduce-scatters into gradients made
    on its reduce-scatter stream; blocks those streams cache serve only them, so reserved memory is
    higher than if every block served every request, and allocated memory is the same."""
    class OneStream(StreamNumbers):
        def current(self) -> int:
            return 0

    monkeypatch.setattr("memplan.estimator.api.StreamNumbers", OneStream)
    one_stream = _fsdp_on_h100()
    assert fsdp_streams.peak_allocated == one_stream.peak_allocated
    assert fsdp_streams.peak_reserved > one_stream.peak_reserved
    assert 0 < fsdp_streams.side_stream_reserved < fsdp_streams.peak_reserved
    assert one_stream.side_stream_reserved == 0
    assert any("side streams (FSDP2's" in n for n in fsdp_streams.notes)
    assert not any("side streams" in n for n in one_stream.notes)
