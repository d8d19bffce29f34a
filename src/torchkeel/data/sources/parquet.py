"""Parquet files through ``pyarrow.dataset``: row groups are the units of work.

A row group is read once with only the needed columns, put in its seeded order (a permutation
of its rows, or length buckets with ``bucket_by``) and turned into tensors column by column —
no Python loop per value, unless samples are wanted one by one (a per-sample transform, a
ragged column, a custom collate).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from torchkeel.data.order import Unit, bucket_order
from torchkeel.data.sources import Bad, Rows, Sample, expand_paths, files_fingerprint
from torchkeel.errors import ConfigError, MissingExtraError


class ParquetSource:
    """Samples ``(input, target)`` — or dicts of columns — from Parquet files.

    Args:
        paths: files, globs, brace patterns or directories.
        input: the feature columns (stacked into one float vector per row) or one list-valued
            column (a vector or a variable-length sequence per row).
        target: the label column (``None``: samples are the input alone).
        columns: instead of ``input``/``target``: samples are dicts of these columns, one
            tensor each (a number, a vector or a variable-length sequence) — the batch of a
            ``model(**batch)`` (``input_ids``, ``labels``).
        bucket_by: a list-valued column whose lengths group similar rows (see ``docs/data.md``).
        bucket_window: rows sorted together when bucketing.
        fixed_length: a list-valued input column holds vectors of one length (the batches are
            stacked, not padded): a row of another length than most rows of its row group is a
            bad sample, named, instead of a batch that cannot be stacked.

    Example::

        source = ParquetSource("data/train/*.parquet", input=["f0", "f1"], target="label")
    """

    def __init__(
        self,
        paths: str | Sequence[str],
        *,
        input: str | Sequence[str] | None = None,
        target: str | None = None,
        columns: Sequence[str] | None = None,
        bucket_by: str | None = None,
        bucket_window: int = 4096,
        key: str = "data.train",
        fixed_length: bool = False,
    ) -> None:
        try:
            import pyarrow.dataset as ds
        except ImportError:
            raise MissingExtraError("data", "pyarrow", "format: parquet") from None
        self.paths = expand_paths(paths, key, ".parquet")
        if (input is None) == (not columns):
            raise ConfigError(
                "data.input or data.columns (not both): the feature columns of (input, target) "
                "samples, or the columns of dict samples"
            )
        self.input = [] if input is None else [input] if isinstance(input, str) else list(input)
        self.keys = list(columns or [])
        self.target = target
        self.bucket_by = bucket_by
        self.bucket_window = bucket_window
        self.fixed_length = fixed_length
        dataset = ds.dataset(self.paths, format="parquet")
        names = set(dataset.schema.names)
        for what, column in [
            *(("input", c) for c in self.input),
            *(("columns", c) for c in self.keys),
            ("target", target),
            ("bucket_by", bucket_by),
        ]:
            if column is not None and column not in names:
                raise ConfigError(
                    f"data.{what}: column '{column}' is not in '{self.paths[0]}' (columns: {', '.join(sorted(names))})"
                )
        self.columns = list(
            dict.fromkeys([*self.input, *self.keys, *([target] if target else []), *([bucket_by] if bucket_by else [])])
        )
        self._units: list[Unit] = []
        self._groups: list[tuple[int, int, int]] = []  # (file, row group, first row in the file)
        for file_index, fragment in enumerate(dataset.get_fragments()):
            offset = 0
            for group in fragment.row_groups:
                self._units.append(Unit(f"{self.paths[file_index]} row group {group.id}", group.num_rows))
                self._groups.append((file_index, group.id, offset))
                offset += group.num_rows
        self._fragments: list[Any] | None = None  # opened lazily in each worker

    def units(self) -> list[Unit]:
        return self._units

    def fingerprint(self) -> str:
        return json.dumps(["parquet", files_fingerprint(self.paths), self.columns])

    def where(self, unit: int, row: int) -> str:
        file_index, _, offset = self._groups[unit]
        return f"{self.paths[file_index]} row {offset + row}"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fragments": None}

    def read(
        self, unit: int, first: int, rng: np.random.Generator | None, *, as_samples: bool
    ) -> Iterator[Rows | Sample | Bad]:
        table = self._read_table(unit)
        n = table.num_rows
        order = self._order(table, rng)
        reasons = self._bad_rows(table)
        positions = np.arange(first, n)
        rows = order[first:]
        if reasons:
            is_bad = np.isin(rows, np.fromiter(reasons, dtype=np.int64, count=len(reasons)))
            for pos in positions[is_bad]:
                row = int(order[pos])
                yield Bad(self.where(unit, row), reasons[row], int(pos) + 1)
            positions, rows = positions[~is_bad], rows[~is_bad]
        if not rows.size:
            return
        if self.keys:
            yield from self._dicts(table, unit, positions, rows, as_samples)
            return
        inputs, ragged = self._column_tensor(table, self.input, rows)
        targets = self._column_tensor(table, [self.target], rows)[0] if self.target else None
        if not as_samples and ragged is None:
            data = inputs if targets is None else (inputs, targets)
            yield Rows(data, positions + 1, rows)
            return
        for i, (pos, row) in enumerate(zip(positions.tolist(), rows.tolist())):
            x = ragged[i] if ragged is not None else inputs[i]
            yield Sample(x if targets is None else (x, targets[i]), pos + 1, self.where(unit, row))

    def _dicts(
        self, table: Any, unit: int, positions: np.ndarray, rows: np.ndarray, as_samples: bool
    ) -> Iterator[Rows | Sample]:
        """Dict samples of ``keys``: one block when every column is regular, else row by row."""
        parts = {name: self._column_tensor(table, [name], rows) for name in self.keys}
        if not as_samples and all(ragged is None for _, ragged in parts.values()):
            yield Rows({name: tensor for name, (tensor, _) in parts.items()}, positions + 1, rows)
            return
        for i, (pos, row) in enumerate(zip(positions.tolist(), rows.tolist())):
            sample = {name: ragged[i] if ragged is not None else tensor[i] for name, (tensor, ragged) in parts.items()}
            yield Sample(sample, pos + 1, self.where(unit, row))

    def _read_table(self, unit: int) -> Any:
        if self._fragments is None:
            import pyarrow.dataset as ds

            self._fragments = list(ds.dataset(self.paths, format="parquet").get_fragments())
        file_index, group, _ = self._groups[unit]
        return self._fragments[file_index].subset(row_group_ids=[group]).to_table(columns=self.columns)

    def _order(self, table: Any, rng: np.random.Generator | None) -> np.ndarray:
        """The row group's seeded order: a permutation (file order without ``rng``), then sorted
        by length within windows."""
        order = rng.permutation(table.num_rows) if rng is not None else np.arange(table.num_rows)
        if self.bucket_by is None:
            return order
        lengths = _lengths(table.column(self.bucket_by).combine_chunks())
        return bucket_order(order, lengths, self.bucket_window, rng or np.random.default_rng(0))

    def _bad_rows(self, table: Any) -> dict[int, str]:
        """Rows that cannot be samples, and why: a null in a needed column; with
        ``fixed_length``, a list of another length than most rows of the row group."""
        import pyarrow as pa

        reasons: dict[int, str] = {}
        for name in self.columns:
            column = table.column(name)
            if column.null_count:
                for row in np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False)).tolist():
                    reasons.setdefault(row, f"a null value in column '{name}'")
        for name in (self.input if len(self.input) == 1 else []) + self.keys if self.fixed_length else []:
            column = table.column(name).combine_chunks()
            if _is_list(pa, column.type) and not pa.types.is_fixed_size_list(column.type):
                lengths = _lengths(column)
                values, counts = np.unique(lengths, return_counts=True)
                if len(values) > 1:
                    common = int(values[np.argmax(counts)])
                    for row in np.flatnonzero(lengths != common).tolist():
                        reasons.setdefault(
                            row,
                            f"column '{name}' holds {int(lengths[row])} values in this "
                            f"row, {common} in the others of its row group",
                        )
        return reasons

    def _column_tensor(
        self, table: Any, names: list[str], rows: np.ndarray
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """Rows ``rows`` of ``names`` as one tensor ``[rows, features]`` (or ``[rows]`` for one
        scalar column); a ragged list column comes back as a list of tensors instead."""
        import pyarrow as pa

        columns = [_without_nulls(table.column(name).combine_chunks()) for name in names]
        if len(columns) == 1 and _is_list(pa, columns[0].type):
            column = columns[0]
            values = _numpy(column.flatten())
            lengths = _lengths(column)
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            wanted = lengths[rows]
            if wanted.size and (wanted == wanted[0]).all():
                index = offsets[rows][:, None] + np.arange(wanted[0])
                return torch.from_numpy(values[index]), None
            values = values if values.flags.writeable else values.copy()  # slices of Arrow's buffer are read-only
            return torch.empty(0), [torch.from_numpy(values[offsets[r] : offsets[r + 1]]) for r in rows.tolist()]
        arrays = [_numpy(c) for c in columns]
        if len(arrays) == 1:
            return torch.from_numpy(arrays[0][rows]), None
        dtype = np.result_type(*arrays)
        out = np.empty((len(rows), len(arrays)), dtype=np.float32 if dtype == np.float64 else dtype)
        for j, array in enumerate(arrays):
            out[:, j] = array[rows]
        return torch.from_numpy(out), None


def _without_nulls(array: Any) -> Any:
    """The column with its nulls filled (their rows are bad samples, skipped), so that it keeps
    its type: a null turns an integer column into floats for numpy."""
    import pyarrow as pa

    kind = array.type
    if not array.null_count or not (
        pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)
    ):
        return array  # list columns: flatten() leaves null entries out
    return array.fill_null(pa.scalar(False if pa.types.is_boolean(kind) else 0, type=kind))


def _numpy(array: Any) -> np.ndarray:
    values = array.to_numpy(zero_copy_only=False)
    if values.dtype == np.float64:
        values = values.astype(np.float32)
    elif values.dtype == object:
        raise ConfigError(f"column of type {array.type} cannot be a tensor; use numeric columns")
    return values


def _is_list(pa: Any, type_: Any) -> bool:
    return pa.types.is_list(type_) or pa.types.is_large_list(type_) or pa.types.is_fixed_size_list(type_)


def _lengths(column: Any) -> np.ndarray:
    return np.asarray(column.value_lengths().fill_null(0).to_numpy(zero_copy_only=False), dtype=np.int64)
