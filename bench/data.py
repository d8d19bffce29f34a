"""Data loading figures, as ratios measured in one run (interleaved rounds, medians of per-round ratios).

Not a test: it prints figures. Three comparisons:

1. Parquet, ROWS rows x 32 float columns (row groups of 64 Ki rows): the torchkeel source
   (``StreamLoader`` over ``ParquetSource``, shuffled, in the process) vs a hand-written
   ``pyarrow.dataset`` scanner loop (``to_batches`` → numpy → tensor, file order) vs a map-style
   dataset that reads one row per item (the pattern the field notes warn about; timed on a
   few thousand items). Goal: torchkeel >= 0.9 x the hand-written scanner.
2. A CPU-bound ``__getitem__`` (a few ms of numpy per sample): ``num_workers: auto`` (the
   trial's choice, fresh cache) vs 0 vs the best of an exhaustive sweep (0 … CPUs + 1), each
   timed over full epochs. Goals on 2 cores: auto >= 0.9 x the best and >= 1.6 x workers=0.
3. The exactly-once, resumable machinery (``EpochLoader``: seeded order, bad-sample guard,
   persistent workers) vs a plain ``DataLoader`` over the same map-style data, step time of a
   small MLP's training loop. Goal <= 1.05 x.

    python bench/data.py [--rows 1000000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import torchkeel as tk
from torchkeel.data.tune import candidates

BATCH = 256
COLUMNS = [f"c{j}" for j in range(32)]


def write_table(path: Path, rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    table = pa.table(
        {name: rng.normal(size=rows).astype(np.float32) for name in COLUMNS} | {"label": rng.integers(0, 10, size=rows)}
    )
    pq.write_table(table, path, row_group_size=65536)


def rate(batches, limit: int | None = None) -> float:
    """Samples per second over ``batches`` (at most ``limit`` samples)."""
    start, samples = time.perf_counter(), 0
    for batch in batches:
        samples += len(batch[1])
        if limit is not None and samples >= limit:
            break
    return samples / (time.perf_counter() - start)


def torchkeel_parquet(path: Path, epoch: int) -> float:
    source = tk.ParquetSource(str(path), input=COLUMNS, target="label")
    return rate(tk.StreamLoader(source, BATCH, seed=0, num_workers=0).epoch(epoch))


def scanner(path: Path) -> float:
    import pyarrow.dataset as ds

    def batches():
        for record_batch in ds.dataset(str(path), format="parquet").to_batches(
            columns=[*COLUMNS, "label"], batch_size=BATCH
        ):
            x = np.column_stack([record_batch.column(i).to_numpy() for i in range(len(COLUMNS))])
            labels = np.array(record_batch.column(len(COLUMNS)).to_numpy(zero_copy_only=False))
            yield torch.from_numpy(x), torch.from_numpy(labels)

    return rate(batches())


class RowPerItem(Dataset):
    """Reads one row from the file per item."""

    def __init__(self, path: Path) -> None:
        import pyarrow.dataset as ds

        self.dataset = ds.dataset(str(path), format="parquet")
        self.rows = self.dataset.count_rows()

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int):
        row = self.dataset.take([i], columns=[*COLUMNS, "label"])
        x = np.array([row.column(j)[0].as_py() for j in range(len(COLUMNS))], dtype=np.float32)
        return torch.from_numpy(x), torch.tensor(row.column(len(COLUMNS))[0].as_py())


def row_per_item(path: Path) -> float:
    loader = DataLoader(RowPerItem(path), batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(0))
    return rate(loader, limit=BATCH)  # about 13 rows/s: a few seconds are enough


class Busy(Dataset):
    """A few ms of single-threaded numpy per sample."""

    def __len__(self) -> int:
        return 768

    def __getitem__(self, i: int):
        a = np.random.default_rng(i).normal(size=30000)
        for _ in range(3):
            a = np.sort(np.sin(a))
        return torch.from_numpy(a[:8].astype(np.float32)), torch.tensor(i % 2)


def busy_epochs(num_workers: int, epochs: int = 2) -> float:
    """Samples/s over ``epochs`` full epochs after the first batch (persistent workers)."""
    loader = tk.EpochLoader(Busy(), 16, seed=0, num_workers=num_workers)
    batches = loader.epoch(0)
    next(batches)  # workers up
    start, samples = time.perf_counter(), 0
    for batch in batches:
        samples += len(batch[1])
    for epoch in range(1, epochs):
        samples += sum(len(b[1]) for b in loader.epoch(epoch))
    loader.close()
    return samples / (time.perf_counter() - start)


def step_time(make_batches, steps: int) -> float:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    start, done = 0.0, 0
    for epoch in range(2):
        for inputs, targets in make_batches(epoch):
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(inputs), targets).backward()
            optimizer.step()
            done += 1
            if done == 10:
                start = time.perf_counter()
    return (time.perf_counter() - start) / (done - 10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "table.parquet"
        write_table(path, args.rows)
        print(f"1. Parquet, {args.rows} rows x 32 float columns, batch {BATCH}, {args.rounds} rounds")
        ours, hand, single = [], [], []
        for round_ in range(args.rounds):
            pair = [lambda: torchkeel_parquet(path, round_), lambda: scanner(path)]
            first, second = pair if round_ % 2 == 0 else pair[::-1]
            a, b = first(), second()
            ours.append(a if round_ % 2 == 0 else b)
            hand.append(b if round_ % 2 == 0 else a)
            if round_ == 0:
                single.append(row_per_item(path))
        print(f"   torchkeel source      {statistics.median(ours):12.0f} samples/s")
        print(f"   hand-written scanner  {statistics.median(hand):12.0f} samples/s")
        print(f"   one row per item      {statistics.median(single):12.0f} samples/s")
        ratio = statistics.median(a / b for a, b in zip(ours, hand))
        print(f"   torchkeel / scanner   {ratio:.3f}   (goal >= 0.9)")
        print(f"   torchkeel / row-per-item {statistics.median(ours) / statistics.median(single):.0f} x")

    print(f"\n2. CPU-bound __getitem__, {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as cache:
        choice = tk.tune_workers(
            lambda n: tk.EpochLoader(Busy(), 16, seed=0, num_workers=n), fingerprint="bench", cache_dir=cache
        )
    print(choice.table())
    counts = sorted(set(candidates()) | {max(candidates()) + 1})
    sweep: dict[int, list[float]] = {n: [] for n in counts}
    for round_ in range(max(2, args.rounds // 2)):
        for n in counts[round_ % len(counts) :] + counts[: round_ % len(counts)]:
            sweep[n].append(busy_epochs(n))
    medians = {n: statistics.median(v) for n, v in sweep.items()}
    for n, value in medians.items():
        print(f"   workers={n}: {value:8.1f} samples/s")
    best = max(medians.values())
    auto = medians.get(choice.num_workers) or busy_epochs(choice.num_workers)
    print(
        f"   auto chose {choice.num_workers}: {auto / best:.3f} x the best (goal >= 0.9), "
        f"{auto / medians[0]:.2f} x workers=0 (goal >= 1.6)"
    )

    print("\n3. exactly-once/resumable EpochLoader vs plain DataLoader, MLP step time, map-style data")
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(300 * 64, 64, generator=g), torch.randint(0, 10, (300 * 64,), generator=g))
    loader = tk.EpochLoader(data, 64, seed=0)
    ours_t, plain_t = [], []
    for round_ in range(args.rounds * 3):
        runs = [
            lambda: step_time(loader.epoch, 600),
            lambda: step_time(
                lambda e: DataLoader(data, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(e)), 600
            ),
        ]
        if round_ % 2:
            runs.reverse()
        a, b = runs[0](), runs[1]()
        ours_t.append(a if round_ % 2 == 0 else b)
        plain_t.append(b if round_ % 2 == 0 else a)
    print(
        f"   EpochLoader {statistics.median(ours_t) * 1e6:8.1f} us/step, DataLoader {statistics.median(plain_t) * 1e6:8.1f} us/step"
    )
    print(f"   ratio {statistics.median(a / b for a, b in zip(ours_t, plain_t)):.3f}   (goal <= 1.05)")


if __name__ == "__main__":
    main()
