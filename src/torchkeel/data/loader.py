"""Data loading of map-style datasets whose order depends only on ``(seed, epoch)`` and that can
start mid-epoch.

Because the order of epoch ``e`` is a pure function of the seed and ``e``, a resumed run sees
exactly the batches an uninterrupted run would, and the global RNG is never consumed by the
loader, so a hand-written loop and the Trainer draw the same numbers. Each batch's
``__getitem__`` calls draw from generators seeded by ``(seed, rank, epoch, first index)``
(``torchkeel.rng.BatchSeeds``), so random augmentations are the same with any number of
workers and after a resume. Worker processes persist across epochs: the sampler, in the main
process, is told each epoch's order.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from torchkeel.data.bad import BadSampleLedger, Handout
from torchkeel.data.collate import DefaultCollate, collate_or_split
from torchkeel.data.options import HasLoaderOptions, LoaderOptions
from torchkeel.data.order import bucket_order, epoch_seed
from torchkeel.data.stream import stop_workers, worker_context
from torchkeel.distributed.parallel import empty_like_batch
from torchkeel.errors import DataError, first_line
from torchkeel.rng import BatchSeeds, preserved_rng


@dataclass
class _BadItem:
    index: int
    error: str


class _SeededReads(Dataset):
    """The user's dataset, with an item that raises turned into a record of it (never a stand-in),
    and each batch's sample draws made on generators seeded by ``(seed, rank, epoch, its first
    index)`` — a batch's own key, whichever worker makes it. ``epoch`` is shared memory the
    loader writes before each epoch (persistent workers read it)."""

    def __init__(self, dataset: Dataset[Any], seed: int, rank: int, epoch: torch.Tensor) -> None:
        self.dataset, self.seed, self.rank, self._epoch = dataset, seed, rank, epoch
        self.epoch = epoch.numpy()  # a view of the shared tensor: cheaper to read than the tensor
        self.seeds = BatchSeeds()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "epoch": None}  # spawned workers get the shared tensor, and view it anew

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.epoch = self._epoch.numpy()

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        with self.seeds(self.seed, self.rank, int(self.epoch[0]), index):
            return self._item(index)

    def _item(self, index: int) -> Any:
        try:
            return self.dataset[index]
        except Exception as exc:
            return _BadItem(index, f"{type(exc).__name__}: {first_line(exc)}")

    def __getitems__(self, indices: list[int]) -> "_Fetched":
        """A batch's items in one call (the DataLoader's fetcher uses it)."""
        if self.seeds.idle_pid == os.getpid():  # the data draws no random numbers: nothing to seed
            return self._fetch(indices)
        with self.seeds(self.seed, self.rank, int(self.epoch[0]), indices[0]):
            return self._fetch(indices)

    def _fetch(self, indices: list[int]) -> "_Fetched":
        """The items; item by item only when one of them raises, so the others are kept."""
        try:
            return _Fetched([self.dataset[i] for i in indices], indices)
        except Exception:
            return _Fetched([self._item(i) for i in indices], indices, may_be_bad=True)


@dataclass
class _Fetched:
    items: list[Any]
    indices: list[int]
    may_be_bad: bool = False
    """Some item raised: the batch holds ``_BadItem`` records (else there are none to look for)."""


class _Collate:
    """Collate the good samples; hand back the bad ones (those that raised, and those whose
    shape differs from the rest of the batch) beside them."""

    def __init__(self, collate: Callable[[list[Any]], Any]) -> None:
        self.collate = collate

    def __call__(self, fetched: _Fetched) -> tuple[Any, list[_BadItem], list[int]]:
        items, indices = fetched.items, fetched.indices
        bad = [item for item in items if type(item) is _BadItem] if fetched.may_be_bad else []
        if bad:
            indices = [i for i, item in zip(indices, items) if type(item) is not _BadItem]
            items = [item for item in items if type(item) is not _BadItem]
            if not items:
                return None, bad, []
        try:
            return self.collate(items), bad, indices
        except Exception:  # noqa: BLE001 - collate_or_split tells a few unlike samples from data that needs pad
            pass
        batch, odd, keep = collate_or_split(self.collate, items, lambda k: f"dataset index {indices[k]}")
        if odd:
            kept = set(keep)
            bad += [
                _BadItem(indices[k], error)
                for k, (_, error) in zip((k for k in range(len(indices)) if k not in kept), odd)
            ]
            indices = [indices[k] for k in keep]
        return batch, bad, indices


class _EpochSampler(Sampler[int]):
    """Yields the indices it was last given; lives in the main process, so persistent workers
    follow each epoch's order."""

    def __init__(self) -> None:
        self.order: list[int] = []

    def __iter__(self) -> Iterator[int]:
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)


