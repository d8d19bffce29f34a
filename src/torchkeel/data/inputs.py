"""What a run's data plan was made from, so that a resume can tell whether it still holds.

A checkpoint records, for each data source the config names (``data.train``, ``data.val``), the
identity of every file it plans over — the tokenizer's files too — as
``{path: [size, mtime_ns, head_tail]}``, where ``head_tail`` hashes the first and last
``EDGE_BYTES`` of the file (xxh3, two reads of 4 KiB whatever the file's size). A resume takes
the hash from its checkpoint for a file whose size and mtime are unchanged, and the size and
mtime from the ``stat`` the source made as it planned (a source's ``file_stats``; otherwise one
``stat`` per file): only a fresh run, or a file whose ``stat`` changed, is read.

A file that was edited, appended to, replaced, removed or added since changes the plan (which
blocks, rows or samples exist, in which order), so a resume stops unless told to continue
(``--allow-data-change``).

Map-style datasets built by code have no files to name: they are not fingerprinted.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import xxhash

EDGE_BYTES = 4096

Inputs = dict[str, dict[str, list[Any]]]
"""``{"data.train": {path: [size, mtime_ns, head_tail]}, ...}``."""


def file_identity(path: str, known: Sequence[Any] | None = None, stat: tuple[int, int] | None = None) -> list[Any]:
    """``[size, mtime_ns, head_tail]`` of ``path`` (see the module docstring). ``known``: the
    identity recorded before, whose hash is kept when size and mtime are unchanged; ``stat``:
    ``(size, mtime_ns)`` as the source planned over the file (``None``: ``stat`` it now)."""
    if stat is None:
        result = os.stat(path)
        stat = (result.st_size, result.st_mtime_ns)
    size, mtime_ns = stat
    if known is not None and list(known[:2]) == [size, mtime_ns]:
        return list(known)
    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        digest.update(f.read(EDGE_BYTES))
        if size > EDGE_BYTES:
            f.seek(max(EDGE_BYTES, size - EDGE_BYTES))
            digest.update(f.read(EDGE_BYTES))
    return [size, mtime_ns, digest.hexdigest()]


def source_files(source: Any) -> list[str] | None:
    """The files a data source plans over (its ``input_files``, else its ``paths``); ``None`` for
    data that names no files (a map-style dataset)."""
    files = getattr(source, "input_files", None)
    if files is None:
        files = getattr(source, "paths", None)
    return None if files is None else [os.path.abspath(p) for p in files]


def fingerprint_inputs(sources: Mapping[str, Any], known: Mapping[str, Any] | None = None) -> Inputs:
    """The identity of every file of each source in ``sources`` (config key → source); ``known``:
    the inputs a checkpoint recorded (their hashes are reused where the ``stat`` is unchanged)."""
    inputs: Inputs = {}
    for key, source in sources.items():
        files = source_files(source) if source is not None else None
        if files is not None:
            before, stats = (known or {}).get(key) or {}, getattr(source, "file_stats", None) or {}
            inputs[key] = {path: file_identity(path, before.get(path), stats.get(path)) for path in files}
    return inputs


def input_changes(saved: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, dict[str, list[str]]]:
    """``{key: {"changed": [...], "missing": [...], "added": [...]}}`` for each source whose files
    differ; a source only one side fingerprinted (map-style data, an older checkpoint) is not compared."""
    found: dict[str, dict[str, list[str]]] = {}
    for key in sorted(set(saved) & set(current)):
        old, new = saved[key], current[key]
        changes = {
            "changed": sorted(p for p in set(old) & set(new) if list(old[p]) != list(new[p])),
            "missing": sorted(set(old) - set(new)),
            "added": sorted(set(new) - set(old)),
        }
        if changes["missing"] and not changes["changed"] and _moved(old, new):
            changes = {"moved": [f"{_root(old)} -> {_root(new)}"]}
        if any(changes.values()):
            found[key] = {kind: paths for kind, paths in changes.items() if paths}
    return found


def is_refused(changes: Mapping[str, Mapping[str, list[str]]]) -> bool:
    """Whether ``changes`` change the data plan; files moved as a whole (the same names, sizes and
    contents under another directory, as a job that stages its data to local disk) do not."""
    return any(kind != "moved" for kinds in changes.values() for kind in kinds)


def _moved(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """The same files under another common directory: names below it, sizes and hashes equal
    (a copy's mtime is its own, so it is not compared)."""

    def by_name(files: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
        root = _root(files)
        return {os.path.relpath(path, root): (ident[0], ident[2]) for path, ident in files.items()}

    return len(old) == len(new) and by_name(old) == by_name(new)


def _root(files: Mapping[str, Any]) -> str:
    paths = list(files)
    return os.path.dirname(paths[0]) if len(paths) == 1 else os.path.commonpath(paths)


def describe_changes(changes: Mapping[str, Mapping[str, list[str]]], shown: int = 5) -> str:
    """``data.train: changed a.txt, b.txt; added c.txt`` (the first ``shown`` of each, then a count)."""
    parts = []
    for key, kinds in changes.items():
        for kind, paths in kinds.items():
            names = ", ".join(paths[:shown]) + (f" and {len(paths) - shown} more" if len(paths) > shown else "")
            parts.append(f"{key}: {kind} {names}")
    return "; ".join(parts)
