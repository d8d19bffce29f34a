"""Which samples each ``(rank, stream)`` reads, in an order that depends only on ``(seed, epoch)``.

A streaming source is cut into *units* (Parquet row groups, WebDataset shards) of known size.
An epoch's plan::

    units ──(seed, epoch) permutation──▶ work items ──greedy by size──▶ stream 0 │ stream 1 │ …
                                                                     (stream = rank × streams + local stream)

Every unit is in exactly one stream, so every sample is read exactly once per epoch. The number
of streams per rank is a setting (``data.streams``), not the number of worker processes: the
workers share the streams out among themselves, and the loader serves the streams in turn, so
the batches and their order do not depend on how many workers made them. The position is one
number per unit: how many of its samples (in the unit's own seeded order) were consumed. A
resume with the same grid re-creates the same plan and skips what was consumed (same batches,
same order); a resume with another grid plans what is left — each unit from its consumed
position — over the new grid, so the rest of the epoch is still read exactly once.
"""

from __future__ import annotations

import heapq
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

    ``streams`` is the number of streams per rank (the grid is ``world_size × streams``);
    ``base`` is each unit's start when the plan was made (all 0 at an epoch start);
    ``consumed`` each unit's position now; ``next_stream`` per rank, the local stream whose
    batch comes next (the loader serves its streams in turn); ``stream_items`` per stream of
    the grid, the items it has given this epoch — batches and its end — which key each batch's
    random draws.
    """

    epoch: int
    world_size: int
    streams: int
    base: list[int]
    consumed: list[int]
    next_stream: list[int] = field(default_factory=list)
    stream_items: list[int] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "world_size": self.world_size,
            "streams": self.streams,
            "base": list(self.base),
            "consumed": list(self.consumed),
            "next_stream": list(self.next_stream),
            "stream_items": list(self.stream_items),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "Position":
        # Checkpoints from before data.streams had one stream per worker ("num_workers").
        streams = int(state["streams"]) if "streams" in state else max(1, int(state.get("num_workers", 1)))
        world_size = int(state["world_size"])
        batches = [int(x) for x in state.get("stream_items", [])] or [0] * (world_size * streams)
        return cls(
            int(state["epoch"]),
            world_size,
            streams,
            [int(x) for x in state["base"]],
            [int(x) for x in state["consumed"]],
            [int(x) for x in state.get("next_stream", [])],
            batches,
        )


def merge_positions(positions: Sequence[Position]) -> Position:
    """One position from every rank's own (each rank only advances the units and streams it reads)."""
    first = positions[0]
    consumed = [max(values) for values in zip(*(p.consumed for p in positions))]
    batches = [max(values) for values in zip(*(p.stream_items for p in positions))]
    next_stream = [0] * first.world_size
    for rank, p in enumerate(positions):
        if rank < len(p.next_stream):
            next_stream[rank] = p.next_stream[rank]
    return Position(first.epoch, first.world_size, first.streams, list(first.base), consumed, next_stream, batches)


def unit_order(num_units: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The order in which units are handed out in ``epoch``."""
    if not shuffle:
        return list(range(num_units))
    return np.random.default_rng(epoch_seed(seed, epoch)).permutation(num_units).tolist()


def assign(
    work: Sequence[Work], sizes: Sequence[int], num_streams: int, per_rank: int | None = None
) -> list[list[Work]]:
    """Hand ``work`` out in order, each item to the stream with the fewest samples so far; among
    equals, the lowest local stream across the ranks first (rank 0's stream 0, rank 1's stream 0,
    …), so that the ranks' shares stay even when there are fewer units than streams."""
    per_rank = per_rank or num_streams
    streams: list[list[Work]] = [[] for _ in range(num_streams)]
    heap = [(0, s % per_rank, s // per_rank, s) for s in range(num_streams)]
    heapq.heapify(heap)
    for item in work:
        load, local, rank, s = heapq.heappop(heap)
        streams[s].append(item)
        heapq.heappush(heap, (load + sizes[item.unit] - item.first, local, rank, s))
    return streams


def plan_streams(units: Sequence[Unit], seed: int, position: Position, *, shuffle: bool) -> list[list[Work]]:
    """Every stream's work (``world_size × streams`` streams, rank-major) for ``position``.

    Items start at the unit's consumed position, and fully consumed units are left out.
    """
    sizes = [u.num_samples for u in units]
    order = unit_order(len(units), seed, position.epoch, shuffle)
    work = [Work(u, position.base[u]) for u in order if position.base[u] < sizes[u]]
    streams = assign(work, sizes, position.world_size * position.streams, position.streams)
    return [
        [Work(w.unit, position.consumed[w.unit]) for w in stream if position.consumed[w.unit] < sizes[w.unit]]
        for stream in streams
    ]


def continue_position(position: Position | None, epoch: int, num_units: int, world_size: int, streams: int) -> Position:
    """The position to read ``epoch`` from: a fresh one, the saved one (same grid), or the saved
    one's remainder re-planned over a new grid (another world size or number of streams)."""
    fresh_counts = [0] * (world_size * streams)
    if position is None or position.epoch != epoch:
        return Position(epoch, world_size, streams, [0] * num_units, [0] * num_units, [0] * world_size, fresh_counts)
    if len(position.base) != num_units:
        raise DataError(
            f"the checkpoint's data position has {len(position.base)} units but the dataset has {num_units}; "
            "the data files changed since it was saved — restore them or start a new run"
        )
    if (position.world_size, position.streams) == (world_size, streams):
        return position
    return Position(
        epoch, world_size, streams, list(position.consumed), list(position.consumed), [0] * world_size, fresh_counts
    )


def num_stream_batches(samples: int, batch_size: int, drop_last: bool) -> int:
    """Batches a stream of ``samples`` samples is cut into."""
    return samples // batch_size if drop_last else -(-samples // batch_size)


def epoch_batches(
    units: Sequence[Unit], seed: int, position: Position, batch_size: int, *, shuffle: bool, drop_last: bool
) -> list[int]:
    """Per rank, the batches left in the epoch from ``position`` (all of it for a fresh one), when
    no further sample is bad. Every rank steps as often as the longest (see ``even_batches``)."""
    sizes = [u.num_samples for u in units]
    streams = plan_streams(units, seed, position, shuffle=shuffle)
    per_stream = [num_stream_batches(sum(sizes[w.unit] - w.first for w in s), batch_size, drop_last) for s in streams]
    return [sum(per_stream[r * position.streams : (r + 1) * position.streams]) for r in range(position.world_size)]
