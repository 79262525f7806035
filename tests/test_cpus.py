"""The CPU budget that sizes torch's thread pool: affinity mask cut by cgroup v1/v2 CFS quotas,
read from fake cgroup trees laid out as the kernel mounts them."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kiln.engine.cpus import configure_torch_threads, cpu_budget


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_no_cgroup_limit_uses_the_affinity_mask(tmp_path: Path) -> None:
    write(tmp_path / "cpu.max", "max 100000\n")
    assert cpu_budget(8, tmp_path, "0::/\n") == (8, "8 CPU(s) in the affinity mask")
    assert cpu_budget(3, tmp_path / "missing", "")[0] == 3


def test_cgroup_v2_quota_in_a_namespace_rounds_up(tmp_path: Path) -> None:
    write(tmp_path / "cpu.max", "250000 100000\n")  # 2.5 CPUs: the pod's limit
    threads, why = cpu_budget(64, tmp_path, "0::/\n")
    assert threads == 3 and "2.5" in why


def test_cgroup_v2_ancestor_quota_counts(tmp_path: Path) -> None:
    # No namespace: the process sits deep in the hierarchy; the pod-level parent holds the limit.
    write(tmp_path / "kubepods/pod1/cpu.max", "200000 100000\n")
    write(tmp_path / "kubepods/pod1/ctr/cpu.max", "max 100000\n")
    assert cpu_budget(16, tmp_path, "0::/kubepods/pod1/ctr\n")[0] == 2


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    write(tmp_path / "cpu,cpuacct/kubepods/ctr/cpu.cfs_quota_us", "150000\n")
    write(tmp_path / "cpu,cpuacct/kubepods/ctr/cpu.cfs_period_us", "100000\n")
    write(tmp_path / "cpu,cpuacct/cpu.cfs_quota_us", "-1\n")  # the root: unlimited
    write(tmp_path / "cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    self_cgroup = "12:memory:/kubepods/ctr\n4:cpu,cpuacct:/kubepods/ctr\n0::/\n"
    threads, why = cpu_budget(32, tmp_path, self_cgroup)
    assert threads == 2 and "1.5" in why


def test_affinity_below_the_quota_wins_and_malformed_files_are_ignored(tmp_path: Path) -> None:
    write(tmp_path / "cpu.max", "800000 100000\n")
    assert cpu_budget(2, tmp_path, "0::/\n")[0] == 2
    write(tmp_path / "cpu.max", "garbage\n")
    assert cpu_budget(4, tmp_path, "0::/\n")[0] == 4


def test_a_tiny_quota_still_gets_one_thread(tmp_path: Path) -> None:
    write(tmp_path / "cpu.max", "10000 100000\n")
    assert cpu_budget(8, tmp_path, "0::/\n")[0] == 1


def test_configure_sets_torch_and_logs(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    try:
        with caplog.at_level(logging.INFO, logger="kiln.cpus"):
            assert configure_torch_threads() == 1
        assert torch.get_num_threads() == 1
        assert "torch threads: 1" in caplog.text
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("value, threads", [("3", 3), ("2,1", 2), (" 2", 2), ("0", 1), ("many", 1)])
def test_omp_num_threads_is_read_as_openmp_reads_it(value: str, threads: int, monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """0 passed for a count (and libgomp ran a thread per host core, whatever the cgroup allowed);
    "2,1" or " 2" were not digits and the user's count was replaced by the CPU budget."""
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})  # a budget of 1
    try:
        with caplog.at_level(logging.INFO, logger="kiln.cpus"):
            assert configure_torch_threads() == threads
        assert torch.get_num_threads() == threads
        assert ("no positive thread count" in caplog.text) == (threads == 1)
    finally:
        torch.set_num_threads(before)
