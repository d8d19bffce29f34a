"""Gradient accumulation: group micro-batches into optimizer steps and weight each one.

The classic bug is stepping inside the micro-batch loop and again every N batches. Here a
group is formed first, each micro-batch's mean loss is weighted by its share of the group's
samples, and the step function steps once per group. A short last group (or a short last
micro-batch) is weighted by its real size, so the update equals one step on the concatenated
batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

def iter_groups(batches: Iterable[Any], accumulate: int) -> Iterator[list[Any]]:
    """Yield lists of up to ``accumulate`` consecutive batches; the last list may be shorter."""
    group: list[Any] = []
    for batch in batches:
        group.append(batch)
        if len(group) == accumulate:
            yield group
            group = []
    if group:
        yield group



def steps_per_epoch(num_batches: int, accumulate: int) -> int:
    """Optimizer steps in an epoch of ``num_batches`` micro-batches (a short last group counts)."""
    return -(-num_batches // accumulate)


def total_steps(
    num_batches: int, accumulate: int, max_epochs: int | None, max_steps: int | None
) -> int:
    """Optimizer steps of the whole run: the first limit reached of ``max_epochs`` and ``max_steps``."""
    limits = []
    if max_epochs is not None:
        limits.append(max_epochs * steps_per_epoch(num_batches, accumulate))
    if max_steps is not None:
        limits.append(max_steps)
    if not limits:
        raise ValueError("total_steps needs max_epochs or max_steps")
    return min(limits)
