"""The CPU rank's memory reading (memplan.hardware.readings._HostReader): the figures psutil gives,
from /proc and cgroup files kept open, with psutil where a file cannot be read."""
from __future__ import annotations

import psutil
import pytest

from memplan.hardware.readings import _HostReader
from memplan.units import GiB, MiB

MEMINFO = b"MemTotal:       32000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\nBuffers: 1 kB\n"


def test_this_process_and_host_match_psutil():
    reader = _HostReader(cgroup=(None, None))
    reading = reader.read(True)
    assert reading.process_bytes == pytest.approx(psutil.Process().memory_info().rss, abs=32 * MiB)
    assert reading.headroom_bytes == pytest.approx(psutil.virtual_memory().available, abs=256 * MiB)
    assert reading.device_total_bytes == psutil.virtual_memory().total
    assert reading.device_used_bytes == reading.device_total_bytes - reading.headroom_bytes


def test_a_changing_file_is_read_afresh_each_time(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_bytes(MEMINFO)
    reader = _HostReader(meminfo=str(meminfo), cgroup=(None, None))
    assert reader.read(True).headroom_bytes == 20000000 * 1024
    meminfo.write_bytes(MEMINFO.replace(b"20000000", b"5"))  # shorter: the old tail must not be read
    assert reader.read(True).headroom_bytes == 5 * 1024


def test_unreadable_or_unparsable_files_fall_back_to_psutil(tmp_path):
    garbled = tmp_path / "garbled"
    garbled.write_bytes(b"MemAvailable: lots\n")
    reader = _HostReader(statm=str(tmp_path / "missing"), meminfo=str(garbled), cgroup=(None, None))
    reading = reader.read(True)
    assert reading.process_bytes == pytest.approx(psutil.Process().memory_info().rss, abs=32 * MiB)
    assert reading.headroom_bytes == pytest.approx(psutil.virtual_memory().available, abs=256 * MiB)


def test_a_container_limit_caps_total_and_headroom(tmp_path):
    meminfo, usage = tmp_path / "meminfo", tmp_path / "memory.current"
    meminfo.write_bytes(MEMINFO)  # 20 GB available on the machine
    usage.write_text(f"{3 * GiB}\n")
    reader = _HostReader(meminfo=str(meminfo), cgroup=(4 * GiB, usage))
    reading = reader.read(True)
    assert reading.device_total_bytes == 4 * GiB
    assert reading.headroom_bytes == 1 * GiB
    usage.write_text(f"{5 * GiB}\n")  # over the limit (page cache): no headroom, never negative
    assert reader.read(True).headroom_bytes == 0
