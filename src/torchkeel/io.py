"""Small file helpers shared by every component that writes run files."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` so that ``path`` holds either the old content or the new, never a mix.

    The data goes to a temporary file in the same directory, is flushed and fsynced, then
    replaces ``path`` in one ``os.replace``.
    """
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: str | Path, data: Any) -> None:
    """``write_text_atomic`` of ``data`` as indented JSON."""
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=False) + "\n")
