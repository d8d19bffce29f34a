"""How much memory this process holds (read every few steps: kept cheap)."""

from __future__ import annotations

import os
import sys

_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


_statm: tuple[int, int] | None = None  # (pid, descriptor of its /proc/self/statm), opened once per process


def rss_bytes() -> int:
    """Resident memory of this process (Linux: /proc; elsewhere: the peak from getrusage).

    Read every few steps, so the file stays open and is read again from its start (a read
    regenerates it): one system call instead of five. A forked child opens its own."""
    global _statm
    try:
        pid = os.getpid()
        if _statm is None or _statm[0] != pid:
            _statm = (pid, os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC))
        return int(os.pread(_statm[1], 128, 0).split()[1]) * _PAGE_SIZE
    except FileNotFoundError:
        pass
    import resource  # POSIX only; Linux took the branch above

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
