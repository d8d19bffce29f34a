"""The journeys' data, as users have it: the same samples as map-style datasets, Parquet files and
WebDataset shards, as ``(input, target)`` pairs or as dicts for a transformers-shaped model —
each with two bad samples (ids 5 and 9) of the kinds that source really has.

Sample ``i`` carries its id: column 0 of a pair's input, the first two tokens of a sequence.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from journeymodels import ID_BASE, NUM_CLASSES, NUM_FEATURES, VOCAB

NUM_TRAIN, NUM_VAL = 2048, 256
BAD = (5, 9)


def pairs(num: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``[num, 1 + NUM_FEATURES]`` inputs (column 0 the id) and their labels."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num, NUM_FEATURES)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64) + 2 * (x[:, 1] > 0).astype(np.int64)
    assert y.max() < NUM_CLASSES
    return np.concatenate([np.arange(num, dtype=np.float32)[:, None], x], axis=1), y


def tokens(num: int, seed: int) -> list[np.ndarray]:
    """Sequences of 6 to 26 tokens: the id in two tokens, then a count by a step of its own."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num):
        n, start, step = int(rng.integers(4, 25)), int(rng.integers(1, VOCAB)), int(rng.integers(1, 4))
        head = [1 + i // ID_BASE, 1 + i % ID_BASE]
        out.append(np.array(head + (1 + (start + step * np.arange(n)) % (VOCAB - 1)).tolist(), dtype=np.int64))
    return out


class MapPairs(torch.utils.data.Dataset):
    """Pairs from a ``.npz`` file; sample 5 cannot be read, sample 9 has one feature too few."""

    def __init__(self, path: str, bad: bool) -> None:
        data = np.load(path)
        self.x, self.y, self.bad = data["x"], data["y"], bad

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.bad and i == 5:
            raise ValueError(f"record {i} is corrupt")
        x = torch.from_numpy(self.x[i])
        return (x[:-1] if self.bad and i == 9 else x), torch.tensor(int(self.y[i]))


class MapTokens(torch.utils.data.Dataset):
    """Token dicts from a ``.json`` file; samples 5 and 9 cannot be read."""

    def __init__(self, path: str, bad: bool) -> None:
        self.items = [np.array(s, dtype=np.int64) for s in json.loads(Path(path).read_text())]
        self.bad = bad

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if self.bad and i in BAD:
            raise ValueError(f"record {i} is corrupt")
        ids = torch.from_numpy(self.items[i])
        return {"input_ids": ids, "labels": ids.clone()}


def map_pairs(root: str) -> tuple[MapPairs, MapPairs]:
    return MapPairs(f"{root}/train.npz", True), MapPairs(f"{root}/val.npz", False)


def map_tokens(root: str) -> tuple[MapTokens, MapTokens]:
    return MapTokens(f"{root}/train.json", True), MapTokens(f"{root}/val.json", False)


def write(source: str, batch: str, root: Path) -> tuple[dict[str, Any], list[str]]:
    """Write the data; return the config's ``data`` section and the names the bad samples get."""
    root.mkdir(parents=True, exist_ok=True)
    writer = {
        ("map", "pair"): _map_pairs,
        ("map", "dict"): _map_tokens,
        ("parquet", "pair"): _parquet_pairs,
        ("parquet", "dict"): _parquet_tokens,
        ("webdataset", "pair"): _shard_pairs,
        ("webdataset", "dict"): _shard_tokens,
    }[(source, batch)]
    data, bad = writer(root)
    if batch == "dict":
        data["collate"] = "pad"
    return data, bad


def _map_pairs(root: Path) -> tuple[dict[str, Any], list[str]]:
    for split, num, seed in (("train", NUM_TRAIN, 1), ("val", NUM_VAL, 2)):
        x, y = pairs(num, seed)
        np.savez(root / f"{split}.npz", x=x, y=y)
    return {"target": "journeydata:map_pairs", "args": {"root": str(root)}}, ["dataset index 5", "dataset index 9"]


def _map_tokens(root: Path) -> tuple[dict[str, Any], list[str]]:
    for split, num, seed in (("train", NUM_TRAIN, 1), ("val", NUM_VAL, 2)):
        (root / f"{split}.json").write_text(json.dumps([s.tolist() for s in tokens(num, seed)]))
    return {"target": "journeydata:map_tokens", "args": {"root": str(root)}}, ["dataset index 5", "dataset index 9"]


def _parquet_pairs(root: Path) -> tuple[dict[str, Any], list[str]]:
    """One list column of 9 values per row (id and features): row 9 has 8; row 5's label is null."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    names = []
    for split, num, seed, files in (("train", NUM_TRAIN, 1, 4), ("val", NUM_VAL, 2, 1)):
        x, y = pairs(num, seed)
        per_file = num // files
        for f in range(files):
            rows = range(f * per_file, (f + 1) * per_file)
            values = [x[i].tolist()[: 8 if split == "train" and i == 9 else None] for i in rows]
            labels = [None if split == "train" and i == 5 else int(y[i]) for i in rows]
            path = root / split / f"part-{f}.parquet"
            path.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(
                pa.table(
                    {"x": pa.array(values, type=pa.list_(pa.float32())), "label": pa.array(labels, type=pa.int64())}
                ),
                path,
                row_group_size=128,
            )
            names += [f"{path} row {i - f * per_file}" for i in BAD if split == "train" and i in rows]
    data = {
        "format": "parquet",
        "train": str(root / "train" / "*.parquet"),
        "val": str(root / "val" / "*.parquet"),
        "input": "x",
        "target": "label",
    }
    return data, names


def _parquet_tokens(root: Path) -> tuple[dict[str, Any], list[str]]:
    """List columns ``input_ids`` and ``labels``: row 5's input_ids and row 9's labels are null."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    names = []
    for split, num, seed, files in (("train", NUM_TRAIN, 1, 4), ("val", NUM_VAL, 2, 1)):
        seqs = tokens(num, seed)
        per_file = num // files
        for f in range(files):
            rows = range(f * per_file, (f + 1) * per_file)
            ids = [None if split == "train" and i == 5 else seqs[i].tolist() for i in rows]
            labels = [None if split == "train" and i == 9 else seqs[i].tolist() for i in rows]
            path = root / split / f"part-{f}.parquet"
            path.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(
                pa.table(
                    {
                        "input_ids": pa.array(ids, type=pa.list_(pa.int64())),
                        "labels": pa.array(labels, type=pa.list_(pa.int64())),
                    }
                ),
                path,
                row_group_size=128,
            )
            names += [f"{path} row {i - f * per_file}" for i in BAD if split == "train" and i in rows]
    data = {
        "format": "parquet",
        "train": str(root / "train" / "*.parquet"),
        "val": str(root / "val" / "*.parquet"),
        "columns": ["input_ids", "labels"],
    }
    return data, names


def _tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for name, payload in members:
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def _shards(root: Path, members: Any, keys: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """8 training shards and 1 validation shard; ``members(split, i)`` gives sample ``i``'s members."""
    for split, num, shards in (("train", NUM_TRAIN, 8), ("val", NUM_VAL, 1)):
        per_shard = num // shards
        for s in range(shards):
            _tar(
                root / f"{split}-{s:06d}.tar",
                [m for i in range(s * per_shard, (s + 1) * per_shard) for m in members(split, i)],
            )
    data = {
        "format": "webdataset",
        "train": str(root / "train-{000000..000007}.tar"),
        "val": str(root / "val-000000.tar"),
        **keys,
    }
    return data, [f"{root / 'train-000000.tar'} key {i:06d}" for i in BAD]


def _shard_pairs(root: Path) -> tuple[dict[str, Any], list[str]]:
    """Members ``.npy`` and ``.cls``: sample 5's npy is garbage, sample 9 has no ``.cls``."""
    data = {"train": pairs(NUM_TRAIN, 1), "val": pairs(NUM_VAL, 2)}

    def members(split: str, i: int) -> list[tuple[str, bytes]]:
        (x, y), bad = data[split], split == "train" and i in BAD
        out = [(f"{i:06d}.npy", b"not an npy file" if bad and i == 5 else _npy(x[i]))]
        return out if bad and i == 9 else out + [(f"{i:06d}.cls", str(int(y[i])).encode())]

    return _shards(root, members, {"input": "npy", "target": "cls"})


def _shard_tokens(root: Path) -> tuple[dict[str, Any], list[str]]:
    """Members ``input_ids.npy`` and ``labels.npy``: sample 5's input_ids is garbage, sample 9 has no labels."""
    data = {"train": tokens(NUM_TRAIN, 1), "val": tokens(NUM_VAL, 2)}

    def members(split: str, i: int) -> list[tuple[str, bytes]]:
        seq, bad = data[split][i], split == "train" and i in BAD
        out = [(f"{i:06d}.input_ids.npy", b"garbage" if bad and i == 5 else _npy(seq))]
        return out if bad and i == 9 else out + [(f"{i:06d}.labels.npy", _npy(seq))]

    return _shards(root, members, {"input": None, "target": None})
