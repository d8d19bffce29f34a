"""Is training waiting for data? The share of wall time spent waiting for the next batch.

``TimedBatches`` wraps any iterable of batches and adds up the time spent inside ``next()``;
``InputBoundDetector`` compares it with the wall time of a window of steps and reports once
when waiting took more than half of it — the GPU-at-35 % failure, named with its figures.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any


class TimedBatches:
    """Iterates ``batches`` and adds the time each ``next()`` took to ``wait_s``."""

    def __init__(self, batches: Iterable[Any]) -> None:
        self._it = iter(batches)
        self.wait_s = 0.0

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        start = time.perf_counter()
        try:
            return next(self._it)
        finally:
            self.wait_s += time.perf_counter() - start

    def take(self) -> float:
        """The waiting time since the last ``take()``."""
        wait, self.wait_s = self.wait_s, 0.0
        return wait


class InputBoundDetector:
    """Reports (once) a window of steps in which waiting for data exceeded ``threshold`` of the time.

    Call ``start()`` when a new epoch's batches begin (its first step, a pipeline refill, is
    left out) and ``observe(wait_s)`` after each step. A window is at least ``window_steps``
    steps and ``min_window_s`` seconds.

    Example::

        batches, detector = TimedBatches(loader.epoch(0)), InputBoundDetector()
        detector.start()
        for batch in batches:
            step(batch)
            finding = detector.observe(batches.take())
    """

    def __init__(self, *, threshold: float = 0.5, window_steps: int = 20, min_window_s: float = 1.0) -> None:
        self.threshold, self.window_steps, self.min_window_s = threshold, window_steps, min_window_s
        self.reported = False
        self._skip = True
        self._reset(time.perf_counter())

    def _reset(self, now: float) -> None:
        self._begin, self._wait, self._steps = now, 0.0, 0

    def start(self) -> None:
        self._skip = True

    def observe(self, wait_s: float) -> dict[str, Any] | None:
        now = time.perf_counter()
        if self._skip:
            self._skip = False
            self._reset(now)
            return None
        self._wait += wait_s
        self._steps += 1
        elapsed = now - self._begin
        if self._steps < self.window_steps or elapsed < self.min_window_s:
            return None
        share, steps, wait = self._wait / elapsed, self._steps, self._wait
        self._reset(now)
        if self.reported or share <= self.threshold:
            return None
        self.reported = True
        return {
            "wait_fraction": round(share, 4),
            "steps": steps,
            "wait_s_per_step": round(wait / steps, 6),
            "step_s": round(elapsed / steps, 6),
            "compute_s_per_step": round((elapsed - wait) / steps, 6),
        }
