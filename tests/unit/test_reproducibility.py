"""Same seed and config → bitwise identical weights; data order depends only on (seed, epoch)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

import torchkeel as tk


def trained_weights(tiny_config, name, *overrides):
    trainer = tk.Trainer(tiny_config(f"name={name}", *overrides), progress=False)
    trainer.fit()
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


def test_same_seed_bitwise_identical(tiny_config):
    a = trained_weights(tiny_config, "a", "train.accumulate=2")
    b = trained_weights(tiny_config, "b", "train.accumulate=2")
    c = trained_weights(tiny_config, "c", "train.accumulate=2", "seed=1")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_seed_everything_seeds_every_generator():
    draws = []
    for _ in range(2):
        tk.seed_everything(123)
        draws.append((random.random(), np.random.rand(), torch.rand(1).item()))
    assert draws[0] == draws[1]


def test_epoch_order_depends_only_on_seed_and_epoch():
    data = TensorDataset(torch.arange(50), torch.arange(50))
    loader = tk.EpochLoader(data, 8, seed=7)
    torch.manual_seed(0)
    first = loader.indices(1)
    torch.rand(100)  # the global RNG does not matter
    assert tk.EpochLoader(data, 8, seed=7).indices(1) == first
    assert loader.indices(2) != first and sorted(first) == list(range(50))
    assert tk.EpochLoader(data, 8, seed=8).indices(1) != first
    # Starting mid-epoch gives exactly the remaining batches.
    full = [b[0].tolist() for b in loader.epoch(1)]
    assert [b[0].tolist() for b in loader.epoch(1, start_batch=3)] == full[3:]
    assert len(loader) == 7 and len(full[-1]) == 2


class NumpyNoise(Dataset):
    """An 'augmentation' drawn from numpy's global RNG, as many user datasets do."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        worker = torch.utils.data.get_worker_info()
        return torch.tensor([np.random.rand(), float(worker.id if worker else -1)]), i


def test_workers_are_seeded_and_reproducible():
    def draws():
        loader = tk.EpochLoader(NumpyNoise(), 4, seed=11, num_workers=2)
        return torch.cat([x for x, _ in loader.epoch(0)])

    a, b = draws(), draws()
    assert torch.equal(a, b)
    by_worker = {int(w): [] for w in a[:, 1]}
    for value, worker in a.tolist():
        by_worker[int(worker)].append(value)
    assert len(by_worker) == 2
    w0, w1 = by_worker.values()
    assert w0[:2] != w1[:2]  # workers do not repeat each other's draws


def test_epoch_loader_rejects_empty_and_iterable_datasets():
    with pytest.raises(tk.DataError, match="is empty"):
        tk.EpochLoader(TensorDataset(torch.zeros(0)), 4)
    with pytest.raises(tk.DataError, match="must be map-style"):
        tk.EpochLoader(iter([1, 2]), 4)
