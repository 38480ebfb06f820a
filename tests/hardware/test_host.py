"""Host readings: RAM, CPUs, the cgroup limit a container or Slurm job imposes, process RSS."""
from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from memplan.hardware.host import HostInfo, host_info, process_rss_bytes
from memplan.units import GiB, MiB


def test_host_info_reads_this_machine():
    host = host_info()
    assert 0 < host.available_bytes <= host.total_bytes
    assert host.total_bytes == psutil.virtual_memory().total
    assert 1 <= host.usable_cpu_count <= host.cpu_count
    assert 0 <= host.budget_bytes <= host.available_bytes


def _cgroup(tmp_path, proc_line: str, files: dict[str, str]):
    tmp_path.mkdir(parents=True, exist_ok=True)
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text(proc_line)
    root = tmp_path / "sys_fs_cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return {"cgroup_root": root, "proc_cgroup": proc, "shm_path": str(tmp_path)}


def test_cgroup_v2_limit_of_a_slurm_job_caps_the_budget(tmp_path):
    paths = _cgroup(tmp_path, "0::/system.slice/slurmstepd.scope/job_1\n", {
        "system.slice/slurmstepd.scope/job_1/memory.max": f"{8 * GiB}\n",
        "system.slice/slurmstepd.scope/job_1/memory.current": f"{3 * GiB}\n",
    })
    host = host_info(**paths)
    assert (host.cgroup_limit_bytes, host.cgroup_used_bytes) == (8 * GiB, 3 * GiB)
    assert host.budget_bytes == min(host.available_bytes, 5 * GiB)


def test_cgroup_v2_max_means_no_limit(tmp_path):
    paths = _cgroup(tmp_path, "0::/\n", {"memory.max": "max\n", "memory.current": "123\n"})
    host = host_info(**paths)
    assert host.cgroup_limit_bytes is None and host.cgroup_used_bytes is None
    assert host.budget_bytes == host.available_bytes


def test_cgroup_v1_container_limit_and_v1_unlimited(tmp_path):
    limited = _cgroup(tmp_path / "a", "4:memory:/docker/abc\n1:cpu:/\n", {
        "memory/memory.limit_in_bytes": f"{16 * GiB}\n",  # namespaced: the container is the root
        "memory/memory.usage_in_bytes": f"{1 * GiB}\n",
    })
    assert host_info(**limited).cgroup_limit_bytes == 16 * GiB
    unlimited = _cgroup(tmp_path / "b", "4:memory:/\n", {
        "memory/memory.limit_in_bytes": "9223372036854771712\n"})  # v1's "no limit"
    assert host_info(**unlimited).cgroup_limit_bytes is None


def test_budget_never_negative():
    host = HostInfo(total_bytes=64 * GiB, available_bytes=60 * GiB, cpu_count=8, usable_cpu_count=8,
                    cgroup_limit_bytes=4 * GiB, cgroup_used_bytes=5 * GiB)
    assert host.budget_bytes == 0


def test_missing_shm_and_cgroup_files_are_unknown_not_errors(tmp_path):
    host = host_info(cgroup_root=tmp_path / "none", proc_cgroup=tmp_path / "none",
                     shm_path=str(tmp_path / "no-shm"))
    assert host.cgroup_limit_bytes is None and host.shm_total_bytes is None


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_process_rss_agrees_with_the_kernels_own_count():
    # /proc/self/statm's second field is resident pages: an independent reading of the same figure.
    # (Comparing RSS before and after allocating is flaky: the allocator may reuse resident memory.)
    block = b"\x01" * (64 * MiB)
    with open("/proc/self/statm") as f:
        statm = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    assert abs(process_rss_bytes() - statm) < 16 * MiB
    assert process_rss_bytes() >= len(block)


def test_process_rss_of_a_finished_process_is_none():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_rss_bytes(child.pid) is None


def test_process_rss_defaults_to_this_process():
    assert process_rss_bytes() == pytest.approx(psutil.Process().memory_info().rss, rel=0.05)
