"""Batches from a streaming source, read exactly once per epoch in a seeded, resumable order.

Worker processes persist across epochs. Each epoch, the main process writes the plan (which
units each local stream reads, from which position) into a shared tensor; each worker reads
its stream's units in order and cuts its own batches, tagged with the unit positions they
reach. The DataLoader serves the workers in turn, and the loader records each position as the
batch is handed out — so a checkpoint taken after a step holds exactly what was trained on,
and a resume rotates the workers so that the stream whose batch came next still comes next.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from torchkeel.data.batch import concat, map_tensors, take
from torchkeel.data.collate import DefaultCollate
from torchkeel.data.order import Position, Work, continue_position, merge_positions, plan_streams, unit_rng
from torchkeel.data.sources import Bad, Rows, Sample, Source
from torchkeel.data.bad import BadSamples, remember
from torchkeel.errors import DataError, first_line

@dataclass
class BatchInfo:
    """What comes with each batch from a worker: its stream, the unit positions it reaches, the
    bad samples met since the previous batch, and where its samples came from."""

    stream: int
    positions: dict[int, int]
    bad: list[tuple[str, str]] = field(default_factory=list)
    origins: list[Any] = field(default_factory=list)


class _Streams(IterableDataset):
    """The worker side: each worker reads the stream the shared plan gives it."""

    def __init__(self, source: Source, plan: torch.Tensor, batch_size: int, *, seed: int,
                 collate: Callable[[list[Any]], Any], transform: Callable[[Any], Any] | None,
                 batch_transform: Callable[[Any], Any] | None, drop_last: bool, as_samples: bool,
                 shuffle: bool) -> None:
        self.source, self.plan, self.batch_size, self.seed = source, plan, batch_size, seed
        self.collate, self.transform, self.batch_transform = collate, transform, batch_transform
        self.drop_last, self.as_samples, self.shuffle = drop_last, as_samples, shuffle
        self.sizes = [u.num_samples for u in source.units()]

    def __iter__(self) -> Iterator[tuple[Any, BatchInfo]]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        epoch, rotation, count = (int(x) for x in self.plan[:3])
        rows = self.plan[3:3 + 3 * count].view(-1, 3).tolist()
        stream = (worker + rotation) % num_workers
        work = [Work(unit, first) for s, unit, first in rows if s == stream]
        return self._batches(stream, epoch, work)

    def _batches(self, stream: int, epoch: int, work: list[Work]) -> Iterator[tuple[Any, BatchInfo]]:
        batch = _Pending(stream)
        for item in work:
            rng = unit_rng(self.seed, epoch, item.unit) if self.shuffle else None
            reader = self.source.read(item.unit, item.first, rng, as_samples=self.as_samples)
            held: list[Bad] = []  # bad samples ahead of the rows taken so far
            for event in reader:
                if isinstance(event, Bad):
                    held.append(event)
                    continue
                if isinstance(event, Sample):
                    event = self._transformed(event)
                    if isinstance(event, Bad):
                        held.append(event)
                        continue
                    batch.take_bad(item.unit, held, event.end)
                    batch.add_sample(item.unit, event)
                    if batch.num == self.batch_size:
                        yield batch.emit(self.collate)
                        batch = _Pending(stream)
                    continue
                for piece in self._row_pieces(item.unit, event):
                    if isinstance(piece, Bad):
                        held.append(piece)
                        continue
                    start = 0
                    while start < len(piece.ends):
                        n = min(self.batch_size - batch.num, len(piece.ends) - start)
                        batch.take_bad(item.unit, held, int(piece.ends[start + n - 1]))
                        batch.add_rows(item.unit, piece, start, n)
                        start += n
                        if batch.num == self.batch_size:
                            yield batch.emit(self.collate)
                            batch = _Pending(stream)
            batch.take_bad(item.unit, held, self.sizes[item.unit])
            batch.positions[item.unit] = self.sizes[item.unit]
        if batch.num and (batch.num == self.batch_size or not self.drop_last):
            yield batch.emit(self.collate)
        elif batch.bad or batch.positions:
            yield None, BatchInfo(stream, batch.positions, batch.bad)  # bad samples still get recorded

    def _transformed(self, sample: Sample) -> Sample | Bad:
        if self.transform is None:
            return sample
        try:
            return Sample(self.transform(sample.data), sample.end, sample.where)
        except Exception as exc:
            return Bad(sample.where, f"transform: {type(exc).__name__}: {first_line(exc)}", sample.end)

    def _row_pieces(self, unit: int, rows: Rows) -> Iterator[Rows | Bad]:
        """``rows`` after the batch transform; when it raises, row by row, to name the bad ones."""
        if self.batch_transform is None:
            yield rows
            return
        try:
            transformed = Rows(self.batch_transform(rows.data), rows.ends, rows.rows)
        except Exception:
            transformed = None
        if transformed is not None:
            yield transformed
            return
        for i in range(len(rows.ends)):
            one = slice(i, i + 1)
            try:
                piece: Rows | Bad = Rows(self.batch_transform(take(rows.data, one)), rows.ends[one], rows.rows[one])
            except Exception as exc:
                piece = Bad(self.source.where(unit, int(rows.rows[i])),
                            f"batch_transform: {type(exc).__name__}: {first_line(exc)}", int(rows.ends[i]))
            yield piece


class _Pending:
    """A batch being filled in a worker: blocks of rows and single samples, in stream order."""

    def __init__(self, stream: int) -> None:
        self.stream = stream
        self.parts: list[tuple[bool, Any, int]] = []  # (is a block of rows, data, samples)
        self.num = 0
        self.positions: dict[int, int] = {}
        self.bad: list[tuple[str, str]] = []
        self.origins: list[Any] = []

    def take_bad(self, unit: int, held: list[Bad], upto: int) -> None:
        held.sort(key=lambda b: b.end)
        while held and held[0].end <= upto:
            bad = held.pop(0)
            self.bad.append((bad.where, bad.error))
            self.positions[unit] = max(self.positions.get(unit, 0), bad.end)

    def add_sample(self, unit: int, sample: Sample) -> None:
        self.parts.append((False, sample.data, 1))
        self.origins.append(sample.where)
        self.num += 1
        self.positions[unit] = sample.end

    def add_rows(self, unit: int, rows: Rows, start: int, count: int) -> None:
        part = slice(start, start + count)
        self.parts.append((True, rows.data if count == len(rows.ends) else take(rows.data, part), count))
        self.origins.append((unit, rows.rows[part]))
        self.num += count
        self.positions[unit] = int(rows.ends[start + count - 1])

    def emit(self, collate: Callable[[list[Any]], Any]) -> tuple[Any, BatchInfo]:
        if all(is_rows for is_rows, _, _ in self.parts):
            data = concat([d for _, d, _ in self.parts])
        else:  # single samples (a ragged unit beside a regular one too): one list, in order
            samples: list[Any] = []
            for is_rows, part, n in self.parts:
                samples += _rows(part, n) if is_rows else [part]
            data = collate(samples)
        return data, BatchInfo(self.stream, self.positions, self.bad, self.origins)


def _rows(block: Any, n: int) -> list[Any]:
    """The samples of a block of rows (each tensor indexed by the row)."""
    return [map_tensors(block, lambda t, i=i: t[i]) for i in range(n)]


def _identity(item: Any) -> Any:
    return item


class StreamLoader:
    """Batches of a streaming ``Source`` for one epoch at a time, exactly once, resumable.

    ``rank``/``world_size`` say which share this process reads; ``num_workers`` DataLoader
    workers persist across epochs. ``state_dict()`` is the position (put it in the checkpoint);
    after ``load_state_dict``, ``epoch(e, start_batch>0)`` continues with the very next samples.

    Example::

        loader = StreamLoader(ParquetSource("train/*.parquet", input=["x"], target="y"), 256, seed=0)
        for epoch in range(3):
            for inputs, targets in loader.epoch(epoch):
                ...
    """

    def __init__(
        self,
        source: Source,
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        num_workers: int = 0,
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
        self.source, self.batch_size, self.seed, self.shuffle = source, batch_size, seed, shuffle
        self.num_workers, self.rank, self.world_size = num_workers, rank, world_size
        self.drop_last, self.max_bad_fraction = drop_last, max_bad_fraction
        self.units = source.units()
        self.num_samples = sum(u.num_samples for u in self.units)
        if self.num_samples == 0:
            raise DataError(f"the data source has no samples ({len(self.units)} units); check data.train")
        if as_samples is None:
            as_samples = collate_fn is not None or transform is not None
        self._plan = torch.zeros(3 + 3 * len(self.units), dtype=torch.int64).share_memory_()
        self._dataset = _Streams(source, self._plan, batch_size, seed=seed,
                                 collate=collate_fn or DefaultCollate(), transform=transform,
                                 batch_transform=batch_transform, drop_last=drop_last, as_samples=as_samples,
                                 shuffle=shuffle)
        self.pin_memory = pin_memory
        self._loader_args = dict(start_method=start_method, prefetch_factor=prefetch_factor)
        self._loader: DataLoader | None = None
        self.position: Position | None = None
        self.bad = BadSamples(max_bad_fraction, self.num_samples / world_size)  # this rank's share
        self._origins: dict[int, list[Any]] = {}

    def __len__(self) -> int:
        """This rank's batches in a fresh epoch 0 (later epochs differ by a batch or so per worker)."""
        fresh = continue_position(None, 0, len(self.units), self.world_size, self.num_workers)
        streams = self._local(plan_streams(self.units, self.seed, fresh, shuffle=self.shuffle))
        round_ = math.floor if self.drop_last else math.ceil
        return sum(round_(sum(self.units[w.unit].num_samples - w.first for w in s) / self.batch_size) for s in streams)

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[Any]:
        """The batches of ``epoch``; with ``start_batch > 0``, from the loaded position onwards."""
        saved = self.position if start_batch > 0 else None
        position = continue_position(saved, epoch, len(self.units), self.world_size, self.num_workers)
        if saved is None or saved.epoch != epoch:
            self.bad.start_epoch(epoch)
        self.bad.epoch = epoch
        self.position = position
        streams = self._local(plan_streams(self.units, self.seed, position, shuffle=self.shuffle))
        rows = [(s, w.unit, w.first) for s, stream in enumerate(streams) for w in stream]
        self._plan[:3] = torch.tensor([epoch, position.next_stream[self.rank], len(rows)])
        if rows:
            self._plan[3:3 + 3 * len(rows)] = torch.tensor(rows).flatten()
        return self._iterate(position)

    def _iterate(self, position: Position) -> Iterator[Any]:
        for batch, info in self._data_loader():
            for unit, end in info.positions.items():
                position.consumed[unit] = max(position.consumed[unit], end)
            position.next_stream[self.rank] = (info.stream + 1) % max(1, self.num_workers)
            if info.bad:
                self.bad.record(info.bad)
            if batch is not None:
                remember(self._origins, batch, info.origins)
                yield batch

    @property
    def new_bad(self) -> list[tuple[str, str]]:
        """Bad samples met since the caller last cleared this list, ``(where, error)``."""
        return self.bad.new

    def origin(self, batch: Any, index: int) -> str | None:
        """Where sample ``index`` of the batch last handed out came from (``None``: another batch)."""
        origins = self._origins.get(id(batch))
        if origins is None:
            return None
        for item in origins:
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

    def state_dict(self) -> dict[str, Any]:
        """This rank's position in the epoch (plain data), with the epoch's bad-sample count."""
        if self.position is None:
            return {}
        return {**self.position.state_dict(), **self.bad.state_dict()}

    def load_state_dict(self, state: dict[str, Any] | Sequence[dict[str, Any]]) -> None:
        """Continue from a saved position: one rank's, or every rank's (a list), merged."""
        states = [state] if isinstance(state, dict) else list(state)
        states = [s for s in states if s]
        if not states:
            return
        self.position = merge_positions([Position.from_state(s) for s in states])
        self.bad.load_state_dict(states)

    def _local(self, streams: list[list[Work]]) -> list[list[Work]]:
        per_rank = max(1, self.num_workers)
        return streams[self.rank * per_rank:(self.rank + 1) * per_rank]

    def close(self) -> None:
        """Stop the worker processes (they are started again by the next ``epoch()``)."""
        self._loader = None

    def _data_loader(self) -> DataLoader:
        if self._loader is None:
            args = self._loader_args
            workers = self.num_workers
            self._loader = DataLoader(
                self._dataset, batch_size=None, num_workers=workers, collate_fn=_identity,
                pin_memory=self.pin_memory, persistent_workers=workers > 0,
                prefetch_factor=args["prefetch_factor"] if workers else None,
                multiprocessing_context=worker_context(args["start_method"]) if workers else None,
            )
        return self._loader


def worker_context(start_method: str | None) -> str | None:
    """The start method for workers: ``forkserver`` once CUDA is initialized (a forked child of a
    CUDA process cannot use CUDA, and may hang), else the platform default."""
    if start_method is not None:
        return start_method
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return "forkserver"
    return None
