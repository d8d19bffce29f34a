"""Data loading whose order depends only on ``(seed, epoch)`` and that can start mid-epoch.

Because the order of epoch ``e`` is a pure function of the seed and ``e``, a resumed run sees
exactly the batches an uninterrupted run would, and the global RNG is never consumed by the
loader, so a hand-written loop and the Trainer draw the same numbers.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from torchkeel.errors import DataError


class EpochLoader:
    """Batches of a map-style dataset for one epoch at a time.

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
    ) -> None:
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise DataError(
                f"dataset {type(dataset).__name__} must be map-style (define __len__ and __getitem__)"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.collate_fn = collate_fn
        self.num_samples = len(dataset)  # type: ignore[arg-type]
        if self.num_samples == 0:
            raise DataError(f"dataset {type(dataset).__name__} is empty")

    def __len__(self) -> int:
        """Batches per epoch (the last one may be short)."""
        return math.ceil(self.num_samples / self.batch_size)

    def indices(self, epoch: int) -> list[int]:
        """The sample order of ``epoch``."""
        if not self.shuffle:
            return list(range(self.num_samples))
        generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[Any]:
        """Iterate the batches of ``epoch``, beginning with batch number ``start_batch``."""
        order = self.indices(epoch)[start_batch * self.batch_size :]
        loader = DataLoader(
            self.dataset,
            batch_size=self.batch_size,
            sampler=order,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            collate_fn=self.collate_fn,
            worker_init_fn=seed_worker if self.num_workers else None,
            # The loader draws its worker base seed from this generator, not the global RNG.
            generator=torch.Generator().manual_seed(epoch_seed(self.seed, epoch) + 1),
        )
        return iter(loader)


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor in a (nested) tuple/list/dict batch to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device, non_blocking) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device, non_blocking) for k, v in batch.items()}
    return batch


def num_samples(batch: Any) -> int:
    """Samples in an ``(input, target)`` batch: the first dimension of the target (or the input)."""
    for part in (batch[1], batch[0]) if isinstance(batch, (list, tuple)) else (batch,):
        if isinstance(part, torch.Tensor) and part.dim() > 0:
            return part.shape[0]
        if isinstance(part, (list, tuple)):
            return len(part)
    raise DataError(
        f"cannot tell the batch size of a {type(batch).__name__} batch; "
        "datasets must yield (input, target) with tensors that have a batch dimension"
    )


def seed_worker(worker_id: int) -> None:
    """``worker_init_fn`` for DataLoader: seed python and numpy in each worker from torch's worker seed.

    PyTorch seeds each worker's torch RNG (base seed + worker id) but not numpy or ``random``,
    so without this, augmentations that use them repeat across workers and differ between runs.
    """
    worker_seed = torch.initial_seed() % 2**32
    random.seed(worker_seed)
    np.random.seed(worker_seed)


def epoch_seed(seed: int, epoch: int) -> int:
    """A seed that depends only on the run seed and the epoch (data order, worker seeds)."""
    return (seed * 1_000_003 + epoch * 7_919 + 17) % 2**63
