"""The CPUs a process may use, and how many intra-op threads torch should run on them.

torch starts one intra-op thread per core of the machine. In a container with a CPU quota, or
next to other ranks of the same job, that is more threads than CPUs: they wait for each other,
and a step that takes 0.7 s with one thread takes 11 s with two on a busy 2-core machine.
``choose_threads`` gives each process its share — the CPUs it may use (affinity mask and cgroup
quota) divided by the processes of the job on this machine — unless the user set a count. The
count never depends on the load of the moment, which would make two runs of the same config
differ (reductions split across threads add in another order); ``keel doctor`` reports the load.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def cgroup_cpus(root: str | Path = "/sys/fs/cgroup") -> float | None:
    """The CPU quota of this process's cgroup in CPUs (``None``: no quota, or not readable).

    cgroup v2 ``cpu.max`` (``"200000 100000"``: 2 CPUs, ``"max 100000"``: no quota), else v1's
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``.
    """
    base = Path(root)
    try:
        quota, period = (base / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((base / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((base / "cpu" / "cpu.cfs_period_us").read_text())
        return quota_us / period_us if quota_us > 0 and period_us > 0 else None
    except (OSError, ValueError):
        return None


def affinity_cpus() -> int:
    """CPUs in this process's affinity mask (``taskset``, a scheduler's binding)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def usable_cpus(affinity: int | None = None, quota: float | None = None) -> int:
    """The CPUs this process may use: its affinity mask, capped by the cgroup quota (rounded up)."""
    affinity = affinity_cpus() if affinity is None else affinity
    return max(1, min(affinity, math.ceil(quota)) if quota is not None else affinity)


def load_average() -> float | None:
    """The machine's 1-minute load average (``None`` where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def choose_threads(local_processes: int, usable: int, environ: Mapping[str, str]) -> tuple[int | None, str]:
    """Intra-op threads for one of ``local_processes`` processes of a job on this machine.

    Returns ``(None, reason)`` when the user chose (``OMP_NUM_THREADS``/``MKL_NUM_THREADS``),
    else ``(count, reason)``: ``usable // local_processes``, at least 1.
    """
    for name in THREAD_VARIABLES:
        if environ.get(name):
            return None, f"{name}={environ[name]} is set"
    count = max(1, usable // max(1, local_processes))
    share = f" / {local_processes} processes on this machine" if local_processes > 1 else ""
    return count, f"{usable} usable CPUs{share}; set OMP_NUM_THREADS to choose"
