"""Streaming sources: data cut into units of work (Parquet row groups, WebDataset shards, chunks
of text files).

A source lists its units and reads one from a position. It yields ``Rows`` (a columnar block of
samples, already tensors) or ``Sample`` (one sample), and ``Bad`` for a sample it could not read
or decode — never a replacement for it. ``torchkeel.data.stream`` turns them into batches.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from torchkeel.data.order import Unit
from torchkeel.errors import ConfigError


@dataclass
class Rows:
    """Samples as one columnar block: ``data`` is a batch (tensors with ``len(ends)`` rows);
    row ``i`` ends at unit position ``ends[i]``; ``rows`` are the rows' numbers in the unit."""

    data: Any
    ends: np.ndarray
    rows: np.ndarray


@dataclass
class Sample:
    """One sample; ``end`` is the unit position after it, ``where`` names it for errors."""

    data: Any
    end: int
    where: str


@dataclass
class Bad:
    """A sample that could not be read, decoded or transformed: where it is and why."""

    where: str
    error: str
    end: int


class Source(Protocol):
    """What the stream loader needs from a source (see ``ParquetSource``, ``WebDatasetSource``)."""

    def units(self) -> list[Unit]:
        """The units of work, each with its number of samples."""

    def read(
        self, unit: int, first: int, rng: np.random.Generator | None, *, as_samples: bool
    ) -> Iterator[Rows | Sample | Bad]:
        """Unit ``unit`` in its seeded order (``rng``; ``None``: file order), from position
        ``first`` to its end."""

    def fingerprint(self) -> str:
        """Identifies the data (paths, sizes, modification times, columns) for caches."""

    def where(self, unit: int, row: int) -> str:
        """Names sample ``row`` of ``unit`` for a person."""


def expand_paths(
    pattern: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], key: str, suffix: str | tuple[str, ...]
) -> list[str]:
    """Files of a glob, a brace pattern (``train-{000..099}.tar``), a directory (its files ending
    in ``suffix``, or one of the suffixes) or a list of them."""
    from braceexpand import braceexpand

    suffixes = (suffix,) if isinstance(suffix, str) else suffix
    patterns = [os.fspath(p) for p in ([pattern] if isinstance(pattern, (str, os.PathLike)) else pattern)]
    paths: list[str] = []
    for item in patterns:
        for expanded in braceexpand(os.path.expanduser(item)):
            if os.path.isdir(expanded):
                paths += sorted(p for s in suffixes for p in glob.glob(os.path.join(expanded, f"*{s}")))
            elif any(ch in expanded for ch in "*?["):
                paths += sorted(glob.glob(expanded))
            elif os.path.isfile(expanded):
                paths.append(expanded)
            else:
                raise ConfigError(f"{key}: file '{expanded}' not found; check the path or pattern")
    if not paths:
        raise ConfigError(f"{key}={pattern!r} matches no {' or '.join(suffixes)} file; check the path or pattern")
    return paths


def stat_files(paths: Sequence[str]) -> dict[str, tuple[int, int]]:
    """``{absolute path: (size, mtime_ns)}``, one ``stat`` per file: what a source planned over."""
    return {os.path.abspath(p): ((s := os.stat(p)).st_size, s.st_mtime_ns) for p in paths}


def files_fingerprint(paths: Sequence[str], stats: dict[str, tuple[int, int]] | None = None) -> list[Any]:
    """``[absolute path, size, mtime in whole seconds]`` of each file, from ``stats`` if given."""
    stats = stats if stats is not None else stat_files(paths)
    return [[path, size, mtime_ns // 1_000_000_000] for path, (size, mtime_ns) in stats.items()]
