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


def unseeded_mlp():
    """As people write factories: no seed of its own."""
    return torch.nn.Sequential(torch.nn.Linear(9, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


class Augmenting(Dataset):
    """Map-style samples augmented with torch's and numpy's global generators."""

    def __init__(self, num: int) -> None:
        g = torch.Generator().manual_seed(num)
        self.x, self.y = torch.randn(num, 9, generator=g), torch.randint(0, 4, (num,), generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.randn(9) + float(np.random.normal(scale=0.01)), self.y[i]


def augmenting_data():
    return Augmenting(320), Augmenting(64)


@pytest.mark.parametrize("source", ["parquet", "map"])
def test_the_first_run_on_a_machine_equals_every_rerun(tmp_path, monkeypatch, source):
    """An unseeded factory, ``num_workers: auto`` and an empty cache: the first run times the
    workers (the trial reads and augments batches), the rerun reads the choice from the cache,
    a third loads with another worker count — every step's loss, bit for bit."""
    import streamdata

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty-cache"))
    if source == "parquet":
        data = [
            "data.format=parquet",
            f"data.train={streamdata.write_parquet(tmp_path / 'data')}",
            "data.input=[id, f0, f1, f2, f3, f4, f5, f6, f7]",
            "data.target=label",
        ]
    else:
        data = ["data.target=test_reproducibility:augmenting_data"]

    def run(name, *extra):
        config = tk.load_config(
            None,
            [
                f"out_dir={tmp_path}",
                f"name={name}",
                "model.target=test_reproducibility:unseeded_mlp",
                *data,
                "train.max_epochs=2",
                "train.batch_size=16",
                "train.log_every=1",
                *extra,
            ],
        )
        trainer = tk.Trainer(config, progress=False)
        trainer.fit()
        rows = tk.read_metrics(tmp_path / name / "metrics.jsonl")
        return trainer, rows

    first, first_rows = run("first")
    second, second_rows = run("second")
    third, third_rows = run(
        "third", "data.num_workers=2" if first.data.tuning.num_workers != 2 else "data.num_workers=0"
    )
    trial, cached = ([r for r in rows if r["kind"] == "data_workers"][0] for rows in (first_rows, second_rows))
    assert not trial["cached"] and cached["cached"]  # the first run timed the workers, the second did not
    losses = [[r["loss"] for r in rows if r["kind"] == "train"] for rows in (first_rows, second_rows, third_rows)]
    assert losses[0] == losses[1] == losses[2] and len(losses[0]) > 20
    for trainer in (second, third):
        assert all(
            torch.equal(a, b) for a, b in zip(first.model.state_dict().values(), trainer.model.state_dict().values())
        )


def test_batch_seeds_seed_what_the_data_code_draws_from_and_put_the_callers_back():
    from torchkeel.rng import BatchSeeds, isolated_rng

    seeds = BatchSeeds()
    for batch in range(BatchSeeds.PROBE_BATCHES + 4):  # past the probes: numpy alone is still fenced off
        np.random.seed(3)
        torch.manual_seed(3)
        with seeds(1, batch):
            drawn = np.random.rand(2)
        with isolated_rng(1, batch):
            expected = np.random.rand(2)  # what a worker draws for this batch
        assert np.array_equal(drawn, expected)
        assert np.random.rand() == np.random.RandomState(3).rand()  # the caller's stream, untouched
        assert torch.equal(torch.rand(1), torch.rand(1, generator=torch.Generator().manual_seed(3)))
