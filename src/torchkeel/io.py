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
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

WriteHook = Callable[[str], None]
_CHUNK_BYTES = 64 * 1024 * 1024


def write_bytes_atomic(path: str | Path, data: bytes | memoryview, hook: WriteHook | None = None) -> None:
    """Write ``data`` to ``path`` atomically and durably (see the module docstring)."""
    target = Path(path)
    _point(hook, "before_temp")
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            view = memoryview(data)
            half = len(view) // 2
            f.write(view[:half])
            f.flush()
            _point(hook, "mid_write")
            for start in range(half, len(view), _CHUNK_BYTES):
                f.write(view[start : start + _CHUNK_BYTES])
            f.flush()
            _point(hook, "after_write")
            os.fsync(f.fileno())
        _point(hook, "after_fsync")
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _point(hook, "after_replace")
    fsync_dir(target.parent)


def write_text_atomic(path: str | Path, text: str, hook: WriteHook | None = None) -> None:
    """``write_bytes_atomic`` of UTF-8 text."""
    write_bytes_atomic(path, text.encode("utf-8"), hook)


def write_json_atomic(path: str | Path, data: Any, hook: WriteHook | None = None) -> None:
    """``write_bytes_atomic`` of ``data`` as indented JSON."""
    write_text_atomic(path, json.dumps(data, indent=2) + "\n", hook)


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
