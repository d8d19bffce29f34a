"""Which samples each ``(rank, worker)`` reads, in an order that depends only on ``(seed, epoch)``.

A streaming source is cut into *units* (Parquet row groups, WebDataset shards) of known size.
An epoch's plan::

    units ──(seed, epoch) permutation──▶ work items ──greedy by size──▶ stream 0 │ stream 1 │ …
                                                                     (stream = rank × num_workers + worker)

Every unit is in exactly one stream, so every sample is read exactly once per epoch. The
position is one number per unit: how many of its samples (in the unit's own seeded order) were
consumed. A resume with the same grid re-creates the same plan and skips what was consumed
(same batches, same order); a resume with another grid plans what is left — each unit from its
consumed position — over the new grid, so the rest of the epoch is still read exactly once.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from torchkeel.errors import DataError

T = TypeVar("T")


@dataclass(frozen=True)
class Unit:
    """One unit of work: a row group or a shard, with the number of samples it holds."""

    name: str
    num_samples: int


@dataclass(frozen=True)
class Work:
    """Read unit ``unit`` from position ``first`` of its seeded order to its end."""

    unit: int
    first: int


def epoch_seed(seed: int, epoch: int) -> int:
    """A seed that depends only on the run seed and the epoch (data order, worker seeds)."""
    return (seed * 1_000_003 + epoch * 7_919 + 17) % 2**63


def unit_rng(seed: int, epoch: int, unit: int) -> np.random.Generator:
    """The generator of one unit's sample order in one epoch (independent of who reads it)."""
    return np.random.default_rng([seed % 2**63, epoch, unit])


def buffered_shuffle(items: Iterable[T], size: int, rng: np.random.Generator) -> Iterator[T]:
    """A shuffle buffer: hold ``size`` items, emit a random one as each new one arrives.

    A stream shorter than the buffer comes out as a full random permutation.
    """
    buffer: list[T] = []
    for item in items:
        if len(buffer) < size:
            buffer.append(item)
            continue
        j = int(rng.integers(size))
        yield buffer[j]
        buffer[j] = item
    for j in rng.permutation(len(buffer)):
        yield buffer[j]


def bucket_order(order: np.ndarray, lengths: np.ndarray, window: int, rng: np.random.Generator) -> np.ndarray:
    """``order`` with each window of ``window`` consecutive samples sorted by length, so batches
    cut from it hold similar lengths (less padding). Each window's direction is drawn from
    ``rng``, so no part of an epoch is always the long one. ``lengths`` is indexed by sample."""
    order = np.array(order)
    ordered_lengths = lengths[order]
    for start in range(0, len(order), window):
        part = slice(start, start + window)
        by_length = np.argsort(ordered_lengths[part], kind="stable")
        if rng.random() < 0.5:
            by_length = by_length[::-1]
        order[part] = order[part][by_length]
    return order


@dataclass
class Position:
    """Where an epoch stands: the plan it follows and what each unit has given so far.

    ``base`` is each unit's start when the plan was made (all 0 at an epoch start);
    ``consumed`` each unit's position now; ``next_stream`` per rank, the local stream whose
    batch comes next (the loader serves its streams in turn).
    """

    epoch: int
    world_size: int
    num_workers: int
    base: list[int]
    consumed: list[int]
    next_stream: list[int] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "world_size": self.world_size, "num_workers": self.num_workers,
                "base": list(self.base), "consumed": list(self.consumed), "next_stream": list(self.next_stream)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "Position":
        return cls(int(state["epoch"]), int(state["world_size"]), int(state["num_workers"]),
                   [int(x) for x in state["base"]], [int(x) for x in state["consumed"]],
                   [int(x) for x in state.get("next_stream", [])])


def merge_positions(positions: Sequence[Position]) -> Position:
    """One position from every rank's own (each rank only advances the units it reads)."""
    first = positions[0]
    consumed = [max(values) for values in zip(*(p.consumed for p in positions))]
    next_stream = [0] * first.world_size
    for rank, p in enumerate(positions):
        if rank < len(p.next_stream):
            next_stream[rank] = p.next_stream[rank]
    return Position(first.epoch, first.world_size, first.num_workers, list(first.base), consumed, next_stream)


def unit_order(num_units: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The order in which units are handed out in ``epoch``."""
    if not shuffle:
        return list(range(num_units))
    return np.random.default_rng(epoch_seed(seed, epoch)).permutation(num_units).tolist()


def assign(work: Sequence[Work], sizes: Sequence[int], num_streams: int) -> list[list[Work]]:
    """Hand ``work`` out in order, each item to the stream with the fewest samples so far."""
    streams: list[list[Work]] = [[] for _ in range(num_streams)]
    loads = [0] * num_streams
    for item in work:
        s = loads.index(min(loads))
        streams[s].append(item)
        loads[s] += sizes[item.unit] - item.first
    return streams


def plan_streams(
    units: Sequence[Unit], seed: int, position: Position, *, shuffle: bool
) -> list[list[Work]]:
    """Every stream's work (``world_size × num_workers`` streams, rank-major) for ``position``.

    Items start at the unit's consumed position, and fully consumed units are left out.
    """
    sizes = [u.num_samples for u in units]
    order = unit_order(len(units), seed, position.epoch, shuffle)
    work = [Work(u, position.base[u]) for u in order if position.base[u] < sizes[u]]
    streams = assign(work, sizes, position.world_size * max(1, position.num_workers))
    return [[Work(w.unit, position.consumed[w.unit]) for w in stream if position.consumed[w.unit] < sizes[w.unit]]
            for stream in streams]


def continue_position(
    position: Position | None, epoch: int, num_units: int, world_size: int, num_workers: int
) -> Position:
    """The position to read ``epoch`` from: a fresh one, the saved one (same grid), or the saved
    one's remainder re-planned over a new grid (a different world size or worker count)."""
    if position is None or position.epoch != epoch:
        return Position(epoch, world_size, num_workers, [0] * num_units, [0] * num_units, [0] * world_size)
    if len(position.base) != num_units:
        raise DataError(
            f"the checkpoint's data position has {len(position.base)} units but the dataset has {num_units}; "
            "the data files changed since it was saved — restore them or start a new run"
        )
    if (position.world_size, position.num_workers) == (world_size, num_workers):
        return position
    return Position(epoch, world_size, num_workers, list(position.consumed), list(position.consumed),
                    [0] * world_size)
