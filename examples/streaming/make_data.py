"""Write the example's data: Parquet files and WebDataset shards of one synthetic task.

    python examples/streaming/make_data.py data/          # then: keel train examples/streaming/parquet.yaml

Four classes of 16-feature points; each row also carries a variable-length token sequence so
that the padded/bucketed example has something to pad.
"""

from __future__ import annotations

import io
import sys
import tarfile
from pathlib import Path

import numpy as np
from torch import nn

NUM_FEATURES, NUM_CLASSES = 16, 4


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(NUM_FEATURES, 64), nn.ReLU(), nn.Linear(64, NUM_CLASSES))


def points(num: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, NUM_CLASSES, size=num)
    centers = np.random.default_rng(0).normal(scale=2.0, size=(NUM_CLASSES, NUM_FEATURES))
    return (centers[labels] + rng.normal(size=(num, NUM_FEATURES))).astype(np.float32), labels


def write_parquet(root: Path, split: str, num: int, files: int, seed: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    x, y = points(num, seed)
    rng = np.random.default_rng(seed + 1)
    out = root / "parquet" / split
    out.mkdir(parents=True, exist_ok=True)
    for f, rows in enumerate(np.array_split(np.arange(num), files)):
        table = {f"f{j}": x[rows, j] for j in range(NUM_FEATURES)}
        table["tokens"] = [rng.integers(1, 50, size=int(n)).tolist() for n in rng.integers(2, 40, size=len(rows))]
        table["label"] = y[rows]
        pq.write_table(pa.table(table), out / f"part-{f:03d}.parquet", row_group_size=256)


def write_shards(root: Path, split: str, num: int, shards: int, seed: int) -> None:
    x, y = points(num, seed)
    out = root / "shards"
    out.mkdir(parents=True, exist_ok=True)
    for s, rows in enumerate(np.array_split(np.arange(num), shards)):
        with tarfile.open(out / f"{split}-{s:06d}.tar", "w") as tar:
            for i in rows:
                buffer = io.BytesIO()
                np.save(buffer, x[i])
                for name, data in ((f"{i:08d}.npy", buffer.getvalue()), (f"{i:08d}.cls", str(int(y[i])).encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))


def main(root: str) -> None:
    path = Path(root)
    write_parquet(path, "train", 4096, files=4, seed=1)
    write_parquet(path, "val", 1024, files=1, seed=2)
    write_shards(path, "train", 4096, shards=8, seed=1)
    write_shards(path, "val", 1024, shards=2, seed=2)
    print(f"wrote {path / 'parquet'} and {path / 'shards'}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "data")
