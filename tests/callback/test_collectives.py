"""memplan.callback.collectives.gather_rows: every rank's row of numbers on every rank. A single process's reading
makes no device round trip: on a GPU one (a tensor copied to the device and read back) waits for every kernel
queued before it, which is what MemoryPlanner's readings cost on one H100 (benchmarks/results/callback_gpu_h100.md)."""
from __future__ import annotations

import torch

from memplan.callback.adjust import RankStatus, gather_statuses
from memplan.callback.collectives import gather_rows
from memplan.hardware.readings import MemoryReading


class RecordingStrategy:
    """A strategy whose all-gather is recorded: `world_size` copies of the row (what the ranks would send,
    all the same here), on the root device."""

    root_device = torch.device("cpu")

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.gathered: list[torch.Tensor] = []

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        self.gathered.append(tensor)
        return torch.stack([tensor] * self.world_size)


def test_one_process_gets_its_row_back_as_a_gather_would_without_a_gather_through_the_device():
    """The row a gather gives back (float64 holds every byte count exactly, None is -1): the same status, and for
    one process the strategy's all-gather (a device round trip on a GPU) is not called."""
    status = RankStatus(rank=0, reading=MemoryReading(process_bytes=(1 << 40) + 12345, device_total_bytes=80 * 2**30),
                        micro_batch_size=8, gradient_checkpointing=True, oom_retries=2, oom_micro_batch_size=16)
    one, two = RecordingStrategy(1), RecordingStrategy(2)
    assert gather_statuses(one, status, 1) == (status,)
    assert one.gathered == []
    assert gather_statuses(two, status, 2) == (status, status)  # several ranks: through the strategy, on its device
    (sent,) = two.gathered
    assert sent.dtype == torch.float64 and sent.device == two.root_device
    assert gather_rows(one, [0, 1.5, -1], 1) == [[0.0, 1.5, -1.0]]
