"""How many CPUs this process may really use, so torch's thread pool matches the pod.

torch sizes its pool from the CPUs it sees, which in a container are the node's (or the affinity
mask's), not the pod's CPU limit. A pod limited to 2 CPUs on a 64-core node that runs 64 threads
is throttled by the CFS quota in every step. The budget is the smallest of the affinity mask and
the CFS quota of the process's cgroup and each of its ancestors (cgroup v2 `cpu.max`, v1
`cpu.cfs_quota_us` / `cpu.cfs_period_us`), rounded up.
"""
from __future__ import annotations

import logging
import math
import os
from pathlib import Path

log = logging.getLogger("kiln.cpus")


def cpu_budget(affinity: int, cgroup_root: Path, self_cgroup: str) -> tuple[int, str]:
    """(CPUs usable, why): `affinity` CPUs in the scheduler mask, cut by the CFS quota found under
    `cgroup_root` (/sys/fs/cgroup) for the cgroups named in `self_cgroup` (/proc/self/cgroup's text)."""
    best, why = max(affinity, 1), f"{affinity} CPU(s) in the affinity mask"
    for directory in _cgroup_dirs(cgroup_root, self_cgroup):
        quota = _quota(directory)
        if quota is not None and math.ceil(quota) < best:
            best, why = math.ceil(quota), f"CFS quota {quota:g} CPU(s) in {directory}"
    return best, why


def _cgroup_dirs(root: Path, self_cgroup: str) -> list[Path]:
    """The process's cgroup directories and their ancestors up to the mount (v2: the `0::` line;
    v1: the line whose controllers include cpu)."""
    dirs: list[Path] = []
    for line in self_cgroup.splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # cgroup v2 unified hierarchy
            base = root
        elif "cpu" in controllers.split(","):
            base = next((root / name for name in (controllers, "cpu", "cpu,cpuacct") if (root / name).is_dir()), None)
            if base is None:
                continue
        else:
            continue
        parts = [p for p in path.strip().split("/") if p]
        # Inside a cgroup namespace the path may not exist under the mount: the mount is the cgroup.
        dirs += [base.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]
    return [d for d in dirs if d.is_dir()]


def _quota(directory: Path) -> float | None:
    """CPUs allowed by the quota in this one cgroup directory; None when unlimited or absent."""
    try:
        if (directory / "cpu.max").exists():
            quota, _, period = (directory / "cpu.max").read_text().strip().partition(" ")
            return None if quota == "max" else int(quota) / int(period or 100000)
        if (directory / "cpu.cfs_quota_us").exists():
            quota_us = int((directory / "cpu.cfs_quota_us").read_text())
            period_us = int((directory / "cpu.cfs_period_us").read_text())
            return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):  # unreadable or malformed: no limit known from this directory
        return None
    return None


def configure_torch_threads() -> int:
    """Set torch's intra-op threads to this process's CPU budget (an explicit OMP_NUM_THREADS wins),
    log the choice, and return it."""
    import torch

    given = os.environ.get("OMP_NUM_THREADS")
    if given is not None:
        # OpenMP's own reading: a positive count, the first of a comma list. libgomp ignores
        # anything else (0 too) and runs a thread per host core, however few the cgroup allows.
        try:
            threads = int(given.split(",")[0])
        except ValueError:
            threads = 0
        if threads >= 1:
            torch.set_num_threads(threads)
            log.info("torch threads: %d (OMP_NUM_THREADS)", threads)
            return threads
        log.warning("OMP_NUM_THREADS=%r is no positive thread count: ignored", given)
    try:
        self_cgroup = Path("/proc/self/cgroup").read_text()
    except OSError:
        self_cgroup = ""
    threads, why = cpu_budget(len(os.sched_getaffinity(0)), Path("/sys/fs/cgroup"), self_cgroup)
    torch.set_num_threads(threads)
    log.info("torch threads: %d (%s)", threads, why)
    return threads
