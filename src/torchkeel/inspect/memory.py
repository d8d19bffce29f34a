"""How much memory this process holds (read every few steps: kept cheap)."""

from __future__ import annotations

import os
import sys

_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """Resident memory of this process (Linux: /proc; elsewhere: the peak from getrusage)."""
    try:
        with open("/proc/self/statm", "rb") as statm:  # read every few steps: kept cheap (~5 us)
            return int(statm.read().split()[1]) * _PAGE_SIZE
    except FileNotFoundError:
        pass
    import resource  # POSIX only; Linux took the branch above

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
