"""Atomic file writes: the one implementation every component that writes run files uses.

A write goes to a temporary name in the same directory, is flushed and fsynced, replaces the
target with ``os.replace`` and then the directory is fsynced, so after a crash at any moment
the target holds either the old content or the new one, never a mix.

``hook`` is a test seam: it is called with the name of each point of the write
(``before_temp``, ``mid_write``, ``after_write``, ``after_fsync``, ``after_replace``) so a
test can kill the process there. It is ``None`` in normal use.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

WriteHook = Callable[[str], None]
_CHUNK_BYTES = 64 * 1024 * 1024


def write_bytes_atomic(path: str | Path, data: bytes | memoryview, hook: WriteHook | None = None) -> None:
    """Write ``data`` to ``path`` atomically and durably (see the module docstring)."""
    view = memoryview(data).cast("B")
    write_chunks_atomic(path, (view[i : i + _CHUNK_BYTES] for i in range(0, len(view), _CHUNK_BYTES)), len(view), hook)


def write_chunks_atomic(
    path: str | Path,
    chunks: Iterable[bytes | memoryview],
    total_bytes: int,
    hook: WriteHook | None = None,
    hasher: Any = None,
    sync_dir: bool = True,
    temp_dir: str | Path | None = None,
) -> None:
    """Write the concatenation of ``chunks`` (``total_bytes`` in all) to ``path`` atomically and
    durably, without ever holding more than one chunk; ``hasher.update`` sees every byte as it goes.

    ``mid_write`` is reached once about half the bytes are out. ``sync_dir=False`` leaves the
    directory's fsync to the caller, who writes several files and syncs the directory once.
    ``temp_dir`` (same filesystem) holds the temporary file instead of the target's directory.
    """
    target = Path(path)
    _point(hook, "before_temp")
    temp_parent = target.parent if temp_dir is None else Path(temp_dir)
    prefix = f".{target.name}." if temp_dir is None else f".{target.parent.name}.{target.name}."
    fd, tmp = _create_temp(temp_parent, prefix)
    try:
        with os.fdopen(fd, "wb", buffering=0) as f:
            written, half_done = 0, hook is None
            for chunk in chunks:
                if hasher is not None:
                    hasher.update(chunk)
                view = memoryview(chunk)
                while view:  # a raw file may write less than asked
                    view = view[f.write(view) :]
                written += len(chunk)
                if not half_done and written * 2 >= total_bytes:
                    half_done = True
                    _point(hook, "mid_write")
            if not half_done:
                _point(hook, "mid_write")
            _point(hook, "after_write")
            os.fsync(f.fileno())
        _point(hook, "after_fsync")
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _point(hook, "after_replace")
    if sync_dir:
        fsync_dir(target.parent)


def write_text_atomic(path: str | Path, text: str, hook: WriteHook | None = None) -> None:
    """``write_bytes_atomic`` of UTF-8 text."""
    write_bytes_atomic(path, text.encode("utf-8"), hook)


def write_json_atomic(path: str | Path, data: Any, hook: WriteHook | None = None) -> None:
    """``write_bytes_atomic`` of ``data`` as indented JSON."""
    write_text_atomic(path, json.dumps(data, indent=2) + "\n", hook)


def _create_temp(directory: Path, prefix: str) -> tuple[int, str]:
    """A new file ``<prefix><random>.tmp`` in ``directory``, opened for writing, with the mode a
    plain ``open()`` gives (0666 less the umask): it keeps that mode when renamed into place, so
    another user can read what the umask lets them (``tempfile.mkstemp`` makes it 0600)."""
    for _ in range(100):
        path = os.path.join(directory, f"{prefix}{secrets.token_hex(6)}.tmp")
        try:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666), path
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name for {prefix}*.tmp in {directory}")


def fsync_dir(path: str | Path) -> None:
    """Make a directory's entries (new names, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _point(hook: WriteHook | None, name: str) -> None:
    if hook is not None:
        hook(name)
