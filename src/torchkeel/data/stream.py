"""Batches from a streaming source, read exactly once per epoch in a seeded, resumable order that
does not depend on the number of worker processes.

Each rank reads ``streams`` streams (``data.streams``); the plan (which units each stream reads,
from which position) is a function of the seed and the epoch (``torchkeel.data.order``). Worker
processes persist across epochs and share the streams out: worker ``w`` of ``W`` makes the
batches of the streams ``s`` with ``s % W == w``. The loader serves the streams in turn — stream
0's first batch, stream 1's, …, stream 0's second — whichever worker made them, keeping
early arrivals aside; a worker that is ``window`` batches ahead on each of its streams sends a
placeholder instead, so nothing piles up. The batches and their order are therefore the same
with 0, 1 or 8 workers, and a resume continues with the very next batch on any of them.

Each batch's sample transforms draw their random numbers from generators seeded by
``(seed, epoch, stream, batch number)`` (``torchkeel.rng.BatchSeeds``), so augmentations too
are the same whoever makes the batch, and the training process's own generators never move.
The loader records each position as the batch is handed out, so a checkpoint taken after a
step holds exactly what was trained on.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader

from torchkeel.data.bad import BadSampleLedger, Handout
from torchkeel.data.collate import DefaultCollate
from torchkeel.data.options import HasLoaderOptions, LoaderOptions
from torchkeel.data.order import (
    Position,
    Work,
    continue_position,
    epoch_batches,
    epoch_seed,
    merge_positions,
    plan_streams,
)
from torchkeel.data.sources import Source
from torchkeel.data.stream_workers import BatchInfo, Streams, identity
from torchkeel.errors import DataError

DEFAULT_STREAMS = 8


class _Undo:
    """What handing out one batch changed in the position (and everything since the batch
    before: stream ends), so that ``state_dict(read_ahead=...)`` can take it back."""

    def __init__(self) -> None:
        self.consumed: dict[int, int] = {}
        self.items: dict[int, int] = {}
        self.next_stream: int | None = None
        self.bad = 0

    def note(self, position: Position, turn: int, offset: int, units: dict[int, int]) -> None:
        """Before an item of local stream ``turn`` changes ``position``: keep the old values."""
        for unit in units:
            self.consumed.setdefault(unit, position.consumed[unit])
        self.items.setdefault(offset + turn, position.stream_items[offset + turn])
        if self.next_stream is None:
            self.next_stream = turn

    def apply(self, position: Position, rank: int) -> None:
        for unit, value in self.consumed.items():
            position.consumed[unit] = value
        for stream, value in self.items.items():
            position.stream_items[stream] = value
        if self.next_stream is not None:
            position.next_stream[rank] = self.next_stream


class StreamLoader(HasLoaderOptions):
    """Batches of a streaming ``Source`` for one epoch at a time, exactly once, resumable.

    ``rank``/``world_size`` say which share this process reads, in ``streams`` streams (the
    batches and their order depend on the seed, the epoch, the world size and ``streams`` —
    not on ``num_workers``); ``num_workers`` DataLoader workers (at most ``streams``: more
    would have nothing to read) persist across epochs. ``state_dict()`` is the position (put
    it in the checkpoint); after ``load_state_dict``, ``epoch(e, start_batch>0)`` continues
    with the very next samples, with any number of workers.

    Example::

        loader = StreamLoader(ParquetSource("train/*.parquet", input=["x"], target="y"), 256, seed=0)
        for epoch in range(3):
            for inputs, targets in loader.epoch(epoch):
                ...
    """

    streaming = True
    """Ranks may hold different numbers of batches (``TrainingJob.batches`` keeps them in step)."""

    def __init__(
        self,
        source: Source,
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        num_workers: int = 0,
        streams: int = DEFAULT_STREAMS,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        transform: Callable[[Any], Any] | None = None,
        batch_transform: Callable[[Any], Any] | None = None,
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
        pin_memory: bool = False,
        start_method: str | None = None,
        prefetch_factor: int = 2,
        max_bad_fraction: float = 0.001,
        as_samples: bool | None = None,
    ) -> None:
        arguments = {k: v for k, v in locals().items() if k != "self"}
        if streams < 1:
            raise ValueError(f"streams must be >= 1, got {streams}")
        self.source = source
        self.options = o = LoaderOptions.of(
            arguments, num_workers=min(num_workers, streams), collate_fn=collate_fn or DefaultCollate()
        )
        self.streams = streams
        self.units = source.units()
        self.num_samples = sum(u.num_samples for u in self.units)
        if self.num_samples == 0:
            raise DataError(
                f"the data source {type(source).__name__} has no samples ({len(self.units)} units): give it data"
            )
        if as_samples is None:
            as_samples = collate_fn is not None or transform is not None
        self._plan = torch.zeros(2 + streams + 3 * len(self.units), dtype=torch.int64).share_memory_()
        self._taken = torch.zeros(streams, dtype=torch.int64).share_memory_()
        self._dataset = Streams(
            source,
            self._plan,
            self._taken,
            o.rank_batch_size,
            seed=seed,
            rank=rank,
            streams=streams,
            window=prefetch_factor + 1,
            collate=o.collate_fn,
            transform=transform,
            batch_transform=batch_transform,
            drop_last=drop_last,
            as_samples=as_samples,
            shuffle=shuffle,
        )
        self._loader: DataLoader | None = None
        self.position: Position | None = None
        self.bad = BadSampleLedger(max_bad_fraction, self.num_samples, world_size)

    def __len__(self) -> int:
        """This rank's batches in a fresh epoch 0 (other epochs differ by a batch or so per stream)."""
        return self.rank_batches(0)[self.options.rank]

    def rank_batches(self, epoch: int) -> list[int]:
        """Every rank's batches in a fresh ``epoch`` when no sample is bad (a function of the plan)."""
        o = self.options
        fresh = continue_position(None, epoch, len(self.units), o.world_size, self.streams)
        return epoch_batches(self.units, o.seed, fresh, o.rank_batch_size, shuffle=o.shuffle, drop_last=o.drop_last)

    def num_batches(self, epoch: int) -> int:
        """The batches every rank iterates in ``epoch``: the longest rank's, when no sample is bad."""
        return max(self.rank_batches(epoch))

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[Any]:
        """The batches of ``epoch``; with ``start_batch > 0``, from the loaded position onwards."""
        saved = self.position if start_batch > 0 else None
        position = continue_position(saved, epoch, len(self.units), self.options.world_size, self.streams)
        self.bad.start_epoch(epoch, resumed=saved is not None and saved.epoch == epoch)
        self.position = position
        streams = self._local(plan_streams(self.units, self.options.seed, position, shuffle=self.options.shuffle))
        rows = [(s, w.unit, w.first) for s, stream in enumerate(streams) for w in stream]
        local = slice(self.options.rank * self.streams, (self.options.rank + 1) * self.streams)
        self._plan[: 2 + self.streams] = torch.tensor([epoch, len(rows), *position.stream_items[local]])
        if rows:
            self._plan[2 + self.streams : 2 + self.streams + 3 * len(rows)] = torch.tensor(rows).flatten()
        self._taken.zero_()
        return self._iterate(position)

    def _iterate(self, position: Position) -> Iterator[Any]:
        """The streams' items in turn (stream 0, 1, …), whichever worker made them; those that
        come early wait in ``pending``. Positions are recorded as a batch is handed out."""
        streams, offset, rank = self.streams, self.options.rank * self.streams, self.options.rank
        pending: list[deque[tuple[Any, BatchInfo]]] = [deque() for _ in range(streams)]
        ended = [False] * streams
        turn = position.next_stream[rank] % streams
        undo = _Undo()
        for item in self._data_loader():
            if item[1].stream < 0:
                continue  # a worker's placeholder: it was ahead on all its streams
            pending[item[1].stream].append(item)
            while not ended[turn] and pending[turn]:
                batch, info = pending[turn].popleft()
                undo.note(position, turn, offset, info.positions)
                self._taken[turn] += 1
                position.stream_items[offset + turn] += 1
                for unit, end in info.positions.items():
                    position.consumed[unit] = max(position.consumed[unit], end)
                ended[turn] = info.ended
                turn = next((s % streams for s in range(turn + 1, turn + streams + 1) if not ended[s % streams]), turn)
                position.next_stream[rank] = turn
                if info.bad:
                    undo.bad += len(info.bad)
                    self.bad.record(info.bad)
                if batch is not None:
                    self.bad.hand_out(Handout(undo.bad, info.origins, undo))
                    undo = _Undo()
                    yield batch
        if not all(ended):
            raise DataError(
                f"the data loader stopped before streams {[s for s in range(streams) if not ended[s]]} "
                "ended; a worker process died — see the messages above"
            )

    def origin(self, number: int, index: int) -> str | None:
        """Where sample ``index`` of the epoch's batch ``number`` came from (``None``: a batch
        no longer kept, or not this loader's)."""
        entry = self.bad.entry(number)
        if entry is None or entry.origins is None:
            return None
        for item in entry.origins:
            if isinstance(item, str):
                if index == 0:
                    return item
                index -= 1
                continue
            unit, rows = item
            if index < len(rows):
                return self.source.where(unit, int(rows[index]))
            index -= len(rows)
        return None

    def state_dict(self, read_ahead: int = 0) -> dict[str, Any]:
        """This rank's position in the epoch (plain data), with the epoch's bad-sample count.

        ``read_ahead``: how many of the latest batches handed out were not trained on; the
        position is the one before them, so that a resume reads them again.
        """
        if self.position is None:
            return {}
        position = copy.deepcopy(self.position)
        for entry in reversed(self.bad.latest(read_ahead)):
            entry.undo.apply(position, self.options.rank)
        return {**position.state_dict(), **self.bad.state_dict(read_ahead)}

    def load_state_dict(self, state: dict[str, Any] | Sequence[dict[str, Any]]) -> None:
        """Continue from a saved position: one rank's, or every rank's (a list), merged."""
        states = [state] if isinstance(state, dict) else list(state)
        states = [s for s in states if s]
        if not states:
            return
        self.position = merge_positions([Position.from_state(s) for s in states])
        self.bad.load_state_dict(states, self.options.rank, self.options.world_size)

    def _local(self, streams: list[list[Work]]) -> list[list[Work]]:
        return streams[self.options.rank * self.streams : (self.options.rank + 1) * self.streams]

    def close(self) -> None:
        """Stop the worker processes (they are started again by the next ``epoch()``)."""
        loader, self._loader = self._loader, None
        stop_workers(loader)

    def _data_loader(self) -> DataLoader:
        if self._loader is None:
            o = self.options
            workers = o.num_workers
            self._loader = DataLoader(
                self._dataset,
                batch_size=None,
                num_workers=workers,
                collate_fn=identity,
                pin_memory=o.pin_memory,
                persistent_workers=workers > 0,
                prefetch_factor=o.prefetch_factor if workers else None,
                multiprocessing_context=worker_context(o.start_method) if workers else None,
                # The workers' base seed comes from this generator, not from the global RNG.
                generator=torch.Generator().manual_seed(epoch_seed(o.seed, 0) + 2),
            )
        return self._loader


def stop_workers(loader: DataLoader | None) -> None:
    """Stop a DataLoader's persistent worker processes now. Left to the garbage collector — an
    iterator kept alive by an exception's traceback, say — they stop late, after a 5 s join per
    worker, and a worker forked meanwhile inherits the iterator and fails on it when it exits."""
    iterator = getattr(loader, "_iterator", None)
    shutdown = getattr(iterator, "_shutdown_workers", None)  # torch's own: no public way exists
    if shutdown is not None:
        shutdown()
    if loader is not None:
        loader._iterator = None


def worker_context(start_method: str | None) -> str | None:
    """The start method for workers: ``forkserver`` once CUDA is initialized (a forked child of a
    CUDA process cannot use CUDA, and may hang), else the platform default."""
    if start_method is not None:
        return start_method
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return "forkserver"
    return None
