"""Data loading of map-style datasets whose order depends only on ``(seed, epoch)`` and that can
start mid-epoch.

Because the order of epoch ``e`` is a pure function of the seed and ``e``, a resumed run sees
exactly the batches an uninterrupted run would, and the global RNG is never consumed by the
loader, so a hand-written loop and the Trainer draw the same numbers. Worker processes persist
across epochs: the sampler, in the main process, is told each epoch's order.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from torchkeel.data.collate import DefaultCollate
from torchkeel.distributed.parallel import empty_like_batch
from torchkeel.distributed.rank import per_rank
from torchkeel.data.order import bucket_order, epoch_seed
from torchkeel.data.stream import worker_context
from torchkeel.data.bad import BadSamples, remember
from torchkeel.errors import DataError, first_line

@dataclass
class _BadItem:
    index: int
    error: str


class _Guarded(Dataset):
    """The user's dataset, with an item that raises turned into a record of it (never a stand-in)."""

    def __init__(self, dataset: Dataset[Any]) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        try:
            return self.dataset[index]
        except Exception as exc:
            return _BadItem(index, f"{type(exc).__name__}: {first_line(exc)}")

    def __getitems__(self, indices: list[int]) -> list[Any]:
        """A batch's items in one call (the DataLoader's fetcher uses it); item by item only when
        one of them raises, so the others are kept."""
        try:
            return [self.dataset[i] for i in indices]
        except Exception:
            return [self[i] for i in indices]


class _Collate:
    """Collate the good samples; hand back the bad ones beside them."""

    def __init__(self, collate: Callable[[list[Any]], Any]) -> None:
        self.collate = collate

    def __call__(self, items: list[Any]) -> tuple[Any, list[_BadItem]]:
        bad = [item for item in items if type(item) is _BadItem]
        if not bad:
            return self.collate(items), bad
        good = [item for item in items if type(item) is not _BadItem]
        return (self.collate(good) if good else None), bad


class _EpochSampler(Sampler[int]):
    """Yields the indices it was last given; lives in the main process, so persistent workers
    follow each epoch's order."""

    def __init__(self) -> None:
        self.order: list[int] = []

    def __iter__(self) -> Iterator[int]:
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)


