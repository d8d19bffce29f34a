"""Gradient accumulation: group micro-batches into optimizer steps and weight each one.

The classic bug is stepping inside the micro-batch loop and again every N batches. Here a
group is formed first, each micro-batch's mean loss is weighted by its share of the group's
samples, and the step function steps once per group. A short last group (or a short last
micro-batch) is weighted by its real size, so the update equals one step on the concatenated
batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any


def iter_groups(batches: Iterable[Any], accumulate: int) -> Iterator[list[Any]]:
    """Lists of up to ``accumulate`` consecutive batches; the last list may be shorter."""
    if accumulate == 1:
        return map(list, zip(batches))  # [batch] each, made without a Python frame per batch
    return _groups(batches, accumulate)


def _groups(batches: Iterable[Any], accumulate: int) -> Iterator[list[Any]]:
    group: list[Any] = []
    for batch in batches:
        group.append(batch)
        if len(group) == accumulate:
            yield group
            group = []
    if group:
        yield group


class Lookahead:
    """Iterates ``groups`` one ahead, so that each comes with whether it is the last.

    While the caller works on a group, ``held`` is the next one, already read from the loader
    but not trained on (a checkpoint must not count it as consumed). ``handed`` counts the
    batches the loader has handed out in the epoch (``loader.bad.handed``): then ``read_ahead``
    is how many of the loader's batches ``held`` took (batches that stand in for a rank whose
    data ran out are not the loader's), and ``first`` the number of the current group's first
    batch in the epoch. ``take_wait()`` is the time spent reading since it was last called: how
    long training waited for its data (the first read, which fills the pipeline, is left out).

    Example::

        ahead = Lookahead(iter_groups(loader.epoch(epoch), accumulate), lambda: loader.bad.handed)
        for group, is_last in ahead:
            ...
    """

    def __init__(self, groups: Iterable[list[Any]], handed: Callable[[], int] | None = None) -> None:
        self._groups = iter(groups)
        self._handed = handed or (lambda: 0)
        self.held: list[Any] | None = None
        self.wait_s = 0.0
        self.first = 0
        self._after_current = 0  # the loader's count once the current group was read

    def __iter__(self) -> Iterator[tuple[list[Any], bool]]:
        handed = self._handed
        self.first = handed()
        current = next(self._groups, None)
        while current is not None:
            self._after_current = handed()
            start = time.perf_counter()
            self.held = next(self._groups, None)
            self.wait_s += time.perf_counter() - start
            yield current, self.held is None
            self.first, current, self.held = self._after_current, self.held, None

    @property
    def read_ahead(self) -> int:
        """The loader's batches read for ``held`` and not trained on (0 between groups)."""
        return self._handed() - self._after_current if self.held is not None else 0

    def take_wait(self) -> float:
        """Seconds spent reading groups since the last call."""
        wait, self.wait_s = self.wait_s, 0.0
        return wait


def steps_per_epoch(num_batches: int, accumulate: int) -> int:
    """Optimizer steps in an epoch of ``num_batches`` micro-batches (a short last group counts)."""
    return -(-num_batches // accumulate)


def total_steps(
    num_batches: int | Callable[[int], int], accumulate: int, max_epochs: int | None, max_steps: int | None
) -> int:
    """Optimizer steps of the whole run: the first limit reached of ``max_epochs`` and ``max_steps``.

    ``num_batches`` is the batches of every epoch, or a function of the epoch (a streaming
    epoch's plan gives it a batch or so more or fewer than another's).
    """
    per_epoch = num_batches if callable(num_batches) else (lambda epoch: num_batches)
    limits = []
    if max_epochs is not None:
        limits.append(sum(steps_per_epoch(per_epoch(e), accumulate) for e in range(max_epochs)))
    if max_steps is not None:
        limits.append(max_steps)
    if not limits:
        raise ValueError("total_steps needs max_epochs or max_steps")
    return min(limits)
