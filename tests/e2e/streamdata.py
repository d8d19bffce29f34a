"""Small Parquet files and WebDataset shards for the streaming tests, and a step function that
logs the ids of the samples it trains on (in the training process, so prefetching is not counted)."""

from __future__ import annotations

import io
import os
import tarfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

NUM_FEATURES = 8
NUM_CLASSES = 4


def samples(num: int, seed: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """Features ``[num, 1 + NUM_FEATURES]`` (column 0 is the sample id) and labels."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num, NUM_FEATURES)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64) + 2 * (x[:, 1] > 0).astype(np.int64)
    return np.concatenate([np.arange(num, dtype=np.float32)[:, None], x], axis=1), y


def write_parquet(
    root: Path, num: int = 480, files: int = 3, row_group: int = 40, null_rows: tuple[int, ...] = ()
) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    x, y = samples(num)
    per_file = num // files
    for f in range(files):
        part = slice(f * per_file, (f + 1) * per_file)
        columns = {"id": x[part, 0]}
        for j in range(NUM_FEATURES):
            column = x[part, 1 + j].tolist()
            if j == 0:
                column = [None if f * per_file + i in null_rows else v for i, v in enumerate(column)]
            columns[f"f{j}"] = pa.array(column, type=pa.float32())
        columns["label"] = y[part]
        pq.write_table(pa.table(columns), root / f"part-{f}.parquet", row_group_size=row_group)
    return str(root / "*.parquet")


def write_shards(
    root: Path, num: int = 480, shards: int = 6, corrupt: tuple[int, ...] = (), sizes: tuple[int, ...] | None = None
) -> str:
    """``shards`` shards of ``num`` samples in all (or shards of the given ``sizes``); returns their pattern."""
    root.mkdir(parents=True, exist_ok=True)
    sizes = sizes or (num // shards,) * shards
    x, y = samples(sum(sizes))
    start = 0
    for s, size in enumerate(sizes):
        with tarfile.open(root / f"train-{s:06d}.tar", "w") as tar:
            for i in range(start, start + size):
                buffer = io.BytesIO()
                np.save(buffer, x[i])
                payload = b"not an npy file" if i in corrupt else buffer.getvalue()
                for name, data in ((f"{i:06d}.npy", payload), (f"{i:06d}.cls", str(int(y[i])).encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        start += size
    return str(root / ("train-{000000..%06d}.tar" % (len(sizes) - 1)))


class Model(nn.Module):
    """An MLP that ignores the id column."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(NUM_FEATURES, 32), nn.ReLU(), nn.Linear(32, NUM_CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x[:, 1:])


def make_model() -> nn.Module:
    return Model()


def logged_step(model: nn.Module, batch) -> torch.Tensor:
    """Cross-entropy, after appending the batch's sample ids to ``$STREAM_LOG`` (one per line)."""
    x, y = batch
    path = os.environ.get("STREAM_LOG")
    if path:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, "".join(f"{int(i)}\n" for i in x[:, 0].tolist()).encode())
        os.close(fd)
    delay = float(os.environ.get("STREAM_DELAY", "0"))
    if delay:
        time.sleep(delay)
    return nn.functional.cross_entropy(model(x), y)