class EpochLoader(HasLoaderOptions):
    """Batches of a map-style dataset for one epoch at a time.

    With ``world_size`` > 1, ``batch_size`` is the global batch: rank ``rank`` takes its slice of
    every batch of the one global order (a short last batch is split as evenly as possible; a
    rank whose slice is empty gets an empty batch), so every rank yields the same number of
    batches and each sample is seen once per epoch by one rank.

    A sample whose ``__getitem__`` raises, or whose shape differs from the rest of its batch, is
    skipped and recorded in the ledger ``bad`` (the Trainer records it as an incident); past
    ``max_bad_fraction`` of the dataset in one epoch, a ``DataError`` lists the first ten (with
    several ranks the caller shares the counts and calls ``bad.check()``, see
    ``BadSampleLedger``). ``bucket_by`` (a dict key or tuple index of the sample)
    sorts windows of ``bucket_window`` samples by that field's length: batches of similar
    lengths, in an order that is still a function of ``(seed, epoch)``.

    Example::

        loader = EpochLoader(train_set, batch_size=64, seed=0)
        for epoch in range(3):
            for inputs, targets in loader.epoch(epoch):
                ...
    """

    streaming = False
    """Ranks hold the same number of batches (see ``StreamLoader.streaming``)."""

    def __init__(
        self,
        dataset: Dataset[Any],
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        num_workers: int = 0,
        pin_memory: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        drop_last: bool = False,
        bucket_by: str | int | None = None,
        bucket_window: int = 4096,
        max_bad_fraction: float = 0.001,
        start_method: str | None = None,
        prefetch_factor: int = 2,
        lengths: Any = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise DataError(f"dataset {type(dataset).__name__} must be map-style (define __len__ and __getitem__)")
        self.dataset = dataset
        self.options = LoaderOptions.of(locals(), collate_fn=collate_fn or DefaultCollate())
        self.bucket_by, self.bucket_window = bucket_by, bucket_window
        self.num_samples = len(dataset)  # type: ignore[arg-type]
        if self.num_samples == 0:
            raise DataError(f"dataset {type(dataset).__name__} is empty")
        self.bad = BadSampleLedger(max_bad_fraction, self.num_samples, world_size)
        self._lengths: np.ndarray | None = None if lengths is None else np.asarray(lengths, dtype=np.int64)
        self._sampler = _EpochSampler()
        self._epoch = torch.zeros(1, dtype=torch.int64).share_memory_()
        self._loader: DataLoader | None = None
        self._reads, self._collate = _SeededReads(dataset, seed, rank, self._epoch), _Collate(self.options.collate_fn)

    def __len__(self) -> int:
        """Batches per epoch (the last one may be short, unless ``drop_last``)."""
        round_ = math.floor if self.options.drop_last else math.ceil
        return round_(self.num_samples / self.options.batch_size)

    def num_batches(self, epoch: int) -> int:
        """The batches every rank iterates in ``epoch`` (the same in every epoch)."""
        return len(self)

    def indices(self, epoch: int) -> list[int]:
        """The sample order of ``epoch``."""
        if not self.options.shuffle:
            order = list(range(self.num_samples))
        else:
            generator = torch.Generator().manual_seed(epoch_seed(self.options.seed, epoch))
            order = torch.randperm(self.num_samples, generator=generator).tolist()
        if self.bucket_by is None:
            return order
        rng = np.random.default_rng([epoch_seed(self.options.seed, epoch), 1])
        return bucket_order(np.array(order), self.lengths(), self.bucket_window, rng).tolist()

    def lengths(self) -> np.ndarray:
        """The ``bucket_by`` length of every sample, read once (given as ``lengths``, or the
        dataset's ``lengths`` attribute, or read from every sample)."""
        if self._lengths is None:
            given = getattr(self.dataset, "lengths", None)
            if given is not None and len(given) == self.num_samples:
                self._lengths = np.asarray(given, dtype=np.int64)
            else:
                with preserved_rng():  # a __getitem__ that augments must not move the run's generators
                    self._lengths = np.array(
                        [_length(self.dataset[i], self.bucket_by) for i in range(self.num_samples)]
                    )
        return self._lengths

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[Any]:
        """Iterate the batches of ``epoch``, beginning with batch number ``start_batch``."""
        self.bad.start_epoch(epoch, resumed=start_batch > 0)
        order = self.indices(epoch)
        if self.options.drop_last:
            order = order[: len(self) * self.options.batch_size]
        self._epoch[0] = epoch
        self._sampler.order = self.rank_share(order)[start_batch * self.options.rank_batch_size :]
        return self._iterate(len(self) - start_batch)

    def rank_share(self, order: list[int]) -> list[int]:
        """This rank's slices of the global batches of ``order``, in order."""
        o = self.options
        if o.world_size == 1:
            return order
        size, rank, world, mine = o.batch_size, o.rank, o.world_size, []
        for start in range(0, len(order), size):
            n = min(size, len(order) - start)
            low = start + rank * (n // world) + min(rank, n % world)
            mine.extend(order[low : low + n // world + (rank < n % world)])
        return mine

    def _iterate(self, expected: int) -> Iterator[Any]:
        template, count, met = None, 0, 0
        for batch, bad, kept in self._batches():
            if bad:
                self.bad.record([(f"dataset index {b.index}", b.error) for b in bad])
                met += len(bad)
            if batch is None and self.options.world_size > 1 and template is not None:
                batch, kept = template, None  # all bad: the other ranks still step, so this one does too
            if batch is not None:
                self.bad.hand_out(Handout(met, kept))
                template = template if template is not None else empty_like_batch(batch)
                count, met = count + 1, 0
                yield batch
        if self.options.world_size > 1 and template is not None:
            for _ in range(expected - count):  # an empty share of the last batch
                self.bad.hand_out(Handout(0))
                yield template

    def origin(self, number: int, index: int) -> str | None:
        """Which dataset index sample ``index`` of the epoch's batch ``number`` is (``None``:
        unknown, or a batch no longer kept)."""
        entry = self.bad.entry(number)
        indices = entry.origins if entry is not None else None
        return f"dataset index {indices[index]}" if indices is not None and index < len(indices) else None

    def state_dict(self, read_ahead: int = 0) -> dict[str, Any]:
        """The epoch's bad-sample count (the position itself is the caller's ``batch_in_epoch``);
        ``read_ahead``: the latest batches handed out but not trained on, whose bad samples are
        not counted."""
        return self.bad.state_dict(read_ahead)

    def load_state_dict(self, state: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Continue the bad-sample count from this rank's state, or every rank's (a list)."""
        self.bad.load_state_dict(
            [state] if isinstance(state, dict) else list(state), self.options.rank, self.options.world_size
        )

    def close(self) -> None:
        """Stop the worker processes (they are started again by the next ``epoch()``)."""
        loader, self._loader = self._loader, None
        stop_workers(loader)

    def _batches(self) -> Iterable[tuple[Any, list[_BadItem], list[int]]]:
        """``(batch, bad samples, kept indices)`` of the sampler's order. Without workers or pinning
        they are made here as the DataLoader's main-process path makes them (``__getitems__`` on
        each run of ``rank_batch_size`` indices, then the collate), without its per-batch
        bookkeeping (a profiler range, a Python loop over every index), which costs more than
        the step of a small model."""
        o = self.options
        if o.num_workers or o.pin_memory:
            return self._data_loader()
        order, size, fetch, collate = self._sampler.order, o.rank_batch_size, self._reads.__getitems__, self._collate
        return (collate(fetch(order[start : start + size])) for start in range(0, len(order), size))

    def _data_loader(self) -> DataLoader:
        if self._loader is None:
            o = self.options
            workers = o.num_workers
            self._loader = DataLoader(
                self._reads,
                batch_size=o.rank_batch_size,
                sampler=self._sampler,
                num_workers=workers,
                pin_memory=o.pin_memory,
                collate_fn=self._collate,
                worker_init_fn=seed_worker if workers else None,
                persistent_workers=workers > 0,
                prefetch_factor=o.prefetch_factor if workers else None,
                multiprocessing_context=worker_context(o.start_method) if workers else None,
                # The loader draws its worker base seed from this generator, not the global RNG.
                generator=torch.Generator().manual_seed(epoch_seed(o.seed, 0) + 1),
            )
        return self._loader


def _length(sample: Any, key: str | int | None) -> int:
    field_ = (
        sample[key]
        if isinstance(sample, dict) or isinstance(key, int)
        else (sample[0] if key == "input" else sample[1] if key == "target" else getattr(sample, str(key)))
    )
    return int(field_.shape[0]) if hasattr(field_, "shape") else len(field_)


def seed_worker(worker_id: int) -> None:
    """``worker_init_fn`` for DataLoader: seed python and numpy in each worker from torch's worker seed.

    PyTorch seeds each worker's torch RNG (base seed + worker id) but not numpy or ``random``,
    so without this, augmentations that use them repeat across workers and differ between runs.
    """
    worker_seed = torch.initial_seed() % 2**32
    random.seed(worker_seed)
    np.random.seed(worker_seed)
