"""What a stream loader's DataLoader workers run: ``Streams`` makes the batches of the streams a
worker owns (see ``torchkeel.data.stream`` for the plan and the order), each collated with its
samples' origins (``BatchInfo``) so that a bad sample is named and a position can be saved."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from torchkeel.batch import concat, map_tensors, take
from torchkeel.data.collate import collate_or_split
from torchkeel.data.order import (
    Work,
    unit_rng,
)
from torchkeel.data.sources import Bad, Rows, Sample, Source
from torchkeel.errors import first_line
from torchkeel.rng import BatchSeeds


@dataclass
class BatchInfo:
    """What comes with each item from a worker: its local stream (-1: a placeholder), the unit
    positions it reaches, the bad samples met since the stream's previous item, where its samples
    came from, and whether it is the stream's last item of the epoch (then it holds no batch)."""

    stream: int
    positions: dict[int, int]
    bad: list[tuple[str, str]] = field(default_factory=list)
    origins: list[Any] = field(default_factory=list)
    ended: bool = False


PLACEHOLDER = (None, BatchInfo(-1, {}))


class Streams(IterableDataset):
    """The worker side: each worker makes the batches of its share of the rank's streams.

    ``plan`` (shared memory, written by the loader each epoch): ``[epoch, rows, batches given
    so far by each of the streams…, (stream, unit, first) per row…]``. ``taken`` (shared): the
    items of each stream the loader has served this epoch, which paces the workers.
    """

    def __init__(
        self,
        source: Source,
        plan: torch.Tensor,
        taken: torch.Tensor,
        batch_size: int,
        *,
        seed: int,
        rank: int,
        streams: int,
        window: int,
        collate: Callable[[list[Any]], Any],
        transform: Callable[[Any], Any] | None,
        batch_transform: Callable[[Any], Any] | None,
        drop_last: bool,
        as_samples: bool,
        shuffle: bool,
    ) -> None:
        self.source, self.plan, self.taken, self.batch_size, self.seed = source, plan, taken, batch_size, seed
        self.rank, self.streams, self.window = rank, streams, window
        self.collate, self.transform, self.batch_transform = collate, transform, batch_transform
        self.drop_last, self.as_samples, self.shuffle = drop_last, as_samples, shuffle
        self.sizes = [u.num_samples for u in source.units()]
        self.seeds = BatchSeeds()

    def __iter__(self) -> Iterator[tuple[Any, BatchInfo]]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        epoch, count = int(self.plan[0]), int(self.plan[1])
        given = self.plan[2 : 2 + self.streams].tolist()
        work: list[list[Work]] = [[] for _ in range(self.streams)]
        for s, unit, first in self.plan[2 + self.streams : 2 + self.streams + 3 * count].view(-1, 3).tolist():
            work[s].append(Work(unit, first))
        mine = [s for s in range(self.streams) if s % num_workers == worker]
        return self._serve(epoch, {s: self._batches(s, epoch, work[s]) for s in mine}, given, paced=info is not None)

    def _serve(
        self, epoch: int, streams: dict[int, Iterator[tuple[Any, BatchInfo]]], given: list[int], paced: bool
    ) -> Iterator[tuple[Any, BatchInfo]]:
        """This worker's streams in turn, each item made on generators seeded by where it is."""
        live, made, turn = list(streams), dict.fromkeys(streams, 0), 0
        while live:
            ready = [
                k
                for k in range(len(live))
                if not paced
                or made[live[(turn + k) % len(live)]] < int(self.taken[live[(turn + k) % len(live)]]) + self.window
            ]
            if not ready:
                yield PLACEHOLDER  # every stream of this worker is far enough ahead: keep the loader's turn
                continue
            index = (turn + ready[0]) % len(live)
            s = live[index]
            with self.seeds(self.seed, epoch, self.rank * self.streams + s, given[s] + made[s]):
                item = next(streams[s])
            made[s] += 1
            if item[1].ended:
                live.pop(index)
                turn = index % len(live) if live else 0
            else:
                turn = (index + 1) % len(live)
            yield item

    def _batches(self, stream: int, epoch: int, work: list[Work]) -> Iterator[tuple[Any, BatchInfo]]:
        """One stream's batches, then its end marker (with the bad samples after its last batch)."""
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
                        yield batch.emit(self.collate, self.source.where)
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
                            yield batch.emit(self.collate, self.source.where)
                            batch = _Pending(stream)
            batch.take_bad(item.unit, held, self.sizes[item.unit])
            batch.positions[item.unit] = self.sizes[item.unit]
        if batch.num and (batch.num == self.batch_size or not self.drop_last):
            yield batch.emit(self.collate, self.source.where)
            batch = _Pending(stream)
        yield None, BatchInfo(stream, batch.positions, batch.bad, ended=True)

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
                piece = Bad(
                    self.source.where(unit, int(rows.rows[i])),
                    f"batch_transform: {type(exc).__name__}: {first_line(exc)}",
                    int(rows.ends[i]),
                )
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

    def emit(self, collate: Callable[[list[Any]], Any], where: Callable[[int, int], str]) -> tuple[Any, BatchInfo]:
        """The batch and its info; samples of another shape than the rest become bad samples."""
        if all(is_rows for is_rows, _, _ in self.parts):
            try:
                return concat([d for _, d, _ in self.parts]), BatchInfo(
                    self.stream, self.positions, self.bad, self.origins
                )
            except RuntimeError:
                pass  # blocks of two units that differ in shape: sample by sample, to name them
        samples: list[Any] = []
        origins: list[Any] = []  # per sample: its name, or (unit, row) to name it when needed
        for (is_rows, part, n), origin in zip(self.parts, self.origins):
            if is_rows:
                samples += _rows(part, n)
                origins += [(origin[0], int(row)) for row in origin[1]]
            else:
                samples.append(part)
                origins.append(origin)

        def name(i: int) -> str:
            return origins[i] if isinstance(origins[i], str) else where(*origins[i])

        data, bad, keep = collate_or_split(collate, samples, name)
        kept_origins = self.origins if not bad else [name(i) for i in keep]
        return data, BatchInfo(self.stream, self.positions, self.bad + bad, kept_origins)


def _rows(block: Any, n: int) -> list[Any]:
    """The samples of a block of rows (each tensor indexed by the row)."""
    return [map_tensors(block, lambda t, i=i: t[i]) for i in range(n)]


def identity(item: Any) -> Any:
    return item