class EpochLoader:
    """Batches of a map-style dataset for one epoch at a time.

    With ``world_size`` > 1, ``batch_size`` is the global batch: rank ``rank`` takes its slice of
    every batch of the one global order (a short last batch is split as evenly as possible; a
    rank whose slice is empty gets an empty batch), so every rank yields the same number of
    batches and each sample is seen once per epoch by one rank.

    A sample whose ``__getitem__`` raises is skipped and listed in ``new_bad`` (the Trainer
    records it as an incident); past ``max_bad_fraction`` of the dataset in one epoch, a
    ``DataError`` lists the first ten. ``bucket_by`` (a dict key or tuple index of the sample)
    sorts windows of ``bucket_window`` samples by that field's length: batches of similar
    lengths, in an order that is still a function of ``(seed, epoch)``.

    Example::

        loader = EpochLoader(train_set, batch_size=64, seed=0)
        for epoch in range(3):
            for inputs, targets in loader.epoch(epoch):
                ...
    """

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
            raise DataError(
                f"dataset {type(dataset).__name__} must be map-style (define __len__ and __getitem__)"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.rank, self.world_size = rank, world_size
        self.rank_batch_size = per_rank(batch_size, world_size)
        self.seed = seed
        self.shuffle = shuffle
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.collate_fn = collate_fn or DefaultCollate()
        self.drop_last = drop_last
        self.bucket_by, self.bucket_window = bucket_by, bucket_window
        self.max_bad_fraction = max_bad_fraction
        self.start_method, self.prefetch_factor = start_method, prefetch_factor
        self.num_samples = len(dataset)  # type: ignore[arg-type]
        if self.num_samples == 0:
            raise DataError(f"dataset {type(dataset).__name__} is empty")
        self.bad = BadSamples(max_bad_fraction, self.num_samples)
        self._lengths: np.ndarray | None = None if lengths is None else np.asarray(lengths, dtype=np.int64)
        self._sampler = _EpochSampler()
        self._loader: DataLoader | None = None
        self._origins: dict[int, list[int]] = {}

    def __len__(self) -> int:
        """Batches per epoch (the last one may be short, unless ``drop_last``)."""
        round_ = math.floor if self.drop_last else math.ceil
        return round_(self.num_samples / self.batch_size)

    def indices(self, epoch: int) -> list[int]:
        """The sample order of ``epoch``."""
        if not self.shuffle:
            order = list(range(self.num_samples))
        else:
            generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
            order = torch.randperm(self.num_samples, generator=generator).tolist()
        if self.bucket_by is None:
            return order
        rng = np.random.default_rng([epoch_seed(self.seed, epoch), 1])
        return bucket_order(np.array(order), self.lengths(), self.bucket_window, rng).tolist()

    def lengths(self) -> np.ndarray:
        """The ``bucket_by`` length of every sample, read once (given as ``lengths``, or the
        dataset's ``lengths`` attribute, or read from every sample)."""
        if self._lengths is None:
            given = getattr(self.dataset, "lengths", None)
            if given is not None and len(given) == self.num_samples:
                self._lengths = np.asarray(given, dtype=np.int64)
            else:
                self._lengths = np.array([_length(self.dataset[i], self.bucket_by) for i in range(self.num_samples)])
        return self._lengths

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[Any]:
        """Iterate the batches of ``epoch``, beginning with batch number ``start_batch``."""
        if start_batch == 0:
            self.bad.start_epoch(epoch)
        self.bad.epoch = epoch  # a resumed epoch keeps the bad-sample count its checkpoint had
        order = self.indices(epoch)
        if self.drop_last:
            order = order[: len(self) * self.batch_size]
        self._sampler.order = self.rank_share(order)[start_batch * self.rank_batch_size:]
        return self._iterate(self._sampler.order, len(self) - start_batch)

    def rank_share(self, order: list[int]) -> list[int]:
        """This rank's slices of the global batches of ``order``, in order."""
        if self.world_size == 1:
            return order
        size, rank, world, mine = self.batch_size, self.rank, self.world_size, []
        for start in range(0, len(order), size):
            n = min(size, len(order) - start)
            low = start + rank * (n // world) + min(rank, n % world)
            mine.extend(order[low:low + n // world + (rank < n % world)])
        return mine

    def _iterate(self, order: list[int], expected: int) -> Iterator[Any]:
        size, template, count = self.rank_batch_size, None, 0
        for number, (batch, bad) in enumerate(self._data_loader()):
            if bad:
                self.bad.record([(f"dataset index {b.index}", b.error) for b in bad])
            if batch is None and self.world_size > 1 and template is not None:
                batch = template  # all bad: the other ranks still step, so this one does too
            if batch is not None:
                skipped = {b.index for b in bad}
                chunk = order[number * size:(number + 1) * size]
                remember(self._origins, batch, [i for i in chunk if i not in skipped])
                template = template if template is not None else empty_like_batch(batch)
                count += 1
                yield batch
        if self.world_size > 1 and template is not None:
            for _ in range(expected - count):  # an empty share of the last batch
                yield template

    def origin(self, batch: Any, index: int) -> str | None:
        """Which dataset index sample ``index`` of a recent batch is (``None``: unknown batch)."""
        indices = self._origins.get(id(batch))
        return f"dataset index {indices[index]}" if indices is not None and index < len(indices) else None

    @property
    def new_bad(self) -> list[tuple[str, str]]:
        """Bad samples met since the caller last cleared this list, ``(where, error)``."""
        return self.bad.new

    def state_dict(self) -> dict[str, Any]:
        """The epoch's bad-sample count (the position itself is the caller's ``batch_in_epoch``)."""
        return self.bad.state_dict()

    def load_state_dict(self, state: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Continue the bad-sample count: this rank's, or every rank's (a list) summed when the
        number of ranks changed."""
        states = [state] if isinstance(state, dict) else list(state)
        if len(states) == self.world_size > 1:
            states = [states[self.rank]]
        self.bad.load_state_dict(states)

    def close(self) -> None:
        """Stop the worker processes (they are started again by the next ``epoch()``)."""
        self._loader = None

    def _data_loader(self) -> DataLoader:
        if self._loader is None:
            workers = self.num_workers
            self._loader = DataLoader(
                _Guarded(self.dataset), batch_size=self.rank_batch_size, sampler=self._sampler,
                num_workers=workers, pin_memory=self.pin_memory, collate_fn=_Collate(self.collate_fn),
                worker_init_fn=seed_worker if workers else None, persistent_workers=workers > 0,
                prefetch_factor=self.prefetch_factor if workers else None,
                multiprocessing_context=worker_context(self.start_method) if workers else None,
                # The loader draws its worker base seed from this generator, not the global RNG.
                generator=torch.Generator().manual_seed(epoch_seed(self.seed, 0) + 1),
            )
        return self._loader


def _length(sample: Any, key: str | int | None) -> int:
    field_ = sample[key] if isinstance(sample, dict) or isinstance(key, int) else (
        sample[0] if key == "input" else sample[1] if key == "target" else getattr(sample, str(key)))
    return int(field_.shape[0]) if hasattr(field_, "shape") else len(field_)


def seed_worker(worker_id: int) -> None:
    """``worker_init_fn`` for DataLoader: seed python and numpy in each worker from torch's worker seed.

    PyTorch seeds each worker's torch RNG (base seed + worker id) but not numpy or ``random``,
    so without this, augmentations that use them repeat across workers and differ between runs.
    """
    worker_seed = torch.initial_seed() % 2**32
    random.seed(worker_seed)
    np.random.seed(worker_seed)

