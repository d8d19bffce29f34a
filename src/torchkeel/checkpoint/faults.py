"""Test-only fault injection at the named points of a checkpoint write.

Rules, comma-separated:

- ``kill:POINT#N``: SIGKILL this process the N-th time ``POINT`` is reached (N defaults to 1);
- ``sleep:POINT=SECONDS``: pause at ``POINT`` every time, to make the write window findable.

Points: ``<file>:before_temp``, ``<file>:mid_write``, ``<file>:after_write``,
``<file>:after_fsync``, ``<file>:after_replace`` for each of ``model.safetensors``,
``state.safetensors`` and ``state.json``, then ``before_manifest`` and ``after_manifest``.
``keel train`` reads the rules from ``TORCHKEEL_TEST_FAULTS``; nothing else does.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter

from torchkeel.checkpoint.format import PointHook


def parse_fault_rules(spec: str) -> PointHook:
    """A hook for ``CheckpointStore(hook=...)`` that carries out ``spec``'s rules."""
    kills: dict[str, int] = {}
    sleeps: dict[str, float] = {}
    for rule in filter(None, (r.strip() for r in spec.split(","))):
        action, _, rest = rule.partition(":")
        if action == "kill":
            point, _, nth = rest.partition("#")
            kills[point] = int(nth or 1)
        elif action == "sleep":
            point, _, seconds = rest.rpartition("=")
            sleeps[point] = float(seconds)
        else:
            raise ValueError(f"unknown fault rule {rule!r}; use kill:POINT#N or sleep:POINT=SECONDS")
    seen: Counter[str] = Counter()

    def hook(point: str) -> None:
        seen[point] += 1
        if point in sleeps:
            time.sleep(sleeps[point])
        if kills.get(point) == seen[point]:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook
