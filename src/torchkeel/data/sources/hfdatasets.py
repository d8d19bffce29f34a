"""A Hugging Face ``datasets`` dataset on disk as a map-style dataset: a directory written by
``save_to_disk``, or ``.arrow`` files ``datasets`` wrote (its cache).

``datasets`` keeps the rows in memory-mapped Arrow files, so a sample is read where it is asked
for, and the dataset is map-style: the epoch loader's seeded, exactly-once, resumable order
applies as it is. Parquet files written by ``datasets`` (``to_parquet``) are plain Parquet:
``data.format: parquet`` reads them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from torchkeel.data.sources import expand_paths
from torchkeel.errors import ConfigError, MissingExtraError, first_line


class HFDiskDataset(torch.utils.data.Dataset):
    """Samples ``{column: tensor}`` of ``columns`` from a ``datasets`` dataset on disk.

    A row with a null in one of the columns raises ``ValueError`` naming the row and the column:
    the loader skips it as a bad sample and names it, never replacing it.

    Example::

        train = HFDiskDataset("tokenized/train", ["input_ids", "labels"])
    """

    def __init__(self, path: str | Sequence[str], columns: Sequence[str], key: str = "data.train") -> None:
        try:
            import datasets
        except ImportError:
            raise MissingExtraError("datasets", "datasets", "data.format: datasets") from None
        if not columns:
            raise ConfigError(
                "data.format=datasets needs data.columns: the token columns of each sample ([input_ids, labels])"
            )
        self.columns = list(columns)
        self.location = str(path)
        dataset = _open(datasets, path, key)
        missing = [c for c in self.columns if c not in dataset.column_names]
        if missing:
            raise ConfigError(
                f"data.columns: {', '.join(repr(c) for c in missing)} not in '{self.location}' "
                f"(columns: {', '.join(dataset.column_names)})"
            )
        self.dataset = dataset.select_columns(self.columns)
        self._fingerprint = str(getattr(dataset, "_fingerprint", ""))

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.dataset[int(index)]
        sample = {}
        for name in self.columns:
            value = row[name]
            if value is None:
                raise ValueError(f"row {index} of '{self.location}': a null value in column '{name}'")
            sample[name] = torch.as_tensor(value)
        return sample

    def fingerprint(self) -> str:
        """Identifies the data for caches: ``datasets``' own fingerprint of its content and history."""
        return f"datasets:{self._fingerprint}:{len(self)}:{','.join(self.columns)}"


def _open(datasets: Any, path: str | Sequence[str], key: str) -> Any:
    """A ``save_to_disk`` directory (one split), or the ``.arrow`` files of a glob or list."""
    if isinstance(path, (str, os.PathLike)) and os.path.isdir(path):
        directory = Path(path)
        if (directory / "dataset_dict.json").is_file():
            splits = sorted(p.name for p in directory.iterdir() if (p / "state.json").is_file())
            raise ConfigError(
                f"{key}={str(path)!r} holds the splits {', '.join(splits)}; name one, e.g. '{directory / splits[0]}'"
                if splits
                else f"{key}={str(path)!r} is a DatasetDict without splits"
            )
        if not (directory / "state.json").is_file():
            raise ConfigError(f"{key}={str(path)!r} is not a directory written by save_to_disk (no state.json)")
        try:
            return datasets.load_from_disk(str(directory))
        except Exception as exc:
            raise ConfigError(f"{key}={str(path)!r} could not be read by datasets: {first_line(exc)}") from exc
    files = expand_paths(path, key, ".arrow")
    try:
        parts = [datasets.Dataset.from_file(f) for f in files]
    except Exception as exc:
        raise ConfigError(
            f"{key}: the Arrow files of {path!r} could not be read by datasets: {first_line(exc)}"
        ) from exc
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
