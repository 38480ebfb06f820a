"""The CPU truth counts what is really allocated, whichever thread frees it."""
from __future__ import annotations

import threading

import torch
from torch.profiler import ProfilerActivity, profile

from memplan.truth.counting import _c10_count_flag, allocator_counts_every_thread, peak_total_allocated

MIB4 = 1 << 20  # float32 elements in 4 MiB


def _alloc_free_elsewhere_alloc_again() -> profile:
    """One 4 MiB tensor, freed by another thread (as gloo's workers free collective buffers), then a
    second 4 MiB tensor: never more than 4 MiB live at once."""
    holder: list[torch.Tensor] = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        holder.append(torch.empty(MIB4))
        thread = threading.Thread(target=holder.clear)
        thread.start()
        thread.join()
        second = torch.empty(MIB4)
        del second
    return prof


def test_a_tensor_freed_on_another_thread_leaves_the_measured_total():
    with allocator_counts_every_thread() as counting:
        prof = _alloc_free_elsewhere_alloc_again()
    assert counting
    assert peak_total_allocated(prof) == 4 * MIB4


def test_the_allocator_flag_is_set_back_after_measuring():
    flag = _c10_count_flag()
    assert flag is not None, "torch's libc10 no longer exports the flag the CPU truth relies on"
    before = flag.value
    with allocator_counts_every_thread():
        assert flag.value
    assert flag.value == before


def test_overlapping_measurements_keep_counting_until_the_last_ends():
    """Two threads' measurements may end in either order: the flag stays set while either runs and is
    set back once, to what it was before the first."""
    flag = _c10_count_flag()
    before = flag.value
    first, second = allocator_counts_every_thread(), allocator_counts_every_thread()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert flag.value  # the second measurement is still running
    second.__exit__(None, None, None)
    assert flag.value == before


def test_a_free_of_a_tensor_from_an_earlier_measurement_is_not_this_runs():
    # an earlier measurement's tensor, still alive, freed during this one (as the garbage collector does between
    # tests): the process-global counter drops by it; read as it was, a run's peak came out low (by half, once)
    from memplan.truth.counting import counted_profile

    with counted_profile():
        earlier = [torch.empty(4 * MIB4)]  # 16 MiB, allocated under the earlier measurement
    with counted_profile() as prof:
        earlier.clear()
        run = torch.empty(MIB4)  # this run's 4 MiB
        del run
    assert peak_total_allocated(prof) == 4 * MIB4
